"""Memory that runs out in a stage, the host's (MemoryError) or the GPU's (torch.OutOfMemoryError): told
apart from other failures and turned into one message, built here: which stage, the peak memory seen (as
metrics.json measures it: the GPU's peak allocation, or the process's peak resident memory on a CPU), and
the recipe keys that lower it. The CLI adds the --resume command.

CUDA libraries that allocate on their own (cuBLAS's workspace, a kernel launch) raise a plain RuntimeError
saying so; those are taken as the GPU's memory running out too."""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path

import torch

from vlm_recipes.decisions import Environment
from vlm_recipes.errors import BadInput, OutOfMemory, StageStopped
from vlm_recipes.recipes.schema import Recipe, Stage
from vlm_recipes.runs.layout import is_done
from vlm_recipes.stages.disk_full import remove_half_written

OOM_TEXTS = ("CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def memory_error_in(error: BaseException) -> BaseException | None:
    """The memory error `error` is, or was raised from or while handling; None when there is none. An error
    already told apart (bad input, a stopped stage) keeps its own message."""
    if isinstance(error, BadInput | StageStopped):
        return None
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, MemoryError | torch.OutOfMemoryError):
            return cause
        if isinstance(cause, RuntimeError) and any(text in str(cause) for text in OOM_TEXTS):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def out_of_memory(
    error: BaseException, run_dir: Path, recipe: Recipe, stage_dirs: list[Path], env: Environment
) -> OutOfMemory:
    """The error a run whose memory ran out stops with, once what was half-written is removed."""
    # The failed stage's frames still hold its tensors: released first, the message and run.json need room
    traceback.clear_frames(error.__traceback__)
    cause = memory_error_in(error) or error
    removed = remove_half_written(stage_dirs)
    pending = [
        (i, s) for i, (s, d) in enumerate(zip(recipe.stages, stage_dirs, strict=False), 1) if not is_done(d)
    ]
    where = f"stage {pending[0][0]}/{len(recipe.stages)} `{pending[0][1].name}`" if pending else "the run"
    message = f"out of memory in {where} ({describe(cause)}); {peak_seen(env)}"
    if pending:
        message += f". To fit, lower {what_to_lower(pending[0][1])}, as overrides of a new run"
    if removed:
        message += f". Removed {len(removed)} half-written file(s) and checkpoint(s)"
    return OutOfMemory(
        f"{message}. Complete checkpoints and finished stages are kept; --resume continues this run as "
        "run.json records it (enough when something else held the memory)"
    )


def describe(cause: BaseException) -> str:
    """The error's type and first words: CUDA's message is a paragraph, its first two sentences say it."""
    lines = str(cause).strip().splitlines()
    text = ". ".join(lines[0].split(". ")[:2]).removesuffix(".") if lines else ""
    name = "torch.OutOfMemoryError" if isinstance(cause, torch.OutOfMemoryError) else type(cause).__name__
    return f"{name}: {text[:160]}" if text else name


def peak_seen(env: Environment) -> str:
    """The peak memory as metrics.json records it (evaluation.metrics.peak_memory), beside the total."""
    from vlm_recipes.evaluation.metrics import peak_memory

    try:
        peak = peak_memory(env)
    except Exception:  # a courtesy: the message must reach the user regardless
        return "peak memory unknown"
    total = ""
    if peak["device"] == "cuda":
        with contextlib.suppress(Exception):
            memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            total = f" of the GPU's {memory / 2**30:.2f} GB"
        return f"peak GPU memory {peak['allocated_gb']:.2f} GB allocated ({peak['reserved_gb']:.2f} GB reserved{total})"
    with contextlib.suppress(ValueError, OSError, AttributeError):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        total = f"; the machine has {memory / 2**30:.2f} GB"
    return f"peak resident memory {peak['rss_gb']:.2f} GB (this process{total})"


def what_to_lower(stage: Stage) -> str:
    """The stage's recipe keys that lower its memory, as the schema spells them, with their values now."""
    training, data = stage.training, stage.data
    keys = []
    batch, accumulation = training.per_device_batch_size, training.gradient_accumulation_steps
    if batch > 1:  # the largest smaller divisor: the global batch stays exactly the same
        smaller = max(n for n in range(1, batch) if batch % n == 0)
        keys.append(
            f"training.per_device_batch_size {batch} -> {smaller} with training.gradient_accumulation_steps "
            f"{accumulation} -> {accumulation * batch // smaller} (the same global batch)"
        )
    no_limit, model_own = "null: no limit", "null: the model's own"
    keys.append(f"data.max_length (now {no_limit if data.max_length is None else data.max_length})")
    keys.append(f"data.max_pixels (now {model_own if data.max_pixels is None else data.max_pixels})")
    if not training.gradient_checkpointing:
        keys.append("or set training.gradient_checkpointing: true (~30% slower)")
    return ", ".join(keys)
