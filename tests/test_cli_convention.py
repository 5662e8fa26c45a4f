"""Command-line conventions: `python -m liger_gen`, what --model takes, refusing to guess, output that reads the
same outside a terminal, a short `show`, and hints that work when followed verbatim."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from liger_gen.cli import main
from liger_gen.runtime import tables

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CONFIG = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=1024, rms_norm_eps=1e-6, hidden_act="silu")


def _no_columns(monkeypatch):
    """No COLUMNS/LINES from the environment: rich falls back to its own default width."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)


# 1. python -m liger_gen

def test_python_dash_m_runs_the_command_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-m", "liger_gen", "--help"], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Usage: python -m liger_gen" in result.stdout and "verify" in result.stdout
    version = subprocess.run([sys.executable, "-m", "liger_gen", "--version"], capture_output=True, text=True,
                             env=env, cwd=ROOT, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("liger-gen, version"), version.stdout


# 2. verify --model: a model folder; no guessing without transformers

def test_verify_takes_a_hugging_face_model_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(tables.ENV_TUNED_DIR, raising=False)
    folder = tmp_path / "Llama-mini"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    result = CliRunner().invoke(main, ["verify", "--gpu", "h200", "--model", str(folder), "--rows", "4096",
                                       "--allow-heuristic"])
    assert result.exit_code == 0, result.output
    assert "LlamaForCausalLM" in result.output and "Llama-mini on h200" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = CliRunner().invoke(main, ["verify", "--gpu", "h200", "--model", str(empty)])
    assert refused.exit_code == 2 and "without a config.json" in refused.output, refused.output


@pytest.mark.parametrize("model", ["llama3-8b", "config"])
def test_verify_without_transformers_refuses_to_guess_the_ops(tmp_path, monkeypatch, model):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    if model == "config":
        model = str(tmp_path / "config.json")
        Path(model).write_text(json.dumps(LLAMA_CONFIG))
    result = CliRunner().invoke(main, ["verify", "--gpu", "h200", "--model", model])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "does not guess" in text and "--ops" in text and "Traceback" not in text
    assert "pip install 'liger-gen[transformers]'" in text and "pip install -e '.[transformers]'" in text
    named = CliRunner().invoke(main, ["verify", "--gpu", "h200", "--model", model, "--ops", "rms_norm",
                                      "--allow-heuristic"])
    assert named.exit_code == 0, named.output
    assert "ops checked: rms_norm (those named by --ops)" in named.output


# 3. outside a terminal nothing is wrapped

def test_verify_output_is_not_wrapped_outside_a_terminal(monkeypatch):
    _no_columns(monkeypatch)
    monkeypatch.delenv(tables.ENV_TUNED_DIR, raising=False)
    result = CliRunner().invoke(main, ["verify", "--gpu", "h200", "--model", "llama3-8b"])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("│")]
    assert rows and all("(tuned at " in line and ".json" in line for line in rows), result.output
    packaged = str(tables.packaged_root() / "h200")
    for op in ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"):
        assert any(f"{packaged}/{op}.json (tuned at" in line for line in rows), op
    assert any(line.startswith("ops checked: ") and line.rstrip().endswith(")") for line in
               result.output.splitlines())


# 4. show: one line per op first, --detail for the tables

def _user_rms_norm_table(tmp_path, monkeypatch):
    import torch

    from liger_gen.ops.norms.rms_norm import RMSNormSpace

    monkeypatch.setenv(tables.ENV_TUNED_DIR, str(tmp_path))
    t = tables.new_table(RMSNormSpace, "h200", "NVIDIA H200", "9.0")
    cfg = RMSNormSpace(4096, torch.bfloat16).heuristic().to_dict()
    timing = [(0.05, 0.06, 0.1, 0.1), (0.1, 0.2, 0.1, 0.2), (0.1, 0.1, 0.1, 0.1)]  # gains +6.7%, +100%, 0%
    t["entries"] = [{"dtype": "bfloat16", "dims": {"n_cols": 4096}, "rows": rows, "config": cfg, "heuristic": cfg,
                     "timing_ms": {"fwd": {"tuned": ft, "heuristic": fh}, "bwd": {"tuned": bt, "heuristic": bh}}}
                    for rows, (ft, fh, bt, bh) in zip((4096, 16384, 65536), timing)]
    tables.write_table(tables.table_path(tmp_path, "h200", "rms_norm"), t)


