"""A patched model trains under TRL's ``SFTTrainer`` (default arguments, gradient accumulation) exactly as the
plain one does."""

from __future__ import annotations

import pytest
import torch

import liger_gen
from liger_gen.integrations import transformers as integration

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(autouse=True)
def _plain_cpu_path_and_restore_rope(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    yield
    integration.restore_rope()


def _model(vocab: int):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=128, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _train(model, tokenizer, dataset, out_dir):
    args = trl.SFTConfig(output_dir=str(out_dir), max_steps=4, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[],
                         save_strategy="no", use_cpu=True, seed=0, max_length=64, dataloader_num_workers=0,
                         disable_tqdm=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_sft_trainer_trains_a_patched_model_like_the_plain_one(corpus, tmp_path):
    tokenizer, dataset = corpus
    vocab = len(tokenizer)
    plain = _train(_model(vocab), tokenizer, dataset, tmp_path / "plain")
    model = liger_gen.apply_to(_model(vocab))
    report = model.liger_gen_report
    assert report.norms == 5 and report.mlps == 2 and report.rope
    patched = _train(model, tokenizer, dataset, tmp_path / "patched")
    assert len(plain) == len(patched) == 4
    assert plain[-1] < plain[0]  # it trains
    # fp32 on the plain CPU path: the same functions, other summation orders (see tests/test_families.py)
    for a, b in zip(patched, plain):
        assert abs(a - b) <= 2e-6 * abs(b), (patched, plain)


# ------------------------------------------------------------------------------ post-training trainers


@pytest.fixture
def liger_gen_log_probs(monkeypatch):
    """TRL's fused LM head on liger-gen's kernels (in Triton's interpreter where the machine has no GPU)."""
    from liger_gen.integrations.trl import restore_trl_log_probs, use_liger_gen_log_probs

    calls = []
    from liger_gen.ops.lm_head import selective_log_softmax as S

    original = S.Chunks.forward

    def counted(self, need):
        calls.append(self.module is not None)
        return original(self, need)

    monkeypatch.setattr(S.Chunks, "forward", counted)

    def start():
        if not torch.cuda.is_available():
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        use_liger_gen_log_probs()
        return calls

    yield start
    restore_trl_log_probs()


def _preference_data(corpus):
    """Prompt, chosen and rejected texts cut from the Shakespeare passages (the rejected one from another)."""
    _, dataset = corpus
    texts = [t for t in dataset["text"] if len(t) > 100][:16]
    return datasets.Dataset.from_dict({"prompt": [t[:40] for t in texts], "chosen": [t[40:80] for t in texts],
                                       "rejected": [texts[(i + 5) % len(texts)][40:80] for i in range(len(texts))]})


def _dpo_history(corpus, out_dir, loss_type, patched=False):
    tokenizer, _ = corpus
    # 2 steps: the rewards are 0 at the first, the second's come from the first update
    args = trl.DPOConfig(output_dir=str(out_dir), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
                         logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, max_length=64,
                         dataloader_num_workers=0, disable_tqdm=True, loss_type=loss_type, bf16=False)
    model = _model(len(tokenizer))
    if patched:  # before the trainer, which wraps the forward apply_to sets
        liger_gen.apply_to(model)
    trainer = trl.DPOTrainer(model=model, ref_model=_model(len(tokenizer)), args=args,
                             train_dataset=_preference_data(corpus), processing_class=tokenizer)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


METRICS = ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins", "entropy", "kl")


def _assert_same_history(ours, theirs, rtol):
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        for key in METRICS:
            if key in b:
                assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(b[key])), (key, a[key], b[key])


@pytest.mark.parametrize("loss_type, patched", [("sigmoid", False), ("ipo", True)])
def test_dpo_trainer_on_liger_gen_log_probs_trains_as_on_trls(corpus, tmp_path, liger_gen_log_probs, loss_type,
                                                              patched):
    """TRL's DPOTrainer (its losses, its reference model) with the log-probabilities, entropy and logged
    statistics of the fused LM head from liger-gen's kernels (and, patched, the model's norms, RoPE and MLP by
    apply_to): the same losses, gradient norms, log-probabilities and rewards as plain TRL, in fp32."""
    theirs = _dpo_history(corpus, tmp_path / "trl", loss_type)
    calls = liger_gen_log_probs()
    ours = _dpo_history(corpus, tmp_path / "lg", loss_type, patched)
    assert calls and (torch.cuda.is_available() or all(calls))  # the kernels ran (interpreter on a CPU machine)
    _assert_same_history(ours, theirs, 2e-5)
    assert ours[0]["logps/chosen"] < 0


def _grpo_history(model_dir, corpus, out_dir):
    tokenizer, dataset = corpus
    prompts = datasets.Dataset.from_dict({"prompt": [t[:40] for t in dataset["text"][:16]]})

    def vowels(completions, **kwargs):
        return [float(sum(c.count(v) for v in "aeiou")) for c in completions]

    # beta > 0: a reference model and its KL term; num_iterations 2: the second pass clips the ratio
    args = trl.GRPOConfig(output_dir=str(out_dir), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, learning_rate=1e-3, logging_steps=1, report_to=[],
                          save_strategy="no", use_cpu=True, seed=0, bf16=False, dataloader_num_workers=0,
                          disable_tqdm=True, loss_type="dr_grpo", beta=0.04, num_iterations=2, temperature=0.9)
    trainer = trl.GRPOTrainer(model=str(model_dir), reward_funcs=[vowels], args=args, train_dataset=prompts,
                              processing_class=tokenizer)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def test_grpo_trainer_on_liger_gen_log_probs_trains_as_on_trls(corpus, tmp_path, liger_gen_log_probs):
    """TRL's GRPOTrainer (sampled completions, clipped ratios, KL to the reference, the temperature): the same
    losses, gradient norms, KL and entropy with liger-gen's log-probabilities as with TRL's."""
    model_dir = tmp_path / "model"
    _model(len(corpus[0])).save_pretrained(model_dir)
    theirs = _grpo_history(model_dir, corpus, tmp_path / "trl")
    calls = liger_gen_log_probs()
    ours = _grpo_history(model_dir, corpus, tmp_path / "lg")
    assert calls and (torch.cuda.is_available() or all(calls))
    assert any(h.get("clip_ratio/region_mean", 0) > 0 for h in theirs)  # the clipping took part
    _assert_same_history(ours, theirs, 2e-5)


def test_the_patch_is_undone_and_idempotent():
    from trl.trainer import utils

    from liger_gen.integrations.trl import LigerGenLogProbFunction, restore_trl_log_probs, use_liger_gen_log_probs

    own = utils._ChunkedLogProbFunction
    use_liger_gen_log_probs()
    use_liger_gen_log_probs()
    assert utils._ChunkedLogProbFunction is LigerGenLogProbFunction
    restore_trl_log_probs()
    assert utils._ChunkedLogProbFunction is own


def test_calls_the_kernels_do_not_cover_go_to_trls_function(monkeypatch):
    """A head of another dtype than the hidden states (outside autocast) and a ZeRO-3 partitioned head go to
    TRL's own function; the others to liger-gen's."""
    import liger_gen.integrations.trl as bridge

    seen = []

    class Original:
        @staticmethod
        def apply(*args):
            seen.append("trl")
            return (torch.zeros(args[0].shape[0]),) + (None,) * 4

    monkeypatch.setattr(bridge, "_original", Original)
    hidden, weight = torch.randn(3, 8), torch.randn(10, 8)
    targets = torch.tensor([1, 2, 3])
    bridge.LigerGenLogProbFunction.apply(hidden, weight.double(), None, targets, 1.0, 4096)
    zero3 = torch.nn.Parameter(weight.clone())
    zero3.ds_shape = weight.shape
    bridge.LigerGenLogProbFunction.apply(hidden, zero3, None, targets, 1.0, 4096)
    assert seen == ["trl", "trl"]
    out = bridge.LigerGenLogProbFunction.apply(hidden, weight, None, targets, 2.0, 4096, None, 1.0,
                                               ("log_probs", "entropy"))
    want = ((hidden @ weight.t()) / 2.0).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(out[0], want) and out[2:] == (None, None, None)
    assert seen == ["trl", "trl"] and out[1] is not None
