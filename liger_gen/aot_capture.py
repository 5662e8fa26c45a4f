"""The capture half of ``liger_gen.aot_check``: every registered op run on tiny CPU inputs under Triton's
interpreter, each kernel launch recorded (module, kernel, arguments, constexprs, options) instead of run. The
module docstring of ``liger_gen.aot_check`` describes the whole check."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Iterable

#: the dtypes captured by default (each gives its own pointer types, so its own compile)
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
CAPTURE_ROWS = 16  # tokens of every captured problem: a multiple of 16, as real batches are


class InterpreterFlag(int):
    """The value ``interpreter_enabled()`` returns during the capture: true (1), and recognisable when it reaches
    a kernel launch as a constexpr, which the compile then sets to False (its value on a GPU)."""

    def __repr__(self) -> str:
        return "InterpreterFlag(1)"


# ------------------------------------------------------------------------------------------------ capture


def _encode(value: Any) -> Any:
    """A launch argument as JSON: tensors by dtype and alignment, marked interpreter flags, plain scalars."""
    import torch

    if isinstance(value, InterpreterFlag):
        return {"interpreter_flag": True}
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "offset": value.data_ptr() % 16}
    if value is None or type(value) in (bool, int, float, str):
        return value
    try:  # a Triton dtype passed as a constexpr (tl.float32)
        import triton.language as tl

        if isinstance(value, tl.dtype):
            return {"tl_dtype": str(value)}
        if isinstance(value, tl.constexpr):
            return _encode(value.value)
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"no JSON form for a launch argument of type {type(value).__name__}: {value!r}")


class _Recorder:
    """Wraps ``InterpretedFunction.run``: each launch is noted under the current label, then runs in the
    interpreter when ``execute`` (else it is skipped: its outputs keep what they held, which the host code never
    reads, since the ops make no data-dependent host decisions; this makes the capture several times faster)."""

    def __init__(self, execute: bool = False):
        self.execute = execute
        self.launches: list[dict] = []
        self.modules: dict[str, str] = {}  # rendered module file -> its text
        self.errors: list[dict] = []
        self.label: dict[str, str] = {}

    @contextlib.contextmanager
    def installed(self):
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        recorder = self

        def run(fn_self, *args, grid, warmup, **kwargs):
            recorder.note(fn_self, args, kwargs)
            return original(fn_self, *args, grid=grid, warmup=warmup, **kwargs) if recorder.execute else None

        InterpretedFunction.run = run
        try:
            yield self
        finally:
            InterpretedFunction.run = original

    def note(self, kernel, args: tuple, kwargs: dict) -> None:
        path = kernel.fn.__code__.co_filename
        if path not in self.modules:
            import linecache

            lines = linecache.getlines(path)
            self.modules[path] = "".join(lines) if lines else Path(path).read_text(encoding="utf-8")
        names = list(kernel.arg_names)
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        options = {k: v for k, v in kwargs.items() if k not in names}
        self.launches.append({
            **self.label, "module": path, "kernel": kernel.fn.__name__,
            "args": {k: _encode(v) for k, v in bound.items()},
            "options": {k: _encode(v) for k, v in options.items()},
        })

    @contextlib.contextmanager
    def labelled(self, **label: str):
        """Note launches under ``label`` (op, source, dtype, phase, variant); an error is kept, not raised."""
        outer = self.label
        self.label = {**outer, **{k: str(v) for k, v in label.items()}}
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - one path that cannot run on the CPU must not hide the rest
            self.errors.append({**self.label, "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc(limit=6)})
        finally:
            self.label = outer


def _mark_interpreter_flag() -> None:
    """Make every ``interpreter_enabled`` imported by liger_gen's modules return ``InterpreterFlag(1)``."""
    from liger_gen.runtime import ops as runtime_ops

    original = runtime_ops.interpreter_enabled

    def marked() -> bool:
        return InterpreterFlag(1) if original() else False

    for name, module in list(sys.modules.items()):
        if name.startswith("liger_gen") and getattr(module, "interpreter_enabled", None) is original:
            module.interpreter_enabled = marked


def _variant_choices(problem) -> dict[str, tuple]:
    """Every render-time variant option of ``problem`` with the values it may take (where known)."""
    from liger_gen.ops.fp8.quantize import FORMATS
    from liger_gen.ops.norms.row_norm import CASTING_MODES

    known = {"casting_mode": CASTING_MODES, "fp8": tuple(FORMATS),
             "activation": tuple(getattr(type(problem), "ACTIVATION_CHOICES", ()))}
    return {k: known.get(k) or (v,) for k, v in problem.variant.items()}


