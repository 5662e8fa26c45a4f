"""Optimizers whose update runs as liger-gen's tuned kernels: ``AdamW``.

    import liger_gen

    optimizer = liger_gen.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

``AdamW`` is a ``torch.optim.AdamW``: the same arguments, parameter groups, state (``step``, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``), ``state_dict`` / ``load_state_dict`` in both directions, learning-rate
schedulers and step hooks. Only ``step`` differs: each parameter's update is one launch of the ``adamw`` kernel
(``liger_gen.functional.adamw_step``), which reads and writes each element once.
"""

from __future__ import annotations

import torch

from liger_gen.ops.optim.adamw import (STATE, adamw_step_unchecked, adamw_torch, check_adamw_tensors,
                                       check_writable)
from liger_gen.runtime.ops import KERNEL_DTYPES, uses_triton

__all__ = ["AdamW"]


class AdamW(torch.optim.AdamW):
    """AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization") with the update of
    ``torch.optim.AdamW``, one tuned Triton kernel launch per parameter.

    Args:
        params: parameters or parameter groups, as for any ``torch.optim`` optimizer.
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW`` (checked as it checks them, at
            construction; any of them may be a tensor, read as a Python float each step).
        foreach, fused: accepted for drop-in use only as None or False: this optimizer is its own fused
            implementation. Its parameter groups record them as None (torch's default), so a ``torch.optim.AdamW``
            that loads its state dict picks its own; values loaded from another optimizer's state dict are kept
            in the groups and do not change how this one steps.
        capturable, differentiable: must be False.

    Each element is computed in fp32 (float64 for float64 parameters) and stored once in its tensor's dtype, as
    torch's fused AdamW does; the state has the parameter's dtype and layout. The step count stays on the host as
    a CPU tensor (``torch.optim.AdamW``'s non-fused layout; a state dict with device step counts is read back to
    the host once), so a step never synchronises with the GPU (unless a hyperparameter is a CUDA tensor, read each
    step). A step checks every parameter with a gradient before it updates any, so one that raises on bad input
    changes nothing. The parameters' version counters move as for an
    in-place PyTorch update, so autograd refuses a backward through a graph that saved a parameter the step
    changed.

    Contiguous CUDA parameters of float32, bfloat16 or float16 run the kernel (CPU parameters too, under
    ``TRITON_INTERPRET=1``), as do the local shards of DTensor parameters (FSDP2's ``fully_shard``, whose
    gradients and state are sharded alike); any other parameter (CPU, float64, a strided layout such as
    channels_last) gets the same update in plain PyTorch.

    Raises:
        ValueError: at construction, a hyperparameter out of ``torch.optim.AdamW``'s ranges, ``capturable`` or
            ``differentiable`` set, ``foreach`` or ``fused`` True. At ``step``, a gradient or state tensor whose
            shape or device differs from its parameter's, or a state without ``step``, ``exp_avg`` or
            ``exp_avg_sq``.
        TypeError: at ``step``, a sparse or complex (not floating-point) gradient, parameter or state; DTensors
            for some of a parameter, its gradient and its state but not all.
        RuntimeError: at ``step``, a parameter or state tensor that is an inference tensor (outside inference
            mode).
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None) -> None:
        for name, value in (("foreach", foreach), ("fused", fused), ("capturable", capturable),
                            ("differentiable", differentiable)):
            if value:
                raise ValueError(f"liger_gen.optim.AdamW: {name}={value!r} is not supported; it is its own fused "
                                 f"implementation (leave {name} unset)")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=None, capturable=False, differentiable=False, fused=None)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient; returns ``closure()``'s loss when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = []  # everything is checked before anything is updated
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            h = {"lr": float(group["lr"]), "beta1": float(beta1), "beta2": float(beta2), "eps": float(group["eps"]),
                 "weight_decay": float(group["weight_decay"])}
            for p in group["params"]:
                if p.grad is not None:
                    _check(p, self.state.get(p) or {})
                    plan.append((p, group["amsgrad"], group["maximize"], h))
        for p, amsgrad, maximize, h in plan:
            self._update(p, amsgrad, maximize, h)
        return loss

    def _update(self, p: torch.Tensor, amsgrad: bool, maximize: bool, h: dict) -> None:
        state = self.state[p]
        if not state:  # torch.optim.AdamW's layout (non-fused, non-capturable)
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:  # (also amsgrad switched on after the state was made)
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if state["step"].device.type != "cpu":  # a state dict saved by a fused or capturable torch optimizer
            state["step"] = state["step"].detach().to("cpu", _scalar_dtype())
        step = state["step"].item() + 1  # counted once the update is written
        tensors = [p, p.grad, state["exp_avg"], state["exp_avg_sq"]] + ([state["max_exp_avg_sq"]] if amsgrad else [])
        local = _local_tensors(tensors)
        if local is not None and uses_triton(local[0]) and all(t.dtype in KERNEL_DTYPES and t.is_contiguous()
                                                              for t in local):
            adamw_step_unchecked(*local[:4], local[4] if amsgrad else None, step=step, maximize=maximize, **h)
            if local is not tensors:  # DTensors: their own version counters move too, not only their shards'
                for t in tensors[:1] + tensors[2:]:
                    torch.autograd.graph.increment_version(t)
        else:  # another device or dtype, or a strided layout: the same update in plain PyTorch
            adamw_torch(*tensors[:4], tensors[4] if amsgrad else None, step=step, maximize=maximize, **h)
        state["step"] += 1


def _check(p: torch.Tensor, state: dict) -> None:
    """What ``AdamW.step`` checks of a parameter with a gradient before it updates anything: the tensors
    (``check_adamw_tensors``), a state holding all of torch.optim.AdamW's entries or none, tensors it may write
    in place outside inference mode, and DTensors for all of param, grad and state or for none."""
    op = "liger_gen.optim.AdamW"
    if state:
        missing = [name for name in ("step",) + STATE[:2] if name not in state]
        if missing:
            raise ValueError(f"{op}: the state of the parameter of shape {tuple(p.shape)} lacks {', '.join(missing)} "
                             f"(holds {', '.join(sorted(state))})")
    present = {name: state[name] for name in STATE if name in state}
    check_adamw_tensors(op, p, p.grad, present)
    check_writable(op, {"param": p, **present})
    named = {"param": p, "grad": p.grad, **present}
    dtensor = _dtensor_class()
    kinds = {name: dtensor is not None and isinstance(t, dtensor) for name, t in named.items()}
    if len(set(kinds.values())) > 1:
        raise TypeError(f"{op}: {', '.join(n for n, d in kinds.items() if d)} of the parameter of shape "
                        f"{tuple(p.shape)} are DTensors and {', '.join(n for n, d in kinds.items() if not d)} are "
                        f"not; they must all be DTensors or none")


def _scalar_dtype() -> torch.dtype:
    """The dtype of torch.optim's step counts: float64 under a float64 default dtype, else float32."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The tensors the kernel updates: the tensors themselves, or, where all are DTensors placed alike (FSDP2's
    parameters, gradients and state), their local shards; None for a mix the kernel cannot take."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return tensors
    distributed = [isinstance(t, dtensor) for t in tensors]
    if not any(distributed):
        return tensors
    if not all(distributed) or any(t.placements != tensors[0].placements or t.device_mesh != tensors[0].device_mesh
                                   for t in tensors):
        return None
    local = [t.to_local() for t in tensors]
    return local if all(t.shape == local[0].shape for t in local) else None


def _dtensor_class():
    """``torch.distributed.tensor.DTensor``, or None in a torch built without distributed."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor
