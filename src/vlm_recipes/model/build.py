"""Build a stage's processor and model: load (quantized or not), then apply each role's training mode.

This is the one place recipe settings become library objects (BitsAndBytesConfig, LoraConfig).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, BitsAndBytesConfig

from vlm_recipes.decisions import DTYPES, Decision
from vlm_recipes.errors import LoraTargetError, MissingProcessorError
from vlm_recipes.families import family_for_config
from vlm_recipes.families.base import Family
from vlm_recipes.families.parameters import (
    expert_parameters_of_role,
    linear_modules_of_role,
    lora_target_modules,
    lora_target_parameters,
    params_by_role,
    routed_experts,
)
from vlm_recipes.model.peft_targets import keep_lora_targets_as_named
from vlm_recipes.recipes.schema import DataSettings, QuantizationSettings, Stage
from vlm_recipes.roles import ROLES

keep_lora_targets_as_named()  # before any adapter is made or loaded: model/peft_targets.py says why

log = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    model: nn.Module  # a PeftModel when any role is in lora mode
    processor: object
    family: Family
    source: str  # model id or directory the weights came from
    source_dtype: torch.dtype  # dtype the source checkpoint is stored in (final/ is saved in it)
    compute_dtype: torch.dtype
    lora_targets: list[str]
    decisions: list[Decision] = field(default_factory=list)  # made while building (a LoRA role trained fully)
    # frozen parameters inside fully trained roles: kept in the trained dtype (guards.cast_frozen_to_compute)
    frozen_in_trained_roles: list[str] = field(default_factory=list)
    # sub-configs whose towers were not loaded (Family.towers_left_out): final/ takes them from the source
    towers_left_out: list[str] = field(default_factory=list)


def detect_family(source: str, trust_remote_code: bool = False) -> tuple[Family, object]:
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    return family_for_config(config, trust_remote_code), config


def load_processor(source: str, data: DataSettings, family: Family, trust_remote_code: bool = False):
    """The model's processor, with the stage's image pixel bounds applied the family's way."""
    try:
        processor = AutoProcessor.from_pretrained(
            source, trust_remote_code=trust_remote_code, **family.processor_load_kwargs
        )
    except (OSError, ValueError, TypeError) as exc:
        raise MissingProcessorError(
            f"no usable processor in {source} ({exc.__class__.__name__}: {str(exc).splitlines()[0]}). A model "
            "directory must hold the processor too: save it beside the weights with processor.save_pretrained(dir)"
        ) from None
    if not hasattr(processor, "image_processor"):
        raise MissingProcessorError(
            f"{source} has a tokenizer but no image processor: save the model's full processor "
            "(AutoProcessor.from_pretrained(base).save_pretrained(dir))"
        )
    if data.min_pixels is not None or data.max_pixels is not None:
        family.apply_pixel_bounds(processor.image_processor, data.min_pixels, data.max_pixels)
    if training_template := family.training_chat_template(processor):
        processor.chat_template = training_template
    return processor


def quantization_config(
    quant: QuantizationSettings, family: Family, compute_dtype: torch.dtype
) -> BitsAndBytesConfig | None:
    if quant.mode == "none":
        return None
    skip = family.quantization_skip_modules(quant.skip_roles)
    if quant.mode == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant.quant_type,
        bnb_4bit_use_double_quant=quant.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=torch.uint8,
        llm_int8_skip_modules=skip,
    )


def load_model(
    source: str,
    quantization: QuantizationSettings,
    family: Family,
    compute_dtype: torch.dtype,
    device: str,
    trust_remote_code: bool = False,
    sharded: bool = False,
    max_memory_per_gpu: str | None = None,
    config=None,
) -> nn.Module:
    """Load weights in the compute dtype (frozen weights need nothing more), quantized if asked.

    On GPU the whole model goes to this process's GPU, or, `sharded` (model-parallel), is balanced over
    every visible GPU, each holding at most `max_memory_per_gpu`. `config`: the model's, changed
    (`leave_out_towers`); None: the source's own."""
    kwargs = {"dtype": compute_dtype, "trust_remote_code": trust_remote_code}
    if config is not None:
        kwargs["config"] = config
    qconfig = quantization_config(quantization, family, compute_dtype)
    if qconfig is not None:
        kwargs["quantization_config"] = qconfig
    if device == "cuda" and sharded:
        kwargs["device_map"] = "balanced"
        if max_memory_per_gpu:
            kwargs["max_memory"] = dict.fromkeys(range(torch.cuda.device_count()), max_memory_per_gpu)
    elif device == "cuda":
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    model = AutoModelForImageTextToText.from_pretrained(source, **kwargs)
    for fix in family.repair(model):
        log.info("  model-fix: %s", fix)
    return model


