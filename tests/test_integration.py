"""``liger_gen.apply_to`` on small transformers models: what it swaps, and that the model computes the same."""

import pytest
import torch

import liger_gen
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.integrations import transformers as integration
from liger_gen.integrations.transformers import layers

from conftest import CPU_PATHS, rope_call


@pytest.fixture(autouse=True)
def _restore_rope():
    yield
    integration.restore_rope()
    integration.restore_layers()


def _model(family: str, device, seed: int = 0, tie: bool = False):
    import transformers

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=211, max_position_embeddings=128, tie_word_embeddings=tie)
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.Qwen3Config(**common, head_dim=16)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(device)
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm that ignored them would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "qwen2", pytest.param("qwen3", marks=pytest.mark.skipif(
    not hasattr(pytest.importorskip("transformers"), "Qwen3Config"), reason="Qwen3 needs transformers>=4.51"))])
def test_apply_to_swaps_every_part_and_training_matches(family, device):
    model = _model(family, device)
    model.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 211, (2, 24), generator=gen).to(device)
    labels = ids.clone()
    labels[0, :5] = -100  # prompt tokens masked, as in instruction tuning
    ref_out, ref_grads = _loss_and_grads(model, ids, labels)
    params_before = dict(model.named_parameters())

    assert liger_gen.apply_to(model) is model
    assert liger_gen.apply_to(model) is model  # twice is harmless
    n_norms = 2 * 2 + 1 + (2 * 2 if family == "qwen3" else 0)  # qwen3 adds per-head q/k norms
    assert sum(isinstance(m, liger_gen.nn.RMSNorm) for m in model.modules()) == n_norms
    assert sum(isinstance(m, liger_gen.nn.GLUMLP) for m in model.modules()) == 2
    assert dict(model.named_parameters()).keys() == params_before.keys()
    assert all(params_before[n] is p for n, p in model.named_parameters())

    out, grads = _loss_and_grads(model, ids, labels)
    assert out.logits is None  # training loss without logits
    assert rel_l2(out.loss.detach(), ref_out.loss.detach()) < 1e-4
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_l2(g, ref_grads[name]) < 1e-3, name


def test_residual_add_runs_inside_the_next_norm(device, monkeypatch):
    """Each decoder layer's attention residual add runs in the post-attention norm's kernel (one
    fused_add_rms_norm call per layer per forward), and the model computes what transformers' does: loss and
    every gradient against the unpatched model in float64, as close as the unfused patch gets."""
    import copy

    import liger_gen.functional

    calls = []
    fused = liger_gen.functional.fused_add_rms_norm

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return fused(*args, **kwargs)

    monkeypatch.setattr(liger_gen.functional, "fused_add_rms_norm", counted)
    model = _model("llama", device).train()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 211, (2, 20), generator=gen).to(device)
    _, ref = _loss_and_grads(copy.deepcopy(model).double(), ids, ids)
    unfused = liger_gen.apply_to(copy.deepcopy(model), fused_add_rms_norm=False)
    assert unfused.liger_gen_report.fused_adds == 0
    assert not any(getattr(m, "fuse_residual", False) for m in unfused.modules())
    liger_gen.apply_to(model)
    assert model.liger_gen_report.fused_adds == 2 and "2 residual adds fused" in model.liger_gen_report.summary()
    assert "fused_add_rms_norm" in integration.patched_ops(model)
    _, base = _loss_and_grads(unfused, ids, ids)
    assert not calls
    out, grads = _loss_and_grads(model, ids, ids)
    assert calls == [torch.Size([2, 20, 64])] * 2
    for name, g in grads.items():
        err, err_unfused = rel_l2(g.double(), ref[name]), rel_l2(base[name].double(), ref[name])
        assert err <= max(2 * err_unfused, 4 * REL_TOL[torch.float32]), (name, err, err_unfused)
    # a second apply_to keeps the one rewrite; a copy and a pickle carry it
    liger_gen.apply_to(model)
    assert model.liger_gen_report.fused_adds == 2
    for other in (copy.deepcopy(model), __import__("pickle").loads(__import__("pickle").dumps(model))):
        calls.clear()
        assert other.model.layers[0].post_attention_layernorm.fuse_residual
        other_out, _ = _loss_and_grads(other, ids, ids)
        assert len(calls) == 2 and torch.equal(other_out.loss, out.loss)


