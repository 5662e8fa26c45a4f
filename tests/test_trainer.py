"""A patched model trains under transformers' ``Trainer`` exactly as the plain one does."""

import inspect
from importlib import resources

import pytest
import torch

import liger_gen
from liger_gen.integrations import transformers as integration

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer's own requirement


@pytest.fixture(autouse=True)
def _restore_rope():
    yield
    integration.restore_rope()


class ByteBlocks(torch.utils.data.Dataset):
    """Fixed-length blocks of the packaged Shakespeare text, one token per byte (vocab 256); the first tokens
    of each block are masked in ``labels``, as a prompt is in instruction tuning."""

    def __init__(self, n_blocks: int, seq_len: int):
        text = (resources.files("liger_gen") / "data" / "tinyshakespeare.txt").read_bytes()
        ids = torch.tensor(list(text[: n_blocks * seq_len]), dtype=torch.long).view(n_blocks, seq_len)
        self.items = []
        for block in ids:
            labels = block.clone()
            labels[:3] = -100
            self.items.append({"input_ids": block, "attention_mask": torch.ones_like(block), "labels": labels})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _model():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _train(model, out_dir, dataset):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True)  # remove_unused_columns=True: the default, which reads forward
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_trains_a_patched_model_like_the_plain_one(tmp_path, monkeypatch):
    """Trainer keeps only the batch columns that ``model.forward``'s signature names and passes
    ``num_items_in_batch`` under gradient accumulation: the patched forward must keep the original signature,
    and every step's loss must equal plain transformers' (fp32)."""
    dataset = ByteBlocks(16, 32)
    reference = _train(_model(), tmp_path / "plain", dataset)

    model = _model()
    before = inspect.signature(model.forward)
    liger_gen.apply_to(model)
    calls = []
    fused = liger_gen.functional.fused_linear_cross_entropy
    monkeypatch.setattr(liger_gen.functional, "fused_linear_cross_entropy",
                        lambda *a, **k: calls.append(k.get("reduction")) or fused(*a, **k))
    losses = _train(model, tmp_path / "patched", dataset)

    assert inspect.signature(model.forward) == before
    assert len(losses) == len(reference) == 2  # the second step's loss comes after an accumulated update
    # the fused loss ran, with Trainer's num_items_in_batch (passed since transformers 4.46)
    takes_items = any(p.kind is p.VAR_KEYWORD for p in before.parameters.values())
    assert calls and set(calls) == ({"sum"} if takes_items else {"mean"})
    for got, want in zip(losses, reference):
        assert abs(got - want) <= 1e-4 * abs(want) + 1e-4, (losses, reference)
