"""``liger-gen`` command line: tune kernels on the target GPU, build, verify and show tuned tables, benchmark.

Thin by design: parse, call the library, print. The options every command shares (``--model``, ``--json``,
``--out``, the lists) are ``liger_gen.cli_options``; the ``--json`` document is ``liger_gen.cli_output``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from liger_gen import cli_output
from liger_gen._version import __version__
from liger_gen.bench.step import DEFAULT_MODELS, DEFAULT_PROVIDERS, PROVIDERS, STEP_MODELS, split_names
from liger_gen.cli_options import (BENCH_OUT_HELP, OPS, bench_out, csv_bench_ops, csv_devices, csv_dtypes, csv_ints,
                                   csv_items, csv_ops, gpu_name, json_option, model_option, models_given, out_folder,
                                   writable_out)
from liger_gen.cli_output import NeedsGPU, files_in, finish
from liger_gen.console import progress_bar
from liger_gen.ops import all_specs, get_spec
from liger_gen.training import DEFAULT_TEXT, DTYPES, MAX_TEXT_BYTES, read_text_bytes

DEFAULT_ROWS = "4096,16384,65536"


def _packaged_gpus() -> list[str]:
    from liger_gen.runtime.tables import gpus_with_tables, packaged_root

    return gpus_with_tables([spec.name for spec in all_specs()], [("packaged", packaged_root())])


class _Group(click.Group):
    """The command group: a missing optional dependency ends a command with the pip command that installs it,
    not a traceback; under --json a failing command still prints its JSON document (``cli_output.json_mode``)."""

    def parse_args(self, ctx, args):
        ctx.meta["liger_gen.wants_json"] = cli_output.wants_json(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        from liger_gen.optional import missing_extra_message

        with cli_output.json_mode(ctx, ctx.meta.get("liger_gen.wants_json", False)):
            try:
                return super().invoke(ctx)
            except ImportError as exc:
                message = missing_extra_message(exc)
                if message is None:
                    raise
                raise click.ClickException(message) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="liger-gen")
def main() -> None:
    """liger-gen: Triton kernels for LLM training, generated from templates and tuned per GPU."""


@main.command()
@click.option("--gpu", required=True, callback=gpu_name,
              help="Target GPU short name (h200, h100, a100, ...; another GPU by its derived name, e.g. tesla-t4); "
                   "must be the visible GPU.")
@model_option("llama3-8b", "Model preset (llama3-8b, llama3.2-1b, qwen2.5-7b, mistral-7b, ...) or a path to a "
                          "Hugging Face config.json.", single=True)
@click.option("--ops", default=",".join(OPS), show_default=True, callback=csv_ops, help="Comma-separated ops.")
@click.option("--rows", default=DEFAULT_ROWS, show_default=True, callback=csv_ints,
              help="Token counts (rows) to tune; the runtime picks the nearest in log distance (adamw is tuned at "
                   "the model's parameter sizes instead).")
@click.option("--dtype", "dtypes", default="bfloat16", show_default=True, callback=csv_dtypes,
              help="Comma-separated dtypes: bfloat16, float16, float32.")
@click.option("--trials", default=24, show_default=True, type=click.IntRange(1, 10_000),
              help="Optuna trials per kernel (forward and backward each) and shape.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              callback=out_folder,
              help="Table root; writes OUT/<gpu>/<op>.json. Default: the package's tuned/ folder in a source "
                   "checkout, else ~/.local/share/liger-gen/tuned ($XDG_DATA_HOME/liger-gen/tuned), which the "
                   "runtime also reads.")
@click.option("--polish", default=None, type=click.IntRange(0, 10_000),
              help="Variants measured by the local polish after the search, per kernel and shape "
                   "(default: a quarter of --trials).")
@click.option("--storage", default=None,
              help="Where the Optuna studies are kept, to resume an interrupted run: a journal file path "
                   "(safe for several workers) or a database URL (sqlite:///tune.db; postgresql://user@host/db "
                   "for several hosts). Default: in memory with one worker; with several, a journal file in "
                   "OUT/<gpu>/, removed after a complete run.")
@click.option("--seed", default=0, show_default=True, type=int, help="Sampler and input seed.")
@click.option("--budget-s", "budget_s", default=36.0, show_default=True, type=click.FloatRange(0),
              help="Seconds of search + polish per op, split evenly over its shapes and kernels; a search that "
                   "reaches its share stops (recorded in the table), re-timing still runs. 0: no cap.")
@click.option("--workers", default=None, type=click.IntRange(1),
              help="Tune on this many GPUs (0..N-1) in parallel, one worker process each, sharing --storage.")
@click.option("--devices", default=None, callback=csv_devices,
              help="Comma-separated GPU indices to tune on in parallel (e.g. 0,1,2,3); overrides --workers.")
@click.option("--batch", default=8, show_default=True, type=click.IntRange(1, 256),
              help="Points the search proposes at once (part of the search: the same seed and batch give the same "
                   "tables with any number of compile workers).")
@click.option("--compile-workers", "compile_workers", default=None, type=click.IntRange(0, 256),
              help="Processes per tuning process that compile each batch's variants on the CPU while the GPU "
                   "times (0: compile at the first launch). Default: the CPU cores less two, at most 16, divided "
                   "by the number of GPU workers (0 on a machine of 2 cores).")
@click.option("--refresh", is_flag=True,
              help="No search: re-time each existing entry's finalists (its best few and the heuristic) under "
                   "the running Triton and rewrite the table (after a Triton upgrade). Shapes without an entry "
                   "are skipped.")
@click.option("--build/--no-build", "build_kernels", default=True, show_default=True,
              help="After tuning, compile the tuned variants into the compiled kernel cache (`liger-gen build`).")
@click.option("--run-id", "run_id", default=None, metavar="NAME",
              help="Name of a run shared by several hosts: each starts the same command with the same --storage "
                   "(a database every host reaches) and --run-id. Needs --storage.")
@click.option("--no-write-tables", "no_write_tables", is_flag=True,
              help="With --run-id: this host only tunes; a host started without this flag writes the tables.")
@click.option("--stale-after", "stale_after", default=600.0, show_default=True, type=click.FloatRange(min=1),
              metavar="SECONDS",
              help="With --run-id: a unit whose owner shows no progress for this long is taken over (one whose "
                   "process on this host is gone, at once). Keep it above the longest stretch without a trial.")
@json_option
@click.pass_context
def tune(ctx, gpu, model_name, ops, rows, dtypes, trials, out_dir, polish, storage, seed, budget_s, workers,
         devices, batch, compile_workers, refresh, build_kernels, run_id, no_write_tables, stale_after,
         as_json) -> None:
    """Search launch settings on this GPU (or several of the same kind) and write the tuned tables.

    Several hosts tune one run together through a PostgreSQL database (pip install 'liger-gen[tune]' brings the
    driver): start the same command on each, with the same --storage URL and --run-id, and --no-write-tables on
    all but the host that writes the tables (that one's --out gets them). Each host tunes the units it claims on
    its own GPUs (--workers), then waits until every unit is done, taking over units whose process died on it or
    that showed no progress for --stale-after seconds. For example, on the table-writing host and on the others:

    \b
      liger-gen tune --gpu h200 --workers 8 --storage postgresql://tuner@db-host/tune --run-id llama-1
      liger-gen tune --gpu h200 --workers 8 --storage postgresql://tuner@db-host/tune --run-id llama-1 \\
          --no-write-tables

    To resume a host that was stopped, run its command again; a new --run-id starts a new run (the studies
    stored for the same problems are reused).
    """
    from liger_gen.optional import require

    require("optuna", "liger-gen tune")  # a training-only install: the group turns this into the pip command

    if run_id is not None:
        import re

        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", run_id):
            raise click.BadParameter(f"expected a name of letters, digits, '.', '_' and '-' (at most 64), got "
                                     f"{run_id!r}", param_hint="--run-id")
        if storage is None or storage.startswith("sqlite"):
            raise click.BadParameter("a shared run needs --storage that every host can open: a database server's "
                                     "URL (postgresql://user@host/db; SQLite is a file of one machine), or a "
                                     "journal file path on a disk every host mounts with working file locks",
                                     param_hint="--run-id")
    else:
        from click.core import ParameterSource

        given = [f"--{name.replace('_', '-')}" for name in ("no_write_tables", "stale_after")
                 if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT]
        if given:
            raise click.BadParameter(f"{' and '.join(given)} only appl{'y' if len(given) > 1 else 'ies'} to a "
                                     f"shared run (--run-id NAME)",
                                     param_hint="--run-id")

    from liger_gen.codegen.spaces import dtype_from_name
    from liger_gen.models import resolve_model
    from liger_gen.runtime.tables import default_tune_root, packaged_root

    try:
        model = resolve_model(model_name)
        dtype_list = [dtype_from_name(d.strip()) for d in dtypes.split(",") if d.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    from liger_gen.tuning.driver import DeviceError, NoGPUError, TuneSettings, find_target, run_tuning

    if devices is None:
        devices = list(range(workers)) if workers else None
    try:
        target = find_target(gpu, devices)  # the one check of the GPUs
    except NoGPUError as exc:  # the tuner's: said as NeedsGPU (--json: error kind "no-gpu")
        shipped = _packaged_gpus()
        listing = (f"`liger-gen show --gpu {gpu}` lists its packaged tables" if gpu in shipped else
                   f"no tables for {gpu} are packaged (packaged: {', '.join(shipped) or 'none'}; `liger-gen show "
                   f"--gpu NAME` lists them)")
        raise NeedsGPU(
            f"{exc} Run `liger-gen tune --gpu {gpu} --model {model_name}` (with the same other options) on a "
            f"machine with that GPU. Without a GPU, {listing}; on CPU tensors the runtime uses plain "
            f"PyTorch (or Triton's interpreter with TRITON_INTERPRET=1).") from None
    except DeviceError as exc:
        if exc.param_hint:
            raise click.BadParameter(str(exc), param_hint=exc.param_hint) from None
        raise click.ClickException(str(exc)) from None
    from liger_gen.tuning.fleet import SharedRunError
    from liger_gen.tuning.storage import JournalError, StorageError

    out_root = out_dir or writable_out(default_tune_root())
    if compile_workers is None:
        compile_workers = default_compile_workers(len(devices) if devices else 1)
    settings = TuneSettings(gpu=gpu, model=model, specs=[get_spec(op) for op in ops], rows=rows, dtypes=dtype_list,
                            target=target, out_root=out_root, trials=trials, polish=polish, seed=seed,
                            budget_s=budget_s or None, storage=storage, batch=batch,
                            compile_workers=compile_workers, refresh=refresh, run_id=run_id,
                            write_tables=not no_write_tables, stale_s=stale_after)
    try:
        result = run_tuning(settings)
    except (JournalError, StorageError, SharedRunError) as exc:
        raise click.ClickException(str(exc)) from None
    if no_write_tables:
        pass  # run_tuning said which host writes the tables
    elif Path(out_root).resolve() != packaged_root().resolve():
        click.echo(f"tables written under {out_root}/{gpu}/. To ship them, copy that folder into the image as "
                   f"<DIR>/{gpu}/ and set LIGER_GEN_TUNED_DIR=<DIR>; check with `liger-gen show --gpu {gpu}`.")
    summary = {"gpu": gpu, "model": model_name, "tables": str(Path(out_root) / gpu), "run_id": run_id,
               "tuned": {op: len(entries) for op, entries in result.entries.items()},
               "unfinished": len(result.unfinished), "errors": [str(e) for e in result.errors], "build": None}
    if result.unfinished:
        raise click.ClickException(f"{len(result.unfinished)} unit(s) not tuned; see the messages above.")
    if result.errors:
        raise click.ClickException("every unit was tuned, but worker(s) failed on the way; see the messages above."
                                   + (" Running the same command again completes the run without tuning (it "
                                      "writes the tables and compiles their kernels)."
                                      if run_id and not no_write_tables else ""))
    if build_kernels and not no_write_tables:
        summary["build"] = _build_after_tune(gpu, model_name, ops, rows, dtypes, out_root, as_json)
    finish(as_json, "tune", summary, {"tables": Path(out_root) / gpu})


def default_compile_workers(gpu_workers: int = 1) -> int:
    """Compile workers per tuning process: the CPU cores this process may use, less two (the tuning processes'
    own work), at most 16, shared evenly by ``gpu_workers`` tuning processes."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(0, min(16, cores - 2) // max(1, gpu_workers))


def _build_after_tune(gpu: str, model_name: str, ops: list[str], rows: list[int], dtypes: str, out_root,
                      as_json: bool = False) -> list | None:
    """``liger-gen build`` for the tuned ops and rows, in a fresh process (it must compile into an empty Triton
    cache, and this process has compiled the tuning variants). Under --json each build's document is collected
    (its stdout) and returned; its other output goes to stderr."""
    import json
    import subprocess

    from liger_gen.bench.ops import CASES

    runnable = [o for o in ops if o in CASES]
    if not runnable:
        return None
    built = []
    for dtype in [d.strip() for d in dtypes.split(",") if d.strip()]:
        cmd = [sys.executable, "-m", "liger_gen.cli", "build", "--gpu", gpu, "--model", model_name,
               "--ops", ",".join(runnable), "--rows", ",".join(map(str, rows)), "--dtype", dtype,
               "--out", str(out_root)] + (["--json"] if as_json else [])
        click.echo("compiling the tuned variants: " + " ".join(cmd[2:]), err=as_json)
        proc = subprocess.run(cmd, check=False, stdout=subprocess.PIPE if as_json else None, text=True)
        if as_json:
            try:
                built.append(json.loads(proc.stdout))
            except ValueError:
                built.append({"exit_code": proc.returncode, "stdout": proc.stdout[-2000:]})
        if proc.returncode != 0:
            raise click.ClickException("the tables were written, but compiling their kernels failed (above); "
                                       "rerun `liger-gen build` for them")
    return built


@main.command()
@click.option("--gpu", required=True, callback=gpu_name,
              help="GPU short name (h200, ...); must be the visible GPU: kernels are compiled for it.")
@model_option("llama3.2-1b", "A whole model to run (llama3.2-1b, qwen2.5-0.5b, tiny, ... or a Hugging Face "
                            "config.json), or with --rows a model preset whose ops run one by one (llama3-8b, ...).",
              single=True)
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(1),
              help="Sequences per step of the whole-model run (the training batch shape).")
