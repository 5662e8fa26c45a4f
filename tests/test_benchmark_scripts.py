"""The small analysis scripts under benchmarks/ that BENCHMARKS.md quotes (they read committed logs), and the
sweeps' own kernels in Triton's interpreter: no GPU."""

import importlib.util
import json
import math
import random
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_clock_summary_counts_only_busy_well_formed_samples(tmp_path):
    rng = random.Random()
    busy = [(rng.randint(1200, 1980), round(rng.uniform(300, 700), 2), rng.randint(40, 80)) for _ in range(15)]
    lines = [f"2026/12/02 21:00:00.{i:03d}, {c}, {p}, {t}, {rng.randint(90, 100)}" for i, (c, p, t) in enumerate(busy)]
    lines += ["2026/12/02 21:00:01.000, 345, 78.2, 39, 0",            # idle: left out
              "2026/12/02 21:00:01.100, [N/A], [N/A], 39, 100",       # unreadable: left out
              "garbage", ""]
    rng.shuffle(lines)
    path = tmp_path / "clocks_run.csv"
    path.write_text("\n".join(lines) + "\n")
    row = _load("clock_summary").summary(path).strip("| ").split(" | ")
    assert row[0] == "clocks_run" and int(row[1]) == len(busy)
    assert float(row[2]) == round(statistics.median(c for c, _, _ in busy))
    assert float(row[3]) == min(c for c, _, _ in busy)
    assert abs(float(row[4]) - statistics.median(p for _, p, _ in busy)) <= 0.05 + 1e-9  # printed to 0.1 W
    assert float(row[5]) == max(t for _, _, t in busy)
    empty = tmp_path / "none.csv"
    empty.write_text("garbage\n")
    assert "| none | 0 |" in _load("clock_summary").summary(empty)


def test_step_shared_gemms_keeps_kernels_every_provider_ran_alike(tmp_path, capsys, monkeypatch):
    rng = random.Random()
    ms = {p: [rng.uniform(1, 50) for _ in range(3)] for p in ("a", "b")}

    def profile(p, head_calls):
        kernels = [{"name": "k_shared_0", "class": "gemm", "calls": 32.0, "ms": ms[p][0]},
                   {"name": "k_shared_1", "class": "gemm", "calls": 16.0, "ms": ms[p][1]},
                   {"name": "k_head", "class": "gemm", "calls": head_calls, "ms": ms[p][2]},
                   {"name": "k_norm", "class": "liger_gen", "calls": 32.0, "ms": 1.0}]
        return {"profile": {"top_kernels": kernels}}

    data = {"models": {"m": {"providers": {"a": profile("a", 16.0), "b": profile("b", 1.0),
                                           "c": {"profile": None}}}}}
    path = tmp_path / "step.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(sys, "argv", ["step_shared_gemms.py", str(path)])
    _load("step_shared_gemms").main()
    out = capsys.readouterr().out
    assert "k_shared_0" in out and "k_shared_1" in out and "k_head" not in out and "k_norm" not in out
    total = [line for line in out.splitlines() if line.startswith("| sum")][0]
    assert f"{ms['a'][0] + ms['a'][1]:.2f}" in total and f"{ms['b'][0] + ms['b'][1]:.2f}" in total


def _sweep(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "sweeps" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("exclude_target,mask_after", [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)])
@pytest.mark.parametrize("inplace", [False, True])
def test_ce_sweep_kernel_matches_float64_cross_entropy(exclude_target, mask_after, inplace):
    """The minimal two-pass kernel the cross-entropy sweeps time computes the mean loss's rows and gradient:
    a persistent grid (fewer programs than rows), a vocab that is not a multiple of the tile, in place or not."""
    import torch

    kernel = _sweep("ce_inplace").ce_grad_kernel
    rows, vocab, programs = 7, 1000, 3
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    ref = logits.double().requires_grad_(True)
    torch.nn.functional.cross_entropy(ref, target).backward()
    ref_rows = torch.nn.functional.cross_entropy(logits.double(), target, reduction="none")
    x = logits.clone()
    dx = x if inplace else torch.empty_like(x)
    loss = torch.empty(rows, dtype=torch.float32)
    kernel[(programs,)](x, target, dx, loss, rows, vocab, vocab, 1.0 / rows, programs, BLOCK_V=256, HINTS=1,
                        NUM_STAGES=1, EXCLUDE_TARGET=exclude_target, MASK_AFTER=mask_after, num_warps=4)
    # fp32 accumulation; one bf16 rounding of dx, which Triton's interpreter does by truncation (up to 2^-7
    # relative per element, against 2^-8 when rounding to nearest)
    eps32, eps16 = torch.finfo(torch.float32).eps, 2.0 ** -7
    assert ((loss.double() - ref_rows).abs() / ref_rows.abs()).max() <= 64 * eps32
    err = (dx.double() - ref.grad).norm() / ref.grad.norm()
    assert err <= eps16


