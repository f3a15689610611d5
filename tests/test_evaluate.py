"""Task metrics against hand-computed cases."""

from __future__ import annotations

import pytest

from vlm_recipes.evaluation.generation import prompts_from_rows
from vlm_recipes.scoring import (
    exact_match,
    final_answer,
    json_field_counts,
    parse_json_object,
    precision_recall_f1,
    score_predictions,
    values_match,
)

REF = {"calories": 250, "fat_g": 12, "sodium_mg": 480}


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        ("red", "red", 1.0),
        (" Red. ", "red", 1.0),
        ("dark red", "red", 0.0),
        ("3", "3", 1.0),
        ("", "red", 0.0),
    ],
)
def test_exact_match(prediction, reference, expected):
    assert exact_match(prediction, reference) == expected


@pytest.mark.parametrize(
    ("generated", "answer"),
    [
        ("\n</think>\n\ngreen", "green"),  # Qwen3.5: the generation prompt opened <think>
        ("<think>it is round</think> circle", "circle"),
        ("a </think> b </think> c", "c"),
        ("red", "red"),
    ],
)
def test_a_thinking_models_answer_is_what_follows_its_reasoning(generated, answer):
    assert final_answer(generated) == answer


def test_json_fields_all_right():
    counts = json_field_counts('{"calories": 250, "fat_g": 12, "sodium_mg": 480}', REF, 0.01)
    assert (counts.true_positive, counts.false_positive, counts.false_negative) == (3, 0, 0)


def test_json_fields_missing_extra_and_wrong():
    # calories right; fat_g wrong (FP + FN); sodium_mg missing (FN); sugar_g extra (FP)
    counts = json_field_counts('{"calories": 250, "fat_g": 20, "sugar_g": 3}', REF, 0.01)
    assert (counts.true_positive, counts.false_positive, counts.false_negative) == (1, 2, 2)
    scores = precision_recall_f1(1, 2, 2)
    assert scores["precision"] == pytest.approx(1 / 3)
    assert scores["recall"] == pytest.approx(1 / 3)
    assert scores["f1"] == pytest.approx(1 / 3)


def test_json_numeric_tolerance():
    assert values_match(251, 250, 0.01)  # within 1 %
    assert not values_match(260, 250, 0.01)
    assert values_match("250", 250, 0.01)  # numbers written as text
    assert values_match("1,200", 1200, 0.01)
    assert not values_match(True, 1, 0.01)  # a boolean is not the number 1
    counts = json_field_counts('{"calories": 252.4, "fat_g": 12, "sodium_mg": 470}', REF, 0.01)
    assert (counts.true_positive, counts.false_positive, counts.false_negative) == (2, 1, 1)


def test_unparseable_output_misses_every_field():
    counts = json_field_counts("calories 250, fat 12", REF, 0.01)
    assert not counts.parsed
    assert (counts.true_positive, counts.false_positive, counts.false_negative) == (0, 0, 3)


def test_json_is_found_inside_prose_and_code_fences():
    assert parse_json_object('Here it is:\n```json\n{"a": {"b": 1}}\n```') == {"a": {"b": 1}}
    assert parse_json_object('{broken} then {"a": 2}') == {"a": 2}
    assert parse_json_object("no json") is None
    counts = json_field_counts(
        '{"a": {"b": 1, "c": 2}}', {"a": {"b": 1, "c": 3}}, 0.01
    )  # nested: dotted keys
    assert (counts.true_positive, counts.false_negative) == (1, 1)


def test_scores_aggregate_per_task():
    records = [
        {"task": "shapes", "reference": "red", "output": "red"},
        {"task": "shapes", "reference": "2", "output": "3"},
        {"task": "nutrition", "reference": '{"calories": 250, "fat_g": 12}', "output": '{"calories": 250}'},
        {"task": "nutrition", "reference": '{"calories": 100, "fat_g": 1}', "output": "garbage"},
    ]
    scores = score_predictions(records)
    assert scores["all"]["exact_match"] == pytest.approx(0.25)
    assert scores["task:shapes"]["exact_match"] == pytest.approx(0.5)
    assert "json_fields" not in scores["task:shapes"]
    fields = scores["task:nutrition"]["json_fields"]
    # TP 1, FP 0, FN 1 + 2 → precision 1, recall 0.25
    assert fields["precision"] == pytest.approx(1.0)
    assert fields["recall"] == pytest.approx(0.25)
    assert fields["f1"] == pytest.approx(0.4)
    assert fields["parse_rate"] == pytest.approx(0.5)


def test_prompts_stop_before_the_last_answer_and_carry_images():
    row = {
        "id": "x",
        "task": "shapes",
        "images": ["IMG"],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "text": None}, {"type": "text", "text": "colour?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        ],
    }
    (prompt,) = prompts_from_rows([row])
    assert prompt.reference == "red" and prompt.text == "colour?" and prompt.task == "shapes"
    assert prompt.messages == [
        {"role": "user", "content": [{"type": "image", "image": "IMG"}, {"type": "text", "text": "colour?"}]}
    ]
