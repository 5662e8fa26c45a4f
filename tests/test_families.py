"""Convergence of every supported family: a mini model trained with plain transformers and after
``liger_gen.apply_to`` from the same weights on the same batches of ``tinyshakespeare.txt`` (byte tokens).

The loss curve, the final parameters and the held-out top-k log-probabilities must agree within float32
tolerances, on the plain CPU path (which checks the patching: the right op, with the family's options, in the
right place) for every family, and through Triton's interpreter for one family of each distinct block (which
checks the kernels). What ``apply_to`` reports patched is asserted too, so a family cannot pass by leaving
everything as it was.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import liger_gen
from liger_gen.training import byte_tokens, make_batches
from liger_gen.integrations.transformers import MODEL_FAMILIES, patched_ops, restore_rope
from liger_gen.nn import SquaredReLUMLP
from helpers import all_grads, assert_bf16_training_matches
from mini_models import FAMILY_CONFIGS, mini_config, mini_model

STEPS, BATCH, SEQ, LR = 20, 2, 32, 3e-3
TOP_K = 5
# float32 tolerances. The patched model computes the same functions with other summation orders (chunked
# LM-head GEMMs, fp32 reductions in another order): one step differs by a few float32 roundoffs (2^-24 ≈ 6e-8)
# of the loss, and over 20 AdamW steps at lr 3e-3 the curves stayed within 2.8e-7 of each other in every family
# (measured on the plain CPU path). A wrong option moves the first loss by far more: measured, a missing Gemma
# offset by 2.7e-3, a dropped Granite or Cohere logit scale by 1.2e-3, a dropped Gemma 2/3 soft-cap by 2.7e-5
# (the mini Gemmas cap at 2 so that it bites at the small logits of a fresh model). The casting modes (where
# the norm rounds) differ only in 16-bit runs, which the GPU run of every family covers.
LOSS_RTOL = 2e-6
PARAM_RTOL = 1e-4  # relative L2 of each parameter after the 20 updates
LOGPROB_ATOL = 1e-3  # held-out top-k log-probabilities (nats)

# families whose decoder layers have no ``h = residual + h; residual = h; h = norm(h)`` before an RMSNorm
# (LFM2 adds before the norm's call, MiniMax scales both terms, Nemotron's are LayerNorms, DeepSeek-V4 mixes
# hyper-connection streams)
UNFUSED_LAYOUTS = ("olmo2", "olmo3", "exaone4", "cohere2", "phimoe", "lfm2", "lfm2_moe", "minimax", "nemotron",
                   "deepseek_v4")
# families with no MLP or experts apply_to swaps (LFM2's w1/w3/w2 MLPs, DeepSeek-V4's clamped SwiGLU)
UNPATCHED_MLPS = ("lfm2", "deepseek_v4")
# families whose MLPs are squared-ReLU (not gated): swapped for SquaredReLUMLP, not GLUMLP
SQUARED_RELU_MLPS = ("nemotron",)

# one family per distinct block, run through the kernels (Triton's interpreter)
INTERPRETER_FAMILIES = ("llama", "gemma2", "phi3", "qwen3_moe", "olmo2", "cohere2", "granite", "gpt_oss", "llama4_text",
                        "gemma4_text", "nemotron")

# families whose patched pieces (norm formula, GLU MLP, fused experts, RoPE layout, fused loss) are each compiled in
# another family's test: their own compile test (4-9 s apiece on 2 cores) would check nothing more, so it is left
# out to keep the CPU suite within its time budget. DeepSeek-V2 (heads-first complex RoPE), Nemotron (LayerNorm of
# 1 + w) and Gemma 4 (one-tensor RoPE, weightless RMSNorms) bring pieces of their own and keep theirs.
COMPILED_ELSEWHERE = ("hunyuan_v1_dense", "hunyuan_v1_moe", "glm4_moe", "olmoe", "ernie4_5", "ernie4_5_moe", "lfm2",
                      "lfm2_moe", "minimax", "deepseek_v4")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _batches():
    tokens = byte_tokens()
    return make_batches(tokens[: len(tokens) // 2], STEPS, BATCH, SEQ, seed=3), \
        make_batches(tokens[len(tokens) // 2:], 1, 4, SEQ, seed=4)[0]


# Parameters whose gradient is roundoff-sized against the others': Qwen 3.5's decay projection of the gated delta
# rule (a gradient ~100x smaller than the other projections') and DeepSeek-V4's hyper-connection base (behind a
# Sinkhorn projection). AdamW normalises such a gradient's roundoff-sized differences into full-sized updates, so
# after 20 steps their weights differ by an amount set by the seed, not by the kernels: they are compared by their
# gradients at the first step instead, where nothing has normalised them yet.
NOISE_NORMALISED = ("linear_attn.in_proj_a.weight", "attn_hc.base")


def first_step_grads(model) -> dict[str, torch.Tensor]:
    """The gradients of ``model``'s ``NOISE_NORMALISED`` parameters, as they stand."""
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()
            if name.endswith(NOISE_NORMALISED) and p.grad is not None}


