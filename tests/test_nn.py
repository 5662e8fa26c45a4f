"""liger_gen.nn modules are drop-ins: same constructor, state_dict and values as the modules they replace."""

import pytest
import torch

import liger_gen
from liger_gen.codegen.problems import FP32_OUT_TOL, REL_TOL, rel_l2


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_loss_module_matches_torch(reduction, device):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 5, 19, generator=gen).to(device).requires_grad_()
    target = torch.randint(0, 19, (6, 5), generator=gen).to(device)
    target[0, :2] = 7
    weight = torch.rand(19, generator=gen).to(device) + 0.5
    ours = liger_gen.nn.CrossEntropyLoss(weight=weight, ignore_index=7, reduction=reduction, label_smoothing=0.1)
    theirs = torch.nn.CrossEntropyLoss(weight=weight.double(), ignore_index=7, reduction=reduction,
                                       label_smoothing=0.1)
    loss = ours(logits, target)
    x64 = logits.detach().double().requires_grad_()
    ref = theirs(x64.reshape(-1, 19), target.reshape(-1)).reshape(loss.shape)
    upstream = torch.randn(loss.shape, generator=gen).to(device)
    loss.backward(upstream)
    ref.backward(upstream.double())
    assert "weight" in dict(ours.named_buffers())
    assert rel_l2(loss.detach(), ref.detach()) < FP32_OUT_TOL
    assert rel_l2(logits.grad, x64.grad) < REL_TOL[torch.float32]


class _Block(torch.nn.Module):
    """Every op family in one module: RMSNorm, LayerNorm, the fused residual norm, RoPE, SwiGLU and GeGLU,
    cross-entropy, fused linear cross-entropy, KL divergence and JSD."""

    def __init__(self, hidden=32, vocab=40):
        super().__init__()
        self.norm = liger_gen.nn.RMSNorm(hidden)
        self.ln = liger_gen.nn.LayerNorm(hidden)
        self.gate = torch.nn.Linear(hidden, 2 * hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, x, target):
        F = liger_gen.functional
        h, r = F.fused_add_rms_norm(self.ln(x), x, self.norm.weight)
        g, u = self.gate(self.norm(h + r)).chunk(2, dim=-1)
        h = F.swiglu(g, u) + F.geglu(g, u, "tanh")
        rows = h.reshape(-1, 1, 4, 8)
        q, k = F.rope(rows, rows, torch.cos(rows[:, 0]), torch.sin(rows[:, 0]))
        h = (q + k).reshape(h.shape)
        logits = self.head(h)
        logp = torch.log_softmax(logits, -1)
        return (F.cross_entropy(logits, target) + F.fused_linear_cross_entropy(h, self.head.weight, target)
                + F.kl_div(logp, logp.detach().flip(0), log_target=True) + F.jsd(logp, logp.detach().flip(0)))


def test_torch_jit_trace_records_the_ops_and_replays_at_other_shapes(device):
    """torch.jit.trace records each op as its registered custom op (an autograd.Function would be traced into
    the kernel launch and fail): the traced module gives the eager values and gradients, also for a row count
    it was not traced with."""
    import warnings

    torch.manual_seed(0)
    block = _Block().to(device)
    x, target = torch.randn(6, 32, device=device), torch.randint(0, 40, (6,), device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace is deprecated; shape checks give TracerWarnings
        traced = torch.jit.trace(block, (x, target), check_trace=False)
    for rows in (6, 10):
        x = torch.randn(rows, 32, device=device, requires_grad=True)
        target = torch.randint(0, 40, (rows,), device=device)
        got = traced(x, target)
        got.backward()
        grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
        block.zero_grad()
        x.grad = None
        want = block(x, target)
        want.backward()
        torch.testing.assert_close(got, want)
        for a, b in zip(grads, [p.grad for p in block.parameters()] + [x.grad]):
            torch.testing.assert_close(a, b)
        block.zero_grad()


def test_jit_trace_of_the_fused_loss_is_right_for_other_grad_states(device):
    """A trace made with a frozen LM head (or under no_grad) replays with a trainable one: the trace records the
    op with every gradient computed, so the head's gradient is there (it used to be an empty tensor)."""
    import warnings

    from liger_gen.codegen.problems import REL_TOL, rel_l2
    from liger_gen.ops.lm_head.fused_linear_cross_entropy import fused_linear_cross_entropy_float64

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 16, generator=gen).to(device)
    w = (torch.randn(30, 16, generator=gen) / 4).to(device)
    t = torch.randint(0, 30, (9,), generator=gen).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(liger_gen.functional.fused_linear_cross_entropy, (x, w, t), check_trace=False)
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    traced(x2, w2, t).backward()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    fused_linear_cross_entropy_float64(x64, w64, t).backward()
    assert rel_l2(x2.grad, x64.grad) < REL_TOL[torch.float32] and rel_l2(w2.grad, w64.grad) < REL_TOL[torch.float32]
