"""The table side of tuning: the entries of the tables a run replaces (its priors), and the merge of new entries
into ``<out_root>/<gpu>/<op>.json`` through ``liger_gen.runtime.tables``' reader and writer (lock, atomic write,
trial log beside the table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from liger_gen.codegen.spaces import dtype_name
from liger_gen.codegen.spec import OpSpec
from liger_gen.tuning.search import Tuner


def problem_key(problem) -> tuple:
    """The table key of the entry ``problem`` gives (``tables.entry_sort_key`` of it)."""
    from liger_gen.runtime.tables import entry_sort_key

    return entry_sort_key({"dtype": dtype_name(problem.dtype), "dims": dict(problem.dims), "rows": problem.rows,
                           "variant": dict(problem.variant)})


def prior_entries(specs: Iterable[OpSpec], roots: Iterable[Any], gpu: str, *,
                  trials: bool = True) -> dict[str, dict[tuple, dict]]:
    """op → entry key → the whole entry of the tables for ``gpu`` found under ``roots`` (the first root holding
    an entry wins), whatever template or Triton version they were tuned with; with ``trials``, with their
    trial-log fields (what ``Tuner.refresh`` re-times). Unreadable tables are skipped."""
    from liger_gen.runtime import tables

    roots = list(roots)
    out: dict[str, dict[tuple, dict]] = {}
    for spec in specs:
        found: dict[tuple, dict] = {}
        for root in roots:
            path = tables.table_path(root, gpu, spec.name)
            try:
                table = tables.load_table(path, spec.space)
            except tables.TableError:
                continue
            if table["op"] != spec.name:
                continue
            for entry in (tables.with_trials(path, table) if trials else table)["entries"]:
                found.setdefault(tables.entry_sort_key(entry), entry)
        out[spec.name] = found
    return out


def prior_configs(specs: Iterable[OpSpec], roots: Iterable[Any], gpu: str) -> dict[str, dict[tuple, dict]]:
    """op → entry key → config of ``prior_entries`` (no trial logs read): a re-tune starts from what won before,
    and every prior is re-validated and re-measured like any other trial."""
    return {op: {key: entry["config"] for key, entry in found.items()}
            for op, found in prior_entries(specs, roots, gpu, trials=False).items()}


def neighbour_priors(priors: Mapping[tuple, Mapping[str, Any]], problem) -> list[dict[str, Any]]:
    """The priors of one op (entry key → config, ``prior_configs``) tuned at other dims than ``problem``'s, nearest
    first (``tables.neighbour_entries``), as ``{"dims", "rows", "config"}``: what ``Tuner.tune`` times beside the
    heuristic at a shape no table has."""
    from liger_gen.runtime import tables

    entries = [{"dtype": key[0], "dims": dict(key[1]), "variant": dict(key[2]), "rows": key[3], "config": config}
               for key, config in priors.items()]
    return [{k: e[k] for k in ("dims", "rows", "config")}
            for e in tables.neighbour_entries(entries, problem.dtype, dict(problem.dims), problem.rows,
                                              dict(problem.variant))]


def merge_entries(table: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """``table`` with ``entries`` added, replacing any entry of the same (dtype, dims, variant, rows)."""
    from liger_gen.runtime.tables import entry_sort_key as key
    fresh = {key(e) for e in entries}
    return {**table, "entries": [e for e in table["entries"] if key(e) not in fresh] + list(entries)}


def write_entries(space, entries: list[dict[str, Any]], out_root, *, gpu: str, device_name: str,
                  compute_capability: str) -> Path:
    """Merge ``entries`` into ``<out_root>/<gpu>/<op>.json`` for ``space``'s op (an op spec's ``space``; atomic
    write, trial logs to ``<op>.trials.json``), re-read it; returns the path.

    An existing table is kept and extended only if it belongs to this GPU, the current templates and Triton
    version; otherwise it is replaced. The read, merge and write happen under the table's lock (``tables.locked``), so
    tuners writing the same table at once keep each other's entries.
    """
    from liger_gen.runtime import tables

    path = tables.table_path(out_root, gpu, space.op)
    table = tables.new_table(space, gpu, device_name, compute_capability)
    with tables.locked(path):
        try:
            old = tables.load_table(path, space)
            if not tables.foreign_reasons(old, space=space, gpu=gpu, strict=True):
                table["entries"] = tables.with_trials(path, old)["entries"]
        except tables.TableError:  # missing, corrupt or foreign: replaced
            pass
        tables.write_table(path, merge_entries(table, entries))
        tables.load_table(path)  # re-read: what was written must parse
    tables.clear_caches()
    return path


def tune_to_table(space, problems: Iterable, out_root, *, gpu: str, device_name: str, compute_capability: str,
                  tuner: Tuner) -> tuple[Any, list[dict[str, Any]]]:
    """Tune every problem in this process and merge the entries into ``space``'s table
    ``<out_root>/<gpu>/<op>.json``.

    Returns (path, new entries). ``problems`` may be a generator that builds each problem (GPU buffers) after
    the last is freed.
    """
    entries = []
    for problem in problems:
        entries.append(tuner.tune(problem))
        del problem
    path = write_entries(space, entries, out_root, gpu=gpu, device_name=device_name,
                         compute_capability=compute_capability)
    return path, entries
