"""How the start of a stage scales with its dataset's rows: `vlm-recipes data check` (rows read and checked,
each image's header read, every row's tokens counted) and a one-step r1 run on N synthetic rows, each with an
image of its own (a JPEG 64-448 px a side), with the tokens counted in one process and in parallel (one per
core), and the run again with `data.streaming: true` (nothing counted up front). Prints a table and writes it
as JSON, naming the machine and the git sha; each measurement's peak resident memory beside its time.

    python benchmarks/data_scale.py --rows 20000 200000 --out benchmarks/results/data-scale.json

The rows are generated once per N under --work (reused on a second call). Each measurement runs in a process
of its own, with a token-count cache of its own (nothing remembered from an earlier one), on the demo model
(tiny-qwen2-vl, its directory passed as `model=`: nothing is built). Every measurement starts with the rows'
files just read once (`warm`): the first measurement of a size would otherwise read the images cold from disk
and the later ones from the page cache, and the ratio would measure the order, not the counting."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import psutil
from PIL import Image, ImageDraw

from vlm_recipes.machine import usable_cores

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]
ONE_PROCESS = "import vlm_recipes.data.parallel as parallel; parallel.MIN_ROWS_PER_PROCESS = 10**12; "


def make_row(i: int, root: Path) -> dict:
    rng = random.Random(i)
    width, height = rng.randint(64, 448), rng.randint(64, 448)
    colour = rng.choice(COLOURS)
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).rectangle([width // 4, height // 4, width * 3 // 4, height * 3 // 4], fill=colour)
    path = root / "images" / f"{i // 1000:04d}" / f"{i:07d}.jpg"
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, quality=85)
    question = {"type": "text", "text": "What colour is the shape?"}
    return {
        "id": str(i),
        "messages": [
            {"role": "user", "content": [{"type": "image"}, question]},
            {"role": "assistant", "content": [{"type": "text", "text": colour}]},
        ],
        "images": [str(path.relative_to(root))],
    }


def dataset(rows: int, work: Path) -> Path:
    """N rows with their images under work/rows-N/, made once (in parallel, one process per core)."""
    root = work / f"rows-{rows}"
    path = root / "train.jsonl"
    if path.is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with Pool(usable_cores().count) as pool:
        made = pool.starmap(make_row, ((i, root) for i in range(rows)), chunksize=500)
    path.with_suffix(".tmp").write_text("".join(json.dumps(row) + "\n" for row in made))
    path.with_suffix(".tmp").rename(path)
    return path


def warm(root: Path) -> float:
    """Read every file under `root` once (the rows and their images), so the measurement that follows finds
    them in the page cache, as every other measurement does. Returns the seconds it took."""
    started = time.perf_counter()
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as file:
                while file.read(1 << 20):
                    pass
    return time.perf_counter() - started


def timed(command: list[str], cache: Path) -> tuple[float, float, float, str]:
    """(seconds, peak resident GB, peak anonymous GB, output) of a command in a process of its own, on a cache
    of its own. Resident memory counts the pages of memory-mapped files (the rows' Arrow tables), which the
    system drops when it needs the room; anonymous memory is what it cannot. Both are the largest process's
    (resident: /usr/bin/time's exact peak; anonymous: /proc's RssAnon, read every 0.1 s)."""
    env = {**os.environ, "VLM_RECIPES_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            ["/usr/bin/time", "-v", *command], stdout=out, stderr=err, text=True, env=env
        )
        anonymous = 0
        while process.poll() is None:
            anonymous = max(
                [anonymous, *(anonymous_kb(child) for child in psutil.Process(process.pid).children(True))]
            )
            time.sleep(0.1)
        seconds = time.perf_counter() - started
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode != 0:
        raise SystemExit(f"failed ({process.returncode}): {' '.join(command)}\n{stderr[-3000:]}")
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr).group(1))
    return seconds, peak_kb / 2**20, anonymous / 2**20, stdout + stderr


def anonymous_kb(process: psutil.Process) -> int:
    try:
        status = Path(f"/proc/{process.pid}/status").read_text()
    except OSError:  # gone
        return 0
    found = re.search(r"RssAnon:\s+(\d+) kB", status)
    return int(found.group(1)) if found else 0


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = re.search(r"model name\s*:\s*(.*)", info).group(1)
    native = "AMX" if "amx_bf16" in info else "AVX512-BF16" if "avx512_bf16" in info else "no native bf16"
    return f"{model}, {usable_cores().count} cores, {native}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[20000])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "vlm-recipes-data-scale")
    parser.add_argument(
        "--model", default=str(Path.home() / ".cache/vlm-recipes/demo-v5/tiny-qwen2-vl-pretrained")
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    results = []
    for rows in args.rows:
        made = time.perf_counter()
        path = dataset(rows, args.work)
        print(f"{rows} rows at {path} ({time.perf_counter() - made:.0f} s to make or find)", flush=True)
        check = ["data", "check", str(path), f"model={args.model}", "data.eval=null", "data.max_length=4096"]
        train = [
            "train",
            "--recipe",
            "r1-llm-only",
            "--max-steps",
            "1",
            "--output-dir",
            str(args.work / "runs"),
        ]
        train += [f"model={args.model}", f"data.train={path}", "data.eval=null", "quantization.mode=none"]
        streamed = [*train, "data.streaming=true"]  # nothing counted up front: rows checked as trained on
        for processes, prefix, runs in (
            ("one", ONE_PROCESS, (("data check", check), ("1-step r1 run", train))),
            ("parallel", "", (("data check", check), ("1-step r1 run", train))),
            ("streamed", "", (("1-step r1 run", streamed),)),
        ):
            for what, cli in runs:
                entry = f"{prefix}from vlm_recipes.cli import main; import sys; sys.exit(main(sys.argv[1:]))"
                warm(path.parent)
                with tempfile.TemporaryDirectory() as cache:
                    seconds, peak, anonymous, _ = timed([sys.executable, "-c", entry, *cli], Path(cache))
                results.append(
                    {
                        "rows": rows,
                        "what": what,
                        "counting": processes,
                        "s": seconds,
                        "peak_gb": peak,
                        "peak_anonymous_gb": anonymous,
                    }
                )
                print(
                    f"  {what:<14} counting {processes:<9} {seconds:7.1f} s  {peak:5.2f} GB resident, "
                    f"{anonymous:5.2f} GB anonymous",
                    flush=True,
                )
    table = {"machine": machine(), "git": sha, "results": results}
    print(json.dumps(table, indent=1))
    if args.out:
        args.out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
