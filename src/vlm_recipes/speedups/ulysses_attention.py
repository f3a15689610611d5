"""Ulysses attention: each rank of a sequence group holds 1/N of a row's tokens; around attention an
all-to-all trades that for 1/N of the heads over the whole row, and back after it (DeepSpeed-Ulysses).

Why our own and not the ecosystem's. DeepSpeed 0.19.8's `UlyssesSPAttentionHF` does run on CPU ranks over
gloo (a probe on 2 ranks: a Llama's logits equal one process's to 0.0). It cannot carry a vision-language
model as it is: `register_with_transformers` replaces transformers' global "sdpa" function, and the Qwen
line's vision towers call that same function, so the tower's attention would be sent through the
all-to-all too (each rank encodes its images whole, with its own token count); it drops every attention
mask (padded rows lean on causality alone); and DeepSpeed is no dependency of this project (on a CPU its
accelerator builds a C++ op at start). Accelerate's `ParallelismConfig(sp_size)` and TRL's SFTTrainer reach
the same class through a DeepSpeed engine (GPUs only here). So the all-to-all below is a few lines of
`torch.distributed.nn` (autograd through `all_to_all_single`), and attention itself stays transformers'
sdpa function, called on the whole row for 1/N of the heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import distributed as dist
from torch.distributed.nn.functional import all_to_all_single


@dataclass
class RowMask:
    """The whole (padded) row's attention mask, kept by the sequence shard for the forward it serves: None
    when every token is real (causal attention needs no mask), else [batch, length] with 1 on real tokens."""

    padding: torch.Tensor | None = None
    # a packed row's text positions over the whole row ([1, length], restarting with every sample), from
    # which per-sample attention reads the samples' bounds (padding-free: speedups/packing.py); else None
    positions: torch.Tensor | None = None
    built: dict = field(default_factory=dict)  # the 4-D mask, built once per forward (every layer reads it)

    def full_mask(self) -> torch.Tensor | None:
        """[batch, 1, length, length] booleans: causal, real keys only, and each query its own key (a padded
        query then attends to itself, never to nothing, so no NaN reaches the backward)."""
        if self.padding is None:
            return None
        if "mask" not in self.built:
            keys = self.padding.bool()
            length = keys.shape[-1]
            causal = torch.ones(length, length, dtype=torch.bool, device=keys.device).tril()
            eye = torch.eye(length, dtype=torch.bool, device=keys.device)
            self.built["mask"] = (causal & keys[:, None, None, :]) | eye
        return self.built["mask"]


def _exchange(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """all_to_all over dim 0 (one slice per rank of `group`), differentiable."""
    tensor = tensor.contiguous()
    return all_to_all_single(torch.empty_like(tensor), tensor, group=group)


def heads_to_row(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[batch, heads, local, dim] on each rank (its 1/N of the row) -> [batch, heads/N, row, dim] (its 1/N of
    the heads over the whole row: rank r keeps heads r*H/N .. (r+1)*H/N)."""
    batch, heads, local, dim = x.shape
    x = x.reshape(batch, size, heads // size, local, dim).permute(1, 0, 2, 3, 4)
    x = _exchange(x, group)  # dim 0 now: the rank the row's piece came from, in row order
    return x.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * local, dim)


def row_to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """sdpa's output [batch, row, heads/N, dim] -> [batch, local, heads, dim]: this rank's tokens, all heads."""
    batch, row, heads, dim = x.shape
    local = row // size
    x = x.reshape(batch, size, local, heads, dim).permute(1, 0, 2, 3, 4)
    x = _exchange(x, group)  # dim 0 now: the rank whose heads these are
    return x.permute(1, 2, 0, 3, 4).reshape(batch, local, size * heads, dim)


def ulysses_attention(
    core: Callable, group: dist.ProcessGroup, size: int, mask: RowMask, module, query, key, value, **kwargs
):
    """One attention call of a language-model layer under Ulysses: q, k, v exchanged to heads over the whole
    row, `core` (transformers' sdpa function) run with the whole row's mask, the output exchanged back. The
    layer's own mask was built for its 1/N of the row and is not used."""
    query, key, value = (heads_to_row(t, group, size) for t in (query, key, value))
    kwargs["position_ids"] = mask.positions  # the layer's are its piece's
    output, weights = core(module, query, key, value, mask.full_mask(), **kwargs)
    return row_to_heads(output, group, size), weights


class AttentionSwitch:
    """The language model's attention function (transformers' sdpa, or padding-free's `sdpa_per_sample`),
    replaced by one that sends the language model's attention modules (`modules`) through Ulysses while a
    sequence shard is active (`active`), and every other call (the vision tower's, generation's, eval's) to
    the function itself. A switch by module, not a new attention name: the tower and the language model share
    the name "sdpa", and a new name would be written into final/'s config."""

    def __init__(self, group: dist.ProcessGroup, size: int, implementation: str = "sdpa"):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.group, self.size = group, size
        self.modules: set[int] = set()
        self.active: RowMask | None = None
        self.core = ALL_ATTENTION_FUNCTIONS[implementation]
        ALL_ATTENTION_FUNCTIONS[implementation] = self

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        if self.active is None or id(module) not in self.modules:
            return self.core(module, query, key, value, attention_mask, *args, **kwargs)
        return ulysses_attention(
            self.core, self.group, self.size, self.active, module, query, key, value, **kwargs
        )
