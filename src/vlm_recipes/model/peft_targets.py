"""Keep PEFT from rewriting a GLM-4.5V LoRA's targets.

PEFT (0.19) converts every LoRA config of a model type transformers 5 fuses the experts of (its
`_MODEL_TO_CONVERSION_PATTERN`), so that adapters trained on transformers 4's per-expert `nn.Linear` still load:
a target module ending in `.gate_proj`, `.up_proj` or `.down_proj` becomes the fused experts' `gate_up_proj` /
`down_proj` parameters, one ending in `.gate` the router. GLM-4.5V (`glm4v_moe`, mapped as `qwen2_moe`) has real
`nn.Linear` layers under those names beside its experts: layer 0's dense MLP and every layer's shared expert. A
stage adapting the language model's linear layers would lose them and adapt all experts and the router instead
(and stop: those take no dropout). The adapters here are trained with transformers 5 and name their targets in
full, so PEFT's table loses `glm4v_moe` (its own copy: transformers' loading of the published per-expert weights
is untouched). tests/test_family_glm4v.py pins it.
"""

from __future__ import annotations

# model types whose LoRA targets this runner names itself (full module names, experts only when asked)
NAMED_TARGETS = ("glm4v_moe",)


def keep_lora_targets_as_named() -> None:
    """Drop NAMED_TARGETS from PEFT's v4-to-v5 conversion table (idempotent)."""
    from peft.utils import transformers_weight_conversion

    for model_type in NAMED_TARGETS:
        transformers_weight_conversion._MODEL_TO_CONVERSION_PATTERN.pop(model_type, None)