def test_fused_residual_forward_falls_back_where_the_norm_is_not_liger_gens(device):
    """The rewritten layer code is process-wide: an unpatched model of the family, and a layer whose norm was put
    back to transformers' own after apply_to, add and then norm exactly as transformers' statements do."""
    model = _model("llama", device).train()
    other = _model("llama", device, seed=1).train()
    ids = torch.randint(0, 211, (1, 12)).to(device)
    expected, expected_other = (m(input_ids=ids, labels=ids).loss.detach() for m in (model, other))
    original = [layer.post_attention_layernorm for layer in model.model.layers]
    liger_gen.apply_to(model, rope=False)
    assert torch.equal(other(input_ids=ids, labels=ids).loss.detach(), expected_other)  # bit for bit
    for layer, norm in zip(model.model.layers, original):
        layer.post_attention_layernorm = norm
    assert rel_l2(model(input_ids=ids, labels=ids).loss.detach(), expected) < 1e-5
    liger_gen.apply_to(model, rms_norm=False, rope=False)  # no liger-gen norm marked: nothing fused
    assert model.liger_gen_report.fused_adds == 0


def test_a_forward_hook_on_the_norm_sees_its_usual_input_and_output(device, monkeypatch):
    """A hook on a post-attention norm (an activation probe, DeepSpeed ZeRO-3's) gets the sum as input and one
    tensor as output, as without the fusion: that layer adds, then calls the norm."""
    import liger_gen.functional

    calls = []
    fused = liger_gen.functional.fused_add_rms_norm
    monkeypatch.setattr(liger_gen.functional, "fused_add_rms_norm",
                        lambda *a, **k: calls.append(1) or fused(*a, **k))
    model = liger_gen.apply_to(_model("llama", device).train(), rope=False)
    seen = []
    model.model.layers[1].post_attention_layernorm.register_forward_hook(
        lambda module, args, out: seen.append((args, out)))
    ids = torch.randint(0, 211, (1, 10)).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    (args, out), = seen
    assert len(args) == 1 and isinstance(out, torch.Tensor) and out.shape == args[0].shape == (1, 10, 64)
    assert len(calls) == 1  # layer 0 still fused


def test_fusion_keeps_what_wraps_a_layer_forward(device, monkeypatch):
    """The rewrite changes the code of the layer's innermost forward only: a wrapper on a layer instance
    (accelerate's dispatch hooks), someone's functools.wraps wrapper on the class and transformers' gradient
    checkpointing keep running, with the add fused; restore_layers() puts transformers' code back."""
    import functools

    import liger_gen.functional
    from transformers.models.llama import modeling_llama

    fused_calls = []
    fused = liger_gen.functional.fused_add_rms_norm
    monkeypatch.setattr(liger_gen.functional, "fused_add_rms_norm",
                        lambda *a, **k: fused_calls.append(1) or fused(*a, **k))
    cls = modeling_llama.LlamaDecoderLayer
    plain_forward = cls.__dict__["forward"]
    ran = []

    @functools.wraps(plain_forward)
    def logged(self, *args, **kwargs):
        ran.append("class")
        return plain_forward(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", logged)
    model = _model("llama", device).train()
    layer = model.model.layers[0]
    original = layer.forward
    layer.forward = lambda *a, **k: ran.append("instance") or original(*a, **k)
    liger_gen.apply_to(model, rope=False)
    assert model.liger_gen_report.fused_adds == 2
    ids = torch.randint(0, 211, (1, 6)).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    assert ran == ["instance", "class", "class"] and len(fused_calls) == 2
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        recomputed = []
        monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", functools.partial(
            lambda real, *a, **k: recomputed.append(1) or real(*a, **k), torch.utils.checkpoint.checkpoint))
        fused_calls.clear()
        model(input_ids=ids, labels=ids).loss.backward()
        assert len(fused_calls) >= 2  # the forward, then the checkpointed recompute (if transformers routes it)
    integration.restore_layers()
    fused_calls.clear()
    model(input_ids=ids, labels=ids)
    assert not fused_calls and model.model.layers[1].post_attention_layernorm.fuse_residual


