"""``liger-gen`` command line: tune kernels on the target GPU, show tuned tables.

Thin by design: parse, call the library, print.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from liger_gen import __version__
from liger_gen.ops import available_ops
from liger_gen.runtime.devices import KNOWN_GPUS

OPS = available_ops()
DEFAULT_ROWS = "4096,16384,65536"


def _csv_ints(ctx, param, value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter(f"expected positive integers, got {value!r}")
    return out


def _csv_ops(ctx, param, value: str) -> list[str]:
    ops = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise click.BadParameter(f"unknown op(s) {unknown or value!r}; available: {', '.join(OPS)}")
    return ops


def _gpu_name(ctx, param, value: str | None) -> str | None:
    if value is None:
        return None
    value = value.lower()
    if value not in KNOWN_GPUS:
        raise click.BadParameter(f"unknown GPU {value!r}; known: {', '.join(KNOWN_GPUS)}")
    return value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="liger-gen")
def main() -> None:
    """liger-gen: Triton kernels for LLM training, generated from templates and tuned per GPU."""


@main.command()
@click.option("--gpu", required=True, callback=_gpu_name,
              help="Target GPU short name (h200, h100, a100, ...); must be the visible GPU.")
@click.option("--model", "model_name", default="llama3-8b", show_default=True,
              help="Model preset (llama3-8b, llama3.2-1b, qwen2.5-7b, mistral-7b, ...) or a path to a "
                   "Hugging Face config.json.")
@click.option("--ops", default=",".join(OPS), show_default=True, callback=_csv_ops, help="Comma-separated ops.")
@click.option("--rows", default=DEFAULT_ROWS, show_default=True, callback=_csv_ints,
              help="Token counts (rows) to tune; the runtime picks the nearest in log distance.")
@click.option("--dtype", "dtypes", default="bfloat16", show_default=True,
              help="Comma-separated dtypes: bfloat16, float16, float32.")
@click.option("--trials", default=24, show_default=True, type=click.IntRange(1, 10_000),
              help="Optuna trials per kernel (forward and backward each) and shape.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Table root; writes OUT/<gpu>/<op>.json. Default: the package's tuned/ folder.")
@click.option("--polish", default=None, type=click.IntRange(0, 10_000),
              help="Variants measured by the local polish after the search, per kernel and shape "
                   "(default: a quarter of --trials).")
@click.option("--storage", default=None, help="Optuna storage URL (e.g. sqlite:///tune.db) to resume studies.")
@click.option("--seed", default=0, show_default=True, type=int, help="Sampler and input seed.")
def tune(gpu, model_name, ops, rows, dtypes, trials, out_dir, polish, storage, seed) -> None:
    """Search launch settings on this GPU and write the tuned tables."""
    import torch

    from liger_gen.codegen.spaces import dtype_from_name
    from liger_gen.models import resolve_model
    from liger_gen.runtime.devices import current_gpu
    from liger_gen.runtime.tables import packaged_root

    try:
        model = resolve_model(model_name)
        dtype_list = [dtype_from_name(d.strip()) for d in dtypes.split(",") if d.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    visible = current_gpu()
    if visible is None:
        raise click.ClickException(
            f"no CUDA GPU is visible, and tuning measures kernels on the target GPU. Run "
            f"`liger-gen tune --gpu {gpu} --model {model_name}` (with the same other options) on a machine with "
            f"that GPU. Without a GPU, "
            f"`liger-gen show --gpu {gpu}` lists the packaged tables; on CPU tensors the runtime uses plain "
            f"PyTorch (or Triton's interpreter with TRITON_INTERPRET=1).")
    if visible[0] != gpu:
        raise click.ClickException(f"--gpu {gpu} does not match the visible GPU {visible[1]!r} ({visible[0]}); "
                                   f"tables must be tuned on the GPU they are for.")
    from liger_gen.codegen.report import run_tuning

    run_tuning(ops=ops, model=model, rows=rows, dtypes=dtype_list, trials=trials,
               out_root=out_dir or packaged_root(), storage=storage, seed=seed, polish=polish,
               device=torch.device("cuda", torch.cuda.current_device()), gpu=gpu, device_name=visible[1])


@main.command()
@click.option("--gpu", callback=_gpu_name, default=None, help="GPU short name; default: the visible GPU.")
@click.option("--trials", "show_trials", is_flag=True, help="Also list every trial.")
def show(gpu, show_trials) -> None:
    """Print the tuned tables for the current or named GPU."""
    from liger_gen.codegen.report import show_tables
    from liger_gen.runtime.devices import current_gpu

    if gpu is None:
        visible = current_gpu()
        if visible is None:
            raise click.ClickException("no CUDA GPU is visible: name one with --gpu (e.g. --gpu h200)")
        gpu = visible[0]
    if not show_tables(gpu, show_trials=show_trials):
        sys.exit(1)


if __name__ == "__main__":
    main()
