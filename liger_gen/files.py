"""The one atomic file writer (readers see the old file or the whole new one, never a part), the one reader of
files named by users (tables, model configs, training text, bench results), which neither blocks on a FIFO nor
reads a device file without end, and the check of an output folder named by users (made before a long run, so the
run cannot end by failing to write what it measured)."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, text: str, *, mode: int | None = 0o644, fsync: bool = False) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder and ``os.replace``.

    The folder is created if needed. ``mode``: the file's permission bits (``mkstemp`` makes 0600; the default
    0o644 suits shared data such as tables and results; None keeps 0600). ``fsync``: flush the file to disk before
    the rename, for files other processes import (kernel modules). Returns the path. Concurrent writers of one
    path each replace it whole: the last rename wins.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def not_private(st: os.stat_result, allow_root: bool = False, allow_sticky: bool = False) -> str | None:
    """Why a file or folder with this ``os.stat`` result is not private to the current user (owned by another
    uid, or writable by group or others), or None when it is (or the platform has no uids). ``allow_root``: a
    root-owned one counts as private too (only root can change it, as an image's files installed as root).
    ``allow_sticky``: a folder with the sticky bit (as /tmp, mode 1777) may be writable by group or others: in
    it only an entry's owner, the folder's owner and root may rename or remove the entry, so an entry that is
    itself private cannot be swapped (for the folders above a path, each checked in turn)."""
    if not hasattr(os, "getuid"):
        return None
    if st.st_uid != os.getuid() and not (allow_root and st.st_uid == 0):
        return f"owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    if allow_sticky and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
        return None
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {oct(st.st_mode)})"
    return None


def read_capped_bytes(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them. OSError if it cannot be opened;
    ValueError (naming ``what`` and the path) if it is not a regular file or is larger than ``limit``. Opened
    without blocking, so a FIFO cannot hang the reader, and read to at most the cap, so a device file such as
    /dev/zero cannot exhaust memory."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # checked before fdopen, which names a folder by its descriptor
        os.close(fd)
        raise ValueError(f"{what} {path} is not a regular file (mode {stat.filemode(st.st_mode)})")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise ValueError(f"{what} {path} has {st.st_size:,} bytes, more than the {limit:,} it may have")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what} {path} grew past {limit:,} bytes while it was read")
    return data


def read_capped_text(path: str | os.PathLike, limit: int, what: str) -> str:
    """The UTF-8 text of the regular file at ``path``, of at most ``limit`` bytes (``read_capped_bytes``).
    OSError if it cannot be opened; ValueError (naming ``what`` and the path) if it is not a regular file, is
    larger than ``limit`` or is not UTF-8."""
    data = read_capped_bytes(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"cannot read {what} {path}: not UTF-8 ({exc})") from exc


_KINDS = ((stat.S_ISREG, "a file"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _not_a_folder(path: Path) -> str | None:
    """``"<p> is a file, not a folder"`` for the first of ``path`` and its parents that exists and is not a
    folder (what stops a folder from being made there), or None."""
    for p in (path, *path.parents):
        try:
            mode = os.stat(p).st_mode
        except OSError as exc:
            if os.path.islink(p):  # a link to nothing, or a loop of links: nothing can be made there
                return f"{p} is a symbolic link that leads nowhere ({exc.strerror or exc})"
            continue
        if stat.S_ISDIR(mode):
            return None
        kind = next((name for test, name in _KINDS if test(mode)), f"mode {stat.filemode(mode)}")
        return f"{p} is {kind}, not a folder"
    return None


def writable_folder(path: str | os.PathLike) -> Path:
    """The folder at ``path``, made (with its parents) if missing, once a file could be written in it: a probe
    file is created there and removed. ValueError naming the path and why otherwise (a file or device in the way,
    a read-only disk, no permission). For output folders named by users, checked before the work whose results
    go there."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot make folder {path}: {_not_a_folder(path) or exc.strerror or exc}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".liger-gen-probe-")
    except OSError as exc:
        raise ValueError(f"cannot write a file in folder {path} ({exc.strerror or exc})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return path


class ResultsNotWritten(Exception):
    """Measured results whose file could not be written. ``kept``: the file in the system's temporary folder that
    holds them instead, or None when that failed too and they were printed to standard output. The message says
    which file failed, why, and where the results are."""

    def __init__(self, path: Path, error: OSError, kept: Path | None):
        self.path, self.error, self.kept = path, error, kept
        why = _not_a_folder(path.parent) or error.strerror or str(error)
        where = f"saved to {kept} instead" if kept is not None else "printed above instead"
        super().__init__(f"cannot write {path}: {why}; the results were {where}")


def write_results(path: str | os.PathLike, text: str) -> Path:
    """``write_atomic`` for results that took long to measure: when ``path`` cannot be written, the text goes to a
    new file in the system's temporary folder or, if that fails too, to standard output, and ResultsNotWritten
    says where. Returns the path written."""
    path = Path(path)
    try:
        return write_atomic(path, text)
    except OSError as exc:
        error = exc
    kept = None
    try:
        fd, name = tempfile.mkstemp(prefix=f"liger-gen-{path.stem}-", suffix=path.suffix)
        kept = Path(name)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        if kept is not None:
            with contextlib.suppress(OSError):
                kept.unlink()
            kept = None
        sys.stdout.write(text)
        sys.stdout.flush()
    raise ResultsNotWritten(path, error, kept)
