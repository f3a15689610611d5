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
  the causal half, as PaLM's MFU does), scaled by c_role / 2 like the weights. A linear-attention layer
  (Qwen3.5's Gated DeltaNet) instead runs chunks of 64 tokens (`linear_attention_flops`). A mixture-of-experts block's experts count as their active share (experts per token /
  experts), the router and any shared expert in full. The language model's L is
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
from vlm_recipes.families.parameters import routed_experts

ROLE_ORDER = ("vision", "projector", "llm")  # the order data flows through a VLM
FORMULA = (
    "FLOPs/sample = sum_role c*N_role*tokens_role (MoE experts: the active share) + c/2 * 4*L^2*width per "
    "attention layer (per window in windowed vision layers; a linear-attention layer: per chunk of 64); "
    "c = 2 forward + 2 if a gradient flows through the role + 2 if its weights train in full; FLOPs run = that less the tower's and projector's for images read from the feature "
    "cache, and less c_llm*N_skipped per unlabelled position with training.loss_positions_only (N_skipped: "
    "the last layer's output projection and MLP and the LM head)"
)
# Published dense bf16 peaks by the exact name torch.cuda.get_device_name() reports: one chip's variants
# differ (an H100 PCIe has 756 to the SXM's 989), so a substring would hand a PCIe card the SXM's peak
PEAK_BF16_TFLOPS = {
    "NVIDIA H200": 989.0,
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA A10G": 125.0,
}


def flop_coefficients(modes: dict[str, str]) -> dict[str, int]:
    """c_role for each role given its training mode (frozen, lora or full)."""
    coefficients, gradient_flows = {}, False
    for role in ROLE_ORDER:
        gradient_flows = gradient_flows or modes[role] != "frozen"
        coefficients[role] = 2 + 2 * gradient_flows + 2 * (modes[role] == "full")
    return coefficients


def matmul_params_by_role(model: nn.Module, family: Family) -> dict[str, float]:
    """N_role: weights of Linear and Conv layers per role, each weight counted once, and the bare weight
    matrices a module multiplies by itself (Gemma 3's projector: `mm_input_projection_weight`; an MoE
    router). A mixture-of-experts block's fused expert weights count as the share a token runs through
    (experts per token / experts): active parameters, not total."""
    active_share = active_expert_share(model)
    counts = dict.fromkeys(ROLE_ORDER, 0.0)
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv3d, nn.Conv2d, nn.Conv1d)):
            weights = [(module.weight, 1.0)]
        elif isinstance(module, nn.Embedding):  # a lookup
            continue
        else:
            weights = [(p, 1.0) for p in module.parameters(recurse=False) if p.dim() == 2]
            if name.endswith("experts"):
                weights += [(p, active_share) for p in module.parameters(recurse=False) if p.dim() == 3]
        role = "llm" if family.is_lm_head(name) else family.role_of(name)
        for weight, share in weights:
            if id(weight) in seen:
                continue
            seen.add(id(weight))
            if role in counts:
                counts[role] += weight.numel() * share
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
    # A hybrid language model (Qwen3.5): its linear-attention layers have no L^2 term (linear_attention_flops)
    linear_layers = list(getattr(text_config, "layer_types", None) or []).count("linear_attention")
    attention_layers = text_config.num_hidden_layers - linear_layers
    text_width = attention_width(text_config) / max(attention_layers, 1)  # their mean heads x head_dim
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
        total["llm"] += c["llm"] / 2 * 4 * length**2 * text_width * attention_layers
        if linear_layers:
            total["llm"] += c["llm"] / 2 * linear_attention_flops(text_config, length) * linear_layers
    return {role: flops / max(len(token_counts), 1) for role, flops in total.items()}


STEP_PARTS = ("vision tower", "projector", "decoder layers", "LM head")


def flop_shares(
    model: nn.Module, family: Family, modes: dict[str, str], token_counts: Iterable[tuple[int, int]]
) -> dict[str, float]:
    """Each part's share of a training step's FLOPs (`STEP_PARTS`, summing to 1): the tower, the projector,
    the language model's decoder layers (attention included), and its LM head, which a plain forward runs
    at every position. A bench model is shaped like a real one when these shares are the real one's."""
    counts = list(token_counts)
    by_role = flops_per_sample_by_role(model, family, modes, counts)
    mean_length = sum(text + image for text, image in counts) / max(len(counts), 1)
    head = flop_coefficients(modes)["llm"] * model.get_output_embeddings().weight.numel() * mean_length
    parts = (by_role["vision"], by_role["projector"], by_role["llm"] - head, head)
    return {part: flops / sum(parts) for part, flops in zip(STEP_PARTS, parts, strict=True)}


