"""pins.txt against what CI resolves today: the GPU carry must bring the versions CI tested.

usage: check_pins.py REPORT [--write]
REPORT: `pip install --dry-run --ignore-installed --report REPORT -e '.[dev]'` as .ci/run installs, on a
fresh environment. Prints each pin that differs from CI's resolution; exit 1 when one does. --write puts the
resolved versions into pins.txt (comments and order kept); rebuild .whl/ after it (make_carry.sh).
gpu_check.sh --rehearse runs it, and not the test suite: pyproject's ranges are open, so a release moves
CI's resolution without any change to the tree. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PINS = Path(__file__).with_name("pins.txt")


def normalized(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): `liger_kernel` is `liger-kernel`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(text: str) -> dict[str, tuple[str, str]]:
    """normalized name -> (the name as pins.txt writes it, its version)."""
    pins = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            pins[normalized(name)] = (name, version)
    return pins


def resolved_versions(report: dict) -> dict[str, str]:
    """normalized name -> version, from pip's installation report (`--report`, format version 1)."""
    return {normalized(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


def differences(pins: dict[str, tuple[str, str]], resolved: dict[str, str]) -> list[str]:
    """One line per pin that is not what CI resolves, saying what to do."""
    found = []
    for key, (name, pinned) in pins.items():
        if key not in resolved:
            found.append(f"{name}=={pinned}: CI does not install it; remove it from pins.txt")
        elif resolved[key] != pinned:
            found.append(f"{name}=={pinned}: CI resolves {resolved[key]}")
    return found


def rewrite(text: str, resolved: dict[str, str]) -> str:
    """pins.txt with each pin at its resolved version; comments, order and unresolved pins as they were."""
    lines = []
    for line in text.splitlines():
        name, equals, _ = line.strip().partition("==")
        if equals and not line.startswith("#") and normalized(name) in resolved:
            line = f"{name}=={resolved[normalized(name)]}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str], pins_path: Path = PINS) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        print("usage: check_pins.py REPORT [--write]", file=sys.stderr)
        return 2
    report = json.loads(Path(argv[0]).read_text())
    text = pins_path.read_text()
    resolved = resolved_versions(report)
    found = differences(read_pins(text), resolved)
    if not found:
        print(f"pins: {len(read_pins(text))} pins, each what CI resolves")
        return 0
    print(f"pins: {len(found)} of pins.txt's pins differ from what CI resolves:")
    print("\n".join(f"  {line}" for line in found))
    if "--write" in argv:
        pins_path.write_text(rewrite(text, resolved))
        print(f"written: {pins_path}; rebuild the carry (benchmarks/gpu_carry/make_carry.sh)")
    else:
        print("regenerate: python3 benchmarks/gpu_carry/check_pins.py REPORT --write, then make_carry.sh")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
