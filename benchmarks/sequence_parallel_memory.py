#!/usr/bin/env python
"""Activation memory per rank with a row split over 2 sequence ranks, against one process: one whole training
step (forward, backward, AdamW) of the wide bench model (`demo:bench-qwen2-vl-wide`: Qwen2-VL-2B's widths, 4
decoder layers) on one video row of ~2k, 8k and 16k tokens, in bf16, the tower frozen, the language model
trained.

    python benchmarks/sequence_parallel_memory.py            # writes docs/results/sequence-parallel-memory.md

Activation memory is the step's peak resident memory (VmHWM, reset through /proc/self/clear_refs) minus the
resident memory just before it, when the process holds the weights, the gradients (zeroed, kept allocated)
and AdamW's state: a warm-up step on the 2k row creates that state first. Beside it, what autograd saves for
the backward (each storage once, the weights left out): the peak's floor, the rest being transient work.

The split runs the package's own path (speedups/sequence_parallel.py: the row padded, cut at the language
model's door, Ulysses attention) under torchrun over gloo, one thread per rank, its gradients summed over the
group before AdamW as DDP would; one process runs with 2 threads, so both use the 2 cores. Both sides run the
same rows and the same step, and time it (the measured step, not the warm-up).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
MODEL = "demo:bench-qwen2-vl-wide"
FRAMES = {"2k": 16, "8k": 64, "16k": 128}  # 448x448 frames: 256 tokens per pair
WARM_UP = (
    "2k"  # the row of the step that creates AdamW's state and warms the kernels, before any measured one
)
PHASES = ("tower", "language model", "backward", "optimizer")
OUT = REPO / "docs" / "results" / "sequence-parallel-memory.md"
GIB = 2**30
# glibc serves blocks of 64 KiB and more by mmap and unmaps them on free, and trims its heap's top past 128
# KiB: a freed activation goes back to the system at once, so resident memory tracks live memory and the peak
# is the step's, not what the allocator kept from an earlier one. Set before the measured processes start.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


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


def resident(keys: tuple[str, ...] = ("VmRSS", "VmHWM")) -> tuple[int, ...]:
    """These lines of /proc/self/status (resident memory now and its peak, by default), in bytes."""
    status = Path("/proc/self/status").read_text()
    return tuple(int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) * 1024 for key in keys)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to VmRSS (Linux 4.0+)


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


class Phases:
    """Each phase's peak resident memory over the step's baseline, and its seconds: the peak is reset at each
    phase's end, so the step's peak is the largest."""

    def __init__(self):
        self.baseline, self.file = resident(("VmRSS", "RssFile"))
        reset_peak()
        self.peaks: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()

    def end(self, phase: str) -> None:
        self.peaks[phase] = resident()[1] - self.baseline
        now = time.perf_counter()
        self.seconds[phase] = now - self.started
        self.started = now
        reset_peak()


def load_model():
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl.trainer.utils import add_fused_lm_head

    from vlm_recipes.demo.models import ensure_demo_model

    path = ensure_demo_model(MODEL)
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    # the weights copied out of the mapped checkpoint into memory of their own: mapped file pages are resident
    # only once read, and the system may drop them mid-step when memory runs short, either way moving the peak
    for parameter in model.parameters():
        parameter.data = parameter.data.clone()
    model.model.visual.requires_grad_(False)  # frozen tower: it keeps nothing for the backward
    add_fused_lm_head(model)  # as SFTTrainer adds it: log-probabilities in chunks, no full logits
    processor = AutoProcessor.from_pretrained(path)
    return model.train(), processor


def train_step(model, optimizer, inputs: dict, language_model, shard=None) -> dict:
    """One training step: (on a sequence group: the row split,) forward, backward, (the gradients summed over
    the group,) AdamW's step. Its peak over the resident memory before it, by phase; what autograd saved; and
    its seconds."""
    from torch import distributed as dist

    gc.collect()
    if shard is not None:
        dist.barrier()  # both ranks start together: the step's time is the group's
    saved = SavedBytes(model)
    phases = Phases()
    # the tower's phase: the row split, the tower, its features merged, the positions; it ends at the language
    # model's door
    door = language_model.register_forward_pre_hook(lambda module, args: phases.end("tower"))
    if shard is not None:
        inputs = shard.split(inputs)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        outputs = model(**inputs, fused_lm_head=True)
    door.remove()
    phases.end("language model")
    (-outputs.log_probs.sum()).backward()
    del outputs
    phases.end("backward")
    if shard is not None:
        shard.release()
        for p in model.parameters():  # what DDP does over every rank: each rank's gradients are its piece's
            if p.grad is not None:
                dist.all_reduce(p.grad)
    optimizer.step()
    optimizer.zero_grad(
        set_to_none=False
    )  # the gradients stay allocated: the next step's baseline holds them
    phases.end("optimizer")
    after, file = resident(("VmRSS", "RssFile"))
    return {
        "baseline_bytes": phases.baseline,
        "peak_bytes": max(phases.peaks.values()),
        "phase_peak_bytes": phases.peaks,
        "saved_bytes": saved.total,
        "left_bytes": after - phases.baseline,  # ~0: the step kept nothing
        # pages of files (the libraries' code) the system took back during the step, when memory ran short:
        # the peak can be that much too low
        "file_dropped_bytes": max(0, phases.file - file),
        "seconds": sum(phases.seconds.values()),
        "phase_seconds": phases.seconds,
    }


def head_alone(model, scored: int) -> dict:
    """The LM head's chunked log-probabilities (TRL's kernel, as the fused head calls it on a CPU: every
    position scored) forward and backward alone, on `scored` random hidden states: its peak over the resident
    memory before it, and its seconds. The part of the step's peak that the row's split does not halve."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    weight = model.get_output_embeddings().weight
    hidden = torch.randn(scored, weight.shape[1], dtype=weight.dtype, requires_grad=True)
    targets = torch.randint(0, weight.shape[0], (scored,))
    gc.collect()
    baseline, _ = resident()
    reset_peak()
    started = time.perf_counter()
    log_probs = ChunkedLogProbFunction.apply(
        hidden, weight, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs",)
    )[0]
    (-log_probs.sum()).backward()
    seconds = time.perf_counter() - started
    peak = resident()[1] - baseline
    model.zero_grad(set_to_none=False)
    return {"peak_bytes": peak, "seconds": seconds}


def measure(split: bool, rows: list[str]) -> dict:
    from torch import distributed as dist
    from trl.kernels import chunked_logprob

    from vlm_recipes.families import QWEN2_VL
    from vlm_recipes.speedups.sequence_parallel import language_model_of, padded_length

    started, load = time.perf_counter(), os.getloadavg()[0]
    model, processor = load_model()
    shard = None
    if split:
        from vlm_recipes.speedups.sequence_parallel import sequence_shard_for

        dist.init_process_group("gloo")
        shard = sequence_shard_for(model, QWEN2_VL, processor, 2)
    language_model = language_model_of(model, QWEN2_VL)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    warm_up = train_step(model, optimizer, batch_of(processor, FRAMES[WARM_UP]), language_model, shard)
    print("warm-up", WARM_UP, warm_up, file=sys.stderr, flush=True)
    results = {}
    for name in rows:
        inputs = batch_of(processor, FRAMES[name])
        results[name] = {"tokens": inputs["input_ids"].shape[1]}
        results[name] |= train_step(model, optimizer, inputs, language_model, shard)
        del inputs
        tokens = results[name]["tokens"]  # the head scores a rank's piece, or one process's row but its last
        scored = padded_length(tokens, shard.groups.size) // shard.groups.size if split else tokens - 1
        tile = chunked_logprob.TOKEN_CHUNK_SIZE
        if split:  # the head's tile as the shard sets it while a row is split (speedups/sequence_parallel.py)
            chunked_logprob.TOKEN_CHUNK_SIZE = tile // shard.groups.size
        try:
            results[name]["head"] = {"scored": scored} | head_alone(model, scored)
        finally:
            chunked_logprob.TOKEN_CHUNK_SIZE = tile
        print(name, results[name], file=sys.stderr, flush=True)
    wall = time.perf_counter() - started
    side = {"rows": results, "load_average": [load, os.getloadavg()[0]], "wall_seconds": wall}
    if split:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, side)
        if dist.get_rank() == 0:
            print(json.dumps(gathered))
        dist.destroy_process_group()
    else:
        print(json.dumps([side]))
    return results


def tables(one: dict, ranks: list[dict], machine: str, sha: str, command: str) -> str:
    """The results page: activation memory and step time on both sides, then each phase's peak."""
    alone, split = one["rows"], [rank["rows"] for rank in ranks]

    def per_rank(name: str, key: str) -> float:
        return max(rank[name][key] for rank in split)

    def gb(n: float) -> str:
        return f"{n / GIB:.2f}"

    row_names = list(alone)
    baseline = f"{gb(alone[row_names[0]]['baseline_bytes'])} GiB in one process, {gb(max(r[row_names[0]]['baseline_bytes'] for r in split))} GiB per rank"
    lines = [
        "# Sequence parallelism: activation memory per rank",
        "",
        f"One training step (forward, backward, AdamW) of `{MODEL}` (Qwen2-VL-2B's widths, 4 decoder layers), "
        f"bf16, tower frozen, the language model trained, one video row; one process with 2 threads against 2 "
        f"sequence ranks (torchrun, gloo, 1 thread each). {machine}, git {sha}; `{command}`.",
        "",
        "Activations: the step's peak resident memory minus the resident memory just before it. That baseline "
        f"holds the weights, the gradients (zeroed, kept allocated) and AdamW's state ({baseline} at 2k). "
        "Saved: what autograd keeps for the backward, the peak's floor. Per rank: the larger of the 2 ranks. "
        "A step on 2 ranks includes the gradients' sum over them (gloo all-reduce).",
        "",
        "| row | tokens | one process: activations (saved) | per rank: activations (saved) | ratio | "
        "one process: step | 2 ranks: step | time ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in row_names:
        peak, seconds = per_rank(name, "peak_bytes"), per_rank(name, "seconds")
        lines.append(
            f"| {name} | {alone[name]['tokens']:,} | {gb(alone[name]['peak_bytes'])} GiB "
            f"({gb(alone[name]['saved_bytes'])}) | {gb(peak)} GiB ({gb(per_rank(name, 'saved_bytes'))}) | "
            f"{peak / alone[name]['peak_bytes']:.2f}x | {alone[name]['seconds']:.1f} s | {seconds:.1f} s | "
            f"{seconds / alone[name]['seconds']:.2f}x |"
        )
    lines += [
        "",
        "Where the peak is: each phase's peak over the baseline and its seconds; per rank, the larger of the 2. "
        "Tower: the row split, the tower, its features merged and the positions, up to the language model's "
        "door. Language model: its forward and the LM head's log-probabilities. Optimizer: the gradients' sum "
        "and AdamW. LM head alone: its forward and backward on as many random hidden states as the side scores.",
        "",
        "| row | side | " + " | ".join(PHASES) + " | LM head alone |",
        "|---|---|" + "---|" * (len(PHASES) + 1),
    ]
    for name in row_names:
        for side, sides in (("one process", [alone]), ("per rank", split)):
            cells = [
                f"{gb(max(r[name]['phase_peak_bytes'][p] for r in sides))} GiB, "
                f"{max(r[name]['phase_seconds'][p] for r in sides):.0f} s"
                for p in PHASES
            ]
            head = max((rows[name]["head"] for rows in sides), key=lambda h: h["peak_bytes"])
            cells.append(f"{gb(head['peak_bytes'])} GiB, {head['seconds']:.0f} s ({head['scored']:,} tokens)")
            lines.append(f"| {name} | {side} | " + " | ".join(cells) + " |")
    wall = max(rank["wall_seconds"] for rank in ranks)
    dropped = max(row["file_dropped_bytes"] for side in [alone, *split] for row in side.values())
    lines += [
        "",
        "File pages (the libraries' code) the system took back during a measured step, when memory ran short: "
        f"at most {dropped / 2**20:.0f} MiB. A peak can be that much too low.",
        "",
        f"Wall time with the load and the warm-up: {one['wall_seconds'] / 60:.1f} min in one process, "
        f"{wall / 60:.1f} min on 2 ranks. The machine is shared: the load average (1 min) went from "
        f"{one['load_average'][0]:.1f} to {one['load_average'][1]:.1f} over the one process's run, from "
        f"{ranks[0]['load_average'][0]:.1f} to {ranks[0]['load_average'][1]:.1f} over the 2 ranks' (each side "
        "alone adds 2).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", choices=["one", "split"], help="(internal) measure one side in this process"
    )
    parser.add_argument("--rows", nargs="+", default=list(FRAMES), choices=list(FRAMES))
    args = parser.parse_args()
    if args.part:
        torch.set_num_threads(2 if args.part == "one" else 1)
        measure(args.part == "split", args.rows)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", **MALLOC}
    one = subprocess.run(
        [sys.executable, __file__, "--part", "one", "--rows", *args.rows],
        stdout=subprocess.PIPE,
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
        [*torchrun, __file__, "--part", "split", "--rows", *args.rows],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        env=env,
    )
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    from data_scale import machine  # benchmarks/: the CPU's model, its cores, native bf16 or not

    command = " ".join(["python benchmarks/sequence_parallel_memory.py", *sys.argv[1:]])
    text = tables(
        json.loads(one.stdout.strip().splitlines()[-1])[0],
        json.loads(split.stdout.strip().splitlines()[-1]),
        machine(),
        sha,
        command,
    )
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
