"""The vision tower's attention over many short sequences in one variable-length call.

The Qwen vision-language towers (Qwen2-VL, Qwen2.5-VL, Qwen 3-VL, Qwen 3.5 and their MoE variants) and GLM-4V's
attend within each image (and, in Qwen2.5-VL's windowed blocks, within each 8 × 8-patch window): the patches of
all images are one sequence, and ``cu_seqlens`` (int32, (N + 1,), the cumulative lengths) cut it into N pieces.
Under ``sdpa`` or ``eager`` transformers reads the lengths to the host (``lengths.tolist()``) and calls the
attention once per piece: a Qwen2.5-VL step of 8 images runs about a hundred attention calls per vision block,
forward and backward, each too short to keep the GPU busy, and the GPU waits for the host.

Under an implementation whose name holds "flash", the same modules pass ``cu_seqlens`` and the longest piece's
length (one host read per block) to the attention function instead. ``apply_to`` gives each vision
attention module a view of its config (``VarlenVisionConfig``) that names ``VARLEN_ATTENTION``, registered in
transformers' ``AttentionInterface``, while the tower's config says ``sdpa``; the model's own config is not
changed, so transformers' checks, ``set_attn_implementation``, models built from the config and saved configs see
``sdpa`` as before, and a tower switched to another implementation runs that one. On a CUDA GPU of compute
capability 8.0 or more, for fp16 and bf16, without dropout, ``varlen_attention_forward`` runs every piece in one
call of ``torch.nn.attention.varlen.varlen_attn`` (the variable-length kernel of FlashAttention-2, Dao 2023, with
autograd, torch 2.10 and later); otherwise it runs SDPA once per piece, exactly as transformers' ``sdpa`` path does. Each piece
attends to itself only (no causal mask): ``softmax(q kᵀ · scaling) v`` per piece and head.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch

# the implementation's name; transformers' vision attention takes its cu_seqlens path for names holding "flash"
VARLEN_ATTENTION = "liger_gen_flash_varlen"
_HALF = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def varlen_kernel():
    """torch's ``varlen_attn`` (torch 2.10 and later), or None; and whether it takes ``scale`` (2.11 and later)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return varlen_attn, "scale" in inspect.signature(varlen_attn).parameters


@functools.lru_cache(maxsize=None)
def _flash_device(index: int) -> bool:
    """Whether CUDA device ``index`` runs torch's FlashAttention kernels (compute capability 8.0 or more)."""
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(index)[0] >= 8


def register() -> bool:
    """Register ``VARLEN_ATTENTION`` in transformers' ``AttentionInterface`` (idempotent); False where the
    release has no ``AttentionInterface.register`` (transformers before 4.48)."""
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return False
    if VARLEN_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    return True


class VarlenVisionConfig:
    """What a routed vision attention module reads as ``self.config``: its tower's config, attribute for attribute,
    except that while the tower's config says ``sdpa`` the attention implementation is ``VARLEN_ATTENTION``. The
    tower's config object stays the model's; unpickling the view registers the function in that process."""

    def __init__(self, config) -> None:
        self.__dict__["config"] = config

    @property
    def _attn_implementation(self):
        current = self.config._attn_implementation
        return VARLEN_ATTENTION if current == "sdpa" else current

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "config":  # copy/pickle protocol names, and before __setstate__
            raise AttributeError(name)
        return getattr(self.config, name)

    def __setattr__(self, name: str, value) -> None:
        if name == "config":
            raise AttributeError("VarlenVisionConfig.config is the tower's config; it is not reassigned")
        setattr(self.config, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.config, name)

    def __iter__(self):
        return iter(self.config)

    def __contains__(self, name) -> bool:
        return name in self.config

    def __eq__(self, other) -> bool:
        return self.config == (other.config if isinstance(other, VarlenVisionConfig) else other)

    __hash__ = None

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self.config)) | {"config"})

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        register()

    def __repr__(self) -> str:
        return f"VarlenVisionConfig({self.config.__class__.__name__}, attention {self._attn_implementation!r})"


def refusal(modeling, config) -> str | None:
    """Why the vision attention of ``config`` (a vision config) in the modeling module ``modeling`` is not routed,
    or None. Routed: transformers' default ``sdpa`` (an ``eager`` tower is the user's choice, kept; a
    ``flash_attention_*`` one already runs one call), in a release whose vision attention takes the cu_seqlens
    path for any flash-named implementation (``is_flash_attention_requested``), on torch 2.10 or later."""
    current = getattr(config, "_attn_implementation", None)
    if current != "sdpa":
        return f"vision attention: {current!r} is kept (liger-gen replaces sdpa's one call per image or window)"
    if not hasattr(modeling, "is_flash_attention_requested"):
        return ("vision attention: this transformers release passes cu_seqlens only to flash_attention_2 (5.x "
                "passes them to any flash-named implementation)")
    if varlen_kernel()[0] is None:
        return "vision attention: torch.nn.attention.varlen needs torch 2.10 or later"
    if not register():
        return "vision attention: this transformers release has no AttentionInterface.register"
    return None


