"""Sequence parallelism (`sequence_parallel_size: N`): the ranks form data groups of N sequence ranks; the N
ranks of a group read the same rows and each carries 1/N of every row through the language model.

What is ours and why: the Ulysses exchange around attention is a few lines (speedups/ulysses_attention.py,
whose docstring says why DeepSpeed's cannot carry a VLM); what no library does for a vision-language model
is here, and it is where sequence parallelism goes wrong for images (a split through an image's tokens, or
positions, masks and features computed on the piece instead of the row):

- the tower's work is split by frame or tile over the group and its features gathered
  (speedups/tower_split.py);
- the row is split only at the language model's door: the features are merged into the embeddings and the
  3-D (M-RoPE) positions are computed, all on the whole row, by the model's own forward; a pre-hook on the
  language model then keeps this rank's 1/N of the embeddings and positions (and of Qwen3-VL's DeepStack
  features);
- labels are shifted on the whole row before the split (the last token of a piece predicts the first of
  the next), and the row is padded to a multiple of N with ignored tokens at its end;
- the loss: each rank sums its own tokens; the Trainer's token count is divided by N (every rank of a group
  counted the same rows), so the gradients, summed by DDP or FSDP over every rank, are one process's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import distributed as dist
from torch import nn

from vlm_recipes.decisions import Decision
from vlm_recipes.errors import GuardError
from vlm_recipes.families.parameters import routed_experts
from vlm_recipes.speedups.tower_split import TowerSplit
from vlm_recipes.speedups.ulysses_attention import AttentionSwitch, RowMask

log = logging.getLogger(__name__)

# Batch keys with one value per token: padded with the row (their pad value) before the model sees it
PER_TOKEN_PAD = {"input_ids": None, "attention_mask": 0, "labels": -100, "mm_token_type_ids": 0}


@dataclass(frozen=True)
class SequenceGroups:
    """This rank's place in the grid: `size` sequence ranks per group, consecutive ranks together."""

    size: int
    rank: int  # within its sequence group
    group: dist.ProcessGroup
    data_groups: int
    data_index: int


