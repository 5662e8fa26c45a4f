"""Tuned tables: file name → load → validate → nearest entry → heuristic.

One JSON file per GPU and op, ``<root>/<gpu>/<op>.json``. The file records its key fields inside::

    {"format_version": 3, "op": "rms_norm", "gpu": "h200", "device_name": "NVIDIA H200",
     "compute_capability": "9.0", "triton_version": "3.6.0", "torch_version": "2.11.0+cu130",
     "template_hashes": {"rms_norm": "..."}, "created": "2026-11-29T23:10:00Z",
     "entries": [{"dtype": "bfloat16", "dims": {"n_cols": 4096}, "rows": 16384,
                  "variant": {"casting_mode": "llama"}, "config": {...}, "heuristic": {...},
                  "timing_ms": {...}, "timing_method": {...}, "bytes": {...}}, ...]}

``template_hashes`` holds the hash of every template the op's configs select (its own, and the ``also_renders``
of its space: fused linear cross-entropy's table is keyed by its template and cross-entropy's). The tuner's
trial logs (``trials``, ``search``, ``retime`` of each entry) go to ``<op>.trials.json`` beside the table, which
the runtime never reads (``liger-gen show --trials`` does).

The runtime is handed the op's space class (``spec.space``), never an op name to look up. Lookup contract
(``lookup``): ``$LIGER_GEN_TUNED_DIR`` first, then ``user_tables_root()`` (where ``liger-gen tune`` writes in an
installed package), then the tables packaged in ``liger_gen/tuned``, then the space's analytic heuristic. A table is used only if its op, GPU and template hashes match the running ones; otherwise it
is skipped with one warning and the next source is tried. A table tuned under another Triton major.minor version
is still used, with one notice (its configs are re-checked against the constraints like every config, and every
valid config computes the right answer; only its speed was measured under the other version), unless
``LIGER_GEN_STRICT_TABLES=1`` makes that a reason to skip it too. Feature
dims (``dims``, e.g. ``{"n_cols": 4096}``) and dtype are matched exactly first; entries tuned with the same
render-time options (``variant``, e.g. the casting mode) are preferred; rows pick the nearest tuned bucket in log
distance. For dims no table has, the entry tuned at the nearest other dims (``neighbour_entries``) is used in
place of the heuristic only where the table itself shows that this beats the heuristic (``nearest_evidence``:
the tuner times the nearest tuned config beside the heuristic at every new shape it tunes).
A corrupt, ill-formed, unreadable or oversized file (over ``MAX_TABLE_BYTES``, or not a regular file) warns and is
skipped: training never crashes, and never runs a wrong kernel, because of a table. Every key field is checked for
its form, and every config taken from a table is re-checked against the space's constraints before use. Writers
merge under an exclusive lock on the table's folder (``fcntl.flock``, released by the kernel when a writer dies),
so concurrent tuners keep every entry.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import math
import os
import re
import stat
import threading
import warnings
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

import torch
import triton

from liger_gen.codegen.render import template_hash
from liger_gen.codegen.spaces import (DeviceLimits, Space, dtype_from_name, dtype_name, log_distance,
                                      template_names)
from liger_gen.files import not_private, read_capped_text, write_atomic
from liger_gen.runtime.devices import GPU_SLUG

FORMAT_VERSION = 3
#: Entry fields that are the tuner's logs: written to ``<op>.trials.json``, not to the table.
TRIAL_FIELDS = ("trials", "search", "retime")
ENV_TUNED_DIR = "LIGER_GEN_TUNED_DIR"
#: Larger files are not read (the packaged tables are ~0.1 MB; a 100 MB table would cost seconds and GBs per rank).
MAX_TABLE_BYTES = 16 * 2**20
#: The nearest-dims rule (``nearest_evidence``): at least this many of a table's entries must have timed the config
#: tuned at their nearest other dims beside the heuristic, and those configs must have been faster by this
#: fraction (geometric mean of forward + backward time ratios), for the runtime to use a neighbouring entry.
NEAREST_MIN_EVIDENCE = 3
NEAREST_MARGIN = 0.02

# the form of each key field: what ``new_table`` writes (a Triton version may carry a local suffix: 3.6.0+gitabc)
_KEY_FORMS = {
    "op": re.compile(r"[a-z][a-z0-9_]*"),
    "gpu": GPU_SLUG,  # every name canonical_gpu_name gives
    "triton_version": re.compile(r"\d+\.\d+(\.\d+)?([.+-][0-9A-Za-z.+-]*)?"),
}
_OPTIONAL_FORMS = {"compute_capability": re.compile(r"\d+\.\d+")}


class TunedTableWarning(UserWarning):
    """A tuned table was missing, foreign or corrupt; the heuristic (or the next table) is used instead."""


class TableError(ValueError):
    """A table file cannot be read or does not have the expected structure."""


_warned: set[str] = set()
_warn_lock = threading.Lock()
_heuristic_only_depth = 0  # process-wide: autograd runs backward ops on its own threads


def _warn_once(message: str) -> None:
    with _warn_lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, TunedTableWarning, stacklevel=3)


def reset_warnings() -> None:
    """Forget which warnings were given (tests use this)."""
    with _warn_lock:
        _warned.clear()


_HASH_FORM = re.compile(r"[0-9a-f]{16}")


def template_hashes(space: type[Space]) -> dict[str, str]:
    """{template name: source hash} of every template ``space``'s configs select: what keys its table."""
    return {name: template_hash(name) for name in template_names(space)}


