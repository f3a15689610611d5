"""Molmo2's training chat template (families/molmo2.py): it renders the published text, the last answer's
<|im_end|> added (and the bos the processor would prepend anyway), marks exactly the answers and their
<|im_end|>, and is needed: the published template's rows are refused, and without the bos the marks land on
other tokens."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from vlm_recipes.data.collate import VideoCollator
from vlm_recipes.errors import DataError
from vlm_recipes.families import family_for_config
from vlm_recipes.families.molmo2 import MOLMO2_CHAT_TEMPLATE, MOLMO2_TRAINING_CHAT_TEMPLATE, Molmo2Family
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings

IMAGE = Image.new("RGB", (80, 60), "red")
ANSWERS = ("Red.", "A square.")
TWO_TURNS = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[0]}]},
    {"role": "user", "content": [{"type": "text", "text": "And the shape?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[1]}]},
]
CONVERSATIONS = [
    TWO_TURNS,
    TWO_TURNS[:2],
    TWO_TURNS[:3],  # a prompt: ends on a user turn
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],  # string contents
    [  # two images, a styled question, a subtitle first
        {"role": "subtitle", "content": "0.0 hello"},
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "No.", "style": "short_answer"}]},
    ],
]


@pytest.fixture(scope="module")
def processor(private_demo_cache):
    from vlm_recipes.demo.models import ensure_demo_model

    return AutoProcessor.from_pretrained(ensure_demo_model("demo:tiny-molmo2"))


def collate(processor, template: str, by_prefix: bool = False) -> dict:
    collator = VideoCollator(
        processor=processor,
        chat_template=template,
        assistant_only_loss=not by_prefix,
        answers_by_prefix=by_prefix,
    )
    return collator(
        [{"messages": TWO_TURNS, "images": [IMAGE]}, {"messages": TWO_TURNS[:2], "images": [IMAGE]}]
    )


def labelled(processor, batch: dict, row: int) -> str:
    return processor.tokenizer.decode([t for t in batch["labels"][row].tolist() if t != -100])


@pytest.mark.parametrize(
    "conversation", CONVERSATIONS, ids=["two turns", "one", "prompt", "strings", "subtitle"]
)
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_training_template_renders_the_published_text_and_marks_the_answers(
    processor, conversation, generation_prompt
):
    def render(template):
        return processor.apply_chat_template(
            conversation, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
        )

    ends_on_answer = conversation[-1]["role"] == "assistant"
    published, training = render(MOLMO2_CHAT_TEMPLATE), render(MOLMO2_TRAINING_CHAT_TEMPLATE)
    prompt = "<|im_start|>assistant\n" if generation_prompt else ""
    assert published.endswith(prompt)
    body = published[: len(published) - len(prompt)]
    assert training == "<|im_end|>" + body + ("<|im_end|>" if ends_on_answer else "") + prompt
    out = processor.apply_chat_template(
        [conversation],
        chat_template=MOLMO2_TRAINING_CHAT_TEMPLATE,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        return_assistant_tokens_mask=True,
        processor_kwargs={
            "images": [[IMAGE] * published.count("<|image|>")] if "<|image|>" in published else None
        },
    )
    marked = [
        t for t, m in zip(out["input_ids"][0].tolist(), out["assistant_masks"][0].tolist(), strict=True) if m
    ]
    assert processor.tokenizer.decode(marked) == "".join(
        f"{answer}<|im_end|>" for answer in answers_of(conversation)
    )


def answers_of(conversation: list[dict]) -> list[str]:
    """The assistant turns' text as the template writes it (a style not among its DEMO_STYLES prefixed)."""
    answers = []
    for message in conversation:
        if message["role"] == "assistant":
            content = message["content"]
            part = {"text": content} if isinstance(content, str) else content[0]
            answers.append(f"{part['style']}: {part['text']}" if "style" in part else part["text"])
    return answers


def test_the_training_template_is_needed_and_trains(processor):
    """The published template's rows are refused (its prefixes render other tokens); without the bos the
    processor prepends, the marks land len(bos) characters early; the family's template labels the answers
    and <|im_end|> only (the image tokens, past the LM head's vocabulary, -100), the batch holds the
    mm_token_type_ids the model needs in train mode, and the model trains on it."""
    with pytest.raises(DataError, match="renders a conversation's first 1 message"):
        collate(processor, MOLMO2_CHAT_TEMPLATE, by_prefix=True)
    without_bos = MOLMO2_TRAINING_CHAT_TEMPLATE.replace("{{ bos_token }}", "", 1)
    assert labelled(processor, collate(processor, without_bos), 1) != "Red.<|im_end|>"

    from vlm_recipes.demo.models import ensure_demo_model

    model_dir = str(ensure_demo_model("demo:tiny-molmo2"))
    config = AutoConfig.from_pretrained(model_dir)
    family = family_for_config(config)
    assert isinstance(family, Molmo2Family)
    trained = load_processor(model_dir, DataSettings(), family)
    assert trained.chat_template == MOLMO2_TRAINING_CHAT_TEMPLATE
    batch = collate(trained, trained.chat_template)
    assert labelled(trained, batch, 0) == "Red.<|im_end|>A square.<|im_end|>"
    assert labelled(trained, batch, 1) == "Red.<|im_end|>"
    labels = batch["labels"][batch["labels"] != -100]
    assert int(labels.max()) < config.text_config.vocab_size
    assert "mm_token_type_ids" in batch and int(batch["mm_token_type_ids"].sum()) > 0
    model = AutoModelForImageTextToText.from_pretrained(model_dir).train()
    loss = model(**batch).loss
    loss.backward()
    assert math.isfinite(loss.item()) and torch.is_tensor(loss)