@click.option("--seq-len", default=2048, show_default=True, type=click.IntRange(1),
              help="Tokens per sequence of the whole-model run.")
@click.option("--rows", default=None, callback=lambda c, p, v: None if v is None else csv_ints(c, p, v),
              help="Run each op of --ops at these token counts instead of a whole model (for model presets and "
                   "for the shapes a tune run tuned).")
@click.option("--ops", default="rms_norm,rope,swiglu,fused_linear_cross_entropy", show_default=True,
              callback=csv_ops, help="The ops of a --rows run.")
@click.option("--dtype", "dtype_name", default="bfloat16", show_default=True,
              help="Activation and parameter dtype: bfloat16, float16 or float32.")
@click.option("--layers", default=None, type=click.IntRange(1),
              help="Decoder layers of the whole-model run (default: up to the first of each distinct layer type; "
                   "layers of one type run the same kernels).")
@click.option("--heuristic/--no-heuristic", default=True, show_default=True,
              help="Also compile the heuristic configs (used where a table is refused at run time).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              callback=out_folder,
              help="Tables root to write OUT/<gpu>/compiled/triton-<version>-<backend>-sm<arch>/ under. "
                   "Default: where `liger-gen tune` writes.")
@click.option("--replace", is_flag=True,
              help="Start the store afresh (default: add to it, so several models share one store).")
