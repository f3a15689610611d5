#!/usr/bin/env python
"""LoRA dropout, torch's against vlm-recipes' sparse one, forward + backward, in one process.

    python benchmarks/dropout_micro.py [--threads 2] [--device cpu]

Inputs are the shapes a LoRA dropout sees on the bench model (a packed row of ~1500 tokens; hidden 512,
MLP 1376) and on Qwen2-VL-2B (hidden 1536, MLP 8960), in bf16. Prints milliseconds per call and the
ratio torch / sparse, for several dropout probabilities.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlm_recipes.speedups.sparse_dropout import SparseDropout

SHAPES = {
    "bench hidden": (1500, 512),
    "bench MLP": (1500, 1376),
    "2B hidden": (4096, 1536),
    "2B MLP": (4096, 8960),
}


def per_call_ms(dropout: torch.nn.Module, x: torch.Tensor, repeats: int) -> float:
    def once() -> None:
        dropout(x).sum().backward()

    once()
    times = []
    for _ in range(repeats):
        if x.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        once()
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{args.device}, {args.threads} threads, bf16, forward + backward, median of {args.repeats}")
    print(f"{'input':<14} {'p':>5} {'torch ms':>9} {'sparse ms':>10} {'torch/sparse':>13}")
    for name, shape in SHAPES.items():
        x = torch.randn(*shape, dtype=torch.bfloat16, device=args.device, requires_grad=True)
        for p in (0.05, 0.1, 0.3):
            dense = per_call_ms(torch.nn.Dropout(p).train(), x, args.repeats)
            sparse = per_call_ms(SparseDropout(p).train(), x, args.repeats)
            print(f"{name:<14} {p:>5} {dense:>9.3f} {sparse:>10.3f} {dense / sparse:>13.2f}")


if __name__ == "__main__":
    main()
