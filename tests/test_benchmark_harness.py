"""The benchmark harness's pure helpers (byte counts, profiler summing, rendering), checked on the CPU."""

import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parent.parent / "benchmarks" / "selfcheck_rms_norm.py"
_spec = importlib.util.spec_from_file_location("selfcheck_rms_norm", _path)
selfcheck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(selfcheck)

CHECKS = sorted(name for name in dir(selfcheck) if name.startswith("check_"))


@pytest.mark.parametrize("name", CHECKS)
def test_benchmark_helper(name):
    getattr(selfcheck, name)()
