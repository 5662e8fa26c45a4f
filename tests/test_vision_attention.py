"""The vision towers' attention over images and windows in one variable-length call
(``liger_gen.integrations.transformers.vision_attention``), for every family whose table entry names it.

On the CPU the function ``apply_to`` installs runs SDPA once per piece, as transformers' own ``sdpa`` path does: the
loss and every gradient are bitwise transformers'. The one-call path is checked on the CPU with a float64 kernel in
``varlen_attn``'s place that asserts the layout it is given (total × heads × head_dim, int32 boundaries, a bound on
the longest piece), and on a GPU with torch's FlashAttention kernel in bf16. The mini Qwen2.5-VL gets a windowed
block of 4-patch windows before its full-attention block, so both kinds of pieces are cut.
"""

from __future__ import annotations

import io
import pickle
import warnings

import pytest
import torch

import liger_gen
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.integrations.transformers import MODEL_FAMILIES, vision_attention as va
from mini_models import VLM_CONFIGS, mini_vlm, vlm_batch

FAMILIES = sorted(t for t in VLM_CONFIGS if t in MODEL_FAMILIES and MODEL_FAMILIES[t].vision_attention)
# a windowed block (window_size 8: one merged 2 × 2 unit a window) before the full-attention one
VISION = {"qwen2_5_vl": dict(depth=2, fullatt_block_indexes=[1], window_size=8)}
# only the vision attention: every other replacement off, so the rest of the model is transformers' own
ONLY = dict(rms_norm=False, swiglu=False, rope=False, fused_linear_cross_entropy=False, fused_add_rms_norm=False)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _models(model_type: str, dtype=torch.float32, device="cpu"):
    plain = mini_vlm(model_type, dtype=dtype, device=device, vision_attention="sdpa", **VISION.get(model_type, {}))
    if plain is None:
        pytest.skip(f"this transformers release has no {model_type}")
    patched = mini_vlm(model_type, dtype=dtype, device=device, vision_attention="sdpa", **VISION.get(model_type, {}))
    return plain, patched


def _batch(model_type: str, device="cpu", dtype=torch.float32) -> dict:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 250, (2, 32), generator=generator)
    batch = vlm_batch(model_type, ids, generator)
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in batch.items()}


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _tower(model):
    return model.model.visual


def _attention(model) -> list:
    return [m for m in _tower(model).modules() if type(m).__name__.endswith("Attention")]


def _vision_blocks(model) -> int:
    return len(_attention(model))


def _routed(model) -> list[str]:
    """The attention implementation each vision attention module reads from its config."""
    return [m.config._attn_implementation for m in _attention(model)]


def _count_sdpa(monkeypatch) -> list:
    """Counts transformers' ``sdpa_attention_forward`` calls, through its attention registry or its module (the
    text stack runs eager: every call is the vision tower's), with the length of each call's sequence."""
    import transformers.integrations.sdpa_attention as sdpa
    from transformers.modeling_utils import AttentionInterface

    calls, own = [], sdpa.sdpa_attention_forward

    def counted(*args, **kwargs):
        calls.append(args[1].shape[2])
        return own(*args, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", counted)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", counted)
    return calls


def _float64_varlen(calls: list):
    """A float64 stand-in for ``varlen_attn``: softmax(q kᵀ · scale) v per piece and head, asserting the layout."""

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):
        assert q.dim() == k.dim() == v.dim() == 3 and q.shape == k.shape == v.shape, (q.shape, k.shape, v.shape)
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k), (cu_q, cu_k)
        bounds = cu_q.tolist()
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        assert bounds[0] == 0 and bounds[-1] == q.shape[0] and max(lengths) <= max_q == max_k, (bounds, max_q)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        pieces = []
        for a, b in zip(bounds, bounds[1:]):
            scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].double()) * scale
            pieces.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[a:b].double()))
        calls.append(len(lengths))
        return torch.cat(pieces).to(q.dtype)

    return kernel


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_cpu_path_is_transformers_sdpa_bitwise(model_type, monkeypatch):
    """On the CPU the installed function cuts the pieces and runs SDPA on each, as transformers' sdpa path does:
    the same number of calls, the same loss and gradients, bit for bit."""
    plain, patched = _models(model_type)
    batch = _batch(model_type)
    sdpa_calls = _count_sdpa(monkeypatch)
    plain_loss, plain_grads = _loss_and_grads(plain, batch)
    plain_calls = list(sdpa_calls)
    liger_gen.apply_to(patched, **ONLY)
    assert _routed(patched) == [va.VARLEN_ATTENTION] * _vision_blocks(patched)
    assert _tower(patched).config._attn_implementation == "sdpa"  # the model's own config is unchanged
    assert patched.liger_gen_report.vision_attention == _vision_blocks(patched) > 0, patched.liger_gen_report
    del sdpa_calls[:]
    loss, grads = _loss_and_grads(patched, batch)
    assert sdpa_calls == plain_calls and len(plain_calls) > _vision_blocks(plain), (sdpa_calls, plain_calls)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


