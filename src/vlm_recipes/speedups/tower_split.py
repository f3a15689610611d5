"""The vision tower's work split over a sequence group: each rank encodes its share of a batch's frames or
tiles, and the features are gathered (differentiably) so every rank merges the whole row's features before
the row is cut at the language model's door (speedups/sequence_parallel.py).

Why our own: Ulysses in DeepSpeed, accelerate and transformers splits a text model's sequence only; every
rank of a group would encode every image. NeMo AutoModel shards video frames across its context-parallel
group (docs/guides/cp-vision-frame-sharding.mdx); this does the same for the towers we prove.

What a unit is, and why the split is exact:
- a tower that takes `grid_thw` (the Qwen line): one frame (one temporal patch) of an image or video. Its
  attention (`cu_seqlens`, Qwen2.5-VL's windows), its 2-D rotary positions, Qwen3-VL's interpolated position
  embeddings and the merger all work within one frame, so a frame encodes the same alone or beside others;
- any other tower (SigLIP, InternViT, Idefics3's): one tile, the first dimension of its pixel tensors; tiles
  are encoded independently (SmolVLM's pixel attention mask is split with them).
The ranks take contiguous runs of units, balanced by patches, so gathering in rank order restores the
batch's order. The gather's backward sums the group's gradients for each rank's features, so the tower's
gradient summed over the group (as DDP and FSDP sum it) is one process's.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch
from torch import distributed as dist
from torch import nn

from vlm_recipes.errors import GuardError

log = logging.getLogger(__name__)

# Keyword arguments a caller may pass precomputed for the whole batch (transformers' vision_utils pops them
# instead of computing them from grid_thw): a split cannot cut them, so the tower then runs whole
PRECOMPUTED = ("position_ids", "cu_seqlens", "max_seqlen", "window_index", "cu_window_seqlens")


def balanced_bounds(sizes: list[int], parts: int) -> list[int]:
    """Where to cut `sizes` (one per unit, at least `parts` of them) into `parts` contiguous, non-empty runs
    of about equal sums: the `parts + 1` boundaries, 0 first and len(sizes) last."""
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    bounds = [0]
    for part in range(1, parts):
        share = next(i for i, before in enumerate(prefix) if before >= prefix[-1] * part / parts)
        bounds.append(min(max(share, bounds[-1] + 1), len(sizes) - (parts - part)))
    return [*bounds, len(sizes)]


class TowerSplit:
    """Wraps `tower.forward`: while `active()` says a training batch is being split, this rank encodes its
    share of the units and the outputs are gathered over `group`; otherwise (generation, eval, fewer units
    than ranks) the tower runs whole, as before."""

    def __init__(self, tower: nn.Module, group, size: int, rank: int, active: Callable[[], bool]):
        self.group, self.size, self.rank, self.active = group, size, rank, active
        self.forward, self.tower_name = tower.forward, type(tower).__name__
        parameters = inspect.signature(self.forward).parameters
        self.by_frame = "grid_thw" in parameters
        self.first_argument = next(iter(parameters))  # pixels: `hidden_states` or `pixel_values`
        self.merge = getattr(getattr(tower, "config", None), "spatial_merge_size", 1) or 1
        self.logged = False
        tower.forward = self

    def __call__(self, *args, **kwargs):
        if not self.active() or any(kwargs.get(k) is not None for k in PRECOMPUTED):
            return self.forward(*args, **kwargs)
        if args:
            kwargs[self.first_argument], args = args[0], args[1:]
        split = self._split_by_frame(kwargs) if self.by_frame else self._split_by_tile(kwargs)
        if split is None:
            return self.forward(*args, **kwargs)
        mine, counts, units = split
        if not self.logged:
            self.logged = True
            log.info(
                "sequence-parallel: the vision tower encodes %s %s per rank of %d (this rank %d), then gathers",
                "/".join(str(n) for n in counts),
                "frames" if self.by_frame else "tiles",
                units,
                self.rank,
            )
        self.gathered = 0
        output = self._gather(self.forward(*args, **mine))
        if not self.gathered:  # e.g. Pixtral's tower: every image's patches in one sequence, not one per tile
            raise GuardError(
                f"sequence-parallel: the vision tower {self.tower_name} returned no tensor "
                "with one entry per frame or tile, so its split cannot be gathered; this family cannot split"
            )
        return output

    def _split_by_frame(self, kwargs: dict):
        """This rank's frames: its pixel rows and a grid of (frames, h, w) runs; None if too few frames."""
        pixels, grid = kwargs[self.first_argument], kwargs["grid_thw"]
        frames = [(row, h, w) for row, (t, h, w) in enumerate(grid.tolist()) for _ in range(t)]
        if len(frames) < self.size:
            return None
        patches = [h * w for _, h, w in frames]
        bounds = balanced_bounds(patches, self.size)
        starts = [sum(patches[:b]) for b in bounds]
        begin, end = bounds[self.rank], bounds[self.rank + 1]
        runs: list[list[int]] = []
        for row, h, w in frames[begin:end]:  # consecutive frames of one image or video: one grid row
            if runs and runs[-1][3] == row:
                runs[-1][0] += 1
            else:
                runs.append([1, h, w, row])
        mine = dict(kwargs)
        mine[self.first_argument] = pixels[starts[self.rank] : starts[self.rank + 1]]
        mine["grid_thw"] = torch.tensor([run[:3] for run in runs], dtype=grid.dtype, device=grid.device)
        per_rank = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        self.sizes = {
            per_rank[self.rank]: per_rank,  # per patch (the last hidden state)
            per_rank[self.rank] // self.merge**2: [n // self.merge**2 for n in per_rank],  # per merged token
        }
        return mine, [b - a for a, b in zip(bounds, bounds[1:], strict=False)], len(frames)

    def _split_by_tile(self, kwargs: dict):
        """This rank's tiles: every tensor argument with one entry per tile cut the same way."""
        tiles = kwargs[self.first_argument].shape[0]
        if tiles < self.size:
            return None
        bounds = balanced_bounds([1] * tiles, self.size)
        begin, end = bounds[self.rank], bounds[self.rank + 1]
        mine = {
            k: v[begin:end] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == tiles else v
            for k, v in kwargs.items()
        }
        per_rank = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        self.sizes = {per_rank[self.rank]: per_rank}
        return mine, per_rank, tiles

    def _gather(self, output):
        """Every tensor of the tower's output with one entry per unit of this rank (features, hidden states,
        Qwen3-VL's DeepStack features), gathered in rank order."""
        if isinstance(output, torch.Tensor):
            return self._gather_tensor(output)
        if isinstance(output, (tuple, list)):
            return type(output)(self._gather(item) for item in output)
        if isinstance(output, dict):  # a ModelOutput: its fields set again, in place
            for key, value in output.items():
                output[key] = self._gather(value)
            return output
        return output

    def _gather_tensor(self, local: torch.Tensor) -> torch.Tensor:
        sizes = self.sizes.get(local.shape[0]) if local.dim() else None
        if sizes is None:
            return local
        self.gathered += 1
        return GatherRows.apply(local, sizes, self.rank, self.group)


class GatherRows(torch.autograd.Function):
    """The ranks' row blocks (of `sizes` rows each) concatenated in rank order on every rank; the backward
    sums the group's gradients and keeps this rank's block. Ours because torch.distributed.nn's all_gather
    backward on gloo scatters by global rank and fails in a group that does not hold rank 0 (torch 2.14:
    "Global rank 0 is not part of group"), which every data group but the first is."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        most = max(sizes)
        padded = local.new_zeros(most, *local.shape[1:])  # all_gather takes equal shapes: pad, gather, cut
        padded[: local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None, None, None
