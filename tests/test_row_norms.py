"""What every row norm (RMSNorm, LayerNorm, fused add + RMSNorm: ``liger_gen.ops.norms.row_norm``'s family) shares,
tested once per norm: a valid heuristic at every width up to the norm's limit, the common constraints, and (for the
two norms of the RMSNorm kernel) every structural variant of the template through the tuner's gate. Each norm's
own tests are in its test module."""

import dataclasses

import pytest
import torch

from liger_gen.codegen.spaces import DeviceLimits
from liger_gen.ops.norms.fused_add_rms_norm import FusedAddRMSNormConfig, FusedAddRMSNormProblem, FusedAddRMSNormSpace
from liger_gen.ops.norms.layer_norm import LayerNormConfig, LayerNormSpace
from liger_gen.ops.norms.rms_norm import RMSNormConfig, RMSNormProblem, RMSNormSpace
from conftest import RMS_NORM_BRANCHES, assert_norm_heuristic_valid
from helpers import assert_passes_the_gate

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (space, its config, the widest row, changes that put too many elements on a thread of a 4096-wide bf16 row):
# the fused add's three backward tiles at 64 threads are 64 elements each per thread, over its 42 budget (RMSNorm,
# with two tiles, allows 64)
NORMS = [
    pytest.param(RMSNormSpace, RMSNormConfig, 65536, dict(BLOCK_M_BWD=16, num_warps_bwd=1), id="rms_norm"),
    pytest.param(LayerNormSpace, LayerNormConfig, 65536, dict(BLOCK_M_BWD=16, num_warps_bwd=1), id="layer_norm"),
    pytest.param(FusedAddRMSNormSpace, FusedAddRMSNormConfig, 32768, dict(BLOCK_M_BWD=1, num_warps_bwd=2),
                 id="fused_add_rms_norm"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("space_cls,config_cls,max_n,per_thread", NORMS)
def test_heuristic_valid_for_every_width(space_cls, config_cls, max_n, per_thread, dtype):
    assert_norm_heuristic_valid(space_cls, dtype, max_n)


@pytest.mark.parametrize("space_cls,config_cls,max_n,per_thread", NORMS)
def test_constraints_reject_bad_configs(space_cls, config_cls, max_n, per_thread):
    """Too many warps, a tile narrower than the row, too many elements per thread and an unknown config field
    are each rejected (a 4096-wide row on a device of 512 threads per block)."""
    space = space_cls(4096, torch.bfloat16, DeviceLimits(max_threads_per_block=512))
    good = space.heuristic()
    assert any("threads" in p for p in space.violations(dataclasses.replace(good, num_warps_fwd=32)))
    assert any("BLOCK_N" in p for p in space.violations(dataclasses.replace(good, BLOCK_N=2048)))
    assert any("per thread" in p for p in space.violations(dataclasses.replace(good, **per_thread)))
    with pytest.raises(ValueError, match="unknown fields"):
        config_cls.from_dict({**good.to_dict(), "BLOCK_K": 2})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("casting_mode", ["llama", "gemma", "none"])
@pytest.mark.parametrize("changes", RMS_NORM_BRANCHES)
@pytest.mark.parametrize("problem_cls", [RMSNormProblem, FusedAddRMSNormProblem])
def test_every_template_branch_passes_the_tuners_gate(problem_cls, changes, casting_mode, dtype, device):
    """The tuner's float64 gate (NaN-poisoned outputs, per-dtype tolerance) on each structural variant."""
    assert_passes_the_gate(problem_cls(dtype, 150, 37, device, casting_mode=casting_mode, seed=5), changes)
