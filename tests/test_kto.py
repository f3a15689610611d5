"""KTO stages (method: kto): TRL's KTOTrainer on answers marked good or bad. Preference pairs unpair into one
good and one bad row with the pair's images; a stage trains from the demo's pairs and moves its weights, its
reference is the adapter switched off, its eval is measured at start and end, its settings reach TRL's
KTOConfig; bad rows are clear errors with exit 2."""

from __future__ import annotations

import json

import datasets
import pytest
from test_grpo import assert_moved, base_weights, final_weights

from vlm_recipes.cli.train import main
from vlm_recipes.data.preference import UNPAIRED, unpaired
from vlm_recipes.data.rows import load_split
from vlm_recipes.decisions import Environment
from vlm_recipes.files import read_json
from vlm_recipes.methods.kto import KTO
from vlm_recipes.methods.trainer import ConfigInputs
from vlm_recipes.recipe import load_recipe

PROMPT = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}
]


def answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def kto_recipe(directory, data: str, settings: str = "{beta: 0.1}"):
    """A one-stage KTO recipe (LoRA on the language model, 2 steps of 4 rows), its sections as YAML flow
    mappings. KTO estimates its KL term from the batch's other rows: a batch holds more than one."""
    path = directory / "kto.yaml"
    path.write_text(
        "model: demo:tiny-qwen2-vl\nstages:\n  - name: kto\n    method: kto\n    train: {llm: lora}\n"
        f"    precision: fp32\n    evaluation: {{generate: false}}\n    data: {data}\n    kto: {settings}\n"
        "    training: {max_steps: 2, per_device_batch_size: 4, learning_rate: 1.0e-3, logging_steps: 1}\n"
    )
    return path


def test_a_preference_pair_unpairs_into_a_good_and_a_bad_row_with_its_images():
    pairs = datasets.Dataset.from_list(
        [
            {
                "id": "a",
                "prompt": PROMPT,
                "chosen": answer("red"),
                "rejected": answer("blue"),
                "images": ["0.png"],
            },
            {
                "id": "b",
                "prompt": PROMPT,
                "chosen": answer("green"),
                "rejected": answer("red"),
                "images": ["1.png"],
            },
        ]
    )
    rows = unpaired(pairs).to_list()
    assert [(r["id"], r["completion"][0]["content"][0]["text"], r["label"]) for r in rows] == [
        ("a", "red", True),
        ("a", "blue", False),
        ("b", "green", True),
        ("b", "red", False),
    ]
    assert [r["images"] for r in rows] == [["0.png"], ["0.png"], ["1.png"], ["1.png"]]
    assert all(r["prompt"] == pairs[0]["prompt"] for r in rows)
    single = datasets.Dataset.from_list([{"prompt": PROMPT, "completion": answer("red"), "label": True}])
    assert unpaired(single) is single  # rows already unpaired pass through


@pytest.mark.parametrize("precision", ["bf16", "fp32"])  # set explicitly: CPUs with and without native bf16
def test_a_kto_stage_trains_from_preference_pairs_and_scores_its_start_and_end(
    tmp_path, private_demo_cache, precision
):
    recipe = kto_recipe(
        tmp_path, "{train: demo:preference-train, eval: demo:preference-eval, max_eval_samples: 8}"
    )
    run = [
        "--recipe",
        str(recipe),
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "t",
        f"precision={precision}",
    ]
    assert main(run) == 0
    stage = tmp_path / "kto" / "t" / "stage-1-kto"
    assert_moved(final_weights(stage), base_weights())
    metrics, report = read_json(stage / "metrics.json"), read_json(stage / "report.json")
    assert metrics["steps"] == 2 and len(metrics["loss_curve"]) == 2
    start = metrics["eval_at_start"]
    # The reference is the stage's start: every reward is 0 there; the policy's own margin is not.
    assert start["eval_reward_margin"] == 0.0 and start["eval_logp_margin"] is not None
    assert metrics["eval_logp_margin"] != start["eval_logp_margin"]
    decisions = {d["guard"]: d["choice"] for d in report["decisions"]}
    assert decisions["precision"] == precision
    assert decisions["kto-reference"] == "the model with its LoRA adapter switched off"


