"""Freed host memory goes back to the system after every step on a CPU (methods/host_memory.py)."""

from __future__ import annotations

import psutil
import pytest
import torch

from vlm_recipes.decisions import Environment
from vlm_recipes.methods.host_memory import HostMemoryRelease, host_memory_release, release_freed_host_memory

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


def test_the_release_runs_on_a_cpu_after_every_step_and_evaluation_and_is_off_on_a_gpu():
    cpu = Environment(device="cpu", gpu_count=0, bf16_supported=True)
    callback, decision = host_memory_release(cpu)
    assert isinstance(callback, HostMemoryRelease) and decision.guard == "host-memory"
    for event in (callback.on_step_end, callback.on_prediction_step, callback.on_evaluate):
        event(None, None, None)
    assert callback.releases == 3
    gpu = Environment(device="cuda", gpu_count=1, bf16_supported=True, gpu_name="H100")
    callback, decision = host_memory_release(gpu)
    assert callback is None and "GPU memory" in decision.reason
