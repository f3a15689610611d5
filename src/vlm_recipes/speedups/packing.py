"""Padding-free batches for VLMs: the samples of a batch packed end to end in one row, no pad tokens.

TRL 1.x refuses `padding_free` for vision datasets, because a packed row breaks Qwen2-VL's multimodal
RoPE: its 3-D (time, height, width) positions are computed per sample from the sample's own image grids.
Here they are computed per sample first, by the model's own `get_rope_index` (`family.rope_index`, given
the batch keys `family.rope_index_keys`) on the ordinary padded batch, and only then packed. The row
carries the 4-row position ids transformers expects for packed Qwen2-VL, Qwen2.5-VL and Qwen3-VL input
alike: row 0 the text positions, restarting at 0 with every sample, from which the attention mask is made
block-diagonal (no token attends to another sample); rows 1-3 the mRoPE positions (Qwen3-VL interleaves
them over the rotary frequencies itself; Qwen3-VL's DeepStack features follow the image tokens wherever
they sit in the row).

With sdpa attention (no flash-attention installed, or a CPU), that block-diagonal mask would make every
layer attend densely over the whole row, (sum of L)^2 work for sum of L^2 worth of attention, and sdpa
can't use its flash kernel with a mask. `attend_per_sample` switches the text model to `sdpa_per_sample`:
the same sdpa, called causally on each sample's slice of the row, which is what flash-attention's varlen
kernel does with the same boundaries.

The loss is unchanged: the same tokens are labelled (TRL's collator does the tokenizing), the first
token of every sample is unlabelled so that no sample predicts the next one's start, and the loss is
still the mean over the batch's labelled tokens. The optimizer sees the same batch of samples; only the
padding work is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

PER_SAMPLE_SDPA = "sdpa_per_sample"
CPU_LENGTH_BUCKET = 64  # per-sample attention on CPU pads each sample to a multiple of this


def is_packed(inputs: dict) -> bool:
    """A padding-free batch: one row, 4-row position ids, no attention mask."""
    position_ids = inputs.get("position_ids")
    return position_ids is not None and position_ids.ndim == 3 and "attention_mask" not in inputs


class PaddingFreeVisionCollator:
    """Wraps the padded collator SFTTrainer built (TRL's vision collator: tokenizing, images, labels,
    pad token and training chat template all as without packing) and packs what it returns. `rope_index`
    and `rope_keys`: the family's (`Family.rope_index`, `Family.rope_index_keys`)."""

    def __init__(
        self,
        padded: DataCollatorForVisionLanguageModeling,
        rope_index: Callable | None,
        rope_keys: tuple[str, ...],
    ):
        self.padded = padded
        self.rope_index = rope_index
        self.rope_keys = rope_keys

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.padded(examples)
        return pack_batch(batch, self.rope_index, self.rope_keys)


def pack_batch(
    batch: dict[str, Any], rope_index: Callable | None, rope_keys: tuple[str, ...]
) -> dict[str, Any]:
    """A right-padded batch → one packed row with 4-row position ids (see the module docstring).

    `rope_index` is called with input_ids, the attention mask and those of the batch keys `rope_keys` the
    batch has (the Qwen line: the token types, the image and video grids, Qwen2.5-VL's video timing)."""
    keep = batch.pop("attention_mask").bool()
    if rope_index is None:
        return _pack_1d(batch, keep)
    rope_kwargs = {k: batch[k] for k in rope_keys if k in batch}
    with torch.no_grad():
        mrope, _ = rope_index(input_ids=batch["input_ids"], attention_mask=keep, **rope_kwargs)
    lengths = keep.sum(dim=1)
    text_positions = torch.cat([torch.arange(int(n)) for n in lengths])
    labels = batch["labels"].clone()
    labels[:, 0] = -100  # the previous sample's last token must not learn to predict this sample's first
    packed = {
        "input_ids": batch["input_ids"][keep][None],
        "labels": labels[keep][None],
        "mm_token_type_ids": batch["mm_token_type_ids"][keep][None],
        # [4, 1, total]: text positions (sample boundaries, for the attention mask), then t/h/w mRoPE
        "position_ids": torch.cat(
            [text_positions[None, None].to(mrope.dtype), mrope[:, keep][:, None]], dim=0
        ),
        # transformers builds the block-diagonal mask from the positions only when no KV cache is in play
        "use_cache": False,
    }
    passthrough = {k: v for k, v in batch.items() if k not in packed and k != "attention_mask"}
    return {**passthrough, **packed}


