"""`liger-gen tune --run-id`: tuner processes of several hosts sharing one PostgreSQL storage, on the CPU with the
fake problems and deterministic timer of ``test_tuner_workers``.

A real PostgreSQL server (Debian's package, /usr/lib/postgresql/*/bin) is started for the module; without one
the server tests are skipped, unless LIGER_GEN_REQUIRE_POSTGRES=1 (CI) makes them fail. Each shared run starts
tuner *processes* (this file run as a script, see ``helper_main``) on a fresh database: one of them is killed
mid-unit, and either the other takes its unit over (same host, dead pid) or the killed one's command is run
again (resume). The tables the writing process writes must equal a one-process run's, and a process started
without table writing must write nothing. The stale-heartbeat path, the plan check, the claims of retries and the
storage errors are tested without a server.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script (the helper processes): import the other test modules
    sys.path.insert(0, str(HERE))

import optuna  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from liger_gen.ops import get_spec  # noqa: E402
from liger_gen.tuning import claims, fleet, report, storage as storage_module  # noqa: E402
from liger_gen.tuning.claims import attempt_name, claim  # noqa: E402
from liger_gen.tuning.driver import TuneSettings, run_tuning  # noqa: E402
from liger_gen.tuning.fleet import (SharedRunError, UnitWatch, WorkUnit, collect_entries, finished_units,  # noqa: E402
                                    join_run, run_units, tune_ops)
from liger_gen.tuning.search import Tuner  # noqa: E402
from liger_gen.tuning.storage import StorageError, open_storage  # noqa: E402
from test_tuner import fake_build  # noqa: E402
from test_tuner_workers import BARRIER, CPU, DIE_AT, MODEL, cost, fake_problems, job  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)

REQUIRE = "LIGER_GEN_REQUIRE_POSTGRES"
OPS = ("rms_norm", "layer_norm")
ROWS = (16, 32, 64)
PROCESS_TIMEOUT_S = 120


def tuning_args(out_root, storage) -> dict:
    """The run_tuning arguments every process of these tests uses (the same command on every 'host')."""
    return dict(specs=[get_spec(op) for op in OPS], model=MODEL, rows=list(ROWS), dtypes=[torch.float32], trials=6,
                out_root=out_root, storage=storage, seed=0, gpu="h200", target=CPU,
                tuner=Tuner(n_trials=6, timer=cost, build=fake_build, seed=3, polish_trials=2, retime_rounds=2),
                make_problems=fake_problems)


def helper_main(argv: list[str]) -> int:
    """One tuner 'host': run_tuning on a shared run; exit 0 when the run is complete without errors."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-write-tables", action="store_true")
    parser.add_argument("--host", default=None, help="pretend to be this host")
    parser.add_argument("--stale-after", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.host:
        socket.gethostname = lambda: args.host
    report.console = Console(file=sys.stdout, width=240)
    result = run_tuning(TuneSettings(**tuning_args(Path(args.out), args.storage), run_id=args.run_id,
                                     write_tables=not args.no_write_tables, stale_s=args.stale_after, poll_s=0.1))
    print(json.dumps({"unfinished": [u.index for u in result.unfinished], "errors": result.errors}))
    return 0 if not result.unfinished and not result.errors else 1


# ------------------------------------------------------------------------------------------------ the server

def _server_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                   key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0)
    return Path(found[-1]).parent if found else None


