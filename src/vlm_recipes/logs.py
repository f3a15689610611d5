"""Logging for every command: one format, rank 0 narrates, libraries' noise kept down."""

from __future__ import annotations

import logging
import os
import warnings


def is_main_process() -> bool:
    """Rank 0 of a launched group, or the only process (read from the launcher's environment, so it can be
    asked before any process group exists)."""
    return os.environ.get("RANK", "0") == "0"


def setup_logging() -> None:
    # transformers 5.x renamed gradient checkpointing; PEFT and TRL still call the old names.
    warnings.filterwarnings(
        "ignore", message=".*is deprecated and will be removed in v6", category=FutureWarning
    )
    # In a launched group only rank 0 narrates; the other ranks report problems only.
    level = logging.INFO if is_main_process() else logging.WARNING
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # bitsandbytes warns on every CPU import that an optional kernels package is missing; its
    # fallback works (and 4-bit on CPU is only ever the demo), so the warning is only noise.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
