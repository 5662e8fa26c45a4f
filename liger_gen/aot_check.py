"""Compile every kernel of every registered op for a GPU target ahead of time, without a GPU.

CI runs the kernels only in Triton's interpreter (``TRITON_INTERPRET=1``), which never compiles them: two kinds
of bug then reach the GPU machine unseen — front-end errors the interpreter accepts (a module-level
``FOO: tl.constexpr = 8`` global, which compiled Triton refuses) and errors in branches only the GPU takes
(kernels get constexpr flags from ``interpreter_enabled()``, such as the FP8 quantize kernels' ``EXACT``; with
the flag False their GPU path is never even compiled in CI). Triton compiles for a target without a GPU
(``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``; ptxas ships inside the Triton wheel), so
this check does, in three processes:

1. **capture** (a child with ``TRITON_INTERPRET=1``): every registered op runs on tiny CPU inputs (the ``tiny``
   model's widths, ``CAPTURE_ROWS`` tokens) — each of its tuning problems with the space's heuristic config,
   every phase (forward and backward kernels), every render-time variant (casting modes, FP8 formats,
   activations), in float32, bfloat16 and float16 — and then the op's public path (forward and backward, as the
   bench calls it). ``--tables h200`` adds every entry of a GPU's packaged tables, tuned and heuristic config, at
   the entry's widths (what that GPU launches; LM-head entries at a smaller head, ``SMALL_HEAD``). Each kernel
   launch is recorded — the rendered module (file and text), the kernel's name, each argument (a tensor by its
   dtype and 16-byte alignment, a scalar by value) and the launch options (``num_warps``, ...) — and, unless
   ``--execute``, not run: the host code never reads what a kernel wrote (the ops make no data-dependent host
   decisions), and skipping the interpreter makes the capture about three times faster. Kernels only CUDA
   tensors reach (the device-side target check) are launched explicitly. ``interpreter_enabled`` is replaced,
   wherever liger_gen imported it, by one returning a marked true value (``InterpreterFlag``), so every constexpr
   it sets is recognised as interpreter-only whatever its name.
2. **compile** (a child without ``TRITON_INTERPRET``): each rendered module is written to a private folder and
   imported fresh (``@triton.jit`` then gives real ``JITFunction``s); interpreter-only constexprs take their GPU
   value (marked ones False, and every param named in ``INTERPRETER_FLAGS``); the arguments are specialised as
   a launch would (Triton's ``native_specialize_impl``: pointer dtypes, ``i32``/``i64``, an int equal to 1 as a
   constexpr, 16-divisibility) and each distinct launch is compiled with ``triton.compile`` for
   ``GPUTarget("cuda", arch, 32)``. ``--full`` picks the depth: by default the first launch of each constexpr
   set (a bfloat16 one where there is one) goes through every stage to ptxas, and the other launches of the set
   (other dtypes, other int specialisations) through Triton's front end and the TTIR passes only, where the
   errors above are raised (a quarter of a full compile's time); ``all`` takes every launch to ptxas.
3. **report** (the parent): one line per kernel — op, kernel, ok or FAILED, distinct launches compiled through
   ptxas and to TTIR — then each failure with the compiler's source excerpt and root cause; exit status 1 if
   any kernel failed or a captured path could not run.

    python -m liger_gen.aot_check [--ops rms_norm,fp8_quantize] [--arch 90] [--tables h200] [--full all]

Run it with the Triton the GPU machine has to learn what will compile there. The rendered modules go to a
temporary kernel cache unless ``LIGER_GEN_CACHE_DIR`` is set. What it cannot see: kernels no captured path
launches (reported as not launched), table entries too large to build on the CPU (listed), and errors that
only the driver raises when loading a kernel (resources past the device's limits at launch).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from liger_gen.aot_capture import DTYPE_NAMES, capture

#: constexpr params set from ``interpreter_enabled()`` in the launch code, by name: on the GPU they are False.
#: The capture also marks such values wherever they come from (``InterpreterFlag``); this list covers a launcher
#: that derives a flag from ``interpreter_enabled()`` (``not ...``, ``int(...)``), which loses the mark.
INTERPRETER_FLAGS: dict[str, Any] = {"EXACT": False}

# ------------------------------------------------------------------------------------------------ compile


def _import_fresh(path: str, source: str, folder: Path):
    """Import the rendered module text as a file in ``folder`` (Triton reads kernel source from it)."""
    file = folder / Path(path).name
    if not file.exists():
        file.write_text(source, encoding="utf-8")
    name = f"liger_gen_aot.{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _decode(value: Any) -> Any:
    """A captured argument back as Triton takes it: tensors as ``MockTensor``s (of the captured alignment),
    interpreter flags as their GPU value (False), Triton dtypes as ``tl`` dtypes."""
    import torch
    import triton.language as tl
    from triton.runtime.jit import MockTensor

    if isinstance(value, dict):
        if value.get("interpreter_flag"):
            return False
        if "tl_dtype" in value:
            return getattr(tl, value["tl_dtype"]) if hasattr(tl, value["tl_dtype"]) else tl.str_to_ty(value["tl_dtype"])
        if "tensor" in value:
            mock = MockTensor(getattr(torch, value["tensor"]))
            if value["offset"]:
                offset = value["offset"]
                mock.data_ptr = lambda: offset  # Triton specialises pointers on 16-byte alignment
            return mock
    return value


def _specialize(fn, backend, name: str, value: Any) -> tuple[str, Any]:
    """(signature type, attribute descriptor) of one runtime argument as Triton's launch would specialise it."""
    params = {p.name: p for p in fn.params}
    p = params[name]
    try:
        from triton._C.libtriton import native_specialize_impl
    except ImportError:  # pragma: no cover - an older Triton: plain types, no attributes
        native_specialize_impl = None
    if native_specialize_impl is not None:
        specialize = not getattr(p, "do_not_specialize", False)
        align = not getattr(p, "do_not_specialize_on_alignment", False)
        kind, attr = native_specialize_impl(type(backend), value, bool(getattr(p, "is_const", False)), specialize,
                                            align)[:2]
        return kind, attr
    if hasattr(value, "dtype"):
        from triton.runtime.jit import mangle_type

        return mangle_type(value), None
    if isinstance(value, bool):
        return "u1", None
    if isinstance(value, int):
        return ("i32" if -2**31 <= value < 2**31 else "i64"), None
    return "fp32", None


