"""Assertions the kernel tests share: the tuner's gate on a rendered variant, heuristics valid over a sweep of
widths and devices, error messages that name what is wrong, and gradients that flow past an inference-mode
target. (Fixtures and seeding live in ``conftest``.)"""

import dataclasses

import pytest
import torch

from liger_gen.codegen.build import load_variant
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.codegen.spaces import DeviceLimits

#: the devices a heuristic must be valid on: the default, the interpreter's, and one of 256 threads per block
HEURISTIC_LIMITS = (DeviceLimits(), DeviceLimits.interpreter(), DeviceLimits(max_threads_per_block=256))


def assert_passes_the_gate(problem, changes=None):
    """``problem``'s heuristic config with ``changes`` is valid, and its rendered variant passes the tuner's
    float64 gate (NaN-poisoned outputs, per-dtype tolerance) in every phase; returns the variant's module."""
    config = dataclasses.replace(problem.space.heuristic(), **(changes or {}))
    assert not problem.space.violations(config)
    module = load_variant(problem.template, problem.template_params(config))
    for phase in problem.phases:
        assert problem.check(module, phase) is None, phase
    return module


def valid_heuristics(space_cls, dims, dtype: torch.dtype, limits=HEURISTIC_LIMITS):
    """(dims, config) of ``space_cls``'s heuristic at each of ``dims`` on each of ``limits``, each asserted valid."""
    for device_limits in limits:
        for d in dims:
            space = space_cls(d, dtype, device_limits)
            config = space.heuristic()
            assert not space.violations(config), (d, device_limits)
            yield d, config


def assert_error_names(fn, args, exc: type[Exception], words, device) -> None:
    """``fn(*args)``, its tensors moved to ``device``, raises ``exc`` with each of ``words`` in its message."""
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(exc) as info:
        fn(*args)
    for word in words:
        assert word in str(info.value)


def assert_trains_past_an_inference_mode_target(op, op_float64, make_target, device) -> None:
    """A (4, 30) target made under ``torch.inference_mode`` (``make_target()``: a frozen teacher's output) and
    log-probabilities that train: ``op``'s gradient matches ``op_float64``'s."""
    with torch.inference_mode():
        target = make_target()
    x = torch.randn(4, 30, device=device).log_softmax(-1).requires_grad_()
    op(x, target).backward()
    x64 = x.detach().double().requires_grad_()
    op_float64(x64, target.clone()).backward()
    assert rel_l2(x.grad, x64.grad) < REL_TOL[torch.float32]


def graph_leaves(outputs) -> list:
    """The leaf tensors autograd reaches from ``outputs`` (a tensor or several): the inputs a call made
    differentiable, or the bases views were taken of."""
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else outputs
    seen, todo, leaves = set(), [t.grad_fn for t in outputs if t.grad_fn is not None], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        todo.extend(n for n, _ in node.next_functions)
    return leaves


def saved_for_backward(fn):
    """(fn(), the tensors autograd saved for its backward while it ran)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


#: launch settings that reach each structural branch of the GLU-family templates (glu, squared_relu): the
#: heuristic's (one column block); several column blocks with a partial last one and row loops with a partial
#: last tile, pipelined; narrow forward and wide backward tiles
GLU_TEMPLATE_BRANCHES = [
    {},
    {"BLOCK_N_FWD": 64, "BLOCK_M_FWD": 2, "TILES_FWD": 4, "num_warps_fwd": 2, "num_stages_fwd": 2,
     "BLOCK_N_BWD": 32, "BLOCK_M_BWD": 4, "TILES_BWD": 2, "num_warps_bwd": 1, "num_stages_bwd": 3},
    {"BLOCK_N_FWD": 32, "BLOCK_M_FWD": 1, "TILES_FWD": 8, "num_warps_fwd": 1,
     "BLOCK_N_BWD": 128, "BLOCK_M_BWD": 16, "TILES_BWD": 1, "num_warps_bwd": 8},
]
GLU_TEMPLATE_BRANCH_IDS = ["heuristic", "col-blocks+row-loops", "narrow+wide"]


def lm_loss_and_grads(model, ids):
    """A causal LM's loss on ``ids`` (its own labels) and every parameter's gradient, from zeroed gradients."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


