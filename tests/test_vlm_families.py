"""Convergence of the vision-language families: a mini ``*ForConditionalGeneration`` (the text stack of the text
mini models, a vision tower of depth 1) trained with plain transformers and after ``liger_gen.apply_to`` from the
same weights on the same batches: byte tokens of ``tinyshakespeare.txt`` with one image per sample laid out as the
family's processor lays it out (placeholder tokens, pixel patches, grids / token types / tiles), the placeholders
masked in the labels as fine-tuning collators mask them; the MoE text stacks ask for router logits, so the
load-balancing loss is in the loss as their forward adds it. Llama 4 holds its language model as a causal LM (no
base model): its fused loss takes that causal LM's hidden states. The wrappers (Llava, PaliGemma, InternVL, SmolVLM)
hold a language model of a text family (their mini config names it: llama, gemma2, qwen2, llama), patched as that
family.

The loss curve, the final parameters (vision tower included) and the held-out top-k log-probabilities must agree
within the float32 tolerances of ``test_families.py``, on the plain CPU path. What ``apply_to`` reports patched
is asserted: every norm of the family's classes (text and vision), the gated MLPs, RoPE (the vision tower's too,
where the family routes it: one call of liger-gen's ``rope`` per vision attention forward), the fused residual
adds, the fused loss (no logits in a training step with labels), and the projector a family leaves as it is,
untouched and listed in the report.
"""

from __future__ import annotations

import functools
import importlib
import math
import warnings

import pytest
import torch

import liger_gen
import liger_gen.ops.rope as rope_op
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.integrations.transformers import MODEL_FAMILIES, family_of, restore_rope
from liger_gen.nn import GLUMLP, LayerNorm, RMSNorm
from liger_gen.ops.rope import rope_float64
from liger_gen.training import byte_tokens, make_batches
from helpers import all_grads, assert_bf16_training_matches
from mini_models import VLM_CONFIGS, mini_vlm, vlm_batch
from test_families import (LOGPROB_ATOL, LOSS_RTOL, LR, NOISE_NORMALISED, PARAM_RTOL, TOP_K, _rel_l2,
                           assert_first_step_grads_match, first_step_grads)

STEPS, BATCH, SEQ = 20, 2, 32
# gated MLPs apply_to swaps: the text stack's two, and Qwen 2.5-VL's, GLM-4V's and Gemma 4's gated vision block; an MoE text
# stack's dense layer and shared experts (Qwen 3-VL-MoE: one dense layer, no shared experts; Qwen 3.5-MoE: a shared
# expert a layer; GLM-4V-MoE: one dense layer, one shared expert and the vision block)
MLPS = {"qwen2_5_vl": 3, "glm4v": 3, "qwen3_vl_moe": 1, "glm4v_moe": 3, "gemma4": 3}
# fused experts modules given liger-gen's forward (the MoE text stacks)
EXPERTS = {"qwen3_vl_moe": 1, "qwen3_5_moe": 2, "glm4v_moe": 1, "llama4": 1}

# the families whose vision tower's 2-D RoPE (``apply_rotary_pos_emb_vision``) apply_to routes to liger-gen
VISION_ROPE = sorted(t for t in VLM_CONFIGS if t in MODEL_FAMILIES and MODEL_FAMILIES[t].vision_rope)
VISION_PARTS = ("visual", "vision_tower", "vision_model")  # the vision tower's attribute, in module names

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
    """``model.model.<path>`` (path dotted: "visual.merger"), or ``model.<path>`` for a model without a base model
    (Llama 4's); None where the mini model has no such part (Gemma 4's audio projector without an audio tower)."""
    return functools.reduce(lambda m, name: getattr(m, name, None), path.split("."), getattr(model, "model", model))


def _outside_kept(model, family) -> list:
    """The modules of ``model`` outside the parts its family leaves as they are (a projector, a patch merger)."""
    kept = {id(m) for part, _ in family.kept if _part(model, part) is not None for m in _part(model, part).modules()}
    return [m for m in model.modules() if id(m) not in kept]


