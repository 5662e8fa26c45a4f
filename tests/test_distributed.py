"""Distributed training on the CPU (gloo, 2 processes started by torchrun): FSDP2 and DDP with liger-gen give the
losses of one unsharded process with plain transformers, and an elastic restart after a killed rank resumes from
the torch.distributed.checkpoint files with the later losses of an uninterrupted run."""

import json
import os
import subprocess
import sys

import pytest
import torch

from liger_gen.training import loss_rel_tolerance

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

STEPS = 5
COMMON = ["--model", "tiny", "--device", "cpu", "--steps", str(STEPS), "--seq-len", "64", "--dtype", "float32",
          "--lr", "1e-3"]


def _train(tmp_path, name, *args, nproc=None, restarts=0, interpret="0"):
    """Run the example (under torchrun with ``nproc`` processes); the losses rank 0 logged, per step."""
    metrics = tmp_path / f"{name}.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": interpret, "OMP_NUM_THREADS": "1"}
    module = ["-m", "liger_gen.examples.train_fsdp", *COMMON, *args, "--metrics-file", str(metrics)]
    if nproc is None:
        cmd = [sys.executable, *module]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "--max-restarts", str(restarts), *module]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


SCRIPT_HEAD = """import os, sys, torch, torch.distributed as dist
dist.init_process_group('gloo')
_said = []
def say(*parts):  # a line of this rank's output; rank 0 prints every rank's at the end (prints interleave)
    _said.append(" ".join(map(str, parts)))
"""
SCRIPT_TAIL = """every = [None] * dist.get_world_size()
dist.all_gather_object(every, _said)
if dist.get_rank() == 0 and any(every):
    print("\\n".join(line for lines in every for line in lines), flush=True)
dist.destroy_process_group()
sys.stdout.flush(); os._exit(0)  # as train_fsdp: no gloo teardown race at exit
"""


def _run_script(tmp_path, name: str, body: str, *, nproc: int = 2, interpret: str = "0") -> str:
    """Run ``body`` in ``nproc`` processes under torchrun (a gloo group is initialised first, and ``say(...)``
    records a line that rank 0 prints with every rank's at the end); their stdout."""
    script = tmp_path / f"{name}.py"
    script.write_text(SCRIPT_HEAD + body + SCRIPT_TAIL)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": interpret}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(script)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, plain transformers, the whole batch (2 ranks x 2 sequences)."""
    return _train(tmp_path_factory.mktemp("ref"), "reference", "--parallel", "none", "--batch-size", "4")


def _assert_same_losses(got, want, steps=STEPS):
    """``got`` has ``steps`` steps, the first ones of ``want`` (a run's first steps do not depend on its length)."""
    tol = loss_rel_tolerance(torch.float32)
    want = want[:steps]
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(steps))
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= tol * abs(w["loss"]), (g, w)
    assert got[-1]["loss"] < got[0]["loss"] - 0.1  # it trains (the losses are not all equal by accident)


FSDP = ("--parallel", "fsdp", "--batch-size", "2", "--liger-gen")


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """FSDP2 with liger-gen on 2 ranks, uninterrupted: the sharded test's run and the restart test's reference."""
    return _train(tmp_path_factory.mktemp("fsdp"), "fsdp", *FSDP, nproc=2)


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_sharded_training_with_liger_gen_matches_one_process(tmp_path, reference, fsdp_run, parallel):
    got = fsdp_run if parallel == "fsdp" else _train(tmp_path, parallel, "--parallel", parallel, "--batch-size", "2",
                                                     "--liger-gen", nproc=2)
    _assert_same_losses(got, reference)


def test_fsdp_with_the_kernels_in_the_interpreter_matches_one_process(tmp_path, reference):
    """The same FSDP2 run with liger-gen's Triton kernels (Triton's interpreter) instead of its plain path."""
    got = _train(tmp_path, "fsdp_triton", "--parallel", "fsdp", "--batch-size", "2", "--liger-gen", nproc=2,
                 interpret="1")
    _assert_same_losses(got, reference)


