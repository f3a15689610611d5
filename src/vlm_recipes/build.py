"""Build a stage's processor and model: load (quantized or not), then apply each role's training mode.

This is the one place recipe settings become library objects (BitsAndBytesConfig, LoraConfig).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, BitsAndBytesConfig
from transformers.image_utils import SizeDict

from vlm_recipes.guards import DTYPES, keep_fp32_patterns, matches_any
from vlm_recipes.roles import FamilyAdapter, adapter_for_model_type, lora_target_modules, params_by_role
from vlm_recipes.schema import ROLES, DataSettings, QuantizationSettings, Stage

log = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    model: nn.Module  # a PeftModel when any role is in lora mode
    processor: object
    family: FamilyAdapter
    source: str  # model id or directory the weights came from
    source_dtype: torch.dtype  # dtype the source checkpoint is stored in (final/ is saved in it)
    compute_dtype: torch.dtype
    lora_targets: list[str]


def detect_family(source: str, trust_remote_code: bool = False) -> tuple[FamilyAdapter, object]:
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    return adapter_for_model_type(config.model_type), config


class MissingProcessorError(ValueError):
    pass


def load_processor(source: str, data: DataSettings, trust_remote_code: bool = False):
    """The model's processor, with the stage's image pixel bounds applied."""
    try:
        processor = AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
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
    image_processor = processor.image_processor
    if data.min_pixels is not None or data.max_pixels is not None:
        # `size` is what the processor reads at call time (passing min/max_pixels per call is deprecated).
        bounds = {
            "shortest_edge": image_processor.size["shortest_edge"],
            "longest_edge": image_processor.size["longest_edge"],
        }
        if data.min_pixels is not None:
            bounds["shortest_edge"] = data.min_pixels
        if data.max_pixels is not None:
            bounds["longest_edge"] = data.max_pixels
        image_processor.size = SizeDict(**bounds)
    return processor


def quantization_config(
    quant: QuantizationSettings, family: FamilyAdapter, compute_dtype: torch.dtype
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
    family: FamilyAdapter,
    compute_dtype: torch.dtype,
    device: str,
    trust_remote_code: bool = False,
    sharded: bool = False,
    max_memory_per_gpu: str | None = None,
) -> nn.Module:
    """Load weights in the compute dtype (frozen weights need nothing more), quantized if asked.

    On GPU the whole model goes to this process's GPU, or, `sharded` (model-parallel), is balanced over
    every visible GPU, each holding at most `max_memory_per_gpu`."""
    kwargs = {"dtype": compute_dtype, "trust_remote_code": trust_remote_code}
    qconfig = quantization_config(quantization, family, compute_dtype)
    if qconfig is not None:
        kwargs["quantization_config"] = qconfig
    if device == "cuda" and sharded:
        kwargs["device_map"] = "balanced"
        if max_memory_per_gpu:
            kwargs["max_memory"] = dict.fromkeys(range(torch.cuda.device_count()), max_memory_per_gpu)
    elif device == "cuda":
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    return AutoModelForImageTextToText.from_pretrained(source, **kwargs)


def apply_training_modes(
    model: nn.Module, stage: Stage, family: FamilyAdapter
) -> tuple[nn.Module, list[str]]:
    """Freeze everything, add LoRA adapters to lora roles, unfreeze full roles.

    Returns the (possibly PEFT-wrapped) model and the LoRA target module names."""
    model.requires_grad_(False)
    modes = {role: getattr(stage.train, role) for role in ROLES}
    lora_roles = {role: stage.lora.targets.get(role, []) for role, mode in modes.items() if mode == "lora"}
    targets: list[str] = []
    if lora_roles:
        targets = lora_target_modules(model, family, lora_roles)
        config = LoraConfig(
            r=stage.lora.rank,
            lora_alpha=stage.lora.alpha,
            lora_dropout=stage.lora.dropout,
            target_modules=targets,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config)  # freezes the base; adapters are fp32
    full_roles = {role for role, mode in modes.items() if mode == "full"}
    for role, params in params_by_role(model, family).items():
        if role not in full_roles:
            continue
        for _, param in params:
            param.requires_grad_(True)
            if stage.training.trainable_dtype == "fp32" and param.dtype != torch.float32:
                # fp32 master weights: bf16 cannot represent small updates to large weights.
                param.data = param.data.float()
    return model, targets


def build_stage_model(
    source: str,
    stage: Stage,
    compute_precision: str,
    device: str,
    trust_remote_code: bool = False,
    processor=None,
    sharded: bool = False,
) -> BuiltModel:
    """Processor (unless given), model loaded and quantized as the stage says, training modes applied."""
    family, config = detect_family(source, trust_remote_code)
    compute_dtype = DTYPES[compute_precision]
    processor = processor or load_processor(source, stage.data, trust_remote_code)
    model = load_model(
        source,
        stage.quantization,
        family,
        compute_dtype,
        device,
        trust_remote_code,
        sharded,
        stage.training.max_memory_per_gpu,
    )
    model, targets = apply_training_modes(model, stage, family)
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
    )


def model_for_final(
    built: BuiltModel,
    trained: nn.Module,
    adapter_dir: Path | None,
    quantized: bool,
    trust_remote_code: bool = False,
    gathered_state: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """The stage's result as a plain model in the source checkpoint's dtype, LoRA merged.

    When training rounded the frozen weights (4-bit load, or compute dtype below the checkpoint's), or
    when the trained weights exist whole only as `gathered_state` (FSDP / DeepSpeed shard them across
    ranks), the result is rebuilt on a fresh full-precision load of the source: frozen weights come back
    exactly as they were, fully trained weights are copied in, and the adapter is merged into unrounded
    weights."""
    if gathered_state is None and not quantized and built.compute_dtype == built.source_dtype:
        model = trained.merge_and_unload() if isinstance(trained, PeftModel) else trained
        return cast_model(model, built.source_dtype)
    base = AutoModelForImageTextToText.from_pretrained(
        built.source, dtype=built.source_dtype, trust_remote_code=trust_remote_code
    )
    values = gathered_state if gathered_state is not None else dict(trained.named_parameters())
    trained_state = {
        name.removeprefix("base_model.model."): values[name]
        for name, p in trained.named_parameters()
        if p.requires_grad and "lora_" not in name
    }
    base_params = dict(base.named_parameters())
    with torch.no_grad():
        for name, value in trained_state.items():  # fully trained roles are never quantized
            base_params[name].copy_(value.detach().to(base_params[name].dtype).cpu())
    if adapter_dir is None:
        return base
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters to `dtype`, leaving the model's strict fp32 modules in fp32."""
    keep = keep_fp32_patterns(model, dtype)
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype != dtype and not (keep and matches_any(name, keep)):
            param.data = param.data.to(dtype)
    return model
