"""FP8 linear layers on one GPU: exactness of the quantize kernels, accuracy of ``fp8_linear``, and the time of
one decoder layer's projections (forward + backward) in bf16 and in FP8, with the quantization's share.

Checks (each must hold; a failure is printed and makes the exit status 1):
  - ``fp8_quantize`` (rows and cols, e4m3 and e5m2) and ``fp8_cast_transpose`` (both axes) equal
    ``quantize_reference`` bit for bit, including rows of zeros, NaN, ±inf, values near the format's max and tiny
    values;
  - ``rms_norm_fp8`` (with and without the residual add) returns the add's sum, the plain norm's y (up to two ulp,
    as two kernels with different tiles may sum the squares in another order) and ``fp8_cast_transpose(y)``;
  - ``glu_fp8`` returns SwiGLU's y and ``fp8_cast_transpose(y)``; its backward kernels write the GLU's dgate and
    dup and ``fp8_cast_transpose`` of each;
  - ``fp8_linear``'s output and gradients are within bf16 rounding of the recipe's float64 value.

Times (CUDA events, median of ``--iters`` after warm-up, L2 not flushed; the GEMMs are compute-bound):
  - per projection of the model's decoder layer at ``--tokens`` tokens: bf16 ``F.linear`` forward + backward,
    ``fp8_linear`` forward + backward, torchao's rowwise ``Float8Linear`` under ``torch.compile`` (when torchao is
    installed), and the quantize kernels alone: rows, cols, and both axes in one op (``fp8_cast_transpose``);
  - the quantize against ``torch.compile`` of the plain-PyTorch recipe (the fused casts torchao relies on);
  - the post-attention norm with its output's operands: ``fused_add_rms_norm`` then ``fp8_cast_transpose``,
    against ``rms_norm_fp8`` (one op);
  - the MLP's GLU with the operands of h (forward) and of dgate and dup (backward): the GLU then
    ``fp8_cast_transpose`` of each, against ``glu_fp8``'s kernels.

    python benchmarks/fp8_linear_check.py --model llama3-8b --tokens 16384 --out results/fp8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from liger_gen.bench import _time_reps
from liger_gen.models import resolve_model
from liger_gen.functional import fp8_cast_transpose, fused_add_rms_norm, glu_fp8, rms_norm, rms_norm_fp8, swiglu
from liger_gen.ops.glu.glu import glu_bwd_into
from liger_gen.ops.glu.glu_fp8 import glu_fp8_backward_into
from liger_gen.ops.fp8.linear import fp8_linear, fp8_linear_float64, fp8_linear_grads_float64
from liger_gen.ops.fp8.quantize import fp8_quantize
from liger_gen.runtime import fp8 as recipe


def cuda_ms(fn, iters: int) -> float:
    """Median CUDA-event milliseconds of ``iters`` calls after warm-up (the bench harness's clock)."""
    return statistics.median(_time_reps(fn, torch.device("cuda"), iters))


def special_rows(m: int, k: int, device) -> torch.Tensor:
    x = torch.randn(m, k, device=device) * torch.logspace(-3, 3, m, device=device)[:, None]
    x[0] = 0
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3, 9] = -float("inf")
    x[4] = torch.linspace(-448, 448, k, device=device)
    x[5] = torch.randn(k, device=device) * 1e-30
    return x.to(torch.bfloat16)


def check_quantize(device, failures: list[str]) -> None:
    for m, k in ((4099, 4096), (2053, 14336), (37, 100)):
        x = special_rows(m, k, device)
        for axis in ("rows", "cols"):
            for fmt in (recipe.E4M3, recipe.E5M2):
                q, d = fp8_quantize(x, axis, fmt)
                qr, dr = recipe.quantize_reference(x, -1 if axis == "rows" else 0, fmt)
                if axis == "cols":
                    if q[:, m:].float().abs().sum() != 0:
                        failures.append(f"quantize {axis} {fmt} {m}x{k}: padding is not zero")
                    q, d = q[:, :m].t(), d.t()
                same = (q.view(torch.uint8) == qr.view(torch.uint8)) | (q.float().isnan() & qr.float().isnan())
                same_d = (d == dr) | (d.isnan() & dr.isnan())
                if not bool(same.all() and same_d.all()):
                    failures.append(f"quantize {axis} {fmt} {m}x{k}: {int((~same).sum())} values and "
                                    f"{int((~same_d).sum())} scales differ from quantize_reference")


