"""Search spaces: typed params, hard constraints checked before compiling, and an analytic heuristic.

A space owns everything about an op's launch settings at one feature shape (``dims``, e.g. ``{"n_cols": 4096}``
for a norm or ``{"n_q_heads": 32, "n_kv_heads": 8, "head_dim": 128, "rotary_dim": 128}`` for RoPE) and dtype:
which params exist and which values they may take (``Param``), which combinations are invalid on a device
(``violations``, checked before anything compiles), and a heuristic default that is valid for every supported
shape (``heuristic``). The tuner samples the space; the runtime falls back to the heuristic when no tuned table
applies. Each op's space lives in its module under ``liger_gen/ops`` and is handed to the runtime and the tuner
by the op's spec; this module holds the shared machinery.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

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


def log_distance(a: int, b: int) -> float:
    """|log2(a) − log2(b)|: how far apart two row counts are, for nearest-bucket lookup."""
    return abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))


def warps_for(elements: int, max_warps: int = 32, per_thread: int = 8) -> int:
    """Power-of-two warp count that gives each thread about ``per_thread`` of ``elements`` (1..max_warps)."""
    warps = 1
    while warps < max_warps and warps * 32 * per_thread < elements:
        warps *= 2
    return warps


class KernelConfig:
    """Base of an op's launch-settings dataclass (``@dataclass(frozen=True)`` subclasses).

    Field types are ``int`` or ``str``; ``from_dict`` checks them, the space's ``violations`` checks the values.
    """

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, as stored in tables."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Build from a table dict; ValueError on unknown, missing or ill-typed fields."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        fields = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
        unknown = set(data) - set(fields)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
        for key, value in data.items():
            kind = fields[key]
            if kind is int and (type(value) is not int or value < 0):
                raise ValueError(f"{cls.__name__}: {key} must be a non-negative int, got {value!r}")
            if kind is str and not isinstance(value, str):
                raise ValueError(f"{cls.__name__}: {key} must be a string, got {value!r}")
        try:
            return cls(**data)
        except TypeError as exc:  # a required field is missing
            raise ValueError(f"{cls.__name__}: {exc}") from None


class Space:
    """Search space, constraints and heuristic of one op at one feature shape and dtype.

    Subclasses set ``op`` (the name of its table), ``template`` (the template family, often ``op``),
    ``config_cls``, ``DIMS`` (names of the feature dims, in order), ``PARAMS``, and implement ``heuristic`` and
    ``shape_violations``. ``also_renders`` names the other templates whose kernels a config configures (fused
    linear cross-entropy's ``CE_*`` settings launch the cross-entropy kernels): every listed template's hash keys
    the op's tuned table, so editing any of them retires its entries.
    """

    op: ClassVar[str]
    template: ClassVar[str]
    also_renders: ClassVar[tuple[str, ...]] = ()
    config_cls: ClassVar[type]
    DIMS: ClassVar[tuple[str, ...]]
    PARAMS: ClassVar[tuple[Param, ...]]
    phases: ClassVar[tuple[str, ...]] = PHASES

    def __init__(self, dims: Mapping[str, int] | int, dtype: torch.dtype, limits: DeviceLimits | None = None):
        dims = normalize_dims(self.DIMS, dims)
        for name, value in dims.items():
            if type(value) is not int or value < 1:
                raise ValueError(f"{self.op}: dim {name} must be a positive int, got {value!r}")
        self.dims = dims
        self.dtype = dtype
        self.limits = limits or DeviceLimits()
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.check_dims()

    def check_dims(self) -> None:
        """Raise ValueError if the kernel family cannot handle these dims at all (subclasses extend)."""

    def params(self, phase: str) -> tuple[Param, ...]:
        """The tunables of one phase ("fwd" or "bwd")."""
        return tuple(p for p in self.PARAMS if p.phase == phase)

    def heuristic(self):
        """Analytic default config, valid for every supported shape."""
        raise NotImplementedError

    def shape_violations(self, config) -> list[str]:
        """Op-specific reasons ``config`` cannot run here (threads, registers, shared memory, block ≥ dim)."""
        return []

    def violations(self, config) -> list[str]:
        """Reasons ``config`` cannot run (or cannot run sensibly) on this device; empty when valid."""
        problems = []
        for param in self.PARAMS:  # bounds every value: a table cannot ask for 10^6 tiles or a 3-row arange
            value = getattr(config, param.name)
            if value not in param.choices or isinstance(value, bool):
                problems.append(f"{param.name}={value!r} is not one of {param.choices}")
        if problems:
            return problems
        return self.shape_violations(config)

    def fit_warps(self, warps: int, tile: int, min_elems_per_thread: int = 1) -> int:
        """Fewest of ``warps`` and what a ``tile`` of elements can feed with at least ``min_elems_per_thread``
        per thread, within the device's thread limit: the heuristics' warp rule."""
        while warps > 1 and tile < warps * 32 * min_elems_per_thread:
            warps //= 2
        return max(1, min(warps, self.limits.max_threads_per_block // 32))

    def threads_violations(self, phase: str, num_warps: int, tile: int, max_elems_per_thread: int) -> list[str]:
        """The common register/thread checks of a kernel holding a ``tile`` of fp32 values per program."""
        problems = []
        threads = num_warps * 32
        if threads > self.limits.max_threads_per_block:
            problems.append(f"{phase}: {threads} threads > device limit {self.limits.max_threads_per_block}")
        if tile < threads and num_warps > 1:
            problems.append(f"{phase}: tile of {tile} elements is smaller than {threads} threads")
        if tile / threads > max_elems_per_thread:
            problems.append(f"{phase}: {tile / threads:.0f} elements per thread > {max_elems_per_thread} (spills)")
        return problems

    def tile_violations(self, name: str, block_m: int, block_k: int, num_warps: int, n_cols: int,
                        max_elems_per_thread: int) -> list[str]:
        """The checks of a 2-D BLOCK_M x BLOCK_K tile over rows of ``n_cols`` (the FP8 cast and amax kernels'):
        no wider than max(16, next_power_of_2(n_cols)), then threads and registers."""
        widest = max(16, next_power_of_2(n_cols))
        problems = [f"{name}: BLOCK_K={block_k} > {widest} (next_power_of_2(n_cols={n_cols}))"] \
            if block_k > widest else []
        return problems + self.threads_violations(name, num_warps, block_m * block_k, max_elems_per_thread)

    def smem_violations(self, phase: str, smem: int) -> list[str]:
        """The shared-memory check: ``smem`` bytes a program of ``phase`` needs against the device limit."""
        if smem > self.limits.max_shared_memory_per_block:
            return [f"{phase}: ~{smem} B shared memory > device limit {self.limits.max_shared_memory_per_block}"]
        return []

    def suggest(self, trial, phase: str, base):
        """Sample the ``phase`` params from an Optuna trial, keeping the other phase's params from ``base``."""
        values: dict[str, Any] = {}
        for param in self.params(phase):
            if param.when is not None and values.get(param.when[0], getattr(base, param.when[0])) != param.when[1]:
                continue
            values[param.name] = trial.suggest_categorical(param.name, list(param.choices))
        return dataclasses.replace(base, **values)

    def phase_params(self, config, phase: str) -> dict[str, Any]:
        """The ``phase`` params of ``config`` as Optuna would sample them (for ``enqueue_trial``)."""
        data = config.to_dict()
        out: dict[str, Any] = {}
        for param in self.params(phase):
            if param.when is not None and out.get(param.when[0], data[param.when[0]]) != param.when[1]:
                continue
            out[param.name] = data[param.name]
        return out


def template_names(space: type[Space] | Space) -> tuple[str, ...]:
    """Every template whose kernels ``space``'s configs select: its own first, then ``also_renders``."""
    return (space.template, *space.also_renders)


def normalize_dims(names: tuple[str, ...], dims: Mapping[str, int] | int) -> dict[str, int]:
    """``dims`` as a dict with exactly ``names`` as keys; a bare int is allowed for one-dim ops."""
    if isinstance(dims, int) and not isinstance(dims, bool):
        if len(names) != 1:
            raise ValueError(f"expected dims {names}, got the single value {dims}")
        return {names[0]: dims}
    if not isinstance(dims, Mapping) or set(dims) != set(names):
        raise ValueError(f"expected dims with keys {names}, got {dims!r}")
    return {name: dims[name] for name in names}
