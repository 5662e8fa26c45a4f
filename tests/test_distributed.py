"""Distributed training on the CPU (gloo, 2 processes started by torchrun): FSDP2 and DDP with liger-gen give the
losses of one unsharded process with plain transformers, and an elastic restart after a killed rank resumes from
the torch.distributed.checkpoint files with the later losses of an uninterrupted run."""

import json
import os
import subprocess
import sys

import pytest
import torch

from liger_gen.bench.step import loss_rel_tolerance

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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, plain transformers, the whole batch (2 ranks x 2 sequences)."""
    return _train(tmp_path_factory.mktemp("ref"), "reference", "--parallel", "none", "--batch-size", "4")


def _assert_same_losses(got, want):
    tol = loss_rel_tolerance(torch.float32)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(STEPS))
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= tol * abs(w["loss"]), (g, w)
    assert got[-1]["loss"] < got[0]["loss"] - 0.1  # it trains (the losses are not all equal by accident)


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_sharded_training_with_liger_gen_matches_one_process(tmp_path, reference, parallel):
    got = _train(tmp_path, parallel, "--parallel", parallel, "--batch-size", "2", "--liger-gen", nproc=2)
    _assert_same_losses(got, reference)


def test_fsdp_with_the_kernels_in_the_interpreter_matches_one_process(tmp_path, reference):
    """The same FSDP2 run with liger-gen's Triton kernels (Triton's interpreter) instead of its plain path."""
    got = _train(tmp_path, "fsdp_triton", "--parallel", "fsdp", "--batch-size", "2", "--liger-gen", nproc=2,
                 interpret="1")
    _assert_same_losses(got, reference)


def test_a_killed_rank_restarts_from_the_checkpoint_with_the_same_later_losses(tmp_path):
    args = ("--parallel", "fsdp", "--batch-size", "2", "--liger-gen", "--save-every", "1")
    straight = _train(tmp_path, "straight", *args, "--checkpoint-dir", str(tmp_path / "ck_straight"), nproc=2)
    resumed = _train(tmp_path, "resumed", *args, "--checkpoint-dir", str(tmp_path / "ck_resumed"),
                     "--fail-at-step", "3", "--fail-rank", "1", nproc=2, restarts=1)
    assert [(r["step"], r["restart"]) for r in resumed] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1)]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]  # bit for bit: the same steps
    assert sorted(p.name for p in (tmp_path / "ck_resumed").iterdir()) == [f"step_{i}" for i in range(STEPS)]


def test_apply_to_after_sharding_is_refused_with_what_to_do(tmp_path):
    script = tmp_path / "late.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "import liger_gen\n"
        "from liger_gen.bench.step import build_model\n"
        "dist.init_process_group('gloo')\n"
        "model = build_model('tiny', 'cpu', torch.float32, 0)\n"
        "fully_shard(model)\n"
        "try:\n"
        "    liger_gen.apply_to(model)\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', exc)\n"
        "dist.destroy_process_group()\n"
        "import os, sys; sys.stdout.flush(); os._exit(0)  # as train_fsdp: no gloo teardown race at exit\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("REFUSED") == 2 and "before fully_shard" in done.stdout and "DTensor" in done.stdout


def test_every_rank_picks_the_same_kernels_whatever_its_clock(tmp_path):
    """The kernel choice is a table lookup, never a local measurement: rank 1 runs with a clock that jumps
    (time.perf_counter and time.time skewed and noisy), and both ranks still choose identical configs for every
    op and shape of the model's training step (all_gather_object of ``liger_gen.runtime.ops.chosen_configs``)."""
    script = tmp_path / "configs.py"
    script.write_text(
        "import random, time, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n"
        "    pc, tt = time.perf_counter, time.time\n"
        "    time.perf_counter = lambda: pc() * 3.0 + random.random()\n"
        "    time.time = lambda: tt() + random.random() * 100\n"
        "import liger_gen\n"
        "from liger_gen.bench.step import build_model\n"
        "from liger_gen.runtime.ops import chosen_configs\n"
        "model = build_model('tiny', 'cpu', torch.float32, 0)\n"
        "liger_gen.apply_to(model)\n"
        "ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank()))\n"
        "model(input_ids=ids, labels=ids).loss.backward()\n"
        "mine = chosen_configs()\n"
        "every = [None, None]\n"
        "dist.all_gather_object(every, mine)\n"
        "if dist.get_rank() == 0:\n"
        "    print('CHOSEN', len(mine), every[0] == every[1])\n"
        "dist.destroy_process_group()\n"
        "import os, sys; sys.stdout.flush(); os._exit(0)  # as train_fsdp: no gloo teardown race at exit\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("CHOSEN"))
    count, same = line.split()[1:]
    assert int(count) >= 4 and same == "True"  # norms, RoPE, the GLU and the loss's kernels at least