@json_option
def build(gpu, model_name, batch_size, seq_len, rows, ops, dtype_name, layers, heuristic, out_dir, replace,
          as_json) -> None:
    """Compile the kernels a model runs on this GPU into a compiled kernel cache beside the tables.

    At run time a kernel found there is loaded without invoking the Triton compiler; ship the folder with the
    tables (in the package's tuned/ or under $LIGER_GEN_TUNED_DIR).
    """
    import torch

    from liger_gen.codegen.spaces import dtype_from_name
    from liger_gen.runtime.devices import current_gpu
    from liger_gen.runtime.tables import default_tune_root

    visible = current_gpu()
    if visible is None:
        raise NeedsGPU(f"no CUDA GPU is visible: compiled kernels are built on the GPU they are for. "
                                   f"Run `liger-gen build --gpu {gpu} --model {model_name}` (with the same other "
                                   f"options) on a machine with that GPU.")
    if visible[0] != gpu:
        raise click.ClickException(f"--gpu {gpu} does not match the visible GPU {visible[1]!r} ({visible[0]})")
    try:
        dtype = dtype_from_name(dtype_name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--dtype") from None
    from liger_gen import prebuild
    from liger_gen.runtime.compiled import store_summary

    out_root = out_dir or writable_out(default_tune_root())
    device = torch.device("cuda", torch.cuda.current_device())
    if rows:
        def steps():
            return prebuild.op_steps(model_name, ops, rows, dtype, device)
        what = {"model": model_name, "ops": ops, "rows": rows, "dtype": dtype_name}
    else:
        def steps():
            try:
                return [prebuild.model_step(model_name, batch_size, seq_len, dtype, device, layers)]
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--model") from None
        what = {"model": model_name, "batch_size": batch_size, "seq_len": seq_len, "dtype": dtype_name,
                "layers": layers}
    with progress_bar("build", enabled=not as_json) as bar:
        path = prebuild.build(steps, out_root, gpu, heuristic=heuristic, built_for=what, merge=not replace,
                              progress=bar)
    summary = store_summary(path)
    click.echo(f"wrote {summary['kernels']} compiled kernels ({summary['files']} files, "
               f"{summary['bytes'] / 2**20:.1f} MiB) to {path}")
    click.echo(f"ship {Path(out_root) / gpu} with the tables (the package's tuned/{gpu}/ or $LIGER_GEN_TUNED_DIR/"
               f"{gpu}/); check with `liger-gen verify --gpu {gpu}`.")
    finish(as_json, "build", {"gpu": gpu, "built_for": what, "store": str(path), "kernels": summary["kernels"],
                              "files": summary["files"], "bytes": summary["bytes"]}, {"store": path})


@main.command()
@click.option("--gpu", callback=gpu_name, default=None, help="GPU short name; default: the visible GPU.")
@click.option("--trials", "show_trials", is_flag=True, help="Also list every trial.")
@click.option("--ops", default=None, callback=lambda c, p, v: None if v is None else csv_ops(c, p, v),
              help="Comma-separated ops whose tables to print. Default: every table.")
@click.option("--detail", is_flag=True,
              help="Print each table in full: its header, every entry's times and its configs (--trials implies "
                   "it).")
@json_option
def show(gpu, show_trials, ops, detail, as_json) -> None:
    """Print the tuned tables for the current or named GPU.

    One line per table: the op, the shapes tuned, the median gain over the heuristic, the compiled kernels
    present, and whether the runtime uses it here or why not. --detail prints the tables in full.
    """
    from liger_gen.tuning.report import show_tables, table_summaries
    from liger_gen.runtime.devices import current_gpu

    if gpu is None:
        visible = current_gpu()
        if visible is None:
            raise NeedsGPU("no CUDA GPU is visible: name the GPU whose tables to show, e.g. "
                           "`liger-gen show --gpu h200`")
        gpu = visible[0]
    from liger_gen.verify import compiled_kernels_per_op

    specs = all_specs()
    if as_json:  # the summary lines as records (--detail and --trials print tables for people)
        found = table_summaries(gpu, specs, ops=ops, compiled=compiled_kernels_per_op(gpu, specs))
        finish(True, "show", {"gpu": gpu, "tables": found}, exit_code=0 if found else 1)
        return
    compiled = None if detail or show_trials else compiled_kernels_per_op(gpu, specs)
    if not show_tables(gpu, specs, show_trials=show_trials, ops=ops, detail=detail, compiled=compiled):
        sys.exit(1)


def _model_folder_config(model_name: str) -> str:
    """--model as resolve_model reads it: a Hugging Face model folder (a directory, e.g. a downloaded snapshot)
    stands for the config.json in it; a folder without one is a usage error. A preset or a file (or anything named
    *.json: resolve_model says what is wrong with it) is unchanged."""
    from liger_gen.models import PRESETS

    folder = Path(model_name)
    if model_name in PRESETS or model_name.endswith(".json") or not folder.is_dir():
        return model_name
    config = folder / "config.json"
    if not config.is_file():
        raise click.BadParameter(f"{model_name} is a folder without a config.json: name a Hugging Face model folder, "
                                 f"a config.json or a preset", param_hint="--model")
    return str(config)


@main.command()
@click.option("--gpu", callback=gpu_name, default=None,
              help="GPU short name (h200, ...); default: the visible GPU. Required without a GPU.")
@model_option("llama3-8b", "Model preset, a Hugging Face model folder (holding config.json) or a path to a "
                          "config.json: the shapes to check.", single=True)
@click.option("--rows", default=DEFAULT_ROWS, show_default=True, callback=csv_ints,
              help="Token counts to check (capped per op as the tuner caps them).")
@click.option("--dtype", "dtypes", default="bfloat16", show_default=True, callback=csv_dtypes,
              help="Comma-separated activation dtypes.")
@click.option("--ops", default=None, callback=lambda c, p, v: None if v is None else csv_ops(c, p, v),
              help="Comma-separated ops the model runs. Default: for a preset or config.json of a supported "
                   "family, the ops apply_to runs for it (its norm, RoPE, gated MLP or experts, fused linear "
                   "cross-entropy), predicted with transformers (without transformers verify refuses to guess: "
                   "name the ops or install it); for a family apply_to does not support, rms_norm,"
                   "fused_add_rms_norm,rope,swiglu,fused_linear_cross_entropy (a Llama-like model).")
@click.option("--fp8", is_flag=True,
              help="The model trains with apply_to(model, fp8=True): the default ops include the FP8 quantize ops "
                   "(at every operand width of the decoder's projections) and the norms that write their "
                   "operands.")
@click.option("--allow-heuristic", is_flag=True,
              help="Exit 0 even when some shapes would run the analytic heuristic (no tuned entry).")
@click.option("--require-compiled", is_flag=True,
              help="Exit 1 unless a compiled kernel store can be used here (for this Triton and GPU), so an image "
                   "whose kernels would all compile at start fails its build.")
@json_option
def verify(gpu, model_name, rows, dtypes, ops, fp8, allow_heuristic, require_compiled, as_json) -> None:
    """Say which tuned tables this machine would use for a model's shapes, which not and why.

    Exits 1 when a table file or entry is unusable, or when a shape would run the heuristic (unless
    --allow-heuristic): run it in an image build to fail early. Without a GPU it checks the files against the
    named GPU and says what it could not check.
    """
    from liger_gen.codegen.spaces import dtype_from_name
    from liger_gen.models import resolve_model
    from liger_gen.runtime.devices import current_gpu
    from liger_gen.verify import check, print_report, print_verdict, report_dict

    if gpu is None:
        visible = current_gpu()
        if visible is None:
            raise click.ClickException("no CUDA GPU is visible: name the GPU to check for with --gpu (e.g. "
                                       "--gpu h200)")
        gpu = visible[0]
    model_source = _model_folder_config(model_name)  # a model folder's config.json; else --model as given
    try:
        model = resolve_model(model_source)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None
    try:
        dtype_list = [dtype_from_name(d.strip()) for d in dtypes.split(",") if d.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--dtype") from None
    if not dtype_list:
        raise click.BadParameter("name at least one dtype (bfloat16, float16, float32)", param_hint="--dtype")
    if ops is None:  # the preset's or config file's own (resolve_model reads a file only if no preset is named so)
        from liger_gen.models import PRESETS
        from liger_gen.verify import default_ops

        ops, ops_source = default_ops(model_source, from_file=model_source not in PRESETS, fp8=fp8)
    else:
        ops_source = "those named by --ops"
    report = check(gpu, model, rows, dtype_list, ops)
    report.ops_source = f"{', '.join(ops)} ({ops_source})"
    if not as_json:
        print_report(report, gpu, model_name)
        print_verdict(report, allow_heuristic, require_compiled=require_compiled)
    finish(as_json, "verify", report_dict(report, gpu, model_name, allow_heuristic, require_compiled),
           exit_code=report.exit_code(allow_heuristic, require_compiled))


@main.command()
@model_option("llama3-8b", "Model preset, a Hugging Face config.json, or 'tiny' (a toy model for --device cpu).",
              single=True)
@click.option("--ops", default=None, callback=csv_bench_ops,
              help="Comma-separated ops. Default: every op with a benchmark case.")
@click.option("--rows", default=None, type=click.IntRange(1),
              help="Token count of every op (adamw: the parameter's element count). Default: 16384 (norms, RoPE, "
                   "GLUs), 8192 (cross-entropy, FLCE, KL, JSD), 2^26 (adamw) on CUDA; 64 on the CPU.")
@click.option("--providers", default=None,
              help="Comma-separated subset of liger-gen, liger-gen-heuristic, torch-eager, torch-compile, "
                   "liger-kernel, cut-cross-entropy, torchao. Default: all.")
@click.option("--dtype", default="bfloat16", show_default=True, help="bfloat16, float16 or float32.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu: a functional run (Triton's interpreter with TRITON_INTERPRET=1; kernel ms is host time).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              callback=out_folder,
              help="Folder for bench_<model>_<gpu>.json and .png, and for --render's .md and .png. " + BENCH_OUT_HELP)
@click.option("--render", "render_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Print a result JSON as markdown and draw its PNG; no GPU needed.")
@click.option("--iters", default=10, show_default=True, type=click.IntRange(1), help="Profiled iterations.")
@click.option("--wall-iters", default=100, show_default=True, type=click.IntRange(1),
              help="Most back-to-back calls in each of the 5 wall-time loops (about 0.3 s in all; the median "
                   "loop counts).")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(1), help="Untimed calls first.")
@click.option("--seed", default=0, show_default=True, type=int, help="Input seed.")
@json_option
def bench(model_name, ops, rows, providers, dtype, device, out_dir, render_path, iters, wall_iters, warmup,
          seed, as_json) -> None:
    """Time every op at a model's shapes: liger-gen vs its heuristic, torch eager/compile, Liger-Kernel, CCE.

    On the CPU (--device cpu) it is a functional run: the table, the JSON and the plot say so."""
    from liger_gen.bench import report
    from liger_gen.files import ResultsNotWritten

    if render_path is not None:
        return _render(report, render_path, out_dir, as_json)
    import torch

    from liger_gen.bench import PROVIDERS, Settings, bench_model, run_bench
    from liger_gen.codegen.spaces import dtype_from_name

    try:
        model = bench_model(model_name)
        torch_dtype = dtype_from_name(dtype)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    names = list(PROVIDERS) if providers is None else csv_items(providers, "provider names", "'--providers'")
    unknown = [p for p in names if p not in PROVIDERS]
    if unknown or not names:
        raise click.BadParameter(f"unknown provider(s) {unknown or providers!r}; known: {', '.join(PROVIDERS)}",
                                 param_hint="--providers")
    if device == "cuda" and not torch.cuda.is_available():
        raise NeedsGPU(
            "no CUDA GPU is visible, and `liger-gen bench` measures kernels on the GPU. Run it on a machine with "
            "a GPU; or use `--device cpu` for a functional run with tiny shapes (e.g. `liger-gen bench --device "
            "cpu --model tiny --providers liger-gen,torch-eager`, in Triton's interpreter with TRITON_INTERPRET=1); "
            "`liger-gen bench --render <result>.json` (the JSON of a GPU run) needs no GPU.")
    if device == "cpu":
        from liger_gen.runtime.ops import interpreter_enabled

        click.echo("note: --device cpu is a functional run: it times host execution, not GPU kernels; "
                   + ("liger-gen runs its Triton kernels in Triton's interpreter." if interpreter_enabled() else
                      "TRITON_INTERPRET=1 is not set, so liger-gen runs its plain-PyTorch path, not its kernels "
                      "(set it before starting Python to run the kernels in the interpreter)."), err=True)
    with bench_out(out_dir, "bench") as folder, progress_bar("bench", enabled=not as_json) as bar:
        data = run_bench(model, ops=ops, providers=names, rows=rows, dtype=torch_dtype, device=device,
                         settings=Settings(iters=iters, wall_iters=wall_iters, warmup=warmup), seed=seed,
                         progress=bar)
    stem = report.default_stem(data)
    try:
        click.echo(f"wrote {report.write_json(data, folder / f'{stem}.json')}", err=True)
    except ResultsNotWritten as exc:  # the JSON is in a temporary file (or printed): show the table, then fail
        report.print_table(data)
        raise click.ClickException(str(exc)) from None
    png = _bench_plot(report, data, folder / f"{stem}.png")
    if png:
        click.echo(f"wrote {png}", err=True)
    failed = report.failures(data)
    for line in failed:
        click.echo(f"liger-gen failed: {line}", err=True)
    if not as_json:
        report.print_table(data)
    finish(as_json, "bench", data, files_in(folder, f"{stem}.json", f"{stem}.png"), exit_code=1 if failed else 0)


def _render(report, render_path: Path, out_dir: Path | None, as_json: bool) -> None:
    """``bench --render``: a result JSON as markdown (printed, and written with its PNG to --out)."""
    from liger_gen.files import write_atomic

    try:
        loaded = report.load_json(render_path)  # read capped, never blocking; ReportError names the file
    except report.ReportError as exc:
        raise click.BadParameter(str(exc), param_hint="'--render'") from None
    try:
        data = report.derive(loaded)
        markdown = report.render_markdown(data)
    except report.ReportError as exc:
        raise click.ClickException(str(exc)) from None
    except (TypeError, AttributeError, KeyError, ValueError, IndexError, RecursionError) as exc:
        # it parses, but a field has the wrong type (or holds lists nested past Python's stack)
        raise click.ClickException(f"{render_path} is not a liger-gen bench result this version can read "
                                   f"(a field has an unexpected type: {type(exc).__name__}: {exc})") from None
    with bench_out(out_dir, "bench-render") as folder:
        if not as_json:
            click.echo(markdown, nl=False)
        md = folder / f"{render_path.stem}.md"
        try:
            write_atomic(md, markdown)
        except OSError as exc:
            raise click.ClickException(f"cannot write {md}: {exc.strerror or exc}"
                                       + ("" if as_json else " (the markdown is printed above)")) from None
        png = _bench_plot(report, data, folder / f"{render_path.stem}.png")
    click.echo(f"wrote {md}" + (f" and {png}" if png else ""), err=True)
    finish(as_json, "bench", {"markdown": markdown, "functional_run": report.functional_note(data) is not None,
                              "functional_run_reason": report.functional_note(data)},
           {"md": md, "png": png})


def _step_names(ctx, param, value: str) -> list[str]:
    """bench-step's --providers: the names (``liger_gen.bench.step.split_names``: no empty or repeated
    one)."""
    try:
        return split_names(value, param.name)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _step_text(ctx, param, value: str) -> str:
    """bench-step's --text, read here too, so a bad file stops the command before anything else runs."""
    try:
        read_text_bytes(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


@main.command("bench-step")
@model_option(DEFAULT_MODELS, f"Models: {', '.join(STEP_MODELS)}.", single=False, alias="--models")
@click.option("--providers", default=",".join(DEFAULT_PROVIDERS), show_default=True, callback=_step_names,
              help=f"Comma-separated providers, run in this order: {', '.join(PROVIDERS)}.")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(1), help="Sequences per step.")
@click.option("--seq-len", default=2048, show_default=True, type=click.IntRange(2), help="Tokens per sequence.")
@click.option("--warmup-steps", default=3, show_default=True, type=click.IntRange(0), help="Untimed steps first.")
@click.option("--steps", default=10, show_default=True, type=click.IntRange(1), help="Timed steps.")
@click.option("--profile-steps", default=2, show_default=True, type=click.IntRange(0),
              help="Steps under torch.profiler after the timed ones (0: no kernel breakdown).")
@click.option("--lr", default=3e-4, show_default=True, type=float, help="AdamW learning rate.")
@click.option("--optimizer", default="torch", show_default=True, type=click.Choice(["torch", "liger-gen"]),
              help="AdamW of the liger-gen providers: torch's fused AdamW (every other provider's) or "
                   "liger_gen.optim.AdamW.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the weights and batches.")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(sorted(DTYPES)),
              help="Parameter dtype.")
