"""Tests for the embedded demo model and dataset (built offline into a temporary cache)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageChops

from vlm_recipes import files
from vlm_recipes.demo import dataset as demo_dataset
from vlm_recipes.demo import models as demo_models
from vlm_recipes.demo import samples as demo_samples


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory: pytest.TempPathFactory):
    """Point the cache at a temp dir for the whole module so the user's cache is never touched."""
    root = tmp_path_factory.mktemp("vlm-recipes-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLM_RECIPES_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def data_dir(demo_cache: Path) -> Path:
    return demo_dataset.ensure_demo_dataset()


@pytest.fixture(scope="module")
def model_dir(demo_cache: Path) -> Path:
    return demo_models.ensure_demo_model()


@pytest.fixture(scope="module")
def processor(model_dir: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _with_image(row: dict, base: Path, *, answer: bool = True) -> list[dict]:
    """The row's messages with its PIL image inlined, as processor.apply_chat_template expects."""
    messages = json.loads(json.dumps(row["messages"]))
    messages[0]["content"][0]["image"] = Image.open(base / row["images"][0]).convert("RGB")
    return messages if answer else messages[:1]


def _answer(row: dict) -> str:
    return row["messages"][1]["content"][0]["text"]


def test_cache_dir_env_and_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLM_RECIPES_CACHE", str(tmp_path / "c"))
    assert files.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("VLM_RECIPES_CACHE")
    assert files.cache_dir() == Path.home() / ".cache" / "vlm-recipes"


def assert_metric_columns(row: dict) -> None:
    """What a demo row carries for the benchmarks' metrics: ten annotators' `answers`, most (7 or more) the
    row's answer, the rest its one variant ("round" for "circle"); or, asked to choose, the two `options` its
    question names in order, one of them its answer; a nutrition label neither (JSON F1 scores it)."""
    answer, question = _answer(row), row["messages"][0]["content"][-1]["text"]
    if "answers" in row:
        assert "options" not in row and len(row["answers"]) == 10
        variants = Counter(row["answers"])
        assert variants[answer] >= 7 and set(variants) <= {
            answer,
            demo_samples.ANNOTATOR_VARIANTS.get(answer),
        }
    elif "options" in row:
        first, second = row["options"]
        assert answer in (first, second) and first != second
        assert question.index(first) < question.rindex(second)
    else:
        assert row["task"] == "nutrition"


def test_dataset_layout(demo_cache: Path, data_dir: Path) -> None:
    assert data_dir == demo_cache / demo_dataset.VERSION / "data-2"
    info = json.loads((data_dir / "dataset_info.json").read_text())
    assert (data_dir / "README.md").is_file()
    for split, n in (("train", 192), ("eval", 48)):
        rows = _rows(data_dir / f"{split}.jsonl")
        assert len(rows) == n == info["splits"][split]["rows"]
        assert [r["id"] for r in rows] == [f"{split}-{i:05d}" for i in range(n)]
        counts = {t: sum(r["task"] == t for r in rows) for t in ("shapes", "nutrition", "pair", "motion")}
        expected = {
            "shapes": n - n // 4 - 2 * (n // 8),
            "nutrition": n // 4,
            "pair": n // 8,
            "motion": n // 8,
        }
        assert counts == info["splits"][split]["tasks"] == expected
        images, videos = {"pair": 2, "motion": 0}, {"motion": 1}
        for r in rows:
            columns = {"shapes": {"answers", "options"}, "pair": {"answers"}, "motion": {"answers"}}
            assert set(r) - {"id", "task", "messages", "images", "videos"} <= columns.get(r["task"], set())
            assert_metric_columns(r)
            assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
            parts = [p["type"] for p in r["messages"][0]["content"]]
            assert parts.count("image") == len(r["images"]) == images.get(r["task"], 1)
            assert parts.count("video") == len(r["videos"]) == videos.get(r["task"], 0)
            assert all((data_dir / path).is_file() for path in r["images"] + r["videos"])
            if r["task"] == "nutrition":
                facts = json.loads(_answer(r))
                assert list(facts) == ["calories", "fat_g", "carbs_g", "protein_g", "sugar_g", "sodium_mg"]
                assert all(isinstance(v, int) for v in facts.values())
                assert facts["sugar_g"] <= facts["carbs_g"]
        # quick runs (data.max_train_samples=4 and up) see every kind of sample
        assert {r["task"] for r in rows[:4]} == {"shapes", "nutrition", "pair", "motion"}
        without_video = _rows(data_dir / f"{split}-images.jsonl")
        assert without_video == [r for r in rows if r["task"] != "motion"]


def test_the_teaching_eval_set_is_demo_evals_kind_of_rows_three_times_over(demo_cache: Path, data_dir: Path):
    """demo:teaching-eval, what `demo-learns` scores on: demo:eval's task mix three times over, rows of their
    own (no image of demo:eval's), pair answers alternating; without video, its rows less the clips."""
    path = Path(demo_dataset.resolve_data_source("demo:teaching-eval"))
    assert path == demo_cache / demo_dataset.VERSION / "teaching-data-2" / "eval.jsonl"
    rows, evals = _rows(path), _rows(data_dir / "eval.jsonl")
    assert len(rows) == 3 * len(evals) == 144
    assert [r["id"] for r in rows] == [f"teaching-{i:05d}" for i in range(144)]
    assert Counter(r["task"] for r in rows) == {
        t: 3 * n for t, n in Counter(r["task"] for r in evals).items()
    }
    pairs = [_answer(r) for r in rows if r["task"] == "pair"]
    assert pairs == ["yes", "no"] * (len(pairs) // 2)
    images = {(path.parent / image).read_bytes() for r in rows for image in r["images"]}
    assert not images & {(data_dir / image).read_bytes() for r in evals for image in r["images"]}
    without_video = demo_dataset.resolve_data_source("demo:teaching-eval", with_videos=False)
    assert _rows(Path(without_video)) == [r for r in rows if r["task"] != "motion"]


def test_pair_and_motion_answers_match_pixels(data_dir: Path) -> None:
    """The two-image answer is the shapes' colours compared; the clip's, where the dot's centre went from
    the first decoded frame to the last."""
    import av

    checked = {"pair": 0, "motion": 0}
    for r in _rows(data_dir / "train.jsonl"):
        if r["task"] == "pair":
            colours = []
            for path in r["images"]:
                pixels = Image.open(data_dir / path).convert("RGB").getcolors()
                colours.append({c for _, c in pixels if c != (255, 255, 255)})
            assert (colours[0] == colours[1]) == (_answer(r) == "yes")
        elif r["task"] == "motion":
            with av.open(str(data_dir / r["videos"][0])) as container:
                frames = [f.to_ndarray(format="rgb24").astype(int) for f in container.decode(video=0)]
            assert len(frames) == demo_samples.CLIP_FRAMES
            centres = []
            for frame in (frames[0], frames[-1]):
                ys, xs = (frame.sum(-1) < 600).nonzero()  # the dot: far from white
                centres.append((xs.mean(), ys.mean()))
            dx, dy = centres[1][0] - centres[0][0], centres[1][1] - centres[0][1]
            seen = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
            assert seen == _answer(r), r["id"]
        else:
            continue
        checked[r["task"]] += 1
    assert checked == {"pair": 24, "motion": 24}


def test_shape_answers_match_pixels(data_dir: Path) -> None:
    """Answers must be readable from the image, otherwise training on the demo proves nothing: the one shape's
    colour is the answer's, its kind is what its share of its bounding box says (a square fills it, a circle
    pi/4 of it, a triangle half), and an either-or question offers the answer."""
    asked = Counter()
    for r in _rows(data_dir / "train.jsonl"):
        if r["task"] != "shapes":
            continue
        img = Image.open(data_dir / r["images"][0]).convert("RGB")
        assert 56 <= img.width <= 112 and 56 <= img.height <= 112
        colours = {rgb: n for n, rgb in img.getcolors() if rgb != (255, 255, 255)}
        assert len(colours) == 1  # one shape, drawn without anti-aliasing
        ((rgb, area),) = colours.items()
        x0, y0, x1, y1 = ImageChops.difference(img, Image.new("RGB", img.size, "white")).getbbox()
        fill = area / ((x1 - x0) * (y1 - y0))
        kind = "triangle" if fill < 0.65 else "circle" if fill < 0.9 else "square"
        colour = next(name for name, value in demo_samples.COLOURS.items() if value == rgb)
        question, answer = r["messages"][0]["content"][1]["text"], _answer(r)
        if question == "What shape is it?":
            assert answer == kind, (r["id"], fill)
            asked["shape"] += 1
        elif question.startswith("Is the shape "):
            assert answer == colour and re.fullmatch(
                rf"Is the shape (\w+ or {colour}|{colour} or \w+)\?", question
            )
            asked["colour_choice"] += 1
        else:
            assert answer == kind and re.fullmatch(rf"Is it a (\w+ or a {kind}|{kind} or a \w+)\?", question)
            asked["shape_choice"] += 1
    assert sum(asked.values()) == 96 and min(asked.values()) >= 20, asked


def test_dataset_build_is_deterministic(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLM_RECIPES_CACHE", str(tmp_path))
    other = demo_dataset.ensure_demo_dataset()
    assert other != data_dir
    clip = next(r["videos"][0] for r in _rows(data_dir / "train.jsonl") if r["videos"])
    for name in ("train.jsonl", "eval.jsonl", "dataset_info.json", "images/train-00003.png", clip):
        assert (other / name).read_bytes() == (data_dir / name).read_bytes(), name


def test_model_build_is_deterministic(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLM_RECIPES_CACHE", str(tmp_path))
    rng_state = torch.random.get_rng_state()
    other = demo_models.ensure_demo_model()
    assert torch.equal(torch.random.get_rng_state(), rng_state), "building must not reseed the caller"
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_model_and_processor_load(model_dir: Path, processor) -> None:
    from transformers import AutoModelForImageTextToText, Qwen2VLForConditionalGeneration
    from trl.chat_template_utils import qwen2_5_vl_chat_template

    tok = processor.tokenizer
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir)
    assert isinstance(AutoModelForImageTextToText.from_pretrained(model_dir), Qwen2VLForConditionalGeneration)
    assert type(processor).__name__ == "Qwen2VLProcessor"
    assert processor.chat_template == qwen2_5_vl_chat_template
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    cfg = model.config
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg.text_config.vocab_size >= len(tok) >= 1000
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert sum(p.numel() for p in model.parameters()) < 400_000


def test_forward_and_generate(model_dir: Path, data_dir: Path, processor) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
    row = next(r for r in _rows(data_dir / "train.jsonl") if r["task"] == "shapes")
    batch = processor.apply_chat_template(
        _with_image(row, data_dir), tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert batch["pixel_values"].shape[-1] == 3 * 2 * 14 * 14
    n_image_tokens = int((batch["input_ids"] == model.config.image_token_id).sum())
    assert n_image_tokens == int(batch["image_grid_thw"].prod()) // 4
    assert 4 <= n_image_tokens <= 16  # min/max_pixels of the demo image processor
    with torch.no_grad():
        loss = model(**batch, labels=batch["input_ids"]).loss
    assert math.isfinite(loss.item())

    prompt = processor.apply_chat_template(
        _with_image(row, data_dir, answer=False),
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        add_generation_prompt=True,
    )
    out = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= prompt["input_ids"].shape[1] + 3


@pytest.mark.parametrize("task", ["shapes", "nutrition"])
def test_assistant_mask_covers_exactly_the_answer(data_dir: Path, processor, task: str) -> None:
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    # TRL recognises the shipped (Qwen2-VL) template and hands back its training variant.
    template = get_training_chat_template(processor)
    assert template is not None and has_generation_markers(template)
    row = next(r for r in _rows(data_dir / "train.jsonl") if r["task"] == task)
    batch = processor.apply_chat_template(
        _with_image(row, data_dir),
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        return_assistant_tokens_mask=True,
    )
    mask = batch["assistant_masks"][0].bool()
    positions = mask.nonzero().flatten().tolist()
    assert positions == list(range(positions[0], positions[-1] + 1)), "mask must be one contiguous span"
    assert positions[-1] == len(mask) - 1
    # The training template deliberately includes the end-of-turn so the model learns to stop.
    masked = processor.tokenizer.decode(batch["input_ids"][0][mask])
    assert masked == _answer(row) + "<|im_end|>\n"


def test_resolve_sources(model_dir: Path, data_dir: Path) -> None:
    assert demo_models.resolve_model_source(demo_models.DEMO_MODEL_ID) == str(model_dir)
    for other in ("Qwen/Qwen2-VL-2B-Instruct", "/models/local", "runs/stage1/checkpoint-10"):
        assert demo_models.resolve_model_source(other) == other
    assert demo_dataset.resolve_data_source("demo:train") == str(data_dir / "train.jsonl")
    assert demo_dataset.resolve_data_source("demo:eval") == str(data_dir / "eval.jsonl")
    for other in ("data/train.jsonl", "HuggingFaceM4/ChartQA", ""):
        assert demo_dataset.resolve_data_source(other) == other
    with pytest.raises(ValueError, match=r"demo:train.*demo:eval"):
        demo_dataset.resolve_data_source("demo:test")


def test_interrupted_build_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VLM_RECIPES_CACHE", str(tmp_path))
    parent = tmp_path / demo_dataset.VERSION
    # A build killed half-way leaves only its temp dir; it must neither count as the dataset nor block.
    dead = parent / ".data-2.tmp-killed"
    dead.mkdir(parents=True)
    (dead / "train.jsonl").write_text('{"id": "train-00000"')
    old = time.time() - 2 * 3600
    os.utime(dead, (old, old))
    live = parent / ".data-2.tmp-live"  # possibly a concurrent builder's: too young to sweep
    live.mkdir()

    with caplog.at_level(logging.INFO, logger="vlm_recipes.files"):
        target = demo_dataset.ensure_demo_dataset()
    assert [r.getMessage() for r in caplog.records] == [f"Building demo dataset in {target}"]
    assert not dead.exists() and live.exists()
    expected = (target / "eval.jsonl").read_bytes()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vlm_recipes.files"):
        assert demo_dataset.ensure_demo_dataset() == target
    assert caplog.records == [], "a complete cache must not be rebuilt"

    (target / "eval.jsonl").unlink()  # cache damaged after the fact
    assert demo_dataset.ensure_demo_dataset() == target
    assert (target / "eval.jsonl").read_bytes() == expected
    assert sorted(p.name for p in parent.iterdir()) == [".data-2.tmp-live", "data-2"]


def test_damaged_model_is_rebuilt(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLM_RECIPES_CACHE", str(tmp_path))
    target = demo_models.ensure_demo_model()
    (target / "model.safetensors").unlink()
    assert demo_models.ensure_demo_model() == target
    assert (target / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_concurrent_builders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLM_RECIPES_CACHE", str(tmp_path))
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: demo_dataset.ensure_demo_dataset(), range(4)))
    assert len(set(results)) == 1
    assert len(_rows(results[0] / "train.jsonl")) == 192
    # Losers discard their temp dirs; only the published dataset remains.
    assert [p.name for p in (tmp_path / demo_dataset.VERSION).iterdir()] == ["data-2"]