#: the last stage of a front-end compile: Triton's code generator (the Python AST to TTIR, where an annotated
#: global or a type error in any branch is refused) and the TTIR passes; about a quarter of a full compile's time
FRONT_END_STAGE = "ttir"


class _StageReached(Exception):
    """Raised after ``FRONT_END_STAGE`` to end a front-end compile (nothing is written to Triton's cache)."""


@contextlib.contextmanager
def _stop_after(stage: str):
    """Make ``triton.compile`` raise ``_StageReached`` once ``stage`` has run, through Triton's
    ``add_stages_inspection_hook`` (Triton 3.6 calls it with the stages to edit; 3.9 also calls it without
    arguments for a cache-key suffix)."""
    from triton import knobs

    def hook(*args):
        if not args:
            return f"liger-gen-aot-stop-after-{stage}", stage
        stages = args[1]
        names = list(stages)
        for name in names[names.index(stage) + 1:]:
            del stages[name]
        run = stages[stage]

        def last(src, metadata):
            run(src, metadata)
            raise _StageReached(stage)

        stages[stage] = last
        return None

    previous = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = hook
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = previous


def compile_launch(fn, launch: dict, target, backend, full: bool = True) -> dict:
    """Compile one captured launch of the JITFunction ``fn`` for ``target``: through ptxas when ``full``, else
    the front end only (``FRONT_END_STAGE``). Returns its signature, constexprs and options as compiled (Triton
    raises on a compile error)."""
    import triton
    from triton.compiler import ASTSource

    captured = launch["args"]
    signature: dict[str, str] = {}
    constexprs: dict[tuple, Any] = {}
    attrs: dict[tuple, Any] = {}
    shown: dict[str, Any] = {}
    defaults = {n: p.default for n, p in fn.signature.parameters.items() if p.default is not p.empty}
    for i, p in enumerate(fn.params):
        name = p.name
        if name in captured:
            raw = captured[name]
        elif name in defaults:
            raw = defaults[name]
        else:
            raise TypeError(f"{fn.__name__}: the captured launch has no value for {name}")
        flagged = isinstance(raw, dict) and raw.get("interpreter_flag")
        value = _decode(raw)
        if p.is_constexpr:
            if name in INTERPRETER_FLAGS:
                value, flagged = INTERPRETER_FLAGS[name], True
            signature[name] = "constexpr"
            constexprs[(i,)] = value  # Triton 3.6 and 3.9 key constexprs by (arg index,); both also take names
            shown[name] = f"{value!r} (GPU value)" if flagged else value
            continue
        kind, attr = _specialize(fn, backend, name, value)
        signature[name] = kind
        if kind == "constexpr":  # an int equal to 1 (or None): Triton folds it in, as a launch would
            constexprs[(i,)] = value.value if hasattr(value, "value") else value
        elif isinstance(attr, str) and attr:
            attrs[(i,)] = backend.parse_attr(attr)
    options = {k: _decode(v) for k, v in launch["options"].items()}
    options.setdefault("debug", bool(getattr(fn, "debug", False)))
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    if full:
        triton.compile(src, target=target, options=options)
    else:
        with _stop_after(FRONT_END_STAGE):
            try:
                triton.compile(src, target=target, options=options)
            except _StageReached:
                pass
    return {"signature": signature, "constexprs": shown, "options": dict(options)}


