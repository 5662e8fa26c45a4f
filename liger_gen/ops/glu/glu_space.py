"""The search space of the gated linear units (``glu``: SwiGLU and GeGLU; ``clamped_swiglu`` and the non-gated
``squared_relu`` reuse it): the launch settings of one variant of ``templates/glu.py.jinja``, their constraints
and the analytic heuristic; and the base of their tuning problems (``MLPActivationProblem``). A companion of
``liger_gen.ops.glu.glu``, which re-exports the space's names."""

from __future__ import annotations

from dataclasses import dataclass

from liger_gen.codegen.problems import REF_CHUNK_ELEMENTS, Problem
from liger_gen.codegen.spaces import KernelConfig, Param, Space, next_power_of_2

# ------------------------------------------------------------------------------------------------ space


@dataclass(frozen=True)
class GLUConfig(KernelConfig):
    """Launch settings of one GLU variant (``templates/glu.py.jinja``), forward and backward separately.

    Each program covers TILES row tiles of BLOCK_M x BLOCK_N elements, walked in a loop (so num_stages can
    pipeline the next tile's loads); a row of n_cols is split over ceil(n_cols / BLOCK_N) programs, so any
    width works. The kernels are pure streaming (no reductions): the knobs trade bytes in flight per SM
    against the tail of partial tiles. The heuristic is analytic (no GPU measurements yet). Compiled for sm_90
    with Triton 3.9, the loads vectorise to 16-byte accesses (when pointers and row strides are multiples of
    16 bytes) and the TILES loop gets no cp.async pipelining, so num_stages may well time flat.
    """

    BLOCK_N_FWD: int
    BLOCK_M_FWD: int = 1
    TILES_FWD: int = 1
    num_warps_fwd: int = 4
    num_stages_fwd: int = 1
    BLOCK_N_BWD: int = 1024
    BLOCK_M_BWD: int = 1
    TILES_BWD: int = 1
    num_warps_bwd: int = 4
    num_stages_bwd: int = 1


class GLUSpace(Space):
    """Search space, constraints and heuristic of SwiGLU for one width (dims ``{"n_cols": intermediate}``) and
    dtype. GeGLU's space is the same with ``op = "geglu"``."""

    op = "swiglu"
    template = "glu"
    config_cls = GLUConfig
    DIMS = ("n_cols",)
    MIN_BLOCK_N = 16
    TILE_TARGET = 2048  # elements per tile of the heuristic: 16 per thread at 4 warps (two 16-byte bf16 vectors)
    # fp32 values one thread may hold per tile before the compiler spills: ~3 live per element forward (gate,
    # up, a), ~5 backward (dy, gate, up, s, products) — estimates, not measurements
    MAX_ELEMS_PER_THREAD_FWD = 64
    MAX_ELEMS_PER_THREAD_BWD = 32
    # tensors each phase streams in (gate, up; + dy backward), which pipelined loads stage in shared memory
    STREAMS_FWD = 2
    STREAMS_BWD = 3
    _BLOCK_N = tuple(2 ** k for k in range(4, 14))  # 16 .. 8192

    PARAMS = (
        Param("BLOCK_N_FWD", _BLOCK_N, "fwd"),
        Param("BLOCK_M_FWD", (1, 2, 4, 8, 16), "fwd"),
        Param("TILES_FWD", (1, 2, 4, 8), "fwd"),
        Param("num_warps_fwd", (1, 2, 4, 8, 16), "fwd"),
        Param("num_stages_fwd", (1, 2, 3), "fwd"),
        Param("BLOCK_N_BWD", _BLOCK_N, "bwd"),
        Param("BLOCK_M_BWD", (1, 2, 4, 8, 16), "bwd"),
        Param("TILES_BWD", (1, 2, 4, 8), "bwd"),
        Param("num_warps_bwd", (1, 2, 4, 8, 16), "bwd"),
        Param("num_stages_bwd", (1, 2, 3), "bwd"),
    )

    def check_dims(self) -> None:
        self.n_cols = self.dims["n_cols"]
        # widest useful column block: a block past the padded row only adds masked-off lanes
        self.max_block_n = max(self.MIN_BLOCK_N, next_power_of_2(self.n_cols))

    def heuristic(self) -> GLUConfig:
        """Analytic default, valid for every n_cols >= 1: tiles of ~2K elements, up to 1024 columns wide, 4 warps."""
        block_n = min(self.max_block_n, 1024)
        block_m = max(1, min(16, self.TILE_TARGET // block_n))
        warps = self.fit_warps(4, block_m * block_n)
        config = GLUConfig(
            BLOCK_N_FWD=block_n, BLOCK_M_FWD=block_m, TILES_FWD=1, num_warps_fwd=warps, num_stages_fwd=1,
            BLOCK_N_BWD=block_n, BLOCK_M_BWD=block_m, TILES_BWD=1, num_warps_bwd=warps, num_stages_bwd=1,
        )
        problems = self.violations(config)
        assert not problems, f"heuristic is invalid for n_cols={self.n_cols}: {problems}"
        return config

    def shape_violations(self, config: GLUConfig) -> list[str]:
        """Block width, threads, registers and shared memory of both kernels."""
        problems: list[str] = []
        for phase, block_n, block_m, warps, stages, max_elems, n_streams in (
            ("fwd", config.BLOCK_N_FWD, config.BLOCK_M_FWD, config.num_warps_fwd, config.num_stages_fwd,
             self.MAX_ELEMS_PER_THREAD_FWD, self.STREAMS_FWD),
            ("bwd", config.BLOCK_N_BWD, config.BLOCK_M_BWD, config.num_warps_bwd, config.num_stages_bwd,
             self.MAX_ELEMS_PER_THREAD_BWD, self.STREAMS_BWD),
        ):
            if block_n > self.max_block_n:
                problems.append(f"{phase}: BLOCK_N={block_n} > {self.max_block_n} (next_power_of_2(n_cols="
                                f"{self.n_cols})): the extra columns are masked-off work")
            tile = block_m * block_n
            problems += self.threads_violations(phase, warps, tile, max_elems)
            # pipelined loads keep (stages - 1) tiles of each streamed input in shared memory
            smem = (stages - 1) * n_streams * tile * self.element_size
            problems += self.smem_violations(phase, smem)
        return problems


# ------------------------------------------------------------------------------------------------ tuning


class MLPActivationProblem(Problem):
    """The base of an MLP activation's tuning problem at ``intermediate_size`` (GLU, squared ReLU): the float64
    truth computed in row chunks of ``REF_CHUNK_ELEMENTS`` (kept as float32: 2^-24 relative, far below every
    tolerance), one output y, and launchers that pass the buffers ``LAUNCH_ARGS`` names per phase to the kernel
    module's ``forward`` and ``backward``."""

    REF_CHUNK_ELEMENTS = 2 * REF_CHUNK_ELEMENTS  # elements per float64 reference chunk
    OUTPUTS = ("y",)
    LAUNCH_ARGS: dict[str, tuple[str, ...]] = {}

    @classmethod
    def shape(cls, model) -> dict[str, int]:
        return {"n_cols": model.intermediate_size}

    def launcher(self, module, phase: str):
        if phase not in ("fwd", "bwd"):
            raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
        launch = module.forward if phase == "fwd" else module.backward
        args = [self.buffers[name] for name in self.LAUNCH_ARGS[phase]]
        return lambda: launch(*args)