def triton_major_minor(version: str | None = None) -> str:
    """'3.6' for Triton 3.6.0 (the running Triton's when ``version`` is None): tables are valid across patch
    releases, not across minor ones."""
    parts = (triton.__version__ if version is None else version).split(".")
    return ".".join(parts[:2])


def packaged_root() -> Path:
    """Folder of the tables shipped inside the package (``liger_gen/tuned``)."""
    return Path(str(resources.files("liger_gen") / "tuned"))


def user_tables_root() -> Path:
    """``$XDG_DATA_HOME/liger-gen/tuned`` (default ``~/.local/share/liger-gen/tuned``): where ``liger-gen tune``
    writes when the package folder is an installed one (site-packages) or not writable."""
    base = os.environ.get("XDG_DATA_HOME")
    if not base:
        try:
            base = str(Path.home() / ".local" / "share")
        except RuntimeError:  # no $HOME and no passwd entry
            return Path(os.devnull) / "liger-gen" / "tuned"
    return Path(base) / "liger-gen" / "tuned"


def default_tune_root() -> Path:
    """Where ``liger-gen tune`` writes without ``--out``: the package's ``tuned/`` folder in a source checkout
    that can be written, else ``user_tables_root()`` (never into site-packages)."""
    root = packaged_root()
    installed = any(part in ("site-packages", "dist-packages") for part in root.resolve().parts)
    if not installed and os.access(root, os.W_OK):
        return root
    return user_tables_root()


def inspect_folder(path: Path) -> tuple[os.stat_result | None, str | None]:
    """(its ``os.stat``, None) when ``path`` is a folder; (None, None) when nothing is there (no such path, or a
    path through a regular file); (None, why) when something else is there or the path cannot be looked at (a
    name over the system's limit, a folder above it that may not be entered). The one check of a tables folder
    for the runtime (``table_roots``) and ``liger-gen verify``: a folder that cannot be looked at holds no table
    the runtime could read, so it is a notice, never an error."""
    try:
        st = Path(path).stat()
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    except (OSError, ValueError) as exc:  # ENAMETOOLONG, EACCES, ELOOP, an I/O error; ValueError: a NUL byte
        return None, f"cannot be read ({type(exc).__name__}: {getattr(exc, 'strerror', None) or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return None, f"is not a folder (mode {stat.filemode(st.st_mode)})"
    return st, None


def user_root_status(path: Path) -> tuple[str, str | None]:
    """(status, why) of the user tables folder at ``path``, the runtime's rule for it (``table_roots``): "used"
    (a folder of yours that others cannot write), "absent", "unreadable" (something is there that is not a
    folder or cannot be looked at: ``inspect_folder``'s why) or "not private" (another user's, or writable by
    group or others: why)."""
    st, why = inspect_folder(path)
    if st is None:
        return ("unreadable", why) if why else ("absent", None)
    reason = not_private(st)
    if reason:
        return "not private", f"it is {reason}; it must belong to you and not be writable by group or others"
    return "used", None


