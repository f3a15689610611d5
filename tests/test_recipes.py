"""Recipe loading: every shipped YAML, reuse (`use`, `extends`), overrides and validation errors."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from conftest import REPO, write_recipe

from vlm_recipes.recipe import load_recipe
from vlm_recipes.recipes.load import available_recipes
from vlm_recipes.recipes.schema import Recipe, Stage
from vlm_recipes.recipes.validate import RecipeError

SEEDS = ["r1-llm-only", "r2-vision-only", "r3-two-stage", "r4-joint"]


@pytest.mark.parametrize(
    "path",
    sorted((REPO / "recipes").glob("*.yaml")),
    ids=lambda p: p.stem,
)
def test_every_shipped_recipe_loads_and_validates(path):
    recipe = load_recipe(str(path))
    assert recipe.stages and recipe.description and recipe.model
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("# Run: python scripts/train_recipe.py --recipe"), (
        "YAML starts with its command"
    )


def test_seed_recipes_match_the_table():
    r1, r2, r3, r4 = (load_recipe(n) for n in SEEDS)
    (s1,) = r1.stages
    assert (s1.quantization.mode, s1.train.vision, s1.train.llm) == ("4bit", "frozen", "lora")
    (s2,) = r2.stages
    assert (s2.quantization.mode, s2.train.vision, s2.train.llm) == ("none", "full", "frozen")
    assert [s.name for s in r3.stages] == [s2.name, s1.name]
    assert r3.stages[0].train == s2.train and r3.stages[1].train == s1.train
    assert r3.stages[1].quantization == s1.quantization
    assert r3.stages[1].init_from == "previous"  # r1 alone starts from base
    assert r3.stages[0].training == s2.training  # r2's recipe-level defaults travel with its stage
    (s4,) = r4.stages
    assert (s4.quantization.mode, s4.train.vision, s4.train.llm) == ("4bit", "lora", "lora")


def test_recipes_are_found_by_name():
    assert set(SEEDS) <= set(available_recipes())


def test_a_recipe_in_the_working_directorys_recipes_folder_is_found_first(tmp_path, monkeypatch):
    """./recipes/ comes before the built-in recipes (the repository's recipes/ in a checkout): a user's own
    recipe is found by name, and one named like a built-in one wins."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    r1 = (REPO / "recipes" / "r1-llm-only.yaml").read_text()
    (tmp_path / "recipes" / "my.yaml").write_text(r1)
    (tmp_path / "recipes" / "r3-two-stage.yaml").write_text(r1)
    found = available_recipes()
    assert found["my"] == tmp_path / "recipes" / "my.yaml"
    assert found["r3-two-stage"] == tmp_path / "recipes" / "r3-two-stage.yaml"
    assert found["r2-vision-only"] == REPO / "recipes" / "r2-vision-only.yaml"
    assert [s.name for s in load_recipe("r3-two-stage").stages] == ["llm-lora"]


def test_overrides_reach_every_stage_or_one_stage():
    recipe = load_recipe(
        "r3-two-stage",
        [
            "training.epochs=3",
            "stages.llm-lora.lora.rank=4",
            "stages.1.training.learning_rate=1e-3",
            "model=Qwen/Qwen2-VL-2B-Instruct",
            "data.train=/data/train.jsonl",
        ],
    )
    assert recipe.model == "Qwen/Qwen2-VL-2B-Instruct"
    assert [s.training.epochs for s in recipe.stages] == [3.0, 3.0]
    assert [s.lora.rank for s in recipe.stages] == [16, 4]
    assert recipe.stages[0].training.learning_rate == pytest.approx(1e-3)  # "1e-3" read as a number
    assert {s.data.train for s in recipe.stages} == {"/data/train.jsonl"}


def test_three_stage_recipe_reusing_stages(tmp_path):
    path = write_recipe(
        tmp_path,
        "projector-vision-llm",
        """
description: projector, then vision, then LoRA on the LLM
model: demo:tiny-qwen2-vl
training: {max_steps: 2}
stages:
  - name: projector
    train: {projector: full}
  - use: r2-vision-only:vision-full
    train: {projector: frozen}
  - use: r1-llm-only:llm-lora
    init_from: previous
""",
    )
    recipe = load_recipe(str(path))
    assert [s.name for s in recipe.stages] == ["projector", "vision-full", "llm-lora"]
    assert recipe.stages[1].train.vision == "full" and recipe.stages[1].train.projector == "frozen"
    assert recipe.stages[1].init_from == "base"  # as r2 wrote it
    assert recipe.stages[2].training.max_steps == 2  # this file's defaults apply to used stages


def test_extends_inherits_and_overrides(tmp_path):
    path = write_recipe(
        tmp_path,
        "r1-rank8",
        """
extends: r1-llm-only
description: r1 with a smaller LoRA
lora: {rank: 8}
""",
    )
    recipe = load_recipe(str(path))
    assert recipe.stages[0].lora.rank == 8
    assert recipe.stages[0].quantization.mode == "4bit"
    assert recipe.description == "r1 with a smaller LoRA"


BAD_RECIPES = [
    (
        "stages:\n  - name: a\n    train: {llm: lora}\n    lora: {rnak: 4}\n",
        "stages[0].lora.rnak: unknown key; did you mean `rank`?",
    ),
    (
        "stages:\n  - name: a\n    train: {llm: lora}\n    training: {epochs: many}\n",
        "stages[0].training.epochs: expected a number",
    ),
    (
        "stages:\n  - name: a\n    train: {llm: lroa}\n",
        "must be one of frozen | lora | full, got 'lroa'; did you mean `lora`?",
    ),
    ("stages: []\n", "needs a non-empty list of stages"),
    ("stages:\n  - name: a\n", "every role is frozen"),
    (
        "stages:\n  - name: a\n    train: {llm: full}\n    quantization: {mode: 4bit}\n",
        "`full` training of a 4bit quantized role is impossible",
    ),
    (
        "stages:\n  - name: a\n    train: {llm: lora}\n    init_from: stage:b\n  - name: b\n    train: {llm: lora}\n",
        "stage `b` comes later",
    ),
    ("stages:\n  - use: r1-llm-only:nope\n", "recipe `r1-llm-only` has no stage `nope`"),
    ("stages:\n  - use: r9-missing\n", "unknown recipe"),
    ("modle: x\nstages:\n  - name: a\n    train: {llm: lora}\n", "modle: unknown key; did you mean `model`?"),
    (
        "stages:\n  - name: a\n    train: {llm: lora}\n    training: {role_learning_rates: {visoin: 1.0e-5}}\n",
        "unknown role; did you mean `vision`?",
    ),
    (
        "stages:\n  - name: a\n    train: {llm: lora}\n  - name: a\n    train: {llm: lora}\n",
        "stage name `a` is used twice",
    ),
    ("stages:\n  - name: a\n    train: {llm: lora\n", "YAML syntax error"),
]


@pytest.mark.parametrize(("text", "message"), BAD_RECIPES, ids=[m[:30] for _, m in BAD_RECIPES])
def test_bad_recipe_is_rejected_with_key_path_and_fix(tmp_path, text, message):
    path = write_recipe(
        tmp_path, "bad", "model: demo:tiny-qwen2-vl\n" + text if "modle" not in text else text
    )
    with pytest.raises(RecipeError) as error:
        load_recipe(str(path))
    assert message in str(error.value)
    assert "bad.yaml" in str(error.value)


def test_every_problem_is_reported_at_once(tmp_path):
    path = write_recipe(
        tmp_path,
        "bad",
        """
model: demo:tiny-qwen2-vl
stages:
  - name: a
    train: {llm: lora}
    lora: {rnak: 4}
    training: {epochs: many, batch: 3}
""",
    )
    with pytest.raises(RecipeError) as error:
        load_recipe(str(path))
    assert len(error.value.problems) == 3


def test_reuse_cycle_is_reported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    write_recipe(
        tmp_path / "recipes",
        "loop-a",
        "model: demo:tiny-qwen2-vl\nextends: loop-b\nstages:\n  - name: a\n    train: {llm: lora}\n",
    )
    write_recipe(
        tmp_path / "recipes",
        "loop-b",
        "model: demo:tiny-qwen2-vl\nextends: loop-a\nstages:\n  - name: b\n    train: {llm: lora}\n",
    )
    with pytest.raises(RecipeError, match="cycle: loop-a → loop-b → loop-a"):
        load_recipe("loop-a")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("stages.llm-lora.lora.rnak=3", "unknown key `rnak`; did you mean `rank`?"),
        ("stages.nope.lora.rank=3", "no stage `nope`"),
        ("trainig.epochs=2", "unknown key `trainig`; did you mean `training`?"),
        ("training.epochs", "an override is key=value"),
        ("training.epochs=lots", "expected a number, got 'lots'"),
        ("stages.llm-lora.lora.dropout=1", "lora.dropout: must be at least 0 and below 1"),
    ],
)
def test_bad_override_is_rejected(override, message):
    with pytest.raises(RecipeError) as error:
        load_recipe("r3-two-stage", [override])
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model=demo:tiny", "unknown demo model `demo:tiny`"),
        ("model=./no-such-model", "`./no-such-model` is not a model directory"),
        ("data.eval=demo:test", "unknown demo data `demo:test`: use demo:train or demo:eval"),
    ],
)
def test_missing_model_or_demo_source_is_caught_before_loading(override, message):
    with pytest.raises(RecipeError) as error:
        load_recipe("r1-llm-only", [override])
    assert message in str(error.value)


