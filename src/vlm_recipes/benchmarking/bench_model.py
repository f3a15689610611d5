"""What the benchmark knows of its model before any run: its size, its FLOPs per sample by role, how its
training step's FLOPs split between the tower, projector, decoder layers and LM head beside the split of the
real model it stands for (Qwen2-VL-2B, from its published config.json, on the meta device), and the device's
peak for MFU.

A bench model is only worth its ratios if its step spends its arithmetic where a real model's does: a
16.7M-parameter model spends it on Python and kernel launches, and one with the real vocabulary but few layers
spends it on the LM head. `demo:bench-qwen2-vl-wide` keeps Qwen2-VL-2B's widths and cuts depth and vocabulary
in proportion, so each part's share stays within a few points of the real one's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vlm_recipes.benchmarking.flops import (
    STEP_PARTS,
    flop_shares,
    flops_per_sample_by_role,
    last_layer_flops_per_position,
    measured_matmul_peak_tflops,
    peak_tflops,
)

REFERENCE_NAME, REFERENCE_FAMILY = "Qwen2-VL-2B", "qwen2-vl"
# Qwen/Qwen2-VL-2B-Instruct's config.json as published (no weights: the meta device needs shapes only)
REFERENCE_CONFIG = Path(__file__).resolve().parent / "bench_recipes" / "Qwen2-VL-2B-Instruct.config.json"
BENCH_PIXELS = (3136, 200704)  # the bench recipes' min and max pixels (4 to 256 merged image tokens)


def reference_model() -> torch.nn.Module:
    """Qwen2-VL-2B on the meta device, built from its published configuration."""
    from transformers import AutoModelForImageTextToText, Qwen2VLConfig

    config = Qwen2VLConfig.from_dict(json.loads(REFERENCE_CONFIG.read_text()))
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


def model_about(
    model: Path, modes_by_stage: dict[str, dict[str, str]], rows: list[tuple[int, int]]
) -> tuple[dict, dict, dict, dict]:
    """The model's size; each stage's mean FLOPs per sample by role; each stage's FLOPs at a position that
    training.loss_positions_only skips when unlabelled; and each stage's FLOP shares by part (`STEP_PARTS`),
    the bench model's beside Qwen2-VL-2B's on the same samples (on the meta device: shapes only)."""
    from transformers import AutoModelForImageTextToText

    from vlm_recipes.model.build import detect_family

    family, config = detect_family(str(model))
    with torch.device("meta"):
        bare = AutoModelForImageTextToText.from_config(config)
    # the reference is read through the bench model's family: only a Qwen2-VL bench model has its roles
    reference = reference_model() if family.name == REFERENCE_FAMILY else None
    flops, last_layer, shares = {}, {}, {}
    for stage, modes in modes_by_stage.items():
        flops[stage] = flops_per_sample_by_role(bare, family, modes, rows)
        last_layer[stage] = last_layer_flops_per_position(bare, family, modes)
        shares[stage] = {model.name: flop_shares(bare, family, modes, rows)}
        if reference is not None:
            shares[stage][REFERENCE_NAME] = flop_shares(reference, family, modes, rows)
    parameters = sum(p.numel() for p in bare.parameters())
    return {"name": model.name, "parameters": parameters, "family": family.name}, flops, last_layer, shares


def render_shares(shares: dict[str, dict[str, dict[str, float]]]) -> str:
    """Each stage's FLOP shares, the bench model's beside the reference's (where it has one), and the
    largest gap in points."""
    lines = []
    for stage, by_model in shares.items():
        names, columns = list(by_model), list(by_model.values())
        lines.append(f"{stage}: share of a training step's FLOPs, {' | '.join(names)}")
        for part in STEP_PARTS:
            lines.append(f"  {part:15} " + " | ".join(f"{of_part[part]:6.1%}" for of_part in columns))
        if len(columns) == 2:
            gap = max(abs(columns[0][part] - columns[1][part]) for part in STEP_PARTS)
            lines.append(f"  largest gap: {gap * 100:.1f} points")
    return "\n".join(lines)


def token_counts(model: Path, data: Path, rows: int) -> list[tuple[int, int]]:
    """Text and image tokens of every sample trained on, padding excluded (both ways see the same)."""
    from transformers import AutoProcessor

    from vlm_recipes.caches.token_counts import remembered_token_counts
    from vlm_recipes.data.lengths import sample_token_counts
    from vlm_recipes.data.rows import load_split, undecoded
    from vlm_recipes.model.build import detect_family

    family, _ = detect_family(str(model))
    processor = AutoProcessor.from_pretrained(model)
    family.apply_pixel_bounds(processor.image_processor, *BENCH_PIXELS)
    ds, _ = load_split(str(data), "train", rows)
    return sample_token_counts(undecoded(ds), processor, family, remember=remembered_token_counts)


def device_peak(device: str, precision: str, threads: int, given: float | None) -> tuple[float | None, str]:
    """MFU's denominator and where it came from: `--peak-tflops` if given; otherwise the matmul peak
    measured here, now, in the training dtype: on a GPU the best 8192x8192 product (its published dense
    peak, where known, named beside it), on a CPU the best 2048x2048 one on the training threads."""
    if given:
        return given, "given (--peak-tflops)"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if device == "cuda":
        measured = measured_matmul_peak_tflops(dtype, threads, size=8192, seconds=3.0, device="cuda")
        published = peak_tflops(device)
        beside = f"; published dense bf16 peak {published:.0f}" if published else ""
        return (
            measured,
            f"measured: the best 8192x8192 {precision} matmul on {torch.cuda.get_device_name()}{beside}",
        )
    if device != "cpu":
        return None, "unknown for this device: pass --peak-tflops"
    measured = measured_matmul_peak_tflops(dtype, threads)
    return measured, f"measured: the best 2048x2048 {precision} matmul on {threads} thread(s)"
