"""The one registry of models: whole architectures to build with transformers, the kernel shapes of every
model (what to tune and benchmark), and Hugging Face config reading."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


@dataclass(frozen=True)
class Architecture:
    """A whole model to build with transformers: its family and the config fields that set it.

    ``family`` is ``config.model_type`` ("llama", "qwen2"); ``fields`` are the config's keyword arguments;
    ``rope`` holds transformers v5's ``rope_parameters`` (``rope_type``, ``rope_theta`` and the scaling fields),
    which ``liger_gen.training.build_config`` turns into ``rope_theta`` + ``rope_scaling`` on transformers 4.x.
    The training-step benchmark and the training example build their models from these; ``shape`` gives the
    kernel dims the tuner and the op benchmark use.
    """

    name: str
    family: str
    fields: dict[str, Any]
    rope: dict[str, Any]
    description: str = ""

    def shape(self) -> ModelShape:
        f = self.fields
        heads = f["num_attention_heads"]
        return ModelShape(self.name, f["hidden_size"], f["intermediate_size"], heads,
                          f.get("num_key_value_heads", heads), f.get("head_dim") or f["hidden_size"] // heads,
                          f["vocab_size"], f["rms_norm_eps"])


_LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)

_LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
                   max_position_embeddings=131072, tie_word_embeddings=False, hidden_act="silu",
                   attention_bias=False, mlp_bias=False)
_LLAMA31_8B_ROPE = dict(_LLAMA3_ROPE, factor=8.0, original_max_position_embeddings=8192)

#: The models built whole (the training-step benchmark, the training example, CPU tests).
ARCHITECTURES: dict[str, Architecture] = {
    m.name: m
    for m in (
        # meta-llama/Llama-3.2-1B's config.json: 1.24 B parameters with the tied embedding counted once.
        Architecture(
            "llama3.2-1b", "llama",
            dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=64, vocab_size=128256, rms_norm_eps=1e-5,
                 max_position_embeddings=131072, tie_word_embeddings=True, hidden_act="silu",
                 attention_bias=False, mlp_bias=False),
            dict(_LLAMA3_ROPE, original_max_position_embeddings=8192), description="Llama-3.2-1B"),
        # Qwen/Qwen2.5-0.5B's config.json: 494 M parameters; q/k/v projections carry a bias (Qwen2Attention
        # hard-codes it, there is no config field), head_dim = 896 / 14 = 64.
        Architecture(
            "qwen2.5-0.5b", "qwen2",
            dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=32768,
                 tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False, sliding_window=32768,
                 max_window_layers=24),
            dict(rope_type="default", rope_theta=1000000.0), description="Qwen2.5-0.5B"),
        # meta-llama/Llama-3.1-8B's config.json (hidden 4096, MLP 14336, GQA 32/8, head_dim 128, untied 128256
        # vocab, llama3 RoPE scaling factor 8): 8.03 B parameters; and with 4 of its 32 layers, an 8B-wide step
        # that fits one GPU with plain transformers (1.92 B parameters).
        Architecture("llama3-8b", "llama", _LLAMA31_8B, _LLAMA31_8B_ROPE, description="Llama-3.1-8B"),
        Architecture("llama3-8b-4l", "llama", dict(_LLAMA31_8B, num_hidden_layers=4), _LLAMA31_8B_ROPE,
                     description="Llama-3.1-8B, 4 of its 32 layers"),
        # CPU-sized models: the same code paths (GQA, tied embeddings; llama3 RoPE scaling, Qwen2's q/k/v bias)
        # at a few kB of weights; vocab 256 covers byte tokens exactly.
        Architecture(
            "tiny", "llama",
            dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, rms_norm_eps=1e-5,
                 max_position_embeddings=2048, tie_word_embeddings=True, hidden_act="silu"),
            dict(_LLAMA3_ROPE, original_max_position_embeddings=256), description="tiny Llama (CPU runs)"),
        Architecture(
            "tiny-qwen2", "qwen2",
            dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-6, max_position_embeddings=2048,
                 tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False),
            dict(rope_type="default", rope_theta=1000000.0), description="tiny Qwen2 (CPU runs)"),
    )
}

#: Every model's kernel shapes, by name: the shapes of the larger published models (from their config.json
#: files), and those of every architecture above. The one registry of model shapes.
PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama3-70b", 8192, 28672, 64, 8, 128, 128256, 1e-5),
        ModelShape("llama3.2-3b", 3072, 8192, 24, 8, 128, 128256, 1e-5),
        ModelShape("qwen2.5-7b", 3584, 18944, 28, 4, 128, 152064, 1e-6),
        ModelShape("mistral-7b", 4096, 14336, 32, 8, 128, 32768, 1e-5),
        # openai/gpt-oss-20b: 32 experts of width 2880 (intermediate_size is one expert's)
        ModelShape("gpt-oss-20b", 2880, 2880, 64, 8, 64, 201088, 1e-5),
        # Qwen/Qwen3-30B-A3B: 128 experts of width 768 (intermediate_size is one expert's), 8 per token
        ModelShape("qwen3-30b-a3b", 2048, 768, 32, 4, 128, 151936, 1e-6),
        *(a.shape() for a in ARCHITECTURES.values()),
    )
}


#: The Hugging Face config of each preset beyond its dims: (``model_type``, the fields that set its family's
#: layout, e.g. its experts). ``preset_hf_config`` adds the dims. Presets built whole take their Architecture's.
_PRESET_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-70b": ("llama", {}), "llama3.2-3b": ("llama", {}),
    "qwen2.5-7b": ("qwen2", {}), "mistral-7b": ("mistral", {}),
    "gpt-oss-20b": ("gpt_oss", dict(num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                        num_hidden_layers=48)),
}

MAX_CONFIG_BYTES = 16 * 2**20  # a config.json is a few kB


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The top-level object of a Hugging Face ``config.json``; ValueError (naming the file) if it cannot be read,
    is not a regular file of at most MAX_CONFIG_BYTES, is not JSON, or is not a JSON object."""
    from liger_gen.files import read_capped_text

    path = Path(path)
    try:
        cfg = json.loads(read_capped_text(path, MAX_CONFIG_BYTES, "model config"))
    except OSError as exc:
        raise ValueError(f"cannot read model config {path}: {exc}") from exc
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested past Python's stack
        raise ValueError(f"model config {path} is not JSON this reader can parse: {type(exc).__name__}: "
                         f"{exc}") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"model config {path} holds a JSON {type(cfg).__name__}, not an object of config fields")
    return cfg


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields of a config: its ``text_config`` where a multimodal config nests one."""
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


def preset_hf_config(name: str) -> dict[str, Any] | None:
    """The Hugging Face config fields (``model_type`` included) of a preset, for building it with transformers;
    None for a name that is not a preset."""
    if name in ARCHITECTURES:
        a = ARCHITECTURES[name]
        return {"model_type": a.family, **a.fields}
    if name not in _PRESET_FAMILIES:
        return None
    family, extra = _PRESET_FAMILIES[name]
    m = PRESETS[name]
    return {"model_type": family, "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
            "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_key_value_heads,
            "head_dim": m.head_dim, "vocab_size": m.vocab_size, "rms_norm_eps": m.rms_norm_eps, **extra}


def from_hf_config(path: str | Path) -> ModelShape:
    """Read a Hugging Face ``config.json`` (``read_hf_config``; a multimodal config's ``text_config``); ValueError
    names the file and the missing or ill-typed field. For a mixture-of-experts config (a
    ``moe_intermediate_size`` field), ``intermediate_size`` is that width: the one its experts' GLU runs at."""
    path = Path(path)
    cfg = text_config(read_hf_config(path))

    def positive(field: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model config {path}: field {field!r} is {value!r}, not a positive integer")
        return value

    width_field = "moe_intermediate_size" if cfg.get("moe_intermediate_size") is not None else "intermediate_size"
    dims = {field: positive(field, cfg.get(field))
            for field in ("hidden_size", width_field, "num_attention_heads", "vocab_size")}
    heads = dims["num_attention_heads"]
    kv_heads = positive("num_key_value_heads", cfg["num_key_value_heads"]) \
        if cfg.get("num_key_value_heads") is not None else heads
    head_dim = positive("head_dim", cfg["head_dim"]) if cfg.get("head_dim") is not None \
        else dims["hidden_size"] // heads
    if head_dim < 1:
        raise ValueError(f"model config {path}: hidden_size {dims['hidden_size']} is smaller than "
                         f"num_attention_heads {heads} and there is no head_dim")
    eps = cfg.get("rms_norm_eps", cfg.get("layer_norm_eps"))
    if eps is None:
        eps = 1e-6
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"model config {path}: field 'rms_norm_eps' is {eps!r}, not a number in (0, 1)")
    return ModelShape(
        name=path.stem if path.stem != "config" else path.parent.name or "config",
        hidden_size=dims["hidden_size"],
        intermediate_size=dims[width_field],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=dims["vocab_size"],
        rms_norm_eps=float(eps),
    )


def resolve_model(name_or_path: str) -> ModelShape:
    """A preset name, or a path to a Hugging Face config.json; ValueError lists the presets otherwise."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        return from_hf_config(name_or_path)
    raise ValueError(f"unknown model {name_or_path!r}: use a preset ({', '.join(sorted(PRESETS))}) "
                     f"or a path to a Hugging Face config.json")
