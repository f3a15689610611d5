"""Stage directories: what a finished stage leaves behind, and how it is written so a crash never
leaves a half-written stage looking finished.

    stage-<i>-<name>/
      final/          complete model dir (merged weights, config, processor, provenance.json)
      adapter/        the LoRA adapter, when the stage trained one
      checkpoints/    Trainer's working dir (logs, intermediate checkpoints)
      report.json     guard decisions, trainable parameters per role, sources
      metrics.json    losses, throughput, wall time
      DONE            written last: the stage is finished
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

FINAL_DIR = "final"
ADAPTER_DIR = "adapter"
DONE_MARKER = "DONE"
PROVENANCE_FILE = "provenance.json"


def stage_dir_name(index: int, name: str) -> str:
    return f"stage-{index}-{name}"


def is_done(stage_dir: Path) -> bool:
    """DONE written, and final/ still a complete model directory (weights, config, processor)."""
    return (stage_dir / DONE_MARKER).is_file() and model_dir_problem(stage_dir / FINAL_DIR) is None


def model_dir_problem(model_dir: Path) -> str | None:
    """What makes a saved model directory unloadable, judged from its files (no weights are read)."""
    if not (model_dir / "config.json").is_file():
        return "no config.json"
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        missing = {f for f in read_json(index)["weight_map"].values() if not (model_dir / f).is_file()}
        if missing:
            return f"missing weight shards: {', '.join(sorted(missing))}"
    elif not (model_dir / "model.safetensors").is_file():
        return "no model.safetensors"
    if not any((model_dir / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")):
        return "no processor"
    return None


def mark_done(stage_dir: Path) -> None:
    write_json(stage_dir / DONE_MARKER, {"finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})


def write_atomically(path: Path, write: Callable[[str], None]) -> None:
    """`write(temporary path)`, then rename onto `path`: a reader never sees half a file, even with several
    processes writing the same path, and a crash leaves no partial entry behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: Path, data: Any) -> None:
    write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2, default=str) + "\n"))


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    write_atomically(path, lambda tmp: save_file(contiguous, tmp))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def read_provenance(model_dir: str | Path) -> list[dict]:
    path = Path(model_dir) / PROVENANCE_FILE
    return read_json(path) if path.is_file() else []


def save_final_model(model: torch.nn.Module, processor, stage_dir: Path, provenance: list[dict]) -> Path:
    """Save a complete model directory that `from_pretrained` loads alone.

    Written to final.partial/ and renamed, so final/ exists only when whole."""
    final = stage_dir / FINAL_DIR
    partial = stage_dir / (FINAL_DIR + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    processor.save_pretrained(partial)
    write_json(partial / PROVENANCE_FILE, provenance)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    return final
