"""RMSNorm kernels (Triton interpreter on the CPU) against float64, and the runtime API around them."""

import pytest
import torch

import liger_gen
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.codegen.spaces import DeviceLimits
from liger_gen.ops.norms.rms_norm import RMSNormConfig, RMSNormSpace
from liger_gen.reference import rms_norm_float64, rms_norm_torch
from liger_gen.runtime import tables
from conftest import CPU_PATHS, seeded
from helpers import assert_error_names

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random_case(shape, dtype, device, gen):
    x = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    w = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(device, dtype).requires_grad_()
    return x, w


def _assert_matches_float64(x, w, eps, offset, casting_mode):
    y = liger_gen.functional.rms_norm(x, w, eps, offset, casting_mode)
    assert y.shape == x.shape
    dy = torch.randn(y.shape, dtype=torch.float32).to(y.device, y.dtype)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref = rms_norm_float64(x64, w64, eps, offset)
    ref.backward(dy.double())
    tol = REL_TOL[x.dtype]
    assert rel_l2(y, ref) < tol, "y"
    assert rel_l2(x.grad, x64.grad) < tol, "dx"
    assert rel_l2(w.grad, w64.grad) < tol, "dw"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 123), (7, 64), (5, 4097), (2, 3, 96), (33, 3)])
def test_kernel_matches_float64(shape, dtype, device):
    gen = seeded(shape, str(dtype))
    x, w = _random_case(shape, dtype, device, gen)
    _assert_matches_float64(x, w, 1e-6, 0.0, "llama")


