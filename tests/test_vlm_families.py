"""Convergence of the vision-language families: a mini ``*ForConditionalGeneration`` (the text stack of the text
mini models, a vision tower of depth 1) trained with plain transformers and after ``liger_gen.apply_to`` from the
same weights on the same batches: byte tokens of ``tinyshakespeare.txt`` with one image per sample laid out as the
family's processor lays it out (placeholder tokens, pixel patches, grids / token types), the placeholders masked in
the labels as fine-tuning collators mask them.

The loss curve, the final parameters (vision tower included) and the held-out top-k log-probabilities must agree
within the float32 tolerances of ``test_families.py``, on the plain CPU path. What ``apply_to`` reports patched
is asserted: every norm of the family's classes (text and vision), the gated MLPs, RoPE, the fused residual adds,
and the fused loss (no logits in a training step with labels).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import liger_gen
from liger_gen.integrations.transformers import MODEL_FAMILIES, restore_rope
from liger_gen.nn import GLUMLP, LayerNorm, RMSNorm
from liger_gen.training import byte_tokens, make_batches
from mini_models import VLM_CONFIGS, mini_vlm, vlm_batch
from test_families import LOGPROB_ATOL, LOSS_RTOL, LR, PARAM_RTOL, TOP_K, _rel_l2

STEPS, BATCH, SEQ = 20, 2, 32
# gated MLPs apply_to swaps: the text stack's two, and Qwen 2.5-VL's SwiGLU vision block
MLPS = {"qwen2_5_vl": 3}

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the mini models' matrices are tiny, and two threads on a shared 2-core machine spin
    against each other (measured: this file in 5 s with one thread, 66 s with two while another test ran)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data():
    tokens = byte_tokens()
    texts = make_batches(tokens[: len(tokens) // 2], STEPS, BATCH, SEQ, seed=3)
    held_out = make_batches(tokens[len(tokens) // 2:], 1, 4, SEQ, seed=4)[0]
    return texts, held_out


def _batches(model_type: str, texts, held_out):
    generator = torch.Generator().manual_seed(5)
    train = [vlm_batch(model_type, ids, generator) for ids in texts]
    test = vlm_batch(model_type, held_out, generator)
    test.pop("labels")
    return train, test


def _train(model, batches) -> tuple[list[float], list]:
    torch.manual_seed(11)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, logits = [], []
    for batch in batches:
        out = model(**batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        logits.append(out.logits)
    return losses, logits


def _top_k(model, batch):
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits.float()
    model.train()
    return torch.log_softmax(logits, dim=-1).topk(TOP_K, dim=-1)


@pytest.mark.parametrize("model_type", sorted(VLM_CONFIGS))
def test_vlm_family_trains_like_transformers_on_the_plain_path(model_type, data, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    family = MODEL_FAMILIES[model_type]
    plain = mini_vlm(model_type)
    if plain is None:
        pytest.skip(f"this transformers release has no {model_type}")
    patched = mini_vlm(model_type)
    batches, held_out = _batches(model_type, *data)
    norms = sum(type(m).__name__ in family.norm_class_names for m in plain.modules())
    try:
        plain_losses, _ = _train(plain, batches)
        plain_top = _top_k(plain, held_out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            liger_gen.apply_to(patched)
        report = patched.liger_gen_report
        patched_losses, patched_logits = _train(patched, batches)
        patched_top = _top_k(patched, held_out)
    finally:
        restore_rope()
    # every norm of the family's classes, the text stack's and the vision tower's, is liger-gen's now
    assert report.norms == norms and not any(type(m).__name__ in family.norm_class_names
                                             and not isinstance(m, (RMSNorm, LayerNorm))
                                             for m in patched.modules()), report.summary()
    vision = [m for name, m in patched.named_modules() if "visual" in name or "vision_tower" in name]
    assert any(isinstance(m, (RMSNorm, LayerNorm)) for m in vision), report.summary()
    assert report.mlps == MLPS.get(model_type, 2) == sum(isinstance(m, GLUMLP) for m in patched.modules())
    assert report.rope and report.loss, report.summary()
    layers = sum(type(m).__name__.endswith("DecoderLayer") for m in patched.modules())
    assert report.fused_adds == layers > 0, report.summary()
    assert all(logits is None for logits in patched_logits)  # the fused loss: no logits in training
    assert all(math.isfinite(x) for x in plain_losses + patched_losses)
    rel = [abs(a - b) / abs(b) for a, b in zip(patched_losses, plain_losses)]
    assert max(rel) <= LOSS_RTOL, (model_type, max(rel), rel)
    assert plain_losses[-1] < plain_losses[0]
    params = dict(plain.named_parameters())
    for name, p in patched.named_parameters():
        if name.endswith("k_proj.bias"):  # its exact gradient is 0 (see test_families.py)
            continue
        if name.endswith("embed_tokens.weight"):  # rows of rare tokens: AdamW-normalised roundoff (test_families.py)
            a, b = p.detach().double(), params[name].detach().double()
            rows = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
            assert (rows > PARAM_RTOL).sum().item() <= 2, (model_type, name, rows.topk(3).values.tolist())
            continue
        assert _rel_l2(p.detach(), params[name].detach()) <= PARAM_RTOL, (model_type, name,
                                                                           _rel_l2(p, params[name]))
    close = ((patched_top.values - plain_top.values).abs() <= LOGPROB_ATOL).all(-1)
    close &= (patched_top.indices == plain_top.indices).all(-1)
    assert close.float().mean().item() >= 1 - 2 / close.numel(), (model_type, (~close).sum().item())


@pytest.mark.parametrize("model_type", sorted(VLM_CONFIGS))
def test_routed_rotary_function_equals_transformers_own_on_multimodal_tables(model_type, monkeypatch):
    """The text stack's routed ``apply_rotary_pos_emb`` returns what transformers' returns, element by element, for
    the family's own tables: Qwen's M-RoPE tables, assembled per section (interleaved in Qwen 3-VL) by the text
    rotary embedding from (3, batch, seq) temporal/height/width positions that differ, as an image's do."""
    import importlib

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    family = MODEL_FAMILIES[model_type]
    model = mini_vlm(model_type)
    if model is None:
        pytest.skip(f"this transformers release has no {model_type}")
    modeling = importlib.import_module(family.modeling_module)
    original = modeling.apply_rotary_pos_emb
    rotary = next(m for name, m in model.named_modules() if name.endswith("language_model.rotary_emb"))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 12, 8, generator=gen)
    if model_type.startswith("qwen"):
        positions = torch.stack([torch.arange(12).expand(2, -1), torch.arange(12).flip(0).expand(2, -1) * 3,
                                 (torch.arange(12) % 4).expand(2, -1)])  # (3, batch, seq)
        cos, sin = rotary(x, positions)
    else:
        layer_type = model.config.get_text_config().layer_types[0]
        cos, sin = rotary(x, torch.arange(12)[None].expand(2, -1), layer_type=layer_type)
    q, k = torch.randn(2, 4, 12, 16, generator=gen), torch.randn(2, 2, 12, 16, generator=gen)
    try:
        liger_gen.apply_to(model)
        routed = modeling.apply_rotary_pos_emb
        assert routed is not original and model.liger_gen_report.rope
        for got, want in zip(routed(q, k, cos, sin), original(q, k, cos, sin)):
            assert got.dtype == want.dtype and got.shape == want.shape, model_type
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    finally:
        restore_rope()
