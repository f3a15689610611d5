"""What one GPU visit (`benchmarks/gpu_check.sh`) got to, written into its $OUT as `summary.md` and
`gpu-check.json`: each part with its time, its limit and how it ended; the device and the libraries'
versions; `pip check`; every GPU test's outcome; the bench's r1 and r2 stages against plain TRL (samples/s,
GPU memory, MFU against the matmul peak measured in the same call), or the rehearsal's r1 stage on a CPU.

gpu_check.sh rewrites both files after every part, so a visit cut short still says how far it got.
Standard library only, and run by its path (`python3 .../gpu_check_summary.py OUT`): it must work before the
carry is installed, and after a part that broke it.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

PARTS = ("pins", "rehearsal-setup", "carry", "versions", "gpu-tests", "bench", "rehearsal-r1")
STAGE_TITLES = {"llm-lora": "r1 `llm-lora` (QLoRA)", "vision-full": "r2 `vision-full`"}
BASELINE = "plain TRL"


def read_parts(out: Path) -> list[dict]:
    """The parts that ended, in order (parts.jsonl: one line each, written as each ends)."""
    path = out / "parts.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


def read_carry(out: Path) -> str | None:
    """The carry part's `carry: N MiB` line (wheels and tree), and what it installed them as."""
    path = out / "carry.log"
    lines = path.read_text().splitlines() if path.is_file() else []
    said = [line for line in lines if line.startswith(("carry:", "this Python is not 3.12"))]
    return "; ".join(said) or None


def read_pins(out: Path) -> list[str] | None:
    """The rehearsal's pins check (gpu_carry/check_pins.py): its verdict and each pin that differs from what
    CI resolves; None where it did not run."""
    path = out / "pins.log"
    lines = path.read_text().splitlines() if path.is_file() else []
    said = [line.strip() for line in lines if line.startswith(("pins:", "  ", "regenerate:", "written:"))]
    return said or None


def read_versions(out: Path) -> dict:
    path = out / "versions.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def read_pip_check(out: Path) -> list[str] | None:
    """`pip check`'s complaints (empty: clean), or None where it did not run."""
    path = out / "pip-check.txt"
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if not line.startswith("No broken requirements")]


def read_tests(out: Path) -> dict | None:
    """Each GPU test's outcome (passed, failed, error, skipped with its reason) and seconds, from pytest's
    JUnit XML; None where the tests did not get as far as writing it."""
    path = out / "gpu-tests.xml"
    if not path.is_file():
        return None
    tests = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            if (element := case.find(kind)) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                detail = (element.get("message") or "").strip().splitlines()[0:1]
                detail = detail[0][:200] if detail else ""
                break
        name = case.get("name", "")
        tests.append(
            {"test": name, "outcome": outcome, "seconds": float(case.get("time", 0)), "detail": detail}
        )
    counts = {}
    for test in tests:
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    return {"counts": counts, "tests": tests}


def read_bench(out: Path) -> dict | None:
    """Per stage, each way's samples/s, GPU peak, MFU and eval loss, and ours against TRL; from the bench's
    results file, complete or as far as it got (`partial`: the runs so far)."""
    path = out / "bench.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    about = report["about"]
    stages = {}
    if report.get("partial"):
        for stage, scenarios in report["runs"].items():
            for way, runs in scenarios.get("first-epoch", {}).items():
                if runs:
                    stages.setdefault(stage, {})[way] = runs[0]
    else:
        for stage, scenarios in report["stages"].items():
            stages[stage] = dict(scenarios["first-epoch"]["summary"])
    keys = ("samples_per_s", "peak_gpu_allocated_gb", "model_tflops_per_s", "mfu", "eval_loss", "wall_s")
    by_stage = {}
    for stage, ways in stages.items():
        by_stage[stage] = {way: {k: measured.get(k) for k in keys} for way, measured in ways.items()}
        base = ways.get(BASELINE)
        for way, measured in ways.items():
            if base and way != BASELINE and base.get("samples_per_s") and measured.get("samples_per_s"):
                by_stage[stage][way]["samples_per_s_vs_trl"] = (
                    measured["samples_per_s"] / base["samples_per_s"]
                )
    return {
        "complete": not report.get("partial"),
        "command": about["command"],
        "git_sha": about["git_sha"],
        "device": about["machine"]["description"],
        "model": about["model"],
        "rows": about["rows"],
        "batch_size": about["batch_size"],
        "precision": about["precision"],
        "peak_tflops": about.get("peak_tflops"),
        "peak_source": about.get("peak_source"),
        "stages": by_stage,
    }


