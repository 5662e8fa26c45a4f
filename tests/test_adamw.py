"""AdamW: ``liger_gen.optim.AdamW`` against ``torch.optim.AdamW`` (steps, options, state dicts both ways, hooks,
schedulers), the update against float64, its errors, and the space and the tuner's gate. The op's common
contract (float64 at odd sizes in three dtypes, strided tensors, zero elements, opcheck, compile) is
``tests/test_contract.py``'s."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

import liger_gen
from liger_gen.codegen.build import load_variant
from liger_gen.codegen.problems import REL_TOL
from liger_gen.functional import adamw_step
from liger_gen.ops.optim.adamw import (SPEC, TUNING_CAP, AdamWConfig, AdamWProblem, AdamWSpace, adamw_float64,
                                      parameter_sizes)
from tests.helpers import assert_passes_the_gate

HYPER = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
FP32_ULPS = 8 * torch.finfo(torch.float32).eps  # a few roundings of fp32 arithmetic per element


def _state(n: int, dtype, device, seed: int, amsgrad: bool = False):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen, dtype=torch.float64) * 0.02
    g = torch.randn(n, generator=gen, dtype=torch.float64)
    m = torch.randn(n, generator=gen, dtype=torch.float64) * 0.3
    v = torch.randn(n, generator=gen, dtype=torch.float64).square()
    vmax = v * torch.rand(n, generator=gen, dtype=torch.float64) * 2 if amsgrad else None  # above v in places only
    return [None if t is None else t.to(device, dtype) for t in (p, g, m, v, vmax)]


def _models(device, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    a = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 8)).to(device, dtype)
    b = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 8)).to(device, dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def _train(model, optimizer, device, steps, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 24, generator=gen).to(device, dtype)
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        optimizer.step()


# ------------------------------------------------------------------------------------------------ the update


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_the_update_matches_float64(amsgrad, maximize, device):
    """fp32: the change of every tensor (not just its new value, which the old value dominates) within a few fp32
    roundings of the float64 step; at step 1 and at step 9, so both bias corrections count."""
    for step in (1.0, 9.0):
        p, g, m, v, vmax = _state(1031, torch.float32, device, seed=int(step), amsgrad=amsgrad)
        ref = adamw_float64(p, g, m, v, vmax, step=step, maximize=maximize, **HYPER)
        before = [t.double() for t in (p, m, v, vmax) if t is not None]
        adamw_step(p, g, m, v, vmax, step=step, maximize=maximize, **HYPER)
        for name, new, old, want in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
                                        [t for t in (p, m, v, vmax) if t is not None], before, ref):
            err = (new.double() - want).norm() / (want - old).norm()
            assert err < 1e3 * FP32_ULPS, f"{name} at step {step}: {err:.3g} of its change"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_state_is_rounded_once(dtype, device):
    """bf16 / fp16: every stored value is the float64 result rounded to nearest once (within half a unit in the
    last place, beyond the fp32 arithmetic), and the state keeps the parameter's dtype. Triton's CPU interpreter
    converts fp32 to bf16 by truncation, so there a bf16 value may be a whole unit off."""
    p, g, m, v, _ = _state(2053, dtype, device, seed=3)
    ref = adamw_float64(p, g, m, v, step=4.0, **HYPER)
    adamw_step(p, g, m, v, step=4.0, **HYPER)
    truncates = device.type == "cpu" and dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    bound = torch.finfo(dtype).eps * (1.0 if truncates else 0.5) * (1 + 1e-3)  # (1 + 1e-3): the fp32 arithmetic
    for new, want in zip((p, m, v), ref):
        assert new.dtype == dtype
        rel = ((new.double() - want).abs() / want.abs().clamp_min(torch.finfo(dtype).tiny)).max().item()
        assert rel <= bound, rel


# ------------------------------------------------------------------------------------------------ the optimizer


def _assert_state_close(sa: dict, sb: dict) -> None:
    """Two AdamW states alike: the same keys, dtypes and devices, values within ten steps of fp32 roundoff of
    each tensor's own scale (each step's gradients come from the last step's parameters, so the roundoff of the
    two implementations compounds: on an H100, up to 1.4e-5 relative in the second moment after ten steps)."""
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and sa[key].device == sb[key].device, key
        torch.testing.assert_close(sa[key], sb[key], rtol=1e-4, atol=1e-5 * float(sb[key].abs().max()))


@pytest.mark.parametrize("options", [{}, {"amsgrad": True, "betas": (0.9, 0.5)}, {"maximize": True},
                                     {"weight_decay": 0.0},
                                     {"betas": (0.8, 0.95), "eps": 1e-6, "lr": 3e-3}])
def test_optimizer_follows_torch_adamw(options, device, cpu_path):
    """Ten steps of a small MLP, on the kernel path and (on the CPU) the plain-PyTorch one:
    liger_gen.optim.AdamW and torch.optim.AdamW stay within fp32 roundoff of each other (parameters and
    state), with the same state layout. The loss shrinks tenfold over the steps, so the gradients' second moment
    falls and (with β2 = 0.5, which follows it closely) amsgrad's maximum stays above it for most elements."""
    a, b = _models(device)
    ours, theirs = liger_gen.optim.AdamW(a.parameters(), **options), torch.optim.AdamW(b.parameters(), **options)
    for model, optimizer in ((a, ours), (b, theirs)):
        gen = torch.Generator().manual_seed(1)
        for i in range(10):
            x = torch.randn(16, 24, generator=gen).to(device)
            optimizer.zero_grad(set_to_none=True)
            (model(x).square().mean() * 10 ** (1 - i / 9)).backward()
            optimizer.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
        _assert_state_close(ours.state[pa], theirs.state[pb])
    if options.get("amsgrad"):
        state = ours.state[a[0].weight]
        assert (state["max_exp_avg_sq"] > 1.5 * state["exp_avg_sq"]).float().mean() > 0.5


