"""Command-line conventions, part two: one --model option everywhere (repeatable, comma-separated, old spellings as
deprecated aliases), --json on every command, progress bars only on a terminal's stderr, CPU results labelled as
functional runs, and benchmark output in a folder of its own.

The benchmark commands run once each with --json and once without, at the smallest sizes they take (a module
fixture: about 20 s on two cores); the assertions share those runs."""

import io
import json
import os
import re

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console

from liger_gen import console as console_module
from liger_gen.cli import main

ESC = re.compile(r"\x1b|\x07|\r")
KEYS = {"schema", "command", "ok", "exit_code", "error", "files", "result"}

BENCH = ["bench", "--device", "cpu", "--model", "tiny", "--ops", "swiglu", "--rows", "8", "--providers",
         "liger-gen,torch-eager", "--dtype", "float32", "--iters", "1", "--wall-iters", "1", "--warmup", "1"]
STEP = ["bench-step", "--device", "cpu", "--model", "tiny", "--providers", "transformers,liger-gen", "--batch-size",
        "1", "--seq-len", "8", "--warmup-steps", "0", "--steps", "1", "--profile-steps", "0"]
LOSSES = ["bench-losses", "--device", "cpu", "--losses", "dpo", "--providers", "torch-eager,liger-gen", "--hidden",
          "16", "--vocab", "32", "--batch", "1", "--seq", "8", "--iters", "1", "--warmup", "1"]
COMMANDS = {"bench": BENCH, "bench-step": STEP, "bench-losses": LOSSES}


