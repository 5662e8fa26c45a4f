"""The liger-gen command line on a machine without a GPU."""

import json
import os

import pytest
import torch
from click.testing import CliRunner

from liger_gen.cli import main
from liger_gen.models import PRESETS, resolve_model
from liger_gen.runtime import tables


@pytest.fixture
def runner():
    return CliRunner()


def test_help_lists_commands(runner):
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "tune" in result.output and "show" in result.output
    result = runner.invoke(main, ["tune", "--help"])
    assert result.exit_code == 0 and "--gpu" in result.output and "--model" in result.output


@pytest.mark.parametrize("name", ["../h200", "h 200", "-h200", "h200_", ""])
def test_a_malformed_gpu_name_is_a_usage_error(runner, name):
    result = runner.invoke(main, ["tune", "--gpu", name])
    assert result.exit_code == 2
    assert "is not a GPU name" in result.output and "h200" in result.output and "tesla-t4" in result.output


def test_a_gpu_the_runtime_names_by_its_slug_can_be_shown_and_tuned(runner, tmp_path, monkeypatch):
    """A GPU outside the known list (here a Tesla T4) gets the slug canonical_gpu_name derives; show and tune
    accept it (tune then requires that GPU to be the visible one)."""
    from liger_gen.ops.norms.rms_norm import RMSNormSpace
    from liger_gen.runtime import devices

    slug = devices.canonical_gpu_name("Tesla T4")
    assert slug == "tesla-t4"
    monkeypatch.setenv(tables.ENV_TUNED_DIR, str(tmp_path))
    t = tables.new_table(RMSNormSpace, slug, "Tesla T4", "7.5")
    cfg = RMSNormSpace(4096, torch.bfloat16).heuristic().to_dict()
    t["entries"] = [{"dtype": "bfloat16", "dims": {"n_cols": 4096}, "rows": 16384, "config": cfg}]
    tables.write_table(tables.table_path(tmp_path, slug, "rms_norm"), t)
    result = runner.invoke(main, ["show", "--gpu", slug], terminal_width=200)
    assert result.exit_code == 0 and "in use" in result.output, result.output
    monkeypatch.setattr(devices, "current_gpu", lambda device=None: ("h200", "NVIDIA H200"))
    result = runner.invoke(main, ["tune", "--gpu", slug])
    assert result.exit_code == 1 and "does not match the visible GPU 'NVIDIA H200'" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_no_gpu_message_names_the_packaged_tables_that_exist(runner):
    result = runner.invoke(main, ["tune", "--gpu", "a100"])
    assert result.exit_code == 1
    assert "no tables for a100 are packaged (packaged: h200" in result.output
    assert "show --gpu a100" not in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_no_gpu_says_what_to_run(runner):
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--model", "llama3-8b"])
    assert result.exit_code == 1
    assert "no CUDA GPU is visible" in result.output
    assert "liger-gen tune --gpu h200 --model llama3-8b" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_show_without_gpu_needs_a_name(runner):
    result = runner.invoke(main, ["show"])
    assert result.exit_code == 1 and "--gpu" in result.output


def test_show_of_an_op_without_a_table_says_it_runs_its_heuristic(runner, tmp_path, monkeypatch):
    """The GPU has tables, not of the op asked for: the message says so instead of 'no tables for h200'."""
    from liger_gen.ops.norms.rms_norm import RMSNormSpace

    monkeypatch.setattr(tables, "table_roots", lambda: [("user", tmp_path)])
    t = tables.new_table(RMSNormSpace, "h200", "NVIDIA H200", "9.0")
    tables.write_table(tables.table_path(tmp_path, "h200", "rms_norm"), t)
    result = runner.invoke(main, ["show", "--gpu", "h200", "--ops", "adamw"], terminal_width=200)
    assert result.exit_code == 1
    assert "no tuned table of adamw for 'h200'" in result.output and "runs its heuristic" in result.output
    other = runner.invoke(main, ["show", "--gpu", "h100", "--ops", "adamw"], terminal_width=200)
    assert other.exit_code == 1 and "no tuned tables for 'h100'" in other.output


def test_bad_model_and_ops_are_usage_errors(runner):
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--model", "gpt-17"])
    assert result.exit_code == 2 and "unknown model 'gpt-17'" in result.output
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--ops", "rms_norm,softmax9"])
    assert result.exit_code == 2 and "softmax9" in result.output
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--rows", "4096,abc"])
    assert result.exit_code == 2 and "integers" in result.output


