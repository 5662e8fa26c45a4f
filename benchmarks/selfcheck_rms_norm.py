"""CPU-only self-check of the pure helpers in ``benchmarks/rms_norm.py``.

Run ``python benchmarks/selfcheck_rms_norm.py``; it needs no GPU and no liger_gen. It checks
the byte formula, shape parsing, the profiler-event summing and flush exclusion (on fake
events and on real ``FunctionEvent`` objects of the installed torch), the JSON -> markdown
rendering, that the eager provider's formula is bit-identical to HF ``LlamaRMSNorm`` (when
transformers is installed), and that the benchmark refuses to run without CUDA while
``--render`` still works.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "rms_norm.py"

_spec = importlib.util.spec_from_file_location("bench_rms_norm", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def check_helpers() -> None:
    assert bench.parse_shapes("16384x4096, 16384X2048") == [(16384, 4096), (16384, 2048)]
    for bad in ("", "16384", "0x4096", "ax4"):
        try:
            bench.parse_shapes(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"parse_shapes accepted {bad!r}")

    r, c = 16384, 4096
    # fwd: x + w + y + rstd ; bwd: dy + x + w + rstd + dx + dw   (bf16 activations/weight)
    expected = (r * c * 2 + c * 2 + r * c * 2 + r * 4) + (r * c * 2 * 3 + c * 2 * 2 + r * 4)
    assert bench.minimal_bytes(r, c, 2) == expected == 5 * r * c * 2 + 3 * c * 2 + 8 * r
    assert bench.minimal_bytes(r, c, 2, 4) == 5 * r * c * 2 + 3 * c * 4 + 8 * r
    assert abs(bench.gb_per_s(1e9, 1.0) - 1000.0) < 1e-9
    assert bench.gb_per_s(1e9, 0.0) is None and bench.gb_per_s(1e9, None) is None
    assert bench.gpu_slug("NVIDIA H200") == "nvidia_h200"
    assert bench.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


def _fake_events(n_iters: int, flush_name: str, extra_flush_named: bool = False):
    """Build fake profiler events: per iteration one flush then two provider kernels."""
    cuda = SimpleNamespace(name="CUDA")
    cpu = SimpleNamespace(name="CPU")
    evts, t = [], 0.0

    def ev(name, dur, dtype=cuda, annot=False):
        nonlocal t
        e = SimpleNamespace(name=name, device_type=dtype, is_user_annotation=annot,
                            self_device_time_total=dur,
                            time_range=SimpleNamespace(start=t, end=t + dur))
        t += dur + 1.0
        return e

    for i in range(n_iters):
        evts.append(ev(flush_name, 60.0))
        evts.append(ev("aten::add", 999.0, dtype=cpu))  # CPU op: must be ignored
        evts.append(ev("annot", 999.0, annot=True))  # GPU-side user annotation: ignored
        evts.append(ev("fwd_kernel", 40.0 + i))  # 40, 41, ...
        evts.append(ev("bwd_kernel", 80.0))
        if extra_flush_named:
            evts.append(ev(flush_name, 5.0))
    return evts


def check_kernel_summing() -> None:
    n = 5
    flush_only = bench.device_events([e for e in _fake_events(n, "fill<int>") if e.name == "fill<int>"])
    flush = bench.summarize_flush(flush_only, n)
    assert flush == {"names": ["fill<int>"], "events_per_flush": 1, "exact": True, "mean_us": 60.0}, flush

    res = bench.summarize_kernels(bench.device_events(_fake_events(n, "fill<int>")), n, flush)
    assert res["method"] == "exclude-flush-by-name", res
    # per iteration: 40+i + 80 -> 120..124, median 122, mean 122, min 120
    assert abs(res["median_ms"] - 0.122) < 1e-12 and abs(res["mean_ms"] - 0.122) < 1e-12
    assert abs(res["min_ms"] - 0.120) < 1e-12 and res["ms"] == res["median_ms"]
    assert set(res["kernels"]) == {"fwd_kernel", "bwd_kernel"}
    assert res["kernels"]["bwd_kernel"] == {"us_per_iter": 80.0, "calls_per_iter": 1.0}

    # A provider kernel sharing the flush kernel's name -> subtract the mean flush time.
    res = bench.summarize_kernels(bench.device_events(_fake_events(n, "fill<int>", True)), n, flush)
    assert res["method"] == "subtract-flush-mean" and res["median_ms"] is None
    assert abs(res["mean_ms"] - (0.122 + 0.005)) < 1e-12, res

    # Real FunctionEvent objects of the installed torch: the attribute names must work.
    try:
        import torch
        from torch.autograd.profiler_util import FunctionEvent
    except ImportError:
        print("  (torch not installed: FunctionEvent check skipped)")
        return
    dt = torch.autograd.DeviceType
    evts = [
        FunctionEvent(id=1, name="fill", thread=0, start_us=0.0, end_us=50.0, use_device="cuda",
                      device_type=dt.CUDA),
        FunctionEvent(id=2, name="aten::fill_", thread=0, start_us=0.0, end_us=5.0, use_device="cuda",
                      device_type=dt.CPU),
        FunctionEvent(id=3, name="k", thread=0, start_us=60.0, end_us=85.5, use_device="cuda",
                      device_type=dt.CUDA),
    ]
    got = bench.device_events(evts)
    assert got == [(0.0, "fill", 50.0), (60.0, "k", 25.5)], got
    res = bench.summarize_kernels(got, 1, {"names": ["fill"], "events_per_flush": 1, "mean_us": 50.0})
    assert res["method"] == "exclude-flush-by-name" and abs(res["ms"] - 0.0255) < 1e-12


def _sample_json() -> dict:
    kernel = {"method": "exclude-flush-by-name", "iters": 20, "mean_ms": 0.2, "median_ms": 0.199,
              "min_ms": 0.198, "ms": 0.199, "kernels": {}}
    return {
        "schema": 1, "benchmark": "rms_norm",
        "meta": {"gpu": "NVIDIA H200", "date": "2026-01-01T00:00:00+00:00",
                 "command": "python benchmarks/rms_norm.py --out benchmarks/results",
                 "versions": {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0",
                              "liger-kernel": None, "liger-gen": "0.1.0"},
                 "copy_bandwidth": {"bytes": 2**31, "reps": 10, "gbps": 4300.0},
                 "warnings": ["16384x4096: something | odd"]},
        "config": {"dtype": "bfloat16", "eps": 1e-6, "iters": 20, "wall_iters": 100},
        "results": [
            {"provider": "liger-gen", "rows": 16384, "cols": 4096, "status": "ok", "kernel": kernel,
             "wall_ms": 0.25, "gbps": 4047.5, "pct_copy": 94.13, "lookup": {"source": "packaged"},
             "rel_err": {"y": 1e-3, "dx": 2e-3, "dw": 3e-4}},
            {"provider": "torch-eager", "rows": 16384, "cols": 4096, "status": "ok", "kernel": kernel,
             "wall_ms": 1.5, "gbps": 800.0, "pct_copy": 18.6,
             "rel_err": {"y": 1e-3, "dx": float("nan"), "dw": 3e-4}},
            {"provider": "liger-kernel", "rows": 16384, "cols": 4096, "status": "not installed"},
        ],
    }


def check_render() -> None:
    data = _sample_json()
    md = bench.render_markdown(json.loads(json.dumps(data)))
    assert md.startswith("# RMSNorm forward+backward on NVIDIA H200\n"), md
    assert "liger-kernel not installed" in md
    assert "| 16384x4096 | liger-gen | 0.1990 | 0.2500 | 4,048 | 94.1 | 2.00e-03 |" in md, md
    assert "| 16384x4096 | liger-kernel | not installed |" in md, md
    assert "nan" in md.split("torch-eager")[1].splitlines()[0]  # NaN error is shown, not hidden
    assert "something \\| odd" in md
    header = [ln for ln in md.splitlines() if ln.startswith("| shape")][0]
    sep = md.splitlines()[md.splitlines().index(header) + 1]
    assert header.count("|") == sep.count("|"), (header, sep)

    # The CLI: --render works anywhere; without CUDA the run exits non-zero with a message.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.json"
        path.write_text(json.dumps(data))
        out = subprocess.run([sys.executable, str(SCRIPT), "--render", str(path)],
                             capture_output=True, text=True, check=True)
        assert out.stdout == md
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        out = subprocess.run([sys.executable, str(SCRIPT), "--out", ""], capture_output=True, text=True)
        assert out.returncode != 0 and "CUDA" in out.stderr, (out.returncode, out.stderr)


def check_eager_matches_hf() -> None:
    try:
        import torch
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        print("  (transformers not installed: HF equivalence check skipped)")
        return
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(64, 256, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(256, generator=g)).to(dtype)
        dy = torch.randn(64, 256, generator=g).to(dtype)
        mod = LlamaRMSNorm(256, eps=1e-6).to(dtype)
        with torch.no_grad():
            mod.weight.copy_(w)
        xa = x.clone().requires_grad_(True)
        xb = x.clone().requires_grad_(True)
        wb = w.clone().requires_grad_(True)
        ya = mod(xa)
        yb = bench.hf_rms_norm(xb, wb, 1e-6)
        assert torch.equal(ya, yb), dtype
        dxa, dwa = torch.autograd.grad(ya, (xa, mod.weight), dy)
        dxb, dwb = torch.autograd.grad(yb, (xb, wb), dy)
        assert torch.equal(dxa, dxb) and torch.equal(dwa, dwb), dtype


def main() -> int:
    for check in (check_helpers, check_kernel_summing, check_render, check_eager_matches_hf):
        check()
        print(f"ok  {check.__name__}")
    print("selfcheck_rms_norm: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
