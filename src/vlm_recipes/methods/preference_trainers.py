"""The DPO and KTO stages' trainers: TRL's DPOTrainer and KTOTrainer with the recipe's mixin, and no second
model for the reference when the stage trains LoRA. Imported when a stage builds its trainer (methods/dpo.py,
methods/kto.py)."""

from __future__ import annotations

from trl import DPOTrainer, KTOTrainer

from vlm_recipes.methods.recipe_trainer import RecipeTrainerMixin

REF_ADAPTER = "ref"  # the adapter copy TRL adds for a PeftModel passed without ref_model


class AdapterOffReferenceMixin:
    """A preference trainer (DPOTrainer, KTOTrainer) whose LoRA reference is the adapter switched off. The
    stage's adapter is fresh (B = 0), so TRL's "ref" copy of it would compute exactly what the base computes;
    without the copy, TRL disables the adapters for the reference pass. That also holds on resume, where the
    restored adapter has moved."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        if self.ref_model is None and REF_ADAPTER in getattr(model, "peft_config", {}):
            model.delete_adapter(REF_ADAPTER)


class RecipeDPOTrainer(AdapterOffReferenceMixin, RecipeTrainerMixin, DPOTrainer):
    """The DPO stage's trainer."""


class RecipeKTOTrainer(AdapterOffReferenceMixin, RecipeTrainerMixin, KTOTrainer):
    """The KTO stage's trainer."""
