"""The one atomic file writer (readers see the old file or the whole new one, never a part) and the one reader of
small files named by users (tables, model configs), which neither blocks on a FIFO nor reads a device file
without end."""

from __future__ import annotations

import contextlib
import os
import stat
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


def not_private(st: os.stat_result, allow_root: bool = False) -> str | None:
    """Why a file or folder with this ``os.stat`` result is not private to the current user (owned by another
    uid, or writable by group or others), or None when it is (or the platform has no uids). ``allow_root``: a
    root-owned one counts as private too (only root can change it, as an image's files installed as root)."""
    if not hasattr(os, "getuid"):
        return None
    if st.st_uid != os.getuid() and not (allow_root and st.st_uid == 0):
        return f"owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {oct(st.st_mode)})"
    return None


def read_capped_text(path: str | os.PathLike, limit: int, what: str) -> str:
    """The UTF-8 text of the regular file at ``path``, of at most ``limit`` bytes. OSError if it cannot be opened;
    ValueError (naming ``what`` and the path) if it is not a regular file, is larger than ``limit`` or is not
    UTF-8. Opened without blocking, so a FIFO cannot hang the reader, and read to at most the cap, so a device
    file such as /dev/zero cannot exhaust memory."""
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
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"cannot read {what} {path}: not UTF-8 ({exc})") from exc
