"""What a stage is run with: the recipe, the stage, where it writes, where its weights come from, the
environment and this process's place in the launched group."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from accelerate import PartialState

from vlm_recipes.decisions import Decision, Environment
from vlm_recipes.families.base import Family
from vlm_recipes.plan import ParallelPlan
from vlm_recipes.ranks import process_state
from vlm_recipes.recipes.schema import Recipe, Stage

log = logging.getLogger("vlm_recipes.stages.run")


@dataclass
class StageContext:
    recipe: Recipe
    stage: Stage
    index: int  # 1-based
    stage_dir: Path
    source: str  # resolved init_from: a model id or directory
    env: Environment
    family: Family  # the source's model family, known when the run planned the stage (runner.py)
    model_config: object = None  # the source's config, as the family was read from it (runner.py)
    state: PartialState = field(default_factory=process_state)  # this process's place in the group
    parallel: ParallelPlan = field(default_factory=lambda: ParallelPlan("single", 1))
    decisions: list[Decision] = field(default_factory=list)
    data_paths: dict[str, str] = field(default_factory=dict)  # demo data ids → their files (runner.py)

    def record(self, *decisions: Decision | None) -> None:
        """The one place a stage's decisions are kept (for report.json) and logged, as they are made; the
        guards, speed-ups and trainers that make them return them. None: nothing was decided."""
        for decision in decisions:
            if decision is not None:
                self.decisions.append(decision)
                if self.is_main:
                    log.info("  %s", decision)

    @property
    def is_main(self) -> bool:
        """Only rank 0 writes the stage directory; the others wait at barriers."""
        return self.state.is_main_process

    @property
    def distributed(self) -> bool:
        return self.state.num_processes > 1

    @property
    def title(self) -> str:
        return f"stage {self.index} `{self.stage.name}`"
