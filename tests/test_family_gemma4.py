"""Gemma 4 (families/gemma4.py): what differs from the families before it, on the tiny model
(`demo:tiny-gemma4`).

The tests every family shares run on it too (tiny_family in tests/test_families.py, test_speedups.py,
test_dpo.py, test_family_features.py); here: exact token counts for images of every size and aspect,
data.max_pixels choosing the image budget, the training chat template (the published text, the model's
own output in the loss) on every revision it supports, the audio tower left out of a stage and back in
final/, the image tokens' bidirectional attention and the padding-free refusal it causes, the cut last
layer's layer_scalar, and the vision tower's FLOPs.
"""

from __future__ import annotations

import datasets
import pytest
import torch
import trl.chat_template_utils as templates
from conftest import (
    TINY_MODELS,
    assert_image_tokens_attend_both_ways,
    assert_padding_free_refused_before_loading,
    demo_split,
    model_torch_can_count,
)
from PIL import Image
from test_families import TINY_RUN
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
from trl.chat_template_utils import has_generation_markers
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from vlm_recipes.benchmarking.flops import matmul_params_by_role
from vlm_recipes.cli.train import main
from vlm_recipes.data.lengths import sample_lengths
from vlm_recipes.errors import GuardError
from vlm_recipes.families.gemma4 import AUDIO, GEMMA4
from vlm_recipes.model.build import build_stage_model, load_processor
from vlm_recipes.recipe import load_recipe
from vlm_recipes.recipes.schema import DataSettings
from vlm_recipes.speedups.loss_positions import LastLayerAtLossPositions, loss_positions_refusal
from vlm_recipes.stages.outputs import model_for_final

MODEL = TINY_MODELS["gemma4"]
# (height, width): tiny, square, wide 4:1, tall 1:4, large, and a strip too thin for one row of tokens
SIZES = {
    "tiny": (12, 12),
    "square": (448, 448),
    "wide": (100, 400),
    "tall": (400, 100),
    "huge": (1200, 1600),
    "strip": (10, 2000),
}


@pytest.fixture(scope="module")
def model_dir(private_demo_cache):
    from vlm_recipes.demo.models import ensure_demo_model

    return ensure_demo_model(MODEL)


def chat(images: list[Image.Image], text: str = "Which colour is the shape?") -> list[dict]:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    ]


def rows_of_every_size() -> list[dict]:
    images = {name: Image.new("RGB", (w, h), (200, 30, 30)) for name, (h, w) in SIZES.items()}
    rows = [{"messages": chat([image]), "images": [image]} for image in images.values()]
    two = [images["wide"], images["tall"]]
    rows.append({"messages": chat(two, "Compare them."), "images": two})  # two images in one row
    rows.append({"messages": chat([], "Say red."), "images": []})  # text only
    return rows


def training_collator(processor) -> DataCollatorForVisionLanguageModeling:
    """TRL's collator as a stage builds it: assistant-only loss with the family's training template."""
    return DataCollatorForVisionLanguageModeling(
        processor, assistant_only_loss=True, chat_template=GEMMA4.training_chat_template(processor)
    )


# ---------------------------------------------------------------- token counts and pixel bounds


@pytest.mark.parametrize(("max_pixels", "budget"), [(200704, 70), (400000, 140)])
def test_lengths_are_exactly_the_processors_for_every_size_and_aspect(model_dir, max_pixels, budget):
    """family.count_tokens (through sample_lengths, as the length check runs it) against what
    Gemma4Processor tokenizes: `<|image>` + the image's tokens + `<image|>` per image, the token count from
    the image processor's own resize."""
    processor = load_processor(str(model_dir), DataSettings(max_pixels=max_pixels), GEMMA4)
    assert processor.image_processor.max_soft_tokens == budget
    rows = rows_of_every_size()
    ds = datasets.Dataset.from_list(rows)
    for row, counted in zip(rows, sample_lengths(ds, processor, GEMMA4), strict=True):
        text = processor.apply_chat_template(row["messages"], tokenize=False)
        out = processor(
            text=[text], images=[row["images"]] if row["images"] else None, add_special_tokens=False
        )
        assert len(out["input_ids"][0]) == counted, [im.size for im in row["images"]]
        if row["images"]:
            own = processor.image_processor(images=row["images"])["num_soft_tokens_per_image"]
            sizes = [(im.height, im.width) for im in row["images"]]
            assert GEMMA4.image_token_counts(processor, sizes) == list(own)
            assert all(n <= budget for n in own)


