"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL as families: their published dimensions (built on the meta device,
no weights), their tiny offline models (real processor classes and chat templates), and every seed
recipe end to end on the tiny Qwen2.5-VL and Qwen3-VL (tests/test_e2e.py runs them on Qwen2-VL).

The speed-ups (packing, per-sample attention, feature cache) and the FLOP formula are checked per family
in tests/test_speedups.py and tests/test_flops.py.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_MODELS, demo_split, distance_and_share_beyond, model_inputs
from PIL import Image
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

from vlm_recipes.benchmarking.flops import flops_per_sample
from vlm_recipes.cli.train import main
from vlm_recipes.data.lengths import sample_lengths
from vlm_recipes.errors import LoraTargetError, UnsupportedModelError
from vlm_recipes.families import FAMILIES, family_for_model_type
from vlm_recipes.families.glm4v_template import GLM4V_CHAT_TEMPLATE
from vlm_recipes.families.internvl import INTERNVL_CHAT_TEMPLATE
from vlm_recipes.families.llava_onevision import LLAVA_ONEVISION_CHAT_TEMPLATE
from vlm_recipes.families.mistral3_template import MISTRAL3_CHAT_TEMPLATE
from vlm_recipes.families.parameters import (
    lora_target_modules,
    lora_target_parameters,
    params_by_role,
    routed_experts,
)
from vlm_recipes.files import read_json
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings

ROLES = ("vision", "projector", "llm")


def qwen2_vl_config(hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int, tie: bool) -> dict:
    """The fields of a Qwen2-VL config.json that shape the model (flat, as published)."""
    return {
        "model_type": "qwen2_vl",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": 28,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {
            "depth": 32,
            "embed_dim": 1280,
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_chans": 3,
            "hidden_size": hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        },
    }


def qwen2_5_vl_config(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tie: bool
) -> dict:
    return {
        "model_type": "qwen2_5_vl",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {
            "depth": 32,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
    }


def qwen3_vl_config(
    hidden: int,
    intermediate: int,
    tie: bool,
    depth: int,
    width: int,
    mlp: int,
    deepstack: list[int],
    layers: int = 36,
    kv_heads: int = 8,
    moe: dict | None = None,
) -> dict:
    """Qwen3-VL's config.json nests text_config and vision_config; `moe`: the MoE's text keys
    (qwen3_vl_moe)."""
    return {
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
        "tie_word_embeddings": tie,
        "text_config": {
            **(moe or {}),
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": 32,
            "num_key_value_heads": kv_heads,
            "head_dim": 128,
            "vocab_size": 151936,
            "tie_word_embeddings": tie,
            "rope_theta": 5000000,
            "rope_scaling": {
                "mrope_interleaved": True,
                "mrope_section": [24, 20, 20],
                "rope_type": "default",
            },
        },
        "vision_config": {
            "depth": depth,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": width,
            "intermediate_size": mlp,
            "num_heads": 16,
            "in_channels": 3,
            "out_hidden_size": hidden,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": deepstack,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }


def qwen3_5_config(
    hidden: int, layers: int, kv_heads: int, moe: dict | None = None, intermediate: int = 0
) -> dict:
    """Qwen3.5's config.json (Qwen/Qwen3.5-9B, -35B-A3B): a hybrid text model, three Gated DeltaNet layers
    to each full-attention one, and Qwen3-VL's tower without DeepStack; `moe`: the MoE's text keys."""
    text = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": kv_heads,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "vocab_size": 248320,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
        **(moe or {"intermediate_size": intermediate}),
    }
    return {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "in_channels": 3,
            "out_hidden_size": hidden,
            "num_position_embeddings": 2304,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }


def smolvlm2_config() -> dict:
    """HuggingFaceTB/SmolVLM2-2.2B-Instruct's config.json: SigLIP-so400m tower (384 px tiles of 14 px
    patches), pixel shuffle 3x3, SmolLM2-1.7B (Llama) text model."""
    return {
        "model_type": "smolvlm",
        "scale_factor": 3,
        "image_token_id": 49190,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "llama",
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 24,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "head_dim": 64,
            "vocab_size": 49280,
            "max_position_embeddings": 16384,
            "rms_norm_eps": 1e-5,
            "rope_theta": 273768.0,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "image_size": 384,
            "patch_size": 14,
        },
    }


def gemma3_config() -> dict:
    """google/gemma-3-4b-it's config.json: SigLIP tower (896 px, 14 px patches, pooled to 256 tokens),
    Gemma 3 text model (the fields config.json leaves out are Gemma3TextConfig's defaults: 8 heads, 4 KV
    heads, head_dim 256, vocab 262208)."""
    return {
        "model_type": "gemma3",
        "mm_tokens_per_image": 256,
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "image_token_index": 262144,
        "eos_token_id": [1, 106],
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }


def llava_onevision_config() -> dict:
    """llava-hf/llava-onevision-qwen2-7b-ov-hf's config.json: SigLIP-so400m tower with its last layer
    dropped (26 layers, 384 px, 14 px patches, no head), a two-layer MLP projector and image_newline,
    Qwen2-7B (vocab grown by <image> and <video>, padded to 152128). image_grid_pinpoints are the config's
    default (384..2304 px in steps of 384)."""
    return {
        "model_type": "llava_onevision",
        "image_token_index": 151646,
        "video_token_index": 151647,
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": -1,
        "vision_aspect_ratio": "anyres_max_9",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen2",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152128,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": 26,
            "num_attention_heads": 16,
            "image_size": 384,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }


def gemma4_config(text: dict, vision: dict, audio: bool) -> dict:
    """A google/gemma-4-*-it config.json: the fields that shape the model (the rest are Gemma4*Config's
    defaults, as the published files have them: vocab 262144, head_dim 256 and global_head_dim 512, a
    sliding window layer 5 times in 6, final logits capped at 30, tied embeddings), 16 px patches pooled
    3x3, and on E2B/E4B the default audio tower (12 conformer layers of 1024)."""
    pattern = ["sliding_attention"] * 5 + ["full_attention"]
    return {
        "model_type": "gemma4",
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "gemma4_text",
            "vocab_size": 262144,
            "head_dim": 256,
            "global_head_dim": 512,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
            "layer_types": pattern * (text["num_hidden_layers"] // 6),
            **text,
        },
        "vision_config": {
            "model_type": "gemma4_vision",
            "patch_size": 16,
            "pooling_kernel_size": 3,
            "position_embedding_size": 10240,
            **vision,
        },
        "audio_config": {"model_type": "gemma4_audio"} if audio else None,
    }


def mistral3_config() -> dict:
    """mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json (Mistral-Small-3.2-24B-Instruct-2506's has the
    same shapes; transformers' Mistral3Config defaults are these values): a Pixtral tower (24 layers of 1024,
    14 px patches), the patch-merger projector (2x2), a Mistral text model (40 layers of 5120, 32 heads over 8
    KV heads of 128, vocab 131072, untied lm_head)."""
    return {
        "model_type": "mistral3",
        "image_token_index": 10,
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
        # not in config.json: transformers 5.24's Mistral3Config defaults it to True, which ties lm_head to the
        # embeddings (23,340,272,640 parameters); the published safetensors hold both matrices
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "mistral",
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 5120,
            "intermediate_size": 32768,
            "max_position_embeddings": 131072,
            "num_attention_heads": 32,
            "num_hidden_layers": 40,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000000.0,
            "sliding_window": None,
            "vocab_size": 131072,
        },
        "vision_config": {
            "model_type": "pixtral",
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 1024,
            "image_size": 1540,
            "intermediate_size": 4096,
            "num_attention_heads": 16,
            "num_channels": 3,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "rope_theta": 10000.0,
        },
    }


