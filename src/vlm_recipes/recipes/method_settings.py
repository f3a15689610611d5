"""The settings of the stage methods beside SFT (the recipe's `dpo:`, `kto:`, `grpo:` and `rloo:` sections):
part of the recipe schema (schema.py), kept apart only to keep each file short."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vlm_recipes.recipes.fields import ABOVE_0, AT_LEAST_0, AT_LEAST_1, Range, doc

GrpoLoss = Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo"]
RewardScaling = Literal["group", "batch", "none"]
VllmMode = Literal["colocate", "server"]
ImportanceSamplingLevel = Literal["token", "sequence"]
KtoLoss = Literal["kto", "apo_zero_unpaired"]
BoxFormat = Literal["same", "pixels", "relative_1000", "resized_pixels"]  # methods/grounding.py
DpoLoss = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
]


def longest_in_tokens(what: str, longer: str, otherwise: str):
    """A method's length limit, off (null) by default: what a row may hold at most, in tokens; a longer row
    is refused or skipped, never cut (cutting would drop image tokens or the answer)."""
    return doc(
        f"longest {what} in tokens, image tokens included; a longer {longer} is a data error, never cut; "
        f"null: {otherwise}",
        None,
        range=AT_LEAST_1,
    )


@dataclass
class DpoSettings:
    """Preference training (method: dpo): TRL's DPOTrainer on prompt / chosen / rejected rows."""

    beta: float = doc(
        "strength of the pull towards the reference model (the stage's start); lower: the policy may drift "
        "further from it",
        0.1,
        range=ABOVE_0,
    )
    loss_type: DpoLoss = doc(
        "TRL's DPO loss: sigmoid (the DPO paper), hinge, ipo, robust, apo_zero, ...", "sigmoid"
    )
    max_length: int | None = longest_in_tokens(
        "prompt + answer (chosen or rejected)", "pair", "data.max_length"
    )


@dataclass
class KtoSettings:
    """Preference training from answers marked good or bad (method: kto): TRL's KTOTrainer on prompt /
    completion / label rows, or on preference pairs (each pair unpaired: chosen good, rejected bad)."""

    beta: float = doc(
        "strength of the pull towards the reference model (the stage's start)", 0.1, range=ABOVE_0
    )
    loss_type: KtoLoss = doc("TRL's KTO loss: kto (the KTO paper) or apo_zero_unpaired", "kto")
    desirable_weight: float = doc(
        "weight of the good answers' loss (raise it where good answers are fewer than bad ones)",
        1.0,
        range=ABOVE_0,
    )
    undesirable_weight: float = doc("weight of the bad answers' loss", 1.0, range=ABOVE_0)
    max_length: int | None = longest_in_tokens("prompt + answer", "row", "data.max_length")


@dataclass
class RewardSettings:
    """One reward of a GRPO stage; the stage's reward is the weighted sum of its rewards."""

    name: str = doc(
        "exact_match (1 when the completion equals the row's `solution`, normalized as the eval scores it), "
        "json_f1 (field F1 of the completion's JSON against the `solution` JSON), format (1 when the whole "
        "completion matches `pattern`), length (1 at or below `target_length` tokens, falling linearly to 0 "
        "at twice it), iou (IoU of the completion's first box, [x1, y1, x2, y2] or (x1,y1),(x2,y2), with "
        "the `solution`'s), or your own `module:function` with TRL's reward signature",
        "exact_match",
    )
    weight: float = doc("its weight in the stage's reward", 1.0)
    pattern: str | None = doc(
        "format: the regular expression the whole completion must match, e.g. "
        "'<think>.*?</think>\\s*<answer>.*?</answer>'",
        None,
    )
    target_length: int | None = doc(
        "length: completions up to this many tokens get the full reward", None, range=AT_LEAST_1
    )
    box_format: BoxFormat | None = doc(
        "iou: how the model writes a box: relative_1000 (0-1000 across the image: Qwen2-VL, Qwen3-VL, "
        "Qwen3.5, GLM-4.xV, InternVL), resized_pixels (pixels of the processor's resized image: Qwen2.5-VL), "
        "pixels, or same (the solution is written in the model's frame); null: the model family's own. The "
        "solution's box is in pixels of the row's image",
        None,
    )


