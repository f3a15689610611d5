"""Llama 4 through the generic family with its module's knowledge (families/llama4.py): the training chat template
renders the published text and marks exactly the answers, and the model as transformers 5.24 loads it cannot run
a forward, train a LoRA through TRL's fused LM head, or take the processor's bf16 pixels into an fp32 tower until
`repair` and the dtype boundaries fix it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import model_inputs
from peft import LoraConfig, get_peft_model
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
from trl.trainer.utils import add_fused_lm_head

from vlm_recipes.families import family_for_config
from vlm_recipes.families.llama4 import LLAMA4_CHAT_TEMPLATE, LLAMA4_TRAINING_CHAT_TEMPLATE, Llama4Family
from vlm_recipes.families.parameters import linear_modules_of_role
from vlm_recipes.model.boundaries import install_dtype_boundaries
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings

SYSTEM = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
TURNS = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    {"role": "user", "content": [{"type": "text", "text": "And?"}]},
    {"role": "assistant", "content": "blue"},  # a plain string too
]
CALL = {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
TOOL = [
    TURNS[0],
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "6"},
]


@pytest.fixture(scope="module")
def model_dir(private_demo_cache) -> Path:
    from vlm_recipes.demo.models import ensure_demo_model

    return ensure_demo_model("demo:tiny-llama4")


def test_training_template_renders_the_published_text_and_marks_the_answers(model_dir):
    processor = AutoProcessor.from_pretrained(model_dir)
    family = family_for_config(AutoConfig.from_pretrained(model_dir))
    assert isinstance(family, Llama4Family) and processor.chat_template == LLAMA4_CHAT_TEMPLATE
    assert (
        load_processor(str(model_dir), DataSettings(), family).chat_template == LLAMA4_TRAINING_CHAT_TEMPLATE
    )
    for messages in ([SYSTEM, *TURNS], TURNS, TURNS[:1], TOOL):
        for prompt in (True, False):
            render = {"tokenize": False, "add_generation_prompt": prompt}
            assert processor.apply_chat_template(messages, **render) == processor.apply_chat_template(
                messages, chat_template=LLAMA4_TRAINING_CHAT_TEMPLATE, **render
            )
    row = {"messages": [SYSTEM, *TURNS], "images": [Image.new("RGB", (56, 56))]}
    batch = model_inputs(
        processor, [row], chat_template=LLAMA4_TRAINING_CHAT_TEMPLATE, return_assistant_tokens_mask=True
    )
    assert processor.tokenizer.decode(batch["input_ids"][0][batch["assistant_masks"][0].bool()]) == (
        "red<|eot|>blue<|eot|>"
    )
    # a tool call is an answer too, from <|python_start|> through its <|eot|> (the tokenizer: the runner's
    # attach_images keeps no tool_calls)
    tool = [*TOOL, {"role": "assistant", "content": "six"}]
    marked = processor.tokenizer.apply_chat_template(
        tool, chat_template=LLAMA4_TRAINING_CHAT_TEMPLATE, return_dict=True, return_assistant_tokens_mask=True
    )
    answers = [i for i, m in zip(marked["input_ids"], marked["assistant_masks"], strict=True) if m]
    assert processor.tokenizer.decode(answers) == (
        '<|python_start|><|python_end|>{"name": "f", "parameters": {"a": 1}}<|eot|>six<|eot|>'
    )


def test_repair_is_needed_and_the_model_trains_and_generates_after_it(model_dir):
    processor = AutoProcessor.from_pretrained(model_dir)
    family = family_for_config(AutoConfig.from_pretrained(model_dir))
    row = {"messages": TURNS[:2], "images": [Image.new("RGB", (100, 60), (200, 0, 0))]}
    batch = dict(model_inputs(processor, [row]))
    assert batch["pixel_values"].dtype == torch.bfloat16  # whatever the model's dtype
    labels = batch["input_ids"].clone()
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad(), pytest.raises(RuntimeError):  # bf16 pixels into the fp32 tower
        model(**batch)
    with torch.no_grad(), pytest.raises(AttributeError, match="image_outputs"):
        model(**{**batch, "pixel_values": batch["pixel_values"].float()})

    assert len(family.repair(model)) == 3 and family.repair(model) == []  # once
    install_dtype_boundaries(model, family)
    assert not any("router" in name for name in linear_modules_of_role(model, family, "llm"))
    with torch.no_grad():
        native = model(**batch, labels=labels)
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
        fused = model(**batch, labels=labels, fused_lm_head=True, output_router_logits=True)
    coefficient = model.config.get_text_config().router_aux_loss_coef
    assert fused.aux_loss > 0
    assert fused.loss.item() == pytest.approx(
        native.loss.item() + coefficient * fused.aux_loss.item(), abs=1e-5
    )

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=linear_modules_of_role(model, family, "llm")))
    lora.train()
    lora(**batch, labels=labels, fused_lm_head=True, output_router_logits=True).loss.backward()
    assert all(p.grad is not None for n, p in lora.named_parameters() if p.requires_grad)
    lora.eval()
    prompt = dict(model_inputs(processor, [{**row, "messages": TURNS[:1]}], add_generation_prompt=True))
    assert lora.generate(**prompt, max_new_tokens=2, do_sample=False).shape[1] > prompt["input_ids"].shape[1]


def test_a_cast_rotary_table_is_recomputed(model_dir):
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16)
    rotary = model.vision_model.rotary_embedding
    assert rotary.freqs_ci.dtype == torch.complex64  # a bf16 load keeps it
    family = family_for_config(AutoConfig.from_pretrained(model_dir))
    with pytest.warns(UserWarning, match="discards the imaginary part"):
        model.to(torch.bfloat16)
    assert rotary.freqs_ci.dtype == torch.bfloat16
    assert any("freqs_ci recomputed" in fix for fix in family.repair(model))
    assert torch.equal(rotary.freqs_ci, rotary._compute_freqs_ci(rotary.config))
