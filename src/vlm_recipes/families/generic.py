"""The three roles of a vision-language model found from its own module tree, for a model type no family
module names (transformers maps ~100 types to AutoModelForImageTextToText; the family modules in FAMILIES
name a few of them).

`find_roles(model)` reads a model built on the meta device (`build_on_meta(config)`: no weights) and
returns `FoundRoles`, the same role prefixes a family module writes by hand, or raises `RolesNotFound`
saying what is missing. How each role is found:
- the language model: the model's `get_decoder()` (the module transformers itself calls the decoder),
  else the module holding `get_input_embeddings()`; the LM head is `get_output_embeddings()`. Where that
  module also holds the tower (IDEFICS' `model`: one module for both), its children outside the tower
  and projector are the language model;
- the towers: modules named as towers are in transformers (`visual`, `vision_tower`, ...; an audio tower
  joins them, as Gemma 4's family has it), else a module whose class name says Vision;
- the projector: modules named as projectors (`multi_modal_projector`, `connector`, ...), those inside a
  tower that map its output into the language model (the Qwen line's `visual.merger`: the longest-prefix
  rule of `Family.role_of` makes them the projector's), and the bare parameters of the module that owns
  the tower (LLaVA's `image_newline`, BLIP-2's `query_tokens`): what sits between the tower and the
  language model.
A parameter outside every role is `unassigned`; a model with any is not accepted (`refusal`).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from vlm_recipes.errors import UnsupportedModelError
from vlm_recipes.families.base import Family
from vlm_recipes.families.parameters import linear_modules_of_role, params_by_role
from vlm_recipes.roles import ROLES

# Attribute names of vision towers in transformers' image-text-to-text models (their module trees at 5.24)
TOWER_NAMES = (
    "vision_tower",
    "visual",
    "vision_model",
    "vision_encoder",
    "image_encoder",
    "image_tower",
    "video_tower",
    "high_res_vision_model",
    "vision_backbone",
)
# Other modalities' towers: the vision role holds every encoder that is not the language model (Gemma 4's
# family puts its audio tower there too), since a recipe trains three roles
AUDIO_TOWER_NAMES = ("audio_tower", "audio_model", "audio_encoder")
# Attribute names of the modules between a tower's output and the language model's input
PROJECTOR_NAMES = (
    "multi_modal_projector",
    "mm_projector",
    "connector",
    "merger",
    "projector",
    "aligner",
    "qformer",
    "language_projection",
    "image_to_text_projection",
    "visual_projection",
    "vision_projection",
    "vision_adapter",
    "vision_resampler",
    "perceiver_resampler",
    "resampler_model",
    "embed_vision",
    "embed_audio",
    "visual_embeddings_table",
    "high_res_vision_neck",
    "high_res_vision_proj",
)
# Children of a tower that project its output into the language model's width: the Qwen line's merger,
# Qwen3-VL's DeepStack mergers (Qwen3-Omni's merger_list), GLM-4V's downsampling convolution that feeds its
# merger, Granite-Docling's connector
PROJECTOR_NAMES_IN_TOWER = (
    "merger",
    "patch_merger",
    "deepstack_merger_list",
    "merger_list",
    "downsample",
    "connector",
)
# Where get_decoder() gives nothing better: common attribute paths of the language model
LANGUAGE_MODEL_NAMES = (
    "model.language_model",
    "model.text_model",
    "language_model",
    "text_model",
    "model.decoder",
    "text_decoder",
)
FAMILY_HINT = "a family module (families/<name>.py) would name it in role_prefixes"


class RolesNotFound(UnsupportedModelError):
    """A model whose roles the generic finder cannot tell: `kind` groups the reasons (the table counts
    them), `what` says what is missing in a few words, `looked_for` where it was looked for."""

    def __init__(self, kind: str, what: str, looked_for: str = ""):
        super().__init__(f"{kind}: {what}" + (f": {looked_for}" if looked_for else ""))
        self.kind, self.what, self.looked_for = kind, what, looked_for

    @property
    def short(self) -> str:
        return f"{self.kind}: {self.what}"


@dataclass(frozen=True)
class FoundRoles:
    """The roles found in one model, in the form a `Family` holds them."""

    model_type: str
    role_prefixes: dict[str, tuple[str, ...]]  # role → module-name prefixes (longest match wins)
    lm_head_prefixes: tuple[str, ...]
    parameters: dict[str, int]  # role → parameter count
    lora_targets: dict[str, tuple[str, ...]]  # "llm", "vision" → names of their nn.Linear leaves
    unassigned: tuple[str, ...]  # parameters outside every role
    language_model: str = ""  # the language model's module ("": the whole model)
    projector_modules: tuple[str, ...] = ()  # the projector's modules (not its bare parameters)

    def as_family(self) -> Family:
        """A plain `Family` holding these roles (role_of, is_lm_head, quantization skips); nothing else."""
        return Family(
            name=f"generic:{self.model_type}",
            model_types=(self.model_type,),
            role_prefixes=self.role_prefixes,
            lm_head_prefixes=self.lm_head_prefixes,
        )

    def role_of(self, name: str) -> str | None:
        return self.as_family().role_of(name)

    @property
    def refusal(self) -> str | None:
        """Why a model with these roles cannot be trained role by role (None: it can)."""
        if not self.unassigned:
            return None
        shown = ", ".join(self.unassigned[:4]) + (", ..." if len(self.unassigned) > 4 else "")
        return (
            f"{len(self.unassigned)} parameters outside every role ({shown}); a family module "
            "(families/<name>.py) would name their modules in role_prefixes"
        )


@contextmanager
def quiet_transformers():
    """Silence transformers' logging and Python warnings while default configs are built (each type warns
    about its defaults: noise around the one line a reader wants)."""
    from transformers.utils import logging as transformers_logging

    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers_logging.set_verbosity(level)


def is_encoder_decoder(config) -> bool:
    text_config = getattr(config, "text_config", None)
    return bool(
        getattr(config, "is_encoder_decoder", False) or getattr(text_config, "is_encoder_decoder", False)
    )


def _encoder_decoder(model_type: str) -> RolesNotFound:
    return RolesNotFound(
        "encoder-decoder",
        "a decoder cross-attending to an encoder writes the text",
        f"{model_type}'s roles are not a vision tower, a projector and a decoder-only language model",
    )


def is_image_text_to_text(model_type: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def build_on_meta(config, trust_remote_code: bool = False) -> nn.Module:
    """The image-text-to-text model of `config`, its parameters on the meta device (no memory, no weights)."""
    from transformers import AutoModelForImageTextToText

    with quiet_transformers(), torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config, trust_remote_code=trust_remote_code)


def roles_of_config(config, trust_remote_code: bool = False) -> FoundRoles:
    """Build `config`'s model on meta and find its roles (RolesNotFound: why not)."""
    if is_encoder_decoder(config):
        raise _encoder_decoder(config.model_type)
    if not trust_remote_code and not is_image_text_to_text(config.model_type):
        raise RolesNotFound(
            "not an image-text-to-text model",
            f"transformers' AutoModelForImageTextToText maps no model class to `{config.model_type}`",
            "a text-only model, or one whose vision part transformers loads another way",
        )
    try:
        model = build_on_meta(config, trust_remote_code)
    except Exception as error:  # whatever the model's own code raises on a config it cannot take
        message = " ".join(str(error).split())
        raise RolesNotFound(
            "cannot be built from the config", f"{type(error).__name__}: {message[:200]}"
        ) from error
    return find_roles(model)


