"""GRPO rewards (methods/rewards.py) against hand-computed cases, called as TRL's GRPOTrainer calls them, and
every way a reward can be wrong as a RewardError (exit 2) naming it. Pure Python: no model."""

from __future__ import annotations

import pytest
from transformers import TrainerState
from trl.trainer.utils import is_async_callable

from vlm_recipes.errors import BadInput
from vlm_recipes.methods.rewards import (
    RewardError,
    build_rewards,
    check_rewards,
    completion_text,
    guarded,
)
from vlm_recipes.methods.sampling_settings import RewardSettings

WHERE = "recipe.yaml: stages[2].grpo.rewards"
THINK = r"<think>.*?</think>\s*<answer>.*?</answer>"


def built(**settings):
    """The one reward `settings` describe, built as the stage builds it."""
    functions, _ = build_rewards([RewardSettings(**settings)], None, WHERE)
    return functions[0]


def trl_call(function, completions, completion_ids=None, **columns):
    """Call `function` as GRPOTrainer._calculate_rewards does: keywords only, columns one value per completion."""
    n = len(completions)
    return function(
        prompts=[[{"role": "user", "content": "What colour?"}]] * n,
        completions=completions,
        completion_ids=completion_ids or [[1, 2, 3]] * n,
        **{key: value if isinstance(value, list) else [value] * n for key, value in columns.items()},
        trainer_state=TrainerState(),
        log_extra=lambda column, values: None,
        log_metric=lambda name, value: None,
    )


def as_messages(text: str) -> list[dict]:
    """A completion of a conversational prompt, as TRL builds it."""
    return [{"role": "assistant", "content": text}]


# ---------------------------------------------------------------------------------------------
# Built-ins


def test_completion_text_reads_strings_messages_and_parts():
    assert completion_text(" red \n") == "red"
    assert completion_text(as_messages("red")) == "red"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "red"}]}]) == "red"
    assert completion_text([{"role": "assistant", "content": None}]) == ""
    # after a tool call, the last assistant turn is the answer
    tool_loop = [*as_messages("calling"), {"role": "tool", "content": "42"}, *as_messages("blue")]
    assert completion_text(tool_loop) == "blue"


@pytest.mark.parametrize("form", [str, as_messages], ids=["string", "messages"])
def test_exact_match_normalizes_as_the_eval(form):
    reward = built(name="exact_match")
    assert reward.__name__ == "exact_match"
    completions = [form("Red."), form(" red"), form("dark red"), form(""), form("\n</think>\n\nred")]
    assert trl_call(reward, completions, solution="red") == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_exact_match_takes_the_best_over_a_rows_few_accepted_answers_as_the_eval_does():
    """A DocVQA-shaped prompt row: its solution and a few accepted `answers`. Before, the reward read only the
    solution and gave the eval's perfect answer "1 May 2012" 0.0. Ten annotators' answers (VQAv2) are not
    each accepted: there the solution alone counts, as in the eval's exact match."""
    reward = built(name="exact_match")
    completions = ["1 May 2012", "May 1, 2012", "May 2012"]
    accepted = [["May 1, 2012", "1 May 2012"]] * 3
    assert trl_call(reward, completions, solution="May 1, 2012", answers=accepted) == [1.0, 1.0, 0.0]
    ten = [["1 May 2012"] * 10] * 3
    assert trl_call(reward, completions, solution="May 1, 2012", answers=ten) == [0.0, 1.0, 0.0]


def test_exact_match_does_not_apply_without_a_solution_value():
    assert trl_call(built(name="exact_match"), ["red", "red"], solution=["red", None]) == [1.0, None]


@pytest.mark.parametrize("form", [str, as_messages], ids=["string", "messages"])
def test_json_f1_by_hand(form):
    solution = '{"calories": 250, "fat_g": 12, "sodium_mg": 480}'
    completions = [
        form(solution),
        # fat_g wrong: TP 2, FP 1, FN 1 → P = R = 2/3, F1 = 2/3
        form('{"calories": 250, "fat_g": 10, "sodium_mg": 480}'),
        # in prose, sodium missing: TP 2, FP 0, FN 1 → P = 1, R = 2/3, F1 = 2·(2/3)/(5/3) = 0.8
        form('Sure: {"calories": "250", "fat_g": 12} done'),
        # numbers within the eval's 1% tolerance
        form('{"calories": 251, "fat_g": 12, "sodium_mg": 480}'),
        form("no JSON here"),
    ]
    scores = trl_call(built(name="json_f1"), completions, solution=solution)
    assert scores == pytest.approx([1.0, 2 / 3, 0.8, 1.0, 0.0])


def test_json_f1_does_not_apply_to_a_solution_that_is_no_json_object():
    scores = trl_call(built(name="json_f1"), ['{"a": 1}'] * 3, solution=["red", "[1, 2]", '{"a": 1}'])
    assert scores == [None, None, 1.0]


