"""Binding an op's kernels to PyTorch: custom ops, and one autograd definition used two ways.

An op writes its autograd once — ``save(ctx, inputs, output)`` and ``backward(ctx, *grads)`` over its forward
custom op — and ``Differentiable`` binds it twice:

* to the custom op (``register_autograd``), which torch.compile traces without a graph break, torch.jit.trace
  records and ``torch.library.opcheck`` checks;
* to an ``autograd.Function`` generated from the same two functions, which eager mode calls: it skips the
  dispatcher, which costs host time (``benchmarks/host_overhead.py``; figures in the README), and eager training
  of small and medium models is host-bound.

``Kernel`` is one custom op and the Python function it registers. A shared ``backward`` calls its kernels as
``kernel.run(ctx, ...)``: through the custom op when the autograd node is the custom op's (its backward may be
traced by torch.compile, which must see the op, not a launch on fake tensors), through the function when it is
the eager Function's (no dispatcher). The node says which it is (``ctx.eager``); whether torch.compile is tracing
a backward is not something every torch version reports.

Under torch.func transforms (``grad``, ``vjp``, ``jacrev``, ``vmap``, ``functional_call`` inside them) neither
binding can run: functorch accepts only an ``autograd.Function`` with a separate ``setup_context`` (the eager
Function's forward takes ``ctx``, for host time; the custom op's autograd is such a Function internally), and
the kernels cannot read functorch's wrapped tensors. So ``Differentiable`` has a third binding, taken only while
a transform is active (``torch._C._are_functorch_transforms_active()``, one C call on the eager path): a
Function with ``setup_context`` (the same ``save``), whose forward functorch runs on the unwrapped tensors
(the kernels), whose backward calls its kernels through the custom ops (``ctx.eager`` is False), which the
dispatcher unwraps, and whose ``vmap`` rule runs the op once per batch element (``Kernel``\\s register the same
rule, for backward kernels that jacrev vmaps). Forward-mode AD (``jvp``, ``jacfwd``, ``hessian``) and a
second derivative (``grad`` of ``grad``) raise a RuntimeError naming the op and its plain reference.

An op's public function is a ``PlannedOp``: the one eager path with per-call-shape plans
(``liger_gen.runtime.plans``). The op supplies its ``key`` (the call's tensors' shapes, strides, dtypes and
devices and its scalar options; the binding adds ``heuristic_only_enabled()`` and ``interpreter_enabled()``), a
``prepare`` that runs its checks once per key and returns a ``plans.Plan`` (kernel choice, output layout,
recordable launches), and its ``full`` path (the checks and the ``Differentiable``, for every call no plan
serves). A planned call runs the ``Differentiable``'s third Function, ``_Planned``: the same ``save`` and
``backward``, with the plan's launches in place of the custom ops' impls (``Kernel.run`` hands the backward
kernel's call to ``ctx.plan``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from torch.autograd import forward_ad

from liger_gen.runtime import plans
from liger_gen.runtime.ops import (describe, interpreter_enabled, no_double_backward, transforms_active,
                                   use_custom_op)
from liger_gen.runtime.tables import heuristic_only_enabled


class Kernel:
    """The custom op ``liger_gen::<name>`` over ``impl``, with ``fake`` as its shape function.

    ``impl`` must be annotated for ``torch.library.custom_op`` (tensors, optional tensors, ints, floats, bools,
    strings, dtypes). ``mutates_args`` names the arguments it writes in place.
    """

    def __init__(self, name: str, impl: Callable, fake: Callable, *, mutates_args: Iterable[str] = ()):
        self.name = f"liger_gen::{name}"
        self.impl = impl
        self.op = torch.library.custom_op(self.name, impl, mutates_args=tuple(mutates_args))
        self.op.register_fake(fake)
        if not mutates_args and hasattr(self.op, "register_vmap"):  # (2.11 and 2.13 have it)
            # under torch.func.vmap (a backward kernel that jacrev vmaps, a direct call): once per element
            self.op.register_vmap(lambda info, in_dims, *args: per_element(name, self.op, info, in_dims, args))

    def run(self, ctx, *args: Any) -> Any:
        """Call from a ``Differentiable``'s backward: ``impl`` under the eager Function (the plan's ``backward``
        under a planned call, when this is the plan's ``BACKWARD`` kernel), the op otherwise."""
        if not ctx.eager:
            return self.op(*args)
        plan = ctx.plan
        if plan is not None and plan.BACKWARD is self:
            return plan.backward(*args)
        return self.impl(*args)