def form_sequence_groups(size: int) -> SequenceGroups:
    """Ranks 0..N-1 form sequence group 0, N..2N-1 group 1, ...: every rank creates every group, in order (a
    rule of `new_group`)."""
    world, me = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise GuardError(
            f"sequence_parallel_size {size} does not divide the {world} processes: use --nproc-per-node (times "
            "--nnodes) a multiple of it"
        )
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if me in ranks:
            mine = group
    return SequenceGroups(size, me % size, mine, world // size, me // size)


def heads_refusal(text_config, size: int) -> str | None:
    """Why a language model cannot be split over `size` ranks by heads (None: it can)."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        return (
            f"its {heads} query heads and {kv_heads} key/value heads must both divide by sequence_parallel_size "
            f"{size} (each rank attends with 1/N of them): use a size that divides both"
        )
    return None


def sequence_parallel_refusal(family, text_config, size: int) -> str | None:
    """Why a stage of this family and language model cannot split its rows over `size` ranks (None: it can):
    the family's own reason (not proven, or a layer Ulysses does not reach), else its head counts."""
    if family.sequence_parallel_refusal:
        return f"{family.name}: {family.sequence_parallel_refusal}"
    if text_config is None:
        return None
    if routed_experts(text_config):
        return (
            f"{family.name}: a mixture-of-experts language model is not proven: each rank's router would balance "
            "its load over its piece of the row, not over the whole row as one process does"
        )
    window = getattr(text_config, "sliding_window", None)
    if window and getattr(text_config, "use_sliding_window", True):
        return f"{family.name}: its sliding-window layers ({window} tokens) need a mask the split's attention does not build"
    return heads_refusal(text_config, size)


def group_share(
    longest: int | None, size: int, limit: int | None = None, what: str = "the longest row"
) -> str:
    """What each rank of a sequence group holds of a row (`longest`: the longest row's tokens, or the limit's),
    for --dry-run and `data check`."""
    if longest is None:
        return f"{size} ranks per row; no data.max_length, so no longest row to state"
    row = padded_length(longest, size)
    held = f"{what}, {longest:,} tokens, is {row // size:,} per rank (padded to {row:,})"
    if limit is not None:
        verdict = "within" if longest <= limit else "over"
        held += f"; {verdict} data.max_length {limit:,}, which the group holds as {padded_length(limit, size) // size:,} per rank"
    return (
        f"{held}; per rank the language model's activations are 1/{size} (its tokens, attention's heads after "
        f"the all-to-all, the LM head's log-probabilities); the tower's about 1/{size} (each rank encodes its "
        "share of the frames or tiles)"
    )


def sequence_plan(stage, world_size: int) -> str | None:
    """--dry-run's line: the grid of ranks and what each holds of the longest row data.max_length allows."""
    size = stage.sequence_parallel_size
    if size == 1:
        return None
    share = group_share(stage.data.max_length, size, what="the longest row data.max_length allows")
    return f"{world_size // size} data group(s) x {size} sequence ranks: {share}"


def padded_length(length: int, size: int) -> int:
    return -(-length // size) * size


class SequenceShard:
    """Splits each training batch over the sequence group: `split(inputs)` pads the row and shifts its labels
    (whole-row work), and the language model's pre-hook keeps this rank's piece. Active from `split` until
    `release` (after the backward: gradient checkpointing runs attention again there)."""

    def __init__(
        self,
        groups: SequenceGroups,
        language_model: nn.Module,
        pad_token_id: int,
        media_ids: set[int],
        tower: nn.Module | None = None,
        implementation: str = "sdpa",
    ):
        self.groups = groups
        self.pad_token_id = pad_token_id
        self.media_ids = (
            media_ids  # image and video placeholder tokens: where the first batch was cut, logged
        )
        self.cuts_logged = False
        self.switch = AttentionSwitch(groups.group, groups.size, implementation)
        self.switch.modules = {id(m) for m in language_model.modules() if hasattr(m, "num_key_value_groups")}
        if not self.switch.modules:
            raise GuardError(f"{type(language_model).__name__}: no attention module to send through Ulysses")
        self.length: int | None = None  # the padded row's length while active
        self.head_tile: int | None = None  # TRL's LM-head tile while active (restored at release)
        language_model.register_forward_pre_hook(self._keep_this_ranks_piece, with_kwargs=True)
        if tower is not None:  # each rank encodes its share of the frames or tiles (speedups/tower_split.py)
            TowerSplit(tower, groups.group, groups.size, groups.rank, active=lambda: self.length is not None)

    def piece(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        local = self.length // self.groups.size
        return tensor.narrow(dim, self.groups.rank * local, local)

    def split(self, inputs: dict) -> dict:
        """The batch padded to a multiple of N (ignored tokens at each row's end), its labels shifted on the
        whole row then cut to this rank's piece (`shift_labels`: the fused LM head scores them unshifted)."""
        inputs = dict(inputs)
        ids = inputs["input_ids"]
        batch, length = ids.shape
        self.length = padded_length(length, self.groups.size)
        # padding-free: one row of samples end to end, their positions restarting, no mask (speedups/packing.py)
        packed = inputs.get("position_ids") is not None and "attention_mask" not in inputs
        if not packed and "attention_mask" not in inputs:
            inputs["attention_mask"] = torch.ones_like(ids)
        if packed and self.length > length:  # the pads join the last sample, after it: causality hides them
            positions = inputs["position_ids"]
            after = torch.arange(1, self.length - length + 1, device=positions.device, dtype=positions.dtype)
            inputs["position_ids"] = torch.cat([positions, positions[..., -1:] + after], dim=-1)
        for key, value in PER_TOKEN_PAD.items():
            tensor = inputs.get(key)
            if tensor is None or tensor.shape[:2] != (batch, length) or self.length == length:
                continue
            fill = self.pad_token_id if value is None else value
            inputs[key] = nn.functional.pad(tensor, (0, self.length - length), value=fill)
        if not self.cuts_logged:
            self.cuts_logged = True
            log.info(
                "sequence-parallel: %s", describe_cuts(ids[0], self.length, self.groups.size, self.media_ids)
            )
        # TRL's fused LM head scores tokens in tiles of TOKEN_CHUNK_SIZE (4,096), whatever their number, and a
        # tile's working memory (on a CPU ~8 fp32 copies of tile x vocabulary) would be one process's on every
        # rank: each rank scores its 1/N of the row in tiles of 1/N, restored at `release`
        from trl.kernels import chunked_logprob

        self.head_tile = chunked_logprob.TOKEN_CHUNK_SIZE
        chunked_logprob.TOKEN_CHUNK_SIZE = max(1, self.head_tile // self.groups.size)
        labels = inputs.pop("labels")
        shifted = nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        inputs["shift_labels"] = self.piece(shifted)
        if packed:  # row 0 of the 4-row (Qwen line) positions: the text ones, restarting with every sample
            positions = inputs["position_ids"]
            self.switch.active = RowMask(positions=positions[0] if positions.dim() == 3 else positions)
            return inputs
        mask = inputs["attention_mask"]
        lengths = mask.sum(-1, keepdim=True)
        right_padded = torch.equal(mask.bool(), torch.arange(self.length, device=mask.device) < lengths)
        # pads only at a row's end: causal attention never reads them, so no mask (sdpa's is_causal)
        self.switch.active = RowMask(None if right_padded else mask)
        return inputs

    def release(self) -> None:
        self.length = None
        self.switch.active = None
        if self.head_tile is not None:
            from trl.kernels import chunked_logprob

            chunked_logprob.TOKEN_CHUNK_SIZE, self.head_tile = self.head_tile, None

    def _keep_this_ranks_piece(self, module, args, kwargs):
        if self.length is None:
            return None  # generation, eval: the whole row on every rank
        kwargs["inputs_embeds"] = self.piece(kwargs["inputs_embeds"], 1)
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = self.piece(kwargs["position_ids"])
        else:  # the language model would count 0.. on its piece: the whole row's positions, this piece's share
            embeds = kwargs["inputs_embeds"]
            kwargs["position_ids"] = self.piece(torch.arange(self.length, device=embeds.device))[None]
        kwargs["attention_mask"] = None  # the whole row's is in the switch's RowMask
        if (visual := kwargs.get("visual_pos_masks")) is not None:  # Qwen3-VL's DeepStack
            # the features of the visual tokens in this rank's piece: their ranks among the row's visual tokens
            order = visual.flatten().cumsum(0).reshape(visual.shape) - 1
            kept = self.piece(order)[self.piece(visual)]
            kwargs["visual_pos_masks"] = self.piece(visual)
            kwargs["deepstack_visual_embeds"] = [e[kept] for e in kwargs["deepstack_visual_embeds"]]
        return args, kwargs


def describe_cuts(ids: torch.Tensor, length: int, size: int, media_ids: set[int]) -> str:
    """Where a row is cut into its pieces, and whether a cut falls inside an image's or video's tokens."""
    cuts = [length // size * k for k in range(1, size)]
    media = torch.isin(ids, torch.tensor(sorted(media_ids), dtype=ids.dtype))
    inside = [c for c in cuts if c < len(ids) and media[c - 1] and media[c]]
    where = (
        f"{len(inside)} of them inside an image's or video's tokens" if inside else "none inside media tokens"
    )
    return f"the first row ({len(ids)} tokens, padded to {length}) cut at token(s) {cuts}: {where}"


def language_model_of(model: nn.Module, family) -> nn.Module:
    """The family's language model (its `llm` role's first module), inside a PEFT wrapper or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_submodule(family.role_prefixes["llm"][0])


def sequence_shard_for(model: nn.Module, family, processor, size: int) -> SequenceShard:
    """The sequence groups formed (every rank must call this, in the same order) and this rank's shard of the
    model: refused first, with the reason, for a family or language model that cannot be split."""
    text_config = model.config.get_text_config()
    if why := sequence_parallel_refusal(family, text_config, size):
        raise GuardError(f"sequence_parallel_size {size} is refused: {why}")
    from vlm_recipes.speedups.packing import PER_SAMPLE_SDPA  # TRL: imported by the ranks only, not the plan

    implementation = getattr(text_config, "_attn_implementation", None)
    if implementation not in ("sdpa", PER_SAMPLE_SDPA):
        raise GuardError(
            f"sequence_parallel_size needs the language model on sdpa attention; it is on {implementation!r}"
        )
    groups = form_sequence_groups(size)
    media_ids = {getattr(processor, name, None) for name in ("image_token_id", "video_token_id")} - {None}
    tower = family.vision_tower(model)
    pad_token_id = processor.tokenizer.pad_token_id
    shard = SequenceShard(
        groups, language_model_of(model, family), pad_token_id, media_ids, tower, implementation
    )
    return shard


def install_sequence_parallel(trainer, built, size: int) -> Decision:
    """Sequence groups formed, the language model's attention sent through Ulysses, the batches split in
    `compute_loss` (methods/sft_trainer.py), every rank of a group fed the same rows."""
    trainer.sequence_shard = sequence_shard_for(built.model, built.family, built.processor, size)
    groups = trainer.sequence_shard.groups
    feed_sequence_groups_alike(trainer.accelerator, groups)
    return Decision(
        "sequence-parallel",
        f"{groups.data_groups} data group(s) x {size} sequence ranks (Ulysses all-to-all in attention)",
        "each row's tower, feature merge and M-RoPE positions on the whole row, then 1/N of its tokens per "
        "rank; labels shifted before the split; the loss summed over the group by token counts",
    )


def feed_sequence_groups_alike(accelerator, groups: SequenceGroups) -> None:
    """Accelerate shards batches over every process; here over the data groups only, so the N ranks of a
    sequence group draw the same rows (accelerate does the same for tensor-parallel ranks)."""
    from accelerate.data_loader import prepare_data_loader

    def prepare_by_data_group(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        prepared = prepare_data_loader(
            data_loader,
            accelerator.device,
            num_processes=groups.data_groups,
            process_index=groups.data_index,
            split_batches=accelerator.split_batches,
            put_on_device=accelerator.device_placement if device_placement is None else device_placement,
            rng_types=accelerator.rng_types.copy(),
            dispatch_batches=accelerator.dispatch_batches,
            even_batches=accelerator.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )
        accelerator._dataloaders.append(prepared)
        return prepared

    accelerator.prepare_data_loader = prepare_by_data_group
