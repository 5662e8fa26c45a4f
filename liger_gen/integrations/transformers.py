"""Patch transformers models in place: one table maps model families to the liger-gen replacements.

What ``apply_to`` replaces, per model family (``config.model_type``):

- **RMSNorm modules** → ``liger_gen.nn.RMSNorm`` holding the same ``weight`` Parameter (every family below
  computes LlamaRMSNorm's formula; Qwen3's per-head q/k norms included).
- **The SwiGLU MLP** (``LlamaMLP`` and its copies, when ``config.hidden_act`` is SiLU) →
  ``liger_gen.nn.SwiGLUMLP`` holding the same three ``nn.Linear`` modules.
- **RoPE**: the family's ``apply_rotary_pos_emb`` function → ``liger_gen.functional.rope`` (wrapped to keep
  transformers' signature). Attention modules
  call that function through their modeling module's globals, so this patch is process-wide: every model of
  that family in the process uses it afterwards (the function computes the same values);
  ``restore_rope()`` puts transformers' functions back.
- **The LM-head loss**: in training mode with ``labels``, the causal-LM ``forward`` computes the loss with
  ``liger_gen.functional.fused_linear_cross_entropy`` from the last hidden states and ``lm_head.weight``,
  without materialising the logits (``outputs.logits`` is None then). The loss equals transformers'
  ``ForCausalLMLoss``: labels shifted left, ``ignore_index=-100``, mean over non-ignored tokens, or a sum
  divided by ``num_items_in_batch`` when the trainer passes it. In eval mode, or without labels, the original
  forward runs and returns logits (also with ``use_cache=True``). ``return_dict=False`` gives a tuple, as in
  transformers.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from liger_gen.nn import RMSNorm


@dataclass(frozen=True)
class ModelFamily:
    """Where a family's modeling code lives and which of its classes liger-gen replaces."""

    modeling_module: str
    norm_classes: tuple[str, ...]
    mlp_classes: tuple[str, ...]
    causal_lm_classes: tuple[str, ...]
    casting_mode: str = "llama"
    offset: float = 0.0


def _family(name: str, prefix: str) -> ModelFamily:
    return ModelFamily(f"transformers.models.{name}.modeling_{name}", (f"{prefix}RMSNorm",), (f"{prefix}MLP",),
                       (f"{prefix}ForCausalLM",))


# model_type (config.model_type) → its modeling module and classes; all four compute LlamaRMSNorm's formula,
# the SwiGLU MLP and transformers' rotate_half RoPE.
MODEL_FAMILIES: dict[str, ModelFamily] = {
    "llama": _family("llama", "Llama"),
    "mistral": _family("mistral", "Mistral"),
    "qwen2": _family("qwen2", "Qwen2"),
    "qwen3": _family("qwen3", "Qwen3"),
}

_SILU = ("silu", "swish")
_original_rope: dict[str, object] = {}  # modeling module name → transformers' apply_rotary_pos_emb
_patched_rope: dict[str, object] = {}  # modeling module name → its liger-gen wrapper (one object, so it pickles)


def _replace_norm(module: nn.Module, family: ModelFamily) -> RMSNorm:
    """A liger-gen RMSNorm that shares ``module``'s weight Parameter (optimizer state and device stay put)."""
    weight = module.weight
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    new = RMSNorm(weight.shape[0], eps=eps, offset=family.offset, casting_mode=family.casting_mode, device="meta")
    new.weight = weight
    new.train(module.training)
    return new


def _replace_mlp(module: nn.Module) -> nn.Module:
    """A liger-gen SwiGLUMLP that holds ``module``'s gate/up/down projections (no new parameters).

    The sizes come from the projections themselves: older transformers releases' MLPs (Mistral, Qwen2) keep no
    ``config``."""
    from liger_gen.nn import SwiGLUMLP

    gate = module.gate_proj
    sizes = SimpleNamespace(hidden_size=gate.in_features, intermediate_size=gate.out_features, hidden_act="silu",
                            mlp_bias=gate.bias is not None)
    with torch.device("meta"):
        new = SwiGLUMLP(getattr(module, "config", None) or sizes)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(new, name, getattr(module, name))
    new.train(module.training)
    return new


def _swap_children(model: nn.Module, class_names: tuple[str, ...], make) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in class_names:
                setattr(parent, name, make(child))
                count += 1
    return count


@functools.lru_cache(maxsize=None)
def _signature(function) -> inspect.Signature:
    """The signature of a model class's forward, read once (binding a call to it happens every step)."""
    return inspect.signature(function)


