"""The image recipe (examples/Dockerfile) as a script on the CPU: build the wheel, install it into a fresh
folder with a tuned folder beside it, and run `liger-gen verify` from the installed package."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "image_steps.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(work: Path, **env):
    return subprocess.run(["bash", str(SCRIPT), str(work)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "COLUMNS": "250", **env})


def test_installed_wheel_verifies_a_shipped_tuned_folder(tmp_path):
    result = _run(tmp_path / "work")
    assert result.returncode == 0, result.stdout + result.stderr
    # every row of the model's shapes comes from the copied folder, through LIGER_GEN_TUNED_DIR
    assert f"tables looked up in (user): {tmp_path / 'work' / 'tuned'}" in result.stdout
    assert "heuristic" not in result.stdout and " user " in result.stdout
    site = tmp_path / "work" / "site"
    wheel_files = {p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()}
    assert "liger_gen/templates/rms_norm.py.jinja" in wheel_files and "liger_gen/tuned/h200/rms_norm.json" in wheel_files
    assert any(name.endswith("LICENSE") for name in wheel_files)
    assert not [name for name in wheel_files if name.endswith(".trials.json")]  # tuner logs stay in the repository
    metadata = next(site.glob("liger_gen-*.dist-info")) / "METADATA"
    text = metadata.read_text()
    assert "License-Expression: Apache-2.0" in text and "Requires-Dist: optuna" not in text.split("Provides-Extra")[0]


def test_a_corrupt_shipped_table_fails_the_build(tmp_path):
    tuned = tmp_path / "tuned"
    shutil.copytree(ROOT / "liger_gen" / "tuned", tuned)
    (tuned / "h200" / "rope.json").write_text(json.dumps({"format_version": 3}))
    result = _run(tmp_path / "work", TUNED=str(tuned))
    assert result.returncode == 1 and "unusable:" in result.stdout, result.stdout + result.stderr