def numeric_fields(cls, prefix=""):
    """(key path, field) of every number in the schema, nested sections included."""
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            yield from numeric_fields(hint, f"{prefix}{f.name}.")
        elif {int, float} & {hint, *typing.get_args(hint)}:  # int, float | None, dict[str, float]
            yield f"{prefix}{f.name}", f


def test_every_numeric_key_declares_its_range_and_its_default_is_in_it():
    fields = list(numeric_fields(Stage)) + list(numeric_fields(Recipe))
    assert {"training.epochs", "lora.rank", "training.seed", "evaluation.max_new_tokens"} <= {
        k for k, _ in fields
    }
    for key, f in fields:
        bounds = f.metadata.get("range")
        assert bounds is not None, f"{key}: a number without a range in schema.py"
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, int | float):
            assert bounds.problem(default) is None, f"{key}: default {default} is outside [{bounds}]"


def test_schema_listing_shows_the_ranges(capsys):
    from vlm_recipes.cli.train import main

    assert main(["--schema"]) == 0
    out = capsys.readouterr().out
    assert "epochs: 1.0  # passes over the training data [above 0]" in out
    assert (
        "max_steps: -1  # stop after this many optimizer steps; -1: run all epochs [-1 or at least 1]" in out
    )
    # a list of settings (GRPO's rewards) shows its default as YAML would and each entry's keys
    assert "rewards:  # the rewards, summed with their weights; default [{'name': 'exact_match'" in out
    assert "RewardSettings(" not in out
    for key in ("name: 'exact_match'", "weight: 1.0", "pattern: None", "target_length: None"):
        assert f"\n        {key}  # " in out
    # a value that is one source or a list of entries (a mixture) lists an entry's keys under it
    train = out[out.index("\n    train: 'demo:train'") :]
    assert train.splitlines()[2].startswith("        path: ''  # the source")
    assert "\n        weight: None  # its share" in train and "\n        samples: None  # exactly" in train
    # each method's own section, from its module, under the stage's keys
    for section in ("dpo", "kto", "grpo", "rloo", "distill"):
        assert f"\n  {section}:  # " in out and f"read when method is {section}\n" in out
    assert "\n    teacher: ''  # the teacher: `stage:<name>`" in out


def test_a_recipe_with_a_utf8_bom_loads(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbfmodel: demo:tiny-qwen2-vl\nstages:\n  - name: a\n    train: {llm: lora}\n")
    assert load_recipe(str(path)).stages[0].name == "a"
