"""benchmarks/gpu_check.sh's summary: what a GPU visit got to, read from the files its parts leave in $OUT,
whole or cut short (src/vlm_recipes/benchmarking/gpu_check_summary.py, standard library only)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from vlm_recipes.benchmarking import gpu_check_summary

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "cpu-2-cores-bf16-wide.json"  # a committed bench, both stages
PLANNED = ["carry", "versions", "gpu-tests", "bench"]
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_on_a_gpu" name="test_seed_recipe_trains_on_the_gpu[r1-llm-only]" time="41.2"/>
<testcase classname="tests.test_on_a_gpu" name="test_roles_of_any_dtypes_meet_under_cuda_autocast[gemma3]" time="12.0">
<failure message="AssertionError: ({'vision': 'full'}, ['model.vision_tower.x'])">trace</failure></testcase>
<testcase classname="tests.test_on_a_gpu" name="test_liger_kernels_train_as_torch_layers_do_on_the_gpu[qwen3.5]" time="0.1">
<skipped message="needs liger-kernel installed">skip</skipped></testcase>
</testsuite></testsuites>"""


def visit_cut_in_the_bench(out: Path) -> None:
    """The files a visit leaves when its bench part is cut after plain TRL's r1 run."""
    out.mkdir()
    parts = [("carry", "ok", 0, 12, 45), ("versions", "ok", 0, 8, 45), ("gpu-tests", "failed", 1, 190, 270)]
    lines = [
        json.dumps(dict(zip(("part", "status", "rc", "seconds", "limit_s"), p, strict=True))) for p in parts
    ]
    lines.append(json.dumps({"part": "bench", "status": "cut", "rc": 124, "seconds": 220, "limit_s": 220}))
    (out / "parts.jsonl").write_text("\n".join(lines) + "\n")
    (out / "carry.log").write_text("12 wheels, 54 MiB; the tree 2 MiB\ncarry: 56 MiB\n")
    versions = {
        "device": "NVIDIA H100 80GB HBM3",
        "python": "3.12.3",
        "libraries": {"torch": "2.11.0"},
        "git_sha": "abc1234",
    }
    (out / "versions.json").write_text(json.dumps(versions))
    (out / "pip-check.txt").write_text(
        "datasets 5.2.0 has requirement pyarrow>=24.0.0, but you have pyarrow 21.0.0.\n"
    )
    (out / "gpu-tests.xml").write_text(JUNIT)
    report = json.loads(RESULTS.read_text())
    trl_run = report["stages"]["llm-lora"]["first-epoch"]["runs"]["plain TRL"][0]
    partial = {
        "about": report["about"],
        "partial": True,
        "runs": {"llm-lora": {"first-epoch": {"plain TRL": [trl_run]}}},
    }
    (out / "bench.json").write_text(json.dumps(partial))


def test_a_visit_cut_short_says_how_far_it_got(tmp_path):
    out = tmp_path / "out"
    visit_cut_in_the_bench(out)
    summary = gpu_check_summary.write(out, PLANNED)
    assert summary["got_to"] == "bench" and not summary["all_ok"]
    assert summary["gpu_tests"]["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    failed = next(t for t in summary["gpu_tests"]["tests"] if t["outcome"] == "failed")
    assert failed["detail"].startswith("AssertionError: ({'vision': 'full'}")
    assert summary["pip_check"] == [
        "datasets 5.2.0 has requirement pyarrow>=24.0.0, but you have pyarrow 21.0.0."
    ]
    assert not summary["bench"]["complete"] and list(summary["bench"]["stages"]["llm-lora"]) == ["plain TRL"]
    page = (out / "summary.md").read_text()
    assert page.startswith("# GPU check: NVIDIA H100 80GB HBM3")
    assert "| bench | cut (rc 124) | 220 | 220 |" in page and "carry: 56 MiB" in page
    assert "(cut short: the runs that finished)" in page
    assert json.loads((out / "gpu-check.json").read_text())["got_to"] == "bench"


def test_a_whole_visit_gives_each_stage_against_trl_with_mfu(tmp_path):
    out = tmp_path / "out"
    visit_cut_in_the_bench(out)
    shutil.copy(RESULTS, out / "bench.json")
    report = json.loads(RESULTS.read_text())
    bench = gpu_check_summary.write(out, PLANNED)["bench"]
    assert bench["complete"] and set(bench["stages"]) == {"llm-lora", "vision-full"}
    for stage, ways in bench["stages"].items():
        summary = report["stages"][stage]["first-epoch"]["summary"]
        ours = ways["vlm-recipes, speed-ups on"]
        expected = (
            summary["vlm-recipes, speed-ups on"]["samples_per_s"] / summary["plain TRL"]["samples_per_s"]
        )
        assert (
            ours["samples_per_s_vs_trl"] == expected
            and ours["mfu"] == summary["vlm-recipes, speed-ups on"]["mfu"]
        )
    page = (out / "summary.md").read_text()
    assert f"MFU over {report['about']['peak_tflops']:.0f} TFLOP/s ({report['about']['peak_source']})" in page


def test_the_summary_runs_by_its_path_with_nothing_but_the_standard_library(tmp_path):
    """gpu_check.sh runs it before the carry is installed and after a part that broke the environment."""
    out = tmp_path / "out"
    visit_cut_in_the_bench(out)
    script = Path(gpu_check_summary.__file__)
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(script), str(out), ",".join(PLANNED)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "| bench | cut (rc 124) |" in (out / "summary.md").read_text()


def test_a_rehearsal_whose_pins_differ_from_ci_says_which_and_how_to_regenerate(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    part = {"part": "pins", "status": "failed", "rc": 1, "seconds": 61, "limit_s": 300}
    (out / "parts.jsonl").write_text(json.dumps(part) + "\n")
    (out / "pins.log").write_text(  # check_pins.py's output, pip's warnings before it
        "WARNING: Location 'file:///opt/pypi-more/simple/rich/' is ignored\n"
        "pins: 1 of pins.txt's pins differ from what CI resolves:\n"
        "  transformers==5.24.0: CI resolves 5.25.0\n"
        "regenerate: python3 benchmarks/gpu_carry/check_pins.py REPORT --write, then make_carry.sh\n"
    )
    summary = gpu_check_summary.write(out, ["pins", "rehearsal-setup"])
    assert not summary["all_ok"] and summary["pins"][1] == "transformers==5.24.0: CI resolves 5.25.0"
    page = (out / "summary.md").read_text()
    assert "| pins | failed (rc 1) | 61 | 300 |" in page and "| rehearsal-setup | not reached |" in page
    assert (
        "differ from what CI resolves:\n\n- transformers==5.24.0: CI resolves 5.25.0\n- regenerate:" in page
    )
