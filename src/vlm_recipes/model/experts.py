"""What a stage does with a mixture-of-experts language model's experts and router, and why.

A mixture-of-experts block (Qwen3.5-MoE, Qwen3-VL-MoE, GLM-4.5V) holds a router (`mlp.gate`, a bare matrix
scoring the experts for each token), routed experts as two fused 3-D weights (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`: [experts, out, in]) and, in Qwen3.5 and GLM-4.5V, a shared expert every token passes
through.
Neither the router nor the fused experts are `nn.Linear`, so:
- LoRA adapts the experts only where the recipe names them (`lora.targets.llm: [..., experts]`), through
  PEFT's `target_parameters`; otherwise they stay frozen, as LLaMA-Factory's `lora_target: all` leaves them;
- bitsandbytes quantizes `nn.Linear` only: in a 4-bit stage the experts stay in the compute dtype, most of
  the model's memory (`vlm-recipes train --dry-run` counts them so);
- the router trains only with the whole language model (`llm: full`); TRL's trainers add the model's
  load-balancing loss for every MoE (`output_router_logits`, weighted by its `router_aux_loss_coef`), so
  routing stays spread over the experts.
"""

from __future__ import annotations

from torch import nn

from vlm_recipes.decisions import Decision
from vlm_recipes.families.base import Family
from vlm_recipes.families.parameters import expert_parameters_of_role, routed_experts


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