def test_show_lists_a_user_table(runner, tmp_path, monkeypatch):
    from liger_gen.ops.norms.rms_norm import RMSNormSpace

    monkeypatch.setenv(tables.ENV_TUNED_DIR, str(tmp_path))
    t = tables.new_table(RMSNormSpace, "h200", "NVIDIA H200", "9.0")
    cfg = RMSNormSpace(4096, torch.bfloat16).heuristic().to_dict()
    t["entries"] = [{"dtype": "bfloat16", "dims": {"n_cols": 4096}, "rows": 16384, "config": cfg, "heuristic": cfg,
                     "timing_ms": {"fwd": {"tuned": 0.05, "heuristic": 0.06}, "bwd": {"tuned": 0.1, "heuristic": 0.1}},
                     "bytes": {"fwd": 268_500_000, "bwd": 402_800_000}}]
    tables.write_table(tables.table_path(tmp_path, "h200", "rms_norm"), t)
    result = runner.invoke(main, ["show", "--gpu", "h200", "--detail"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "n_cols=4096" in result.output and "16384" in result.output and "1.07x" in result.output and "in use" in result.output
    only = runner.invoke(main, ["show", "--gpu", "h200", "--ops", "rope"], terminal_width=200)
    assert only.exit_code == 0 and "rms_norm.json" not in only.output and "rope.json" in only.output


def test_model_presets_and_hf_config(tmp_path):
    for name in ("llama3-8b", "llama3.2-1b", "qwen2.5-7b", "mistral-7b"):
        assert name in PRESETS
    assert resolve_model("llama3-8b").hidden_size == 4096
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
                                "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6}))
    model = resolve_model(str(path))
    assert (model.hidden_size, model.head_dim, model.num_key_value_heads) == (1536, 128, 2)
    path.write_text(json.dumps({"hidden_size": 1536}))
    with pytest.raises(ValueError, match="intermediate_size"):
        resolve_model(str(path))


def test_gpu_that_is_not_the_visible_one_is_refused(runner, monkeypatch):
    from liger_gen.runtime import devices

    monkeypatch.setattr(devices, "current_gpu", lambda device=None: ("h100", "NVIDIA H100 80GB HBM3"))
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--model", "llama3-8b"])
    assert result.exit_code == 1
    assert "--gpu h200 does not match the visible GPU 'NVIDIA H100 80GB HBM3' (h100)" in result.output


def test_canonical_gpu_names():
    from liger_gen.runtime.devices import canonical_gpu_name

    assert canonical_gpu_name("NVIDIA H200") == "h200"
    assert canonical_gpu_name("NVIDIA H100 80GB HBM3") == "h100"
    assert canonical_gpu_name("NVIDIA GH200 480GB") == "gh200"
    assert canonical_gpu_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert canonical_gpu_name("NVIDIA L4") == "l4" and canonical_gpu_name("NVIDIA L40S") == "l40s"
    assert canonical_gpu_name("Some Future GPU X1") == "some-future-gpu-x1"


def test_bench_render_of_a_wrongly_typed_result_is_a_clean_error(runner, tmp_path):
    """A JSON that parses but holds the wrong types (hand-edited, another version) gives a message, not a
    traceback; the committed H200 result still renders."""
    from pathlib import Path

    committed = Path(__file__).resolve().parent.parent / "benchmarks/results/h200_2026-11-30/bench_llama3-8b_nvidia_h200.json"
    data = json.loads(committed.read_text())
    ok = runner.invoke(main, ["bench", "--render", str(committed), "--out", str(tmp_path / "ok")])
    assert ok.exit_code == 0 and "| rms_norm | liger-gen |" in ok.output
    data["meta"]["ceilings"] = None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    result = runner.invoke(main, ["bench", "--render", str(bad), "--out", str(tmp_path / "bad")])
    assert result.exit_code == 1 and "not a liger-gen bench result" in result.output
    assert not isinstance(result.exception, (TypeError, AttributeError))


def test_bench_step_bad_options_are_usage_errors(runner):
    for args, needle in ((["--model", "nope"], "unknown"), (["--lr", "nan"], "lr"),
                         (["--loss-rel-tol", "-1"], "loss_rel_tol"), (["--device", "garbage"], "device"),
                         (["--device", "meta"], "device")):
        result = runner.invoke(main, ["bench-step", "--device", "cpu", *args])
        assert result.exit_code == 2, (args, result.output)
        assert needle in result.output and "Traceback" not in result.output


def _show(runner, tmp_path, monkeypatch, **table_fields):
    from liger_gen.ops.norms.rms_norm import RMSNormSpace

    monkeypatch.setenv(tables.ENV_TUNED_DIR, str(tmp_path))
    t = tables.new_table(RMSNormSpace, "h200", "NVIDIA H200", "9.0")
    cfg = RMSNormSpace(4096, torch.bfloat16).heuristic().to_dict()
    entry = {"dtype": "bfloat16", "dims": {"n_cols": 4096}, "rows": 16384, "config": cfg, "heuristic": cfg,
             "timing_ms": {"fwd": {"tuned": 0.05, "heuristic": 0.06}, "bwd": {"tuned": 0.1, "heuristic": 0.1}},
             "bytes": {"fwd": 268_500_000, "bwd": 402_800_000}}
    entry.update(table_fields.pop("entry", {}))
    t["entries"] = [entry]
    t.update(table_fields)
    tables.write_table(tables.table_path(tmp_path, "h200", "rms_norm"), t)
    return runner.invoke(main, ["show", "--gpu", "h200", "--trials"], terminal_width=200)


def test_show_an_entry_whose_heuristic_could_not_be_retimed(runner, tmp_path, monkeypatch):
    """The tuner records a heuristic it could not re-time as null: show prints n/a instead of crashing."""
    result = _show(runner, tmp_path, monkeypatch, entry={"timing_ms": {"fwd": {"tuned": 0.05, "heuristic": None},
                                                                       "bwd": {"tuned": 0.1, "heuristic": 0.1}}})
    assert result.exit_code == 0, result.output
    assert "n/a" in result.output and "0.1500" in result.output and not isinstance(result.exception, TypeError)


def test_show_prints_markup_and_escape_sequences_in_a_table_as_text(runner, tmp_path, monkeypatch):
    """Rich markup in a table is not interpreted (it used to raise MarkupError) and terminal control characters
    are shown as \\xNN, not sent to the terminal."""
    result = _show(runner, tmp_path, monkeypatch, device_name="[/bold] evil \x1b]0;title\x07 \x1b[2J",
                   torch_version="[red]2.11",
                   entry={"variant": {"casting_mode": "[link=file:///etc]x[/link]", "\x1b[31mk": "\x1b[2J"},
                          "trials": {"fwd": [{"number": 0, "status": "\x1b[31mok", "ms": 0.05}],
                                     "\x1b]0;pwned\x07": [{"number": 1, "status": "ok"}]}})
    assert result.exit_code == 0, result.output
    assert "[/bold] evil" in result.output and "[red]2.11" in result.output and "[link=file:///etc]" in result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "\\x1b[2J" in result.output and "\\x1b[31mok" in result.output and "\\x1b]0;pwned\\x07" in result.output


def test_show_survives_numbers_and_characters_a_hand_edited_table_may_hold(runner, tmp_path, monkeypatch):
    """Valid JSON that no tuner writes: an int too large for a float in the times and bytes, a lone surrogate in
    a name. show prints n/a and escapes instead of raising OverflowError or UnicodeEncodeError."""
    result = _show(runner, tmp_path, monkeypatch, device_name="NVIDIA \ud800 H200",
                   entry={"timing_ms": {"fwd": {"tuned": 10**400, "heuristic": 0.06}, "bwd": {"tuned": 0.1,
                                                                                           "heuristic": 10**400}},
                          "bytes": {"fwd": 10**400, "bwd": 1}, "trials": {"fwd": [{"number": 0, "status": "ok",
                                                                                   "ms": 10**400}]}})
    assert result.exit_code == 0, result.output
    assert "n/a" in result.output and "\\ud800" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_bench_step_without_a_gpu_refuses_and_names_the_cpu_command(runner, monkeypatch):
    """With no arguments on a CPU-only machine bench-step used to start training the 1B shape at 8 x 2048 tokens
    (20 GB after two minutes); it refuses at once, before building a model, and says what to run instead."""
    from liger_gen.bench import step

    monkeypatch.setattr(step, "run_step_benchmark", lambda **kw: pytest.fail("started a benchmark"))
    result = runner.invoke(main, ["bench-step"])
    assert result.exit_code == 1
    assert "no CUDA GPU is visible" in result.output
    assert "liger-gen bench-step --device cpu --model tiny" in result.output


def test_show_survives_a_subnormal_time_and_marks_a_misnamed_copy_unused(runner, tmp_path, monkeypatch):
    result = _show(runner, tmp_path, monkeypatch, entry={"timing_ms": {"fwd": {"tuned": 5e-324, "heuristic": 0.06},
                                                                       "bwd": {"tuned": 0.1, "heuristic": 0.1}}})
    assert result.exit_code == 0 and not isinstance(result.exception, ZeroDivisionError), result.output
    folder = tmp_path / "h200"
    (folder / "rms_norm.backup.json").write_text((folder / "rms_norm.json").read_text())
    result = runner.invoke(main, ["show", "--gpu", "h200"], terminal_width=300)
    lines = [line for line in result.output.splitlines() if "rms_norm.backup.json" in line]
    assert lines and "reads only rms_norm.json" in result.output, result.output


def test_tune_without_optuna_says_what_to_install(monkeypatch):
    """A training-only install (no Optuna): `liger-gen tune` exits with the pip command of the [tune] extra, and
    importing the runtime, the tables and `show` does not need Optuna."""
    import sys

    from liger_gen.optional import MissingExtraError, require

    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna now raises ImportError
    result = CliRunner().invoke(main, ["tune", "--gpu", "h200"])
    assert result.exit_code != 0
    assert "liger-gen tune needs optuna" in result.output and "pip install 'liger-gen[tune]'" in result.output
    with pytest.raises(MissingExtraError, match=r"needs matplotlib.*liger-gen\[bench\]"):
        monkeypatch.setitem(sys.modules, "matplotlib", None)
        require("matplotlib", "plotting")
    assert CliRunner().invoke(main, ["show", "--gpu", "h200"]).exit_code == 0


def _verify(*args, env=None):
    return CliRunner().invoke(main, ["verify", *args], env={"COLUMNS": "200", **(env or {})})


def test_verify_reports_the_tables_a_model_would_use(tmp_path, monkeypatch):
    """`liger-gen verify` on a CPU machine: the packaged H200 tables cover llama3-8b's default ops (exit 0), a
    model whose shapes are not tuned exits 1 unless --allow-heuristic, and it says what it could not check."""
    monkeypatch.delenv(tables.ENV_TUNED_DIR, raising=False)
    ok = _verify("--gpu", "h200", "--model", "llama3-8b")
    assert ok.exit_code == 0, ok.output
    assert "packaged" in ok.output and "not checked" in ok.output and "unusable:" not in ok.output
    tiny = _verify("--gpu", "h200", "--model", "tiny")
    assert tiny.exit_code == 1 and "heuristic" in tiny.output
    assert _verify("--gpu", "h200", "--model", "tiny", "--allow-heuristic").exit_code == 0
    if not torch.cuda.is_available():
        assert "--gpu" in _verify("--model", "tiny").output


def test_verify_fails_on_an_unusable_table(tmp_path, monkeypatch):
    """A corrupt table file, an entry whose config breaks the constraints, and (under LIGER_GEN_STRICT_TABLES=1)
    a table of another Triton version are each reported as unusable, with exit 1."""
    from liger_gen.ops.norms.rms_norm import RMSNormSpace

    user = tmp_path / "tuned"
    env = {tables.ENV_TUNED_DIR: str(user)}
    path = tables.table_path(user, "h200", "rms_norm")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    bad = _verify("--gpu", "h200", "--model", "llama3-8b", "--ops", "rms_norm", env=env)
    assert bad.exit_code == 1 and "unusable:" in bad.output and "corrupt" in bad.output
    space = RMSNormSpace({"n_cols": 4096}, torch.bfloat16)
    config = space.heuristic().to_dict() | {"num_warps_fwd": 3}
    table = tables.new_table(RMSNormSpace, "h200", "NVIDIA H200", "9.0")
    table["entries"] = [{"dtype": "bfloat16", "dims": {"n_cols": 4096}, "rows": 4096, "config": config,
                         "variant": {"casting_mode": "llama"}}]
    tables.write_table(path, table)
    invalid = _verify("--gpu", "h200", "--model", "llama3-8b", "--ops", "rms_norm", env=env)
    assert invalid.exit_code == 1 and "num_warps_fwd" in invalid.output
    table["entries"][0]["config"] = space.heuristic().to_dict()
    table["triton_version"] = "2.1.0"
    tables.write_table(path, table)
    old = _verify("--gpu", "h200", "--model", "llama3-8b", "--ops", "rms_norm", env=env)
    assert old.exit_code == 0 and "Triton 2.1.0" in old.output
    strict = _verify("--gpu", "h200", "--model", "llama3-8b", "--ops", "rms_norm",
                     env={**env, tables.STRICT_TABLES_ENV: "1"})
    assert strict.exit_code == 1 and "Triton 2.1.0" in strict.output


def test_a_missing_extra_ends_any_command_with_its_pip_command(monkeypatch):
    """Without transformers, `liger-gen bench-step` ends with one line naming the [transformers] extra, not a
    traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    result = CliRunner().invoke(main, ["bench-step", "--device", "cpu", "--model", "tiny", "--steps", "1"])
    assert result.exit_code == 1, result.output
    assert "liger-gen[transformers]" in result.output and "Traceback" not in result.output


def test_moe_config_json_gives_the_experts_width(tmp_path):
    """A mixture-of-experts config.json: the GLU width to tune and verify is its experts' (moe_intermediate_size)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                                "vocab_size": 151936}))
    assert resolve_model(str(path)).intermediate_size == 768
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                 "vocab_size": 256}))
    assert resolve_model(str(dense)).intermediate_size == 128