@click.option("--device", default=None, help="torch device (default: cuda; without a GPU, name cpu explicitly).")
@click.option("--attn-implementation", default="sdpa", show_default=True,
              help="transformers attention implementation.")
@click.option("--text", default=str(DEFAULT_TEXT), type=click.Path(dir_okay=False, exists=True), callback=_step_text,
              help=f"Training text, a regular file of at most {MAX_TEXT_BYTES // 2**20} MiB read as bytes "
                   f"(default: tiny Shakespeare).")
@click.option("--loss-rel-tol", default=None, type=float,
              help="Loss-curve tolerance, relative per step (default: the dtype's eps; bf16 2**-7).")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False, path_type=Path), callback=out_folder,
              help="Folder for step.json (first_step.json with --first-step). " + BENCH_OUT_HELP)
@click.option("--first-step", is_flag=True,
              help="Instead: time each provider's first step in a fresh process with empty Triton caches (process "
                   "start to the end of step 1, compilation included); JSON to OUT/first_step.json.")
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(1),
              help="Fresh processes per provider and model with --first-step (the median is reported).")
@json_option
def bench_step(first_step, repeats, as_json, **options) -> None:
    """Training steps of whole transformers models: plain vs Liger-Kernel vs liger-gen (vs torch.compile).

    Tokens/s, peak memory, the loss curve against plain transformers and a profile by kernel class; JSON to
    --out. Exits 1 if a provider fails or its loss curve departs from plain transformers'. With --first-step:
    the time to the end of the first step in a fresh process, per provider. On the CPU (--device cpu) it is a
    functional run: the table and the JSON say so.
    """
    import torch

    from liger_gen.files import ResultsNotWritten

    if as_json:
        options["console"] = False  # the tables are for people; the document replaces them
    if first_step:
        from liger_gen.bench.first_step import run_first_step

        keep = ("models", "providers", "batch_size", "seq_len", "dtype", "seed", "lr", "device",
                "attn_implementation", "text", "console")
        with bench_out(options["out_dir"], "bench-step") as folder:
            try:
                result = run_first_step(repeats=repeats, **{k: v for k, v in options.items() if k in keep},
                                        **{"out_dir": folder})
            except ValueError as exc:
                raise click.BadParameter(str(exc)) from None
            except ResultsNotWritten as exc:  # measured, printed, kept in a temporary file the message names
                raise click.ClickException(str(exc)) from None
        failed = any(r.get("status") == "error" for m in result["models"].values() for p in m.values()
                     for r in p["runs"])
        written = files_in(folder, "first_step.json")
        if written["json"]:
            click.echo(f"wrote {written['json']}", err=True)
        return finish(as_json, "bench-step", result, written, exit_code=int(failed))

    from liger_gen.bench.step import run_step_benchmark

    if options.get("device") is None and not torch.cuda.is_available():
        given = models_given()
        raise NeedsGPU(
            "no CUDA GPU is visible, and `liger-gen bench-step` trains "
            + (",".join(options["models"]) if given else "the Llama-3.2-1B and Qwen2.5-0.5B shapes")
            + " at --batch-size x --seq-len tokens per step (by default 8 x 2048: tens of GB of memory and hours on "
            "a CPU for a real model's shapes). Run it on a machine with a GPU; for a functional run on the CPU name "
            "the device and the tiny model: `TRITON_INTERPRET=1 liger-gen bench-step --device cpu --model tiny "
            "--batch-size 2 --seq-len 64 --warmup-steps 1 --steps 2 --profile-steps 0`.")
    with bench_out(options.pop("out_dir"), "bench-step") as folder:
        with progress_bar("bench-step", enabled=not as_json) as bar:
            try:
                result = run_step_benchmark(**options, out_dir=folder, progress=bar)
            except ValueError as exc:  # a bad option value (unknown model/provider/device, bad number, short text)
                raise click.BadParameter(str(exc)) from None
            except ResultsNotWritten as exc:  # measured, printed, kept in a temporary file the message names
                raise click.ClickException(str(exc)) from None
    written = files_in(folder, "step.json")
    if written["json"]:
        click.echo(f"wrote {written['json']}", err=True)
    failed = any(p.get("status") == "error" or (p.get("loss_check") or {}).get("pass") is False
                 for m in result.get("models", {}).values() for p in m.get("providers", {}).values())
    finish(as_json, "bench-step", result, written, exit_code=int(failed))


