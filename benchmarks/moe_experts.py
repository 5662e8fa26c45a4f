"""MoE experts on a GPU: transformers' experts module (its grouped_mm implementation), the same module with
liger-gen's GLU kernel as its gate, liger-gen's ``moe_experts`` (what ``liger_gen.apply_to`` installs on such
modules), and Liger-Kernel's fused MoE function.

    python benchmarks/moe_experts.py

For each shape (bf16; random routing, top-k of a softmax, weights renormalised): the wall time of one forward
+ backward of the experts (gradients of the input and both weight tensors), the median of 5 rounds of 10
back-to-back calls after a warm-up; the peak memory above the inputs and weights; and the output's and the
input gradient's relative L2 difference from an fp32 run of transformers' module on the same values. Prints a
markdown table. Liger-Kernel is skipped when it is not installed, and at shapes whose Triton autotuning runs
longer than this benchmark's budget (``LIGER_AT``: the shapes it runs at).
"""

from __future__ import annotations

import torch

from target_check_cost import wall_ms  # the same timing loop (this folder's scripts run as `python benchmarks/...`)

SHAPES = (  # name, hidden, expert width, experts, top-k, tokens
    ("Qwen3-30B-A3B", 2048, 768, 128, 8, 8192),
    ("Mixtral-8x7B", 4096, 14336, 8, 2, 4096),
    ("gpt-oss-20b-like (SwiGLU)", 2880, 2880, 32, 4, 8192),
)


LIGER_AT = ("Qwen3-30B-A3B",)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def experts_module(hidden, width, experts, dtype):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=width, num_experts=experts,
                                         num_hidden_layers=1)
    config._experts_implementation = "grouped_mm"
    module = Qwen3MoeExperts(config).cuda()
    with torch.no_grad():
        module.gate_up_proj.normal_(0, hidden ** -0.5)
        module.down_proj.normal_(0, width ** -0.5)
    return module.to(dtype)


def main() -> None:
    from liger_gen.integrations.transformers import ExpertsGate, FusedExpertsForward

    try:
        from liger_kernel.ops import LigerFusedMoEFunction
    except ImportError:
        LigerFusedMoEFunction = None
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | provider | fwd+bwd ms | peak extra GiB | out rel. diff | dx rel. diff |")
    print("|---|---|---:|---:|---:|---:|")
    for name, hidden, width, experts, k, tokens in SHAPES:
        torch.manual_seed(0)
        module = experts_module(hidden, width, experts, torch.bfloat16)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        scores = torch.randn(tokens, experts, device="cuda").softmax(-1)
        weights, index = scores.topk(k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
        dout = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        ref_module = experts_module(hidden, width, experts, torch.float32)
        with torch.no_grad():
            ref_module.gate_up_proj.copy_(module.gate_up_proj)
            ref_module.down_proj.copy_(module.down_proj)
        x32 = x.float().requires_grad_()
        ref = ref_module(x32, index, weights.float())
        (ref_dx,) = torch.autograd.grad(ref, x32, dout.float())
        del ref_module

        def transformers_step():
            xi = x.detach().requires_grad_()
            out = module(xi, index, weights)
            out.backward(dout)
            return out, xi.grad

        def liger_kernel_step():
            xi = x.detach().requires_grad_()
            out = LigerFusedMoEFunction.apply(xi, module.gate_up_proj, module.down_proj, index.int(), weights)
            out.backward(dout)
            return out, xi.grad

        providers = [("transformers grouped_mm", transformers_step, None),
                     ("transformers grouped_mm + liger-gen gate", transformers_step, ExpertsGate("silu")),
                     ("liger-gen moe_experts", transformers_step, FusedExpertsForward(module, "silu"))]
        if LigerFusedMoEFunction is not None and name in LIGER_AT:
            providers.append(("Liger-Kernel LigerFusedMoEFunction", liger_kernel_step, None))
        for provider, step, patch in providers:
            module.__dict__.pop("_apply_gate", None)
            module.__dict__.pop("forward", None)
            if isinstance(patch, ExpertsGate):
                module._apply_gate = patch
            elif patch is not None:
                module.forward = patch
            out, dx = step()
            d_out, d_dx = rel(out, ref), rel(dx, ref_dx)
            del out, dx
            module.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            module.zero_grad(set_to_none=True)
            ms = wall_ms(step, calls=10)
            module.zero_grad(set_to_none=True)
            print(f"| {name} (T={tokens}, H={hidden}, I={width}, E={experts}, k={k}) | {provider} | {ms:.3f} | "
                  f"{peak:.2f} | {d_out:.1e} | {d_dx:.1e} |", flush=True)
        module = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
