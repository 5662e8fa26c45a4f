"""Hand-over of FP8 operands from the kernel that produced a tensor to the FP8 linear layers that read it.

A norm or GLU kernel that writes a tensor can write its FP8 GEMM operands with it (its rows operand, a scale per
token, and its columns operand, a scale per feature over the tokens, transposed), and the projections that read
the tensor then quantize nothing. Producer and consumer meet here, below ``ops/``, so that any op family can
offer and the FP8 linear layers (``liger_gen.ops.fp8.linear``) can take:

- ``LAST_INPUT`` (forward): the operands of the last input offered or quantized, keyed on the tensor object. The
  projections that read one tensor (q, k and v; gate and up) share it; the norm before them, and the GLU before
  the down projection, offer theirs first.
- ``GRADS`` (backward): the operands of the gradients a GLU backward wrote (dgate and dup, or a packed gate_up's
  gradient), keyed on the gradient's memory (address, element count, width, dtype and version counter), because
  autograd hands the projection a view of the tensor the GLU returned, not the tensor itself. Taken once.

Both are per thread and eager only: under torch.compile and torch.func every projection quantizes its own
operands (a compiled graph's buffers must not alias). A miss is always safe: the consumer quantizes.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch

from liger_gen.runtime.ops import transforms_active, use_custom_op


def eager_tensor(x: torch.Tensor) -> bool:
    """Whether operands of ``x`` may be handed over: eager mode, and a tensor with a version counter (not an
    inference tensor)."""
    return not (use_custom_op() or transforms_active() or x.is_inference())


def _key(x: torch.Tensor) -> tuple:
    return x._version, x.data_ptr(), x.shape, x.stride(), x.dtype


def _forget(slot: list, ref: weakref.ref) -> None:
    """The input of ``slot``'s entry was freed: drop its operands."""
    entry = slot[0]
    if entry is not None and entry[0] is ref:
        slot[0] = None


class InputOperands(threading.local):
    """The operands of the last input a projection quantized or a producer offered (one entry per thread).

    The entry is the input's weak reference, its version counter, data pointer, shape, strides and dtype (an
    in-place write, ``set_`` or a ``.data =`` swap is a miss; writes that bypass the version counter, through
    ``.data`` or the storage, cannot be seen), and the operands (rows q, dequant, and the token-axis qt, dequant
    or two Nones); it is dropped when the input is freed, so the FP8 copies live no longer than the tensor they
    were made from (and the backward's references). Threads calling concurrently neither read each other's entry
    nor evict it."""

    def __init__(self):
        self.slot: list = [None]  # [entry]: the weakref callback clears this thread's slot from any thread

    @property
    def operands(self) -> tuple:
        entry = self.slot[0]
        return () if entry is None else entry[-1]

    def get(self, x: torch.Tensor) -> tuple | None:
        """The operands offered for ``x`` (the same object, unchanged since), or None."""
        entry = self.slot[0]
        if entry is not None and eager_tensor(x):
            ref, key, operands = entry
            if ref() is x and key == _key(x):
                return operands
        return None

    def offer(self, x: torch.Tensor, operands: tuple) -> None:
        """Make ``operands`` the entry of ``x`` (nothing in a traced graph or a transform)."""
        if eager_tensor(x):
            self.slot[0] = (weakref.ref(x, functools.partial(_forget, self.slot)), _key(x), operands)

    def clear(self) -> None:
        self.slot[0] = None


class GradOperands(threading.local):
    """The operands of the last ``SIZE`` gradients a backward kernel offered (one list per thread), each taken at
    most once by the projection whose output gradient it is, and all dropped when the backward pass that offered
    them ends (so an entry nobody took, a gradient a hook replaced, is not kept into the next step).

    An entry holds the gradient itself (so its memory cannot be reused while the entry lives), its memory's key
    (data pointer, element count, last dim, dtype, version counter: a view of it with the same elements in the
    same order, as autograd passes on, matches; an in-place write between offer and take does not; a write
    through ``.data`` or the storage cannot be seen, which is why the GLU offers nothing where a hook could make
    one) and the operands (rows q, dequant, the token-axis qt, dequant). A newer offer evicts the oldest entry."""

    SIZE = 2  # a GLU backward offers dgate's and dup's

    def __init__(self):
        self.entries: list = []  # changed in place: the end-of-backward callback holds this thread's list
        self.task = -1  # the backward pass (autograd graph task) the entries were offered in

    @staticmethod
    def _key(g: torch.Tensor) -> tuple | None:
        if not g.is_contiguous():
            return None
        return g.data_ptr(), g.numel(), g.shape[-1] if g.dim() else 1, g.dtype, g._version

    def offer(self, grad: torch.Tensor, operands: tuple) -> None:
        """Keep ``operands`` for ``grad`` (contiguous, eager; else nothing)."""
        key = self._key(grad) if eager_tensor(grad) else None
        if key is None:
            return
        entries, task = self.entries, torch._C._current_graph_task_id()
        if task != self.task:  # the first offer of this backward pass (-1: none is running)
            entries.clear()  # what an earlier pass left (one that raised before its end)
            self.task = task
            if task != -1:  # dropped when this pass ends, taken or not
                torch.autograd.Variable._execution_engine.queue_callback(entries.clear)
        entries[:] = [*entries[-(self.SIZE - 1):], (grad, key, operands)]

    def take(self, dy: torch.Tensor) -> tuple | None:
        """The operands offered for ``dy``'s memory, removed, or None."""
        if not self.entries or not eager_tensor(dy):
            return None
        key = self._key(dy)
        for i, (_grad, k, operands) in enumerate(self.entries):
            if k == key:
                del self.entries[i]
                return operands
        return None

    def clear(self) -> None:
        self.entries.clear()


LAST_INPUT = InputOperands()
GRADS = GradOperands()
