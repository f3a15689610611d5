"""What the training process itself is given: the GPUs it sees (`--gpu`) and what SIGTERM does."""

from __future__ import annotations

import contextlib
import os
import signal
import threading


def select_gpus(spec: str) -> None:
    """`--gpu 6,7`: make exactly those GPUs visible, before CUDA starts, and check they exist."""
    from vlm_recipes.errors import GuardError

    ids = [i.strip() for i in spec.split(",") if i.strip()]
    if not ids or not all(i.isdigit() for i in ids):
        raise GuardError(f"--gpu {spec}: give GPU ids separated by commas, e.g. --gpu 0 or --gpu 6,7")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    import torch

    visible = torch.cuda.device_count()  # CUDA drops every id from the first one that does not exist
    if visible == 0:
        raise GuardError(
            f"--gpu {spec}: this machine has no usable CUDA GPU; leave out --gpu to train on the CPU"
        )
    if visible < len(ids):
        raise GuardError(
            f"--gpu {spec}: only {visible} of these GPU ids exist (ids {', '.join(ids[:visible])} work); "
            "`nvidia-smi -L` lists this machine's GPUs"
        )


@contextlib.contextmanager
def sigterm_stops_like_ctrl_c():
    """SIGTERM (a scheduler stopping the job, `kill`, `docker stop`) stops the run as Ctrl-C does: the
    stage in training saves a checkpoint first (methods/callbacks.InterruptCallback), and run.json says
    `interrupted`, instead of the process vanishing with the run still marked `running`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
