"""``liger-gen verify``: which tuned tables this machine would use for a model's shapes, which not and why.

For every op, activation dtype, feature dims of the model and token count the tuner tunes at, it walks the same
sources as the runtime (``$LIGER_GEN_TUNED_DIR``, the user tables folder, the packaged tables) and reports the
table entry that would be used, or that the heuristic would run and why. A tables folder that cannot be looked
at (a name over the system's limit, a folder that may not be entered) is a notice, as the runtime reads no table
there (``tables.inspect_folder``). It checks the compiled kernel stores of the GPU beside the tables as the
runtime would (``compiled.store_folders`` and ``compiled.open_store``: real path, trust, the manifest's schema;
then every file's hash, Triton version, the GPU architecture where that GPU is visible) and says which ops'
kernels each holds. Every table file in those sources for the GPU is checked as the runtime checks it (format,
op, GPU, template hashes, Triton version under ``LIGER_GEN_STRICT_TABLES``), and the config of every entry the
model's shapes would use against the op's constraints: the visible GPU's limits when it is the named one,
otherwise the defaults, which is said. The exit status is 1 when a table file, an entry or a compiled kernel
store is unusable, or when a shape the model needs would run the heuristic (unless ``allow_heuristic``), so an
image build can fail early.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from liger_gen.codegen.spaces import DeviceLimits, dtype_name
from liger_gen.console import output_console
from liger_gen.runtime import tables
from liger_gen.runtime.compiled import real_root


@dataclass
class Finding:
    op: str
    dtype: str
    dims: dict[str, int]
    rows: int
    source: str  # "user" / "packaged" / "heuristic"
    detail: str


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    file_problems: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    compiled: list[str] = field(default_factory=list)  # one line per usable compiled kernel store
    usable_compiled: int = 0
    missing_compiled: list[str] = field(default_factory=list)  # ops a usable store holds no kernel of
    compiled_ops: dict[str, int] = field(default_factory=dict)  # op -> kernels of its templates in usable stores
    roots: list[tuple[str, str]] = field(default_factory=list)  # (source, folder) in lookup order
    no_tables: str | None = None  # set when no folder looked up holds a table for the GPU: what to say
    ops_source: str = ""  # where the checked ops came from (--ops, the config's family, the Llama-like default)

    def compiled_missing(self) -> str | None:
        """Why ``--require-compiled`` fails, or None."""
        if not self.usable_compiled:
            return "no compiled kernel store can be used here (none, or none for this Triton and GPU)"
        return None

    def exit_code(self, allow_heuristic: bool, require_compiled: bool = False) -> int:
        heuristic = any(f.source == "heuristic" for f in self.findings)
        return 1 if self.file_problems or (heuristic and not allow_heuristic) or (
            require_compiled and self.compiled_missing()) else 0


def _limits_for(gpu: str) -> tuple[DeviceLimits | None, str | None]:
    """The visible GPU's limits when it is ``gpu``; else None and what could not be checked."""
    from liger_gen.runtime.devices import current_gpu

    visible = current_gpu()
    if visible is not None and visible[0] == gpu:
        return DeviceLimits.from_device(), None
    where = "no GPU is visible" if visible is None else f"the visible GPU is {visible[1]!r}"
    return None, (f"{where}: configs were checked against the default device limits, not {gpu}'s own (shared "
                  f"memory, registers); run verify on a machine with that GPU for that check")


