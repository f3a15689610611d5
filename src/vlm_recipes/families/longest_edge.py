"""data.min_pixels / data.max_pixels for an image processor that sizes each image by its longest edge
(Mistral 3's Pixtral, SmolVLM's Idefics3): max_pixels becomes that edge; min_pixels has no meaning there."""

from __future__ import annotations

import math


def set_longest_edge(
    family: str, image_processor, min_pixels: int | None, max_pixels: int | None, unit: int, resizing: str
) -> int | None:
    """Set `image_processor.size` to the longest edge whose square holds max_pixels, in whole `unit`s (at
    least one), and return it (None: max_pixels not set, the processor's own). A min_pixels is refused:
    `resizing` says how the processor resizes instead."""
    from transformers.image_utils import SizeDict

    if min_pixels is not None:
        raise ValueError(
            f"{family}: data.min_pixels has no meaning for this family: {resizing}. Leave data.min_pixels null "
            "(data.max_pixels sets that longest edge)"
        )
    if max_pixels is None:
        return None
    edge = max(unit, math.isqrt(max_pixels) // unit * unit)
    image_processor.size = SizeDict(longest_edge=edge)
    return edge