def test_parameter_groups_and_a_scheduler(device):
    """Two groups with their own lr and weight decay, a frozen parameter (no gradient: untouched, no state), and
    a LambdaLR schedule: as torch.optim.AdamW."""
    a, b = _models(device)
    for model in (a, b):
        model[1].weight.requires_grad_(False)

    def groups(model):
        return [{"params": list(model[0].parameters()), "lr": 2e-2},
                {"params": list(model[1].parameters()) + list(model[2].parameters()), "weight_decay": 0.0}]

    ours, theirs = liger_gen.optim.AdamW(groups(a), lr=5e-3), torch.optim.AdamW(groups(b), lr=5e-3)
    frozen = a[1].weight.detach().clone()
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ours, theirs)]
    for _ in range(4):
        _train(a, ours, device, 1)
        _train(b, theirs, device, 1)
        for s in scheds:
            s.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    assert torch.equal(a[1].weight, frozen) and a[1].weight not in ours.state


def test_state_dicts_load_both_ways(device):
    """A torch.optim.AdamW state dict continues in liger_gen.optim.AdamW and the other way round, as if one
    optimizer had run throughout."""
    ref, a = _models(device)
    _, b = _models(device)
    straight = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(ref, straight, device, 6)

    first = torch.optim.AdamW(a.parameters(), lr=1e-2)
    _train(a, first, device, 3)
    second = liger_gen.optim.AdamW(a.parameters(), lr=1e-2)
    second.load_state_dict(first.state_dict())
    # the same batches as the straight run's steps 4-6: replay its generator
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 24, generator=gen).to(device) for _ in range(6)]
    for x in xs[3:]:
        second.zero_grad()
        a(x).square().mean().backward()
        second.step()
    for pr, pa in zip(ref.parameters(), a.parameters()):
        torch.testing.assert_close(pa, pr, rtol=1e-5, atol=1e-6)

    b.load_state_dict(a.state_dict())
    back = torch.optim.AdamW(b.parameters(), lr=1e-2)
    back.load_state_dict(copy.deepcopy(second.state_dict()))  # (loading keeps same-device tensors: no aliasing)
    assert all(s["step"].item() == 6 for s in back.state.values())
    twin = liger_gen.optim.AdamW(a.parameters(), lr=1e-2)
    twin.load_state_dict(copy.deepcopy(second.state_dict()))
    for model, opt in ((b, back), (a, twin)):
        opt.zero_grad()
        model(xs[0]).square().mean().backward()
        opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_step_hooks_and_closure_run_once(device):
    a, _ = _models(device)
    opt = liger_gen.optim.AdamW(a.parameters())
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    opt.register_step_post_hook(lambda *args: calls.append("post"))
    x = torch.randn(4, 24, device=device)

    def closure():
        opt.zero_grad()
        loss = a(x).square().mean()
        loss.backward()
        calls.append("closure")
        return loss

    loss = opt.step(closure)
    assert calls == ["pre", "closure", "post"] and loss.ndim == 0


