"""Convergence of the vision-language families: a mini ``*ForConditionalGeneration`` (the text stack of the text
mini models, a vision tower of depth 1) trained with plain transformers and after ``liger_gen.apply_to`` from the
same weights on the same batches: byte tokens of ``tinyshakespeare.txt`` with one image per sample laid out as the
family's processor lays it out (placeholder tokens, pixel patches, grids / token types / tiles), the placeholders
masked in the labels as fine-tuning collators mask them. The wrappers (Llava, PaliGemma, InternVL, SmolVLM) hold a
language model of a text family (their mini config names it: llama, gemma2, qwen2, llama), patched as that family.

The loss curve, the final parameters (vision tower included) and the held-out top-k log-probabilities must agree
within the float32 tolerances of ``test_families.py``, on the plain CPU path. What ``apply_to`` reports patched
is asserted: every norm of the family's classes (text and vision), the gated MLPs, RoPE, the fused residual adds,
the fused loss (no logits in a training step with labels), and the projector a family leaves as it is, untouched
and listed in the report.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch

import liger_gen
from liger_gen.integrations.transformers import family_of, restore_rope
from liger_gen.nn import GLUMLP, LayerNorm, RMSNorm
from liger_gen.training import byte_tokens, make_batches
from mini_models import VLM_CONFIGS, mini_vlm, vlm_batch
from test_families import LOGPROB_ATOL, LOSS_RTOL, LR, PARAM_RTOL, TOP_K, _rel_l2

STEPS, BATCH, SEQ = 20, 2, 32
# gated MLPs apply_to swaps: the text stack's two, and Qwen 2.5-VL's and GLM-4V's SwiGLU vision block
MLPS = {"qwen2_5_vl": 3, "glm4v": 3}

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


def _part(model, path: str):
    """``model.model.<path>`` (path dotted: "visual.merger")."""
    return functools.reduce(getattr, path.split("."), model.model)


def _outside_kept(model, family) -> list:
    """The modules of ``model`` outside the parts its family leaves as they are (a projector, a patch merger)."""
    kept = {id(m) for part, _ in family.kept for m in _part(model, part).modules()}
    return [m for m in model.modules() if id(m) not in kept]


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
    plain = mini_vlm(model_type)
    if plain is None:
        pytest.skip(f"this transformers release has no {model_type}")
    family = family_of(plain)  # a wrapper's (Llava, ...) composed with the family of its text_config
    patched = mini_vlm(model_type)
    batches, held_out = _batches(model_type, *data)
    norms = sum(type(m).__name__ in family.norm_class_names for m in _outside_kept(plain, family))
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
                                             for m in _outside_kept(patched, family)), report.summary()
    vision = [m for name, m in patched.named_modules()
              if any(part in name for part in ("visual", "vision_tower", "vision_model"))]
    assert any(isinstance(m, (RMSNorm, LayerNorm)) for m in vision), report.summary()
    # a projector is left as it is, whole, where the family says so, and listed in the report with why
    for part, _ in family.kept:
        kept = _part(patched, part)
        assert not any(isinstance(m, (RMSNorm, LayerNorm, GLUMLP)) for m in kept.modules()), (model_type, part)
        name = part if type(kept).__module__.startswith("torch.") else type(kept).__name__
        assert any(line.startswith(name + " ×1 (") for line in report.left), report.summary()
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
    the family's own tables: Qwen's and GLM-4V's M-RoPE tables, assembled per section (interleaved in Qwen 3-VL;
    each angle twice in a row, for interleaved pairs of the partial rotary dims, in GLM-4V) by the text rotary
    embedding from (3, batch, seq) temporal/height/width positions that differ, as an image's do."""
    import importlib
    import inspect

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = mini_vlm(model_type)
    if model is None:
        pytest.skip(f"this transformers release has no {model_type}")
    family = family_of(model)  # a wrapper's: its text family's modeling module and RoPE
    modeling = importlib.import_module(family.modeling_module)
    original = modeling.apply_rotary_pos_emb
    language_model = family.language_model or "language_model"
    rotary = next(m for name, m in model.named_modules() if name.endswith(f"{language_model}.rotary_emb"))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 12, 8, generator=gen)
    if model_type.startswith("qwen") or model_type == "glm4v":
        positions = torch.stack([torch.arange(12).expand(2, -1), torch.arange(12).flip(0).expand(2, -1) * 3,
                                 (torch.arange(12) % 4).expand(2, -1)])  # (3, batch, seq)
        cos, sin = rotary(x, positions)
    elif "layer_type" in inspect.signature(rotary.forward).parameters:  # Gemma 3: tables per layer type
        layer_type = model.config.get_text_config().layer_types[0]
        cos, sin = rotary(x, torch.arange(12)[None].expand(2, -1), layer_type=layer_type)
    else:
        cos, sin = rotary(x, torch.arange(12)[None].expand(2, -1))
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


