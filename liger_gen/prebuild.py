"""``liger-gen build``: compile the kernels a model runs on this GPU into a compiled kernel cache beside the tables.

Two ways to run the kernels, both through the public ops, so the cache holds exactly the (variant, launch key)
pairs training will ask for:

* ``model_step``: a whole transformers model (a name of ``liger_gen.models.ARCHITECTURES`` or a Hugging Face
  ``config.json``), cut to the first layers that cover each distinct layer type (every layer of one type runs the
  same kernels), patched with ``liger_gen.apply_to`` and run for one forward, backward and
  ``liger_gen.optim.AdamW`` step at the training batch
  shape (``batch_size`` x ``seq_len``) in ``dtype`` (a vision-language architecture of ``ARCHITECTURES`` on an
  image + text batch, so its vision tower's kernels compile too; a vision-language ``config.json`` on text alone,
  for want of the processor's image layout: its vision tower's kernels compile in training);
* ``op_steps``: each op's benchmark case (one forward and backward) at a model preset's shapes for each token
  count in ``rows`` (what ``liger-gen tune`` runs after tuning, for the shapes it tuned).

Both run once with the tables and once with the heuristic configs (``heuristic=True``), so a table refused at run
time (another GPU, ``LIGER_GEN_STRICT_TABLES``) still finds its kernels compiled. The process compiles into an
empty temporary Triton cache with the compiled kernel cache switched off; what Triton compiled is then written
with ``liger_gen.runtime.compiled.write_store``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch

from liger_gen.console import NO_PROGRESS, ProgressBar

def _cut_layers(config, layers: int | None) -> None:
    """Keep the first ``layers`` decoder layers (default: up to the first layer of each distinct layer type)."""
    types = getattr(config, "layer_types", None)
    total = getattr(config, "num_hidden_layers", None)
    if total is None:
        return
    if layers is None:
        layers = 1
        if types:
            layers = max(types.index(t) for t in set(types)) + 1
    layers = min(int(layers), int(total))
    config.num_hidden_layers = layers
    if types:
        config.layer_types = list(types[:layers])


def build_config(name_or_path: str):
    """The transformers config of an ``ARCHITECTURES`` name or of a ``config.json`` (file or folder)."""
    from liger_gen.models import ARCHITECTURES
    from liger_gen.optional import require

    transformers = require("transformers", "liger-gen build --model")
    if name_or_path in ARCHITECTURES:
        from liger_gen.training import build_config as architecture_config

        return architecture_config(name_or_path)
    path = Path(name_or_path)
    if path.exists():
        folder = path.parent if path.is_file() else path
        return transformers.AutoConfig.from_pretrained(str(folder))
    raise ValueError(f"--model {name_or_path!r}: give one of {', '.join(ARCHITECTURES)} or a Hugging Face "
                     f"config.json; model presets without a whole architecture ({name_or_path!r} included) are "
                     f"built per op with --rows")


def model_step(name_or_path: str, batch_size: int, seq_len: int, dtype: torch.dtype, device: torch.device,
               layers: int | None = None, seed: int = 0) -> Callable[[], None]:
    """A callable running one forward and backward of the patched, cut model at the batch shape, then one step of
    ``liger_gen.optim.AdamW`` over its parameters (so the optimizer's kernels are compiled too; the weights it
    changes are thrown away with the model)."""
    import liger_gen
    from liger_gen.optional import require

    require("transformers", "liger-gen build --model")
    from liger_gen.training import lm_class

    config = build_config(name_or_path)
    _cut_layers(config, layers)
    config.use_cache = False
    torch.manual_seed(seed)
    with torch.device(device):
        model = lm_class(config).from_config(config)
    model = model.to(dtype=dtype)
    model.train()
    liger_gen.apply_to(model)
    from liger_gen.models import ARCHITECTURES

    spec = ARCHITECTURES.get(name_or_path)
    if spec is not None and spec.vision is not None:
        # a vision-language architecture: an image + text batch, so its vision tower's kernels compile too
        from liger_gen.bench.step_data import batches_to, step_batches
        from liger_gen.training import byte_tokens

        inputs = batches_to(step_batches(spec, byte_tokens(), 1, batch_size, seq_len, seed), device,
                            model.forward)[0]
    else:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        vocab = int(config.get_text_config().vocab_size if hasattr(config, "get_text_config") else config.vocab_size)
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen).to(device)
        inputs = {"input_ids": ids, "labels": ids}

    optimizer = liger_gen.optim.AdamW(model.parameters(), lr=1e-6)

    def step():
        out = model(**inputs)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def op_steps(model_name: str, ops: list[str], rows: list[int], dtype: torch.dtype,
             device: torch.device) -> list[Callable[[], None]]:
    """One forward and backward per (op, rows) of the ops' benchmark cases at a model preset's shapes."""
    from liger_gen.bench import _Private, make_step
    from liger_gen.bench.ops import bench_model, get_case

    model = bench_model(model_name)
    steps = []
    for op in ops:
        case = get_case(op)
        for r in rows:
            dims = case.dims(model, r)
            gen = torch.Generator(device="cpu").manual_seed(0)
            inputs = case.make(dims, dtype, device, gen, model)
            steps.append(make_step(case.liger_gen, _Private(inputs), case.outputs))
    return steps


@contextlib.contextmanager
def fresh_triton_cache():
    """An empty temporary Triton cache for this process (and the compiled kernel cache switched off)."""
    from liger_gen.runtime import compiled, ops

    with tempfile.TemporaryDirectory(prefix="liger-gen-build-") as tmp:
        saved = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", compiled.ENV_DISABLE)}
        os.environ["TRITON_CACHE_DIR"] = tmp
        os.environ[compiled.ENV_DISABLE] = "0"
        ops.clear_caches()
        try:
            yield Path(tmp)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            ops.clear_caches()


def build(steps: Callable[[], list[Callable[[], None]]], out_root: Path, gpu: str, heuristic: bool = True,
          built_for: dict | None = None, merge: bool = True, progress: ProgressBar = NO_PROGRESS) -> Path:
    """Run ``steps()`` (built inside the fresh cache) with the tables, and again with the heuristics if
    ``heuristic``, recording what Triton compiles; write (or, with ``merge``, extend) the store under
    ``out_root/<gpu>/compiled/``. ``progress`` is advanced after each step run (``liger_gen.console``)."""
    from liger_gen.runtime import compiled, tables

    device = torch.cuda.current_device()
    with fresh_triton_cache() as cache_dir, compiled.Recorder() as recorder:
        calls = steps()
        progress.start(len(calls) * (2 if heuristic else 1))
        for i, call in enumerate(calls):
            call()
            progress.advance(f"tuned configs {i + 1}/{len(calls)}")
        torch.cuda.synchronize()
        if heuristic:
            with tables.heuristic_only():
                for i, call in enumerate(calls):
                    call()
                    progress.advance(f"heuristic configs {i + 1}/{len(calls)}")
                torch.cuda.synchronize()
        path = compiled.write_store(out_root, gpu, recorder, cache_dir, compiled.device_target(device),
                                     built_for, merge)
    compiled.clear()
    return path
