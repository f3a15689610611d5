"""GLM-4.1V and GLM-4.6V-Flash (`glm4v`; `glm46v`, transformers' class for the GLM-4.6V processor, the same
model): roles, token counts, positions for packing, the decoder layer, the training chat template, FLOP
geometry (the tiny offline builder of `demo:tiny-glm4v` and `demo:tiny-glm4v-moe`: `demo/tiny/glm4v.py`).

Built from Qwen2.5-VL's design, so `Glm4vFamily` is a `Qwen2VLFamily`: the inner model's `visual` and
`language_model`, the image and video patches end to end (t*h*w per image or video), `get_image_features` /
`get_video_features` returning each one's merged tokens, 3-D multimodal RoPE from the model's own
`get_rope_index`. What differs (transformers' models/glm4v, 5.24):
- the tower: learned position embeddings bicubically resampled to each image's grid, 2-D RoPE, then a 2x2
  convolution (`model.visual.downsample`) that merges 2x2 patches into one token of the language model's
  width, then the merger (a projection and a SwiGLU MLP). The downsampling convolution runs on merged tokens
  and maps into the language model: it is the projector's, with the merger;
- the processor's resize (its own `smart_resize`) counts an image as temporal_patch_size (2) frames against
  `size` and enlarges a side under 28 px: token counts come from the image processor itself, and
  data.min/max_pixels (per image) are doubled into its bounds;
- a video is written as one image block per pair of frames, `<|begin_of_image|>`, the frame's <|image|>
  tokens, `<|end_of_image|>`, then the pair's first timestamp (GLM-4.1V: whole seconds, `3`; GLM-4.6V's
  processor: `3.0 seconds`), all inside `<|begin_of_video|>...<|end_of_video|>`. The video's tokens are
  <|image|> tokens too (the processor's mm_token_type_ids tell them apart), and `get_rope_index` places each
  pair of frames as its own image;
- transformers 5.24's model takes every <|image|> token for an image's and a video's: a batch holding both
  fails, so `glm4v_masks` fixes the placeholder masks as soon as transformers' GLM-4V module is imported;
- the decoder layer adds post-norms after attention and MLP (`DecoderLayer` below);
- the language model rotates half of each head (`partial_rotary_factor` 0.5).

GLM-4.5V and GLM-4.6V (`glm4v_moe`, 106B-A12B: `GLM4V_MOE`) have the same processor, tower and projector,
and GLM-4.5-Air's language model (transformers' models/glm4v_moe):
- pre-norm layers (input_layernorm, self_attn, post_attention_layernorm, mlp: no post-norms), biased q, k, v;
- the first `first_k_dense_replace` layers (1) keep a dense MLP; every later one is a routed block: a router
  (`mlp.gate`, a bare fp32 matrix scoring experts by sigmoid, with a fixed per-expert bias
  `e_score_correction_bias`, a buffer), 128 experts as two fused 3-D parameters (`mlp.experts.gate_up_proj`,
  `mlp.experts.down_proj`: not `nn.Linear`, so LoRA reaches them only when named, as Qwen3.5-MoE's), 8 per
  token, and a shared expert every token runs through (`mlp.shared_experts`, linear layers);
- the config names the routed experts `n_routed_experts` (transformers' alias `num_local_experts`), not
  `num_experts`; the load-balancing loss (`router_aux_loss_coef` 0.0001) is transformers' softmax one, over
  the router's logits, added by TRL when it asks for `output_router_logits`.
"""

from __future__ import annotations

from vlm_recipes.families import glm4v_masks
from vlm_recipes.families.base import DecoderLayer, VisionGeometry
from vlm_recipes.families.glm4v_template import GLM4V_CHAT_TEMPLATE, GLM4V_TRAINING_CHAT_TEMPLATE
from vlm_recipes.families.qwen2_vl import Qwen2VLFamily

glm4v_masks.install()


def name_the_experts_as_trl_reads_them() -> None:
    """TRL 1.16's fused loss reads `text_config.num_experts` for the load-balancing loss, and GLM-4.5V's
    config names its routed experts `n_routed_experts` (transformers aliases only `num_local_experts`): every
    training step stopped with an AttributeError. An alias, not a field: config.json is written as before."""
    from transformers.models.glm4v_moe.configuration_glm4v_moe import Glm4vMoeTextConfig

    Glm4vMoeTextConfig.attribute_map = {**Glm4vMoeTextConfig.attribute_map, "num_experts": "n_routed_experts"}


