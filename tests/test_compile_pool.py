"""Compile workers: a worker process compiles a variant's kernels for the tuning GPU without a GPU, into the Triton
cache entry the launch looks up; the search is the same with and without workers."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from liger_gen.tuning.search import Tuner

from test_tuner import FakeRMSNormProblem, cost_model, fake_build

triton = pytest.importorskip("triton")


def _ptxas() -> bool:
    nvidia = Path(triton.__file__).parent / "backends" / "nvidia"
    return (nvidia / "bin" / "ptxas").exists() or bool(os.environ.get("TRITON_PTXAS_PATH"))


# Runs in a fresh process with compiled (not interpreted) kernels and no GPU: Triton is pointed at a driver that
# reports an sm_90 target, the problem's tensors live on the CPU (its launcher only runs under capture()).
WORKER_CHECK = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from liger_gen.codegen.build import load_variant
    from liger_gen.codegen.launch import capture
    from liger_gen.ops.norms.rms_norm import RMSNormProblem
    from liger_gen.tuning.compile_pool import CompilePool, TargetDriver, describe

    target = GPUTarget("cuda", 90, 32)
    driver.set_active(TargetDriver(target))
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    problem = RMSNormProblem(torch.bfloat16, 256, 48, "cpu", seed=0)
    config = problem.space.heuristic()
    out = {}
    with CompilePool(2, target=target) as pool:
        for phase in ("fwd", "bwd"):
            pool.submit(problem, config, phase)
        for phase in ("fwd", "bwd"):
            pool.wait(problem, config, phase)
        out["stats"] = pool.stats.to_dict()
        out["errors"] = pool.stats.errors
    entries = sorted(p.name for p in cache.iterdir())
    out["entries"] = entries
    # what the launch would compile: Triton's own binder on the same arguments finds the workers' entries
    module = load_variant(problem.template, problem.template_params(config))
    hashes = []
    for phase in ("fwd", "bwd"):
        with capture() as launches:
            problem.launcher(module, phase)()
        for name, args, kwargs in launches:
            kernel = getattr(module, name).run(*map(describe, args), grid=(1,), warmup=True,
                                               **{k: describe(v) for k, v in kwargs.items()})
            hashes.append(kernel.hash)
    out["hashes"] = hashes
    out["entries_after"] = sorted(p.name for p in cache.iterdir())
    # workers killed mid-run (out of memory, a stray kill): the tuning process goes on, new workers take over
    import dataclasses, signal
    with CompilePool(1, target=target) as pool:
        pool.start()
        pool.wait(problem, config, "fwd")
        for proc in list(pool._pool()._processes.values()):
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
        other = dataclasses.replace(config, num_warps_fwd=config.num_warps_fwd * 2)
        for attempt in range(3):  # the first sends may meet the broken pool; a later one a new one
            pool.submit(problem, other, "fwd")
            pool.wait(problem, other, "fwd")
            if pool.stats.compiled:
                break
            pool._futures.clear()
            pool._waited.clear()
        out["after_kill"] = pool.stats.to_dict()
    print(json.dumps(out))
""")