def _problems(spec, model, dtype) -> list:
    """The op's tuning problems at ``CAPTURE_ROWS`` tokens, one per render-time variant value (the first
    problem's other values re-made with the same class)."""
    problems = spec.tuning_problems(model, [CAPTURE_ROWS], dtype, "cpu")
    out = list(problems)
    for problem in problems:
        for key, values in _variant_choices(problem).items():
            for value in values:
                if value == problem.variant[key]:
                    continue
                try:
                    out.append(type(problem)(dtype, dict(problem.dims), problem.rows, "cpu", **{key: value}))
                except (TypeError, ValueError):  # a constructor that does not take the option or the value
                    pass
    return out


#: bytes of a table entry's inputs at ``CAPTURE_ROWS`` tokens above which it is not captured (the LM-head ops'
#: weights at a real vocabulary: their problems build float64 truths of several GB)
TABLE_CAPTURE_BYTES = 64 * 2**20


def _table_problems(spec, gpu: str, skipped: list[dict]) -> list[tuple[Any, Any, str]]:
    """(problem, config, label) for the tuned and the heuristic config of every entry of the op's packaged table
    for ``gpu``, at the entry's dims and variant and ``CAPTURE_ROWS`` tokens, with the generic device limits
    (Hopper's SM count and shared memory): what the GPU launches at those widths. Entries too large for the CPU
    (``TABLE_CAPTURE_BYTES``) or whose problem cannot be made are noted in ``skipped``."""
    from liger_gen.codegen.spaces import DeviceLimits, dtype_from_name
    from liger_gen.runtime.tables import packaged_root, table_path

    path = table_path(packaged_root(), gpu, spec.name)
    if not path.exists():
        return []
    out = []
    for entry in json.loads(path.read_text())["entries"]:
        dtype, dims, variant = dtype_from_name(entry["dtype"]), dict(entry["dims"]), dict(entry.get("variant") or {})
        label = f"{entry['dtype']} {dims} rows {entry['rows']} {variant or ''}".strip()
        if _input_bytes(spec, dims, dtype) > TABLE_CAPTURE_BYTES and "vocab" in dims:
            # an LM-head op: its kernels' settings at a smaller head (the vocabulary is looped over in tiles)
            dims.update({k: min(v, SMALL_HEAD[k]) for k, v in dims.items() if k in SMALL_HEAD})
            label += f" at {dims}"
        size = _input_bytes(spec, dims, dtype)
        if size > TABLE_CAPTURE_BYTES:
            skipped.append({"op": spec.name, "entry": label, "reason": f"{size / 2**20:.0f} MiB of inputs"})
            continue
        try:
            problem = spec.problem(dtype, dims, CAPTURE_ROWS, "cpu", limits=DeviceLimits(), **variant)
        except Exception as exc:  # noqa: BLE001 - a problem class that takes other arguments: noted, not fatal
            skipped.append({"op": spec.name, "entry": label, "reason": f"{type(exc).__name__}: {exc}"})
            continue
        for which in ("config", "heuristic"):
            config = problem.space.config_cls.from_dict(entry[which])
            problems = problem.space.violations(config)
            if problems:
                skipped.append({"op": spec.name, "entry": f"{which} of {label}", "reason": "; ".join(problems)})
                continue
            out.append((problem, config, f"{which} of {label}"))
    return out


#: the LM-head dims a table entry is captured at when its own are too large for the CPU
SMALL_HEAD = {"vocab": 16384, "hidden": 512}


def _input_bytes(spec, dims: dict, dtype) -> int:
    """Bytes the op's phases move at ``dims`` and ``CAPTURE_ROWS`` tokens (0 where the problem class needs
    more than the table's dims to say, e.g. RoPE's sequence length: small ops)."""
    import torch

    try:
        return sum(spec.problem.phase_bytes({"rows": CAPTURE_ROWS, **dims},
                                            torch.empty((), dtype=dtype).element_size()).values())
    except KeyError:
        return 0


