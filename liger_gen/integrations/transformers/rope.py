"""RoPE routing: a family's ``apply_rotary_pos_emb`` (or its other rotary functions, its vision tower's included)
replaced, in its modeling module, by a wrapper of ``liger_gen.functional.rope`` with transformers' signature;
process-wide, undone by ``restore_rope``. This module owns that state."""

from __future__ import annotations

import functools
import importlib
import inspect

import torch
from torch import nn

from liger_gen.integrations.transformers.families import TESTED_TRANSFORMERS, ModelFamily

_original_rope: dict[str, object] = {}  # modeling module name → transformers' apply_rotary_pos_emb
_patched_rope: dict[str, object] = {}  # modeling module name → its liger-gen wrapper (one object, so it pickles)


# ------------------------------------------------------------------------------------------------ RoPE


def _is_function_module(obj) -> bool:
    """Whether ``obj`` is a module-level function that transformers turned into an ``nn.Module`` instance for hub
    kernels (``kernels.use_kernel_forward_from_hub`` on a function, transformers 5.25 and later with the
    ``kernels`` package): calls go through its ``forward``, and attention modules keep private copies of it that
    are rebuilt, when unpickled, as ``type(<the module-level object>)()``."""
    return isinstance(obj, nn.Module)


def _routed_function_module(original: nn.Module, patched) -> nn.Module:
    """A module to put in place of the function module ``original``: an instance of a subclass of its class whose
    ``forward`` calls ``patched``, with the original forward's signature. The subclass keeps the class's name and
    module, so the module-level object pickles by name as before. What ``type(obj)()`` builds (kernels' copies,
    and the attention modules' private copies when a model is unpickled) is transformers' own module, so nothing
    outside the module-level object stays routed after ``restore_rope``."""
    base = type(original)

    def forward(self, *args, **kwargs):
        return patched(*args, **kwargs)

    def new(cls, *args, **kwargs):
        return base(*args, **kwargs)

    forward.__signature__ = inspect.signature(base.forward)
    routed = type(base.__name__, (base,), {"forward": forward, "__new__": new, "liger_gen": True,
                                           "liger_gen_function": staticmethod(patched),
                                           "__module__": base.__module__, "__qualname__": base.__qualname__})
    module = nn.Module.__new__(routed)
    module.__init__()
    return module


def _rope_signature(original) -> inspect.Signature:
    """The call signature of transformers' rotary function, also when it is a function module."""
    if _is_function_module(original):
        signature = inspect.signature(type(original).forward)
        return signature.replace(parameters=list(signature.parameters.values())[1:])  # no ``self``
    return inspect.signature(original)


def _wraps_rope(original, name: str, signature: inspect.Signature):
    """functools.wraps for transformers' rotary function; a function module lends its name, module and
    signature (``_rope_signature``; copying its ``__dict__`` would copy the module's parameters and hooks)."""
    if not _is_function_module(original):
        return functools.wraps(original)

    def wrap(function):
        function.__module__ = type(original).__module__
        function.__name__ = function.__qualname__ = name
        function.__signature__ = signature
        return function

    return wrap


