"""Distributed training with torchrun: FSDP2, DDP or DeepSpeed ZeRO-3, DCP checkpoints, elastic restart, optionally
liger-gen.

What it does
------------
Each process started by ``torchrun`` (Torch Distributed Elastic) builds the same transformers model from a config
(``--model``: a name of ``liger_gen.models.ARCHITECTURES``; random init from ``--seed``, nothing downloaded),
patches it (``--kernels liger-gen``: ``liger_gen.apply_to(model)``; ``--kernels liger-kernel``: Liger-Kernel's
``apply_liger_kernel_to_<family>(model=model)``), optionally turns on activation checkpointing
(``--activation-checkpointing``) and compiles every decoder layer (``--compile``), shards it and trains it with
AdamW on windows of a text read as bytes (token ids 0..255; tiny Shakespeare by default):

- ``--parallel fsdp``: ``torch.distributed.fsdp.fully_shard`` on every decoder layer, then on the root, with a
  ``MixedPrecisionPolicy`` computing in ``--dtype`` (parameters and gradients reduced in float32);
- ``--parallel ddp``: ``torch.nn.parallel.DistributedDataParallel``;
- ``--parallel zero3``: DeepSpeed ZeRO stage 3 (``deepspeed.initialize``; ``pip install deepspeed``; on the CPU
  set ``DS_ACCELERATOR=cpu``), parameters, gradients and optimizer state partitioned over the ranks; the fused
  loss reads ``lm_head.weight`` inside the model's forward, where DeepSpeed gathers it;
- ``--parallel none``: one process, no process group (the reference the distributed runs are compared with).

Order: ``liger_gen.apply_to`` patches the transformers model before it is sharded or wrapped (it replaces
modules and forwards, which FSDP2 then shards like any other); applied to a model whose parameters are already
DTensors, or that ``deepspeed.initialize`` already hooked, it stops with a ``ValueError`` saying so. Activation
checkpointing and ``torch.compile`` of the decoder layers come after the patch and before sharding.

Data: step ``s`` draws ``world_size × --batch-size`` windows (``liger_gen.training.make_batches``, seeded with
``--seed``); rank ``r`` trains on rows ``r·B .. (r+1)·B − 1``. A one-process run with ``--batch-size`` equal to
the world's total sees the same tokens at every step, and since every row has the same number of tokens the mean
of the ranks' losses is its loss; FSDP2 and DDP average the gradients over ranks, so the runs take the same
steps (float32: equal to rounding).

Checkpoints (not with ``zero3``, which has its own format): with ``--checkpoint-dir`` the model and optimizer
state are saved with ``torch.distributed.checkpoint`` (``get_state_dict`` / ``set_state_dict``, so the same code
serves FSDP2, DDP and one process) every ``--save-every`` steps into ``step_<n>`` (written as ``step_<n>.tmp`` and
renamed by rank 0 once every rank finished). A start, or a restart by ``torchrun --max-restarts K`` after a rank
died, resumes from the newest complete checkpoint, so the later steps are the ones an uninterrupted run takes.

Output: rank 0 appends one JSON line per step to ``--metrics-file`` (``step``, the mean loss over ranks, tokens/s of the
step on this rank, peak memory) and every rank prints its tokens/s, peak memory and last loss at the end.

How to run
----------
On the CPU (gloo), a tiny model::

    torchrun --standalone --nproc-per-node 2 -m liger_gen.examples.train_fsdp --model tiny --device cpu \\
        --steps 5 --parallel fsdp --kernels liger-gen --metrics-file losses.jsonl

On GPUs (NCCL), the Llama-3.2-1B shape at 8 × 2048 tokens per rank, with checkpoints and one restart allowed::

    torchrun --standalone --nproc-per-node 8 --max-restarts 1 -m liger_gen.examples.train_fsdp --model llama3.2-1b \\
        --dtype bfloat16 --batch-size 8 --seq-len 2048 --steps 100 --kernels liger-gen --checkpoint-dir ckpt --save-every 20

``--fail-at-step N`` (with ``--fail-rank R``) makes rank R exit at step N on the first attempt only (Torch
Elastic's ``TORCHELASTIC_RESTART_COUNT`` is 0): the restart test uses it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from liger_gen.models import ARCHITECTURES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny", choices=sorted(ARCHITECTURES), help="architecture to build")
    p.add_argument("--parallel", default="fsdp", choices=("fsdp", "ddp", "zero3", "none"))
    p.add_argument("--kernels", default="transformers", choices=("transformers", "liger-gen", "liger-kernel"),
                   help="transformers' own modules; liger_gen.apply_to(model); or Liger-Kernel's\n"
                        "apply_liger_kernel_to_<family>(model=model) (llama and qwen2 families)")
    p.add_argument("--liger-gen", dest="kernels", action="store_const", const="liger-gen",
                   help="the same as --kernels liger-gen")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer in the backward (transformers'\n"
                        "gradient_checkpointing_enable, non-reentrant)")
    p.add_argument("--zero3-persistence-threshold", type=int, default=None,
                   help="zero3: DeepSpeed's stage3_param_persistence_threshold (parameters with fewer\n"
                        "elements are never partitioned; default: DeepSpeed's); 0 partitions every one")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every decoder layer (in place, before sharding)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps in all (a resumed run continues to it)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per step on each rank")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="compute dtype")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="training text, read as bytes")
    p.add_argument("--checkpoint-dir", default=None, help="save / resume with torch.distributed.checkpoint here")
    p.add_argument("--save-every", type=int, default=1, help="steps between checkpoints")
    p.add_argument("--metrics-file", default=None, help="rank 0 appends one JSON line per step here")
    p.add_argument("--fail-at-step", type=int, default=None, help="(tests) rank --fail-rank exits at this step, "
                                                                   "first attempt only")
    p.add_argument("--fail-rank", type=int, default=1)
    args = p.parse_args(argv)
    import importlib.util

    if args.parallel == "zero3" and importlib.util.find_spec("deepspeed") is None:
        p.error("--parallel zero3 needs DeepSpeed, which is not installed; install it with: DS_BUILD_OPS=0 pip "
                "install --no-build-isolation deepspeed==0.19.8 (built against the torch installed; its first run "
                "compiles a small CPU communication op, which needs a C++ compiler)")
    if args.kernels == "liger-kernel" and importlib.util.find_spec("liger_kernel") is None:
        p.error("--kernels liger-kernel needs Liger-Kernel, which is not installed; install it with: pip install "
                "liger-kernel")
    if args.parallel == "zero3" and args.checkpoint_dir:
        p.error("--checkpoint-dir saves with torch.distributed.checkpoint (fsdp, ddp, none); DeepSpeed keeps its own "
                "checkpoint format (engine.save_checkpoint)")
    for name in ("steps", "batch_size", "seq_len", "save_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def patch_kernels(model: torch.nn.Module, kernels: str, name: str) -> None:
    """Swap in the fused kernels of ``kernels`` (before sharding: ``liger_gen.apply_to`` refuses a model whose
    parameters are already DTensors)."""
    if kernels == "liger-gen":
        import liger_gen

        liger_gen.apply_to(model)
    elif kernels == "liger-kernel":
        from liger_gen.models import ARCHITECTURES
        from liger_gen.training import apply_liger_kernel

        family = ARCHITECTURES[name].family if name in ARCHITECTURES else None
        if family not in ("llama", "qwen2"):
            raise SystemExit(f"--kernels liger-kernel: this example patches the llama and qwen2 families; "
                             f"{name} is {family or 'not one of them'}")
        apply_liger_kernel(model, family)


def shard(model: torch.nn.Module, parallel: str, dtype: torch.dtype, device: torch.device, *, lr: float = 1e-3,
          batch_size: int = 1, persistence_threshold: int | None = None):
    """FSDP2 (every decoder layer, then the root), DDP, a DeepSpeed ZeRO-3 engine (with its AdamW), or the model
    itself."""
    if parallel == "zero3":
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3}, "bf16": {"enabled": dtype == torch.bfloat16},
                  "fp16": {"enabled": dtype == torch.float16}}
        if persistence_threshold is not None:
            config["zero_optimization"]["stage3_param_persistence_threshold"] = persistence_threshold
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine
    if parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    out = []
    for path in root.glob("step_*"):
        suffix = path.name[len("step_"):]
        if suffix.isdigit() and path.is_dir():
            out.append((int(suffix), path))
    return sorted(out)


def save_checkpoint(root: Path, step: int, model, optimizer, rank: int, distributed: bool) -> Path:
    """DCP save of model + optimizer after ``step`` into ``root/step_<step>`` (via a .tmp folder)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    tmp, final = root / f"step_{step}.tmp", root / f"step_{step}"
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    if distributed:
        dist.barrier()
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}, checkpoint_id=str(tmp))
    if distributed:
        dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    if distributed:
        dist.barrier()
    return final


