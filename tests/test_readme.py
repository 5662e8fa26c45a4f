"""The README's training-code example runs as written (in this process's mode: the interpreter without a GPU)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_use_in_training_code_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert namespace["model"].lm_head.weight.grad is not None  # the loss reached the LM head without logits
    assert namespace["y"].shape == namespace["x"].shape and namespace["loss"].ndim == 0
