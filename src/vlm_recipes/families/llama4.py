"""Llama 4 (model_type `llama4`: Llama-4-Scout-17B-16E / Maverick-17B-128E, Instruct), trained through the generic
family (roles from the module tree: `vision_model`, `multi_modal_projector`, `language_model`) with what its
transformers 5.24 model class gets wrong, fixed on each loaded model (`repair`), and a training chat template.

1. Every forward with return_dict=True raises AttributeError. `Llama4ForConditionalGeneration.forward` ends with
   `Llama4CausalLMOutputWithPast(..., image_outputs=outputs.image_outputs)`, where `outputs` is what its
   `language_model` (a `Llama4ForCausalLM`) returned: a `MoeCausalLMOutputWithPast`, which has no such field
   (the image encoder's output is the forward's local `mm_encoder_outputs["image"]`). Fix: a forward hook on
   the model's own `language_model` gives its output `image_outputs = None` (transformers' class untouched). A
   hook, not a replaced `forward`: it stays on the module through PEFT's wrapping (LoRA replaces the linear
   layers inside it, the module itself stays), gradient checkpointing (of the decoder layers), generate() and
   deepcopy, and it adds the attribute only where the output lacks it. `image_outputs` stays None
   (nothing here reads it; the deprecated `image_hidden_states` property would fail on it).
2. An fp32 tower fails with `expected scalar type Float but found BFloat16`: `Llama4ImageProcessor` returns
   `pixel_values` in bf16 whatever the model's dtype (its `_preprocess`: "as the original implementation"),
   and the tower's patch embedding is a plain Linear. Fix: a dtype boundary casting the tower's floating inputs
   to its weights' dtype, beside the generic ones. All of them, not `inputs=("pixel_values",)`: the model's
   `get_image_features` calls `self.vision_model(pixel_values, **kwargs)` positionally, which a keyword cast
   would miss; its only floating input is the pixels.
3. The tower's 2-D RoPE table `vision_model.rotary_embedding.freqs_ci` is a complex64 non-persistent buffer,
   recomputed at every load; `model.to(dtype)` would cast it to a real dtype and drop its imaginary part
   (torch's Module.to casts complex tensors too). Nothing the runner does casts it: loads in bf16 keep it
   complex64 (computed in fp32 by `_compute_freqs_ci`), and the runner's casts (model/guards.py:
   cast_frozen_to_compute, apply_trainable_dtype; stages/outputs.py: cast_model) take floating tensors only
   (`is_floating_point()` is False for complex), placement moves devices only. `repair` checks it against
   `_compute_freqs_ci` and recomputes it if a load ever left it otherwise (a no-op, unlogged, when intact).

Found on the way, the same way (the runs stopped without them):
4. A LoRA on the language model stops (`'tuple' object has no attribute 'dtype'`): each MoE block's
   `Llama4Router` is an `nn.Linear` subclass whose forward returns (scores, logits), so the runner's LoRA
   targets (every `nn.Linear` of the role) include it, and PEFT's LoRA Linear reads `.dtype` off the base
   layer's output. Fix: each router becomes `Llama4RouterScores`, the same computation on the same weight
   Parameter (same name: checkpoints unchanged) but not an `nn.Linear`: no LoRA wraps it, it trains with
   `llm: full` as before, and bitsandbytes never quantized it (it converts `type(m) is nn.Linear` only).
   transformers records `output_router_logits` off `Llama4Router` instances, so the new modules get the same
   recording hook (output_capturing.install_output_capuring_hook).
5. Every SFT step stops (`'Llama4CausalLMOutputWithPast' object has no attribute 'last_hidden_state'`): TRL
   1.16's fused LM head runs `model.base_model` for the hidden states, and Llama4ForConditionalGeneration has no
   base model module (`base_model_prefix` "model" names no attribute; the image merge is in its own forward),
   so `base_model` is the model itself. Fix: the instance attribute `model` (so `base_model`) is a
   `Llama4Backbone`: the model's own forward with the LM head on the last position only, returning what its
   text model returned (`last_hidden_state`, `router_logits`). Not a module: no parameters or state-dict keys.
6. TRL's load-balancing loss reads `text_config.num_experts`; Llama 4 names them `num_local_experts`: an alias
   on Llama4TextConfig (as families/glm4v.py does for GLM-4.5V), config.json written as before. (Llama 4's own
   forward computes no aux loss; TRL adds Mixtral's for every MoE with `router_aux_loss_coef`, 0.001 here.)

The chat template: the Instruct checkpoints' as transformers' conversion writes it (Llama4Processor's default,
`processing_llama4.chat_template`). TRL has no training variant of it; `LLAMA4_TRAINING_CHAT_TEMPLATE` is the
same text with `{% generation %}` around each assistant turn's content and its <|eot|> (a tool-calling turn:
from <|python_start|> through its <|eot|>), so the assistant-only loss trains the answer and the stop token,
not the `<|header_start|>assistant<|header_end|>` prompt. The hub's later chat_template.jinja (Meta's revision
for pythonic tool calls) differs: a checkpoint with it trains with answers told by prefix (methods/sft.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
from transformers.models.llama4.modeling_llama4 import Llama4Router
from transformers.models.llama4.processing_llama4 import chat_template as LLAMA4_CHAT_TEMPLATE
from transformers.utils.output_capturing import install_output_capuring_hook

from vlm_recipes.families.base import DtypeBoundary
from vlm_recipes.families.generic_family import GenericFamily

_EOT = '        {{- "<|eot|>" }}\n'
_HEADER = "    {{- '<|header_start|>' + message['role'] + '<|header_end|>\n\n' }}\n"
_CALL_START = "       {{- '<|python_start|>' }}\n"
_CALL_END = "        {%- endfor %}\n" + '       {{- "<|eot|>" }}\n'


def training_variant(published: str) -> str | None:
    """`published` with each assistant turn marked for the loss (None: not the text this expects)."""
    parts = published.split(_HEADER)
    if len(parts) != 2 or _EOT not in parts[1] or published.count(_CALL_START) != 1:
        return None
    head, rest = parts
    content, tail = rest.split(_EOT, 1)
    if tail.count(_CALL_END) != 1:
        return None
    turn = (
        "        {%- if message['role'] == 'assistant' %}\n        {%- generation %}\n"
        + content
        + _EOT
        + "        {%- endgeneration %}\n        {%- else %}\n"
        + content
        + _EOT
        + "        {%- endif %}\n"
    )
    tail = tail.replace(_CALL_START, "       {%- generation %}\n" + _CALL_START)
    tail = tail.replace(_CALL_END, _CALL_END + "       {%- endgeneration %}\n")
    return head + _HEADER + turn + tail


LLAMA4_TRAINING_CHAT_TEMPLATE = training_variant(LLAMA4_CHAT_TEMPLATE)


def name_the_experts_as_trl_reads_them() -> None:
    """TRL 1.16's fused loss reads `text_config.num_experts` for the load-balancing loss; Llama 4's config
    names its routed experts `num_local_experts`. An alias, not a field: config.json is written as before."""
    Llama4TextConfig.attribute_map = {**Llama4TextConfig.attribute_map, "num_experts": "num_local_experts"}


name_the_experts_as_trl_reads_them()


class Llama4RouterScores(nn.Module):
    """`Llama4Router`'s computation (transformers 5.24) as a plain module holding the same weight: not an
    `nn.Linear`, so no LoRA wraps it (PEFT's Linear layer reads `.dtype` off the base layer's output, which
    here is a tuple)."""

    def __init__(self, router: nn.Linear):
        super().__init__()
        self.weight = router.weight  # the same Parameter: its name, dtype and role unchanged
        self.num_experts, self.top_k = router.num_experts, router.top_k

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits = F.linear(hidden_states, self.weight)
        top_value, top_index = torch.topk(router_logits, self.top_k, dim=1)
        scores = torch.full_like(router_logits, float("-inf")).scatter_(1, top_index, top_value)
        return torch.sigmoid(scores.float()).to(scores.dtype), router_logits


class Llama4Backbone:
    """`model.base_model` of a Llama 4: the model without its LM head, as TRL's fused LM head calls it (fix 5).
    The model's own forward, every hook included, the LM head on the last position only; what its text model
    returned (`last_hidden_state`, `router_logits` when asked)."""

    _tp_plan = None  # what transformers reads off a base model besides (supports_tp_plan / _pp_plan)
    _pp_plan = None

    def __init__(self, model: nn.Module):
        self.model = model

    @property
    def get_image_features(self):
        """The model's own (generate() encodes the images through `base_model`'s, by its signature)."""
        return self.model.get_image_features

    def __call__(self, *args, **kwargs) -> MoeModelOutputWithPast:
        seen = []
        model = self.model
        hook = model.language_model.model.register_forward_hook(lambda module, a, output: seen.append(output))
        # Under mixed precision accelerate wraps the model's forward in one autocast object, and this runs
        # inside that forward (TRL's fused head): entering the same object again overwrote the state its outer
        # exit restores, and CPU autocast stayed on for the rest of the process (a later fp32 stage ran in
        # bf16). The nested call takes the forward accelerate wrapped; the outer autocast is still on.
        wrapped = model.__dict__.get("forward")
        if wrapped is not None and hasattr(model, "_original_forward"):
            model.forward = model._original_forward
        try:
            model(*args, **{**kwargs, "logits_to_keep": 1})
        finally:
            hook.remove()
            if wrapped is not None:
                model.forward = wrapped
        return seen[0]


def _carry_image_outputs(module: nn.Module, args, output):
    """Forward hook on the language model: its output gets the `image_outputs` field its caller reads."""
    if not isinstance(output, tuple) and not hasattr(output, "image_outputs"):
        output.image_outputs = None


class Llama4Family(GenericFamily):
    """Llama 4 through the generic family, with the fixes of this module's docstring."""

    # lmms-eval 0.7.3's --model for a stage's final/ (cli/lmms_eval.py): its Llama4ForConditionalGeneration
    lmms_eval_models = {"llama4": "llama4_scout"}

    training_chat_templates = (
        {LLAMA4_CHAT_TEMPLATE: LLAMA4_TRAINING_CHAT_TEMPLATE} if LLAMA4_TRAINING_CHAT_TEMPLATE else {}
    )

    def dtype_boundaries(self) -> list[DtypeBoundary]:
        tower = self.role_prefixes["vision"][0]
        pixels = DtypeBoundary(
            "pixel values -> vision tower",
            tower,
            why="Llama4ImageProcessor returns bf16 pixels whatever the tower's dtype",
        )
        return [pixels, *super().dtype_boundaries()]

    def repair(self, model: nn.Module) -> list[str]:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        fixes = []
        language_model = base.language_model
        if _carry_image_outputs not in language_model._forward_hooks.values():
            language_model.register_forward_hook(_carry_image_outputs)
            fixes.append(
                "language_model's output given image_outputs=None (Llama4ForConditionalGeneration.forward "
                "reads it from a MoeCausalLMOutputWithPast, which has no such field)"
            )
        routers = [(name, m) for name, m in base.named_modules() if isinstance(m, Llama4Router)]
        for name, router in routers:
            parent, _, child = name.rpartition(".")
            scores = Llama4RouterScores(router)
            setattr(base.get_submodule(parent), child, scores)
            # transformers records the router logits (output_router_logits) off Llama4Router instances only
            install_output_capuring_hook(scores, "router_logits", index=1)
        if routers:
            fixes.append(
                f"{len(routers)} MoE routers made plain modules (Llama4Router is an nn.Linear returning a tuple, "
                "which a LoRA cannot wrap)"
            )
        if not isinstance(base.__dict__.get("model"), Llama4Backbone):
            base.model = Llama4Backbone(base)
            fixes.append(
                "base_model is the model without its LM head (TRL's fused LM head reads its hidden states)"
            )
        rotary = base.vision_model.rotary_embedding
        table = rotary._compute_freqs_ci(rotary.config).to(rotary.freqs_ci.device)
        now = rotary.freqs_ci
        if now.device.type != "meta" and not (now.dtype == table.dtype and torch.allclose(now, table)):
            rotary.freqs_ci = table
            fixes.append(
                f"vision_model.rotary_embedding.freqs_ci recomputed (was {now.dtype}, not the table)"
            )
        return fixes
