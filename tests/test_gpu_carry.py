"""The GPU machine's carry and visit (benchmarks/gpu_carry/, benchmarks/gpu_check.sh): pins.txt checked
against a pip resolution (the rehearsal's check, not this suite's: pyproject's ranges are open), the wheel
slimming keeps a wheel installable (every member's RECORD line matches its bytes), and the visit ends by its
deadline however long its parts run."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from conftest import REPO

CARRY = REPO / "benchmarks" / "gpu_carry"


def check_pins_module():
    spec = importlib.util.spec_from_file_location("check_pins", CARRY / "check_pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pip_report(versions: dict[str, str]) -> dict:
    """An installation report as `pip install --dry-run --report` writes it (format version 1)."""
    items = [{"metadata": {"name": name, "version": v}, "requested": False} for name, v in versions.items()]
    return {"version": "1", "pip_version": "23.2.1", "install": items, "environment": {}}


PINS_TEXT = """# what the image lacks
transformers==5.24.0
trl==1.16.0
# through the dev extra
liger-kernel==0.8.5
docopt==0.6.2
"""


def test_pins_that_ci_resolves_differently_are_named_and_rewritten_in_place(tmp_path, capsys):
    check_pins = check_pins_module()
    pins_path, report_path = tmp_path / "pins.txt", tmp_path / "report.json"
    pins_path.write_text(PINS_TEXT)
    # a release of transformers; pip writes liger-kernel's name as its metadata does; docopt gone
    resolved = {"transformers": "5.25.0", "trl": "1.16.0", "liger_kernel": "0.8.5", "torch": "2.14.1"}
    report_path.write_text(json.dumps(pip_report(resolved)))

    assert check_pins.main([str(report_path)], pins_path) == 1
    said = capsys.readouterr().out
    assert "transformers==5.24.0: CI resolves 5.25.0" in said
    assert "docopt==0.6.2: CI does not install it" in said
    assert "trl" not in said and "liger" not in said, "a pin CI resolves alike is not reported"
    assert "--write" in said and pins_path.read_text() == PINS_TEXT, "without --write the pins stay"

    assert check_pins.main([str(report_path), "--write"], pins_path) == 1
    assert pins_path.read_text() == PINS_TEXT.replace("transformers==5.24.0", "transformers==5.25.0")
    now = check_pins.resolved_versions(pip_report(resolved))
    assert check_pins.differences(check_pins.read_pins(pins_path.read_text()), now) == [
        "docopt==0.6.2: CI does not install it; remove it from pins.txt"
    ]


def test_pins_equal_to_cis_resolution_pass(tmp_path, capsys):
    check_pins = check_pins_module()
    pins_path, report_path = tmp_path / "pins.txt", tmp_path / "report.json"
    pins_path.write_text(PINS_TEXT)
    resolved = {"Transformers": "5.24.0", "trl": "1.16.0", "liger_kernel": "0.8.5", "docopt": "0.6.2"}
    report_path.write_text(json.dumps(pip_report(resolved)))
    assert check_pins.main([str(report_path)], pins_path) == 0
    assert capsys.readouterr().out == "pins: 4 pins, each what CI resolves\n"


def test_the_carrys_pins_file_reads_as_name_version_pairs():
    """Every line of pins.txt is a comment or NAME==VERSION, as make_carry.sh and check_pins.py read it."""
    pins = check_pins_module().read_pins((CARRY / "pins.txt").read_text())
    assert len(pins) >= 10 and all(name and version for name, version in pins.values())


def record_digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_rewheel_drops_the_libraries_asked_and_rewrites_record_to_match(tmp_path, monkeypatch):
    members = {
        "pkg/__init__.py": b"VERSION = '1'\n",
        "pkg/libpkg_cuda130.so": b"\x7fELF kept" * 100,
        "pkg/libpkg_cuda124.so": b"\x7fELF dropped" * 100,
        "pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n",
        "pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
    }
    source = tmp_path / "in" / "pkg-1.0-py3-none-any.whl"
    source.parent.mkdir()
    with zipfile.ZipFile(source, "w") as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
        record = "".join(f"{name},{record_digest(data)},{len(data)}\n" for name, data in members.items())
        wheel.writestr("pkg-1.0.dist-info/RECORD", record + "pkg-1.0.dist-info/RECORD,,\n")
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(
        sys, "argv", ["rewheel.py", str(source), str(out), "--drop", r"libpkg_cuda12[0-9]\.so$"]
    )
    runpy.run_path(str(CARRY / "rewheel.py"), run_name="__main__")

    with zipfile.ZipFile(out / source.name) as slim:
        names = set(slim.namelist())
        assert "pkg/libpkg_cuda124.so" not in names and "pkg/libpkg_cuda130.so" in names
        lines = slim.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
        listed = {line.split(",")[0]: line.split(",")[1:] for line in lines}
        assert set(listed) == names, "RECORD lists exactly the members kept"
        for name in names - {"pkg-1.0.dist-info/RECORD"}:
            data = slim.read(name)
            assert listed[name] == [record_digest(data), str(len(data))], name
            assert data == members[name]


# Every part but the carry ignores SIGINT and sleeps on, so that each runs to its limit and its kill; the
# 2B-shaped model's build (in the background during the tests) never ends by itself either.
STUBBORN_PARTS = """case $1 in
    carry) echo "carry: 1 MiB" ;;
    build-2b) echo $$ > "$OUT/build-2b.pid"; exec sleep 60 ;;
    *) trap '' INT; exec sleep 60 ;;
esac"""


def test_the_gpu_visit_ends_by_its_deadline_whatever_its_parts_take(tmp_path):
    """gpu_check.sh's schedule at a small scale: parts that run to their limits and kills would take
    (2 + 1) + (5 + 1) + (3 + 1) = 13 s, past the 12 s deadline; instead a part is cut to what the deadline
    leaves, and a part with no time left is skipped."""
    deadline = 12
    scale = {"DEADLINE_S": deadline, "KILL_AFTER_S": 1, "SUMMARY_S": 2, "END_S": 1, "MIN_PART_S": 1}
    own = {"CARRY_S": 2, "VERSIONS_S": 2, "TESTS_S": 5, "BENCH_S": 3}
    env = {**os.environ, **{k: str(v) for k, v in {**scale, **own}.items()}}
    env.update(OUT=str(tmp_path / "out"), PART_STAND_IN=STUBBORN_PARTS)
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=deadline + 30,
    )
    took = time.monotonic() - started
    assert took <= deadline, f"the visit took {took:.1f} s, past its {deadline} s deadline:\n{done.stdout}"
    assert done.returncode == 1, "a visit with parts cut or skipped does not pass"
    parts = [json.loads(line) for line in (tmp_path / "out" / "parts.jsonl").read_text().splitlines()]
    ended = {p["part"]: (p["status"], p["limit_s"]) for p in parts}
    assert ended["carry"] == ("ok", 2) and ended["versions"] == ("cut", 2)
    assert ended["gpu-tests"][0] == "cut" and ended["gpu-tests"][1] < own["TESTS_S"], "cut to the deadline"
    assert ended["bench"][0] == "skipped"
    assert "| bench | skipped:" in (tmp_path / "out" / "summary.md").read_text()
    builder = int((tmp_path / "out" / "build-2b.pid").read_text())
    status = Path(f"/proc/{builder}/status")
    assert not status.exists() or "\nState:\tZ" in status.read_text(), "the background build is stopped"