def glm4v_config() -> dict:
    """zai-org/GLM-4.1V-9B-Thinking's config.json (transformers' Glm4vConfig defaults are its values; GLM-4.6V-Flash
    has the same shapes): a 24-layer tower of 1536 (14 px patches, 336 px learned positions), the 2x2
    downsampling convolution and the merger into 4096, a GLM-4 text model (40 layers of 4096, 32 heads over 2 KV
    heads, half of each head rotating, vocab 151552, untied lm_head)."""
    return {
        "model_type": "glm4v",
        "image_token_id": 151343,
        "video_token_id": 151344,
        "image_start_token_id": 151339,
        "image_end_token_id": 151340,
        "video_start_token_id": 151341,
        "video_end_token_id": 151342,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "glm4v_text",
            "vocab_size": 151552,
            "hidden_size": 4096,
            "intermediate_size": 13696,
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-05,
            "max_position_embeddings": 65536,
            "partial_rotary_factor": 0.5,
            "rope_theta": 10000.0,
            "rope_scaling": {"rope_type": "default", "mrope_section": [8, 12, 12]},
            "pad_token_id": 151329,
            "eos_token_id": [151329, 151336, 151338, 151348],
        },
        "vision_config": {
            "model_type": "glm4v",
            "depth": 24,
            "hidden_size": 1536,
            "intermediate_size": 13696,
            "num_heads": 12,
            "out_hidden_size": 4096,
            "image_size": 336,
            "patch_size": 14,
            "in_channels": 3,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-05,
        },
    }


def glm4_5v_config() -> dict:
    """zai-org/GLM-4.5V's config.json (GLM-4.6V: the same shapes): GLM-4.1V's tower (24 layers of 1536, 336 px
    learned positions) but a merger of 10944, into GLM-4.5-Air (46 layers of 4096, 96 heads over 8 KV heads of
    128, biased q/k/v, half of each head rotating; layer 0 a dense MLP of 10944, layers 1-45 a router, 128
    experts of 1408, 8 per token, and one shared expert of 1408; vocab 151552, untied lm_head). Copied from a
    public model-inspection report that loaded the published checkpoint with transformers 5.7 and printed its
    config and tensor table."""
    return {
        "model_type": "glm4v_moe",
        "image_token_id": 151363,
        "video_token_id": 151364,
        "image_start_token_id": 151339,
        "image_end_token_id": 151340,
        "video_start_token_id": 151341,
        "video_end_token_id": 151342,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "glm4v_moe_text",
            "vocab_size": 151552,
            "hidden_size": 4096,
            "intermediate_size": 10944,
            "num_hidden_layers": 46,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "attention_bias": True,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 1408,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "router_aux_loss_coef": 0.0001,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-05,
            "max_position_embeddings": 65536,
            "partial_rotary_factor": 0.5,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [8, 12, 12],
            },
            "pad_token_id": 151329,
            "eos_token_id": [151329, 151336, 151338],
            "tie_word_embeddings": False,
        },
        # GLM-4.1V's tower, with a merger of 10944 and no bias in its attention
        "vision_config": {
            **glm4v_config()["vision_config"],
            "model_type": "glm4v_moe_vision",
            "intermediate_size": 10944,
            "attention_bias": False,
        },
    }


