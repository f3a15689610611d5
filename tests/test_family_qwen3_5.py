"""Qwen3.5 and Qwen3.5-MoE (families/qwen3_5.py): what differs from the Qwen-VL line, on the tiny models
(`demo:tiny-qwen3.5`, `demo:tiny-qwen3.5-moe`).

The tests every family shares run on both (TINY_MODELS: seed recipes in bf16 and fp32, DPO, dtype
boundaries, token counts, caches, kill and resume, DDP); here: the linear-attention state that makes a
packed row inexact, and packing refused for it; the mixture of experts: LoRA on attention only or on the
experts too, experts unquantized in a 4-bit stage, the router trained with its load-balancing loss, the
experts' memory in the plan, and FLOPs that count active parameters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODELS, demo_split
from safetensors.torch import load_file
from test_families import TINY_RUN
from transformers import AutoConfig, AutoModelForImageTextToText

from vlm_recipes.benchmarking.flops import matmul_params_by_role
from vlm_recipes.cli.train import main
from vlm_recipes.families.qwen3_5 import QWEN3_5_MOE

MODEL, MOE = TINY_MODELS["qwen3.5"], TINY_MODELS["qwen3.5-moe"]
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # fused, in memory


def saved_experts(weights: dict) -> list[str]:
    """The experts' tensors of a saved checkpoint: transformers saves them per expert, as published
    (`mlp.experts.3.up_proj.weight`), and fuses them on loading."""
    return [name for name in weights if re.search(r"\.mlp\.experts\.\d+\.", name)]


@pytest.fixture(scope="module")
def model_dirs(private_demo_cache) -> dict[str, Path]:
    from vlm_recipes.demo.models import ensure_demo_model

    return {model: ensure_demo_model(model) for model in (MODEL, MOE)}


def run(tmp_path, recipe: str, model: str, *overrides: str) -> int:
    args = ["--recipe", recipe, "--output-dir", str(tmp_path), "--run-name", "t", *TINY_RUN, f"model={model}"]
    return main([*args, "precision=fp32", *overrides])


def final_weights(tmp_path, recipe: str) -> tuple[dict[str, torch.Tensor], dict]:
    stage = json.loads((tmp_path / recipe / "t" / "run.json").read_text())["stages"][-1]
    report = json.loads((Path(stage["dir"]) / "report.json").read_text())
    return load_file(Path(stage["dir"]) / "final" / "model.safetensors"), report


def test_a_packed_row_leaks_the_linear_attention_state_so_packing_is_refused(model_dirs, tmp_path, capsys):
    """Two samples end to end in one row through a Gated DeltaNet layer: the first comes out as alone
    (causal), the second does not (it starts from the state and convolution the first left); given the
    boundary, transformers' torch path refuses (only the CUDA kernels keep samples apart). The refusal's
    reason is real; the stage is refused at the data check, before the model loads."""
    model = AutoModelForImageTextToText.from_pretrained(model_dirs[MODEL], dtype=torch.float32)
    layer = model.model.language_model.layers[0].linear_attn
    torch.manual_seed(0)
    first, second = torch.randn(1, 7, model.config.text_config.hidden_size), torch.randn(1, 9, 64)
    with torch.no_grad():
        alone = [layer(first), layer(second)]
        packed = layer(torch.cat([first, second], 1))
        boundaries = torch.tensor([0, 7, 16], dtype=torch.int32)
        with pytest.raises(ValueError, match="can't keep packed sequences apart"):
            layer(torch.cat([first, second], 1), cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries)
    noise = (packed[:, :7] - alone[0]).abs().max().item()  # the same sums: fp32 rounding at most
    leak = (packed[:, 7:] - alone[1]).abs().max().item()
    assert noise < 1e-5 and leak > 1000 * max(noise, 1e-7), (noise, leak)

    code = run(tmp_path, "r1-llm-only", MODEL, "training.padding_free=true")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "training.padding_free is refused for qwen3.5" in err
    assert "Gated DeltaNet" in err and "padding_free: false" in err
    assert "loading" not in err, "refused before the model loads"


def test_lora_on_attention_only_leaves_the_experts_as_they_were(model_dirs, tmp_path):
    """r1 on the MoE: 4-bit, LoRA on every linear layer of the language model; the fused experts are not
    linear layers, so they stay frozen and unquantized, and come out of final/ exactly as they went in."""
    assert run(tmp_path, "r1-llm-only", MOE) == 0
    final, report = final_weights(tmp_path, "r1-llm-only")
    base = load_file(model_dirs[MOE] / "model.safetensors")
    experts = saved_experts(base)
    assert len(experts) == 3 * 4 * 3  # three layers, four experts, gate, up and down each
    assert all(torch.equal(final[name], base[name]) for name in experts)
    choices = {d["guard"]: d["choice"] for d in report["decisions"]}
    assert choices["experts"] == "6 fused expert weights frozen"
    assert choices["experts-unquantized"] == "expert weights kept in the compute dtype"
    assert choices["router"] == "router frozen, load-balancing loss on (coefficient 0.001)"
    assert not any("experts" in target for target in report["lora_targets"])


def test_lora_on_the_experts_too_trains_every_expert_weight(model_dirs, tmp_path, capsys):
    """Naming `experts` in lora.targets.llm adds a LoRA per expert through PEFT's target_parameters (which
    takes no dropout: asked for, the stage stops with the fix); after merging, every expert has moved."""
    targets = "stages.llm-lora.lora.targets={llm: [q_proj, v_proj, experts]}"
    assert run(tmp_path / "dropout", "r1-llm-only", MOE, targets) == 2, "PEFT's experts take no dropout"
    assert "set lora.dropout: 0" in capsys.readouterr().err
    assert run(tmp_path, "r1-llm-only", MOE, targets, "lora.dropout=0", "training.learning_rate=0.01") == 0
    final, report = final_weights(tmp_path, "r1-llm-only")
    base = load_file(model_dirs[MOE] / "model.safetensors")
    experts = saved_experts(base)
    moved = [name for name in experts if not torch.equal(final[name], base[name])]
    assert moved == experts
    assert {d["guard"]: d["choice"] for d in report["decisions"]}["experts"] == (
        "6 fused expert weights adapted with LoRA"
    )
    assert sum("experts" in target for target in report["lora_targets"]) == 6


def test_a_fully_trained_language_model_trains_the_router_with_its_load_balancing_loss(model_dirs, tmp_path):
    """llm: full trains the router; TRL adds the model's load-balancing loss (its aux_loss is logged at
    every step), and final/ is saved with the router logits off again, so it generates."""
    assert run(tmp_path, "r2-vision-only", MOE, "stages.vision-full.train.llm=full") == 0
    final, report = final_weights(tmp_path, "r2-vision-only")
    base = load_file(model_dirs[MOE] / "model.safetensors")
    routers = [name for name in base if name.endswith("mlp.gate.weight")]
    assert len(routers) == 3 and all(not torch.equal(final[name], base[name]) for name in routers)
    choices = {d["guard"]: d["choice"] for d in report["decisions"]}
    assert choices["router"] == "router trained, load-balancing loss on (coefficient 0.001)"
    stage_dir = tmp_path / "r2-vision-only" / "t" / "stage-1-vision-full"
    [state] = stage_dir.glob("checkpoints/checkpoint-*/trainer_state.json")
    logged = [
        entry["aux_loss"] for entry in json.loads(state.read_text())["log_history"] if "aux_loss" in entry
    ]
    assert logged and all(value > 0 for value in logged)
    assert (
        json.loads((stage_dir / "final" / "config.json").read_text())["text_config"]["output_router_logits"]
        is False
    )


def test_the_plan_states_what_a_qlora_stage_does_with_the_experts_and_their_memory(model_dirs, capsys):
    assert main(["--recipe", "r1-llm-only", "--dry-run", f"model={MOE}"]) == 0
    plan = capsys.readouterr().out
    config = AutoConfig.from_pretrained(model_dirs[MOE]).text_config
    count = 3 * 4 * (2 * 32 * 64 + 64 * 32)  # layers x experts x (gate_up + down)
    assert config.num_experts == 4 and config.moe_intermediate_size == 32
    assert f"4 routed, 2 per token: frozen; router frozen; {count:,} expert weights" in plan
    assert "(unquantized: bitsandbytes quantizes nn.Linear only)" in plan


def test_flops_count_the_experts_a_token_runs_through(model_dirs):
    """Two of four experts per token: the experts count half, the router and shared expert in full."""
    config = AutoConfig.from_pretrained(model_dirs[MOE])
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    counted = matmul_params_by_role(model, QWEN3_5_MOE)["llm"]
    experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith(EXPERT_WEIGHTS))
    everything = sum(  # every weight a token multiplies by: all but norms, gates' vectors and embeddings
        p.numel()
        for n, p in model.named_parameters()
        if n.startswith(("model.language_model", "lm_head")) and p.dim() >= 2 and "embed_tokens" not in n
    )
    assert counted == everything - experts / 2


def test_qwen3_6s_chat_template_trains_with_trls_training_variant(model_dirs):
    """Qwen3.6's checkpoints are Qwen3.5's model types (Qwen/Qwen3.6-35B-A3B: qwen3_5_moe) with a chat template
    of their own, which TRL has a training variant of: the loss reads the answer and its end of turn only."""
    from test_families import model_inputs
    from transformers import AutoProcessor
    from trl.chat_template_utils import get_training_chat_template, qwen3_6_chat_template

    processor = AutoProcessor.from_pretrained(model_dirs[MOE])
    processor.chat_template = qwen3_6_chat_template
    assert QWEN3_5_MOE.training_chat_template(processor) is None  # TRL's, not the family's
    row = demo_split("demo:train", "train", 1)[0][0]
    batch = model_inputs(
        processor,
        [row],
        chat_template=get_training_chat_template(processor),
        return_assistant_tokens_mask=True,
    )
    answer = row["messages"][1]["content"][0]["text"]
    marked = processor.tokenizer.decode(batch["input_ids"][0][batch["assistant_masks"][0].bool()])
    assert marked.endswith(f"{answer}<|im_end|>\n") and len(marked) < len(answer) + 40, marked
