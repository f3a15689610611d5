"""Liger's Triton kernels for the model's layers (RMSNorm, LayerNorm, SwiGLU, rotary embeddings) on a GPU.

Applied through transformers' own switch (`integrations.liger.apply_liger_kernel`, what
`use_liger_kernel=True` runs), with Liger's loss kernels off: the loss is TRL's (its chunked, fused LM head
on the labelled positions, never the whole logits) and `training.loss_positions_only` hands that head only
the positions it scores. Liger replaces modules' forwards and module-level functions in place; it computes
the same functions in a different order of operations, so a step agrees with the unpatched one up to
rounding (tests/test_on_a_gpu.py bounds it against what training moves).

Off, with the reason logged, where Liger cannot run: on a CPU (Triton compiles for CUDA), without the
`liger-kernel` package, for a model type Liger has no kernels for, or one its patch cannot import (with
transformers 5.24 and Liger 0.8.5: the Qwen-VL line and GLM-4V-MoE; Qwen3.5, SmolVLM, Gemma 3 and 4, GLM-4V
and InternVL patch).
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import version

from torch import nn
from transformers.integrations.liger import apply_liger_kernel
from transformers.trainer_utils import unwrap_peft_model

from vlm_recipes.decisions import Decision

GUARD = "liger-kernels"
# TRL's fused LM head computes the loss; Liger's would replace the model's forward (TRL refuses that too)
LAYER_KERNELS_ONLY = {"cross_entropy": False, "fused_linear_cross_entropy": False}


def liger_refusal(model: nn.Module) -> str | None:
    """Why Liger's kernels cannot run on this model here (None: they can)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return f"Liger's kernels are Triton kernels for CUDA, and this stage computes on {device.type}"
    if importlib.util.find_spec("liger_kernel") is None:
        return "the liger-kernel package is not installed (pip install liger-kernel)"
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = unwrap_peft_model(model).config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"Liger has no kernels for model type `{model_type}`"
    return None


def off(why: str) -> Decision:
    return Decision(GUARD, "off", f"training.liger_kernels is on, but {why}: the stage trains without them")


def use_liger_kernels(model: nn.Module) -> Decision:
    """Liger's layer kernels patched into `model` where they can run; the decision says which way and why."""
    if why := liger_refusal(model):
        return off(why)
    model_type = unwrap_peft_model(model).config.model_type
    try:
        apply_liger_kernel(model, LAYER_KERNELS_ONLY)
    except ImportError as error:
        # Each of Liger's patch functions imports its model module before it patches anything, so the model is
        # untouched. Seen with Liger 0.8.5 on transformers 5.24 for qwen2_vl, qwen2_5_vl, qwen3_vl and
        # glm4v_moe: Liger subclasses output classes that transformers renamed.
        versions = f"liger-kernel {version('liger-kernel')} with transformers {version('transformers')}"
        return off(f"{versions} cannot patch model type `{model_type}` ({error})")
    return Decision(
        GUARD,
        f"Liger's layer kernels for {model_type} (norms, SwiGLU, rotary embeddings); TRL's fused LM head keeps "
        "the loss",
        "training.liger_kernels is on, the model is on a GPU and liger-kernel is installed: fused Triton kernels "
        "read and write each activation once where torch runs several element-wise kernels",
    )