def internvl3_5_config() -> dict:
    """OpenGVLab/InternVL3_5-8B-HF's config.json: InternViT-300M (24 layers of 1024, 448 px tiles of 14 px patches,
    biased qkv, LayerNorm, mean pooling: the vit_300m_config of OpenGVLab/InternVL's
    internvl_chat/tools/internvl_custom2hf.py, which wrote the -HF configs, with its image_token_id 151671), pixel
    shuffle 0.5 into the MLP projector, Qwen3-8B's text model (36 layers of 4096, 32 heads over 8 KV heads of 128,
    vocab 151936, untied lm_head: Qwen/Qwen3-8B's config.json, the llm_config the script copies)."""
    return {
        "model_type": "internvl",
        "image_token_id": 151671,
        "image_seq_length": 256,
        "downsample_ratio": 0.5,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "internvl_vision",
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "attention_bias": True,
            "norm_type": "layer_norm",
            "use_qk_norm": False,
            "use_mean_pooling": True,
            "layer_scale_init_value": 0.1,
            "image_size": [448, 448],
            "patch_size": [14, 14],
        },
    }


GEMMA4_E4B = gemma4_config(
    {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 42,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "sliding_window": 512,
        "max_position_embeddings": 131072,
        "hidden_size_per_layer_input": 256,  # per-layer embeddings: 262144 x 42 x 256 (2.8B of the 8B)
        "vocab_size_per_layer_input": 262144,
        "num_kv_shared_layers": 18,  # the last 18 layers reuse the keys and values of earlier ones
    },
    {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 16,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "head_dim": 64,
        "use_clipped_linears": True,
    },
    audio=True,
)
GEMMA4_31B = gemma4_config(
    {
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 60,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "num_global_key_value_heads": 4,
        "attention_k_eq_v": True,  # the global layers' keys are their values
        "sliding_window": 1024,
        "max_position_embeddings": 262144,
        "hidden_size_per_layer_input": 0,
        "use_bidirectional_attention": "vision",
    },
    {
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 72,
        "standardize": True,
    },
    audio=False,
)