def _constexpr_set(launch: dict) -> str:
    """What makes two launches of a kernel the same code but for argument types: module, kernel, the values of
    every non-tensor argument that is not a plain int or float (constexprs, flags), and the launch options."""
    fixed = {k: v for k, v in launch["args"].items()
             if not (isinstance(v, dict) and "tensor" in v) and (type(v) not in (int, float))}
    return json.dumps([launch["module"], launch["kernel"], fixed, launch["options"]], sort_keys=True)


def compile_all(data: dict, arch: int, folder: Path, full: str = "first") -> list[dict]:
    """Compile every distinct captured launch for ``GPUTarget("cuda", arch, 32)``; one result per distinct
    launch: {op, kernel, module, ok, error, stage, seconds, launches (how many captured launches it stands for),
    ...}. ``full``: "all" compiles every distinct launch through ptxas; "first" (the default) one launch per
    constexpr set (``_constexpr_set``; a bfloat16 one where there is one) and the others' front end only, which
    costs about a quarter; "none" the front end of every launch. Must run without ``TRITON_INTERPRET``."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("aot_check compile: TRITON_INTERPRET must be unset (the interpreter compiles nothing)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    modules: dict[str, Any] = {}
    import_errors: dict[str, str] = {}
    distinct: dict[str, dict] = {}
    for launch in data["launches"]:
        key = json.dumps([launch["module"], launch["kernel"], launch["args"], launch["options"]], sort_keys=True)
        entry = distinct.setdefault(key, {"launch": launch, "count": 0, "ops": set()})
        entry["count"] += 1
        entry["ops"].add(launch["op"])
    results = []
    full_sets: set[str] = set()
    order = sorted(distinct.values(), key=lambda e: e["launch"].get("dtype") != "bfloat16")  # stable: bf16 first
    for entry in order:
        launch = entry["launch"]
        group = _constexpr_set(launch)
        through_ptxas = full == "all" or (full == "first" and group not in full_sets)
        full_sets.add(group)
        path = launch["module"]
        result = {"op": ",".join(sorted(entry["ops"])), "kernel": launch["kernel"], "module": Path(path).name,
                  "launches": entry["count"], "dtype": launch.get("dtype", ""), "phase": launch.get("phase", ""),
                  "variant": launch.get("variant", ""), "source": launch.get("source", ""),
                  "stage": "cubin" if through_ptxas else FRONT_END_STAGE}
        start = time.monotonic()
        try:
            if path not in modules and path not in import_errors:
                try:
                    modules[path] = _import_fresh(path, data["modules"][path], folder)
                except Exception as exc:  # noqa: BLE001 - compiled Triton refuses the module itself
                    import_errors[path] = f"import: {type(exc).__name__}: {exc}"
            if path in import_errors:
                raise RuntimeError(import_errors[path])
            fn = getattr(modules[path], launch["kernel"])
            fn = getattr(fn, "fn", fn) if not hasattr(fn, "params") else fn
            result.update(compile_launch(fn, launch, target, backend, through_ptxas), ok=True, error="")
        except Exception as exc:  # noqa: BLE001 - a compile error is the result
            result.update(ok=False, error=_error_text(exc), cause=_root_cause(exc))
        result["seconds"] = round(time.monotonic() - start, 3)
        results.append(result)
    results.extend(_not_launched(data, modules))
    return results


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from, outermost first (Triton wraps a helper's error in the
    caller's ``CompilationError``, and the first cause in a ``NameError`` or ``TypeError``)."""
    chain = [exc]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and nxt not in chain:
        chain.append(nxt)
    return chain


