"""Freed host memory handed back to the operating system after every step, on a CPU.

glibc's malloc keeps what a program frees for its next allocations, and raises the size above which it maps
fresh pages each time it sees one freed (up to 32 MB). A training step's activations are tensors of many
sizes that change with every batch's length; freed, they leave holes in the heap that the next batch's
shapes do not fit, so the process's resident memory grows step after step while what it uses stays flat.
On the wide bench model (`demo:bench-qwen2-vl-wide`, bf16, 2 threads) a QLoRA stage grew by ~250 MB a step,
to 7-10 GB after 32 steps, with ~2 GB in use: plain TRL's script does the same.

`malloc_trim(0)` returns every free page of the heap to the system (glibc >= 2.8 releases pages inside the
heap, not only at its top). It frees nothing in use, so what is computed is unchanged. It is not free: the
next step faults the released pages in again and the kernel zeroes them (there, up to ~20 % of the training
loop; releasing only once the process has grown past a bound would cost less). Mapping every large block
fresh instead (`MALLOC_MMAP_THRESHOLD_`) also stops the growth, but made the steps 1.6x slower.

On a GPU the tensors live in CUDA's own caching allocator and the host holds little, so nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from transformers import TrainerCallback

from vlm_recipes.decisions import Decision, Environment


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_freed_host_memory() -> bool:
    """Hand the heap's free pages back to the system; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class HostMemoryRelease(TrainerCallback):
    """Releases freed host memory after every training step, every eval batch and the evaluation."""

    def __init__(self):
        self.releases = 0

    def _release(self, *_, **__) -> None:
        self.releases += release_freed_host_memory()

    on_step_end = on_prediction_step = on_evaluate = _release


def host_memory_release(env: Environment) -> tuple[HostMemoryRelease | None, Decision]:
    """The callback for this device, and the decision that says why."""
    if env.device != "cpu":
        return None, Decision("host-memory", "left to the allocator", "tensors live in GPU memory")
    if _malloc_trim() is None:
        return None, Decision("host-memory", "left to the allocator", "this C library has no malloc_trim")
    return HostMemoryRelease(), Decision(
        "host-memory",
        "freed heap pages returned to the system after every step",
        "on a CPU, batches of changing shapes leave freed blocks glibc keeps: resident memory grew ~250 MB "
        "a step on the wide bench model without it; nothing in use is freed",
    )
