"""The callbacks a stage's trainer runs beside every step, and the checkpoint files they write.

Keeping a long run's work safe: complete-checkpoint markers, NaN/inf detection, Ctrl-C and SIGTERM handling.
(The crash tests kill runs at chosen points with tests/fault_injection.py, outside the package.)
A Trainer checkpoint is written in place (model, optimizer, scheduler, RNG, trainer state, in that
order); the `COMPLETE` marker is written after all of it, so a checkpoint without one was interrupted
mid-write and is never resumed from.

Measuring it: the step timer (time to the first step, step time median and p90, for metrics.json and the
benchmark). Keeping a CPU process's memory flat: HostMemoryRelease (see the section's comment).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import signal
import statistics
import time
from pathlib import Path

import psutil
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import TrainerCallback

from vlm_recipes.decisions import Decision, Environment
from vlm_recipes.files import write_json

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Checkpoints, NaN/inf, Ctrl-C

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
            (checkpoint / COMPLETE_MARKER).write_text(f"step {state.global_step}\n")


class NonFiniteCallback(TrainerCallback):
    """Before each optimizer step: if any gradient is NaN/inf, the step must not touch the weights.

    `stop`: end the stage (the last complete checkpoint stays good). `skip_step`: drop this step's
    gradients and go on. The logged loss is checked too (Trainer's NaN filter is turned off)."""

    def __init__(self, policy: str):
        self.policy = policy
        self.skipped_steps = 0
        self.diverged_at: int | None = None
        self.reason = ""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if args.fp16:
            return  # fp16 loss scaling skips overflowing steps itself and lowers the scale
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        total = torch.stack([g.detach().float().norm() for g in grads]).sum()
        if torch.isfinite(total):
            return
        for param in model.parameters():
            param.grad = None  # optimizers skip parameters without a gradient: the weights stay as they were
        step = state.global_step + 1
        if self.policy == "skip_step":
            self.skipped_steps += 1
            log.warning("step %d: gradients are NaN/inf, step skipped (nan_policy: skip_step)", step)
            return
        self._stop(control, step, "gradients became NaN/inf")

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if self.policy == "stop" and loss is not None and not torch.isfinite(torch.tensor(float(loss))):
            self._stop(control, state.global_step, f"train loss became {loss}")

    def _stop(self, control, step: int, reason: str) -> None:
        if self.diverged_at is None:
            self.diverged_at, self.reason = step, reason
        control.should_training_stop = True
        control.should_save = False  # never checkpoint a diverged state


STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}  # SIGTERM: a scheduler's or `kill`'s stop


class InterruptCallback(TrainerCallback):
    """First Ctrl-C or SIGTERM: finish the current step, save a checkpoint, stop. A second one stops at once."""

    def __init__(self):
        self.requested = False
        self._previous: dict = {}

    def install(self) -> None:
        self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt(STOP_SIGNALS[signum])
        self.requested = True
        log.warning(
            "%s: saving a checkpoint after this step (another one stops without saving)", STOP_SIGNALS[signum]
        )

    def on_step_end(self, args, state, control, **kwargs):
        if self.requested:
            control.should_save = True
            control.should_training_stop = True


# ---------------------------------------------------------------------------------------------
# Step timing


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step, data loading included: from the end of the step before (or the
    start of training) to the end of this one. Trainer fetches a step's batches before `on_step_begin`, so
    a timer started there would leave the data loading out. Time spent evaluating or saving a checkpoint
    between two steps is not a step's."""

    def __init__(self):
        self.first_step_end: float | None = None  # wall clock, to compare with the process start
        self.step_times: list[float] = []
        self._since = 0.0

    def _restart(self, *args, **kwargs):
        self._since = time.perf_counter()

    on_train_begin = on_evaluate = on_save = _restart

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.step_times.append(now - self._since)
        self._since = now
        if self.first_step_end is None:
            self.first_step_end = time.time()

    def summary(self) -> dict:
        """Seconds from process start (imports and model loading included) to the end of the first step,
        and step time statistics over the steps after the first (the first pays for warm-up)."""
        steady = self.step_times[1:] or self.step_times
        started = psutil.Process().create_time()
        return {
            "time_to_first_step_s": (self.first_step_end - started) if self.first_step_end else None,
            "step_time_median_s": statistics.median(steady) if steady else None,
            "step_time_p90_s": percentile(steady, 0.9) if steady else None,
            "steps_timed": len(self.step_times),
        }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


