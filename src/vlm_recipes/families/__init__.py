"""Model families: everything the runner knows about a family, one module each; any other image-text-to-text
model through the generic family (generic_family.py), from the roles its module tree shows.

Adding a family means adding one module here (its `Family` instance: what the family is), its line in
`FAMILIES` below, and its tiny offline builder in `demo/tiny/` (a module whose BUILDS names its demo models).
The rest asks the registry: the demo ids' families, lmms-eval's model names, the tests' model lists, the
Liger table.
"""

from __future__ import annotations

from vlm_recipes.errors import LoraTargetError, UnsupportedModelError
from vlm_recipes.families.base import Family
from vlm_recipes.families.gemma3 import GEMMA3
from vlm_recipes.families.gemma4 import GEMMA4
from vlm_recipes.families.generic import RolesNotFound, roles_of_config
from vlm_recipes.families.generic_family import GenericFamily
from vlm_recipes.families.glm4v import GLM4V, GLM4V_MOE
from vlm_recipes.families.internvl import INTERNVL
from vlm_recipes.families.lfm2_vl import LFM2_VL
from vlm_recipes.families.llama4 import Llama4Family
from vlm_recipes.families.llava_onevision import LLAVA_ONEVISION
from vlm_recipes.families.mistral3 import MISTRAL3
from vlm_recipes.families.molmo2 import Molmo2Family
from vlm_recipes.families.qwen2_5_vl import QWEN2_5_VL
from vlm_recipes.families.qwen2_vl import QWEN2_VL
from vlm_recipes.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from vlm_recipes.families.qwen3_vl import QWEN3_VL
from vlm_recipes.families.smolvlm import SMOLVLM

# Model types trained from the roles the generic finder shows, with what their model needs besides, one
# module each (a GenericFamily subclass): a training chat template, a fix transformers lacks
GENERIC_WITH_KNOWLEDGE: dict[str, type[GenericFamily]] = {"llama4": Llama4Family, "molmo2": Molmo2Family}

FAMILIES: tuple[Family, ...] = (
    QWEN2_VL,
    QWEN2_5_VL,
    QWEN3_VL,
    QWEN3_5,
    QWEN3_5_MOE,
    SMOLVLM,
    GEMMA3,
    GEMMA4,
    LLAVA_ONEVISION,
    MISTRAL3,
    GLM4V,
    GLM4V_MOE,
    INTERNVL,
    LFM2_VL,
)

__all__ = [
    "FAMILIES",
    "Family",
    "LoraTargetError",
    "UnsupportedModelError",
    "family_for_config",
    "family_for_model_type",
]


def family_for_model_type(model_type: str) -> Family:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(f"{f.name} ({', '.join(f.model_types)})" for f in FAMILIES)
    raise UnsupportedModelError(
        f"model type `{model_type}` is not supported. Supported families: {supported}. "
        "A new family is one module in vlm_recipes/families/."
    )


def family_for_config(config, trust_remote_code: bool = False) -> Family:
    """The family module naming `config`'s model type, else the generic family with the roles found in the
    model built from `config` on the meta device (found once per config)."""
    for family in FAMILIES:
        if config.model_type in family.model_types:
            return family
    key = (config.to_json_string(use_diff=False), trust_remote_code)
    if key not in _GENERIC:
        _GENERIC[key] = _generic_family(config, trust_remote_code)
    return _GENERIC[key]


_GENERIC: dict[tuple[str, bool], Family] = {}


def _generic_family(config, trust_remote_code: bool) -> Family:
    known = ", ".join(t for family in FAMILIES for t in family.model_types)
    try:
        found = roles_of_config(config, trust_remote_code)
    except RolesNotFound as refusal:
        raise UnsupportedModelError(
            f"model type `{config.model_type}` has no family module (those with one: {known}), and the generic "
            f"family cannot train it: {refusal}{_image_text_part(config)}"
        ) from None
    if found.refusal:
        raise UnsupportedModelError(
            f"model type `{config.model_type}` has no family module, and the generic family cannot train it: "
            f"{found.refusal}"
        )
    return GENERIC_WITH_KNOWLEDGE.get(config.model_type, GenericFamily).of(found)


def _image_text_part(config) -> str:
    """Where a composite checkpoint (Qwen3-Omni: thinker, talker, speech decoder) holds an image-text-to-text
    model as one of its parts, how to train that part."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    for name in getattr(config, "sub_configs", {}):
        part = getattr(config, name, None)
        if getattr(part, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            model_class = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[part.model_type]
            return (
                f". Its `{name}` is an image-text-to-text model ({part.model_type}): save it alone, "
                f"`{model_class}.from_pretrained(<model>).save_pretrained(<dir>)` with the processor beside it, "
                "and train model=<dir>"
            )
    return ""