name_the_experts_as_trl_reads_them()


class Glm4vFamily(Qwen2VLFamily):
    """GLM-4.1V / GLM-4.6V-Flash: Qwen2-VL's layout and feature outputs, GLM's processor, tower and layer."""

    # the tiny GLM-4V has one key/value head, so no test splits it over 2 ranks
    sequence_parallel_refusal = "not proven: the demo model's one key/value head cannot be split over 2 ranks"

    # why no lmms-eval 0.7.3 class loads a stage's final/ (cli/lmms_eval.py)
    lmms_eval_models = {}  # none (Qwen2-VL's class is not GLM's)
    no_lmms_eval_model = {"glm4v": "glm4v loads the MoE class unless the path contains `Flash`"}

    # get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask): no video
    # timing key (the time is written as text between the frames)
    rope_index_keys = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw")
    # GLM-4's layer: input_layernorm, self_attn, post_self_attn_layernorm (on the attention's output, before
    # the residual), post_attention_layernorm (before the MLP), mlp, post_mlp_layernorm (on the MLP's output):
    # Gemma 3's sandwich layer under other names
    decoder_layer = DecoderLayer(
        post_attention_norm="post_self_attn_layernorm",
        pre_mlp_norm="post_attention_layernorm",
        post_mlp_norm="post_mlp_layernorm",
    )

    def apply_pixel_bounds(self, image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
        # the processor's smart_resize compares temporal_patch_size x height x width with `size`
        frames = image_processor.temporal_patch_size
        super().apply_pixel_bounds(
            image_processor,
            None if min_pixels is None else min_pixels * frames,
            None if max_pixels is None else max_pixels * frames,
        )

    def image_token_counts(self, processor, sizes: list[tuple[int, int]]) -> list[int]:
        # the image processor's own resize rule (glm4v's smart_resize, not qwen-vl-utils')
        ip = processor.image_processor
        return [ip.get_number_of_image_patches(h, w, {}) // ip.merge_size**2 for h, w in sizes]

    # a video's frames are <|image|> tokens, each pair of frames an image block and its timestamp (the
    # processor's own expansion of <|video|>, which count_video_tokens reads)
    video_feature_token = "image_token_id"

    # the published template prints content parts as a Python list and has no generation markers
    training_chat_templates = {GLM4V_CHAT_TEMPLATE: GLM4V_TRAINING_CHAT_TEMPLATE}

    def vision_geometry(self, config) -> VisionGeometry:
        vision = config.vision_config
        return VisionGeometry(
            patches_per_token=vision.spatial_merge_size**2,
            width=vision.hidden_size,
            layers=vision.depth,
        )


class Glm4vMoeFamily(Glm4vFamily):
    """GLM-4.5V / GLM-4.6V: GLM-4.1V's processor, tower and projector, GLM-4.5-Air's pre-norm MoE layers."""

    # lmms-eval 0.7.3's --model for a stage's final/ (cli/lmms_eval.py)
    lmms_eval_models = {"glm4v_moe": "glm4v"}
    no_lmms_eval_model = {}

    decoder_layer = DecoderLayer()  # input_layernorm, self_attn, post_attention_layernorm, mlp
    # its text model hands the layers the 3-D positions, not the text ones (transformers 5.24, glm4v_moe)
    text_positions_reach_attention = False


GLM4V_ROLES = {
    "vision": ("model.visual",),
    # the 2x2 downsampling convolution merges patches into the language model's width; the merger projects them
    "projector": ("model.visual.downsample", "model.visual.merger"),
    "llm": ("model.language_model", "lm_head"),
}

GLM4V = Glm4vFamily(name="glm4v", model_types=("glm4v", "glm46v"), role_prefixes=GLM4V_ROLES)
GLM4V_MOE = Glm4vMoeFamily(name="glm4v-moe", model_types=("glm4v_moe",), role_prefixes=GLM4V_ROLES)