# From each model's config.json on the Hugging Face hub (huggingface.co/Qwen/<name>/blob/main/config.json),
# the fields that shape the model; with the parameter count the hub shows for its safetensors, which the
# meta-device build must reproduce (a check that the fields were copied right).
PUBLISHED = {
    # Qwen/Qwen2-VL-2B-Instruct: 2.21B
    "Qwen2-VL-2B": (qwen2_vl_config(1536, 8960, 12, 2, 151936, True), 2_208_985_600),
    # Qwen/Qwen2-VL-7B-Instruct: 8.29B
    "Qwen2-VL-7B": (qwen2_vl_config(3584, 18944, 28, 4, 152064, False), 8_291_375_616),
    # Qwen/Qwen2.5-VL-3B-Instruct: 3.75B
    "Qwen2.5-VL-3B": (qwen2_5_vl_config(2048, 11008, 36, 16, 2, 151936, True), 3_754_622_976),
    # Qwen/Qwen2.5-VL-7B-Instruct: 8.29B
    "Qwen2.5-VL-7B": (qwen2_5_vl_config(3584, 18944, 28, 28, 4, 152064, False), 8_292_166_656),
    # Qwen/Qwen3-VL-4B-Instruct: 4.44B
    "Qwen3-VL-4B": (qwen3_vl_config(2560, 9728, True, 24, 1024, 4096, [5, 11, 17]), 4_437_815_808),
    # Qwen/Qwen3-VL-8B-Instruct: 8.77B
    "Qwen3-VL-8B": (qwen3_vl_config(4096, 12288, False, 27, 1152, 4304, [8, 16, 24]), 8_767_123_696),
    # Qwen/Qwen3.5-9B: its model.safetensors.index.json holds 19,306,216,416 bytes: bf16 values but for the
    # Gated DeltaNet layers' A_log and gated-norm weights in fp32 (24 layers x (32 + 128)), and a
    # multi-token-prediction head transformers does not load (mtp.*: fc 8192x4096, 3 norms, one full-attention
    # decoder layer: 243,290,624). Source of the config and size: tests of public repos quoting config.json.
    "Qwen3.5-9B": (
        qwen3_5_config(4096, 32, 4, intermediate=12288),
        (19_306_216_416 - 4 * 3_840) // 2 + 3_840 - 243_290_624,
    ),
    # Qwen/Qwen3.5-35B-A3B: 35,951,822,704 values in its safetensors (the hub's count: 35,951,817,904 BF16 +
    # 4,800 F32), of which the multi-token-prediction head transformers does not load (785 mtp.* tensors, one
    # MoE decoder layer with its 256 experts) holds 844,640,768. Config and counts: copies of the revision
    # 59d61f3 config.json, safetensors index (71,903,655,008 bytes) and tensor table in public repos.
    "Qwen3.5-35B-A3B": (
        qwen3_5_config(
            2048,
            40,
            2,
            moe={
                "num_experts": 256,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512,
                "router_aux_loss_coef": 0.001,
            },
        ),
        35_951_822_704 - 844_640_768,
    ),
    # Qwen/Qwen3-VL-30B-A3B-Instruct: 31,070,754,032 (31.07B), every tensor bf16, no MTP head; 128 experts
    # top-8 in all 48 layers
    "Qwen3-VL-30B-A3B": (
        qwen3_vl_config(
            2048,
            6144,
            False,
            27,
            1152,
            4304,
            [8, 16, 24],
            layers=48,
            kv_heads=4,
            moe={
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 768,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            },
        ),
        31_070_754_032,
    ),
    # HuggingFaceTB/SmolVLM2-2.2B-Instruct: 2.25B
    "SmolVLM2-2.2B": (smolvlm2_config(), 2_246_784_880),
    # google/gemma-3-4b-it: 4.30B
    "Gemma3-4B": (gemma3_config(), 4_300_079_472),
    # llava-hf/llava-onevision-qwen2-7b-ov-hf: 8.03B
    "LLaVA-OneVision-7B": (llava_onevision_config(), 8_030_807_584),
    # google/gemma-4-E4B-it: 7,996,156,490 values in its safetensors (the hub's BF16 count, 8B), which also
    # hold what transformers does not build: the keys and values of the 18 KV-shared layers (15 sliding:
    # k_proj, v_proj 2560x512, k_norm 256; 3 global: 2560x1024, 512) and the 42 layers' layer_scalar buffer
    "Gemma4-E4B": (
        GEMMA4_E4B,
        7_996_156_490 - 15 * (2 * 2560 * 512 + 256) - 3 * (2 * 2560 * 1024 + 512) - 42,
    ),
    # google/gemma-4-31B-it: 31,273,088,876 (31.3B), with 2,364 buffers: 60 layer_scalar, the tower's
    # std_bias and std_scale (1152 each)
    "Gemma4-31B": (GEMMA4_31B, 31_273_088_876 - 60 - 2 * 1152),
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503: 24,011,361,280 (24B; keras-hub's mistral3 presets give
    # this count for it, its base and Mistral-Small-3.2-24B-Instruct-2506)
    "Mistral-Small-3.1-24B": (mistral3_config(), 24_011_361_280),
    # zai-org/GLM-4.6V-Flash: 10,292,777,472 (BF16, Glm4vForConditionalGeneration), its safetensors' count as public
    # repos quote it (a model survey, a model card write-up, a training log: base + LoRA = its `all params`);
    # it has GLM-4.1V-9B-Thinking's shapes (the hub's 10.3B), built here from that config
    "GLM-4.6V-Flash": (glm4v_config(), 10_292_777_472),
    # zai-org/GLM-4.5V: 107,710,933,120 values in its 46 safetensors files (18,106 tensors), as a public
    # model-inspection report of the published checkpoint counts them (its tensor table), of which the 45 MoE
    # layers' e_score_correction_bias (128 each, fp32) are buffers, not parameters; no multi-token-prediction
    # layer is saved (layers 0-45 only)
    "GLM-4.5V": (glm4_5v_config(), 107_710_933_120 - 45 * 128),
    # OpenGVLab/InternVL3_5-8B-HF: 8,528,318,464 (BF16), the hub's count (huggingface.co/api/models/OpenGVLab/
    # InternVL3_5-8B-HF) as public write-ups quote it, one of them a conversion whose keys match the official
    # model.safetensors.index.json 841 of 841 and which loads to this count
    "InternVL3.5-8B": (internvl3_5_config(), 8_528_318_464),
}


def published_files_of_families() -> dict[str, tuple[dict, object]]:
    """tests/published/'s checkpoint configs whose model type a family module names (the generic family's until
    a module named it), by checkpoint, with the parameter count published for it, as rounded there."""
    known = {model_type for family in FAMILIES for model_type in family.model_types}
    found = {}
    for path in sorted((REPO / "tests" / "published").glob("*.json")):
        published = json.loads(path.read_text())
        if published["config"]["model_type"] in known:
            counts = published["published_parameters"]
            assert "total" in counts, f"{path}: the family tests need the checkpoint's total parameter count"
            found[published["checkpoint"]] = (
                published["config"],
                pytest.approx(counts["total"], rel=counts.get("rounding", 0)),
            )
    return found


PUBLISHED.update(published_files_of_families())


VISION_QKV = {
    "smolvlm": "q_proj",
    "gemma3": "q_proj",
    "llava-onevision": "q_proj",
    "mistral3": "q_proj",
    "internvl": "q_proj",
    "gemma4": "q_proj.linear",  # a clippable linear: the nn.Linear inside it
}  # the vision tower's attention input projection where it is not one fused qkv (Qwen's)
# role prefixes a published checkpoint of the family may lack (Gemma 4's audio tower: E2B and E4B only)
OPTIONAL_MODULES = {"gemma4": {"model.audio_tower", "model.embed_audio"}}


BARE_PROJECTOR = {"gemma3"}  # families whose projector has no nn.Linear (Gemma 3: pool, norm, one matrix)


@pytest.fixture(scope="module", params=list(PUBLISHED))
def published(request):
    """(family, model on the meta device, published parameter count): real shapes, no weights."""
    fields, params = PUBLISHED[request.param]
    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)  # as from_pretrained reads config.json
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return family_for_model_type(config.model_type), model, params


def test_published_dimensions_build_the_published_model(published):
    _, model, params = published
    assert sum(p.numel() for p in model.parameters()) == params


def test_every_parameter_has_exactly_one_role(published):
    family, model, _ = published
    groups = params_by_role(model, family)
    assert not groups["other"], [name for name, _ in groups["other"]][:5]
    assert all(groups[role] for role in ROLES)
    counted = sum(len(params) for params in groups.values())
    assert counted == len(list(model.named_parameters())), "each parameter in one group"
    names = {name for name, _ in model.named_parameters()}
    for name in names:
        # Qwen3-VL's DeepStack mergers project too, and GLM-4V's downsampling into the language model's width
        if ".deepstack_merger_list." in name or ".merger." in name or ".visual.downsample." in name:
            assert family.role_of(name) == "projector", name
        elif name.startswith("model.visual."):
            assert family.role_of(name) == "vision", name


