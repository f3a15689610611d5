"""The run directory: where a run and its stages live, what marks a stage finished, and run.json.

    runs/<recipe>/<run-name>/
      .lock                 held (flock) by the one process writing the run; holds its pid and host
      run.json              resolved recipe, versions, git sha, hardware, seeds, status, per-stage summary
      stage-<i>-<name>/
        final/              complete model dir (merged weights, config, processor, provenance.json)
        adapter/            the LoRA adapter, when the stage trained one
        checkpoints/        Trainer's working dir (logs, intermediate checkpoints)
        report.json         guard decisions, trainable parameters per role, sources, freeze audit
        metrics.json        losses, throughput, wall time
        DONE                written last: the stage is finished, and each output file's path, size and
                            digest (final/, adapter/, report.json, metrics.json)

A crash never leaves a half-written stage looking finished: final/ and adapter/ are renamed into place when
whole, and DONE is written after everything else; all of it fsynced before the rename that publishes it, so
a power cut cannot either. What changes after DONE (a disk that lied about a flush, a file cut or edited by
hand) no longer matches DONE's record: `--resume` trains such a stage again (finished_stage_problem).

run.json's `status` is `running` while the run trains, `finished` at the end, `failed` (with `error`) or
`interrupted` (Ctrl-C) when the process ended early and could say so; a run killed outright (SIGKILL, power
loss) stays `running`, which `.lock` tells apart from a live run.

The lock is in lock.py, run.json in manifest.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from vlm_recipes.demo.models import resolve_model_source
from vlm_recipes.files import FILE_DIGEST, file_digest, read_json, write_json
from vlm_recipes.recipes.schema import Recipe, Stage

FINAL_DIR = "final"
ADAPTER_DIR = "adapter"
DONE_MARKER = "DONE"
PROVENANCE_FILE = "provenance.json"
RECORDED = (FINAL_DIR, ADAPTER_DIR, "report.json", "metrics.json")  # DONE's record: these, whole

log = logging.getLogger(__name__)


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
    """DONE, with the record `finished_stage_problem` checks: each output file's path (relative to the
    stage directory), size and digest. Reading the files back costs little: they were just written (the
    page cache holds them) and the digest is fast (files.FILE_DIGEST: about 0.4 ms for the tiny model's
    final/, a disk's read speed for a large one)."""
    files = [
        {
            "path": path.relative_to(stage_dir).as_posix(),
            "size": path.stat().st_size,
            "digest": file_digest(path),
        }
        for path in recorded_files(stage_dir)
    ]
    record = {"finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "digest": FILE_DIGEST, "files": files}
    write_json(stage_dir / DONE_MARKER, record)


def recorded_files(stage_dir: Path) -> list[Path]:
    found = []
    for name in RECORDED:
        path = stage_dir / name
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            found.append(path)
    return found


_told_unrecorded = []  # DONE files written before DONE kept a record: said once a process


def finished_stage_problem(stage_dir: Path) -> str | None:
    """Why a stage whose DONE exists no longer holds what it finished with (DONE unreadable, final/ not a
    model directory, a recorded file missing, of another size or another digest); None when it holds it.
    Sizes are compared first, then digests (each file read once)."""
    try:
        record = read_json(stage_dir / DONE_MARKER)
    except (OSError, ValueError) as error:
        return f"DONE cannot be read ({type(error).__name__}: cut short?)"
    if not isinstance(record, dict):
        return "DONE cannot be read (not a record)"
    if problem := model_dir_problem(stage_dir / FINAL_DIR):
        return f"{FINAL_DIR}/ has {problem}"
    if "files" not in record:
        if not _told_unrecorded:
            _told_unrecorded.append(stage_dir)
            log.info(
                "%s was written before DONE recorded its files' sizes and digests: such stages count as done "
                "with their files present, unchecked",
                stage_dir / DONE_MARKER,
            )
        return None
    for entry in record["files"]:
        path = stage_dir / entry["path"]
        if not path.is_file():
            return f"{entry['path']} is missing"
        if (size := path.stat().st_size) != entry["size"]:
            return f"{entry['path']} is {size} bytes, DONE recorded {entry['size']}"
    for entry in record["files"]:
        digest = file_digest(stage_dir / entry["path"], record["digest"])
        if digest is None:  # written where another digest was at hand: the sizes were checked
            log.warning(
                "%s: no %s here to check the files' digests; their sizes match", stage_dir, record["digest"]
            )
            return None
        if digest != entry["digest"]:
            return f"{entry['path']} changed: {record['digest']} {digest}, DONE recorded {entry['digest']}"
    return None


def read_provenance(model_dir: str | Path) -> list[dict]:
    path = Path(model_dir) / PROVENANCE_FILE
    return read_json(path) if path.is_file() else []


@dataclass(frozen=True)
class NodeSettings:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    accelerate_config: str | None = None  # a shipped config name (zero3, in configs/) or a path
    max_restarts: int = 0  # times torchrun's elastic agent restarts a failed group (launch/cluster.py)


@dataclass
class RunOptions:
    output_dir: Path = Path("runs")
    run_name: str | None = None
    resume: bool = False
    until_stage: int | None = None  # the launcher's children train up to this stage
    nproc_per_node: int | None = None
    node: NodeSettings = field(default_factory=NodeSettings)


def run_dir_for(recipe: Recipe, options: RunOptions) -> Path:
    name = options.run_name or time.strftime("%Y%m%d-%H%M%S")
    return options.output_dir / recipe.name / name


def stage_dirs(recipe: Recipe, run_dir: Path) -> list[Path]:
    return [run_dir / stage_dir_name(i, s.name) for i, s in enumerate(recipe.stages, start=1)]


def resolve_source(recipe: Recipe, stage: Stage, index: int, dirs: list[Path]) -> str:
    """Where a stage's weights come from: the base model, an earlier stage's final/, or a model id/dir."""
    init = stage.init_from
    if init == "base" or (init == "previous" and index == 1):
        return resolve_model_source(recipe.model)
    if init == "previous":
        return str(dirs[index - 2] / FINAL_DIR)
    if init.startswith("stage:"):
        names = [s.name for s in recipe.stages]
        return str(dirs[names.index(init.removeprefix("stage:"))] / FINAL_DIR)
    return resolve_model_source(init)


def describe_source(recipe: Recipe, stage: Stage, index: int) -> str:
    """Human form of init_from for plans and summaries."""
    init = stage.init_from
    if init == "base" or (init == "previous" and index == 1):
        return f"base model {recipe.model}"
    if init == "previous":
        return f"stage {index - 1} ({recipe.stages[index - 2].name}) final/"
    if init.startswith("stage:"):
        return f"stage `{init.removeprefix('stage:')}` final/"
    return init


# ---------------------------------------------------------------------------------------------
# One writer per run directory