@dataclass
class SampledCompletionSettings:
    """What the reinforcement methods share (method: grpo, rloo): completions sampled per prompt, scored by
    rewards, compared within their prompt's group. Defaults fit a 7B model with LoRA on one 24-80 GB GPU."""

    rewards: list[RewardSettings] = doc(
        "the rewards, summed with their weights", factory=lambda: [RewardSettings()]
    )
    num_generations: int = doc(
        "completions sampled per prompt: the group whose rewards set each completion's advantage; "
        "training.per_device_batch_size counts completions and must be a multiple of it",
        8,
        range=Range(2),
    )
    max_completion_length: int = doc("longest sampled completion, in tokens", 256, range=AT_LEAST_1)
    max_prompt_length: int | None = longest_in_tokens(
        "prompt", "prompt", "data.max_length minus max_completion_length"
    )
    temperature: float = doc("sampling temperature of the completions", 1.0, range=ABOVE_0)
    beta: float = doc(
        "KL penalty towards the reference (the stage's start; with LoRA, the model with its adapter "
        "off); 0: no KL term and no reference pass (DAPO, Dr. GRPO)",
        0.0,
        range=AT_LEAST_0,
    )
    epsilon: float = doc("clipping range of the policy ratio", 0.2, range=ABOVE_0)
    epsilon_high: float | None = doc(
        "upper clipping range of the policy ratio (DAPO: 0.28; GSPO: 4e-4 with epsilon 3e-4); null: epsilon",
        None,
        range=ABOVE_0,
    )
    sample_with_merged_lora: bool = doc(
        "sample the completions with the LoRA adapter merged into a copy of the weights (as vLLM samples "
        "them): no adapter matmuls per sampled token; the loss still reads the log-probabilities through "
        "the adapter. Needs LoRA on a base in full or half precision",
        False,
    )
    inverse_cdf_sampling: bool = doc(
        "draw each sampled token from the cumulative distribution of softmax(logits / temperature) with one "
        "uniform number a row: the same distribution as torch.multinomial's draw, which costs one "
        "exponential per vocabulary entry",
        False,
    )
    cpu_log_probs: bool = doc(
        "on a CPU, compute the log-probability pass's LM head (TRL's fused head) in one vocabulary tile with "
        "bf16 matmuls and fewer element-wise passes: the same function; TRL's own path on a GPU or where the "
        "vocabulary is over one tile (32,768)",
        False,
    )
    use_vllm: bool = doc(
        "sample the completions with vLLM instead of generate(): a GPU and `pip install vllm`; TRL moves the "
        "policy's weights (LoRA merged) into vLLM before each generation",
        False,
    )
    vllm_mode: VllmMode = doc(
        "colocate: vLLM inside the training processes, on their GPUs; server: a separate `trl vllm-serve` "
        "process on GPUs of its own",
        "colocate",
    )
    vllm_gpu_memory_utilization: float = doc(
        "colocate: the share of each GPU's memory vLLM may take (the rest trains)",
        0.3,
        range=Range(0, 1, low_open=True),
    )


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


@dataclass
class RlooSettings(SampledCompletionSettings):
    """REINFORCE Leave-One-Out (method: rloo): TRL's RLOOTrainer on `prompt` rows; a completion's advantage
    is its reward against the mean of the other completions of its group. TRL's default KL term (beta 0.05)."""

    beta: float = doc(
        "KL penalty towards the reference (the stage's start; with LoRA, the model with its adapter off), "
        "as TRL's RLOOTrainer applies it; 0: no reference pass",
        0.05,
        range=AT_LEAST_0,
    )
    normalize_advantages: bool = doc(
        "divide the advantages by their std over the generation batch (mean 0, std 1)", False
    )