def _own_config(module: torch.nn.Module):
    """The config ``module`` holds (``module.config``), seen through its ``VarlenVisionConfig`` where routed."""
    config = module.__dict__.get("config")
    return config.config if isinstance(config, VarlenVisionConfig) else config


def attention_modules(tower: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of ``tower`` that read a config of the tower's config class (routed ones included)."""
    cls = type(tower.config)
    return [m for m in tower.modules() if type(m).__name__.endswith("Attention") and isinstance(_own_config(m), cls)]


def route(modules: list[torch.nn.Module]) -> None:
    """Give each of ``modules`` (``attention_modules``) a ``VarlenVisionConfig`` of its config (idempotent);
    ``register`` first."""
    register()
    for module in modules:
        if not isinstance(module.__dict__["config"], VarlenVisionConfig):
            module.config = VarlenVisionConfig(_own_config(module))


def count(model: torch.nn.Module) -> int:
    """The attention modules of ``model`` routed by ``route``: they run ``varlen_attention_forward`` while their
    tower's config says ``sdpa``, and what it says otherwise."""
    return sum(isinstance(m.__dict__.get("config"), VarlenVisionConfig) for m in model.modules())


def _use_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                attention_mask, dropout: float, causal: bool, scaling: float | None) -> bool:
    """Whether one ``varlen_attn`` call computes this attention: a CUDA GPU FlashAttention runs on, fp16/bf16 q, k
    and v of one dtype, boundaries of at least one piece on the same GPU, equal head counts, head dims
    FlashAttention takes, no mask, dropout or causal mask, and a scale the installed torch can pass."""
    kernel, takes_scale = varlen_kernel()
    head_dim = query.shape[-1]
    return (kernel is not None and query.is_cuda and query.dtype in _HALF and query.shape[0] == 1
            and key.dtype == value.dtype == query.dtype
            and cu_seqlens.device == query.device and cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 2
            and key.shape[1] == query.shape[1] and head_dim % 8 == 0 and head_dim <= 256
            and attention_mask is None and not dropout and not causal
            and (takes_scale or scaling is None or math.isclose(scaling, head_dim ** -0.5))
            and _flash_device(query.device.index if query.device.index is not None else torch.cuda.current_device()))


def _run_varlen(query, key, value, cu_seqlens, max_length, scaling):
    """One ``varlen_attn`` call: (1, heads, seq, head_dim) q, k, v → (1, seq, heads, head_dim)."""
    kernel, takes_scale = varlen_kernel()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (seq, heads, head_dim), the layout it takes
    extra = {"scale": scaling} if takes_scale and scaling is not None else {}
    out = kernel(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, **extra)
    return out.unsqueeze(0)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, is_causal: bool | None = None,
                             cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                             max_length_q: int | torch.Tensor | None = None, max_length_k=None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q (batch, heads, seq, head_dim), k and v (batch, kv_heads, seq,
    head_dim) → ((batch, seq, heads, head_dim), None). With ``cu_seq_lens_q`` (int, (N + 1,)), the sequence is N
    pieces, each attending to itself (``cu_seq_lens_k`` must be the same boundaries); see the module docstring for
    which path runs. Without it, transformers' ``sdpa_attention_forward``.

    Raises:
        ValueError: ``cu_seq_lens_k`` differs from ``cu_seq_lens_q`` (cross-attention between pieces); on the
            per-piece path (where the lengths are read to the host), boundaries that do not end at the sequence's
            length. The one-call path takes the boundaries as transformers builds them from the image grids.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(cu_seq_lens_k,
                                                                                           cu_seq_lens_q):
        raise ValueError(f"liger-gen vision attention: cu_seq_lens_k {tuple(cu_seq_lens_k.shape)} differs from "
                         f"cu_seq_lens_q {tuple(cu_seq_lens_q.shape)}; each piece attends to itself only")
    if _use_varlen(query, key, value, cu_seq_lens_q, attention_mask, dropout, causal, scaling):
        if max_length_q is None:
            max_length_q = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max()
        return _run_varlen(query, key, value, cu_seq_lens_q.to(torch.int32), int(max_length_q), scaling), None
    # transformers' own sdpa path: one call per piece
    lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    if sum(lengths) != query.shape[2]:
        raise ValueError(f"liger-gen vision attention: cu_seq_lens_q ends at {sum(lengths)} but the sequence has "
                         f"{query.shape[2]} positions (query {tuple(query.shape)}, {query.dtype})")
    pieces = zip(*(torch.split(t, lengths, dim=2) for t in (query, key, value)))
    outs = [sdpa_attention_forward(module, q, k, v, attention_mask, dropout=dropout, scaling=scaling,
                                   is_causal=is_causal, **kwargs)[0] for q, k, v in pieces]
    return torch.cat(outs, dim=1), None