def apply_training_modes(
    model: nn.Module, stage: Stage, family: Family, decisions: list[Decision] | None = None
) -> tuple[nn.Module, list[str], list[str]]:
    """Freeze everything, add LoRA adapters to lora roles, unfreeze full roles.

    Returns the (possibly PEFT-wrapped) model, the LoRA target module names, and the frozen parameters
    inside fully trained roles (kept in the trained dtype: they compute on the trained layers' output)."""
    model.requires_grad_(False)
    modes = {role: getattr(stage.train, role) for role in ROLES}
    for role in roles_without_linear_layers(model, family, modes):
        # LoRA adapts linear layers; a role of bare weight matrices (Gemma 3's projector) has none. Like
        # LLaMA-Factory with an unfrozen projector, it is trained fully instead (it is small), and said so.
        modes[role] = "full"
        decision = Decision(
            "lora-role", f"{role} trained fully", f"`{role}: lora` asked, but it has no linear layer to adapt"
        )
        if decisions is not None:
            decisions.append(decision)
    lora_roles = {role: stage.lora.targets.get(role, []) for role, mode in modes.items() if mode == "lora"}
    targets: list[str] = []
    expert_targets = lora_target_parameters(model, family, lora_roles)
    if expert_targets and stage.lora.dropout:
        raise LoraTargetError(
            f"lora.targets names the experts, which PEFT adapts through target_parameters, and those take no "
            f"dropout: set lora.dropout: 0 (it is {stage.lora.dropout:g}), or leave `experts` out of the targets"
        )
    if decisions is not None:  # the stage logs them with the others
        decisions += expert_decisions(model, family, modes["llm"], expert_targets, stage.quantized)
    if lora_roles:
        targets = lora_target_modules(model, family, lora_roles)
        config = LoraConfig(
            r=stage.lora.rank,
            lora_alpha=stage.lora.alpha,
            lora_dropout=stage.lora.dropout,
            target_modules=targets,
            target_parameters=expert_targets or None,
            task_type="CAUSAL_LM",
        )
        targets = targets + expert_targets
        model = get_peft_model(model, config)  # freezes the base; adapters are fp32
    full_roles = {role for role, mode in modes.items() if mode == "full"}
    unread = {name.removeprefix("base_model.model.") for name in family.unread_parameters(model)}
    kept_frozen: list[str] = []
    for role, params in params_by_role(model, family).items():
        if role not in full_roles:
            continue
        for name, param in params:
            if name.removeprefix("base_model.model.") in unread:
                # the loss never reads it, so no gradient would come (see Family.unread_parameters): frozen,
                # but it still computes on the trained layers' output, so it keeps their dtype
                kept_frozen.append(name)
            else:
                param.requires_grad_(True)
            if stage.training.trainable_dtype == "fp32" and param.dtype != torch.float32:
                # fp32 master weights: bf16 cannot represent small updates to large weights.
                param.data = param.data.float()
    return model, targets, kept_frozen


def roles_without_linear_layers(model: nn.Module, family: Family, modes: dict[str, str]) -> list[str]:
    """Roles in lora mode with parameters but no linear layer for an adapter."""
    roles = params_by_role(model, family)
    return [
        role
        for role, mode in modes.items()
        if mode == "lora" and roles[role] and not linear_modules_of_role(model, family, role)
    ]