def test_fsdp_with_activation_checkpointing_and_compiled_layers_matches_one_process(tmp_path, reference):
    """FSDP2 over decoder layers that recompute in the backward and are compiled by torch.compile, with the
    kernels in Triton's interpreter (the ops run as registered custom ops inside the compiled graphs)."""
    # 3 steps (each recomputes the layers in the interpreter): the first compiles, the next two run compiled
    got = _train(tmp_path, "fsdp_ac_compile", "--parallel", "fsdp", "--batch-size", "2", "--kernels", "liger-gen",
                 "--activation-checkpointing", "--compile", "--steps", "3", nproc=2, interpret="1")
    _assert_same_losses(got, reference, steps=3)


def test_a_killed_rank_restarts_from_the_checkpoint_with_the_same_later_losses(tmp_path, fsdp_run):
    resumed = _train(tmp_path, "resumed", *FSDP, "--save-every", "1", "--checkpoint-dir", str(tmp_path / "ck_resumed"),
                     "--fail-at-step", "3", "--fail-rank", "1", nproc=2, restarts=1)
    assert [(r["step"], r["restart"]) for r in resumed] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1)]
    # bit for bit the steps of the same run uninterrupted (and without checkpoints: saving changes nothing)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in fsdp_run]
    assert sorted(p.name for p in (tmp_path / "ck_resumed").iterdir()) == [f"step_{i}" for i in range(STEPS)]


def test_apply_to_after_sharding_is_refused_with_what_to_do(tmp_path):
    out = _run_script(tmp_path, "late",
                      "from torch.distributed.fsdp import fully_shard\n"
                      "import liger_gen\n"
                      "from liger_gen.training import build_model\n"
                      "model = build_model('tiny', 'cpu', torch.float32, 0)\n"
                      "fully_shard(model)\n"
                      "try:\n"
                      "    liger_gen.apply_to(model)\n"
                      "    say('PATCHED')\n"
                      "except ValueError as exc:\n"
                      "    say('REFUSED', exc)\n")
    assert out.count("REFUSED") == 2 and "before fully_shard" in out and "DTensor" in out


def test_every_rank_picks_the_same_kernels_whatever_its_clock(tmp_path):
    """The kernel choice is a table lookup, never a local measurement: rank 1 runs with a clock that jumps
    (time.perf_counter and time.time skewed and noisy), and both ranks still choose identical configs for every
    op and shape of the model's training step (all_gather_object of ``liger_gen.runtime.ops.chosen_configs``)."""
    out = _run_script(tmp_path, "configs",
                      "import random, time\n"
                      "if dist.get_rank() == 1:\n"
                      "    pc, tt = time.perf_counter, time.time\n"
                      "    time.perf_counter = lambda: pc() * 3.0 + random.random()\n"
                      "    time.time = lambda: tt() + random.random() * 100\n"
                      "import liger_gen\n"
                      "from liger_gen.training import build_model\n"
                      "from liger_gen.runtime.ops import chosen_configs\n"
                      "model = build_model('tiny', 'cpu', torch.float32, 0)\n"
                      "liger_gen.apply_to(model)\n"
                      "ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank()))\n"
                      "model(input_ids=ids, labels=ids).loss.backward()\n"
                      "mine = chosen_configs()\n"
                      "every = [None, None]\n"
                      "dist.all_gather_object(every, mine)\n"
                      "if dist.get_rank() == 0:\n"
                      "    print('CHOSEN', len(mine), every[0] == every[1])\n", interpret="1")
    line = next(x for x in out.splitlines() if x.startswith("CHOSEN"))
    count, same = line.split()[1:]
    assert int(count) >= 4 and same == "True"  # norms, RoPE, the GLU and the loss's kernels at least