def _unavailable(reason: str):
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{reason}, and {REQUIRE}=1 requires the PostgreSQL tests to run (apt-get install postgresql)")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A throw-away PostgreSQL cluster on 127.0.0.1 (trust authentication); ``database()`` makes a fresh one."""

    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="liger-gen-pg-", dir="/tmp"))
        os.chmod(self.root, 0o755)  # the server's user must reach its data and socket folders
        self.data, self.sockets, self.log = self.root / "data", self.root / "sockets", self.root / "server.log"
        self.sockets.mkdir()
        self.prefix: list[str] = []
        if os.geteuid() == 0:  # postgres refuses to run as root: run it as Debian's postgres user
            import pwd

            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                shutil.rmtree(self.root)
                _unavailable("running as root and there is no 'postgres' user to run the server as")
            runuser = shutil.which("runuser")
            if runuser is None:
                shutil.rmtree(self.root)
                _unavailable("running as root and runuser (util-linux) is missing")
            for path in (self.root, self.sockets):
                os.chown(path, user.pw_uid, user.pw_gid)
            self.prefix = [runuser, "-u", "postgres", "--"]
        self.port = _free_port()
        self.count = 0

    def run(self, tool: str, *args: str) -> None:
        cmd = self.prefix + [str(self.bindir / tool), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/tmp",
                              env={**os.environ, "LC_ALL": "C", "LANG": "C"})
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}\n{log}")

    def start(self) -> None:
        self.run("initdb", "-D", str(self.data), "--auth=trust", "-U", "postgres", "--no-locale", "-E", "UTF8",
                 "--no-sync")
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.sockets} -c fsync=off "
                   f"-c synchronous_commit=off -c full_page_writes=off")
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o", options, "start")

    def stop(self) -> None:
        try:
            self.run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def database(self) -> str:
        """The URL of a new, empty database."""
        import psycopg2

        self.count += 1
        name = f"tune{self.count}"
        connection = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres")
        try:
            connection.autocommit = True
            with connection.cursor() as cursor:
                cursor.execute(f"CREATE DATABASE {name}")
        finally:
            connection.close()
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{name}"


@pytest.fixture(scope="module")
def server():
    bindir = _server_bin()
    if bindir is None or not (bindir / "initdb").exists() or not (bindir / "pg_ctl").exists():
        _unavailable("no PostgreSQL server under /usr/lib/postgresql/*/bin (Debian's postgresql package)")
    import importlib.util

    if importlib.util.find_spec("psycopg2") is None:  # the tuner's and the fixture's driver
        _unavailable("psycopg2 is not installed (pip install -e '.[test]')")
    server = Server(bindir)
    try:
        server.start()
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process run, studies in memory: its result and the folder of its tables."""
    root = tmp_path_factory.mktemp("reference")
    saved = report.console
    report.console = Console(file=io.StringIO(), width=240)
    try:
        result = run_tuning(TuneSettings(**tuning_args(root, None)))
    finally:
        report.console = saved
    assert not result.unfinished and not result.errors
    return result, root


def tables_in(root: Path) -> dict[str, dict]:
    """Every table and trial log under ``root``, as JSON without the creation time."""
    out = {}
    for path in sorted(root.rglob("*.json")):
        table = json.loads(path.read_text())
        table.pop("created", None)
        out[str(path.relative_to(root))] = table
    return out


class Host:
    """A tuner process started as a script; its output goes to a log file."""

    def __init__(self, tmp: Path, name: str, storage: str, run_id: str, *, write_tables: bool = True,
                 host: str | None = None, die_at: int | None = None, barrier: str | None = None,
                 stale_after: float = 60.0):
        self.out = tmp / f"out-{name}"
        self.log_path = tmp / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if k not in (DIE_AT, BARRIER)}
        if die_at is not None:
            env[DIE_AT] = str(die_at)
        if barrier is not None:
            env[BARRIER] = barrier
        cmd = [sys.executable, str(Path(__file__).resolve()), "--storage", storage, "--run-id", run_id,
               "--out", str(self.out), "--stale-after", str(stale_after)]
        if not write_tables:
            cmd.append("--no-write-tables")
        if host is not None:
            cmd += ["--host", host]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(HERE.parent))

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=PROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"tuner process timed out:\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text()


def _barrier(tmp: Path, n: int) -> str:
    folder = tmp / "barrier"
    folder.mkdir()
    return f"{folder}:{n}"


def test_a_killed_process_is_taken_over_by_the_other_one(server, reference, tmp_path):
    """W writes the tables, F only tunes and is killed inside its first unit: W, on the same host, sees F's pid
    gone and tunes F's unit on from its stored trials; W's tables equal the one-process run's."""
    url = server.database()
    barrier = _barrier(tmp_path, 2)  # each process claims a unit before either goes on
    writer = Host(tmp_path, "w", url, "run-a", barrier=barrier)
    follower = Host(tmp_path, "f", url, "run-a", write_tables=False, die_at=20, barrier=barrier)
    assert follower.wait() == 3, follower.log()  # killed by the timer (os._exit(3)) mid-trial
    assert writer.wait() == 0, writer.log()
    assert "taking over unit" in writer.log() and "is no longer running" in writer.log(), writer.log()
    assert tables_in(writer.out) == tables_in(reference[1])
    assert not follower.out.exists() or not any(follower.out.rglob("*")), "a --no-write-tables host wrote files"


