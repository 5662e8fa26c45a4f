"""One provider's first training step in a fresh process (run as a script by ``liger_gen.bench.first_step``).

Run as ``python first_step_child.py SPEC.json``, never imported: the plain-transformers and Liger-Kernel runs
must not import liger-gen (its import is part of what liger-gen's first step costs). SPEC holds the provider,
the transformers config class and fields, dtype, device, seed, lr and the path of the batch (a tensor file:
the token ids, or a vision-language model's inputs by name, labels included).
Prints one JSON line: wall-clock stamps (``time.time()``) at the script's start, after the imports, after the
model is built and patched, and at the end of the first step (after ``torch.cuda.synchronize()``), plus the
loss and the names of the inputs the model was given.
"""

import importlib
import inspect
import json
import os
import sys
import time

t_start = time.time()
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # this folder's modules (ops.py, profile.py) must not shadow top-level ones


def main(spec_path: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    import torch
    import transformers

    provider = spec["provider"]
    if provider == "liger-gen":
        import liger_gen
    elif provider == "liger-kernel":
        importlib.import_module("liger_kernel.transformers")  # its import time is part of the first step
    t_imports = time.time()
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    config = getattr(transformers, spec["config_class"])(**spec["config"])
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        model = getattr(transformers, spec["model_class"])(config)
    model = model.to(dtype=dtype)
    model.train()
    if provider == "liger-gen":
        liger_gen.apply_to(model)
    elif provider == "liger-kernel":
        from liger_gen.training import apply_liger_kernel  # its own patch, or its modules composed (glm4_moe)

        apply_liger_kernel(model, spec["family"])
    elif provider == "torch-compile":
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], fused=device.type == "cuda")
    batch = torch.load(spec["batch"])
    if isinstance(batch, dict):  # image + text: the inputs the model's forward takes
        takes = set(inspect.signature(model.forward).parameters)
        inputs = {k: v.to(device) for k, v in batch.items() if k in takes}
    else:
        inputs = {"input_ids": batch.to(device), "labels": batch.to(device)}
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_ready = time.time()
    loss = model(**inputs).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = float(loss.detach())  # synchronizes
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_end = time.time()
    print(json.dumps({"start": t_start, "imports": t_imports, "ready": t_ready, "end": t_end, "loss": value,
                      "inputs": sorted(inputs),
                      "imported_liger_gen": "liger_gen" in sys.modules,
                      "imported_liger_kernel": "liger_kernel" in sys.modules}))


if __name__ == "__main__":
    main(sys.argv[1])