def attention_width(text_config) -> int:
    """The summed width (heads x head_dim) of the language model's attention layers, each from its own
    config: Gemma 4's global layers have a head_dim of their own (and transformers refuses the global value
    of a per-layer attribute)."""
    types = list(getattr(text_config, "layer_types", None) or [])
    widths = []
    for i in range(text_config.num_hidden_layers):
        if i < len(types) and types[i] == "linear_attention":
            continue
        layer = text_config.per_layer_config[i]
        heads = layer.num_attention_heads
        widths.append(heads * (getattr(layer, "head_dim", None) or text_config.hidden_size // heads))
    return sum(widths)


LINEAR_ATTENTION_CHUNK = 64  # transformers' and flash-linear-attention's chunk for Gated DeltaNet


def linear_attention_flops(text_config, length: int) -> float:
    """Forward FLOPs of one Gated DeltaNet layer's token mixing over a sample of `length` (its projections
    are weights, counted with the role's), in the chunked form transformers and flash-linear-attention run:
    the sample padded to whole chunks of C; per chunk and value head, the intra-chunk products
    (keys x keys, queries x keys: 2*C^2*key_dim each; their scores x values: 2*C^2*value_dim) and the state
    read and written (3 x 2*C*key_dim*value_dim). The two triangular solves of the UT transform
    (C^2*(key_dim + value_dim)) are left out, as torch's FLOP counter leaves them."""
    chunk = LINEAR_ATTENTION_CHUNK
    chunks = -(-length // chunk)
    key, value = text_config.linear_key_head_dim, text_config.linear_value_head_dim
    per_chunk = 2 * chunk**2 * (2 * key + value) + 6 * chunk * key * value
    return chunks * text_config.linear_num_value_heads * per_chunk


def last_layer_flops_per_position(model: nn.Module, family: Family, modes: dict[str, str]) -> float:
    """The training FLOPs, at one position, of what training.loss_positions_only skips at an unlabelled
    position: the last decoder layer's output projection and MLP, and the LM head."""
    from vlm_recipes.speedups.loss_positions import skipped_at_unlabelled_positions

    skipped = skipped_at_unlabelled_positions(model)
    share = active_expert_share(model)
    weights = {}
    for module in skipped:
        for name, p in module.named_parameters():
            if p.dim() == 2:
                weights[id(p)] = p.numel()
            elif p.dim() == 3 and (name.startswith("experts.") or ".experts." in name):
                weights[id(p)] = p.numel() * share  # an MoE last layer's experts: the active share
    return flop_coefficients(modes)["llm"] * sum(weights.values())


def active_expert_share(model: nn.Module) -> float:
    """The share of a mixture-of-experts block's experts a token runs through (1: a dense model)."""
    text = model.config.get_text_config()
    # Gemma 4's config names experts per token `top_k_experts`, and holds None where it has no experts
    per_token = getattr(text, "num_experts_per_tok", None) or getattr(text, "top_k_experts", None) or 1
    return per_token / (routed_experts(text) or 1)


def measured_matmul_peak_tflops(
    dtype: torch.dtype, threads: int, size: int = 2048, seconds: float = 1.0, device: str = "cpu"
) -> float:
    """The device's matmul peak in `dtype`, as training would get it: the best of several timed size x size
    products after a warm-up. MFU's denominator: a CPU's depends on its vector units (AMX, AVX512-BF16 or
    neither) and on `threads`; a GPU's on its clocks and power limit as they are now, which a published
    peak does not know. On a GPU each timing covers 10 products between synchronisations."""
    import time

    on_gpu = device == "cuda"
    group = 10 if on_gpu else 1
    synchronize = torch.cuda.synchronize if on_gpu else (lambda: None)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, dtype=dtype, device=device)
        b = torch.randn(size, size, dtype=dtype, device=device)
        for _ in range(2 * group):
            a @ b
        synchronize()
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            for _ in range(group):
                a @ b
            synchronize()
            best = max(best, group * 2 * size**3 / (time.perf_counter() - started))
        return best / 1e12
    finally:
        torch.set_num_threads(before)


def peak_tflops(device: str) -> float | None:
    """Dense bf16 peak of the current GPU by name (None on CPU or an unknown GPU: pass it yourself)."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    return PEAK_BF16_TFLOPS.get(torch.cuda.get_device_name())
