"""Train a Llama twice — plain transformers, then with liger-gen's kernels — and compare.

What it measures
----------------
A transformers ``LlamaForCausalLM`` is built once from a config (random init, nothing downloaded) and trained
for ``--steps`` AdamW steps on random windows of a tokenized text file. The same training is run:

1. ``baseline``         — plain transformers;
2. ``baseline_repeat``  — plain transformers again (only with ``--repeat-baseline``): the run-to-run noise
                          floor of the stack itself (non-deterministic GPU kernels such as SDPA backward and
                          atomics in matmul reductions make two identical runs differ slightly on CUDA);
3. ``liger_gen``        — after ``liger_gen.apply_to(model)``, which swaps every RMSNorm for
                          ``liger_gen.nn.RMSNorm``, every MLP for ``liger_gen.nn.GLUMLP``, RoPE for
                          ``liger_gen.functional.rope`` and the LM-head loss for
                          ``liger_gen.functional.fused_linear_cross_entropy`` (tuned Triton kernels on CUDA).

All runs start from the same weights (the initial ``state_dict`` is copied before the first run and loaded
before each run) and see the same batches in the same order (drawn up front from a ``torch.Generator``
seeded with ``--seed``). The script reports, per step, the losses and their differences from the baseline,
then per run: throughput in tokens/s (the first ``--warmup-steps`` steps, 3 by default, are excluded from
timing; on CUDA the clock is read after ``torch.cuda.synchronize``), peak allocated memory in bytes
(``torch.cuda.max_memory_allocated``, reset before each run; n/a on CPU) and the max / mean absolute loss
difference from the baseline. A liger-gen curve that differs from the baseline by about as much as the
repeated baseline does is numerically equivalent; a clearly larger gap means the kernel changes training.

The text is tokenized with a byte-level BPE tokenizer trained locally with the ``tokenizers`` library
(``--vocab-size``, 8192 by default). It is cached as JSON under ``~/.cache/liger_gen/tokenizers/`` (or
``--cache-dir``), keyed by the sha256 of the text and the vocab size, so re-runs skip training.

How to run
----------
On a GPU, the real Llama-3.2-1B shape (bf16 parameters, fused AdamW)::

    python -m liger_gen.examples.train_llama --model llama3.2-1b --steps 50 --batch-size 8 \\
        --seq-len 1024 --repeat-baseline --json $OUT/train.json

On a CPU, a tiny model in float32 (a few seconds)::

    python -m liger_gen.examples.train_llama --model tiny --steps 20 --seq-len 128 --batch-size 4

Measured figures, with the command that produced them, are in the README. Timings on a shared CPU machine
swing by several times between identical runs: read CPU tokens/s as a smoke test, not a comparison.

With ``TRITON_INTERPRET=1`` on a CPU, liger-gen runs its Triton kernels in the interpreter instead of plain
PyTorch (slow; keep the model tiny and the steps few). Library use: ``run(["--steps", "10"])`` returns the
results dict that ``--json`` writes.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from liger_gen.files import write_atomic
from liger_gen.integrations.transformers import restore_rope
from liger_gen.training import (build_config, compare_losses, loss_rel_tolerance, make_batches, make_optimizer, sync,
                                train_step)
from liger_gen.models import ARCHITECTURES

#: The default corpus, shipped inside the package (public domain, 1,115,394 bytes).
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"

#: The Llama models of the one model registry (``liger_gen.models.ARCHITECTURES``): ``tiny`` trains on a laptop
#: CPU in seconds, ``llama3.2-1b`` is the published Llama-3.2-1B architecture, ``llama3-8b-4l`` Llama-3.1-8B's
#: layer with 4 of its 32 layers. The tokenizer's ids must fit the embedding; ``tiny``'s embedding is sized to
#: the tokenizer (its vocab in the registry is for byte tokens).
PRESETS = {name: arch for name, arch in ARCHITECTURES.items() if arch.family == "llama"}
_VOCAB_FROM_TOKENIZER = {"tiny"}

#: Default AdamW peak learning rate per preset: the tiny model learns visibly within a few dozen steps at 3e-3;
#: the larger models use a usual pre-training peak rate, reached after a linear warm-up (--lr-warmup-steps).
DEFAULT_LR = {"tiny": 3e-3, "llama3.2-1b": 3e-4, "llama3-8b": 3e-4, "llama3-8b-4l": 3e-4}

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

#: Short labels for the report's columns.
_LABELS = {"baseline": "baseline", "baseline_repeat": "repeat", "liger_gen": "liger-gen"}


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


class _OneModel(argparse.Action):
    """``--model NAME``: one model of ``PRESETS``, as ``liger-gen``'s one-model commands take it (several, comma-
    separated or repeated, are a usage error). ``--preset`` is its deprecated spelling: it prints one line on
    stderr and sets ``model`` too."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == "--preset":
            print("train_llama: --preset is deprecated, use --model (it takes the same values)", file=sys.stderr)
        names = [v.strip() for v in str(values).split(",")]
        seen = [namespace.model] if getattr(namespace, "model_given", False) else []
        if len(seen + names) > 1:
            parser.error(f"{option_string}: this example trains one model, got {len(seen + names)} "
                         f"({', '.join(seen + names)}): run it once per model")
        if names[0] not in PRESETS:
            parser.error(f"{option_string}: invalid choice {names[0]!r} (choose from {', '.join(sorted(PRESETS))})")
        namespace.model, namespace.model_given = names[0], True
        setattr(namespace, self.dest, names[0])


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface; ``run()`` parses the same options."""
    p = argparse.ArgumentParser(
        prog="python -m liger_gen.examples.train_llama",
        description="Train a Llama with plain transformers and with liger_gen.apply_to(); compare loss, "
        "tokens/s and peak memory.",
    )
    p.add_argument("--model", action=_OneModel, default="tiny", metavar="{" + ",".join(sorted(PRESETS)) + "}",
                   help="model shape, one of the choices (default: tiny)")
    p.add_argument("--preset", action=_OneModel, help=argparse.SUPPRESS)  # the old spelling of --model
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per run (default: 50)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="AdamW learning rate (default: per model, "
             + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()) + ")",
    )
    p.add_argument("--lr-warmup-steps", type=int, default=10,
                   help="linear learning-rate warm-up steps before the peak rate (default: 10; 0 disables)")
    p.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="parameter dtype (default: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument(
        "--attn-implementation",
        default="sdpa",
        help="transformers attention implementation, e.g. sdpa or eager (default: sdpa)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default: 0)")
    p.add_argument(
        "--repeat-baseline",
        action="store_true",
        help="run plain transformers a second time to show the run-to-run noise floor",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=3,
        help="leading steps excluded from timing (default: 3)",
    )
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="UTF-8 training text (default: tiny Shakespeare)")
    p.add_argument(
        "--max-chars",
        type=int,
        default=None,
        help="use only the first N characters of the text (tokenizer and data; default: all)",
    )
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE tokenizer vocab size (default: 8192)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where trained tokenizers are cached (default: $XDG_CACHE_HOME/liger_gen or ~/.cache/liger_gen)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write all results to this JSON file")
    return p


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("steps", "batch_size", "seq_len", "vocab_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.max_chars is not None and args.max_chars < 1:
        parser.error(f"--max-chars must be >= 1, got {args.max_chars}")
    if args.vocab_size < 257:
        # Byte-level BPE starts from the 256 byte symbols; fewer would not cover the alphabet.
        parser.error(f"--vocab-size must be >= 257 (byte alphabet + merges), got {args.vocab_size}")
    if not Path(args.text).is_file():
        parser.error(f"--text {args.text}: no such file")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError as exc:
            parser.error(f"--device {args.device!r}: {exc}")
        if device.type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: this PyTorch build sees no CUDA GPU (use --device cpu)")
    if args.steps <= args.warmup_steps:
        print(f"note: --steps {args.steps} <= --warmup-steps {args.warmup_steps}: no step is timed, "
              "tokens/s will read n/a", file=sys.stderr)


# --------------------------------------------------------------------------------------------------------------
# Data: text -> tokenizer -> token stream -> batches
# --------------------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/liger_gen`` if set, else ``~/.cache/liger_gen``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "liger_gen"


def load_text(path: Path, max_chars: int | None = None) -> str:
    """Read ``path`` as UTF-8, keeping only the first ``max_chars`` characters if given.

    Raises FileNotFoundError if the file is missing and ValueError if it is empty.
    """
    text = Path(path).read_text(encoding="utf-8")
    if max_chars is not None:
        text = text[:max_chars]
    if not text:
        raise ValueError(f"training text {path} is empty")
    return text


def get_tokenizer(text: str, vocab_size: int, cache_dir: Path):
    """Return ``(tokenizer, path, from_cache)``: a byte-level BPE ``tokenizers.Tokenizer`` trained on ``text``.

    The trained tokenizer is cached as ``<cache_dir>/tokenizers/bpe-<sha256(text)>-v<vocab_size>.json``; a
    cached file is loaded instead of retraining. Writes are atomic (temp file + rename), so concurrent runs
    cannot leave a truncated file behind. The result may have fewer than ``vocab_size`` entries when the text
    is too small to support that many merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    path = Path(cache_dir) / "tokenizers" / f"bpe-{digest}-v{vocab_size}.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path)), path, True
        except Exception:  # a corrupt cache entry is retrained, never fatal
            pass

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown tokens
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer=trainer)

    write_atomic(path, tokenizer.to_str())
    return tokenizer, path, False