def test_layer_rewrite_edges(device):
    """restore_layers() keeps the helper a running forward may still call, and a copy of a patched model made
    after it does not rewrite the code again; a model holding a TorchScript module is patched; a post-norm
    layer (OLMo 2: ``h = self.mlp(h)`` after the add) is not rewritten."""
    import copy

    from transformers.models.llama import modeling_llama

    model = liger_gen.apply_to(_model("llama", device).train(), rope=False)
    integration.restore_layers()
    assert callable(getattr(modeling_llama, layers.HELPER))
    copy.deepcopy(model)
    assert not layers.fused_norm_names(modeling_llama.LlamaDecoderLayer)
    assert liger_gen.apply_to(model, rope=False).liger_gen_report.fused_adds == 2  # apply_to rewrites again

    scripted = _model("llama", device).train()
    scripted.probe = torch.jit.script(torch.nn.Linear(2, 2))
    assert liger_gen.apply_to(scripted, rope=False).liger_gen_report.fused_adds == 2

    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    assert layers.fuse_layer_code(olmo2.Olmo2DecoderLayer) is None


def test_data_parallel_replicas_run_their_own_modules(device):
    """nn.DataParallel copies each module's __dict__ into its replicas: the fused-loss forward apply_to installs
    is bound to the replica, not to the original (whose weights live on another device)."""
    model = liger_gen.apply_to(_model("llama", device).train(), rope=False)
    replica = model._replicate_for_data_parallel()
    assert replica is not model and replica.forward.module is replica
    assert replica._replicate_for_data_parallel().forward.module is not replica  # a replica's replica
    layer_replica = model.model.layers[0]._replicate_for_data_parallel()
    assert "forward" not in vars(layer_replica)  # the layers' fusion lives in their class's code


def test_no_fusion_without_liger_gens_norms(device):
    model = liger_gen.apply_to(_model("qwen2", device), rms_norm=False, rope=False)
    assert model.liger_gen_report.fused_adds == 0 and "residual" not in model.liger_gen_report.summary()


def test_eval_mode_returns_logits_equal_to_transformers(device):
    model = _model("llama", device).eval()
    ids = torch.randint(0, 211, (1, 16)).to(device)
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids)
        liger_gen.apply_to(model)
        got = model(input_ids=ids, labels=ids)
    assert rel_l2(got.logits, expected.logits) < REL_TOL[torch.float32] * 10
    assert rel_l2(got.loss, expected.loss) < REL_TOL[torch.float32] * 10


def test_num_items_in_batch_divides_the_summed_loss(device):
    """Gradient accumulation: transformers' trainer passes num_items_in_batch; the loss is sum / that count."""
    import inspect

    model = _model("llama", device).train()
    if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values()):
        pytest.skip("transformers<4.46: the causal-LM forward takes no num_items_in_batch")
    ids = torch.randint(0, 211, (2, 12)).to(device)
    expected = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(37)).loss.detach()
    liger_gen.apply_to(model)
    got = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(37)).loss.detach()
    assert rel_l2(got, expected) < 1e-4


