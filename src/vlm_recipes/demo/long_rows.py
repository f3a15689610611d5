"""Rows long enough to split over sequence ranks: one clip each, a square crossing a plain frame, asked which
way it moves. 448x448 px frames at 2 fps: on the Qwen line each pair of frames is 256 tokens (Qwen2-VL and
Qwen2.5-VL: 16x16 tokens of 28 px), so 32 frames make a row of 4,096 video tokens and ~4,135 in all."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from vlm_recipes.demo.samples import write_clip

SIDE = 448  # px; data.video_max_pixels must allow SIDE**2 (200704)


def long_video_rows(directory: Path, n: int = 4, frames: int = 32) -> Path:
    """`n` rows of one clip of `frames` frames each (written under `directory`), as a JSONL file; answers
    of two lengths, so a batch of two holds a padded row."""
    (directory / "videos").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    step = (SIDE - 48) // frames
    rows = []
    for i in range(n):
        background = rng.integers(0, 255, size=3).astype(np.uint8)
        clip = []
        for t in range(frames):
            frame = np.zeros((SIDE, SIDE, 3), np.uint8) + background
            frame[200:248, step * t : step * t + 48] = 255 - background
            clip.append(frame)
        write_clip(directory / "videos" / f"clip{i}.mp4", clip, fps=2)
        question = [{"type": "video"}, {"type": "text", "text": "Which way does the square move?"}]
        answer = [{"type": "text", "text": "to the right" if i % 2 else "right, slowly, across the frame"}]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages, "videos": [f"videos/clip{i}.mp4"]})
    path = directory / f"long-video-{frames}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