# ---------------------------------------------------------------------------------------------- the finder


def inside(name: str, prefix: str) -> bool:
    """`name` is `prefix` or a module or parameter below it ("" holds everything)."""
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _in_a_module_list(name: str) -> bool:
    # A tower or projector is never one element of a ModuleList (a layer's vision expert is not a tower)
    return any(part.isdigit() for part in name.split("."))


def _shallowest(names: list[str]) -> list[str]:
    """The names not below another of them, in their order."""
    return [n for n in names if not any(other != n and inside(n, other) for other in names)]


def _language_model(model: nn.Module, paths: dict[int, str]) -> str:
    """The path of the language model's module ("": the whole model)."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):  # a model that names no decoder
        decoder = None
    path = paths.get(id(decoder)) if decoder is not None else None
    if path:
        return path
    modules = dict(model.named_modules())
    for name in LANGUAGE_MODEL_NAMES:
        if name in modules:
            return name
    # the module holding the input embeddings and the decoder layers
    embeddings = model.get_input_embeddings()
    path = paths.get(id(embeddings), "")
    while path:
        path = path.rpartition(".")[0]
        if any(isinstance(m, nn.ModuleList) for m in modules[path].children()):
            return path
    return ""


def _towers(model: nn.Module, language_model: str) -> list[str]:
    """Paths of the vision (and other modality) towers: by name, else by a class name with Vision in it."""
    named = [
        name
        for name, _ in model.named_modules()
        if name.rpartition(".")[2] in TOWER_NAMES + AUDIO_TOWER_NAMES and not _in_a_module_list(name)
    ]
    towers = _shallowest(named)
    if not any(name.rpartition(".")[2] in TOWER_NAMES for name in towers):
        by_class = [
            name
            for name, module in model.named_modules()
            if "Vision" in type(module).__name__
            and name
            and not _in_a_module_list(name)
            and name.rpartition(".")[2] not in PROJECTOR_NAMES
            and not (language_model and inside(name, language_model))
        ]
        towers = _shallowest(towers + _shallowest(by_class))
    # vision towers first (as a family module lists them), other modalities' after
    return sorted(towers, key=lambda name: name.rpartition(".")[2] in AUDIO_TOWER_NAMES)


def _projectors(model: nn.Module, towers: list[str]) -> list[str]:
    """Paths of the projector's modules and bare parameters."""
    modules = dict(model.named_modules())
    found = [
        name
        for name in modules
        if name.rpartition(".")[2] in PROJECTOR_NAMES
        and not _in_a_module_list(name)
        and not any(inside(name, tower) for tower in towers)
    ]
    for tower in towers:
        children = modules[tower]._modules
        # GLM-4V's downsample feeds its merger: a projector's part only beside one
        found += [
            f"{tower}.{child}"
            for child in PROJECTOR_NAMES_IN_TOWER
            if child in children and (child != "downsample" or "merger" in children)
        ]
    found = _shallowest(found)
    # the bare parameters of the modules that hold a tower: glue between the tower and the language model
    owners = {tower.rpartition(".")[0] if "." in tower else "" for tower in towers}
    for owner in sorted(owners):
        found += [f"{owner}.{n}" if owner else n for n, _ in modules[owner].named_parameters(recurse=False)]
    return found