class _Run:
    """One command run in a folder of its own: click's result, what a terminal's progress bar would have shown,
    and the names at the top of the folder afterwards."""

    def __init__(self, args, folder, monkeypatch):
        self.bar = io.StringIO()
        # stderr as a terminal for the progress bar (CliRunner's streams are not one): a console writing to a buffer
        monkeypatch.setattr(console_module, "progress_console",
                            lambda: Console(file=self.bar, force_terminal=True, width=120))
        folder.mkdir()
        cwd = os.getcwd()
        os.chdir(folder)
        try:
            self.result = CliRunner().invoke(main, args)
        finally:
            os.chdir(cwd)
        self.folder = folder
        self.top = sorted(p.name for p in folder.iterdir())

    def document(self) -> dict:
        return json.loads(self.result.stdout)  # the whole of stdout is one document

    def written(self) -> list:
        return sorted((self.folder / "bench-results").glob("*/*"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each benchmark command at its smallest, with --json and without, none given --out."""
    root = tmp_path_factory.mktemp("cli_output")
    out = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, args in COMMANDS.items():
            out[name] = _Run(args, root / name, monkeypatch)
            out[name + " --json"] = _Run(args + ["--json"], root / f"{name}-json", monkeypatch)
    return out


# 1. --model: one name, repeatable and comma-separated; old spellings are deprecated aliases

@pytest.fixture
def step_options(monkeypatch, tmp_path):
    """bench-step's options as the benchmark receives them (it is replaced by a stand-in that records them)."""
    from liger_gen.bench import step

    seen = {}
    monkeypatch.setattr(step, "run_step_benchmark", lambda **kw: seen.update(kw) or {"models": {}})
    monkeypatch.chdir(tmp_path)
    return seen


def test_model_is_repeatable_and_comma_separated(step_options):
    result = CliRunner().invoke(main, ["bench-step", "--device", "cpu", "--model", "tiny,tiny-qwen2", "--model",
                                       "llama3.2-1b"])
    assert result.exit_code == 0, result.output
    assert step_options["models"] == ["tiny", "tiny-qwen2", "llama3.2-1b"]
    assert "deprecated" not in result.output


def test_models_is_a_hidden_deprecated_alias(step_options):
    result = CliRunner().invoke(main, ["bench-step", "--device", "cpu", "--models", "tiny,tiny-qwen2"])
    assert result.exit_code == 0, result.output
    assert step_options["models"] == ["tiny", "tiny-qwen2"]
    assert [line for line in result.stderr.splitlines() if "deprecated" in line] == [
        "liger-gen: --models is deprecated, use --model (it takes the same values)"]
    assert "deprecated" not in result.stdout
    help_text = CliRunner().invoke(main, ["bench-step", "--help"]).output
    assert "--model " in help_text and "--models" not in help_text


@pytest.mark.parametrize("command", [["tune", "--gpu", "h200"], ["build", "--gpu", "h200"],
                                     ["verify", "--gpu", "h200"], ["bench", "--device", "cpu"]])
@pytest.mark.parametrize("models", [["--model", "llama3-8b,llama3.2-1b"],
                                    ["--model", "llama3-8b", "--model", "llama3.2-1b"]])
def test_one_model_commands_refuse_several(command, models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, command + models)
    assert result.exit_code == 2, result.output
    assert "takes one model, got 2 (llama3-8b, llama3.2-1b)" in result.output
    assert list(tmp_path.iterdir()) == []


def test_the_training_example_takes_model_and_preset_is_its_deprecated_alias(capsys):
    from liger_gen.examples import train_llama

    parser = train_llama.build_parser()
    assert parser.parse_args(["--model", "llama3.2-1b"]).model == "llama3.2-1b"
    assert capsys.readouterr().err == ""
    assert parser.parse_args(["--preset", "llama3.2-1b"]).model == "llama3.2-1b"
    assert capsys.readouterr().err.count("--preset is deprecated, use --model") == 1
    assert "--preset" not in parser.format_help()
    for several in (["--model", "tiny,llama3.2-1b"], ["--model", "tiny", "--preset", "llama3.2-1b"]):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args(several)
        assert stop.value.code == 2 and "trains one model, got 2" in capsys.readouterr().err


# 2. --json: one document on stdout, the same keys for every command

@pytest.mark.parametrize("name", list(COMMANDS))
def test_bench_commands_print_one_json_document(runs, name):
    run = runs[name + " --json"]
    assert run.result.exit_code == 0, run.result.output
    doc = run.document()
    assert set(doc) == KEYS and doc["command"] == name and doc["ok"] and doc["error"] is None
    assert doc["result"]["functional_run"] is True
    written = json.loads((run.folder / doc["files"]["json"]).read_text())
    assert written["functional_run"] is True
    assert run.result.stderr.strip()  # the progress lines and the "wrote" line: on stderr, not stdout
    assert "wrote" not in run.result.stdout and run.bar.getvalue() == ""  # no bar under --json


def test_bench_json_result_is_the_measured_result(runs):
    doc = runs["bench --json"].document()
    assert [(r["op"], r["provider"]) for r in doc["result"]["results"]] == [("swiglu", "liger-gen"),
                                                                           ("swiglu", "torch-eager")]
    step = runs["bench-step --json"].document()["result"]
    assert set(step["models"]["tiny"]["providers"]) == {"transformers", "liger-gen"}


def test_verify_and_show_print_json(monkeypatch):
    from liger_gen.runtime import tables

    monkeypatch.delenv(tables.ENV_TUNED_DIR, raising=False)
    verify = CliRunner().invoke(main, ["verify", "--gpu", "h200", "--model", "llama3-8b", "--ops", "rms_norm",
                                       "--rows", "4096", "--json"])
    doc = json.loads(verify.stdout)
    assert set(doc) == KEYS and doc["command"] == "verify" and verify.exit_code == doc["exit_code"] == 0
    assert [(f["op"], f["rows"], f["source"]) for f in doc["result"]["findings"]] == [("rms_norm", 4096, "packaged")]
    show = CliRunner().invoke(main, ["show", "--gpu", "h200", "--ops", "rms_norm", "--json"])
    doc = json.loads(show.stdout)
    assert set(doc) == KEYS and doc["command"] == "show" and show.exit_code == 0
    (table,) = doc["result"]["tables"]
    assert table["op"] == "rms_norm" and table["source"] == "packaged" and table["shapes_tuned"] > 0
    assert table["in_use"] is True and table["status"].startswith("in use")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
@pytest.mark.parametrize("command", ["tune", "build"])
def test_gpu_commands_refuse_with_a_json_error_document(command):
    result = CliRunner().invoke(main, [command, "--gpu", "h200", "--model", "tiny", "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert set(doc) == KEYS and doc["command"] == command and doc["ok"] is False and doc["exit_code"] == 1
    assert doc["error"]["kind"] == "no-gpu" and "no CUDA GPU is visible" in doc["error"]["message"]
    assert f"liger-gen {command} --gpu h200 --model tiny" in doc["error"]["hints"]


def test_show_without_a_gpu_names_the_option_as_a_no_gpu_hint(monkeypatch):
    """``show`` on a machine without a GPU: kind no-gpu, and the hint is the command to run (not the bare command
    that failed, which no hint list repeats)."""
    import liger_gen.runtime.devices as devices

    monkeypatch.setattr(devices, "current_gpu", lambda *a, **k: None)
    result = CliRunner().invoke(main, ["show", "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["error"]["kind"] == "no-gpu"
    assert doc["error"]["hints"] == ["liger-gen show --gpu h200"]
    bench = json.loads(CliRunner().invoke(main, ["bench-step", "--json"]).stdout)["error"]["hints"]
    assert bench and "liger-gen bench-step" not in bench


def test_a_usage_error_under_json_is_a_json_document():
    result = CliRunner().invoke(main, ["bench", "--device", "cpu", "--model", "tiny", "--ops", "softmax9", "--json"])
    assert result.exit_code == 2
    doc = json.loads(result.stdout)
    assert doc["error"]["kind"] == "usage" and doc["error"]["param"] == "--ops" and "softmax9" in doc["error"]["message"]
    assert doc["exit_code"] == 2 and doc["result"] is None


# 3. progress bars: on a terminal's stderr only

@pytest.mark.parametrize("name", list(COMMANDS))
def test_progress_bar_on_a_terminal_and_no_control_characters_in_the_output(runs, name):
    run = runs[name]
    assert run.result.exit_code == 0, run.result.output
    assert name in run.bar.getvalue() and "\x1b[" in run.bar.getvalue()  # drawn on the (forced) terminal
    assert not ESC.search(run.result.output)  # what the command printed itself has no control characters


def test_no_progress_console_off_a_terminal():
    assert console_module.progress_console() is None  # pytest's stderr is captured: not a terminal
    with console_module.progress_bar("x") as bar:
        assert bar is console_module.NO_PROGRESS


# 4. CPU results are labelled functional runs

def test_cpu_tables_say_functional_run(runs):
    assert "functional run, not performance" in " ".join(runs["bench"].result.stdout.split())
    assert "functional run, not performance" in " ".join(runs["bench-step"].result.stdout.split())
    first = runs["bench-losses"].result.stdout.splitlines()[0]
    assert first.startswith("functional run on the CPU (") and "not performance" in first


def test_cpu_tables_show_no_rate_or_share_of_a_gpu_ceiling(runs):
    """A functional run's times are the host's: the table leaves out the rate and the % SOL, which a GPU run of
    the same results shows."""
    from liger_gen.bench import report

    data = runs["bench --json"].document()["result"]
    rows = report.table_rows(data)
    assert rows and all(r["rate"] == "-" and r["% SOL"] == "-" for r in rows)
    gpu = {**data, "functional_run": False, "functional_run_reason": None, "meta": {**data["meta"], "device": "cuda"}}
    assert any(r["% SOL"] != "-" for r in report.table_rows(gpu))


def test_cpu_json_and_plot_caption_say_functional_run(runs):
    from liger_gen.bench import report

    doc = runs["bench --json"].document()
    reason = doc["result"]["functional_run_reason"]
    assert reason.startswith("functional run on the CPU") and "\n" not in reason
    assert reason in report.plot_title(doc["result"])
    gpu = {**doc["result"], "functional_run": False, "functional_run_reason": None,
           "meta": {**doc["result"]["meta"], "device": "cuda"}}
    assert "functional run" not in report.plot_title(gpu) and report.functional_note(gpu) is None


# 5. benchmark output goes into a folder of its own

@pytest.mark.parametrize("name", list(COMMANDS))
def test_bench_without_out_writes_only_its_folder(runs, name):
    for run in (runs[name], runs[name + " --json"]):
        assert run.top == ["bench-results"], run.top
        written = run.written()
        assert written and all(p.parent.name.startswith(name + "-") for p in written)
        assert any(p.suffix == ".json" for p in written)


def test_a_refused_run_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["bench-step", "--device", "cpu", "--model", "tiny", "--lr", "-1"])
    assert result.exit_code == 2, result.output
    assert list(tmp_path.iterdir()) == []