def check(gpu: str, model, rows: list[int], dtypes: list[torch.dtype], ops: list[str] | None = None) -> Report:
    """The findings for ``model``'s shapes on ``gpu`` for ``ops`` (None: every op); see the module docstring."""
    from liger_gen.ops import all_specs

    report = Report()
    limits, unchecked = _limits_for(gpu)
    if unchecked:
        report.unchecked.append(unchecked)
    specs = {spec.name: spec for spec in all_specs()}
    unreadable = set()  # folders the runtime cannot look at: it reads no tables there (a notice, as there)
    env = os.environ.get(tables.ENV_TUNED_DIR)
    if env:
        st, why = tables.inspect_folder(Path(env))
        if st is None:
            if why:
                unreadable.add(Path(env))
            report.notices.append(f"${tables.ENV_TUNED_DIR}={env} {why or 'does not exist'}: the runtime finds no "
                                  f"tables there")
    user = tables.user_tables_root()
    if not env or Path(env) != user:
        status, why = tables.user_root_status(user)  # the runtime's rule (``table_roots``)
        if status == "not private":
            report.file_problems.append(f"the user tables folder {user} is not used: {why}")
        elif status == "unreadable":
            report.notices.append(f"the user tables folder {user} {why}: the runtime reads no tables there")
    roots, seen_roots = [], set()
    for source, root in tables.table_roots():  # the same folder twice (a symlink) is read once
        resolved = real_root(root)  # a link loop is checked as it is, never a traceback
        if resolved not in seen_roots:
            seen_roots.add(resolved)
            roots.append((source, root))
    report.roots = [(source, str(root)) for source, root in roots]
    readable = [(source, root) for source, root in roots if Path(root) not in unreadable]
    loaded: dict[tuple[str, str], dict | None] = {}
    same_remark: dict[tuple[str, str], list[str]] = {}
    for source, root in readable:  # every table file of this GPU, whether or not the model needs its op
        folder = Path(root) / gpu
        try:
            paths = tables.table_files(folder)
        except OSError as exc:
            report.file_problems.append(f"cannot list {folder}: {type(exc).__name__}: {exc}")
            continue
        for path in paths:
            spec = specs.get(path.stem)
            if spec is None:
                report.notices.append(f"{path}: not an op of this installation (ignored by the runtime)")
                continue
            table, problem, notice = tables.check_table_file(path, spec.space, gpu)
            loaded[(str(root), spec.name)] = table
            if problem:
                report.file_problems.append(problem)
            if notice:  # one line per folder and remark (most often: every file of another Triton)
                same_remark.setdefault((str(folder), notice), []).append(spec.name)
    for (folder, notice), names in same_remark.items():
        report.notices.append(f"{folder}: {len(names)} table(s) ({', '.join(names)}): {notice}; used (set "
                              f"{tables.STRICT_TABLES_ENV}=1 to refuse them)")
    if not loaded and not report.file_problems:
        report.no_tables = tables.no_tables_message(gpu, specs, roots)
    from liger_gen.codegen.spaces import template_names

    check_compiled(report, gpu, readable, {name: template_names(spec.space) for name, spec in specs.items()
                                           if ops is None or name in ops})
    for name, spec in specs.items():
        if ops is not None and name not in ops:
            continue
        try:
            shapes = spec.problem.shapes(model)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            report.notices.append(f"{name}: no shape for this model ({type(exc).__name__}: {exc})")
            continue
        for dims, dtype in ((d, t) for d in shapes for t in dtypes):
            try:
                space = spec.space(dims, dtype, limits)
            except ValueError as exc:  # dims this op's kernels do not take: the runtime would refuse the call
                report.file_problems.append(f"{name}: the model's dims are outside what the op supports ({exc})")
                continue
            for r in spec.tuning_rows(model, rows):
                report.findings.append(_find(report, spec, space, dtype, r, roots, loaded))
    return report


#: The ops ``apply_to`` runs on a Llama-like model: what verify checks when the model's family is not known.
LLAMA_OPS = ("rms_norm", "fused_add_rms_norm", "rope", "swiglu", "fused_linear_cross_entropy")
#: The ops ``apply_to(model, fp8=True)`` adds on a Llama-like bf16 model.
FP8_OPS = ("rms_norm_fp8", "glu_fp8", "fp8_quantize", "fp8_cast_transpose")


