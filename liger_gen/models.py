"""The one registry of models: whole architectures to build with transformers, the kernel shapes of every
model (what to tune and benchmark), and Hugging Face config reading."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """The dims of a decoder-only transformer that set kernel shapes. ``rotary_dim``: the leading dims of each
    head that RoPE rotates, the width of transformers' cos/sin tables for ``partial_rotary_factor``
    (``rotary_width``; None: all of ``head_dim``)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rotary_dim: int | None = None


def reads_partial_rotary(model_type: Any) -> bool:
    """Whether transformers' modeling code of ``model_type`` reads ``partial_rotary_factor`` (GLM-4, Phi-3,
    Nemotron, Qwen 3.5 do; Llama, Mistral, Qwen 2 rotate all of head_dim whatever the config says): whether the
    installed release's ``modeling_<model_type>.py`` names the field, found without importing it. True where
    that cannot be told (no transformers, a model type without such a file)."""
    import importlib.util

    if not isinstance(model_type, str) or not model_type.isidentifier():
        return True
    try:
        spec = importlib.util.find_spec(f"transformers.models.{model_type}.modeling_{model_type}")
    except (ImportError, ValueError):
        return True
    if spec is None or not spec.origin:
        return True
    try:
        return "partial_rotary_factor" in Path(spec.origin).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return True


def rotary_width(head_dim: int, factor: float) -> int:
    """The width of the cos/sin tables transformers builds for ``partial_rotary_factor`` ``factor``: one angle per
    pair of ``int(head_dim · factor)`` dims, each twice (an odd count rounds up), at most ``head_dim``."""
    return min(head_dim, 2 * ((int(head_dim * factor) + 1) // 2))


@dataclass(frozen=True)
class VisionTower:
    """The image side of a vision-language Architecture (Qwen2.5-VL's layout): its vision tower's config fields
    (``vision_config``), the special token ids of its text stack, and the image each training sample carries.

    ``image_size`` is (height, width) in pixels, a multiple of ``patch_size · spatial_merge_size`` both ways (the
    size the processor resizes to); the image becomes ``grid_thw = (1, height / patch, width / patch)`` patches
    and ``image_tokens = h · w / merge²`` placeholder tokens in the text (448 x 448: 32 x 32 patches, 256 tokens).
    """

    fields: dict[str, Any]
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    image_size: tuple[int, int] = (448, 448)

    def __post_init__(self) -> None:
        step = self.fields["patch_size"] * self.fields["spatial_merge_size"]
        if any(side < step or side % step for side in self.image_size):
            raise ValueError(f"image_size {self.image_size}: each side must be a positive multiple of patch_size x "
                             f"spatial_merge_size = {step} pixels")

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """(temporal, height, width) patches of one image: what ``image_grid_thw`` holds per image."""
        patch = self.fields["patch_size"]
        return 1, self.image_size[0] // patch, self.image_size[1] // patch

    @property
    def image_tokens(self) -> int:
        """The placeholder tokens of one image in the text: its patches over the spatial merge (merge² per token)."""
        t, h, w = self.grid_thw
        return t * h * w // self.fields["spatial_merge_size"] ** 2

    @property
    def patch_dim(self) -> int:
        """The width of one row of ``pixel_values``: channels · temporal_patch_size · patch_size²."""
        f = self.fields
        return f.get("in_channels", 3) * f["temporal_patch_size"] * f["patch_size"] ** 2

    def config_fields(self) -> dict[str, Any]:
        """The top-level config fields of the image side: ``vision_config`` and the special token ids."""
        return {"vision_config": dict(self.fields), "image_token_id": self.image_token_id,
                "video_token_id": self.video_token_id, "vision_start_token_id": self.vision_start_token_id,
                "vision_end_token_id": self.vision_end_token_id}


@dataclass(frozen=True)
class Architecture:
    """A whole model to build with transformers: its family and the config fields that set it.

    ``family`` is ``config.model_type`` ("llama", "qwen2", "glm4_moe", "qwen2_5_vl"); ``fields`` are the keyword
    arguments of its (text) config; ``rope`` holds transformers v5's ``rope_parameters`` (``rope_type``,
    ``rope_theta`` and the scaling fields), which ``liger_gen.training.build_config`` turns into ``rope_theta`` +
    ``rope_scaling`` on transformers 4.x. ``vision``: a vision-language model's image side, whose ``fields`` are
    then its ``text_config`` (see :meth:`hf_fields`). The training-step benchmark and the training example build
    their models from these; ``shape`` gives the kernel dims the tuner and the op benchmark use.
    """

    name: str
    family: str
    fields: dict[str, Any]
    rope: dict[str, Any]
    description: str = ""
    vision: VisionTower | None = None

    def shape(self) -> ModelShape:
        """The text stack's kernel dims; for a mixture-of-experts model (a ``moe_intermediate_size`` field) the
        intermediate size is the experts' width, as ``from_hf_config`` reads it."""
        f = self.fields
        heads = f["num_attention_heads"]
        head_dim = f.get("head_dim") or f["hidden_size"] // heads
        factor = self.rope.get("partial_rotary_factor")
        return ModelShape(self.name, f["hidden_size"], f.get("moe_intermediate_size") or f["intermediate_size"],
                          heads, f.get("num_key_value_heads", heads), head_dim, f["vocab_size"], f["rms_norm_eps"],
                          rotary_dim=rotary_width(head_dim, factor) if factor is not None else None)

    def vision_shape(self) -> ModelShape | None:
        """The vision tower's kernel dims, as the preset ``<name>-vision``: its width (the RMSNorms'), its MLP width
        (the gated MLPs'), its heads (as many key/value heads) and head_dim (the 2-D RoPE rotates all of it); the
        vocabulary is the text stack's (no LM head runs in the tower). None without a vision tower."""
        if self.vision is None:
            return None
        f = self.vision.fields
        return ModelShape(f"{self.name}-vision", f["hidden_size"], f["intermediate_size"], f["num_heads"],
                          f["num_heads"], f["hidden_size"] // f["num_heads"], self.fields["vocab_size"], 1e-6)

    def hf_fields(self) -> dict[str, Any]:
        """The config's keyword arguments without RoPE: ``fields``, or for a vision-language model
        ``text_config=fields`` beside the image side's fields (the embedding tie is the outer config's)."""
        if self.vision is None:
            return dict(self.fields)
        text = dict(self.fields)
        tie = text.pop("tie_word_embeddings", False)
        return {"text_config": text, **self.vision.config_fields(), "tie_word_embeddings": tie}


_LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)

_LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
                   max_position_embeddings=131072, tie_word_embeddings=False, hidden_act="silu",
                   attention_bias=False, mlp_bias=False)
_LLAMA31_8B_ROPE = dict(_LLAMA3_ROPE, factor=8.0, original_max_position_embeddings=8192)

_QWEN25_VL_7B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4, num_attention_heads=28,
                          num_key_value_heads=4, vocab_size=152064, rms_norm_eps=1e-6, max_position_embeddings=128000,
                          tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False, sliding_window=32768)