class Differentiable:
    """One autograd definition of ``forward`` (a ``Kernel``), bound to its custom op and to an eager Function.

    ``save(ctx, inputs, output)`` stores what the backward needs (the custom op's ``setup_context`` signature);
    ``backward(ctx, *grads)`` gets one gradient per output of the custom op and returns one gradient (or None)
    per input, calling its backward kernels through ``Kernel``\\s. Gradients of unused outputs reach
    ``backward`` as None in both bindings (``save`` runs after ``ctx.set_materialize_grads(False)``). Both
    bindings refuse double backward (``create_graph=True``: the kernels have no second derivative), naming
    ``reference`` as the differentiable alternative.

    ``outputs``: how many leading outputs the callers use; the rest (saved statistics such as rstd or lse) are
    not returned by the eager Function, which saves autograd their bookkeeping, and their gradients are None.
    Calling the object returns a tuple whose first ``outputs`` items are those outputs: through the custom op
    (the whole output tuple) while a graph is recorded, through ``transformable`` (the whole output tuple) under
    torch.func transforms, through the eager Function otherwise.
    """

    def __init__(self, forward: Kernel, save: Callable, backward: Callable, *, reference: str,
                 outputs: int | None = None):
        op_name = forward.name.removeprefix("liger_gen::").removesuffix("_fwd")

        def setup_context(ctx, inputs, output):
            ctx.set_materialize_grads(False)
            ctx.eager = False
            save(ctx, inputs, output)

        def op_backward(ctx, *grads):
            if torch.is_grad_enabled():  # create_graph=True; a traced backward (torch.compile) runs without grad
                no_double_backward(op_name, reference)
            return backward(ctx, *grads)

        forward.op.register_autograd(op_backward, setup_context=setup_context)
        impl = forward.impl

        n_out = len(forward.op._opoverload._schema.returns)
        kept = n_out if outputs is None else outputs
        padding = (None,) * (n_out - kept)

        def eager_forward(ctx, *args):
            output = impl(*args)
            ctx.set_materialize_grads(False)
            ctx.eager = True
            ctx.plan = None
            save(ctx, args, output)
            return output if kept == n_out else output[:kept]

        def eager_backward(ctx, *grads):
            no_double_backward(op_name, reference)
            return backward(ctx, *grads, *padding)

        def planned_forward(ctx, *tensors_and_plan):
            # the op's leading tensor arguments, then the plan (its ``tail``: the rest, fixed per plan), so that
            # ``needs_input_grad`` and the gradients keep their positions (autograd drops the gradients past the
            # plan's, all None: those of the tail)
            tensors, plan = tensors_and_plan[:-1], tensors_and_plan[-1]
            output = plan.forward(*tensors)
            ctx.set_materialize_grads(False)
            ctx.eager = True
            ctx.plan = plan
            save(ctx, tensors + plan.tail, output)
            return output if kept == n_out else output[:kept]

        def planned_backward(ctx, *grads):
            no_double_backward(op_name, reference)
            return *backward(ctx, *grads, *padding), None  # the plan's, where it has no tail

        self.function = type(f"{type(self).__name__}_{op_name}", (torch.autograd.Function,), {
            "forward": staticmethod(eager_forward), "backward": staticmethod(eager_backward),
            "__doc__": f"Eager binding of {forward.name} (same save/backward as its registered autograd).",
        })
        # a planned call (``PlannedOp``): the same save and backward, the plan's launches for the kernels
        self.planned = type("_Planned", (torch.autograd.Function,), {
            "forward": staticmethod(planned_forward), "backward": staticmethod(planned_backward),
            "__doc__": f"Eager binding of {forward.name} through a per-call-shape plan (same save/backward).",
        })
        self.kept = None if kept == n_out else kept  # leading outputs the eager Functions return
        self._op = forward.op
        self._apply = self.function.apply
        self._name = op_name
        self.transformable = _transformable(op_name, forward, save, backward, reference)
        self._transformed = self.transformable.apply

    def __call__(self, *args: Any) -> Any:
        try:
            if use_custom_op():
                return self._op(*args)
            if transforms_active():
                return self._transformed(*args)
            return self._apply(*args)
        except Exception as exc:  # costs nothing until something fails: then say so if a DTensor was the cause
            refuse_dtensors(self._name, args, exc)
            raise


