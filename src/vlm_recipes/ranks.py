"""This process and its group: accelerate's process state (the one Trainer uses too), and passing values
between ranks. One process when nothing launched it."""

from __future__ import annotations

import os

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object


def process_state() -> PartialState:
    """This process's place in the group torchrun/accelerate launched (one process when not launched).
    Initialises the process group once; gloo on CPU."""
    return PartialState(cpu=not torch.cuda.is_available())


def broadcast_from_main(state: PartialState, value):
    """Rank 0's value, on every rank."""
    if state.num_processes == 1:
        return value
    return broadcast_object_list([value], from_process=0)[0]


def gather_from_ranks(state: PartialState, value) -> list:
    """Every rank's value, in rank order, on every rank."""
    if state.num_processes == 1:
        return [value]
    return gather_object([value])


def launched() -> bool:
    """True inside a process that torchrun or accelerate started (it must not launch again)."""
    return "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def restarts() -> tuple[int, int]:
    """(this group's restart, the most allowed): what torchrun's elastic agent tells the processes it
    restarts after a failure (0, 0 outside one)."""
    return (
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")),
    )