def test_a_killed_host_resumes_when_its_command_is_run_again(server, reference, tmp_path):
    """Two 'hosts' (host names faked): W is killed in its first unit; F, on another host, does not take W's
    unit over before --stale-after, and waits. W's command run again takes its own dead attempt over at once,
    finishes the run and writes the tables; F ends with the run complete and writes nothing."""
    url = server.database()
    barrier = _barrier(tmp_path, 2)
    writer = Host(tmp_path, "w1", url, "run-b", host="host-w", die_at=20, barrier=barrier)
    follower = Host(tmp_path, "f", url, "run-b", write_tables=False, host="host-f", barrier=barrier,
                    stale_after=PROCESS_TIMEOUT_S)
    assert writer.wait() == 3, writer.log()
    assert not (tmp_path / "out-w1").exists() or not any((tmp_path / "out-w1").rglob("*.json"))
    deadline = time.monotonic() + 60
    while "waiting for 1 unit(s) being tuned by host-w pid" not in follower.log():  # F's own units are done
        assert follower.proc.poll() is None and time.monotonic() < deadline, follower.log()
        time.sleep(0.1)
    resumed = Host(tmp_path, "w2", url, "run-b", host="host-w")
    assert resumed.wait() == 0, resumed.log()
    assert follower.wait() == 0, follower.log()
    assert "taking over unit" in resumed.log() and "no longer running" in resumed.log(), resumed.log()
    assert "taking over" not in follower.log(), follower.log()
    assert "run 'run-b' is complete; the tables are written by the host(s) started without --no-write-tables" \
        in follower.log(), follower.log()
    assert tables_in(resumed.out) == tables_in(reference[1])
    assert not follower.out.exists() or not any(follower.out.rglob("*")), "a --no-write-tables host wrote files"


def test_two_processes_of_one_run_agree_on_the_storage_before_tuning(server):
    """Hosts opening an empty database at once all get its tables (the creation race is retried), and a
    password in the URL is never printed."""
    url = server.database().replace("postgresql+psycopg2://", "postgresql://")  # the driver installed is used
    results = []

    def open_it():
        try:
            storage = open_storage(url)
            results.append(claim(storage, "x") is not None)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion
            results.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(map(repr, results)) == ["False", "False", "False", "True"], results
    bad = url.replace("postgres@", "postgres:secret@").replace(f":{server.port}/", f":{_free_port()}/")
    with pytest.raises(StorageError, match="cannot open the tuning storage") as failed:
        open_storage(bad)
    assert "secret" not in str(failed.value) and "postgres:***@" in str(failed.value)


# ------------------------------------------------------------------------------------------------ no server

OTHER = {"host": "elsewhere.example", "pid": 4242, "token": "t"}


