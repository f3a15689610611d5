#!/usr/bin/env python
"""Activation memory per rank with a row split over 2 sequence ranks, against one process: one training step
of the wide bench model (`demo:bench-qwen2-vl-wide`: Qwen2-VL-2B's widths, 4 decoder layers) on one video row
of ~2k, 8k and 16k tokens, in bf16, the tower frozen, the language model trained.

    python benchmarks/sequence_parallel_memory.py            # writes docs/results/sequence-parallel-memory.md

Activation memory is what the forward keeps for the backward: every tensor autograd saves, counted once per
storage (torch.autograd.graph.saved_tensors_hooks), the weights left out, read on each rank. The split runs the package's own path
(speedups/sequence_parallel.py: the row padded, cut at the language model's door, Ulysses attention) under
torchrun over gloo, one thread per rank; one process runs with 2 threads, so both use the 2 cores. Time: a
whole step (forward and backward, after a warm-up step on the same row) for the rows given to --step-time
(2k by default: on 2 cores a step of 16k takes many minutes), the forward alone for the others.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
MODEL = "demo:bench-qwen2-vl-wide"
FRAMES = {"2k": 16, "8k": 64, "16k": 128}  # 448x448 frames: 256 tokens per pair
OUT = REPO / "docs" / "results" / "sequence-parallel-memory.md"


def batch_of(processor, frames: int) -> dict:
    """One row: a clip of `frames` frames (demo/long_rows.py's square) and a question; every token labelled."""
    import numpy as np

    from vlm_recipes.demo.long_rows import SIDE

    clip = np.zeros((frames, SIDE, SIDE, 3), np.uint8) + 90
    for t in range(frames):
        clip[t, 200:248, 3 * t % 400 : 3 * t % 400 + 48] = 200
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which way?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + "Right."
    inputs = processor(
        text=[text], videos=[clip], do_resize=False, do_sample_frames=False, return_tensors="pt"
    )
    inputs["labels"] = inputs["input_ids"].clone()
    return dict(inputs)


class SavedBytes:
    """Bytes autograd saves for the backward, each storage once, the weights left out (saved too, but held
    anyway)."""

    def __init__(self, model):
        self.storages: dict[int, int] = {}
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.weights:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def load_model():
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl.trainer.utils import add_fused_lm_head

    from vlm_recipes.demo.models import ensure_demo_model

    path = ensure_demo_model(MODEL)
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    model.model.visual.requires_grad_(False)  # frozen tower: it keeps nothing for the backward
    add_fused_lm_head(model)  # as SFTTrainer adds it: log-probabilities in chunks, no full logits
    processor = AutoProcessor.from_pretrained(path)
    return model.train(), processor


def step(model, inputs: dict, shard=None, backward: bool = True) -> tuple[int, float]:
    """One forward (and backward): the bytes saved for the backward, and the seconds."""
    saved = SavedBytes(model)
    started = time.perf_counter()
    if shard is not None:
        inputs = shard.split(inputs)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        outputs = model(**inputs, fused_lm_head=True)
    if backward:
        (-outputs.log_probs.sum()).backward()
    del outputs
    if shard is not None:
        shard.release()
    model.zero_grad(set_to_none=True)
    return saved.total, time.perf_counter() - started


def measure(split: bool, rows: list[str], timed: list[str]) -> dict:
    from torch import distributed as dist

    model, processor = load_model()
    shard = None
    if split:
        from vlm_recipes.families import QWEN2_VL
        from vlm_recipes.speedups.sequence_parallel import sequence_shard_for

        dist.init_process_group("gloo")
        shard = sequence_shard_for(model, QWEN2_VL, processor, 2)
    results = {}
    for name in rows:
        frames = FRAMES[name]
        inputs = batch_of(processor, frames)
        # what the forward saves is complete when it ends; the backward, timed on the rows asked (2 cores take
        # minutes per step at 8k+), follows a warm-up step
        backward = name in timed
        if backward:
            step(model, dict(inputs), shard)
        saved, seconds = step(model, dict(inputs), shard, backward)
        results[name] = {"tokens": inputs["input_ids"].shape[1], "saved_bytes": saved, "seconds": seconds}
        results[name]["timed"] = "step" if backward else "forward"
        print(name, results[name], file=sys.stderr, flush=True)
    if split:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results)
        if dist.get_rank() == 0:
            print(json.dumps(gathered))
        dist.destroy_process_group()
    else:
        print(json.dumps([results]))
    return results


def table(one: dict, ranks: list[dict], machine: str, sha: str) -> str:
    lines = [
        f"One training step of `{MODEL}` (Qwen2-VL-2B's widths, 4 decoder layers), bf16, tower frozen, one "
        f"video row; activation memory: what autograd saves for the backward. {machine}, git {sha}; "
        "`python benchmarks/sequence_parallel_memory.py`.",
        "",
        "| row | tokens | one process: activations | per rank, 2 sequence ranks | ratio | one process: time | "
        "2 ranks: time | timed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in one:
        per_rank = max(rank[name]["saved_bytes"] for rank in ranks)
        alone = one[name]["saved_bytes"]
        seconds = max(rank[name]["seconds"] for rank in ranks)
        lines.append(
            f"| {name} | {one[name]['tokens']:,} | {alone / 2**30:.2f} GB | {per_rank / 2**30:.2f} GB | "
            f"{per_rank / alone:.2f}x | {one[name]['seconds']:.1f} s | {seconds:.1f} s | {one[name]['timed']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", choices=["one", "split"], help="(internal) measure one side in this process"
    )
    parser.add_argument("--rows", nargs="+", default=list(FRAMES), choices=list(FRAMES))
    parser.add_argument(
        "--step-time", nargs="*", default=["2k"], choices=list(FRAMES), help="rows timed by a whole step"
    )
    args = parser.parse_args()
    if args.part:
        torch.set_num_threads(2 if args.part == "one" else 1)
        measure(args.part == "split", args.rows, args.step_time)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [sys.executable, __file__, "--part", "one", "--rows", *args.rows, "--step-time", *args.step_time],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29677",
    ]
    split = subprocess.run(
        [*torchrun, __file__, "--part", "split", "--rows", *args.rows, "--step-time", *args.step_time],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    ranks = json.loads(split.stdout.strip().splitlines()[-1])
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout
    from data_scale import machine  # benchmarks/: the CPU's model, its cores, native bf16 or not

    text = table(json.loads(one.stdout.strip().splitlines()[-1])[0], ranks, machine(), sha.strip())
    OUT.write_text("# Sequence parallelism: activation memory per rank\n\n" + text)
    print(text)


if __name__ == "__main__":
    main()