def test_format_matches_the_whole_completion():
    reward = built(name="format", pattern=THINK)
    completions = [
        "<think>two\nlines</think>\n<answer>red</answer>\n",  # DOTALL; the trailing newline is stripped
        as_messages("<think>x</think><answer>red</answer>"),
        "<answer>red</answer>",
        "<think>x</think><answer>red</answer> and more",
    ]
    assert trl_call(reward, completions) == [1.0, 1.0, 0.0, 0.0]


def test_length_falls_linearly_from_target_to_twice_it():
    reward = built(name="length", target_length=10)
    lengths = [5, 10, 15, 20, 30]
    ids = [[0] * n for n in lengths]
    assert trl_call(reward, ["x"] * len(lengths), completion_ids=ids) == [1.0, 1.0, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("form", [str, as_messages], ids=["string", "messages"])
def test_iou_by_hand(form):
    """Reference [0, 0, 10, 10] (area 100). The boxes below are written every way models write them."""
    completions = [
        form("[0, 0, 10, 10]"),  # the same box: 1
        form('{"bbox_2d": [5, 0, 15, 10], "label": "cat"}'),  # overlap 5x10 = 50, union 150: 1/3
        form("<|box_start|>(0,0),(5,5)<|box_end|>"),  # inside: 25 / 100
        form("[10, 10, 0, 0]"),  # corners swapped: the same box
        form("The box is [20, 20, 30, 30]."),  # apart: 0
        form("[2.5, 2.5, 7.5, 7.5] then [0, 0, 10, 10]"),  # the first box counts: 25 / 100
        form("\n</think>\n\n[0,0,10,10]"),  # after the thinking, as the eval reads it
        form("no box"),
    ]
    scores = trl_call(built(name="iou", box_format="pixels"), completions, solution="[0, 0, 10, 10]")
    assert scores == pytest.approx([1.0, 1 / 3, 0.25, 1.0, 0.0, 0.25, 1.0, 0.0])


def test_iou_does_not_apply_to_a_solution_without_a_box():
    reward = built(name="iou", box_format="same")
    scores = trl_call(reward, ["[0, 0, 1, 1]"] * 3, solution=["red", None, "(0,0),(1,1)"])
    assert scores == [None, None, 1.0]


def test_iou_reads_a_relative_1000_answer_in_the_images_pixels():
    """A 200x100 image, the solution [20, 10, 60, 50] in its pixels. Qwen2-VL's family answers in 0-1000
    across the image: (100,100),(300,500) is that box. Read as pixels, or with x and y scaled the wrong way
    round, it is another box."""
    from PIL import Image

    image = [Image.new("RGB", (200, 100))]
    answer = ["<|box_start|>(100,100),(300,500)<|box_end|>"]
    functions, _ = build_rewards([RewardSettings(name="iou")], None, WHERE, family_box_format="relative_1000")
    assert trl_call(functions[0], answer, solution="[20, 10, 60, 50]", images=[image]) == [pytest.approx(1.0)]
    as_pixels = trl_call(built(name="iou", box_format="pixels"), answer, solution="[20, 10, 60, 50]")
    assert as_pixels[0] < 0.1
    swapped = [Image.new("RGB", (100, 200))]  # the same numbers scaled as if width and height were swapped
    assert trl_call(functions[0], answer, solution="[20, 10, 60, 50]", images=[swapped])[0] < 0.5
    # without the image a relative box has no pixels: the reward does not apply to that row
    assert trl_call(functions[0], answer, solution="[20, 10, 60, 50]", images=[[]]) == [None]


def test_iou_reads_a_resized_pixels_answer_through_the_processors_own_resize(private_demo_cache):
    """Qwen2.5-VL answers in pixels of the image its processor resized. The resized size is the one the
    processor's patch grid covers (image_grid_thw x patch size), and the answer's box, scaled back, is the
    solution's."""
    from PIL import Image
    from transformers import AutoProcessor

    from vlm_recipes.demo.models import ensure_demo_model
    from vlm_recipes.methods.grounding import resized_size

    processor = AutoProcessor.from_pretrained(ensure_demo_model("demo:tiny-qwen2-vl"))
    image = Image.new("RGB", (200, 100))
    grid = processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    patch = processor.image_processor.patch_size
    width, height = resized_size(processor, 200, 100)
    assert (width, height) == (grid[2] * patch, grid[1] * patch) != (200, 100)
    x, y = width / 200, height / 100
    answer = [f'{{"bbox_2d": [{20 * x}, {10 * y}, {60 * x}, {50 * y}]}}']
    reward = build_rewards([RewardSettings(name="iou", box_format="resized_pixels")], processor, WHERE)[0][0]
    assert trl_call(reward, answer, solution="[20, 10, 60, 50]", images=[[image]]) == [pytest.approx(1.0)]


def test_iou_on_a_family_without_a_known_box_convention_asks_for_box_format():
    with pytest.raises(
        RewardError, match=r"stages\[2\]\.grpo\.rewards\[0\]\.box_format: this model's family"
    ):
        built(name="iou")
    with pytest.raises(RewardError, match="`box_format` belongs to the iou reward"):
        built(name="exact_match", box_format="pixels")


def test_build_rewards_names_and_weights_in_order():
    settings = [
        RewardSettings(),
        RewardSettings(name="format", weight=0.5, pattern=THINK),
        RewardSettings(name="length", weight=-1, target_length=64),
        RewardSettings(name="json_f1", weight=2.0),
    ]
    functions, weights = build_rewards(settings, None, WHERE)
    assert [f.__name__ for f in functions] == ["exact_match", "format", "length", "json_f1"]
    assert weights == [1.0, 0.5, -1.0, 2.0] and all(type(w) is float for w in weights)


# ---------------------------------------------------------------------------------------------
# A user's module:function


def test_user_function_is_imported_from_the_working_directory(user_module):
    user_module(
        "my_rewards",
        """
        def colour(completions, solution, trainer_state, log_metric, **kwargs):
            log_metric("colour_seen", 1.0)
            return [float(s in str(c)) + trainer_state.global_step for c, s in zip(completions, solution)]
        """,
    )
    functions, weights = build_rewards([RewardSettings(name="my_rewards:colour", weight=0.3)], None, WHERE)
    assert functions[0].__name__ == "my_rewards:colour" and weights == [0.3]
    assert trl_call(functions[0], ["red", "blue"], solution="red") == [1.0, 0.0]


def test_async_user_function_stays_async_and_is_checked(user_module):
    user_module(
        "async_rewards",
        """
        async def colour(completions, **kwargs):
            return [1.0 for _ in completions]
        """,
    )
    function = built(name="async_rewards:colour")
    assert is_async_callable(function)  # TRL gathers it with the other async rewards
    check_rewards([function], {"prompt": [{"role": "user", "content": "q"}], "solution": "red"}, WHERE)


def test_check_rewards_calls_each_reward_as_trl_will(user_module):
    user_module(
        "row_rewards",
        """
        def everything(prompts, completions, completion_ids, solution, task, images, **kwargs):
            assert len(prompts) == len(completions) == len(completion_ids) == len(task) == len(images) == 2
            assert completions[0] == [{"role": "assistant", "content": solution[0]}]
            assert completion_ids == [[ord(c) for c in solution[0]], []]
            kwargs["log_extra"]("task", task)
            return [None, 0.5]
        """,
    )

    class CharTokenizer:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    class Processor:  # a processor holds the tokenizer
        tokenizer = CharTokenizer()

    settings = [
        RewardSettings(name="row_rewards:everything"),
        RewardSettings(),
        RewardSettings(name="length", target_length=2),
    ]
    functions, _ = build_rewards(settings, Processor(), WHERE)
    row = {
        "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
        "solution": "red",
        "task": "colours",
        "images": ["a.png"],
    }
    check_rewards(functions, row, WHERE)


# ---------------------------------------------------------------------------------------------
# Errors: each a RewardError (exit 2) that says where and how to fix it


def test_reward_error_is_bad_input():
    assert issubclass(RewardError, BadInput) and issubclass(RewardError, ValueError)
    assert RewardError.exit_code == 2


def test_unknown_name_lists_the_built_ins_with_a_suggestion():
    with pytest.raises(
        RewardError, match=r"rewards\[0\]\.name: unknown reward 'exact_mach'.*; did you mean `exact_match`\?$"
    ) as e:
        built(name="exact_mach")
    assert "json_f1" in str(e.value) and "module:function" in str(e.value)


def test_missing_module(user_module):
    with pytest.raises(RewardError, match=r"no module 'nowhere_rewards'.*working directory.*installed"):
        built(name="nowhere_rewards:colour")


def test_module_importing_a_missing_dependency(user_module):
    user_module("needs_more", "import not_installed_anywhere\n")
    with pytest.raises(RewardError, match=r"importing 'needs_more' failed.*not_installed_anywhere"):
        built(name="needs_more:colour")


def test_missing_function(user_module):
    user_module("few_rewards", "def colour(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    with pytest.raises(RewardError, match=r"'few_rewards'.*has no 'color'.*did you mean `colour`"):
        built(name="few_rewards:color")


def test_not_callable(user_module):
    user_module("constant_rewards", "colour = 3\n")
    with pytest.raises(RewardError, match=r"'constant_rewards:colour' is a int, not a function"):
        built(name="constant_rewards:colour")


@pytest.mark.parametrize(
    ("module", "signature"),
    [
        ("no_kwargs", "completions"),
        ("positional_only", "completions, /, **kwargs"),
    ],
)
def test_signature_that_cannot_take_trl_arguments(user_module, module, signature):
    user_module(module, f"def colour({signature}):\n    return []\n")
    with pytest.raises(
        RewardError, match=r"cannot take TRL's keyword arguments.*def colour\(completions, \*\*kwargs\)"
    ):
        built(name=f"{module}:colour")


def test_a_reward_may_name_only_what_it_reads(user_module):
    """TRL passes everything by keyword: a reward reading only `completion_ids` (the rest in **kwargs) is fine."""
    user_module(
        "short_rewards", "def short(completion_ids, **kwargs):\n    return [1.0] * len(completion_ids)\n"
    )
    (function,), _ = build_rewards([RewardSettings(name="short_rewards:short")], None, "r.yaml")
    assert function(prompts=["p"], completions=["a"], completion_ids=[[1, 2]], solution=["a"]) == [1.0]


def test_guarded_names_the_reward_and_the_exception(user_module):
    user_module(
        "raising_rewards",
        """
        def colour(completions, **kwargs):
            raise KeyError("no colour in this answer")
        """,
    )
    reward = built(name="raising_rewards:colour")
    with pytest.raises(
        RewardError,
        match=r"reward raising_rewards:colour raised KeyError.*no colour in this answer.*raising_rewards\.py:3",
    ):
        trl_call(reward, ["red"])


def test_guarded_wrong_count_and_non_list():
    def two(completions, **kwargs):
        return [1.0, 1.0]

    with pytest.raises(RewardError, match=r"reward two returned 2 rewards for 3 completions"):
        trl_call(guarded(two), ["a", "b", "c"])

    def generator(completions, **kwargs):
        return (1.0 for _ in completions)

    with pytest.raises(RewardError, match=r"reward mine returned a generator, not a list"):
        trl_call(guarded(generator, "mine"), ["a"])


def test_check_rewards_refuses_a_non_number():
    def words(completions, **kwargs):
        return ["high" for _ in completions]

    row = {"prompt": [{"role": "user", "content": "q"}], "solution": "red"}
    with pytest.raises(
        RewardError, match=r"rewards\[1\]: checked on one training row, reward words returned 'high'"
    ):
        check_rewards([guarded(lambda completions, **kwargs: [1.0, None]), words], row, WHERE)


def test_check_rewards_names_an_unguarded_function_that_raises():
    def broken(completions, **kwargs):
        return 1 / 0

    row = {"prompt": [{"role": "user", "content": "q"}], "solution": "red"}
    with pytest.raises(RewardError, match=r"rewards\[0\]: .*reward broken raised ZeroDivisionError"):
        check_rewards([broken], row, WHERE)


def test_exact_match_needs_a_solution_column():
    with pytest.raises(RewardError, match=r"reward exact_match needs a `solution` column.*\['task'\]"):
        trl_call(built(name="exact_match"), ["red"], task="colours")
    row = {"prompt": [{"role": "user", "content": "q"}], "task": "colours"}
    with pytest.raises(RewardError, match=r"rewards\[0\]: checked on one training row.*`solution` column"):
        check_rewards([built(name="json_f1")], row, WHERE)


def test_format_needs_a_valid_pattern():
    with pytest.raises(RewardError, match=r"rewards\[0\]\.pattern: the format reward needs a `pattern`"):
        built(name="format")
    with pytest.raises(
        RewardError, match=r"rewards\[0\]\.pattern: '<answer>\(' is not a valid regular expression"
    ):
        built(name="format", pattern="<answer>(")


def test_length_needs_a_target_length():
    with pytest.raises(
        RewardError, match=r"rewards\[0\]\.target_length: the length reward needs a `target_length`"
    ):
        built(name="length")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"name": "exact_match", "pattern": THINK},
            r"`pattern` belongs to the format reward, not to exact_match",
        ),
        (
            {"name": "format", "pattern": THINK, "target_length": 8},
            r"`target_length` belongs to the length reward",
        ),
        ({"name": "my_rewards:colour", "target_length": 8}, r"`target_length` belongs to the length reward"),
    ],
)
def test_keys_of_another_reward(settings, message):
    with pytest.raises(RewardError, match=message):
        built(**settings)


def test_index_of_the_failing_reward_is_named():
    settings = [RewardSettings(), RewardSettings(name="length")]
    with pytest.raises(RewardError, match=r"^recipe\.yaml: stages\[2\]\.grpo\.rewards\[1\]\.target_length"):
        build_rewards(settings, None, WHERE)
    with pytest.raises(RewardError, match=r"at least one reward"):
        build_rewards([], None, WHERE)
