import gc, sys, torch
from liger_gen.bench import step as bench
import liger_gen
name = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b-4l"
dev = torch.device("cuda")
model = bench.build_model(name, dev, torch.bfloat16, 0); model.train()
if len(sys.argv) > 2 and sys.argv[2] == "lk":
    bench._apply_liger_kernel(model, bench._step_model(name).family)
else:
    liger_gen.apply_to(model)
params = {id(p): n for n, p in model.named_parameters()}
opt = bench.make_optimizer(model, 1e-4, dev)
batches = bench.make_batches(bench.byte_tokens(), 4, 8, 2048, seed=0).to(dev)
def big():
    out = []
    for o in gc.get_objects():
        try:
            if torch.is_tensor(o) and o.is_cuda and o.untyped_storage().nbytes() > 400 * 2**20:
                out.append((tuple(o.shape), o.dtype, params.get(id(o), "-"), o.untyped_storage().nbytes() >> 20,
                            [type(r).__name__ for r in gc.get_referrers(o)][:4]))
        except Exception:
            pass
    return out
for k in range(3):
    bench.train_step(model, opt, batches[k]); torch.cuda.synchronize()
    a = torch.cuda.memory_allocated() / 2**20
    print(f"step {k}: allocated {a:.0f} MiB, gc garbage collectable: {gc.collect()} objects -> {torch.cuda.memory_allocated()/2**20:.0f} MiB")
print("big tensors:", [b for b in big() if b[2] == "-"][:10])
print("gc counts", gc.get_count(), "thresholds", gc.get_threshold())
