"""CPU tests of ``liger_gen.bench.step`` and what it is built on (``liger_gen.bench.profile``,
``liger_gen.training``): kernel classes, profile arithmetic, the loss-curve check, the model configs, the click
options, the report, and a tiny end-to-end run of plain transformers vs liger-gen (its
Triton kernels run in the interpreter: tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA)."""

from __future__ import annotations

import collections
import dataclasses
import importlib
import inspect
import json
import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from liger_gen import training  # noqa: E402
from liger_gen.bench import profile, step  # noqa: E402
from liger_gen.models import PRESETS  # noqa: E402

from conftest import rope_call  # noqa: E402

TEMPLATES = Path(step.__file__).resolve().parent.parent / "templates"


def launched_template_kernels() -> set[str]:
    """Every kernel the templates launch (``name[grid](``), read independently of the module's own parser."""
    names: set[str] = set()
    for path in TEMPLATES.glob("*.jinja"):
        names.update(re.findall(r"\b(\w+)\[[^\]\n]*\]\(", path.read_text(encoding="utf-8")))
    return names


# ---------------------------------------------------------------------------------------------------------------
# Kernel classes
# ---------------------------------------------------------------------------------------------------------------


def test_every_launched_template_kernel_is_liger_gen():
    launched = launched_template_kernels()
    assert len(launched) >= 15, launched  # rms_norm, rope, glu, cross_entropy, ... each launch one or more
    assert profile.liger_gen_kernel_names() == launched
    # FP8 quantization, its own class: the single-axis quantize's kernels, the cast + transpose op's amax passes
    # and its cast (which the norm and GLU kernels that write FP8 operands launch too)
    quantize = {"quantize_rows_kernel", "column_amax_kernel", "quantize_cols_kernel", "amax_kernel",
                "amax_tiles_kernel", "cast_transpose_kernel"}
    assert quantize <= launched and profile.quantize_kernel_names() == quantize
    for name in sorted(launched):  # the optimizer's kernel counts as an optimizer, whoever's it is
        want = "quantize" if name in quantize else "optimizer" if name == "adamw_kernel" else "liger_gen"
        assert profile.classify_kernel(name) == want, name
        # Tritons before 3.0 appended the argument specialisation to the name
        assert profile.classify_kernel(name + "_0d1d2d3de") == want, name


# Names as torch.profiler reports them (H100/H200 traces of transformers / Liger-Kernel / inductor runs).
KERNEL_NAMES = [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
     "kernel__5x_cublas", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>"
     "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false, false, "
     "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("triton_red_fused__to_copy_abs_amax_clamp_0", "quantize"),  # torchao's rowwise scaling under compile
    ("triton_poi_fused__to_copy_clamp_div_float8_1", "quantize"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, "
     "false, true, true, false, false>(pytorch_flash::Flash_fwd_params)", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, "
     "4, 4, 4, false, false, cutlass::bfloat16_t>, true, false, false, false, false>(pytorch_flash::"
     "Flash_bwd_params)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<c10::BFloat16, "
     "4, (at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, bool*, bool*>"
     "(at::native::(anonymous namespace)::FusedOptimizerTensorListMetadata<4>)", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
     "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, at::native::BinaryFunctor"
     "<float, float, float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul>)",
     "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4>)", "elementwise"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
     "namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)", "elementwise"),
    ("_rms_norm_forward_kernel", "triton_other"),  # Liger-Kernel
    ("_swiglu_backward_kernel", "triton_other"),
    ("liger_cross_entropy_kernel", "triton_other"),
    ("_triton_rope", "triton_other"),
    ("triton_poi_fused__to_copy_add_mul_0", "triton_other"),  # inductor
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "triton_other"),
    ("triton_poi_fused__scaled_dot_product_efficient_attention_backward_3", "triton_other"),
    ("Memcpy HtoD (Pageable -> Device)", "other"),
    ("Memset (Device)", "other"),
]


@pytest.mark.parametrize("name,expected", KERNEL_NAMES, ids=[n[:40] for n, _ in KERNEL_NAMES])
def test_classify_real_kernel_names(name, expected):
    assert profile.classify_kernel(name) == expected


def test_busy_union_counts_overlap_once():
    assert profile.busy_union_us([(0, 10), (5, 15), (20, 25)]) == 20
    assert profile.busy_union_us([(0, 10), (2, 3)]) == 10
    assert profile.busy_union_us([(20, 25), (0, 10)]) == 15
    assert profile.busy_union_us([]) == 0
    with pytest.raises(ValueError, match="intervals"):
        profile.busy_union_us([(5, 1)])


