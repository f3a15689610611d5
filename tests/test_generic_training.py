"""Training through the generic family (families/generic_family.py): a model type no family module names
is trained from the roles its module tree shows; a chat template without {% generation %} markers has its
answers told by rendering each one's prefix (data/collate.py); a type whose roles cannot be found is
refused with what is missing. The new models' runs are in tests/test_new_models.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import demo_split
from transformers import AutoProcessor, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from trl.chat_template_utils import get_training_chat_template, has_generation_markers

from vlm_recipes.cli.train import main
from vlm_recipes.data.collate import VideoCollator


def demo_rows(count: int) -> list[dict]:
    """Image rows of the demo (a two-image one among them), and one two-turn conversation made from them."""
    ds, _ = demo_split("demo:train", "train", count + 4)
    rows = [{"messages": r["messages"], "images": r["images"]} for r in ds if not r.get("videos")][:count]
    first, second = rows[0], rows[1]
    follow_up = [m for m in second["messages"] if m["role"] != "system"]
    follow_up[0] = {  # the second question without its image: the conversation's images come first
        "role": "user",
        "content": [p for p in follow_up[0]["content"] if p["type"] == "text"],
    }
    return [*rows, {"messages": first["messages"] + follow_up, "images": first["images"]}]


def training_template(family, processor) -> str:
    """The template a stage trains the family with: its own training variant, TRL's, or the published one
    where it has markers already."""
    template = family.training_chat_template(processor) or get_training_chat_template(processor)
    return template or processor.chat_template


# Where TRL's training template marks, inside an answer, text the generation prompt already writes: Qwen3.5's
# prompt ends in "<think>\n", which TRL's marks begin before. Told by prefix, it is the prompt (as it is at
# inference: the model never writes it), so the labels differ by exactly that text in each answer.
PROMPT_TAILS_TRL_MARKS = {"qwen3.5": "<think>\n", "qwen3.5-moe": "<think>\n"}


def test_answers_told_by_prefix_are_the_ones_generation_markers_mark(tiny_family):
    """Both ways of finding the answers, on the same rendered text (the family's training template): the
    {% generation %} markers TRL reads, and rendering each answer's prefix. The same labels, every token
    (but the generation prompt's tail TRL marks too)."""
    family, model_dir = tiny_family
    processor = AutoProcessor.from_pretrained(model_dir, **family.processor_load_kwargs)
    template = training_template(family, processor)
    assert has_generation_markers(template)
    rows = demo_rows(4)
    marked = VideoCollator(processor=processor, chat_template=template, assistant_only_loss=True)(rows)
    by_prefix = VideoCollator(processor=processor, chat_template=template, answers_by_prefix=True)(rows)
    assert torch.equal(marked["input_ids"], by_prefix["input_ids"])
    labelled = (marked["labels"] != -100).sum(1)
    assert (labelled > 0).all() and labelled[-1] > labelled[0], "the two-turn row has both answers labelled"
    tail = PROMPT_TAILS_TRL_MARKS.get(family.name)
    if tail is None:
        assert torch.equal(marked["labels"], by_prefix["labels"])
        return
    only_marked = (marked["labels"] != -100) & (by_prefix["labels"] == -100)
    assert ((by_prefix["labels"] != -100) <= (marked["labels"] != -100)).all()
    for row, answers in enumerate((1, 1, 1, 1, 2)):  # the two-turn row has two answers
        assert processor.tokenizer.decode(marked["input_ids"][row][only_marked[row]]) == tail * answers


def test_a_prefix_whose_tokens_differ_from_the_row_is_refused():
    """A template that renders the start of a conversation differently once more follows (here: a system
    line only when the conversation is longer than one message) cannot have its answers told this way."""
    processor = AutoProcessor.from_pretrained(_qwen2_vl_dir())
    template = "{% if messages|length > 2 %}System line that only long conversations get.\n{% endif %}"
    template += processor.chat_template
    collator = VideoCollator(processor=processor, chat_template=template, answers_by_prefix=True)
    with pytest.raises(ValueError, match="generation"):
        collator(demo_rows(2))


def test_a_model_type_whose_roles_cannot_be_found_exits_2_naming_what_is_missing(tmp_path, capsys):
    """A text-only model given as the model: no traceback, exit 2, the type, and what the generic family
    looked for."""
    text_only = tmp_path / "text-only"
    tokenizer = AutoTokenizer.from_pretrained(
        AutoProcessor.from_pretrained(_qwen2_vl_dir()).tokenizer.name_or_path
    )
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(text_only)
    tokenizer.save_pretrained(text_only)
    args = ["--recipe", "r1-llm-only", "--output-dir", str(tmp_path / "runs"), "--run-name", "t"]
    assert main([*args, f"model={text_only}", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "model type `qwen2` has no family module" in err and "Traceback" not in err
    assert "not an image-text-to-text model: transformers' AutoModelForImageTextToText maps no" in err, err


def _qwen2_vl_dir() -> str:
    from vlm_recipes.demo.models import ensure_demo_model

    return str(ensure_demo_model("demo:tiny-qwen2-vl", weights="untrained"))


def test_a_composite_checkpoint_is_refused_naming_its_image_text_part():
    """Qwen3-Omni's published checkpoints hold the thinker (image-text-to-text) beside a talker: the refusal
    says which part to save alone, and how."""
    from transformers import AutoConfig

    from vlm_recipes.errors import UnsupportedModelError
    from vlm_recipes.families import family_for_config

    with pytest.raises(UnsupportedModelError) as refusal:
        family_for_config(AutoConfig.for_model("qwen3_omni_moe"))
    assert "`thinker_config` is an image-text-to-text model (qwen3_omni_moe_thinker)" in str(refusal.value)
    assert "Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(<model>)" in str(refusal.value)


def plain_generic_demo_model() -> tuple[str, str]:
    """(demo id, model type) of the first demo model whose type no module names, not even with knowledge of
    its own (families' GENERIC_WITH_KNOWLEDGE): the plain generic family."""
    from vlm_recipes.demo.models import DEMO_MODELS
    from vlm_recipes.families import GENERIC_WITH_KNOWLEDGE

    return next(
        (demo_id, demo.model_type)
        for demo_id, demo in DEMO_MODELS.items()
        if demo.family is None and demo.model_type not in GENERIC_WITH_KNOWLEDGE
    )


def test_speedups_the_generic_family_cannot_prove_are_off_each_with_its_reason(tmp_path, private_demo_cache):
    """A stage asking for packing, the loss-positions cut and both caches on a model no family module
    describes trains without them; report.json says each is off, and why."""
    from vlm_recipes.files import read_json

    asked = ["padding_free", "loss_positions_only", "vision_feature_cache", "preprocessed_cache"]
    args = ["--recipe", "r1-llm-only", "--output-dir", str(tmp_path), "--run-name", "t", "--max-steps", "1"]
    model, model_type = plain_generic_demo_model()
    args += [f"model={model}", "data.max_train_samples=4", "data.eval=null"]
    assert main([*args, *(f"training.{setting}=true" for setting in asked)]) == 0
    stage = read_json(tmp_path / "r1-llm-only" / "t" / "run.json")["stages"][0]
    decisions = {d["guard"]: d for d in read_json(Path(stage["dir"]) / "report.json")["decisions"]}
    for setting in asked:
        decision = decisions[setting.replace("_", "-")]
        assert decision["choice"] == "off" and decision["reason"].startswith(f"generic ({model_type}): "), (
            decision
        )
    assert "per-sample-attention" not in decisions and "loss_positions_only" not in read_json(
        Path(stage["dir"]) / "metrics.json"
    )


def test_the_benchmark_refuses_a_generic_model_for_want_of_its_flop_formula(capsys, private_demo_cache):
    from vlm_recipes.benchmarking.sft_vs_trl import main as bench

    model, model_type = plain_generic_demo_model()
    assert bench(["--model", model, "--rows", "2", "--stages", "llm-lora"]) == 2
    err = capsys.readouterr().err
    assert (
        f"generic ({model_type}): FLOP counts need the tower's patch geometry" in err
        and "Traceback" not in err
    )
