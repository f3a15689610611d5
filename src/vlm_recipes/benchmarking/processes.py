"""Each benchmarked way runs as a fresh process: `vlm-recipes bench` and `bench-grpo` start them alike (a plain
TRL script, or a vlm-recipes run of a bench recipe), on fixed torch threads, each run's caches its own, and
measure the whole process (wall time, peak RSS); and they say where they ran (git, processor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_process(command: list[str], env: dict) -> tuple[float, float]:
    """Run a command to its end; its wall seconds and the whole process's peak RSS in GB."""
    with tempfile.TemporaryFile() as output:
        started = time.perf_counter()
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            output.seek(0)
            tail = output.read()[-3000:].decode(errors="replace")
            sys.exit(f"benchmark run failed ({process.returncode}): {' '.join(command)}\n{tail}")
    from vlm_recipes.machine import peak_rss_gb  # torch with it: not on the way to `bench --help`

    return wall, peak_rss_gb(usage.ru_maxrss)


def threads_env(threads: int) -> dict:
    """This process's environment, every run's torch held to `threads` threads."""
    fixed = {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    return {**os.environ, **fixed}


def cache_env(env: dict, caches: Path) -> dict:
    """Every cache a run fills (datasets' Arrow files; ours: token counts and the speed-ups') in `caches`."""
    return {
        **env,
        "HF_DATASETS_CACHE": str(caches / "datasets"),
        "VLM_RECIPES_CACHE": str(caches),
        "VLM_RECIPES_SPEEDUP_CACHE": str(caches),
    }


def run_baseline_script(
    script: Path, flags: dict[str, object], setup: dict, caches: Path
) -> tuple[float, float, dict]:
    """One run of a plain TRL script on the setup's model, data (its first rows) and precision, with `flags`
    (`--name=value` each), its caches in `caches`: its wall seconds, peak RSS in GB and what it measured."""
    flags = {"model": setup["model"], "data": setup["data"], "rows": setup["rows"], **flags}
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        command = [
            sys.executable,
            str(script),
            *(f"--{name}={value}" for name, value in flags.items()),
            f"--out={result.name}",
            *(["--bf16"] if setup["precision"] == "bf16" else []),
        ]
        wall, rss = run_process(command, cache_env(setup["env"], caches))
        return wall, rss, json.loads(Path(result.name).read_text())


def run_recipe(
    recipe: Path, name: str, settings: list[str], setup: dict, caches: Path, options: tuple[str, ...] = ()
) -> tuple[float, float, dict]:
    """One vlm-recipes run (named `name`-<time>) of a one-stage recipe on the setup's model, data (its first
    rows) and precision, with `settings` (key=value) and command-line `options`, its run and caches in
    `caches`: its wall seconds, peak RSS in GB and the stage's metrics.json."""
    out, run_name = caches / "runs", f"{name}-{time.time_ns()}"
    command = [
        *(sys.executable, "-m", "vlm_recipes", "--recipe", str(recipe)),
        *("--output-dir", str(out), "--run-name", run_name),
        *options,
        f"model={setup['model']}",
        f"data.train={setup['data']}",
        f"data.max_train_samples={setup['rows']}",
        f"precision={setup['precision']}",
        *settings,
    ]
    wall, rss = run_process(command, cache_env(setup["env"], caches))
    metrics = json.loads(next(out.glob(f"*/{run_name}/stage-1-*/metrics.json")).read_text())
    return wall, rss, metrics


def git_sha() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True, text=True)
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else "?"


def processor_name() -> str:
    """The device a figure was measured on, by name: the GPU's, or the CPU's model (its instruction set and
    bf16 are in `Environment.describe()`, printed beside it)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    from vlm_recipes.machine import processor_model

    return processor_model()