def test_tied_embeddings_get_the_head_gradient(device):
    model = _model("qwen2", device, tie=True).train()
    ids = torch.randint(0, 211, (2, 10)).to(device)
    _, ref = _loss_and_grads(model, ids, ids)
    liger_gen.apply_to(model)
    _, got = _loss_and_grads(model, ids, ids)
    name = "model.embed_tokens.weight"
    assert rel_l2(got[name], ref[name]) < 1e-3


def test_flags_switch_replacements_off(device):
    model = _model("llama", device)
    liger_gen.apply_to(model, rms_norm=False, swiglu=False, rope=False, fused_linear_cross_entropy=False)
    assert not any(isinstance(m, (liger_gen.nn.RMSNorm, liger_gen.nn.GLUMLP)) for m in model.modules())
    assert "forward" not in vars(model)
    from transformers.models.llama import modeling_llama

    assert not getattr(modeling_llama.apply_rotary_pos_emb, "liger_gen", False)


def test_restore_rope_puts_transformers_function_back(device):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    liger_gen.apply_to(_model("llama", device))
    assert modeling_llama.apply_rotary_pos_emb.liger_gen
    integration.restore_rope()
    assert modeling_llama.apply_rotary_pos_emb is original
    assert not getattr(modeling_llama.apply_rotary_pos_emb, "liger_gen", False)