DTENSOR_CASES = """
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.device_mesh import init_device_mesh
import liger_gen.functional as F
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
g = torch.Generator().manual_seed(0)
full = {"x": torch.randn(8, 64, generator=g), "w": torch.rand(64, generator=g) + 0.5,
        "W": torch.randn(100, 64, generator=g), "t": torch.randint(0, 100, (8,), generator=g),
        "l": torch.randn(8, 100, generator=g), "q": torch.randn(1, 2, 8, 16, generator=g),
        "c": torch.randn(1, 8, 16, generator=g)}
sharded = {k: distribute_tensor(v, mesh, [Replicate() if k in ("w", "W", "c") else Shard(0)]) for k, v in full.items()}
cases = {
    "rms_norm": lambda a: F.rms_norm(a["x"], a["w"]), "layer_norm": lambda a: F.layer_norm(a["x"], a["w"], a["w"]),
    "swiglu": lambda a: F.swiglu(a["x"], a["x"]), "cross_entropy": lambda a: F.cross_entropy(a["l"], a["t"]),
    "fused_linear_cross_entropy": lambda a: F.fused_linear_cross_entropy(a["x"], a["W"], a["t"]),
    "kl_div": lambda a: F.kl_div(a["l"].log_softmax(-1), a["l"].flip(0).softmax(-1)),
    "rope": lambda a: F.rope(a["q"], a["q"], a["c"], a["c"])[0],
}
interpreted = os.environ["TRITON_INTERPRET"] == "1"
refused = ("fused_linear_cross_entropy",)  # chunked in liger-gen's own code on every path: always refused
for grad in (True, False):
    with torch.set_grad_enabled(grad):
        for name, fn in cases.items():
            try:
                got = fn(sharded)
            except TypeError as exc:
                text = str(exc)
                ok = ((interpreted or name in refused) and "is a DTensor" in text and "placements" in text
                      and "to_local()" in text)
            else:
                ok = (not interpreted and name not in refused
                      and torch.allclose(got.full_tensor(), fn(full), rtol=1e-5, atol=1e-6))
            print("CASE", grad, name, ok)
"""


def test_a_dtensor_input_is_refused_with_what_to_do(tmp_path):
    """Every op handed a DTensor (a row-sharded activation, a replicated weight) raises a TypeError naming the
    input, its placements and the alternatives, with and without autograd; on the plain PyTorch path (no Triton)
    the ops are torch calls, which DTensor runs itself, and the result equals the op on full tensors (except the
    fused linear cross-entropy, whose chunking is liger-gen's own code on every path: refused there too)."""
    out = (_run_script(tmp_path, "dtensor", DTENSOR_CASES, nproc=1, interpret="1")
           + _run_script(tmp_path, "dtensor_plain", DTENSOR_CASES, nproc=1, interpret="0"))
    cases = [line.split() for line in out.splitlines() if line.startswith("CASE")]
    assert len(cases) == 2 * 2 * 7 and all(ok == "True" for *_, ok in cases), cases


RANK_CASES = """
import copy, math
from torch.distributed.fsdp import fully_shard
import liger_gen
from liger_gen.training import build_model
rank = dist.get_rank()
ours = build_model("tiny", "cpu", torch.float32, 0)
ref = copy.deepcopy(ours)
liger_gen.apply_to(ours)
for m in (ours, ref):
    for layer in m.model.layers:
        fully_shard(layer)
    fully_shard(m)
g = torch.Generator().manual_seed(rank)
ids = torch.randint(0, 256, (2, 64) if rank == 0 else (3, 32), generator=g)  # unequal shapes across ranks
def report(name, ok):
    say("CASE", rank, name, bool(ok))
def close(a, b):
    return a is not None and b is not None and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
def grads_close():
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        a, b = p.grad.full_tensor(), q.grad.full_tensor()
        if not (torch.isfinite(a).all() and torch.allclose(a, b, rtol=1e-4, atol=1e-6)):
            return name
    return "all"
# 1. unequal batch shapes: each rank's loss and the averaged gradients match plain transformers'
lo, lr = ours(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
lo.backward(); lr.backward()
report("unequal_shapes", close(lo, lr) and grads_close() == "all")
ours.zero_grad(); ref.zero_grad()
# 2. every label ignored on rank 1, no num_items_in_batch: that rank's mean over zero tokens is NaN, as PyTorch's
labels = ids if rank == 0 else torch.full_like(ids, -100)
with torch.no_grad():
    lo, lr = ours(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss
report("all_ignored_mean", (math.isnan(lo) and math.isnan(lr)) if rank == 1 else close(lo, lr))
# 3. the same with num_items_in_batch = the tokens of every rank (all-reduced): the sum over the global count,
#    0 on rank 1, and gradients that match
n = torch.tensor(float((labels[:, 1:] != -100).sum()))
dist.all_reduce(n)
lo = ours(input_ids=ids, labels=labels, num_items_in_batch=n).loss
lr = ref(input_ids=ids, labels=labels, num_items_in_batch=n).loss
lo.backward(); lr.backward()
report("all_ignored_num_items", close(lo, lr) and (rank == 0 or float(lo) == 0.0)
       and grads_close() == "all")
# 4. a rank without labels: no loss, and the logits transformers computes
with torch.no_grad():
    oo = ours(input_ids=ids, labels=ids if rank == 0 else None)
    rr = ref(input_ids=ids, labels=ids if rank == 0 else None)
report("no_labels", (oo.loss is None and rr.loss is None and close(oo.logits, rr.logits))
       if rank == 1 else close(oo.loss, rr.loss))
"""


