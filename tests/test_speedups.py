"""The speed-ups of issue 7, each proven not to change what is learned: padding-free packing with
multimodal RoPE and per-sample attention, sparse LoRA dropout, the frozen vision tower without
autograd, and the vision feature and preprocessed sample caches.

Tests on a model run for every family's tiny model (`tiny_family`); those that train through the CLI
use the default (Qwen2-VL)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import model_inputs, single_image_demo_rows
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl.chat_template_utils import get_training_chat_template
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from vlm_recipes.caches import PreprocessedSampleCollator
from vlm_recipes.cli.train import main
from vlm_recipes.data.rows import undecoded
from vlm_recipes.files import cache_dir
from vlm_recipes.recipes.load import load_recipe
from vlm_recipes.speedups import packing
from vlm_recipes.speedups.frozen_vision import VisionFeatureCache, run_without_grad
from vlm_recipes.speedups.packing import PER_SAMPLE_SDPA, PaddingFreeVisionCollator, attend_per_sample
from vlm_recipes.speedups.sparse_dropout import SparseDropout
from vlm_recipes.stages.build import build_stage_model

PER_SAMPLE_LOSS_TOLERANCE = 1e-5  # fp32 on CPU; observed differences are ~5e-7 (summation order)


@pytest.fixture(scope="module")
def family(tiny_family):
    return tiny_family[0]


@pytest.fixture(scope="module")
def tiny(tiny_family):
    model_dir = tiny_family[1]
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    return model, processor


@pytest.fixture(scope="module")
def rows():
    """Rows of different lengths, one of them a long answer, and one text-only row."""
    ds = single_image_demo_rows(6)
    picked = [dict(ds[i]) for i in range(6)]
    text_only = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say left."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "left"}]},
        ],
        "images": [],
    }
    return picked[:2] + [text_only] + picked[2:]


def padded_collator(processor):
    """TRL's vision collator as SFTTrainer builds it (assistant-only loss, training chat template)."""
    return DataCollatorForVisionLanguageModeling(
        processor, assistant_only_loss=True, chat_template=get_training_chat_template(processor)
    )


def image_inputs(batch) -> tuple:
    """The (pixel_values, second argument) of `get_image_features`: Qwen's image grids, SmolVLM's pixel
    attention mask."""
    second = batch.get("image_grid_thw", batch.get("pixel_attention_mask", batch.get("image_sizes")))
    return (batch["pixel_values"],) if second is None else (batch["pixel_values"], second)  # Gemma 3: pixels