def test_patched_rope_keeps_transformers_signature(device):
    """Callers of the module function may pass unsqueeze_dim positionally, as transformers' signature allows."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 5, 4, 8, generator=gen).to(device), torch.randn(2, 5, 2, 8, generator=gen).to(device)
    cos, sin = torch.randn(2, 5, 8, generator=gen).to(device), torch.randn(2, 5, 8, generator=gen).to(device)
    import inspect

    expected = original(q, k, cos, sin, unsqueeze_dim=2)
    liger_gen.apply_to(_model("llama", device))
    # unsqueeze_dim is the 5th parameter since transformers 5.0, the 6th (after position_ids) before
    padding = [None] * (list(inspect.signature(rope_call(modeling_llama)).parameters).index("unsqueeze_dim") - 4)
    got = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, *padding, 2)
    for a, b in zip(got, expected):
        assert rel_l2(a, b) < REL_TOL[torch.float32]


def test_return_dict_false_and_positional_arguments(device):
    model = _model("llama", device).train()
    ids = torch.randint(0, 211, (2, 9)).to(device)
    expected = model(input_ids=ids, labels=ids).loss.detach()
    liger_gen.apply_to(model)
    out = model(input_ids=ids, labels=ids, return_dict=False)
    # transformers' tuple, with None where the logits would be (the fused loss never computes them)
    assert isinstance(out, tuple) and rel_l2(out[0].detach(), expected) < 1e-4 and out[1] is None
    positional = model(ids, None, None, None, None, ids)  # labels is the 6th parameter of forward
    assert rel_l2(positional.loss.detach(), expected) < 1e-4
    model.eval()  # eval mode with gradients enabled (e.g. training without dropout): still the fused loss
    evaluated = model(ids, None, None, None, None, ids)
    assert evaluated.logits is None and rel_l2(evaluated.loss.detach(), expected) < 1e-4
    with torch.no_grad():  # an evaluation loop: the original forward and its logits
        assert model(ids, None, None, None, None, ids).logits is not None


def test_patched_model_pickles_and_loads(device):
    import io

    model = _model("qwen2", device).train()
    liger_gen.apply_to(model)
    ids = torch.randint(0, 211, (1, 8)).to(device)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.forward.module is loaded and loaded.liger_gen_report.rope
    a, b = model(input_ids=ids, labels=ids), loaded(input_ids=ids, labels=ids)
    assert b.logits is None and rel_l2(b.loss.detach(), a.loss.detach()) < 1e-6
    # as in a new process: the RoPE routing is process-wide and not part of the pickle; the report says so
    from liger_gen.integrations.transformers import restore_rope

    restore_rope()
    # what the loaded model's attention modules keep of the rotary function (transformers 5.25 with `kernels`:
    # private copies, rebuilt from the module-level object when unpickled) is transformers' own again
    kept = [f for m in loaded.modules() for f in (m.__dict__.get("_kernel_funcs") or {}).values()]
    assert not any(getattr(f, "liger_gen", False) for f in kept)
    buffer.seek(0)
    fresh = torch.load(buffer, weights_only=False)
    assert not fresh.liger_gen_report.rope and "apply_to" in fresh.liger_gen_report.note
    assert liger_gen.apply_to(fresh).liger_gen_report.rope
    restore_rope()


def test_a_patched_model_loaded_in_a_new_process_compiles_without_a_graph_break(tmp_path):
    """A patched model saved whole and loaded in a process that never called apply_to: torch.compile with
    fullgraph=True gives the eager loss (what the fused-loss forward looks up is read when it is unpickled)."""
    import os
    import subprocess
    import sys

    model = _model("llama", torch.device("cpu")).train()
    liger_gen.apply_to(model)
    torch.save(model, tmp_path / "model.pt")
    script = (
        "import sys, torch\n"
        "m = torch.load(sys.argv[1], weights_only=False)\n"
        "ids = torch.randint(0, 211, (2, 9), generator=torch.Generator().manual_seed(3))\n"
        "got = torch.compile(m, backend='aot_eager', fullgraph=True)(input_ids=ids, labels=ids).loss\n"
        "expected = m(input_ids=ids, labels=ids).loss\n"
        "from liger_gen.integrations.transformers.patch import count_fused_adds\n"
        "print(count_fused_adds(m))\n"  # the layers' rewritten code is made again when the model is loaded
        "print(abs(got.item() - expected.item()) / expected.item())\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.pt")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert int(lines[-2]) == 2 and float(lines[-1]) < 1e-6


def test_use_cache_in_training_runs_the_original_forward(device):
    model = _model("llama", device).train()
    liger_gen.apply_to(model)
    ids = torch.randint(0, 211, (1, 8)).to(device)
    out = model(input_ids=ids, labels=ids, use_cache=True)
    assert out.logits is not None and out.loss is not None


def test_unsupported_model_is_rejected():
    with pytest.raises(ValueError, match="model_type"):
        liger_gen.apply_to(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_compiled_training_step_of_a_patched_model_on_cpu(interpret, monkeypatch):
    """torch.compile of a patched model's whole training step (forward, fused loss, backward) on CPU tensors, in
    the interpreter and on the plain path: the same loss and gradients as the eager patched model."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    model = _model("llama", torch.device("cpu")).train()
    liger_gen.apply_to(model)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 211, (2, 12), generator=gen)
    labels = ids.clone()
    labels[:, :3] = -100

    def step(ids, labels):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach()

    expected = step(ids, labels)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = torch.compile(step, backend="aot_eager")(ids, labels)
    assert rel_l2(got, expected) < 1e-6
    for name, p in model.named_parameters():
        assert rel_l2(p.grad, ref_grads[name]) < 1e-5, name


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_patched_model_forward_compiles_without_a_graph_break(family, interpret, monkeypatch):
    """torch.compile(fullgraph=True) of a patched model's forward (RoPE routed, the fused loss), whatever form
    transformers gives its rotary function (a function, or with the ``kernels`` package a module whose attention
    callers wrap it): the same loss and gradients as eager."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    model = _model(family, torch.device("cpu")).train()
    liger_gen.apply_to(model)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 211, (2, 10), generator=gen)
    expected = model(input_ids=ids, labels=ids).loss
    expected.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    got = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids).loss
    got.backward()
    assert rel_l2(got.detach(), expected.detach()) < 1e-6
    for name, p in model.named_parameters():
        assert rel_l2(p.grad, ref_grads[name]) < 1e-5, name


def test_use_cache_false_reaches_the_base_model():
    """A training call with use_cache=False builds no cache, as transformers' own forward does (the cache would
    cost memory every step and shift return_dict=False's tuple)."""
    model = _model("llama", "cpu").train()
    ids = torch.randint(0, 211, (2, 9))
    plain = model(input_ids=ids, labels=ids, use_cache=False, return_dict=False)
    liger_gen.apply_to(model)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits is None and getattr(out, "past_key_values", None) is None
    assert len(model(input_ids=ids, labels=ids, use_cache=False, return_dict=False)) == len(plain)


