"""The learning rates a stage trains at: the recipe's, except on the pretrained demo models, which are 24x
narrower than the models the seed recipes' rates are set for and train at rates scaled by the width ratio.

Why a demo model needs this: Adam moves every weight by about the learning rate each step whatever the
width, but the recipes' rates (LoRA 2e-4, a vision tower 2e-5) are tuned on models ~1.5k wide, and a 64-wide
layer sums 24x fewer inputs, so the same step moves its output ~24x less. muP (Yang et al., "Tensor Programs
V", 2022) makes one rate fit every width by scaling Adam's rate with 1 / width; the demo models are not muP
models, so this is the same idea applied once, as a constant. Measured on the pretrained tiny Qwen2-VL, 24
steps of r1 (1 epoch of demo:train, bf16, demo-v5): at 2e-4 the eval loss goes 5.86 -> 5.03 and exact match
stays 0.062; at 2e-4 x 24 they go to 2.06 and 0.312. A real model id, or a demo model asked for untrained (the test
suite), trains at the recipe's rates, unchanged.
"""

from __future__ import annotations

import dataclasses

from vlm_recipes.decisions import Decision
from vlm_recipes.demo.models import DEMO_MODEL_IDS, PRETRAINED_PREFIX, demo_weights
from vlm_recipes.recipes.schema import Stage

SEED_RECIPES_WIDTH = 1536  # Qwen2-VL-2B's hidden size: the model the seed recipes' rates are set for
DEMO_WIDTH = 64  # the hidden size of every demo:tiny-* language model
DEMO_RATE_SCALE = SEED_RECIPES_WIDTH // DEMO_WIDTH  # 24


def learning_rate_scale(model_id: str) -> int:
    """DEMO_RATE_SCALE for a pretrained `demo:tiny-*` model, 1 for any other model."""
    pretrained_demo = model_id in DEMO_MODEL_IDS and model_id.startswith(PRETRAINED_PREFIX)
    return DEMO_RATE_SCALE if pretrained_demo and demo_weights() == "pretrained" else 1


def stage_learning_rates(model_id: str, stage: Stage) -> tuple[Stage, Decision | None]:
    """The stage as it trains on `model_id` (its rates scaled for a demo model) and the decision to log, or
    the stage itself and None."""
    scale = learning_rate_scale(model_id)
    if scale == 1:
        return stage, None
    t = stage.training
    scaled = dataclasses.replace(
        t,
        learning_rate=t.learning_rate * scale,
        role_learning_rates={role: rate * scale for role, rate in t.role_learning_rates.items()},
    )
    roles = "".join(f", {role} {rate:g}" for role, rate in scaled.role_learning_rates.items())
    decision = Decision(
        "learning rate",
        f"{scaled.learning_rate:g}{roles} (the recipe's x{scale})",
        f"{model_id} is {DEMO_WIDTH} wide, the seed recipes' rates are set for {SEED_RECIPES_WIDTH}-wide "
        "models: scaled by the width ratio, as muP scales Adam's rate; a real model trains at the recipe's",
    )
    return dataclasses.replace(stage, training=scaled), decision