_QWEN25_VL_ROPE = dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24])
_QWEN25_VL_7B_VISION = VisionTower(
    dict(depth=4, hidden_size=1280, intermediate_size=3420, num_heads=16, hidden_act="silu", in_channels=3,
         patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112, fullatt_block_indexes=[3],
         out_hidden_size=3584, tokens_per_second=2),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    image_size=(448, 448))
_GLM45_AIR = dict(hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552, rms_norm_eps=1e-5,
                  max_position_embeddings=131072, tie_word_embeddings=False, hidden_act="silu", attention_bias=True,
                  n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1,
                  norm_topk_prob=True, routed_scaling_factor=1.0, n_group=1, topk_group=1, use_qk_norm=False)
_GLM45_AIR_ROPE = dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.5)
# the toy widths of the CPU models
_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)

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
        # Qwen/Qwen2.5-VL-7B-Instruct's config.json, 4 of its 28 decoder layers and 4 of its 32 vision blocks (every
        # 8th block of the 32 attends over the whole image, the others in 112-pixel windows: block 3 of 4 here):
        # text 3584 wide, MLP 18944, GQA 28/4, head_dim 128, untied 152064 vocab, M-RoPE sections 16/24/24; vision
        # tower 1280 wide, MLP 3420, 16 heads, 14-pixel patches, 2x2 merge into 3584; one 448 x 448 image per
        # sample: 32 x 32 patches, 256 image tokens.
        Architecture("qwen2.5-vl-7b-4l", "qwen2_5_vl", _QWEN25_VL_7B_TEXT, _QWEN25_VL_ROPE,
                     description="Qwen2.5-VL-7B, 4 of its 28 decoder layers and 4 of its 32 vision blocks",
                     vision=_QWEN25_VL_7B_VISION),
        # zai-org/GLM-4.5-Air's config.json (transformers' Glm4MoeConfig defaults hold the same dims), 4 of its 46
        # layers: layer 0 dense (MLP 10944), layers 1-3 of 128 routed experts of width 1408, 8 per token, plus one
        # shared expert; hidden 4096, 96 query / 8 KV heads of head_dim 128 (set: 4096 / 96 is not 128), q/k/v
        # bias, RoPE over half of each head (partial_rotary_factor 0.5), untied 151552 vocab: 8.51 B parameters,
        # 6.64 B of them routed experts (bf16 weights, gradients and AdamW state: 68 GB).
        Architecture("glm4.5-air-4l", "glm4_moe", _GLM45_AIR, _GLM45_AIR_ROPE,
                     description="GLM-4.5-Air, 4 of its 46 layers (1 dense, 3 of 128 experts)"),
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
        # the two above at toy widths: Qwen2.5-VL's vision tower (a windowed and a full-attention block, 2x2 merge) on
        # a 56 x 112 image (4 x 8 patches, 8 image tokens, two windows), and GLM-4.5-Air's dense layer then a layer
        # of 8 experts
        Architecture("tiny-qwen2.5-vl", "qwen2_5_vl",
                     dict(_TINY_TEXT, rms_norm_eps=1e-6, vocab_size=264, bos_token_id=None, eos_token_id=None),
                     dict(_QWEN25_VL_ROPE, mrope_section=[2, 3, 3]), description="tiny Qwen2.5-VL (CPU runs)",
                     vision=VisionTower(dict(_QWEN25_VL_7B_VISION.fields, depth=2, hidden_size=32, intermediate_size=48,
                                             num_heads=2, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1]),
                                        image_token_id=258, video_token_id=259, vision_start_token_id=256,
                                        vision_end_token_id=257, image_size=(56, 112))),
        Architecture("tiny-glm4.5-air", "glm4_moe",
                     dict(_GLM45_AIR, **_TINY_TEXT, vocab_size=256, moe_intermediate_size=32, n_routed_experts=8,
                          num_experts_per_tok=2),
                     _GLM45_AIR_ROPE, description="tiny GLM-4.5-Air (CPU runs)"),
    )
}

