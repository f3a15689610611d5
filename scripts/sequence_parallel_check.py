"""One stage split over 2 sequence ranks (gloo, CPU) against one process, per demo model and precision: the
first step's loss and the final weights of what trained, beside the floor (one process with the same global
batch as 2 accumulated micro-batches: summation order only) and how far training moved the weights.

    python scripts/sequence_parallel_check.py --models demo:tiny-qwen2.5-vl demo:tiny-smolvlm --precision fp32 bf16
    python scripts/sequence_parallel_check.py --parallel fsdp training.gradient_checkpointing=true

Prints one Markdown row per model and precision (docs/parallel.md's family table), then the families that
refuse `sequence_parallel_size` with their reasons. The Qwen line trains on 4,135-token video rows
(demo/long_rows.py), the others on the demo's image rows; the stage: tower frozen, projector full, language
model LoRA, 2 steps of 2 rows, lr 1e-3, LoRA dropout off. Each model takes ~2-3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
TRAIN = [sys.executable, str(REPO / "scripts" / "train_recipe.py")]
STAGE = [
    "--recipe",
    "r1-llm-only",
    "quantization.mode=none",
    "train.vision=frozen",
    "train.projector=full",
    "train.llm=lora",
    "data.eval=null",
    "lora.dropout=0",
    "training.learning_rate=1e-3",
    "training.logging_steps=1",
    "evaluation.generate=false",
    "--max-steps",
    "2",
]
RUNS = {
    "one": ["training.per_device_batch_size=2"],
    "floor": ["training.per_device_batch_size=1", "training.gradient_accumulation_steps=2"],
    "split": [
        "training.per_device_batch_size=2",
        *("--parallel", "ddp", "--nproc-per-node", "2", "stages.1.sequence_parallel_size=2"),
    ],
}


def trained(run_dir: Path, start: dict) -> dict:
    weights = load_file(run_dir / "stage-1-llm-lora" / "final" / "model.safetensors")
    return {k: v.float() for k, v in weights.items() if k in start and not v.equal(start[k])}


def apart(one: dict, other: dict) -> float:
    return max((one[k] - other[k]).abs().max().item() for k in one)


def check(model: str, precision: str, root: Path, parallel: str = "ddp", overrides: tuple = ()) -> str:
    from vlm_recipes.demo.long_rows import long_video_rows
    from vlm_recipes.demo.models import DEMO_MODELS, ensure_demo_model

    family = DEMO_MODELS[model].family
    data = ["data.train=demo:train"]
    if family is not None and family.takes_video:
        data = [
            f"data.train={long_video_rows(root / 'data')}",
            "data.max_length=8192",
            "data.video_max_pixels=200704",
        ]
    common = [
        *STAGE,
        f"model={model}",
        f"precision={precision}",
        *data,
        *overrides,
        "--output-dir",
        str(root),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, flags in RUNS.items():
        result = subprocess.run(
            [*TRAIN, *common, "--run-name", name, *flags], capture_output=True, text=True, env=env
        )
        if result.returncode:
            return (
                f"| {model} | {precision} | failed ({name}): {result.stderr.strip().splitlines()[-1][:200]} |"
            )
    start = {k: v.float() for k, v in load_file(ensure_demo_model(model) / "model.safetensors").items()}
    runs = {name: root / "r1-llm-only" / name for name in RUNS}
    weights = {name: trained(path, start) for name, path in runs.items()}
    loss = {
        name: json.loads((path / "stage-1-llm-lora" / "metrics.json").read_text())["loss_curve"][0]["loss"]
        for name, path in runs.items()
    }
    moved = apart(weights["one"], {k: start[k] for k in weights["one"]})
    return (
        f"| {model} | {precision} {parallel} {' '.join(overrides)} | {abs(loss['one'] - loss['split']):.1e} | {apart(weights['one'], weights['split']):.1e}"
        f" | {abs(loss['one'] - loss['floor']):.1e} | {apart(weights['one'], weights['floor']):.1e} | {moved:.1e} |"
    )


def refusals() -> list[str]:
    from vlm_recipes.families import FAMILIES
    from vlm_recipes.families.base import Family

    rows = [f"| {f.name} | {f.sequence_parallel_refusal} |" for f in FAMILIES if f.sequence_parallel_refusal]
    generic = f"| generic (Llama 4, Molmo2, Kimi K2.5, MiniCPM-V, Qwen3-Omni, ...) | {Family.sequence_parallel_refusal} |"
    return ["| family | refused because |", "|---|---|", *rows, generic]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["demo:tiny-qwen2-vl"])
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument(
        "--parallel", default="ddp", choices=["ddp", "fsdp"], help="how the 2 split ranks run"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],
        help="key=value for every run, e.g. training.gradient_checkpointing=true",
    )
    args = parser.parse_args()
    print(
        "| model | precision, split as, overrides | loss, split | weights, split | loss, floor | weights, floor | moved |"
    )
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        for precision in args.precision:
            with tempfile.TemporaryDirectory() as root:
                print(check(model, precision, Path(root), args.parallel, tuple(args.overrides)), flush=True)
    print()
    print("\n".join(refusals()))


if __name__ == "__main__":
    main()
