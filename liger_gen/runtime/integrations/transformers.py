"""Patch transformers models in place: one table maps model families to the liger-gen replacements."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from liger_gen.nn import RMSNorm


@dataclass(frozen=True)
class NormPatch:
    """Which RMSNorm classes a family uses and the casting semantics they follow."""

    class_names: tuple[str, ...]
    casting_mode: str = "llama"
    offset: float = 0.0


# model_type (config.model_type) → its norm classes; every one below computes LlamaRMSNorm's formula
MODEL_FAMILIES: dict[str, NormPatch] = {
    "llama": NormPatch(("LlamaRMSNorm",)),
    "mistral": NormPatch(("MistralRMSNorm",)),
    "qwen2": NormPatch(("Qwen2RMSNorm",)),
    "qwen3": NormPatch(("Qwen3RMSNorm",)),
}


def _replacement(module: nn.Module, patch: NormPatch) -> RMSNorm:
    """A liger-gen RMSNorm that shares ``module``'s weight Parameter (optimizer state and device stay put)."""
    weight = module.weight
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    new = RMSNorm(weight.shape[0], eps=eps, offset=patch.offset, casting_mode=patch.casting_mode, device="meta")
    new.weight = weight
    new.train(module.training)
    return new


def apply_to(model: nn.Module, *, rms_norm: bool = True) -> nn.Module:
    """Replace the supported modules of a transformers model in place and return the model.

    Supported ``config.model_type``: llama, mistral, qwen2, qwen3. Every RMSNorm module is swapped for
    ``liger_gen.nn.RMSNorm`` holding the same ``weight`` Parameter, so the state_dict, the optimizer's
    references and the device are unchanged. Calling it twice is harmless.

    Raises:
        ValueError: the model has no ``config.model_type`` among the supported families.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"liger_gen.apply_to: model_type {model_type!r} is not supported; "
                         f"supported: {sorted(MODEL_FAMILIES)}")
    patch = MODEL_FAMILIES[model_type]
    if rms_norm:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child).__name__ in patch.class_names:
                    setattr(parent, name, _replacement(child, patch))
    return model