@pytest.mark.parametrize("casting_mode,offset", [("llama", 0.0), ("llama", 0.5), ("gemma", 1.0), ("gemma", 0.0),
                                                 ("none", 0.0), ("none", 1.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_casting_modes_and_offset(casting_mode, offset, dtype, device):
    gen = torch.Generator().manual_seed(7)
    x, w = _random_case((9, 200), dtype, device, gen)
    _assert_matches_float64(x, w, 1e-5, offset, casting_mode)


@pytest.mark.parametrize("make_view", [
    lambda t: t.t(),                      # transposed: last dim has stride != 1
    lambda t: t[:, 3:67],                 # sliced columns: unit stride, row stride 80
    lambda t: t[::2],                     # every other row
])
def test_non_contiguous_input(make_view, device):
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(80, 80, generator=gen).to(device, torch.float32)
    x = make_view(base).detach().requires_grad_()
    assert not x.is_contiguous()
    w = (1 + 0.2 * torch.randn(x.shape[-1], generator=gen)).to(device).requires_grad_()
    _assert_matches_float64(x, w, 1e-6, 0.0, "llama")


@pytest.mark.parametrize("casting_mode", ["llama", "gemma", "none"])
def test_kernel_rounds_like_plain_pytorch(casting_mode, device):
    """bf16 outputs of the kernel and of the plain-PyTorch formula differ by at most two bf16 units in the last place (rsqrt may differ by an fp32 ulp, which can flip
    each of the two roundings)."""
    if device.type == "cpu":
        pytest.skip("Triton's interpreter converts fp32 to bf16 by truncation, not round-to-nearest")
    gen = torch.Generator().manual_seed(11)
    x, w = _random_case((16, 256), torch.bfloat16, device, gen)
    y = liger_gen.functional.rms_norm(x, w, 1e-6, 0.0, casting_mode).float()
    ref = rms_norm_torch(x.detach(), w.detach(), 1e-6, 0.0, casting_mode).float()
    two_ulp = 2.0 ** -6 * ref.abs().clamp_min(1e-3)
    assert ((y - ref).abs() <= two_ulp).all()


def test_llama_mode_dtype_promotion(device):
    """Like transformers: bf16 activations with an fp32 weight give an fp32 output in llama mode."""
    x = torch.randn(4, 32).to(device, torch.bfloat16)
    w = torch.randn(32).to(device, torch.float32)
    assert liger_gen.functional.rms_norm(x, w, casting_mode="llama").dtype == torch.float32
    assert liger_gen.functional.rms_norm(x, w, casting_mode="gemma").dtype == torch.bfloat16


def test_cpu_path_equals_transformers_llama_rms_norm(monkeypatch):
    """Without the interpreter, CPU tensors run plain PyTorch: bit-identical to LlamaRMSNorm."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    hf = LlamaRMSNorm(48, eps=1e-5).to(torch.bfloat16)
    torch.nn.init.normal_(hf.weight, 1.0, 0.1)
    ours = liger_gen.nn.RMSNorm(48, eps=1e-5).to(torch.bfloat16)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(3, 5, 48, dtype=torch.bfloat16)
    assert torch.equal(ours(x), hf(x))


def test_module_is_drop_in_for_llama_rms_norm(device):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(64, eps=1e-5)
    torch.nn.init.normal_(hf.weight, 1.0, 0.1)
    ours = liger_gen.nn.RMSNorm(64, eps=1e-5)
    assert ours.state_dict().keys() == hf.state_dict().keys()
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(6, 64)
    torch.testing.assert_close(ours.to(device)(x.to(device)).cpu(), hf(x), rtol=1e-5, atol=1e-5)


def test_apply_to_replaces_norms_and_keeps_parameters(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, 1.0, 0.2)
    ids = torch.randint(0, 97, (2, 16), device=device)
    expected = model(ids).logits
    params_before = {n: p for n, p in model.named_parameters()}
    assert liger_gen.apply_to(model) is model
    norms = [m for m in model.modules() if isinstance(m, liger_gen.nn.RMSNorm)]
    assert len(norms) == 2 * 2 + 1
    assert not any(type(m).__name__ == "LlamaRMSNorm" for m in model.modules())
    assert all(params_before[n] is p for n, p in model.named_parameters())
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_apply_to_rejects_unknown_model():
    with pytest.raises(ValueError, match="model_type"):
        liger_gen.apply_to(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("shape", [(0, 16), (3, 0, 16), (4, 0)])
def test_empty_inputs_match_pytorch(shape, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    w = torch.ones(shape[-1], device=device, requires_grad=True)
    y = liger_gen.functional.rms_norm(x, w)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("x,w,exc,words", [
    (torch.ones(4, 8, dtype=torch.int64), torch.ones(8), TypeError, ["x", "(4, 8)", "torch.int64"]),
    (torch.ones(4, 8), torch.ones(7), ValueError, ["weight", "(7,)", "(8,)"]),
    (torch.ones(4, 8), torch.ones(2, 8), ValueError, ["weight", "(2, 8)"]),
    (torch.ones(4, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), TypeError, ["float64", "(4, 8)"]),
    (torch.ones(()), torch.ones(1), ValueError, ["at least one dim"]),
])
def test_bad_input_names_tensor_shape_dtype(x, w, exc, words, device):
    assert_error_names(liger_gen.functional.rms_norm, (x, w), exc, words, device)


def test_bad_casting_mode_and_too_wide_rows(device):
    with pytest.raises(ValueError, match="casting_mode"):
        liger_gen.functional.rms_norm(torch.ones(2, 4, device=device), torch.ones(4, device=device), casting_mode="fp8")
    with pytest.raises(ValueError, match="65536"):
        liger_gen.functional.rms_norm(torch.ones(1, 65537, device=device), torch.ones(65537, device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_weight_on_other_device_is_an_error():
    with pytest.raises(ValueError, match="one device"):
        liger_gen.functional.rms_norm(torch.ones(2, 4, device="cuda"), torch.ones(4))


def test_float64_runs_on_plain_cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(3, 10, dtype=torch.float64)
    w = torch.randn(10, dtype=torch.float64)
    torch.testing.assert_close(liger_gen.functional.rms_norm(x, w), rms_norm_float64(x, w, 1e-6))


def test_constraints_reject_bad_configs():
    """(The constraints every row norm shares: ``test_row_norms``.)"""
    good = RMSNormSpace(4096, torch.bfloat16, DeviceLimits(max_threads_per_block=512)).heuristic()
    with pytest.raises(ValueError, match="non-negative int"):
        RMSNormConfig.from_dict({**good.to_dict(), "num_warps_fwd": -4})


def test_heuristic_only_context_restores_state():
    assert not tables.heuristic_only_enabled()
    with tables.heuristic_only():
        assert tables.heuristic_only_enabled()
    assert not tables.heuristic_only_enabled()


def test_inference_mode_input_with_trained_weight(device):
    with torch.inference_mode():
        x = torch.randn(4, 16, device=device)
    w = torch.randn(16, device=device, requires_grad=True)
    liger_gen.functional.rms_norm(x, w).sum().backward()
    w64 = w.detach().double().requires_grad_()
    rms_norm_float64(x.clone(), w64, 1e-6).sum().backward()
    assert rel_l2(w.grad, w64.grad) < REL_TOL[torch.float32]


def test_scalar_arguments_are_type_checked():
    with pytest.raises(TypeError, match="eps"):
        liger_gen.functional.rms_norm(torch.ones(2, 4), torch.ones(4), eps="1e-6")
    with pytest.raises(ValueError, match="casting_mode"):
        liger_gen.nn.RMSNorm(8, casting_mode="foo")


@pytest.mark.parametrize("interpret", CPU_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_without_a_weight_is_x_over_its_rms(dtype, interpret, monkeypatch):
    """``weight=None`` (``torch.nn.RMSNorm(elementwise_affine=False)``): y = x / rms(x) against float64, its x
    gradient by autograd of that, and the module form against torch's own."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = torch.Generator().manual_seed(31)
    x = (torch.randn(2, 7, 48, generator=gen) * 3).to(dtype).requires_grad_()
    dy = torch.randn(2, 7, 48, generator=gen).to(dtype)
    y = liger_gen.functional.rms_norm(x, None, eps=1e-6)
    assert y.dtype == dtype
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    y64 = rms_norm_float64(x64, None, 1e-6)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    tol = REL_TOL[dtype]
    assert rel_l2(y.detach(), y64.detach()) <= tol and rel_l2(dx, dx64) <= tol
    module = liger_gen.nn.RMSNorm(48, eps=1e-6, elementwise_affine=False)
    assert module.weight is None and list(module.state_dict()) == []
    expected = torch.nn.RMSNorm(48, eps=1e-6, elementwise_affine=False)(x.detach().float())
    assert rel_l2(module(x.detach().float()), expected) <= REL_TOL[torch.float32]
    with pytest.raises(ValueError, match="offset=1.0 needs a weight"):
        liger_gen.functional.rms_norm(x, None, offset=1.0)
    with pytest.raises(ValueError, match="needs a weight"):
        liger_gen.nn.RMSNorm(48, offset=1.0, elementwise_affine=False)