def ops_apply_to_runs(cfg: dict, *, quiet: bool = False, fp8: bool = False) -> tuple[list[str] | None, str]:
    """(the ops ``apply_to`` runs for the model a Hugging Face config's fields describe, why) — or (None, why
    not). The model is built with transformers on the meta device (``from_config`` of ``AutoModelForCausalLM``,
    or of ``AutoModelForImageTextToText`` for a vision-language config; no weights allocated, no remote code),
    patched by ``apply_to`` and asked (``patched_ops``), so the answer is ``apply_to``'s own: the family's norm,
    RoPE where the family's rotation is routed, the gated MLPs' and experts' GLU, ``moe_permute`` for fused
    experts, ``fused_linear_cross_entropy`` where the LM-head loss is fused (in a ``*ForConditionalGeneration`` of
    a vision-language family too). Attention is built as "eager" whatever the config names (the ops do not
    depend on it, and flash-attention need not be installed where verify runs); a config of more than MAX_LAYERS
    layers is not built. ``quiet``: raise the ``liger_gen`` and ``transformers`` loggers to ERROR while building
    (process-wide: for the single-threaded command line). ``fp8``: as ``apply_to(model, fp8=True)`` on a bf16
    model (the FP8 quantize ops, and ``rms_norm_fp8`` and ``glu_fp8`` where norms and MLPs write the operands)."""
    import warnings

    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed (pip install 'liger-gen[transformers]')"
    from liger_gen.integrations import transformers as integration
    from liger_gen.integrations.transformers.families import ALIASES
    from liger_gen.integrations.transformers.rope import rope_functions
    from liger_gen.training import lm_class

    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        return None, f"model_type {model_type!r} is not one this transformers release ({transformers.__version__}) knows"
    if ALIASES.get(model_type, model_type) not in integration.MODEL_FAMILIES:  # before any building
        return None, (f"model_type {model_type!r} is not a family apply_to supports (supported: "
                      f"{', '.join(sorted(integration.MODEL_FAMILIES))})")
    layers = [c.get("num_hidden_layers") for c in (cfg, cfg.get("text_config")) if isinstance(c, dict)]
    if any(isinstance(n, int) and n > MAX_LAYERS for n in layers):
        return None, f"num_hidden_layers {max(n for n in layers if isinstance(n, int))} is more than {MAX_LAYERS}"
    fields = {k: v for k, v in cfg.items()
              if k not in ("model_type", "_attn_implementation", "attn_implementation")}
    loggers = (logging.getLogger("liger_gen"), logging.getLogger("transformers")) if quiet else ()
    levels = [log.level for log in loggers]
    try:
        for log in loggers:
            log.setLevel(logging.ERROR)
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            config_class = transformers.CONFIG_MAPPING[model_type]
            # as from_pretrained reads a file: releases that write inf/NaN as {"__float__": ...} decode them
            decode = getattr(config_class, "_decode_special_floats", None)
            config = config_class.from_dict(decode(fields) if callable(decode) else fields)
            dtype = {"dtype": torch.bfloat16} if fp8 else {}
            model = lm_class(config).from_config(config, attn_implementation="eager", **dtype)
            family = integration.family_of(model)  # ValueError: not a family apply_to supports
            integration.apply_to(model, rope=False, fp8=fp8)  # RoPE routing is process-wide: predicted, not done
    except Exception as exc:  # noqa: BLE001 - any failure to build the model means: no prediction
        return None, f"{model_type}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
    modeling = importlib.import_module(family.modeling_module)
    functions = rope_functions(family)  # what apply_to(rope=True) would route
    ops = integration.patched_ops(model, rope=bool(functions) and all(callable(getattr(modeling, f, None))
                                                                      for f, _ in functions))
    return ops, f"those apply_to runs on {type(model).__name__} built from the config"


MAX_LAYERS = 1024  # far above any released model; building is per layer, and the count never changes the ops


def ops_for_config(path: str | Path) -> list[str] | None:
    """The ops ``apply_to`` runs for the model a Hugging Face ``config.json`` describes (``ops_apply_to_runs``);
    None when the file is not a readable config or its model cannot be built and patched."""
    from liger_gen.models import read_hf_config

    try:
        cfg = read_hf_config(path)
    except ValueError:
        return None
    return ops_apply_to_runs(cfg)[0]