#: Every model's kernel shapes, by name: the shapes of the larger published models (from their config.json
#: files), and those of every architecture above (and of its vision tower, ``<name>-vision``). The one registry
#: of model shapes.
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
        *(a.vision_shape() for a in ARCHITECTURES.values() if a.vision is not None),
    )
}
#: The presets of vision towers (``Architecture.vision_shape``) and the ops ``apply_to`` runs there.
VISION_PRESETS = frozenset(a.vision_shape().name for a in ARCHITECTURES.values() if a.vision is not None)
VISION_OPS = ("rms_norm", "rope", "swiglu")


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
        return {"model_type": a.family, **a.hf_fields()}
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
    ``moe_intermediate_size`` field), ``intermediate_size`` is that width: the one its experts' GLU runs at.
    ``partial_rotary_factor`` (in ``rope_parameters``, else in ``rope_scaling``, else at the top level, the order
    transformers reads them in) sets ``rotary_dim`` where the family's modeling code reads it
    (``reads_partial_rotary``)."""
    path = Path(path)
    top = read_hf_config(path)
    cfg = text_config(top)

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
    # where transformers 5 reads it: rope_parameters, else the legacy rope_scaling, else the top level
    factor = next((c["partial_rotary_factor"] for c in (cfg.get("rope_parameters"), cfg.get("rope_scaling"), cfg)
                   if isinstance(c, dict) and c.get("partial_rotary_factor") is not None), None)
    if factor is not None and not reads_partial_rotary(top.get("model_type")):
        factor = None  # a family that rotates all of head_dim whatever the field says
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                               or not 0 < factor <= 1 or int(head_dim * factor) < 1):
        raise ValueError(f"model config {path}: field 'partial_rotary_factor' is {factor!r}, not a number in (0, 1] "
                         f"that leaves at least one of head_dim {head_dim} to rotate")
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
        rotary_dim=rotary_width(head_dim, factor) if factor is not None and factor < 1 else None,
    )


def resolve_model(name_or_path: str) -> ModelShape:
    """A preset name, or a path to a Hugging Face config.json; ValueError lists the presets otherwise."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        return from_hf_config(name_or_path)
    raise ValueError(f"unknown model {name_or_path!r}: use a preset ({', '.join(sorted(PRESETS))}) "
                     f"or a path to a Hugging Face config.json")
