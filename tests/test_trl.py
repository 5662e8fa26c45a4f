"""A patched model trains under TRL's ``SFTTrainer`` (default arguments, gradient accumulation) exactly as the
plain one does."""

from __future__ import annotations

from importlib import resources

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


@pytest.fixture(scope="module")
def corpus():
    """A byte-level BPE tokenizer trained locally on the packaged Shakespeare text, and 48 passages of it."""
    text = (resources.files("liger_gen") / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:200_000]
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<eos>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([text], trainer=trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")
    passages = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 80][:48]
    return tokenizer, datasets.Dataset.from_dict({"text": passages})


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
