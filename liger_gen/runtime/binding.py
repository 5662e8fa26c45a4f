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
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from liger_gen.runtime.ops import no_double_backward, use_custom_op


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

    def run(self, ctx, *args: Any) -> Any:
        """Call from a ``Differentiable``'s backward: ``impl`` under the eager Function, the op otherwise."""
        return self.impl(*args) if ctx.eager else self.op(*args)


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
    (the whole output tuple) while a graph is recorded, through the Function otherwise.
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
            save(ctx, args, output)
            return output if kept == n_out else output[:kept]

        def eager_backward(ctx, *grads):
            no_double_backward(op_name, reference)
            return backward(ctx, *grads, *padding)

        self.function = type(f"{type(self).__name__}_{op_name}", (torch.autograd.Function,), {
            "forward": staticmethod(eager_forward), "backward": staticmethod(eager_backward),
            "__doc__": f"Eager binding of {forward.name} (same save/backward as its registered autograd).",
        })
        self._op = forward.op
        self._apply = self.function.apply
        self._name = op_name

    def __call__(self, *args: Any) -> Any:
        try:
            if use_custom_op():
                return self._op(*args)
            return self._apply(*args)
        except Exception as exc:  # costs nothing until something fails: then say so if a DTensor was the cause
            refuse_dtensors(self._name, args, exc)
            raise


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