def tokenize(text: str, tokenizer) -> torch.Tensor:
    """The whole text as one int64 token stream of shape ``[n_tokens]``."""
    return torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)


# --------------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------------


def build_model(
    preset: str,
    tokenizer_vocab: int,
    seq_len: int,
    attn_implementation: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
):
    """A randomly initialised ``LlamaForCausalLM`` of the given preset, on ``device`` with ``dtype`` params.

    Raises ValueError if the tokenizer's ids do not fit the preset's embedding or ``seq_len`` exceeds the
    preset's ``max_position_embeddings``.
    """
    from transformers import LlamaForCausalLM

    config = build_config(preset, attn_implementation)
    if preset in _VOCAB_FROM_TOKENIZER:
        config.vocab_size = tokenizer_vocab
    elif tokenizer_vocab > config.vocab_size:
        raise ValueError(f"tokenizer vocab {tokenizer_vocab} exceeds the {preset} embedding ({config.vocab_size} rows)")
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"--seq-len {seq_len} exceeds max_position_embeddings {config.max_position_embeddings}")

    torch.manual_seed(seed)
    # Initialise directly on the device: a 1B model initialises in a fraction of a second on a GPU but takes
    # many seconds on a CPU. Init in float32, then cast, so the init distribution does not depend on dtype.
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype=dtype)


