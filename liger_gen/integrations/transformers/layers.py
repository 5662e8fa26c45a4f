"""The residual add fused into the next norm: the decoder layer classes' own forward code rewritten, process-
wide, so that ``h = r + x; r = h; h = self.<norm>(h)`` becomes one call (``restore_layers`` undoes it).
This module owns that state."""

from __future__ import annotations

import __future__
import functools
import inspect
import logging
import operator
import threading
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module  # the global hook registries

from liger_gen.nn import RMSNorm

logger = logging.getLogger("liger_gen")

# ------------------------------------------------------------------------------------------------ residual adds

HELPER = "__liger_gen_add_then_norm__"  # the global name the rewritten layer code calls
_layers_lock = threading.Lock()
_layers_restored = False  # restore_layers() ran (and no apply_to since): unpickling a model rewrites nothing
_ORIGINAL_LAYER_CODE: dict[Any, Any] = {}  # a layer class's innermost forward function → its original code
_LAYER_NORMS: dict[Any, tuple[str, ...] | None] = {}  # that function → the norms its rewrite fuses (None: none)
_FUTURE_FLAGS = functools.reduce(operator.or_, (getattr(__future__, f).compiler_flag
                                                for f in __future__.all_feature_names))
_LAYER_PLANS: dict[Any, Any] = {}  # that function → its rewrite, or why it is refused (see _layer_plan)


def _norm_hooked(norm: nn.Module) -> bool:
    """Whether a hook would see ``norm``'s call: its own forward or backward hooks (of any kind: full, pre,
    the older non-full ones) or global ones (DeepSpeed ZeRO-3's, activation probes, gradient monitors). A hook
    expects the norm's usual single input and output, and a backward hook the gradient of the norm's own input,
    which only the unfused add-then-norm gives."""
    return bool(norm._forward_hooks or norm._forward_pre_hooks or norm._backward_hooks or norm._backward_pre_hooks
                or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)