def test_verify_reports_an_unusable_user_tables_folder(tmp_path, monkeypatch):
    import os

    monkeypatch.delenv(tables.ENV_TUNED_DIR, raising=False)
    root = tmp_path / "data" / "liger-gen" / "tuned"
    root.mkdir(parents=True)
    os.chmod(root, 0o777)
    result = _verify("--gpu", "h200", "--model", "llama3-8b", env={"XDG_DATA_HOME": str(tmp_path / "data")})
    assert result.exit_code == 1 and "user tables folder" in result.output and "not used" in result.output


def _user_store(root, triton_version):
    """A copy of the packaged H200 compiled kernel store under ``root``, relabelled for ``triton_version``."""
    import shutil

    from liger_gen.runtime import compiled

    packaged = sorted((tables.packaged_root() / "h200" / compiled.FOLDER).iterdir())[0]
    dest = root / "h200" / compiled.FOLDER / packaged.name
    shutil.copytree(packaged, dest)
    manifest = json.loads((dest / compiled.MANIFEST).read_text())
    manifest["triton"] = triton_version
    (dest / compiled.MANIFEST).write_text(json.dumps(manifest))
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest, manifest


def test_verify_checks_the_compiled_kernel_stores(tmp_path, monkeypatch):
    """verify reads the compiled kernel stores beside the tables as the runtime does: a store for this Triton is
    listed with the ops' kernels it holds; one file altered, or a folder others may write, makes it unusable
    (exit 1); a store of another Triton is a notice (the runtime compiles instead)."""
    import triton

    user = tmp_path / "tuned"
    env = {tables.ENV_TUNED_DIR: str(user)}
    args = ("--gpu", "h200", "--model", "llama3.2-1b", "--ops", "rms_norm,rope,fused_linear_cross_entropy",
            "--allow-heuristic")
    store, manifest = _user_store(user, triton.__version__)
    good = _verify(*args, "--require-compiled", env=env)
    assert good.exit_code == 0, good.output
    line = " ".join(good.output.split())
    assert f"compiled kernels: {store} (user)" in line and "built for llama3.2-1b (batch_size=8" in line
    # FLCE launches the cross-entropy kernels: a store holding those holds FLCE's
    assert "fused_linear_cross_entropy " in line.split("kernels per op:")[1] and "none for" not in line
    victim = store / sorted(manifest["files"])[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = _verify(*args, env=env)
    assert bad.exit_code == 1 and "not matching manifest.json" in " ".join(bad.output.split())
    victim.write_bytes(bytes(data[:10]))  # truncated: still refused
    assert _verify(*args, env=env).exit_code == 1
    store.chmod(0o777)
    loose = _verify(*args, env=env)
    assert loose.exit_code == 1 and "writable by group or others" in " ".join(loose.output.split())
    store.chmod(0o755)
    other, other_manifest = _user_store(tmp_path / "other", "0.0.1")
    foreign = _verify(*args, env={tables.ENV_TUNED_DIR: str(tmp_path / "other")})
    assert foreign.exit_code == 0 and "built by Triton 0.0.1" in " ".join(foreign.output.split())
    if sorted((tables.packaged_root() / "h200" / "compiled").glob("*"))[0].name.split("-")[1] != triton.__version__:
        # only the foreign store and the packaged one (another Triton here): nothing can be used
        required = _verify(*args, "--require-compiled", env={tables.ENV_TUNED_DIR: str(tmp_path / "other")})
        assert required.exit_code == 1 and "no compiled kernel store can be used" in required.output
    (other / sorted(other_manifest["files"])[0]).write_bytes(b"x")  # the runtime never reads it: still a notice
    assert _verify(*args, env={tables.ENV_TUNED_DIR: str(tmp_path / "other")}).exit_code == 0
    (store.parent).chmod(0o777)  # compiled/ itself writable by others: the store is not trusted
    parent = _verify(*args, env=env)
    assert parent.exit_code == 1 and f"{store.parent} is writable" in " ".join(parent.output.split())
    store.parent.chmod(0o755)


def test_build_needs_the_gpu_it_builds_for(runner):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    result = runner.invoke(main, ["build", "--gpu", "h200", "--model", "llama3.2-1b"])
    assert result.exit_code != 0 and "no CUDA GPU is visible" in result.output
    assert "liger-gen build --gpu h200 --model llama3.2-1b" in " ".join(result.output.split())


def test_first_step_runs_each_provider_in_a_fresh_process(runner, tmp_path, monkeypatch):
    """bench-step --first-step on the CPU: every provider runs in its own process, the plain-transformers one never
    imports liger-gen, the times add up (start-up + imports + build + step <= the whole), and both providers
    compute the same first loss from the same weights and batch."""
    import functools

    from liger_gen.bench import first_step

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # no untimed warm-up round (2 more child processes; the next test checks that it is left out)
    monkeypatch.setattr(first_step, "run_first_step", functools.partial(first_step.run_first_step, warmup_rounds=0))
    done = runner.invoke(main, ["bench-step", "--first-step", "--device", "cpu", "--model", "tiny", "--providers",
                                "transformers,liger-gen", "--batch-size", "2", "--seq-len", "32", "--repeats", "1",
                                "--out", str(tmp_path)])
    assert done.exit_code == 0, done.output
    result = json.loads((tmp_path / "first_step.json").read_text())
    runs = {p: s["runs"] for p, s in result["models"]["tiny"].items()}
    assert [len(r) for r in runs.values()] == [1, 1] and all(r[0]["status"] == "ok" for r in runs.values())
    plain, ours = runs["transformers"][0], runs["liger-gen"][0]
    assert plain["imported_liger_gen"] is False and ours["imported_liger_gen"] is True
    for run in (plain, ours):
        parts = run["startup_s"] + run["imports_s"] + run["build_s"] + run["step_s"]
        assert 0 < run["step_s"] and parts == pytest.approx(run["first_step_s"], abs=1e-6)
    from liger_gen.training import loss_rel_tolerance

    # same weights and batch in bf16: the two first losses differ by rounding only
    assert ours["loss"] == pytest.approx(plain["loss"], rel=loss_rel_tolerance(torch.bfloat16))
    summary = result["models"]["tiny"]
    assert summary["liger-gen"]["vs_transformers_s"] == pytest.approx(
        summary["liger-gen"]["median_s"] - summary["transformers"]["median_s"])


def test_a_vision_language_models_first_step_sees_an_image(tmp_path, monkeypatch):
    """The first step of a vision-language model is an image + text batch, so its vision tower runs (and, on a
    GPU, its kernels compile) inside the timed step."""
    from liger_gen.bench.first_step import run_first_step

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    result = run_first_step("tiny-qwen2.5-vl", "liger-gen", device="cpu", batch_size=1, seq_len=64, repeats=1,
                            warmup_rounds=0, out_dir=tmp_path, dtype="float32")
    (run,) = result["models"]["tiny-qwen2.5-vl"]["liger-gen"]["runs"]
    assert run["status"] == "ok", run
    assert {"input_ids", "labels", "pixel_values", "image_grid_thw"} <= set(run["inputs"])


def test_first_step_options_and_a_hung_child_are_reported_not_raised(tmp_path):
    from liger_gen.bench.first_step import run_first_step

    for device in ("nonsense", "meta") + (() if torch.cuda.is_available() else ("cuda",)):
        with pytest.raises(ValueError, match="device"):
            run_first_step(models="tiny", providers="transformers", device=device, console=False)
    result = run_first_step(models="tiny", providers="transformers", device="cpu", batch_size=1, seq_len=8,
                            repeats=1, warmup_rounds=1, timeout_s=0.01, out_dir=tmp_path, console=False)
    (run,) = result["models"]["tiny"]["transformers"]["runs"]  # the warm-up round's run is left out
    assert run["status"] == "error" and "no first step within 0.01 s" in run["reason"]
    assert json.loads((tmp_path / "first_step.json").read_text())["models"]["tiny"]["transformers"]["median_s"] is None


def test_verify_names_the_gpus_that_have_tables_when_the_named_one_has_none(tmp_path, monkeypatch):
    """A misspelt --gpu is a valid name for some other GPU: verify says that no table exists for it, which GPUs
    have tables, and the closest of those; a known GPU without tables gets no guess."""
    monkeypatch.delenv(tables.ENV_TUNED_DIR, raising=False)
    typo = _verify("--gpu", "hh200", "--model", "llama3-8b")
    text = " ".join(typo.output.split())
    assert typo.exit_code == 1 and "no tuned tables for 'hh200'" in text and "did you mean h200?" in text
    known = " ".join(_verify("--gpu", "a100", "--model", "llama3-8b").output.split())
    assert "no tuned tables for 'a100'" in known and "did you mean" not in known
    ok = " ".join(_verify("--gpu", "h200", "--model", "llama3-8b").output.split())
    assert "no tuned tables" not in ok


def _write_config(tmp_path, name, **fields):
    base = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=1024, rms_norm_eps=1e-6, hidden_act="silu")
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**base, **fields}))
    return path