def test_max_pixels_picks_the_largest_budget_that_fits(model_dir):
    """A token is 48x48 px: data.max_pixels sets max_soft_tokens to the largest budget whose pixels fit
    (the smallest when none does); data.min_pixels does not apply, every image is scaled to fill its budget
    (small ones up)."""
    for max_pixels, budget in {
        161279: 70,
        161280: 70,
        322560: 140,
        645119: 140,
        645120: 280,
        10**9: 1120,
    }.items():
        processor = load_processor(str(model_dir), DataSettings(max_pixels=max_pixels), GEMMA4)
        assert processor.image_processor.max_soft_tokens == budget, max_pixels
    plain = AutoProcessor.from_pretrained(model_dir)
    bounded = load_processor(str(model_dir), DataSettings(min_pixels=10**6, max_pixels=200704), GEMMA4)
    assert bounded.image_processor.max_soft_tokens == plain.image_processor.max_soft_tokens == 70
    images = [Image.new("RGB", (w, h)) for h, w in SIZES.values()]
    own = bounded.image_processor(images=images)["num_soft_tokens_per_image"]
    assert GEMMA4.image_token_counts(bounded, list(SIZES.values())) == list(own)
    assert own[list(SIZES).index("tiny")] == 64, "a 12x12 image is scaled up to 8x8 tokens"


# ---------------------------------------------------------------- the chat template


THINKING_AND_TOOLS = [
    {"role": "user", "content": [{"type": "text", "text": "What is 2 * 3?"}]},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Multiply them.",
        "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}],
    },
    {"role": "tool", "name": "multiply", "content": "6"},
    {"role": "assistant", "content": [{"type": "text", "text": "It is 6."}]},
]


@pytest.mark.parametrize("revision", ["gemma4", "gemma4_v4", "gemma4_v5"])
def test_training_template_renders_the_published_text_with_the_models_output_in_the_loss(model_dir, revision):
    """TRL has no training variant of any Gemma 4 template; the family's renders every conversation as the
    published revision does, and the loss covers the model's thinking, tool call, answer and end of turn,
    never the turn header or the tool's response."""
    processor = AutoProcessor.from_pretrained(model_dir)
    processor.chat_template = getattr(templates, f"{revision}_chat_template")
    training = GEMMA4.training_chat_template(processor)
    assert has_generation_markers(training)
    demo = [row["messages"] for row in demo_split("demo:train", "train", 4)[0]]
    for conversation in [*demo, THINKING_AND_TOOLS]:
        for prompt in (False, True):
            published = processor.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=prompt
            )
            assert (
                processor.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=prompt, chat_template=training
                )
                == published
            )
    batch = processor.apply_chat_template(
        THINKING_AND_TOOLS,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        chat_template=training,
    )
    ids, mask = batch["input_ids"][0], batch["assistant_masks"][0]
    learned = processor.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    call = "<|tool_call>call:multiply{a:2,b:3}<tool_call|>"
    assert learned == f"<|channel>thought\nMultiply them.\n<channel|>{call}It is 6.<turn|>\n"


@pytest.mark.parametrize("revision", ["gemma4_v2", "gemma4_v3"])
def test_older_template_revisions_are_refused_with_what_to_do(model_dir, revision):
    processor = AutoProcessor.from_pretrained(model_dir)
    processor.chat_template = getattr(templates, f"{revision}_chat_template")
    with pytest.raises(GuardError, match="chat_template.jinja to the current one"):
        GEMMA4.training_chat_template(processor)
    processor.chat_template = templates.qwen3_vl_chat_template  # not Gemma 4's: not the family's business
    assert GEMMA4.training_chat_template(processor) is None