def read_rehearsal_run(out: Path) -> dict | None:
    """The rehearsal's r1 stage: how it ended, its steps, losses and the decisions that matter on a GPU."""
    runs = sorted((out / "r1").glob("*/*/run.json")) if (out / "r1").is_dir() else []
    if not runs:
        return None
    manifest = json.loads(runs[0].read_text())
    stages = []
    for stage in manifest.get("stages", []):
        report_path = Path(stage["dir"]) / "report.json"
        decisions = {}
        if report_path.is_file():
            report = json.loads(report_path.read_text())
            decisions = {d["guard"]: d["choice"] for d in report.get("decisions", [])}
        stages.append(
            {
                "name": stage.get("name"),
                "steps": stage.get("steps"),
                "train_loss": stage.get("train_loss"),
                "eval_loss": stage.get("eval_loss"),
                "precision": decisions.get("precision"),
                "quantization_backend": decisions.get("quantization-backend"),
            }
        )
    return {"status": manifest.get("status"), "stages": stages}


def summarize(out: Path) -> dict:
    parts = read_parts(out)
    return {
        "parts": parts,
        "got_to": parts[-1]["part"] if parts else None,
        "all_ok": bool(parts) and all(part["status"] == "ok" for part in parts),
        "carry": read_carry(out),
        "pins": read_pins(out),
        "versions": read_versions(out),
        "pip_check": read_pip_check(out),
        "gpu_tests": read_tests(out),
        "bench": read_bench(out),
        "rehearsal_r1": read_rehearsal_run(out),
    }


def number(value, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def render(summary: dict) -> str:
    versions = summary["versions"]
    where = versions.get("device", "device not read yet")
    lines = [f"# GPU check: {where}", ""]
    if versions:
        libraries = ", ".join(f"{name} {v}" for name, v in versions.get("libraries", {}).items())
        lines += [
            f"Python {versions.get('python', '?')}; {libraries}; git {versions.get('git_sha', '?')}",
            "",
        ]
    lines += ["| part | ended | seconds | limit s |", "|---|---|---:|---:|"]
    lines += [
        f"| {p['part']} | {p['status']} (rc {p['rc']}) | {p['seconds']} | {p['limit_s']} |"
        if p["status"] != "skipped"
        else f"| {p['part']} | skipped: {p['limit_s']} s left before the deadline |  |  |"
        for p in summary["parts"]
    ]
    ended = {p["part"] for p in summary["parts"]}
    lines += [
        f"| {name} | not reached |  |  |"
        for name in PARTS
        if name not in ended and name in summary.get("planned", ())
    ]
    if pins := summary.get("pins"):
        lines += ["", pins[0], *([""] + [f"- {line}" for line in pins[1:]] if pins[1:] else [])]
    if summary["carry"]:
        lines += ["", summary["carry"]]
    if (complaints := summary["pip_check"]) is not None:
        lines += ["", "`pip check`: " + ("clean" if not complaints else "; ".join(complaints))]
    if tests := summary["gpu_tests"]:
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(tests["counts"].items()))
        lines += ["", f"## GPU tests: {counts}", "", "| test | outcome | s | detail |", "|---|---|---:|---|"]
        lines += [
            f"| `{t['test']}` | {t['outcome']} | {t['seconds']:.0f} | {t['detail'].replace('|', '/')} |"
            for t in tests["tests"]
        ]
    if bench := summary["bench"]:
        model = bench["model"]
        lines += [
            "",
            f"## Bench: {model['name']} ({model['parameters'] / 1e9:.2f}B parameters), {bench['precision']}, "
            f"{bench['rows']} rows, batch {bench['batch_size']}, first epoch, one run a way"
            + ("" if bench["complete"] else " (cut short: the runs that finished)"),
            "",
            f"{bench['device']}, git {bench['git_sha']}: `{bench['command']}`. MFU over "
            f"{number(bench['peak_tflops'], 0)} TFLOP/s ({bench['peak_source']}).",
            "",
            "| stage | way | samples/s | vs TRL | GPU peak GB | model TFLOP/s | MFU | eval loss |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for stage, ways in bench["stages"].items():
            for way, m in ways.items():
                versus = number(m.get("samples_per_s_vs_trl"), 2, "x") if way != BASELINE else "1"
                mfu = number(m["mfu"] * 100 if m.get("mfu") is not None else None, 1, " %")
                lines.append(
                    f"| {STAGE_TITLES.get(stage, stage)} | {way} | {number(m['samples_per_s'])} | {versus} | "
                    f"{number(m['peak_gpu_allocated_gb'])} | {number(m['model_tflops_per_s'], 1)} | {mfu} | "
                    f"{number(m['eval_loss'], 4)} |"
                )
    if run := summary["rehearsal_r1"]:
        lines += ["", f"## Rehearsal: r1 on the CPU through the carried packages: {run['status']}", ""]
        for stage in run["stages"]:
            lines.append(
                f"- {stage['name']}: {stage['steps']} steps, train loss {number(stage['train_loss'], 4)}, eval "
                f"loss {number(stage['eval_loss'], 4)}; precision {stage['precision']}; 4-bit: "
                f"{stage['quantization_backend']}"
            )
    return "\n".join(lines) + "\n"


def write(out: Path, planned: list[str]) -> dict:
    summary = {**summarize(out), "planned": planned}
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(render(summary))
    return summary


if __name__ == "__main__":
    write(Path(sys.argv[1]), sys.argv[2].split(",") if len(sys.argv) > 2 else [])
