"""Where the Optuna studies live: a storage spec (None, a journal file path, a database URL) opened as an Optuna
storage, a torn journal repaired before it is opened, and URLs printed without their password."""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path
from typing import Any

try:
    import optuna
except ImportError:  # a training-only install: ``liger-gen tune`` says what to install
    optuna = None


class JournalError(ValueError):
    """A tuning journal cannot be resumed as is: a bad record with valid ones after it, a record Optuna cannot
    replay, or a path that is not a regular file."""


class JournalWarning(UserWarning):
    """Something about a tuning journal the user should know: a torn tail was cut off, or a stale lock waits."""


#: How old Optuna's journal lock must be before liger-gen says it was probably left by a dead process.
STALE_LOCK_S = 2.0


def repair_journal(path: str | os.PathLike) -> int:
    """Make a journal file that ends in a torn record resumable; returns the number of bytes cut off (0: intact).

    A write cut short (disk full, power loss, a process killed mid-write) leaves a last line without its newline,
    or with bytes that are not a JSON record; Optuna then fails on every later run (its next record lands on the
    same line). Such a tail — everything after the last valid record, when no valid record follows — is moved to
    ``<journal>.torn-<unix time>`` and the journal is truncated to its valid records, with a ``JournalWarning``.
    A bad record followed by valid ones is not a tear but corruption: ``JournalError`` names the file and line and
    nothing is changed. The scan holds Optuna's own journal lock, so it never races a writer.
    """
    import json
    import warnings

    from optuna.storages.journal import JournalFileSymlinkLock

    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(mode):  # a FIFO would block the read below forever
        raise JournalError(f"tuning journal {path} is not a regular file (mode {stat.filemode(mode)})")
    lock = JournalFileSymlinkLock(str(path))
    lock_file = Path(str(path) + ".lock")
    try:
        age = time.time() - lock_file.lstat().st_mtime
    except OSError:
        age = None
    if age is not None and age >= STALE_LOCK_S:
        warnings.warn(f"liger-gen: the journal lock {lock_file} is {age:.0f} s old: a tuner that stopped while "
                      f"writing {path} left it (or one is writing now). Optuna breaks a lock after its 30 s grace "
                      f"period, so this run may wait up to 30 s before it starts; delete the lock file if no "
                      f"tuner is running.", JournalWarning, stacklevel=2)
    lock.acquire()
    try:
        data = path.read_bytes()
        good_end, good_records, bad_line, line_no, start = 0, 0, None, 0, 0
        while start < len(data):
            end = data.find(b"\n", start)
            line_no += 1
            line = data[start:] if end < 0 else data[start:end]
            try:
                if end < 0:
                    raise ValueError("no newline")
                record = json.loads(line)
                if not (isinstance(record, dict) and type(record.get("op_code")) is int):
                    raise ValueError("not an Optuna journal record (an object with an int op_code)")
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                if bad_line is None:
                    bad_line = (line_no, exc)
            else:
                if bad_line is not None:
                    raise JournalError(
                        f"tuning journal {path}: line {bad_line[0]} is not a valid record ({bad_line[1]}), and "
                        f"valid records follow it (line {line_no}): the file is corrupt in the middle, not cut "
                        f"short, so it cannot be resumed. Nothing was changed; move it aside to start the studies "
                        f"over (tables already written are kept).")
                good_end, good_records = end + 1, good_records + 1
            if end < 0:
                break
            start = end + 1
        torn = len(data) - good_end
        if torn:
            aside = path.with_name(f"{path.name}.torn-{int(time.time())}")
            aside.write_bytes(data[good_end:])
            with open(path, "r+b") as f:
                f.truncate(good_end)
                f.flush()
                os.fsync(f.fileno())
            warnings.warn(f"liger-gen: tuning journal {path} ended in {torn} bytes that are not a complete record "
                          f"(line {bad_line[0]}: a write cut short by a full disk, a power loss or a killed "
                          f"process); cut them off (saved in {aside}) and resuming from the {good_records} records "
                          f"before them.", JournalWarning, stacklevel=2)
        return torn
    finally:
        lock.release()


