"""DeepSpeed ZeRO-3 on the CPU (gloo, 2 processes started by torchrun, ``DS_ACCELERATOR=cpu``): the fused
linear cross-entropy gathers the partitioned ``lm_head.weight`` for its call and the gradient reaches the
partition, so training with liger-gen takes the steps plain transformers takes under the same ZeRO-3 engine; an
empty or partial shard handed to the op directly is refused with what to do."""

import importlib.util
import os

import pytest
import torch

import liger_gen.functional as F
from liger_gen.training import loss_rel_tolerance
from test_distributed import STEPS, _run_script, _train

REQUIRED = os.environ.get("LIGER_GEN_REQUIRE_DEEPSPEED") == "1"  # CI: a missing install fails, never skips
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None and not REQUIRED,
    reason="needs DeepSpeed: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed")
# --zero3-persistence-threshold 0: every parameter is partitioned, the tiny model's lm_head (tied to the embedding)
# too; --seq-len 32 (after COMMON's 64, so it wins) halves the interpreter's rows, which ZeRO-3's gathers ignore
ZERO3 = ("--parallel", "zero3", "--batch-size", "2", "--zero3-persistence-threshold", "0", "--seq-len", "32")


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


@needs_deepspeed
def test_zero3_training_with_liger_gen_takes_the_steps_of_plain_transformers(tmp_path):
    """Same engine, same data: the losses of liger-gen's kernels (Triton's interpreter) equal those of plain
    transformers to fp32 rounding, step for step. (Both differ from one unsharded process by 3e-5 to 9e-5
    relative from step 2 on: DeepSpeed's own update, the same with either model.)"""
    plain = _train(tmp_path, "zero3_plain", *ZERO3, nproc=2)
    ours = _train(tmp_path, "zero3_liger_gen", *ZERO3, "--kernels", "liger-gen", nproc=2, interpret="1")
    tol = loss_rel_tolerance(torch.float32)
    assert [r["step"] for r in ours] == [r["step"] for r in plain] == list(range(STEPS))
    for g, w in zip(ours, plain):
        assert abs(g["loss"] - w["loss"]) <= tol * abs(w["loss"]), (g, w)
    assert ours[-1]["loss"] < ours[0]["loss"] - 0.1


@needs_deepspeed
def test_zero3_partitions_outside_a_forward_are_refused_and_apply_to_after_initialize(tmp_path):
    """Read outside a forward (a loss computed from hidden states in a training loop or trainer), ZeRO-3's
    lm_head.weight is an empty partition: the op refuses it, saying where DeepSpeed gathers it; apply_to on a
    model deepspeed.initialize already hooked is refused."""
    out = _run_script(tmp_path, "zero3_refusals", """
import deepspeed
import liger_gen
import liger_gen.functional as F
from liger_gen.training import build_model
model = build_model("tiny", "cpu", torch.float32, 0)
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3,
          "stage3_param_persistence_threshold": 0}}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
w = engine.module.lm_head.weight  # read outside any forward: DeepSpeed leaves it partitioned
x, t = torch.randn(4, 64, requires_grad=True), torch.randint(0, 256, (4,))
try:
    F.fused_linear_cross_entropy(x, w, t)
except ValueError as exc:
    say("OP", "ZeRO-3 partition" in str(exc) and "(256, 64)" in str(exc) and "register_external" in str(exc))
try:
    liger_gen.apply_to(engine.module)
except ValueError as exc:
    say("APPLY", "before deepspeed.initialize" in str(exc))
""")
    assert out.count("OP True") == 2 and out.count("APPLY True") == 2, out


def test_an_empty_or_partitioned_lm_head_weight_is_refused_with_what_to_do():
    """Without DeepSpeed: an empty weight, and one that carries ZeRO-3's ds_shape (a partition of another shape),
    never reach the kernels (no ZeroDivisionError, no loss over zero classes)."""
    x, t = torch.randn(4, 8), torch.randint(0, 16, (4,))
    with pytest.raises(ValueError, match=r"lm_head_weight is empty .*shape \(0, 8\).*whole \(vocab, 8\) weight"):
        F.fused_linear_cross_entropy(x, torch.empty(0, 8), t)
    part = torch.nn.Parameter(torch.empty(0))
    part.ds_shape = torch.Size([16, 8])
    with pytest.raises(ValueError,
                       match=r"ZeRO-3 partition .*shape \(0,\).*shape \(16, 8\).*register_external_parameter"):
        F.fused_linear_cross_entropy(x, part, t)
    half = torch.nn.Parameter(torch.randn(8, 8))
    half.ds_shape = torch.Size([16, 8])
    with pytest.raises(ValueError, match=r"ZeRO-3 partition .*shape \(8, 8\).*shape \(16, 8\)"):
        F.fused_linear_cross_entropy(x, half, t)


