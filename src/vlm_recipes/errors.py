"""The package's errors: two families, each carrying the exit code the command line returns.

- BadInput (exit 2): the recipe, the data, the model or the command line cannot be used as given. The
  message names the file, key or row and the fix; the CLI prints it without a traceback.
- StageStopped: a stage stopped before its end. StageInterrupted (130: Ctrl-C or SIGTERM, a checkpoint
  saved), TrainingDiverged (3: NaN/inf with on_nan: stop), DiskFull (4) or OutOfMemory (5: the host's
  MemoryError or the GPU's torch.OutOfMemoryError). The CLI prints the message and the --resume command.

The CLI catches these two bases. In a launched process group (torchrun, accelerate) the failing rank
records its error and exit code; the launcher returns that code (launch/rank_failures.py). A rank that
stopped answering (its host lost) ends the others with EXIT_RANK_LOST.
Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

# What the command line returns for bad input: every command's refusal, caught BadInput or not (an
# unknown command, a missing file, a dataset with problems)
EXIT_BAD_INPUT = 2
# What the ranks of a group return when one of them stopped answering: its host down, its network cut
EXIT_RANK_LOST = 6


class BadInput(Exception):
    """Input that cannot be used as given; the message says where and how to fix it."""

    exit_code = EXIT_BAD_INPUT


class GuardError(BadInput, RuntimeError):
    """A stage cannot run as configured; the message says why and how to fix it."""


class DataError(BadInput, ValueError):
    """Rows that cannot be trained on; the message lists where they are and why."""


class VideoError(BadInput, ValueError):
    """A video that cannot be read; the message says which and why."""


class UnsupportedModelError(BadInput, ValueError):
    """The model's architecture is not one of the supported families."""


class LoraTargetError(BadInput, ValueError):
    """A role has no layer LoRA can adapt, or a target names none."""


class MissingProcessorError(BadInput, ValueError):
    """The model directory has no processor (image processor, tokenizer, chat template)."""


class RunExistsError(BadInput, RuntimeError):
    """The run directory cannot be used as asked (exists, missing, or another process writes it)."""


class RunBusyError(RunExistsError):
    """Another live process holds the run directory's lock."""


class RunNotComparable(BadInput, ValueError):
    """A named run cannot be compared: it has not finished (failed, interrupted, running, killed)."""


class StageStopped(Exception):
    """A stage stopped before its end; what it finished is kept."""

    exit_code = 1


class StageInterrupted(StageStopped, RuntimeError):
    """Ctrl-C or SIGTERM: a checkpoint was saved and the stage stopped."""

    exit_code = 130


class DiskFull(StageStopped, OSError):
    """The disk filled while the run wrote (a checkpoint, final/, a cache, metrics, run.json): what was
    half-written is removed, finished stages are kept, and the run continues with --resume."""

    exit_code = 4


class TrainingDiverged(StageStopped, RuntimeError):
    """Loss or gradients became NaN/inf and the stage stopped (on_nan: stop). `resume_overrides`: what the
    printed --resume command changes, so that it does not replay the divergence."""

    exit_code = 3

    def __init__(self, message: str, resume_overrides: tuple[str, ...] = ()):
        super().__init__(message)
        self.resume_overrides = resume_overrides


class OutOfMemory(StageStopped, MemoryError):
    """The host's or the GPU's memory ran out in a stage: the message names the stage, the peak memory
    seen and the recipe keys that lower it; what was half-written is removed, finished stages are kept."""

    exit_code = 5


def exit_code_of(error: BaseException) -> int:
    """The exit code a process ending with `error` returns: its family's, 130 for Ctrl-C, else 1."""
    if isinstance(error, KeyboardInterrupt):
        return StageInterrupted.exit_code
    return getattr(error, "exit_code", 1)