def _same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a.view(torch.uint8) == b.view(torch.uint8)) | (a.float().isnan() & b.float().isnan())).all())


def _same_scales(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def check_cast_transpose(device, failures: list[str]) -> None:
    for m, k in ((4099, 4096), (2053, 14336), (37, 100)):
        x = special_rows(m, k, device)
        for fmt in (recipe.E4M3, recipe.E5M2):
            q, d, qt, dt = fp8_cast_transpose(x, fmt)
            qr, dr = recipe.quantize_reference(x, -1, fmt)
            qtr, dtr = recipe.quantize_reference(x, 0, fmt)
            ok = (_same_fp8(q, qr) and _same_scales(d, dr) and _same_fp8(qt[:, :m], qtr.t())
                  and _same_scales(dt, dtr.t()) and qt[:, m:].float().abs().sum() == 0)
            if not ok:
                failures.append(f"fp8_cast_transpose {fmt} {m}x{k}: differs from quantize_reference")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b (same shape, bf16) in units in the last place of b."""
    exponent = torch.frexp(b.float().abs().clamp_min(torch.finfo(b.dtype).tiny)).exponent  # |b| in [2^(e-1), 2^e)
    ulp = torch.ldexp(torch.full_like(b, torch.finfo(b.dtype).eps, dtype=torch.float32), exponent - 1)
    return int(((a.float() - b.float()).abs() / ulp).max().ceil())


def check_norm(device, failures: list[str]) -> None:
    """The sum exactly the add's, y the plain norm's up to two ulp (the mean square may be reduced in another order
    when the two kernels' tiles differ: rstd one fp32 ulp apart can move the rounded x·rstd to its neighbour, which
    the weight (up to 1.5 here) scales to two ulp of y), the operands exactly ``fp8_cast_transpose(y)`` of the y
    returned."""
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(4099, 4096, device=device, generator=gen).to(torch.bfloat16)
    r = torch.randn(4099, 4096, device=device, generator=gen).to(torch.bfloat16)
    w = (torch.rand(4096, device=device, generator=gen) + 0.5).to(torch.bfloat16)
    for residual in (None, r):
        name = f"rms_norm_fp8 ({'fused add' if residual is not None else 'rms_norm'})"
        out = rms_norm_fp8(x, w, 1e-5, residual=residual)
        plain = (rms_norm(x, w, 1e-5),) if residual is None else fused_add_rms_norm(x, r, w, 1e-5)
        if residual is not None and not torch.equal(out.sum, plain[1]):
            failures.append(f"{name}: the sum differs from fused_add_rms_norm's")
        if not torch.equal(out.y, plain[0]):
            differ, ulps = int((out.y != plain[0]).sum()), _ulps(out.y, plain[0])
            print(f"{name}: {differ} of {out.y.numel()} values of y differ from the plain norm's, by up to {ulps} "
                  "ulp")
            if ulps > 2:
                failures.append(f"{name}: y differs from the plain norm's by {ulps} ulp")
        want = fp8_cast_transpose(out.y)
        for part, ok in (("q", _same_fp8(out.q, want[0])), ("dequant_rows", _same_scales(out.dequant_rows, want[1])),
                         ("qt", _same_fp8(out.qt, want[2])), ("dequant_cols", _same_scales(out.dequant_cols, want[3]))):
            if not ok:
                failures.append(f"{name}: {part} differs from fp8_cast_transpose of its y")


def _same_operands(x: torch.Tensor, operands) -> bool:
    want = fp8_cast_transpose(x)
    q, d, qt, dt = operands
    return (_same_fp8(q, want[0]) and _same_scales(d.view(-1, 1), want[1]) and _same_fp8(qt, want[2])
            and _same_scales(dt.view(-1, 1), want[3]))


def check_glu(device, failures: list[str]) -> None:
    gen = torch.Generator(device=device).manual_seed(2)
    gate, up, dy = (torch.randn(4099, 14336, device=device, generator=gen).to(torch.bfloat16) for _ in range(3))
    out = glu_fp8(gate, up)
    if not (torch.equal(out.y, swiglu(gate, up)) and _same_operands(out.y, out[1:])):
        failures.append("glu_fp8: y or its operands differ from swiglu's and fp8_cast_transpose's")
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    operands = glu_fp8_backward_into(dy, gate, up, dgate, dup, None, "silu")
    want_dgate, want_dup = torch.empty_like(gate), torch.empty_like(up)
    glu_bwd_into(dy, gate, up, want_dgate, want_dup, "silu")
    if not (torch.equal(dgate, want_dgate) and torch.equal(dup, want_dup)
            and all(_same_operands(t, o) for t, o in zip((dgate, dup), operands))):
        failures.append("glu_fp8 backward: dgate, dup or their operands differ from the GLU's and "
                        "fp8_cast_transpose's")


def check_linear(device, failures: list[str]) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1000, 512, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(768, 512, device=device, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    y = fp8_linear(x, w)
    dy = torch.randn(y.shape, device=device, generator=gen).to(torch.bfloat16)
    y.backward(dy)
    dx, dw = fp8_linear_grads_float64(x.detach(), w.detach(), dy)
    tol = 2 * 2.0 ** -8  # bf16 rounding of the GEMM output (and of dW's cast), relative L2
    for name, got, ref in (("y", y, fp8_linear_float64(x.detach(), w.detach())), ("dx", x.grad, dx),
                           ("dw", w.grad, dw)):
        err = ((got.double() - ref).norm() / ref.norm()).item()
        if not err < tol:
            failures.append(f"fp8_linear {name}: relative L2 {err:.2e} >= {tol:.2e}")


def projections(model) -> dict[str, tuple[int, int]]:
    h, i = model.hidden_size, model.intermediate_size
    kv = model.num_key_value_heads * model.head_dim
    return {"q": (h, model.num_attention_heads * model.head_dim), "k": (h, kv), "v": (h, kv),
            "o": (model.num_attention_heads * model.head_dim, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


def torchao_layer(k: int, n: int, device):
    """torchao's rowwise float8 training of one bias-free linear layer under torch.compile, or None."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16))
    convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name("rowwise"))
    return torch.compile(layer)


