"""The FP8 quantize op as a tuned op: its space, its heuristic and the tuner's exactness gate on each kernel
branch (Triton's interpreter on the CPU)."""

import dataclasses

import pytest
import torch

from liger_gen.codegen.build import load_variant
from liger_gen.models import ModelShape
from liger_gen.ops.fp8.quantize import QuantizeProblem, QuantizeSpace, tuning_problems


@pytest.mark.parametrize("n_cols", [1, 16, 100, 4096, 14336, 28672, 100_000])
def test_the_heuristic_is_valid_for_any_width(n_cols):
    space = QuantizeSpace({"n_cols": n_cols}, torch.bfloat16)
    config = space.heuristic()
    assert not space.violations(config)
    assert max(config.BLOCK_K_ROWS, config.BLOCK_K_COLS) <= max(16, 1 << (n_cols - 1).bit_length())


def test_the_space_refuses_what_cannot_run():
    space = QuantizeSpace({"n_cols": 100}, torch.bfloat16)
    base = space.heuristic()
    too_wide = dataclasses.replace(base, BLOCK_K_ROWS=1024)
    assert any("fwd: BLOCK_K" in p for p in space.violations(too_wide))
    spills = dataclasses.replace(base, BLOCK_M_COLS=128, BLOCK_K_COLS=128, num_warps_cols=1)
    assert any("bwd" in p and "per thread" in p for p in space.violations(spills))
    assert space.violations(dataclasses.replace(base, BLOCK_M_ROWS=3))  # not one of the choices


# one- and two-pass rows, and the two-kernel column path, at odd sizes (rows not a multiple of the tile or of 16)
BRANCHES = [("fwd", {"BLOCK_K_ROWS": 128, "BLOCK_M_ROWS": 4, "num_warps_rows": 1}),
            ("fwd", {"BLOCK_K_ROWS": 32, "BLOCK_M_ROWS": 2, "num_warps_rows": 1}),
            ("bwd", {"BLOCK_K_COLS": 32, "BLOCK_M_COLS": 8, "num_warps_cols": 1}),
            ("bwd", {"BLOCK_K_COLS": 128, "BLOCK_M_COLS": 1, "num_warps_cols": 1})]


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("phase,changes", BRANCHES)
def test_every_kernel_branch_passes_the_tuners_gate(phase, changes, dtype, fp8, device):
    problem = QuantizeProblem(dtype, {"n_cols": 100}, 37, device, fp8=fp8, seed=int(torch.randint(0, 1 << 30, ())))
    config = dataclasses.replace(problem.space.heuristic(), **changes)
    assert not problem.space.violations(config)
    module = load_variant("fp8_quantize", {**config.to_dict(), "fp8": fp8})
    assert problem.check(module, phase) is None


@pytest.mark.parametrize("phase", ["fwd", "bwd"])
def test_the_gate_catches_a_kernel_of_the_other_format(phase, device):
    """The check compares exactly: an e5m2 kernel checked against the e4m3 truth fails."""
    problem = QuantizeProblem(torch.bfloat16, {"n_cols": 64}, 20, device, fp8="e4m3")
    wrong = load_variant("fp8_quantize", {**problem.space.heuristic().to_dict(), "fp8": "e5m2"})
    for name in ("q_rows", "q_cols"):
        problem.buffers[name] = torch.empty_like(problem.buffers[name], dtype=torch.float8_e5m2)
    assert "differ" in problem.check(wrong, phase)


def test_tuning_problems_cover_every_operand_width():
    model = ModelShape("m", hidden_size=64, intermediate_size=96, num_attention_heads=3, num_key_value_heads=1,
                       head_dim=16, vocab_size=100, rms_norm_eps=1e-6)
    problems = tuning_problems(model, [16, 40], torch.bfloat16, "cpu")
    # hidden, intermediate, q (3 x 16 = 48) and k/v (16) widths, each once
    assert sorted((p.rows, p.dims["n_cols"]) for p in problems) == sorted(
        (r, k) for r in (16, 40) for k in (64, 96, 48, 16))
    for p in problems:
        m, k = p.rows, p.dims["n_cols"]
        assert p.phase_bytes(p.problem_dims, 2) == {"fwd": 3 * m * k + 4 * m,
                                                    "bwd": 2 * m * k + k * (-(-m // 16) * 16) + 4 * k}