def _claim_for(storage, run_id: str, unit: WorkUnit, owner: dict, k: int = 0) -> int:
    base = f"{claims.CLAIM_PREFIX}:{run_id}:unit:{unit.index}"
    study_id = claim(storage, attempt_name(base, k))
    storage.set_study_user_attr(study_id, "owner", owner)
    storage.set_study_user_attr(study_id, "beat", 0)
    return study_id


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_unit_watch_takes_over_a_silent_attempt_and_not_a_beating_one():
    storage = optuna.storages.InMemoryStorage()
    now = [0.0]
    watch = UnitWatch(storage, "r", stale_s=10, clock=lambda: now[0])
    units = [WorkUnit(i, "rms_norm", "float32", 16) for i in range(7)]
    silent = _claim_for(storage, "r", units[0], OTHER)
    beating = _claim_for(storage, "r", units[1], {**OTHER, "pid": 4243})
    assert watch.check(units[0])[0] == watch.check(units[1])[0] == "running"
    now[0] = 6.0
    storage.set_study_user_attr(beating, "beat", 3)
    assert watch.check(units[1])[0] == "running"
    now[0] = 11.0
    state, (successor, why) = watch.check(units[0])
    assert state == "abandoned" and successor.endswith(":unit:0:retry1") and "no progress for 11 s" in why
    assert watch.check(units[1])[0] == "running"  # its beat changed 5 s ago
    now[0] = 16.5
    assert watch.check(units[1])[0] == "abandoned"  # unchanged since 6.0
    storage.set_study_user_attr(silent, "done", True)
    assert watch.check(units[0]) == ("done", None)
    here = socket.gethostname()
    _claim_for(storage, "r", units[2], {"host": here, "pid": _dead_pid(), "token": "t"})
    state, (_, why) = watch.check(units[2])
    assert state == "abandoned" and "no longer running" in why  # this host, pid gone: at once
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _claim_for(storage, "r", units[3], {"host": here, "pid": sleeper.pid, "token": "t"})
        assert watch.check(units[3])[0] == "running"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert watch.check(units[3])[0] == "abandoned"
    _claim_for(storage, "r", units[4], {"host": here, "pid": os.getpid(), "token": "an earlier process"})
    assert watch.check(units[4])[0] == "abandoned"
    _claim_for(storage, "r", units[5], claims.this_process())
    assert watch.check(units[5])[0] == "mine"
    me = claims.this_process()
    if me["boot"] is not None:  # the same name on another machine (or after a reboot): only the heartbeat tells
        elsewhere = {**me, "pid": _dead_pid(), "boot": "another-boot"}
        assert not claims.same_host(elsewhere, me) and claims.same_host({**me, "boot": None}, me)
    assert watch.check(units[6]) == ("unclaimed", f"{claims.CLAIM_PREFIX}:r:unit:6")
    _claim_for(storage, "r", units[1], claims.this_process(), k=1)  # the latest attempt counts
    assert watch.check(units[1])[0] == "mine"


def test_a_claim_whose_process_died_before_recording_itself_is_taken_over_after_a_grace():
    storage = optuna.storages.InMemoryStorage()
    now = [0.0]
    watch = UnitWatch(storage, "r", stale_s=600, clock=lambda: now[0])
    unit = WorkUnit(0, "rms_norm", "float32", 16)
    claim(storage, f"{claims.CLAIM_PREFIX}:r:unit:0")  # claimed, no owner written
    assert watch.check(unit)[0] == "running"
    now[0] = fleet.OWNERLESS_S - 1
    assert watch.check(unit)[0] == "running"
    now[0] = fleet.OWNERLESS_S
    state, (successor, why) = watch.check(unit)
    assert state == "abandoned" and successor.endswith(":unit:0:retry1") and "never recorded itself" in why


def test_a_shared_run_takes_over_after_stale_s_and_not_while_the_owner_beats(reference):
    """tune_ops of a shared run (in-memory storage) whose two units were claimed by processes of another host:
    unit 0's owner is silent and is taken over once stale_s has passed; unit 1's owner beats for a while and is
    taken over only after it stops. The entries equal the one-process run's."""
    storage = optuna.storages.InMemoryStorage()
    shared = job(storage=storage, ops=("rms_norm",), rows=(16, 32))
    shared.run_id, shared.shared, shared.stale_s, shared.poll_s = "r", True, 0.6, 0.05
    _claim_for(storage, "r", shared.units[0], OTHER)
    beating = _claim_for(storage, "r", shared.units[1], {**OTHER, "pid": 4243})
    stopped = []

    def beat():
        for n in range(1, 51):  # 2.5 s of progress
            storage.set_study_user_attr(beating, "beat", n)
            time.sleep(0.05)
        stopped.append(time.monotonic())

    thread = threading.Thread(target=beat)
    takeovers = {}
    began = time.monotonic()
    thread.start()
    try:
        result = tune_ops(shared, on_event=lambda e: takeovers.setdefault(e["unit"], time.monotonic())
                          if e["kind"] == "takeover" else None)
    finally:
        thread.join()
    assert not result.unfinished and not result.errors
    assert set(takeovers) == {0, 1}
    assert began + 0.6 <= takeovers[0] < stopped[0]  # the silent one, while the other one still beat
    assert takeovers[1] >= stopped[0] + 0.55
    assert result.entries == {"rms_norm": reference[0].entries["rms_norm"][:2]}
    names = {s.study_name for s in storage.get_all_studies()}
    assert {f"{claims.CLAIM_PREFIX}:r:unit:{i}:retry1" for i in (0, 1)} <= names