# ---------------------------------------------------------------- audio


@pytest.fixture(scope="module")
def with_audio(model_dir, tmp_path_factory):
    """The tiny model with a (tiny) audio tower and embedder, as E2B/E4B checkpoints have them."""
    from transformers import Gemma4AudioConfig, Gemma4ForConditionalGeneration

    config = AutoConfig.from_pretrained(model_dir)
    config.audio_config = Gemma4AudioConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[4, 4],
        output_proj_dims=16,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma4ForConditionalGeneration._from_config(config, dtype=torch.float32)
    tiny = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    assert not model.load_state_dict(tiny.state_dict(), strict=False).unexpected_keys
    out = tmp_path_factory.mktemp("gemma4-with-audio")
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(model_dir).save_pretrained(out)
    return out


def is_audio(name: str) -> bool:
    return any(name.startswith(prefix + ".") for prefix in AUDIO)


def test_a_stage_loads_the_model_without_its_audio_tower_and_final_takes_it_back(with_audio, model_dir):
    """Stages build the model with audio_config None: the checkpoint's audio weights are left unread (no
    weight missing), the text-and-image forward is the whole model's, and final/ is the whole model again,
    its audio tower the source's, bit for bit."""
    config = AutoConfig.from_pretrained(with_audio)
    config.audio_config = None
    _, info = AutoModelForImageTextToText.from_pretrained(with_audio, config=config, output_loading_info=True)
    assert not info["missing_keys"] and info["unexpected_keys"]
    assert all(is_audio(key) for key in info["unexpected_keys"])

    stage = load_recipe("r2-vision-only").stages[0]  # vision and projector trained in full, in fp32
    built = build_stage_model(str(with_audio), stage, "fp32", "cpu")
    assert built.towers_left_out == ["audio_config"]
    decision = next(d for d in built.decisions if d.guard == "towers-left-out")
    assert "no stage's data holds" in decision.reason
    loaded = dict(built.model.named_parameters())
    whole = AutoModelForImageTextToText.from_pretrained(with_audio, dtype=torch.float32).eval()
    source = dict(whole.named_parameters())
    assert set(source) - set(loaded) == {n for n in source if is_audio(n)} != set()
    assert all(torch.equal(p, source[n]) for n, p in loaded.items())

    processor = AutoProcessor.from_pretrained(model_dir)
    rows = [dict(r) for r in demo_split("demo:train", "train", 2)[0]]
    inputs = {k: v for k, v in training_collator(processor)(rows).items() if k != "labels"}
    with torch.no_grad():
        assert torch.equal(built.model.eval()(**inputs).logits, whole(**inputs).logits)

    trained = "model.embed_vision.embedding_projection.weight"
    with torch.no_grad():
        loaded[trained].add_(1.0)  # as if the stage had trained it
    final = dict(model_for_final(built, built.model, None, quantized=False).named_parameters())
    assert set(final) == set(source)
    assert all(torch.equal(final[n], source[n]) for n in source if is_audio(n))
    assert torch.equal(final[trained], loaded[trained]) and not torch.equal(final[trained], source[trained])


# ---------------------------------------------------------------- attention, packing, the last layer


def test_image_tokens_attend_to_each_other_both_ways(model_dir):
    """The collator passes mm_token_type_ids (1 on image tokens), with which Gemma 4 (as 26B and 31B, the
    tiny model's text config) lets an image's tokens attend to each other both ways in the sliding
    layers: the first image token's output changes, the text before the image does not."""
    processor = AutoProcessor.from_pretrained(model_dir)
    rows = [dict(r) for r in demo_split("demo:train", "train", 2)[0]][::-1]  # one image, then two (pair)
    batch = training_collator(processor)(rows)
    is_image = batch["input_ids"] == processor.tokenizer.image_token_id
    assert torch.equal(batch["mm_token_type_ids"].bool(), is_image)
    assert_image_tokens_attend_both_ways(model_dir, batch, is_image, "mm_token_type_ids")


