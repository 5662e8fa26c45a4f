"""The FP8 quantize ops (``fp8_quantize``, ``fp8_cast_transpose``) as tuned ops: their spaces, heuristics and
tuning problems, and the tuner's exactness gate on each kernel branch of ``fp8_quantize`` (Triton's interpreter
on the CPU; ``test_fp8_cast_transpose.py`` has the other op's)."""

import dataclasses

import pytest
import torch

from liger_gen.codegen.build import load_variant
from liger_gen.models import ModelShape
from liger_gen.ops.fp8.cast_transpose import CastTransposeSpace
from liger_gen.ops import get_spec
from liger_gen.ops.fp8.quantize import QuantizeProblem, QuantizeSpace


# each space with its two tiles' (BLOCK_M, BLOCK_K, num_warps) fields and the names its violations give them
SPACES = {"fp8_quantize": (QuantizeSpace, ("BLOCK_M_ROWS", "BLOCK_K_ROWS", "num_warps_rows", "fwd"),
                           ("BLOCK_M_COLS", "BLOCK_K_COLS", "num_warps_cols", "bwd")),
          "fp8_cast_transpose": (CastTransposeSpace, ("BLOCK_M_AMAX", "BLOCK_K_AMAX", "num_warps_amax", "amax"),
                                 ("BLOCK_M", "BLOCK_K", "num_warps", "cast"))}


@pytest.mark.parametrize("op", sorted(SPACES))
@pytest.mark.parametrize("n_cols", [1, 16, 100, 4096, 14336, 28672, 100_000])
def test_the_heuristic_is_valid_for_any_width(n_cols, op):
    space_cls, first, second = SPACES[op]
    space = space_cls({"n_cols": n_cols}, torch.bfloat16)
    config = space.heuristic()
    assert not space.violations(config)
    assert max(getattr(config, first[1]), getattr(config, second[1])) <= max(16, 1 << (n_cols - 1).bit_length())


@pytest.mark.parametrize("op", sorted(SPACES))
def test_the_space_refuses_what_cannot_run(op):
    space_cls, first, second = SPACES[op]
    space = space_cls({"n_cols": 100}, torch.bfloat16)
    base = space.heuristic()
    too_wide = dataclasses.replace(base, **{first[1]: 1024})
    assert any(f"{first[3]}: BLOCK_K" in p for p in space.violations(too_wide))
    spills = dataclasses.replace(base, **{second[0]: 128, second[1]: 128, second[2]: 1})
    assert any(second[3] in p and "per thread" in p for p in space.violations(spills))
    assert space.violations(dataclasses.replace(base, **{first[0]: 3}))  # not one of the choices


def test_walking_amax_tiles_count_their_column_accumulator():
    """A program walking several amax tiles keeps an int32 accumulator of the tile's size: the register check
    counts it (a tile at the limit alone is refused when walked)."""
    space = CastTransposeSpace({"n_cols": 4096}, torch.bfloat16)
    at_limit = dataclasses.replace(space.heuristic(), BLOCK_M_AMAX=64, BLOCK_K_AMAX=256, num_warps_amax=8,
                                   TILES_AMAX=1)
    assert not space.violations(at_limit)
    walked = space.violations(dataclasses.replace(at_limit, TILES_AMAX=2))
    assert walked == ["amax: 128 values per thread with the column accumulator of TILES_AMAX=2 > 64 (spills)"]
    # a tile too small for its threads stays refused when walked
    small = dataclasses.replace(at_limit, BLOCK_M_AMAX=2, BLOCK_K_AMAX=16, num_warps_amax=2)
    for tiles in (1, 2, 64):
        assert any("smaller than 64 threads" in p for p in space.violations(dataclasses.replace(small, TILES_AMAX=tiles)))


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


def _expected_bytes(op: str, m: int, k: int) -> dict[str, int]:
    """x read (once per axis, or once for both), one byte per value and a fp32 scale per slice written; the
    columns' copy padded to 16 rows."""
    rows, cols = m * k + 4 * m, k * (-(-m // 16) * 16) + 4 * k
    if op == "fp8_quantize":
        return {"fwd": 2 * m * k + rows, "bwd": 2 * m * k + cols}
    return {"fwd": 2 * m * k + rows + cols}


@pytest.mark.parametrize("op", sorted(SPACES))
def test_tuning_problems_cover_every_operand_width(op):
    model = ModelShape("m", hidden_size=64, intermediate_size=96, num_attention_heads=3, num_key_value_heads=1,
                       head_dim=16, vocab_size=100, rms_norm_eps=1e-6)
    problems = get_spec(op).tuning_problems(model, [16, 40], torch.bfloat16, "cpu")
    # hidden, intermediate, q (3 x 16 = 48) and k/v (16) widths, each once
    assert sorted((p.rows, p.dims["n_cols"]) for p in problems) == sorted(
        (r, k) for r in (16, 40) for k in (64, 96, 48, 16))
    for p in problems:
        assert p.phase_bytes(p.problem_dims, 2) == _expected_bytes(op, p.rows, p.dims["n_cols"])