def test_the_lead_of_several_workers_takes_over_their_units_when_they_die(reference, tmp_path, monkeypatch):
    """`--workers 2` in a shared run (journal storage): both workers are killed in their first unit; the lead
    process takes their units over (this host, pids gone) and claims the units nobody had claimed, then the
    entries equal the one-process run's."""
    import test_tuner_workers

    monkeypatch.setattr(test_tuner_workers, "_calls", [-10**9, 1])  # this process's timer never dies, no barrier
    (tmp_path / "barrier").mkdir()
    monkeypatch.setenv(BARRIER, f"{tmp_path / 'barrier'}:2")
    monkeypatch.setenv(DIE_AT, "20")  # each spawned worker exits at its 20th timing
    shared = job(storage=str(tmp_path / "tune.journal"))
    shared.run_id, shared.shared, shared.poll_s = "r", True, 0.05
    events = []
    result = tune_ops(shared, devices=[None, None], on_event=events.append)
    assert not result.unfinished
    assert sorted(e for e in result.errors if "exited with code 3" in e) == [
        "worker 0 exited with code 3", "worker 1 exited with code 3"], result.errors
    takeovers = [e for e in events if e["kind"] == "takeover"]
    assert sorted(e["why"].split()[-3:] == ["no", "longer", "running"] for e in takeovers) == [False] * 4 + [True] * 2
    assert {e["worker"] for e in takeovers} == {2}  # the lead
    assert result.entries == reference[0].entries


def test_an_owner_stops_when_its_unit_is_taken_over(monkeypatch):
    """The heartbeat of a shared run's unit attempt finds the retry claim another process created and ends the
    attempt ("lost"): its problem is left without an entry and the unit without "done"."""
    monkeypatch.setattr(claims, "BEAT_INTERVAL_S", 0.0)
    storage = optuna.storages.InMemoryStorage()
    shared = job(storage=storage, ops=("rms_norm",), rows=(16,))
    shared.run_id, shared.shared = "r", True
    base = f"{claims.CLAIM_PREFIX}:r:unit:0"
    calls = []

    def timer(launch, params):
        calls.append(1)
        if len(calls) == 3:
            claim(storage, attempt_name(base, 1))  # another host takes the unit over
        return cost(launch, params)

    shared.tuner.timer = timer
    events = []
    run_units(shared, storage, events.append)
    kinds = [e["kind"] for e in events]
    assert "lost" in kinds and "done" not in kinds and len(calls) < 8
    assert "taken over" in next(e for e in events if e["kind"] == "lost")["reason"]
    assert finished_units(storage, "r", shared.units) == set()
    assert collect_entries(storage, "r", shared.units) == {}


def test_entries_and_done_units_count_every_attempt_once():
    storage = optuna.storages.InMemoryStorage()
    units = [WorkUnit(0, "rms_norm", "float32", 16), WorkUnit(1, "rms_norm", "float32", 32)]
    prefix = f"{claims.CLAIM_PREFIX}:r"
    for name, unit, entry in ((f"{prefix}:problem:rms_norm:a", 0, "first"),
                              (f"{prefix}:problem:rms_norm:a:retry1", 0, "again"),  # a stale owner finished too
                              (f"{prefix}:problem:rms_norm:b:retry2", 1, "retried")):
        study_id = claim(storage, name)
        for key, value in (("unit", unit), ("pos", 0), ("entry", entry)):
            storage.set_study_user_attr(study_id, key, value)
    storage.set_study_user_attr(claim(storage, f"{prefix}:unit:1:retry1"), "done", True)
    claim(storage, f"{prefix}:unit:0")
    assert collect_entries(storage, "r", units) == {"rms_norm": ["first", "retried"]}
    assert finished_units(storage, "r", units) == {1}


def test_a_host_with_other_options_cannot_join_and_every_host_gets_the_writers_priors():
    storage = optuna.storages.InMemoryStorage()
    key = ("float32", (("n_cols", 96),), (), 16)
    first = dataclasses.replace(job(storage=storage), run_id="r", shared=True, priors={"rms_norm": {key: {"A": 1}}})
    assert join_run(first, storage) is first
    other = dataclasses.replace(job(storage=storage, rows=(16, 32)), run_id="r", shared=True, write_tables=False)
    with pytest.raises(SharedRunError, match="units: the run has"):
        join_run(other, storage)
    follower = dataclasses.replace(job(storage=storage), run_id="r", shared=True, write_tables=False)
    assert join_run(follower, storage).priors == {"rms_norm": {key: {"A": 1}}}  # tuple keys again


