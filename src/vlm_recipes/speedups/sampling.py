"""A GRPO stage's completions sampled faster, each speed-up switchable: the LoRA adapter merged into the
weights while sampling (`grpo.sample_with_merged_lora`), and each token drawn from the cumulative
distribution with one uniform number a row instead of torch.multinomial (`grpo.inverse_cdf_sampling`).

generate() runs the model once per sampled token, and sampling is most of a GRPO step. On the wide bench
model (GRPO at r6's settings: 8 completions of 128 tokens, bf16, 2 threads of an Intel Xeon, py-spy) the
adapter's own matmuls were ~16 % of sampling and torch.multinomial ~9 %. torch.multinomial's one-sample
draw is the exponential race (argmax of probabilities / Exp(1) noise): one exponential per vocabulary entry,
4.9 ms a token for 8 rows over the wide model's 21,760 entries and 45 ms over Qwen2-VL's 151,936 on that CPU
(the whole forward of the wide model's language model is ~45 ms).

Merged adapter. Before each generate(), every LoRA layer's merged weight W + scale * B @ A (one addmm in
W's dtype) is computed into a new tensor and the adapter is switched off (PEFT's `disable_adapter`); afterwards the original weight tensors are put back,
untouched. Not PEFT's in-place merge and unmerge: in bf16 W + D - D is not W, and the frozen base would
drift a little every step. The log-probabilities the loss and its ratio read come from the training pass,
through the adapter, as before. The distribution the completions are drawn from moves by the rounding of the
merged weights, and by LoRA dropout where it is on (TRL samples in training mode, so the unmerged adapter
samples through its dropout; the merged weights have none): with lora.dropout 0 in fp32 the same completions
and weights (tests/test_sampling_speedups.py), otherwise other draws (TRL's vLLM path samples from merged weights the
same way). It costs one copy of the adapted weights while sampling. Where a merge is not the same function
(a 4-bit or 8-bit base, DoRA, experts adapted by parameter) it is refused with the reason.

Inverse-CDF draws. The cumulative sum of softmax(logits / T) (in float64) and one uniform number u per row:
the token whose interval [cdf[i-1], cdf[i]) holds u * cdf[-1] is a draw from softmax(logits / T), the
distribution torch.multinomial draws from, for one pass over the vocabulary and one random number a row:
0.5 ms a token on the wide model (8 rows), 14 ms at Qwen2-VL's vocabulary. A token of probability 0 (the
suppressed image token) has an empty interval and is never drawn. TRL hands generate() a config and no logits
processor, so for the generation the config says greedy (do_sample False, no temperature) and generate() is
given the processor that draws the token and leaves only it finite; the processors generate() runs itself
come first, as they do before a multinomial draw. It is refused where TRL's config filters the distribution
(top_p, top_k, min_p, a repetition penalty, generation_kwargs): those filters run only when generate()
samples. (The Gumbel-max trick, argmax(logits / T + Gumbel noise), draws the same distribution but costs one
noise draw per entry, as multinomial does: measured slower, 6.1 ms against 4.9.)
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList


def lora_layers(model: nn.Module) -> list[LoraLayer]:
    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def merged_sampling_refusal(model: nn.Module) -> str | None:
    """Why this model's adapter cannot be merged for sampling; None where it can."""
    layers = lora_layers(model)
    if not layers or not hasattr(model, "disable_adapter"):
        return "the model has no LoRA adapter (train a role with lora)"
    for layer in layers:
        base = layer.get_base_layer()
        if type(base) is not nn.Linear or not base.weight.dtype.is_floating_point:
            return (
                f"an adapted layer's base is {type(base).__name__}, not a linear layer in full or half "
                "precision (a quantized base cannot take the merged weights; experts adapted by parameter "
                "are not merged here)"
            )
        if any(layer.use_dora.get(adapter) for adapter in layer.active_adapters):
            return "DoRA's magnitude vector is not a weight delta"
        if getattr(layer, "fan_in_fan_out", False):
            return "an adapted layer stores its weight transposed (fan_in_fan_out)"
    return None


@contextlib.contextmanager
def lora_merged(model: nn.Module):
    """Within: every LoRA layer computes with W + scale * B @ A and the adapters are off; after: the original
    weights (the same tensors) and adapters are back. Each merged weight is one fused addmm in W's dtype
    (the factors rounded to it, the product accumulated in fp32 and the sum rounded once): PEFT's
    `get_delta_weight` would first build the delta as a full fp32 matrix, which on the wide bench model
    took most of what merging saves."""
    saved = []
    try:
        with torch.no_grad():
            for layer in lora_layers(model):
                base = layer.get_base_layer()
                merged = base.weight.data
                for adapter in (a for a in layer.active_adapters if a in layer.lora_A):
                    down, up = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
                    scale = layer.scaling[adapter]
                    merged = torch.addmm(merged, up.to(merged.dtype), down.to(merged.dtype), alpha=scale)
                saved.append((base, base.weight.data))
                base.weight.data = merged
        with model.disable_adapter():
            yield
    finally:
        for base, weight in saved:
            base.weight.data = weight


class InverseCdfDraw(LogitsProcessor):
    """Draws each row's token from softmax(scores / temperature) by the inverse of its cumulative
    distribution, and returns scores in which only the drawn token is finite: the argmax greedy decoding takes
    of them is the draw."""

    def __init__(self, temperature: float):
        self.temperature = temperature

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        cdf = torch.softmax(scores.float() / self.temperature, dim=-1).cumsum(-1, dtype=torch.float64)
        uniform = torch.rand((cdf.shape[0], 1), dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, uniform, right=True).clamp_(max=cdf.shape[1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, drawn, 0.0)


FILTERS = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0, "generation_kwargs": None}


def inverse_cdf_refusal(args) -> str | None:
    """Why TRL's sampling settings (a GRPOConfig) are not a plain draw from softmax(logits / T)."""
    if args.use_vllm:
        return "grpo.use_vllm samples with vLLM, which draws its tokens itself"
    changed = [
        f"{key} {getattr(args, key)!r}" for key, plain in FILTERS.items() if getattr(args, key) != plain
    ]
    if changed:
        return f"TRL's sampling filters the distribution ({', '.join(changed)}), which a greedy config drops"
    return None


@contextlib.contextmanager
def inverse_cdf_sampling(trainer, model: nn.Module):
    """Within: TRL's generate() call on `model` draws each token by the inverse of its cumulative distribution."""
    saved = trainer.generation_config, trainer.generation_kwargs
    greedy = copy.deepcopy(trainer.generation_config)
    greedy.do_sample, greedy.temperature = False, None
    trainer.generation_config = greedy
    trainer.generation_kwargs = {**trainer.generation_kwargs, "do_sample": False, "temperature": None}
    draw = LogitsProcessorList([InverseCdfDraw(saved[0].temperature)])
    model.generate = functools.partial(type(model).generate, model, logits_processor=draw)  # this instance
    try:
        yield
    finally:
        del model.generate
        trainer.generation_config, trainer.generation_kwargs = saved
