"""Every kernel of every op compiles for Hopper (sm_90) with the installed Triton, as the GPU would compile it.

The rest of the CPU suite runs the kernels in Triton's interpreter, which compiles nothing: an error of Triton's
front end (a module-level ``FOO: tl.constexpr = 8`` global, refused by compiled Triton) or one in a branch that
only the GPU takes (``EXACT=False`` in the FP8 quantize kernels) would reach the GPU machine unseen. Here
``liger_gen.aot_check`` captures every op's launches in the interpreter and compiles each one ahead of
time for ``GPUTarget("cuda", 90, 32)`` in a process without the interpreter (no GPU needed: ptxas ships inside
the Triton wheel). About 55 s (35 s of CPU) on a 2-core machine: the capture 9 s, then one launch per constexpr set
through ptxas and the rest (other dtypes) to TTIR only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from liger_gen import aot_check
from liger_gen.ops import available_ops


def _nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


pytestmark = pytest.mark.skipif(not _nvidia_backend(), reason="this Triton has no NVIDIA backend to compile for")


def test_every_kernel_of_every_op_compiles_for_sm90():
    ops = list(available_ops())
    rows, details = aot_check.run(ops, arch=90)
    table = aot_check.format_table(rows, 90, details["triton"], details["seconds"])
    assert not details["capture_errors"], "\n".join(
        f"{e.get('op')} {e.get('source')} {e.get('dtype', '')} {e.get('variant', '')}: {e['error']}\n{e['traceback']}"
        for e in details["capture_errors"])
    assert not [r for r in rows if r["failed"]], table
    compiled_ops = {op for r in rows if r["compiled"] for op in r["op"].split(",")}
    assert set(ops) <= compiled_ops, f"ops with no compiled kernel: {sorted(set(ops) - compiled_ops)}\n{table}"
    assert any(r["kernel"] == "targets_in_range_kernel" and r["compiled"] for r in rows)  # the CUDA-only check
    # the FP8 kernels' interpreter-only flag was compiled at its GPU value
    exact = [r["constexprs"].get("EXACT") for r in details["results"] if r.get("ok") and "EXACT" in r["constexprs"]]
    assert exact and all(v == "False (GPU value)" for v in exact)


# A module with the two kinds of bug the interpreter lets through: an annotated global (refused by compiled
# Triton) and a type error in the branch that only the GPU takes (EXACT is set from interpreter_enabled()).
BROKEN = textwrap.dedent('''
    import triton
    import triton.language as tl

    WIDTH: tl.constexpr = 8


    @triton.jit
    def annotated_global_kernel(x_ptr, n):
        offs = tl.arange(0, WIDTH)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


    @triton.jit
    def gpu_branch_kernel(x_ptr, n, BLOCK: tl.constexpr, EXACT: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        if EXACT:
            y = x * 2.0
        else:
            y = x + tl.zeros((BLOCK // 2,), tl.float32)  # shapes that do not broadcast
        tl.store(x_ptr + offs, y, mask=offs < n)


    @triton.jit
    def fine_kernel(x_ptr, n, BLOCK: tl.constexpr, EXACT: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)
''')


def test_the_compile_stage_reports_front_end_and_gpu_branch_errors(tmp_path):
    """The compile stage on a hand-made capture: the annotated global and the GPU-only branch fail with the
    compiler's message (the interpreter runs both kernels), a correct kernel compiles: through ptxas for the first
    launch of its constexpr set, to TTIR for another pointer dtype."""
    module = str(tmp_path / "broken_0123.py")
    tensor = {"tensor": "float32", "offset": 0}
    launches = [
        {"op": "demo", "module": module, "kernel": "annotated_global_kernel", "args": {"x_ptr": tensor, "n": 8},
         "options": {"num_warps": 1}},
        {"op": "demo", "module": module, "kernel": "gpu_branch_kernel",
         "args": {"x_ptr": tensor, "n": 8, "BLOCK": 8, "EXACT": {"interpreter_flag": True}}, "options": {}},
        {"op": "demo", "module": module, "kernel": "fine_kernel",
         "args": {"x_ptr": tensor, "n": 8, "BLOCK": 8, "EXACT": True}, "options": {}},
        {"op": "demo", "module": module, "kernel": "fine_kernel",
         "args": {"x_ptr": {"tensor": "float16", "offset": 2}, "n": 8, "BLOCK": 8, "EXACT": True}, "options": {}},
    ]
    captured, out = tmp_path / "launches.json", tmp_path / "results.json"
    captured.write_text(json.dumps({"launches": launches, "modules": {module: BROKEN}, "errors": []}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    subprocess.run([sys.executable, "-m", "liger_gen.aot_check", "--stage", "compile", "--launches",
                    str(captured), "--arch", "90", "--out", str(out)], env=env, check=True)
    compiled = json.loads(out.read_text())["results"]
    results = {r["kernel"]: r for r in compiled}
    fine = [r for r in compiled if r["kernel"] == "fine_kernel"]
    assert results["annotated_global_kernel"]["ok"] is False
    assert "WIDTH" in results["annotated_global_kernel"]["cause"]
    assert results["gpu_branch_kernel"]["ok"] is False
    assert "incompatible" in results["gpu_branch_kernel"]["error"]
    assert [(r["ok"], r["stage"], r["signature"]["x_ptr"]) for r in fine] == [(True, "cubin", "*fp32"),
                                                                              (True, "ttir", "*fp16")]
    assert fine[0]["constexprs"]["EXACT"] == "False (GPU value)"  # flipped by name (INTERPRETER_FLAGS)


@pytest.mark.parametrize("args,words", [
    (["--tables", "nosuchgpu"], "no packaged tables"), (["--ops", ","], "names no op"),
    (["--ops", "no_such_op"], "unknown ops"), (["--dtypes", "fp64"], "give some of"), (["--dtypes", ","], "give some of"),
    (["--arch", "1000"], "compute capability"), (["--json", "/nonexistent-folder/x.json"], "does not exist"),
])
def test_bad_arguments_are_usage_errors_before_any_work(args, words, capsys):
    with pytest.raises(SystemExit) as exc:
        aot_check.main(args)
    assert exc.value.code == 2 and words in capsys.readouterr().err
