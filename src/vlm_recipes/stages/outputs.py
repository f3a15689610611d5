"""What a finished stage leaves: final/ (a complete model directory, LoRA merged, in the source
checkpoint's dtype), adapter/, and provenance. Each is written to <name>.partial/ and published when whole
(files fsynced, one rename, the stage directory fsynced: files.publish_dir)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from peft import PeftModel
from torch import nn
from transformers import AutoConfig, AutoModelForImageTextToText
from trl import SFTTrainer

from vlm_recipes.files import publish_dir, write_json
from vlm_recipes.model.boundaries import install_dtype_boundaries
from vlm_recipes.model.build import BuiltModel, leave_out_towers
from vlm_recipes.model.guards import keep_fp32_patterns, matches_any
from vlm_recipes.runs.layout import ADAPTER_DIR, FINAL_DIR, PROVENANCE_FILE, read_provenance
from vlm_recipes.stages.context import StageContext


def save_stage_outputs(
    ctx: StageContext,
    built: BuiltModel,
    trained: torch.nn.Module,
    gathered_state: dict[str, torch.Tensor] | None = None,
) -> None:
    provenance = read_provenance(ctx.source) + [
        {
            "recipe": ctx.recipe.name,
            "stage": ctx.stage.name,
            "index": ctx.index,
            "init_from": ctx.stage.init_from,
            "source": ctx.source,
            "train": {role: getattr(ctx.stage.train, role) for role in ("vision", "projector", "llm")},
            "quantization": ctx.stage.quantization.mode,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    ]
    adapter_dir = None
    if built.lora_targets:
        partial = ctx.stage_dir / (ADAPTER_DIR + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        trained.save_pretrained(str(partial), state_dict=gathered_state)
        adapter_dir = publish_dir(partial, ctx.stage_dir / ADAPTER_DIR)
    model = model_for_final(
        built, trained, adapter_dir, ctx.stage.quantized, ctx.recipe.trust_remote_code, gathered_state
    )
    save_final_model(model, built.processor, ctx.stage_dir, provenance)


def save_final_model(model: torch.nn.Module, processor, stage_dir: Path, provenance: list[dict]) -> Path:
    """Save a complete model directory that `from_pretrained` loads alone.

    Written to final.partial/ and published (fsynced, renamed), so final/ exists only when whole."""
    final = stage_dir / FINAL_DIR
    partial = stage_dir / (FINAL_DIR + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    text = model.config.get_text_config()
    if getattr(text, "output_router_logits", False):
        # TRL switched an MoE's router logits on to train with the load-balancing loss; saved so, the model
        # computes that loss in every forward, and transformers 5.23 fails it in cached generation
        text.output_router_logits = False
    model.save_pretrained(partial)
    processor.save_pretrained(partial)
    write_json(partial / PROVENANCE_FILE, provenance)
    return publish_dir(partial, final)


def model_for_final(
    built: BuiltModel,
    trained: nn.Module,
    adapter_dir: Path | None,
    quantized: bool,
    trust_remote_code: bool = False,
    gathered_state: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """The stage's result as a plain model in the source checkpoint's dtype, LoRA merged.

    When training rounded the frozen weights (4-bit load, or compute dtype below the checkpoint's), when
    the trained weights exist whole only as `gathered_state` (FSDP / DeepSpeed shard them across ranks), or
    when towers were left out of the load (Gemma 4's audio), the result is rebuilt on a fresh
    full-precision load of the source: frozen weights (and left-out towers) come back exactly as they
    were, fully trained weights are copied in, and the adapter is merged into unrounded weights."""
    whole = not built.towers_left_out
    if gathered_state is None and not quantized and built.compute_dtype == built.source_dtype and whole:
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


def gather_sharded_state(trainer: SFTTrainer) -> dict[str, torch.Tensor]:
    """The whole state dict of a sharded model (accelerate gathers FSDP / ZeRO-3 shards to rank 0), keyed
    like the unwrapped model's parameters."""
    state = trainer.accelerator.get_state_dict(trainer.model)
    return {name: tensor.detach().cpu() for name, tensor in (state or {}).items()}


def load_final_for_eval(final_dir: Path, built: BuiltModel, ctx: StageContext) -> torch.nn.Module:
    device = f"cuda:{torch.cuda.current_device()}" if ctx.env.device == "cuda" else "cpu"
    kwargs = {"dtype": built.compute_dtype, "trust_remote_code": ctx.recipe.trust_remote_code}
    if built.towers_left_out:  # evaluated as trained: without the towers no stage feeds
        config = AutoConfig.from_pretrained(final_dir, trust_remote_code=ctx.recipe.trust_remote_code)
        leave_out_towers(config, built.family)
        kwargs["config"] = config
    model = AutoModelForImageTextToText.from_pretrained(final_dir, **kwargs)
    built.family.repair(model)  # what the family's model class gets wrong (Llama 4's forward)
    install_dtype_boundaries(model, built.family)  # Llama 4's processor hands bf16 pixels to any tower
    return model.to(device).eval()