# ---------------------------------------------------------------------------------------------
# Host memory: freed heap pages handed back to the operating system once the process has grown, on a CPU.
#
# glibc's malloc keeps what a program frees for its next allocations, and raises the size above which it maps
# fresh pages each time it sees one freed (up to 32 MB). A training step's activations are tensors of many
# sizes that change with every batch's length; freed, they leave holes in the heap that the next batch's
# shapes do not fit, so the process's resident memory grows step after step while what it uses stays flat.
# On the wide bench model (`demo:bench-qwen2-vl-wide`, bf16, 2 threads) a QLoRA stage grew by ~250 MB a step,
# to 7-10 GB after 32 steps, with ~2 GB in use: plain TRL's script does the same.
#
# `malloc_trim(0)` returns every free page of the heap to the system (glibc >= 2.8 releases pages inside the
# heap, not only at its top). It frees nothing in use, so what is computed is unchanged. It is not free: the
# next step faults the released pages in again and the kernel zeroes them. So the release waits until
# resident memory has grown past GROWTH_BOUND times what it was just after the last release (one read of
# /proc/self/statm a step). On r1's bench stage (wide model, bf16, 128 rows, Intel Xeon with AMX, 2 threads,
# 3 interleaved runs each) the training loop took 77-79 s with a bound of 1.25 (peak 3.8-4.0 GB), 76-96 s with
# 1.5 (4.4-4.5 GB), and 84-120 s releasing at every step (3.9 GB); plain TRL's took 136-156 s (6.9-8.6 GB). Mapping every large block fresh instead
# (`MALLOC_MMAP_THRESHOLD_`) also stops the growth, but made the steps 1.6x slower.
#
# On a GPU the tensors live in CUDA's own caching allocator and the host holds little, so nothing is done.


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


GROWTH_BOUND = 1.25  # release once resident memory is this many times its size after the last release
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident memory, from /proc (cheap enough to read every step); None off Linux."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None


def release_freed_host_memory() -> bool:
    """Hand the heap's free pages back to the system; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class HostMemoryRelease(TrainerCallback):
    """After every training step, eval batch and evaluation, releases freed host memory if the process has
    grown past `growth_bound` times its resident size just after the last release (always, where the size
    cannot be read)."""

    def __init__(self, growth_bound: float = GROWTH_BOUND):
        self.growth_bound = growth_bound
        self.floor: int | None = None  # resident bytes just after the last release
        self.releases = 0

    def _release_if_grown(self, *_, **__) -> None:
        resident = resident_bytes()
        if self.floor is not None and resident is not None and resident <= self.floor * self.growth_bound:
            return
        self.releases += release_freed_host_memory()
        self.floor = resident_bytes()

    on_step_end = on_prediction_step = on_evaluate = _release_if_grown


def host_memory_release(env: Environment) -> tuple[HostMemoryRelease | None, Decision]:
    """The callback for this device, and the decision that says why."""
    if env.device != "cpu":
        return None, Decision("host-memory", "left to the allocator", "tensors live in GPU memory")
    if _malloc_trim() is None:
        return None, Decision("host-memory", "left to the allocator", "this C library has no malloc_trim")
    return HostMemoryRelease(), Decision(
        "host-memory",
        f"freed heap pages returned to the system whenever resident memory grows {GROWTH_BOUND}x past its "
        "size after the last release",
        "on a CPU, batches of changing shapes leave freed blocks glibc keeps: resident memory grew ~250 MB "
        "a step on the wide bench model without it; nothing in use is freed",
    )


def stage_callbacks(
    stage_index: int, nan_policy: str, env: Environment
) -> tuple[dict[str, TrainerCallback], Decision]:
    """A stage's callbacks by name (checkpoints, NaN/inf, Ctrl-C, step timing, and the host-memory release
    where this device has one), with the decision that says why host memory is released or not."""
    callbacks = {
        "checkpoint": CheckpointCallback(stage_index),
        "nonfinite": NonFiniteCallback(nan_policy),
        "interrupt": InterruptCallback(),
        "timer": StepTimer(),
    }
    release, decision = host_memory_release(env)
    if release is not None:
        callbacks["host_memory"] = release
    return callbacks, decision