def test_show_opens_with_one_line_per_op(tmp_path, monkeypatch):
    _no_columns(monkeypatch)
    _user_rms_norm_table(tmp_path, monkeypatch)
    result = CliRunner().invoke(main, ["show", "--gpu", "h200", "--ops", "rms_norm"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("rms_norm: ")]
    assert len(lines) == 2, result.output  # the user table and the packaged one
    user = next(line for line in lines if "packaged rms_norm.json" not in line)
    assert "3 shape(s) tuned" in user and "median gain over the heuristic +6.7%" in user, user
    assert "compiled" in user and user.rstrip().endswith("in use"), user
    assert "┏" not in result.output and "n_cols=4096" not in result.output  # no tables without --detail
    assert "liger-gen show --gpu h200 --ops rms_norm --detail" in result.output
    detail = CliRunner().invoke(main, ["show", "--gpu", "h200", "--ops", "rms_norm", "--detail"])
    assert detail.exit_code == 0 and "configs" in detail.output and "2.00x" in detail.output, detail.output


# 5. every "run this instead" hint is a command the CLI accepts verbatim

HINT = re.compile(r"`((?:TRITON_INTERPRET=1 )?liger-gen [^`]*)`")


def _hinted_commands(output: str) -> list[str]:
    """The commands quoted in backticks in ``output`` (the message joined across lines), less the templates a user
    completes (<result>.json, NAME, ...)."""
    text = " ".join(output.split())
    return [c for c in HINT.findall(text) if "<" not in c and "NAME" not in c and "..." not in c]


def _parses(command: str) -> None:
    """``command`` parses as the CLI would parse it, every option's check run, without running the command."""
    args = shlex.split(command)
    if args[0] == "TRITON_INTERPRET=1":
        args = args[1:]
    assert args[0] == "liger-gen", command
    with main.commands[args[1]].make_context(args[1], args[2:]):  # click.UsageError/BadParameter if not
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU hints")
@pytest.mark.parametrize("args,expected", [
    (["bench"], ["liger-gen bench --device cpu --model tiny --providers liger-gen,torch-eager"]),
    (["bench-step"], ["liger-gen bench-step --device cpu --model tiny "]),
    # a real model's shapes on the CPU need its full weights (tens of GB for llama3-8b-4l): the hint names tiny
    (["bench-step", "--model", "qwen2.5-0.5b"], ["liger-gen bench-step --device cpu --model tiny "]),
    (["bench-losses"], ["liger-gen bench-losses --device cpu "]),
    (["tune", "--gpu", "h200", "--model", "llama3.2-1b"], ["liger-gen show --gpu h200",
                                                           "liger-gen tune --gpu h200 --model llama3.2-1b"]),
    (["build", "--gpu", "h200", "--model", "tiny"], ["liger-gen build --gpu h200 --model tiny"]),
])
def test_no_gpu_hints_are_valid_commands(tmp_path, monkeypatch, args, expected):
    monkeypatch.chdir(tmp_path)  # --out's default folder
    from liger_gen.bench import step

    monkeypatch.setattr(step, "run_step_benchmark", lambda **kw: pytest.fail("started a benchmark"))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    commands = _hinted_commands(result.output)
    for want in expected:
        assert any(want in c for c in commands), (want, commands)
    for command in commands:
        _parses(command)


def test_the_bench_step_hint_runs_as_printed(tmp_path, monkeypatch):
    """The hinted CPU run of bench-step, followed verbatim: what it asks the benchmark for is the tiny run."""
    from liger_gen.bench import step

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hint = _hinted_commands(CliRunner().invoke(main, ["bench-step"]).output)
    command = next(c for c in hint if "bench-step --device cpu" in c)
    seen = {}
    monkeypatch.setattr(step, "run_step_benchmark", lambda **kw: seen.update(kw) or {"models": {}})
    run = CliRunner().invoke(main, shlex.split(command)[2:], env={"TRITON_INTERPRET": "1"})
    assert run.exit_code == 0, run.output
    assert seen["models"] == ["tiny"] and seen["device"] == "cpu" and seen["batch_size"] == 2