def _run_case(op: str, model, dtype) -> None:
    """The op's public path as the bench calls it: forward, then backward of every differentiable input."""
    import torch

    from liger_gen.bench.ops import CASES

    case = CASES[op]
    gen = torch.Generator().manual_seed(0)
    inputs = case.make(case.dims(model, CAPTURE_ROWS), dtype, torch.device("cpu"), gen, model)
    tensors = {n: (t.detach().clone() if isinstance(t, torch.Tensor) else t) for n, t in inputs.tensors.items()}
    leaves = [tensors[n].requires_grad_() for n in inputs.grad_of]
    outs = tuple(case.liger_gen(tensors, inputs.options))
    if leaves:
        ups = [torch.ones_like(o) if inputs.upstream.get(n) is None else inputs.upstream[n].reshape(o.shape).to(o.dtype)
               for n, o in zip(case.outputs, outs)]
        pairs = [(o, u) for o, u in zip(outs, ups) if o.requires_grad]
        torch.autograd.grad([o for o, _ in pairs], leaves, [u for _, u in pairs], allow_unused=True)


def _option_calls(op: str, t: dict) -> list[tuple[str, Any]]:
    """(name, call) of the op's public function with options that switch its kernels' constexpr flags (class
    weights, label smoothing, z-loss, soft-capping, reductions, log targets, JSD's beta at 0 and 1, no label, no
    LayerNorm weight or bias, RoPE's position ids, entropy outputs), on the bench case's tiny inputs ``t``: the
    bench calls each op with its defaults only, so without these the other branches would never compile."""
    import torch

    import liger_gen.functional as F

    def tensor(like, *shape):
        return torch.rand(*shape, dtype=like.dtype) + 0.5

    if op == "cross_entropy":
        logits, target = t["logits"], t["target"]
        w = tensor(logits, logits.shape[-1]).float()
        return [("weight, smoothing, z-loss, softcap, extra outputs",
                 lambda: F.cross_entropy(logits, target, weight=w, label_smoothing=0.1, lse_square_scale=1e-4,
                                         softcap=30.0, return_z_loss=True, return_token_accuracy=True,
                                         return_predicted_tokens=True)),
                ("reduction=none", lambda: F.cross_entropy(logits, target, reduction="none", label_smoothing=0.1)),
                ("reduction=sum, token scaling",
                 lambda: F.cross_entropy(logits, target, reduction="sum", use_token_scaling=True))]
    if op == "fused_linear_cross_entropy":
        x, w, target = t["x"], t["w"], t["target"]
        cw = tensor(x, w.shape[0]).float()
        bias = tensor(x, w.shape[0])
        return [("bias, weight, smoothing, z-loss, softcap, extra outputs",
                 lambda: F.fused_linear_cross_entropy(x, w, target, bias=bias, weight=cw, label_smoothing=0.1,
                                                      lse_square_scale=1e-4, softcap=30.0, return_z_loss=True,
                                                      return_token_accuracy=True, return_predicted_tokens=True)),
                ("reduction=none", lambda: F.fused_linear_cross_entropy(x, w, target, reduction="none")),
                ("reduction=sum, token scaling",
                 lambda: F.fused_linear_cross_entropy(x, w, target, reduction="sum", use_token_scaling=True))]
    if op == "kl_div":
        inp, target = t["input"], t["target"]
        return [(f"reduction={r}, log_target={lt}",
                 lambda r=r, lt=lt: F.kl_div(inp, target, reduction=r, log_target=lt))
                for r in ("none", "sum", "mean") for lt in (False, True)]
    if op == "jsd":
        st, te, label = t["student"], t["teacher"], t["label"]
        return [(f"beta={b}", lambda b=b: F.jsd(st, te, beta=b, label=label)) for b in (0.0, 1.0)] + [
            ("no label", lambda: F.jsd(st, te, beta=0.5))]
    if op == "fused_linear_jsd":
        a = (t["student_x"], t["student_w"], t["teacher_x"], t["teacher_w"])
        return [(f"beta={b}", lambda b=b: F.fused_linear_jsd(*a, t["target"], beta=b)) for b in (0.0, 1.0)] + [
            ("no target, temperature, batchmean",
             lambda: F.fused_linear_jsd(*a, None, temperature=2.0, reduction="batchmean"))]
    if op == "selective_log_softmax":
        x, w, target = t["x"], t["w"], t["target"]
        return [("bias, temperature, softcap, logit scale, entropy",
                 lambda: F.selective_log_softmax(x, w, target, bias=tensor(x, w.shape[0]), temperature=0.7,
                                                 softcap=30.0, logit_scale=0.5, return_entropy=True))]
    if op == "layer_norm":
        x, w, b = t["x"], t["w"], t["b"]
        return [("no weight, no bias", lambda: F.layer_norm(x, None, None)), ("no bias", lambda: F.layer_norm(x, w)),
                ("no weight", lambda: F.layer_norm(x, None, b))]
    if op == "rope":
        q, k, cos, sin = t["q"], t["k"], t["cos"], t["sin"]
        pos = torch.arange(q.shape[2]).flip(0)[None]
        return [("position ids", lambda: F.rope(q, k, cos[0], sin[0], position_ids=pos))]
    if op in ("rms_norm", "fused_add_rms_norm"):
        fn = getattr(F, op)
        args = (t["x"], t["w"]) if op == "rms_norm" else (t["x"], t["residual"], t["w"])
        return [("offset=1 (Gemma)", lambda: fn(*args, offset=1.0))]
    return []


