"""The op spec: the one declared object per op that the tuner, the runtime, the bench and the tests read.

Each module under ``liger_gen/ops`` ends its tuning section with ``SPEC = OpSpec(...)``. The machinery below
``ops/`` (``codegen``, ``runtime``) is handed a spec or its space and never looks an op up by name, so it never
imports ``liger_gen.ops``; only the entry points (the CLI, the bench, the tests) resolve names, through
``liger_gen.ops.get_spec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from liger_gen.codegen.problems import Problem
from liger_gen.codegen.spaces import Space


@dataclass(frozen=True)
class OpSpec:
    """One op, end to end.

    name: the op's name; also its table's (``tuned/<gpu>/<name>.json``) and its bench case's.
    space: the search space class (params, constraints, heuristic; ``space.template`` and
        ``space.also_renders`` name every template whose hash keys the table).
    problem: the tuning problem class (inputs, float64 truth, launchers, bytes moved at one shape).
    tuning_problems: ``(model, rows, dtype, device, seed) -> [Problem]``, the problems a model's shapes give.
    custom_ops: the qualified names of the ``torch.library`` custom ops the binding registers
        (``"liger_gen::rms_norm_fwd"``, ...), which the contract tests check with ``opcheck``.
    max_tuning_rows: token counts above this are tuned at this many rows (None: no cap).
    rows_cap: ``model -> int``, a shape-dependent cap applied on top (e.g. rows·vocab elements).
    """

    name: str
    space: type[Space]
    problem: type[Problem]
    tuning_problems: Callable[..., list[Problem]]
    custom_ops: tuple[str, ...] = ()
    max_tuning_rows: int | None = None
    rows_cap: Callable[[Any], int] | None = None

    def tuning_rows(self, model: Any, rows: Sequence[int]) -> list[int]:
        """The distinct token counts the op is tuned at for ``rows``, in their order (caps applied)."""
        cap = self.max_tuning_rows
        if self.rows_cap is not None:
            shape_cap = int(self.rows_cap(model))
            cap = shape_cap if cap is None else min(cap, shape_cap)
        return capped_rows(rows, cap)


def capped_rows(rows: Sequence[int], cap: int | None) -> list[int]:
    """The distinct values of ``rows`` capped at ``cap`` (None: no cap) and at least 1, in their order."""
    out: list[int] = []
    for r in rows:
        r = max(1, int(r) if cap is None else min(int(r), cap))
        if r not in out:
            out.append(r)
    return out