def default_ops(model_name: str, from_file: bool, fp8: bool = False) -> tuple[list[str], str]:
    """The ops ``liger-gen verify`` checks without ``--ops``, and where they come from: those ``apply_to`` runs for
    the preset or config file (``from_file``; a vision tower's preset, ``VISION_OPS``), else the Llama-like
    ``LLAMA_OPS`` with the reason (a model without
    a family, a family apply_to does not support). Without transformers the ops cannot be predicted, and they are
    not guessed: ``MissingExtraError`` names the pip command (the command line exits with it) and ``--ops``."""
    from liger_gen.models import VISION_OPS, VISION_PRESETS, preset_hf_config, read_hf_config
    from liger_gen.optional import MissingExtraError, require

    if not from_file and model_name in VISION_PRESETS:
        return list(VISION_OPS), "a vision tower's: its RMSNorms, 2-D RoPE and gated MLPs"
    try:
        cfg = read_hf_config(model_name) if from_file else preset_hf_config(model_name)
    except ValueError as exc:
        cfg, why = None, str(exc)
    else:
        why = "" if cfg is not None else f"{model_name!r} has no family"
    if cfg is not None:
        try:
            require("transformers", f"predicting the ops apply_to runs for {model_name}")
        except MissingExtraError as exc:
            raise MissingExtraError(f"liger-gen verify does not guess the ops a model runs: {exc}; or name the "
                                    f"ops to check with --ops") from exc
        ops, why = ops_apply_to_runs(cfg, quiet=True, fp8=fp8)
        if ops:
            return ops, why
    return list(LLAMA_OPS + (FP8_OPS if fp8 else ())), f"a Llama-like model's: no prediction for this one, {why}"


def check_compiled(report: Report, gpu: str, roots, op_templates: dict[str, tuple[str, ...]]) -> None:
    """Check every compiled kernel store of ``gpu`` as the runtime would (manifest, trust, every file's SHA-256,
    Triton version, GPU architecture where the GPU is visible, the Python its host modules are for) and say how
    many kernels it holds of the templates each op launches (``op_templates``) and what it was built for."""
    import triton

    from liger_gen.runtime import compiled
    from liger_gen.runtime.devices import current_gpu

    visible = current_gpu()
    target = compiled.device_target(torch.cuda.current_device()) if visible and visible[0] == gpu else None
    if target is None:
        report.unchecked.append(f"compiled kernels: the GPU architecture they were built for (no {gpu} is "
                                f"visible; their files, hashes and Triton version were checked)")
    found = 0
    for source, root in roots:
        for store_dir in compiled.store_folders(root, gpu):  # on their real path, as the runtime reads them
            found += 1
            try:
                manifest = compiled.open_store(store_dir, source)  # trust (a user store) and the manifest's schema
            except ValueError as exc:
                report.file_problems.append(f"compiled kernels {store_dir}: {exc}")
                continue
            if manifest.get("triton") != triton.__version__:  # the runtime never reads it: nothing to check
                report.notices.append(f"compiled kernels {store_dir}: built by Triton {manifest.get('triton')}, "
                                      f"this is Triton {triton.__version__}: not used here (kernels compile at "
                                      f"first use)")
                continue
            store = compiled.Store(store_dir, source, manifest)
            bad = [rel for rel in store.files if not store._hash_matches(rel)]
            if bad:
                report.file_problems.append(f"compiled kernels {store_dir}: {len(bad)} file(s) missing or not "
                                            f"matching {compiled.MANIFEST} (e.g. {bad[0]}); none of them would "
                                            f"be loaded")
            if target is not None:
                why = compiled.mismatch(manifest, triton.__version__, target, compiled.cache_env())
                if why:
                    report.file_problems.append(f"compiled kernels {store_dir}: {why}")
                    continue
            host = manifest.get("host", {}).get("ext_suffix")
            if host and host != compiled.host_identity()["ext_suffix"]:
                report.notices.append(f"compiled kernels {store_dir}: its host modules are for Python "
                                      f"extensions '{host}', not this Python's: its kernels load, and Triton "
                                      f"builds their launchers with the C compiler at first use")
            stems = [key.split(":", 1)[0].rsplit("_", 1)[0] for key in manifest["kernels"]]
            held = {op: sum(stem in templates for stem in stems) for op, templates in op_templates.items()}
            missing = [op for op, n in held.items() if n == 0]
            if missing:
                report.missing_compiled.extend(missing)
            built = "; ".join(f"{b.get('model')} (" + ", ".join(f"{k}={v}" for k, v in sorted(b.items())
                                                             if v is not None and k != "model") + ")"
                              for b in manifest.get("built_for", []) if isinstance(b, dict))
            report.compiled.append(f"{store_dir} ({source}): {len(stems)} kernels, "
                                   f"{sum(f['size'] for f in store.files.values()) / 2**20:.1f} MiB"
                                   + (f", built for {built}" if built else "") + "; kernels per op: "
                                   + ", ".join(f"{op} {n}" for op, n in held.items() if n)
                                   + (f"; none for {', '.join(missing)} (compiled at first use)" if missing else ""))
            report.usable_compiled += 1
            for op, n in held.items():
                report.compiled_ops[op] = report.compiled_ops.get(op, 0) + n
    if not found and report.no_tables is None:  # without tables, building kernels is not the next step
        report.notices.append(f"no compiled kernels for {gpu}: every kernel is compiled at its first use in a "
                              f"process (`liger-gen build --gpu {gpu} --model ...` makes them)")


