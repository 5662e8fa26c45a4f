"""Rendering and the content-addressed kernel cache."""

import multiprocessing as mp
import os

import jinja2
import pytest
import torch

from liger_gen.codegen import build, render
from liger_gen.ops.norms.rms_norm import RMSNormSpace


def _params(**changes):
    return {**RMSNormSpace(200, torch.float32).heuristic().to_dict(), "casting_mode": "llama", **changes}


def test_render_is_deterministic_and_strict():
    a = render.render("rms_norm", _params())
    assert a == render.render("rms_norm", dict(reversed(list(_params().items()))))
    assert a != render.render("rms_norm", _params(casting_mode="gemma"))
    params = _params()
    del params["BLOCK_M_BWD"]
    with pytest.raises(jinja2.UndefinedError, match="BLOCK_M_BWD"):
        render.render("rms_norm", params)
    compile(a, "rms_norm.py", "exec")  # valid Python
    assert len(render.template_hash("rms_norm")) == 16


def test_a_template_hash_covers_the_macros_it_imports(monkeypatch):
    """The three row norms import templates/row_norm.jinja: editing it changes all three hashes (retiring their
    tuned entries) and no other; a template without imports keeps the hash of its own text."""
    import hashlib

    norms = ("rms_norm", "fused_add_rms_norm", "layer_norm")
    others = ("rope", "glu", "cross_entropy", "fused_linear_cross_entropy", "kl_div", "jsd")
    for op in norms:
        assert render.template_files(op) == (f"{op}.py.jinja", "row_norm.jinja")
    for op in others:
        assert render.template_files(op) == (f"{op}.py.jinja",)
        assert render.template_hash(op) == hashlib.sha256(render.template_source(op).encode()).hexdigest()[:16]
    before = {op: render.template_hash(op) for op in norms + others}
    real = render._file_text
    monkeypatch.setattr(render, "_file_text", lambda name: real(name) + ("\n" if name == "row_norm.jinja" else ""))
    render.template_hash.cache_clear()
    try:
        after = {op: render.template_hash(op) for op in norms + others}
    finally:
        monkeypatch.undo()
        render.template_hash.cache_clear()
    assert [op for op in before if before[op] != after[op]] == list(norms)


@pytest.mark.parametrize("strategy", ["blocked", "persistent"])
def test_variants_render_each_strategy(strategy):
    text = render.render("rms_norm", _params(dw_strategy=strategy))
    assert ("tl.num_programs(0)" in text) == (strategy == "persistent")