def _add_then_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x), as a decoder layer computes them: one fused pass where ``norm`` is a
    liger-gen RMSNorm that ``apply_to`` marked (``fuse_residual``) and no hook watches it (``_norm_hooked``);
    otherwise the add, then the norm's own call, exactly transformers' statements. Hooks are looked up on every
    call, so hooks registered after ``apply_to`` are seen too."""
    if getattr(norm, "fuse_residual", False) and isinstance(norm, RMSNorm) and not _norm_hooked(norm):
        return norm(x, residual=residual)
    s = residual + x
    return norm(s), s


def _match_add_then_norm(statements: list) -> tuple[str, str, Any, str] | None:
    """(hidden name, residual name, added expression, norm attribute) when three statements read
    ``h = r + <x>; r = h; h = self.<norm>(h)`` (the pre-norm decoder between its attention and MLP blocks)."""
    import ast

    if len(statements) < 3 or not all(isinstance(s, ast.Assign) and len(s.targets) == 1
                                      and isinstance(s.targets[0], ast.Name) for s in statements[:3]):
        return None
    add, keep, norm = statements[:3]
    h, r = add.targets[0].id, keep.targets[0].id
    if not (isinstance(add.value, ast.BinOp) and isinstance(add.value.op, ast.Add)
            and isinstance(add.value.left, ast.Name) and add.value.left.id == r and h != r):
        return None
    if not (isinstance(keep.value, ast.Name) and keep.value.id == h and norm.targets[0].id == h):
        return None
    call = norm.value
    if not (isinstance(call, ast.Call) and not call.keywords and len(call.args) == 1
            and isinstance(call.args[0], ast.Name) and call.args[0].id == h
            and isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "self" and "norm" in call.func.attr):
        return None  # (a post-norm layer's ``h = self.mlp(h)`` after the add is not a pre-norm)
    return h, r, add.value.right, call.func.attr


def fuse_layer_code(cls: type) -> tuple[str, ...] | None:
    """Rewrite the code of ``cls``'s forward so that each ``h = r + x; r = h; h = self.<norm>(h)`` at the top
    level of its body becomes ``h, r = _add_then_norm(self.<norm>, x, r)``; return the names of those norms, or
    None where its source has no such statements or cannot be rewritten (no source, a closure, a source file that
    no longer holds the code that runs: ``layer_code_refusal`` says why).

    The code object of the innermost function is replaced (``function.__code__``), so everything around it stays
    as it is: transformers' own wrappers (gradient checkpointing, deprecated keyword names), a user's wrapper on
    the class, hooks and wrappers on layer instances (accelerate's), pickling, ``nn.DataParallel``'s replicas.
    Like the RoPE routing this is process-wide, and it changes nothing for a layer whose norm ``apply_to`` did not
    mark: ``_add_then_norm`` then runs the add and the norm as the original statements did.
    ``restore_layers()`` puts the original code back. Done once per function."""
    with _layers_lock:  # one rewrite at a time: a second reader would parse the rewritten source
        inner, plan = _layer_plan(cls)
        if inner is None or inner in _LAYER_NORMS:
            return _LAYER_NORMS.get(inner)
        result = None
        if isinstance(plan, tuple):
            new, norms = plan
            inner.__globals__[HELPER] = _add_then_norm
            _ORIGINAL_LAYER_CODE[inner] = inner.__code__
            inner.__code__ = new
            global _layers_restored
            _layers_restored = False
            result = norms
        _LAYER_NORMS[inner] = result
        return result


def restored() -> bool:
    """Whether ``restore_layers()`` ran with no ``apply_to`` since (a model unpickled then rewrites nothing)."""
    return _layers_restored


def layer_code_refusal(cls: type) -> str | None:
    """Why the code of ``cls``'s forward is not rewritten to fuse its residual adds, or None (rewritten, or not a
    layout with an add then a norm): its source cannot be read (an install of .pyc files only), or its source
    file has changed since the class was imported (an upgraded or edited transformers in a running process: the
    parsed definition no longer compiles to the code that runs, and rewriting it would install the edited body),
    or the function cannot be recompiled as it stands (a closure, a function defined inside another)."""
    with _layers_lock:
        inner, plan = _layer_plan(cls)
    return plan if isinstance(plan, str) else None


def _compile_definition(definition, owner: str | None, filename: str, future_flags: int):
    """The code object of the function ``definition`` (an ``ast.FunctionDef`` with its line numbers and columns)
    compiled as a method of a class named ``owner`` (private names are mangled as in that class), or at module
    level when ``owner`` is None, under the ``__future__`` features ``future_flags`` (its module's, not ours)."""
    import ast

    fields = {"type_params": []} if "type_params" in ast.ClassDef._fields else {}  # Python 3.12 and later
    first = min([definition.lineno] + [d.lineno for d in definition.decorator_list])
    body = [ast.ClassDef(name=owner, bases=[], keywords=[], body=[definition], decorator_list=[], **fields,
                         lineno=first, col_offset=0, end_lineno=definition.end_lineno,
                         end_col_offset=definition.end_col_offset)] if owner else [definition]
    module = compile(ast.fix_missing_locations(ast.Module(body, type_ignores=[])), filename, "exec",
                     flags=future_flags, dont_inherit=True)
    code_type = type(module)
    scope = next(c for c in module.co_consts if isinstance(c, code_type)) if owner else module
    return next(c for c in scope.co_consts if isinstance(c, code_type) and c.co_name == definition.name)


def _layer_plan(cls: type):
    """(innermost forward, plan) for ``cls``: plan is (new code, norm names) when the forward can be rewritten,
    None when it has no add-then-norm to fuse (another layout), or a string saying why it is not rewritten (its
    source cannot be read, no longer matches the running code, or cannot be recompiled as it stands). Caller
    holds ``_layers_lock``; plans are kept per function until ``restore_layers``."""
    import ast
    import linecache

    try:
        inner = inspect.unwrap(cls.forward)
    except Exception:  # noqa: BLE001 - a class whose forward cannot be read (TorchScript's) is not ours
        return None, None
    if inner in _LAYER_PLANS:
        return inner, _LAYER_PLANS[inner]
    code = _ORIGINAL_LAYER_CODE.get(inner, getattr(inner, "__code__", None))
    plan = None
    try:
        if code is None or code.co_freevars:
            raise TypeError("not a plain function")  # a closure (e.g. super() without arguments)
        qualname = getattr(inner, "__qualname__", "").split(".")
        if "<locals>" in qualname:
            raise TypeError("a function defined inside another")
        owner = qualname[-2] if len(qualname) > 1 else None
        lines, first = inspect.getsourcelines(inner)
        # parsed where it stands (the class's indentation, the file's line numbers), so that the unmodified
        # definition compiles to the very code object that runs when the file is the one the class came from
        tree = ast.parse("if 1:\n" + "".join(lines))
        ast.increment_lineno(tree, first - 2)
        definition = tree.body[0].body[0]
        if not isinstance(definition, ast.FunctionDef) or definition.name != inner.__name__:
            raise TypeError("source is not the function's definition")
        futures = code.co_flags & _FUTURE_FLAGS
        body, norms, i = [], [], 0
        while i < len(definition.body):
            match = _match_add_then_norm(definition.body[i:i + 3])
            if match is None:
                body.append(definition.body[i])
                i += 1
                continue
            h, r, x, norm = match
            stmt = ast.parse(f"{h}, {r} = {HELPER}(self.{norm}, __x__, {r})").body[0]
            stmt.value.args[1] = x
            body.append(stmt)
            norms.append(norm)
            i += 3
        # checked only where there is something to fuse: a layout without the statements is not rewritten anyway
        # (and CPython 3.11 compiles some multi-line method calls parsed from an AST to other, equivalent code)
        if norms and _compile_definition(definition, owner, code.co_filename, futures) != code:
            plan = (f"residual add not fused: {code.co_filename} has changed since "
                    f"{inner.__module__} was imported (restart the process to fuse it)")
            raise LookupError(plan)
        if norms:
            definition.body, definition.decorator_list = body, []  # the decorators stay on the class
            definition = ast.parse(ast.unparse(ast.fix_missing_locations(definition))).body[0]  # fresh lines
            filename = f"<liger-gen: {inner.__module__}.{inner.__qualname__} with the residual add fused into the norm>"
            source = ast.unparse(definition)
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
            new = _compile_definition(definition, owner, filename, futures)
            if new.co_freevars:
                raise TypeError("the rewrite would need a closure")
            if hasattr(code, "co_qualname"):
                new = new.replace(co_qualname=code.co_qualname)
            plan = (new, tuple(norms))
    except LookupError:
        pass
    except OSError as e:  # no source to read (an install of .pyc files only, code made at run time)
        plan = f"residual add not fused: the source of its forward cannot be read ({e})"
    except (TypeError, SyntaxError, ValueError, AttributeError, IndexError, StopIteration, SystemError,
            RecursionError) as e:
        plan = f"residual add not fused: its forward cannot be rewritten ({e})"
    if isinstance(plan, str):
        logger.info("liger_gen.apply_to: %s.%s: %s", inner.__module__, inner.__qualname__, plan)
    _LAYER_PLANS[inner] = plan
    return inner, plan


def fused_norm_names(cls: type) -> tuple[str, ...]:
    """The norms whose add the code of ``cls``'s forward fuses in this process; () where it is not rewritten."""
    if not cls.__name__.endswith("DecoderLayer"):
        return ()
    try:
        inner = inspect.unwrap(cls.forward)
    except Exception:  # noqa: BLE001 - a class whose forward cannot be read (TorchScript's) is not ours
        return ()
    return (_LAYER_NORMS.get(inner) or ()) if inner in _ORIGINAL_LAYER_CODE else ()


def restore_layers() -> None:
    """Put back the original code of every decoder layer forward ``apply_to`` rewrote (the marked norms then run
    after transformers' own add again)."""
    global _layers_restored
    with _layers_lock:
        for function, code in _ORIGINAL_LAYER_CODE.items():
            function.__code__ = code  # the helper stays in the module: a forward running now may still call it
        _ORIGINAL_LAYER_CODE.clear()
        _LAYER_NORMS.clear()
        _LAYER_PLANS.clear()
        _layers_restored = True


def fusable_norms(module: nn.Module, modeling, norm_kind: str | None, swapped: set[int]) -> list[str]:
    """The names of the norms of ``module`` whose residual add can be fused: ``module`` is a decoder layer of
    ``modeling`` whose forward can be rewritten, and each such norm is (or is about to be) a liger-gen RMSNorm."""
    cls = type(module)
    if cls.__module__ != modeling.__name__ or not cls.__name__.endswith("DecoderLayer") \
            or norm_kind not in ("llama", "gemma", "fp32"):  # LayerNorms have no fused add
        return []
    names = fuse_layer_code(cls)
    if not names:
        return []
    norms = [getattr(module, name, None) for name in names]
    return list(names) if all(isinstance(n, RMSNorm) or id(n) in swapped for n in norms) else []
