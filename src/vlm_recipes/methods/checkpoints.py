"""A stage's checkpoints: what Trainer writes, plus the trainable tensors under their module names and a
`COMPLETE` marker written after all of it is fsynced (CheckpointCallback), so a checkpoint without one was
interrupted mid-write (or by a power cut) and is never resumed from; and reading them back on any number of
ranks."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import TrainerCallback

from vlm_recipes.files import fsync_dir, fsync_tree, write_atomically, write_json

COMPLETE_MARKER = "COMPLETE"
TRAINABLE_FILE = "trainable.safetensors"
GLOBAL_BATCH_FILE = "global_batch.json"  # the processes, rows per device and accumulation that wrote it
TRAINABLE_SHARDS = "trainable"  # FSDP2: a torch.distributed.checkpoint directory, a file per rank


def complete_checkpoints(checkpoints_dir: Path) -> tuple[list[Path], list[Path]]:
    """(complete, incomplete) `checkpoint-N` directories, each sorted by step."""
    found = sorted(checkpoints_dir.glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    complete = [p for p in found if (p / COMPLETE_MARKER).is_file()]
    return complete, [p for p in found if p not in complete]


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable tensor (LoRA adapters and fully trained weights) by module name, whole, on the CPU:
    the checkpoint file of a model that is not sharded (an FSDP2 model's go through save_trainable_shards)."""
    return {name: tensor.cpu().contiguous() for name, tensor in trainable_views(model).items()}


def is_sharded(model: torch.nn.Module) -> bool:
    """Its weights are FSDP2 shards (DTensor): reading them whole takes every rank."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def restore_trainable(model: torch.nn.Module, checkpoint: Path) -> int:
    """Put a checkpoint's trainable tensors back into the model, in place (optimizer state stays attached)."""
    if (checkpoint / TRAINABLE_SHARDS).is_dir():
        return restore_trainable_shards(model, checkpoint / TRAINABLE_SHARDS)
    path = checkpoint / TRAINABLE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint} has no {TRAINABLE_FILE}: it was not written by vlm-recipes")
    saved = load_file(str(path))
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in saved]
    if missing:
        raise ValueError(
            f"{path} lacks {len(missing)} trainable tensors (e.g. {missing[0]}): the recipe changed"
        )
    with torch.no_grad():
        for name, value in saved.items():
            param = params[name]
            value = value.to(param.device, param.dtype)
            if isinstance(param, DTensor):  # FSDP2: each rank keeps its own shard of the whole tensor
                value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(value)
    return len(saved)


def save_trainable_shards(model: torch.nn.Module, shards: Path) -> None:
    """FSDP2: every rank writes its own shards of the trainable tensors (torch.distributed.checkpoint, a
    collective), so no rank ever holds them whole; `restore_trainable_shards` reads them back on any
    number of ranks."""
    dcp.save(trainable_views(model), checkpoint_id=shards)


def restore_trainable_shards(model: torch.nn.Module, shards: Path) -> int:
    """Each rank reads the parts of the saved shards its own shards cover, in place (re-sharded by
    torch.distributed.checkpoint when the ranks are not the ones that wrote them)."""
    views = trainable_views(model)
    try:
        dcp.load(views, checkpoint_id=shards)
    except dcp.api.CheckpointException as error:
        raise ValueError(
            f"{shards} does not hold this stage's trainable tensors (the recipe changed): {error}"
        ) from error
    return len(views)


def trainable_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable tensor by module name, sharing the parameter's storage (a shard, under FSDP2)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


class CheckpointCallback(TrainerCallback):
    """After Trainer has written a checkpoint: add the trainable tensors under their module names, then
    mark it complete. Resuming reads that file, not Trainer's copy of the model: transformers 5.23 saves
    Qwen2-VL under its hub key names and, on resume, silently fails to load them back."""

    def __init__(self, stage_index: int):
        self.stage_index = stage_index

    def on_save(self, args, state, control, model=None, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            # A checkpoint of the last step is never resumed from: transformers 5.23 resuming at
            # global_step == max_steps still trains one more step (17 of 16). Left without COMPLETE, a
            # stage killed after its last step resumes from the checkpoint before and ends identical.
            return
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if is_sharded(model):
            save_trainable_shards(model, checkpoint / TRAINABLE_SHARDS)  # every rank writes its own
        elif state.is_world_process_zero:
            save_file(trainable_state(model), str(checkpoint / TRAINABLE_FILE))
        if state.is_world_process_zero:
            batch = {
                "processes": args.world_size,
                "per_device": args.per_device_train_batch_size,
                "accumulation": args.gradient_accumulation_steps,
            }
            write_json(checkpoint / GLOBAL_BATCH_FILE, batch)
            # Trainer wrote the checkpoint in place: all of it on the disk before the marker says so (this
            # node's files; a shared filesystem has the other nodes' once their ranks closed them)
            fsync_tree(checkpoint)
            fsync_dir(checkpoint.parent)
            marker = f"step {state.global_step}\n"
            write_atomically(checkpoint / COMPLETE_MARKER, lambda tmp: Path(tmp).write_text(marker))


def keep_the_asked_learning_rates(optimizer, scheduler, asked: list[float]) -> list[tuple[float, float]]:
    """After Trainer restored a checkpoint's optimizer and scheduler: each group's rates scaled to the base
    rates this resume asked for (`asked`, as the fresh scheduler had them). Trainer's restore brings back the
    checkpoint's base rates, so a resume at a lower learning rate (after a NaN stop) would train at the old
    one. The schedule's shape and position stay: its rate at a step is base x the schedule's factor.
    Returns (restored, asked) per group that changed."""
    restored = list(getattr(scheduler, "base_lrs", []))
    if len(restored) != len(asked) or restored == asked:
        return []
    changed = []
    for index, (group, old, new) in enumerate(zip(optimizer.param_groups, restored, asked, strict=True)):
        if old != new:
            group["lr"] *= new / old
            group["initial_lr"] = new
            scheduler.base_lrs[index] = new
            changed.append((old, new))
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
    return changed