def _split_language_model(model: nn.Module, prefix: str, others: list[str]) -> tuple[str, ...]:
    """The language model's prefixes: its module's path, or, where that module also holds a tower or the
    projector (IDEFICS' `model`), its children and bare parameters outside them, looked into as deep as
    needed."""
    if not any(inside(other, prefix) for other in others):
        return (prefix,)
    module = model.get_submodule(prefix)
    inner = [n for n, _ in module.named_children()] + [n for n, _ in module.named_parameters(recurse=False)]
    parts: tuple[str, ...] = ()
    for name in (f"{prefix}.{n}" if prefix else n for n in inner):
        if name not in others:
            parts += _split_language_model(model, name, others)
    return parts


def _missing(part: str, names: tuple[str, ...], also: str = "") -> RolesNotFound:
    return RolesNotFound("roles not found", f"no {part}", f"none of {', '.join(names)}{also}; {FAMILY_HINT}")


def _lm_head(model: nn.Module, language_model: str, paths: dict[int, str]) -> str | None:
    """The LM head's path: the model's output embeddings, else its language model's (Nemotron-H Omni's
    wrapper has none of its own)."""
    for module in (model, model.get_submodule(language_model)):
        head = (
            module.get_output_embeddings()
            if callable(getattr(module, "get_output_embeddings", None))
            else None
        )
        if head is not None and id(head) in paths:
            return paths[id(head)]
    return None


def find_roles(model: nn.Module) -> FoundRoles:
    """The roles of `model` (built on meta from its config) from its module tree; RolesNotFound says what
    is missing. Parameters are read by name and shape only."""
    config = model.config
    model_type = config.model_type
    if is_encoder_decoder(config):
        raise _encoder_decoder(model_type)
    paths = {id(module): name for name, module in model.named_modules()}
    language_model = _language_model(model, paths)
    towers = _towers(model, language_model)
    if not towers:
        if getattr(config, "vision_config", None) is None:
            raise RolesNotFound("no vision part", "no vision_config and no vision tower")
        raise _missing("vision tower", TOWER_NAMES, " and no module class named *Vision*")
    projectors = _projectors(model, towers)
    if not any(name in paths.values() for name in projectors):  # bare parameters alone project nothing
        raise _missing("projector", PROJECTOR_NAMES + tuple(f"<tower>.{n}" for n in PROJECTOR_NAMES_IN_TOWER))
    head = _lm_head(model, language_model, paths)
    if head is None:
        raise RolesNotFound("roles not found", "no LM head", "get_output_embeddings() gives none")
    llm = _split_language_model(model, language_model, towers + projectors)
    embeddings = paths.get(id(model.get_input_embeddings()), "")
    if not any(inside(embeddings, prefix) for prefix in llm):
        raise _missing("language model", LANGUAGE_MODEL_NAMES, " holding the input embeddings")
    if not any(inside(head, prefix) for prefix in llm):
        llm += (head,)
    found = FoundRoles(
        model_type=model_type,
        role_prefixes={"vision": tuple(towers), "projector": tuple(projectors), "llm": llm},
        lm_head_prefixes=(head,),
        parameters={},
        lora_targets={},
        unassigned=(),
        language_model=language_model,
        projector_modules=tuple(name for name in projectors if name in paths.values()),
    )
    family = found.as_family()
    groups = params_by_role(model, family)
    linear_leaves = {
        role: tuple(sorted({n.rpartition(".")[2] for n in linear_modules_of_role(model, family, role)}))
        for role in ("llm", "vision")
    }
    return replace(
        found,
        parameters={role: sum(p.numel() for _, p in groups[role]) for role in ROLES},
        lora_targets=linear_leaves,
        unassigned=tuple(name for name, _ in groups["other"]),
    )
