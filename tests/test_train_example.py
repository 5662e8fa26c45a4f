"""CPU tests of ``liger_gen.examples.train_llama``: a tiny Llama trains to the same loss curve with and without
``liger_gen.apply_to``, on the plain-PyTorch CPU path and through the Triton interpreter.

Tolerance. Both runs execute the same float32 program except RMSNorm, where the kernel may sum x² in another
order and computes the backward from its closed form instead of autograd's graph: each norm output and gradient
may differ by a few float32 ulps (eps = 2**-23 ≈ 1.2e-7). Averaged into the mean loss and carried through 4 AdamW
steps such noise stays well below 1e-6 relative: injecting 1e-6 relative noise into every RMSNorm output and
gradient moved the loss by at most 2.5e-7 relative, an RMSNorm computed in float64 by at most 8e-8 (measured
with this configuration). We use ``rtol = 1e-5`` (about 80 ulps of a loss near 6), > 30x above that noise and
well below what wrong norms do: the two bugs in ``test_check_catches_a_wrong_rmsnorm`` move the curve by up to
7.2e-4 (mean over N-1 instead of N) and 4.0e-4 (dW never written); others we tried move it by 7e-5 (dW without
rstd), 6.7e-4 (eps 1e-6 instead of 1e-5) and 4.4e-3 (dX without its projection term). ``--lr 1e-2`` makes the
4 steps move the weights enough for backward bugs to reach the loss (at 1e-3 the dW-without-rstd bug moved it by
less than 3e-6, which no float32 tolerance could tell from noise).

TRITON_INTERPRET is read by Triton when it is imported, so it cannot be flipped inside one process; the mode the
test process runs in (tests/conftest.py sets the interpreter on machines without CUDA) runs in-process and the
other mode runs this file as a subprocess.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import liger_gen  # noqa: E402
from liger_gen.examples import train_llama  # noqa: E402
from liger_gen.runtime import ops  # noqa: E402

RTOL = 1e-5
N_LAYERS = 2  # the tiny preset; every layer has two RMSNorms, plus the final norm

# Small enough for < 10 s on two CPU cores, Triton interpreter included: a 512-entry BPE trained on the first
# 100 kB of tiny Shakespeare, 4 steps of 2 x 64 tokens.
BASE_ARGS = [
    "--model", "tiny", "--device", "cpu", "--dtype", "float32",
    "--steps", "4", "--batch-size", "2", "--seq-len", "64", "--lr", "1e-2",
    "--vocab-size", "512", "--max-chars", "100000", "--seed", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One tokenizer cache for the module: the first test trains the tokenizer, the others load it."""
    return tmp_path_factory.mktemp("liger_gen_cache")


def curves_match(losses: list[float], reference: list[float], rtol: float = RTOL) -> bool:
    """True when every step's loss is within ``rtol`` (relative) of the reference's."""
    return len(losses) == len(reference) and all(
        math.isfinite(a) and abs(a - b) <= rtol * abs(b) for a, b in zip(losses, reference)
    )


class _LigerOpCounter:
    """Counts kernel-variant lookups of liger_gen's ops (made only on the Triton-kernel path) while active."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    def __enter__(self):
        self._original = ops._variant

        def counting(space, *args):
            self.calls[space.op] = self.calls.get(space.op, 0) + 1
            return self._original(space, *args)

        ops._variant = counting
        return self

    def __exit__(self, *exc):
        ops._variant = self._original


def _interpreter_on() -> bool:
    """liger_gen's rule: CPU tensors run the Triton kernels in the interpreter iff TRITON_INTERPRET is "1"."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _run_counting_liger_ops(args: list[str]) -> tuple[dict, dict[str, int]]:
    """``train_llama.run(args)`` plus the number of calls of each ``liger_gen::*`` op during it."""
    with _LigerOpCounter() as counter:
        results = train_llama.run(args)
    return results, counter.calls


