"""Claims: studies created in the shared Optuna storage as locks, so that of several processes (workers of one
host, or hosts of one run) exactly one takes a unit or a problem; attempts at a claim (``<claim>:retry<k>``); the
owner (host, pid, boot id, PID namespace, token) a claim records; and the heartbeat that says its owner still makes
progress. What the fleet (``fleet.py``) builds its units, takeovers and waits on."""

from __future__ import annotations

import functools
import os
import re
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

try:
    import optuna
    from optuna.study import StudyDirection
except ImportError:  # a training-only install: ``liger-gen tune`` says what to install
    optuna = StudyDirection = None

CLAIM_PREFIX = "liger-gen-claim"


def claim(storage, name: str) -> int | None:
    """Create the study ``name`` in ``storage``; its id if this call created it, None if it already existed.

    Exactly one of several processes creating the same name succeeds (a unique name in an RDB; the first
    creation in a journal's order)."""
    try:
        return storage.create_new_study([StudyDirection.MINIMIZE], name)
    except optuna.exceptions.DuplicatedStudyError:
        return None


class TakenOver(Exception):
    """Another process took over the unit attempt this one works on (a retry claim of it exists)."""


#: Least seconds between two writes of a unit attempt's ``beat`` (every trial and problem raises it).
BEAT_INTERVAL_S = 0.5
_RETRY = ":retry"
_RETRY_RE = re.compile(r":retry(\d+)$")
_TOKEN = uuid.uuid4().hex  # tells this process from an earlier one that had the same host name and pid


def problem_claim(run_id: str, op: str, key: str) -> str:
    return f"{CLAIM_PREFIX}:{run_id}:problem:{op}:{key}"


def attempt_name(base: str, k: int) -> str:
    """The claim of attempt ``k`` of the claim ``base``: ``base`` itself, then ``base:retry1``, ``base:retry2``..."""
    return base if k == 0 else f"{base}{_RETRY}{k}"


def base_name(name: str) -> str:
    return _RETRY_RE.sub("", name)


def retry_index(name: str) -> int:
    found = _RETRY_RE.search(name)
    return int(found.group(1)) if found else 0


def study_attrs(storage, name: str) -> dict[str, Any] | None:
    """The user attrs of the study ``name``; None if there is no such study."""
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return None
    return storage.get_study_user_attrs(study_id)


def attempts(storage, base: str) -> list[tuple[int, str, dict[str, Any]]]:
    """The attempts at the claim ``base``, oldest first: (k, claim name, user attrs) of ``base``, ``base:retry1``,
    ... as far as they exist (retry k+1 is only ever created after retry k)."""
    out: list[tuple[int, str, dict[str, Any]]] = []
    while True:
        name = attempt_name(base, len(out))
        attrs = study_attrs(storage, name)
        if attrs is None:
            return out
        out.append((len(out), name, attrs))


@functools.lru_cache(maxsize=None)
def _machine() -> tuple[str | None, int | None]:
    """(boot id, PID namespace) of this process on Linux, None where they cannot be read: with the host name
    they say whether a pid recorded in a claim can be looked up here."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        boot = None
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = None
    return boot, pidns


def this_process() -> dict[str, Any]:
    """The ``owner`` a unit claim of this process records: host name and pid, the boot id and PID namespace that
    make the pid meaningful (containers that share the host name, machines with the same name), and a token that
    tells this process from an earlier one with the same pid (a container's process 1)."""
    boot, pidns = _machine()
    return {"host": socket.gethostname(), "pid": os.getpid(), "boot": boot, "pidns": pidns, "token": _TOKEN}


def same_host(owner: Mapping[str, Any], me: Mapping[str, Any]) -> bool:
    """Whether the process ``owner`` of a claim ran where ``me`` runs, so that its pid can be checked here: the
    same host name, and the same boot and PID namespace where both are known (after a reboot, or from another
    container or machine of the same name, only the heartbeat tells)."""
    return owner.get("host") == me["host"] and all(
        owner.get(k) == me.get(k) for k in ("boot", "pidns") if owner.get(k) is not None and me.get(k) is not None)


def pid_alive(pid: Any) -> bool:
    """Whether process ``pid`` of this host is running (a zombie is not); True when it cannot be told."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return True  # os.kill(0, ...) would signal this process group: never ask about such a pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, as another user
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def owner_text(owner: Any) -> str:
    """'host pid 123' for a claim's ``owner`` attr; 'an unknown process' when it has none (yet)."""
    if not isinstance(owner, Mapping) or "host" not in owner:
        return "an unknown process"
    return f"{owner['host']} pid {owner.get('pid', '?')}"


class Heartbeat:
    """The ``owner`` and ``beat`` of one unit attempt: recorded when it is claimed, the beat raised by every call
    and written at most every ``BEAT_INTERVAL_S``. With ``fenced`` (a shared run), each write also looks for
    the next retry claim of the unit and raises ``TakenOver`` when another process has created it."""

    def __init__(self, storage, study_id: int, name: str, *, fenced: bool):
        self.storage, self.study_id, self.name, self.fenced = storage, study_id, name, fenced
        self.successor = attempt_name(base_name(name), retry_index(name) + 1)
        self.count = 0
        storage.set_study_user_attr(study_id, "owner", this_process())
        storage.set_study_user_attr(study_id, "beat", 0)
        self.written = time.monotonic()

    def __call__(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.written < BEAT_INTERVAL_S:
            return
        self.written = now
        self.storage.set_study_user_attr(self.study_id, "beat", self.count)
        successor = study_attrs(self.storage, self.successor) if self.fenced else None
        if successor is not None:
            raise TakenOver(f"{self.name} was taken over by {owner_text(successor.get('owner'))} (as "
                            f"{self.successor}), which saw no progress of this process for its stale time")


def claim_problem(storage, base: str, attempt: str, retry: bool) -> int | None:
    """Claim the problem ``base`` for the unit attempt ``attempt``: the claim's id, or None when the problem is
    not this attempt's to tune. A first attempt of a unit claims ``base`` (taken: another unit gives the same
    problem and tunes it). A retry skips a problem any attempt of which holds an entry, and claims the next retry
    of a problem whose latest claim an earlier attempt of the same unit made (one of another unit's is left to
    that unit)."""
    if not retry:
        study_id = claim(storage, base)
    else:
        found = attempts(storage, base)
        if any("entry" in attrs for _, _, attrs in found):
            return None
        if not found:
            study_id = claim(storage, base)
        else:
            k, name, attrs = found[-1]
            by = attrs.get("attempt")
            if by is None:  # claimed an instant ago, or by a process that died right after claiming: look again
                time.sleep(1.0)
                attrs = study_attrs(storage, name) or {}
                if "entry" in attrs:
                    return None
                by = attrs.get("attempt")
            if by is not None and base_name(by) != base_name(attempt):
                return None
            study_id = claim(storage, attempt_name(base, k + 1))
    if study_id is not None:
        storage.set_study_user_attr(study_id, "attempt", attempt)
    return study_id
