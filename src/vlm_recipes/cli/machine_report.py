"""`vlm-recipes machine [--reprobe] [--threads N]`: what a run finds on this machine, and the bf16 probe asked
again.

It prints the device a stage computes on, the cores a dataset is read with (and what limits them: CPU
affinity, a container's CPU quota), and this CPU's kept answer to "native bf16?" on this process's threads,
with the file that keeps it. `--reprobe` times the probe again and rewrites that file: after a BIOS, kernel,
VM or CPU change, the kept answer no longer describes the machine.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None, prog: str = "vlm-recipes machine") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--reprobe",
        action="store_true",
        help="time the bf16 probe again on this CPU and keep the new answer (what precision: auto reads)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads to probe on (default: torch's, as OMP_NUM_THREADS sets them; each rank of a "
        "CPU group runs on 1); the answer is kept per thread count",
    )
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: give 1 or more")

    import torch

    from vlm_recipes import machine

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if args.reprobe:
        answer, path = machine.reprobe_cpu_bf16()
        kept = "probed again, kept in"
    else:
        answer = machine.cpu_bf16()
        path, kept = machine.remembered_answer_path(answer.instruction_set, threads), "kept in"
    env = machine.detect_environment()
    print(f"device:   {env.describe()}")
    if env.left_unused:
        print(f"          {env.left_unused}")
    print(f"cores:    {machine.usable_cores()} (data read in parallel: one process per core)")
    native = "native" if answer.native else "emulated"
    print(f"CPU bf16: {native} on {threads} thread{'s' if threads != 1 else ''} ({answer.reason})")
    print(f"          {kept} {path}")
    return 0
