"""The callbacks a stage's trainer runs beside every step.

Keeping a long run's work safe: NaN/inf detection, Ctrl-C and SIGTERM handling, and the checkpoints'
completion markers (methods/checkpoints.py). (The crash tests kill runs at chosen points with
tests/fault_injection.py, outside the package.) None of them reads a tensor on the host between logging steps
(tests/test_host_reads.py): on a GPU such a read makes the step wait for its last kernel.

Measuring it: the step timer (time to the first step, step time median and p90, for metrics.json and the
benchmark). Keeping a CPU process's memory flat: HostMemoryRelease (see the section's comment).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import os
import signal
import statistics
import time

import psutil
import torch
from transformers import TrainerCallback

from vlm_recipes.decisions import Decision, Environment
from vlm_recipes.methods.checkpoints import CheckpointCallback

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# NaN/inf, Ctrl-C


class NonFiniteCallback(TrainerCallback):
    """A gradient or loss that turns NaN/inf, caught without reading the device every step.

    Every step, Trainer's own gradient norm (computed anyway, for clipping and the log; a NaN/inf gradient
    makes it NaN/inf) is handed over by the trainer (`RecipeTrainerMixin._get_grad_norm`) and folded into a
    device-side record of the first step whose norm was not finite: a few tensor ops, no host read. That
    record is read on the host only at steps where Trainer reads the device anyway or must not go on blind:
    a logging, evaluation or checkpoint step, and the last. A host read every step would make the GPU wait
    for the step's last kernel before the next step's first one is queued.

    `stop` (the default): the stage ends at the first such step after the divergence, within
    `logging_steps`; no checkpoint is written from a diverged state, so the last complete checkpoint is the
    last good one. `skip_step`: that step's gradients are dropped before the optimizer sees them, which
    needs the answer before every optimizer step: one host read a step, the price of the policy. The logged
    loss is checked too (Trainer's NaN filter is turned off)."""

    def __init__(self, policy: str):
        self.policy = policy
        self.skipped_steps = 0
        self.diverged_at: int | None = None
        self.reason = ""
        self.first_bad_step: torch.Tensor | None = (
            None  # on the device: first step with a NaN/inf norm, or -1
        )
        self._norm: torch.Tensor | None = None  # this step's gradient norm, as the trainer handed it
        self._norm_step = -1

    def see_grad_norm(self, grad_norm, step: int) -> None:
        """The trainer's gradient norm of optimizer step `step` (1-based), before the optimizer runs."""
        if grad_norm is None:
            return
        if not isinstance(grad_norm, torch.Tensor):  # DeepSpeed hands a float
            grad_norm = torch.tensor(float(grad_norm))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor, the same value on every rank
            grad_norm = grad_norm.full_tensor()
        self._norm, self._norm_step = grad_norm.detach(), step
        if self.first_bad_step is None:
            self.first_bad_step = torch.full((), -1, dtype=torch.long, device=grad_norm.device)
        diverged_now = ~torch.isfinite(self._norm) & (self.first_bad_step < 0)
        self.first_bad_step = torch.where(diverged_now, step, self.first_bad_step)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if args.fp16:
            return  # fp16 loss scaling skips overflowing steps itself and lowers the scale
        step = state.global_step + 1
        if self._norm_step != step:  # a trainer that does not hand its norm over: computed here
            self.see_grad_norm(gradient_norm(model), step)
        if self.policy != "skip_step" or self._norm is None or torch.isfinite(self._norm):
            return
        for param in model.parameters():
            param.grad = None  # optimizers skip parameters without a gradient: the weights stay as they were
        self.skipped_steps += 1
        log.warning("step %d: gradients are NaN/inf, step skipped (on_nan: skip_step)", step)

    def on_step_end(self, args, state, control, **kwargs):
        # Trainer's DefaultFlowCallback, which runs first, has just said what follows this step
        reads = control.should_log or control.should_evaluate or control.should_save
        if self.first_bad_step is None or not (reads or control.should_training_stop):
            return
        first_bad = int(self.first_bad_step)  # the one host read, at steps that read the device anyway
        if first_bad >= 0 and self.policy == "stop":
            self._stop(control, first_bad, "gradients became NaN/inf")

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if self.policy == "stop" and loss is not None and not math.isfinite(loss):
            self._stop(control, state.global_step, f"train loss became {loss}")

    def _stop(self, control, step: int, reason: str) -> None:
        if self.diverged_at is None:
            self.diverged_at, self.reason = step, reason
        control.should_training_stop = True
        control.should_save = False  # never checkpoint a diverged state
        control.should_evaluate = False


def gradient_norm(model: torch.nn.Module) -> torch.Tensor | None:
    """The 2-norm of every gradient together, on the device (no host read); None before any gradient."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    device = grads[0].device
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32).to(device) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


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
# resident memory has grown past GROWTH_BOUND times the working size: what it was at the end of the first step
# after the last release, that step's own tensors back in (one read of /proc/self/statm a step). On r1's bench
# stage (wide model, bf16, 128 rows, Intel Xeon with AMX, 2 threads, 3 interleaved runs each) the training loop
# took 77-79 s with a bound of 1.25 (peak 3.8-4.0 GB), 76-96 s with 1.5 (4.4-4.5 GB), and 84-120 s releasing
# at every step (3.9 GB); plain TRL's took 136-156 s (6.9-8.6 GB). Mapping every large block fresh instead
# (`MALLOC_MMAP_THRESHOLD_`) also stops the growth, but made the steps 1.6x slower.
# The bound was first counted from the size just after a release. A step whose own tensors are over a quarter
# of the process then crossed it every step: r2's bench stage on the small model (fp32, an AMD EPYC with AVX2,
# 2 threads) released at 30 of its 32 steps, its RSS 1.42 GB before each release and 1.09 after, and trained
# 8-15 % slower than plain TRL for nothing (no growth to stop). Counted from the working size, it releases
# only when the process grows.
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


GROWTH_BOUND = 1.25  # release once resident memory is this many times the working size
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
    """After every training step, eval batch and evaluation, releases freed host memory once the process has
    grown past `growth_bound` times its working size: its resident size at the end of the first training
    step after the last release, when that step's own tensors are back in. A process whose steps reuse what
    they freed stays near its working size and is never trimmed; only growth beyond it is (always, where the
    size cannot be read)."""

    def __init__(self, growth_bound: float = GROWTH_BOUND):
        self.growth_bound = growth_bound
        self.working: int | None = None  # resident bytes after the first step since the last release
        self.releases = 0

    def _release_if_grown(self, *_, **__) -> None:
        resident = resident_bytes()
        if resident is not None and (self.working is None or resident <= self.working * self.growth_bound):
            return
        self.releases += release_freed_host_memory()
        self.working = None

    on_prediction_step = on_evaluate = _release_if_grown

    def on_step_end(self, *args, **kwargs) -> None:
        if self.working is None:
            self.working = resident_bytes()
            return
        self._release_if_grown()


def host_memory_release(env: Environment) -> tuple[HostMemoryRelease | None, Decision]:
    """The callback for this device, and the decision that says why."""
    if env.device != "cpu":
        return None, Decision("host-memory", "left to the allocator", "tensors live in GPU memory")
    if _malloc_trim() is None:
        return None, Decision("host-memory", "left to the allocator", "this C library has no malloc_trim")
    return HostMemoryRelease(), Decision(
        "host-memory",
        f"freed heap pages returned to the system whenever resident memory grows {GROWTH_BOUND}x past the "
        "working size (after the first step since the last release)",
        "on a CPU, batches of changing shapes leave freed blocks glibc keeps: resident memory grew ~250 MB "
        "a step on the wide bench model without it; nothing in use is freed",
    )


def stage_callbacks(
    stage_index: int, on_nan: str, env: Environment
) -> tuple[dict[str, TrainerCallback], Decision]:
    """A stage's callbacks by name (checkpoints, NaN/inf, Ctrl-C, step timing, and the host-memory release
    where this device has one), with the decision that says why host memory is released or not."""
    callbacks = {
        "checkpoint": CheckpointCallback(stage_index),
        "nonfinite": NonFiniteCallback(on_nan),
        "interrupt": InterruptCallback(),
        "timer": StepTimer(),
    }
    release, decision = host_memory_release(env)
    if release is not None:
        callbacks["host_memory"] = release
    return callbacks, decision
