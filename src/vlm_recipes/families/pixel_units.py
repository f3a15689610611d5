"""data.min_pixels / data.max_pixels for an image processor that spends whole units of one pixel area on each
image (InternVL's tiles, LFM2-VL's image tokens): max_pixels bounds the units an image may take, min_pixels
sets the fewest, which a smaller image is enlarged to."""

from __future__ import annotations

import math


def most_units(family: str, max_pixels: int, unit_pixels: int, unit: str) -> int:
    """The most units of `unit_pixels` pixels within max_pixels; refused under one, since every image takes
    at least one. `unit`: what one is, for the error."""
    if max_pixels < unit_pixels:
        raise ValueError(
            f"{family}: data.max_pixels={max_pixels} is under one {unit} ({unit_pixels} pixels): every image "
            f"takes at least one. Set data.max_pixels to {unit_pixels} or more (or null: the model's own)"
        )
    return max_pixels // unit_pixels


def fewest_units(family: str, min_pixels: int, unit_pixels: int, units: str, most: tuple[str, int]) -> int:
    """The fewest units of `unit_pixels` pixels that hold min_pixels; refused above `most`, the processor's
    setting (name, value) for the most units an image may take. `units`: what they are, for the error."""
    fewest = math.ceil(min_pixels / unit_pixels)
    setting, limit = most
    if fewest > limit:
        raise ValueError(
            f"{family}: data.min_pixels={min_pixels} needs {fewest} {units}, more than {setting} {limit}: "
            "lower data.min_pixels or raise data.max_pixels"
        )
    return fewest