_BACKWARD_HOOKS = {
    "full": lambda norm, hook: norm.register_full_backward_hook(lambda m, gi, go: hook(gi, go)),
    "full_pre": lambda norm, hook: norm.register_full_backward_pre_hook(lambda m, go: hook(None, go)),
    "global_full": lambda norm, hook: torch.nn.modules.module.register_module_full_backward_hook(
        lambda m, gi, go: hook(gi, go) if m is norm else None),
    "global_full_pre": lambda norm, hook: torch.nn.modules.module.register_module_full_backward_pre_hook(
        lambda m, go: hook(None, go) if m is norm else None),
}


@pytest.mark.parametrize("kind", sorted(_BACKWARD_HOOKS))
def test_a_backward_hook_on_a_fused_norm_sees_and_gives_the_unpatched_gradients(kind, device):
    """A backward hook on a post-attention norm (gradient monitoring, clipping, attribution), of any kind and
    registered after apply_to, sees one grad_output shaped like the norm's output, and the model's gradients are
    the unpatched model's: that layer adds, then calls the norm, for as long as the hook is there."""
    ids = torch.randint(0, 211, (2, 10)).to(device)
    results = []
    for patched in (False, True):
        model = _model("llama", device).train()
        if patched:
            liger_gen.apply_to(model, rope=False)
            assert model.liger_gen_report.fused_adds == 2
        norm = model.model.layers[1].post_attention_layernorm
        seen = []
        handle = _BACKWARD_HOOKS[kind](norm, lambda gi, go: seen.append(
            ([None if g is None else g.detach().clone() for g in gi] if gi is not None else None,
             [g.detach().clone() for g in go])))
        try:
            _, grads = _loss_and_grads(model, ids, ids)
        finally:
            handle.remove()
        results.append((seen, grads))
    (plain_seen, plain_grads), (seen, grads) = results
    assert len(seen) == len(plain_seen) == 1
    (grad_in, grad_out), (plain_in, plain_out) = seen[0], plain_seen[0]
    assert len(grad_out) == len(plain_out) == 1 and grad_out[0].shape == plain_out[0].shape
    assert rel_l2(grad_out[0], plain_out[0]) < REL_TOL[torch.float32]
    if plain_in is not None:
        assert len(grad_in) == len(plain_in) == 1 and rel_l2(grad_in[0], plain_in[0]) < REL_TOL[torch.float32]
    assert grads.keys() == plain_grads.keys()
    for name, g in grads.items():
        assert rel_l2(g, plain_grads[name]) < REL_TOL[torch.float32], name


def test_a_backward_hook_turns_the_fusion_off_only_while_it_is_there(device, monkeypatch):
    import liger_gen.functional

    calls = []
    fused = liger_gen.functional.fused_add_rms_norm
    monkeypatch.setattr(liger_gen.functional, "fused_add_rms_norm",
                        lambda *a, **k: calls.append(1) or fused(*a, **k))
    model = liger_gen.apply_to(_model("llama", device).train(), rope=False)
    ids = torch.randint(0, 211, (1, 8)).to(device)
    handle = model.model.layers[0].post_attention_layernorm.register_full_backward_hook(lambda *a: None)
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 1  # layer 1 only
    handle.remove()
    calls.clear()
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 2


_LAYER_SOURCE = '''
import torch


class ToyDecoderLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(8, 8)
        self.post_attention_layernorm = torch.nn.LayerNorm(8)
        self.mlp = torch.nn.Linear(8, 8)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states
'''