def test_ce_target_column_sweep_renders_the_template_it_is_given():
    """The sweep that times two cross-entropy templates side by side renders from the text it is handed and
    then from the package's file again (a mix-up would time one template twice)."""
    import torch

    from liger_gen.codegen import render
    from liger_gen.ops.lm_head.cross_entropy import CrossEntropyProblem

    sweep = _sweep("ce_target_column")
    problem = CrossEntropyProblem(torch.float32, {"vocab": 1000}, 8, "cpu", seed=0)
    params = problem.template_params(problem.space.heuristic())
    current = render.render("cross_entropy", params)
    marker = f"# marker {random.randrange(2**31)}\n"
    old = (ROOT / "liger_gen" / "templates" / "cross_entropy.py.jinja").read_text().replace(
        "import triton\n", marker + "import triton\n", 1)
    try:
        sweep.with_template(old)
        assert marker in render.render("cross_entropy", params)
    finally:
        sweep.with_template(None)
    assert render.render("cross_entropy", params) == current and marker not in current


def test_headline_figure_plots_the_committed_step_json_figures():
    """The front page's figure reads its numbers from the committed bench-step JSON, unchanged."""
    module = _load("headline_figure")
    path = module.DEFAULT_STEP_JSON
    assert path.is_file() and path.is_relative_to(ROOT / "benchmarks" / "results")
    data = json.loads(path.read_text())
    figure = module.load(path)
    assert figure["gpu"] == data["metadata"]["gpu"] and data["metadata"]["date"].startswith(figure["date"])
    assert figure["command"].startswith("liger-gen bench-step ") and "--out" not in figure["command"]
    assert len(figure["models"]) >= 3 and set(figure["models"]) <= set(data["models"])
    for model in figure["models"]:
        runs = data["models"][model]["providers"]
        plotted = {r["provider"]: r for r in figure["rows"] if r["model"] == model}
        assert set(plotted) == {"transformers", "liger-kernel", "liger-gen"}
        for provider, row in plotted.items():
            assert row["tokens_per_s"] == runs[provider]["tokens_per_s"]
            assert row["peak_gib"] == runs[provider]["peak_allocated_gib"]
            assert row["vs_transformers"] == runs[provider]["tokens_per_s"] / runs["transformers"]["tokens_per_s"]


def test_benchmark_pages_link_only_to_files_that_exist():
    """BENCHMARKS.md and the dated results folders' READMEs (where its history lives) link to committed files."""
    import re

    link = re.compile(r"!?\[[^\]]*\]\((?!https?://|mailto:|#)([^)\s#]+)(?:#[^)\s]*)?\)")
    pages = [ROOT / "BENCHMARKS.md", *sorted((ROOT / "benchmarks" / "results").rglob("README.md"))]
    broken = [f"{page.relative_to(ROOT)}: {m.group(1)}" for page in pages
              for m in link.finditer(page.read_text(encoding="utf-8")) if not (page.parent / m.group(1)).exists()]
    assert not broken, broken


