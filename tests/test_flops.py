"""The model-FLOPs formula behind the benchmark's TFLOP/s and MFU, checked against torch's own count of
every matmul, convolution and attention each family's tiny model runs."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import model_inputs, model_torch_can_count, single_image_demo_rows
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoProcessor

from vlm_recipes.benchmarking.flops import (
    flop_coefficients,
    flops_per_sample,
    linear_attention_flops,
    matmul_params_by_role,
)
from vlm_recipes.data.lengths import sample_token_counts
from vlm_recipes.data.rows import undecoded
from vlm_recipes.errors import UnsupportedModelError
from vlm_recipes.families.base import VisionGeometry


def test_flop_coefficients_follow_the_gradient():
    """2 forward, +2 where a gradient flows back through the role, +2 where its weights train."""
    r1 = {"vision": "frozen", "projector": "frozen", "llm": "lora"}
    r2 = {"vision": "full", "projector": "frozen", "llm": "frozen"}
    projector_only = {"vision": "frozen", "projector": "full", "llm": "frozen"}
    assert flop_coefficients(r1) == {"vision": 2, "projector": 2, "llm": 4}
    assert flop_coefficients(r2) == {"vision": 6, "projector": 4, "llm": 4}
    assert flop_coefficients(projector_only) == {"vision": 2, "projector": 6, "llm": 4}


# Towers that run every image padded to a fixed number of patches: torch counts the padding, the formula (model
# work) does not; their own test counts an image that fills its budget.
PADDED_TOWERS = {
    "gemma4": "tests/test_family_gemma4.py::test_vision_flops_are_torchs_count_for_an_image_that_fills_its_budget"
}
# Towers that prepend a CLS token to every tile: it is attended and transformed but never becomes an image token,
# and the formula leaves it out (1 token in 1025 a tile on InternViT); their own test adds its exact work.
CLASS_TOKEN_TOWERS = {
    "internvl": "tests/test_family_internvl.py::test_vision_flops_are_the_formulas_plus_each_tiles_class_token"
}


def skip_where_flops_are_refused(family, model_dir) -> None:
    """A family that refuses FLOP counts (its `vision_geometry` says why; the benchmark refuses it the same
    way) has none to check."""
    try:
        family.vision_geometry(AutoConfig.from_pretrained(model_dir))
    except UnsupportedModelError as refusal:
        pytest.skip(f"FLOP counts refused: {refusal}")


def merged_grids(inputs, model, family) -> list[list[tuple[int, int]]]:
    """One sample's images as merged (height, width) token grids, as flops_per_sample takes them."""
    if hasattr(model.config, "mm_tokens_per_image"):  # Gemma 3: every image one square of pooled tokens
        side = math.isqrt(model.config.mm_tokens_per_image)
        return [[(side, side)] * len(inputs["pixel_values"])]
    if model.config.model_type == "mistral3":  # Pixtral: each image's rows x cols of patch x merge px tokens
        side = model.config.vision_config.patch_size * model.config.spatial_merge_size
        return [[(int(h) // side, int(w) // side) for h, w in inputs["image_sizes"].tolist()]]
    if "image_sizes" in inputs:  # LLaVA-OneVision: every real tile a square of `window` x `window` tokens
        side = family.vision_geometry(model.config).window
        tiles = sum(pixels.shape[0] for pixels, _ in family.image_units(*image_inputs(inputs)))
        return [[(side, side)] * tiles]
    if "image_grid_thw" not in inputs:  # SmolVLM: every tile a square of `window` x `window` tokens
        side = family.vision_geometry(model.config).window
        return [[(side, side)] * len(family.image_units(*image_inputs(inputs)))]
    merge = model.config.vision_config.spatial_merge_size
    return [[(int(h) // merge, int(w) // merge) for _, h, w in inputs["image_grid_thw"].tolist()]]


def image_inputs(inputs) -> tuple:
    """The (pixel_values, second argument) of `get_image_features`: Qwen's image grids, SmolVLM's pixel
    attention mask."""
    second = inputs.get("image_grid_thw", inputs.get("pixel_attention_mask", inputs.get("image_sizes")))
    # Gemma 3: pixels only
    return (inputs["pixel_values"],) if second is None else (inputs["pixel_values"], second)


@pytest.mark.parametrize("mode", ["frozen", "full"])
def test_formula_matches_torchs_flop_count(tiny_family, mode):
    family, model_dir = tiny_family
    skip_where_flops_are_refused(family, model_dir)
    if family.name in PADDED_TOWERS:
        pytest.skip(f"every image padded to its budget's patches: {PADDED_TOWERS[family.name]}")
    if family.name in CLASS_TOKEN_TOWERS:
        pytest.skip(f"a CLS token per tile, left out of the formula: {CLASS_TOKEN_TOWERS[family.name]}")
    model = model_torch_can_count(model_dir, family)
    model.requires_grad_(mode == "full")
    processor = AutoProcessor.from_pretrained(model_dir)
    ds = single_image_demo_rows(1)
    row = ds[0]
    [counts] = sample_token_counts(undecoded(ds.select([0])), processor, family)
    inputs = model_inputs(processor, [row])
    assert inputs["input_ids"].shape[1] == sum(counts), "one sample, no padding"

    with FlopCounterMode(display=False) as counter:
        logits = model(**inputs).logits
        if mode == "full":
            logits.float().pow(2).mean().backward()
    modes = dict.fromkeys(("vision", "projector", "llm"), mode)
    geometry = family.vision_geometry(model.config)
    grids = merged_grids(inputs, model, family)
    predicted = flops_per_sample(model, family, modes, [counts], grids)
    if mode == "frozen":
        assert predicted == pytest.approx(counter.get_total_flops(), rel=0.01)
        return
    # Training: the formula, like the usual 6N, also counts an input gradient for the patch embedding
    # (torch skips it: pixels need none; +4-6 % on these tiny towers, ~0.1 % on 2B), taken out here, and
    # counts attention backward as 2x its forward (as eager's matmuls are; flash backward is 2.5x).
    patch_embed = next(m for m in model.modules() if isinstance(m, torch.nn.Conv3d | torch.nn.Conv2d))
    input_gradient = 2 * patch_embed.weight.numel() * counts[1] * geometry.patches_per_token
    assert predicted - input_gradient + linear_attention_excess(model, sum(counts)) == pytest.approx(
        counter.get_total_flops(), rel=0.03
    )


def linear_attention_excess(model, length: int) -> float:
    """What torch's counter sees in training a hybrid model's Gated DeltaNet layers beyond the formula's 3x
    forward (0 for a model without them), measured on one such layer alone: its counter counts a depthwise
    convolution's backward as a dense one's (~200x), and the UT transform's triangular solves, uncounted in
    forward, backpropagate through counted matmuls."""
    text_config = model.config.get_text_config()
    linear_layers = list(getattr(text_config, "layer_types", None) or []).count("linear_attention")
    if not linear_layers:
        return 0.0
    layer = model.model.language_model.layers[0].linear_attn
    hidden = torch.randn(1, length, text_config.hidden_size, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        layer(hidden).sum().backward()
    weights = sum(
        m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv1d)
    )
    formula = 3 * (2 * weights * length + linear_attention_flops(text_config, length))
    return linear_layers * (counter.get_total_flops() - formula)


def test_vision_tower_forward_is_counted_exactly_windows_included(tiny_family):
    """The tower alone (patch embedding, blocks, merger and, for Qwen3-VL, the DeepStack mergers): torch's
    count equals the formula's vision and projector terms, attention counted per window where the tower
    attends in windows (Qwen2.5-VL)."""
    family, model_dir = tiny_family
    skip_where_flops_are_refused(family, model_dir)
    if family.name in PADDED_TOWERS:
        pytest.skip(f"every image padded to its budget's patches: {PADDED_TOWERS[family.name]}")
    if family.name in CLASS_TOKEN_TOWERS:
        pytest.skip(f"a CLS token per tile, left out of the formula: {CLASS_TOKEN_TOWERS[family.name]}")
    model = model_torch_can_count(model_dir, family).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    rows = single_image_demo_rows(4)
    inputs = model_inputs(processor, [dict(r) for r in rows])
    geometry = family.vision_geometry(model.config)
    params = matmul_params_by_role(model, family)
    grids = merged_grids(inputs, model, family)[0]
    tokens = sum(h * w for h, w in grids)
    calls = [image_inputs(inputs)]
    if family.name == "mistral3":  # eager Pixtral convolves the batch padding and attends over all the images
        # under a block mask: the model's work (flash attention's) is each image on its own
        calls = [family.batch_image_units([unit]) for unit in family.image_units(*calls[0])]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        for args in calls:
            family.image_encoder_owner(model).get_image_features(*args)
    pairs = sum(geometry.attention_pairs(h * w, (h, w)) for h, w in grids)
    expected = 2 * params["vision"] * tokens * geometry.patches_per_token + 2 * params["projector"] * tokens
    assert counter.get_total_flops() == expected + 4 * pairs * geometry.width
    unwindowed = sum(geometry.layers * (h * w * geometry.patches_per_token) ** 2 for h, w in grids)
    if "image_grid_thw" not in inputs and geometry.window:  # SmolVLM: its tiles, one window each
        assert pairs == unwindowed == geometry.attention_pairs(tokens), "from the token count alone too"
        return
    assert (pairs < unwindowed) == (geometry.window is not None), "windows are counted as windows"


def test_windows_without_the_grid_are_an_upper_bound():
    """Qwen2.5-VL-shaped: 4x4-token windows, 4 of 32 layers full. A 6x5 grid has windows of 4x4, 4x1,
    2x4 and 2x1 tokens; from the token count alone the formula assumes full windows but the last."""
    geometry = VisionGeometry(patches_per_token=4, width=1280, layers=32, window=4, full_attention_layers=4)
    exact = geometry.attention_pairs(30, (6, 5))
    windows = [16, 4, 8, 2]
    assert exact == 4 * 120**2 + 28 * sum((4 * w) ** 2 for w in windows)
    assert geometry.attention_pairs(30) == 4 * 120**2 + 28 * (64**2 + 56**2) >= exact
    assert geometry.attention_pairs(32, (8, 4)) == geometry.attention_pairs(32), "whole windows: exact"
    plain = VisionGeometry(patches_per_token=4, width=1280, layers=32)
    assert plain.attention_pairs(30) == plain.attention_pairs(30, (6, 5)) == 32 * 120**2
