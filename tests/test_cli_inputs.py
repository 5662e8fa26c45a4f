"""Files and folders that users name on the command line: read with a cap and never blocking, checked before any
work starts, and results that are never lost to a failed write. No benchmark runs here (one tiny loss on the CPU
aside): the run functions are replaced by fakes, and the autouse fixture makes any other run fail the test."""

import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner

from liger_gen import files, training
from liger_gen.bench import first_step, losses, report, step
from liger_gen.cli import main

ROOT = Path(__file__).resolve().parents[1]
_REAL_RUN_STEP = step.run_step_benchmark  # before the autouse fixture replaces it
_REAL_RUN_LOSSES = losses.run_losses


class Hung(BaseException):
    """Raised by the alarm: a BaseException, so CliRunner does not swallow it as the command's exception."""


@contextmanager
def hangs_after(seconds: float):
    """Fail (with Hung) instead of blocking forever, e.g. on a FIFO nobody writes."""
    def on_alarm(signum, frame):
        raise Hung(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _no_run(*args, **kwargs):
    raise AssertionError("a benchmark ran: the command should have stopped before it")


@pytest.fixture(autouse=True)
def no_benchmarks(monkeypatch):
    import liger_gen.bench

    for module, name in ((liger_gen.bench, "run_bench"), (step, "run_step_benchmark"), (first_step, "run_first_step"),
                         (losses, "run_losses")):
        monkeypatch.setattr(module, name, _no_run)


def _bench_result() -> dict:
    """The smallest dict ``report.validate`` accepts (what a run of no op returns)."""
    return {"schema": 1, "benchmark": "liger-gen bench",
            "meta": {"gpu": "cpu", "versions": {}, "command": "liger-gen bench", "date": "2026-01-01",
                     "ceilings": {}},
            "config": {"model": {"name": "tiny"}, "dtype": "float32", "ops": [], "providers": []},
            "ops": {}, "results": []}


def _usage_error(result, *needles):
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # a click error, not a traceback
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, (needle, result.output)


# ------------------------------------------------------------------------------------------------ input files


def test_bench_step_text_that_is_a_fifo_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setattr(step, "run_step_benchmark", _REAL_RUN_STEP)  # the text is read before any model is built
    fifo = tmp_path / "text.fifo"
    os.mkfifo(fifo)
    with hangs_after(20):
        result = CliRunner().invoke(main, ["bench-step", "--device", "cpu", "--model", "tiny", "--text", str(fifo)])
    _usage_error(result, "--text", str(fifo), "not a regular file")


def test_bench_step_text_that_is_a_device_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(step, "run_step_benchmark", _REAL_RUN_STEP)
    result = CliRunner().invoke(main, ["bench-step", "--device", "cpu", "--model", "tiny", "--text", "/dev/null"])
    _usage_error(result, "--text", "/dev/null", "not a regular file")


def test_bench_step_text_from_dev_zero_stops_at_once(tmp_path):
    """In a child process whose address space is capped at 1 GiB beyond what it has once the command line is
    imported, so a reader that reads /dev/zero without end fails with MemoryError instead of filling this
    machine's memory."""
    code = ("import resource, sys; from liger_gen.cli import main; "
            "size = 1024 * int(next(line.split()[1] for line in open('/proc/self/status') "
            "if line.startswith('VmSize:'))); "
            "resource.setrlimit(resource.RLIMIT_AS, (size + 2**30, size + 2**30)); "
            "main(sys.argv[1:], prog_name='liger-gen')")
    proc = subprocess.run([sys.executable, "-c", code, "bench-step", "--device", "cpu", "--model", "tiny",
                           "--text", "/dev/zero", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--text" in proc.stderr and "/dev/zero" in proc.stderr and "not a regular file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_step_text_over_the_cap_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setattr(step, "run_step_benchmark", _REAL_RUN_STEP)
    monkeypatch.setattr(training, "MAX_TEXT_BYTES", 1000)
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 1001)
    result = CliRunner().invoke(main, ["bench-step", "--device", "cpu", "--model", "tiny", "--text", str(big)])
    _usage_error(result, "--text", str(big), "1,001 bytes, more than the 1,000")
    with pytest.raises(ValueError, match="more than the 1,000"):
        training.byte_tokens(big)  # the library reads with the same cap


def test_training_text_is_read_as_bytes_whatever_its_encoding(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf\xe9\x00\xff")
    assert training.byte_tokens(path).tolist() == [99, 97, 102, 233, 0, 255]


def test_too_little_text_names_options_that_exist(tmp_path, monkeypatch):
    monkeypatch.setattr(step, "run_step_benchmark", _REAL_RUN_STEP)  # it stops before building a model
    short = tmp_path / "short.txt"
    short.write_bytes(b"To be, or not to be")
    result = CliRunner().invoke(main, ["bench-step", "--device", "cpu", "--model", "tiny", "--text", str(short),
                                       "--seq-len", "64"])
    _usage_error(result, "--seq-len 64", "--text")
    assert "--max-chars" not in result.output
    with pytest.raises(ValueError) as caught:
        training.make_batches(training.byte_tokens(short), 1, 1, 64, 0)
    assert "--max-chars" not in str(caught.value) and "--text" in str(caught.value)


def test_bench_render_of_a_fifo_is_a_usage_error(tmp_path):
    fifo = tmp_path / "result.json"
    os.mkfifo(fifo)
    with hangs_after(20):
        result = CliRunner().invoke(main, ["bench", "--render", str(fifo), "--out", str(tmp_path / "out")])
    _usage_error(result, "--render", str(fifo), "not a regular file")


def test_bench_render_of_deeply_nested_json_is_a_usage_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    result = CliRunner().invoke(main, ["bench", "--render", str(deep), "--out", str(tmp_path / "out")])
    _usage_error(result, "--render", str(deep), "nested")


@pytest.mark.parametrize("field,value", [("meta", None), ("config", 3), ("results", [5]), ("results", ["op"]),
                                         ("op", [])])
def test_bench_render_of_a_mistyped_section_is_a_usage_error(tmp_path, field, value):
    import json

    data = _bench_result()
    if field == "op":
        data["results"] = [{key: 0 for key in report.REQUIRED["result"]}]
        data["results"][0]["op"] = value
    else:
        data[field] = value
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    result = CliRunner().invoke(main, ["bench", "--render", str(path), "--out", str(tmp_path / "out")])
    _usage_error(result, "--render", "must be")


def test_bench_render_of_an_oversized_file_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "MAX_RESULT_BYTES", 100)
    path = report.write_json(_bench_result(), tmp_path / "run.json")
    result = CliRunner().invoke(main, ["bench", "--render", str(path), "--out", str(tmp_path / "out")])
    _usage_error(result, "--render", str(path), "more than the 100")


# ------------------------------------------------------------------------------------------------ --out

COMMANDS = {
    "bench": ["bench", "--device", "cpu", "--model", "tiny"],
    "bench-render": ["bench", "--render", str(ROOT / "benchmarks/results/h200_2026-11-30/"
                                                     "bench_llama3-8b_nvidia_h200.json")],
    "bench-step": ["bench-step", "--device", "cpu", "--model", "tiny"],
    "bench-step-first": ["bench-step", "--first-step", "--device", "cpu", "--model", "tiny"],
    "bench-losses": ["bench-losses", "--device", "cpu"],
    "tune": ["tune", "--gpu", "h200"],
    "build": ["build", "--gpu", "h200"],
}


def _bad_outs(tmp_path):
    (tmp_path / "a_file").write_text("x")
    return {"device": "/dev/null", "under a file": str(tmp_path / "a_file" / "out"),
            "a file": str(tmp_path / "a_file"), "unwritable folder": "/proc"}


@pytest.mark.parametrize("kind", ["device", "under a file", "a file", "unwritable folder"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_unusable_out_is_a_usage_error_before_any_work(command, kind, tmp_path):
    if kind == "unwritable folder" and not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc, a folder where no file can be made (not even by root)")
    out = _bad_outs(tmp_path)[kind]
    result = CliRunner().invoke(main, [*COMMANDS[command], "--out", out])
    _usage_error(result, "--out", out)


def test_an_out_folder_on_a_read_only_disk_is_a_usage_error(tmp_path, monkeypatch):
    """Root writes through any mode bits, so a read-only mount is simulated where the check meets it: making
    the probe file fails with EROFS."""
    import errno
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(kwargs.get("dir")))

    folder = tmp_path / "mounted"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    result = CliRunner().invoke(main, ["bench-losses", "--device", "cpu", "--out", str(folder)])
    _usage_error(result, "--out", str(folder), "Read-only file system")


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_an_out_that_is_a_broken_link_says_so(tmp_path, kind):
    link = tmp_path / "out"
    if kind == "dangling":
        link.symlink_to(tmp_path / "nowhere")
    else:
        (tmp_path / "other").symlink_to(link)
        link.symlink_to(tmp_path / "other")
    result = CliRunner().invoke(main, ["bench-losses", "--device", "cpu", "--out", str(link)])
    _usage_error(result, "--out", str(link), "symbolic link that leads nowhere")


def test_the_out_check_creates_the_folder_and_leaves_no_probe(tmp_path):
    folder = tmp_path / "a" / "b"
    assert files.writable_folder(folder) == folder
    assert folder.is_dir() and list(folder.iterdir()) == []
    assert files.writable_folder(folder) == folder  # an existing folder passes too
    with pytest.raises(ValueError, match="not a folder"):
        files.writable_folder("/dev/null")


def _make_unusable(folder: Path) -> None:
    """The out folder goes away during the run (a disk unmounted, a cleanup job) and a file takes its place."""
    folder.rmdir()
    folder.write_text("not a folder any more")


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """Where the results that could not be written are kept (the system's temporary folder in real runs)."""
    import tempfile

    keep = tmp_path / "tmp"
    keep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(keep))
    return keep


def _kept(temp_dir: Path, output: str) -> dict:
    kept = list(temp_dir.iterdir())
    assert len(kept) == 1, kept
    assert str(kept[0]) in output
    return json.loads(kept[0].read_text())


def test_bench_keeps_its_results_when_the_final_write_fails(tmp_path, temp_dir, monkeypatch):
    import liger_gen.bench

    out = tmp_path / "out"

    def run_bench(*args, **kwargs):
        _make_unusable(out)
        return _bench_result()

    monkeypatch.setattr(liger_gen.bench, "run_bench", run_bench)
    result = CliRunner().invoke(main, ["bench", "--device", "cpu", "--model", "tiny", "--out", str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"cannot write {out / 'bench_tiny_cpu.json'}" in result.output
    assert _kept(temp_dir, result.output)["results"] == []


def test_bench_step_keeps_its_results_when_the_final_write_fails(tmp_path, temp_dir, monkeypatch):
    out = tmp_path / "out"
    measured = {"schema": step.SCHEMA, "models": {"tiny": {"providers": {}}}}

    def run_step_benchmark(**options):
        _make_unusable(out)
        return step.finish_run(measured, options["out_dir"], "step.json", step.print_report, False)

    monkeypatch.setattr(step, "run_step_benchmark", run_step_benchmark)
    result = CliRunner().invoke(main, ["bench-step", "--device", "cpu", "--model", "tiny", "--out", str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"cannot write {out / 'step.json'}" in result.output
    assert _kept(temp_dir, result.output) == measured


def test_bench_losses_keeps_its_results_when_the_write_fails(tmp_path, temp_dir, monkeypatch):
    """A real (tiny) run of one loss: its row is kept though the out folder went away during the run."""
    out = tmp_path / "out"

    def run_losses(*args, **kwargs):
        _make_unusable(out)
        return _REAL_RUN_LOSSES(*args, **kwargs)

    monkeypatch.setattr(losses, "run_losses", run_losses)
    result = CliRunner().invoke(main, ["bench-losses", "--device", "cpu", "--losses", "dpo", "--providers",
                                       "torch-eager", "--hidden", "16", "--vocab", "32", "--batch", "1", "--seq",
                                       "8", "--iters", "1", "--warmup", "1", "--out", str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"cannot write {out / 'bench_losses.json'}" in result.output
    rows = _kept(temp_dir, result.output)["rows"]
    assert [(r["loss"], r["provider"]) for r in rows] == [("dpo", "torch-eager")]


def test_results_are_printed_when_no_file_can_be_written(tmp_path, monkeypatch, capsys):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))  # the fallback file fails too
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(files.ResultsNotWritten, match="printed above") as caught:
        files.write_results(tmp_path / "a_file" / "r.json", '{"rows": [1]}\n')
    assert caught.value.kept is None
    assert capsys.readouterr().out == '{"rows": [1]}\n'


# ------------------------------------------------------------------------------------------------ lists


@pytest.mark.parametrize("args", [
    ["tune", "--gpu", "h200", "--rows", "4096,,8"],
    ["tune", "--gpu", "h200", "--rows", "4096,"],
    ["tune", "--gpu", "h200", "--ops", "rms_norm,,rope"],
    ["tune", "--gpu", "h200", "--dtype", "bfloat16,,float16"],
    ["tune", "--gpu", "h200", "--devices", "0,,1"],
    ["build", "--gpu", "h200", "--rows", ",4096"],
    ["show", "--gpu", "h200", "--ops", "rms_norm,"],
    ["verify", "--gpu", "h200", "--rows", "4096,,8"],
    ["verify", "--gpu", "h200", "--dtype", "bfloat16,,float16"],
    ["bench", "--device", "cpu", "--model", "tiny", "--ops", "rms_norm,,swiglu"],
    ["bench", "--device", "cpu", "--model", "tiny", "--providers", "liger-gen,,torch-eager"],
    ["bench-step", "--device", "cpu", "--model", "tiny,"],
    ["bench-step", "--device", "cpu", "--model", "tiny", "--providers", "transformers,,liger-gen"],
    ["bench-losses", "--device", "cpu", "--losses", "dpo,,orpo"],
    ["bench-losses", "--device", "cpu", "--providers", "torch-eager,"],
], ids=lambda args: " ".join(args[:1] + args[-2:]))
def test_an_empty_item_in_a_list_is_a_usage_error(args):
    result = CliRunner().invoke(main, args)
    _usage_error(result, "empty item", args[-2])