def test_lora_targets_resolve_for_each_role(published):
    family, model, _ = published
    roles = ROLES
    if family.name in BARE_PROJECTOR:  # a bare weight matrix, no linear layer: LoRA on it is refused
        with pytest.raises(LoraTargetError, match="no module of `projector`"):
            lora_target_modules(model, family, {"projector": []})
        roles = ("vision", "llm")
    everything = lora_target_modules(model, family, dict.fromkeys(roles, []))
    by_role = {role: [t for t in everything if family.role_of(t) == role] for role in roles}
    assert all(by_role.values()) and len(everything) == len(set(everything))
    assert not any(family.is_lm_head(t) for t in everything)
    modules = dict(model.named_modules())
    assert all(isinstance(modules[t], nn.Linear) for t in everything)
    # the suffixes a recipe would name (lora.targets) reach the right role only
    fused = any(name.endswith(".qkv") and family.role_of(name) == "vision" for name in modules)
    vision_qkv = VISION_QKV.get(family.name, "qkv" if fused else "q_proj")
    named = lora_target_modules(model, family, {"llm": ["q_proj", "v_proj"], "vision": [vision_qkv]})
    text = model.config.get_text_config()
    # each layer that attends has one q_proj: every layer, or those whose type is attention over the sequence
    # (not Qwen3.5's Gated DeltaNet layers, nor any other type without a q_proj)
    types = list(getattr(text, "layer_types", None) or [])
    layers = (
        sum(t in ("full_attention", "sliding_attention") for t in types) if types else text.num_hidden_layers
    )
    assert sum(t.endswith(".q_proj") and family.role_of(t) == "llm" for t in named) == layers
    if routed_experts(text):  # an MoE: `experts` names its two fused weights in every MoE layer
        experts = lora_target_parameters(model, family, {"llm": ["experts"]})
        moe_layers = text.num_hidden_layers - getattr(text, "first_k_dense_replace", 0)  # GLM-4.5V: 1 dense
        assert len(experts) == 2 * moe_layers and all(".experts." in name for name in experts)
    assert {family.role_of(t) for t in named} == {"llm", "vision"}


def test_quantization_skip_modules_are_real_modules_and_cover_the_tower(published):
    family, model, _ = published
    skip = family.quantization_skip_modules(["vision", "projector", "lm_head"])
    modules = dict(model.named_modules())
    optional = OPTIONAL_MODULES.get(family.name, set())
    assert all(name in modules or name in optional for name in skip), [n for n in skip if n not in modules]
    for name, module in modules.items():
        if isinstance(module, nn.Linear) and family.role_of(name) in ("vision", "projector"):
            assert any(name.startswith(s + ".") for s in skip), f"{name} would be quantized"
    assert "lm_head" in skip


def test_flop_formula_gives_positive_counts(published):
    family, model, _ = published
    try:
        family.vision_geometry(model.config)
    except UnsupportedModelError as refusal:  # the benchmark refuses it the same way
        pytest.skip(f"FLOP counts refused: {refusal}")
    r1 = {"vision": "frozen", "projector": "frozen", "llm": "lora"}
    r2 = {"vision": "full", "projector": "full", "llm": "frozen"}
    grids = [[(16, 16)]]  # one 448x448 (Qwen3-VL: 512x512) image: 256 tokens
    forward = flops_per_sample(model, family, r1, [(100, 256)], grids)
    assert 0 < forward < flops_per_sample(model, family, r2, [(100, 256)], grids)
    geometry = family.vision_geometry(model.config)
    if model.config.model_type == "qwen2_5_vl":  # 4 of 32 layers full, the rest in 4x4-token windows
        assert (geometry.window, geometry.full_attention_layers) == (4, 4)
        assert geometry.attention_pairs(256, (16, 16)) < geometry.layers * 1024**2
    elif model.config.model_type == "smolvlm":  # each 384 px tile (9x9 tokens of 3x3 patches) on its own
        assert (geometry.window, geometry.full_attention_layers) == (9, 0)
        assert geometry.attention_pairs(81 * 5) == 5 * geometry.layers * 729**2
    elif model.config.model_type == "llava_onevision":  # each 384 px tile (27x27 patches) on its own
        assert (geometry.window, geometry.full_attention_layers) == (27, 0)
        assert geometry.attention_pairs(729 * 5) == 5 * geometry.layers * 729**2
    elif model.config.model_type == "internvl":  # each 448 px tile (16x16 tokens of 2x2 patches) on its own
        assert (geometry.window, geometry.full_attention_layers, geometry.patches_per_token) == (16, 0, 4)
        assert geometry.attention_pairs(256 * 3) == 3 * geometry.layers * 1024**2
    else:
        assert geometry.window is None


# ---------------------------------------------------------------------------------- the tiny models


def test_every_family_has_a_tiny_model_and_model_types_do_not_overlap():
    from vlm_recipes.demo.models import DEMO_MODELS

    assert {family.name for family in FAMILIES} == set(TINY_MODELS)
    for family in FAMILIES:
        assert DEMO_MODELS[TINY_MODELS[family.name]].family is family
    # None: a model type the generic family trains (tests/test_new_models.py)
    assert all(demo.family is None or demo.family in FAMILIES for demo in DEMO_MODELS.values())
    model_types = [t for family in FAMILIES for t in family.model_types]
    assert len(model_types) == len(set(model_types)) and "qwen2_5_vl" in model_types


