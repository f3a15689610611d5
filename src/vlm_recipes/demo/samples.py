"""One synthetic demo sample at a time: the images (shapes, a nutrition label, a pair of shapes, a
description grid) or the clip (a moving dot) and its question and answer, each readable off the pixels.
demo/dataset.py assembles them into the demo datasets."""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 60, 180),
    "orange": (240, 130, 30),
}
# JSON key -> label line on the image; the dict order is the answer's key order.
NUTRITION_LINES = {
    "calories": "Calories {}",
    "fat_g": "Fat {}g",
    "carbs_g": "Carbs {}g",
    "protein_g": "Protein {}g",
    "sugar_g": "Sugar {}g",
    "sodium_mg": "Sodium {}mg",
}
NUTRITION_QUESTION = "Extract the nutrition facts as JSON."


def draw_shape(draw: ImageDraw.ImageDraw, kind: str, box: tuple[int, int, int, int], fill: tuple) -> None:
    x0, y0, x1, y1 = box
    if kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def shapes_sample(rng: random.Random) -> tuple[Image.Image, str, str]:
    """One shapes image asked its colour, count or a place, whose answer can only be read off the pixels: the
    benchmark's rows (demo:bench). The demo's fine-tuning rows ask shape_question_sample's questions."""
    w, h = rng.randint(56, 112), rng.randint(56, 112)
    img = Image.new("RGB", (w, h), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    kind = rng.choice(["colour", "count", "horizontal", "vertical"])
    # Each shape gets its own cell of a 2x2 grid (or a half of the image), so shapes never overlap
    # and "left"/"top" are unambiguous.
    if kind == "count":
        n = rng.randint(1, 4)
        cells = rng.sample([(0, 0), (1, 0), (0, 1), (1, 1)], n)
        regions = [(cx * w // 2, cy * h // 2, (cx + 1) * w // 2, (cy + 1) * h // 2) for cx, cy in cells]
    elif kind == "horizontal":
        side = rng.choice(["left", "right"])
        regions = [(0, 0, w // 2, h) if side == "left" else (w - w // 2, 0, w, h)]
    elif kind == "vertical":
        side = rng.choice(["top", "bottom"])
        regions = [(0, 0, w, h // 2) if side == "top" else (0, h - h // 2, w, h)]
    else:
        regions = [(0, 0, w, h)]
    colours = [rng.choice(list(COLOURS)) for _ in regions]
    for (rx0, ry0, rx1, ry1), colour in zip(regions, colours, strict=True):
        size = rng.randint(10, min(rx1 - rx0, ry1 - ry0) - 6)
        x0, y0 = rng.randint(rx0 + 3, rx1 - 3 - size), rng.randint(ry0 + 3, ry1 - 3 - size)
        shape = rng.choice(["circle", "square", "triangle"])
        draw_shape(draw, shape, (x0, y0, x0 + size, y0 + size), COLOURS[colour])
    if kind == "colour":
        return img, "What colour is the shape?", colours[0]
    if kind == "count":
        return img, "How many shapes are there?", str(len(regions))
    if kind == "horizontal":
        return img, "Is the shape on the left or the right?", side
    return img, "Is the shape at the top or the bottom?", side


SHAPES = ("circle", "square", "triangle")
ONE_SHAPE_QUESTIONS = {
    "colour": "What colour is the shape?",
    "shape": "What shape is it?",
    "name": "Name the shape and its colour.",
}


def one_shape_sample(rng: random.Random, question: str | None = None) -> tuple[Image.Image, str, str]:
    """One shape of a random colour, kind and size on white; asked its colour, its kind, or both (`question`:
    a key of ONE_SHAPE_QUESTIONS, else drawn). What the demo models are pretrained on: seeing and saying."""
    w, h = rng.randint(56, 112), rng.randint(56, 112)
    img = Image.new("RGB", (w, h), (255, 255, 255))
    size = rng.randint(16, min(w, h) - 8)
    x0, y0 = rng.randint(4, w - 4 - size), rng.randint(4, h - 4 - size)
    colour, kind = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    draw_shape(ImageDraw.Draw(img), kind, (x0, y0, x0 + size, y0 + size), COLOURS[colour])
    question = question or rng.choice(list(ONE_SHAPE_QUESTIONS))
    answer = {"colour": colour, "shape": kind, "name": f"a {colour} {kind}"}[question]
    return img, ONE_SHAPE_QUESTIONS[question], answer


SHAPE_QUESTIONS = ("shape", "colour_choice", "shape_choice")


def shape_question_sample(rng: random.Random) -> tuple[Image.Image, str, str, list[str] | None]:
    """The demo's `shapes` rows: one shape asked its kind, or to choose between two colours or two kinds, one
    of them its own, and those two options as the question lists them (None for the kind question). What a
    pretrained demo model sees (colours surely, kinds less), in forms its pretraining never asked: "Is the
    shape red or blue?" it answers yes or no before fine-tuning, a colour after it. The counts and places of
    shapes_sample are beyond the demo's 32-wide towers (docs/results/demo-learns.md), so a fine-tune on them
    could teach their form only."""
    img, _, name = one_shape_sample(rng, "name")  # "a red circle"
    _, colour, kind = name.split()
    question = rng.choice(SHAPE_QUESTIONS)
    if question == "shape":
        return img, ONE_SHAPE_QUESTIONS["shape"], kind, None
    if question == "colour_choice":
        first, second = colour, rng.choice([c for c in COLOURS if c != colour])
        template, answer = "Is the shape {} or {}?", colour
    else:
        first, second = kind, rng.choice([k for k in SHAPES if k != kind])
        template, answer = "Is it a {} or a {}?", kind
    if rng.random() < 0.5:
        first, second = second, first
    return img, template.format(first, second), answer, [first, second]


# What a few of ten annotators say instead of the demo's answer, as VQAv2's annotators differ ("round" for a
# circle): the demo rows' `answers` (annotators_answers), so VQA accuracy gives such an answer partial
# credit where exact match gives none.
ANNOTATOR_VARIANTS = {
    "circle": "round",
    "square": "rectangle",
    "triangle": "triangular",
    **{direction: f"{direction}ward" for direction in ("left", "right", "up", "down")},
}


def scene_sample(rng: random.Random) -> tuple[Image.Image, str, str]:
    """1-4 shapes in the cells of a 2x2 grid, counted and each named with its place: the words of the demo
    tasks' answers (digits, colours, kinds, top/bottom/left/right) in one sentence."""
    img, _, described = describe_sample(rng)
    parts = described.removeprefix("There is ").removesuffix(".").split(", ")
    parts = [part.replace("a orange", "an orange") for part in parts]
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    count = "There is 1 shape" if len(parts) == 1 else f"There are {len(parts)} shapes"
    return img, "Describe the picture.", f"{count}: {listed}."


PRETRAINING_TASKS = {  # kind -> share of the pretraining rows
    "colour": 0.3,
    "shape": 0.1,
    "name": 0.15,
    "is_colour": 0.15,
    "json": 0.1,
    "scene": 0.15,
    "label": 0.05,
}


def pretraining_sample(rng: random.Random) -> tuple[Image.Image, str, str, str]:
    """What the demo models are pretrained on: seeing (colours, kinds, places, counts; labels, less surely)
    and saying every word the demo tasks answer with (yes/no, digits, JSON), in questions other than theirs.
    Returns (image, question, answer, kind)."""
    kind = rng.choices(list(PRETRAINING_TASKS), weights=list(PRETRAINING_TASKS.values()))[0]
    if kind in ONE_SHAPE_QUESTIONS:
        return (*one_shape_sample(rng, kind), kind)
    if kind == "scene":
        return (*scene_sample(rng), kind)
    if kind == "label":
        img, _, facts = nutrition_sample(rng)
        values = json.loads(facts)
        read = ", ".join(line.format(values[key]) for key, line in NUTRITION_LINES.items())
        return img, "Read the label.", read, kind
    img, _, name = one_shape_sample(rng, "name")  # "a red circle"
    _, colour, shape = name.split()
    if kind == "json":
        return (
            img,
            "Describe the shape as JSON.",
            json.dumps({"colour": colour, "shape": shape}, separators=(",", ":")),
            kind,
        )
    asked = colour if rng.random() < 0.5 else rng.choice([c for c in COLOURS if c != colour])
    return img, f"Is the shape {asked}?", "yes" if asked == colour else "no", kind


def nutrition_sample(rng: random.Random) -> tuple[Image.Image, str, str]:
    """A rendered nutrition-facts label; the answer is its values as compact JSON in fixed key order."""
    carbs = rng.randint(0, 80)
    values = (
        rng.randrange(40, 650, 10),
        rng.randint(0, 35),
        carbs,
        rng.randint(0, 40),
        rng.randint(0, carbs),
    )
    facts = dict(zip(NUTRITION_LINES, (*values, rng.randrange(0, 900, 5)), strict=True))
    img = Image.new("RGB", (112, 140), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()  # bundled with Pillow: no font files needed
    draw.text((6, 4), "Nutrition Facts", fill=(0, 0, 0), font=font)
    draw.line((6, 18, 106, 18), fill=(0, 0, 0), width=2)
    for i, (key, line) in enumerate(NUTRITION_LINES.items()):
        draw.text((6, 24 + 18 * i), line.format(facts[key]), fill=(0, 0, 0), font=font)
    return img, NUTRITION_QUESTION, json.dumps(facts, separators=(",", ":"))


def pair_sample(rng: random.Random, same: bool) -> tuple[list[Image.Image], str, str]:
    """Two images of one shape each, of the same colour or not (`same`); the answer is whether they are."""
    first = rng.choice(list(COLOURS))
    second = first if same else rng.choice([c for c in COLOURS if c != first])
    images = []
    for colour in (first, second):
        w, h = rng.randint(56, 84), rng.randint(56, 84)
        img = Image.new("RGB", (w, h), (255, 255, 255))
        size = rng.randint(20, min(w, h) - 8)
        x0, y0 = rng.randint(4, w - 4 - size), rng.randint(4, h - 4 - size)
        draw_shape(
            ImageDraw.Draw(img),
            rng.choice(["circle", "square", "triangle"]),
            (x0, y0, x0 + size, y0 + size),
            COLOURS[colour],
        )
        images.append(img)
    return images, "Are the two shapes the same colour?", "yes" if same else "no"


DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
CLIP_FRAMES, CLIP_FPS, CLIP_SIZE = 8, 4, 64  # 2 s of 64x64 px: 4 frames at data.video_fps 2


def motion_sample(rng: random.Random) -> tuple[list, str, str]:
    """A clip (frames as RGB arrays) of a dot crossing the frame; the answer is its direction."""
    import numpy as np

    direction = rng.choice(list(DIRECTIONS))
    dx, dy = DIRECTIONS[direction]
    colour = COLOURS[rng.choice(list(COLOURS))]
    step, dot = 5, 10
    span = step * (CLIP_FRAMES - 1)
    x = rng.randint(4, CLIP_SIZE - 4 - dot) if dx == 0 else (4 if dx > 0 else CLIP_SIZE - 4 - dot)
    y = rng.randint(4, CLIP_SIZE - 4 - dot) if dy == 0 else (4 if dy > 0 else CLIP_SIZE - 4 - dot)
    frames = []
    for i in range(CLIP_FRAMES):
        frame = np.full((CLIP_SIZE, CLIP_SIZE, 3), 255, np.uint8)
        fx, fy = x + dx * step * i, y + dy * step * i
        frame[fy : fy + dot, fx : fx + dot] = colour
        frames.append(frame)
    assert span + dot + 8 <= CLIP_SIZE
    return frames, "Which way does the dot move?", direction


def write_clip(path: Path, frames: list, fps: int = CLIP_FPS) -> None:
    """An H.264 MP4 of RGB frames, with PyAV (FFmpeg comes in its wheel); the same frames, the same bytes."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


POSITIONS = {(0, 0): "top left", (1, 0): "top right", (0, 1): "bottom left", (1, 1): "bottom right"}


def describe_sample(rng: random.Random) -> tuple[Image.Image, str, str]:
    """1-4 shapes in the cells of a 2x2 grid; the answer names each one: answers of 6 to ~40 tokens."""
    w, h = 112, 112
    img = Image.new("RGB", (w, h), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    parts = []
    for cx, cy in sorted(rng.sample(list(POSITIONS), rng.randint(1, 4)), key=lambda c: (c[1], c[0])):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(["circle", "square", "triangle"])
        x0, y0 = cx * 56 + rng.randint(4, 20), cy * 56 + rng.randint(4, 20)
        draw_shape(draw, shape, (x0, y0, x0 + 30, y0 + 30), COLOURS[colour])
        parts.append(f"a {colour} {shape} at the {POSITIONS[(cx, cy)]}")
    return img, "Describe every shape and where it is.", "There is " + ", ".join(parts) + "."


def annotators_answers(rng: random.Random, answer: str) -> list[str]:
    """Ten annotators' answers, as VQAv2 ships them: most say `answer`, up to three its variant
    (ANNOTATOR_VARIANTS: "round" for "circle"). The majority answer scores 1 by VQA accuracy, the
    variant min(1, its count / 3)."""
    variants = rng.randint(0, 3)
    return [answer] * (10 - variants) + [ANNOTATOR_VARIANTS[answer]] * variants


def wrong_answer(rng: random.Random, task: str, answer: str) -> str:
    """A plausible wrong answer to a demo row (demo:preference-*'s rejected): another kind or colour, the
    other yes/no, one nutrition value off."""
    if task == "nutrition":
        facts = json.loads(answer)
        key = rng.choice(list(facts))
        facts[key] += (
            rng.choice([-1, 1]) * rng.randint(1, 5) * (10 if key in ("calories", "sodium_mg") else 1)
        )
        facts[key] = abs(facts[key]) if facts[key] else 1
        return json.dumps(facts, separators=(",", ":"))
    if task == "pair":
        return "no" if answer == "yes" else "yes"
    if answer in SHAPES:
        return rng.choice([kind for kind in SHAPES if kind != answer])
    return rng.choice([c for c in COLOURS if c != answer])
