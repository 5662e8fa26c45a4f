"""The options every ``liger-gen`` command shares, spelled one way: ``--model`` (repeatable and comma-separated),
``--json``, ``--out`` (checked before the work; the benchmarks' default is a new folder under ``bench-results/``),
and the checks of comma-separated lists. Old spellings stay as hidden aliases that print one deprecation line on
stderr."""

from __future__ import annotations

import contextlib
import functools
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

import click

from liger_gen.ops import available_ops
from liger_gen.runtime.devices import GPU_SLUG, KNOWN_GPUS

OPS = available_ops()

#: The folder under the current one that holds each benchmark run's default --out folder.
BENCH_RESULTS = Path("bench-results")


# ------------------------------------------------------------------------------------------------ lists


def csv_items(value: str, what: str, param_hint: str | None = None) -> list[str]:
    """The stripped items of a comma-separated option value (none for an empty value). An empty item ('a,,b',
    'a,') is a usage error: a typo more often than a wish to drop it. ``param_hint`` names the option when this
    is called outside the option's callback."""
    items = [v.strip() for v in value.split(",")]
    if any(items) and not all(items):
        raise click.BadParameter(f"empty item in {value!r}: expected comma-separated {what}", param_hint=param_hint)
    return [v for v in items if v]


def csv_ints(ctx, param, value: str) -> list[int]:
    try:
        out = [int(v) for v in csv_items(value, "positive integers")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter(f"expected positive integers, got {value!r}")
    return out


def csv_ops(ctx, param, value: str) -> list[str]:
    ops = csv_items(value, "op names")
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise click.BadParameter(f"unknown op(s) {unknown or value!r}; available: {', '.join(OPS)}")
    return ops


def csv_bench_ops(ctx, param, value: str | None) -> list[str] | None:
    """``liger-gen bench --ops``: names of benchmark cases (every op, and ``fp8_linear``, whose GEMMs are
    cuBLASLt's: it has a case but nothing to tune); None, every case."""
    if value is None:
        return None
    from liger_gen.bench.ops import CASES

    ops = csv_items(value, "op names")
    unknown = [o for o in ops if o not in CASES]
    if unknown or not ops:
        raise click.BadParameter(f"unknown op(s) {unknown or value!r}; available: {', '.join(CASES)}")
    return ops


def csv_dtypes(ctx, param, value: str) -> str:
    """The --dtype text, unchanged once it has no empty item (the command reads the names)."""
    csv_items(value, "dtype names")
    return value


def csv_devices(ctx, param, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        devices = [int(v) for v in csv_items(value, "GPU indices")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated GPU indices, got {value!r}") from None
    if not devices or min(devices) < 0 or len(set(devices)) != len(devices):
        raise click.BadParameter(f"expected distinct GPU indices >= 0, got {value!r}")
    return devices


def gpu_name(ctx, param, value: str | None) -> str | None:
    """A known short name (h200, a100, ...) or the slug the runtime derives for any other GPU (tesla-t4)."""
    if value is None:
        return None
    value = value.lower()
    if value not in KNOWN_GPUS and not GPU_SLUG.fullmatch(value):
        raise click.BadParameter(f"{value!r} is not a GPU name: use a short name ({', '.join(KNOWN_GPUS)}) or, "
                                 f"for another GPU, the name the runtime derives from the reported device name "
                                 f"(lower case, words joined by '-', without 'NVIDIA': 'Tesla T4' -> tesla-t4)")
    return value


# ------------------------------------------------------------------------------------------------ --model


def split_models(values: tuple[str, ...] | list[str]) -> list[str]:
    """The model names of every --model given, each split at commas ('a,b' is a and b); a value that names an
    existing file or folder as a whole is one model, commas and all. An empty item is a usage error."""
    names: list[str] = []
    for value in values:
        names += [value] if "," in value and Path(value).exists() else csv_items(value, "model names", "'--model'")
    return names


def deprecated(old: str, new: str) -> None:
    """The one line on stderr that says ``old`` is a deprecated spelling of ``new``."""
    click.echo(f"liger-gen: {old} is deprecated, use {new} (it takes the same values)", err=True)


def model_option(default: str | tuple[str, ...], help: str, *, single: bool,
                 alias: str | None = None) -> Callable:
    """``--model``, repeatable and comma-separated (``--model a,b --model c``); the command receives ``model_name``
    (``single``: exactly one model, several are a usage error) or ``models`` (a list). ``alias``: an older
    spelling kept as a hidden option that prints one deprecation line on stderr; its values join --model's."""
    defaults = (default,) if isinstance(default, str) else tuple(default)

    def decorator(f: Callable) -> Callable:
        @functools.wraps(f)
        def command(*args, model_names: tuple[str, ...] = (), model_alias: tuple[str, ...] = (), **kwargs):
            ctx = click.get_current_context()
            given = ctx.get_parameter_source("model_names") is not click.core.ParameterSource.DEFAULT
            if model_alias:
                deprecated(alias, "--model")
            names = split_models((model_names if given else ()) + model_alias) if (given or model_alias) \
                else list(defaults)
            if not names:
                raise click.BadParameter("name at least one model", param_hint="'--model'")
            ctx.meta["liger_gen.models_given"] = given or bool(model_alias)
            if not single:
                return f(*args, models=names, **kwargs)
            if len(names) > 1:
                raise click.BadParameter(f"this command takes one model, got {len(names)} ({', '.join(names)}): "
                                         f"run it once per model", param_hint="'--model'")
            return f(*args, model_name=names[0], **kwargs)

        if alias is not None:
            command = click.option(alias, "model_alias", multiple=True, hidden=True,
                                   help="Deprecated spelling of --model.")(command)
        return click.option("--model", "model_names", multiple=True, default=defaults,
                            show_default=",".join(defaults), help=help + (" Repeatable and comma-separated."
                                                                          if not single else ""))(command)
    return decorator


def models_given() -> bool:
    """Whether the running command was given --model (or its alias), rather than its default models."""
    return bool(click.get_current_context().meta.get("liger_gen.models_given"))


# ------------------------------------------------------------------------------------------------ --json


def json_option(f: Callable) -> Callable:
    """``--json``: one JSON document on stdout instead of the tables (``liger_gen.cli_output``)."""
    return click.option("--json", "as_json", is_flag=True,
                        help="Print one JSON document on stdout instead of the tables; progress and notices go to "
                             "stderr.")(f)


# ------------------------------------------------------------------------------------------------ --out


def writable_out(path: str | Path) -> Path:
    """``path`` as an output folder (``liger_gen.files.writable_folder``: made if missing, a file written in it and
    removed), or a usage error naming --out. Every command with --out checks it so, before its work: a run never
    ends by failing to write what it measured."""
    from liger_gen.files import writable_folder

    try:
        return writable_folder(path)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--out'") from None


def out_folder(ctx, param, value: Path | None) -> Path | None:
    """The callback of every --out: the folder checked by ``writable_out`` (None stays None: the command checks
    its default folder itself)."""
    return None if value is None else writable_out(value)


def default_bench_out(command: str) -> Path:
    """A new folder ``bench-results/<command>-<UTC date>-<time>/`` under the current folder (``-2``, ``-3``, ... if
    a run in the same second made one), checked by ``writable_out``: where a benchmark writes without --out."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    folder, n = BENCH_RESULTS / f"{command}-{stamp}", 1
    while folder.exists():
        n += 1
        folder = BENCH_RESULTS / f"{command}-{stamp}-{n}"
    return writable_out(folder)


@contextlib.contextmanager
def bench_out(out_dir: Path | None, command: str) -> Iterator[Path]:
    """``out_dir``, or the default folder (``default_bench_out``), which is removed again (with ``bench-results/``)
    if the command ends without writing anything in it (a usage error found by the run, a missing extra)."""
    if out_dir is not None:
        yield out_dir
        return
    folder = default_bench_out(command)
    try:
        yield folder
    finally:
        for empty in (folder, BENCH_RESULTS):
            with contextlib.suppress(OSError):
                empty.rmdir()  # only an empty folder goes


BENCH_OUT_HELP = ("Default: a new folder bench-results/<command>-<UTC date>-<time>/ under the current folder "
                  "(nothing is written at the current folder's top level).")
