"""The batches of the training-step benchmark: windows of byte tokens for a text model, and for a vision-language
model the same windows with one image per sample, laid out as Qwen2.5-VL's processor lays out an image and its
text.

A text model's batches are ``liger_gen.training.make_batches``: a ``[steps, batch, seq_len]`` tensor of token ids,
their own labels. A vision-language model (an ``Architecture`` with a ``vision`` side) gets, per step, a dict of
model inputs (:func:`image_text_batches`):

- ``input_ids`` (batch, seq_len): the byte windows, each with one image's tokens at an offset drawn per sample:
  ``<vision_start>``, ``image_tokens`` placeholders (``image_token_id``), ``<vision_end>``;
- ``labels``: ``input_ids`` with the placeholders masked (-100), as fine-tuning collators mask them: nothing is
  predicted at an image token;
- ``mm_token_type_ids``: 1 at the placeholders, 0 elsewhere (the processor's; the model reads the image positions
  of its M-RoPE from it, where its forward takes it);
- ``pixel_values`` (batch · h · w, channels · temporal_patch · patch²) float32: one random image per sample of
  ``image_size`` pixels, uniform in [0, 1), normalised with the CLIP mean and std and cut into patches in the
  processor's order (each temporal pair of frames is the image twice; the patches of one 2x2 merge window
  adjacent);
- ``image_grid_thw`` (batch, 3) int64: ``(1, h, w)`` patches per image.

Every batch is drawn from generators seeded with ``seed``, so every provider trains on the same batches.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

from liger_gen.models import Architecture, VisionTower
from liger_gen.training import make_batches

# the image processor's normalisation (OpenAI CLIP's per-channel mean and std)
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
IGNORE_INDEX = -100

#: A step's batch: token ids (their own labels) or a dict of model inputs with ``labels``.
Batch = torch.Tensor | dict[str, torch.Tensor]


def min_seq_len(spec: Architecture) -> int:
    """The shortest sequence that holds a sample of ``spec``: for a vision-language model its image's tokens, the
    start and end tokens around them and two text tokens (one to predict from the other)."""
    return 2 if spec.vision is None else spec.vision.image_tokens + 4


def patchify(images: torch.Tensor, vision: VisionTower) -> torch.Tensor:
    """Qwen2-VL's image processor's ``pixel_values`` of ``images`` (n, channels, height, width): each image
    repeated over ``temporal_patch_size`` frames, cut into ``patch_size`` squares ordered merge window by merge
    window; returns (n · h · w, channels · temporal_patch_size · patch_size²) where (h, w) = ``grid_thw[1:]``."""
    f = vision.fields
    patch, merge, temporal = f["patch_size"], f["spatial_merge_size"], f["temporal_patch_size"]
    n, channels, height, width = images.shape
    h, w = height // patch, width // patch
    frames = images.unsqueeze(1).expand(n, temporal, channels, height, width)
    x = frames.reshape(n, temporal, channels, h // merge, merge, patch, w // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (n, h/m, w/m, m, m, channels, temporal, patch, patch)
    return x.reshape(n * h * w, channels * temporal * patch * patch)


def image_text_batches(spec: Architecture, tokens: torch.Tensor, steps: int, batch_size: int, seq_len: int,
                       seed: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches of ``batch_size`` samples of ``seq_len`` tokens, one image each (the module docstring
    gives the layout). ValueError if ``seq_len`` is shorter than :func:`min_seq_len` or the token stream shorter
    than one window."""
    vision = spec.vision
    if vision is None:
        raise ValueError(f"{spec.name} has no vision tower: its batches are token windows (make_batches)")
    n_image = vision.image_tokens
    if seq_len < min_seq_len(spec):
        raise ValueError(f"seq_len {seq_len} is too short for {spec.name}: its {vision.image_size[0]}x"
                         f"{vision.image_size[1]} image is {n_image} tokens, plus its start and end tokens and two "
                         f"of text (at least {min_seq_len(spec)})")
    windows = make_batches(tokens, steps, batch_size, seq_len, seed)
    gen = torch.Generator().manual_seed(seed + 1)  # apart from the windows' offsets
    channels = vision.fields.get("in_channels", 3)
    mean = torch.tensor(IMAGE_MEAN[:channels]).view(channels, 1, 1)
    std = torch.tensor(IMAGE_STD[:channels]).view(channels, 1, 1)
    grid = torch.tensor([vision.grid_thw] * batch_size, dtype=torch.int64)
    out = []
    for ids in windows:
        ids = ids.clone()
        starts = torch.randint(0, seq_len - (n_image + 2) + 1, (batch_size,), generator=gen)
        for row, at in enumerate(starts.tolist()):
            ids[row, at] = vision.vision_start_token_id
            ids[row, at + 1:at + 1 + n_image] = vision.image_token_id
            ids[row, at + 1 + n_image] = vision.vision_end_token_id
        image = ids == vision.image_token_id
        pixels = torch.rand(batch_size, channels, *vision.image_size, generator=gen)
        out.append({"input_ids": ids, "labels": ids.masked_fill(image, IGNORE_INDEX),
                    "mm_token_type_ids": image.to(torch.int32),
                    "pixel_values": patchify((pixels - mean) / std, vision), "image_grid_thw": grid.clone()})
    return out


