"""The fused LM-head loss: the causal-LM ``forward`` ``apply_to`` installs, which computes the training loss
from the last hidden states and ``lm_head.weight`` without materialising the logits."""

from __future__ import annotations

import inspect
import sys
import typing
from typing import Any

import torch
from torch import nn

from liger_gen.integrations.transformers import packing
from liger_gen.integrations.transformers.families import ModelFamily, family_of

# ------------------------------------------------------------------------------------------------ loss


_SIGNATURES: dict[Any, inspect.Signature] = {}


def _signature(function) -> inspect.Signature:
    """The signature of a model class's forward, read once (binding a call to it happens every step). A plain
    dict rather than functools.lru_cache: torch.compile traces through an lru_cache wrapper with a warning."""
    signature = _SIGNATURES.get(function)
    if signature is None:
        signature = _SIGNATURES[function] = inspect.signature(function)
    return signature


def _logit_transform(model: nn.Module, family: ModelFamily) -> tuple[float | None, float | None]:
    """(multiplier of the hidden states, softcap) that reproduce the family's logits before the loss."""
    config = model.config
    if family.logits == "softcap":  # a multimodal model's text settings are in its text config (PaliGemma's)
        text_config = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
        return None, getattr(text_config, "final_logit_softcapping", None)
    if family.logits == "divide":
        return 1.0 / float(config.logits_scaling), None
    if family.logits == "multiply":
        return float(getattr(model, "logit_scale", getattr(config, "logit_scale", 1.0))), None
    if family.logits == "lm_head_multiplier":
        return float(getattr(model.model, "lm_head_multiplier", config.lm_head_multiplier)), None
    return None, None


# the keyword the fused forward of a ``*ForConditionalGeneration`` passes through its own forward to the
# ``*ForCausalLM`` inside it (Llama 4's, ``ModelFamily.causal_lm_inside``), whose fused forward then returns its text
# model's last hidden states in the logits' place: the outer forward merges the images and runs the text stack as
# it is, and no logits are computed
HIDDEN_STATES_KEYWORD = "liger_gen_hidden_states"

_OUTPUT_CLASSES: dict[Any, Any] = {}


def _output_class(model_cls: type, moe: bool):
    """The output class of ``model_cls.forward``: the ``ModelOutput`` with ``loss`` and ``logits`` its annotation
    names (a multimodal model's own, with its image fields; resolved once per class), else transformers'
    ``MoeCausalLMOutputWithPast`` (``moe``: the base model's output has router logits) or
    ``CausalLMOutputWithPast``."""
    key = (model_cls, moe)
    if key not in _OUTPUT_CLASSES:
        # imported by every modeling module; an import statement here stops torch.compile in a process where
        # nothing imported transformers' lazy module attribute before (a patched model loaded with torch.load)
        modeling_outputs = sys.modules["transformers.modeling_outputs"]
        annotation = _signature(model_cls.forward).return_annotation
        modeling = sys.modules.get(model_cls.__module__)
        names = annotation.replace(" ", "").split("|") if isinstance(annotation, str) else None
        candidates = [getattr(modeling, n, getattr(modeling_outputs, n, None)) for n in names] if names \
            else (typing.get_args(annotation) or (annotation,))
        found = [c for c in candidates if isinstance(c, type) and issubclass(c, modeling_outputs.ModelOutput)
                 and {"loss", "logits"} <= set(getattr(c, "__dataclass_fields__", ()))]
        _OUTPUT_CLASSES[key] = found[0] if found else (
            modeling_outputs.MoeCausalLMOutputWithPast if moe else modeling_outputs.CausalLMOutputWithPast)
    return _OUTPUT_CLASSES[key]