def test_device_events_keeps_gpu_activity_only():
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def event(name, device_type, start, end, annotation=False):
        return FunctionEvent(id=0, name=name, thread=0, start_us=start, end_us=end, device_type=device_type,
                             is_user_annotation=annotation)

    prof = types.SimpleNamespace(events=lambda: [
        event("aten::mm", DeviceType.CPU, 0.0, 50.0),                    # the host op that launched it
        event("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", DeviceType.CUDA, 10.0, 40.0),
        event("my_step", DeviceType.CUDA, 0.0, 100.0, annotation=True),  # GPU-side record_function range
        event("Memset (Device)", DeviceType.CUDA, 45.0, 47.0),
    ])
    assert profile.device_events(prof) == [profile.DeviceEvent("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 10.0, 30.0),
                                         profile.DeviceEvent("Memset (Device)", 45.0, 2.0)]


def test_summarize_profile_arithmetic():
    ev = profile.DeviceEvent
    # Two steps. Per step: a 4 ms GEMM, a 1 ms liger-gen norm, a 0.5 ms optimizer kernel overlapping the GEMM.
    events = []
    for base in (0.0, 10_000.0):
        events += [ev("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", base, 4000.0),
                   ev("rms_norm_fwd_kernel", base + 5000.0, 1000.0),
                   ev("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>()", base + 3500.0, 500.0)]
    p = profile.summarize_profile(events, n_steps=2, ms_per_step=8.0, profiled_wall_s=0.02)
    assert p["kernel_ms"]["gemm"] == pytest.approx(4.0)
    assert p["kernel_ms"]["liger_gen"] == pytest.approx(1.0)
    assert p["kernel_ms"]["optimizer"] == pytest.approx(0.5)
    assert p["kernel_ms"]["attention"] == 0.0
    assert set(p["kernel_ms"]) == set(profile.KERNEL_CLASSES)
    assert p["kernel_calls"]["gemm"] == 1.0
    assert p["busy_ms"] == pytest.approx(5.0)  # the optimizer kernel hides under the GEMM
    assert p["idle_ms"] == pytest.approx(3.0)  # 8 ms per unprofiled step - 5 ms busy
    assert p["profiled_ms_per_step"] == pytest.approx(10.0)
    assert [t["class"] for t in p["top_kernels"]] == ["gemm", "liger_gen", "optimizer"]
    assert p["top_kernels"][0]["ms"] == pytest.approx(4.0)
    assert profile.summarize_profile(events, 2, None)["idle_ms"] is None
    with pytest.raises(ValueError, match="n_steps"):
        profile.summarize_profile(events, 0, 1.0)


# ---------------------------------------------------------------------------------------------------------------
# Loss-curve check
# ---------------------------------------------------------------------------------------------------------------


def test_loss_tolerance_is_the_dtype_eps():
    assert training.loss_rel_tolerance(torch.bfloat16) == 2.0**-7
    assert training.loss_rel_tolerance("bfloat16") == 2.0**-7
    assert training.loss_rel_tolerance(torch.float16) == 2.0**-10
    assert training.loss_rel_tolerance(torch.float32) == 1e-5
    with pytest.raises(ValueError, match="dtype"):
        training.loss_rel_tolerance("int8")
    with pytest.raises(ValueError, match="dtype"):
        training.loss_rel_tolerance(torch.int32)


REFERENCE = [11.76, 11.2, 10.1, 9.0, 8.3, 7.9, 7.5]


def test_compare_losses_passes_within_tolerance():
    tol = training.loss_rel_tolerance(torch.bfloat16)
    close = [x * (1 + 0.5 * tol * (-1) ** i) for i, x in enumerate(REFERENCE)]
    c = training.compare_losses(close, REFERENCE, tol)
    assert c["pass"] is True
    assert c["max_rel_diff"] == pytest.approx(0.5 * tol)
    assert c["first_step_rel_diff"] == pytest.approx(0.5 * tol)
    assert c["max_abs_diff"] == pytest.approx(0.5 * tol * REFERENCE[0])
    assert c["reference"] == "transformers" and c["rel_tol"] == tol


def test_compare_losses_flags_a_perturbed_curve():
    tol = training.loss_rel_tolerance(torch.bfloat16)
    n = len(REFERENCE)
    drift = list(REFERENCE)
    drift[4] *= 1 + 2 * tol  # one later step off by two bf16 spacings: chaotic drift, reported but tolerated
    c = training.compare_losses(drift, REFERENCE, tol)
    assert c["pass"] is True
    assert c["max_rel_diff"] == pytest.approx(2 * tol)
    assert c["mean_rel_diff"] == pytest.approx(2 * tol / n)
    assert c["first_step_rel_diff"] == 0.0
    first = list(REFERENCE)
    first[0] *= 1 + 2 * tol  # the first step (one forward from equal weights) off: a numerics error
    assert training.compare_losses(first, REFERENCE, tol)["pass"] is False
    biased = [r * (1 + 2 * tol) for r in REFERENCE[:1]] + [r * (1 + 1.5 * tol) for r in REFERENCE[1:]]
    biased[0] = REFERENCE[0]  # a systematic offset after the first step shows in the mean
    c = training.compare_losses(biased, REFERENCE, tol)
    assert c["pass"] is False and c["mean_rel_diff"] > tol


@pytest.mark.parametrize("losses", [REFERENCE[:-1], [*REFERENCE[:-1], math.nan], [*REFERENCE[:-1], None], []])
def test_compare_losses_fails_on_missing_or_nonfinite(losses):
    ref = REFERENCE if losses else []
    c = training.compare_losses(losses, ref, 1e-2)
    assert c["pass"] is False and c["max_rel_diff"] is None and c["reason"]


def test_compare_losses_rejects_bad_tolerance():
    with pytest.raises(ValueError, match="rel_tol"):
        training.compare_losses(REFERENCE, REFERENCE, 0.0)


def test_add_comparisons_speedups_and_checks():
    tol = 1e-2
    providers = {
        "transformers": {"status": "ok", "tokens_per_s": 100.0, "losses": [5.0, 4.0]},
        "liger-kernel": {"status": "ok", "tokens_per_s": 120.0, "losses": [5.0, 4.01]},
        "liger-gen": {"status": "ok", "tokens_per_s": 150.0, "losses": [5.0, 4.2]},
        "torch-compile": {"status": "error", "reason": "boom"},
    }
    step.add_comparisons(providers, tol)
    assert providers["transformers"]["loss_check"] is None
    assert providers["transformers"]["speedup_vs_transformers"] == 1.0
    assert providers["liger-gen"]["speedup_vs_transformers"] == pytest.approx(1.5)
    assert providers["liger-gen"]["speedup_vs_liger_kernel"] == pytest.approx(1.25)
    assert providers["liger-kernel"]["loss_check"]["pass"] is True
    assert providers["liger-gen"]["loss_check"]["pass"] is False  # 4.2 vs 4.0: 5 % off
    assert "loss_check" not in providers["torch-compile"]


def test_fp8_providers_are_checked_at_the_fp8_tolerance():
    tol = 2.0 ** -7
    providers = {"transformers": {"status": "ok", "tokens_per_s": 100.0, "losses": [5.0, 4.0]},
                 "liger-gen": {"status": "ok", "tokens_per_s": 150.0, "losses": [5.045, 4.03]},
                 "liger-gen-fp8": {"status": "ok", "tokens_per_s": 180.0, "losses": [5.045, 4.03]},
                 "torchao-fp8": {"status": "ok", "tokens_per_s": 170.0, "losses": [5.1, 4.1]}}
    step.add_comparisons(providers, tol)
    assert providers["liger-gen"]["loss_check"]["pass"] is False  # first step 0.9 % off: beyond bf16's epsilon
    assert providers["liger-gen-fp8"]["loss_check"]["pass"] is True  # within FP8's 1 %
    assert providers["torchao-fp8"]["loss_check"]["pass"] is False  # 2 % off


def test_fp8_providers_say_why_they_cannot_run():
    why = step.provider_unavailable("torchao-fp8", torch.device("cpu"))
    assert why is not None and ("CUDA" in why or "not installed" in why)
    assert step.provider_unavailable("liger-gen-fp8", torch.device("cpu")) is None  # CPU torch._scaled_mm
    for dtype in (torch.float32, torch.float16):  # without autocast, FP8 layers of such weights run F.linear
        why = step.provider_unavailable("liger-gen-fp8", torch.device("cpu"), dtype)
        assert why is not None and "bf16" in why and str(dtype).removeprefix("torch.") in why


# ---------------------------------------------------------------------------------------------------------------
# Model configs
# ---------------------------------------------------------------------------------------------------------------

# Published parameter counts (tied embedding counted once) and layer counts, which PRESETS does not hold.
PUBLISHED = {"llama3.2-1b": (1_235_814_400, 16), "qwen2.5-0.5b": (494_032_768, 24)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_configs_have_the_published_dims(name):
    spec = step.STEP_MODELS[name]
    preset = PRESETS[spec.name]
    config = training.build_config(name)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads,
            head_dim, config.vocab_size, config.rms_norm_eps) == (
        preset.hidden_size, preset.intermediate_size, preset.num_attention_heads, preset.num_key_value_heads,
        preset.head_dim, preset.vocab_size, preset.rms_norm_eps)
    n_params, n_layers = PUBLISHED[name]
    assert config.num_hidden_layers == n_layers
    assert config.tie_word_embeddings is True and config.use_cache is False
    assert config._attn_implementation == "sdpa"
    import transformers

    cls = getattr(transformers, training.FAMILY_CLASSES[spec.family][1])
    with torch.device("meta"):
        model = cls(config)
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    # Qwen2 puts a bias on q/k/v (not on o); Llama has none
    assert (attn.q_proj.bias is not None, attn.o_proj.bias is not None) == ((True, False) if spec.family == "qwen2"
                                                                         else (False, False))


def test_llama3_8b_width_model_is_llama_3_1_8b_with_fewer_layers():
    """Its layer is Llama-3.1-8B's: at the published 32 layers it has the published 8,030,261,248 parameters
    (untied embedding and LM head); the benchmark builds 4 of them, at the llama3-8b kernel shapes."""
    import dataclasses

    import transformers

    config = training.build_config("llama3-8b-4l")
    assert config.num_hidden_layers == 4 and config.tie_word_embeddings is False
    shape, preset = step.STEP_MODELS["llama3-8b-4l"].shape(), PRESETS["llama3-8b"]
    assert dataclasses.replace(shape, name=preset.name) == preset
    rope = config.rope_parameters
    assert (rope["rope_type"], rope["rope_theta"], rope["factor"], rope["original_max_position_embeddings"]) == (
        "llama3", 500000.0, 8.0, 8192)
    whole = training.build_config("llama3-8b")  # the whole model, for the full-size FP8 step
    assert whole.num_hidden_layers == 32 and whole.rope_parameters == rope
    config.num_hidden_layers = 32
    assert whole.to_dict() == config.to_dict()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_rope_parameters():
    rope = training.build_config("llama3.2-1b").rope_parameters
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    assert (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
            rope["original_max_position_embeddings"]) == (32.0, 1.0, 4.0, 8192)
    assert training.build_config("qwen2.5-0.5b").rope_parameters["rope_theta"] == 1000000.0
    summary = step.config_summary(training.build_config("qwen2.5-0.5b"))
    assert summary["head_dim"] == 64 and summary["num_hidden_layers"] == 24
    json.dumps(summary)  # JSON-serialisable


def test_unknown_model_and_bad_arguments_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="models: unknown"):
        training.build_config("llama9")
    kw = dict(device="cpu", console=False)
    with pytest.raises(ValueError, match="models"):
        step.run_step_benchmark("llama9", ["transformers"], **kw)
    with pytest.raises(ValueError, match="providers"):
        step.run_step_benchmark("tiny", ["deepspeed"], **kw)
    with pytest.raises(ValueError, match="providers: repeated"):
        step.run_step_benchmark("tiny", "transformers,transformers", **kw)
    with pytest.raises(ValueError, match="steps must be"):
        step.run_step_benchmark("tiny", ["transformers"], steps=0, **kw)
    with pytest.raises(ValueError, match="seq_len 4096 exceeds tiny"):
        step.run_step_benchmark("tiny", ["transformers"], seq_len=4096, **kw)
    with pytest.raises(ValueError, match="dtype"):
        step.run_step_benchmark("tiny", ["transformers"], dtype="int8", **kw)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="text"):
        step.run_step_benchmark("tiny", ["transformers"], text=empty, **kw)


