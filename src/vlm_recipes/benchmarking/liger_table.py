"""What Liger's kernels reach in each family: the table of docs/results/liger-kernels.md's "Liger's kernels by family",
printed by `python -m vlm_recipes.benchmarking.liger_table` from each family's tiny demo model on the meta
device (speedups/liger.py patches them as a stage would; tests/test_liger.py checks the docs' copy)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

from transformers import PreTrainedModel

from vlm_recipes.speedups.liger import KINDS, LigerPatch, NoLigerKernels, patch_liger_kernels


def demo_models() -> dict[str, str]:
    """Each family's tiny demo model (`demo:tiny-<family>`), then the tiny model of each type the generic family
    trains with knowledge of its own (`GENERIC_WITH_KNOWLEDGE`), by the name the table gives: the registry's,
    so a family added there is in the table when this runs again."""
    from vlm_recipes.demo.models import DEMO_MODELS, PRETRAINED_PREFIX
    from vlm_recipes.families import FAMILIES, GENERIC_WITH_KNOWLEDGE

    extras = {
        demo.model_type: demo_id
        for demo_id, demo in DEMO_MODELS.items()
        if demo.model_type in GENERIC_WITH_KNOWLEDGE and demo_id.startswith(PRETRAINED_PREFIX)
    }
    return {**{family.name: f"demo:tiny-{family.name}" for family in FAMILIES}, **extras}


def build_on_meta(model_id: str) -> PreTrainedModel:
    """The demo model's architecture on the meta device (no weights: patching needs none)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlm_recipes.demo.models import ensure_demo_model

    config = AutoConfig.from_pretrained(ensure_demo_model(model_id, weights="untrained"))
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


def patched_demo_models() -> Iterator[tuple[str, PreTrainedModel, LigerPatch | NoLigerKernels]]:
    """(name, model, what patching it gave) for each of `demo_models()`. Every model is built before any is
    patched: Liger also replaces classes in transformers' modeling modules, which a model built afterwards
    would be made of."""
    models = {name: build_on_meta(model_id) for name, model_id in demo_models().items()}
    for name, model in models.items():
        try:
            yield name, model, patch_liger_kernels(model)
        except NoLigerKernels as refusal:
            yield name, model, refusal


def _cell(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts[k]} {k}" for k in KINDS if counts.get(k)) or "-"


def markdown(rows: list[tuple[str, PreTrainedModel, LigerPatch | NoLigerKernels]]) -> str:
    """The table of docs/results/liger-kernels.md's "Liger's kernels by family"."""
    lines = [
        "| family | model type | language model | vision side | rotary | how |",
        "|---|---|---|---|---|---|",
    ]
    for name, model, patch in rows:
        if isinstance(patch, NoLigerKernels):
            lines.append(f"| {name} | `{model.config.model_type}` | - | - | - | none: {patch} |")
            continue
        lines.append(
            f"| {name} | `{patch.model_type}` | {_cell(patch.language_model)} | {_cell(patch.vision)} | "
            f"{patch.rotary_words()} | ({patch.path}) {patch.how} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)  # Liger's and transformers' warnings about the tiny configs
    sys.stdout.write(markdown(list(patched_demo_models())))
