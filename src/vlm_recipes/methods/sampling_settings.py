"""What the sampling methods share (method: grpo, rloo; methods/grpo.py and rloo.py): the settings of their
sections that mean the same in both (rewards, group size, completion length, sampling switches) and the
checks of a stage that samples, which no single key shows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vlm_recipes.recipes.fields import ABOVE_0, AT_LEAST_0, AT_LEAST_1, Range, doc, longest_in_tokens
from vlm_recipes.recipes.schema import Stage
from vlm_recipes.recipes.validate import Problem

VllmMode = Literal["colocate", "server"]
BoxFormat = Literal["same", "pixels", "relative_1000", "resized_pixels"]  # methods/grounding.py


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


def merged_sampling_problem(stage: Stage) -> str | None:
    """Why a stage's LoRA adapter cannot be merged for sampling, as far as the recipe says (the model's own
    layers are checked once it is built: speedups/merged_sampling.py)."""
    if stage.settings.use_vllm:
        return f"{stage.method}.use_vllm samples with vLLM, which merges the adapter itself"
    if "lora" not in (stage.train.vision, stage.train.projector, stage.train.llm):
        return "no role trains with LoRA: there is no adapter to merge"
    if stage.quantized:
        return f"quantization.mode {stage.quantization.mode}: a quantized base cannot take the merged weights"
    return None


def sampling_problems(stage: Stage, at: str) -> list[Problem]:
    """A step's completions are whole groups of `num_generations`; the prompt leaves room for the completion
    (`at`: the stage's key path, as errors name it)."""
    problems = []
    g, t, section = stage.settings, stage.training, f"{at}.{stage.method}"
    completions = t.per_device_batch_size * t.gradient_accumulation_steps
    if completions % g.num_generations:
        problems.append(
            Problem(
                f"{at}.training.per_device_batch_size",
                f"{t.per_device_batch_size} x gradient_accumulation_steps {t.gradient_accumulation_steps} = "
                f"{completions} completions a step, not a multiple of {stage.method}.num_generations "
                f"{g.num_generations}: a step must hold whole prompt groups",
            )
        )
    no_room = stage.data.max_length is not None and stage.data.max_length <= g.max_completion_length
    if g.max_prompt_length is None and no_room:
        problems.append(
            Problem(
                f"{section}.max_completion_length",
                f"{g.max_completion_length} leaves no room for the prompt in data.max_length "
                f"{stage.data.max_length}: raise data.max_length or set {stage.method}.max_prompt_length",
            )
        )
    if g.sample_with_merged_lora and (why := merged_sampling_problem(stage)):
        problems.append(Problem(f"{section}.sample_with_merged_lora", f"{why}: remove it"))
    if g.inverse_cdf_sampling and g.use_vllm:
        problems.append(
            Problem(
                f"{section}.inverse_cdf_sampling",
                f"{stage.method}.use_vllm samples with vLLM, which draws its tokens: remove it",
            )
        )
    # the rewards themselves (names, keys, a user's module:function) are checked by cli/jobs.py, which may
    # import the reward functions' floor (methods/)
    return problems
