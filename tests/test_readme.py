"""The README's training-code example runs as written (in this process's mode: the interpreter without a GPU)."""

import re
from pathlib import Path

import pytest

from conftest import preference_batch

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(autouse=True)
def _restore_rope():
    """The examples call apply_to, whose RoPE routing is process-wide: undo it for the tests that follow."""
    yield
    from liger_gen.integrations.transformers import restore_rope

    restore_rope()


def test_use_in_training_code_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert namespace["model"].lm_head.weight.grad is not None  # the loss reached the LM head without logits
    assert namespace["y"].shape == namespace["x"].shape and namespace["loss"].ndim == 0


def test_preference_and_distillation_example_runs(monkeypatch):
    """The post-training example, with tiny Llamas as policy, reference, student and teacher (the teacher wider)
    and a batch of two chosen/rejected pairs."""
    import pytest
    import torch

    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
                 if "fused_linear_dpo" in b)

    def llama(hidden, seed):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=97)
        return transformers.LlamaForCausalLM(config)

    namespace = preference_batch(llama)
    exec(compile(block, str(README), "exec"), namespace)
    assert torch.isfinite(namespace["out"].loss) and namespace["policy"].lm_head.weight.grad is not None
    assert namespace["out"].chosen_rewards.shape == (2,)
    assert torch.isfinite(namespace["loss"]) and namespace["loss"] > 0