def test_liger_kernel_is_skipped_without_cuda():
    why = step.provider_unavailable("liger-kernel", torch.device("cpu"))
    assert why is not None and ("CUDA" in why or "not installed" in why)
    assert step.provider_unavailable("liger-gen", torch.device("cpu")) is None


def test_restore_module_globals(monkeypatch):
    mod = types.ModuleType("fake_modeling_for_step_test")
    mod.apply_rotary_pos_emb = original = object()
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    with step.restore_module_globals([mod.__name__]):
        mod.apply_rotary_pos_emb = object()
        mod.added_by_a_patch = 1
    assert mod.apply_rotary_pos_emb is original
    assert not hasattr(mod, "added_by_a_patch")


# ---------------------------------------------------------------------------------------------------------------
# Command-line options and report
# ---------------------------------------------------------------------------------------------------------------


def test_click_options_map_onto_run_step_benchmark(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from liger_gen.cli import main

    params = inspect.signature(step.run_step_benchmark).parameters
    seen = {}

    def run(**options):
        seen.update(options)
        return {"models": {}}

    monkeypatch.setattr(step, "run_step_benchmark", run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # else the command refuses the default device
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["bench-step", "--model", "tiny", "--providers", "liger-gen,transformers",
                                       "--steps", "4"])
    assert result.exit_code == 0, result.output
    assert set(seen) <= set(params)
    assert seen["models"] == ["tiny"] and seen["providers"] == ["liger-gen", "transformers"] and seen["steps"] == 4
    for name in ("batch_size", "seq_len", "warmup_steps", "profile_steps", "lr", "seed", "dtype",
                 "attn_implementation", "loss_rel_tol", "device"):
        assert seen[name] == params[name].default, name
    # without --out: a new folder under bench-results/ (removed again here: the stand-in wrote nothing in it)
    assert seen["out_dir"].parent == Path("bench-results") and seen["out_dir"].name.startswith("bench-step-")
    assert list(tmp_path.iterdir()) == []
    assert seen["text"] == str(params["text"].default)
    bad = CliRunner().invoke(main, ["bench-step", "--steps", "0"])
    assert bad.exit_code != 0 and "--steps" in bad.output


def test_report_lists_failures_and_skips():
    from rich.console import Console

    result = {
        "metadata": {"gpu": "NVIDIA H200", "device": "cuda:0", "torch": "2.11", "triton": "3.6",
                     "transformers": "5.17", "liger_kernel": "0.8.5"},
        "settings": {"batch_size": 8, "seq_len": 2048, "dtype": "bfloat16", "lr": 3e-4, "warmup_steps": 3,
                     "steps": 10, "profile_steps": 2, "loss_rel_tol": 2**-7},
        "models": {"llama3.2-1b": {"providers": {
            "transformers": {"status": "ok", "tokens_per_s": 40000.0, "ms_per_step": 409.6, "first_step_s": 1.0,
                             "compile_s": None, "peak_allocated_gib": 50.0, "peak_reserved_gib": 60.0,
                             "loss_check": None, "speedup_vs_transformers": 1.0, "speedup_vs_liger_kernel": None,
                             "profile": {"kernel_ms": {c: 1.0 for c in profile.KERNEL_CLASSES}, "idle_ms": 2.5,
                                         "busy_ms": 7.0}},
            "liger-gen": {"status": "ok", "tokens_per_s": 50000.0, "ms_per_step": 327.7, "first_step_s": 2.0,
                          "compile_s": None, "peak_allocated_gib": 30.0, "peak_reserved_gib": 35.0,
                          "loss_check": {"max_rel_diff": 0.05, "pass": False}, "speedup_vs_transformers": 1.25,
                          "speedup_vs_liger_kernel": None, "profile": None},
            "liger-kernel": {"status": "error", "reason": "TypeError: lce_forward() got an unexpected keyword"},
        }}},
    }
    console = Console(record=True, width=220)
    step.print_report(result, console)
    text = console.export_text()
    assert "FAIL" in text and "5.0e-02" in text and "1.25" in text
    assert "liger-kernel: error: TypeError: lce_forward()" in text
    assert "40,000" in text and "2.5" in text  # tokens/s, idle ms


def test_write_json_is_strict(tmp_path):
    path = step.write_json({"a": [1.0, math.nan, math.inf], "b": {"c": 2}}, tmp_path / "x" / "step.json")
    assert json.loads(path.read_text()) == {"a": [1.0, None, None], "b": {"c": 2}}


# ---------------------------------------------------------------------------------------------------------------
# End to end on the CPU
# ---------------------------------------------------------------------------------------------------------------


def test_tiny_cpu_run_plain_vs_liger_gen(tmp_path):
    """Two AdamW steps (one warm-up, one timed) of the tiny Llama in bf16, plain transformers then liger-gen.

    lr 1e-2 makes the second step's loss reflect one real update (it drops by about 9 %), so the check compares
    trained states, not two evaluations of the same random init.
    """
    from rich.console import Console

    import transformers

    import liger_gen

    modeling = importlib.import_module("transformers.models.llama.modeling_llama")
    rope_before = rope_call(modeling)
    # an earlier apply_to in this process routes RoPE process-wide: the plain provider must not run it
    liger_gen.apply_to(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64)))
    assert rope_call(modeling) != rope_before
    console = Console(record=True, width=200)
    result = step.run_step_benchmark("tiny", ["transformers", "liger-gen", "liger-gen-unfused-add", "liger-gen-fp8"],
                                     batch_size=2,
                                     seq_len=64,
                                     warmup_steps=1, steps=1, profile_steps=0, lr=1e-2, device="cpu",
                                     out_dir=tmp_path, console=console, command="pytest")
    tol = result["settings"]["loss_rel_tol"]
    assert tol == 2.0**-7
    runs = result["models"]["tiny"]["providers"]
    plain, lg = runs["transformers"], runs["liger-gen"]
    assert plain["status"] == "ok" and lg["status"] == "ok", (plain.get("reason"), lg.get("reason"))
    for r in (plain, lg):
        assert len(r["losses"]) == 2
        assert r["losses"][0] == pytest.approx(math.log(256), rel=0.02)  # random init: uniform over 256 bytes
        assert r["losses"][1] < r["losses"][0] * (1 - 5 * tol)  # the update moved the loss
        assert r["tokens_per_s"] > 0 and len(r["step_ms"]) == 1 and r["profile"] is None
    check = lg["loss_check"]
    assert check["pass"] is True and check["max_rel_diff"] <= tol
    assert check["max_rel_diff"] == pytest.approx(
        max(abs(a - b) / b for a, b in zip(lg["losses"], plain["losses"])))
    # what actually ran
    assert plain["patch"]["rope"] == "transformers.models.llama.modeling_llama.apply_rotary_pos_emb"
    assert plain["patch"]["norm_classes"] == ["LlamaRMSNorm (transformers.models.llama.modeling_llama."
                                              "LlamaRMSNorm.forward)"]
    assert lg["patch"]["rope"].endswith("(wrapped by liger_gen.integrations.transformers.rope)")
    assert all("liger_gen" in c for c in lg["patch"]["norm_classes"] + lg["patch"]["mlp_classes"])
    assert lg["patch"]["forward"].endswith("FusedLossForward")
    (layer,) = lg["patch"]["decoder_layers"]
    assert "code from <liger-gen: " in layer and "residual add fused" in layer
    fp8 = runs["liger-gen-fp8"]  # the FP8 GEMMs on the CPU (torch._scaled_mm), checked at the FP8 tolerance
    assert fp8["status"] == "ok", fp8.get("reason")
    assert fp8["loss_check"]["pass"] and fp8["loss_check"]["rel_tol"] == step.FP8_LOSS_REL_TOL
    assert fp8["losses"] != lg["losses"]  # the projections did run in FP8
    unfused = runs["liger-gen-unfused-add"]
    assert unfused["status"] == "ok" and unfused["loss_check"]["pass"], unfused.get("reason")
    assert plain["patch"]["decoder_layers"] == unfused["patch"]["decoder_layers"] == [
        "LlamaDecoderLayer (transformers.models.llama.modeling_llama.LlamaDecoderLayer.forward; code from "
        "modeling_llama.py)"]
    assert rope_call(modeling) == rope_before  # liger-gen's process-wide RoPE patch was undone
    # JSON and report
    data = json.loads((tmp_path / "step.json").read_text())
    assert data["schema"] == step.SCHEMA
    assert data["metadata"]["command"] == "pytest" and data["metadata"]["device"] == "cpu"
    assert {"torch", "triton", "transformers", "liger_kernel", "date", "gpu"} <= set(data["metadata"])
    assert data["models"]["tiny"]["config"]["hidden_size"] == 64
    assert data["models"]["tiny"]["providers"]["liger-gen"]["losses"] == lg["losses"]
    assert "pass" in console.export_text()


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_the_recorded_command_carries_the_interpreter_variable(interpret, monkeypatch):
    """A run of the kernels in the interpreter records ``TRITON_INTERPRET=1`` in its command: the same line
    without it times the plain-PyTorch path, another run."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(sys, "argv", ["liger-gen", "bench-step", "--device", "cpu", "--model", "tiny"])
    command = step.run_metadata(torch.device("cpu"), None)["command"]
    assert command == ("TRITON_INTERPRET=1 " if interpret == "1" else "") + "liger-gen bench-step --device cpu --model tiny"


# ---------------------------------------------------------------------------------------------------------------
# A vision-language model and a mixture of experts
# ---------------------------------------------------------------------------------------------------------------


def _meta_params(config, family: str) -> int:
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, training.FAMILY_CLASSES[family][1])(config)
    return sum(p.numel() for p in model.parameters())


def test_qwen2_5_vl_7b_width_model_is_qwen2_5_vl_7b_with_fewer_layers():
    """Qwen2.5-VL-7B's text and vision widths: at its published 28 decoder layers and 32 vision blocks (every 8th
    attending over the whole image) it has the published 8,292,166,656 parameters; the benchmark builds 4 and 4."""
    import transformers

    spec = step.STEP_MODELS["qwen2.5-vl-7b-4l"]
    config = training.build_config("qwen2.5-vl-7b-4l")
    text, vision = config.text_config, config.vision_config
    assert config.model_type == "qwen2_5_vl" and config.tie_word_embeddings is False and text.use_cache is False
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
            text.num_key_value_heads, text.vocab_size, text.rms_norm_eps) == (3584, 18944, 4, 28, 4, 152064, 1e-6)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24] and text.rope_parameters["rope_theta"] == 1e6
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads, vision.patch_size,
            vision.spatial_merge_size, vision.temporal_patch_size, vision.out_hidden_size, vision.window_size,
            vision.fullatt_block_indexes) == (4, 1280, 3420, 16, 14, 2, 2, 3584, 112, [3])
    assert (config.image_token_id, config.vision_start_token_id, config.vision_end_token_id) == (151655, 151652, 151653)
    assert spec.shape() == dataclasses.replace(PRESETS["qwen2.5-7b"], name="qwen2.5-vl-7b-4l")  # the text stack's
    assert spec.vision.grid_thw == (1, 32, 32) and spec.vision.image_tokens == 256 and spec.vision.patch_dim == 1176
    whole = spec.hf_fields()
    whole["text_config"].update(num_hidden_layers=28, rope_parameters=spec.rope)
    whole["vision_config"].update(depth=32, fullatt_block_indexes=[7, 15, 23, 31])
    assert _meta_params(transformers.Qwen2_5_VLConfig(**whole), "qwen2_5_vl") == 8_292_166_656


def test_glm4_5_air_width_model_is_glm4_5_air_with_fewer_layers():
    """GLM-4.5-Air's layers: one dense, then 128 routed experts of width 1408 (8 per token) and a shared one; at
    its 46 layers it has 106.85 B parameters (GLM-4.5-Air's published 106 B, its MTP layer apart)."""
    config = training.build_config("glm4.5-air-4l")
    assert config.model_type == "glm4_moe" and config.num_hidden_layers == 4 and config.use_cache is False
    assert (config.hidden_size, config.intermediate_size, config.moe_intermediate_size, config.n_routed_experts,
            config.num_experts_per_tok, config.n_shared_experts, config.first_k_dense_replace,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size) == (
        4096, 10944, 1408, 128, 8, 1, 1, 96, 8, 128, 151552)
    assert config.attention_bias is True and config.tie_word_embeddings is False
    assert config.rope_parameters["partial_rotary_factor"] == 0.5 and config.rope_parameters["rope_theta"] == 1e6
    assert step.STEP_MODELS["glm4.5-air-4l"].shape().intermediate_size == 1408  # the experts' GLU width
    assert _meta_params(config, "glm4_moe") == 8_509_550_592
    config.num_hidden_layers = 46
    assert _meta_params(config, "glm4_moe") == 106_852_245_504


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-glm4.5-air", "qwen2.5-vl-7b-4l", "glm4.5-air-4l"])
def test_the_new_models_build_and_their_presets_read_as_configs(name):
    from liger_gen.models import preset_hf_config
    from liger_gen.verify import ops_apply_to_runs

    spec = step.STEP_MODELS[name]
    summary = step.config_summary(training.build_config(name))
    json.dumps(summary)
    assert summary["model_type"] == spec.family
    assert ("vision" in summary) == (spec.vision is not None)
    cfg = preset_hf_config(name)  # what `liger-gen verify --model` reads
    assert cfg["model_type"] == spec.family
    if spec.vision is not None:
        assert cfg["text_config"]["hidden_size"] == spec.fields["hidden_size"]
        assert cfg["vision_config"] == spec.vision.fields and cfg["image_token_id"] == spec.vision.image_token_id
    else:  # the experts run liger-gen's fused MoE
        ops, why = ops_apply_to_runs(cfg, quiet=True)
        assert ops is not None and "moe_permute" in ops and "swiglu" in ops, why
    if name.startswith("tiny"):  # built whole on the CPU
        model = training.build_model(name, "cpu", torch.float32, 0)
        assert model.training and model.config.model_type == step.STEP_MODELS[name].family


def test_image_text_batches_are_laid_out_as_the_processor_lays_them_out():
    from liger_gen.bench import step_data

    spec = step.STEP_MODELS["tiny-qwen2.5-vl"]
    vision = spec.vision
    tokens = training.byte_tokens()
    batches = step_data.step_batches(spec, tokens, 3, 2, 32, seed=5)
    assert len(batches) == 3 and batches[0].keys() == {"input_ids", "labels", "mm_token_type_ids", "pixel_values",
                                                       "image_grid_thw"}
    t, h, w = vision.grid_thw
    assert (t, h, w) == (1, 4, 8)
    merge = vision.fields["spatial_merge_size"]
    for b in batches:
        ids, labels = b["input_ids"], b["labels"]
        assert ids.shape == labels.shape == (2, 32) and ids.dtype == torch.int64
        image = ids == vision.image_token_id
        assert image.sum(1).tolist() == [t * h * w // merge ** 2] * 2 == [vision.image_tokens] * 2
        assert (labels[image] == -100).all() and torch.equal(labels[~image], ids[~image])
        assert torch.equal(b["mm_token_type_ids"], image.int())
        for row in range(2):  # <vision_start> image tokens <vision_end>, contiguous
            at = image[row].nonzero().flatten()
            assert at.tolist() == list(range(int(at[0]), int(at[0]) + vision.image_tokens))
            assert ids[row, at[0] - 1] == vision.vision_start_token_id and ids[row, at[-1] + 1] == vision.vision_end_token_id
        assert b["pixel_values"].shape == (2 * t * h * w, 3 * 2 * 14 * 14) and b["pixel_values"].dtype == torch.float32
        assert b["image_grid_thw"].tolist() == [[1, 4, 8]] * 2
    again = step_data.step_batches(spec, tokens, 3, 2, 32, seed=5)  # every provider: the same batches
    assert all(torch.equal(a[k], b[k]) for a, b in zip(batches, again) for k in a)
    whole = step.STEP_MODELS["qwen2.5-vl-7b-4l"]  # 448 x 448: 32 x 32 patches, 256 image tokens
    assert step_data.describe_batch(whole, 8, 2048)["pixel_values_shape"] == [8 * 1024, 1176]
    assert step_data.describe_batch(whole, 8, 2048)["text_tokens_per_sample"] == 2048 - 256
    with pytest.raises(ValueError, match="seq_len 11 is too short"):
        step_data.step_batches(spec, tokens, 1, 1, 11, seed=0)
    with pytest.raises(ValueError, match="too short for qwen2.5-vl-7b-4l"):
        step.run_step_benchmark("qwen2.5-vl-7b-4l", ["transformers"], seq_len=200, device="cpu", console=False)


def test_patches_follow_the_qwen2_vl_image_processor():
    """pixel_values are the processor's for the same pixels (no resize, rescale or normalisation here)."""
    import transformers

    from liger_gen.bench.step_data import patchify

    processor_cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or getattr(
        transformers, "Qwen2VLImageProcessor", None)
    if processor_cls is None:
        pytest.skip("this transformers has no Qwen2-VL image processor")
    vision = step.STEP_MODELS["tiny-qwen2.5-vl"].vision
    image = torch.rand(3, *vision.image_size, generator=torch.Generator().manual_seed(0))
    try:
        out = processor_cls(patch_size=14, merge_size=2, temporal_patch_size=2)(
            images=[image], do_resize=False, do_rescale=False, do_normalize=False, return_tensors="pt")
    except ImportError as exc:  # its imaging backend (PIL, torchvision) is absent
        pytest.skip(str(exc))
    assert out["image_grid_thw"].tolist() == [list(vision.grid_thw)]
    assert torch.allclose(out["pixel_values"].float(), patchify(image[None], vision))


@pytest.mark.parametrize("name,seq_len", [("tiny-qwen2.5-vl", 16), ("tiny-glm4.5-air", 8)])
def test_tiny_cpu_step_of_the_new_models(name, seq_len, tmp_path):
    """One step of the vision-language model (an image per sample) and of the mixture of experts, plain
    transformers then liger-gen; Liger-Kernel is skipped with the reason, its autotune warm-up marked not run."""
    result = step.run_step_benchmark(name, ["transformers", "liger-gen", "liger-kernel"], batch_size=1,
                                     seq_len=seq_len, warmup_steps=0, steps=1, profile_steps=0, device="cpu",
                                     console=False, command="pytest", out_dir=tmp_path)
    entry = result["models"][name]
    written = json.loads((tmp_path / "step.json").read_text())["models"][name]
    assert written["inputs"] == entry["inputs"] and written["config"] == json.loads(json.dumps(entry["config"]))
    plain, lg, lk = (entry["providers"][p] for p in ("transformers", "liger-gen", "liger-kernel"))
    assert plain["status"] == "ok" and lg["status"] == "ok", (plain.get("reason"), lg.get("reason"))
    assert lg["loss_check"]["pass"], lg["loss_check"]
    assert plain["tokens_per_s"] == pytest.approx(seq_len / (plain["ms_per_step"] / 1e3))
    assert plain["autotune_warmup"] is None and lg["autotune_warmup"] is None
    assert lk["status"] == "skipped" and lk["reason"]
    assert lk["autotune_warmup"] == {"s": None, "kernels_tuned": None, "reason": lk["reason"]}
    if name == "tiny-qwen2.5-vl":
        assert entry["inputs"]["image_tokens_per_sample"] == 8 and entry["config"]["vision"]["depth"] == 2
        assert plain["patch"]["forward"].endswith("Qwen2_5_VLForConditionalGeneration.forward")
    else:
        assert entry["inputs"] is None and entry["config"]["n_routed_experts"] == 8
        assert plain["patch"]["expert_classes"] and "liger_gen" in lg["patch"]["expert_classes"][0]


def _fake_liger_kernel(monkeypatch, patches: dict):
    """A ``liger_kernel`` package whose ``transformers`` module holds ``patches`` (apply functions by name)."""
    import importlib.machinery

    root = types.ModuleType("liger_kernel")
    root.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    sub = types.ModuleType("liger_kernel.transformers")
    for key, fn in patches.items():
        setattr(sub, key, fn)
    root.transformers = sub
    monkeypatch.setitem(sys.modules, "liger_kernel", root)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", sub)
    return root


def test_liger_kernel_without_a_patch_for_the_model_type_says_why(monkeypatch):
    _fake_liger_kernel(monkeypatch, {"apply_liger_kernel_to_qwen2_5_vl": lambda model: None})
    cuda = torch.device("cuda", 0)
    assert step.provider_unavailable("liger-kernel", cuda, family="qwen2_5_vl") is None
    why = step.provider_unavailable("liger-kernel", cuda, family="olmoe")  # neither its patch nor a composition
    assert "no patch for model_type 'olmoe'" in why and "apply_liger_kernel_to_olmoe" in why
    with pytest.raises(ValueError, match="olmoe"):
        training.apply_liger_kernel(torch.nn.Linear(1, 1), "olmoe")
    assert step.provider_unavailable("liger-kernel", cuda, family="glm4_moe") is None  # composed
    assert "CUDA" in step.provider_unavailable("liger-kernel", torch.device("cpu"), family="qwen2_5_vl")


def test_liger_kernel_autotune_warm_up_is_timed_apart(monkeypatch):
    """A stand-in Liger-Kernel whose one autotuned kernel tunes on its first call: the warm-up pass records it
    (time and one tuned entry), the steps after it tune nothing, and its loss curve is the plain one's (the
    warm-up's gradients are dropped, no optimizer step)."""
    pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner

    class Tuner(Autotuner):  # no __init__: only what the count reads
        def __init__(self):
            self.cache = {}

    kernels = types.ModuleType("liger_kernel.ops.fake_moe")
    kernels.fused_experts = tuner = Tuner()
    calls = []

    def first_call_tunes(*_):
        calls.append(1)
        tuner.cache.setdefault(("H", "I"), "best")

    def apply(model, family):
        monkeypatch.setitem(sys.modules, kernels.__name__, kernels)
        model.register_forward_hook(first_call_tunes)
        return model

    monkeypatch.setattr(step, "provider_unavailable", lambda *a, **k: None)
    monkeypatch.setattr(step, "apply_liger_kernel", apply)
    result = step.run_step_benchmark("tiny", ["transformers", "liger-kernel"], batch_size=1, seq_len=8,
                                     warmup_steps=1, steps=1, profile_steps=0, device="cpu", console=False)
    runs = result["models"]["tiny"]["providers"]
    lk = runs["liger-kernel"]
    assert lk["status"] == "ok", lk.get("reason")
    warm = lk["autotune_warmup"]
    assert warm["s"] > 0 and warm["kernels_tuned"] == 1 and warm["reason"] is None
    assert len(calls) == 3  # the warm-up pass, then one warm-up and one timed step
    assert lk["losses"] == runs["transformers"]["losses"]
    assert runs["transformers"]["autotune_warmup"] is None
    from rich.console import Console

    console = Console(record=True, width=240)
    step.print_report(result, console)
    text = console.export_text()
    assert "autotune s" in text and f"{warm['s']:.1f} (1 tuned)" in text


def test_liger_kernel_modules_are_composed_where_it_ships_no_patch():
    """Liger-Kernel has no glm4_moe patch: its modules go where its GLM-4.5V patch puts them on the same decoder
    layer (every RMSNorm, the routed experts, the shared experts and dense MLPs, the loss forward), none elsewhere."""
    pytest.importorskip("liger_kernel")
    from liger_gen.training import apply_liger_kernel, build_model, liger_kernel_unsupported

    assert liger_kernel_unsupported("glm4_moe") is None
    for qk_norm in (False, True):  # GLM-4.5-Air has no q/k norms, GLM-4.5 has them
        model = build_model("tiny-glm4.5-air", "cpu", torch.float32, 0)
        if qk_norm:
            model = type(model)(type(model.config)(**{**model.config.to_dict(), "use_qk_norm": True}))
        apply_liger_kernel(model, "glm4_moe")
        given = collections.defaultdict(set)  # every module of each class, by the name Liger-Kernel gave it
        for m in model.modules():
            given[type(m).__name__].add(m._get_name())
        assert given["Glm4MoeRMSNorm"] == {"LigerRMSNorm"} and given["Glm4MoeExperts"] == {"LigerExperts"}
        assert given["Glm4MoeMLP"] == {"LigerSwiGLUMLP"} and given["Glm4MoeAttention"] == {"Glm4MoeAttention"}
        layers = model.model.layers
        assert layers[0].mlp._get_name() == "LigerSwiGLUMLP" and not hasattr(layers[0].mlp, "experts")  # dense
        norms = sum(type(m).__name__ == "Glm4MoeRMSNorm" for m in model.modules())
        assert norms == 2 * len(layers) + 1 + (2 * len(layers) if qk_norm else 0)
        assert model.forward.__func__.__module__ == "liger_kernel.transformers.model.glm4"
    gelu = build_model("tiny-glm4.5-air", "cpu", torch.float32, 0)
    gelu = type(gelu)(type(gelu.config)(**{**gelu.config.to_dict(), "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act is 'gelu'"):
        apply_liger_kernel(gelu, "glm4_moe")
