"""The last decoder layer computed only where the loss reads it.

An SFT loss reads the final hidden state at the positions whose next token is labelled: the answer
tokens, a small share of a VLM sample whose image tokens and prompt are unlabelled. Every layer but the
last must still run at every position (later positions attend to them), but the last layer's output at
an unlabelled position goes nowhere: to a logit the loss masks out. So the last layer runs its attention
(queries, keys and values) at every position, and its output projection, MLP and residuals, the final
norm and the LM head only at the labelled ones. On CPU, TRL's fused LM head also scores every position
(it compacts to the labelled ones only on Triton devices); here it is handed just those.

The loss is the same sum over the same labelled tokens divided by the same count; each kept row is
computed by the same per-row operations, so what changes is at most the rounding of a matrix product
with fewer rows (tests/test_speedups.py bounds it against what training moves).

Two layer shapes are supported, read from the layer's sub-modules, whose names the family gives
(`Family.decoder_layer`, the same in every family here): the pre-norm layer of Llama, Qwen2, the Qwen-VL
line and SmolVLM's text model (input_layernorm, self_attn, post_attention_layernorm, mlp), and Gemma 3's
sandwich-norm layer (plus pre_/post_feedforward_layernorm), which Gemma 4 scales by a learned
`layer_scalar` buffer at the end. Any other layer is refused.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from vlm_recipes.families.base import DecoderLayer, Family

# A caller holding the family passes its `decoder_layer`; without one, the default every family here has.
DEFAULT_DECODER = Family.decoder_layer


def text_decoder_layers(model: nn.Module, decoder: DecoderLayer = DEFAULT_DECODER) -> nn.ModuleList:
    """The language model's decoder layers (under PEFT too)."""
    return decoder.decoder_layers(model)


def skipped_at_unlabelled_positions(
    model: nn.Module, decoder: DecoderLayer = DEFAULT_DECODER
) -> list[nn.Module]:
    """What the cut last layer does not run at an unlabelled position: its output projection, its MLP, and
    the LM head (the benchmark's FLOPs actually run leave them out there)."""
    last = text_decoder_layers(model, decoder)[-1]
    attention_output = last.get_submodule(f"{decoder.attention}.{decoder.attention_output}")
    return [attention_output, last.get_submodule(decoder.mlp), model.get_output_embeddings()]


def loss_positions_refusal(model: nn.Module, decoder: DecoderLayer = DEFAULT_DECODER) -> str | None:
    """Why the last layer can't be cut to the loss positions exactly (None: it can)."""
    layers = text_decoder_layers(model, decoder)
    parts = {name for name, _ in layers[-1].named_children()}
    if parts not in (decoder.pre_norm, decoder.sandwich_norm):
        return (
            f"the last decoder layer ({type(layers[-1]).__name__}) has parts {sorted(parts)}; only the "
            f"pre-norm layer {sorted(decoder.pre_norm)} and Gemma 3's sandwich-norm layer are supported"
        )
    vision_config = getattr(model.config, "vision_config", None)
    deepstack = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())
    if deepstack >= len(layers):
        return (
            f"DeepStack adds image features after each of the first {deepstack} decoder layers, the last "
            f"of {len(layers)} among them, at image positions the cut layer no longer returns"
        )
    return None


class LastLayerAtLossPositions:
    """Installed on the last decoder layer. While `positions` is set (flat indices into the batch's
    [batch * length] positions), the layer returns [1, len(positions), hidden] at those positions only;
    unset (generation, any other forward), the layer is untouched."""

    def __init__(self, model: nn.Module, decoder: DecoderLayer = DEFAULT_DECODER):
        self.decoder = decoder
        self.layer = text_decoder_layers(model, decoder)[-1]
        self.sandwich = {name for name, _ in self.layer.named_children()} == decoder.sandwich_norm
        self.full_forward = self.layer.forward
        signature = inspect.signature(self.full_forward)
        self.bind = signature.bind
        self.extra = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
        self.positions: torch.Tensor | None = None
        # in training: the labelled positions the last layer computed, and the batches' real positions
        # (the benchmark's FLOPs actually run leave out the rest)
        self.counted = {"labelled": 0, "positions": 0}
        # an instance attribute: GradientCheckpointingLayer's recompute calls it again, positions still set
        self.layer.forward = self.forward

    def select(self, inputs: dict) -> dict:
        """Set the positions from the batch's labels; the inputs with `shift_labels` for just those
        (TRL's fused LM head then scores exactly them, unshifted)."""
        labels = inputs["labels"]
        following = F.pad(labels[:, 1:], (0, 1), value=-100)  # position i predicts token i + 1
        read = following != -100
        if not read.any():  # nothing to score: the full layer keeps the loss connected
            self.positions = None
            return inputs
        self.positions = read.flatten().nonzero().squeeze(1)
        if torch.is_grad_enabled():  # a training step (eval runs without autograd)
            real = inputs["attention_mask"].sum() if "attention_mask" in inputs else labels.numel()
            self.counted["labelled"] += len(self.positions)
            self.counted["positions"] += int(real)
        return {**inputs, "shift_labels": following[read][None]}

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.positions is None:
            return self.full_forward(hidden_states, *args, **kwargs)
        positions, d = self.positions, self.decoder
        part = self.layer.get_submodule  # the layer's parts by the family's names for them
        attention, mlp = part(d.attention), part(d.mlp)
        # what the layer passes its attention: every argument it was called with, by name
        passed = self.bind(hidden_states, *args, **kwargs).arguments
        passed = {**passed, **passed.pop(self.extra, {})}
        del passed[next(iter(passed))]  # hidden_states, normed below
        keep_rows = attention.get_submodule(d.attention_output).register_forward_pre_hook(
            lambda _, args: (args[0].flatten(0, -2).index_select(0, positions)[None],)
        )
        try:
            attended = attention(hidden_states=part(d.input_norm)(hidden_states), **passed)[0]
        finally:
            keep_rows.remove()
        if self.sandwich:
            attended = part(d.post_attention_norm)(attended)
        hidden = hidden_states.flatten(0, -2).index_select(0, positions)[None] + attended
        if self.sandwich:
            out = part(d.post_mlp_norm)(mlp(part(d.pre_mlp_norm)(hidden)))
        else:
            out = mlp(part(d.post_attention_norm)(hidden))
        scalar = getattr(self.layer, "layer_scalar", None)  # Gemma 4 scales the layer's output
        return hidden + out if scalar is None else (hidden + out) * scalar