def _root_cause(exc: BaseException) -> str:
    """The innermost exception of the chain, as one line (what went wrong, without the source excerpts)."""
    inner = _chain(exc)[-1]
    text = " ".join(str(inner).split())
    return f"{type(inner).__name__}: {text}"


def _error_text(exc: BaseException, lines: int = 14) -> str:
    """Every exception of the chain, outermost first, each cut to its last ``lines`` lines: the compiler's
    source excerpts point at the kernel line, then at the helper line, then say what was refused."""
    parts = []
    for e in _chain(exc):
        text = str(e).strip().splitlines()
        parts.append(f"{type(e).__name__}: " + "\n".join(text[-lines:]))
    return "\n--- raised from ---\n".join(parts)


def _not_launched(data: dict, modules: dict) -> list[dict]:
    """Kernels (``<name>_kernel`` JIT functions) of the captured modules that no captured path launched."""
    from triton.runtime.jit import JITFunction

    launched = {(l["module"], l["kernel"]) for l in data["launches"]}
    out = []
    for path, module in modules.items():
        ops = ",".join(sorted({l["op"] for l in data["launches"] if l["module"] == path}))
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and name.endswith("_kernel") and (path, name) not in launched:
                out.append({"op": ops, "kernel": name, "module": Path(path).name, "launches": 0, "ok": None,
                            "error": "not launched by any captured path (not compiled)", "seconds": 0.0})
    return out


# ------------------------------------------------------------------------------------------------ report


def summarize(results: list[dict]) -> list[dict]:
    """One row per (op, kernel): distinct launches compiled (``full``: of them through ptxas), failed, and the
    first failure's message."""
    rows: dict[tuple, dict] = {}
    for r in results:
        row = rows.setdefault((r["op"], r["kernel"]), {"op": r["op"], "kernel": r["kernel"], "compiled": 0,
                                                        "full": 0, "failed": 0, "not_launched": 0, "error": "",
                                                        "cause": "", "seconds": 0.0, "failed_in": ""})
        row["seconds"] += r.get("seconds", 0.0)
        if r["ok"] is None:
            row["not_launched"] += 1
        elif r["ok"]:
            row["compiled"] += 1
            row["full"] += r.get("stage") == "cubin"
        else:
            row["failed"] += 1
            if not row["error"]:
                row["error"], row["cause"] = r["error"], r.get("cause", "")
                row["failed_in"] = f"{r['module']} {r.get('dtype', '')} {r.get('phase', '')} {r.get('variant', '')}"
    return sorted(rows.values(), key=lambda r: (r["op"], r["kernel"]))