def test_fp8_convergence_compares_each_fp8_run_with_its_own_stacks_bf16_run():
    """torchao-fp8 is measured against compile-bf16 where that ran, else against bf16; the bf16 runs are their own
    baselines; the run passes only when every loss is finite and every FP8 run with a baseline is within 1%."""
    conv = _load("fp8_convergence")
    rng = random.Random()
    tail = rng.randint(3, 9)
    base = [rng.uniform(1.0, 3.0) for _ in range(tail + 5)]
    compiled = [v * (1 + rng.uniform(0.02, 0.05)) for v in base]  # the compiled stack's bf16 is 2-5% higher
    near = [v * (1 + rng.uniform(-0.004, 0.004)) for v in compiled]  # torchao-fp8 within 0.4% of it, 1.6%+ of bf16
    rows, ok = conv.compare({"bf16": base, "compile-bf16": compiled, "torchao-fp8": near}, tail)
    by = {r["provider"]: r for r in rows}
    mean = lambda c: statistics.fmean(c[-tail:])  # noqa: E731
    assert by["torchao-fp8"]["own"] == "compile-bf16" and ok
    assert by["torchao-fp8"]["vs_own"] == pytest.approx((mean(near) - mean(compiled)) / mean(compiled), rel=1e-12)
    assert by["torchao-fp8"]["vs_bf16"] == pytest.approx((mean(near) - mean(base)) / mean(base), rel=1e-12)
    assert by["compile-bf16"]["own"] == "compile-bf16" and by["compile-bf16"]["vs_own"] == 0
    rows, ok = conv.compare({"bf16": base, "torchao-fp8": near}, tail)  # no compiled run: bf16 is the baseline
    assert rows[1]["own"] == "bf16" and not ok
    rows, ok = conv.compare({"compile-bf16": compiled, "torchao-fp8": near, "liger-gen-fp8": base}, tail)
    assert ok and rows[2]["own"] is None and math.isnan(rows[2]["vs_own"])  # no bf16: finiteness alone
    nan = near[:-1] + [float("nan")]
    rows, ok = conv.compare({"bf16": base, "compile-bf16": base, "torchao-fp8": nan}, tail)
    assert not ok and not rows[2]["finite"]
    with pytest.raises(ValueError, match="tail"):
        conv.compare({"bf16": base}, 0)


@pytest.mark.parametrize("argv,words", [(["--providers", ","], "each provider once"),
                                        (["--providers", "bf16,bf16"], "each provider once"),
                                        (["--providers", "bf16,fp4"], "unknown provider"),
                                        (["--steps", "0"], "--steps"), (["--tail", "-2"], "--tail")])
def test_fp8_convergence_refuses_bad_arguments_before_training(argv, words, monkeypatch, capsys):
    conv = _load("fp8_convergence")
    monkeypatch.setattr(conv, "train", lambda *a: pytest.fail("trained with bad arguments"))
    monkeypatch.setattr(sys, "argv", ["fp8_convergence.py", "--tiny", "--device", "cpu", *argv])
    with pytest.raises(SystemExit) as exit_:
        conv.main()
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_fp8_convergence_tiny_cpu_run_writes_its_curves(tmp_path, monkeypatch, capsys):
    """The FP8 page's CPU smoke run: every provider trains the same batches, and the JSON holds every loss, the
    tail means the printed table shows, and the complete flag."""
    conv = _load("fp8_convergence")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    steps = random.randint(3, 5)
    monkeypatch.setattr(sys, "argv", ["fp8_convergence.py", "--tiny", "--steps", str(steps), "--warmup", "1",
                                      "--device", "cpu", "--providers", "bf16,liger-gen-fp8", "--tail", "2",
                                      "--batch-size", "2", "--seq-len", "64", "--out", str(tmp_path)])
    assert conv.main() in (0, 1)
    result = json.loads((tmp_path / "fp8_convergence.json").read_text())
    assert result["complete"] and result["providers"] == ["bf16", "liger-gen-fp8"]
    for provider, losses in result["losses"].items():
        assert len(losses) == steps and all(math.isfinite(v) for v in losses)
        assert result["tail_mean"][provider] == pytest.approx(statistics.fmean(losses[-2:]), rel=1e-12)
    out = capsys.readouterr().out
    assert f"{result['tail_mean']['liger-gen-fp8']:.4f}" in out
