"""FP8 training keeps working with what training runs on: torch.compile of a patched model, activation
checkpointing, transformers' Trainer and FSDP2 (gloo, 2 processes under torchrun), each against the same model
without it."""

import json

import pytest
import torch

import liger_gen
from liger_gen.codegen.problems import rel_l2
from liger_gen.integrations import transformers as integration
from liger_gen.nn import Float8Linear
from liger_gen.training import byte_tokens, make_batches
from liger_gen.runtime.fp8 import fp8_unsupported_reason

# every test trains on the CPU with its FP8 GEMMs there: torch builds before 2.13 take only per-tensor scales there
pytestmark = pytest.mark.skipif(fp8_unsupported_reason(torch.device("cpu")) is not None,
                                reason="this torch build has no CPU torch._scaled_mm with per-row scales")

transformers = pytest.importorskip("transformers")

# A bf16 model in FP8 and the same model in bf16 differ by FP8's rounding: the losses of a few steps agree to
# about 1e-3 relative (measured on this tiny Llama); 1 % is the bound FP8 training is held to over a run.
FP8_LOSS_RTOL = 0.01


@pytest.fixture(autouse=True)
def _restore_rope():
    yield
    integration.restore_rope()


def _llama(seed=0, layers=2):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()


def _ids(n=2, seq=32, seed=0):
    return make_batches(byte_tokens(), 1, n, seq, seed=seed)[0]


def _loss_and_grads(model, ids, call=None):
    loss = (model if call is None else call)(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_a_compiled_fp8_model_gives_the_eager_loss_and_gradients():
    """torch.compile(fullgraph=True) of an FP8-patched model: every projection traced as the custom ops (no graph
    break), with eager's loss bit for bit (the quantization is deterministic; eager shares one input's
    quantization between its projections, the compiled graph quantizes per projection) and eager's gradients up
    to the order in which bf16 sums the three projections' input gradients: a bf16 rounding (2^-8) there moves
    some gradient values across an e4m3 rounding boundary of the next layer's quantization, so the gradients
    agree to e4m3's precision (2^-4), not bit for bit."""
    model = _llama()
    liger_gen.apply_to(model, fp8=True)
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 14
    ids = _ids()
    loss, grads = _loss_and_grads(model, ids)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got, got_grads = _loss_and_grads(model, ids, compiled)
    torch._dynamo.reset()
    assert torch.equal(got, loss)
    for name, g in grads.items():
        assert rel_l2(got_grads[name], g) < 2.0 ** -4, name


def test_activation_checkpointing_gives_the_same_fp8_gradients():
    """Checkpointed decoder layers recompute their forward in the backward; the FP8 projections' shared
    quantization must not hand the recomputation a stale operand: the same loss and gradients."""
    ids = _ids(seed=1)
    plain = _llama()
    liger_gen.apply_to(plain, fp8=True)
    loss, grads = _loss_and_grads(plain, ids)
    checkpointed = _llama()
    liger_gen.apply_to(checkpointed, fp8=True)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got, got_grads = _loss_and_grads(checkpointed, ids)
    assert torch.equal(got, loss)
    for name, g in grads.items():
        assert torch.equal(got_grads[name], g), name


class _Blocks(torch.utils.data.Dataset):
    def __init__(self, n, seq):
        self.ids = make_batches(byte_tokens(), 1, n, seq, seed=2)[0]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_losses(model, out_dir):
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=3, per_device_train_batch_size=2, learning_rate=3e-3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Blocks(6, 32))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_trains_an_fp8_model_like_the_bf16_one(tmp_path):
    bf16 = _trainer_losses(liger_gen.apply_to(_llama()), tmp_path / "bf16")
    fp8_model = liger_gen.apply_to(_llama(), fp8=True)
    fp8 = _trainer_losses(fp8_model, tmp_path / "fp8")
    assert len(fp8) == len(bf16) == 3 and bf16[-1] < bf16[0]
    for a, b in zip(fp8, bf16):
        assert abs(a - b) <= FP8_LOSS_RTOL * b, (fp8, bf16)
    assert fp8 != bf16  # the projections did run in FP8


FSDP_FP8 = """
import copy
from torch.distributed.fsdp import fully_shard
import liger_gen, transformers
from liger_gen.training import byte_tokens, make_batches
rank, world = dist.get_rank(), dist.get_world_size()
config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, use_cache=False)
config._attn_implementation = "sdpa"
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()
liger_gen.apply_to(model, fp8=True)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
batches = make_batches(byte_tokens(), 3, 4, 32, seed=5)
for step, ids in enumerate(batches):
    mine = ids[rank * 2:(rank + 1) * 2]
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward(); opt.step(); opt.zero_grad()
    total = loss.detach().float().clone(); dist.all_reduce(total)
    say("LOSS", rank, step, float(total) / world)
"""


def test_fsdp2_shards_an_fp8_model_and_trains_it_like_one_process(tmp_path):
    """FSDP2 all-gathers the bf16 weights, each Float8Linear quantizes the gathered weight: the mean loss of 2
    ranks x 2 sequences follows one process's on the 4 sequences (the same FP8 recipe; the gradients are
    averaged in another order, so within FP8's tolerance rather than exactly)."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    from test_distributed import _run_script

    out = _run_script(tmp_path, "fsdp_fp8", FSDP_FP8, nproc=2)
    losses = {}
    for line in out.splitlines():
        if line.startswith("LOSS"):
            _, rank, step, value = line.split()
            losses.setdefault(int(step), []).append(float(value))
    assert sorted(losses) == [0, 1, 2] and all(len(v) == 2 and v[0] == v[1] for v in losses.values())
    model = _llama()
    liger_gen.apply_to(model, fp8=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step, ids in enumerate(make_batches(byte_tokens(), 3, 4, 32, seed=5)):
        halves = [model(input_ids=ids[i:i + 2], labels=ids[i:i + 2]).loss for i in (0, 2)]
        loss = (halves[0] + halves[1]) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert abs(losses[step][0] - float(loss)) <= FP8_LOSS_RTOL * float(loss), (step, losses, float(loss))
    json.dumps(losses)  # plain numbers
    assert rel_l2(torch.tensor(losses[2]), torch.tensor([float(loss)] * 2)) < FP8_LOSS_RTOL