def format_table(rows: list[dict], arch: int, triton_version: str, seconds: float) -> str:
    """The short table printed at the end: one line per kernel, then the totals."""
    lines = [f"AOT compile for sm_{arch} with Triton {triton_version}:",
             f"{'op':<28} {'kernel':<32} {'status':<7} distinct launches compiled (through ptxas + front end)"]
    for r in rows:
        status = "FAILED" if r["failed"] else ("ok" if r["compiled"] else "skipped")
        notes = ([f"{r['failed']} failed"] if r["failed"] else []) + (
            [f"not launched from {r['not_launched']} module(s) that define it"] if r["not_launched"] else [])
        lines.append(f"{r['op'] or '-':<28} {r['kernel']:<32} {status:<7} {r['full']} + {r['compiled'] - r['full']}"
                     + (f" ({'; '.join(notes)})" if notes else ""))
    failed = [r for r in rows if r["failed"]]
    for r in failed:
        excerpt = r["error"].split("\n--- raised from ---\n")[0].splitlines()
        lines.append(f"\n{r['op']} {r['kernel']} failed ({' '.join(r['failed_in'].split())}):\n  "
                     + "\n  ".join(excerpt[-8:]) + f"\n  cause: {r['cause']}")
    lines.append(f"\n{len(rows)} kernels: {len(rows) - len(failed)} ok, {len(failed)} failed "
                 f"({sum(r['compiled'] + r['failed'] for r in rows)} distinct launches, {seconds:.1f} s)")
    return "\n".join(lines)


class StageFailed(RuntimeError):
    """A child process (capture or compile) ended with an error of its own (its traceback is on stderr)."""


def _child(stage: str, args: list[str], env: dict[str, str]) -> None:
    """Run ``stage`` of this module in a child process with ``env``; StageFailed if it fails."""
    done = subprocess.run([sys.executable, "-m", "liger_gen.aot_check", "--stage", stage, *args], env=env)
    if done.returncode:
        raise StageFailed(f"aot_check: the {stage} process failed (exit status {done.returncode}; its traceback "
                          f"is above)")


def run(ops: list[str], arch: int = 90, dtypes: list[str] | None = None, cases: bool = True,
        full: str = "first", execute: bool = False, tables: str | None = None) -> tuple[list[dict], dict]:
    """Capture (interpreter child), then compile (compiled-Triton child; ``full`` as ``compile_all`` takes it);
    returns (summary rows, details) where details holds the capture's errors, every distinct launch's result,
    the Triton version and the seconds (in all, and of the capture)."""
    dtypes = dtypes or list(DTYPE_NAMES)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="liger_gen_aot_") as tmp:
        tmp = Path(tmp)
        base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        base.setdefault("LIGER_GEN_CACHE_DIR", str(tmp / "kernels"))
        captured, compiled = tmp / "launches.json", tmp / "results.json"
        _child("capture", ["--ops", ",".join(ops), "--dtypes", ",".join(dtypes), "--out", str(captured)]
               + ([] if cases else ["--no-cases"]) + (["--execute"] if execute else [])
               + (["--tables", tables] if tables else []),
               {**base, "TRITON_INTERPRET": "1"})
        capture_s = time.monotonic() - start
        _child("compile", ["--launches", str(captured), "--arch", str(arch), "--full", full, "--out", str(compiled)],
               {**base, "TRITON_CACHE_DIR": str(tmp / "triton")})
        data = json.loads(captured.read_text())
        results = json.loads(compiled.read_text())
    details = {"capture_errors": data["errors"], "skipped_entries": data.get("skipped", []),
               "results": results["results"], "triton": results["triton"],
               "capture_s": capture_s, "seconds": time.monotonic() - start, "launches": len(data["launches"])}
    return summarize(results["results"]), details