def _find(report: Report, spec, space, dtype: torch.dtype, rows: int, roots, loaded) -> Finding:
    why, without = [], []  # without: (source, root, table) of the tables with no entry at these dims
    for source, root in roots:
        table = loaded.get((str(root), spec.name))
        if table is None:
            continue
        entry = tables.nearest_entry(table, dtype, space.dims, rows)
        if entry is None:
            why.append(f"{source} table has no {dtype_name(dtype)} entry for {space.dims}")
            without.append((source, root, table))
            continue
        config, problems = tables.entry_config(space, entry)
        if problems:
            message = f"{tables.table_path(root, table['gpu'], spec.name)}: entry rows={entry['rows']} for " \
                      f"{space.dims} is invalid here: {'; '.join(problems)}"
            report.file_problems.append(message)
            why.append(message)
            continue
        return Finding(spec.name, dtype_name(dtype), space.dims, rows, source,
                       f"{tables.table_path(root, table['gpu'], spec.name)} (tuned at {entry['rows']} rows)")
    for source, root, table in without:  # the runtime's nearest-dims rule (``tables.lookup``)
        if not tables.nearest_allowed(table, spec.space, space.limits):
            continue
        for entry in tables.neighbour_entries(table["entries"], dtype, space.dims, rows):
            if not tables.entry_config(space, entry)[1]:
                count, ratio = tables.nearest_evidence(table, spec.space, space.limits)
                return Finding(spec.name, dtype_name(dtype), space.dims, rows, source,
                               f"{tables.table_path(root, table['gpu'], spec.name)}: the entry tuned at "
                               f"{entry['dims']} ({entry['rows']} rows) stands in (nearest dims; "
                               f"{ratio:.2f}x the heuristic's time over {count} tuned shapes)")
    return Finding(spec.name, dtype_name(dtype), space.dims, rows, "heuristic",
                   "; ".join(why) or "no table for this op")