def norm_inventory(model: torch.nn.Module, liger_rmsnorm: type) -> dict[str, int]:
    """Count ``transformers_rmsnorm`` (transformers' own ``*RMSNorm`` classes), ``liger_gen_rmsnorm`` (instances
    of ``liger_rmsnorm``) and ``liger_gen_swiglu_mlp`` modules of ``model``, and say whether its loss is fused."""
    n_hf = n_liger = 0
    for m in model.modules():
        cls = type(m)
        n_hf += cls.__name__.endswith("RMSNorm") and cls.__module__.startswith("transformers.")
        n_liger += isinstance(m, liger_rmsnorm)
    import liger_gen

    n_mlp = sum(isinstance(m, liger_gen.nn.GLUMLP) for m in model.modules())
    return {"transformers_rmsnorm": n_hf, "liger_gen_rmsnorm": n_liger, "liger_gen_swiglu_mlp": n_mlp,
            "fused_linear_cross_entropy_loss": "forward" in vars(model)}


# --------------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------------


def train(
    model: torch.nn.Module,
    batches: torch.Tensor,
    lr: float,
    device: torch.device,
    warmup_steps: int,
    seed: int,
    lr_warmup_steps: int = 0,
) -> dict[str, Any]:
    """Train ``model`` in place on ``batches`` ``[steps, B, T]`` with a fresh AdamW; return the run's metrics.

    Returns ``losses`` (one float per step, the mean token cross-entropy in nats), ``timed_steps``,
    ``timed_s``, ``tokens_per_s`` and ``ms_per_step`` (None if no step is left after warm-up) and
    ``peak_memory_bytes`` (None off CUDA). Losses stay on the device until the end so that the timed loop has
    no host synchronisation.
    """
    steps, batch_size, seq_len = batches.shape
    cuda = device.type == "cuda"
    batches = batches.to(device)
    torch.manual_seed(seed)  # Llama has no dropout by default; seeding keeps any stochastic layer repeatable
    model.train()
    optimizer = make_optimizer(model, lr, device)
    # linear warm-up to the peak rate, then constant: avoids the loss spike of a cold start at full rate
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / lr_warmup_steps) if lr_warmup_steps > 0 else 1.0)
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    losses: list[torch.Tensor] = []
    t_start = None
    for step in range(steps):
        if step == warmup_steps:
            sync(device)
            t_start = time.perf_counter()
        losses.append(train_step(model, optimizer, batches[step], schedule))
    sync(device)
    t_end = time.perf_counter()

    timed_steps = steps - warmup_steps if t_start is not None else 0
    timed_s = t_end - t_start if t_start is not None else None
    result = {
        "losses": torch.stack(losses).float().cpu().tolist(),
        "timed_steps": timed_steps,
        "timed_s": timed_s,
        "tokens_per_s": timed_steps * batch_size * seq_len / timed_s if timed_s else None,
        "ms_per_step": 1e3 * timed_s / timed_steps if timed_s else None,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
    }
    del optimizer, schedule
    model.zero_grad(set_to_none=True)
    return result


