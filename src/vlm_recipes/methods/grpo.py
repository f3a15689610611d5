"""The GRPO stage's method: TRL's GRPOTrainer on prompt rows, rewarded by the recipe's `grpo.rewards`
(methods/rewards.py), with the recipe's resume and per-role learning rates (RecipeTrainerMixin). What any
stage that samples completions shares (SamplingMethod: its prompt length, sampling backend and speed-ups,
reference, trainer construction and metrics) is here too: methods/rloo.py builds RLOO's stage from it.

Its reference model (used only when `grpo.beta` > 0): with LoRA, the same model with its adapter switched
off (TRL's own choice for a PeftModel: no second copy); fully trained roles get a frozen copy, loaded from
the stage's source by TRL, and the plan says so."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from vlm_recipes.errors import GuardError
from vlm_recipes.methods.sampling_settings import SampledCompletionSettings, sampling_problems
from vlm_recipes.methods.trainer import ConfigInputs, StageParts, TrainerInputs, TrainingMethod
from vlm_recipes.recipes.fields import doc
from vlm_recipes.recipes.schema import Stage

if TYPE_CHECKING:
    from trl import GRPOConfig

    from vlm_recipes.decisions import Decision, Environment
    from vlm_recipes.methods.recipe_trainer import RecipeTrainerMixin
    from vlm_recipes.model.build import BuiltModel

# The keys of a `grpo:` or `rloo:` section that TRL's GRPOConfig and RLOOConfig take under the same name.
SAME_NAME_IN_TRL = [
    "num_generations",
    "max_completion_length",
    "temperature",
    "beta",
    "epsilon",
    "epsilon_high",
    "use_vllm",
    "vllm_mode",
    "vllm_gpu_memory_utilization",
]


def reference_decision(built: BuiltModel, stage: Stage) -> Decision:
    """What the KL term compares against (nothing when beta is 0)."""
    from vlm_recipes.decisions import Decision

    guard, section = f"{stage.method}-reference", stage.method
    if stage.settings.beta == 0:
        return Decision(guard, "none", f"{section}.beta is 0: no KL term, no reference pass")
    if "full" not in (stage.train.vision, stage.train.projector, stage.train.llm):
        return Decision(guard, "the model with its LoRA adapter switched off", "no second model copy")
    return Decision(
        guard,
        f"a frozen copy loaded from {built.source}",
        "fully trained weights: no adapter to switch off (a second model in memory)",
    )


# TRL's per-step logs that say how the policy moves: reward (total and per function), completion lengths,
# how many hit max_completion_length, and the KL to the reference (beta > 0).
_CURVE_KEYS = {
    "reward": "reward",
    "reward_std": "reward_std",
    "completions/mean_length": "completion_length",
    "completions/clipped_ratio": "clipped_ratio",
    "kl": "kl",
}


class SamplingMethod(TrainingMethod):
    """What GRPO and RLOO share: `prompt` rows, completions sampled per prompt and scored by the recipe's
    rewards, the reward measured before step 1 too and its curve in metrics.json."""

    eval_at_start = True
    loss_kind = "policy"
    measures = {"eval_reward": ("reward", True)}
    measured_before = ("eval_reward",)

    def has_reference(self, stage: Stage) -> bool:
        """A reference pass only with a KL term (beta > 0)."""
        return stage.settings.beta > 0

    def problems(self, stage: Stage, at: str, earlier: list[Stage]) -> list:
        return super().problems(stage, at, earlier) + sampling_problems(stage, at)

    def max_length(self, stage: Stage) -> int | None:
        """Longest prompt: <method>.max_prompt_length, else what data.max_length leaves beside the longest
        completion (<method>.max_completion_length)."""
        if stage.settings.max_prompt_length is not None:
            return stage.settings.max_prompt_length
        if stage.data.max_length is None:
            return None
        return stage.data.max_length - stage.settings.max_completion_length

    def check_environment(self, stage: Stage, env: Environment) -> Decision | None:
        """Before loading: a stage that samples with vLLM (<method>.use_vllm) needs a GPU and vllm importable;
        TRL would otherwise fail after the model loaded."""
        from vlm_recipes.decisions import Decision

        if not stage.settings.use_vllm:
            return None
        g, section = stage.settings, stage.method
        key = f"stage {stage.name}: {section}.use_vllm"
        if env.device != "cuda":
            raise GuardError(
                f"{key} needs a GPU: vLLM does not sample on this machine's CPU. Set {section}.use_vllm: false"
            )
        try:
            import vllm
        except ImportError as exc:
            raise GuardError(
                f"{key}: vllm cannot be imported here ({exc}): pip install vllm (the versions TRL supports: "
                f"pip install 'trl[vllm]'), or set {section}.use_vllm: false"
            ) from None
        return Decision(
            "generation",
            f"vLLM {vllm.__version__}, {g.vllm_mode}",
            f"{section}.use_vllm: completions sampled by vLLM, the policy's weights moved into it each generation",
        )

    def sampling_keywords(self, inputs: ConfigInputs) -> dict:
        """The keywords GRPOConfig and RLOOConfig share, from the stage's grpo or rloo section."""
        g = inputs.stage.settings
        common = inputs.common_keywords()
        # TRL evaluates whole prompt groups: one eval prompt's `num_generations` completions per eval batch.
        common["per_device_eval_batch_size"] = g.num_generations
        return dict(
            **common,
            **{key: getattr(g, key) for key in SAME_NAME_IN_TRL},
            reward_weights=[reward.weight for reward in g.rewards],
        )

    def make_trainer(self, inputs: TrainerInputs) -> RecipeTrainerMixin:
        """The stage's GRPOTrainer or RLOOTrainer, its rewards checked on a training row first, with the
        parallelism and trainable-dtype guards applied."""
        from vlm_recipes.methods.rewards import build_rewards, check_rewards
        from vlm_recipes.methods.sampling_trainers import sampling_speedups

        built, stage = inputs.built, inputs.stage
        where = f"stage {stage.name}: {stage.method}.rewards"
        rewards, _ = build_rewards(
            stage.settings.rewards,
            built.processor,
            where,
            tolerance=stage.evaluation.numeric_tolerance,
            family_box_format=built.family.box_format,
        )
        check_rewards(rewards, inputs.data.train[0], where)
        inputs.record(reference_decision(built, stage))
        unused = ("padding_free", "preprocessed_cache", "group_by_length")
        inputs.warn_unused(unused, "TRL samples its own batches")
        trainer = self.construct_trainer(inputs, reward_funcs=rewards)
        model = trainer.accelerator.unwrap_model(trainer.model)
        forward = type(model.get_base_model() if hasattr(model, "get_base_model") else model).forward
        trainer.counts_images_per_row = "batch_num_images" in inspect.signature(forward).parameters
        for decision in sampling_speedups(trainer, model, stage):
            inputs.record(decision)
        return self.prepare_trainer(trainer, inputs)

    def eval_metrics(self, eval_metrics: dict) -> dict:
        """Eval reward from TRL: mean and std over the eval prompts' completions, and each reward's mean."""
        found = {
            "eval_reward": eval_metrics.get("eval_reward"),
            "eval_reward_std": eval_metrics.get("eval_reward_std"),
        }
        for key, value in eval_metrics.items():
            if key.startswith("eval_rewards/") and key.endswith("/mean"):
                found[f"eval_reward:{key.split('/')[1]}"] = value
        return found

    def train_metrics(self, history: list[dict]) -> dict:
        """The reward curve: one point per logged step."""
        curve = []
        for entry in history:
            if "reward" not in entry:
                continue
            point = {"step": entry["step"]}
            point |= {name: entry[key] for key, name in _CURVE_KEYS.items() if key in entry}
            point |= {
                f"reward:{key.split('/')[1]}": value
                for key, value in entry.items()
                if key.startswith("rewards/") and key.endswith("/mean")
            }
            curve.append(point)
        return {"reward_curve": curve}