def test_a_wrapper_takes_the_family_of_its_text_config():
    """Llava, PaliGemma, InternVL and SmolVLM hold another family's language model: ``family_of`` combines the
    wrapper's entry with the family of ``config.text_config.model_type`` (its norms, RoPE and modeling module), and
    names the supported text families when that one is not."""
    import types

    import transformers

    from liger_gen.integrations.transformers import MODEL_FAMILIES

    for text_type in ("mistral", "qwen2", "gemma2"):
        config = transformers.LlavaConfig(text_config={"model_type": text_type})
        family = family_of(types.SimpleNamespace(config=config))
        text = MODEL_FAMILIES[text_type]
        assert (family.model_type, family.text_family, family.modeling_module) == ("llava", text_type,
                                                                                   text.modeling_module)
        assert family.causal_lm_classes == ("LlavaForConditionalGeneration",) and family.logits is None
        assert family.norm_kind(text.norm_class_names[0]) == text.norm and family.norm_kind("LayerNorm") == "llama"
    for text_type in ("gpt2", "qwen2_vl", "llava"):
        config = types.SimpleNamespace(model_type="llava", text_config=types.SimpleNamespace(model_type=text_type))
        with pytest.raises(ValueError, match=f"llava's language model has config.text_config.model_type "
                                             f"'{text_type}', which is not a supported text family; "
                                             f"supported: .*llama"):
            family_of(types.SimpleNamespace(config=config))


def test_a_patched_wrapper_reports_pickles_and_lists_its_ops(tmp_path, monkeypatch):
    """The projector stays by design: listed in the report, not refused by ``strict``; the base model (no LM head)
    is patched without a loss; a patched model saved and loaded keeps its fused loss and its report's text family."""
    import io

    from liger_gen.integrations.transformers import patched_ops

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = mini_vlm("llava")
    if model is None:
        pytest.skip("this transformers release has no llava")
    try:
        liger_gen.apply_to(model, swiglu=False, strict=True)  # the CLIP MLPs are MLPs: swiglu=False leaves them
        report = model.liger_gen_report
        assert report.left == ["LlavaMultiModalProjector ×1 (the projector: linear layers and an activation, no "
                               "liger-gen op)"], report.summary()
        assert "apply_to(llava, text model llama)" in report.summary() and report.loss and report.rope
        with pytest.raises(ValueError, match=r"CLIPMLP ×1 \(not gated"):
            liger_gen.apply_to(mini_vlm("llava"), strict=True)
        base = liger_gen.apply_to(mini_vlm("llava").model)
        assert not base.liger_gen_report.loss and base.liger_gen_report.norms == report.norms
        assert patched_ops(model) == ["rms_norm", "fused_add_rms_norm", "layer_norm", "rope",
                                      "fused_linear_cross_entropy"]
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert loaded.liger_gen_report.text_family == "llama" and loaded.liger_gen_report.rope
        batch = vlm_batch("llava", torch.randint(3, 250, (2, 32), generator=torch.Generator().manual_seed(1)),
                          torch.Generator().manual_seed(2))
        want, got = model(**batch), loaded(**batch)
        assert got.logits is None and torch.equal(got.loss, want.loss)
    finally:
        restore_rope()
