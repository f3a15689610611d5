"""FSDP2 stages: what the runner decides before Trainer builds its accelerator (the wrap units, 4-bit
weights left whole), the plugin handed to accelerate on CPU ranks, and the persistent buffers carried
through accelerate's rank-0 load. Nothing here runs unless the process was launched for FSDP."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vlm_recipes.decisions import Decision
from vlm_recipes.families import family_for_config

log = logging.getLogger(__name__)


def sharding() -> bool:
    """Launched for FSDP (`accelerate launch` with an FSDP config sets this in every rank's environment)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_decisions(model) -> list[Decision]:
    """What an FSDP stage shards, decided before Trainer builds its accelerator (nothing when not sharding)."""
    if not sharding():
        return []
    decisions = [wrap_language_layers_only(model)]
    quantized = sum(type(p).__name__ == "Params4bit" for p in model.parameters())
    if quantized:
        decisions.append(
            Decision(
                "fsdp-4bit",
                f"{quantized} 4-bit weights replicated on every rank, the rest sharded",
                "accelerate keeps uint8-stored Params4bit out of fully_shard (sharding would break their "
                "quant_state); a float bnb_4bit_quant_storage would let them shard",
            )
        )
    return decisions


def wrap_language_layers_only(model) -> Decision:
    """FSDP units: the language model's decoder layers; the vision tower and projector stay in the root unit.

    A unit's weights are gathered by a collective each time it runs, so every rank must run the same units
    the same number of times. The tower runs once per image batch and once more per video batch, and not at
    all on a batch of text rows: ranks whose batches differ in kind would gather different units and stall
    or fail (gloo: "Received data size doesn't match expected size"). In the root unit the tower's weights
    are gathered once per step on every rank, whatever the batch holds. Costs the tower's size in unsharded
    memory during the forward (a few hundred MB for the towers here). A config naming its own classes wins.
    The layer class is the family's (Family.decoder_layer): Qwen2VLDecoderLayer, Gemma3DecoderLayer, ..."""
    family = family_for_config(model.config)
    layer = type(family.decoder_layer.decoder_layers(model)[0]).__name__
    named = os.environ.setdefault("FSDP_TRANSFORMER_CLS_TO_WRAP", layer)
    if named != layer:
        return Decision("fsdp-units", f"each {named}", "the accelerate config names them")
    decision = Decision(
        "fsdp-units",
        f"each {layer}; the vision tower and projector in the root unit",
        "gathered once a step on every rank, so batches with and without images or videos run the same "
        "collectives",
    )
    return decision


@contextmanager
def fsdp_on_cpu_ranks(decisions: list[Decision]) -> Iterator[None]:
    """On CPU ranks launched for FSDP (`accelerate launch` with configs/fsdp.yaml sets
    ACCELERATE_USE_FSDP), let accelerate's state take the FSDP plugin as it does on GPUs.

    Our own because accelerate (1.15) switches to FSDP only from MULTI_GPU and its kin: on CPU ranks its
    AcceleratorState keeps MULTI_CPU, drops the plugin, and Trainer wraps the model in DDP, silently
    unsharded. FSDP2's `fully_shard` itself runs on CPU over gloo, so the only change is the state's
    distributed type; everything after it (wrapping by _no_split_modules, full state dict for final/) is
    accelerate's and Trainer's own FSDP2 path."""
    if not sharding() or torch.cuda.is_available():
        yield
        return
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def take_the_plugin(state, *args, fsdp_plugin=None, **kwargs):
        original(state, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and state.distributed_type == DistributedType.MULTI_CPU:
            # as accelerate does at the end of its own switch: every later AcceleratorState() re-reads it
            state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if state.mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(state.mixed_precision)
            state.fsdp_plugin = fsdp_plugin
            decision = Decision(
                "fsdp-on-cpu",
                f"FSDP{fsdp_plugin.fsdp_version} over gloo on {state.num_processes} CPU processes",
                "accelerate leaves CPU ranks unsharded (DDP); the runner hands its state the FSDP plugin",
            )
            decisions.append(decision)

    AcceleratorState.__init__ = take_the_plugin
    try:
        yield
    finally:
        AcceleratorState.__init__ = original


def persistent_buffers(model) -> dict[str, tuple[torch.nn.Module, str]]:
    """Each buffer the state dict holds (registered persistent), by its full name: its module and name."""
    return {
        f"{prefix}.{name}" if prefix else name: (module, name)
        for prefix, module in model.named_modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    }


def carry_buffers_through_the_sharded_load(model) -> Decision | None:
    """Let accelerate's rank-0 load (fsdp_cpu_ram_efficient_loading) take a model with persistent buffers.

    Our own because accelerate (1.15) treats every state-dict entry as a sharded parameter: after
    `fully_shard` it reads `.device_mesh` off each, and a buffer, which FSDP2 leaves a plain tensor, fails
    with "'Tensor' object has no attribute 'device_mesh'" on every rank (accelerate#3898; its fix was not
    merged). Gemma 4's vision projections keep their clipping bounds in buffers, GLM-4V-MoE's routers their
    score bias. The load below hides those buffers from accelerate's loop, then sends rank 0's values of them
    to every rank, as the loop does for the weights; the rest is accelerate's own load."""
    buffers = persistent_buffers(model)
    if not sharding() or not buffers:
        return None
    from accelerate.utils import fsdp_utils

    if not getattr(fsdp_utils.fsdp2_load_full_state_dict, "carries_buffers", False):
        fsdp_utils.fsdp2_load_full_state_dict = load_weights_and_buffers(
            fsdp_utils.fsdp2_load_full_state_dict
        )
    decision = Decision(
        "fsdp-buffers",
        f"{len(buffers)} persistent buffers sent from rank 0 beside the sharded weights, whole on every rank",
        "accelerate's rank-0 load takes every state-dict entry for a sharded parameter and fails on a buffer "
        "(accelerate#3898)",
    )
    return decision


def load_weights_and_buffers(load_weights):
    """accelerate's `fsdp2_load_full_state_dict`, with the model's persistent buffers broadcast from rank 0."""
    import torch.distributed as dist

    def load(accelerator, model, full_sd, cpu_offload=False):
        buffers = persistent_buffers(model)
        for module, name in buffers.values():  # out of model.state_dict() for accelerate's loop
            module._non_persistent_buffers_set.add(name)
        try:
            weights = {k: v for k, v in full_sd.items() if k not in buffers}
            model = load_weights(accelerator, model, weights, cpu_offload=cpu_offload)
        finally:
            for module, name in buffers.values():
                module._non_persistent_buffers_set.discard(name)
        for fqn, (module, name) in buffers.items():
            # rank 0's full_sd holds the loaded values, the other ranks' tensors of the right shape and dtype
            value = full_sd[fqn].detach().to(accelerator.device).clone()
            dist.broadcast(value, src=0)
            module._buffers[name] = value.cpu() if cpu_offload else value
        return model

    load.carries_buffers = True
    return load
