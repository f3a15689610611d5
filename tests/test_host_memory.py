"""Freed host memory goes back to the system on a CPU once the process has grown (methods/callbacks.py)."""

from __future__ import annotations

import psutil
import pytest
import torch

from vlm_recipes.decisions import Environment
from vlm_recipes.methods.callbacks import (
    GROWTH_BOUND,
    HostMemoryRelease,
    host_memory_release,
    release_freed_host_memory,
    resident_bytes,
)

MB = 2**20


def resident_mb() -> float:
    return psutil.Process().memory_info().rss / MB


@pytest.mark.skipif(not release_freed_host_memory(), reason="this C library has no malloc_trim")
def test_freed_blocks_between_blocks_in_use_go_back_to_the_system():
    """A step's activations freed between tensors still in use leave holes glibc keeps (what grew a QLoRA
    stage by ~250 MB a step on the wide bench model): releasing returns them, and without it they stay."""
    # a freed 16 MB block raises glibc's mmap threshold past it, so the 4 MB blocks below come from the heap
    # (as a training step's activations do once glibc has seen one freed)
    big = torch.ones(16 * MB, dtype=torch.uint8)
    del big
    blocks = [torch.ones(4 * MB + 4096 * i, dtype=torch.uint8) for i in range(64)]  # ~260 MB
    del blocks[::2]  # every other one freed: each hole sits between blocks in use
    held = resident_mb()
    assert resident_mb() > held - 16, "freeing alone hands nothing back (the growth the release stops)"
    assert release_freed_host_memory()
    released = held - resident_mb()
    assert released > 100, f"released {released:.0f} MB of the ~130 MB freed"
    del blocks


def test_the_release_runs_on_a_cpu_once_memory_has_grown_past_the_working_size_and_is_off_on_a_gpu():
    cpu = Environment(device="cpu", gpu_count=0, bf16_supported=True)
    callback, decision = host_memory_release(cpu)
    assert isinstance(callback, HostMemoryRelease) and decision.guard == "host-memory"
    assert f"{GROWTH_BOUND}x" in decision.choice
    callback.on_step_end(None, None, None)
    assert callback.releases == 0, "the first step sets the working size and releases nothing"
    assert callback.working == pytest.approx(resident_bytes(), rel=0.1)
    for released, event in enumerate(
        (callback.on_step_end, callback.on_prediction_step, callback.on_evaluate)
    ):
        callback.working = resident_bytes()  # not grown: the pages stay for the next step
        event(None, None, None)
        assert callback.releases == released
        callback.working = resident_bytes() / (GROWTH_BOUND + 0.1)  # grown past the bound: released
        event(None, None, None)
        assert callback.releases == 1 + released and callback.working is None
    callback.on_prediction_step(None, None, None)  # no working size yet: an eval batch waits for a step
    assert callback.releases == 3
    callback.on_step_end(None, None, None)  # the step after a release measures the working size again
    assert callback.releases == 3 and callback.working == pytest.approx(resident_bytes(), rel=0.1)


def test_a_process_whose_steps_reuse_what_they_freed_is_never_trimmed():
    """The regression: counted from the size just after a release, a step whose own tensors are over a quarter
    of the process crossed the bound every step (r2's small bench stage released at 30 of 32 steps, 8-15 %
    slower than plain TRL). Counted from the working size, a step that frees what it took leaves it alone."""
    callback = HostMemoryRelease()
    for _ in range(6):
        step = torch.ones(64 * MB, dtype=torch.uint8)  # the step's tensors: ~15-30 % of this process
        callback.on_step_end(None, None, None)
        del step
    assert callback.releases == 0
