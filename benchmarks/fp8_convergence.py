"""Does FP8 training converge like bf16? A small Llama trained on tinyshakespeare in bf16, with liger-gen's FP8
linear layers and with torchao's rowwise float8 training (under torch.compile), from the same weights on the same
batches. Each FP8 run is compared with the bf16 run of its own stack: ``liger-gen-fp8`` with ``bf16`` (liger-gen's
kernels), ``torchao-fp8`` with ``compile-bf16`` (transformers' modules under torch.compile), or with ``bf16``
where ``compile-bf16`` did not run.

Each provider starts from the same float32-drawn weights (cast to bf16) and sees the same batches of byte tokens
in the same order (``liger_gen.training``). Reported per provider: the mean loss of the last ``--tail`` steps, its
relative difference from bf16's and from its own baseline's, whether any loss was not finite, and the run's wall
seconds (model building and compilation included); the curves go to ``curves.png`` and every loss to
``fp8_convergence.json`` under ``--out`` (a loss that is not finite as null). The exit status is 1 when a loss is
not finite or an FP8 run's tail mean is more than 1% from its baseline's (an FP8 run without its baseline is
judged on finiteness alone).

    python benchmarks/fp8_convergence.py --steps 400 --out results/fp8_convergence      # the H200 run
    python benchmarks/fp8_convergence.py --tiny --steps 30 --device cpu --providers bf16,liger-gen-fp8   # CPU smoke run

On the CPU, leave ``TRITON_INTERPRET`` unset: the ops then run plain PyTorch (the interpreter is minutes slower).
The plot needs matplotlib (``pip install -e '.[bench]'``) and ``torchao-fp8`` needs torchao; without them the
plot, or that provider, is skipped with a note.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

import liger_gen
from liger_gen.optional import install_hint
from liger_gen.training import byte_tokens, make_batches, make_optimizer, sync

PROVIDERS = ("bf16", "liger-gen-fp8", "compile-bf16", "torchao-fp8")
# the bf16 runs each FP8 run is compared with, first the one of its own stack (the bf16 runs are their own)
BASELINE = {"liger-gen-fp8": ("bf16",), "torchao-fp8": ("compile-bf16", "bf16")}
# 136 M parameters with a byte vocabulary (12 layers of 1024 / 2816): big enough that the projections dominate
MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, vocab_size=256, max_position_embeddings=4096)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512)


def build(fields: dict, device: torch.device, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**fields, use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).train()


def prepare(provider: str, model):
    """The model as ``provider`` trains it: liger-gen's kernels (bf16), plus its FP8 linear layers; transformers'
    modules under torch.compile, plus torchao's float8 linear layers."""
    if provider == "bf16":
        return liger_gen.apply_to(model)
    if provider == "liger-gen-fp8":
        return liger_gen.apply_to(model, fp8=True)
    if provider == "compile-bf16":
        return torch.compile(model)
    if provider == "torchao-fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=lambda module, fqn: fqn != "lm_head")
        return torch.compile(model)
    raise ValueError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")