def token_losses(model, batch) -> torch.Tensor:
    """The loss of every labelled token, in order (the causal shift applied)."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch["labels"]
    log_probs = F.log_softmax(logits[:, :-1].float(), -1)
    target = labels[:, 1:]
    mask = target != -100
    return -log_probs[mask].gather(-1, target[mask][:, None])[:, 0]


@pytest.fixture(scope="module")
def tiny_per_sample(tiny_family):
    """The tiny model with its text attention switched to sdpa_per_sample, as padding_free does."""
    model_dir = tiny_family[1]
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert attend_per_sample(model) == "sdpa"
    assert model.config.text_config._attn_implementation == PER_SAMPLE_SDPA
    assert model.config.vision_config._attn_implementation == "sdpa", "the vision tower is not packed"
    return model, AutoProcessor.from_pretrained(model_dir)


@pytest.mark.parametrize("attention", ["sdpa with a block mask", PER_SAMPLE_SDPA])
def test_packed_per_sample_losses_equal_unpacked(tiny, tiny_per_sample, family, rows, attention):
    if why := family.padding_free_refusal():  # refused at the data check: tests/test_family_gemma3.py
        pytest.skip(why)
    model, processor = tiny if attention != PER_SAMPLE_SDPA else tiny_per_sample
    padded = padded_collator(processor)
    packed = PaddingFreeVisionCollator(padded, family.rope_index(model))([dict(r) for r in rows])
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    one_by_one = [token_losses(model, padded([dict(r)])) for r in rows]
    together = token_losses(model, packed)
    assert together.shape == torch.cat(one_by_one).shape
    assert (together - torch.cat(one_by_one)).abs().max() < PER_SAMPLE_LOSS_TOLERANCE
    if attention == PER_SAMPLE_SDPA:
        lengths = [padded([dict(r)])["input_ids"].shape[1] for r in rows]
        assert packing._last_lengths[1] == lengths, "each sample was attended on its own"


def test_per_sample_attention_leaves_padded_batches_to_sdpa(tiny, tiny_per_sample, rows):
    """Unpacked batches (eval with padding, generation) take exactly the sdpa path they took before."""
    batch = padded_collator(tiny[1])([dict(r) for r in rows])
    assert torch.equal(token_losses(tiny[0], batch), token_losses(tiny_per_sample[0], batch))


def test_per_sample_attention_generates_what_sdpa_generates(tiny, tiny_per_sample, rows):
    """Generation (a KV cache; left padding beyond one row) never takes the per-sample path."""
    processor = AutoProcessor.from_pretrained(tiny_per_sample[0].name_or_path)  # its own: padded left
    processor.tokenizer.padding_side = "left"
    for batch in ([rows[0]], rows[:3]):
        prompts = [{**r, "messages": r["messages"][:1]} for r in batch]
        inputs = model_inputs(processor, prompts, add_generation_prompt=True)
        generated = [
            model.generate(**inputs, max_new_tokens=8, do_sample=False)
            for model, _ in (tiny, tiny_per_sample)
        ]
        assert torch.equal(*generated)


@pytest.mark.parametrize("p", [0.05, 0.3])
def test_sparse_dropout_drops_each_element_independently_with_probability_p(p):
    torch.manual_seed(0)
    n_blocks, block = 2000, 1000
    x = torch.randn(n_blocks, block, requires_grad=True)
    y = SparseDropout(p).train()(x)
    dropped = y == 0
    rate = dropped.float().mean().item()
    assert abs(rate - p) < 5 * (p * (1 - p) / x.numel()) ** 0.5, "the drop rate is p"
    per_block = dropped.float().sum(dim=1)
    binomial_variance = block * p * (1 - p)
    assert per_block.var().item() == pytest.approx(binomial_variance, rel=0.1), "drops are independent"
    assert torch.allclose(y[~dropped], x[~dropped] / (1 - p)), "the rest is scaled by 1/(1-p)"
    y.sum().backward()
    assert torch.equal(x.grad == 0, dropped), "no gradient through a dropped element"
    assert torch.allclose(x.grad[~dropped], torch.tensor(1 / (1 - p)))
    eval_input = torch.randn(10, 10)
    assert SparseDropout(p).eval()(eval_input) is eval_input, "eval mode is the identity"
    torch.manual_seed(1)
    first = SparseDropout(p).train()(torch.ones(100, 100))
    torch.manual_seed(1)
    assert torch.equal(first, SparseDropout(p).train()(torch.ones(100, 100))), "seeded like torch"


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_sparse_dropout_replays_its_mask_under_activation_checkpointing(use_reentrant):
    """Recomputation in backward must drop the same positions, or the gradient is wrong."""
    layer, dropout = torch.nn.Linear(64, 64), SparseDropout(0.3).train()
    x = torch.randn(32, 64, requires_grad=True)

    def block(t):
        return layer(dropout(t)).relu()

    torch.manual_seed(0)
    block(x).sum().backward()
    expected, x.grad = x.grad.clone(), None
    torch.manual_seed(0)
    checkpoint(block, x, use_reentrant=use_reentrant).sum().backward()
    assert torch.equal(x.grad, expected)


def short_r1_stage(tmp_path, run_name: str, overrides: list[str]):
    """r1's stage for 4 steps on 16 rows (eval on 8, no generation), in this process (an interpreter start
    costs more than the stage); returns its stage directory."""
    code = main(
        [
            "--recipe",
            "r1-llm-only",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            run_name,
            "--max-steps",
            "4",
            "data.max_train_samples=16",
            "data.max_eval_samples=8",
            "evaluation.generate=false",
            *overrides,
        ]
    )
    assert code == 0
    return tmp_path / "r1-llm-only" / run_name / "stage-1-llm-lora"


def test_sparse_lora_dropout_stage_learns_like_torch_dropout(tmp_path):
    """The same stage with either dropout: every LoRA dropout swapped, losses as close as two seeds of
    the same dropout would be."""
    results = {}
    for way, extra in (("torch", []), ("sparse", ["training.sparse_lora_dropout=true"])):
        stage_dir = short_r1_stage(tmp_path, way, extra)
        report = json.loads((stage_dir / "report.json").read_text())
        results[way] = (json.loads((stage_dir / "metrics.json").read_text()), report)
    (torch_metrics, _), (sparse_metrics, report) = results["torch"], results["sparse"]
    swapped = next(d for d in report["decisions"] if d["guard"] == "sparse-lora-dropout")
    assert swapped["choice"].startswith(f"{len(report['lora_targets'])} LoRA dropouts"), "every one"
    assert sparse_metrics["final_train_loss"] == pytest.approx(torch_metrics["final_train_loss"], rel=0.02)
    assert sparse_metrics["eval_loss"] == pytest.approx(torch_metrics["eval_loss"], rel=0.01)


def test_packed_batch_keeps_each_samples_own_positions(tiny, family, rows):
    if why := family.padding_free_refusal():
        pytest.skip(why)
    model, processor = tiny
    padded = padded_collator(processor)
    packed = PaddingFreeVisionCollator(padded, family.rope_index(model))([dict(r) for r in rows])
    start = 0
    for row in rows:
        alone = padded([dict(row)])
        length = alone["input_ids"].shape[1]
        if family.rope_index(model) is None:  # 1-D RoPE (SmolVLM): [1, total] positions
            assert packed["position_ids"][0, start : start + length].tolist() == list(range(length))
            assert packed["labels"][0, start] == -100
            start += length
            continue
        own, _ = model.model.get_rope_index(
            input_ids=alone["input_ids"],
            mm_token_type_ids=alone["mm_token_type_ids"],
            image_grid_thw=alone.get("image_grid_thw"),
            attention_mask=alone["attention_mask"],
        )
        positions = packed["position_ids"][:, 0, start : start + length]
        assert positions[0].tolist() == list(range(length)), "text positions restart with every sample"
        assert torch.equal(positions[1:], own[:, 0]), "the 3-D mRoPE positions are the sample's own"
        assert packed["labels"][0, start] == -100, "no sample learns to predict the next one's start"
        start += length
    assert start == packed["input_ids"].shape[1], "no padding"


def test_padding_free_stage_matches_padded_training(tmp_path):
    """Same data, seed and steps: the losses agree (bf16 rounding aside) and the token count is exact."""
    metrics = {}
    for way, extra in (("padded", []), ("packed", ["training.padding_free=true"])):
        stage_dir = short_r1_stage(tmp_path, way, extra)
        metrics[way] = json.loads((stage_dir / "metrics.json").read_text())
        assert (stage_dir / "DONE").exists()
    padded, packed = metrics["padded"], metrics["packed"]
    assert packed["final_train_loss"] == pytest.approx(padded["final_train_loss"], rel=0.01)
    assert packed["eval_loss"] == pytest.approx(padded["eval_loss"], rel=0.01)
    tokens = {way: m["train_tokens_per_second"] * m["train_runtime_s"] for way, m in metrics.items()}
    assert tokens["packed"] == pytest.approx(tokens["padded"], rel=1e-3), "TRL counts real tokens both ways"


@pytest.fixture()
def llm_lora_model(tiny_family):
    stage = load_recipe("r1-llm-only", ["stages.llm-lora.quantization.mode=none"]).stages[0]
    return build_stage_model(str(tiny_family[1]), stage, "fp32", "cpu").model


def test_frozen_vision_gets_no_autograd_even_with_checkpointing(llm_lora_model, tiny, family, rows):
    """transformers' enable_input_require_grads hooks the vision patch embedding too: without the guard,
    backward would run through the whole frozen tower."""
    model = llm_lora_model
    _, processor = tiny
    batch = padded_collator(processor)([dict(r) for r in rows[:2]])
    model.base_model.model.activation_checkpointing_enable()
    model.enable_input_require_grads()
    owner = family.image_encoder_owner(model)

    def feature_requires_grad() -> bool:
        out = owner.get_image_features(*image_inputs(batch), return_dict=True)
        return out.pooler_output[0].requires_grad

    # Qwen2-VL and Qwen2.5-VL name their patch embedding as the tower's input embedding, so transformers
    # hooks it; Qwen3-VL's tower names none and runs without the waste, the guard changing nothing there.
    assert feature_requires_grad() or family.name == "qwen3-vl", "the waste this guard removes is real"
    run_without_grad(model, family)
    assert not feature_requires_grad()
    loss = model(**batch).loss
    loss.backward()
    vision_side = ("vision", "projector")
    assert all(
        p.grad is None
        for n, p in model.named_parameters()
        if family.role_of(n.removeprefix("base_model.model.")) in vision_side
    )
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_vision_feature_cache_hits_match_computed_features(tiny_family, rows, tmp_path):
    """Cold and warm, the forward is the uncached one bit for bit: every tensor the model reads from the
    image features is cached per image (Qwen3-VL: the DeepStack features as well as the merged tokens)."""
    family, model_dir = tiny_family
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    batch = padded_collator(processor)([dict(r) for r in rows])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        expected = model(**inputs).logits
        computed = family.image_encoder_owner(model).get_image_features(
            *image_inputs(batch), return_dict=True
        )
    cache = VisionFeatureCache(tmp_path, model, family).install()
    images = len(family.image_units(*image_inputs(batch)))  # SmolVLM: one entry per tile
    with torch.no_grad():
        first = model(**inputs).logits
        assert (cache.hits, cache.misses) == (0, images)
        second = model(**inputs).logits
        assert (cache.hits, cache.misses) == (images, images)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    stored = [load_file(str(path)) for path in sorted(cache.directory.glob("*/*.safetensors"))]
    # one entry per distinct image (SmolVLM: blank tiles of different images share one)
    assert len(stored) == len(
        {pixels.numpy().tobytes() for pixels, _ in family.image_units(*image_inputs(batch))}
    )
    assert {frozenset(s) for s in stored} == {frozenset(family.split_image_features(computed)[0])}

    # other processor settings: other pixel values, so other keys (never a stale hit)
    if family.name == "smolvlm":  # one tile side less: other tiles
        edge = (
            processor.image_processor.size["longest_edge"]
            - processor.image_processor.max_image_size["longest_edge"]
        )
        processor.image_processor.size = {"longest_edge": edge}
    elif family.name in ("gemma3", "llava-onevision"):  # fixed tile sizes: another normalization
        processor.image_processor.image_mean = [0.25, 0.25, 0.25]
    else:
        processor.image_processor.size = {"shortest_edge": 28 * 28 * 100, "longest_edge": 28 * 28 * 400}
    smaller = padded_collator(processor)([dict(r) for r in rows])
    with torch.no_grad():
        model(**{k: v for k, v in smaller.items() if k != "labels"})
    assert cache.misses == images + len(family.image_units(*image_inputs(smaller)))

    # other tower weights: another cache directory
    with torch.no_grad():
        next(family.vision_tower(model).parameters()).add_(1e-3)
    assert VisionFeatureCache(tmp_path, model, family).directory != cache.directory


def test_vision_feature_cache_second_run_reads_everything_and_learns_the_same(tmp_path):
    shutil.rmtree(cache_dir() / "vision-features", ignore_errors=True)  # the session's cache: start cold
    common = [
        "--recipe",
        "r1-llm-only",
        "--output-dir",
        str(tmp_path),
        "--max-steps",
        "3",
        "data.max_train_samples=12",
        "data.max_eval_samples=4",  # eval answers are generated too: generate() goes through the cache
    ]
    metrics = {}
    for run in ("plain", "cold", "warm"):
        extra = [] if run == "plain" else ["training.vision_feature_cache=true"]
        assert main([*common, "--run-name", run, *extra]) == 0  # in this process: cheaper than a start
        path = tmp_path / "r1-llm-only" / run / "stage-1-llm-lora" / "metrics.json"
        metrics[run] = json.loads(path.read_text())
    cold, warm = metrics["cold"]["vision_feature_cache"], metrics["warm"]["vision_feature_cache"]
    # 3 steps of 8 over 12 rows: the second epoch already reads what the first one wrote
    assert cold["misses"] > 0 and cold["hits"] > 0
    assert warm["misses"] == 0 and warm["hits"] == cold["hits"] + cold["misses"]
    curves = {run: [p["loss"] for p in m["loss_curve"]] for run, m in metrics.items()}
    assert curves["warm"] == curves["cold"]
    assert curves["cold"] == pytest.approx(curves["plain"], rel=1e-3)


def test_preprocessed_samples_assemble_to_exactly_the_collators_batch(tiny, rows, tmp_path):
    """Cold (images decoded from their files) and warm (read back), the batch is TRL's, tensor for tensor."""
    _, processor = tiny
    padded = padded_collator(processor)
    expected = padded([dict(r) for r in rows])
    files = [dict(r) for r in undecoded(single_image_demo_rows(6))]
    as_stored = files[:2] + [rows[2]] + files[2:]  # images as file references, the text-only row as is
    cached = PreprocessedSampleCollator(padded, tmp_path)
    for attempt in ("cold", "warm"):
        batch = cached([dict(r) for r in as_stored])
        assert batch.keys() == expected.keys(), attempt
        for key, value in expected.items():
            assert torch.equal(batch[key], value), (attempt, key)
    assert (cached.misses, cached.hits) == (len(rows), len(rows))


def test_second_stage_reads_the_samples_the_first_stage_preprocessed(tmp_path, monkeypatch):
    monkeypatch.setenv("VLM_RECIPES_SPEEDUP_CACHE", str(tmp_path / "speedups"))
    code = main(
        [
            "--recipe",
            "r3-two-stage",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "cached",
            "--max-steps",
            "2",
            "data.max_train_samples=8",
            "data.max_eval_samples=4",
            "evaluation.generate=false",
            "training.preprocessed_cache=true",
        ]
    )
    assert code == 0
    stages = sorted((tmp_path / "r3-two-stage" / "cached").glob("stage-*"))
    first, second = (json.loads((d / "metrics.json").read_text())["preprocessed_cache"] for d in stages)
    assert first["misses"] > 0
    assert second["misses"] == 0 and second["hits"] > 0, "same processor settings: every row was ready"
