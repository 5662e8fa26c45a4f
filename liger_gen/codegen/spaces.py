"""Search spaces: typed params, hard constraints checked before compiling, and an analytic heuristic.

A space owns everything about an op's launch settings: which params exist and which values they may take
(``Param``), which combinations are invalid on a device (``violations``, checked before anything compiles), and
a heuristic default that is valid for every supported shape (``heuristic``). The tuner samples the space; the
runtime falls back to the heuristic when no tuned table applies.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

PHASES = ("fwd", "bwd")


@dataclass(frozen=True)
class DeviceLimits:
    """The device properties the constraints need.

    ``max_shared_memory_per_block`` is in bytes (the opt-in limit; 227 KiB on Hopper).
    """

    name: str = "generic"
    max_threads_per_block: int = 1024
    max_shared_memory_per_block: int = 232_448
    num_sms: int = 132

    @classmethod
    def from_device(cls, device: torch.device | int | None = None) -> "DeviceLimits":
        """Limits of a CUDA device, read from ``torch.cuda.get_device_properties``."""
        props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
        smem = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
        return cls(
            name=props.name,
            max_threads_per_block=int(getattr(props, "max_threads_per_block", 1024) or 1024),
            max_shared_memory_per_block=int(smem or 232_448),
            num_sms=int(props.multi_processor_count),
        )

    @classmethod
    def interpreter(cls) -> "DeviceLimits":
        """Limits used under ``TRITON_INTERPRET=1``: few 'SMs', so persistent grids stay small on the CPU."""
        return cls(name="triton-interpreter", num_sms=4)


@dataclass(frozen=True)
class Param:
    """One tunable: its name, the values it may take, and the phase (kernel) it belongs to."""

    name: str
    choices: tuple
    phase: str
    when: tuple[str, Any] | None = None  # only sampled when params[when[0]] == when[1]

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"Param {self.name}: phase must be one of {PHASES}, got {self.phase!r}")
        if not self.choices:
            raise ValueError(f"Param {self.name}: no choices")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16, and so on: the spelling used in tables."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``dtype_name``; ValueError for anything but float32/bfloat16/float16."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
    key = aliases.get(name, name)
    if key not in table:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(table)}")
    return table[key]


# ---------------------------------------------------------------------------------------------- RMSNorm


@dataclass(frozen=True)
class RMSNormConfig:
    """Launch settings of one RMSNorm variant (``templates/rms_norm.py.jinja``).

    BLOCK_N is the single-pass row width (a power of two >= n_cols). The forward kernel normalises a tile of
    BLOCK_M_FWD rows per program. The backward kernel walks tiles of BLOCK_M_BWD rows; with
    ``dw_strategy="blocked"`` each program takes TILES_PER_PROGRAM consecutive tiles, with ``"persistent"``
    PROGRAMS_PER_SM × num_sms programs stride over all tiles. Each backward program writes one fp32 partial
    row of dW, summed by a second pass. BWD_PREFETCH=1 issues the next tile's loads before the current tile's
    reductions (software pipelining written out, at the cost of a second tile of registers).

    Measured on an H200 (Triton 3.6, bf16, tuned table of 2026-11-29): every tuned entry with 16384 or more
    rows chose persistent + prefetch (backward 0.132 → 0.114 ms at 16384×4096), every 4096-row entry chose
    blocked without prefetch.
    """

    BLOCK_N: int
    BLOCK_M_FWD: int = 1
    num_warps_fwd: int = 4
    num_stages_fwd: int = 1
    BLOCK_M_BWD: int = 1
    dw_strategy: str = "persistent"
    TILES_PER_PROGRAM: int = 1
    PROGRAMS_PER_SM: int = 1
    BWD_PREFETCH: int = 0
    num_warps_bwd: int = 4
    num_stages_bwd: int = 1

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, as stored in tables."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RMSNormConfig":
        """Build from a table dict; ValueError on unknown or ill-typed fields."""
        names = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = set(data) - set(names)
        if unknown:
            raise ValueError(f"RMSNormConfig: unknown fields {sorted(unknown)}")
        values = {}
        for key, value in data.items():
            if key == "dw_strategy":
                if value not in ("blocked", "persistent"):
                    raise ValueError(f"RMSNormConfig: dw_strategy must be 'blocked' or 'persistent', got {value!r}")
            elif key == "BWD_PREFETCH":
                if value not in (0, 1) or isinstance(value, bool):
                    raise ValueError(f"RMSNormConfig: BWD_PREFETCH must be 0 or 1, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RMSNormConfig: {key} must be a positive int, got {value!r}")
            values[key] = value
        return cls(**values)

    def template_params(self, casting_mode: str) -> dict[str, Any]:
        """Everything the template needs to render this variant."""
        return {**self.to_dict(), "casting_mode": casting_mode}


class RMSNormSpace:
    """Search space, constraints and heuristic of RMSNorm for one row width and dtype."""

    op = "rms_norm"
    config_cls = RMSNormConfig
    MAX_N_COLS = 65536  # one row per single pass; past this a row no longer fits in registers
    CASTING_MODES = ("llama", "gemma", "none")
    # fp32 values one thread may hold per live tile before the compiler spills (measured ranges, not limits)
    MAX_ELEMS_PER_THREAD_FWD = 128
    MAX_ELEMS_PER_THREAD_BWD = 64

    PARAMS = (
        Param("BLOCK_M_FWD", (1, 2, 4, 8, 16, 32), "fwd"),
        Param("num_warps_fwd", (1, 2, 4, 8, 16, 32), "fwd"),
        Param("num_stages_fwd", (1, 2, 3), "fwd"),
        Param("BLOCK_M_BWD", (1, 2, 4, 8, 16), "bwd"),
        Param("dw_strategy", ("blocked", "persistent"), "bwd"),
        Param("TILES_PER_PROGRAM", (1, 2, 4, 8, 16, 32, 64), "bwd", when=("dw_strategy", "blocked")),
        Param("PROGRAMS_PER_SM", (1, 2, 4, 8), "bwd", when=("dw_strategy", "persistent")),
        Param("BWD_PREFETCH", (0, 1), "bwd"),
        Param("num_warps_bwd", (1, 2, 4, 8, 16, 32), "bwd"),
        Param("num_stages_bwd", (1, 2, 3, 4), "bwd"),
    )

    def __init__(self, n_cols: int, dtype: torch.dtype, limits: DeviceLimits | None = None):
        if not 1 <= n_cols <= self.MAX_N_COLS:
            raise ValueError(f"rms_norm supports 1 <= n_cols <= {self.MAX_N_COLS}, got n_cols={n_cols}")
        self.n_cols = int(n_cols)
        self.dtype = dtype
        self.limits = limits or DeviceLimits()
        self.block_n = next_power_of_2(self.n_cols)

    def params(self, phase: str) -> tuple[Param, ...]:
        """The tunables of one phase ("fwd" or "bwd")."""
        return tuple(p for p in self.PARAMS if p.phase == phase)

    def heuristic(self) -> RMSNormConfig:
        """Analytic default, valid for every n_cols in range: ~2K-element tiles, warps grow with the row."""
        block_n = self.block_n
        warps = 1 if block_n <= 256 else 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16 if block_n <= 16384 else 32
        block_m_fwd = max(1, min(16, 2048 // block_n))
        block_m_bwd = max(1, min(8, 1024 // block_n))
        config = RMSNormConfig(
            BLOCK_N=block_n,
            BLOCK_M_FWD=block_m_fwd,
            num_warps_fwd=self._fit_warps(warps, block_m_fwd),
            num_stages_fwd=1,
            BLOCK_M_BWD=block_m_bwd,
            dw_strategy="persistent",
            TILES_PER_PROGRAM=1,
            PROGRAMS_PER_SM=2,
            num_warps_bwd=self._fit_warps(warps, block_m_bwd),
            num_stages_bwd=1,
        )
        problems = self.violations(config)
        assert not problems, f"heuristic is invalid for n_cols={self.n_cols}: {problems}"
        return config

    def _fit_warps(self, warps: int, block_m: int) -> int:
        """Fewest of ``warps`` and what the tile can feed (one element per thread at least)."""
        tile = block_m * self.block_n
        while warps > 1 and tile < warps * 32:
            warps //= 2
        return max(1, min(warps, self.limits.max_threads_per_block // 32))

    def violations(self, config: RMSNormConfig) -> list[str]:
        """Reasons ``config`` cannot run (or cannot run sensibly) on this device; empty when valid."""
        problems: list[str] = []
        n, lim = self.n_cols, self.limits
        elem = torch.empty((), dtype=self.dtype).element_size()
        if config.BLOCK_N < n:
            problems.append(f"BLOCK_N={config.BLOCK_N} < n_cols={n}: the single-pass kernel needs the whole row")
        if config.BLOCK_N != self.block_n:
            problems.append(f"BLOCK_N={config.BLOCK_N} is not next_power_of_2(n_cols)={self.block_n}")
        for param in self.PARAMS:  # bounds every value: a table cannot ask for 10^6 tiles or a 3-row arange
            value = getattr(config, param.name)
            if value not in param.choices or isinstance(value, bool):
                problems.append(f"{param.name}={value!r} is not one of {param.choices}")
        for phase, block_m, warps, stages, max_elems in (
            ("fwd", config.BLOCK_M_FWD, config.num_warps_fwd, config.num_stages_fwd, self.MAX_ELEMS_PER_THREAD_FWD),
            # prefetching holds a second tile of x and dy in registers
            ("bwd", config.BLOCK_M_BWD, config.num_warps_bwd, config.num_stages_bwd,
             self.MAX_ELEMS_PER_THREAD_BWD // (2 if config.BWD_PREFETCH else 1)),
        ):
            threads = warps * 32
            tile = block_m * config.BLOCK_N
            if threads > lim.max_threads_per_block:
                problems.append(f"{phase}: {threads} threads > device limit {lim.max_threads_per_block}")
            if tile < threads and warps > 1:
                problems.append(f"{phase}: tile of {tile} elements is smaller than {threads} threads")
            if tile / threads > max_elems:
                problems.append(f"{phase}: {tile / threads:.0f} elements per thread > {max_elems} (spills)")
            # pipelined loads keep (stages - 1) tiles of each streamed input in shared memory, plus the
            # cross-warp reduction scratch (one fp32 per warp per row)
            n_streams = 1 if phase == "fwd" else 2
            smem = (stages - 1) * n_streams * tile * elem + block_m * warps * 4
            if smem > lim.max_shared_memory_per_block:
                problems.append(f"{phase}: ~{smem} B shared memory > device limit {lim.max_shared_memory_per_block}")
        return problems

    def suggest(self, trial, phase: str, base: RMSNormConfig) -> RMSNormConfig:
        """Sample the ``phase`` params from an Optuna trial, keeping the other phase's params from ``base``."""
        values: dict[str, Any] = {}
        for param in self.params(phase):
            if param.when is not None and values.get(param.when[0]) != param.when[1]:
                continue
            values[param.name] = trial.suggest_categorical(param.name, list(param.choices))
        return dataclasses.replace(base, **values)

    def phase_params(self, config: RMSNormConfig, phase: str) -> dict[str, Any]:
        """The ``phase`` params of ``config`` as Optuna would sample them (for ``enqueue_trial``)."""
        data = config.to_dict()
        out: dict[str, Any] = {}
        for param in self.params(phase):
            if param.when is not None and out.get(param.when[0], data[param.when[0]]) != param.when[1]:
                continue
            out[param.name] = data[param.name]
        return out


SPACES = {"rms_norm": RMSNormSpace}


def space_for(op: str, n_cols: int, dtype: torch.dtype, limits: DeviceLimits | None = None):
    """The search space of ``op`` at one feature width; KeyError names the known ops."""
    if op not in SPACES:
        raise KeyError(f"unknown op {op!r}; known: {sorted(SPACES)}")
    return SPACES[op](n_cols, dtype, limits)


def log_distance(a: int, b: int) -> float:
    """|log2(a) − log2(b)|: how far apart two row counts are, for nearest-bucket lookup."""
    return abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))