def test_kto_settings_reach_trls_ktoconfig(tmp_path):
    settings = "{beta: 0.2, loss_type: apo_zero_unpaired, desirable_weight: 1.5, undesirable_weight: 0.5}"
    stage = load_recipe(str(kto_recipe(tmp_path, "{train: demo:preference-train}", settings))).stages[0]
    config = KTO().build_config(
        ConfigInputs(stage, tmp_path / "out", "fp32", Environment("cpu", 0, False), has_eval=False)
    )
    assert type(config).__name__ == "KTOConfig"
    assert (config.beta, config.loss_type) == (0.2, "apo_zero_unpaired")
    assert (config.desirable_weight, config.undesirable_weight, config.max_length) == (1.5, 0.5, None)


def test_unpaired_rows_load_and_a_bad_label_is_a_clear_error(tmp_path, capsys, private_demo_cache):
    (tmp_path / "images").mkdir()
    from PIL import Image

    Image.new("RGB", (56, 56), (255, 0, 0)).save(tmp_path / "images" / "0.png")
    good = {"prompt": PROMPT, "completion": answer("red"), "label": True, "images": ["images/0.png"]}
    rows = [good, {**good, "completion": answer("blue"), "label": False}]
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds, _ = load_split(str(data), "train", None, row_format=UNPAIRED)
    assert ds["label"] == [True, False] and "chosen" not in ds.column_names

    data.write_text(
        "".join(json.dumps(r) + "\n" for r in [{**good, "label": "yes"}, {**good, "label": "no"}])
    )
    code = main(["--recipe", str(kto_recipe(tmp_path, f"{{train: {data}}}")), "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "kto.jsonl:line 1" in err and "`label` must be true (a good answer) or false" in err


def test_unpairing_pairs_on_a_full_disk_names_the_cache_with_exit_4(
    tmp_path, monkeypatch, private_demo_cache
):
    """The unpairing map writes datasets' cache file beside the rows' table: a full disk there is the data
    cache's DiskFull (exit 4, the folder and VLM_RECIPES_CACHE named), as in every other read of the rows.
    Before: datasets' OSError, a traceback. The full disk is datasets' writer raising what a full disk gave it
    (tests/test_data_disk_full.py fills a real tmpfs for the same writer)."""
    from test_data_disk_full import fill_at_datasets_map
    from transformers import AutoProcessor

    from vlm_recipes.data import arrow_rows
    from vlm_recipes.data.preference import check_unpaired_lengths
    from vlm_recipes.demo.models import resolve_model_source
    from vlm_recipes.errors import DiskFull
    from vlm_recipes.families import family_for_model_type

    monkeypatch.setenv("VLM_RECIPES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(arrow_rows, "_directory", None)
    (tmp_path / "images").mkdir()
    from PIL import Image

    Image.new("RGB", (56, 56), (255, 0, 0)).save(tmp_path / "images" / "0.png")
    pair = {"prompt": PROMPT, "chosen": answer("red"), "rejected": answer("blue"), "images": ["images/0.png"]}
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({**pair, "id": str(i)}) + "\n" for i in range(4)))
    pairs, _ = load_split(str(data), "train", None, row_format=UNPAIRED)
    processor = AutoProcessor.from_pretrained(resolve_model_source("demo:tiny-qwen2-vl"))
    fill_at_datasets_map("raised", tmp_path / "cache" / "rows", data, monkeypatch)
    with pytest.raises(DiskFull) as raised:
        check_unpaired_lengths(pairs, processor, family_for_model_type("qwen2_vl"), 1024, str(data))
    assert raised.value.exit_code == 4
    assert "writing a dataset's cache files failed" in str(raised.value) and "VLM_RECIPES_CACHE" in str(
        raised.value
    )