def load_checkpoint(root: Path, model, optimizer) -> int:
    """Load the newest complete checkpoint under ``root``; return the next step to run (0 if none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    found = _complete_checkpoints(root)
    if not found:
        return 0
    step, path = found[-1]
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(-1)}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"]) + 1


def init_process_group(backend: str) -> None:
    """``init_process_group`` on torchrun's store, with the keys of this attempt under their own prefix.

    After a restart the workers of the new attempt meet in the store the previous attempt used; without a prefix
    per attempt (``TORCHELASTIC_RESTART_COUNT``) gloo can read the addresses the dead workers published there and
    fail to connect.
    """
    import datetime

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                          is_master=rank == 0 and not agent_store, timeout=datetime.timedelta(seconds=300),
                          wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"liger_gen/attempt_{attempt}", store), rank=rank,
                            world_size=world)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Train as the arguments say (one process of a torchrun launch); returns this rank's summary."""
    args = parse_args(argv)
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = args.parallel != "none"
    if distributed and "RANK" not in os.environ:
        raise SystemExit(f"--parallel {args.parallel} runs under torchrun (e.g. torchrun --standalone --nproc-per-node 2 -m "
                         f"liger_gen.examples.train_fsdp ...); use --parallel none for one process")
    if not distributed and world != 1:
        raise SystemExit("--parallel none is one process; started by torchrun with several, use fsdp or ddp")
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if distributed:
        init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    try:
        summary = train(args, device, rank, world, distributed)
        # one JSON line per rank, in rank order, each in one write: torchrun merges the ranks' stdout, and
        # lines printed at once could interleave
        for turn in range(world if distributed else 1):
            if distributed:
                dist.barrier()
            if turn == rank:
                sys.stdout.write(json.dumps(summary) + "\n")
                sys.stdout.flush()
        return summary
    finally:
        if distributed:  # the model, the optimizer and DDP's reducer are gone by now: no thread outlives the group
            gc.collect()
            dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device, rank: int, world: int, distributed: bool) -> dict:
    """Build, patch, shard, (resume,) train and checkpoint on this rank; return its summary."""
    import torch.distributed as dist

    from liger_gen.training import build_model, byte_tokens, make_batches

    dtype = _DTYPES[args.dtype]
    # the same weights on every rank (built in float32 from the seed); FSDP2 keeps float32 shards
    master = torch.float32 if args.parallel in ("fsdp", "zero3") else dtype  # kept in fp32 where sharded
    model = build_model(args.model, device, master, args.seed)
    patch_kernels(model, args.kernels, args.model)
    if args.activation_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.compile:
        for layer in model.model.layers:
            layer.compile()  # in place: parameter names (and so checkpoints) stay those of the eager model
    model = shard(model, args.parallel, dtype, device, lr=args.lr, batch_size=args.batch_size,
                  persistence_threshold=args.zero3_persistence_threshold)
    engine = model if args.parallel == "zero3" else None
    optimizer = engine.optimizer if engine is not None else \
        torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    root = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    start = 0
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
        start = load_checkpoint(root, model, optimizer)
    tokens = byte_tokens(args.text)
    batches = make_batches(tokens, args.steps, world * args.batch_size, args.seq_len, args.seed)
    rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    loss_value, rates = float("nan"), []
    for step in range(start, args.steps):
        if args.fail_at_step == step and rank == args.fail_rank and restart == 0:
            print(f"rank {rank}: failing on purpose at step {step}", file=sys.stderr, flush=True)
            os._exit(17)
        batch = batches[step, rows].to(device)
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        if engine is not None:  # DeepSpeed owns the backward (its loss scaling, gradient partitioning) and the step
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().float()
        if distributed:
            dist.all_reduce(mean)
            mean /= world
        loss_value = float(mean)  # synchronises
        rate = batch.numel() / (time.perf_counter() - t0)
        rates.append(rate)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        if rank == 0 and args.metrics_file:
            with open(args.metrics_file, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "loss": loss_value, "tokens_per_s": rate,
                                    "peak_allocated_bytes": peak, "restart": restart}) + "\n")
        if root is not None and (step + 1) % args.save_every == 0:
            save_checkpoint(root, step, model, optimizer, rank, distributed)
    summary = {"rank": rank, "world_size": world, "kernels": args.kernels, "parallel": args.parallel,
               "start_step": start, "last_loss": loss_value,
               "tokens_per_s": sorted(rates)[len(rates) // 2] if rates else None,  # upper median
               "peak_allocated_gib": (torch.cuda.max_memory_allocated(device) / 2 ** 30
                                      if device.type == "cuda" else None)}
    return summary


if __name__ == "__main__":
    run()
    if "RANK" in os.environ:  # a torchrun worker: skip interpreter teardown, where gloo's threads can still hold
        sys.stdout.flush()    # tensors after destroy_process_group and abort the process (SIGABRT) at exit
        sys.stderr.flush()
        os._exit(0)
