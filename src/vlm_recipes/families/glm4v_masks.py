"""A fix for transformers' GLM-4V: a batch holding both an image and a video.

GLM-4V's processor writes a video's frames with the image token (each pair of frames an image block inside
`<|begin_of_video|>...<|end_of_video|>`), and transformers 5.24's `Glm4vModel.get_placeholder_mask` takes
every <|image|> token as an image's and, again, as a video's. A batch with images alone or videos alone
works; one with both (a sample with an image and a video, or an image row batched with a video row) stops
with "Image features and image tokens do not match" (tests/test_family_glm4v.py pins it on the unfixed
method). The fix tells them apart as the processor's own `mm_token_type_ids` do: an <|image|> token inside a
video's start and end tokens is the video's. Everything else is the method it replaces.

GLM-4.6V's model (`Glm46VModel`, its processor's model type) and GLM-4.5V / GLM-4.6V's MoE model
(`Glm4vMoeModel`) are copies of the same code, not subclasses, with the same method: each is fixed the same
way, when transformers' modeling module of that model is imported, not before (importing one costs seconds
that commands loading no model should not pay).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

import torch

# transformers' modeling module -> its model class with the method to fix
MODELS = {
    "transformers.models.glm4v.modeling_glm4v": "Glm4vModel",
    "transformers.models.glm46v.modeling_glm46v": "Glm46VModel",
    "transformers.models.glm4v_moe.modeling_glm4v_moe": "Glm4vMoeModel",
}
_FIXED = "_vlm_recipes_video_span_masks"


def placeholder_masks_by_video_span(
    self, input_ids, inputs_embeds, image_features=None, video_features=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(image mask, video mask), [batch, length, 1]: the <|image|> tokens outside and inside a video's span."""
    if input_ids is None:  # embeddings only: the method it replaces (it cannot tell them apart either)
        return getattr(type(self), _FIXED)(self, input_ids, inputs_embeds, image_features, video_features)
    config = self.config
    opened = (input_ids == config.video_start_token_id).cumsum(-1)
    closed = (input_ids == config.video_end_token_id).cumsum(-1)
    in_video = opened > closed
    placeholders = input_ids == config.image_token_id
    masks = []
    for what, mask, features in (
        ("Image", placeholders & ~in_video, image_features),
        ("Video", placeholders & in_video, video_features),
    ):
        if features is not None and int(mask.sum()) * inputs_embeds.shape[-1] != features.numel():
            raise ValueError(
                f"{what} features and {what.lower()} tokens do not match, tokens: {int(mask.sum())}, "
                f"features: {features.shape[0]}"
            )
        masks.append(mask.unsqueeze(-1).to(inputs_embeds.device))
    return masks[0], masks[1]


def fix_placeholder_masks(modeling) -> None:
    """Install the fix on the module's model class (once), keeping the original beside it."""
    model_class = getattr(modeling, MODELS[modeling.__name__])
    if not hasattr(model_class, _FIXED):
        setattr(model_class, _FIXED, model_class.get_placeholder_mask)
        model_class.get_placeholder_mask = placeholder_masks_by_video_span


class _FixOnImport(importlib.abc.MetaPathFinder):
    """Finds one of transformers' GLM-4V modeling modules as usual and fixes it right after it executes."""

    def __init__(self, pending: set[str]):
        self.pending = pending

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        sys.meta_path.remove(self)  # the lookup below must not find this finder again
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if self.pending:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            fix_placeholder_masks(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Fix each module now if it is loaded, else as soon as it is."""
    if any(isinstance(finder, _FixOnImport) for finder in sys.meta_path):
        return
    for name in [name for name in MODELS if name in sys.modules]:
        fix_placeholder_masks(sys.modules[name])
    if pending := {name for name in MODELS if name not in sys.modules}:
        sys.meta_path.insert(0, _FixOnImport(pending))
