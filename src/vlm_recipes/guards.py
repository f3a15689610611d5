"""Guards: pure decisions (facts in → choice + reason out) and the small steps that apply them.

Each decision is printed before training and saved in the stage's report.json, so a failed run
explains itself. The pure functions take an Environment, so tests can fake 2 GPUs or an
fp16-only GPU on a CPU machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


class GuardError(RuntimeError):
    """A stage cannot run as configured; the message says why and how to fix it."""


@dataclass(frozen=True)
class Environment:
    device: str  # "cuda" or "cpu"
    gpu_count: int
    bf16_supported: bool  # on the device that will compute
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
        return cls(device="cpu", gpu_count=0, bf16_supported=True)

    def describe(self) -> str:
        if self.device == "cuda":
            return f"{self.gpu_count} × {self.gpu_name} (bf16 {'yes' if self.bf16_supported else 'no'})"
        return "CPU"


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


def decide_precision(requested: str, env: Environment, quantized: bool) -> Decision:
    """Pick the compute precision. An explicit request wins, unless the hardware cannot do it."""
    if requested != "auto":
        if requested == "fp16" and env.device == "cpu":
            raise GuardError(
                "precision fp16 was requested but this machine has no GPU: use bf16 or fp32 on CPU"
            )
        if requested == "bf16" and env.device == "cuda" and not env.bf16_supported:
            raise GuardError(
                f"precision bf16 was requested but {env.gpu_name or 'this GPU'} does not support it: "
                "use fp16 (or auto)"
            )
        return Decision("precision", requested, "set in the recipe")
    if env.device == "cuda":
        kind = "quantized model computes in bf16" if quantized else "params train with bf16 autocast"
        if env.bf16_supported:
            return Decision("precision", "bf16", f"GPU supports bf16; {kind}")
        return Decision("precision", "fp16", "GPU does not support bf16; fp16 autocast with loss scaling")
    return Decision(
        "precision", "fp32", "CPU: fp32 is exact and, for small models, no slower than bf16 autocast"
    )


def decide_parallelism(env: Environment) -> Decision:
    """Never torch.nn.DataParallel: its worker threads lose the autocast context, so bf16 and fp32
    tensors meet in one matmul (`expected mat1 and mat2 to have the same dtype`)."""
    if env.device == "cuda" and env.gpu_count > 1:
        return Decision(
            "parallelism",
            "single device (Trainer n_gpu forced to 1)",
            f"{env.gpu_count} GPUs visible to one process: Trainer would wrap the model in DataParallel",
        )
    where = "one GPU" if env.device == "cuda" else "CPU"
    return Decision("parallelism", "single device", f"{where}, one process")


def apply_parallelism(trainer) -> None:
    """Make Trainer see one GPU so it never builds a DataParallel (transformers 5.x dropped the
    `is_parallelizable`/`model_parallel` flags that used to prevent it)."""
    if trainer.args.n_gpu > 1:
        trainer.args._n_gpu = 1