@pytest.mark.parametrize("fields,expected", [
    (dict(model_type="llama"), ["rms_norm", "fused_add_rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"]),
    (dict(model_type="gemma2", hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh"),
     ["rms_norm", "fused_add_rms_norm", "rope", "geglu", "fused_linear_cross_entropy"]),
    (dict(model_type="phimoe", num_local_experts=16),
     ["layer_norm", "rope", "swiglu", "moe_permute", "fused_linear_cross_entropy"]),
    # GPT-OSS: apply_to routes the experts' clamped gate; the experts loop stays transformers' (no moe_permute)
    (dict(model_type="gpt_oss", num_local_experts=32), ["rms_norm", "fused_add_rms_norm", "rope", "clamped_swiglu",
                                                        "fused_linear_cross_entropy"]),
    (dict(model_type="mixtral", num_local_experts=1), ["rms_norm", "fused_add_rms_norm", "rope", "swiglu", "moe_permute",
                                                       "fused_linear_cross_entropy"]),
    (dict(model_type="llama", hidden_act="relu"), ["rms_norm", "fused_add_rms_norm", "rope", "fused_linear_cross_entropy"]),
    (dict(model_type="qwen3_moe", num_experts=128), ["rms_norm", "fused_add_rms_norm", "rope", "swiglu", "moe_permute",
                                                      "fused_linear_cross_entropy"]),
    # multimodal Gemma 3: built as Gemma3ForConditionalGeneration: its SigLIP tower's LayerNorms and its fused
    # loss too
    (dict(model_type="gemma3", text_config=dict(model_type="gemma3_text", hidden_size=256, intermediate_size=512,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                                hidden_activation="gelu_pytorch_tanh")),
     ["rms_norm", "fused_add_rms_norm", "layer_norm", "rope", "geglu", "fused_linear_cross_entropy"]),
    # a vision-language config is built as its *ForConditionalGeneration (AutoModelForImageTextToText)
    (dict(model_type="paligemma", text_config=dict(model_type="gemma2", hidden_size=256)),
     ["rms_norm", "fused_add_rms_norm", "layer_norm", "rope", "geglu", "fused_linear_cross_entropy"]),
    (dict(model_type="bert"), None),
    (dict(model_type=["llama"]), None),
])
def test_verify_default_ops_follow_the_config_family(tmp_path, fields, expected):
    """Without --ops, verify checks the ops apply_to runs for a config.json's family; a family apply_to does
    not support (or an unreadable file) falls back to the Llama-like default."""
    from liger_gen.verify import ops_for_config

    path = _write_config(tmp_path, "m", **fields)
    assert ops_for_config(path) == expected
    assert ops_for_config(tmp_path / "missing.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert ops_for_config(bad) is None


@pytest.mark.parametrize("preset,expected", [
    ("llama3-8b", ["rms_norm", "fused_add_rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"]),
    ("gpt-oss-20b", ["rms_norm", "fused_add_rms_norm", "rope", "clamped_swiglu", "fused_linear_cross_entropy"]),
    ("qwen3-30b-a3b", ["rms_norm", "fused_add_rms_norm", "rope", "swiglu", "moe_permute", "fused_linear_cross_entropy"]),
])
def test_verify_default_ops_of_a_preset_are_its_familys(preset, expected):
    from liger_gen.verify import default_ops

    ops, why = default_ops(preset, from_file=False)
    assert ops == expected and "apply_to runs on" in why


def test_a_vision_language_model_and_its_vision_preset_cover_every_shape_it_looks_up(monkeypatch):
    """The shapes ``verify`` checks (and ``tune`` tunes) for a vision-language preset and its ``-vision`` preset,
    each with its default ops, are the shapes the patched model looks its tables up at in a training step: the
    text stack's and the vision tower's norms, RoPE, gated MLPs and loss, and no other."""
    from helpers import table_lookups
    from liger_gen.bench.step_data import step_batches
    from liger_gen.ops import get_spec
    from liger_gen.training import architecture, build_model, byte_tokens
    from liger_gen.verify import default_ops

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = build_model("tiny-qwen2.5-vl", "cpu", torch.float32, 0)
    looked_up = table_lookups(model, step_batches(architecture("tiny-qwen2.5-vl"), byte_tokens(), 1, 2, 32, 0)[0])
    covered = set()
    for preset in ("tiny-qwen2.5-vl", "tiny-qwen2.5-vl-vision"):
        ops, _ = default_ops(preset, from_file=False)
        for op in ops:
            spec = get_spec(op)
            dims = spec.problem.shape(PRESETS[preset])  # a one-dim op's lookups name the width alone
            covered.add((spec.space.__name__, next(iter(dims.values())) if len(dims) == 1
                         else tuple(sorted(dims.items()))))
    assert covered == looked_up, (sorted(covered - looked_up), sorted(looked_up - covered))
    assert PRESETS["qwen2.5-vl-7b-4l-vision"].head_dim == 80 and default_ops("qwen2.5-vl-7b-4l-vision", False)[0] == [
        "rms_norm", "rope", "swiglu"]

def test_verify_fp8_checks_the_fp8_ops_at_every_operand_width(monkeypatch):
    """With --fp8 the predicted ops are those apply_to(model, fp8=True) runs on a bf16 model (the norms that
    write the operands, both quantize ops), and the quantize ops are checked at each width the projections'
    operands have (hidden 4096, intermediate 14336, k/v 1024 at Llama-3-8B)."""
    from liger_gen.verify import default_ops

    monkeypatch.delenv(tables.ENV_TUNED_DIR, raising=False)
    ops, _ = default_ops("llama3-8b", from_file=False, fp8=True)
    assert {"rms_norm_fp8", "fp8_quantize", "fp8_cast_transpose"} <= set(ops)
    assert "fp8_quantize" not in default_ops("llama3-8b", from_file=False)[0]
    result = _verify("--gpu", "h200", "--model", "llama3-8b", "--fp8", "--rows", "4096", "--allow-heuristic",
                     "--json")
    widths = {op: sorted(f["dims"]["n_cols"] for f in json.loads(result.output)["result"]["findings"] if f["op"] == op)
              for op in ("fp8_quantize", "fp8_cast_transpose")}
    assert widths == {"fp8_quantize": [1024, 4096, 14336], "fp8_cast_transpose": [1024, 4096, 14336]}


def test_verify_says_where_its_ops_come_from(tmp_path, monkeypatch):
    monkeypatch.delenv(tables.ENV_TUNED_DIR, raising=False)
    path = _write_config(tmp_path, "bert", model_type="bert")
    text = " ".join(_verify("--gpu", "h200", "--model", str(path), "--allow-heuristic").output.split())
    assert "ops checked: rms_norm, fused_add_rms_norm, rope, swiglu, fused_linear_cross_entropy (a Llama-like model's" in text
    assert "'bert' is not a family apply_to supports" in text
    moe = " ".join(_verify("--gpu", "h200", "--model", "qwen3-30b-a3b", "--allow-heuristic").output.split())
    assert "moe_permute" in moe and "Qwen3MoeForCausalLM" in moe


def test_verify_cli_checks_a_gemma_config_with_geglu(tmp_path, monkeypatch):
    monkeypatch.delenv(tables.ENV_TUNED_DIR, raising=False)
    path = _write_config(tmp_path, "gemma2", model_type="gemma2", hidden_activation="gelu_pytorch_tanh")

    def checked_ops(*extra):
        out = _verify("--gpu", "h200", "--model", str(path), "--rows", "4096", "--allow-heuristic", *extra).output
        cells = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
        return {c for c in cells if c}  # the op column (wrapped names leave fragments; these are short)

    assert checked_ops() >= {"rms_norm", "rope", "geglu"} and "swiglu" not in checked_ops()
    assert checked_ops("--ops", "swiglu") == {"swiglu"}


@pytest.mark.parametrize("content,message", [
    ("[1, 2]", "holds a JSON list, not an object"),
    ('{"hidden_size": 0, "intermediate_size": 8, "num_attention_heads": 2, "vocab_size": 8}',
     "'hidden_size' is 0, not a positive integer"),
    ('{"hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 0, "vocab_size": 8}',
     "'num_attention_heads' is 0"),
    ('{"hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2, "vocab_size": 8, "rms_norm_eps": "x"}',
     "'rms_norm_eps' is 'x'"),
    ('{"hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2, "vocab_size": 8, "head_dim": true}',
     "'head_dim' is True"),
    ('{"hidden_size": 2, "intermediate_size": 8, "num_attention_heads": 4, "vocab_size": 8}',
     "smaller than num_attention_heads"),
    ("{", "is not JSON"),
])
def test_a_malformed_config_is_a_model_error(tmp_path, content, message):
    """A config.json whose values cannot describe a model ends verify with a --model error naming the field."""
    path = tmp_path / "config.json"
    path.write_text(content)
    result = _verify("--gpu", "h200", "--model", str(path))
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_a_config_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # opening a FIFO for reading would block until a writer came
    result = _verify("--gpu", "h200", "--model", str(fifo))
    assert result.exit_code == 2 and "is not a regular file" in result.output


def test_gpus_with_tables_counts_only_op_tables(tmp_path):
    for gpu, name in (("h200", "rms_norm.json"), ("a100", "rms_norm.trials.json"), ("l4", "notes.json")):
        (tmp_path / gpu).mkdir()
        (tmp_path / gpu / name).write_text("{}")
    assert tables.gpus_with_tables(["rms_norm"], [("user", tmp_path)]) == ["h200"]


def test_verify_predicts_ops_whatever_attention_the_config_names(tmp_path):
    """A config naming flash-attention (not installed here) still gets its ops, and the loggers are left as
    they were when the library (not the command line) asks."""
    import logging

    from liger_gen.verify import ops_apply_to_runs

    cfg = dict(model_type="mixtral", hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=2, num_local_experts=4, vocab_size=1024,
               _attn_implementation="flash_attention_2", attn_implementation="flash_attention_2")
    from transformers.utils import logging as transformers_logging

    transformers_logging.get_logger("transformers")  # transformers sets its root logger's level on first use
    levels = [logging.getLogger(n).level for n in ("liger_gen", "transformers")]
    ops, why = ops_apply_to_runs(cfg)
    assert ops == ["rms_norm", "fused_add_rms_norm", "rope", "swiglu", "moe_permute", "fused_linear_cross_entropy"], why
    assert [logging.getLogger(n).level for n in ("liger_gen", "transformers")] == levels
    deep = ops_apply_to_runs({**cfg, "num_hidden_layers": 10**6})
    assert deep[0] is None and "more than" in deep[1]


@pytest.mark.parametrize("content,message", [
    ("[" * 100000 + "]" * 100000, "RecursionError"),
    (None, "is not a regular file"),  # a folder named like a config
])
def test_unparseable_config_files_are_model_errors(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    result = _verify("--gpu", "h200", "--model", str(path))
    assert result.exit_code == 2 and message in result.output, result.output


def test_verify_reports_dims_an_op_does_not_take(tmp_path, monkeypatch):
    monkeypatch.delenv(tables.ENV_TUNED_DIR, raising=False)
    path = _write_config(tmp_path, "wide", model_type="llama", hidden_size=70000, num_hidden_layers=2)
    result = _verify("--gpu", "h200", "--model", str(path), "--allow-heuristic")
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "rms_norm: the model's dims are outside what the op supports" in text