def _option_sweeps(recorder: _Recorder, op: str, model, dtype) -> None:
    """Each of ``_option_calls``, forward and backward (a random upstream gradient: no unit-gradient shortcut)."""
    import torch

    from liger_gen.bench.ops import CASES

    case = CASES[op]
    gen = torch.Generator().manual_seed(1)
    inputs = case.make(case.dims(model, CAPTURE_ROWS), dtype, torch.device("cpu"), gen, model)
    tensors = {n: (t.detach().clone() if isinstance(t, torch.Tensor) else t) for n, t in inputs.tensors.items()}
    leaves = [tensors[n].requires_grad_() for n in inputs.grad_of]
    for name, call in _option_calls(op, tensors):
        with recorder.labelled(variant=name):
            outs = call()
            outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs and leaves:
                loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs)
                torch.autograd.grad(loss, leaves, allow_unused=True)


def _gpu_only_launches(recorder: _Recorder) -> None:
    """Launch the kernels that only CUDA tensors take (the interpreter never reaches them through the ops)."""
    import torch

    from liger_gen.codegen.build import load_variant

    with recorder.labelled(op="checks", source="gpu-only", dtype="int64"):
        target = torch.tensor([0, 3, -100, 5] * 4, dtype=torch.int64)
        load_variant("checks", {}).targets_in_range(target, 8, -100)


def _launch_phases(recorder: _Recorder, problem, config) -> None:
    """Render ``config`` for ``problem`` and launch every phase once (each phase's error noted on its own)."""
    from liger_gen.codegen.build import load_variant

    module = load_variant(problem.template, problem.template_params(config))
    for phase in problem.phases:
        with recorder.labelled(phase=phase):
            problem.prepare(phase)
            problem.launcher(module, phase)()


def capture(ops: Iterable[str], dtypes: Iterable[str], cases: bool = True, execute: bool = False,
            tables: str | None = None) -> dict:
    """Run ``ops`` in the interpreter and return {"launches", "modules", "errors", "skipped", "ops"} (see the
    module docstring); ``execute``: run the kernels too (else their launches are only recorded); ``tables``: a
    GPU name (``h200``) whose packaged tables' entries are captured too (``_table_problems``). Must run with
    ``TRITON_INTERPRET=1`` set before Triton is imported."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("aot_check capture: TRITON_INTERPRET=1 must be set before Triton is imported")
    import torch

    from liger_gen.bench.ops import TINY
    from liger_gen.ops import get_spec

    specs = {op: get_spec(op) for op in ops}
    _mark_interpreter_flag()  # after the imports above, so that every module that took the function gets the mark
    recorder = _Recorder(execute)
    skipped: list[dict] = []
    with recorder.installed():
        for op, spec in specs.items():
            for dname in dtypes:
                dtype = getattr(torch, DTYPE_NAMES.get(dname, dname))
                with recorder.labelled(op=op, source="tuning problem", dtype=DTYPE_NAMES.get(dname, dname)):
                    for problem in _problems(spec, TINY, dtype):
                        variant = ",".join(f"{k}={v}" for k, v in sorted(problem.variant.items()))
                        with recorder.labelled(variant=variant):
                            _launch_phases(recorder, problem, problem.space.heuristic())
                if cases:
                    with recorder.labelled(op=op, source="op call", dtype=DTYPE_NAMES.get(dname, dname)):
                        _run_case(op, TINY, dtype)
                    with recorder.labelled(op=op, source="op options", dtype=DTYPE_NAMES.get(dname, dname)):
                        _option_sweeps(recorder, op, TINY, dtype)
            if tables:
                found: list = []
                with recorder.labelled(op=op, source=f"{tables} table"):
                    found = _table_problems(spec, tables, skipped)
                for problem, config, label in found:
                    with recorder.labelled(op=op, source=f"{tables} table", dtype=str(problem.dtype)[6:],
                                           variant=label):
                        _launch_phases(recorder, problem, config)
        _gpu_only_launches(recorder)
    return {"ops": list(specs), "launches": recorder.launches, "modules": recorder.modules,
            "errors": recorder.errors, "skipped": skipped}