def _train(model, batches, grads: dict | None = None, every: bool = False) -> tuple[list[float], list]:
    """The losses and logits of an AdamW step per batch; ``grads`` receives ``first_step_grads`` of the first (with
    ``every``, every parameter's first-step gradient)."""
    torch.manual_seed(11)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, logits = [], []
    for batch in batches:
        out = model(**batch)
        out.loss.backward()
        if grads is not None and not losses:
            grads.update(all_grads(model) if every else first_step_grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        logits.append(out.logits)
    return losses, logits


def _count_vision_rope(model, monkeypatch) -> dict[str, int]:
    """Counts, while the model runs, its vision attention forwards ("attention") and the calls of liger-gen's
    ``rope`` op made inside one ("rope"): every call of the op goes through ``rope_op.rope_planned``."""
    counts = {"attention": 0, "rope": 0}
    running = []
    planned = rope_op.rope_planned

    def counted(*args, **kwargs):
        counts["rope"] += bool(running)
        return planned(*args, **kwargs)

    def enter(*_):
        counts["attention"] += 1
        running.append(True)

    def leave(*_):  # returns None: the module's output stays its own
        running.pop()

    monkeypatch.setattr(rope_op, "rope_planned", counted)
    for name, module in model.named_modules():
        if any(part in name for part in VISION_PARTS) and type(module).__name__.endswith("Attention"):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)
    return counts


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
    plain_grads, patched_grads = {}, {}
    try:
        plain_losses, _ = _train(plain, batches, plain_grads)
        plain_top = _top_k(plain, held_out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            liger_gen.apply_to(patched)
        report = patched.liger_gen_report
        vision_rope = _count_vision_rope(patched, monkeypatch)
        patched_losses, patched_logits = _train(patched, batches, patched_grads)
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
        if kept is None:
            continue
        assert not any(isinstance(m, (RMSNorm, LayerNorm, GLUMLP)) for m in kept.modules()), (model_type, part)
        name = part if type(kept).__module__.startswith("torch.") else type(kept).__name__
        assert any(line.startswith(name + " ×1 (") for line in report.left), report.summary()
    assert report.mlps == MLPS.get(model_type, 2) == sum(isinstance(m, GLUMLP) for m in patched.modules())
    assert report.experts == EXPERTS.get(model_type, 0), report.summary()
    assert report.rope and report.loss, report.summary()
    if family.vision_rope:  # the vision tower's RoPE runs liger-gen's op, once per vision attention forward
        assert vision_rope["attention"] > 0 and vision_rope["rope"] == vision_rope["attention"], (model_type,
                                                                                                 vision_rope)
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
        if name.endswith(NOISE_NORMALISED):  # compared by their first-step gradients (test_families.py)
            continue
        assert _rel_l2(p.detach(), params[name].detach()) <= PARAM_RTOL, (model_type, name, _rel_l2(p, params[name]))
    assert_first_step_grads_match(model_type, patched_grads, plain_grads)
    close = ((patched_top.values - plain_top.values).abs() <= LOGPROB_ATOL).all(-1)
    close &= (patched_top.indices == plain_top.indices).all(-1)
    assert close.float().mean().item() >= 1 - 2 / close.numel(), (model_type, (~close).sum().item())


def _on_gpu(value):
    """A batch's tensor on the GPU, its floating inputs (pixel values) in bf16 as the model's weights."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to("cuda", torch.bfloat16) if value.is_floating_point() else value.cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", sorted(VLM_CONFIGS))
def test_vlm_family_trains_like_transformers_in_bfloat16_on_the_gpu(model_type, data):
    """The same training in bf16 on a GPU, every patched op (the vision tower's too) on its tuned Triton kernel:
    the curves and the first-step gradients agree within bf16's precision (``helpers.assert_bf16_training_matches``),
    and the fused loss leaves no logits."""
    plain = mini_vlm(model_type, dtype=torch.bfloat16, device="cuda")
    if plain is None:
        pytest.skip(f"this transformers release has no {model_type}")
    patched = mini_vlm(model_type, dtype=torch.bfloat16, device="cuda")
    batches, _ = _batches(model_type, *data)
    batches = [{k: _on_gpu(v) for k, v in b.items()} for b in batches]
    plain_grads, patched_grads = {}, {}
    try:
        plain_losses, _ = _train(plain, batches, plain_grads, every=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            liger_gen.apply_to(patched)
        patched_losses, patched_logits = _train(patched, batches, patched_grads, every=True)
    finally:
        restore_rope()
    report = patched.liger_gen_report
    assert report.norms > 0 and report.loss and all(logits is None for logits in patched_logits), report.summary()
    # (Mllama's vision tower has no first-step gradient: its cross-attention gates start at 0)
    assert_bf16_training_matches(model_type, report, patched_losses, plain_losses, patched_grads, plain_grads)


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
    original = getattr(modeling, family.rope_function)
    language_model = family.language_model or "language_model"
    rotary = next(m for name, m in model.named_modules()  # Llama 4's text model is in a causal LM
                  if name.endswith((f"{language_model}.rotary_emb", f"{language_model}.model.rotary_emb")))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 12, 8, generator=gen)
    if model_type.startswith(("qwen", "glm4v")):
        positions = torch.stack([torch.arange(12).expand(2, -1), torch.arange(12).flip(0).expand(2, -1) * 3,
                                 (torch.arange(12) % 4).expand(2, -1)])  # (3, batch, seq)
        cos, sin = rotary(x, positions)
    elif "layer_type" in inspect.signature(rotary.forward).parameters:  # Gemma 3: tables per layer type
        layer_type = model.config.get_text_config().layer_types[0]
        cos, sin = rotary(x, torch.arange(12)[None].expand(2, -1), layer_type=layer_type)
    elif family.rope_tables == "complex":  # Llama 4: one complex table of cos + i·sin per pair
        freqs_cis = rotary(x, torch.arange(12)[None].expand(2, -1))
    else:
        cos, sin = rotary(x, torch.arange(12)[None].expand(2, -1))
    q, k = torch.randn(2, 4, 12, 16, generator=gen), torch.randn(2, 2, 12, 16, generator=gen)
    if family.rope_tables == "complex":  # (xq, xk, freqs_cis), (batch, seq, heads, head_dim)
        args = (q.transpose(1, 2), k.transpose(1, 2), freqs_cis)
    else:
        args = (q, cos, sin) if family.rope_single else (q, k, cos, sin)  # Gemma 4: one tensor a call
    vision = None
    if hasattr(modeling, "apply_multidimensional_rope"):
        # Gemma 4's vision tower rotates the x and y halves of each head, (batch, patches, heads, head_dim), through
        # the same apply_rotary_pos_emb: its (x, y) patch positions and its own tables
        grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(1, 16, 2)
        x = torch.randn(2, 16, 2, 16, generator=gen)
        tables = model.model.vision_tower.encoder.rotary_emb(x, grid.expand(2, -1, -1))
        vision = (x, *tables, grid.expand(2, -1, -1))
        vision_want = modeling.apply_multidimensional_rope(*vision)
    try:
        liger_gen.apply_to(model)
        routed = getattr(modeling, family.rope_function)
        assert routed is not original and model.liger_gen_report.rope
        got, want = routed(*args), original(*args)
        pairs = list(zip(got, want)) if isinstance(got, tuple) else [(got, want)]
        if vision is not None:
            pairs.append((modeling.apply_multidimensional_rope(*vision), vision_want))
        for got, want in pairs:
            assert got.dtype == want.dtype and got.shape == want.shape, model_type
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    finally:
        restore_rope()


def _vision_tables(seq: int, head_dim: int, gen: torch.Generator, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (seq, head_dim) in fp32 as the Qwen and GLM-4V vision rotary embeddings make them ("2-D": per
    patch, the angles of its row and of its column, head_dim / 4 frequencies each, then cat(freqs, freqs)); in
    bf16 ("2-D bf16", tables of a release whose inverse frequencies were cast with the model); or arbitrary values
    ("random": real tables have equal halves, which would hide a mix-up of the halves)."""
    if kind == "random":
        return torch.randn(seq, head_dim, generator=gen), torch.randn(seq, head_dim, generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim // 2, 2).float() / (head_dim // 2)))
    rows, cols = torch.randint(0, 64, (2, seq), generator=gen).float()
    freqs = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    dtype = torch.bfloat16 if kind == "2-D bf16" else torch.float32
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _vision_call(function, qkv: torch.Tensor, heads: int, cos, sin, grads, fused: bool):
    """``function(q, k, cos, sin)`` for q and k made as the vision attention makes them: (seq, heads, head_dim)
    views of the fused qkv projection (``reshape(seq, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)``: strided, not
    contiguous), or contiguous copies; the outputs and the gradient of ``qkv`` for the output gradients ``grads``."""
    qkv = qkv.detach().requires_grad_()
    q, k, _ = qkv.reshape(qkv.shape[0], 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
    if not fused:
        q, k = q.contiguous(), k.contiguous()
    assert q.is_contiguous() != fused
    out = function(q, k, cos, sin)
    torch.autograd.backward(out, grads)
    return out, qkv.grad


@pytest.mark.parametrize("model_type", VISION_ROPE)
def test_routed_vision_rotary_function_equals_transformers_own(model_type, cpu_path):
    """The vision tower's routed ``apply_rotary_pos_emb_vision`` against transformers' own, on random q and k of
    (seq, heads, head_dim) = (37, 3, 80) (Qwen's vision head_dim: 40 of a 64-wide tile rotated per half), in fp32,
    bf16 and fp16, as strided views of a fused qkv projection and contiguous, with 2-D tables in fp32 and bf16 and
    random ones; on both CPU paths.

    Tolerances, per dtype: transformers upcasts q, k, cos and sin to fp32, rotates there and casts back; the routed
    function hands the op fp32 tables, so the op's products and sums are fp32 ones too and its fp32 outputs are cast
    back by PyTorch: the outputs are transformers' bit for bit, and within ``REL_TOL[dtype]`` of the float64
    rotation. The backward sums in fp32 and rounds once to q's dtype, as the backward of transformers' upcast does:
    bit for bit, but for the interpreter's bf16 stores, which truncate where PyTorch (and a GPU) rounds to nearest:
    there one unit in the last place, ``eps`` of bf16 relative. Calls of another form go to transformers' own."""
    family = MODEL_FAMILIES[model_type]
    try:
        modeling = importlib.import_module(family.modeling_module)
    except ImportError:
        pytest.skip(f"this transformers release has no {model_type}")
    original = getattr(modeling, family.vision_rope)
    model = mini_vlm(model_type)
    gen = torch.Generator().manual_seed(17)
    seq, heads, head_dim = 37, 3, 80
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            liger_gen.apply_to(model)
        routed = getattr(modeling, family.vision_rope)
        assert routed is not original and routed.liger_gen and model.liger_gen_report.rope
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            grad_tol = dict(rtol=torch.finfo(dtype).eps, atol=0) if cpu_path == "1" and dtype == torch.bfloat16 \
                else dict(rtol=0, atol=0)
            for fused, tables in ((True, "2-D"), (True, "random"), (False, "2-D"), (True, "2-D bf16")):
                qkv = torch.randn(seq, 3 * heads * head_dim, generator=gen).to(dtype)
                cos, sin = _vision_tables(seq, head_dim, gen, tables)
                grads = [torch.randn(seq, heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
                got, got_grad = _vision_call(routed, qkv, heads, cos, sin, grads, fused)
                want, want_grad = _vision_call(original, qkv, heads, cos, sin, grads, fused)
                case = (model_type, dtype, fused, tables)
                q, k, _ = qkv.reshape(seq, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
                exact = rope_float64(q[None], k[None], cos[None], sin[None], unsqueeze_dim=2)
                for g, w, x in zip(got, want, exact):
                    assert g.dtype == w.dtype == dtype and g.shape == w.shape, case
                    assert torch.equal(g, w), case
                    assert rel_l2(g, x[0]) < REL_TOL[dtype], case
                assert got_grad.dtype == dtype, case
                torch.testing.assert_close(got_grad, want_grad, **grad_tol, msg=lambda m: f"{case}: {m}")
        # other forms go to transformers' function: a batch of images (4-D q, 3-D tables) computed as it does, and
        # tables of another head_dim raising what it raises
        q, k = torch.randn(2, 2, 5, 3, 16, generator=gen).unbind(0)
        cos, sin = torch.randn(2, 2, 5, 16, generator=gen).unbind(0)
        for g, w in zip(routed(q, k, cos, sin), original(q, k, cos, sin)):
            assert torch.equal(g, w)
        with pytest.raises(RuntimeError, match="size of tensor"):
            original(q[0], k[0], cos[0, :, :8], sin[0, :, :8])
        with pytest.raises(RuntimeError, match="size of tensor"):
            routed(q[0], k[0], cos[0, :, :8], sin[0, :, :8])
    finally:
        restore_rope()
    assert getattr(modeling, family.vision_rope) is original


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


@pytest.mark.parametrize("model_type", sorted(VLM_CONFIGS))
def test_verify_predicts_a_vision_language_models_ops_from_its_config(model_type, tmp_path, monkeypatch):
    """``liger-gen verify --model config.json`` (and ``build``) build a vision-language config as its
    ``*ForConditionalGeneration``: the ops predicted from the mini model's config.json are the ops ``apply_to``
    runs on the model itself, its vision tower's included."""
    from liger_gen.integrations.transformers import patched_ops
    from liger_gen.verify import ops_for_config

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = mini_vlm(model_type)
    if model is None:
        pytest.skip(f"this transformers release has no {model_type}")
    try:
        model.config.to_json_file(tmp_path / "config.json")
        liger_gen.apply_to(model)
        assert ops_for_config(tmp_path / "config.json") == patched_ops(model)
    finally:
        restore_rope()


def test_builds_model_step_patches_a_vision_language_architecture(monkeypatch):
    """``liger-gen build --model tiny-qwen2.5-vl``'s step: the architecture is built as its
    ``*ForConditionalGeneration`` (which AutoModelForCausalLM refuses), patched with its fused loss, and runs
    on an image + text batch."""
    from liger_gen import prebuild

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    built = []
    apply_to = liger_gen.apply_to
    monkeypatch.setattr(liger_gen, "apply_to", lambda model, **kw: built.append(model) or apply_to(model, **kw))
    try:
        step = prebuild.model_step("tiny-qwen2.5-vl", 1, 64, torch.float32, torch.device("cpu"))
        (model,) = built
        assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration" and model.liger_gen_report.loss
        images = []
        model.model.visual.register_forward_hook(lambda m, args, out: images.append(args[0].shape))
        step()
        assert len(images) == 1  # an image + text batch: the vision tower (and its kernels) ran
    finally:
        restore_rope()
