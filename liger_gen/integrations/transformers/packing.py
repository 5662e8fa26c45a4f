"""Packed sequences: a warning when a patched model is given several documents in one row (``position_ids`` that
restart, as transformers' ``DataCollatorWithFlattening`` makes them) in a configuration where transformers will not
keep the documents apart.

What transformers 5.25 does with such a batch (verified on the CPU by ``tests/test_packed_sequences.py``):

- RoPE always reads ``position_ids``, so every document is rotated from position 0; liger-gen's RoPE takes the
  same cos/sin tables, so it does too.
- The loss never crosses documents: the collator puts -100 at each document's first label, so the last token of a
  document predicts nothing.
- Attention: with ``eager``, ``sdpa`` and ``flex_attention``, ``masking_utils`` looks for restarting
  ``position_ids`` (``find_packed_sequence_indices``) only when no 2D ``attention_mask`` is given and no cache is
  used (``_preprocess_mask_arguments``: ``attention_mask is None and cache is None``). The decoder makes a
  ``DynamicCache`` whenever ``use_cache`` is on, and a call that does not pass ``use_cache`` takes
  ``config.use_cache``, True in most configs (``Trainer`` sets it to ``TrainingArguments.use_cache``, False by
  default; gradient checkpointing in training turns it off too). So a plain training loop over a fresh model mixes
  the documents unless it passes ``use_cache=False``. The flash-attention implementations find the boundaries in
  ``cu_seq_lens_q``/``_k`` and ``max_length_q``/``_k`` (the collator's ``return_flash_attn_kwargs``) or, for a batch
  of one row, in ``position_ids``, with or without a cache.
- Some families mix documents whatever the attention does (``MIXING_FAMILIES``).

Cost: the checks of the arguments and the config are host-only dictionary and attribute reads, done only for calls
with labels and skipped under ``torch.compile``. Only when they find a configuration that would mix documents are
the values of ``position_ids`` read: on every such call while ``position_ids`` is a CPU tensor (as a data loader
gives it; no device sync), and only on the first such call per model when it is on an accelerator (one
device-to-host sync per model, never per step). After the warning, nothing more is checked for that model.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn

# model_type → why its documents mix in transformers 5.25 whatever ``use_cache`` and the attention mask are (found
# by changing one document and watching the logits of the next, tests/test_packed_sequences.py)
MIXING_FAMILIES: dict[str, str] = {
    "gpt_oss": "GPT-OSS builds its attention masks without position_ids, so eager and sdpa attention never see "
               "the document boundaries (flash-attention finds them in position_ids or cu_seq_lens_q)",
    "deepseek_v4": "DeepSeek-V4's compressed-attention layers pool keys across document boundaries",
    "falcon_h1": "Falcon-H1's Mamba-2 layers carry their state across document boundaries",
    "lfm2": "LFM2's short-convolution layers reach across document boundaries",
    "lfm2_moe": "LFM2-MoE's short-convolution layers reach across document boundaries",
    "minimax": "MiniMax's lightning (linear) attention layers carry their state across document boundaries",
    "qwen3_next": "Qwen3-Next's gated-delta-rule (linear attention) layers carry their state across document "
                  "boundaries (unless cu_seq_lens_q reaches the flash-linear-attention kernels on a GPU)",
    "qwen3_5_text": "Qwen3.5's gated-delta-rule (linear attention) layers carry their state across document "
                    "boundaries (unless cu_seq_lens_q reaches the flash-linear-attention kernels on a GPU)",
    "qwen3_5_moe_text": "Qwen3.5-MoE's gated-delta-rule (linear attention) layers carry their state across "
                        "document boundaries (unless cu_seq_lens_q reaches the flash-linear-attention kernels on a "
                        "GPU)",
}


class PackedSequenceWarning(UserWarning):
    """A patched model got packed documents that transformers will not keep apart (``warn_if_mixed``)."""


_FLASH_SEPARATES = ("gpt_oss",)  # of MIXING_FAMILIES, those whose documents flash-attention keeps apart
_LINEAR_ATTENTION = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # they take cu_seq_lens_q
_MASK_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")  # masking_utils' packed detection serves these

_checked: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()  # model → done with it


def _argument(named: dict, extra: dict, *names: str):
    """The first of ``names`` given (not None) as a named argument or in ``**kwargs``."""
    for name in names:
        value = named.get(name, extra.get(name))
        if value is not None:
            return value
    return None


def mixing_reason(model: nn.Module, named: dict, extra: dict) -> tuple[str, str] | None:
    """(why, what to do) when transformers will not keep packed documents apart in this call of ``model``; None
    when it will, when the call gives no (batch, seq) ``position_ids`` (multimodal RoPE's 3D ones step by more
    than 1 within an image), or a prepared (4D or per-layer) mask, or when the
    attention implementation is not one whose behaviour is known. Reads arguments and the config only."""
    position_ids = named.get("position_ids", extra.get("position_ids"))
    mask = _argument(named, extra, "attention_mask")
    if not torch.is_tensor(position_ids) or position_ids.dim() != 2:
        return None
    if mask is not None and (not torch.is_tensor(mask) or mask.dim() != 2):
        return None
    config = model.config  # a multimodal model's text stack reads its text config
    config = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    model_type = getattr(config, "model_type", "")
    attention = getattr(config, "_attn_implementation", None) or "eager"
    flash = attention.startswith("flash_attention")
    varlen = _argument(named, extra, "cu_seq_lens_q") is not None
    if model_type in MIXING_FAMILIES and not (flash and model_type in _FLASH_SEPARATES) \
            and not (varlen and model_type in _LINEAR_ATTENTION):
        return MIXING_FAMILIES[model_type], "train this family on padded batches (one document per row)"
    if flash:
        rows = _argument(named, extra, "input_ids", "inputs_embeds")
        if varlen or (rows if rows is not None else position_ids).shape[0] == 1:
            return None
        return ("flash-attention reads document boundaries from position_ids only for a batch of one row",
                "pack into one row, or pass DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s "
                "cu_seq_lens_q/cu_seq_lens_k/max_length_q/max_length_k")
    if attention not in _MASK_IMPLEMENTATIONS:
        return None
    if mask is not None:
        return (f"an attention_mask is given, so transformers' {attention} attention masks padding only and does not "
                "look for restarting position_ids",
                "leave attention_mask out of packed batches (DataCollatorWithFlattening gives none)")
    use_cache = _argument(named, extra, "use_cache")
    use_cache = getattr(config, "use_cache", False) if use_cache is None else use_cache
    base = getattr(model, "base_model", model)
    base = getattr(base, "language_model", base)  # a multimodal model's text stack makes the cache
    if getattr(base, "gradient_checkpointing", False) and base.training and torch.is_grad_enabled():
        use_cache = False  # transformers turns the cache off under gradient checkpointing in training
    if use_cache or _argument(named, extra, "cache", "past_key_values") is not None:
        return (f"a cache is used (use_cache is on, from the call or from config.use_cache), and with a cache "
                f"transformers' {attention} attention does not look for restarting position_ids",
                "pass use_cache=False to the forward or set model.config.use_cache = False (transformers' Trainer "
                "does: TrainingArguments.use_cache defaults to False)")
    return None


def _restarts(position_ids: torch.Tensor) -> bool:
    """Whether positions restart within a row (transformers' test: a step other than +1)."""
    return position_ids.shape[-1] > 1 and bool((torch.diff(position_ids, dim=-1) != 1).any())


def warn_if_mixed(model: nn.Module, named: dict, extra: dict) -> None:
    """Warn, once per model, when a call with labels gives packed documents that transformers will not keep apart
    (see the module docstring for what is checked and what it costs)."""
    if torch.compiler.is_compiling() or named.get("labels") is None or model in _checked:
        return
    reason = mixing_reason(model, named, extra)
    if reason is None:
        return
    position_ids = named.get("position_ids", extra.get("position_ids"))
    if position_ids.device.type != "cpu":
        _checked[model] = True  # one device-to-host read per model, on its first such call
    if not _restarts(position_ids):
        return
    _checked[model] = True
    why, fix = reason
    warnings.warn(f"liger-gen: {type(model).__name__} got packed sequences (position_ids restart within a row, as "
                  f"DataCollatorWithFlattening makes them), but transformers will not keep the documents apart: "
                  f"{why}. Tokens then see the earlier documents of their row, so the loss and gradients are "
                  f"not those of the documents trained separately. To fix: {fix}.", PackedSequenceWarning,
                  stacklevel=6)  # the caller of model(...): this, the fused forward, its object, nn.Module's two