@pytest.mark.parametrize("model_type", FAMILIES)
def test_one_variable_length_call_per_block_equals_transformers(model_type, monkeypatch):
    """With the one-call path taken (a float64 ``varlen_attn`` stand-in), each vision block makes one call over all
    its pieces and no SDPA call; the loss and every gradient match transformers' sdpa path to float32 roundoff."""
    plain, patched = _models(model_type)
    batch = _batch(model_type)
    plain_loss, plain_grads = _loss_and_grads(plain, batch)
    liger_gen.apply_to(patched, **ONLY)
    calls = []
    monkeypatch.setattr(va, "varlen_kernel", lambda: (_float64_varlen(calls), True))
    monkeypatch.setattr(va, "_use_varlen", lambda *args: True)
    sdpa_calls = _count_sdpa(monkeypatch)
    loss, grads = _loss_and_grads(patched, batch)
    assert len(calls) == _vision_blocks(patched) and not sdpa_calls, (calls, sdpa_calls)
    assert sum(calls) > len(calls)  # several pieces a call
    tol = REL_TOL[torch.float32]
    assert abs(loss.item() - plain_loss.item()) <= tol * abs(plain_loss.item())
    vision = [n for n in grads if "visual" in n]
    assert vision and grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        assert rel_l2(grad, plain_grads[name]) <= tol, (name, rel_l2(grad, plain_grads[name]))


def test_the_report_lists_what_is_kept_and_refused(monkeypatch):
    """``vision_attention=False`` and an eager tower leave the attention as it is (the eager one listed); a release
    whose vision attention passes cu_seqlens to flash_attention_2 alone, or a torch without ``varlen_attn``, leaves
    it listed with why, and ``strict`` refuses it with the model unchanged; a second call keeps it routed."""
    model_type = "qwen2_5_vl"
    off = _models(model_type)[1]
    liger_gen.apply_to(off, vision_attention=False)
    assert set(_routed(off)) == {"sdpa"} and off.liger_gen_report.vision_attention == 0
    assert "vision attention" not in off.liger_gen_report.summary()

    eager = mini_vlm(model_type)
    liger_gen.apply_to(eager, strict=True)
    assert set(_routed(eager)) == {"eager"}
    assert any("vision attention: 'eager' is kept" in line for line in eager.liger_gen_report.left)

    modeling = __import__(MODEL_FAMILIES[model_type].modeling_module, fromlist=["_"])
    for patch, words in ((lambda m: m.delattr(modeling, "is_flash_attention_requested"), "flash_attention_2"),
                         (lambda m: m.setattr(va, "varlen_kernel", lambda: (None, False)), "torch 2.10")):
        with monkeypatch.context() as m:
            patch(m)
            model = _models(model_type)[1]
            with pytest.raises(ValueError, match=words):
                liger_gen.apply_to(model, strict=True)
            assert set(_routed(model)) == {"sdpa"}
            assert not hasattr(model, "liger_gen_report")
            liger_gen.apply_to(model)
            assert set(_routed(model)) == {"sdpa"}
            assert any(words in line for line in model.liger_gen_report.left), model.liger_gen_report.left

    twice = _models(model_type)[1]
    liger_gen.apply_to(twice, **ONLY)
    liger_gen.apply_to(twice, **ONLY)
    assert set(_routed(twice)) == {va.VARLEN_ATTENTION}
    assert twice.liger_gen_report.vision_attention == _vision_blocks(twice)


