"""Model FLOPs of a training step, for throughput in TFLOP/s and MFU (model FLOPs utilization).

Per sample, with the samples' own lengths (padding is not model work):

    FLOPs = sum over roles of  c_role * N_role * tokens_role  +  attention

- N_role: the weights of the role's matmuls (Linear layers and the vision patch embedding). The input
  embedding is a lookup and is not counted; a tied lm_head counts once, as the matmul it is.
- tokens_role: the vision tower sees every patch (image tokens x spatial_merge_size^2); the projector and
  the language model see the merged image tokens, and the language model the text tokens too.
- c_role = 2 for the forward pass, + 2 when a gradient has to flow back through the role (it trains, in
  full or with LoRA, or a role before it trains), + 2 when its own weights get gradients (trained in
  full; LoRA adapters are rank << width and left out).
- attention, per layer: 2 * 2 * L^2 * width forward (QK^T and AV over a sequence of L, counted without
  the causal half, as PaLM's MFU does), scaled by c_role / 2 like the weights. The language model's L is
  the sample's length, the vision tower's the image's patches (each image attends only to itself), or,
  in a windowed layer (Qwen2.5-VL: all but `fullatt_block_indexes`), each window's patches, summed over
  the windows (`VisionGeometry.attention_pairs`).

MFU = samples/s * mean FLOPs per sample / the device's peak dense bf16 FLOP/s.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vlm_recipes.families.base import Family

ROLE_ORDER = ("vision", "projector", "llm")  # the order data flows through a VLM
FORMULA = (
    "FLOPs/sample = sum_role c*N_role*tokens_role + c/2 * 4*L^2*width per attention layer (per window in "
    "windowed vision layers); c = 2 forward + 2 if a gradient flows through the role + 2 if its weights "
    "train in full; FLOPs run = that less the tower's and projector's for images read from the feature "
    "cache, and less c_llm*N_skipped per unlabelled position with training.loss_positions_only (N_skipped: "
    "the last layer's output projection and MLP and the LM head)"
)
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}  # dense


def flop_coefficients(modes: dict[str, str]) -> dict[str, int]:
    """c_role for each role given its training mode (frozen, lora or full)."""
    coefficients, gradient_flows = {}, False
    for role in ROLE_ORDER:
        gradient_flows = gradient_flows or modes[role] != "frozen"
        coefficients[role] = 2 + 2 * gradient_flows + 2 * (modes[role] == "full")
    return coefficients


def matmul_params_by_role(model: nn.Module, family: Family) -> dict[str, int]:
    """N_role: weights of Linear and Conv layers per role, each weight counted once, and the bare weight
    matrices a module multiplies by itself (Gemma 3's projector: `mm_input_projection_weight`)."""
    counts = dict.fromkeys(ROLE_ORDER, 0)
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv3d, nn.Conv2d)):
            weights = [module.weight]
        elif isinstance(module, nn.Embedding):  # a lookup
            continue
        else:
            weights = [p for p in module.parameters(recurse=False) if p.dim() == 2]
        role = "llm" if family.is_lm_head(name) else family.role_of(name)
        for weight in weights:
            if id(weight) in seen:
                continue
            seen.add(id(weight))
            if role in counts:
                counts[role] += weight.numel()
    return counts


def flops_per_sample(
    model: nn.Module,
    family: Family,
    modes: dict[str, str],
    token_counts: Iterable[tuple[int, int]],
    image_grids: Iterable[list[tuple[int, int]]] | None = None,
) -> float:
    """Mean training FLOPs per sample over `token_counts` ((text, image) tokens per sample): the sum of
    `flops_per_sample_by_role`."""
    return sum(flops_per_sample_by_role(model, family, modes, token_counts, image_grids).values())


def flops_per_sample_by_role(
    model: nn.Module,
    family: Family,
    modes: dict[str, str],
    token_counts: Iterable[tuple[int, int]],
    image_grids: Iterable[list[tuple[int, int]]] | None = None,
) -> dict[str, float]:
    """Mean training FLOPs per sample over `token_counts` ((text, image) tokens per sample), by role (the
    benchmark leaves out the tower's and projector's where the feature cache ran neither).

    `image_grids`: per sample, each image's merged (height, width) in tokens (LLaVA-OneVision: each tile's),
    which places a windowed tower's windows exactly. Without it a sample's images are taken as one image for the vision tower's
    attention (exact for one image per sample and a tower without windows; an upper bound with windows)."""
    text_config = model.config.get_text_config()
    vision = family.vision_geometry(model.config)
    params = matmul_params_by_role(model, family)
    c = flop_coefficients(modes)
    text_width = text_config.num_attention_heads * getattr(
        text_config, "head_dim", text_config.hidden_size // text_config.num_attention_heads
    )
    token_counts = list(token_counts)
    grids = list(image_grids) if image_grids is not None else [None] * len(token_counts)
    total = dict.fromkeys(ROLE_ORDER, 0.0)
    for (text, image), sample_grids in zip(token_counts, grids, strict=True):
        # the tower's and projector's tokens: the grids' where given (LLaVA-OneVision's tiles, unpadded
        # afterwards, outnumber the <image> tokens), else the language model's image tokens (the Qwen line)
        tower = image if sample_grids is None else sum(h * w for h, w in sample_grids)
        length, patches = text + image, tower * vision.patches_per_token
        if sample_grids is None:
            pairs = vision.attention_pairs(image) if image else 0
        else:
            pairs = sum(vision.attention_pairs(h * w, (h, w)) for h, w in sample_grids)
        total["vision"] += (
            c["vision"] * params["vision"] * patches + c["vision"] / 2 * 4 * pairs * vision.width
        )
        total["projector"] += c["projector"] * params["projector"] * tower
        total["llm"] += c["llm"] * params["llm"] * length
        total["llm"] += c["llm"] / 2 * 4 * length**2 * text_width * text_config.num_hidden_layers
    return {role: flops / max(len(token_counts), 1) for role, flops in total.items()}


def last_layer_flops_per_position(model: nn.Module, family: Family, modes: dict[str, str]) -> float:
    """The training FLOPs, at one position, of what training.loss_positions_only skips at an unlabelled
    position: the last decoder layer's output projection and MLP, and the LM head."""
    from vlm_recipes.speedups.loss_positions import skipped_at_unlabelled_positions

    skipped = skipped_at_unlabelled_positions(model)
    weights = {id(p): p.numel() for module in skipped for p in module.parameters() if p.dim() == 2}
    return flop_coefficients(modes)["llm"] * sum(weights.values())


def peak_tflops(device: str) -> float | None:
    """Dense bf16 peak of the current GPU by name (None on CPU or an unknown GPU: pass it yourself)."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)