def test_bf16_parameters_train_as_float64_adamw(device):
    """bf16 weights and state, five steps: each step's parameters within bf16 rounding of the float64 update
    applied to the same bf16 values (the reference re-rounds each step, as the stored tensors are)."""
    lin = torch.nn.Linear(64, 32).to(device, torch.bfloat16)
    opt = liger_gen.optim.AdamW(lin.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(7)
    for step in range(1, 6):
        x = torch.randn(8, 64, generator=gen).to(device, torch.bfloat16)
        opt.zero_grad()
        lin(x).float().square().mean().backward()
        before = {p: (p.detach().clone(), opt.state[p]["exp_avg"].clone() if step > 1 else torch.zeros_like(p),
                      opt.state[p]["exp_avg_sq"].clone() if step > 1 else torch.zeros_like(p))
                  for p in lin.parameters()}
        opt.step()
        assert all(opt.state[p][k].dtype == torch.bfloat16 for p in before for k in ("exp_avg", "exp_avg_sq"))
        for p, (p0, m0, v0) in before.items():
            want, _, _ = adamw_float64(p0, p.grad, m0, v0, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                       weight_decay=0.1, step=float(step))
            change = (want - p0.double()).norm()
            assert (p.double() - want).norm() <= REL_TOL[torch.bfloat16] * change + 2 ** -8 * want.norm()


def test_a_step_moves_version_counters_as_an_in_place_update(device):
    """A step between a forward and its backward is refused by autograd, as torch.optim.AdamW's is; adamw_step on
    a leaf that requires grad, with grad mode on, is refused as any in-place update of it is."""
    for cls in (torch.optim.AdamW, liger_gen.optim.AdamW):
        lin = torch.nn.Linear(4, 4).to(device)
        opt = cls(lin.parameters(), lr=0.1)
        x = torch.randn(2, 4, device=device, requires_grad=True)  # so the forward saves the weight
        lin(x).sum().backward()
        out = lin(x).square().sum()
        before = lin.weight._version
        opt.step()
        assert lin.weight._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()
    p, g, m, v, _ = _state(8, torch.float32, device, seed=0)
    leaf = p.clone().requires_grad_()
    for target in (leaf, leaf.view(8), leaf * 1):  # a leaf, a view of it, a tensor of its graph
        with pytest.raises(RuntimeError, match="requires grad and would be updated in place"):
            adamw_step(target, g, m, v, step=1.0, lr=1e-3)
    with torch.inference_mode():
        frozen = torch.zeros_like(m)
    with pytest.raises(RuntimeError, match="exp_avg of shape \\(8,\\).* is an inference tensor"):
        adamw_step(p, g, frozen, v, step=1.0, lr=1e-3)


def test_a_step_that_raises_changes_nothing(device):
    """A bad state tensor on the last parameter: the step raises before the first parameter moves."""
    lin = torch.nn.Linear(3, 3).to(device)
    extra = torch.nn.Parameter(torch.zeros(5, device=device))
    opt = liger_gen.optim.AdamW(list(lin.parameters()) + [extra], lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        (lin(torch.ones(1, 3, device=device)).sum() + extra.sum()).backward()
        if opt.state:
            opt.state[extra]["exp_avg"] = torch.zeros(6, device=device)
            weight = lin.weight.detach().clone()
            with pytest.raises(ValueError, match=r"exp_avg must have param's shape \(5,\); got exp_avg of shape"):
                opt.step()
            assert torch.equal(lin.weight, weight)
            assert all(opt.state[p]["step"].item() == 1 for p in lin.parameters())
        else:
            opt.step()


def test_a_step_with_bad_state_raises_before_anything_moves(device):
    """State that cannot be written (an inference tensor) or is incomplete, on the second parameter: the first
    parameter, and every step count, are as before the step."""
    lin = torch.nn.Linear(3, 3, bias=False).to(device)
    extra = torch.nn.Parameter(torch.ones(2, device=device))
    opt = liger_gen.optim.AdamW([lin.weight, extra], lr=0.1)
    for bad, match in ((lambda s: s.__setitem__("exp_avg", _inference_zeros(extra)), "is an inference tensor"),
                       (lambda s: s.pop("exp_avg_sq"), "lacks exp_avg_sq")):
        opt.zero_grad()
        (lin(torch.ones(1, 3, device=device)).sum() + extra.sum()).backward()
        opt.step()
        bad(opt.state[extra])
        weight, steps = lin.weight.detach().clone(), [s["step"].item() for s in opt.state.values()]
        with pytest.raises((RuntimeError, ValueError), match=match):
            opt.step()
        assert torch.equal(lin.weight, weight) and [s["step"].item() for s in opt.state.values()] == steps
        opt.state[extra].clear()


def _inference_zeros(t):
    with torch.inference_mode():
        return torch.zeros_like(t)


def test_state_dicts_leave_foreach_and_fused_to_the_loader(device):
    """The state dict records foreach and fused as None (torch's own default), not as False."""
    lin = torch.nn.Linear(3, 3).to(device)
    opt = liger_gen.optim.AdamW(lin.parameters())
    group = opt.state_dict()["param_groups"][0]
    assert group["foreach"] is None and group["fused"] is None


# ------------------------------------------------------------------------------------------------ errors


def test_bad_arguments_name_the_tensor_shape_and_dtype(device):
    p, g, m, v, _ = _state(16, torch.float32, device, seed=0)
    with pytest.raises(ValueError, match=r"grad must have param's shape \(16,\); got grad of shape \(4, 4\)"):
        adamw_step(p, g.view(4, 4), m, v, step=1.0, lr=1e-3)
    with pytest.raises(TypeError, match="exp_avg must be floating point; got exp_avg of shape"):
        adamw_step(p, g, m.long(), v, step=1.0, lr=1e-3)
    with pytest.raises(ValueError, match="beta2 must be in"):
        adamw_step(p, g, m, v, step=1.0, lr=1e-3, beta2=1.0)
    with pytest.raises(ValueError, match="step must be >= 1"):
        adamw_step(p, g, m, v, step=0.0, lr=1e-3)
    with pytest.raises(TypeError, match="lr must be a real number"):
        adamw_step(p, g, m, v, step=1.0, lr="1e-3")
    with pytest.raises(ValueError, match="fused=True is not supported"):
        liger_gen.optim.AdamW([torch.nn.Parameter(p)], fused=True)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # torch's own check
        liger_gen.optim.AdamW([torch.nn.Parameter(p)], lr=-1.0)


def test_float64_and_sparse(device, monkeypatch):
    """float64 parameters take the plain-PyTorch update in float64 (the kernel refuses them by name); sparse
    gradients are refused as torch.optim.AdamW refuses them."""
    p, g, m, v, _ = _state(33, torch.float64, device, seed=2)
    if device.type == "cuda" or __import__("os").environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(TypeError, match="param of shape \\(33,\\), dtype torch.float64"):
            adamw_step(p, g, m, v, step=1.0, lr=1e-2)
    param = torch.nn.Parameter(p.clone())
    opt = liger_gen.optim.AdamW([param], lr=1e-2, weight_decay=0.1)
    param.grad = g.clone()
    opt.step()
    want, _, _ = adamw_float64(p, g, torch.zeros_like(p), torch.zeros_like(p), lr=1e-2, beta1=0.9, beta2=0.999,
                               eps=1e-8, weight_decay=0.1, step=1.0)
    torch.testing.assert_close(param.detach(), want, rtol=1e-12, atol=1e-14)
    emb = torch.nn.Embedding(10, 4, sparse=True).to(device)
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    with pytest.raises(TypeError, match="grad must be a dense tensor"):
        liger_gen.optim.AdamW(emb.parameters()).step()


# ------------------------------------------------------------------------------------------------ space, gate


def test_heuristic_and_constraints():
    for dtype in (torch.float32, torch.bfloat16):
        space = AdamWSpace({}, dtype)
        assert not space.violations(space.heuristic())
    space = AdamWSpace({}, torch.bfloat16)
    assert space.violations(AdamWConfig(128, 16))  # fewer elements than threads
    assert space.violations(AdamWConfig(16384, 1))  # 512 values a thread
    assert space.violations(AdamWConfig(1000, 4))  # not a choice


@pytest.mark.parametrize("changes", [{}, {"BLOCK": 128, "num_warps": 1}, {"BLOCK": 4096, "num_warps": 8}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_block_passes_the_tuners_gate(changes, dtype, device):
    assert_passes_the_gate(AdamWProblem(dtype, {}, 3001, device, seed=4), changes)


def test_the_gate_catches_a_wrong_update(device):
    """The gate can fail: a kernel rendered without the bias corrections' effect (step 1 where the truth is at
    step 7) is rejected, and so are inputs other than the truth's."""
    problem = AdamWProblem(torch.float32, {}, 999, device, seed=1)
    module = load_variant("adamw", problem.template_params(problem.space.heuristic()))
    assert problem.check(module, "fwd") is None
    problem.hyper["step"] = 1.0
    assert "relative L2 error" in problem.check(module, "fwd")
    problem.hyper["step"] = 7.0
    problem.originals["grad"][:50] *= -1
    assert "relative L2 error" in problem.check(module, "fwd")


def test_spec_bytes_and_tuning_problems():
    from liger_gen.models import PRESETS

    model = PRESETS["llama3-8b"]
    assert SPEC.name == "adamw" and SPEC.space is AdamWSpace and SPEC.problem is AdamWProblem
    assert AdamWProblem.phase_bytes({"rows": 10}, 2) == {"fwd": 140}
    sizes = parameter_sizes(model)
    assert sizes[0] == model.hidden_size and sizes[-1] == model.vocab_size * model.hidden_size
    problems = SPEC.tuning_problems(dataclasses.replace(model, vocab_size=64, hidden_size=32, intermediate_size=48,
                                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8),
                                    [8192], torch.bfloat16, "cpu")
    assert [p.rows for p in problems] == [32, 32 * 16, 32 * 32, 32 * 48, 32 * 64]
    assert all(p.dims == {} and p.op == "adamw" for p in problems)
    assert max(min(n, TUNING_CAP) for n in sizes) == TUNING_CAP


def test_small_tuner_run_writes_a_usable_table(tmp_path, monkeypatch):
    """A tuner run (a deterministic cost model for the timer) writes a table keyed by element count alone, and the
    runtime then uses it for a parameter of about that many elements."""
    import optuna

    from liger_gen.codegen.spaces import DeviceLimits
    from liger_gen.runtime import tables
    from liger_gen.runtime.ops import clear_caches
    from liger_gen.tuning.search import Tuner
    from liger_gen.tuning.tables import tune_to_table

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    problem = AdamWProblem(torch.float32, {}, 5000, "cpu", seed=1)
    tuner = Tuner(n_trials=4, timer=lambda launch, params: abs(params["BLOCK"] - 512) / 512 + params["num_warps"],
                  seed=0, retime_rounds=1)
    path, (entry,) = tune_to_table(AdamWSpace, [problem], tmp_path, gpu="h200", device_name="NVIDIA H200",
                                   compute_capability="9.0", tuner=tuner)
    assert path == tmp_path / "h200" / "adamw.json"
    config = AdamWConfig.from_dict(entry["config"])
    assert entry["dims"] == {} and entry["rows"] == 5000 and entry["bytes"] == {"fwd": 7 * 5000 * 4}
    assert not problem.space.violations(config)
    monkeypatch.setenv(tables.ENV_TUNED_DIR, str(tmp_path))
    tables.clear_caches()
    try:
        found = tables.lookup(AdamWSpace, torch.float32, {}, 6000, "h200", DeviceLimits.interpreter())
        assert found["source"] == "user" and found["config"] == config
    finally:
        monkeypatch.delenv(tables.ENV_TUNED_DIR)
        clear_caches()