def test_a_new_tiny_module_is_a_demo_model_with_no_line_elsewhere(tmp_path, monkeypatch):
    """demo/models.py finds each tiny module's BUILDS, and each model's family by the type it builds: a module
    added to demo/tiny/ is a demo model, with its family (or none: the generic family's), the families' models
    first in the registry's order."""
    from vlm_recipes.demo import models, tiny

    (tmp_path / "new_vlm.py").write_text(
        textwrap.dedent(
            """
            from vlm_recipes.demo.tiny import TinyModel
            from vlm_recipes.demo.tiny.qwen2_vl import TINY, build_tiny_qwen2_vl

            BUILDS = {
                "demo:tiny-new-vlm": TinyModel("new_vlm", build_tiny_qwen2_vl, TINY),
                "demo:tiny-qwen2-vl-again": TinyModel("qwen2_vl", build_tiny_qwen2_vl, {**TINY, "layers": 1}),
            }
            """
        )
    )
    monkeypatch.setattr(tiny, "__path__", [*tiny.__path__, str(tmp_path)])
    found = models._demo_models()
    del sys.modules["vlm_recipes.demo.tiny.new_vlm"]  # imported from tmp_path, which goes
    assert found["demo:tiny-new-vlm"].family is None and found["demo:tiny-new-vlm"].model_type == "new_vlm"
    again = found["demo:tiny-qwen2-vl-again"]
    assert again.family is family_for_model_type("qwen2_vl") and again.dims["layers"] == 1
    ids = list(found)
    assert (
        ids.index("demo:tiny-qwen2-vl-again")
        < ids.index("demo:tiny-qwen2.5-vl")
        < ids.index("demo:tiny-new-vlm")
    )
    assert {k: v for k, v in found.items() if "-again" not in k and "new-vlm" not in k} == models.DEMO_MODELS


# TRL's name for the template each family's checkpoints ship (Qwen2-VL's is byte-identical to Qwen2.5-VL's)
TEMPLATES = {
    "qwen2-vl": "qwen2_5_vl",
    "qwen2.5-vl": "qwen2_5_vl",
    "qwen3-vl": "qwen3_vl",
    "qwen3.5": "qwen3_5_think",
    "qwen3.5-moe": "qwen3_5_think",
    "smolvlm": "smolvlm",
}
TEMPLATES["gemma3"] = "gemma3"
TEMPLATES["gemma4"] = "gemma4_v5"  # the current revision google/gemma-4-*-it ship
# The published checkpoints' eos, pad and image placeholder; a family not here checks its own in
# tests/test_family_<name>.py
QWEN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|image_pad|>")
TOKENS = {
    **dict.fromkeys(("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5", "qwen3.5-moe"), QWEN_TOKENS),
    "smolvlm": ("<end_of_utterance>", "<|im_end|>", "<image>"),
    "gemma3": ("<eos>", "<pad>", "<image_soft_token>"),
    "gemma4": ("<eos>", "<pad>", "<|image|>"),
    "llava-onevision": ("<|im_end|>", "<|endoftext|>", "<image>"),
    "mistral3": ("</s>", "<pad>", "[IMG]"),
    "glm4v": ("<|endoftext|>", "<|endoftext|>", "<|image|>"),
    "glm4v-moe": ("<|endoftext|>", "<|endoftext|>", "<|image|>"),
    "internvl": ("<|im_end|>", "<|endoftext|>", "<IMG_CONTEXT>"),
}
# what the assistant mask covers: the answer and the end of the turn (SmolVLM's template: "Assistant: ...")
ASSISTANT_SPANS = {
    "smolvlm": " {answer}<end_of_utterance>\n",
    "gemma3": "{answer}<end_of_turn>\n",
    "gemma4": "{answer}<turn|>\n",  # the family's training template (TRL has none for Gemma 4)
    "mistral3": "{answer}</s>",  # the family's training template (TRL has none for Mistral 3)
    "glm4v": "{answer}<|endoftext|>",  # the family's training template: the last answer ends with its eos
    "glm4v-moe": "{answer}<|endoftext|>",
    # Qwen3.5's thinking template: an empty thought before the answer, in the loss as TRL trains it
    "qwen3.5": "<think>\n\n</think>\n\n{answer}<|im_end|>\n",
    "qwen3.5-moe": "<think>\n\n</think>\n\n{answer}<|im_end|>\n",
}
# templates TRL does not ship, as the checkpoints do (llava-hf's: transformers' conversion script writes it)
PUBLISHED_TEMPLATES = {
    "llava-onevision": LLAVA_ONEVISION_CHAT_TEMPLATE,
    "mistral3": MISTRAL3_CHAT_TEMPLATE,
    "glm4v": GLM4V_CHAT_TEMPLATE,
    "glm4v-moe": GLM4V_CHAT_TEMPLATE,
    "internvl": INTERNVL_CHAT_TEMPLATE,
}


def test_tiny_model_is_built_from_the_familys_own_classes(tiny_family):
    import trl.chat_template_utils as templates
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    family, model_dir = tiny_family
    config = AutoConfig.from_pretrained(model_dir)
    assert family_for_model_type(config.model_type) is family
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir)
    # the processor class transformers maps the model type to, with each part it declares (a video processor
    # where the class takes videos)
    assert type(processor).__name__ == PROCESSOR_MAPPING_NAMES[config.model_type]
    if "video_processor" in type(processor).get_attributes():
        assert type(processor.video_processor).__name__.endswith("VideoProcessor")
    # the template the real checkpoints ship, byte for byte: TRL recognises it and swaps in its training
    # variant (generation markers for assistant-only loss)
    if family.name in TEMPLATES:
        assert processor.chat_template == getattr(templates, f"{TEMPLATES[family.name]}_chat_template")
    else:  # TRL ships none: the family module holds the published text and its training variant
        assert processor.chat_template == PUBLISHED_TEMPLATES.get(family.name, processor.chat_template)
        assert processor.chat_template in family.training_chat_templates
    training = family.training_chat_template(processor) or get_training_chat_template(processor)
    assert has_generation_markers(training)
    tok = processor.tokenizer
    eos, pad, image = TOKENS.get(family.name, (tok.eos_token, tok.pad_token, processor.image_token))
    assert tok.eos_token == eos and tok.pad_token == pad and pad is not None
    assert model.config.image_token_id == tok.convert_tokens_to_ids(image)
    eos_ids = model.generation_config.eos_token_id  # Gemma 3: <eos> and <end_of_turn>, as published
    assert tok.eos_token_id in (eos_ids if isinstance(eos_ids, list) else [eos_ids])
    assert not params_by_role(model, family)["other"]
    assert sum(p.numel() for p in model.parameters()) < 500_000


