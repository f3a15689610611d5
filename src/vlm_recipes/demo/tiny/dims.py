"""The tiny models' sizes, and the config fields the builders make of them: the language model's and the
vision tower's, as most families name them (a family's own fields are added or replace them)."""

from __future__ import annotations

# Every tiny model's language model: 64 wide, 2 layers, 4 query heads over 2 key/value heads (head_dim 16)
TINY_TEXT_DIMS = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2}
# and its vision tower: 32 wide, 2 layers of 2 heads
TINY_VISION_DIMS = {"vision_layers": 2, "vision_dim": 32, "vision_intermediate": 64, "vision_heads": 2}
# and a mixture-of-experts model's experts: 4 routed, 2 of them per token, each 32 wide
TINY_MOE_DIMS = {"experts": 4, "experts_per_token": 2, "expert_intermediate": 32}


def tiny_text_config(tok, dims: dict, **fields) -> dict:
    """A tiny language model's config fields: the vocabulary (the dims' `vocab`, else the tokenizer's
    rounded up to a multiple of 64; the tokenizer never yields the rest), `dims`' sizes and 4096
    positions, then the family's own `fields` (which may replace any of them)."""
    return {
        **({"model_type": fields.pop("model_type")} if "model_type" in fields else {}),
        "vocab_size": dims.get("vocab", -(-len(tok) // 64) * 64),
        "hidden_size": dims["hidden"],
        "intermediate_size": dims["intermediate"],
        "num_hidden_layers": dims["layers"],
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv_heads"],
        "max_position_embeddings": 4096,
        **fields,
    }


def deepseek_moe_fields(dims: dict) -> dict:
    """DeepSeek-V3's mixture-of-experts config fields, routed as GLM-4.5V and Kimi K2.5 publish it: the first
    `dense_layers` layers dense, then `dims`' routed experts beside one shared expert, one group, the top-k
    renormalized."""
    return {
        "first_k_dense_replace": dims["dense_layers"],
        "n_routed_experts": dims["experts"],
        "num_experts_per_tok": dims["experts_per_token"],
        "moe_intermediate_size": dims["expert_intermediate"],
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
    }


def tiny_vision_config(dims: dict, **fields) -> dict:
    """A tiny vision tower's config fields: `dims`' vision sizes, then the family's own `fields` (which
    may replace any of them)."""
    return {
        **({"model_type": fields.pop("model_type")} if "model_type" in fields else {}),
        "hidden_size": dims["vision_dim"],
        "intermediate_size": dims["vision_intermediate"],
        "num_hidden_layers": dims["vision_layers"],
        "num_attention_heads": dims["vision_heads"],
        **fields,
    }


def siglip_vision_config(dims: dict, image_size: int) -> dict:
    """A SigLIP tower of 14 px patches without its pooling head (Gemma 3's and LLaVA-OneVision's)."""
    return tiny_vision_config(
        dims, model_type="siglip_vision_model", image_size=image_size, patch_size=14, vision_use_head=False
    )