def _pack_1d(batch: dict[str, Any], keep: torch.Tensor) -> dict[str, Any]:
    """Packing for a 1-D RoPE family (SmolVLM): [1, total] position ids restarting with every sample, from
    which transformers makes the block-diagonal mask and `sdpa_per_sample` finds the samples."""
    labels = batch["labels"].clone()
    labels[:, 0] = -100  # the previous sample's last token must not learn to predict this sample's first
    packed = {
        "input_ids": batch["input_ids"][keep][None],
        "labels": labels[keep][None],
        "position_ids": torch.cat([torch.arange(int(n)) for n in keep.sum(dim=1)])[None],
        "use_cache": False,
    }
    if "mm_token_type_ids" in batch:
        packed["mm_token_type_ids"] = batch["mm_token_type_ids"][keep][None]
    # images stay per sample (SmolVLM: pixel_values [batch, tiles, ...]); their features fill the <image>
    # tokens in order, and the packed row keeps the samples' order
    return {**{k: v for k, v in batch.items() if k not in packed}, **packed}


def attend_per_sample(model: nn.Module) -> str | None:
    """Switch a text model on sdpa to `sdpa_per_sample`; returns the implementation it replaced, or None
    when there was nothing to switch (flash-attention already works per sample; eager is left alone)."""
    AttentionInterface.register(PER_SAMPLE_SDPA, per_sample_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PER_SAMPLE_SDPA, sdpa_mask)  # unpacked batches keep sdpa's mask
    for module in model.modules():
        config = getattr(module, "config", None)
        text_config = config.get_text_config() if config is not None else None
        if callable(getattr(module, "set_attn_implementation", None)) and text_config is not None:
            if text_config._attn_implementation != "sdpa":
                return None
            key = next((k for k in config.sub_configs if getattr(config, k) is text_config), None)
            module.set_attn_implementation({key: PER_SAMPLE_SDPA} if key else PER_SAMPLE_SDPA)
            return "sdpa"
    return None


def per_sample_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """sdpa, but a packed row (text positions restarting per sample) is attended one sample at a time,
    causally and without a mask. Anything else (padded batches, generation, the vision tower, sliding-window
    layers) is plain sdpa with the mask transformers made."""
    lengths = None
    if kwargs.get("sliding_window") is None:  # a sliding window lives in the mask: keep it
        lengths = _packed_lengths(module, query, key, position_ids, kwargs.get("is_causal"))
    if lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs["is_causal"] = True
    outputs = []
    for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)), strict=True):
        length = q.shape[2]
        if query.device.type == "cpu" and length % CPU_LENGTH_BUCKET:
            # CPU kernels keep state per distinct shape (oneDNN/brgemm caches): one per sample length
            # would grow memory with every new length. Causal attention lets padding go at the end,
            # where no real token can see it; its outputs are cut off below.
            pad = CPU_LENGTH_BUCKET - length % CPU_LENGTH_BUCKET
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        outputs.append(sdpa_attention_forward(module, q, k, v, None, **kwargs)[0][:, :length])
    return torch.cat(outputs, dim=1), None  # [1, total length, heads, head_dim]


_last_lengths: list = [None, None]  # (position ids, sample lengths): every layer of a forward shares them


def _packed_lengths(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, position_ids, is_causal
) -> list[int] | None:
    """The sample lengths of a packed causal row without a KV cache, or None for anything else."""
    if (
        position_ids is None
        # 3-D multimodal positions, not the text ones (GLM-4.5V's MoE layers are handed these): no sample
        # boundaries to read; the block mask transformers built from the text positions keeps samples apart
        or position_ids.dim() == 3
        or query.shape[0] != 1
        or query.shape[2] != key.shape[2]
        or position_ids.shape[-1] != query.shape[2]
        or (is_causal if is_causal is not None else getattr(module, "is_causal", True)) is False
    ):
        return None
    if _last_lengths[0] is not position_ids:
        positions = position_ids.reshape(-1)
        starts = (torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1).tolist()
        bounds = [0, *starts, positions.numel()]
        _last_lengths[:] = [position_ids, [end - start for start, end in pairwise(bounds)]]
    lengths = _last_lengths[1]
    return lengths if len(lengths) > 1 else None