def _toy_layer_module(tmp_path, monkeypatch, name):
    import importlib
    import sys

    (tmp_path / f"{name}.py").write_text(_LAYER_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_layer_rewrite_reads_the_source_of_the_code_that_runs(tmp_path, monkeypatch):
    """The rewrite parses the class's source file: where it matches the running code the add is fused, the same
    values; where the file was edited after import, the running code stays (not the edited body) and the class
    is refused with the reason."""
    import os

    toy = _toy_layer_module(tmp_path, monkeypatch, "liger_gen_toy_layer_a")
    layer = toy.ToyDecoderLayer()
    x = torch.randn(3, 8)
    expected = layer(x).detach()
    assert layers.fuse_layer_code(toy.ToyDecoderLayer) == ("post_attention_layernorm",)
    assert torch.allclose(layer(x), expected, rtol=0, atol=1e-6)
    integration.restore_layers()

    edited = tmp_path / "liger_gen_toy_layer_a.py"
    edited.write_text(_LAYER_SOURCE.replace("hidden_states = self.mlp(hidden_states)",
                                            "hidden_states = self.mlp(hidden_states) * 2"))
    os.utime(edited, (0, 0))  # another mtime, as after an upgrade
    code = toy.ToyDecoderLayer.forward.__code__
    assert layers.fuse_layer_code(toy.ToyDecoderLayer) is None
    assert toy.ToyDecoderLayer.forward.__code__ is code
    assert torch.equal(layer(x).detach(), expected)  # not the edited body
    assert "has changed since" in integration.layer_code_refusal(toy.ToyDecoderLayer)
    edited.write_text(_LAYER_SOURCE)  # the file the class came from again: fused
    integration.restore_layers()
    assert integration.layer_code_refusal(toy.ToyDecoderLayer) is None
    assert layers.fuse_layer_code(toy.ToyDecoderLayer) == ("post_attention_layernorm",)


def test_apply_to_reports_a_layer_whose_source_file_changed(device, monkeypatch):
    """apply_to on a model whose decoder layer's file no longer holds the running code: the layers stay
    unfused and the report lists them with the reason; strict=True raises and changes nothing."""
    import inspect

    from transformers.models.llama import modeling_llama

    real = inspect.getsourcelines
    inner = inspect.unwrap(modeling_llama.LlamaDecoderLayer.forward)

    def edited(obj):
        lines, first = real(obj)
        if obj is inner:  # as if the file had been edited under the running process
            lines = [line.replace("hidden_states = self.mlp(hidden_states)",
                                  "hidden_states = self.mlp(hidden_states) * 2") for line in lines]
        return lines, first

    monkeypatch.setattr(inspect, "getsourcelines", edited)
    model = _model("llama", device).train()
    ids = torch.randint(0, 211, (1, 8)).to(device)
    expected = model(input_ids=ids, labels=ids).loss.detach()
    with pytest.raises(ValueError, match="has changed since"):
        liger_gen.apply_to(model, rope=False, strict=True)
    assert not hasattr(model, "liger_gen_report")
    liger_gen.apply_to(model, rope=False)
    report = model.liger_gen_report
    assert report.fused_adds == 0 and any("LlamaDecoderLayer ×2" in item and "has changed since" in item
                                          for item in report.left), report.summary()
    assert rel_l2(model(input_ids=ids, labels=ids).loss.detach(), expected) < REL_TOL[torch.float32]


def test_a_layer_whose_source_cannot_be_read_is_reported():
    """A decoder layer class whose forward has no source to read (an install of .pyc files only; here, code made
    at run time) is left unfused, and says why, rather than silently."""
    namespace = {}
    exec(compile(_LAYER_SOURCE, "<no file>", "exec"), namespace)
    cls = namespace["ToyDecoderLayer"]
    assert layers.fuse_layer_code(cls) is None
    assert "cannot be read" in integration.layer_code_refusal(cls)
