"""Packed sequences: several documents in one row, as transformers' ``DataCollatorWithFlattening`` makes them
(input ids concatenated, ``position_ids`` restarting at 0 for each document, -100 at each document's first label).

Where transformers keeps the documents apart, a packed batch must give the loss and the gradients of the same
documents padded one per row, with plain transformers and after ``liger_gen.apply_to`` alike (so RoPE, the fused
loss and every patched op treat the documents as separate, as the library does). Where it does not, the patched
model warns once (``liger_gen.integrations.transformers.packing``), and the losses are shown to differ.

What transformers 5.25 does on the CPU (``masking_utils._preprocess_mask_arguments``): eager and sdpa attention
find the documents from restarting ``position_ids`` only when no 2D ``attention_mask`` is given and no cache is
used, so the packed calls pass ``use_cache=False`` (a fresh config has ``use_cache=True``; transformers' ``Trainer``
sets it to ``TrainingArguments.use_cache``, False by default). The families of ``packing.MIXING_FAMILIES`` mix
documents whatever the attention does.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from transformers import DataCollatorWithFlattening

import liger_gen
from liger_gen.integrations.transformers import restore_rope
from liger_gen.integrations.transformers.packing import MIXING_FAMILIES, PackedSequenceWarning, mixing_reason
from conftest import seeded
from helpers import BF16_GRAD_PART_RTOL, grad_part_rel_l2
from mini_models import FAMILY_CONFIGS, mini_model

# three documents of different lengths, the longest past the mini Gemmas' and OLMo 3's sliding window of 16 (so the
# window is taken per document) and none a multiple of another
DOC_LENGTHS = (11, 7, 19)
TARGETS = sum(n - 1 for n in DOC_LENGTHS)  # every token but each document's first is a target, packed or padded
# float32 tolerances. Packed and padded compute each token's loss from the same products in other shapes (one row
# of 37 tokens against three rows of 19, masked scores that add exact zeros), so they differ by roundoff only: the
# mean of the TARGETS = 34 per-token losses, summed in another order, may move by up to about TARGETS·u relative
# (u = 2^-24 ≈ 6e-8), i.e. 2e-6; measured at most 2.6e-7 (plain and patched, every family, eager and sdpa). When
# documents mix, the loss moves by 2e-4 relative or more (measured in 17 families, llama 3.3e-3), 100 times this.
LOSS_RTOL = TARGETS * torch.finfo(torch.float32).eps / 2
# each parameter's gradient (relative L2 over the tensor): like the loss, a sum over the 34 targets' backward
# paths in other shapes; measured at most 6.8e-7 (every family, plain and patched, eager and sdpa), so about 7
# times that; mixed documents move some parameter's gradient by 0.7 relative or more. The key projections' biases
# are left out: their exact gradient is 0 (softmax ignores a per-query constant), so both are roundoff with nothing
# to compare relative to.
GRAD_RTOL = 5e-6

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The mini models' matmuls are a few thousand flops: a second intra-op thread gains nothing, and on shared
    cores each parallel region waits for a descheduled thread (measured: a forward and backward took 0.9 s with 2
    threads on 2 busy cores, 8 ms with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _documents() -> list[list[int]]:
    g = seeded("packed documents")
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in DOC_LENGTHS]


def _packed(docs: list[list[int]]) -> dict:
    """The documents in one row, by transformers' own collator."""
    return DataCollatorWithFlattening()([{"input_ids": d} for d in docs])


def _padded(docs: list[list[int]]) -> dict:
    """One document per row, right-padded: attention_mask 0 and labels -100 on the padding."""
    width = max(map(len, docs))
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for row, doc in enumerate(docs):
        ids[row, :len(doc)] = labels[row, :len(doc)] = torch.tensor(doc)
        mask[row, :len(doc)] = 1
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _targets(labels: torch.Tensor) -> int:
    """How many tokens the causal-LM loss averages over (labels shifted by one, -100 ignored)."""
    return int((labels[..., 1:] != -100).sum())