class PlannedOp:
    """An op's public path: per-call-shape plans in eager mode, the op's full path for every other call.

    ``key(*args)`` → a hashable tuple of what makes a call valid and its kernels' launches the same (the tensors'
    ``plans.meta``, the scalar options), or None / ``plans.Unplanned`` for a call no plan may serve.
    ``prepare(*args)`` → the op's checks (raising the op's errors), then a ``plans.Plan`` for the call shape, or
    None where the op's full path must run (the plain-PyTorch path, an empty tensor, a layout that needs a copy);
    called once per key (the verdict is kept too). ``full(*args)`` → the op's result through its checks and its
    ``Differentiable`` (torch.compile, torch.func transforms, forward-mode AD, tensor subclasses, unkeyed calls).

    ``plans`` is the op's plan cache (emptied by ``liger_gen.runtime.ops.clear_caches``). A call of a known key
    skips the checks: with grad mode on and an input that requires grad it runs ``differentiable``'s
    ``_planned`` Function (the same save and backward), else the plan's forward alone.
    """

    def __init__(self, differentiable: Differentiable, *, key: Callable[..., tuple | None],
                 prepare: Callable[..., plans.Plan | None], full: Callable[..., Any]):
        self.differentiable = differentiable
        self.key, self.prepare, self.full = key, prepare, full
        self.plans = plans.new_cache()
        self._apply = differentiable.planned.apply
        self._kept = differentiable.kept

    def __call__(self, *args: Any) -> Any:
        try:
            key = self.key(*args)
        except plans.Unplanned:
            key = None
        if key is None or use_custom_op() or transforms_active() or forward_ad._current_level >= 0:
            return self.full(*args)
        key = (key, heuristic_only_enabled(), interpreter_enabled())
        plan = self.plans.get(key)
        if plan is None:  # the first call of this key: the op's checks, then its plan (or the verdict: none)
            plan = plans.remember(self.plans, key, self.prepare(*args) or plans.NO_PLAN)
        if plan is plans.NO_PLAN:
            return self.full(*args)
        tensors = plan.inputs(*args)
        if torch.is_grad_enabled() and plan.needs_grad(tensors):
            return plan.result(self._apply(*tensors, plan), *args)
        outputs = plan.forward(*tensors)
        return plan.result(outputs if self._kept is None else outputs[:self._kept], *args)


def per_element(op: str, fn: Callable, info: Any, in_dims: tuple, args: tuple) -> tuple[Any, Any]:
    """A torch.func.vmap rule: ``fn`` once per batch element (the kernels take plain tensors only), the outputs
    stacked along dim 0. ``select`` gives each element the strides its logical tensor had, which the op's
    checks saw. ``op`` names the op in the error for an empty batch (no element to run, so no output shapes)."""
    if info.batch_size == 0:
        batched = [f"{tuple(a.shape)} (batch dim {d})" for a, d in zip(args, in_dims) if d is not None]
        raise ValueError(f"liger_gen {op}: torch.func.vmap over an empty batch is not supported (the kernels run "
                         f"once per batch element); got inputs of shapes {', '.join(batched)}. Skip the call for "
                         f"an empty batch.")
    results = [fn(*[a if d is None else a.select(d, i) for a, d in zip(args, in_dims)])
               for i in range(info.batch_size)]
    if isinstance(results[0], torch.Tensor):
        return torch.stack(results), 0
    outputs = tuple(torch.stack(parts) for parts in zip(*results))
    return outputs, (0,) * len(outputs)