@pytest.mark.parametrize("part", ["model", "tower"])
def test_a_pickled_model_or_tower_registers_the_function_where_it_is_loaded(part, monkeypatch):
    """A routed attention module's config view names the function; a process that loads the model, or its vision
    tower alone, without having patched one gets it registered by the view's unpickling: the loaded copy runs and
    equals the original."""
    from transformers.modeling_utils import AttentionInterface

    plain, patched = _models("qwen2_5_vl")
    liger_gen.apply_to(patched, **ONLY)
    batch = _batch("qwen2_5_vl")
    buffer = io.BytesIO()
    torch.save(patched if part == "model" else _tower(patched), buffer)
    monkeypatch.delitem(AttentionInterface._global_mapping, va.VARLEN_ATTENTION)
    buffer.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = torch.load(buffer, weights_only=False)
    assert va.VARLEN_ATTENTION in AttentionInterface._global_mapping
    if part == "model":
        assert torch.equal(_loss_and_grads(loaded, batch)[0], _loss_and_grads(plain, batch)[0])
        assert pickle.loads(pickle.dumps(patched.liger_gen_report)).vision_attention == _vision_blocks(patched)
    else:
        inputs = (batch["pixel_values"], batch["image_grid_thw"])
        assert torch.equal(loaded(*inputs).pooler_output, _tower(plain)(*inputs).pooler_output)


def test_the_models_config_stays_transformers_own(monkeypatch):
    """Routing changes no config: transformers' own checks accept the patched model's config (switching the text
    stack's attention, building a model from it), a model sharing that config object stays on sdpa, and a tower
    switched to eager afterwards runs eager, and the variable-length path again once switched back to sdpa (the
    report counts the routed layers throughout, a second ``apply_to`` while eager too)."""
    import copy

    import transformers

    config_name, model_name, settings = VLM_CONFIGS["qwen2_5_vl"]
    config = getattr(transformers, config_name)(**settings)
    config._attn_implementation = "sdpa"
    first, second = (getattr(transformers, model_name)(config) for _ in range(2))
    liger_gen.apply_to(first)
    assert set(_routed(first)) == {va.VARLEN_ATTENTION} and set(_routed(second)) == {"sdpa"}
    assert first.config is second.config and first.config.vision_config._attn_implementation == "sdpa"
    rebuilt = getattr(transformers, model_name)._from_config(first.config)
    assert set(_routed(rebuilt)) == {"sdpa"}
    first.set_attn_implementation({"text_config": "eager"})
    assert set(_routed(first)) == {va.VARLEN_ATTENTION}
    twin = copy.deepcopy(first)
    assert set(_routed(twin)) == {va.VARLEN_ATTENTION} and _attention(twin)[0].config.config is _tower(twin).config
    first.set_attn_implementation({"vision_config": "eager"})
    assert set(_routed(first)) == {"eager"} and set(_routed(twin)) == {va.VARLEN_ATTENTION}
    sdpa_calls = _count_sdpa(monkeypatch)
    batch = _batch("qwen2_5_vl")
    first(**batch)
    assert not sdpa_calls  # the text stack and the tower run eager now
    liger_gen.apply_to(first)
    blocks = _vision_blocks(first)
    assert first.liger_gen_report.vision_attention == blocks == va.count(first)
    assert not any("vision attention" in line for line in first.liger_gen_report.left)
    first.set_attn_implementation({"vision_config": "sdpa"})
    assert set(_routed(first)) == {va.VARLEN_ATTENTION}


