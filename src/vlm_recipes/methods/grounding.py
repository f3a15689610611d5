"""The grounding reward (`iou`, as VLM-R1 and Visual-RFT reward it): the IoU of the answer's first box with
the row's `solution` box, the answer read in its model family's coordinate convention.

A row's `solution` box is in pixels of the row's image, as grounding datasets give it (RefCOCO, ms-swift's
`bbox`). Models answer in their own frame, which differs per family (ms-swift's custom-dataset guide, the
Qwen cookbooks):
- `relative_1000`: x and y from 0 to 1000 across the image: Qwen2-VL (`<|box_start|>(x1,y1),(x2,y2)<|box_end|>`,
  the special tokens dropped when TRL decodes), Qwen3-VL and Qwen3.5 (`{"bbox_2d": [...]}`), GLM-4.1V/4.5V,
  InternVL;
- `resized_pixels`: pixels of the image as the processor resized it: Qwen2.5-VL (`{"bbox_2d": [...]}`);
- `pixels`: pixels of the image as given.
The reward converts the answer's box into the image's pixels and scores it against the solution's. `same`
scores the two as written (a solution already in the model's frame). The family's convention is
`Family.box_format`; a family without one (none documented) needs the reward's `box_format` set.
"""

from __future__ import annotations

from collections.abc import Callable

from qwen_vl_utils import smart_resize

from vlm_recipes.scoring import box_iou, final_answer, first_box

Box = tuple[float, float, float, float]
BOX_FORMATS = ("same", "pixels", "relative_1000", "resized_pixels")


def resized_size(processor, width: int, height: int) -> tuple[int, int]:
    """(width, height) of an image after the Qwen line's processor resizes it: sides rounded to whole merged
    patches within the processor's pixel bounds (qwen-vl-utils' `smart_resize`, the rule
    Qwen2VLImageProcessor applies)."""
    images = processor.image_processor
    bounds = images.size
    factor = images.patch_size * images.merge_size
    new_height, new_width = smart_resize(
        height, width, factor=factor, min_pixels=bounds["shortest_edge"], max_pixels=bounds["longest_edge"]
    )
    return new_width, new_height


def in_image_pixels(box: Box, box_format: str, size: tuple[int, int], resized: tuple[int, int] | None) -> Box:
    """`box`, written in `box_format`, as pixels of an image of `size` (width, height); `resized`: the size
    the processor resized it to (resized_pixels only)."""
    if box_format in ("same", "pixels"):
        return box
    width, height = size
    if box_format == "relative_1000":
        scale_x, scale_y = width / 1000, height / 1000
    else:  # resized_pixels
        scale_x, scale_y = width / resized[0], height / resized[1]
    x1, y1, x2, y2 = box
    return x1 * scale_x, y1 * scale_y, x2 * scale_x, y2 * scale_y


def iou_reward(box_format: str, processor, solutions_of: Callable, text_of: Callable) -> Callable:
    """The iou reward for answers written in `box_format` (resolved: not auto). `solutions_of(kwargs, name)`
    and `text_of(completion)` are the rewards module's readers of TRL's arguments."""

    def iou(completions: list, **kwargs) -> list[float | None]:
        """IoU of each completion's first box, in the image's pixels, with its row's solution box (0.0 when
        the answer has no box); None for a row whose solution has no box, or, where the frame needs the
        image, for a row without one."""
        images = kwargs.get("images") or [None] * len(completions)
        scores: list[float | None] = []
        for completion, solution, row_images in zip(
            completions, solutions_of(kwargs, "iou"), images, strict=True
        ):
            reference = first_box(solution) if isinstance(solution, str) else None
            answer = first_box(final_answer(text_of(completion)))
            if reference is None:
                scores.append(None)
            elif answer is None:
                scores.append(0.0)
            elif box_format in ("same", "pixels"):
                scores.append(box_iou(answer, reference))
            elif not row_images:
                scores.append(None)  # a relative frame with no image to measure
            else:
                size = row_images[0].size  # the first image: the one the question's box is in
                resized = resized_size(processor, *size) if box_format == "resized_pixels" else None
                scores.append(box_iou(in_image_pixels(answer, box_format, size, resized), reference))
        return scores

    return iou