def _transformable(op_name: str, forward: Kernel, save: Callable, backward: Callable,
                   reference: str) -> type[torch.autograd.Function]:
    """The Function ``Differentiable`` calls under torch.func transforms (see the module docstring): the forward
    kernels on plain tensors, ``save`` as ``setup_context``, ``backward`` through the custom ops, a per-element
    ``vmap`` rule, and liger_gen errors for forward-mode AD and second derivatives."""
    impl = forward.impl
    arg_names = [a.name for a in forward.op._opoverload._schema.arguments]

    def first_tensor(tensors) -> str:
        """The first tensor argument, described (what the errors name)."""
        for name, t in zip(arg_names, tensors):
            if isinstance(t, torch.Tensor):
                return describe(name, t)
        return "no tensor"

    def fwd(*args):
        return impl(*args)

    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        ctx.eager = False  # the backward calls its kernels as custom ops, which unwrap functorch's tensors
        ctx.level = torch._C._functorch.maybe_current_level()  # the grad transform this node belongs to
        ctx.first_input = next(((n, t.shape, t.dtype, t.device) for n, t in zip(arg_names, inputs)
                                if isinstance(t, torch.Tensor)), None)  # for the error below, formatted there
        save(ctx, inputs, output)

    def bwd(ctx, *grads):
        outer = _other_derivative_transform(ctx.level)
        if outer is not None:
            name, shape, dtype, device = ctx.first_input
            raise RuntimeError(
                f"liger_gen {op_name}: a second derivative is not supported: an outer torch.func {outer} "
                f"transform differentiates the backward of the op (e.g. grad of grad, jacrev of grad), and the "
                f"kernels have no derivative of their backward (input {name} of shape {tuple(shape)}, dtype "
                f"{dtype}, device {device}). Use {reference} where second derivatives are needed, or take the "
                f"outer derivative of something that does not differentiate this op.")
        with torch.no_grad():  # the transform's graph stops here (functorch runs backwards with create_graph)
            return backward(ctx, *grads)

    def jvp(ctx, *tangents):
        raise RuntimeError(
            f"liger_gen {op_name}: forward-mode AD (torch.func.jvp, jacfwd, hessian, linearize) is not supported: "
            f"the kernels have no forward derivative (input {first_tensor(tangents)}). Use reverse mode "
            f"(torch.func.grad, vjp, jacrev), or {reference} where forward-mode derivatives are needed.")

    def vmap(info, in_dims, *args):
        return per_element(op_name, function.apply, info, in_dims, args)

    function = type(f"Transformable_{op_name}", (torch.autograd.Function,), {
        "forward": staticmethod(fwd), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(bwd), "jvp": staticmethod(jvp), "vmap": staticmethod(vmap),
        "__doc__": f"{forward.name} under torch.func transforms (same save/backward as its other bindings).",
    })
    return function


def _other_derivative_transform(level: int | None) -> str | None:
    """The name of an active torch.func transform that takes derivatives (grad, jvp) other than the one at
    ``level``, if any: during a backward, one that would differentiate the backward itself."""
    for interpreter in torch._C._functorch.get_interpreter_stack() or ():
        key = interpreter.key()
        if interpreter.level() != level and key in _DERIVATIVE_TRANSFORMS:
            return _DERIVATIVE_TRANSFORMS[key]
    return None


_DERIVATIVE_TRANSFORMS = {torch._C._functorch.TransformType.Grad: "grad/vjp/jacrev",
                          torch._C._functorch.TransformType.Jvp: "jvp/jacfwd"}


def refuse_dtensors(op: str, args: Iterable[Any], cause: BaseException | None = None) -> None:
    """TypeError naming the first ``torch.distributed.tensor.DTensor`` among ``args``, with what to do instead.

    The kernels read raw pointers of local tensors; a DTensor has no storage of its own. FSDP2 (``fully_shard``)
    hands modules plain tensors inside their forward, so ``apply_to`` before sharding never meets one; tensor or
    sequence parallel code that holds DTensors must pass local shards or full tensors."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return
    for pos, arg in enumerate(args):
        if isinstance(arg, DTensor):
            raise TypeError(
                f"liger_gen {op}: input {pos} is a DTensor (global shape {tuple(arg.shape)}, local shape "
                f"{tuple(arg.to_local().shape)}, placements {tuple(arg.placements)}, dtype {arg.dtype}); the "
                f"kernels take plain tensors. Under FSDP2 call liger_gen.apply_to(model) before fully_shard (the "
                f"modules then see unsharded plain tensors); with tensor or sequence parallelism pass the local "
                f"shard (dtensor.to_local(), for row-wise ops on rows sharded with Shard(0)) or "
                f"dtensor.full_tensor().") from cause


def saved(ctx, *tensors: torch.Tensor | None) -> None:
    """``ctx.save_for_backward`` of ``tensors``, cloning inference-mode ones (x made under inference_mode with a
    trained weight), which autograd cannot save."""
    ctx.save_for_backward(*[t.clone() if t is not None and t.is_inference() else t for t in tensors])
