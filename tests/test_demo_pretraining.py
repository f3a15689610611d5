"""The demo models' pretraining (demo/pretraining.yaml): `demo:tiny-*` starts from a model that sees colours,
not from random weights; VLM_RECIPES_DEMO_WEIGHTS picks the random ones; a failed pretraining keeps nothing
that looks finished and says where its log is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlm_recipes.data.rows import load_split
from vlm_recipes.demo import models
from vlm_recipes.demo.data import ensure_demo_dataset
from vlm_recipes.demo.models import WEIGHTS_ENV, ensure_demo_model
from vlm_recipes.errors import UnsupportedModelError
from vlm_recipes.evaluation.evaluate import evaluate_generation
from vlm_recipes.files import read_json


def colour_rows():
    """The demo eval split's colour questions (one shape: "What colour is the shape?")."""
    ds, _ = load_split(str(ensure_demo_dataset() / "eval-images.jsonl"), "eval", None)
    keep = [
        i for i, row in enumerate(ds) if row["messages"][0]["content"][-1]["text"].startswith("What colour")
    ]
    return ds.select(keep)


def colour_exact_match(model_dir) -> float:
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    scores, _ = evaluate_generation(model, processor, colour_rows(), 8, 8, 0.01, desc="colour")
    return scores["all"]["exact_match"]


@pytest.mark.e2e
@pytest.mark.parametrize("model", ["demo:tiny-qwen2-vl", "demo:tiny-qwen3.5"])
def test_the_pretrained_demo_model_sees_colours(model, monkeypatch, private_demo_cache):
    """Pretraining teaches: on the demo eval split's colour questions (10 rows it never saw; chance is 1/6),
    the pretrained model's greedy answers are right where the untrained model's never are. Measured (AMD
    EPYC): Qwen2-VL 10 of 10, Qwen3.5 7 of 10, both 0 before. Qwen3.5 thinks: its template opens `<think>` in
    the generation prompt, so it answers `</think>\n\ngreen`, and its answer is what follows the reasoning
    (scored as the whole text, it was 0 of 10)."""
    untrained = ensure_demo_model(model)  # the suite's default: untrained
    monkeypatch.setenv(WEIGHTS_ENV, "pretrained")
    pretrained = ensure_demo_model(model)
    assert pretrained.name == f"{untrained.name}-pretrained"
    summary = read_json(pretrained / "pretraining.json")
    assert summary["steps"] == 600 and summary["eval"]["task:colour"]["exact_match"] >= 0.5
    assert (pretrained / "pretraining.log").is_file()
    assert colour_exact_match(untrained) == 0.0
    assert colour_exact_match(pretrained) >= 0.5


def test_untrained_weights_are_asked_for_by_name(monkeypatch, private_demo_cache):
    assert ensure_demo_model("demo:tiny-qwen2-vl").name == "tiny-qwen2-vl"  # the suite's setting
    monkeypatch.setenv(WEIGHTS_ENV, "random")
    with pytest.raises(
        UnsupportedModelError, match="VLM_RECIPES_DEMO_WEIGHTS='random': use pretrained or untrained"
    ):
        ensure_demo_model("demo:tiny-qwen2-vl")
    monkeypatch.setenv(WEIGHTS_ENV, "pretrained")  # the benchmark's models are never pretrained
    assert ensure_demo_model("demo:bench-qwen2-vl").name == "bench-qwen2-vl"


def test_a_failed_pretraining_leaves_no_model_and_names_its_log(tmp_path, monkeypatch, private_demo_cache):
    broken = tmp_path / "pretraining.yaml"
    broken.write_text("stages: not a list\n")
    monkeypatch.setattr(models, "PRETRAINING_RECIPE", broken)
    monkeypatch.setenv(WEIGHTS_ENV, "pretrained")
    with pytest.raises(
        RuntimeError, match=r"pretraining demo model tiny-smolvlm failed; its log: .*\.log"
    ) as error:
        ensure_demo_model("demo:tiny-smolvlm")
    log = error.value.args[0].rsplit("its log: ", 1)[1]
    assert "stages" in Path(log).read_text()  # the runner's own message, kept
    assert not (private_demo_cache / "demo-v2" / "tiny-smolvlm-pretrained").exists()
