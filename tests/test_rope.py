"""RoPE kernels (Triton interpreter on the CPU) against float64 and transformers, and the runtime API around them."""

import dataclasses

import optuna
import pytest
import torch
from conftest import CPU_PATHS

from liger_gen.codegen.build import load_variant
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.codegen.spaces import DeviceLimits
from liger_gen.tuning.search import Tuner
from liger_gen.models import PRESETS
from liger_gen.ops.rope import (RoPEConfig, RoPEProblem, RoPESpace, rope, rope_float64, rope_torch,
                                tuning_problems)

from conftest import seeded

optuna.logging.set_verbosity(optuna.logging.WARNING)

# tests that run the kernels in the interpreter on CPU tensors: it must be on before the kernels are defined
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="needs the interpreter (no GPU)")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _qk(batch, n_q, n_kv, seq, head_dim, dtype, device, gen, unsqueeze_dim=1):
    """q, k as transformers makes them: a (b, s, h, d) projection output, transposed for unsqueeze_dim=1."""
    q = torch.randn(batch, seq, n_q, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, seq, n_kv, head_dim, generator=gen).to(device, dtype)
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    return q.requires_grad_(), k.requires_grad_()


def _cos_sin(cos_batch, seq, rotary_dim, dtype, device, gen, base=10000.0, tables="llama"):
    """Real rotary tables (as LlamaRotaryEmbedding) at random positions, so every angle is exercised; or, with
    tables="random", arbitrary values (the op is transformers' formula for any cos/sin, and real tables have
    equal halves, which would hide a mix-up of the halves)."""
    if tables == "random":
        shape = (cos_batch, seq, rotary_dim)
        return tuple(torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
    pos = torch.randint(0, 4096, (cos_batch, seq), generator=gen).float()
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def _assert_matches_float64(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, tol=None):
    q_out, k_out = rope(q, k, cos, sin, position_ids, unsqueeze_dim)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.dtype == torch.promote_types(q.dtype, cos.dtype)
    gen = torch.Generator().manual_seed(1234)
    dq_out = torch.randn(q_out.shape, generator=gen).to(q_out.device, q_out.dtype)
    dk_out = torch.randn(k_out.shape, generator=gen).to(k_out.device, k_out.dtype)
    torch.autograd.backward((q_out, k_out), (dq_out, dk_out))
    leaves = [t for t in (q, k, cos, sin) if t.requires_grad]
    leaves64 = [t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, cos, sin)]
    ref_q, ref_k = rope_float64(*leaves64, position_ids, unsqueeze_dim)
    torch.autograd.backward((ref_q, ref_k), (dq_out.double(), dk_out.double()))
    tol = tol or REL_TOL[q_out.dtype]
    assert rel_l2(q_out, ref_q) < tol, "q_out"
    assert rel_l2(k_out, ref_k) < tol, "k_out"
    for name, t, t64 in zip(("q", "k", "cos", "sin"), (q, k, cos, sin), leaves64):
        if t.requires_grad:
            assert t.grad is not None and t.grad.dtype == t.dtype, name
            assert rel_l2(t.grad, t64.grad) < REL_TOL[t.dtype], f"d{name}"
    return leaves


@pytest.mark.parametrize("tables", ["llama", "random"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,n_q,n_kv,seq,head_dim,rotary_dim,cos_batch", [
    (1, 2, 1, 2, 128, 128, 1),     # the regression shape (MQA: one KV head)
    (2, 4, 2, 5, 64, 64, 1),       # GQA, cos broadcast over the batch
    (2, 3, 3, 7, 32, 32, 2),       # MHA, per-batch cos (e.g. packed sequences)
    (1, 6, 2, 1, 96, 96, 1),       # one row; rotary half 48 is not a power of two
    (3, 2, 1, 3, 80, 20, 3),       # partial rotary (GPT-NeoX / Phi style); half 10, pass 60
    (1, 5, 5, 4, 16, 8, 1),        # five heads: the head loop's tail
])
def test_kernel_matches_float64(batch, n_q, n_kv, seq, head_dim, rotary_dim, cos_batch, dtype, tables, device):
    gen = seeded(batch, n_q, n_kv, seq, head_dim, rotary_dim, str(dtype))
    q, k = _qk(batch, n_q, n_kv, seq, head_dim, dtype, device, gen)
    cos, sin = _cos_sin(cos_batch, seq, rotary_dim, dtype, device, gen, tables=tables)
    _assert_matches_float64(q, k, cos, sin)


