"""The benchmark scripts stay runnable; speed is measured by scripts/benchmark.py, never by a test."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.e2e
def test_benchmark_baseline_script_runs(tmp_path, private_demo_cache):
    """The benchmark's plain-TRL baseline stays runnable (its numbers are the benchmark's business)."""
    import json

    from vlm_recipes.data.demo_data import ensure_bench_dataset
    from vlm_recipes.demo import ensure_demo_model

    out = tmp_path / "baseline.json"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "baseline_trl.py"),
            "--stage",
            "vision-full",
            "--model",
            str(ensure_demo_model("demo:bench-qwen2-vl")),
            "--data",
            str(ensure_bench_dataset() / "bench.jsonl"),
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(out.read_text())
    assert (
        measured["steps"] == 2 and measured["step_time_median_s"] > 0 and measured["time_to_first_step_s"] > 0
    )