def step_batches(spec: Architecture, tokens: torch.Tensor, steps: int, batch_size: int, seq_len: int,
                 seed: int) -> torch.Tensor | list[dict[str, torch.Tensor]]:
    """The benchmark's batches for ``spec``: :func:`image_text_batches` for a vision-language model, else
    ``make_batches`` (a ``[steps, batch_size, seq_len]`` tensor)."""
    if spec.vision is not None:
        return image_text_batches(spec, tokens, steps, batch_size, seq_len, seed)
    return make_batches(tokens, steps, batch_size, seq_len, seed)


def batches_to(batches: torch.Tensor | Sequence[dict[str, torch.Tensor]], device: torch.device,
               forward=None) -> torch.Tensor | list[dict[str, torch.Tensor]]:
    """``batches`` on ``device``. ``forward``: the model's ``forward``; inputs it does not take are dropped (a
    transformers release before ``mm_token_type_ids`` computes the image positions from ``input_ids`` alone)."""
    if isinstance(batches, torch.Tensor):
        return batches.to(device)
    takes = _parameters(forward)
    return [{k: v.to(device) for k, v in b.items() if takes is None or k in takes} for b in batches]


def _parameters(forward) -> set[str] | None:
    if forward is None:
        return None
    params = inspect.signature(forward).parameters
    return set(params)  # **kwargs would swallow an unknown input into the loss's kwargs, so it is not counted


def tokens_per_step(batches: torch.Tensor | Sequence[dict[str, torch.Tensor]]) -> int:
    """The tokens one step trains on: batch · seq_len (image placeholders included: the text stack runs them)."""
    ids = batches[0] if isinstance(batches, torch.Tensor) else batches[0]["input_ids"]
    return ids.numel()


def describe_batch(spec: Architecture, batch_size: int, seq_len: int) -> dict[str, Any] | None:
    """What the JSON records of a vision-language model's inputs (None for a text model): the image size, its patch
    grid, its tokens per sample and in all, and the layout."""
    vision = spec.vision
    if vision is None:
        return None
    return {"image_size": list(vision.image_size), "grid_thw": list(vision.grid_thw),
            "image_tokens_per_sample": vision.image_tokens, "text_tokens_per_sample": seq_len - vision.image_tokens,
            "pixel_values_shape": [batch_size * vision.grid_thw[1] * vision.grid_thw[2], vision.patch_dim],
            "layout": "one image per sample at a random offset: <vision_start> image tokens <vision_end>; labels "
                      "-100 at the image tokens"}