@pytest.mark.parametrize("tables", ["llama", "random"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_regression_q_1x2x2x128_k_1x1x2x128_both_rotated_correctly(dtype, tables, device):
    """RoPE with q of shape (1, 2, 2, 128) and k of shape (1, 1, 2, 128): both rotated correctly (forward and
    gradients) — k with a single KV head must be rotated too, not left as is or rotated with q's heads."""
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(1, 2, 2, 128, generator=gen).to(device, dtype).requires_grad_()
    k = torch.randn(1, 1, 2, 128, generator=gen).to(device, dtype).requires_grad_()
    cos, sin = _cos_sin(1, 2, 128, dtype, device, gen, tables=tables)
    _assert_matches_float64(q, k, cos, sin)
    # and not trivially: position 1 really rotates k (out differs from in by far more than rounding)
    _, k_out = rope(q.detach(), k.detach(), cos, sin)
    assert rel_l2(k_out[:, :, 1], k[:, :, 1].detach()) > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unsqueeze_dim_2_layout(dtype, device):
    gen = torch.Generator().manual_seed(5)
    q, k = _qk(2, 4, 2, 6, 64, dtype, device, gen, unsqueeze_dim=2)  # (b, s, h, d), contiguous
    cos, sin = _cos_sin(1, 6, 64, dtype, device, gen)
    _assert_matches_float64(q, k, cos, sin, unsqueeze_dim=2)
    q_out, _ = rope(q, k, cos, sin, unsqueeze_dim=-2)
    torch.testing.assert_close(q_out, rope(q, k, cos, sin, unsqueeze_dim=2)[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pos_batch,rotary_dim", [(2, 64), (1, 64), (2, 32)])
def test_position_ids_gather_the_tables(pos_batch, rotary_dim, dtype, device):
    """With position_ids, cos/sin are (max_position, r) tables gathered in the kernel: the result equals
    rope(q, k, cos[position_ids], sin[position_ids]), negative positions included."""
    gen = torch.Generator().manual_seed(9)
    q, k = _qk(2, 4, 2, 5, 64, dtype, device, gen)
    cos, sin = _cos_sin(1, 40, rotary_dim, dtype, device, gen, tables="random")
    cos, sin = cos[0], sin[0]
    position_ids = torch.randint(-40, 40, (pos_batch, 5), generator=gen).to(device)
    _assert_matches_float64(q, k, cos, sin, position_ids)
    gathered = rope(q.detach(), k.detach(), cos[position_ids], sin[position_ids])
    for a, b in zip(rope(q.detach(), k.detach(), cos, sin, position_ids.int()), gathered):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    q2, k2 = q.detach().transpose(1, 2).requires_grad_(), k.detach().transpose(1, 2).requires_grad_()
    _assert_matches_float64(q2, k2, cos, sin, position_ids, unsqueeze_dim=2)


@pytest.mark.parametrize("make_qk", [
    # transformers: (b, s, h, d) projection → view → transpose(1, 2)
    lambda qp, kp: (qp.transpose(1, 2), kp.transpose(1, 2)),
    # sliced out of a fused qkv projection (non-dense: row stride covers q, k and v)
    lambda qp, kp: (torch.cat([qp, kp, kp], 2)[:, :, :4].transpose(1, 2),
                    torch.cat([qp, kp, kp], 2)[:, :, 4:6].transpose(1, 2)),
    # head_dim not unit stride (transposed last two dims)
    lambda qp, kp: (qp.permute(0, 2, 3, 1).contiguous().transpose(2, 3),
                    kp.permute(0, 2, 3, 1).contiguous().transpose(2, 3)),
    # every other position
    lambda qp, kp: (qp.transpose(1, 2)[:, :, ::2], kp.transpose(1, 2)[:, :, ::2]),
])
def test_non_contiguous_inputs(make_qk, device):
    gen = torch.Generator().manual_seed(3)
    qp = torch.randn(2, 8, 4, 32, generator=gen).to(device)
    kp = torch.randn(2, 8, 2, 32, generator=gen).to(device)
    q, k = make_qk(qp, kp)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    seq = q.shape[2]
    cos, sin = _cos_sin(1, seq, 32, torch.float32, device, gen, tables="random")
    cos = cos.expand(2, seq, 32)  # stride-0 batch, as a broadcast tensor would come
    sin = torch.cat([sin, sin], -1)[..., :32].expand(2, seq, 32)  # sliced: row stride 64
    assert not (q.is_contiguous() and k.is_contiguous())
    _assert_matches_float64(q, k, cos, sin)
    _assert_matches_float64(q.detach().requires_grad_(), k.detach().requires_grad_(), cos.transpose(1, 2)
                            .contiguous().transpose(1, 2), sin)  # cos with unit seq stride, d stride seq


def test_outputs_keep_the_projection_layout_and_are_new_tensors(device):
    gen = torch.Generator().manual_seed(4)
    q, k = _qk(2, 4, 2, 3, 16, torch.float32, device, gen)
    cos, sin = _cos_sin(1, 3, 16, torch.float32, device, gen)
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()
    assert q_out.data_ptr() != q.data_ptr() and k_out.data_ptr() != k.data_ptr()


@pytest.mark.parametrize("q_dtype,cos_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_dtype_promotion_like_transformers(q_dtype, cos_dtype, device):
    """q·cos follows PyTorch's promotion: bf16 q with fp32 cos gives fp32 outputs; the grads keep q's dtype."""
    gen = torch.Generator().manual_seed(8)
    q, k = _qk(1, 2, 1, 4, 32, q_dtype, device, gen)
    cos, sin = _cos_sin(1, 4, 32, cos_dtype, device, gen)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    expected = apply_rotary_pos_emb(q.detach().cpu(), k.detach().cpu(), cos.cpu(), sin.cpu())[0].dtype
    assert expected == torch.promote_types(q_dtype, cos_dtype)
    leaves = _assert_matches_float64(q, k, cos, sin)
    assert [t.grad.dtype for t in leaves] == [q_dtype, q_dtype]


@pytest.mark.parametrize("with_positions", [False, True])
def test_cos_sin_gradients_when_they_require_grad(with_positions, device):
    """cos/sin from a non-trainable buffer get no grad; if they do require grad, it is computed (fp32 sums
    over heads and batch, scattered into the table rows with position_ids)."""
    gen = torch.Generator().manual_seed(13)
    q, k = _qk(2, 3, 1, 4, 32, torch.float32, device, gen)
    cos, sin = _cos_sin(1, 12 if with_positions else 4, 24, torch.float32, device, gen, tables="random")
    position_ids = None
    if with_positions:
        cos, sin = cos[0], sin[0]
        position_ids = torch.tensor([[0, 3, 3, -1], [5, 1, 0, 11]], device=device)
    cos.requires_grad_()
    sin.requires_grad_()
    _assert_matches_float64(q, k, cos, sin, position_ids)
    # only cos trainable: sin stays without grad
    cos2 = cos.detach().requires_grad_()
    q_out, k_out = rope(q.detach(), k.detach(), cos2, sin.detach(), position_ids)
    (q_out.sum() + k_out.sum()).backward()
    assert cos2.grad is not None and cos2.grad.shape == cos2.shape


def test_cpu_path_is_transformers_bit_for_bit(monkeypatch):
    """Without the interpreter, CPU tensors run plain PyTorch: bit-identical to apply_rotary_pos_emb (Llama,
    bf16, unsqueeze_dim 1 and 2) and to GPT-NeoX's partial-rotary version."""
    from transformers import LlamaConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    x = torch.randn(2, 7, 4, 64, dtype=torch.bfloat16)
    position_ids = torch.arange(7)[None].expand(2, 7)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, position_ids)
    assert cos.dtype == torch.bfloat16
    q, k = x.transpose(1, 2), torch.randn(2, 7, 2, 64, dtype=torch.bfloat16).transpose(1, 2)
    for a, b in zip(rope(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2),
                    apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)):
        assert torch.equal(a, b)
    for a, b in zip(rope(q, k, cos[..., :16], sin[..., :16]), neox_apply(q, k, cos[..., :16], sin[..., :16])):
        assert torch.equal(a, b)
    with pytest.raises(IndexError):
        rope(q, k, cos[0], sin[0], position_ids + 7)


def test_kernel_agrees_with_transformers_in_float32(device):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(2)
    q, k = _qk(2, 4, 2, 6, 64, torch.float32, device, gen)
    cos, sin = _cos_sin(1, 6, 64, torch.float32, device, gen, tables="random")
    for a, b in zip(rope(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_float64_runs_on_plain_cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(6)
    q, k = _qk(1, 2, 1, 3, 16, torch.float64, "cpu", gen)
    cos, sin = _cos_sin(1, 3, 16, torch.float64, "cpu", gen)
    for a, b in zip(rope(q, k, cos, sin), rope_float64(q, k, cos, sin)):
        torch.testing.assert_close(a, b)


def _bad(device):
    q, k = torch.ones(2, 4, 3, 8), torch.ones(2, 2, 3, 8)
    cos, sin = torch.ones(1, 3, 8), torch.ones(1, 3, 8)
    d = {"q": q, "k": k, "cos": cos, "sin": sin}
    return {name: t.to(device) for name, t in d.items()}


@pytest.mark.parametrize("changes,exc,words", [
    ({"k": torch.ones(2, 2, 3, 16)}, ValueError, ["k", "(2, 2, 3, 16)", "head_dim"]),
    ({"k": torch.ones(2, 2, 5, 8)}, ValueError, ["k", "(2, 2, 5, 8)", "seq"]),
    ({"k": torch.ones(1, 2, 3, 8)}, ValueError, ["k", "(1, 2, 3, 8)", "batch"]),
    ({"q": torch.ones(4, 3, 8)}, ValueError, ["q", "(4, 3, 8)", "4-D"]),
    ({"cos": torch.ones(1, 3, 16), "sin": torch.ones(1, 3, 16)}, ValueError, ["cos", "(1, 3, 16)", "head_dim=8"]),
    ({"cos": torch.ones(1, 3, 5), "sin": torch.ones(1, 3, 5)}, ValueError, ["cos", "(1, 3, 5)", "even"]),
    ({"cos": torch.ones(1, 4, 8), "sin": torch.ones(1, 4, 8)}, ValueError, ["cos", "(1, 4, 8)", "seq"]),
    ({"cos": torch.ones(3, 3, 8), "sin": torch.ones(3, 3, 8)}, ValueError, ["cos", "(3, 3, 8)", "batch or 1"]),
    ({"cos": torch.ones(3, 8), "sin": torch.ones(3, 8)}, ValueError, ["cos", "(3, 8)", "rotary_dim"]),
    ({"sin": torch.ones(1, 3, 6)}, ValueError, ["sin", "(1, 3, 6)", "same shape"]),
    ({"q": torch.ones(2, 4, 3, 8, dtype=torch.int64)}, TypeError, ["q", "torch.int64"]),
    ({"k": torch.ones(2, 2, 3, 8, dtype=torch.float16)}, TypeError, ["k", "torch.float16", "same dtype"]),
    ({"sin": torch.ones(1, 3, 8, dtype=torch.bfloat16)}, TypeError, ["sin", "torch.bfloat16", "same dtype"]),
    ({"q": torch.ones(2, 4, 3, 8, dtype=torch.float64), "k": torch.ones(2, 2, 3, 8, dtype=torch.float64)},
     TypeError, ["q", "float64", "(2, 4, 3, 8)"]),
    ({"cos": [1.0]}, TypeError, ["cos", "list"]),
    ({"unsqueeze_dim": 3}, ValueError, ["unsqueeze_dim", "3"]),
    ({"position_ids": torch.zeros(2, 3)}, TypeError, ["position_ids", "torch.float32", "int"]),
    ({"position_ids": torch.zeros(2, 3, dtype=torch.long)}, ValueError, ["cos", "(1, 3, 8)", "max_position"]),
    ({"position_ids": torch.zeros(3, 3, dtype=torch.long), "cos": torch.ones(9, 8), "sin": torch.ones(9, 8)},
     ValueError, ["position_ids", "(3, 3)", "batch or 1"]),
    ({"position_ids": torch.zeros(3, dtype=torch.long), "cos": torch.ones(9, 8), "sin": torch.ones(9, 8)},
     ValueError, ["position_ids", "(3,)"]),
])
def test_bad_input_names_argument_shape_dtype(changes, exc, words, device):
    args = _bad(device)
    args.update({k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in changes.items()})
    with pytest.raises(exc) as info:
        rope(**args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_head_dim_limit_on_kernel_path(device):
    q, k = torch.ones(1, 1, 1, 1026, device=device), torch.ones(1, 1, 1, 1026, device=device)
    cos = torch.ones(1, 1, 2, device=device)
    with pytest.raises(ValueError, match="1024"):
        rope(q, k, cos, cos)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tensors_on_other_devices_are_an_error():
    q, k = torch.ones(1, 2, 3, 8, device="cuda"), torch.ones(1, 1, 3, 8, device="cuda")
    with pytest.raises(ValueError, match="one device"):
        rope(q, k, torch.ones(1, 3, 8), torch.ones(1, 3, 8))


@pytest.mark.parametrize("shape_q,shape_k", [((0, 2, 3, 8), (0, 1, 3, 8)), ((2, 2, 0, 8), (2, 1, 0, 8)),
                                             ((1, 2, 3, 8), (1, 0, 3, 8))])
def test_empty_inputs_match_pytorch(shape_q, shape_k, device):
    q = torch.randn(shape_q, device=device, requires_grad=True)
    k = torch.randn(shape_k, device=device, requires_grad=True)
    cos = torch.randn(1, shape_q[2], 8, device=device)
    sin = torch.randn(1, shape_q[2], 8, device=device)
    q_out, k_out = rope(q, k, cos, sin)
    ref_q, ref_k = rope_torch(q.detach(), k.detach(), cos, sin)
    torch.testing.assert_close(q_out, ref_q)
    torch.testing.assert_close(k_out, ref_k)
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_zero_kv_heads_matches_float64(device):
    gen = torch.Generator().manual_seed(16)
    q, k = _qk(2, 3, 0, 4, 16, torch.float32, device, gen)
    cos, sin = _cos_sin(1, 4, 16, torch.float32, device, gen, tables="random")
    _assert_matches_float64(q, k, cos, sin)


@INTERPRETER_ONLY
def test_custom_ops_called_directly_on_plain_cpu_path(monkeypatch):
    """Without the interpreter the custom ops' implementations compute the kernels' formulas in PyTorch."""
    gen = torch.Generator().manual_seed(24)
    q, k = _qk(2, 3, 1, 4, 24, torch.bfloat16, "cpu", gen)
    q, k = q.detach(), k.detach()
    cos, sin = _cos_sin(1, 9, 16, torch.float32, "cpu", gen, tables="random")
    cos, sin = cos[0], sin[0]
    pos = torch.randint(0, 9, (1, 4), generator=gen)
    g_q, g_k = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)
    results = []
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        results.append(torch.ops.liger_gen.rope_fwd(q, k, cos, sin, pos)
                       + torch.ops.liger_gen.rope_bwd(g_q, g_k, cos, sin, pos, torch.bfloat16))
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)  # bf16 grads: truncation vs round-to-nearest


def test_only_one_output_used(device):
    gen = torch.Generator().manual_seed(17)
    q, k = _qk(1, 2, 1, 3, 16, torch.float32, device, gen)
    cos, sin = _cos_sin(1, 3, 16, torch.float32, device, gen)
    q_out, _ = rope(q, k, cos, sin)
    q_out.square().sum().backward()
    q64 = q.detach().double().requires_grad_()
    rope_float64(q64, k.detach(), cos, sin)[0].square().sum().backward()
    assert rel_l2(q.grad, q64.grad) < REL_TOL[torch.float32]
    assert k.grad is None or not k.grad.any()


def test_inference_mode_inputs(device):
    gen = torch.Generator().manual_seed(19)
    with torch.inference_mode():
        q, k = _qk(1, 2, 1, 3, 16, torch.float32, device, gen)
        q, k = q.detach(), k.detach()
        cos, sin = _cos_sin(1, 3, 16, torch.float32, device, gen)
        q_out, k_out = rope(q, k, cos, sin)
    ref_q, ref_k = rope_float64(q, k, cos, sin)
    assert rel_l2(q_out, ref_q) < REL_TOL[torch.float32] and rel_l2(k_out, ref_k) < REL_TOL[torch.float32]
    cos_t = cos.clone().requires_grad_()  # trainable table, inference-mode activations
    q_out, _ = rope(q, k, cos_t, sin)
    q_out.sum().backward()
    assert cos_t.grad is not None


@pytest.mark.parametrize("with_positions", [False, True])
def test_torch_compile_has_no_graph_break(with_positions, device):
    gen = torch.Generator().manual_seed(22)
    q, k = _qk(2, 4, 2, 5, 32, torch.float32, device, gen)
    cos, sin = _cos_sin(1, 5, 32, torch.float32, device, gen)
    position_ids = None
    if with_positions:
        cos, sin = cos[0], sin[0]
        position_ids = torch.tensor([[4, 3, 2, 1, 0]], device=device)
    cos.requires_grad_(with_positions)  # also traces the cos/sin gradient path

    def f(q, k, cos, sin):
        q_out, k_out = rope(q, k, cos, sin, position_ids)
        return q_out.square().sum() + (k_out * 3).sum()

    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, cos, sin)
    loss.backward()
    q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    cos2 = cos.detach().clone().requires_grad_(with_positions)
    ref = f(q2, k2, cos2, sin)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(q.grad, q2.grad)
    torch.testing.assert_close(k.grad, k2.grad)
    if with_positions:
        torch.testing.assert_close(cos.grad, cos2.grad)


def test_opcheck_custom_ops(device):
    gen = torch.Generator().manual_seed(23)
    q, k = _qk(2, 4, 2, 3, 16, torch.bfloat16, device, gen)
    q, k = q.detach(), k.detach()
    cos, sin = _cos_sin(1, 3, 16, torch.float32, device, gen)
    pos = torch.tensor([[2, 0, 1]], device=device)
    for args in ((q, k, cos, sin, None), (q, k, cos[0], sin[0], pos)):
        torch.library.opcheck(torch.ops.liger_gen.rope_fwd.default, args,
                              test_utils=("test_schema", "test_faketensor"))
    g = torch.randn(q.shape, generator=gen).to(device)
    torch.library.opcheck(torch.ops.liger_gen.rope_bwd.default, (g, g[:, :2], cos, sin, None, torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_heuristic_valid_for_every_shape(dtype):
    for limits in (DeviceLimits(), DeviceLimits.interpreter(), DeviceLimits(max_shared_memory_per_block=101376,
                                                                           max_threads_per_block=512)):
        for n_q, n_kv in ((1, 1), (2, 1), (14, 2), (32, 8), (64, 8), (128, 128), (5, 3)):
            for head_dim in (2, 8, 64, 80, 96, 128, 256, 1024):
                for rotary_dim in sorted({2, head_dim // 4 * 2, head_dim // 2, head_dim}):
                    if rotary_dim % 2 or rotary_dim < 2:
                        continue
                    dims = {"n_q_heads": n_q, "n_kv_heads": n_kv, "head_dim": head_dim, "rotary_dim": rotary_dim}
                    space = RoPESpace(dims, dtype, limits)
                    config = space.heuristic()
                    assert 2 * config.BLOCK_HALF >= rotary_dim and not space.violations(config), dims


def test_constraints_reject_bad_configs():
    dims = {"n_q_heads": 32, "n_kv_heads": 8, "head_dim": 128, "rotary_dim": 128}
    space = RoPESpace(dims, torch.bfloat16, DeviceLimits(max_threads_per_block=256))
    good = space.heuristic()
    assert (good.BLOCK_HALF, good.BLOCK_PASS) == (64, 0)
    assert any("threads" in p for p in space.violations(dataclasses.replace(good, num_warps_fwd=16)))
    assert any("BLOCK_HALF" in p for p in space.violations(dataclasses.replace(good, BLOCK_HALF=32)))
    assert any("BLOCK_PASS" in p for p in space.violations(dataclasses.replace(good, BLOCK_PASS=64)))
    assert any("BLOCK_H=64" in p for p in space.violations(dataclasses.replace(good, BLOCK_H_BWD=64)))
    assert any("per thread" in p for p in space.violations(
        dataclasses.replace(good, BLOCK_M_FWD=32, BLOCK_H_FWD=32, num_warps_fwd=1)))
    assert any("qk_launches_fwd" in p for p in space.violations(dataclasses.replace(good, qk_launches_fwd=3)))
    with pytest.raises(ValueError, match="even"):
        RoPESpace({**dims, "rotary_dim": 7}, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown fields"):
        RoPEConfig.from_dict({**good.to_dict(), "BLOCK_K": 2})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(32, 32), (48, 20)])
@pytest.mark.parametrize("changes", [
    {},  # heuristic: q and k in one launch, all heads in one tile
    {"qk_launches_fwd": 2, "qk_launches_bwd": 2, "BLOCK_M_FWD": 2, "BLOCK_M_BWD": 4},
    {"BLOCK_H_FWD": 1, "BLOCK_H_BWD": 2, "num_stages_fwd": 2, "num_stages_bwd": 3, "qk_launches_bwd": 2,
     "num_warps_fwd": 1, "num_warps_bwd": 1},  # the head loop runs several steps, with a tail (5 heads)
])
def test_every_template_branch_passes_the_tuners_gate(changes, head_dim, rotary_dim, dtype, device):
    """The tuner's float64 gate (NaN-poisoned outputs, per-dtype tolerance) on each structural variant."""
    dims = {"n_q_heads": 5, "n_kv_heads": 1, "head_dim": head_dim, "rotary_dim": rotary_dim}
    problem = RoPEProblem(dtype, dims, 12, device, seq_len=6, seed=5)
    config = dataclasses.replace(problem.space.heuristic(), **changes)
    assert not problem.space.violations(config)
    module = load_variant("rope", problem.template_params(config))
    assert problem.check(module, "fwd") is None
    assert problem.check(module, "bwd") is None
    problem.ref["q_out"] = problem.ref["q_out"] * 1.1  # and the gate can fail
    assert "q_out" in problem.check(module, "fwd")


@pytest.mark.parametrize("qk_launches", [1, 2])
def test_both_launch_variants_gather_positions(qk_launches, device):
    """qk_launches 1 and 2 with position_ids (the problem class tunes without them), forward and backward."""
    gen = torch.Generator().manual_seed(31)
    dims = {"n_q_heads": 3, "n_kv_heads": 2, "head_dim": 16, "rotary_dim": 16}
    space = RoPESpace(dims, torch.float32, DeviceLimits.interpreter())
    config = dataclasses.replace(space.heuristic(), qk_launches_fwd=qk_launches, qk_launches_bwd=qk_launches)
    module = load_variant("rope", config.to_dict())
    q, k = _qk(2, 3, 2, 4, 16, torch.float32, device, gen)
    q, k = q.detach(), k.detach()
    cos, sin = _cos_sin(1, 10, 16, torch.float32, device, gen, tables="random")
    cos, sin = cos[0], sin[0]
    pos = torch.randint(0, 10, (2, 4), generator=gen).to(device)
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    module.forward(q, k, cos, sin, pos, q_out, k_out)
    ref_q, ref_k = rope_float64(q, k, cos, sin, pos)
    assert rel_l2(q_out, ref_q) < 1e-6 and rel_l2(k_out, ref_k) < 1e-6
    dq, dk = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    module.backward(q, k, cos, sin, pos, dq, dk)  # grads of a rotation by θ, then by −θ: identity
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    ref = rope_float64(q64, k64, cos, sin, pos)
    torch.autograd.backward(ref, (q.double(), k.double()))
    assert rel_l2(dq, q64.grad) < 1e-6 and rel_l2(dk, k64.grad) < 1e-6


@INTERPRETER_ONLY
def test_tuner_produces_a_valid_entry():
    def cost_model(launch, params):
        """Deterministic 'time': favours two launches forward and BLOCK_M_FWD=2."""
        fwd = (params["qk_launches_fwd"] != 2) + abs(params["BLOCK_M_FWD"] - 2) + 0.1 * params["num_warps_fwd"]
        return 1.0 + fwd + 0.05 * params["num_warps_bwd"] + 0.1 * params["BLOCK_M_BWD"]

    dims = {"n_q_heads": 4, "n_kv_heads": 2, "head_dim": 16, "rotary_dim": 16}
    problem = RoPEProblem(torch.float32, dims, 8, "cpu", seq_len=4, seed=1)
    entry = Tuner(n_trials=5, timer=cost_model, seed=0, retime_rounds=1).tune(problem)
    config = RoPEConfig.from_dict(entry["config"])
    assert not problem.space.violations(config)
    assert entry["dims"] == dims and entry["rows"] == 8
    for phase in ("fwd", "bwd"):
        assert entry["timing_ms"][phase]["tuned"] <= entry["timing_ms"][phase]["heuristic"]
        assert any(r["status"] == "ok" for r in entry["trials"][phase])
    assert entry["bytes"]["fwd"] == 2 * (8 * 4 * 16 + 8 * 2 * 16) * 4 + 2 * 4 * 16 * 4


def test_tuning_problems_from_model_shape():
    model = dataclasses.replace(PRESETS["llama3-8b"], num_attention_heads=4, num_key_value_heads=1, head_dim=8)
    problems = tuning_problems(model, [16384, 24], torch.bfloat16, "cpu")
    assert [p.rows for p in problems] == [16384, 24]
    assert problems[0].dims == {"n_q_heads": 4, "n_kv_heads": 1, "head_dim": 8, "rotary_dim": 8}
    assert problems[0].buffers["q"].shape == (4, 4, 4096, 8)  # 16384 tokens as 4 sequences of 4096
    assert problems[0].buffers["q"].transpose(1, 2).is_contiguous()  # transformers' projection layout
    assert problems[1].buffers["k"].shape == (1, 1, 24, 8)  # up to 4096 tokens: one sequence
    assert problems[0].buffers["cos"].shape == (1, 4096, 8)
    assert problems[0].buffers["cos"].dtype == torch.bfloat16
    llama = tuning_problems(PRESETS["llama3-8b"], [8], torch.bfloat16, "cpu")[0]
    assert llama.dims == {"n_q_heads": 32, "n_kv_heads": 8, "head_dim": 128, "rotary_dim": 128}


def test_a_partial_rotary_model_is_tuned_at_the_dims_it_looks_up(monkeypatch, tmp_path):
    """GLM-4.5-Air rotates half of each head: the tuner's problems (and so ``tune --model`` and ``verify``) take the
    rotary_dim the patched model's RoPE looks its table up at, read from the preset and from a config.json (the
    factor at the top level, as transformers 4.x writes it, or in ``rope_parameters``, as 5.x does), where the
    family's transformers code reads the factor (Llama's does not: it rotates all of head_dim)."""
    import json

    from helpers import table_lookups
    from liger_gen.models import from_hf_config
    from liger_gen.training import build_model

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tuning_problems(PRESETS["glm4.5-air-4l"], [8], torch.bfloat16, "cpu")[0].dims == {
        "n_q_heads": 96, "n_kv_heads": 8, "head_dim": 128, "rotary_dim": 64}
    ids = torch.randint(0, 256, (1, 12))
    lookups = table_lookups(build_model("tiny-glm4.5-air", "cpu", torch.float32, 0), dict(input_ids=ids, labels=ids))
    looked_up = [dict(dims) for space, dims in lookups if space == "RoPESpace"]
    expected = RoPEProblem.shape(PRESETS["tiny-glm4.5-air"])
    assert looked_up and all(d == expected for d in looked_up), (looked_up, expected)
    assert expected["rotary_dim"] == expected["head_dim"] // 2
    fields = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=100)
    path = tmp_path / "config.json"
    # (0.35: int(5.6) = 5 dims, whose 3 angles transformers' tables hold twice: 6 wide)
    cases = ((dict(partial_rotary_factor=0.25), 4), (dict(rope_parameters=dict(partial_rotary_factor=0.5)), 8),
             (dict(partial_rotary_factor=0.35), 6), ({}, None), (dict(partial_rotary_factor=1.0), None),
             # a family whose code reads the factor, and one whose code rotates all of head_dim whatever it says
             (dict(model_type="glm4_moe", partial_rotary_factor=0.5), 8),
             (dict(model_type="llama", partial_rotary_factor=0.5), None),
             # transformers 5 reads rope_parameters first, then a legacy rope_scaling; 0.1 of 16: one dim, 2 wide
             (dict(partial_rotary_factor=0.5, rope_parameters=dict(partial_rotary_factor=0.25)), 4),
             (dict(rope_scaling=dict(rope_type="default", partial_rotary_factor=0.25)), 4),
             (dict(partial_rotary_factor=0.1), 2))
    for extra, rotary in cases:
        path.write_text(json.dumps({**fields, **extra}))
        shape = from_hf_config(path)
        assert shape.rotary_dim == rotary and RoPEProblem.shape(shape)["rotary_dim"] == (rotary or 16), extra
    for bad in (0, 1.5, True, "half", 0.05):  # (0.05 of 16: no dim to rotate)
        path.write_text(json.dumps({**fields, "partial_rotary_factor": bad}))
        with pytest.raises(ValueError, match="partial_rotary_factor"):
            from_hf_config(path)


@pytest.mark.gpu
def test_llama3_8b_shape_on_gpu():
    """Llama-3-8B: q 4x32x4096x128 and k 4x8x4096x128 bf16 (transposed projection views), cos/sin
    (1, 4096, 128) from transformers' LlamaRotaryEmbedding (bf16: it casts to the activations' dtype)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    torch.manual_seed(0)
    dev = torch.device("cuda")
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=8192, rope_theta=500000.0)
    q = torch.randn(4, 4096, 32, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(4, 4096, 8, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    position_ids = torch.arange(4096, device=dev)[None]
    cos, sin = LlamaRotaryEmbedding(cfg).to(dev)(q, position_ids)
    assert cos.shape == (1, 4096, 128) and cos.dtype == torch.bfloat16
    q_out, k_out = rope(q, k, cos, sin)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward((q_out, k_out), (dq_out, dk_out))
    tol = REL_TOL[torch.bfloat16]
    for b in range(4):  # float64 reference one sequence at a time
        q64 = q.detach()[b:b + 1].double().requires_grad_()
        k64 = k.detach()[b:b + 1].double().requires_grad_()
        ref_q, ref_k = rope_float64(q64, k64, cos, sin)
        torch.autograd.backward((ref_q, ref_k), (dq_out[b:b + 1].double(), dk_out[b:b + 1].double()))
        assert rel_l2(q_out[b:b + 1], ref_q) < tol and rel_l2(k_out[b:b + 1], ref_k) < tol
        assert rel_l2(q.grad[b:b + 1], q64.grad) < tol and rel_l2(k.grad[b:b + 1], k64.grad) < tol
    # transformers rounds each product to bf16 before the sum; the kernel's compiler may contract one product
    # and the sum into an FMA. Either way the difference is within one bf16 unit in the last place of the
    # larger product (which can be many units of a small result that cancels).
    hf_q, hf_k = apply_rotary_pos_emb(q.detach(), k.detach(), cos, sin)
    for x, ours, theirs in ((q, q_out, hf_q), (k, k_out, hf_k)):
        x = x.detach().float()
        c, s_ = cos.float()[:, None], sin.float()[:, None]
        scale = torch.maximum((x * c).abs(), (torch.cat((-x[..., 64:], x[..., :64]), -1) * s_).abs())
        ulp = 2.0 ** (torch.floor(torch.log2(scale.clamp_min(2.0 ** -100))) - 7)
        diff = (ours.detach().float() - theirs.float()).abs()
        print(f"rope vs transformers: {(diff == 0).float().mean().item():.4%} bit-equal, "
              f"max {(diff / ulp).max().item():.2f} ulp of the larger product")
        assert (diff <= 2 * ulp).all()
    # position_ids gathered in the kernel: same as pre-gathered tables
    table_cos, table_sin = LlamaRotaryEmbedding(cfg).to(dev)(q, torch.arange(8192, device=dev)[None])
    pos = torch.randint(0, 8192, (4, 4096), device=dev)
    with torch.no_grad():
        a = rope(q, k, table_cos[0], table_sin[0], pos)
        b = rope(q, k, table_cos[0][pos], table_sin[0][pos])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("interpret", CPU_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_half_tables_rotate_every_dim_with_one_angle_per_pair(dtype, interpret, monkeypatch):
    """half_tables=True: (…, r/2) tables (one angle per rotated pair, GPT-OSS's layout) equal the duplicated
    (…, r) tables of the same angles, forward and backward, on both CPU paths; a non-bool flag is an error."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = torch.Generator().manual_seed(91)
    q = torch.randn(2, 4, 9, 32, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(2, 2, 9, 32, generator=gen).to(dtype).requires_grad_()
    angles = torch.rand(2, 9, 16, generator=gen) * 6.0
    cos, sin = angles.cos(), angles.sin()
    got = rope(q, k, cos, sin, half_tables=True)
    want = rope(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    g = [torch.randn(t.shape, generator=gen).to(t.dtype) for t in got]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ga = torch.autograd.grad(got, (q, k), g)
    gb = torch.autograd.grad(want, (q, k), g)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    q64, k64 = q.detach().double(), k.detach().double()
    ref = rope_float64(q64, k64, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    assert rel_l2(got[0], ref[0]) < REL_TOL[dtype]
    with pytest.raises(TypeError, match="half_tables must be a bool"):
        rope(q, k, cos, sin, half_tables=1)
