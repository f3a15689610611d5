"""How a stage trains (`method:` in the recipe), one module per method. Each is a TrainingMethod
(trainer.py): how its rows are checked, its config and trainer built and its metrics read. sft.py, dpo.py,
kto.py (answers marked good or bad, DPO's reference), grpo.py (with its rewards in rewards.py), rloo.py
(GRPO's rows and rewards, RLOO's advantage); what every method's trainer shares is in trainer.py, and
callbacks.py what runs beside its steps (NaN/inf, Ctrl-C, step timing, host memory); checkpoints.py the
checkpoints they write and resume from.
run_stage asks `method_of(stage)`; a new method is one more module and one more entry here."""

from __future__ import annotations

from vlm_recipes.methods.dpo import DPO
from vlm_recipes.methods.grpo import GRPO
from vlm_recipes.methods.kto import KTO
from vlm_recipes.methods.rloo import RLOO
from vlm_recipes.methods.sft import SFT
from vlm_recipes.methods.trainer import TrainingMethod
from vlm_recipes.recipes.schema import Stage

METHODS: dict[str, TrainingMethod] = {method.name: method for method in (SFT(), DPO(), KTO(), GRPO(), RLOO())}


def method_of(stage: Stage) -> TrainingMethod:
    return METHODS[stage.method]