def time_layer(model, tokens: int, iters: int, device) -> list[dict]:
    compiled_quantize = torch.compile(lambda t: recipe.quantize_reference(t, -1))
    rows = []
    for name, (k, n) in projections(model).items():
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)

        def bf16_step():
            F.linear(x, w).backward(dy)

        def fp8_step():
            fp8_linear(x, w).backward(dy)

        bf16 = cuda_ms(bf16_step, iters)
        fp8 = cuda_ms(fp8_step, iters)
        ao = torchao_layer(k, n, device)
        ao_ms = None
        if ao is not None:
            x_ao = x.detach().requires_grad_()
            ao_ms = cuda_ms(lambda: ao(x_ao).backward(dy), iters)
        q_rows = cuda_ms(lambda: fp8_quantize(x.detach(), "rows"), iters)
        q_cols = cuda_ms(lambda: fp8_quantize(x.detach(), "cols"), iters)
        q_both = cuda_ms(lambda: fp8_cast_transpose(x.detach()), iters)
        q_compiled = cuda_ms(lambda: compiled_quantize(x.detach()), iters)
        bytes_rows = tokens * k * 3 + tokens * 4
        rows.append({"proj": name, "K": k, "N": n, "bf16_ms": bf16, "fp8_ms": fp8, "speedup": bf16 / fp8,
                     "torchao_ms": ao_ms, "quantize_rows_ms": q_rows, "quantize_cols_ms": q_cols,
                     "cast_transpose_ms": q_both, "compiled_rows_ms": q_compiled,
                     "quantize_rows_GBps": bytes_rows / q_rows / 1e6})
    return rows


def time_norm(model, tokens: int, iters: int, device) -> dict:
    """The post-attention norm with its output's two operands: two ops against one."""
    h = model.hidden_size
    x, r = (torch.randn(tokens, h, device=device, dtype=torch.bfloat16) for _ in range(2))
    w = torch.ones(h, device=device, dtype=torch.bfloat16)
    eps = model.rms_norm_eps

    def two_ops():
        y, _ = fused_add_rms_norm(x, r, w, eps)
        fp8_cast_transpose(y)

    separate = cuda_ms(two_ops, iters)
    fused = cuda_ms(lambda: rms_norm_fp8(x, w, eps, residual=r), iters)
    return {"hidden": h, "norm_then_cast_transpose_ms": separate, "rms_norm_fp8_ms": fused}