# The parts of a model whose first-step gradients a bf16 comparison checks, each as one vector (a parameter name
# goes to the first part one of whose words it contains). Per part rather than per parameter: an MoE router's or a
# key bias's gradient is roundoff-sized, so its own relative difference is noise, while each part's vector is
# dominated by its large gradients, which a wrong kernel (a scaled norm, a missing gradient) moves as a whole.
GRAD_PARTS = (("vision", ("visual.", "vision_tower.", "vision_model.", "multi_modal_projector.")),
              ("embeddings", ("embed", "lm_head")),
              ("norms", ("norm",)),
              ("mlp", ("mlp.", "experts", "feed_forward.", "block_sparse_moe.")),
              ("attention", ("attn.", "attention.")))
#: bf16 bound on each part's relative L2 difference: the activations are rounded to 8 bits between ops, and the
#: fused kernels round once where transformers rounds each op, so a gradient moves by several ulps (2^-8 relative
#: each) of the values it sums; measured on an H100 up to 8.9e-2 (Gemma 4's per-layer embeddings, "other"; an MoE
#: expert bank's up to 7.9e-2, most parts 1e-3 to 1e-2), so 2^-3 = 32 ulps. Gemma 4's mini model is that
#: sensitive in itself: transformers' own bf16 gradients are 5-10% from its float32 ones per part (on the CPU).
#: A norm scaled by 1.1 moves some part downstream by 0.15 or more, a part whose gradient is lost by 1.
BF16_GRAD_PART_RTOL = 2.0 ** -3


def all_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, as it stands (float32 copies)."""
    return {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}


def grad_part_rel_l2(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative L2 distance of ``got`` from ``want`` per part of ``GRAD_PARTS`` (the rest: "other"), each part's
    gradients flattened into one vector; parts whose ``want`` is all zero are left out."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    diff: dict[str, float] = {}
    norm: dict[str, float] = {}
    for name in want:
        part = next((p for p, words in GRAD_PARTS if any(w in name for w in words)), "other")
        diff[part] = diff.get(part, 0.0) + (got[name].double() - want[name].double()).square().sum().item()
        norm[part] = norm.get(part, 0.0) + want[name].double().square().sum().item()
    return {p: (diff[p] / norm[p]) ** 0.5 for p in norm if norm[p] > 0}


def assert_bf16_training_matches(model_type: str, report, losses, ref_losses, grads, ref_grads) -> None:
    """A bf16 training run against transformers': the loss curves within bf16's epsilon
    (``liger_gen.training.compare_losses``) and every part's first-step gradients within ``BF16_GRAD_PART_RTOL``
    (the loss of a random mini model stays near ln(vocab) whatever its kernels do: the gradients tell them apart).
    Prints the figures (``pytest -rP`` shows them)."""
    from liger_gen.training import compare_losses, loss_rel_tolerance

    result = compare_losses(losses, ref_losses, loss_rel_tolerance(torch.bfloat16))
    parts = grad_part_rel_l2(grads, ref_grads)
    print(f"{model_type}: {report.summary()}; first {result['first_step_rel_diff']:.2e}, "
          f"mean {result['mean_rel_diff']:.2e}, max {result['max_rel_diff']:.2e}; first-step gradients "
          + ", ".join(f"{p} {d:.1e}" for p, d in parts.items()))
    assert result["pass"], (model_type, result)
    assert parts and max(parts.values()) <= BF16_GRAD_PART_RTOL, (model_type, parts)


def table_lookups(model, batch: dict) -> set[tuple[str, object]]:
    """The (space class name, dims) at which a training step of ``model`` patched by ``apply_to`` looks its tables
    up, on the kernel path (Triton's interpreter; set TRITON_INTERPRET=1 first): dims as the runtime keys them, a
    dict, or the width alone for a one-dim op. The lookups of earlier calls are cleared first; RoPE's process-wide
    routing is undone after."""
    import ast

    import liger_gen
    from liger_gen.integrations.transformers import restore_rope
    from liger_gen.runtime import ops as runtime_ops

    runtime_ops.clear_caches()
    try:
        liger_gen.apply_to(model)
        model(**batch).loss.backward()
    finally:
        restore_rope()
    lookups = set()
    for key, _ in runtime_ops.chosen_configs():
        dims = ast.literal_eval(key[2])
        lookups.add((key[0], tuple(sorted(dict(dims).items())) if isinstance(dims, (tuple, list)) else dims))
    return lookups