def open_storage(spec: Any):
    """An Optuna storage from ``spec``: None stays None (in memory); a URL (``sqlite:///tune.db``,
    ``postgresql://...``) opens that database; any other string or path is a journal file (``JournalStorage``,
    safe for several processes on one disk; created with its folder, and first checked by ``repair_journal``: a
    torn tail is cut off, a corrupt middle raises ``JournalError``); a storage object is returned as is.

    A database other than SQLite (PostgreSQL, shared by the hosts of a ``--run-id`` run) is opened with
    connections checked before use (a server restart or a closed idle connection is not an error), and its
    tables are created by the first opener (hosts starting at once retry the creation the other won). A missing
    driver raises ``MissingExtraError`` with the pip command; a server that cannot be reached, ``StorageError``."""
    if spec is None or not isinstance(spec, (str, os.PathLike)):
        return spec
    spec = str(spec)
    if "://" in spec:
        if spec.startswith("sqlite"):
            return optuna.storages.get_storage(spec)
        return _open_database(spec)
    from optuna.storages.journal import JournalFileBackend

    Path(spec).parent.mkdir(parents=True, exist_ok=True)
    repair_journal(spec)
    try:  # the storage replays every record now: a record that parses but is not what Optuna wrote fails here
        return optuna.storages.JournalStorage(JournalFileBackend(spec))
    except Exception as exc:  # noqa: BLE001 - whatever Optuna raises on a corrupt record
        raise JournalError(f"tuning journal {spec} cannot be replayed by Optuna ({type(exc).__name__}: {exc}): a "
                           f"record in it is corrupt. Nothing was changed; move it aside to start the studies over "
                           f"(tables already written are kept).") from exc


class StorageError(ValueError):
    """A tuning storage cannot be opened (a database that cannot be reached, refuses the login, ...)."""


def display_storage(spec: Any) -> str:
    """``spec`` as it may be printed: the password of a database URL replaced by ``***`` (SQLAlchemy's own URL
    parsing, so a password holding '/', ':' or '@' is hidden too)."""
    text = str(spec)
    if "://" not in text:
        return text
    try:
        from sqlalchemy.engine import make_url

        return make_url(text).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy parses: hide everything between :// and the last @
        return re.sub(r"^([^:/]+://)[^@]*@", r"\1***@", text)


def _open_database(url: str):
    """An RDB storage on ``url`` (not SQLite): see ``open_storage``."""
    import sqlalchemy.exc

    from liger_gen.optional import MissingExtraError

    shown = display_storage(url)
    url = _with_driver(url)
    for attempt in range(6):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url))
            return optuna.storages.get_storage(storage)  # Optuna's cache of finished trials in front of it
        except ImportError as exc:
            cause, missing = exc, None
            while cause is not None and missing is None:
                missing = getattr(cause, "name", None)
                cause = cause.__cause__ or cause.__context__
            dialect = url.split("://", 1)[0]
            if dialect in ("postgresql", "postgresql+psycopg2"):
                hint = ("pip install 'liger-gen[tune]' (it brings psycopg2-binary; from a source checkout: pip "
                        "install -e '.[tune]'), or pip install psycopg2-binary")
            elif dialect == "postgresql+psycopg":
                hint = "pip install 'psycopg[binary]'"
            else:
                hint = "pip install the Python driver that SQLAlchemy names for it"
            raise MissingExtraError(f"the tuning storage {shown} needs the database driver "
                                    f"{missing or dialect}, which is not installed ({exc}); install it with: "
                                    f"{hint}") from exc
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError) as exc:
            # several hosts creating the tables of an empty database at once: all but one fail on a duplicate
            # table or type; by the next try the winner's tables are there
            last = exc
            time.sleep(0.1 * 2 ** attempt)
        except (sqlalchemy.exc.SQLAlchemyError, ValueError) as exc:  # ValueError: a malformed URL (its port)
            raise StorageError(f"cannot open the tuning storage {shown}: {type(exc).__name__}: "
                               f"{_first_line(exc)}") from exc
    raise StorageError(f"cannot create Optuna's tables in the tuning storage {shown}: {type(last).__name__}: "
                       f"{_first_line(last)}") from last


#: Seconds a PostgreSQL connection attempt may take, and the TCP keepalive settings that notice a server gone
#: silent (a host must not hang forever on a dead connection; the other hosts would take its units over).
CONNECT_TIMEOUT_S = 20
_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}


def _engine_kwargs(url: str) -> dict[str, Any]:
    """SQLAlchemy engine options: connections checked before use; for PostgreSQL through psycopg2 or psycopg, a
    connect timeout and TCP keepalives (libpq's parameters)."""
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.split("://", 1)[0] in ("postgresql", "postgresql+psycopg2", "postgresql+psycopg"):
        kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S, **_KEEPALIVES}
    return kwargs


def _with_driver(url: str) -> str:
    """``url`` with the PostgreSQL driver that is installed: a ``postgresql://`` URL names none, and SQLAlchemy
    2.1 takes psycopg (3) for it, 2.0 psycopg2 (the driver liger-gen's ``tune`` extra brings); with only psycopg2
    installed it becomes ``postgresql+psycopg2://``. Any other URL, or one that names its driver, is kept."""
    import importlib.util

    scheme, sep, rest = url.partition("://")
    if scheme != "postgresql":
        return url

    def installed(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # ValueError: blocked in sys.modules
            return False

    return f"postgresql+psycopg2{sep}{rest}" if installed("psycopg2") and not installed("psycopg") else url


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else ""