@main.command("bench-losses")
@click.option("--losses", default="dpo,orpo,cpo,simpo,kto,grpo,jsd", show_default=True,
              help="Comma-separated: dpo, orpo, cpo, simpo, kto, grpo, jsd.")
@click.option("--providers", default="torch-eager,torch-compile,liger-gen,liger-gen-logps,liger-kernel",
              show_default=True,
              help="Comma-separated. torch-eager always runs as the reference of the error columns (its row is "
                   "shown when named); liger-gen-logps (DPO only) is DPO on selective_log_softmax, whose backward "
                   "recomputes the logits.")
@click.option("--hidden", default=4096, show_default=True, type=click.IntRange(1), help="Hidden size of the head.")
@click.option("--vocab", default=128256, show_default=True, type=click.IntRange(2), help="Vocabulary size.")
@click.option("--batch", default=8, show_default=True, type=click.IntRange(1),
              help="Sequences per side (DPO-family: chosen and as many rejected).")
@click.option("--seq", default=1024, show_default=True, type=click.IntRange(8), help="Tokens per sequence.")
@click.option("--iters", default=10, show_default=True, type=click.IntRange(1), help="Timed calls (median).")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(1),
              help="Untimed calls first (torch.compile compiles in the first).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu: a functional run in fp32 (host time, no memory figures).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              callback=out_folder, help="Folder for bench_losses.json. " + BENCH_OUT_HELP)
