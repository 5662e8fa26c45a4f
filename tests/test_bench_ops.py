"""``liger-gen bench`` on the CPU: byte and flop formulas, profiler summing, derived metrics, the correctness flag,
the JSON schema, markdown and PNG rendering, and the command line (tiny shapes through Triton's interpreter)."""

import importlib.util
import json
import math
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

import liger_gen.bench as bench
from liger_gen.bench import report
from liger_gen.bench.ops import CASES, TINY, bench_model
from liger_gen.runtime import fp8 as recipe
from liger_gen.cli import main
from liger_gen.models import PRESETS
from liger_gen.ops import available_ops

LLAMA = PRESETS["llama3-8b"]


# ------------------------------------------------------------------------------------------------ formulas


def test_every_op_has_a_case():
    assert set(available_ops()) <= set(CASES)


def _tiny_inputs(op, rows=8, dtype=torch.float32):
    case = CASES[op]
    dims = case.dims(TINY, rows)
    inputs = case.make(dims, dtype, torch.device("cpu"), torch.Generator().manual_seed(0), TINY)
    return case, dims, inputs


def _nb(t):
    return t.numel() * t.element_size()


def _expected_bytes(op, t, up, rows):
    """Each formula written out from the tensors' shapes: what a pass reads and writes."""
    f32_row = rows * 4  # one fp32 statistic per row
    if op == "rms_norm":
        fwd = _nb(t["x"]) + _nb(t["w"]) + _nb(up["y"]) + f32_row
        bwd = _nb(up["y"]) + _nb(t["x"]) + _nb(t["w"]) + f32_row + _nb(t["x"]) + _nb(t["w"])
        return fwd + bwd
    if op == "fused_add_rms_norm":
        fwd = _nb(t["x"]) + _nb(t["residual"]) + _nb(t["w"]) + _nb(up["y"]) + _nb(up["s"]) + f32_row
        bwd = _nb(up["y"]) + _nb(up["s"]) + _nb(up["s"]) + _nb(t["w"]) + f32_row + _nb(t["x"]) + _nb(t["residual"]) \
            + _nb(t["w"])
        return fwd + bwd
    if op == "rms_norm_fp8":  # the fused add + RMSNorm, then y read once more and its two e4m3 operands written
        m, k = t["x"].shape
        fwd = _nb(t["x"]) + _nb(t["residual"]) + _nb(t["w"]) + _nb(up["y"]) + _nb(up["s"]) + f32_row \
            + _nb(up["y"]) + (m * k + f32_row) + (k * (-(-m // 16) * 16) + 4 * k)
        bwd = _nb(up["y"]) + _nb(up["s"]) + _nb(up["s"]) + _nb(t["w"]) + f32_row + _nb(t["x"]) + _nb(t["residual"]) \
            + _nb(t["w"])
        return fwd + bwd
    if op == "layer_norm":
        fwd = _nb(t["x"]) + _nb(t["w"]) + _nb(t["b"]) + _nb(up["y"]) + 2 * f32_row
        bwd = _nb(up["y"]) + _nb(t["x"]) + _nb(t["w"]) + 2 * f32_row + _nb(t["x"]) + _nb(t["w"]) + _nb(t["b"])
        return fwd + bwd
    if op == "rope":
        per_pass = 2 * (_nb(t["q"]) + _nb(t["k"])) + _nb(t["cos"]) + _nb(t["sin"])
        return 2 * per_pass
    if op in ("swiglu", "geglu"):
        return (_nb(t["gate"]) + _nb(t["up"]) + _nb(up["y"])) + (_nb(up["y"]) + 2 * _nb(t["gate"]) + 2 * _nb(t["up"]))
    if op == "glu_fp8":  # SwiGLU, then y read once more and its two e4m3 operands written; the plain backward
        m, n = t["gate"].shape
        operands = (m * n + f32_row) + (n * (-(-m // 16) * 16) + 4 * n)
        fwd = _nb(t["gate"]) + _nb(t["up"]) + _nb(up["y"]) + _nb(up["y"]) + operands
        return fwd + (_nb(up["y"]) + 2 * _nb(t["gate"]) + 2 * _nb(t["up"]))
    if op == "clamped_swiglu":  # interleaved gate_up in, y out; dy and gate_up in, the interleaved gradient out
        return (_nb(t["gate_up"]) + _nb(up["y"])) + (_nb(up["y"]) + 2 * _nb(t["gate_up"]))
    if op == "squared_relu":  # x in, y out; dy and x in, dx out
        return (_nb(t["x"]) + _nb(up["y"])) + (_nb(up["y"]) + 2 * _nb(t["x"]))
    if op == "moe_permute":
        index = _nb(t["token"]) + _nb(t["pos"])
        fwd = 2 * _nb(t["ys"]) + _nb(t["token"]) + _nb(t["ys"]) + _nb(t["pos"]) + _nb(t["w"]) + _nb(t["x"])
        bwd = (_nb(t["x"]) + _nb(t["ys"]) + _nb(t["pos"]) + _nb(t["w"]) + _nb(t["ys"]) + 4 * t["w"].numel()
               + _nb(t["ys"]) + _nb(t["pos"]) + _nb(t["x"]))
        assert index == 2 * 8 * t["w"].numel()
        return fwd + bwd
    if op == "cross_entropy":
        return 2 * _nb(t["logits"]) + _nb(t["target"])
    if op == "fused_linear_cross_entropy":
        return 2 * _nb(t["x"]) + 2 * _nb(t["w"]) + _nb(t["target"])
    if op == "selective_log_softmax":  # logits GEMMs in both passes; log p, lse written; lse, d log p read
        return 3 * _nb(t["x"]) + 3 * _nb(t["w"]) + 2 * _nb(t["target"]) + 4 * f32_row
    if op == "fused_linear_jsd":  # both inputs and heads read once, dx and dW written, the targets read
        return (_nb(t["student_x"]) + _nb(t["teacher_x"]) + _nb(t["student_x"]) + _nb(t["student_w"])
                + _nb(t["teacher_w"]) + _nb(t["student_w"]) + _nb(t["target"]))
    if op == "kl_div":
        return _nb(t["input"]) + _nb(t["target"]) + _nb(t["input"])
    if op == "jsd":
        return 2 * _nb(t["student"]) + _nb(t["teacher"]) + _nb(t["label"])
    if op == "fp8_quantize":  # x read, one byte per value and a fp32 scale per slice written, for each axis; the
        m, k = t["x"].shape  # columns' copy is padded to 16 rows
        return (_nb(t["x"]) + m * k + 4 * m) + (_nb(t["x"]) + k * (-(-m // 16) * 16) + 4 * k)
    if op == "fp8_linear":  # bf16 x, W, y, dy, dx, dW once each; every FP8 operand written once and read once
        (m, k), n = t["x"].shape, t["weight"].shape[0]
        mp = -(-m // 16) * 16
        bf16 = _nb(t["x"]) + _nb(t["weight"]) + 2 * _nb(up["y"]) + _nb(t["x"]) + _nb(t["weight"])
        return bf16 + 2 * (m * k + k * mp + 2 * n * k + m * n + n * mp)
    if op == "fp8_cast_transpose":  # as fp8_quantize's two axes, but x read once for both
        m, k = t["x"].shape
        return _nb(t["x"]) + (m * k + 4 * m) + (k * (-(-m // 16) * 16) + 4 * k)
    if op == "adamw":  # param, grad and both moments read; param and both moments written
        return 2 * _nb(t["param"]) + _nb(t["grad"]) + 2 * _nb(t["exp_avg"]) + 2 * _nb(t["exp_avg_sq"])
    raise AssertionError(f"no expected formula for {op}")


@pytest.mark.parametrize("op", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_minimal_bytes_match_the_tensors(op, dtype):
    rows = 8
    case, dims, inputs = _tiny_inputs(op, rows, dtype)
    got = case.bytes(dims, torch.empty((), dtype=dtype).element_size())
    assert got == _expected_bytes(op, inputs.tensors, inputs.upstream, rows)


def test_bytes_and_flops_at_llama3_8b():
    r, h, i, v = 16384, LLAMA.hidden_size, LLAMA.intermediate_size, LLAMA.vocab_size
    assert CASES["rms_norm"].bytes(CASES["rms_norm"].dims(LLAMA, r), 2) == 5 * r * h * 2 + 3 * h * 2 + 8 * r
    assert CASES["swiglu"].bytes(CASES["swiglu"].dims(LLAMA, r), 2) == 8 * r * i * 2
    rope = CASES["rope"].dims(LLAMA, r)
    assert (rope["batch"], rope["seq"]) == (4, 4096)  # B·S = rows, as in transformers' (b, h, s, d)
    assert CASES["rope"].bytes(rope, 2) == 4 * r * (32 + 8) * 128 * 2 + 4 * 4096 * 128 * 2
    rows = 8192  # the cross-entropy shape: 8192 x 128256 bf16 = 2.1 GB of logits, read once, written once
    ce = CASES["cross_entropy"]
    assert ce.default_rows == rows
    assert ce.bytes(ce.dims(LLAMA, rows), 2) == 2 * (rows * 128256 * 2) + rows * 8
    flce = CASES["fused_linear_cross_entropy"]
    d = flce.dims(LLAMA, rows)
    # logits = x @ W.T, dx = dlogits @ W, dW = dlogits.T @ x: three GEMMs of 2·M·N·K
    gemms = [(rows, v, h), (rows, h, v), (v, h, rows)]
    assert flce.flops(d) == sum(2 * m * n * k for m, n, k in gemms)
    assert CASES["rms_norm"].flops(CASES["rms_norm"].dims(LLAMA, r)) == 0


@pytest.mark.skipif(recipe.fp8_unsupported_reason(torch.device("cpu")) is not None,
                    reason="this torch build has no CPU torch._scaled_mm with per-row scales")
def test_fp8_linear_rows_compare_the_same_recipe_across_providers():
    """``fp8_linear``'s bench rows: liger-gen, the recipe in plain PyTorch and torchao's rowwise Float8Linear
    compute the same recipe (power-of-two scales, e4m3): every output and gradient within bf16 of the float64
    truth, and the three equally far from it; bf16 inputs whatever the bench's dtype, and the op's FLOPs are the
    three GEMMs'."""
    pytest.importorskip("torchao")
    data = bench.run_bench(TINY, ops=["fp8_linear"], providers=["liger-gen", "torch-eager", "torchao"], rows=20,
                           dtype=torch.float32, device="cpu", settings=bench.Settings(iters=1, wall_iters=1, warmup=0),
                           command="test", log=lambda msg: None)
    info = data["ops"]["fp8_linear"]
    assert info["flops"] == 6 * 20 * TINY.hidden_size * TINY.intermediate_size and info["tolerance"] == 3e-2
    rows = {r["provider"]: r for r in data["results"]}
    assert set(rows) == {"liger-gen", "torch-eager", "torchao"}
    for r in rows.values():
        assert r["status"] == "ok" and r["correct"], r
        assert r["rel_err"] == rows["liger-gen"]["rel_err"], r["provider"]
    assert 0 < max(rows["liger-gen"]["rel_err"].values()) < 3e-2


def test_bench_model_knows_tiny_and_the_presets():
    assert bench_model("tiny") is TINY
    assert bench_model("llama3-8b") == LLAMA
    with pytest.raises(ValueError, match="unknown model 'gpt-17'"):
        bench_model("gpt-17")


# ------------------------------------------------------------------------------------------------ pure helpers


def _events(n, flush_name="fill", clash=False):
    cuda, cpu = SimpleNamespace(name="CUDA"), SimpleNamespace(name="CPU")
    out, t = [], 0.0

    def ev(name, dur, kind=cuda):
        nonlocal t
        e = SimpleNamespace(name=name, device_type=kind, is_user_annotation=False, self_device_time_total=dur,
                            time_range=SimpleNamespace(start=t, end=t + dur))
        t += dur + 1
        return e

    for i in range(n):
        out += [ev(flush_name, 50.0), ev("aten::mul", 999.0, cpu), ev("fwd", 10.0 + i), ev("bwd", 30.0)]
        if clash:
            out.append(ev(flush_name, 4.0))
    return out


def test_kernel_time_excludes_the_flush():
    n = 5
    flush = bench.summarize_flush(bench.device_events([e for e in _events(n) if e.name == "fill"]), n)
    assert flush["names"] == ["fill"] and flush["events_per_flush"] == 1 and flush["mean_us"] == 50.0
    res = bench.summarize_kernels(bench.device_events(_events(n)), n, flush)
    # per iteration 10+i + 30 µs: 40..44, median 42
    assert res["method"] == "exclude-flush-by-name"
    assert math.isclose(res["ms"], 0.042) and math.isclose(res["min_ms"], 0.040)
    assert res["kernels"]["bwd"] == {"us_per_iter": 30.0, "calls_per_iter": 1.0}
    res = bench.summarize_kernels(bench.device_events(_events(n, clash=True)), n, flush)
    assert res["method"] == "subtract-flush-mean" and res["median_ms"] is None
    assert math.isclose(res["ms"], 0.042 + 0.004)


def test_wall_time_is_the_median_of_its_loops():
    """One loop of five is slowed (a descheduled process): the median ignores it; each loop runs n calls."""
    calls, clock = [], [0.0]
    slow_loop = 2

    def step():
        calls.append(1)
        loop = (len(calls) - 2) // 4 if len(calls) > 1 else -1
        clock[0] += 0.010 if loop == slow_loop else 0.001  # seconds per call

    import unittest.mock as mock

    with mock.patch.object(bench.time, "perf_counter", lambda: clock[0]):
        ms, n, rounds = bench.wall_time(step, lambda: None, max_iters=4, rounds=5, budget_s=1.0)
    assert n == 4 and len(calls) == 1 + 5 * 4
    assert rounds[slow_loop] == pytest.approx(10.0) and ms == pytest.approx(1.0)


def test_wall_iterations_follow_the_budget():
    assert bench.wall_iterations(1.0, 100, budget_s=0.05) == 50
    assert bench.wall_iterations(0.001, 100, budget_s=0.3) == 100
    assert bench.wall_iterations(500.0, 100, budget_s=0.3) == 3
    assert bench.wall_iterations(None, 100) == 3


def _synthetic():
    """A result dict with round numbers: 1 GB moved in 0.5 ms is 2000 GB/s, half of a 4000 GB/s ceiling."""
    def res(provider, kernel_ms, wall_ms, **kw):
        return {"op": "rms_norm", "provider": provider, "status": "ok", "note": "", "kernel": {"ms": kernel_ms},
                "wall_ms": wall_ms, "rel_err": {"y": 1e-3, "dx": 2e-3}, "correct": True, **kw}

    return {
        "schema": 1, "benchmark": "liger-gen bench",
        "meta": {"gpu": "NVIDIA H200", "gpu_slug": "nvidia_h200", "device": "cuda", "versions": {"torch": "2.11"},
                 "command": "liger-gen bench --model llama3-8b", "date": "2026-11-30T00:00:00+00:00",
                 "ceilings": {"copy": {"gbps": 4000.0, "bytes": 2**31}, "matmul": {"tflops": 800.0, "n": 8192}}},
        "config": {"model": {"name": "llama3-8b"}, "dtype": "bfloat16", "ops": ["rms_norm", "flce"],
                   "providers": ["liger-gen", "torch-compile", "liger-kernel"]},
        "ops": {"rms_norm": {"bytes": 10**9, "flops": 0, "tolerance": 3e-2, "dims": {"rows": 1}},
                "flce": {"bytes": 10**9, "flops": 4 * 10**12, "tolerance": 3e-2, "dims": {"rows": 1}}},
        "results": [res("liger-gen", 0.5, 0.6, lookup={"source": "packaged"}), res("torch-compile", 1.0, 1.5),
                    res("liger-kernel", 0.75, 0.9),
                    {"op": "flce", "provider": "liger-gen", "status": "ok", "note": "", "kernel": {"ms": 10.0},
                     "wall_ms": 10.0},
                    {"op": "flce", "provider": "liger-kernel", "status": "not installed", "note": ""}],
    }


def test_derive_rates_ceilings_and_speedups():
    data = report.derive(_synthetic())
    lg = data["results"][0]
    assert math.isclose(lg["gbps"], 2000.0) and math.isclose(lg["pct_copy"], 50.0)
    assert math.isclose(lg["speedup"]["torch-compile"]["kernel"], 2.0)
    assert math.isclose(lg["speedup"]["torch-compile"]["wall"], 2.5)
    assert math.isclose(lg["speedup"]["liger-kernel"]["kernel"], 1.5)
    assert "torch-compile" not in data["results"][1]["speedup"]  # nobody is compared with itself
    flce = data["results"][3]
    assert math.isclose(flce["tflops"], 400.0) and math.isclose(flce["pct_matmul"], 50.0)
    assert flce["speedup"] == {}  # liger-kernel did not run
    # speed of light: max(1e9 B / 4000 GB/s, 4e12 / 800 TFLOP/s) = max(0.25, 5) ms
    assert math.isclose(data["ops"]["flce"]["sol_ms"], 5.0) and math.isclose(data["ops"]["rms_norm"]["sol_ms"], 0.25)
    assert report.derive(data) == data  # idempotent (the --render path derives again)
    assert report.default_stem(data) == "bench_llama3-8b_nvidia_h200"


# ------------------------------------------------------------------------------------------------ CPU runs


def _perturbed(case):
    """A provider that is 10% off in its outputs (and so in every gradient)."""
    def fn(t, o):
        return tuple(y * 1.1 for y in case.eager(t, o))

    return bench.Provider("perturbed", fn, note="torch-eager x 1.1")


@pytest.fixture(scope="module")
def cpu_run():
    """One interpreter run shared by the tests below: 2 ops x liger-gen, torch-eager and a wrong provider."""
    bench.PROVIDER_BUILDERS["perturbed"] = _perturbed
    try:
        data = bench.run_bench(TINY, ops=["rms_norm", "cross_entropy"],
                               providers=["liger-gen", "torch-eager", "perturbed"], rows=16, dtype=torch.float32,
                               device="cpu", settings=bench.Settings(iters=2, wall_iters=2, warmup=1),
                               command="test", log=lambda msg: None)
    finally:
        del bench.PROVIDER_BUILDERS["perturbed"]
    return data


def test_cpu_run_measures_every_provider(cpu_run):
    got = {(r["op"], r["provider"]): r for r in cpu_run["results"]}
    assert set(got) == {(op, p) for op in ("rms_norm", "cross_entropy") for p in ("liger-gen", "torch-eager",
                                                                                   "perturbed")}
    for res in got.values():
        assert res["status"] == "ok", res
        assert res["kernel"]["method"] == "cpu-wall" and res["kernel"]["ms"] > 0 and res["wall_ms"] > 0
        assert res["peak_extra_bytes"] is None  # not measurable on the CPU
    assert set(got["rms_norm", "liger-gen"]["rel_err"]) == {"y", "dx", "dw"}
    assert set(got["cross_entropy", "torch-eager"]["rel_err"]) == {"loss", "dlogits"}
    assert got["rms_norm", "liger-gen"]["lookup"]["source"] == "heuristic"
    assert cpu_run["ops"]["rms_norm"]["dims"] == {"rows": 16, "n_cols": TINY.hidden_size}
    assert cpu_run["meta"]["command"] == "test" and cpu_run["meta"]["gpu"] == "cpu"


def test_wrong_provider_is_flagged(cpu_run):
    got = {(r["op"], r["provider"]): r for r in cpu_run["results"]}
    for op in ("rms_norm", "cross_entropy"):
        assert got[op, "liger-gen"]["correct"] is True and got[op, "liger-gen"]["max_rel_err"] < 1e-5
        assert got[op, "torch-eager"]["correct"] is True
        bad = got[op, "perturbed"]
        assert bad["correct"] is False and math.isclose(bad["max_rel_err"], 0.1, rel_tol=1e-3)
        assert any(w.startswith(f"{op} perturbed: WRONG") for w in cpu_run["meta"]["warnings"])
    assert report.failures(cpu_run) == []  # only liger-gen's own failures fail the command
    rows = {(r["op"], r["provider"]): r for r in report.table_rows(cpu_run)}
    assert rows["rms_norm", "perturbed"]["max rel err"] == "1.0e-01 WRONG"
    assert "WRONG" not in rows["rms_norm", "liger-gen"]["max rel err"]


def test_failures_name_liger_gen_errors_and_wrong_results(cpu_run):
    data = json.loads(json.dumps(cpu_run))
    data["results"][0]["correct"] = False
    data["results"].append({"op": "rms_norm", "provider": "liger-gen-heuristic", "status": "error: OOM"})
    out = report.failures(data)
    assert out[0].startswith("rms_norm liger-gen: wrong") and out[1] == "rms_norm liger-gen-heuristic: error: OOM"


def test_json_round_trip_and_schema_errors(cpu_run, tmp_path):
    path = report.write_json(cpu_run, tmp_path / "r.json")
    back = report.load_json(path)
    assert back == json.loads(json.dumps(cpu_run, default=str))
    assert report.default_stem(back) == "bench_tiny_cpu"
    broken = dict(back)
    del broken["ops"]
    with pytest.raises(report.ReportError, match="missing top-level field 'ops'"):
        report.validate(broken)
    broken = json.loads(json.dumps(back))
    del broken["meta"]["ceilings"]
    with pytest.raises(report.ReportError, match="meta.ceilings"):
        report.validate(broken)
    broken = json.loads(json.dumps(back))
    broken["results"][1]["op"] = "softmax9"
    with pytest.raises(report.ReportError, match="results\\[1\\] names op 'softmax9'"):
        report.validate(broken)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(report.ReportError, match="cannot read bench result"):
        report.load_json(tmp_path / "bad.json")


def test_render_lists_every_op_and_provider(cpu_run, tmp_path, monkeypatch):
    data = report.derive(report.load_json(report.write_json(cpu_run, tmp_path / "run.json")))
    data["results"].append({"op": "rms_norm", "provider": "liger-kernel", "status": "not installed", "note": ""})
    report.write_json(data, tmp_path / "run.json")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    result = CliRunner().invoke(main, ["bench", "--render", str(tmp_path / "run.json")])
    assert result.exit_code == 0, result.output
    # printed, and written to a new folder under bench-results/: never beside a committed result, never at the
    # current folder's top level
    assert [p.name for p in (tmp_path / "cwd").iterdir()] == ["bench-results"]
    (folder,) = (tmp_path / "cwd" / "bench-results").iterdir()
    md = (folder / "run.md").read_text()
    assert md in result.output
    assert not (tmp_path / "run.md").exists()
    assert md.startswith("# tiny ops on cpu\n")
    assert "functional run on the CPU" in md  # a CPU result says its times are not performance
    for res in data["results"]:
        assert f"| {res['op']} | {res['provider']} |" in md
    assert "| rms_norm | liger-kernel | not installed |" in md
    header = next(line for line in md.splitlines() if line.startswith("| op | provider"))
    sep = md.splitlines()[md.splitlines().index(header) + 1]
    assert header.count("|") == sep.count("|")


def test_png_is_written(cpu_run, tmp_path):
    pytest.importorskip("matplotlib")
    path = report.plot(cpu_run, tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    with pytest.raises(ValueError, match="no result with a kernel time"):
        report.plot(cpu_run, tmp_path / "q.png", normalise="torch-compile")  # no torch-compile in this run
    with pytest.raises(ValueError, match="normalise must be"):
        report.plot(cpu_run, tmp_path / "q.png", normalise="eager")


def test_png_is_skipped_with_a_warning_without_matplotlib(cpu_run, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert report.plot(cpu_run, tmp_path / "p.png") is None
    assert not (tmp_path / "p.png").exists()


# ------------------------------------------------------------------------------------------------ command line


def test_bench_help():
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0
    for option in ("--model", "--ops", "--rows", "--providers", "--dtype", "--out", "--render", "--device"):
        assert option in result.output
    assert "bench" in CliRunner().invoke(main, ["--help"]).output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_bench_without_cuda_says_what_to_do():
    result = CliRunner().invoke(main, ["bench", "--model", "llama3-8b"])
    assert result.exit_code == 1
    assert "no CUDA GPU is visible" in result.output and "--device cpu" in result.output
    assert "--render" in result.output


def test_bench_bad_arguments_are_usage_errors():
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "--device", "cpu", "--providers", "liger-gen,nvfuser"])
    assert result.exit_code == 2 and "nvfuser" in result.output
    result = runner.invoke(main, ["bench", "--device", "cpu", "--model", "gpt-17"])
    assert result.exit_code == 2 and "unknown model 'gpt-17'" in result.output
    result = runner.invoke(main, ["bench", "--device", "cpu", "--ops", "rms_norm,softmax9"])
    assert result.exit_code == 2 and "softmax9" in result.output


def test_bench_cpu_end_to_end(tmp_path):
    result = CliRunner().invoke(main, [
        "bench", "--device", "cpu", "--model", "tiny", "--ops", "swiglu,kl_div,fp8_linear", "--rows", "8",
        "--providers", "liger-gen,liger-gen-heuristic,torch-eager", "--dtype", "float32", "--iters", "2",
        "--wall-iters", "2", "--warmup", "1", "--out", str(tmp_path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    data = report.load_json(tmp_path / "bench_tiny_cpu.json")
    ops = ("swiglu", "kl_div") + (("fp8_linear",) if recipe.fp8_unsupported_reason(torch.device("cpu")) is None
                                  else ())
    results = [r for r in data["results"] if r["op"] in ops]
    assert [(r["op"], r["provider"]) for r in results] == [
        (op, p) for op in ops for p in ("liger-gen", "liger-gen-heuristic", "torch-eager")]
    assert all(r["status"] == "ok" and r["correct"] for r in results)
    assert data["ops"]["swiglu"]["bytes"] == 8 * 8 * TINY.intermediate_size * 4
    assert data["config"]["dtype"] == "float32" and data["config"]["rows"] == 8
    assert "liger-gen-heuristic" in result.output and "kl_div" in result.output
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bench_tiny_cpu.png").stat().st_size > 0