def schedule(step: int, steps: int, warmup: int) -> float:
    """The learning-rate factor: linear warm-up over ``warmup`` steps, then a cosine decay to 10% at the end."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train(provider: str, fields: dict, batches: torch.Tensor, lr: float, warmup: int, device: torch.device,
          seed: int):
    model = prepare(provider, build(fields, device, seed))
    optimizer = make_optimizer(model, lr, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step, len(batches), warmup))
    losses = []
    start = time.perf_counter()
    for ids in batches:
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync(device)
    return [float(v) for v in torch.stack(losses).float().cpu()], time.perf_counter() - start


def plot(curves: dict[str, list[float]], path: Path, title: str) -> bool:
    """Draw the curves to ``path``; False (nothing written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def tail_means(curves: dict[str, list[float]], tail: int) -> dict[str, float]:
    """The mean of each curve's last ``tail`` values (``tail`` >= 1; all of a shorter curve)."""
    if tail < 1:
        raise ValueError(f"tail must be at least 1, got {tail}")
    return {p: sum(c[-tail:]) / len(c[-tail:]) for p, c in curves.items()}


def compare(curves: dict[str, list[float]], tail: int) -> tuple[list[dict], bool]:
    """One row per provider: the mean of its last ``tail`` losses (``tail`` >= 1), its relative difference from
    bf16's and from its baseline's (an FP8 run's: the first of ``BASELINE`` that ran, else None and NaN; a bf16
    run is its own), and whether every loss is finite; then whether the run passes: every loss finite and every
    FP8 run with a baseline within 1% of it."""
    means = tail_means(curves, tail)
    rows, ok = [], True
    for p, curve in curves.items():
        own = next((b for b in BASELINE[p] if b in means), None) if p in BASELINE else p
        rel = {name: (means[p] - means[name]) / means[name] if means.get(name) else float("nan")
               for name in ("bf16", own)}
        finite = all(math.isfinite(v) for v in curve)
        ok &= finite and (own is None or abs(rel[own]) <= 0.01)
        rows.append({"provider": p, "mean": means[p], "vs_bf16": rel["bf16"], "own": own, "vs_own": rel[own],
                     "finite": finite})
    return rows, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--tail", type=int, default=50, help="steps whose mean loss is compared")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=50, help="warm-up steps (then a cosine decay to 10%%)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer 64-wide model (a CPU smoke run)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/fp8_convergence"))
    args = parser.parse_args()
    providers = [p for p in args.providers.split(",") if p]
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        parser.error(f"unknown provider(s) {', '.join(unknown)}; known: {', '.join(PROVIDERS)}")
    if not providers or len(set(providers)) != len(providers):
        parser.error(f"--providers must name each provider once (of {', '.join(PROVIDERS)}), got {args.providers!r}")
    for name in ("steps", "tail", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if "torchao-fp8" in providers and importlib.util.find_spec("torchao") is None:
        print(f"torchao-fp8: skipped, torchao is not installed ({install_hint('torchao')})")
        providers.remove("torchao-fp8")
    device = torch.device(args.device)
    fields = TINY if args.tiny else MODEL
    seq_len = min(args.seq_len, 128) if args.tiny else args.seq_len
    tokens = byte_tokens()
    batches = make_batches(tokens, args.steps, args.batch_size, seq_len, seed=args.seed)
    passes = args.steps * args.batch_size * seq_len / tokens.numel()  # how often the run reads the text, on average
    curves, seconds = {}, {}
    tail = min(args.tail, args.steps)
    title = (f"Llama {fields['num_hidden_layers']}x{fields['hidden_size']}, {args.steps} steps of "
             f"{args.batch_size}x{seq_len} bytes ({passes:.2f} passes over the text), AdamW lr {args.lr} "
             f"(warm-up {args.warmup}, cosine)")
    args.out.mkdir(parents=True, exist_ok=True)
    for provider in providers:  # the results so far are written after each provider (a cut run keeps them)
        curves[provider], seconds[provider] = train(provider, fields, batches, args.lr, args.warmup, device,
                                                    args.seed)
        means = tail_means(curves, tail)
        result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(device)
                  if device.type == "cuda" else "cpu", "torch": torch.__version__, "model": fields,
                  "steps": args.steps, "passes_over_text": passes, "tail": tail, "providers": providers,
                  "complete": len(curves) == len(providers),  # False: a cut run, some providers missing
                  # a loss that is not finite as null (strict JSON has no NaN or inf)
                  "losses": {p: [v if math.isfinite(v) else None for v in c] for p, c in curves.items()},
                  "tail_mean": {p: v if math.isfinite(v) else None for p, v in means.items()}, "seconds": seconds}
        partial = args.out / "fp8_convergence.json.partial"  # replaced in one step: never a half-written file
        partial.write_text(json.dumps(result, indent=1, allow_nan=False))
        partial.replace(args.out / "fp8_convergence.json")
        if not plot(curves, args.out / "curves.png", title) and len(curves) == 1:
            print(f"matplotlib is not installed: no curves.png; {install_hint('matplotlib')}")
    rows, ok = compare(curves, tail)
    print(f"losses and curves: {args.out}")
    print(f"{args.steps} steps, {passes:.2f} passes over the text")
    print(f"{'provider':15} {'last-' + str(tail) + ' mean':>14} {'vs bf16':>8} {'vs own':>8} {'own bf16':>13} "
          f"{'finite':>7} {'s':>7}")
    for r in rows:
        print(f"{r['provider']:15} {r['mean']:14.4f} {r['vs_bf16']:+8.2%} {r['vs_own']:+8.2%} {r['own'] or '-':>13} "
              f"{str(r['finite']):>7} {seconds[r['provider']]:7.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