# What a stage does with a mixture-of-experts language model's experts and router, and why.
#
# A mixture-of-experts block (Qwen3.5-MoE, Qwen3-VL-MoE, GLM-4.5V) holds a router (`mlp.gate`, a bare matrix
# scoring the experts for each token), routed experts as two fused 3-D weights (`mlp.experts.gate_up_proj`,
# `mlp.experts.down_proj`: [experts, out, in]) and, in Qwen3.5 and GLM-4.5V, a shared expert every token passes
# through.
# Neither the router nor the fused experts are `nn.Linear`, so:
# - LoRA adapts the experts only where the recipe names them (`lora.targets.llm: [..., experts]`), through
#   PEFT's `target_parameters`; otherwise they stay frozen, as LLaMA-Factory's `lora_target: all` leaves them;
# - bitsandbytes quantizes `nn.Linear` only: in a 4-bit stage the experts stay in the compute dtype, most of
#   the model's memory (`vlm-recipes train --dry-run` counts them so);
# - the router trains only with the whole language model (`llm: full`); TRL's trainers add the model's
#   load-balancing loss for every MoE (`output_router_logits`, weighted by its `router_aux_loss_coef`), so
#   routing stays spread over the experts.
def expert_decisions(
    model: nn.Module, family: Family, llm_mode: str, expert_targets: list[str], quantized: bool
) -> list[Decision]:
    """The decisions for a mixture-of-experts language model (none for a dense one)."""
    experts = expert_parameters_of_role(model, family, "llm")
    if not experts:
        return []
    text = model.config.get_text_config()
    routing = f"{routed_experts(text)} routed experts, {text.num_experts_per_tok} per token"
    if llm_mode == "full":
        what, why = "trained in full", f"llm: full; {routing}"
    elif expert_targets:
        what, why = "adapted with LoRA", f"lora.targets.llm names them: PEFT's target_parameters; {routing}"
    elif llm_mode == "lora":
        what = "frozen"
        why = f"LoRA adapts linear layers, add `experts` to lora.targets.llm to adapt them too; {routing}"
    else:
        what, why = "frozen", f"llm: frozen; {routing}"
    decisions = [Decision("experts", f"{len(experts)} fused expert weights {what}", why)]
    if quantized:
        decisions.append(
            Decision(
                "experts-unquantized",
                "expert weights kept in the compute dtype",
                "bitsandbytes quantizes nn.Linear only, and the experts are fused 3-D weights",
            )
        )
    # TRL's SFT and DPO trainers switch on the model's load-balancing loss for every MoE (output_router_logits),
    # weighted by the config's router_aux_loss_coef (SFTConfig.router_aux_loss_coef overrides it)
    router = "router trained" if llm_mode == "full" else "router frozen"
    coefficient = getattr(text, "router_aux_loss_coef", None)
    if coefficient is None:  # DeepSeek-V3's routing (Kimi K2.5) balances by a bias, no auxiliary loss
        why = "the model declares no load-balancing loss: its routing balances the experts another way"
        decisions.append(Decision("router", f"{router}, no load-balancing loss", why))
        return decisions
    loss = f"load-balancing loss on (coefficient {coefficient:g})"
    why = (
        "TRL adds it for a mixture of experts: it keeps the router spreading tokens over the experts"
        if llm_mode == "full"
        else "the router is a bare matrix LoRA does not adapt; TRL adds the loss for a mixture of experts, "
        "and its gradient reaches the adapters before each router"
    )
    decisions.append(Decision("router", f"{router}, {loss}", why))
    return decisions


def leave_out_towers(config, family: Family) -> tuple[list[str], list[Decision]]:
    """Set to None the sub-configs of `config` whose towers no stage feeds (`Family.towers_left_out`), so
    the model is built without them and their weights are not read; one decision each, naming why."""
    left_out, decisions = [], []
    for name, why in family.towers_left_out.items():
        if getattr(config, name, None) is not None:
            setattr(config, name, None)
            left_out.append(name)
            decisions.append(Decision("towers-left-out", f"{name}: not loaded", why))
    return left_out, decisions


def build_stage_model(
    source: str,
    stage: Stage,
    compute_precision: str,
    device: str,
    trust_remote_code: bool = False,
    processor=None,
    sharded: bool = False,
) -> BuiltModel:
    """The model of `source` as `stage` trains it, its family read from its config (a test, a benchmark, a
    CLI tool); a stage's run has read both already and calls `load_stage_model`."""
    family, config = detect_family(source, trust_remote_code)
    processor = processor or load_processor(source, stage.data, family, trust_remote_code)
    return load_stage_model(
        source, family, config, processor, stage, compute_precision, device, trust_remote_code, sharded
    )


def load_stage_model(
    source: str,
    family: Family,
    config,
    processor,
    stage: Stage,
    compute_precision: str,
    device: str,
    trust_remote_code: bool = False,
    sharded: bool = False,
) -> BuiltModel:
    """Model loaded and quantized as the stage says, training modes applied. `config`: the source's, as
    `detect_family` read it (towers the stage leaves out are set to None in a copy)."""
    compute_dtype = DTYPES[compute_precision]
    config = copy.deepcopy(config)  # leave_out_towers edits it; the caller's stays the source's
    left_out, decisions = leave_out_towers(config, family)
    model = load_model(
        source,
        stage.quantization,
        family,
        compute_dtype,
        device,
        trust_remote_code,
        sharded,
        stage.training.max_memory_per_gpu,
        config if left_out else None,
    )
    model, targets, kept_frozen = apply_training_modes(model, stage, family, decisions)
    source_dtype = getattr(config, "dtype", None) or getattr(config.get_text_config(), "dtype", None)
    if isinstance(source_dtype, str):
        source_dtype = getattr(torch, source_dtype)
    return BuiltModel(
        model=model,
        processor=processor,
        family=family,
        source=source,
        source_dtype=source_dtype or compute_dtype,
        compute_dtype=compute_dtype,
        lora_targets=targets,
        decisions=decisions,
        frozen_in_trained_roles=kept_frozen,
        towers_left_out=left_out,
    )
