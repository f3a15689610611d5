"""The GRPO stage's method: TRL's GRPOTrainer on prompt rows, rewarded by the recipe's `grpo.rewards`
(methods/rewards.py), with the recipe's resume and per-role learning rates (RecipeTrainerMixin). What any
stage that samples completions shares (SamplingMethod: its prompt length, sampling backend and speed-ups,
reference, trainer construction and metrics) is here too: methods/rloo.py builds RLOO's stage from it.

Its reference model (used only when `grpo.beta` > 0): with LoRA, the same model with its adapter switched
off (TRL's own choice for a PeftModel: no second copy); fully trained roles get a frozen copy, loaded from
the stage's source by TRL, and the plan says so."""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Literal

import torch
from trl import GRPOConfig, GRPOTrainer

from vlm_recipes.data.prompts import PROMPTS, check_prompt_lengths
from vlm_recipes.decisions import Decision, Environment
from vlm_recipes.errors import GuardError
from vlm_recipes.methods.rewards import build_rewards, check_rewards
from vlm_recipes.methods.sampling_settings import SampledCompletionSettings, sampling_problems
from vlm_recipes.methods.trainer import ConfigInputs, RecipeTrainerMixin, TrainerInputs, TrainingMethod
from vlm_recipes.model.build import BuiltModel
from vlm_recipes.recipes.fields import doc
from vlm_recipes.recipes.schema import Stage
from vlm_recipes.speedups import log_probs, sampling

log = logging.getLogger(__name__)

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


class SamplingTrainerMixin:
    """What a sampling stage's trainer (GRPOTrainer, RLOOTrainer: the same sampling and log-probability code
    in TRL 1.16) adds: the sampling speed-ups, and LLaVA-OneVision's per-row image counts."""

    counts_images_per_row: bool = False  # the model's forward takes `batch_num_images` (LLaVA-OneVision)
    sample_with_merged_lora: bool = False  # <method>.sample_with_merged_lora (speedups/sampling.py)
    inverse_cdf_sampling: bool = False  # <method>.inverse_cdf_sampling (speedups/sampling.py)
    cpu_log_probs: bool = False  # <method>.cpu_log_probs (speedups/log_probs.py)

    def _generate_single_turn(self, *args, **kwargs):
        """TRL's sampling, with the sampling speed-ups the stage asks for around it."""
        model = self.accelerator.unwrap_model(self.model)
        with contextlib.ExitStack() as speedups:
            if self.sample_with_merged_lora:
                speedups.enter_context(sampling.lora_merged(model))
            if self.inverse_cdf_sampling:
                speedups.enter_context(sampling.inverse_cdf_sampling(self, model))
            return super()._generate_single_turn(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, num_images=None, **kwargs):
        """LLaVA-OneVision tiles a row's single image ("anyres") but not each of a row's several, and its
        forward tells them apart by `batch_num_images`: TRL 1.16 keeps that field for generation but drops it
        from the log-probability passes, so a prompt of two images met 5 tiles' worth of features where one
        tile each was sent ("split_with_sizes expects split_sizes to sum exactly to 8"). Here the batch goes
        in one chunk with its per-row counts."""
        kwargs.pop("batch_num_images", None)  # from the processor's fields, where TRL passes them all
        with log_probs.cpu_log_probs() if self.cpu_log_probs else contextlib.nullcontext():
            return self._log_probs_with_image_counts(model, input_ids, *args, num_images=num_images, **kwargs)

    def _log_probs_with_image_counts(self, model, input_ids, *args, num_images=None, **kwargs):
        if not (self.counts_images_per_row and num_images is not None):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, *args, num_images=num_images, **kwargs
            )
        counts = torch.tensor(num_images, device=input_ids.device)

        def with_counts(module, positional, keywords):
            return positional, {**keywords, "batch_num_images": counts}

        hook = model.register_forward_pre_hook(with_counts, with_kwargs=True)
        try:
            kwargs["batch_size"] = input_ids.size(0)  # one chunk: the counts are the whole batch's
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, *args, num_images=num_images, **kwargs
            )
        finally:
            hook.remove()


def reference_decision(built: BuiltModel, stage: Stage) -> Decision:
    """What the KL term compares against (nothing when beta is 0)."""
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


def sampling_speedups(trainer: SamplingTrainerMixin, model, stage: Stage) -> list[Decision]:
    """Switch on the sampling speed-ups the stage asks for (speedups/sampling.py); a refusal names why."""
    chosen, section = [], stage.method
    if stage.settings.sample_with_merged_lora:
        sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled
        why = "the weights are sharded across ranks" if sharded else sampling.merged_sampling_refusal(model)
        if why:
            raise GuardError(
                f"stage {stage.name}: {section}.sample_with_merged_lora is refused: {why}. Remove it"
            )
        trainer.sample_with_merged_lora = True
        chosen.append(
            Decision(
                "merged-sampling",
                "completions sampled with the LoRA adapter merged into a copy of the weights",
                f"{section}.sample_with_merged_lora is on: no adapter matmuls per sampled token; the loss "
                "still reads log-probabilities through the adapter, and the original weights are put back",
            )
        )
    if stage.settings.inverse_cdf_sampling:
        if why := sampling.inverse_cdf_refusal(trainer.args):
            raise GuardError(
                f"stage {stage.name}: {section}.inverse_cdf_sampling is refused: {why}. Remove it"
            )
        trainer.inverse_cdf_sampling = True
        chosen.append(
            Decision(
                "inverse-cdf-sampling",
                "each token drawn from the cumulative distribution of softmax(logits / temperature)",
                f"{section}.inverse_cdf_sampling is on: the same distribution as torch.multinomial's draw, "
                "one random number a row instead of one exponential per vocabulary entry",
            )
        )
    if stage.settings.cpu_log_probs:
        trainer.cpu_log_probs = True
        chosen.append(
            Decision(
                "cpu-log-probs",
                "the log-probability pass's LM head in one vocabulary tile, bf16 matmuls (on a CPU)",
                f"{section}.cpu_log_probs is on: TRL's fused head off a GPU runs its gradient matmuls in fp32 "
                "and ~10 element-wise passes over the logits; the same function in fewer (TRL's own on a GPU)",
            )
        )
    return chosen


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

    row_format = PROMPTS
    check_lengths = staticmethod(check_prompt_lengths)
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


class RecipeGRPOTrainer(SamplingTrainerMixin, RecipeTrainerMixin, GRPOTrainer):
    """The GRPO stage's trainer."""


class GRPO(SamplingMethod):
    """Sampled completions scored by the recipe's rewards, the `grpo:` section: a completion's advantage is
    its reward against its group's mean (and std)."""

    name = "grpo"
    settings = GrpoSettings
    trainer_class = RecipeGRPOTrainer

    def build_config(self, inputs: ConfigInputs) -> GRPOConfig:
        g = inputs.stage.settings
        return GRPOConfig(
            **self.sampling_keywords(inputs),
            loss_type=g.loss_type,
            importance_sampling_level=g.importance_sampling_level,
            scale_rewards=g.scale_rewards,
        )
