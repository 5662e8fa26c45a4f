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