def _loss_and_grads(model, batch: dict, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(**batch, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).norm().item() / max(b.double().norm().item(), 1e-30)


def _assert_same(got, expected, what):
    _assert_close(got, expected, what, LOSS_RTOL, GRAD_RTOL)


def _assert_close(got, expected, what, loss_rtol, grad_rtol=None):
    """The (loss, gradients) ``got`` within ``loss_rtol`` and, unless None, every parameter's gradient within
    ``grad_rtol`` (relative L2) of ``expected``; returns the worst parameter's distance (None without a bound)."""
    (loss, grads), (ref_loss, ref_grads) = got, expected
    assert torch.isfinite(loss) and abs(loss.item() - ref_loss.item()) <= loss_rtol * abs(ref_loss.item()), (
        what, loss, ref_loss)
    assert grads.keys() == ref_grads.keys(), what
    if grad_rtol is None:
        return None
    worst = max((n for n in grads if not n.endswith("k_proj.bias")), key=lambda n: _rel_l2(grads[n], ref_grads[n]))
    assert _rel_l2(grads[worst], ref_grads[worst]) <= grad_rtol, (what, worst, _rel_l2(grads[worst], ref_grads[worst]))
    return _rel_l2(grads[worst], ref_grads[worst])


def _patched_packed_and_padded(model, packed: dict, padded: dict):
    """``apply_to(model)``, then the (loss, gradients) of the packed batch, which must not warn, and of the padded
    one; transformers' rotary functions restored after."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            liger_gen.apply_to(model)
            assert model.liger_gen_report.loss, model.liger_gen_report.summary()
            patched_packed = _loss_and_grads(model, packed, use_cache=False)
        assert not _packing_warnings(caught)  # the configuration that keeps documents apart does not warn
        return patched_packed, _loss_and_grads(model, padded, use_cache=False)
    finally:
        restore_rope()


def _packing_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, PackedSequenceWarning)]


def _model(model_type: str, attention: str):
    if model_type in MIXING_FAMILIES:
        pytest.skip(f"transformers 5.25 mixes packed documents here: {MIXING_FAMILIES[model_type]}")
    model = mini_model(model_type)
    if model is None:
        pytest.skip(f"this transformers release has no {model_type}")
    if attention == "sdpa" and not model._supports_sdpa:
        pytest.skip(f"transformers 5.25's {type(model).__name__} does not support sdpa")
    model.set_attn_implementation(attention)
    model.eval()  # no dropout draws (Seed-OSS); gradients stay on, so the fused loss runs
    return model


CASES = [pytest.param(t, a, id=f"{t}-{a}") for t in sorted(FAMILY_CONFIGS) for a in ("eager", "sdpa")]


@pytest.mark.parametrize("model_type,attention", CASES)
def test_packed_batch_trains_like_padded_documents(model_type, attention, monkeypatch):
    """Plain path (the patching: RoPE from restarting positions, the fused loss over -100 separators): packed and
    padded agree with plain transformers, and again after apply_to, which also agrees with plain transformers."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = _model(model_type, attention)
    docs = _documents()
    packed, padded = _packed(docs), _padded(docs)
    assert packed["input_ids"].shape == (1, sum(DOC_LENGTHS))
    assert _targets(packed["labels"]) == _targets(padded["labels"]) == TARGETS  # both losses: means over the same
    plain_packed = _loss_and_grads(model, packed, use_cache=False)
    plain_padded = _loss_and_grads(model, padded, use_cache=False)
    _assert_same(plain_packed, plain_padded, (model_type, attention, "transformers"))
    patched_packed, patched_padded = _patched_packed_and_padded(model, packed, padded)
    _assert_same(patched_packed, patched_padded, (model_type, attention, "liger-gen"))
    _assert_same(patched_packed, plain_packed, (model_type, attention, "liger-gen vs transformers"))


# On a GPU, per dtype: (loss, gradient) relative tolerances between packed and padded. float32: cuBLAS and the
# attention kernels pick their algorithms (split-K, tile counts) by shape, so a 37-token row and three 19-token
# rows sum the same products in other orders: each product's relative error is of order sqrt(K)·u (K <= 128 in the
# mini models, u = 2^-24), about 1e-6, and the loss's mean over 34 targets adds TARGETS·u; 1e-5 and 1e-4 leave a
# margin of ten over that, and still catch mixed documents (loss 2e-4 relative or more in most families, a
# parameter's gradient 0.7). bfloat16: the activations are rounded to 8 bits of mantissa between ops, so packed
# and padded differ by a few bf16 ulps (2^-8 relative each): the loss by up to eps = 2^-7, each gradient by up to
# 2^-4 (a mini MoE's router may also send one of the 34 tokens to another expert: about 1/34 of that expert's
# gradient); mixed documents still move a gradient by 0.7, ten times that.
GPU_RTOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2.0 ** -7, 2.0 ** -4)}
GPU_CASES = [pytest.param(t, a, d, id=f"{t}-{a}-{str(d)[6:]}") for t in sorted(FAMILY_CONFIGS)
             for a, d in (("sdpa", torch.float32), ("eager", torch.float32), ("sdpa", torch.bfloat16),
                          ("flash_attention_2", torch.bfloat16))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type,attention,dtype", GPU_CASES)
def test_packed_batch_equals_padded_on_the_gpu(model_type, attention, dtype):
    """On a GPU, every patched op on its Triton kernel, with the attention implementations transformers keeps
    packed documents apart with there (sdpa and eager from restarting positions, FlashAttention-2 from the
    documents' boundaries when ``flash_attn`` is installed): packed equals padded, plain and patched."""
    from transformers.utils import is_flash_attn_2_available

    if attention == "flash_attention_2" and not is_flash_attn_2_available():
        pytest.skip("flash_attn is not installed")
    if model_type in MIXING_FAMILIES:
        pytest.skip(f"transformers 5.25 mixes packed documents here: {MIXING_FAMILIES[model_type]}")
    model = mini_model(model_type, dtype=dtype, device="cuda")
    if model is None:
        pytest.skip(f"this transformers release has no {model_type}")
    if attention == "sdpa" and not model._supports_sdpa or attention.startswith("flash") and not model._supports_flash_attn:
        pytest.skip(f"transformers' {type(model).__name__} does not support {attention}")
    model.set_attn_implementation(attention)
    model.eval()
    docs = _documents()
    packed = {k: v.cuda() for k, v in _packed(docs).items()}
    padded = {k: v.cuda() for k, v in _padded(docs).items()}
    rtols = GPU_RTOL[dtype]
    plain_packed = _loss_and_grads(model, packed, use_cache=False)
    _assert_close(plain_packed, _loss_and_grads(model, padded, use_cache=False), (model_type, "transformers"), *rtols)
    patched_packed, patched_padded = _patched_packed_and_padded(model, packed, padded)
    worst = _assert_close(patched_packed, patched_padded, (model_type, "liger-gen"), *rtols)
    # liger-gen against transformers: every gradient in float32; in bf16 each part's gradients as one vector
    # (helpers.grad_part_rel_l2), as an MoE router's own gradients (1e-4 and below) are sums of the experts'
    # bf16-rounded outputs, which liger-gen's kernels round once where transformers rounds each op (measured 0.16
    # to 0.46 relative on an H100 for three mini MoEs), while packed and padded, each through the same ops, stay
    # within the bound above parameter by parameter
    _assert_close(patched_packed, plain_packed, (model_type, "liger-gen vs transformers"), rtols[0],
                  rtols[1] if dtype == torch.float32 else None)
    if dtype == torch.bfloat16:
        parts = grad_part_rel_l2(patched_packed[1], plain_packed[1])
        assert max(parts.values()) <= BF16_GRAD_PART_RTOL, (model_type, "liger-gen vs transformers", parts)
    print(f"{model_type} {attention} {dtype}: packed vs padded loss {patched_packed[0].item():.6f} / "
          f"{patched_padded[0].item():.6f}, worst gradient {worst:.2e}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter must be on before kernels are defined")
def test_packed_batch_through_the_kernels(monkeypatch):
    """The same through the Triton kernels (RMSNorm, SwiGLU, RoPE, the fused loss) in the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # conftest's setting without a GPU, whatever ran before
    model = _model("llama", "eager")
    docs = _documents()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            liger_gen.apply_to(model)
        packed = _loss_and_grads(model, _packed(docs), use_cache=False)
        padded = _loss_and_grads(model, _padded(docs), use_cache=False)
    finally:
        restore_rope()
    _assert_same(packed, padded, ("llama", "eager", "interpreter"))


# ------------------------------------------------------------------------------------------------ the warning


def _patched(model_type: str = "llama"):
    model = mini_model(model_type)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        liger_gen.apply_to(model)
    return model


def _calls(model, batch: dict, times: int = 1, **kwargs) -> tuple[list[float], list[str]]:
    """The losses of ``times`` calls, and the packing warnings they gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the once-per-model rule must be liger-gen's, not the warnings registry's
        losses = [model(**batch, **kwargs).loss.item() for _ in range(times)]
    return losses, _packing_warnings(caught)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_warns_once_when_the_cache_keeps_documents_together(monkeypatch):
    """A fresh config has use_cache=True: transformers then makes a cache and looks for no document boundaries,
    so the packed loss is not the padded one. The patched model says so, once."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    try:
        model = _patched()
        assert model.config.use_cache
        docs = _documents()
        (padded,), _ = _calls(model, _padded(docs), use_cache=False)
        losses, caught = _calls(model, _packed(docs), times=3)
        assert len(caught) == 1 and "use_cache=False" in caught[0] and "documents" in caught[0], caught
        assert _rel(losses[0], padded) > 50 * LOSS_RTOL, (losses[0], padded)  # why the warning matters
        (separate,), caught = _calls(model, _packed(docs), use_cache=False)
        assert not caught and _rel(separate, padded) <= LOSS_RTOL
        # plain transformers mixes them alike: the patched model keeps the library's behaviour
        plain = mini_model("llama")
        (mixed,), _ = _calls(plain, _packed(docs))
        assert _rel(mixed, losses[0]) <= LOSS_RTOL
    finally:
        restore_rope()


def test_warns_when_an_attention_mask_comes_with_packed_positions(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    try:
        model = _patched()
        docs = _documents()
        packed = _packed(docs)
        packed["attention_mask"] = torch.ones_like(packed["input_ids"])
        (padded,), _ = _calls(model, _padded(docs), use_cache=False)
        (loss,), caught = _calls(model, packed, use_cache=False)
        assert len(caught) == 1 and "attention_mask" in caught[0], caught
        assert _rel(loss, padded) > 50 * LOSS_RTOL
    finally:
        restore_rope()


def test_no_warning_for_unpacked_batches_or_separated_documents(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    try:
        model = _patched()
        docs = _documents()
        ids = torch.tensor([sum(docs, [])])
        _, caught = _calls(model, dict(input_ids=ids, labels=ids))  # no position_ids, the config's use_cache
        assert not caught
        _, caught = _calls(model, dict(input_ids=ids, labels=ids, position_ids=torch.arange(ids.shape[1])[None]))
        assert not caught  # positions that do not restart
        _, caught = _calls(model, _packed(docs), use_cache=False)
        assert not caught
        model.config.use_cache = False  # what transformers' Trainer does (TrainingArguments.use_cache=False)
        _, caught = _calls(model, _packed(docs))
        assert not caught
        model.config.use_cache = True
        # in training, transformers turns the cache off (activation_checkpointing_enable: 5.25's new name)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
        _, caught = _calls(model, _packed(docs))
        assert not caught
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
        _, caught = _calls(model, _packed(docs))
        assert len(caught) == 1  # the same model does warn once the cache is back on
    finally:
        restore_rope()


@pytest.mark.parametrize("model_type", sorted(MIXING_FAMILIES))
def test_families_that_mix_documents_warn(model_type, monkeypatch):
    """Families whose layers cross document boundaries whatever the attention mask (``MIXING_FAMILIES``): with
    use_cache=False, another first document changes the logits of the later ones in plain transformers; the patched
    model warns. (Every other family passes ``test_packed_batch_trains_like_padded_documents``.)"""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    plain = mini_model(model_type)
    if plain is None:
        pytest.skip(f"this transformers release has no {model_type}")
    plain.eval()
    docs = _documents()
    other = [torch.randint(3, 256, (DOC_LENGTHS[0],), generator=seeded("other document")).tolist()] + docs[1:]

    def later_documents(ds):  # a convolution reaches the first few tokens of the next document only
        batch = _packed(ds)
        batch.pop("labels")
        with torch.no_grad():
            return plain(**batch, use_cache=False).logits[0, DOC_LENGTHS[0]:]

    leak = (later_documents(docs) - later_documents(other)).abs().max().item()
    assert leak > 1e-5, leak  # MoE roundoff from another batch composition stays below 1e-7
    try:
        model = _patched(model_type)
        _, caught = _calls(model, _packed(docs), use_cache=False)
    finally:
        restore_rope()
    assert len(caught) == 1 and MIXING_FAMILIES[model_type] in caught[0], caught


def _fake(model_type: str, attention: str):
    config = types.SimpleNamespace(model_type=model_type, _attn_implementation=attention, use_cache=False)
    return types.SimpleNamespace(config=config, training=True)


@pytest.mark.parametrize("model_type,attention,rows,varlen,mixes", [
    ("llama", "flash_attention_2", 1, False, False),  # one row: boundaries from position_ids
    ("llama", "flash_attention_2", 2, False, True),  # several rows: flash reads position_ids for one row only
    ("llama", "flash_attention_3", 2, True, False),  # cu_seq_lens_q & co from the collator
    ("gpt_oss", "flash_attention_2", 1, False, False),  # flash keeps GPT-OSS's documents apart
    ("gpt_oss", "sdpa", 1, False, True),  # its masks are built without position_ids
    ("qwen3_next", "flash_attention_2", 1, False, True),  # linear attention without cu_seq_lens_q
    ("qwen3_next", "flash_attention_2", 1, True, False),
    ("lfm2", "flash_attention_2", 1, True, True),  # convolutions take no boundaries at all
    ("llama", "kernels-community/flash-attn", 2, False, False),  # an implementation whose behaviour is unknown
])
def test_what_the_warning_assumes_of_attention_implementations(model_type, attention, rows, varlen, mixes):
    """The rules for implementations the CPU cannot run, from transformers 5.25's code
    (modeling_flash_attention_utils._flash_attention_forward, _is_packed_sequence)."""
    position_ids = torch.tensor([[0, 1, 2, 0, 1]] * rows)
    named = dict(input_ids=torch.zeros_like(position_ids), position_ids=position_ids, labels=position_ids)
    extra = dict(cu_seq_lens_q=torch.tensor([0, 3, 5])) if varlen else {}
    assert (mixing_reason(_fake(model_type, attention), named, extra) is not None) == mixes
    # a prepared 4D mask is the caller's: nothing is assumed
    named["attention_mask"] = torch.ones(rows, 1, 5, 5, dtype=torch.bool)
    assert mixing_reason(_fake(model_type, attention), named, extra) is None
