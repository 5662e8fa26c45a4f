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

from liger_gen.ops.optim.adamw import (adamw_step_unchecked, adamw_torch, check_adamw_tensors,
                                       check_hyperparameters)
from liger_gen.runtime.ops import KERNEL_DTYPES, uses_triton

__all__ = ["AdamW"]


class AdamW(torch.optim.AdamW):
    """AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization") with the update of
    ``torch.optim.AdamW``, one tuned Triton kernel launch per parameter.

    Args:
        params: parameters or parameter groups, as for any ``torch.optim`` optimizer.
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW`` (lr may be a tensor; it is read
            as a Python float each step).
        foreach, fused: accepted for drop-in use only as None or False: this optimizer is its own fused
            implementation.
        capturable, differentiable: must be False.

    Each element is computed in fp32 (float64 for float64 parameters) and stored once in its tensor's dtype, as
    torch's fused AdamW does; the state has the parameter's dtype. The step count stays on the host as a float32
    CPU tensor (``torch.optim.AdamW``'s non-fused layout; a state dict with device step counts is read back to
    the host once), so a step never synchronises with the GPU.

    CUDA parameters of float32, bfloat16 or float16 run the kernel (CPU parameters too, under
    ``TRITON_INTERPRET=1``); any other parameter (CPU, float64) runs the same update in plain PyTorch.

    Raises:
        ValueError: at construction, a hyperparameter out of ``torch.optim.AdamW``'s ranges, ``capturable`` or
            ``differentiable`` set, ``foreach`` or ``fused`` True. At ``step``, a gradient whose shape or device
            differs from its parameter's.
        TypeError: at ``step``, a sparse or complex (not floating-point) gradient, parameter or state.
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
                         maximize=maximize, foreach=False, capturable=False, differentiable=False, fused=False)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient; returns ``closure()``'s loss when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            h = check_hyperparameters("liger_gen.optim.AdamW", float(group["lr"]), float(beta1), float(beta2),
                                      group["eps"], group["weight_decay"])
            del h["step"]
            amsgrad, maximize = group["amsgrad"], group["maximize"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._update(p, p.grad, amsgrad, maximize, h)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, amsgrad: bool, maximize: bool, h: dict) -> None:
        state = self.state[p]
        if not state:  # torch.optim.AdamW's layout (non-fused, non-capturable)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        vmax = state.get("max_exp_avg_sq") if amsgrad else None
        if amsgrad and vmax is None:  # amsgrad switched on after the state was made
            vmax = state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        check_adamw_tensors("liger_gen.optim.AdamW", p, grad, {"exp_avg": m, "exp_avg_sq": v,
                                                                "max_exp_avg_sq": vmax})
        if state["step"].device.type != "cpu":  # a state dict saved by a fused or capturable torch optimizer
            state["step"] = state["step"].detach().to("cpu", torch.float32)
        state["step"] += 1
        step = state["step"].item()
        tensors = (p, grad, m, v) + ((vmax,) if vmax is not None else ())
        if uses_triton(p) and all(t.dtype in KERNEL_DTYPES and t.is_contiguous() for t in tensors):
            adamw_step_unchecked(p, grad, m, v, vmax, step=step, maximize=maximize, **h)
        else:  # another device or dtype, or a strided layout: the same update in plain PyTorch
            adamw_torch(p, grad, m, v, vmax, step=step, maximize=maximize, **h)