def _private_dir(path: Path) -> bool:
    """Whether the user tables folder at ``path`` is looked up (``user_root_status``); warns once about one that
    is not private."""
    status, why = user_root_status(path)
    if status == "not private":
        _warn_once(f"liger-gen: ignoring the tables folder {path}: {why}")
    return status == "used"


def table_roots() -> list[tuple[str, Path]]:
    """Where tables are looked for, in order: ('user', $LIGER_GEN_TUNED_DIR) if set; ('user',
    ``user_tables_root()``) if that folder exists, is yours and is not writable by others; ('packaged', ...)."""
    roots = []
    env = os.environ.get(ENV_TUNED_DIR)
    if env:
        roots.append(("user", Path(env)))
    default = user_tables_root()
    if (not env or Path(env) != default) and _private_dir(default):
        roots.append(("user", default))
    roots.append(("packaged", packaged_root()))
    return roots


def table_files(folder: Path) -> list[Path]:
    """The table files of one GPU's folder, sorted: its ``*.json`` files other than trial logs (``[]`` when the
    folder does not exist; OSError when it cannot be listed)."""
    folder = Path(folder)
    return sorted(p for p in folder.glob("*.json") if not p.name.endswith(".trials.json")) \
        if folder.is_dir() else []


def gpus_with_tables(ops, roots: list[tuple[str, Path]] | None = None) -> list[str]:
    """The GPU names (folder names) under ``roots`` (default: ``table_roots()``) that hold a table of one of
    ``ops`` (op names: this installation's), sorted; a folder with only trial logs or other JSON files does not
    count."""
    ops = set(ops)
    found = set()
    for _, root in table_roots() if roots is None else roots:
        try:
            folders = [p for p in Path(root).iterdir() if p.is_dir()] if Path(root).is_dir() else []
            found.update(p.name for p in folders if any(f.stem in ops for f in table_files(p)))
        except OSError:  # an unreadable folder holds no table the runtime could read
            continue
    return sorted(found)


def no_tables_message(gpu: str, ops, roots: list[tuple[str, Path]] | None = None) -> str:
    """What to say when no folder looked up holds a table for ``gpu``: the GPUs that have tables and, for a name
    that is not a known GPU, the closest one ("did you mean h200?"); a misspelt name is a valid name for some
    other GPU, so it is not an error by itself. ``ops``: the op names whose tables count (``gpus_with_tables``)."""
    import difflib

    from liger_gen.runtime.devices import KNOWN_GPUS

    have = gpus_with_tables(ops, roots)
    close = (difflib.get_close_matches(gpu, have, n=1, cutoff=0.5)  # a GPU that has tables first
             or difflib.get_close_matches(gpu, list(KNOWN_GPUS), n=1, cutoff=0.6))
    hint = f"; did you mean {close[0]}?" if close and close[0] != gpu and gpu not in KNOWN_GPUS else ""
    return (f"no tuned tables for {gpu!r} in any folder looked up (tables exist for: {', '.join(have) or 'none'})"
            f"{hint}")


def table_path(root: Path, gpu: str, op: str) -> Path:
    """``<root>/<gpu>/<op>.json``."""
    return Path(root) / gpu / f"{op}.json"


def trials_path(path: Path) -> Path:
    """The trial log beside the table at ``path``: ``<op>.trials.json``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.trials.json")


def read_table_text(path: Path) -> str:
    """The text of a table file (``liger_gen.files.read_capped_text``): OSError if it cannot be opened; TableError
    if it is not a regular file, is larger than MAX_TABLE_BYTES or is not UTF-8."""
    try:
        return read_capped_text(path, MAX_TABLE_BYTES, "tuned table")
    except ValueError as exc:
        raise TableError(f"{exc}" + (" (tables hold configs; trial logs belong beside them)"
                                     if "more than the" in str(exc) else "")) from exc


def load_table(path: Path, space: type[Space] | None = None) -> dict[str, Any]:
    """Read and structurally check a table; TableError (with the path) if it cannot be read or is not valid JSON
    of our format, or if a key field does not have its form (e.g. an empty ``triton_version``).

    A table of the previous format (2: one ``template_hash``, trial logs inside the entries) is read as format 3
    when ``space`` says which template that hash was of (its ``template``); without it, it is a TableError."""
    try:
        data = json.loads(read_table_text(Path(path)))
    except TableError:
        raise
    except (OSError, ValueError, RecursionError) as exc:  # ValueError covers JSON and int-size errors
        raise TableError(f"cannot read tuned table {path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict):
        raise TableError(f"tuned table {path}: top level is {type(data).__name__}, expected an object")
    if (space is not None and data.get("format_version") == 2 and isinstance(data.get("template_hash"), str)
            and "template_hashes" not in data):
        data["template_hashes"] = {space.template: data.pop("template_hash")}
        data["format_version"] = FORMAT_VERSION
    for field, kind in (("format_version", int), ("op", str), ("gpu", str), ("template_hashes", dict),
                        ("triton_version", str), ("entries", list)):
        if field not in data:
            raise TableError(f"tuned table {path}: missing field {field!r}")
        if type(data[field]) is not kind:
            raise TableError(f"tuned table {path}: field {field!r} is {type(data[field]).__name__}, "
                             f"expected {kind.__name__}")
    if data["format_version"] != FORMAT_VERSION:
        raise TableError(f"tuned table {path}: format_version {data['format_version']!r}, expected {FORMAT_VERSION}")
    for field, form in (*_KEY_FORMS.items(), *_OPTIONAL_FORMS.items()):
        if field not in data and field in _OPTIONAL_FORMS:
            continue
        if not isinstance(data[field], str) or not form.fullmatch(data[field]):
            raise TableError(f"tuned table {path}: field {field!r} is {data[field]!r}, which is not of the form "
                             f"{form.pattern!r}")
    hashes = data["template_hashes"]
    if not hashes or not all(isinstance(k, str) and isinstance(v, str) and _HASH_FORM.fullmatch(v)
                             for k, v in hashes.items()):
        raise TableError(f"tuned table {path}: field 'template_hashes' must map template names to 16-digit hex "
                         f"hashes, got {hashes!r}")
    for field in ("device_name", "torch_version", "created"):
        if field in data and not isinstance(data[field], str):
            raise TableError(f"tuned table {path}: field {field!r} is {type(data[field]).__name__}, expected str")
    for i, entry in enumerate(data["entries"]):
        if not isinstance(entry, dict) or not {"dtype", "dims", "rows", "config"} <= set(entry):
            raise TableError(f"tuned table {path}: entry {i} lacks dtype/dims/rows/config")
        if (type(entry["rows"]) is not int or entry["rows"] < 1 or not isinstance(entry["dims"], dict)
                or not all(type(v) is int for v in entry["dims"].values())
                or not isinstance(entry.get("variant", {}), dict)
                or not isinstance(entry["dtype"], str) or not isinstance(entry["config"], dict)):
            raise TableError(f"tuned table {path}: entry {i} has a bad dtype/dims/rows/variant/config")
    return data


STRICT_TABLES_ENV = "LIGER_GEN_STRICT_TABLES"


def strict_tables() -> bool:
    """Whether ``$LIGER_GEN_STRICT_TABLES`` (1, true, yes or on) asks to refuse tables tuned under another Triton
    version."""
    return os.environ.get(STRICT_TABLES_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def triton_mismatch(table: dict[str, Any]) -> str | None:
    """"tuned with Triton X, running Triton Y" when the table's Triton major.minor is not the running one."""
    if triton_major_minor(str(table["triton_version"])) != triton_major_minor():
        return f"tuned with Triton {table['triton_version']}, running Triton {triton.__version__}"
    return None


def foreign_reasons(table: dict[str, Any], *, space: type[Space], gpu: str, strict: bool | None = None) -> list[str]:
    """Why a table does not belong to ``space``'s op, this GPU and the current templates (empty when it does).
    Another Triton major.minor version is a reason only when ``strict`` (None: ``strict_tables()``)."""
    reasons = []
    if table["op"] != space.op:
        reasons.append(f"op {table['op']!r} != {space.op!r}")
    if table["gpu"] != gpu:
        reasons.append(f"tuned on GPU {table['gpu']!r}, running on {gpu!r}")
    current = template_hashes(space)
    if table["template_hashes"] != current:
        changed = sorted(set(current) | set(table["template_hashes"]))
        changed = [n for n in changed if table["template_hashes"].get(n) != current.get(n)]
        reasons.append("template hashes differ for " + ", ".join(
            f"{n} ({table['template_hashes'].get(n, 'absent')} != current {current.get(n, 'absent')})"
            for n in changed) + " (template changed)")
    mismatch = triton_mismatch(table)
    if mismatch and (strict_tables() if strict is None else strict):
        reasons.append(mismatch + f" (${STRICT_TABLES_ENV} is set)" if strict is None else mismatch)
    return reasons