GrpoLoss = Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo"]
RewardScaling = Literal["group", "batch", "none"]
ImportanceSamplingLevel = Literal["token", "sequence"]


@dataclass
class GrpoSettings(SampledCompletionSettings):
    """Reinforcement learning with verifiable rewards (method: grpo): TRL's GRPOTrainer on `prompt` rows; a
    completion's advantage is its reward against its group's mean (and std)."""

    loss_type: GrpoLoss = doc(
        "TRL's loss: dapo (tokens normalized over the batch), grpo (per sequence), dr_grpo (by a constant), "
        "bnpo, cispo, sapo",
        "dapo",
    )
    importance_sampling_level: ImportanceSamplingLevel = doc(
        "the policy ratio per token (GRPO, DAPO) or one per completion, the mean of its tokens' log-ratios "
        "(sequence: GSPO, the method Qwen3's RL used)",
        "token",
    )
    scale_rewards: RewardScaling = doc(
        "divide advantages by the reward std of the group (GRPO), of the batch, or not at all (Dr. GRPO)",
        "group",
    )


class GRPO(SamplingMethod):
    """Sampled completions scored by the recipe's rewards, the `grpo:` section: a completion's advantage is
    its reward against its group's mean (and std)."""

    name = "grpo"
    settings = GrpoSettings

    def parts(self) -> StageParts:
        from vlm_recipes.data.prompts import PROMPTS, check_prompt_lengths
        from vlm_recipes.methods.sampling_trainers import RecipeGRPOTrainer

        return StageParts(PROMPTS, check_prompt_lengths, RecipeGRPOTrainer)

    def build_config(self, inputs: ConfigInputs) -> GRPOConfig:
        from trl import GRPOConfig

        g = inputs.stage.settings
        return GRPOConfig(
            **self.sampling_keywords(inputs),
            loss_type=g.loss_type,
            importance_sampling_level=g.importance_sampling_level,
            scale_rewards=g.scale_rewards,
        )
