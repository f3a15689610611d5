"""What the runner asks of a model family, in one place.

A family module (``families/qwen2_vl.py``, ...) defines one ``Family`` instance; the registry in
``families/__init__.py`` lists them. Its tiny offline demo models are the demo's (``demo/tiny/``): a family
knows its real models only. Nothing outside ``families/`` names a family's modules: the speed-ups, caches,
demo, tests and tables ask the family (``rope_index_keys``, ``image_padding``, ``lmms_eval_models``).

Roles: each role is a set of module-name prefixes, and a parameter belongs to the role with the longest
matching prefix, so ``model.visual.merger.*`` is the projector although it sits inside ``model.visual``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn


@dataclass(frozen=True)
class VisionGeometry:
    """What the FLOP formula needs to know about a vision tower."""

    patches_per_token: int  # vision patches merged into one language-model token
    width: int  # attention width of a tower layer
    layers: int
    # Windowed attention (Qwen2.5-VL): a window is `window` x `window` merged tokens; all layers but
    # `full_attention_layers` attend within their window only. None: every layer attends over the image.
    window: int | None = None
    full_attention_layers: int | None = None

    @classmethod
    def of_tower(cls, vision_config, patches_per_token: int, tile_side: int | None = None) -> VisionGeometry:
        """A ViT tower's (`hidden_size` wide, `num_hidden_layers` deep). `tile_side`: each tile attended on
        its own, a window of one tile (that many merged tokens a side); None: layers see the whole image."""
        return cls(
            patches_per_token,
            vision_config.hidden_size,
            vision_config.num_hidden_layers,
            window=tile_side,
            full_attention_layers=None if tile_side is None else 0,
        )

    def attention_pairs(self, image_tokens: int, grid: tuple[int, int] | None = None) -> int:
        """Query-key pairs (L^2 summed over attention groups) over all tower layers, for one image of
        `image_tokens` merged tokens. `grid`: its merged (height, width), which places the windows exactly;
        without it the windows are taken as full but for the last one, an upper bound (partial windows at
        the image's edges hold fewer pairs)."""
        per_token = self.patches_per_token
        patches = image_tokens * per_token
        if self.window is None:
            return self.layers * patches**2
        full = self.layers if self.full_attention_layers is None else self.full_attention_layers
        if grid is not None:
            rows, cols = (self._window_sides(side) for side in grid)
            windowed = sum((r * c * per_token) ** 2 for r in rows for c in cols)
        else:
            whole, rest = divmod(image_tokens, self.window**2)
            windowed = whole * (self.window**2 * per_token) ** 2 + (rest * per_token) ** 2
        return full * patches**2 + (self.layers - full) * windowed

    def _window_sides(self, tokens: int) -> list[int]:
        """Window extents along one side of `tokens` merged tokens: whole windows from the top left, then
        what is left (transformers' get_vision_window_index)."""
        whole, rest = divmod(tokens, self.window)
        return [self.window] * whole + ([rest] if rest else [])


@dataclass(frozen=True)
class DtypeBoundary:
    """A place in the forward where a tensor made by one role is read by another. Roles can hold different
    dtypes (trained fp32 masters beside frozen bf16 weights), and where they meet, what crosses is cast to
    the dtype of `dtype_of`'s weights (a module path; "": the receiving `module` itself).

    `side` "input": the floating inputs of `module` are cast before it runs (those named in `inputs`, or all
    of them); "output": its output is cast after it ran."""

    crossing: str  # what crosses, for the log: "vision tower -> projector"
    module: str  # the module path that receives (side "input") or produces (side "output") it
    side: str = "input"
    inputs: tuple[str, ...] = ()  # keyword inputs to cast (side "input"); (): every floating input
    dtype_of: str = ""
    why: str = ""  # where the cast is not obvious: what in the model needs it


@dataclass(frozen=True)
class DecoderLayer:
    """The language model's decoder layers by transformers' module names, the same in every family here: the
    loss-positions speed-up (speedups/loss_positions.py) runs the last layer's parts itself.

    A pre-norm layer (Llama, Qwen2, Qwen3) is input norm, attention, post-attention norm, MLP; Gemma 3's
    sandwich-norm layer adds a norm before and after its MLP (and its post-attention norm then normalizes
    the attention's output before the residual)."""

    layers: str = "layers"  # the ModuleList of the model's `get_decoder()`
    input_norm: str = "input_layernorm"
    attention: str = "self_attn"
    attention_output: str = "o_proj"  # the attention's output projection, a child of `attention`
    post_attention_norm: str = "post_attention_layernorm"
    mlp: str = "mlp"
    pre_mlp_norm: str = "pre_feedforward_layernorm"  # sandwich norm only
    post_mlp_norm: str = "post_feedforward_layernorm"  # sandwich norm only

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The language model's decoder layers (under PEFT too)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return getattr(base.get_decoder(), self.layers)

    @property
    def pre_norm(self) -> set[str]:
        """The children of a pre-norm layer."""
        return {self.input_norm, self.attention, self.post_attention_norm, self.mlp}

    @property
    def sandwich_norm(self) -> set[str]:
        """The children of a sandwich-norm layer."""
        return self.pre_norm | {self.pre_mlp_norm, self.post_mlp_norm}


def expand_image_placeholders(
    texts: list[str], sizes: list[list[tuple[int, int]]], placeholder: str, expand: Callable[[list, int], str]
) -> list[str]:
    """Each text with its image placeholders replaced by `expand(sample's image sizes, index)`, the text the
    processor writes for that image (ValueError: not one placeholder per image)."""
    expanded = []
    for text, image_sizes in zip(texts, sizes, strict=True):
        parts = text.split(placeholder)
        if len(parts) - 1 != len(image_sizes):
            raise ValueError(f"{len(parts) - 1} {placeholder} in the text, {len(image_sizes)} images")
        pieces = [parts[0]]
        for index, rest in enumerate(parts[1:]):
            pieces += [expand(image_sizes, index), rest]
        expanded.append("".join(pieces))
    return expanded


def count_expanded_tokens(
    processor, texts: list[str], sizes: list[list[tuple[int, int]]], expand: Callable[[list, int], str]
) -> list[tuple[int, int]]:
    """(text tokens, image tokens) of each chat-templated text, each image placeholder replaced by
    `expand(sample's image sizes, index)`, the processor's own text for that image (its
    `replace_image_token`), then tokenized as the processor does: for processors that write more around each
    image than repeated placeholders (rows and their breaks, tiles and their frames, begin and end tokens)."""
    expanded = expand_image_placeholders(texts, sizes, processor.image_token, expand)
    ids = processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    image_id = processor.image_token_id
    return [(len(sample) - sample.count(image_id), sample.count(image_id)) for sample in ids]


# The module names transformers gives the models built like LLaVA (a tower, a projector, a language model)
LLAVA_STYLE_ROLES = {
    "vision": ("model.vision_tower",),
    "projector": ("model.multi_modal_projector",),
    "llm": ("model.language_model", "lm_head"),
}


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.model_type values this family handles
    role_prefixes: dict[str, tuple[str, ...]]  # role → module-name prefixes
    lm_head_prefixes: tuple[str, ...] = ("lm_head",)  # the output head (in llm; kept out of 4-bit by default)

    # ------------------------------------------------------------------ what the speed-ups and caches ask
    # (class attributes: a family class that differs sets its own)

    # The batch keys `rope_index` takes as keyword arguments besides input_ids and attention_mask (those a
    # batch holds are passed: padding-free packing computes each sample's positions with them).
    rope_index_keys: ClassVar[tuple[str, ...]] = ()
    # How the processor batches an image tensor that is neither per token nor concatenated along its first
    # dimension, by batch key (the preprocessed-sample cache assembles a batch from one-row samples the same
    # way): "per sample", [samples, images, ..., H, W] zero-padded to the batch's most images and largest
    # sides (SmolVLM's tiles and their pixel masks); "tiles", [images, tiles, ...] zero-padded to the batch's
    # most tiles (LLaVA-OneVision's anyres); "sides", [images, 3, H, W] each zero-padded to the batch's
    # largest height and width (Mistral 3's Pixtral images); "concatenated", along the first dimension as any
    # other image tensor is (the Qwen line's patches, Gemma 3's images), named where one image's tensor
    # [1, patches, ...] could pass for a per-token one (Gemma 4's patches, padded to a budget near a sample's
    # length).
    image_padding: ClassVar[dict[str, str]] = {}
    # The language model's decoder layers and their parts (the loss-positions speed-up cuts the last one).
    decoder_layer: ClassVar[DecoderLayer] = DecoderLayer()
    # Sub-configs whose towers no stage feeds, each with why (Gemma 4's audio_config): stages set them to
    # None before the weights load (model/build.py), and final/ takes the towers back from the source.
    towers_left_out: ClassVar[dict[str, str]] = {}
    # Whether the decoder layers hand attention a packed row's text positions, from which per-sample attention
    # reads each sample's bounds (padding-free packing); False: the layers get only the 3-D multimodal
    # positions (GLM-4.5V's MoE layers), and packed rows stay on sdpa under the block mask transformers builds.
    text_positions_reach_attention: ClassVar[bool] = True
    # Keyword arguments every load of the family's processor passes (model/build.load_processor, predict):
    # fixes transformers applies only when asked (Mistral 3's fix_mistral_regex).
    processor_load_kwargs: ClassVar[dict[str, object]] = {}
    # How the family's models write a box in their answers (methods/grounding.py: relative_1000,
    # resized_pixels, pixels); None: no convention documented, so the iou reward asks the recipe.
    box_format: ClassVar[str | None] = None
    # training.* speed-ups the family cannot prove exact, each with why: a stage that asks for one trains
    # without it, the decision logged (the generic family's: generic_family.UNPROVEN_SPEEDUPS)
    unproven_speedups: ClassVar[dict[str, str]] = {}
    # Whether every trained parameter gets a gradient from a row with an image (False: some may not, as the
    # generic family cannot tell, and DDP searches each step's graph for those without one)
    reads_every_parameter: ClassVar[bool] = True
    sequence_parallel_refusal: ClassVar[str | None] = "not proven equal to one process yet"  # None: proven
    # lmms-eval's --model that loads a stage's final/ of each model type, and why none does (cli/lmms_eval.py)
    lmms_eval_models: ClassVar[dict[str, str]] = {}
    no_lmms_eval_model: ClassVar[dict[str, str]] = {}

    # ------------------------------------------------------------------ roles

    def role_of(self, name: str) -> str | None:
        """The role a parameter or module name belongs to (None: outside every role)."""
        best, best_len = None, -1
        for role, prefixes in self.role_prefixes.items():
            for prefix in prefixes:
                if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                    best, best_len = role, len(prefix)
        return best

    def is_lm_head(self, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in self.lm_head_prefixes)

    def quantization_skip_modules(self, parts: list[str]) -> list[str]:
        """Full module paths for bitsandbytes' `llm_int8_skip_modules`.

        Full paths, because bitsandbytes matches `visual` against module names in a way that still
        quantizes `model.visual` (seen with transformers 5.23 / bitsandbytes 0.50), and lm_head must be
        listed explicitly: passing any skip list replaces transformers' default skips."""
        modules: list[str] = []
        for part in parts:
            modules.extend(self.lm_head_prefixes if part == "lm_head" else self.role_prefixes[part])
        return list(dict.fromkeys(modules))

    # ------------------------------------------------------------------ what differs per family

    # The inner model's attribute holding the vision tower (the Qwen line: `visual`, SmolVLM: `vision_model`)
    tower_attribute: ClassVar[str] = "vision_tower"

    def image_encoder_owner(self, model: nn.Module) -> nn.Module:
        """The inner module whose forward calls `self.get_image_features(...)` for a batch's images."""
        for module in model.modules():
            if (
                callable(getattr(module, "get_image_features", None))
                and self.tower_attribute in module._modules
            ):
                return module
        raise ValueError(f"{type(model).__name__} has no vision tower with get_image_features")

    def vision_tower(self, model: nn.Module) -> nn.Module:
        """The vision tower module (its weights key the feature cache)."""
        return getattr(self.image_encoder_owner(model), self.tower_attribute)

    def split_images(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
        """A batch's pixel values, one tensor per image, in the order features come back."""
        raise NotImplementedError

    def image_units(self, pixel_values: torch.Tensor, grids) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What the vision feature cache keys and stores one entry per: (pixels, grid) of each image, in the
        order features come back. `grids`: the second argument of `get_image_features` (Qwen: the image
        grids; SmolVLM: the pixel attention mask)."""
        return list(zip(self.split_images(pixel_values, grids), grids, strict=True))

    def batch_image_units(self, units: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        """The inverse of `image_units` for some of them: the (pixel_values, grids) arguments of
        `get_image_features` that compute just these."""
        return torch.cat([pixels for pixels, _ in units]), torch.stack([grid for _, grid in units])

    def split_image_features(self, output) -> list[dict[str, torch.Tensor]]:
        """What `get_image_features` returned for a batch's images, as one dict of tensors per image (what
        the vision feature cache stores): everything the model reads from it, by default `pooler_output`."""
        return [{"features": features} for features in output.pooler_output]

    def join_image_features(self, images: list[dict[str, torch.Tensor]]):
        """The inverse of `split_image_features`: the output `get_image_features` returns for these images."""
        raise NotImplementedError

    def apply_pixel_bounds(self, image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
        """Make the processor resize images to between min_pixels and max_pixels (data.min/max_pixels)."""
        raise NotImplementedError

    def image_token_counts(self, processor, sizes: list[tuple[int, int]]) -> list[int]:
        """Tokens the processor expands each image of (height, width) into."""
        raise NotImplementedError

    def count_tokens(
        self, processor, texts: list[str], sizes: list[list[tuple[int, int]]]
    ) -> list[tuple[int, int]]:
        """(text tokens, image tokens) of each chat-templated text whose images have these (height, width)
        sizes, exactly as the processor will tokenize it, without processing pixels.

        This default holds where the template writes one placeholder token per image and the processor
        repeats it (the Qwen line: one <|image_pad|> becomes `image_token_counts` of them). A family whose
        processor writes more around each image (boundary tokens, tiles, rows and columns) overrides it."""
        ids = processor.tokenizer(texts, add_special_tokens=False)["input_ids"]
        counts = []
        for text_ids, image_sizes in zip(ids, sizes, strict=True):
            image_tokens = sum(self.image_token_counts(processor, image_sizes)) if image_sizes else 0
            counts.append((len(text_ids) - len(image_sizes), image_tokens))
        return counts

    def count_expanded_images(
        self,
        processor,
        texts: list[str],
        sizes: list[list[tuple[int, int]]],
        placeholder: str,
        expand: Callable[[list, int], str],
    ) -> list[tuple[int, int]]:
        """(text tokens, image tokens) of each text, its placeholders expanded (expand_image_placeholders)
        and tokenized as the processor does: image tokens as `image_token_counts` says, the rest text."""
        expanded = expand_image_placeholders(texts, sizes, placeholder, expand)
        ids = processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        counts = []
        for text_ids, image_sizes in zip(ids, sizes, strict=True):
            image_tokens = sum(self.image_token_counts(processor, image_sizes)) if image_sizes else 0
            counts.append((len(text_ids) - image_tokens, image_tokens))
        return counts

    @property
    def takes_video(self) -> bool:
        """Whether rows with videos can be trained on (the family says how: `video_frame_factor`)."""
        return type(self).video_frame_factor is not Family.video_frame_factor

    def video_frame_factor(self, processor) -> int | None:
        """Video frame sides are resized to multiples of this many pixels (patch size x merge size); None:
        the family takes no video, and a row with one is refused at the data check."""
        return None

    def video_encoder(self) -> str | None:
        """The method of `image_encoder_owner` that computes video features, where it does not call
        `get_image_features` itself (None: it does, or the family takes no video). The frozen-vision
        speed-ups hook it as they hook `get_image_features`."""
        return None

    def video_processor_kwargs(self, processor, metadata: list) -> dict:
        """The processor's `videos_kwargs` for frames already sampled and sized (data/video.py), with their
        `VideoMetadata` (frame times)."""
        raise NotImplementedError

    def count_video_tokens(self, processor, plans: list) -> tuple[int, int]:
        """(text tokens, video tokens) a sample's videos add, given their frame plans (data.video.FramePlan),
        to the one placeholder token per video that `count_tokens` counted as text."""
        raise NotImplementedError

    def rope_index(self, model: nn.Module) -> Callable | None:
        """The model's multimodal position function for padding-free packing (None: 1-D positions)."""
        return None

    def feature_cache_refusal(self, most_images_per_sample: int) -> str | None:
        """Why the vision feature cache cannot be exact for data whose samples hold up to this many images
        (None: it is). A stage asking for it is refused at its data check with this reason."""
        return None

    def padding_free_refusal(self) -> str | None:
        """Why padding-free packing cannot be exact for this family (None: it is). A stage asking for it is
        refused at its data check with this reason. Packing is exact where text attention is causal and each
        image's features are its own; a family without `rope_index` packs with 1-D positions restarting per
        sample. Every family's packed losses are compared with unpacked ones in tests/test_speedups.py."""
        return None

    def unread_parameters(self, model: nn.Module) -> list[str]:
        """Parameters the model's forward never reads (LLaVA-OneVision: its tower's post_layernorm). They stay
        frozen when their role trains in full: no gradient reaches them, and DDP stops on such a one."""
        return []

    # A published chat template TRL has no training variant of (or whose markers leave the stop token out of
    # the loss, which TRL only warns about) → the variant stages train with: the same text, each answer and
    # its stop token marked for the loss.
    training_chat_templates: ClassVar[dict[str, str]] = {}

    def training_chat_template(self, processor) -> str | None:
        """A chat template to train with in place of the processor's, rendering the same text (None: the
        processor's, or TRL's training variant of it)."""
        template = processor.chat_template
        return self.training_chat_templates.get(template) if isinstance(template, str) else None

    def dtype_boundaries(self) -> list[DtypeBoundary]:
        """Where roles meet in the forward, each crossing cast to the receiver's dtype (the dtype-boundary
        guard installs them). The default: image and video features enter every projector module in its
        dtype, and the language model takes its input embeddings (the image features scattered into them)
        in its own. A family whose model casts elsewhere (SmolVLM) adds its own."""
        return [
            *(DtypeBoundary("vision tower -> projector", prefix) for prefix in self.projector_modules()),
            DtypeBoundary(
                "image features -> language model", self.role_prefixes["llm"][0], inputs=("inputs_embeds",)
            ),
        ]

    def projector_modules(self) -> tuple[str, ...]:
        """The projector role's modules that take the tower's output (a bare parameter such as LLaVA's
        image_newline is not one)."""
        return self.role_prefixes["projector"]

    def vision_geometry(self, config) -> VisionGeometry:
        raise NotImplementedError

    def repair(self, model: nn.Module) -> list[str]:
        """Fix what the family's model class gets wrong in this transformers version, on a model just loaded
        (model/build.py: load_model; predict); each fix said in a few words for the log. None by default."""
        return []
