"""Host (Python) cost of one eager forward+backward call of several ops, with the kernel launches stubbed out.

What a slow host pays per call of ``liger_gen.functional.<op>`` on the kernel path besides the kernels: argument
checks, the per-call-shape plan lookup (``liger_gen.runtime.binding.PlannedOp``), output allocation, autograd.
Runs on the CPU with ``TRITON_INTERPRET=1`` (the Triton path is taken; the rendered modules' launch functions are
replaced by no-ops after a first real call), so no GPU is needed. Small shapes: the host cost does not depend on
them. Cross-entropy's target range check stays in (on the CPU it is a host check of the values).

    TRITON_INTERPRET=1 python benchmarks/host_overhead_ops.py [op ...]

Compare two versions of the tree by running this file from each (``PYTHONPATH=<tree>``), alternating, and taking
the smallest median of each (a shared host adds noise, never removes it).
"""

import os
import sys

import torch

import liger_gen
from liger_gen.runtime import ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_overhead import per_call_us  # noqa: E402  (the same clock for every op)

F = liger_gen.functional
STUBBED = ("forward", "backward", "mean_scale", "reduce", "scale_grad_")


def _stub(module) -> None:
    for name in STUBBED:
        if hasattr(module, name):
            setattr(module, name, lambda *a, **k: None)


def rms_norm():
    from liger_gen.ops.norms.rms_norm import RMSNormSpace

    x, w, dy = torch.randn(64, 256, requires_grad=True), torch.ones(256, requires_grad=True), torch.ones(64, 256)
    step = lambda: F.rms_norm(x, w).backward(dy)  # noqa: E731
    step()
    _stub(ops.kernel_module(RMSNormSpace, x.detach(), 256, 64, casting_mode="llama")[0])
    return step


def rope():
    from liger_gen.ops.rope import RoPESpace

    b, s, hq, hk, d = 1, 64, 8, 2, 64  # transformers' layout: (b, s, h, d) projections viewed as (b, h, s, d)
    q = torch.randn(b, s, hq, d).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, hk, d).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(1, s, d), torch.randn(1, s, d)
    gq, gk = torch.ones(b, hq, s, d), torch.ones(b, hk, s, d)

    def step():
        torch.autograd.backward(F.rope(q, k, cos, sin), (gq, gk))

    step()
    dims = {"n_q_heads": hq, "n_kv_heads": hk, "head_dim": d, "rotary_dim": d}
    _stub(ops.kernel_module(RoPESpace, q.detach(), dims, b * s)[0])
    return step


def cross_entropy():
    from liger_gen.ops.lm_head.cross_entropy_space import CrossEntropySpace

    logits = torch.randn(64, 512, requires_grad=True)
    target = torch.randint(0, 512, (64,))
    step = lambda: F.cross_entropy(logits, target).backward()  # noqa: E731
    step()
    _stub(ops.kernel_module(CrossEntropySpace, logits.detach(), 512, 64)[0])
    return step


def swiglu():
    from liger_gen.ops.glu.glu import GLUSpace

    gate, up = torch.randn(64, 256, requires_grad=True), torch.randn(64, 256, requires_grad=True)
    dy = torch.ones(64, 256)
    step = lambda: F.swiglu(gate, up).backward(dy)  # noqa: E731
    step()
    _stub(ops.kernel_module(GLUSpace, gate.detach(), 256, 64, activation="silu")[0])
    return step


def layer_norm():
    from liger_gen.ops.norms.layer_norm import LayerNormSpace

    x, dy = torch.randn(64, 256, requires_grad=True), torch.ones(64, 256)
    w, b = torch.ones(256, requires_grad=True), torch.zeros(256, requires_grad=True)
    step = lambda: F.layer_norm(x, w, b).backward(dy)  # noqa: E731
    step()
    _stub(ops.kernel_module(LayerNormSpace, x.detach(), 256, 64)[0])
    return step


def clamped_swiglu():
    from liger_gen.ops.glu.clamped_swiglu import ClampedSwiGLUSpace

    gate, up = torch.randn(64, 256, requires_grad=True), torch.randn(64, 256, requires_grad=True)
    dy = torch.ones(64, 256)
    step = lambda: F.clamped_swiglu(gate, up).backward(dy)  # noqa: E731
    step()
    _stub(ops.kernel_module(ClampedSwiGLUSpace, gate.detach(), 256, 64)[0])
    return step


def clamped_swiglu_gate_up():
    from liger_gen.ops.glu.clamped_swiglu import ClampedSwiGLUSpace

    gate_up, dy = torch.randn(64, 512, requires_grad=True), torch.ones(64, 256)  # gpt-oss's interleaved layout
    step = lambda: F.clamped_swiglu_gate_up(gate_up).backward(dy)  # noqa: E731
    step()
    _stub(ops.kernel_module(ClampedSwiGLUSpace, gate_up.detach()[:, ::2], 256, 64)[0])
    return step


def kl_div():
    from liger_gen.ops.divergence.kl_div import KLDivSpace

    x = torch.randn(64, 512).log_softmax(-1).requires_grad_()
    t = torch.randn(64, 512).softmax(-1)
    step = lambda: F.kl_div(x, t, reduction="batchmean").backward()  # noqa: E731
    step()
    _stub(ops.kernel_module(KLDivSpace, x.detach(), 512, 64)[0])
    return step


def jsd():
    from liger_gen.ops.divergence.jsd import JSDSpace

    s = torch.randn(64, 512).log_softmax(-1).requires_grad_()
    t = torch.randn(64, 512).log_softmax(-1)
    label = torch.randint(0, 512, (64,))
    step = lambda: F.jsd(s, t, 0.5, -100, label).backward()  # noqa: E731
    step()
    _stub(ops.kernel_module(JSDSpace, s.detach(), 512, 64)[0])
    return step


OPS = {"rms_norm": rms_norm, "rope": rope, "cross_entropy": cross_entropy, "swiglu": swiglu,
       "layer_norm": layer_norm, "clamped_swiglu": clamped_swiglu, "clamped_swiglu_gate_up": clamped_swiglu_gate_up,
       "kl_div": kl_div, "jsd": jsd}


def main(names):
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (the kernels are stubbed out, but the Triton path is taken)")
    print(f"torch {torch.__version__}; liger_gen from {os.path.dirname(liger_gen.__file__)}")
    for name in names or OPS:
        print(f"{name:24s} fwd+bwd: {per_call_us(OPS[name](), n=1000):7.1f} µs/call")


if __name__ == "__main__":
    main(sys.argv[1:])