def nearest_entry(table: dict[str, Any], dtype: torch.dtype, dims: dict[str, int], rows: int,
                  variant: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Entry with the same dtype and dims whose rows bucket is nearest to ``rows`` in log2 distance.

    Entries tuned with the same ``variant`` options are preferred over others. Ties go to the larger bucket.
    None when no entry has this dtype and dims.
    """
    name = dtype_name(dtype)
    candidates = [e for e in table["entries"] if e["dtype"] == name and e["dims"] == dims]
    same_variant = [e for e in candidates if e.get("variant", {}) == (variant or {})]
    candidates = same_variant or candidates
    if not candidates:
        return None
    return min(candidates, key=lambda e: (log_distance(e["rows"], rows), -e["rows"]))


def _variant_key(variant: Any) -> tuple:
    return tuple(sorted((str(k), str(v)) for k, v in (variant or {}).items()))


def dims_distance(a: dict[str, int], b: dict[str, int]) -> float:
    """Sum over the dims of |log2(a) − log2(b)|; inf when the dim names differ or a size is not positive."""
    if set(a) != set(b) or not all(type(v) is int and v > 0 for v in (*a.values(), *b.values())):
        return math.inf
    return sum(abs(math.log2(a[k]) - math.log2(b[k])) for k in a)


def neighbour_entries(entries: list[dict[str, Any]], dtype: torch.dtype | str, dims: dict[str, int], rows: int,
                      variant: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Entries of ``dtype`` tuned at other dims with the same dim names, nearest first.

    Order: same ``variant`` first, then ``dims_distance`` to ``dims``, then the rows bucket's log2 distance to
    ``rows`` (ties: the larger dims, then the larger bucket). Entries at exactly ``dims`` are not neighbours."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    want = _variant_key(variant)
    found = []
    for e in entries:
        if e.get("dtype") != name or not isinstance(e.get("dims"), dict) or e["dims"] == dims:
            continue
        distance = dims_distance(e["dims"], dims)
        if math.isfinite(distance):
            found.append(((_variant_key(e.get("variant")) != want, distance, log_distance(e["rows"], rows),
                           tuple(-v for _, v in sorted(e["dims"].items())), -e["rows"]), e))
    return [e for _, e in sorted(found, key=lambda pair: pair[0])]


def _phase_total(timing: Any, which: str) -> float | None:
    """Forward + backward ms of ``which`` in an entry's ``timing_ms``; None unless every phase holds a finite,
    non-negative number (not a bool or a string) and the sum is positive and finite."""
    if not isinstance(timing, dict) or not timing:
        return None
    values = []
    for t in timing.values():
        value = t.get(which) if isinstance(t, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        try:
            value = float(value)
        except OverflowError:  # an int too large for a float
            return None
        if not (math.isfinite(value) and value >= 0):
            return None
        values.append(value)
    total = sum(values)
    return total if math.isfinite(total) and total > 0 else None


def _current_heuristic(entry: dict[str, Any], space: type[Space] | None, limits: DeviceLimits | None) -> bool:
    """Whether ``entry`` recorded the heuristic that ``space`` gives at its dims now (True without a space)."""
    if space is None:
        return True
    try:
        return space(entry["dims"], dtype_from_name(entry["dtype"]), limits).heuristic().to_dict() == entry["heuristic"]
    except Exception:  # noqa: BLE001 - a hand-edited entry, or dims this space rejects: not evidence
        return False


def nearest_evidence(table: dict[str, Any], space: type[Space] | None = None,
                     limits: DeviceLimits | None = None) -> tuple[int, float | None]:
    """(entries, geometric mean of nearest / heuristic): how the config tuned at the nearest other dims did
    against the heuristic, over the entries whose tuning timed both (``timing_ms[phase]["nearest"]``, forward +
    backward ms). With ``space`` (the op's space class), only entries whose recorded heuristic is the one the
    space gives now count: a changed heuristic makes the old comparisons stale. (0, None) when none count."""
    logs = []
    for e in table.get("entries", []):
        timing = e.get("timing_ms") if isinstance(e, dict) else None
        nearest, heuristic = _phase_total(timing, "nearest"), _phase_total(timing, "heuristic")
        if nearest is not None and heuristic is not None and _current_heuristic(e, space, limits):
            logs.append(math.log(nearest) - math.log(heuristic))  # not log(n / h): that ratio may under/overflow
    if not logs:
        return 0, None
    mean = math.fsum(logs) / len(logs)
    return len(logs), (math.exp(mean) if mean < 709 else math.inf)  # exp overflows past ~709.78


def nearest_allowed(table: dict[str, Any], space: type[Space] | None = None,
                    limits: DeviceLimits | None = None) -> bool:
    """Whether ``table``'s own measurements let the runtime use a neighbouring entry for dims it lacks: at least
    ``NEAREST_MIN_EVIDENCE`` entries (``nearest_evidence``), and the nearest configs faster than the heuristic by
    ``NEAREST_MARGIN``."""
    count, ratio = nearest_evidence(table, space, limits)
    return count >= NEAREST_MIN_EVIDENCE and ratio is not None and ratio <= 1 - NEAREST_MARGIN


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock for a read-merge-write of the table at ``path`` (blocks while another writer holds it).

    The lock is ``fcntl.flock`` on the table's folder itself (no lock file is left beside the tables): the kernel
    releases it when its holder exits or is killed, so a dead tuner never blocks the next. Where ``fcntl`` does
    not exist (Windows) the block runs unlocked.
    """
    folder = Path(path).parent
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def write_table(path: Path, table: dict[str, Any]) -> None:
    """Write a table and its trial log atomically (each: temp file in the same folder + rename), keys sorted,
    entries in key order. Entry fields in ``TRIAL_FIELDS`` go to ``trials_path(path)``, the rest to ``path``.
    The trial log is written first (and removed when no entry has one, so no stale log outlives its entries); a
    log that cannot be written warns, and the table is written all the same."""
    path = Path(path)
    entries = sorted(table["entries"], key=entry_sort_key)
    shipped = [{k: v for k, v in e.items() if k not in TRIAL_FIELDS} for e in entries]
    logs = [{**_entry_key_fields(e), **{k: e[k] for k in TRIAL_FIELDS if k in e}} for e in entries]
    header = {k: v for k, v in table.items() if k != "entries"}
    log_path = trials_path(path)
    try:
        if any(len(log) > len(_entry_key_fields(log)) for log in logs):
            write_atomic(log_path, json.dumps({**header, "entries": logs}, indent=1, sort_keys=True) + "\n")
        elif log_path.is_file():  # no entry has a log now: an old one would be read back as theirs
            log_path.unlink()
    except OSError as exc:  # e.g. a folder in its place: the log is lost, the table is not
        warnings.warn(f"liger-gen: cannot write the trial log {log_path}: {type(exc).__name__}: {exc}; the table "
                      f"is written without it", TunedTableWarning, stacklevel=2)
    write_atomic(path, json.dumps({**header, "entries": shipped}, indent=1, sort_keys=True) + "\n")


def _entry_key_fields(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: entry[k] for k in ("dtype", "dims", "rows", "variant") if k in entry}


def with_trials(path: Path, table: dict[str, Any]) -> dict[str, Any]:
    """``table`` (loaded from ``path``) with each entry's trial-log fields read back from ``<op>.trials.json``
    (entries whose log is missing, or a log that cannot be read, keep only their table fields)."""
    try:
        logs = load_trials(path)
    except TableError:
        return table
    merged = [{**logs.get(entry_sort_key(e), {}), **e} for e in table["entries"]]
    return {**table, "entries": merged}


def load_trials(path: Path) -> dict[tuple, dict[str, Any]]:
    """entry key → trial-log fields, from the trial log beside the table at ``path``; TableError if it cannot be
    read or is not a JSON object with a list of entries."""
    where = trials_path(path)
    try:
        data = json.loads(read_table_text(where))
    except TableError:
        raise
    except (OSError, ValueError, RecursionError) as exc:
        raise TableError(f"cannot read trial log {where}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise TableError(f"trial log {where}: expected an object with a list of entries")
    out = {}
    for e in data["entries"]:
        try:
            out[entry_sort_key(e)] = {k: e[k] for k in TRIAL_FIELDS if k in e}
        except (KeyError, TypeError, AttributeError):
            continue  # a malformed log entry is only a missing log
    return out


def entry_sort_key(entry: dict[str, Any]) -> tuple:
    """Order of entries in a file: dtype, dims, variant, rows."""
    return (entry["dtype"], tuple(sorted(entry["dims"].items())),
            tuple(sorted((k, str(v)) for k, v in entry.get("variant", {}).items())), entry["rows"])


def new_table(space: type[Space], gpu: str, device_name: str, compute_capability: str) -> dict[str, Any]:
    """An empty table for ``space``'s op stamped with this process's versions and the current template hashes."""
    return {
        "format_version": FORMAT_VERSION,
        "op": space.op,
        "gpu": gpu,
        "device_name": device_name,
        "compute_capability": compute_capability,
        "triton_version": triton.__version__,
        "torch_version": torch.__version__,
        "template_hashes": template_hashes(space),
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "entries": [],
    }


@contextlib.contextmanager
def heuristic_only() -> Iterator[None]:
    """Inside this block the runtime ignores tuned tables and launches the heuristic config.

    The switch is process-wide, not per thread, because autograd runs backward ops on worker threads.
    """
    global _heuristic_only_depth
    with _warn_lock:
        _heuristic_only_depth += 1
    try:
        yield
    finally:
        with _warn_lock:
            _heuristic_only_depth -= 1


def heuristic_only_enabled() -> bool:
    """True inside ``heuristic_only()``."""
    return _heuristic_only_depth > 0


def check_table_file(path: Path, space: type[Space], gpu: str) -> tuple[dict[str, Any] | None, str | None, str]:
    """(table, problem, notice) of the file at ``path`` for ``space``'s op on ``gpu``: the table when it is there,
    parses and belongs here (else None); ``problem`` why it is not used (None: usable, or no file at all);
    ``notice`` a non-blocking remark (another Triton version) or ""."""
    try:
        table = load_table(path, space)
    except TableError as exc:
        cause = exc.__cause__
        if isinstance(cause, (FileNotFoundError, NotADirectoryError)):
            return None, None, ""  # no table here: the next source is tried
        if isinstance(cause, OSError):  # permission denied, a name too long, an I/O error: never fatal
            return None, f"unreadable tuned table location {path}: {type(cause).__name__}: {cause}", ""
        return None, f"corrupt tuned table: {exc}", ""
    reasons = foreign_reasons(table, space=space, gpu=gpu)
    if reasons:
        return None, f"tuned table {path}: " + "; ".join(reasons), ""
    return table, None, triton_mismatch(table) or ""


@functools.lru_cache(maxsize=64)
def _load_for(path: str, space: type[Space], gpu: str) -> dict[str, Any] | None:
    """Cached: the table at ``path`` if it exists, parses and belongs to (space's op and templates, gpu); else
    None. Warns once about a table it skips, and once about one tuned under another Triton version."""
    p = Path(path)
    table, problem, notice = check_table_file(p, space, gpu)
    if problem:
        _warn_once(f"liger-gen: ignoring {problem}")
    if notice:
        _warn_once(f"liger-gen: using tuned table {p}, {notice}: its configs are valid here (each is re-checked "
                   f"against the constraints) but were timed under the other version; re-tune with `liger-gen "
                   f"tune` for this one, or set {STRICT_TABLES_ENV}=1 to refuse such tables")
    return table


def entry_config(space: Space, entry: dict[str, Any]) -> tuple[Any, list[str]]:
    """(config, problems) of a table entry for ``space`` (an instance at the call's dims): the problems are the
    constraint violations, or the error a hand-edited entry raised; the config is None then."""
    try:
        config = space.config_cls.from_dict(entry["config"])
        problems = space.violations(config)
    except Exception as exc:  # whatever a hand-edited entry holds, it must not reach training
        return None, [f"{type(exc).__name__}: {exc}"]
    return (None if problems else config), problems


def _holds_tables(folder: Path) -> bool:
    """``folder`` holds a table file (``table_files``); False where it cannot be listed (a lookup never raises
    because of a table)."""
    try:
        return bool(table_files(folder))
    except OSError:
        return False


def lookup(space: type[Space], dtype: torch.dtype, dims: dict[str, int] | int, rows: int, gpu: str | None,
           limits: DeviceLimits | None = None, *, variant: dict[str, Any] | None = None) -> dict[str, Any]:
    """Pick the launch config of ``space``'s op (an op spec's ``space``) for one call shape; never raises because
    of a table.

    Returns ``{"source": "user"|"packaged"|"heuristic", "path": str|None, "rows": tuned bucket or None,
    "config": <space config object>}``, with ``"dims"`` (the entry's dims) when a neighbouring entry stood in for
    dims no table has (``nearest_allowed``). ``gpu`` is the canonical GPU name, or None (interpreter / no GPU),
    in which case only the heuristic applies.
    """
    op = space.op
    space_cls, space = space, space(dims, dtype, limits)
    dims = space.dims
    if gpu is not None and not heuristic_only_enabled():
        without = []  # (source, path, table) of the tables with no entry at these dims
        tables_found = False  # a table of the op for this GPU, in any folder
        for source, root in table_roots():
            path = table_path(root, gpu, op)
            table = _load_for(str(path), space_cls, gpu)
            if table is None:
                continue
            tables_found = True
            entry = nearest_entry(table, dtype, dims, rows, variant)
            if entry is None:
                without.append((source, path, table))
                continue
            config, problems = entry_config(space, entry)
            if problems:
                _warn_once(f"liger-gen: ignoring entry {dtype_name(dtype)}/{dims}/{entry['rows']} of {path}: "
                           + "; ".join(problems))
                continue
            return {"source": source, "path": str(path), "rows": entry["rows"], "config": config}
        for source, path, table in without:
            if not nearest_allowed(table, space_cls, limits):
                continue
            for entry in neighbour_entries(table["entries"], dtype, dims, rows, variant):
                config, problems = entry_config(space, entry)
                if problems:  # tuned for other dims: it may not fit these
                    continue
                count, ratio = nearest_evidence(table, space_cls, limits)
                _warn_once(f"liger-gen: no tuned {op} config for {gpu} at {dtype_name(dtype)} {dims}; using the "
                           f"entry tuned at {entry['dims']} (in {count} tuned shapes of {path} the nearest "
                           f"tuned config took {ratio:.2f}x the heuristic's time). Run `liger-gen tune --gpu "
                           f"{gpu} --ops {op} ...` to tune these dims.")
                return {"source": source, "path": str(path), "rows": entry["rows"], "config": config,
                        "dims": dict(entry["dims"])}
        if tables_found:
            _warn_once(f"liger-gen: no tuned {op} config for {gpu} ({dtype_name(dtype)}, {dims}); "
                       f"using the heuristic. Run `liger-gen tune --gpu {gpu} --ops {op} ...` to tune.")
        elif any(_holds_tables(Path(root) / gpu) for _, root in table_roots()):  # once per op: no shape tuned
            _warn_once(f"liger-gen: no tuned {op} table for {gpu}; {op} runs its heuristic at every shape. Run "
                       f"`liger-gen tune --gpu {gpu} --ops {op} ...` to tune.")
        else:  # one warning per GPU
            _warn_once(f"liger-gen: no tuned tables for {gpu}; every op runs its heuristic. Run `liger-gen tune "
                       f"--gpu {gpu} --model <model>` to tune the ops a model runs.")
    return {"source": "heuristic", "path": None, "rows": None, "config": space.heuristic()}


def describe_lookup(space: type[Space], dtype: torch.dtype, dims: dict[str, int] | int, rows: int,
                    gpu: str | None = None, variant: dict[str, Any] | None = None) -> dict[str, Any]:
    """Like ``lookup`` for the current GPU, with the config as a plain dict (for reports)."""
    if gpu is None and torch.cuda.is_available():
        from liger_gen.runtime.devices import current_gpu

        gpu = current_gpu()[0]
    found = lookup(space, dtype, dims, rows, gpu, variant=variant)
    return {**found, "config": found["config"].to_dict()}


def clear_caches() -> None:
    """Forget loaded tables (after writing one, or when $LIGER_GEN_TUNED_DIR changes)."""
    _load_for.cache_clear()