def _causal_lm_forward(self, *args, **kwargs):
    """Causal-LM forward whose training loss never materialises the logits (see the module docstring).

    The call is bound to the original ``forward``'s signature, so positional and keyword arguments mean what
    they mean there; anything but a training call with ``labels`` (and without ``use_cache=True``) runs the
    original forward unchanged.
    """
    original = type(self).forward
    signature = _signature(original)
    bound = signature.bind(self, *args, **kwargs)
    named = dict(bound.arguments)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    extra = dict(named.pop(var_keyword, {})) if var_keyword else {}  # **kwargs, **loss_kwargs (4.46), none (4.45)
    labels = named.get("labels")
    if not self.training or labels is None or named.get("use_cache"):
        return original(self, *args, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from liger_gen.functional import fused_linear_cross_entropy

    for name in ("self", "labels", "logits_to_keep", "num_logits_to_keep", "use_cache"):
        named.pop(name, None)
    return_dict = named.pop("return_dict", None)  # a named parameter before transformers 4.51, else in **kwargs
    return_dict = extra.pop("return_dict", return_dict)
    shift_labels = extra.pop("shift_labels", None)
    num_items_in_batch = extra.pop("num_items_in_batch", None)  # a loss argument; base models before 4.48 reject it
    if "return_dict" in _signature(type(self.model).forward).parameters:
        named["return_dict"] = True  # the base model returns a tuple when config.return_dict/its caller says so
    outputs = self.model(**named, **extra)
    hidden = outputs.last_hidden_state
    if shift_labels is None:  # tokens < n predict token n, as transformers' ForCausalLMLoss shifts them
        shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    head = self.get_output_embeddings()
    loss = fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                                      shift_labels.reshape(-1).to(hidden.device), bias=head.bias,
                                      ignore_index=-100, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                       else num_items_in_batch)
    out = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                 attentions=outputs.attentions)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return out if return_dict else out.to_tuple()


class FusedLossForward:
    """The ``forward`` ``apply_to`` installs on a causal-LM instance: ``_causal_lm_forward`` bound to it.

    A plain object rather than a bound method so that a patched model can be pickled and loaded (a bound method
    pickles as a lookup of its function's name on the instance, which does not exist). It has the original
    bound forward's signature, name and docstring: trainers read the signature to decide which batch columns to
    pass (transformers' ``Trainer`` drops every column the forward does not name) and whether the loss takes
    ``num_items_in_batch``.
    """

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return _causal_lm_forward(self.module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        signature = _signature(type(self.module).forward)
        return signature.replace(parameters=list(signature.parameters.values())[1:])  # bound: no ``self``

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return type(self.module).forward.__doc__

    @property
    def __name__(self) -> str:
        return "forward"


def _transformers_rope(original):
    """liger-gen RoPE with the signature of the transformers function it replaces: ``unsqueeze_dim`` is
    honoured by name or position; a ``position_ids`` argument (deprecated and unused in transformers since
    cos/sin come per position) is ignored as transformers ignores it."""
    from liger_gen.functional import rope

    signature = inspect.signature(original)

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        arguments = signature.bind(q, k, cos, sin, *args, **kwargs).arguments
        return rope(q, k, cos, sin, unsqueeze_dim=arguments.get("unsqueeze_dim", 1))

    apply_rotary_pos_emb.liger_gen = True
    return apply_rotary_pos_emb


def apply_to(model: nn.Module, *, rms_norm: bool = True, swiglu: bool = True, rope: bool = True,
             fused_linear_cross_entropy: bool = True) -> nn.Module:
    """Replace the supported parts of a transformers model in place and return the model.

    Supported ``config.model_type``: llama, mistral, qwen2, qwen3. Each flag switches one replacement (see the
    module docstring for what each does): the state_dict, the Parameter objects (so an optimizer built before
    still updates them) and the devices are unchanged. Calling it twice is harmless.

    Args:
        model: a transformers model of a supported family (a ``*ForCausalLM`` or its base ``*Model``).
        rms_norm: swap RMSNorm modules for ``liger_gen.nn.RMSNorm``.
        swiglu: swap the MLP modules for ``liger_gen.nn.SwiGLUMLP`` (only when the activation is SiLU).
        rope: route the family's ``apply_rotary_pos_emb`` to ``liger_gen.functional.rope`` (process-wide).
        fused_linear_cross_entropy: compute the training loss of a ``*ForCausalLM`` without logits.

    Raises:
        ValueError: the model has no ``config.model_type`` among the supported families.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"liger_gen.apply_to: model_type {model_type!r} is not supported; "
                         f"supported: {sorted(MODEL_FAMILIES)}")
    family = MODEL_FAMILIES[model_type]
    if rms_norm:
        _swap_children(model, family.norm_classes, lambda m: _replace_norm(m, family))
    if swiglu and getattr(config, "hidden_act", None) in _SILU:
        _swap_children(model, family.mlp_classes, _replace_mlp)
    if rope:
        modeling = importlib.import_module(family.modeling_module)
        original = _original_rope.setdefault(family.modeling_module, modeling.apply_rotary_pos_emb)
        patched = _patched_rope.get(family.modeling_module)
        if patched is None:
            patched = _patched_rope[family.modeling_module] = _transformers_rope(original)
        modeling.apply_rotary_pos_emb = patched
        # transformers 5.0-5.14 keep the function on every attention module too (use_kernelized_func: a
        # ``rotary_fn`` attribute, later a ``_hidden_kernels`` dict); a function pickles by its module's name,
        # which now names the wrapper, so those references must be the wrapper for torch.save to work.
        for module in model.modules():
            if module.__dict__.get("rotary_fn") is original:
                module.rotary_fn = patched
            hidden = module.__dict__.get("_hidden_kernels")
            if isinstance(hidden, dict):
                for key, value in list(hidden.items()):
                    if value is original:
                        hidden[key] = patched
    if fused_linear_cross_entropy and type(model).__name__ in family.causal_lm_classes:
        model.forward = FusedLossForward(model)
    return model


def restore_rope() -> None:
    """Undo the process-wide RoPE patch of every family ``apply_to`` patched."""
    for name, function in _original_rope.items():
        importlib.import_module(name).apply_rotary_pos_emb = function
    _original_rope.clear()
