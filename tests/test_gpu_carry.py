"""The GPU machine's carry (benchmarks/gpu_carry/): its pins are the versions CI resolves, and the wheel
slimming keeps a wheel installable (every member's RECORD line matches its bytes)."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import runpy
import sys
import zipfile

from conftest import REPO

CARRY = REPO / "benchmarks" / "gpu_carry"


def pins() -> dict[str, str]:
    lines = (CARRY / "pins.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_the_carrys_pins_are_the_versions_this_environment_resolved():
    pinned, installed = pins(), {}
    for name in pinned:
        try:
            installed[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a pin this environment lacks (CI's has them all: liger-kernel comes with .[dev])
    assert len(installed) >= 10, "the carry holds the project's own dependencies"
    differ = {name: (pinned[name], version) for name, version in installed.items() if pinned[name] != version}
    assert not differ, f"benchmarks/gpu_carry/pins.txt against this environment (pinned, installed): {differ}"


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
