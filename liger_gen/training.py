"""What a training run is built from: a transformers model of the model registry, batches of byte tokens, AdamW,
one training step, and the check that two runs' loss curves agree.

The training-step benchmark (``liger-gen bench-step``), the training examples (``liger_gen.examples``) and
``liger-gen build --model`` build their models here, so every one of them trains the same model on the same
batches: ``build_model(name, device, dtype, seed)`` draws the weights in float32 right after
``torch.manual_seed(seed)``; ``make_batches(byte_tokens(text), steps, batch_size, seq_len, seed)`` draws the
windows from a generator seeded with ``seed``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from liger_gen.files import read_capped_bytes
from liger_gen.models import ARCHITECTURES, Architecture

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"
#: The most bytes of training text read (--text). The default text is 1.1 MB and the steps read windows of it at
#: random offsets, so more text adds variety, not work; every byte becomes an int64 token, so 64 MiB of text is
#: 512 MiB of host memory.
MAX_TEXT_BYTES = 64 * 2**20

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

#: transformers' config and causal-LM classes of each family ``ARCHITECTURES`` holds (a vision-language family's
#: ``*ForConditionalGeneration``: images and text in, the text stack's loss out)
FAMILY_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                  "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
                  "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")}


# --------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------


def _transformers():
    from liger_gen.optional import require

    return require("transformers", "the training-step benchmark")


def _transformers_major() -> int:
    transformers = _transformers()

    return int(transformers.__version__.split(".")[0])


def lm_class(config):
    """transformers' auto class whose ``from_config(config)`` builds ``config``'s model with its language-modelling
    head: ``AutoModelForImageTextToText`` for a vision-language config (its ``*ForConditionalGeneration``, images
    and text in), else ``AutoModelForCausalLM``."""
    transformers = _transformers()
    image_text = getattr(transformers, "AutoModelForImageTextToText", None)
    if image_text is not None and type(config) in image_text._model_mapping:
        return image_text
    return transformers.AutoModelForCausalLM


def architecture(name: str) -> Architecture:
    """``ARCHITECTURES[name]``; ValueError for an unknown name (listing the known ones)."""
    if name not in ARCHITECTURES:
        raise ValueError(f"models: unknown model {name!r}; known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def build_config(name: str, attn_implementation: str = "sdpa"):
    """The transformers config of ``ARCHITECTURES[name]`` with ``use_cache=False`` and the attention backend.

    Raises ValueError for an unknown name (listing the known ones).
    """
    spec = architecture(name)
    transformers = _transformers()

    config_cls = getattr(transformers, FAMILY_CLASSES[spec.family][0])
    kwargs = spec.hf_fields()
    text = kwargs["text_config"] if spec.vision is not None else kwargs  # where RoPE and the cache are set
    if _transformers_major() >= 5:
        text["rope_parameters"] = dict(spec.rope)
    else:  # transformers 4.x: rope_theta (and partial_rotary_factor) at top level, scaling (if any) in rope_scaling
        rope = dict(spec.rope)
        text["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:
            text["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        if rope.get("rope_type", "default") != "default" or "mrope_section" in rope:
            text["rope_scaling"] = rope
    if spec.vision is not None:
        text["use_cache"] = False
    return config_cls(**kwargs, use_cache=False, attn_implementation=attn_implementation)


def build_model(name: str, device: torch.device | str, dtype: torch.dtype, seed: int,
                attn_implementation: str = "sdpa"):
    """A randomly initialised ``*ForCausalLM`` of ``name`` on ``device`` with ``dtype`` parameters, train mode.

    The weights are drawn in float32 on ``device`` right after ``torch.manual_seed(seed)`` and then cast, so
    the same (seed, device) gives the same weights.
    """
    spec = architecture(name)
    transformers = _transformers()

    config = build_config(name, attn_implementation)
    model_cls = getattr(transformers, FAMILY_CLASSES[spec.family][1])
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    model = model.to(dtype=dtype)
    model.train()
    return model


def _liger_kernel_glm4_moe(model=None):
    """Liger-Kernel's modules on a GLM-4.5 (``glm4_moe``) causal LM, composed as Liger-Kernel's own
    ``apply_liger_kernel_to_glm4v_moe`` composes them on GLM-4.5V's text stack, which has the same decoder layer:
    ``LigerRMSNorm`` (GLM's settings: offset 0, llama casting) on every RMSNorm (the attention's q and k norms
    too where ``use_qk_norm`` gives them, as its Qwen3-MoE patch patches those), ``LigerExperts`` (its fused MoE)
    on the routed experts, ``LigerSwiGLUMLP`` on the shared experts and the dense layers' MLPs, and its GLM-4
    fused linear cross-entropy forward; RoPE stays transformers' (Liger-Kernel has none for GLM's partial rotary
    dims). Liger-Kernel 0.8 ships no ``apply_liger_kernel_to_glm4_moe``; this is the patch its GLM-4.5V one
    implies for the text model. ``model`` is required (an instance is patched, not the modeling module)."""
    from types import MethodType

    from liger_kernel.transformers.model.glm4 import lce_forward
    from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module, _patch_swiglu_module
    from liger_kernel.transformers.swiglu import LigerExperts, LigerSwiGLUMLP

    if model is None:
        raise ValueError("Liger-Kernel's glm4_moe composition patches a model instance: pass model=")
    if model.config.hidden_act not in ("silu", "swish"):  # its fused MoE and SwiGLU compute SiLU whatever it says
        raise ValueError(f"Liger-Kernel's SwiGLU modules compute SiLU; this model's hidden_act is "
                         f"{model.config.hidden_act!r}")
    base = model.model
    _patch_rms_norm_module(base.norm)
    for layer in base.layers:
        _patch_rms_norm_module(layer.input_layernorm)
        _patch_rms_norm_module(layer.post_attention_layernorm)
        for name in ("q_norm", "k_norm"):  # GLM-4.5's (use_qk_norm=True); GLM-4.5-Air has none
            if getattr(layer.self_attn, name, None) is not None:
                _patch_rms_norm_module(getattr(layer.self_attn, name))
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            _patch_swiglu_module(layer.mlp, LigerSwiGLUMLP)
            continue
        _patch_swiglu_module(experts, LigerExperts)
        _patch_swiglu_module(layer.mlp.shared_experts, LigerSwiGLUMLP)
    model.forward = MethodType(lce_forward, model)


#: model types Liger-Kernel ships no ``apply_liger_kernel_to_<model_type>`` for, patched with its own modules the
#: way its patch of the closest family composes them (each function's docstring says which)
LIGER_KERNEL_COMPOSED = {"glm4_moe": _liger_kernel_glm4_moe}


def liger_kernel_apply(family: str):
    """Liger-Kernel's ``liger_kernel.transformers.apply_liger_kernel_to_<family>``, else its modules composed for
    ``family`` (``LIGER_KERNEL_COMPOSED``), or None where neither exists. ImportError without Liger-Kernel."""
    import liger_kernel.transformers as liger_transformers

    return getattr(liger_transformers, f"apply_liger_kernel_to_{family}", None) or LIGER_KERNEL_COMPOSED.get(family)


def liger_kernel_unsupported(family: str) -> str | None:
    """Why Liger-Kernel cannot patch a model of ``family`` (its ``config.model_type``), or None when it can."""
    try:
        apply = liger_kernel_apply(family)
    except ImportError as exc:
        return f"liger-kernel cannot be imported ({exc}; pip install liger-kernel)"
    if apply is None:
        from liger_gen.optional import installed_version

        version = installed_version("liger-kernel") or installed_version("liger_kernel") or "(version unknown)"
        return (f"Liger-Kernel {version} has no patch for model_type {family!r} "
                f"(no liger_kernel.transformers.apply_liger_kernel_to_{family})")
    return None


def apply_liger_kernel(model, family: str):
    """Liger-Kernel's ``apply_liger_kernel_to_<family>(model=model)`` with its defaults (rope, rms_norm, swiglu,
    fused_linear_cross_entropy), or for a family of ``LIGER_KERNEL_COMPOSED`` its modules composed as that
    function's docstring says. ValueError where Liger-Kernel has neither (:func:`liger_kernel_unsupported` says
    why)."""
    apply = liger_kernel_apply(family)
    if apply is None:
        raise ValueError(liger_kernel_unsupported(family))
    apply(model=model)
    return model


# --------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------


def read_text_bytes(path: str | Path = DEFAULT_TEXT) -> bytes:
    """The bytes of the training text at ``path`` (any encoding: the tokens are its bytes). ValueError naming the
    path if it cannot be read, is not a regular file (a FIFO, a device such as /dev/zero), is larger than
    MAX_TEXT_BYTES or is empty."""
    try:
        data = read_capped_bytes(path, MAX_TEXT_BYTES, "training text")
    except OSError as exc:
        raise ValueError(f"cannot read training text {path}: {exc.strerror or exc}") from exc
    if not data:
        raise ValueError(f"training text {path} is empty")
    return data


def byte_tokens(path: str | Path = DEFAULT_TEXT) -> torch.Tensor:
    """The file's bytes as an int64 token stream (ids 0..255); ValueError as :func:`read_text_bytes`."""
    return torch.frombuffer(bytearray(read_text_bytes(path)), dtype=torch.uint8).to(torch.int64)


