"""Freed host memory handed back to the operating system once the process has grown, on a CPU.

glibc's malloc keeps what a program frees for its next allocations, and raises the size above which it maps
fresh pages each time it sees one freed (up to 32 MB). A training step's activations are tensors of many
sizes that change with every batch's length; freed, they leave holes in the heap that the next batch's
shapes do not fit, so the process's resident memory grows step after step while what it uses stays flat.
On the wide bench model (`demo:bench-qwen2-vl-wide`, bf16, 2 threads) a QLoRA stage grew by ~250 MB a step,
to 7-10 GB after 32 steps, with ~2 GB in use: plain TRL's script does the same.

`malloc_trim(0)` returns every free page of the heap to the system (glibc >= 2.8 releases pages inside the
heap, not only at its top). It frees nothing in use, so what is computed is unchanged. It is not free: the
next step faults the released pages in again and the kernel zeroes them. So the release waits until
resident memory has grown past GROWTH_BOUND times what it was just after the last release (one read of
/proc/self/statm a step). On r1's bench stage (wide model, bf16, 128 rows, Intel Xeon with AMX, 2 threads,
3 interleaved runs each) the training loop took 77-79 s with a bound of 1.25 (peak 3.8-4.0 GB), 76-96 s with
1.5 (4.4-4.5 GB), and 84-120 s releasing at every step (3.9 GB); plain TRL's took 136-156 s (6.9-8.6 GB). Mapping every large block fresh instead
(`MALLOC_MMAP_THRESHOLD_`) also stops the growth, but made the steps 1.6x slower.

On a GPU the tensors live in CUDA's own caching allocator and the host holds little, so nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

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
