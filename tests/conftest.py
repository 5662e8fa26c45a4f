"""Test set-up: kernels run in Triton's interpreter on the CPU unless a GPU test asks for CUDA.

TRITON_INTERPRET must be set before Triton decorates any kernel, so it is set here, at collection time.
The kernel cache and the user tables folder are redirected to temporary folders for the whole session.
"""

import os
import tempfile
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("LIGER_GEN_CACHE_DIR", tempfile.mkdtemp(prefix="liger_gen_kernels_"))
os.makedirs(os.environ["LIGER_GEN_CACHE_DIR"], mode=0o700, exist_ok=True)
# the user tables folder (``tables.user_tables_root``) of the person running the tests must not take part
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="liger_gen_data_")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: The two CPU paths, as values of TRITON_INTERPRET: "1" runs the Triton kernels in the interpreter (only where
#: the kernels were defined in interpreter mode, i.e. on machines without a GPU), "0" runs plain PyTorch.
CPU_PATHS = [pytest.param("1", id="interpreter", marks=pytest.mark.skipif(
                 torch.cuda.is_available(), reason="the interpreter must be on before kernels are defined")),
             pytest.param("0", id="plain")]


@pytest.fixture(params=CPU_PATHS)
def cpu_path(request, monkeypatch):
    """Each CPU path in turn: the Triton kernels in the interpreter ("1") and plain PyTorch ("0")."""
    monkeypatch.setenv("TRITON_INTERPRET", request.param)
    return request.param


def rope_call(modeling):
    """What a call of ``modeling.apply_rotary_pos_emb`` runs: the function, or the forward of the module that
    transformers makes of it with the ``kernels`` package installed (5.25 and later)."""
    current = modeling.apply_rotary_pos_emb
    return current.forward if isinstance(current, torch.nn.Module) else current


def seeded(*key) -> torch.Generator:
    """A CPU generator seeded from ``key`` (the test's parameters): the same inputs in every run and process
    (Python's ``hash`` of strings changes from process to process), different ones between cases."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))



def lm_head_tol(dtype: torch.dtype) -> float:
    """Relative tolerance of a chunked LM-head op's outputs against float64: 16-bit logits are rounded to x's
    dtype (as transformers' lm_head output), which moves each token's value by about u·|logit|."""
    return {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]



def assert_compiles_like_eager(f, x: torch.Tensor) -> None:
    """``f(x)`` (a scalar) under ``torch.compile(backend="aot_eager", fullgraph=True)`` and eagerly, each on its
    own leaf copy of ``x``: the same value and the same gradient. Resets dynamo afterwards."""
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x1)
    got.backward()
    ref = f(x2)
    ref.backward()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(x1.grad, x2.grad)
    torch._dynamo.reset()



#: Structural variants of the row-norm template as RMSNorm and the fused residual add + RMSNorm use it (dW
#: strategy, backward prefetch, rows per program): the tuner's gate must pass each one.
RMS_NORM_BRANCHES = [
    {"dw_strategy": "blocked", "TILES_PER_PROGRAM": 1, "BLOCK_M_BWD": 1},
    {"dw_strategy": "blocked", "TILES_PER_PROGRAM": 4, "BLOCK_M_BWD": 2, "BWD_PREFETCH": 1},
    {"dw_strategy": "persistent", "PROGRAMS_PER_SM": 1, "BWD_PREFETCH": 1, "BLOCK_M_FWD": 4, "BLOCK_M_BWD": 2},
    {"dw_strategy": "persistent", "PROGRAMS_PER_SM": 2, "BLOCK_M_BWD": 4, "num_warps_bwd": 2},
]


def assert_norm_heuristic_valid(space_cls, dtype: torch.dtype, max_n: int) -> None:
    """A row norm's heuristic at every width 1..299 and 2^k − 1, 2^k, 2^k + 1 from 512 up to ``max_n``, under the
    default, the interpreter's and a 99 KiB-shared-memory device: valid, with one tile covering the row; a row
    wider than ``max_n`` is refused, naming the limit."""
    from liger_gen.codegen.spaces import DeviceLimits

    widths = list(range(1, 300)) + [2**k + d for k in range(9, max_n.bit_length()) for d in (-1, 0, 1)
                                    if 2**k + d <= max_n]
    for limits in (DeviceLimits(), DeviceLimits.interpreter(), DeviceLimits(max_shared_memory_per_block=101376)):
        for n in widths:
            space = space_cls(n, dtype, limits)
            config = space.heuristic()
            assert config.BLOCK_N >= n and not space.violations(config)
    with pytest.raises(ValueError, match=str(max_n)):
        space_cls(max_n + 1, dtype)


@pytest.fixture
def device():
    """The device kernel tests run on: CUDA when present, else the CPU through the interpreter."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class StoragePeak:
    """Peak bytes of the tensor storages created while it is active and still alive (a TorchDispatchMode).

    Every storage a non-aliasing op returns is counted once, from its creation until it is freed (a weakref finalizer on the
    storage object, which PyTorch keeps for the storage's lifetime). Storages made before ``__enter__`` (the
    inputs) are not counted; scratch memory inside a single native kernel is not seen. Works on any device,
    which makes it the CPU paths' memory meter (``torch.cuda.max_memory_allocated`` has no CPU twin).
    """

    def __init__(self):
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def _track(self, out) -> None:
        import weakref

        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self._seen:
                continue
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not any(r.alias_info is not None for r in func._schema.returns):  # views, in-place: no allocation
                    meter._track(out)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


@pytest.fixture
def storage_peak():
    """``with storage_peak() as meter: ...; meter.peak`` — see ``StoragePeak``."""
    return StoragePeak


@pytest.fixture(scope="module")
def corpus():
    """A byte-level BPE tokenizer trained locally on the packaged Shakespeare text, and 48 passages of it (TRL
    trainer tests; skipped without transformers, tokenizers and datasets)."""
    from importlib import resources

    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    datasets = pytest.importorskip("datasets")
    text = (resources.files("liger_gen") / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:200_000]
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<eos>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([text], trainer=trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")
    passages = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 80][:48]
    return tokenizer, datasets.Dataset.from_dict({"text": passages})


def preference_batch(llama) -> dict:
    """The names the post-training examples use: tiny Llamas from ``llama(hidden, seed)`` as policy, reference,
    student and teacher (the teacher wider), and a batch of two chosen/rejected pairs over a 97-token vocabulary
    (one padded, the first 5 tokens the prompt)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (4, 12), generator=gen)
    masks = torch.ones(4, 12, dtype=torch.long)
    masks[1, -2:] = 0  # padding
    completion = masks.clone()
    completion[:, :5] = 0  # the prompt
    return {"policy": llama(32, 0), "reference": llama(32, 1), "student": llama(32, 2), "teacher": llama(48, 3),
            "chosen_ids": ids[:2], "rejected_ids": ids[2:], "chosen_mask": masks[:2], "rejected_mask": masks[2:],
            "chosen_completion_mask": completion[:2], "rejected_completion_mask": completion[2:]}
