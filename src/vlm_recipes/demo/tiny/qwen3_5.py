"""The tiny offline Qwen3.5 (`demo:tiny-qwen3.5`) and Qwen3.5-MoE (`demo:tiny-qwen3.5-moe`): Qwen3-VL's
special tokens and processor, Qwen3.5's tokenizer class and pre-tokenizer, the thinking chat template, a
hybrid language model (Gated DeltaNet layers beside full-attention ones), and for the MoE a few routed
experts beside a shared one."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel
from vlm_recipes.demo.tiny.dims import TINY_MOE_DIMS
from vlm_recipes.demo.tiny.qwen2_vl import save_qwen_vl
from vlm_recipes.demo.tiny.qwen3_vl import qwen3_text_config, qwen3_vision_config, qwen3_vl_processor


def build_tiny_qwen3_5(out: Path, dims: dict, corpus: list[str]) -> None:
    import transformers
    from trl.chat_template_utils import qwen3_5_think_chat_template

    # Qwen3.5-4B and larger ship the thinking template (2B and smaller the same with thinking off by
    # default); TRL swaps in its training variant, which always writes the <think> block and marks
    # the assistant's output with {% generation %}.
    processor = qwen3_vl_processor(corpus, dims, qwen3_5_think_chat_template, qwen3_5=True)
    tok = processor.tokenizer
    text = qwen3_text_config(
        tok,
        dims,
        rope_theta=1e7,
        # rotary on a quarter of each head, interleaved t/h/w as Qwen3-VL's (the real [11, 11, 10] of 32)
        rope={"partial_rotary_factor": 0.25},
        **hybrid_attention_fields(dims),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )
    moe = "experts" in dims
    if moe:
        text |= {
            "num_experts": dims["experts"],
            "num_experts_per_tok": dims["experts_per_token"],
            "moe_intermediate_size": dims["expert_intermediate"],
            "shared_expert_intermediate_size": dims["expert_intermediate"],
        }
        del text["intermediate_size"]  # every layer's MLP is the sparse block
    model_class = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )
    save_qwen_vl(out, model_class, processor, dims, text, qwen3_vision_config(dims))


def hybrid_attention_fields(dims: dict) -> dict:
    """The text config fields of Qwen3.5's hybrid layers (Gated DeltaNet beside full attention; MiniCPM-V
    4.6's text model is Qwen3.5's): which layer is which, and the Gated DeltaNet heads."""
    return {
        "layer_types": dims["layer_types"],
        "linear_num_key_heads": dims["linear_key_heads"],
        "linear_num_value_heads": dims["linear_value_heads"],
        "linear_key_head_dim": dims["linear_head_dim"],
        "linear_value_head_dim": dims["linear_head_dim"],
    }


# What build_tiny_qwen3_5 builds, one dict per demo model (BUILDS below)
TINY = {
    "hidden": 64,
    "intermediate": 128,
    # Gated DeltaNet, Gated DeltaNet, full attention: the real 3:1 pattern cut to one full layer, which is
    # last as in every published size (the loss-positions speed-up cuts a full-attention layer)
    "layers": 3,
    "layer_types": ["linear_attention", "linear_attention", "full_attention"],
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 32,  # a quarter of it rotary: 8 dimensions, 4 frequencies
    "mrope": [2, 1, 1],
    "linear_key_heads": 2,
    "linear_value_heads": 4,
    "linear_head_dim": 16,
    "vision_depth": 2,
    "vision_dim": 32,
    "vision_intermediate": 64,
    "vision_heads": 2,
    "vision_positions": 64,  # an 8x8 learned grid (the real one: 48x48 = 2304)
    "max_pixels": 32 * 32 * 16,  # at most 16 merged image tokens per image: fast on CPU
}


TINY_MOE = {**TINY, **TINY_MOE_DIMS}  # beside one shared expert (the real: 256 routed, eight per token)


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-qwen3.5": TinyModel("qwen3_5", build_tiny_qwen3_5, TINY),
    "demo:tiny-qwen3.5-moe": TinyModel("qwen3_5_moe", build_tiny_qwen3_5, TINY_MOE),
}