# --------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def print_report(results: dict[str, Any], console=None) -> None:
    """Print the per-step loss table and the per-run summary with ``rich``."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    runs, comps = results["runs"], results["comparisons"]
    names = list(runs)  # insertion order: baseline, [baseline_repeat], liger_gen
    others = [n for n in names if n != "baseline"]

    m, d, cfg = results["model"], results["data"], results["config"]
    console.print(
        f"[bold]{m['preset']}[/bold] Llama, {m['n_params'] / 1e6:.2f} M params, {m['dtype']} on "
        f"{results['environment']['device_name']}; batch {d['batch_size']} x seq {d['seq_len']}, {d['steps']} "
        f"steps, AdamW lr {cfg['lr']:g}; BPE vocab {d['tokenizer_vocab_size']}, {d['n_tokens']:,} tokens; "
        f"{results['patch'].get('summary') or 'liger_gen.apply_to: no report'}"
    )

    label = lambda n: _LABELS.get(n, n)  # noqa: E731
    table = Table(title="Loss per step (nats/token)", caption="Δ = run − baseline")
    table.add_column("step", justify="right")
    table.add_column("baseline", justify="right")
    for n in others:
        table.add_column(label(n), justify="right")
        table.add_column(f"Δ {label(n)}", justify="right")
    for i, base in enumerate(runs["baseline"]["losses"]):
        row = [str(i), f"{base:.6f}"]
        for n in others:
            diff = comps[n]["diff"]
            row += [f"{runs[n]['losses'][i]:.6f}", f"{diff[i]:+.2e}" if i < len(diff) else "n/a"]
        table.add_row(*row)
    console.print(table)

    summary = Table(title=f"Per run (timing excludes the first {cfg['warmup_steps']} steps)")
    for col in ("run", "tokens/s", "ms/step", "peak mem GiB", "max |Δ|", "mean |Δ|", "same curve"):
        summary.add_column(col, justify="left" if col == "run" else "right")
    for n in names:
        r = runs[n]
        peak = r["peak_memory_bytes"]
        c = comps.get(n)
        summary.add_row(
            label(n),
            _fmt(r["tokens_per_s"], ",.0f"),
            _fmt(r["ms_per_step"], ".1f"),
            "n/a" if peak is None else f"{peak / 2**30:.2f}",
            "—" if c is None else _fmt(c["max_abs_diff"], ".2e"),
            "—" if c is None else _fmt(c["mean_abs_diff"], ".2e"),
            "—" if c is None else ("yes" if c["pass"] else "no"),
        )
    console.print(summary)


# --------------------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------------------


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run(args_list: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison with command-line style ``args_list`` (``None``: ``sys.argv[1:]``).

    Prints the report and returns the results dict (also written to ``--json`` if given): ``config``,
    ``environment``, ``model``, ``data``, ``patch`` (what ``apply_to`` replaced), ``runs`` (name -> metrics
    from :func:`train`) and ``comparisons`` (name -> ``liger_gen.training.compare_losses`` against
    ``runs["baseline"]`` at ``loss_rel_tolerance(dtype)``: per-step ``diff``, max / mean absolute and relative
    differences, ``pass``).
    """
    import liger_gen  # the real package; called as liger_gen.apply_to so tests can wrap it

    parser = build_parser()
    args = parser.parse_args(args_list)
    _validate(args, parser)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = _DTYPES[dtype_name]
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.model]

    # Data.
    text = load_text(args.text, args.max_chars)
    cache_dir = args.cache_dir or default_cache_dir()
    tokenizer, tokenizer_path, tokenizer_cached = get_tokenizer(text, args.vocab_size, cache_dir)
    tokens = tokenize(text, tokenizer)
    batches = make_batches(tokens, args.steps, args.batch_size, args.seq_len, args.seed)

    # Model, built once; every run starts from a CPU copy of these initial weights.
    model = build_model(
        args.model, tokenizer.get_vocab_size(), args.seq_len, args.attn_implementation, device, dtype, args.seed
    )
    initial_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    runs: dict[str, dict[str, Any]] = {}
    runs["baseline"] = train(model, batches, lr, device, args.warmup_steps, args.seed,
        args.lr_warmup_steps)
    if args.repeat_baseline:
        model.load_state_dict(initial_state)
        runs["baseline_repeat"] = train(model, batches, lr, device, args.warmup_steps, args.seed,
        args.lr_warmup_steps)

    model.load_state_dict(initial_state)
    params_before = {name: p for name, p in model.named_parameters()}
    model = liger_gen.apply_to(model)
    params_after = dict(model.named_parameters())
    patch = {
        **norm_inventory(model, liger_gen.nn.RMSNorm),
        # The contract: the replacement modules reuse the same Parameter objects and keep the state_dict keys.
        "same_parameter_objects": params_before.keys() == params_after.keys()
        and all(params_before[k] is params_after[k] for k in params_before),
        "same_state_dict_keys": set(model.state_dict()) == set(initial_state),
        "summary": model.liger_gen_report.summary(),  # what apply_to replaced, as its log line says
    }
    try:
        runs["liger_gen"] = train(model, batches, lr, device, args.warmup_steps, args.seed, args.lr_warmup_steps)
    finally:  # apply_to routes transformers' rotary function to liger-gen for the process: route it back
        restore_rope()

    base = runs["baseline"]["losses"]
    tol = loss_rel_tolerance(dtype)
    comparisons = {n: compare_losses(r["losses"], base, tol, "baseline") for n, r in runs.items() if n != "baseline"}

    import tokenizers
    import transformers
    import triton

    results: dict[str, Any] = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "lr": lr},
        "environment": {
            "device": str(device),
            "device_name": _device_name(device),
            "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "liger_gen": getattr(liger_gen, "__version__", None),
        },
        "model": {
            "preset": args.model,  # the name --model gave (the key kept for readers of older results)
            "dtype": dtype_name,
            "n_params": sum(p.numel() for p in model.parameters()),  # tied embeddings counted once
            "attn_implementation": model.config._attn_implementation,
            "config": {k: v for k, v in model.config.to_dict().items() if not k.startswith("_")},
        },
        "data": {
            "text": str(args.text),
            "n_chars": len(text),
            "n_tokens": tokens.numel(),
            "tokenizer_vocab_size": tokenizer.get_vocab_size(),
            "tokenizer_path": str(tokenizer_path),
            "tokenizer_from_cache": tokenizer_cached,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
        },
        "patch": patch,
        "runs": runs,
        "comparisons": comparisons,
    }

    print_report(results)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
    return results


def main() -> None:
    """Console entry point: run with ``sys.argv`` and exit non-zero if any loss is not finite."""
    from liger_gen.optional import missing_extra_message

    try:
        results = run()
    except ImportError as exc:
        message = missing_extra_message(exc)
        if message is None:
            raise
        raise SystemExit(f"train_llama: {message}") from None
    finite = all(math.isfinite(x) for r in results["runs"].values() for x in r["losses"])
    sys.exit(0 if finite else 1)


if __name__ == "__main__":
    main()