def test_ranks_with_unequal_shapes_no_labels_or_only_ignored_labels(tmp_path):
    """What each rank's loss is when the ranks' batches differ, under FSDP2 with liger-gen against the same
    sharded model with plain transformers: the documented behaviour of the README's "Distributed training"."""
    out = _run_script(tmp_path, "ranks", RANK_CASES, interpret="1")
    cases = [line.split() for line in out.splitlines() if line.startswith("CASE")]
    assert len(cases) == 2 * 4 and all(ok == "True" for *_, ok in cases), cases


def test_liger_gen_adamw_steps_fsdp2_shards_as_torch_adamw(tmp_path):
    """FSDP2 on 2 ranks, kernels in Triton's interpreter: liger_gen.optim.AdamW updates each rank's local shards
    with its kernel (parameters, gradients and state are DTensors placed alike), and three steps end where
    torch.optim.AdamW's end; a DTensor parameter with a plain gradient is refused before anything moves."""
    body = """
from torch.distributed.fsdp import fully_shard
import liger_gen
import liger_gen.optim as lo
calls = []
kernel = lo.adamw_step_unchecked
lo.adamw_step_unchecked = lambda *args, **kwargs: calls.append(args[0].shape) or kernel(*args, **kwargs)
results = []
for cls in (torch.optim.AdamW, liger_gen.optim.AdamW):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    opt = cls(m.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(4, 8, generator=gen)).square().mean().backward()
        opt.step()
    results.append([p.full_tensor() for p in m.parameters()])
worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*results))
say("KERNEL", dist.get_rank(), len(calls), tuple(calls[0]))
say("WORST", dist.get_rank(), worst)
# a DTensor parameter given a plain gradient: refused before the plain parameter beside it moves
from torch.distributed.tensor import Replicate, distribute_tensor
plain = torch.nn.Parameter(torch.ones(4))
sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4), m[0].weight.device_mesh, [Replicate()]))
opt = liger_gen.optim.AdamW([plain, sharded], lr=0.1)
plain.grad, sharded.grad = torch.ones(4), torch.ones(4)
try:
    opt.step()
except TypeError as exc:
    say("MIXED", dist.get_rank(), "grad are not" in str(exc), torch.equal(plain.detach(), torch.ones(4)), len(opt.state))
"""
    out = _run_script(tmp_path, "adamw_fsdp", body, nproc=2, interpret="1")
    kernel = [line.split() for line in out.splitlines() if line.startswith("KERNEL")]
    worst = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("WORST")]
    assert len(kernel) == 2 and all(k[2] == "12" for k in kernel), out  # 4 parameters x 3 steps, each rank
    assert all(k[3:] == ["(8,", "8)"] for k in kernel), out  # the local shard: half of the (16, 8) weight
    assert len(worst) == 2 and max(worst) < 1e-5, out
    mixed = [line.split()[2:] for line in out.splitlines() if line.startswith("MIXED")]
    assert mixed == [["True", "True", "0"]] * 2, out