def test_a_host_on_other_software_cannot_join(monkeypatch):
    """Another Triton (or torch, liger-gen, or template) on one host would tune other kernels than the tables the
    run writes say: it is refused, naming what differs."""
    storage = optuna.storages.InMemoryStorage()
    first = dataclasses.replace(job(storage=storage), run_id="r", shared=True)
    join_run(first, storage)
    real = fleet.installed_version
    monkeypatch.setattr(fleet, "installed_version", lambda dist, module=None: "0.0.0" if dist == "triton"
                        else real(dist, module))
    with pytest.raises(SharedRunError, match=r"software: the run has .*'triton': '0\.0\.0'"):
        join_run(dataclasses.replace(job(storage=storage), run_id="r", shared=True, write_tables=False), storage)


def test_storage_errors_say_what_to_do(monkeypatch):
    from liger_gen.optional import MissingExtraError

    monkeypatch.setitem(sys.modules, "psycopg2", None)  # no driver is installed
    monkeypatch.setitem(sys.modules, "psycopg", None)
    for url in ("postgresql+psycopg2://tuner:hunter2@127.0.0.1:1/tune", "postgresql://tuner:hunter2@127.0.0.1:1/t"):
        with pytest.raises(MissingExtraError, match=r"needs the database driver psycopg.*liger-gen\[tune\]") as failed:
            open_storage(url)
        assert "hunter2" not in str(failed.value) and "tuner:***@" in str(failed.value)


def test_printed_urls_hide_any_password_and_a_bad_port_is_a_storage_error():
    show = storage_module.display_storage
    assert show("postgresql://tuner:pa/ss:w%40rd@127.0.0.1:5432/t1") == "postgresql://tuner:***@127.0.0.1:5432/t1"
    assert "secret" not in show("postgresql://u:secret@127.0.0.1:notaport/t1")
    assert show("sqlite:///tune.db") == "sqlite:///tune.db" and show("/tmp/x.journal") == "/tmp/x.journal"
    with pytest.raises(StorageError, match="cannot open the tuning storage") as failed:
        open_storage("postgresql+psycopg2://u:secret@127.0.0.1:notaport/t1")
    assert "secret" not in str(failed.value)
    kwargs = storage_module._engine_kwargs("postgresql+psycopg2://u@h/db")
    assert kwargs["connect_args"]["connect_timeout"] > 0 and kwargs["connect_args"]["keepalives"] == 1


def test_a_postgresql_url_without_a_driver_gets_the_installed_one(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # SQLAlchemy 2.1's default for postgresql://: missing
    assert storage_module._with_driver("postgresql://u@h/db") == "postgresql+psycopg2://u@h/db"
    assert storage_module._with_driver("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"
    assert storage_module._with_driver("mysql://u@h/db") == "mysql://u@h/db"


def test_shared_run_options_are_checked(tmp_path):
    from click.testing import CliRunner

    from liger_gen.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--run-id", "r1"])
    assert result.exit_code == 2 and "needs --storage" in result.output
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--run-id", "r 1", "--storage", "x.journal"])
    assert result.exit_code == 2 and "--run-id" in result.output
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--run-id", "r1", "--storage", "sqlite:///tune.db"])
    assert result.exit_code == 2 and "SQLite is a file of one machine" in result.output
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--no-write-tables"])
    assert result.exit_code == 2 and "only applies to a shared run" in result.output
    help_text = runner.invoke(main, ["tune", "--help"]).output
    assert "--run-id" in help_text and "--no-write-tables" in help_text and "--stale-after" in help_text
    with pytest.raises(ValueError, match="needs a storage every host can open"):
        run_tuning(TuneSettings(**tuning_args(tmp_path, None), run_id="r1"))
    with pytest.raises(ValueError, match="write_tables=False needs a shared run"):
        run_tuning(TuneSettings(**tuning_args(tmp_path, None), write_tables=False))


if __name__ == "__main__":
    sys.exit(helper_main(sys.argv[1:]))
