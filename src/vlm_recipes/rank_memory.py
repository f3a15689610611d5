"""What one process holds for a stage's training state, from the model's parameter counts (no weights read):
the parameters, their gradients, AdamW's two moments and the frozen copies its method holds (a DPO or GRPO
stage's reference, a distillation's teacher); under FSDP2 sharded over the ranks, otherwise whole in every
process. `--dry-run` prints it. Activations are not included (they grow with the batch's tokens and images)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_recipes.families.base import Family
from vlm_recipes.recipes.schema import MethodSections, Stage
from vlm_recipes.roles import ROLES

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
QUANTIZED_BYTES = {"4bit": 0.5, "8bit": 1.0}  # bitsandbytes' storage (quantization constants left out)


def quantized_weights(model: torch.nn.Module, family: Family, stage: Stage) -> set[str]:
    """Names of the parameters a quantized load stores in 4 or 8 bits: nn.Linear weights outside
    `skip_roles` (the output head is `lm_head` there)."""
    if not stage.quantized:
        return set()
    skip = stage.quantization.skip_roles
    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and ("lm_head" if family.is_lm_head(name) else family.role_of(name)) not in skip
    }


@dataclass(frozen=True)
class RankMemory:
    """Bytes one process holds at rest between steps; `gathered`: what FSDP2 adds while a step runs."""

    mode: str  # the stage's parallel mode
    ranks: int
    parameters: float
    gradients: float
    optimizer: float
    replicated: float = 0.0  # FSDP2: quantized weights left whole on every rank (in `parameters`)
    reference: float = 0.0  # a DPO or GRPO (beta > 0) stage training weights in full: TRL's frozen copy
    gathered: float = 0.0  # FSDP2: the root unit and one decoder layer, whole while they run

    def __str__(self) -> str:
        """Two lines (as --dry-run prints them): the sizes, then how they are held."""
        total = self.parameters + self.gradients + self.optimizer + self.reference
        reference = f" + frozen copies (reference, teacher) {human(self.reference)}" if self.reference else ""
        sizes = (
            f"parameters {human(self.parameters)} + gradients {human(self.gradients)} + optimizer state "
            f"{human(self.optimizer)} (AdamW's 2 moments){reference} = {human(total)}"
        )
        if self.mode != "fsdp":
            where = {
                "model-parallel": "in all, spread over the GPUs",
                "deepspeed": "per process, before ZeRO shards it (the accelerate config says how)",
            }.get(self.mode, "per process, unsharded")
            return f"{where}: {sizes}\nactivations not included"
        held = (
            f"quantized weights ({human(self.replicated)}) replicated on every rank (fsdp-4bit), the rest"
            if self.replicated
            else "everything"
        )
        return (
            f"per rank, FSDP2 over {self.ranks} ranks: {sizes}\n{held} sharded 1/{self.ranks}; while a step "
            f"runs, + {human(self.gathered)} gathered whole (the root unit: tower, projector, embeddings, head; "
            "one decoder layer); activations not included"
        )


def rank_memory(
    model: torch.nn.Module,
    family: Family,
    stage: Stage,
    precision: str,
    adapter_params: int,
    mode: str,
    ranks: int,
) -> RankMemory:
    """A stage's training state per process, `model` on the meta device as the stage loads it (frozen
    weights in the compute `precision`, trained ones in `training.trainable_dtype`), `adapter_params`
    LoRA weights added. Under FSDP2 (`mode` fsdp) every tensor is sharded over `ranks` except quantized
    weights: accelerate keeps bitsandbytes' uint8 storage out of fully_shard (decision fsdp-4bit; 8-bit
    weights, never run under FSDP here, are counted replicated too: an upper bound)."""
    compute = BYTES[precision]
    trained = 4 if stage.training.trainable_dtype == "fp32" else compute
    quantized = quantized_weights(model, family, stage)
    quantized_bytes = QUANTIZED_BYTES.get(stage.quantization.mode, 0.0)

    def trains(name: str) -> bool:
        role = family.role_of(name)
        return role in ROLES and getattr(stage.train, role) == "full"

    def held(params) -> tuple[float, float]:  # (bytes as trained, of which quantized)
        size = quant = 0.0
        for name, param in params:
            if name in quantized:
                quant += param.numel() * quantized_bytes
            else:
                size += param.numel() * (trained if trains(name) else compute)
        return size + quant, quant

    parameters, replicated = held(model.named_parameters())
    trainable = (sum(p.numel() for n, p in model.named_parameters() if trains(n)) + adapter_params) * trained
    parameters += adapter_params * trained
    # the frozen copies a method holds beside the model (a reference; a teacher), each the model's size
    reference = sum(p.numel() for p in model.parameters()) * compute * frozen_copies(stage)
    if mode != "fsdp":
        return RankMemory(mode, ranks, parameters, trainable, 2 * trainable, reference=reference)
    # FSDP2's units (methods.sharding.wrap_language_layers_only): each decoder layer, the rest in the root
    layers = {id(layer) for layer in family.decoder_layer.decoder_layers(model)}
    prefixes = [name for name, module in model.named_modules() if id(module) in layers]
    in_layer = tuple(prefix + "." for prefix in prefixes)
    params = list(model.named_parameters())

    def unsharded(names) -> float:  # gathered whole: what the unit holds beyond quantized weights
        size, quant = held((n, p) for n, p in params if names(n))
        return size - quant

    root = unsharded(lambda n: not n.startswith(in_layer))
    layer = max(unsharded(lambda n, prefix=prefix: n.startswith(prefix + ".")) for prefix in prefixes)
    return RankMemory(
        mode,
        ranks,
        (parameters - replicated) / ranks + replicated,
        trainable / ranks,
        2 * trainable / ranks,
        replicated=replicated,
        gathered=root + layer,
        reference=reference / ranks,  # TRL prepares it with the same FSDP plugin: sharded too
    )


def frozen_copies(stage: Stage) -> int:
    """The frozen copies of the model the stage's method holds beside it (TrainingMethod.frozen_copies). A
    stage of the default method holds none, known without importing the methods (MethodSections.asked_for):
    a launcher's plan loads no training library."""
    if not MethodSections.asked_for(stage):
        return 0
    from vlm_recipes.methods import method_of

    return method_of(stage).frozen_copies(stage)


def human(size: float) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:.0f} B"
