"""What every guard decides with, on the ground floor so any room can import it: the machine's facts
(Environment, found by machine.py), a decision with its reason (Decision), and the names of the dtypes."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Environment:
    """The facts the guards decide with (found by `machine.detect_environment`; tests build their own)."""

    device: str  # "cuda" or "cpu"
    gpu_count: int
    bf16_supported: bool  # natively, at fp32's speed or better, on the device that computes
    gpu_name: str = ""
    instruction_set: str = ""  # a CPU's: AMX, AVX512-BF16, AVX512, AVX2, Arm BF16, Arm
    bf16_reason: str = (
        ""  # what was found, e.g. "AVX512 without BF16: bf16 matmul measured 5.4x slower than fp32"
    )
    left_unused: str = ""  # an accelerator found and not computed on, and why (a Mac's MPS)

    def describe(self) -> str:
        """The machine as a run or a figure records it: the GPU, or the CPU's instruction set and its bf16."""
        if self.device == "cuda":
            return f"{self.gpu_count} × {self.gpu_name} (bf16 {'yes' if self.bf16_supported else 'no'})"
        cpu = f"CPU, {self.instruction_set}" if self.instruction_set else "CPU"
        return f"{cpu} (bf16 {'native' if self.bf16_supported else 'emulated'})"


@dataclass(frozen=True)
class Decision:
    guard: str
    choice: str
    reason: str

    def __str__(self) -> str:
        return f"{self.guard}: {self.choice} ({self.reason})"

    def to_dict(self) -> dict:
        return asdict(self)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