def main(argv: list[str] | None = None) -> int:
    """``python -m liger_gen.aot_check``: exit status 0 when every captured launch compiled, 1 if a
    kernel failed to compile or a captured path failed to run, 2 if the capture or compile process itself
    failed."""
    parser = argparse.ArgumentParser(prog="python -m liger_gen.aot_check", description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default="", help="comma-separated op names (default: every registered op)")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for (90: Hopper)")
    parser.add_argument("--dtypes", default=",".join(DTYPE_NAMES), help="input dtypes to capture (fp32,bf16,fp16)")
    parser.add_argument("--no-cases", action="store_true",
                        help="capture the tuning problems only, not the op calls and their option sweeps")
    parser.add_argument("--tables", metavar="GPU",
                        help="also capture every entry (tuned and heuristic config) of the packaged tables of GPU "
                             "(e.g. h200), at the entries' widths: the configs that GPU launches (slower)")
    parser.add_argument("--execute", action="store_true",
                        help="run the kernels in the interpreter while capturing (slower; default: record only)")
    parser.add_argument("--full", choices=("first", "all", "none"), default="first",
                        help="which launches compile through ptxas: the first of each constexpr set (default; the "
                             "others to TTIR), all, or none (every launch to TTIR only)")
    parser.add_argument("--json", help="write every distinct launch's result to this file")
    parser.add_argument("--stage", choices=("capture", "compile"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--launches", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.stage == "capture":
        from liger_gen.ops import available_ops

        ops = [o for o in args.ops.split(",") if o] or list(available_ops())
        data = capture(ops, [d for d in args.dtypes.split(",") if d], cases=not args.no_cases, execute=args.execute,
                       tables=args.tables)
        Path(args.out).write_text(json.dumps(data))
        return 0
    if args.stage == "compile":
        import triton

        data = json.loads(Path(args.launches).read_text())
        with tempfile.TemporaryDirectory(prefix="liger_gen_aot_modules_") as folder:
            results = compile_all(data, args.arch, Path(folder), args.full)
        Path(args.out).write_text(json.dumps({"results": results, "triton": triton.__version__}, default=str))
        return 0

    from liger_gen.ops import available_ops
    from liger_gen.runtime.tables import packaged_root

    if args.ops.strip() and not [o for o in args.ops.split(",") if o.strip()]:
        parser.error(f"--ops {args.ops!r} names no op; leave it out for every op")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] or list(available_ops())
    unknown = sorted(set(ops) - set(available_ops()))
    if unknown:
        parser.error(f"unknown ops {unknown}; known: {', '.join(available_ops())}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or set(dtypes) - set(DTYPE_NAMES):
        parser.error(f"--dtypes {args.dtypes!r}: give some of {', '.join(DTYPE_NAMES)}")
    if not 50 <= args.arch <= 130:
        parser.error(f"--arch {args.arch}: a CUDA compute capability as major·10 + minor, e.g. 80, 89, 90, 100")
    if args.tables is not None and not (packaged_root() / args.tables).is_dir():
        known = sorted(p.name for p in packaged_root().iterdir() if p.is_dir())
        parser.error(f"--tables {args.tables!r}: no packaged tables for that GPU; packaged: {', '.join(known)}")
    if args.json is not None and not Path(args.json).resolve().parent.is_dir():
        parser.error(f"--json {args.json!r}: its folder does not exist")
    try:
        rows, details = run(ops, args.arch, dtypes, cases=not args.no_cases,
                            full=args.full, execute=args.execute, tables=args.tables)
    except StageFailed as exc:
        print(exc, file=sys.stderr)
        return 2
    for err in details["capture_errors"]:
        print(f"capture error: {err.get('op')} {err.get('source')} {err.get('dtype')} {err.get('phase', '')}: "
              f"{err['error']}\n{err['traceback']}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(details, indent=1, default=str))
    print(format_table(rows, args.arch, details["triton"], details["seconds"]))
    for s in details["skipped_entries"]:
        print(f"table entry not captured: {s['op']} {s['entry']}: {s['reason']}")
    print(f"(capture {details['capture_s']:.1f} s, {details['launches']} launches captured)")
    failed = any(r["failed"] for r in rows) or bool(details["capture_errors"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