ZERO_INIT = """
import deepspeed, transformers
from liger_gen.models import ARCHITECTURES
from liger_gen.training import FAMILY_CLASSES, build_config, byte_tokens, make_batches
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
          "stage3_param_persistence_threshold": 0}}
cls = getattr(transformers, FAMILY_CLASSES[ARCHITECTURES["tiny"].family][1])  # imported before zero.Init, which
cfg = build_config("tiny", "sdpa")  # patches torch.Tensor.__new__ (torch._dynamo's import then fails inside it)
cfg.tie_word_embeddings = False  # lm_head.weight is then used by lm_head alone, which the fused loss never calls
rank = dist.get_rank()
batches = make_batches(byte_tokens(), 3, 4, 32, 0)  # 32 tokens: the interpreter's time goes with the rows
def train(with_liger_gen):
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):  # partitioned as it is built, before initialize
        model = cls(cfg)
    model.train()
    if with_liger_gen:
        import liger_gen
        liger_gen.apply_to(model)
        assert type(model.model.norm).__name__ == "RMSNorm", type(model.model.norm)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=config)
    losses = []
    for step in range(3):
        b = batches[step, rank * 2:(rank + 1) * 2]
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / 2)
    return losses
plain = train(False)  # first: apply_to's patches are in place only for the second model
ours = train(True)
if rank == 0:
    print("PLAIN", *plain, flush=True)
    print("OURS", *ours, flush=True)
"""


@needs_deepspeed
def test_a_model_partitioned_by_zero_init_before_apply_to_trains_as_plain_transformers(tmp_path):
    """The Trainer's ZeRO-3 path: parameters partitioned while the model is built (deepspeed.zero.Init), then
    apply_to, then deepspeed.initialize; the losses equal plain transformers' under the same engine (both models
    in one torchrun, plain first)."""
    out = _run_script(tmp_path, "zero_init", ZERO_INIT, interpret="1")
    runs = {x.split()[0]: [float(v) for v in x.split()[1:]] for x in out.splitlines()
            if x.startswith(("PLAIN", "OURS"))}
    plain, ours = runs["PLAIN"], runs["OURS"]
    tol = loss_rel_tolerance(torch.float32)
    assert len(ours) == len(plain) == 3 and ours[-1] < ours[0]
    assert all(abs(a - b) <= tol * abs(b) for a, b in zip(ours, plain)), (ours, plain)


TRAINER = """
import transformers
from transformers import Trainer, TrainingArguments
from liger_gen.models import ARCHITECTURES
from liger_gen.training import FAMILY_CLASSES, build_config, byte_tokens, make_batches
zero3 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
rows = make_batches(byte_tokens(), 3, 4, 32, 0).reshape(-1, 32)  # 32 tokens: the interpreter's time goes with rows
def train(name, with_liger_gen):
    args = TrainingArguments(output_dir=f"out_{name}", per_device_train_batch_size=2, max_steps=3, logging_steps=1,
                             deepspeed=zero3, report_to=[], save_strategy="no", learning_rate=1e-3,
                             lr_scheduler_type="constant", seed=0, dataloader_drop_last=True)
    torch.manual_seed(0)
    cfg = build_config("tiny", "sdpa")
    cfg.tie_word_embeddings = False  # lm_head.weight is then used by lm_head alone, which the fused loss never calls
    model = getattr(transformers, FAMILY_CLASSES[ARCHITECTURES["tiny"].family][1])(cfg)
    if with_liger_gen:
        import liger_gen
        liger_gen.apply_to(model)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
    trainer.train()
    import deepspeed
    head = trainer.model_wrapped.module.lm_head.weight
    with deepspeed.zero.GatheredParameters([head]):  # the untied head after training: its gradient reached it
        norm = float(head.detach().double().norm())
    if dist.get_rank() == 0:
        print(name, "LOSSES", *[h["loss"] for h in trainer.state.log_history if "loss" in h], flush=True)
        print(name, "HEAD", norm, flush=True)
train("PLAIN", False)  # first: apply_to's patches are in place only for the second model
train("OURS", True)
"""


@needs_deepspeed
def test_transformers_trainer_with_zero3_trains_as_with_plain_transformers(tmp_path):
    """transformers' Trainer with a DeepSpeed ZeRO-3 config (its own deepspeed.initialize, every parameter
    partitioned): the losses it logs with liger-gen equal those without (both trainers in one torchrun, plain
    first)."""
    out = _run_script(tmp_path, "trainer", TRAINER, interpret="1")
    runs = {tuple(x.split()[:2]): [float(v) for v in x.split()[2:]] for x in out.splitlines()
            if x.startswith(("PLAIN ", "OURS "))}
    (plain, (plain_head,)), (ours, (our_head,)) = ((runs[name, "LOSSES"], runs[name, "HEAD"])
                                                   for name in ("PLAIN", "OURS"))
    tol = loss_rel_tolerance(torch.float32)
    assert len(ours) == len(plain) == 3 and ours[-1] < ours[0]
    assert all(abs(a - b) <= tol * abs(b) for a, b in zip(ours, plain)), (ours, plain)
    assert abs(our_head - plain_head) <= 1e-6 * plain_head, (our_head, plain_head)


def test_the_example_says_how_to_install_a_missing_deepspeed_or_liger_kernel(monkeypatch, capsys):
    import importlib.util

    from liger_gen.examples import train_fsdp

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("deepspeed", "liger_kernel") else real(name, *a))
    for args, needed in ((["--parallel", "zero3"], "--no-build-isolation deepspeed"),
                         (["--kernels", "liger-kernel"], "pip install liger-kernel")):
        with pytest.raises(SystemExit) as stopped:
            train_fsdp.parse_args(args)
        assert stopped.value.code == 2 and needed in capsys.readouterr().err