def _binder(signature: inspect.Signature, name: str):
    """``Signature.bind(...).arguments`` with the defaults filled in, in plain Python: torch.compile traces it
    (``Signature.bind`` reads a mappingproxy, which breaks the graph once the trace has mutated a dict, as
    transformers' hub-kernel wrappers of attention modules do). TypeError as a call of the function would raise."""
    params = list(signature.parameters.values())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_positional = any(p.kind is p.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    defaults = {p.name: p.default for p in params if p.default is not p.empty}

    def bind(args: tuple, kwargs: dict) -> dict:
        if len(args) > len(positional) and not var_positional:
            raise TypeError(f"{name}() takes {len(positional)} positional arguments but {len(args)} were given")
        arguments = dict(defaults)
        arguments.update(zip(positional, args))
        given = positional[:len(args)]
        for key, value in kwargs.items():
            if key in given:
                raise TypeError(f"{name}() got multiple values for argument {key!r}")
            if key not in keywords and not var_keyword:
                raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
            arguments[key] = value
        return arguments

    return bind


def _transformers_rope(original, family: ModelFamily, interleaved: bool = False, name: str | None = None):
    """liger-gen RoPE with the signature of the transformers function it replaces: ``unsqueeze_dim`` is
    honoured by name or position; a ``position_ids`` argument is used only with (seq, dim) tables, as the older
    releases that pass such tables use it (transformers ignores it with per-position tables). Per the family:
    results cast back to q's and k's dtypes (``rope_keeps_dtype``); half-width or interleaved tables turned
    into cat(freqs, freqs) (``rope_tables``); interleaved pairs of the rotary dims laid out as two halves for
    the kernel and back again (``rope_pairs``); or, for ``interleaved`` (DeepSeek's second function), laid out
    as two halves, the layout that function returns."""
    from liger_gen.functional import rope

    signature = _rope_signature(original)
    name = name or getattr(original, "__name__", family.rope_function)
    bind = _binder(signature, name)
    keeps_dtype, tables, pairs = family.rope_keeps_dtype, family.rope_tables, family.rope_pairs and not interleaved

    def halves(x: torch.Tensor, width: int) -> torch.Tensor:
        """The first ``width`` dims of x with pairs (x0, x1), (x2, x3), ... laid out as two halves."""
        rot = x[..., :width]
        out = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
        return out if width == x.shape[-1] else torch.cat((out, x[..., width:]), dim=-1)

    def pairs_of(y: torch.Tensor, width: int) -> torch.Tensor:
        """The inverse of ``halves``."""
        rot = torch.stack((y[..., :width // 2], y[..., width // 2:width]), dim=-1).flatten(-2)
        return rot if width == y.shape[-1] else torch.cat((rot, y[..., width:]), dim=-1)

    if tables == "complex":  # Llama 4, DeepSeek-V2: complex multiplication of interleaved pairs, in fp32, cast back
        heads_dim = family.rope_heads_dim

        @_wraps_rope(original, name, signature)
        def apply_rotary_emb(xq, xk, freqs_cis):
            cos, sin = freqs_cis.real, freqs_cis.imag
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            width = cos.shape[-1]
            q_out, k_out = rope(halves(xq, width), halves(xk, width), cos, sin, unsqueeze_dim=heads_dim)
            return pairs_of(q_out, width).to(xq.dtype), pairs_of(k_out, width).to(xk.dtype)

        apply_rotary_emb.liger_gen = True
        return apply_rotary_emb

    if family.rope_single:  # Gemma 4: one tensor a call; k is a detached one-head view of it, its result unused
        @_wraps_rope(original, name, signature)
        def apply_rotary_pos_emb_single(x, cos, sin, *args, **kwargs):
            unsqueeze_dim = bind((x, cos, sin, *args), kwargs).get("unsqueeze_dim", 1)
            out, _ = rope(x, x.detach().narrow(unsqueeze_dim, 0, 1), cos, sin, unsqueeze_dim=unsqueeze_dim)
            return out.to(x.dtype) if keeps_dtype else out

        apply_rotary_pos_emb_single.liger_gen = True
        return apply_rotary_pos_emb_single

    @_wraps_rope(original, name, signature)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        arguments = bind((q, k, cos, sin, *args), kwargs)
        dtypes = q.dtype, k.dtype
        half = tables == "half"
        if tables == "interleaved":
            cos, sin = torch.cat((cos[..., 0::2],) * 2, dim=-1), torch.cat((sin[..., 0::2],) * 2, dim=-1)
        width = cos.shape[-1] * (2 if half else 1)
        if interleaved or pairs:
            q, k = halves(q, width), halves(k, width)
        # (seq, dim) tables with position_ids (older releases gather per position inside this function)
        position_ids = arguments.get("position_ids") if cos.dim() == 2 else None
        q_out, k_out = rope(q, k, cos, sin, position_ids, unsqueeze_dim=arguments.get("unsqueeze_dim", 1),
                            half_tables=half)
        if pairs:
            q_out, k_out = pairs_of(q_out, width), pairs_of(k_out, width)
        return (q_out.to(dtypes[0]), k_out.to(dtypes[1])) if keeps_dtype else (q_out, k_out)

    apply_rotary_pos_emb.liger_gen = True
    return apply_rotary_pos_emb


_VISION_PARAMETERS = ("q", "k", "cos", "sin")
_VISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _vision_rope(original, name: str, signature: inspect.Signature):
    """liger-gen RoPE with the signature of transformers' ``apply_rotary_pos_emb_vision(q, k, cos, sin)``, the
    vision tower's 2-D RoPE of the Qwen vision-language families and GLM-4V: q and k (seq, heads, head_dim), views
    of the blocks' fused qkv projection; cos and sin (seq, head_dim) tables of the patches' (height, width)
    angles, cat(freqs, freqs), rotate_half layout. transformers computes it in fp32 (q, k, cos and sin upcast) and
    casts the results back to q's and k's dtypes. The op takes q and k as a batch of one in its (batch, seq, heads,
    head_dim) layout (read in place) with the tables in fp32: its outputs are then fp32, each product and the sum
    rounded in fp32 as transformers rounds them, and cast back once; its backward sums in fp32 and rounds once to
    q's dtype, as the backward of transformers' upcast does. On the plain-PyTorch path (CPU tensors without the
    interpreter) the op is the text formula under PyTorch's promotion, whose backward would round each product's
    gradient to q's dtype: q and k are upcast there, as transformers upcasts them, so that path is transformers'
    own, bit for bit. Calls of another form (other ranks or shapes, q and k of different dtypes or float64) go to
    transformers' function, which computes them, or raises, as it does."""
    from liger_gen.functional import rope
    from liger_gen.runtime.ops import uses_triton

    def takes(q, k, cos, sin) -> bool:
        tensors = all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin))
        return tensors and q.dim() == k.dim() == 3 and cos.dim() == sin.dim() == 2 and q.dtype == k.dtype \
            and q.dtype in _VISION_DTYPES and cos.is_floating_point() and sin.is_floating_point() \
            and cos.shape == sin.shape == (q.shape[0], q.shape[-1]) and k.shape[0] == q.shape[0] \
            and k.shape[-1] == q.shape[-1]

    @_wraps_rope(original, name, signature)
    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        if not takes(q, k, cos, sin):
            return original(q, k, cos, sin)
        dtype = q.dtype
        if not uses_triton(q):
            q, k = q.float(), k.float()
        q_out, k_out = rope(q.unsqueeze(0), k.unsqueeze(0), cos.unsqueeze(0).float(), sin.unsqueeze(0).float(),
                            unsqueeze_dim=2)
        return q_out.squeeze(0).to(dtype), k_out.squeeze(0).to(dtype)

    apply_rotary_pos_emb_vision.liger_gen = True
    return apply_rotary_pos_emb_vision


def rope_functions(family: ModelFamily) -> tuple[tuple[str, bool], ...]:
    """(function name, interleaved) of every rotary function of the family's text stack that liger-gen replaces
    (``vision_rope_function``: its vision tower's)."""
    names = ((family.rope_function, False),) if family.rope else ()
    return names + (((family.interleaved_rope, True),) if family.interleaved_rope else ())


def vision_rope_function(family: ModelFamily, modeling) -> str | None:
    """The name of the family's vision rotary function (``ModelFamily.vision_rope``) where ``modeling`` has it with
    the (q, k, cos, sin) parameters liger-gen's wrapper takes; None otherwise (it then stays transformers' own)."""
    name = family.vision_rope
    function = _original_rope.get((modeling.__name__, name), getattr(modeling, name, None)) if name else None
    if function is None or not callable(function):
        return None
    try:
        parameters = tuple(_rope_signature(function).parameters)
    except (TypeError, ValueError):
        return None
    return name if parameters == _VISION_PARAMETERS else None


def _route(modeling, function: str, make) -> tuple[object, object]:
    """Put the liger-gen wrapper of ``modeling.<function>`` (made once, by ``make(original)``) in its place;
    (transformers' function, the wrapper)."""
    key = (modeling.__name__, function)
    original = _original_rope.setdefault(key, getattr(modeling, function))
    patched = _patched_rope.get(key)
    if patched is None:
        patched = make(original)
        if _is_function_module(original):
            patched = _routed_function_module(original, patched)
        _patched_rope[key] = patched
    setattr(modeling, function, patched)
    return original, patched


def patch_rope(model: nn.Module, modeling, family: ModelFamily) -> bool:
    """Route the family's rotary functions (its vision tower's where ``vision_rope_function`` names one) to
    liger-gen; whether all of them now are."""
    done = True
    for function, interleaved in rope_functions(family):
        current = getattr(modeling, function, None)
        if not callable(current):
            raise RuntimeError(f"liger_gen.apply_to: {modeling.__name__} has no {function}; transformers "
                               f"releases tested: {', '.join(TESTED_TRANSFORMERS)}")
        original, patched = _route(modeling, function,
                                   lambda original: _transformers_rope(original, family, interleaved, function))
        done = done and getattr(modeling, function) is patched
        # transformers 5.0-5.14 keep the function on every attention module too (use_kernelized_func: a
        # ``rotary_fn`` attribute, later a ``_hidden_kernels`` dict); a function pickles by its module's name,
        # which now names the wrapper, so those references must be the wrapper for torch.save to work.
        for module in model.modules():
            if module.__dict__.get("rotary_fn") is original:
                module.rotary_fn = patched
            hidden = module.__dict__.get("_hidden_kernels")
            if isinstance(hidden, dict):
                for key_, value in list(hidden.items()):
                    if value is original:
                        hidden[key_] = patched
    vision = vision_rope_function(family, modeling)
    if vision is not None:  # called by name from the vision attention's forward: no module holds it
        _, patched = _route(modeling, vision, lambda original: _vision_rope(original, vision,
                                                                            _rope_signature(original)))
        done = done and getattr(modeling, vision) is patched
    return done


def rope_is_patched(family: ModelFamily) -> bool:
    """Whether every rotary function of the family (its vision tower's included, where ``vision_rope_function``
    names one) is routed to liger-gen in this process now."""
    functions = [f for f, _ in rope_functions(family)]
    if not functions:
        return False
    try:
        modeling = importlib.import_module(family.modeling_module)
    except ImportError:
        return False
    functions += [f for f in (vision_rope_function(family, modeling),) if f is not None]
    return all(getattr(modeling, f, None) is _patched_rope.get((modeling.__name__, f)) for f in functions)


def restore_rope() -> None:
    """Undo the process-wide RoPE patch of every family ``apply_to`` patched."""
    for (name, function_name), function in _original_rope.items():
        setattr(importlib.import_module(name), function_name, function)
    _original_rope.clear()