def test_assistant_mask_covers_exactly_the_answer(tiny_family):
    from trl.chat_template_utils import get_training_chat_template

    family, model_dir = tiny_family
    processor = AutoProcessor.from_pretrained(model_dir)
    row = demo_split("demo:train", "train", 1)[0][0]
    batch = model_inputs(
        processor,
        [row],
        # what a stage trains with: the family's training template (load_processor) or TRL's
        chat_template=family.training_chat_template(processor) or get_training_chat_template(processor),
        return_assistant_tokens_mask=True,
    )
    mask = batch["assistant_masks"][0].bool()
    positions = mask.nonzero().flatten().tolist()
    assert positions == list(range(positions[0], len(mask))), "one span, to the end"
    answer = row["messages"][1]["content"][0]["text"]
    span = ASSISTANT_SPANS.get(family.name, "{answer}<|im_end|>\n").format(answer=answer)
    assert processor.tokenizer.decode(batch["input_ids"][0][mask]) == span


def test_pixel_bounds_reach_the_processor_and_lengths_match_it(tiny_family):
    """data.min/max_pixels in the family's own units (Qwen3-VL: 32 px per merged token, not 28)."""
    family, model_dir = tiny_family
    processor = AutoProcessor.from_pretrained(model_dir)
    if not hasattr(processor.image_processor, "merge_size"):
        own = f"tests/test_family_{family.name.replace('-', '_').replace('.', '_')}.py"
        pytest.skip(
            f"pixel bounds in patches of the Qwen line; {family.name}'s own (or that it has none): {own}"
        )
    side = processor.image_processor.patch_size * processor.image_processor.merge_size
    processor = load_processor(
        str(model_dir), DataSettings(min_pixels=side * side * 4, max_pixels=side * side * 9), family
    )
    ds, _ = demo_split("demo:eval", "test", 4)
    for row, expected in zip(ds, sample_lengths(ds, processor, family), strict=True):
        out = model_inputs(processor, [row])
        assert out["input_ids"].shape[1] == expected
        assert all(4 <= n <= 9 for n in (out["image_grid_thw"].prod(-1) // 4).tolist())
    # odd sizes and aspect ratios: the count from the size alone is the processor's
    sizes = [(33, 33), (56, 200), (300, 90), (20, 400), (123, 77)]
    processor.image_processor.size = {"shortest_edge": side * side * 4, "longest_edge": side * side * 64}
    grids = processor.image_processor(images=[Image.new("RGB", (w, h)) for h, w in sizes])["image_grid_thw"]
    assert family.image_token_counts(processor, sizes) == (grids.prod(-1) // 4).tolist()


# ---------------------------------------------------------------- every seed recipe, end to end

# r2-vision-only's one stage is r3-two-stage's first, as the recipe says (`use: r2-vision-only:vision-full`, from
# the base model): r3 runs it on every family, and tests/test_e2e.py runs r2 alone
SEED_RECIPES = ("r1-llm-only", "r3-two-stage", "r4-joint")
TINY_RUN = [
    "--max-steps",
    "2",
    "training.per_device_batch_size=4",
    "data.max_train_samples=8",
    "data.max_eval_samples=4",
    "evaluation.max_new_tokens=4",
]


def assert_stage_trained_its_roles(stage: dict, recipe_stage: dict, family) -> None:
    """Frozen: bit-identical to the source. LoRA: only the adapted linear weights moved. Full: all moved."""

    def weights(model_dir: str) -> dict[str, torch.Tensor]:
        model = AutoModelForImageTextToText.from_pretrained(model_dir)
        return {name: p.detach() for name, p in model.named_parameters()}

    before, after = weights(stage["source"]), weights(stage["final_model"])
    # weights the forward never reads stay frozen in a full role (LLaVA-OneVision: the tower's post_layernorm)
    unread = set(family.unread_parameters(AutoModelForImageTextToText.from_pretrained(stage["source"])))
    assert before.keys() == after.keys()
    report = read_json(Path(stage["dir"]) / "report.json")
    lora_weights = {f"{m}.weight" for m in report["lora_targets"]}
    modes = dict(recipe_stage["train"])
    for decision in report["decisions"]:  # a LoRA role without linear layers (Gemma 3's projector)
        if decision["guard"] == "lora-role":
            modes[decision["choice"].removesuffix(" trained fully")] = "full"
    for name, old in before.items():
        role, mode = family.role_of(name), modes[family.role_of(name)]
        changed = not torch.equal(old, after[name])
        if mode == "frozen" or (mode == "lora" and name not in lora_weights) or name in unread:
            assert not changed, f"{stage['name']}: {name} ({role}, {mode}) changed"
        else:
            assert changed, f"{stage['name']}: {name} ({role}, {mode}) did not change"


def assert_r3_trains_packed_with_the_feature_cache(tmp_path, model: str, family, *overrides: str) -> None:
    """r3-two-stage (vision full, then LoRA on the 4-bit language model) with padding-free packing and, in
    stage 2 where the tower is frozen, the vision feature cache: both stages finish, packed with per-sample
    attention, each training exactly its roles, and stage 2 fills the cache."""
    speedups = ["training.padding_free=true", "stages.llm-lora.training.vision_feature_cache=true"]
    args = ["--recipe", "r3-two-stage", "--output-dir", str(tmp_path), "--run-name", "t", *TINY_RUN]
    assert main([*args, f"model={model}", *speedups, *overrides]) == 0
    manifest = read_json(tmp_path / "r3-two-stage" / "t" / "run.json")
    assert manifest["status"] == "finished"
    for stage, recipe_stage in zip(manifest["stages"], manifest["resolved_recipe"]["stages"], strict=True):
        report = read_json(Path(stage["dir"]) / "report.json")
        assert report["family"] == family.name and stage["steps"] == 2 and stage["eval_loss"] is not None
        assert "per-sample-attention" in {d["guard"] for d in report["decisions"]}, "packed, sdpa per sample"
        assert_stage_trained_its_roles(stage, recipe_stage, family)
    metrics = read_json(Path(manifest["stages"][1]["dir"]) / "metrics.json")
    assert metrics["vision_feature_cache"]["misses"] > 0


@pytest.mark.e2e
@pytest.mark.parametrize("recipe", SEED_RECIPES)
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_seed_recipe_runs_end_to_end(tiny_family, recipe, precision, tmp_path):
    """Every family, every seed recipe's stages, in both precisions whatever the CPU (bf16: trained roles in
    fp32 masters beside frozen bf16 ones, where the dtype-boundary guard decides each crossing)."""
    family, _ = tiny_family
    model = f"model={TINY_MODELS[family.name]}"
    args = ["--recipe", recipe, "--output-dir", str(tmp_path), "--run-name", "t", *TINY_RUN, model]
    assert main([*args, f"precision={precision}"]) == 0
    manifest = read_json(tmp_path / recipe / "t" / "run.json")
    assert manifest["status"] == "finished"
    for stage, recipe_stage in zip(manifest["stages"], manifest["resolved_recipe"]["stages"], strict=True):
        assert (Path(stage["dir"]) / "DONE").is_file()
        assert stage["steps"] == 2 and stage["eval_loss"] is not None
        report = read_json(Path(stage["dir"]) / "report.json")
        assert report["family"] == family.name
        guards = {d["guard"]: d for d in report["decisions"]}
        assert guards["precision"]["choice"] == precision
        assert "dtype-boundary" in guards, "the crossing decision is in report.json"
        assert_stage_trained_its_roles(stage, recipe_stage, family)
        # the demo's first rows hold a two-image row and, for a family that takes video, a video row
        tasks = {json.loads(line)["task"] for line in (Path(stage["dir"]) / "predictions.jsonl").open()}
        assert tasks == {"pair", "nutrition", "shapes", *(["motion"] if family.takes_video else [])}


# One optimizer step of r1 (LoRA, fp32, no dropout, lr 1e-3) over the same 16 demo rows: one batch of 16,
# or 2 micro-batches of 8 accumulated. The step moves lora_B by 1e-3 (Adam's first step: lr x sign). Without
# methods/sft.py's average_the_loss_over_the_global_batch, the seven families whose classes say
# accepts_loss_kwargs = False averaged each micro-batch alone: 2.0e-3 apart (Qwen2.5-VL, Gemma 4, Qwen3.5-MoE
# measured; some steps' signs flipped). With it, measured on a 2-core AMD EPYC: below 1e-6 on ten families
# (the summation order); 1.6e-6 (Qwen3.5-MoE) and 1.2e-5 (GLM-4V-MoE), whose router's load-balancing loss is
# a statistic of each micro-batch; 1.7e-5 on Gemma 4 (demo-v4's rows). Adam's first step, lr x g / (|g| +
# eps), amplifies the summation-order noise of the few elements whose gradient is near eps: on demo-v5's rows
# Qwen2-VL ends 1.5e-6 apart at 1 element of 32,768 (2 beyond 1e-7). Bounds: fewer than 0.1 % of the elements
# beyond 1e-6 (5e-5 for those three), and none beyond 2e-4, 10x under the effect guarded against.
ONE_STEP = ["--max-steps", "1", "precision=fp32", "data.max_train_samples=16", "data.eval=null"]
ONE_STEP += ["training.learning_rate=1e-3", "lora.dropout=0", "quantization.mode=none"]
ACCUMULATION_BOUND = {"qwen3.5-moe": 5e-5, "glm4v-moe": 5e-5, "gemma4": 5e-5}


def test_gradient_accumulation_trains_as_one_batch_does(tiny_family, tmp_path):
    """The loss is the mean over every labelled token of the global batch, however it is split: 2 micro-
    batches of 8 accumulated give the weights one batch of 16 gives (as 2 ranks of 8 must: the FSDP and DDP
    proofs in test_parallel.py)."""
    family, model_dir = tiny_family
    bound = ACCUMULATION_BOUND.get(family.name, 1e-6)
    common = ["--recipe", "r1-llm-only", f"model={model_dir}", "--output-dir", str(tmp_path), *ONE_STEP]
    assert main([*common, "--run-name", "one", "training.per_device_batch_size=16"]) == 0
    split = ["training.per_device_batch_size=8", "training.gradient_accumulation_steps=2"]
    assert main([*common, "--run-name", "accumulated", *split]) == 0
    adapter = "stage-1-llm-lora/adapter/adapter_model.safetensors"
    one, accumulated = (load_file(tmp_path / "r1-llm-only" / run / adapter) for run in ("one", "accumulated"))
    moved = max(t.abs().max().item() for k, t in one.items() if "lora_B" in k)
    distance, beyond = distance_and_share_beyond(one, accumulated, bound)
    print(
        f"{family.name}: 2 x 8 against 16: {distance:.2e} ({beyond:.3%} beyond {bound:g}), moved {moved:.2e}"
    )
    assert moved > 10 * bound, moved
    assert distance < 2e-4 and beyond < 1e-3, (distance, beyond, moved)
