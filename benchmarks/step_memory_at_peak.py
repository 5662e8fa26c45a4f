"""What is alive on the GPU at the peak of one training step, per provider, grouped by the code that allocated it.

For one model of ``liger-gen bench-step`` (same build, same batch of tiny Shakespeare bytes, bf16, fused AdamW)
and each provider (plain transformers, Liger-Kernel, liger-gen), this runs two warm-up steps, then records one
step with ``torch.cuda.memory._record_memory_history`` and replays the allocator trace: at the moment the
allocated bytes peak, every live block is attributed to the innermost frame of its allocation stack that lies in
transformers, Liger-Kernel, liger-gen or torch.optim (else "other"). Weights, gradients and optimizer state
allocated before the recorded step appear as "before the step". Prints the peak and the largest groups per
provider, and the groups whose size differs most between two providers.

    python benchmarks/step_memory_at_peak.py --model llama3-8b-4l [--providers transformers,liger-kernel,liger-gen]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json

import torch

from liger_gen import training
from liger_gen.bench import step as bench

KEYS = ("liger_gen/", "liger_kernel/", "transformers/models/", "transformers/", "torch/optim/")


def _where(frames: list[dict]) -> str:
    for frame in frames:  # innermost first
        name = frame.get("filename", "")
        for key in KEYS:
            if key in name:
                short = name[name.index(key):]
                return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "other"


def peak_groups(snapshot: dict, device: int = 0) -> tuple[int, int, dict[str, int]]:
    """(bytes live before the recorded step, peak bytes, {allocation site: bytes live at the peak})."""
    before = sum(b["size"] for seg in snapshot["segments"] if seg["device"] == device
                 for b in seg["blocks"] if b["state"] == "active_allocated")
    trace = snapshot["device_traces"][device]
    # what was alive when recording began: the end state minus the trace's net allocation
    net = sum(e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
              for e in trace)
    base = before - net
    live: dict[int, tuple[int, str]] = {}
    current, old_alive = base, base  # old_alive: bytes of blocks from before the step still alive
    peak, at_peak, old_at_peak = base, {}, base
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            current += event["size"]
            if current > peak:
                peak, at_peak, old_at_peak = current, dict(live), old_alive
        elif event["action"] == "free_completed":
            if event["addr"] in live:
                current -= live.pop(event["addr"])[0]
            else:
                current -= event["size"]
                old_alive -= event["size"]
    groups: dict[str, int] = collections.Counter()
    for size, where in at_peak.values():
        groups[where] += size
    groups["before the step (weights, optimizer state, ...)"] = old_at_peak
    return base, peak, dict(groups)


def run(model_name: str, provider: str, batch_size: int, seq_len: int) -> tuple[int, dict[str, int]]:
    device = torch.device("cuda")
    spec = training.architecture(model_name)
    modeling = bench.MODELING_MODULES[spec.family]
    with bench.restore_module_globals([modeling]):
        model = training.build_model(model_name, device, torch.bfloat16, 0)
        model.train()
        if provider == "liger-kernel":
            training.apply_liger_kernel(model, spec.family)
        elif provider == "liger-gen":
            import liger_gen

            liger_gen.apply_to(model)
        optimizer = training.make_optimizer(model, 1e-4, device)
        batches = training.make_batches(training.byte_tokens(), 3, batch_size, seq_len, seed=0).to(device)
        for k in range(2):
            training.train_step(model, optimizer, batches[k])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        training.train_step(model, optimizer, batches[2])
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        measured = torch.cuda.max_memory_allocated()
        if provider == "liger-gen":
            bench.undo_liger_gen()
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    _, peak, groups = peak_groups(snapshot)
    print(f"{provider}: peak from the trace {peak / 2**30:.3f} GiB, torch.cuda.max_memory_allocated "
          f"{measured / 2**30:.3f} GiB")
    return measured, groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b-4l")
    parser.add_argument("--providers", default="transformers,liger-kernel,liger-gen")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", default=None, help="write {provider: {peak, groups}} here")
    args = parser.parse_args()
    results = {}
    for provider in args.providers.split(","):
        peak, groups = run(args.model, provider, args.batch_size, args.seq_len)
        results[provider] = {"peak": peak, "groups": groups}
        print(f"  largest groups at the peak ({provider}), MiB:")
        for where, size in sorted(groups.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"    {size / 2**20:10.1f}  {where}")
    names = list(results)
    if len(names) >= 2:
        a, b = names[-1], names[-2]
        print(f"peak {a} - {b}: {(results[a]['peak'] - results[b]['peak']) / 2**20:+.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