@pytest.mark.skipif(not _ptxas(), reason="Triton's ptxas is needed to compile for a GPU target")
def test_a_worker_compiles_the_cache_entry_the_launch_looks_up(tmp_path):
    from liger_gen.runtime.compiled import base32_key

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton"),
               LIGER_GEN_CACHE_DIR=str(tmp_path / "kernels"), CUDA_VISIBLE_DEVICES="")
    (tmp_path / "triton").mkdir()
    done = subprocess.run([sys.executable, "-c", WORKER_CHECK], env=env, capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    stats = out["stats"]
    assert stats["sent"] == 2 and stats["compiled"] == 2 and stats["failed"] == 0, (stats, out["errors"])
    assert out["hashes"], "the launcher launched no kernel"
    # every kernel the launch asks for is an entry a worker wrote, and looking them up compiled nothing new
    assert {base32_key(h) for h in out["hashes"]} <= set(out["entries"])
    assert out["entries_after"] == out["entries"]
    assert out["after_kill"]["compiled"] == 1, out["after_kill"]  # killed workers were replaced


class RecordingPool:
    """Stands for the compile workers: notes what is sent and waited for (and compiles nothing)."""

    def __init__(self, fail_every: int = 0):
        self.sent, self.waited, self.fail_every = [], [], fail_every

    @staticmethod
    def key(problem, config, phase):
        return (phase, tuple(sorted(problem.space.phase_params(config, phase).items())))

    def submit(self, problem, config, phase):
        self.sent.append(self.key(problem, config, phase))

    def wait(self, problem, config, phase):
        self.waited.append(self.key(problem, config, phase))


class CudaFake(FakeRMSNormProblem):
    """The fake RMSNorm problem, claiming a CUDA device so the tuner hands its variants to a pool."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.device = torch.device("cuda")


@pytest.fixture
def cuda_fake():
    return CudaFake(torch.float32, 96, 20, "cpu", seed=1)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("seed", [0, 7])
def test_the_search_is_the_same_with_and_without_compile_workers(cuda_fake, batch, seed):
    settings = dict(build=fake_build, timer=cost_model, n_trials=10, polish_trials=4, seed=seed, batch=batch,
                    retime_rounds=2)
    serial = Tuner(**settings).tune(cuda_fake)
    pool = RecordingPool()
    parallel = Tuner(compile_pool=pool, **settings).tune(cuda_fake)
    assert parallel == serial
    # every measured variant was sent ahead, before its first launch
    measured = [("fwd" if "num_warps_fwd" in r["params"] else "bwd", tuple(sorted(r["params"].items())))
                for phase in ("fwd", "bwd") for r in serial["trials"][phase] if r["status"] == "ok"]
    assert set(measured) <= set(pool.sent)
    assert set(measured) <= set(pool.waited)
    if batch > 1:  # a batch is sent as a whole before its first point is measured
        assert len(pool.sent) >= len(set(measured))


def test_batches_are_part_of_the_search_and_reproducible(cuda_fake):
    settings = dict(build=fake_build, timer=cost_model, n_trials=12, polish_trials=2, retime_rounds=1)
    one = Tuner(batch=4, seed=3, **settings).tune(cuda_fake)
    again = Tuner(batch=4, seed=3, **settings).tune(cuda_fake)
    assert one == again
    assert one["search"]["fwd"]["trials"] == 12
    for phase in ("fwd", "bwd"):
        assert one["trials"][phase][0]["params"] == cuda_fake.space.phase_params(cuda_fake.space.heuristic(), phase)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        Tuner(batch=0, **settings)
    with pytest.raises(ValueError, match="compile_workers must be an int >= 0"):
        Tuner(compile_workers=-1, **settings)


def test_no_pool_for_problems_that_run_no_compiled_kernels(cuda_fake, monkeypatch):
    tuner = Tuner(build=fake_build, timer=cost_model, n_trials=2, compile_workers=2)
    cpu = FakeRMSNormProblem(torch.float32, 96, 20, "cpu", seed=1)
    assert tuner._pool(cpu) is None  # a CPU problem
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tuner._pool(cuda_fake) is None  # the interpreter compiles nothing
    assert Tuner(build=fake_build, timer=cost_model, n_trials=2)._pool(cuda_fake) is None  # no workers asked for


def test_default_compile_workers_leave_two_cores_and_are_shared_by_gpu_workers(monkeypatch):
    from liger_gen.cli import default_compile_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert default_compile_workers() == 14
    assert default_compile_workers(4) == 3
    assert default_compile_workers(32) == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert default_compile_workers() == 16  # at most 16
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert default_compile_workers() == 0  # a 2-core machine compiles in the tuning process


def test_tune_refuses_bad_batch_and_worker_counts():
    from click.testing import CliRunner

    from liger_gen.cli import main

    for args in (["--batch", "0"], ["--compile-workers", "-1"]):
        result = CliRunner().invoke(main, ["tune", "--gpu", "h200", *args])
        assert result.exit_code == 2 and ("--batch" in result.output or "--compile-workers" in result.output)