def test_cache_rewrites_tampered_file_before_import(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGER_GEN_CACHE_DIR", str(tmp_path / "k"))
    path, source = build.materialize("rms_norm", _params(BLOCK_M_FWD=2))
    good = path.read_text()
    assert good == source
    path.write_text("raise SystemExit('tampered')\n")
    assert build.materialize("rms_norm", _params(BLOCK_M_FWD=2))[0] == path
    assert path.read_text() == good
    module = build.load_variant("rms_norm", _params(BLOCK_M_FWD=2))
    assert module.BLOCK_M_FWD == 2
    # executed from the verified text in memory: no bytecode cache that could be swapped behind our back
    assert not (path.parent / "__pycache__").exists()


def test_cache_refuses_group_writable_dir(tmp_path, monkeypatch):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    monkeypatch.setenv("LIGER_GEN_CACHE_DIR", str(d))
    with pytest.raises(PermissionError, match="writable"):
        build.cache_dir()


def _materialize(args):
    cache, n = args
    os.environ["LIGER_GEN_CACHE_DIR"] = cache
    return [str(build.materialize("rms_norm", _params(BLOCK_M_FWD=1 + i % 2))[0]) for i in range(n)]


def test_concurrent_writers_leave_complete_files(tmp_path):
    cache = str(tmp_path / "c")
    with mp.get_context("spawn").Pool(2) as pool:
        results = pool.map(_materialize, [(cache, 20), (cache, 20)])
    paths = set(results[0]) | set(results[1])
    assert len(paths) == 2
    for p in paths:
        text = open(p).read()
        assert render.source_hash(text) in p
    assert not [f for f in os.listdir(cache) if f.endswith(".tmp")]


@pytest.mark.parametrize("problem", ["file_in_the_way", "group_writable", "no_home"])
def test_an_unusable_cache_falls_back_to_memory_with_one_warning(problem, tmp_path, monkeypatch, device):
    """A cache folder that cannot be made (a read-only $HOME; here a file where the folder should be) or must not
    be used (writable by others): one KernelCacheWarning naming LIGER_GEN_CACHE_DIR, and the ops still run and
    give the right answer from modules rendered in memory."""
    import warnings

    from liger_gen.functional import rms_norm
    from liger_gen.reference import rms_norm_float64
    from liger_gen.runtime.ops import clear_caches

    if problem == "no_home":  # no $HOME and no passwd entry: a container run as an arbitrary uid
        from pathlib import Path

        def no_home():
            raise RuntimeError("Could not determine home directory.")

        for name in ("LIGER_GEN_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(Path, "home", staticmethod(no_home))
        cache = "the default kernel cache"
    else:
        if problem == "file_in_the_way":
            (tmp_path / "home").write_text("not a folder")
            cache = tmp_path / "home" / ".cache" / "kernels"
        else:
            cache = tmp_path / "shared"
            cache.mkdir()
            cache.chmod(0o777)
        monkeypatch.setenv("LIGER_GEN_CACHE_DIR", str(cache))
    monkeypatch.setattr(build, "_warned_dirs", set())
    monkeypatch.setattr(build, "_modules", {})
    clear_caches()
    x, w = torch.randn(6, 48, dtype=torch.float32, device=device), torch.rand(48, device=device) + 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = rms_norm(x, w, eps=1e-6)
        rms_norm(x + 1, w, eps=1e-6)
    clear_caches()
    messages = [str(c.message) for c in caught if issubclass(c.category, build.KernelCacheWarning)]
    assert len(messages) == 1 and "LIGER_GEN_CACHE_DIR" in messages[0] and str(cache) in messages[0]
    assert (y.double() - rms_norm_float64(x, w, 1e-6)).abs().max() < 1e-5  # compiled from the in-memory text
    path, source = build.materialize("rms_norm", _params())
    assert path.parent == build.IN_MEMORY and not path.exists()


def run_without_interpreter(script: str):
    """``script`` in a fresh Python with this checkout on the path and TRITON_INTERPRET unset (CompletedProcess)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests launch the check for real")
def test_the_target_check_kernel_compiles_with_its_assertion_for_sm90():
    """The interpreter ignores device_assert, so compile the check kernel to sm_90 (in a process without
    TRITON_INTERPRET) and look for the assertion call in the PTX: ``debug=True`` keeps it without TRITON_DEBUG."""
    import textwrap

    script = textwrap.dedent('''
        import triton
        from triton.compiler import ASTSource
        from triton.backends.compiler import GPUTarget
        from liger_gen.codegen.build import load_variant
        fn = load_variant("checks", {}).targets_in_range_kernel
        sig = {"target_ptr": "*i64", "n_rows": "i32", "stride": "i64", "n_classes": "i32", "ignore_index": "i32",
               "BLOCK": "constexpr"}
        assert fn.debug is True  # a launch compiles with the decorator's debug flag
        compiled = triton.compile(ASTSource(fn, sig, {"BLOCK": 1024}), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=4, debug=fn.debug))
        print("assertfail" if "__assertfail" in compiled.asm["ptx"] else "no assertion")
    ''')
    done = run_without_interpreter(script)
    assert done.returncode == 0 and "assertfail" in done.stdout, (done.stdout, done.stderr[-3000:])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter must be on before kernels are defined")
@pytest.mark.parametrize("at_import", [True, False])
def test_the_interpreter_switched_on_after_import_is_a_clear_error(at_import):
    """Triton decides at its import whether its own library functions are interpreted; TRITON_INTERPRET=1 set
    after `import liger_gen` gets liger-gen's RuntimeError naming the variable, not Triton's "Cannot call
    @triton.jit'd outside of the scope of a kernel"; set before, the kernel runs."""
    import textwrap

    script = textwrap.dedent(f'''
        import os
        if {at_import}:
            os.environ["TRITON_INTERPRET"] = "1"
        import torch, liger_gen
        os.environ["TRITON_INTERPRET"] = "1"
        x = torch.randn(5, 48, dtype=torch.float64).float()
        try:
            y = liger_gen.functional.rms_norm(x, torch.ones(48))
        except RuntimeError as exc:
            print("RuntimeError:", exc)
        else:
            want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
            print("max error", float((y.double() - want).abs().max()))
    ''')
    done = run_without_interpreter(script)
    assert done.returncode == 0, done.stderr[-3000:]
    if at_import:
        assert float(done.stdout.split("max error")[1]) < 4 * torch.finfo(torch.float32).eps, done.stdout
    else:
        assert "set after Triton was imported" in done.stdout and "TRITON_INTERPRET=1 python" in done.stdout, \
            done.stdout