def _causal_lm_forward(self, family: ModelFamily, *args, **kwargs):
    """Causal-LM forward whose training loss never materialises the logits (see the module docstring); also the
    forward of a multimodal ``*ForConditionalGeneration``, whose base model takes the images and returns the text
    stack's last hidden states, and whose loss is transformers' same ``ForCausalLMLoss`` of the labels (image
    placeholder tokens are in the loss unless the labels mask them, as the collator does for transformers).

    The call is bound to the original ``forward``'s signature, so positional and keyword arguments mean what
    they mean there; a call without labels, with gradients disabled or with ``use_cache=True`` runs the original
    forward unchanged. A ``*ForConditionalGeneration`` that holds a ``*ForCausalLM`` instead of a base model (Llama
    4's, ``family.causal_lm_inside``) runs its own forward without labels, passing ``HIDDEN_STATES_KEYWORD`` to the
    causal LM inside, whose fused forward then returns the text model's outputs with its last hidden states as
    ``logits``.
    """
    original = type(self).forward
    signature = _signature(original)
    bound = signature.bind(self, *args, **kwargs)
    named = dict(bound.arguments)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    extra = dict(named.pop(var_keyword, {})) if var_keyword else {}  # **kwargs, **loss_kwargs (4.46), none (4.45)
    labels = named.get("labels")
    hidden_only = bool(extra.pop(HIDDEN_STATES_KEYWORD, False))  # from the forward of the model holding this one
    packing.warn_if_mixed(self, named, extra)  # packed documents that transformers will not keep apart: warn once
    if not hidden_only and (labels is None or not torch.is_grad_enabled() or named.get("use_cache")
                            or extra.get("use_cache")):
        return original(self, *args, **kwargs)
    from liger_gen.functional import fused_linear_cross_entropy

    for name in ("self", "labels", "logits_to_keep", "num_logits_to_keep"):
        named.pop(name, None)  # use_cache (False or None here) goes on to the base model, as transformers passes it
    return_dict = named.pop("return_dict", None)  # a named parameter before transformers 4.51, else in **kwargs
    return_dict = extra.pop("return_dict", return_dict)
    shift_labels = extra.pop("shift_labels", None)
    num_items_in_batch = extra.pop("num_items_in_batch", None)  # a loss argument; base models before 4.48 reject it
    # router logits: asked by name, in **kwargs, or by the config (the base model reads the same three); a
    # multimodal model's MoE settings are in its text config, as its forward reads them
    config = self.config
    text_config = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    router = named.get("output_router_logits", extra.get("output_router_logits"))
    if router is None:
        router = getattr(config, "output_router_logits", getattr(text_config, "output_router_logits", False))
    router = bool(router)
    inside = getattr(self, family.causal_lm_inside, None) if family.causal_lm_inside and not hidden_only else None
    if inside is not None and not hasattr(self, "model"):
        # this forward merges the images into the text embeddings and calls the causal LM inside it (Llama 4's):
        # run as it is, without labels, that causal LM returning its text model's hidden states as the logits
        outputs = original(self, **named, **extra, return_dict=True, **{HIDDEN_STATES_KEYWORD: True})
        hidden = outputs.logits
    else:
        base_parameters = _signature(type(self.model).forward).parameters
        if "output_router_logits" in base_parameters and "output_router_logits" not in extra:
            named["output_router_logits"] = router  # resolved here, as transformers' forward passes it on
        if "return_dict" in base_parameters:
            named["return_dict"] = True  # the base model returns a tuple when config.return_dict/its caller says so
        if "labels" in base_parameters:
            named["labels"] = labels  # a multimodal base model that takes them (Gemma 3's, PaliGemma's), as there
        outputs = self.model(**named, **extra)
        hidden = outputs.last_hidden_state
    if hidden_only:  # the base model's outputs, by the output class's names, with the hidden states as the logits
        out_cls = _output_class(type(self), hasattr(outputs, "router_logits"))
        fields = {name: getattr(outputs, name, None) for name in out_cls.__dataclass_fields__}
        fields.update(logits=hidden)
        return out_cls(**fields)
    if shift_labels is None:  # tokens < n predict token n, as transformers' ForCausalLMLoss shifts them
        shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    head = self.get_output_embeddings()
    scale, softcap = _logit_transform(self, family)
    x = hidden.reshape(-1, hidden.shape[-1])
    if scale is not None:
        x = x * scale
    # under DeepSpeed ZeRO-3, reading head.weight here (inside the forward of a module it manages) gathers the
    # partitioned weight and registers it with this module, so its backward gathers it again
    loss = fused_linear_cross_entropy(x, head.weight, shift_labels.reshape(-1).to(hidden.device), bias=head.bias,
                                      ignore_index=-100, reduction=reduction, softcap=softcap)
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                       else num_items_in_batch)
    # an MoE base model (its output has router_logits) gives the MoE output class, as transformers' forward does;
    # the load-balancing loss is added where the family's forward adds it (a modeling function and a coefficient)
    moe = hasattr(outputs, "router_logits")
    aux_loss = None
    modeling = sys.modules[type(self).__module__]  # imported with the class (import_module stops torch.compile)
    # (a multimodal model's coefficient and expert counts from its text config where it holds none of its own)
    coef = getattr(self, "router_aux_loss_coef", None if text_config is config
                   else getattr(text_config, "router_aux_loss_coef", None))
    if router and getattr(outputs, "router_logits", None) is not None \
            and hasattr(modeling, "load_balancing_loss_func") and coef is not None:
        num_experts = getattr(self, "num_experts", None) or getattr(text_config, "num_experts", None) \
            or text_config.num_local_experts
        top_k = getattr(self, "num_experts_per_tok", None) or text_config.num_experts_per_tok
        aux_loss = modeling.load_balancing_loss_func(outputs.router_logits, num_experts, top_k,
                                                     named.get("attention_mask"))
        loss = loss + coef * aux_loss.to(loss.device)
    out_cls = _output_class(type(self), moe)
    # the base model's fields by the output class's own names (the cache field was renamed in transformers 5);
    # __dataclass_fields__ rather than dataclasses.fields, which torch.compile does not trace (the output classes
    # declare no ClassVar or InitVar, so both name the same fields)
    fields = {name: getattr(outputs, name, None) for name in out_cls.__dataclass_fields__}
    fields.update(loss=loss, logits=None)
    if moe and "aux_loss" in fields:
        fields["aux_loss"] = aux_loss
    out = out_cls(**fields)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if return_dict:
        return out
    # transformers' tuple (its non-None fields in order), with None kept where it would hold the logits
    return tuple(v for k, v in fields.items() if v is not None or k == "logits")


class FusedLossForward:
    """The ``forward`` ``apply_to`` installs on a causal-LM instance: ``_causal_lm_forward`` bound to it.

    A plain object rather than a bound method so that a patched model can be pickled and loaded (a bound method
    pickles as a lookup of its function's name on the instance, which does not exist). It has the original
    bound forward's signature, name and docstring: trainers read the signature to decide which batch columns to
    pass (transformers' ``Trainer`` drops every column the forward does not name) and whether the loss takes
    ``num_items_in_batch``.
    """

    def __init__(self, module: nn.Module, family: ModelFamily | None = None):
        self.module = module
        self.family = family or family_of(module)

    def __call__(self, *args, **kwargs):
        return _causal_lm_forward(self.module, self.family, *args, **kwargs)

    def rebound(self, module: nn.Module) -> "FusedLossForward":
        """The same forward bound to ``module`` (a replica of the patched model)."""
        return FusedLossForward(module, self.family)

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
