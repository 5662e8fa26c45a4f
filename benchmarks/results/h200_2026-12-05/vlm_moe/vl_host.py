"""Where a Qwen2.5-VL-7B-width training step (4 decoder layers, 4 vision blocks, bench-step's batches) waits for the
host, per provider: the synchronising CUDA calls of one step (torch.cuda.set_sync_debug_mode, with the Python line
that made each), the host time of the forward, backward and optimizer calls against the step's wall time, and the
profiler's top CPU ops. Usage: python vl_host.py OUT_DIR [providers, comma-separated]."""
import collections, json, sys, time, traceback, warnings

import torch

from liger_gen.bench.step_data import batches_to, step_batches
from liger_gen.training import apply_liger_kernel, architecture, build_model, byte_tokens

out_dir = sys.argv[1]
providers = (sys.argv[2] if len(sys.argv) > 2 else "transformers,liger-gen").split(",")
spec = architecture("qwen2.5-vl-7b-4l")
batches = step_batches(spec, byte_tokens(), 6, 8, 2048, 0)
report = {}
for provider in providers:
    model = build_model("qwen2.5-vl-7b-4l", "cuda", torch.bfloat16, 0)
    if provider == "liger-gen":
        import liger_gen
        liger_gen.apply_to(model)
    elif provider == "liger-kernel":
        apply_liger_kernel(model, "qwen2_5_vl")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = batches_to(batches, torch.device("cuda"), model.forward)

    def step(batch, times=None):
        t0 = time.perf_counter()
        loss = model(**batch).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step(); opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if times is not None:
            times.append((t1 - t0, t2 - t1, t3 - t2))
        return loss

    for b in data[:3]:
        step(b)
    torch.cuda.synchronize()
    syncs = collections.Counter()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        where = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.line}" for f in reversed(frames)
                      if "torch/" not in f.filename), "?")
        syncs[where] += 1

    warnings.showwarning = record
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        step(data[3])
        torch.cuda.set_sync_debug_mode(0)
    warnings.showwarning = shown
    torch.cuda.synchronize()
    times, walls = [], []
    for b in data[4:6]:
        t0 = time.perf_counter()
        step(b, times)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(data[5]); torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    open(f"{out_dir}/vl_host_cpu_ops_{provider}.txt", "w").write(table)
    report[provider] = {"syncs": dict(syncs.most_common()), "host_fwd_bwd_opt_s": times, "wall_s": walls}
    print(provider, "wall", [round(w, 3) for w in walls], "host fwd/bwd/opt", [tuple(round(x, 3) for x in t) for t in times])
    for where, n in syncs.most_common(12):
        print(f"   {n:4d} x {where[:200]}")
    del model, opt
    torch.cuda.empty_cache()
json.dump(report, open(f"{out_dir}/vl_host.json", "w"), indent=1)