def _run_in_mode(interpret: bool, args: list[str], tmp_path) -> tuple[dict, dict[str, int]]:
    """Run the example with TRITON_INTERPRET on or off.

    Triton decides at import time whether its own library functions (``tl.sum``'s combine function, ...) are
    interpretable, so the variable cannot be flipped inside this process once triton is imported. The mode
    this process was started in runs in-process; the other one runs this file as a subprocess.
    """
    if interpret == _interpreter_on():
        return _run_counting_liger_ops(args)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    package_root = str(Path(liger_gen.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    calls_file = tmp_path / "liger_op_calls.json"
    proc = subprocess.run(
        [sys.executable, __file__, str(calls_file), *args],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    json_path = Path(args[args.index("--json") + 1])
    return json.loads(json_path.read_text()), json.loads(calls_file.read_text())


@pytest.mark.parametrize("interpret", [False, True], ids=["plain-pytorch", "triton-interpreter"])
def test_liger_gen_loss_curve_matches_transformers(interpret, cache_dir, tmp_path):
    out = tmp_path / "train.json"
    args = [*BASE_ARGS, "--cache-dir", str(cache_dir), "--repeat-baseline", "--json", str(out)]
    results, liger_op_calls = _run_in_mode(interpret, args, tmp_path)

    assert (results["environment"]["triton_interpret"] == "1") == interpret
    patch = results["patch"]
    assert patch["transformers_rmsnorm"] == 0, patch
    assert patch["liger_gen_rmsnorm"] == 2 * N_LAYERS + 1, patch
    assert patch["liger_gen_swiglu_mlp"] == N_LAYERS and patch["fused_linear_cross_entropy_loss"], patch
    assert patch["same_parameter_objects"] and patch["same_state_dict_keys"], patch
    if interpret:  # otherwise this variant would silently test the plain-PyTorch path twice
        ran = {op for op, n in liger_op_calls.items() if n > 0}
        assert {"rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"} <= ran, liger_op_calls

    base = results["runs"]["baseline"]["losses"]
    repeat = results["runs"]["baseline_repeat"]["losses"]
    liger = results["runs"]["liger_gen"]["losses"]
    assert len(base) == 4 and all(math.isfinite(x) for x in base + repeat + liger)
    assert base[-1] < base[0], f"the tiny model did not learn: {base}"
    assert repeat == base, "two plain float32 CPU runs should be bitwise identical"
    assert curves_match(liger, base), f"liger_gen {liger} vs transformers {base} (rtol {RTOL})"
    assert results["comparisons"]["liger_gen"]["max_abs_diff"] == max(abs(a - b) for a, b in zip(liger, base))

    written = json.loads(out.read_text())
    assert written["runs"]["liger_gen"]["losses"] == liger
    assert written["data"]["tokenizer_vocab_size"] == 512
    assert written["runs"]["baseline"]["peak_memory_bytes"] is None  # CPU: n/a
    assert written["runs"]["baseline"]["timed_steps"] == 1  # 4 steps minus 3 warm-up steps


def _mean_over_n_minus_1(model):
    """A wrong RMSNorm: rstd from sum(x²)/(N-1) instead of mean(x²), i.e. the output scaled by sqrt((N-1)/N)."""
    for m in model.modules():
        if isinstance(m, liger_gen.nn.RMSNorm):
            n = m.weight.numel()
            m.register_forward_hook(lambda mod, inp, out, n=n: out * math.sqrt((n - 1) / n))


def _drop_weight_grad(model):
    """A wrong RMSNorm backward: dW is never written (zero), so the norm weights stop training."""
    for m in model.modules():
        if isinstance(m, liger_gen.nn.RMSNorm):
            m.weight.register_hook(torch.zeros_like)


@pytest.mark.parametrize("bug", [_mean_over_n_minus_1, _drop_weight_grad], ids=["fwd-mean-n-1", "bwd-no-dw"])
def test_check_catches_a_wrong_rmsnorm(bug, cache_dir, monkeypatch):
    real_apply_to = liger_gen.apply_to

    def buggy_apply_to(model):
        model = real_apply_to(model)
        bug(model)
        return model

    monkeypatch.setattr(liger_gen, "apply_to", buggy_apply_to)
    results = train_llama.run([*BASE_ARGS, "--cache-dir", str(cache_dir)])
    base, liger = results["runs"]["baseline"]["losses"], results["runs"]["liger_gen"]["losses"]
    assert not curves_match(liger, base), f"a wrong RMSNorm passed the check: {liger} vs {base}"


def test_tokenizer_is_cached_by_text_and_vocab(tmp_path):
    text = train_llama.load_text(train_llama.DEFAULT_TEXT, max_chars=20_000)
    tok, path, cached = train_llama.get_tokenizer(text, 300, tmp_path)
    assert not cached and path.is_file() and tok.get_vocab_size() == 300
    tok2, path2, cached2 = train_llama.get_tokenizer(text, 300, tmp_path)
    assert cached2 and path2 == path
    assert tok2.encode(text[:2000]).ids == tok.encode(text[:2000]).ids
    assert tok.decode(tok.encode(text[:2000]).ids) == text[:2000]  # byte-level: lossless round trip
    _, path3, cached3 = train_llama.get_tokenizer(text, 320, tmp_path)
    assert not cached3 and path3 != path


def test_batches_are_seeded_windows_of_the_stream():
    tokens = torch.arange(1000)
    a = train_llama.make_batches(tokens, steps=3, batch_size=2, seq_len=16, seed=7)
    b = train_llama.make_batches(tokens, steps=3, batch_size=2, seq_len=16, seed=7)
    c = train_llama.make_batches(tokens, steps=3, batch_size=2, seq_len=16, seed=8)
    assert a.shape == (3, 2, 16) and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a - a[..., :1], torch.arange(16).expand(3, 2, 16))  # contiguous windows
    with pytest.raises(ValueError, match="seq-len"):
        train_llama.make_batches(tokens[:10], steps=1, batch_size=1, seq_len=16, seed=0)


def test_every_preset_has_a_default_learning_rate_and_a_choice():
    """A preset added to the model registry is offered by --model; without its default lr a run without --lr
    would stop with a KeyError."""
    assert set(train_llama.DEFAULT_LR) == set(train_llama.PRESETS)
    parser = train_llama.build_parser()
    assert parser.parse_args(["--model", "llama3-8b-4l"]).model == "llama3-8b-4l"
    assert "llama3-8b-4l 0.0003" in " ".join(parser.format_help().split())


if __name__ == "__main__":
    # Subprocess driver for _run_in_mode: argv = [calls_json, *train_llama args].
    _, _calls = _run_counting_liger_ops(sys.argv[2:])
    Path(sys.argv[1]).write_text(json.dumps(_calls))