def assert_first_step_grads_match(model_type: str, got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), (model_type, sorted(got), sorted(want))
    for name in want:
        assert _rel_l2(got[name], want[name]) <= PARAM_RTOL, (model_type, name, _rel_l2(got[name], want[name]))


def _train(model, batches, steps: int, grads: dict | None = None, every: bool = False) -> list[float]:
    """The losses of ``steps`` AdamW steps; ``grads`` (a dict) receives ``first_step_grads`` of the first (with
    ``every``, every parameter's first-step gradient)."""
    torch.manual_seed(11)  # the same dropout / router-jitter draws in both runs
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in batches[:steps]:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if grads is not None and not losses:
            grads.update(all_grads(model) if every else first_step_grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _top_k(model, held_out):
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=held_out).logits.float()
    model.train()
    return torch.log_softmax(logits, dim=-1).topk(TOP_K, dim=-1)


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).norm().item() / max(b.double().norm().item(), 1e-30)


def _compare(model_type: str, steps: int):
    family = MODEL_FAMILIES[model_type]
    plain = mini_model(model_type)
    if plain is None:
        pytest.skip(f"this transformers release has no {model_type}")
    patched = mini_model(model_type)
    batches, held_out = _batches()
    plain_grads, patched_grads = {}, {}
    try:
        plain_losses = _train(plain, batches, steps, plain_grads)
        plain_top = _top_k(plain, held_out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            liger_gen.apply_to(patched)
        report = patched.liger_gen_report
        patched_losses = _train(patched, batches, steps, patched_grads)
        patched_top = _top_k(patched, held_out)
    finally:
        restore_rope()
    # what was patched: norms and the fused loss always; MLPs or experts gates; RoPE where the layout is ours
    assert report.norms > 0 and report.loss, report.summary()
    assert (report.mlps + report.experts > 0) == (model_type not in UNPATCHED_MLPS), report.summary()
    mlps = [m for m in patched.modules() if type(m).__name__.endswith("MLP")]
    if model_type in SQUARED_RELU_MLPS:  # every MLP swapped: none of transformers' own left
        assert mlps and all(isinstance(m, SquaredReLUMLP) for m in mlps), report.summary()
        assert report.mlps == len(mlps) and "squared_relu" in patched_ops(patched), report.summary()
    assert report.rope == family.rope, report.summary()
    # the attention residual add fused into the next norm in every pre-norm decoder layer; the post-norm (OLMo 2/3,
    # Exaone 4), parallel-block (Cohere 2) and LayerNorm (PhiMoE) layouts keep transformers' add
    layers = sum(type(m).__name__.endswith("DecoderLayer") for m in patched.modules())
    assert report.fused_adds == (0 if model_type in UNFUSED_LAYOUTS else layers), report.summary()
    assert all(math.isfinite(x) for x in plain_losses + patched_losses)
    rel = [abs(a - b) / abs(b) for a, b in zip(patched_losses, plain_losses)]
    assert max(rel) <= LOSS_RTOL, (model_type, max(rel), rel)
    assert plain_losses[-1] < plain_losses[0]  # the run trains: a flat curve would compare equal trivially
    params = dict(plain.named_parameters())
    for name, p in patched.named_parameters():
        if name.endswith("k_proj.bias"):
            # its exact gradient is 0 (softmax ignores a per-query constant), so both runs' updates of it are
            # AdamW-normalised roundoff: nothing to compare
            continue
        if name.endswith(NOISE_NORMALISED):  # compared by their first-step gradients, below
            continue
        tol = PARAM_RTOL
        if name.endswith("embed_tokens.weight"):
            # a token's row whose gradient is roundoff-sized over the 20 steps gets AdamW-normalised roundoff
            # updates, as above (seen for Exaone 4 on one machine's BLAS: of 264 rows one drifted to 6e-2 and one
            # to 2e-4 relative, the others stayed within 5e-5): per row, at most 2 rows outside the tolerance
            a, b = p.detach().double(), params[name].detach().double()
            rows = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
            assert (rows > tol).sum().item() <= 2, (model_type, name, rows.topk(3).values.tolist())
            continue
        assert _rel_l2(p.detach(), params[name].detach()) <= tol, (model_type, name, _rel_l2(p, params[name]))
    assert_first_step_grads_match(model_type, patched_grads, plain_grads)
    # per held-out position: the top-k tokens and their log-probabilities. A router's top-k choice is a step
    # function, so a roundoff-sized difference may pick another expert at an isolated token of an MoE model
    # (seen once in Llama 4's top-1 routing); ties between nearly equal log-probabilities may swap too. At most
    # 2 of the 128 positions may differ.
    close = ((patched_top.values - plain_top.values).abs() <= LOGPROB_ATOL).all(-1)
    close &= (patched_top.indices == plain_top.indices).all(-1)
    assert close.float().mean().item() >= 1 - 2 / close.numel(), (model_type, (~close).sum().item())


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_family_trains_like_transformers_on_the_plain_path(model_type, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _compare(model_type, STEPS)


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_family_takes_a_bfloat16_training_step_on_the_plain_path(model_type, monkeypatch):
    """bf16 weights and activations: every patched piece keeps the dtypes transformers' code expects (a float32
    result where bf16 is expected breaks the next matmul), and the first loss agrees within bf16's precision."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    plain = mini_model(model_type, dtype=torch.bfloat16)
    if plain is None:
        pytest.skip(f"this transformers release has no {model_type}")
    patched = mini_model(model_type, dtype=torch.bfloat16)
    batches, _ = _batches()
    try:
        (expected,) = _train(plain, batches, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            liger_gen.apply_to(patched)
        (got,) = _train(patched, batches, 1)
    finally:
        restore_rope()
    assert abs(got - expected) <= torch.finfo(torch.bfloat16).eps * abs(expected), (model_type, got, expected)


@pytest.mark.parametrize("model_type", sorted(set(FAMILY_CONFIGS) - set(COMPILED_ELSEWHERE)))
def test_patched_family_forward_compiles_without_a_graph_break(model_type, monkeypatch):
    """torch.compile(fullgraph=True) of the patched model's forward (norms, MLP or experts, RoPE, the fused loss):
    the loss and the gradients of eager. Eval mode, so dropout (Seed-OSS's) draws nothing; gradients stay on, so
    the fused loss runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = mini_model(model_type)
    if model is None:
        pytest.skip(f"this transformers release has no {model_type}")
    model.eval()
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (BATCH, 10),
                        generator=torch.Generator().manual_seed(7))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            liger_gen.apply_to(model)
        expected = model(input_ids=ids, labels=ids).loss
        expected.backward()
        ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        try:
            got = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids).loss
            got.backward()
        except Exception:  # noqa: BLE001 - transformers' own model may not compile in this release
            restore_rope()
            torch._dynamo.reset()
            plain = mini_model(model_type).eval()
            try:
                torch.compile(plain, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids).loss.backward()
            except Exception as e:  # noqa: BLE001
                pytest.skip(f"{model_type}: transformers' own model does not compile here either: {e}"[:300])
            raise
    finally:
        restore_rope()
        torch._dynamo.reset()
    assert _rel_l2(got.detach(), expected.detach()) <= 1e-6, (model_type, got.item(), expected.item())
    for name, p in model.named_parameters():
        if name in ref:
            assert _rel_l2(p.grad, ref[name]) <= 1e-5, (model_type, name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs CPU tensors")
@pytest.mark.parametrize("model_type", INTERPRETER_FAMILIES)
def test_family_trains_like_transformers_through_the_kernels(model_type, monkeypatch, tmp_path):
    """...and the ops whose kernels ran are those ``liger-gen verify`` predicts from the model's config.json."""
    from liger_gen.ops import all_specs
    from liger_gen.runtime.ops import chosen_configs, clear_caches
    from liger_gen.verify import ops_for_config

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    clear_caches()  # chosen_configs() then lists the kernels of this test's runs only
    # 3 steps: the first loss checks the kernels' forwards; the next two losses and the parameters, their
    # gradients (the plain-path test above trains 20)
    _compare(model_type, 3)
    op_of_space = {spec.space.__name__: spec.name for spec in all_specs()}
    ran = {op_of_space[key[0]] for key, _ in chosen_configs()}
    mini_config(model_type).to_json_file(tmp_path / "config.json")
    predicted = ops_for_config(tmp_path / "config.json")
    assert predicted is not None and set(predicted) == ran, (model_type, predicted, sorted(ran))


def test_every_family_has_a_mini_model():
    from mini_models import VLM_CONFIGS  # the vision-language families' (test_vlm_families.py)

    assert set(FAMILY_CONFIGS) | set(VLM_CONFIGS) == set(MODEL_FAMILIES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_family_trains_like_transformers_in_bfloat16_on_the_gpu(model_type):
    """The same training in bf16 on a GPU, where every patched op runs its tuned Triton kernel: the curves and the
    first-step gradients agree within bf16's precision (``helpers.assert_bf16_training_matches``)."""
    plain = mini_model(model_type, dtype=torch.bfloat16, device="cuda")
    if plain is None:
        pytest.skip(f"this transformers release has no {model_type}")
    patched = mini_model(model_type, dtype=torch.bfloat16, device="cuda")
    batches = [b.cuda() for b in _batches()[0]]
    plain_grads, patched_grads = {}, {}
    try:
        plain_losses = _train(plain, batches, STEPS, plain_grads, every=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            liger_gen.apply_to(patched)
        patched_losses = _train(patched, batches, STEPS, patched_grads, every=True)
    finally:
        restore_rope()
    assert patched.liger_gen_report.norms > 0 and patched.liger_gen_report.loss
    assert_bf16_training_matches(model_type, patched.liger_gen_report, patched_losses, plain_losses, patched_grads,
                                 plain_grads)


def test_a_family_whose_classes_changed_is_reported_not_half_patched(monkeypatch, caplog):
    """A release that renamed the norm class (simulated by a table entry naming a class the model lacks): the
    report says so, strict raises naming the class, and nothing is silently left half-done."""
    import dataclasses
    import logging

    from liger_gen.integrations import transformers as integration

    renamed = dataclasses.replace(MODEL_FAMILIES["llama"], norm_classes=("LlamaRenamedRMSNorm",))
    monkeypatch.setitem(integration.MODEL_FAMILIES, "llama", renamed)
    try:
        with pytest.raises(ValueError, match="LlamaRenamedRMSNorm.*no such module"):
            liger_gen.apply_to(mini_model("llama"), strict=True)
        with caplog.at_level(logging.INFO, logger="liger_gen"):
            model = liger_gen.apply_to(mini_model("llama"))
    finally:
        restore_rope()
    assert model.liger_gen_report.norms == 0 and "LlamaRenamedRMSNorm" in caplog.text


def test_unknown_family_names_the_supported_ones():
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="'gpt2' is not supported; supported: .*llama"):
        liger_gen.apply_to(model)


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_patched_rotary_functions_equal_transformers_own(model_type, monkeypatch):
    """Each rotary function ``apply_to`` replaces returns what transformers' returns, element by element, for the
    family's own cos/sin tables (its rotary embedding module) — also where attention could not tell (the same
    permutation of q and k leaves every score unchanged, so the training curves alone would not catch a layout
    left de-interleaved)."""
    import importlib
    import inspect

    from liger_gen.integrations.transformers.rope import rope_functions

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    family = MODEL_FAMILIES[model_type]
    if not rope_functions(family):
        pytest.skip(f"{model_type}: RoPE is not patched")
    model = mini_model(model_type)
    modeling = importlib.import_module(family.modeling_module)
    originals = {name: getattr(modeling, name) for name, _ in rope_functions(family)}
    rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    gen = torch.Generator().manual_seed(5)
    position_ids = torch.arange(12)[None]
    takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
    extra = {"layer_type": model.config.layer_types[-1]} if takes_layer_type else {}
    try:
        tables = rotary(torch.randn(1, 12, 8, generator=gen), position_ids, **extra)
    except (IndexError, RuntimeError):  # multimodal RoPE (Qwen 3.5 in some releases): (3, batch, seq) positions
        tables = rotary(torch.randn(1, 12, 8, generator=gen), position_ids[None].expand(3, -1, -1), **extra)
    head_dim = getattr(model.config, "qk_rope_head_dim", None) or model.config.head_dim
    if family.rope_tables == "complex":  # (xq, xk, freqs_cis), the heads at dim rope_heads_dim of q and k
        shape = (2, 12, 12, head_dim)
        args = tuple(torch.randn(shape[:family.rope_heads_dim] + (heads,) + shape[family.rope_heads_dim + 1:],
                                 generator=gen) for heads in (4, 2)) + (tables,)
    elif family.rope_single:  # Gemma 4: (x, cos, sin, unsqueeze_dim), one tensor a call
        args = (torch.randn(2, 4, 12, head_dim, generator=gen), *tables)
    else:
        args = (torch.randn(2, 4, 12, head_dim, generator=gen), torch.randn(2, 2, 12, head_dim, generator=gen),
                *tables)
    try:
        liger_gen.apply_to(model)
        for name, original in originals.items():
            got, want = getattr(modeling, name)(*args), original(*args)
            if family.rope_single:
                got, want = (got, getattr(modeling, name)(args[0].transpose(1, 2), *args[1:], unsqueeze_dim=2)), \
                    (want, original(args[0].transpose(1, 2), *args[1:], unsqueeze_dim=2))
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and g.shape == w.shape, (model_type, name)
                torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    finally:
        restore_rope()