@json_option
def bench_losses(losses, providers, hidden, vocab, batch, seq, iters, warmup, device, out_dir, as_json) -> None:
    """Post-training losses from hidden states (DPO, ORPO, CPO, SimPO, KTO, GRPO, JSD distillation) at an LM head:
    liger-gen vs Liger-Kernel's chunked losses vs the PyTorch formula, eager and compiled. Forward + backward
    time, peak extra memory, the loss and gradients against torch eager. bf16 on CUDA; on the CPU a functional
    run in fp32, and the table and the JSON say so."""
    import torch

    from liger_gen.bench.losses import format_table, run_losses
    from liger_gen.files import ResultsNotWritten

    names = list(dict.fromkeys(csv_items(losses, "loss names", "'--losses'")))
    provider_names = list(dict.fromkeys(csv_items(providers, "provider names", "'--providers'")))
    if not names or not provider_names:
        raise click.BadParameter("name at least one loss and one provider", param_hint="--losses / --providers")
    if device == "cuda" and not torch.cuda.is_available():
        raise NeedsGPU("no CUDA GPU is visible; `TRITON_INTERPRET=1 liger-gen bench-losses --device cpu "
                         "--hidden 64 --vocab 320 --batch 2 --seq 16 --iters 2` is a functional run on "
                         "the CPU (the kernels in Triton's interpreter; without TRITON_INTERPRET=1 the "
                         "CPU runs the plain-PyTorch path)")
    with bench_out(out_dir, "bench-losses") as folder, progress_bar("bench-losses", enabled=not as_json) as bar:
        try:
            result = run_losses(names, provider_names, hidden, vocab, batch, seq, iters, warmup, device,
                                folder / "bench_losses.json", progress=bar)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        except ResultsNotWritten as exc:  # measured and kept in a temporary file the message names
            raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {folder / 'bench_losses.json'}", err=True)
    if not as_json:
        click.echo(format_table(result))
    finish(as_json, "bench-losses", result, files_in(folder, "bench_losses.json"))


def _bench_plot(report, data: dict, path: Path) -> Path | None:
    """The PNG, or None with a one-line message when there is nothing to draw or no matplotlib to draw it."""
    import warnings

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            png = report.plot(data, path)
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as exc:
        click.echo(f"no PNG: {exc}", err=True)
        return None
    for w in caught:  # report.plot's own warnings (no matplotlib) as plain lines, not a Python warning's two
        click.echo(f"no PNG: {w.message}" if png is None else str(w.message), err=True)
    return png


if __name__ == "__main__":  # pragma: no cover
    main()
