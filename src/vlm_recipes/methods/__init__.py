"""How a stage trains (`method:` in the recipe), one module per method. Each is a TrainingMethod
(trainer.py) and owns everything about itself: its recipe section (`settings`, a dataclass: the schema,
`--schema` and validation read it from there), its rows' check, its TRL config and trainer, its checks of a
stage (`problems`), the metrics it adds and what its losses are (`loss_kind`, `measures`: the end-of-run table
and `compare` read them from metrics.json), the frozen models it holds beside the trained one
(`frozen_copies`: rank_memory.py counts them), what else it takes (`takes_video`, `takes_loss_positions_cut`,
`takes_streamed_rows`) and what older runs recorded of it (`older_record`). sft.py, dpo.py, kto.py (answers marked good or bad, DPO's
reference), grpo.py (with its rewards in rewards.py and the section it shares with RLOO in
sampling_settings.py), rloo.py, distill.py. Their TRL trainers are in sft_trainer.py,
preference_trainers.py, sampling_trainers.py and distill_trainer.py, imported only when a stage builds one:
reading a recipe, `--list` and `--schema` import no torch or TRL (trainer.py says how). What every method's
trainer shares is in recipe_trainer.py, callbacks.py what runs beside its steps (NaN/inf, Ctrl-C, step
timing, host memory), checkpoints.py the checkpoints they write and resume from.

A new method is its module (its trainer beside it), one entry in METHODS below, its test file and its
section in docs/recipes.md; the shared modules ask the method and change for none."""

from __future__ import annotations

from vlm_recipes.methods.distill import Distill
from vlm_recipes.methods.dpo import DPO
from vlm_recipes.methods.grpo import GRPO
from vlm_recipes.methods.kto import KTO
from vlm_recipes.methods.rloo import RLOO
from vlm_recipes.methods.sft import SFT
from vlm_recipes.methods.trainer import TrainingMethod
from vlm_recipes.recipes.schema import Stage

METHODS: dict[str, TrainingMethod] = {
    method.name: method for method in (SFT(), DPO(), KTO(), GRPO(), RLOO(), Distill())
}


def method_of(stage: Stage) -> TrainingMethod:
    return METHODS[stage.method]


def recorded_method(metrics: dict, name: str) -> dict:
    """What a stage's metrics.json says of its method `name` (TrainingMethod.record); for a run from before
    it said, what the method's record was then (older_record)."""
    return metrics.get("method") or METHODS[name].older_record()