def make_batches(tokens: torch.Tensor, steps: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[steps, batch_size, seq_len]`` int64 windows of ``tokens`` at uniformly random offsets.

    Offsets come from a ``torch.Generator`` seeded with ``seed``, so every run (and every provider) sees the same
    batches in the same order. Raises ValueError if the stream is shorter than one window.
    """
    n = tokens.numel()
    if n < seq_len:
        raise ValueError(
            f"the token stream has {n} tokens (one per byte of the training text), fewer than --seq-len "
            f"{seq_len}; name a longer --text file or a shorter --seq-len"
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - seq_len + 1, (steps, batch_size), generator=gen)
    return tokens[starts.unsqueeze(-1) + torch.arange(seq_len)]


# --------------------------------------------------------------------------------------------------------------
# Training step
# --------------------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, optimizer, input_ids: torch.Tensor | Mapping[str, torch.Tensor], scheduler=None) -> torch.Tensor:
    """One causal-LM training step on ``input_ids`` (B, T): forward with ``labels=input_ids`` (transformers shifts
    them), backward, optimizer (and ``scheduler``) step, gradients cleared. ``input_ids`` may instead be a mapping
    of model inputs with their ``labels`` (a vision-language batch: ``pixel_values``, ``image_grid_thw``, ...),
    passed as they are. Returns the loss, detached, on the device (no host sync)."""
    loss = step_loss(model, input_ids)
    loss.backward()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def step_loss(model, batch: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The loss of ``batch`` (token ids, their own labels; or a mapping of model inputs with ``labels``), not yet
    backpropagated."""
    if isinstance(batch, Mapping):
        return model(**batch).loss
    return model(input_ids=batch, labels=batch).loss


OPTIMIZERS = ("torch", "liger-gen")


def make_optimizer(model, lr: float, device: torch.device, kind: str = "torch"):
    """AdamW over ``model``'s parameters: torch's fused implementation where the build has it (CUDA always), or
    with ``kind="liger-gen"`` ``liger_gen.optim.AdamW``. ValueError for another ``kind``."""
    if kind == "liger-gen":
        from liger_gen.optim import AdamW

        return AdamW(model.parameters(), lr=lr)
    if kind != "torch":
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {kind!r}")
    try:
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    except RuntimeError:
        if device.type == "cuda":
            raise
        return torch.optim.AdamW(model.parameters(), lr=lr)  # a CPU build without fused AdamW for this dtype


# --------------------------------------------------------------------------------------------------------------
# Loss-curve check
# --------------------------------------------------------------------------------------------------------------


def loss_rel_tolerance(dtype: torch.dtype | str) -> float:
    """Per-step relative tolerance between a provider's loss curve and plain transformers'.

    bfloat16 / float16: the dtype's machine epsilon (bf16: 2**-7 = 7.8e-3; fp16: 2**-10). Every provider runs
    the same model with bf16 weights and activations; they differ only in rounding (fused kernels keep fp32 where
    transformers rounds to bf16, e.g. FLCE's fp32 logits) and summation order. bf16 numbers near a value x are
    spaced 2**-8·|x| to 2**-7·|x| apart, so a difference below eps·|x| is at most two bf16 steps (ulps) at the
    loss's magnitude: the curves agree to the precision the model is trained in. A change in what the model
    computes (a wrong gradient, a wrong norm) moves the curve by more once a few updates have been applied.
    float32: 1e-5 (see tests/test_train_example.py for that bound's derivation).
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if dtype in (torch.bfloat16, torch.float16):
        return float(torch.finfo(dtype).eps)
    if dtype == torch.float32:
        return 1e-5
    raise ValueError(f"dtype: expected bfloat16, float16 or float32, got {dtype}")


def compare_losses(losses: Sequence[float | None], reference: Sequence[float | None], rel_tol: float,
                   reference_name: str = "transformers") -> dict[str, Any]:
    """Compare two per-step loss curves: first-step, mean and max relative differences and a pass flag.

    ``pass`` is True when the curves have the same length, every loss of both is finite, the first step's
    relative difference (one forward from identical weights: the kernels' numerics alone) is <= ``rel_tol``, and
    so is the mean over all steps of ``|loss - ref| / |ref|``. ``diff`` holds the per-step ``loss - ref`` (nats),
    ``max_abs_diff`` / ``mean_abs_diff`` its largest and mean magnitude. The max is reported, not judged: two bf16
    training runs that differ only in rounding drift apart step by step (measured on an H200, 2026-11-30:
    Liger-Kernel vs transformers at Llama-3.2-1B, 8 steps, lr 3e-4: first step 3e-5, max 1.3e-2, mean 3.5e-3),
    so a per-step bound would fail correct kernels, while a systematic error shows in the first step or the
    mean. Non-finite losses give None differences and ``pass: False``. Raises ValueError if ``rel_tol`` is not
    positive.
    """
    if not rel_tol > 0:
        raise ValueError(f"rel_tol must be > 0, got {rel_tol}")
    out: dict[str, Any] = {"reference": reference_name, "rel_tol": rel_tol, "max_rel_diff": None,
                           "mean_rel_diff": None, "max_abs_diff": None, "mean_abs_diff": None,
                           "first_step_rel_diff": None, "diff": [], "pass": False}
    if len(losses) != len(reference) or not losses:
        out["reason"] = f"{len(losses)} losses vs {len(reference)} reference losses"
        return out
    vals = [x if x is not None else math.nan for x in losses]
    refs = [x if x is not None else math.nan for x in reference]
    if not all(math.isfinite(x) for x in vals + refs):
        out["reason"] = "non-finite loss"
        return out
    out["diff"] = [a - b for a, b in zip(vals, refs)]
    rel = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(vals, refs)]
    out["max_rel_diff"] = max(rel)
    out["max_abs_diff"] = max(abs(d) for d in out["diff"])
    out["mean_abs_diff"] = sum(abs(d) for d in out["diff"]) / len(rel)
    out["mean_rel_diff"] = sum(rel) / len(rel)
    out["first_step_rel_diff"] = rel[0]
    out["pass"] = rel[0] <= rel_tol and out["mean_rel_diff"] <= rel_tol
    return out