def test_bad_boundaries_raise_naming_them():
    q = torch.randn(1, 2, 10, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        va.varlen_attention_forward(module, q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu.flip(0))
    with pytest.raises(ValueError, match=r"ends at 9 but the sequence has 10 positions"):
        va.varlen_attention_forward(module, q, q, q, None, cu_seq_lens_q=torch.tensor([0, 4, 9]),
                                    cu_seq_lens_k=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", FAMILIES)
def test_one_flash_call_per_block_matches_transformers_in_bfloat16_on_the_gpu(model_type, monkeypatch):
    """On a GPU in bf16 the one-call path runs torch's FlashAttention variable-length kernel, once a vision block,
    and the loss and the vision tower's gradients agree with transformers' sdpa path within bf16's precision; in
    float32 it runs transformers' own path."""
    if va.varlen_kernel()[0] is None:
        pytest.skip("torch.nn.attention.varlen needs torch 2.10 or later")
    plain, patched = _models(model_type, torch.bfloat16, "cuda")
    batch = _batch(model_type, "cuda", torch.bfloat16)
    plain_loss, plain_grads = _loss_and_grads(plain, batch)
    liger_gen.apply_to(patched, **ONLY)
    calls, run = [], va._run_varlen
    monkeypatch.setattr(va, "_run_varlen", lambda *args: calls.append(1) or run(*args))
    loss, grads = _loss_and_grads(patched, batch)
    assert len(calls) == _vision_blocks(patched), calls
    tol = REL_TOL[torch.bfloat16]
    assert abs(loss.item() - plain_loss.item()) <= tol * abs(plain_loss.item())
    vision = [n for n in grads if "visual" in n]
    assert vision
    for name in vision:
        assert rel_l2(grads[name], plain_grads[name]) <= tol, (name, rel_l2(grads[name], plain_grads[name]))
    del calls[:]
    fp32 = _models(model_type, torch.float32, "cuda")[1]
    liger_gen.apply_to(fp32, **ONLY)
    _loss_and_grads(fp32, _batch(model_type, "cuda"))
    assert not calls


def test_the_config_view_reads_and_writes_the_towers_config():
    """A ``VarlenVisionConfig`` is its tower's config for every attribute and protocol but the attention
    implementation, which follows the config's (liger-gen's function while it says sdpa)."""
    import copy

    config = _tower(_models("qwen2_5_vl")[1]).config
    view = va.VarlenVisionConfig(config)
    assert view.hidden_size == config.hidden_size and view.to_dict() == config.to_dict()
    assert view._attn_implementation == va.VARLEN_ATTENTION and config._attn_implementation == "sdpa"
    view.layer_marker = 3
    assert config.layer_marker == 3 and "layer_marker" in view and "layer_marker" in dir(view)
    del view.layer_marker
    assert not hasattr(config, "layer_marker") and not hasattr(view, "layer_marker")
    assert list(view) == list(config) and view == config and view == va.VarlenVisionConfig(config)
    with pytest.raises(AttributeError, match="not reassigned"):
        view.config = config
    config._attn_implementation = "eager"
    assert view._attn_implementation == "eager"
    copied = copy.deepcopy(view)
    assert copied.config is not config and copied.config.hidden_size == config.hidden_size
    assert pickle.loads(pickle.dumps(view))._attn_implementation == "eager"


def test_the_one_call_path_calls_torchs_varlen_attn_as_it_takes_them(monkeypatch):
    """torch's own ``varlen_attn`` (its fake kernels, on the meta device: no GPU here) takes the one-call path's
    arguments, forward and backward, and gives transformers' output layout (batch, seq, heads, head_dim)."""
    if va.varlen_kernel()[0] is None:
        pytest.skip("torch.nn.attention.varlen needs torch 2.10 or later")
    monkeypatch.setattr(va, "_use_varlen", lambda *args: True)
    heads, seq, head_dim = 4, 40, 80
    q, k, v = (torch.empty(1, heads, seq, head_dim, device="meta", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    cu = torch.tensor([0, 16, 40], dtype=torch.int32).to("meta")
    out, weights = va.varlen_attention_forward(torch.nn.Module(), q, k, v, None, scaling=head_dim ** -0.5,
                                               cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=24, max_length_k=24)
    assert weights is None and out.shape == (1, seq, heads, head_dim) and out.dtype == torch.bfloat16
    out.sum().backward()
    assert all(t.grad.shape == t.shape for t in (q, k, v))
