"""What every guard decides with, on the ground floor so any room can import it: the machine
(Environment), a decision with its reason (Decision), and the names of the dtypes."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Environment:
    device: str  # "cuda" or "cpu"
    gpu_count: int
    bf16_supported: bool  # natively, on the device that computes
    gpu_name: str = ""

    @classmethod
    def detect(cls) -> Environment:
        if torch.cuda.is_available():
            return cls(
                device="cuda",
                gpu_count=torch.cuda.device_count(),
                bf16_supported=torch.cuda.is_bf16_supported(),
                gpu_name=torch.cuda.get_device_name(0),
            )
        return cls(device="cpu", gpu_count=0, bf16_supported=cpu_has_native_bf16())

    def describe(self) -> str:
        if self.device == "cuda":
            return f"{self.gpu_count} × {self.gpu_name} (bf16 {'yes' if self.bf16_supported else 'no'})"
        return f"CPU (native bf16 {'yes' if self.bf16_supported else 'no'})"


# A test-only switch: set to 1 or 0, the CPU is taken to have native bf16 or not, whatever it has, so the
# suite can be run both ways on one machine (`precision: auto` picks bf16 or fp32 from it). Never in a run.
TEST_ONLY_CPU_BF16_SWITCH = "VLM_RECIPES_TEST_ONLY_CPU_NATIVE_BF16"


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16/AMX CPUs run bf16 autocast at fp32 speed or better; elsewhere it is emulated and slow."""
    forced = os.environ.get(TEST_ONLY_CPU_BF16_SWITCH)
    if forced in ("0", "1"):
        return forced == "1"
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


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