def run(tmp_path, recipe: str, *overrides: str) -> int:
    args = ["--recipe", recipe, "--output-dir", str(tmp_path), "--run-name", "t", *TINY_RUN, f"model={MODEL}"]
    return main([*args, *overrides])


def test_padding_free_is_refused_at_the_data_check_with_the_reason(tmp_path, capsys):
    code = run(tmp_path, "r1-llm-only", "training.padding_free=true")
    assert_padding_free_refused_before_loading(code, capsys.readouterr().err, "gemma4")


def test_the_cut_last_layer_scales_its_output_by_layer_scalar(model_dir):
    """Gemma 4 multiplies each layer's output by a learned layer_scalar (1 in the tiny model's random
    init, not in a trained checkpoint): the last layer computed at the loss positions only scales too."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert loss_positions_refusal(model, GEMMA4.decoder_layer) is None
    last = GEMMA4.decoder_layer.decoder_layers(model)[-1]
    last.layer_scalar.fill_(0.5)
    outputs = []
    last.register_forward_hook(lambda _, args, out: outputs.append(out))
    processor = AutoProcessor.from_pretrained(model_dir)
    batch = training_collator(processor)([dict(r) for r in demo_split("demo:train", "train", 4)[0]])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        model.model(**inputs)
        cut = LastLayerAtLossPositions(model, GEMMA4.decoder_layer)
        cut.select(batch)
        model.model(**inputs)
    whole, at_positions = outputs
    expected = whole.flatten(0, 1)[cut.positions]
    assert (at_positions[0] - expected).abs().max() < 1e-5 * expected.abs().max()


# ---------------------------------------------------------------- FLOPs


def test_vision_flops_are_torchs_count_for_an_image_that_fills_its_budget(model_dir):
    """The tower runs every image padded to its budget's patches (tests/test_flops.py's families count
    only real patches, as the formula does); an image of exactly 7x10 tokens has no padding, and torch's
    count is the formula's vision and projector terms, plus the pooler's averaging done as a matmul."""
    model = model_torch_can_count(model_dir, GEMMA4).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    inputs = processor.image_processor(
        images=[Image.new("RGB", (480, 336), (10, 200, 30))], return_tensors="pt"
    )
    assert torch.as_tensor(inputs["num_soft_tokens_per_image"]).tolist() == [70]
    assert (inputs["image_position_ids"] >= 0).all(), "no padded patch"
    geometry = GEMMA4.vision_geometry(model.config)
    params = matmul_params_by_role(model, GEMMA4)
    tokens, patches = 70, 70 * geometry.patches_per_token
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        GEMMA4.image_encoder_owner(model).get_image_features(
            inputs["pixel_values"], inputs["image_position_ids"]
        )
    expected = 2 * params["vision"] * patches + 2 * params["projector"] * tokens
    expected += 4 * geometry.attention_pairs(tokens) * geometry.width
    pooling = 2 * tokens * patches * model.config.vision_config.hidden_size
    assert counter.get_total_flops() == expected + pooling


def test_the_patch_embedding_is_a_linear_layer_so_the_matmul_speedup_has_nothing_to_switch(model_dir):
    """The processor cuts the patches; the tower embeds them by a linear layer: no convolution for
    training.matmul_patch_embedding to switch, which a stage then refuses (speedups/install.py)."""
    from vlm_recipes.speedups.patch_embedding import use_matmul_patch_embedding

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    tower = GEMMA4.vision_tower(model)
    assert isinstance(tower.patch_embedder.input_proj, torch.nn.Linear)
    assert not use_matmul_patch_embedding(tower)
