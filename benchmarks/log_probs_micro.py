#!/usr/bin/env python
"""The log-probability pass's LM head, TRL's fused head against vlm-recipes' CPU path (`grpo.cpu_log_probs`),
forward + backward, in one process.

    python benchmarks/log_probs_micro.py [--threads 2] [--repeats 5]

The shapes of a GRPO step on the wide bench model at r6's settings (8 completions of 128 tokens after a
~42-token prompt: 1,352 positions scored, 1,024 of them completion tokens the loss reads; hidden 1536; a
21,760-entry vocabulary), in bf16, temperature 0.9, log-probabilities and entropies as GRPOTrainer asks.
Prints seconds per pass (median of the repeats) and the ratio TRL / ours, ours over every position and over
the labelled ones only (what TRL's fused head hands it on a CPU with the speed-up on).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

from vlm_recipes.speedups.log_probs import OUTPUTS, CpuLogProbs

POSITIONS, COMPLETION_TOKENS, HIDDEN, VOCABULARY = 1352, 1024, 1536, 21760


def one_pass(function, hidden, weight, targets, grad_out) -> None:
    hidden = hidden.clone().requires_grad_(True)
    log_probs, *_ = function.apply(hidden, weight, None, targets, 0.9, 32768, None, 1.0, OUTPUTS)
    (log_probs * grad_out).sum().backward()


def seconds(function, inputs, repeats: int) -> float:
    one_pass(function, *inputs)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass(function, *inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(POSITIONS, HIDDEN, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(VOCABULARY, HIDDEN, generator=generator) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, VOCABULARY, (POSITIONS,), generator=generator)
    grad_out = torch.zeros(POSITIONS)
    grad_out[-COMPLETION_TOKENS:] = torch.randn(
        COMPLETION_TOKENS, generator=generator
    )  # the prompt's: masked
    labelled = slice(POSITIONS - COMPLETION_TOKENS, POSITIONS)  # what TRL's fused head hands ours on a CPU
    trl = seconds(ChunkedLogProbFunction, (hidden, weight, targets, grad_out), args.repeats)
    same_rows = seconds(CpuLogProbs, (hidden, weight, targets, grad_out), args.repeats)
    ours = seconds(
        CpuLogProbs, (hidden[labelled], weight, targets[labelled], grad_out[labelled]), args.repeats
    )
    print(
        f"{POSITIONS} positions ({COMPLETION_TOKENS} labelled) x {VOCABULARY} entries x {HIDDEN} wide, bf16, {args.threads} threads"
    )
    print(f"TRL's fused head over every position: {trl:.3f} s a pass (forward + backward)")
    print(
        f"ours over every position: {same_rows:.3f} s ({trl / same_rows:.2f}x); over the labelled: {ours:.3f} s ({trl / ours:.2f}x)"
    )


if __name__ == "__main__":
    main()
