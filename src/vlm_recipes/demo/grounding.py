"""The demo's grounding rows: "Where is the shape?" over one shape on white, answered with its box.

- `demo:grounding-train` / `demo:grounding-eval`: prompt rows (method grpo, rloo). The `solution` is the box
  in pixels of the image, `[x1, y1, x2, y2]`, as grounding datasets give it; the `iou` reward reads each
  model's answer in its family's frame (methods/grounding.py).
- `demo:grounding-sft-train` / `demo:grounding-sft-eval`: rows of the same kind as SFT messages, answered in
  the demo model's frame: Qwen2-VL's, `(x1,y1),(x2,y2)` from 0 to 1000 across the image. They teach the
  default model to answer with a box before a GRPO stage rewards where it puts it (r7-grounding-grpo); for
  a family writing boxes another way, write its answers in its own frame.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

from vlm_recipes.demo.samples import COLOURS, SHAPES, draw_shape
from vlm_recipes.files import build_dir_atomically, cache_dir

PREFIX, SFT_PREFIX = "grounding-", "grounding-sft-"
QUESTION = "Where is the shape? Answer with its box."
ROWS = {"train": 128, "eval": 32}
SEEDS = {"train": 2468, "eval": 1357}  # the SFT rows are drawn with seed + 1: other images than the prompts'
FILES = ("train.jsonl", "eval.jsonl", "sft-train.jsonl", "sft-eval.jsonl")


def grounding_sample(rng: random.Random) -> tuple[Image.Image, tuple[int, int, int, int]]:
    """One shape of a random colour, kind and size on a white image of random size, and its box in pixels."""
    w, h = rng.randint(56, 112), rng.randint(56, 112)
    image = Image.new("RGB", (w, h), (255, 255, 255))
    size = rng.randint(16, min(w, h) - 8)
    x0, y0 = rng.randint(4, w - 4 - size), rng.randint(4, h - 4 - size)
    box = (x0, y0, x0 + size, y0 + size)
    draw_shape(ImageDraw.Draw(image), rng.choice(SHAPES), box, COLOURS[rng.choice(list(COLOURS))])
    return image, box


def relative_1000(box: tuple[int, int, int, int], size: tuple[int, int]) -> str:
    """The box as Qwen2-VL writes it: `(x1,y1),(x2,y2)`, 0-1000 across the image."""
    (x1, y1, x2, y2), (w, h) = box, size
    return f"({round(x1 * 1000 / w)},{round(y1 * 1000 / h)}),({round(x2 * 1000 / w)},{round(y2 * 1000 / h)})"


def ensure_grounding_dataset(version: str) -> Path:
    """The rows' directory under the demo data's `version` (demo/dataset.py's VERSION); built once."""
    return build_dir_atomically(
        cache_dir() / version / "grounding-data", FILES, _build, "demo grounding rows"
    )


def resolve_grounding_source(split: str, version: str) -> str | None:
    """The JSONL file of a `demo:grounding-…` split (split without `demo:`); None for any other split."""
    for prefix, stem in ((SFT_PREFIX, "sft-"), (PREFIX, "")):
        if split.startswith(prefix) and split.removeprefix(prefix) in ROWS:
            return str(ensure_grounding_dataset(version) / f"{stem}{split.removeprefix(prefix)}.jsonl")
    return None


def _build(out: Path) -> None:
    (out / "images").mkdir()
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    for split, rows in ROWS.items():
        for stem, seed in (("", SEEDS[split]), ("sft-", SEEDS[split] + 1)):
            rng = random.Random(seed)
            with open(out / f"{stem}{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
                for i in range(rows):
                    image, box = grounding_sample(rng)
                    name = f"images/{stem}{split}-{i:04d}.png"
                    image.save(out / name, format="PNG")
                    row = {"id": f"grounding-{stem}{split}-{i:04d}", "task": "grounding", "images": [name]}
                    if stem:
                        answer = {
                            "role": "assistant",
                            "content": [{"type": "text", "text": relative_1000(box, image.size)}],
                        }
                        row["messages"] = [*question, answer]
                    else:
                        row |= {"prompt": question, "solution": json.dumps(list(box))}
                    f.write(json.dumps(row) + "\n")