def print_report(report: Report, gpu: str, model_name: str, console: Console | None = None) -> None:
    console = console or output_console()
    if report.ops_source:
        console.print(Text(f"ops checked: {report.ops_source}"), soft_wrap=True)
    if report.no_tables is None:
        table = Table(title=f"liger-gen verify: {model_name} on {gpu}")
        for column in ("op", "dtype", "dims", "rows", "source", "detail"):
            table.add_column(column, overflow="fold")
        for f in report.findings:
            style = "green" if f.source != "heuristic" else "yellow"
            table.add_row(f.op, f.dtype, " ".join(f"{k}={v}" for k, v in f.dims.items()), str(f.rows),
                          Text(f.source, style=style), f.detail)
        console.print(table)
    else:  # one line instead of a table whose every row says the same
        console.print(Text(f"all {len(report.findings)} shapes of {model_name} would run the heuristic: "
                           f"{report.no_tables}", style="yellow"), soft_wrap=True)
    for problem in report.file_problems:
        console.print(Text(f"unusable: {problem}", style="red"))
    for notice in report.notices:
        console.print(Text(f"notice: {notice}", style="yellow"))
    for line in report.compiled:
        console.print(Text(f"compiled kernels: {line}", style="green"), soft_wrap=True)
    for line in report.unchecked:
        console.print(Text(f"not checked: {line}"))
    for source, root in report.roots:
        console.print(Text(f"tables looked up in ({source}): {root}"), soft_wrap=True)
    used = sum(f.source != "heuristic" for f in report.findings)
    console.print(f"{used} of {len(report.findings)} shapes use a tuned table; "
                  f"{len(report.file_problems)} unusable table file(s), entries or compiled kernel stores")


def report_dict(report: Report, gpu: str, model_name: str, allow_heuristic: bool,
                require_compiled: bool = False) -> dict:
    """The report as ``liger-gen verify --json`` prints it: what ``print_report`` and ``print_verdict`` say, with
    stable keys (``findings``: one per op, dtype and rows, ``source`` user / packaged / heuristic)."""
    from dataclasses import asdict

    return {"gpu": gpu, "model": model_name, "ops_checked": report.ops_source,
            "exit_code": report.exit_code(allow_heuristic, require_compiled),
            "findings": [asdict(f) for f in report.findings],
            "tuned_shapes": sum(f.source != "heuristic" for f in report.findings),
            "heuristic_shapes": sum(f.source == "heuristic" for f in report.findings),
            "unusable": list(report.file_problems), "notices": list(report.notices),
            "not_checked": list(report.unchecked), "compiled": list(report.compiled),
            "usable_compiled_stores": report.usable_compiled, "compiled_kernels_per_op": dict(report.compiled_ops),
            "no_tables": report.no_tables, "compiled_missing": report.compiled_missing() if require_compiled else None,
            "looked_up": [{"source": source, "folder": str(root)} for source, root in report.roots]}


def print_verdict(report: Report, allow_heuristic: bool, console: Console | None = None,
                  require_compiled: bool = False) -> None:
    """One line saying why the exit status is what it is."""
    console = console or output_console()
    heuristic = sum(f.source == "heuristic" for f in report.findings)
    if report.file_problems:
        console.print(Text(f"exit 1: {len(report.file_problems)} unusable table file(s), entries or compiled "
                           f"kernel stores (above)", style="red"))
    elif require_compiled and report.compiled_missing():
        console.print(Text(f"exit 1: {report.compiled_missing()}; build them with the Triton you train with "
                           f"(`liger-gen build`), or drop --require-compiled", style="red"))
    elif heuristic and not allow_heuristic and report.no_tables:
        console.print(Text(f"exit 1: {report.no_tables}", style="red"), soft_wrap=True)
    elif heuristic and not allow_heuristic:
        console.print(Text(f"exit 1: {heuristic} shape(s) would run the heuristic (no tuned entry); tune them, or "
                           f"pass --allow-heuristic to accept that", style="red"))
    else:
        console.print("exit 0: every table found is usable" + (
            f"; {heuristic} shape(s) run the heuristic (--allow-heuristic)" if heuristic else ""))


def compiled_kernels_per_op(gpu: str, specs) -> dict[str, int]:
    """Kernels of each op's templates in the compiled kernel stores of ``gpu`` that this Triton can use (checked
    as ``liger-gen verify`` checks them: ``check_compiled``); an op without any is missing."""
    from liger_gen.codegen.spaces import template_names

    roots, seen = [], set()
    for source, root in tables.table_roots():  # the same folder twice (a symlink) is counted once
        if real_root(root) not in seen:
            seen.add(real_root(root))
            roots.append((source, root))
    report = Report()
    check_compiled(report, gpu, roots, {spec.name: template_names(spec.space) for spec in specs})
    return {op: n for op, n in report.compiled_ops.items() if n}