def time_glu(model, tokens: int, iters: int, device) -> dict:
    """The MLP's GLU with h's operands (forward) and dgate's and dup's (backward): separate ops against one."""
    n = model.intermediate_size
    gate, up, dy = (torch.randn(tokens, n, device=device, dtype=torch.bfloat16) for _ in range(3))
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)

    def fwd_separate():
        fp8_cast_transpose(swiglu(gate, up))

    def bwd_separate():
        glu_bwd_into(dy, gate, up, dgate, dup, "silu")
        fp8_cast_transpose(dgate)
        fp8_cast_transpose(dup)

    return {"intermediate": n,
            "fwd_glu_then_cast_transpose_ms": cuda_ms(fwd_separate, iters),
            "fwd_glu_fp8_ms": cuda_ms(lambda: glu_fp8(gate, up), iters),
            "bwd_glu_then_cast_transposes_ms": cuda_ms(bwd_separate, iters),
            "bwd_glu_fp8_ms": cuda_ms(lambda: glu_fp8_backward_into(dy, gate, up, dgate, dup, None, "silu"),
                                      iters)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench-results/fp8"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (compute capability 8.9 or newer)")
    device = torch.device("cuda")
    failures: list[str] = []
    check_quantize(device, failures)
    check_cast_transpose(device, failures)
    check_norm(device, failures)
    check_glu(device, failures)
    check_linear(device, failures)
    model = resolve_model(args.model)
    rows = time_layer(model, args.tokens, args.iters, device)
    norm = time_norm(model, args.tokens, args.iters, device)
    glu = time_glu(model, args.tokens, args.iters, device)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
              "tokens": args.tokens, "failures": failures, "projections": rows, "norm": norm, "glu": glu,
              "command": " ".join(sys.argv)}
    (args.out / "fp8_linear_check.json").write_text(json.dumps(result, indent=2))
    print(f"{'proj':6} {'K':>6} {'N':>6} {'bf16 ms':>8} {'fp8 ms':>8} {'x':>5} {'torchao':>8} {'q rows':>7} "
          f"{'q cols':>7} {'q both':>7} {'compiled':>8} {'GB/s':>6}")
    for r in rows:
        ao = "-" if r["torchao_ms"] is None else f"{r['torchao_ms']:.3f}"
        print(f"{r['proj']:6} {r['K']:6d} {r['N']:6d} {r['bf16_ms']:8.3f} {r['fp8_ms']:8.3f} {r['speedup']:5.2f} "
              f"{ao:>8} {r['quantize_rows_ms']:7.3f} {r['quantize_cols_ms']:7.3f} {r['cast_transpose_ms']:7.3f} "
              f"{r['compiled_rows_ms']:8.3f} {r['quantize_rows_GBps']:6.0f}")
    total_bf16, total_fp8 = sum(r["bf16_ms"] for r in rows), sum(r["fp8_ms"] for r in rows)
    print(f"layer  bf16 {total_bf16:.2f} ms  fp8 {total_fp8:.2f} ms  ({total_bf16 / total_fp8:.2f}x)")
    print(f"norm + operands at {norm['hidden']}: fused_add_rms_norm then fp8_cast_transpose "
          f"{norm['norm_then_cast_transpose_ms']:.3f} ms, rms_norm_fp8 {norm['rms_norm_fp8_ms']:.3f} ms")
    print(f"GLU + operands at {glu['intermediate']}: forward {glu['fwd_glu_then_cast_transpose_ms']:.3f} ms "
          f"separate, {glu['fwd_glu_fp8_ms']:.3f} ms glu_fp8; backward {glu['bwd_glu_then_cast_transposes_ms']:.3f} "
          f"ms separate, {glu['bwd_glu_fp8_ms']:.3f} ms glu_fp8")
    print("checks:", "all passed" if not failures else "\n  ".join(["FAILED"] + failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
