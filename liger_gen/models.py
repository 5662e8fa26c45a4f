"""Model shape presets and Hugging Face config reading: which shapes to tune for a model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """The dims of a decoder-only transformer that set kernel shapes."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float


# From the models' published config.json files.
PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama3-8b", 4096, 14336, 32, 8, 128, 128256, 1e-5),
        ModelShape("llama3-70b", 8192, 28672, 64, 8, 128, 128256, 1e-5),
        ModelShape("llama3.2-1b", 2048, 8192, 32, 8, 64, 128256, 1e-5),
        ModelShape("llama3.2-3b", 3072, 8192, 24, 8, 128, 128256, 1e-5),
        ModelShape("qwen2.5-0.5b", 896, 4864, 14, 2, 64, 151936, 1e-6),
        ModelShape("qwen2.5-7b", 3584, 18944, 28, 4, 128, 152064, 1e-6),
        ModelShape("mistral-7b", 4096, 14336, 32, 8, 128, 32768, 1e-5),
    )
}


def from_hf_config(path: str | Path) -> ModelShape:
    """Read a Hugging Face ``config.json``; ValueError names the missing or ill-typed field."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config {path}: {exc}") from exc
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if not isinstance(cfg.get(field), int):
            raise ValueError(f"model config {path}: field {field!r} missing or not an integer")
    heads = cfg["num_attention_heads"]
    return ModelShape(
        name=path.stem if path.stem != "config" else path.parent.name or "config",
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    )


def resolve_model(name_or_path: str) -> ModelShape:
    """A preset name, or a path to a Hugging Face config.json; ValueError lists the presets otherwise."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        return from_hf_config(name_or_path)
    raise ValueError(f"unknown model {name_or_path!r}: use a preset ({', '.join(sorted(PRESETS))}) "
                     f"or a path to a Hugging Face config.json")
