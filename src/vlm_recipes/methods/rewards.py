"""The rewards of a GRPO stage (method: grpo), as TRL's GRPOTrainer calls them.

The built-ins score a sampled completion exactly as the eval scores a generated answer (scoring.py's
normalization, JSON parsing and field counts): exact_match, json_f1, format (a regular expression),
length (completion tokens) and iou (a box against the reference box). A recipe's `module:function` is the
user's own, imported from the working directory. Every reward is called once on a real row before training (check_rewards) and guarded during
it, so a broken reward stops the stage with a RewardError naming it (exit 2), not a traceback inside TRL.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import numbers
import os
import re
import sys
import traceback
from collections.abc import Callable

from transformers import TrainerState
from trl.trainer.utils import get_callable_name, is_async_callable

from vlm_recipes.benchmark_metrics.metric import Targets, references_of
from vlm_recipes.benchmark_metrics.vqa_accuracy import exact_match_score
from vlm_recipes.errors import BadInput
from vlm_recipes.methods.grounding import BOX_FORMATS, iou_reward
from vlm_recipes.methods.sampling_settings import RewardSettings
from vlm_recipes.recipes.schema import EvaluationSettings
from vlm_recipes.recipes.validate import did_you_mean, key_path
from vlm_recipes.scoring import (
    final_answer,
    json_field_counts,
    parse_json_object,
    precision_recall_f1,
    text_of,
)

BUILT_INS = ("exact_match", "json_f1", "format", "length", "iou")
# What TRL passes besides the dataset's columns (and `environments` when the stage has some).
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
TOLERANCE = EvaluationSettings().numeric_tolerance  # the eval's default for numbers in JSON answers
# reward keys that belong to one built-in
ONLY_FOR = {"pattern": "format", "target_length": "length", "box_format": "iou"}


class RewardError(BadInput, ValueError):
    """A reward that cannot be built or failed on a completion; the message names it and the fix."""


# ---------------------------------------------------------------------------------------------
# Built-ins (pure functions with TRL's reward signature)


def completion_text(completion) -> str:
    """The completion's answer: TRL passes a string for a plain-text prompt and, for a conversational one, a
    list of messages whose last assistant turn holds it (content a string or text parts). Stripped, as the
    eval strips generated answers."""
    if isinstance(completion, str):
        return completion.strip()
    answers = [m for m in completion if m.get("role") == "assistant"] or list(completion)
    return text_of(answers[-1].get("content") or "").strip() if answers else ""


def json_reference(solution: str | None) -> dict | None:
    """The solution's JSON object, read as the eval reads a reference; None where it is not one."""
    if not isinstance(solution, str) or not solution.strip().startswith("{"):
        return None
    return parse_json_object(solution)


def _solutions(kwargs: dict, name: str) -> list:
    if "solution" not in kwargs:
        columns = sorted(set(kwargs) - set(TRL_ARGUMENTS) - {"environments"})
        raise RewardError(
            f"reward {name} needs a `solution` column: the rows have {columns or 'none besides prompt'}; "
            "give every prompt row its expected answer as `solution`"
        )
    return kwargs["solution"]


def exact_match_reward(completions: list, **kwargs) -> list[float | None]:
    """1.0 when the completion's answer (after any `</think>`, as the eval reads it) equals the row's solution
    after the eval's normalization (`Red.` = `red`), or one of a few accepted `answers` where the row has
    them (DocVQA's), as the eval's exact match takes the best over them."""
    solutions = _solutions(kwargs, "exact_match")
    answers = kwargs.get("answers") or [None] * len(solutions)
    scores = []
    for completion, solution, accepted in zip(completions, solutions, answers, strict=True):
        if solution is None:
            scores.append(None)
            continue
        targets = Targets(str(solution), tuple(references_of(accepted)) if accepted else ())
        scores.append(exact_match_score(final_answer(completion_text(completion)), targets, str(solution)))
    return scores


def json_f1_reward(tolerance: float = TOLERANCE) -> Callable:
    """Field F1 of the completion's first JSON object against the solution's (0.0 when none parses, numbers
    within `tolerance`); None for a row whose solution is not a JSON object."""

    def json_f1(completions: list, **kwargs) -> list[float | None]:
        scores: list[float | None] = []
        for completion, solution in zip(completions, _solutions(kwargs, "json_f1"), strict=True):
            reference = json_reference(solution)
            if reference is None:
                scores.append(None)
                continue
            counts = json_field_counts(final_answer(completion_text(completion)), reference, tolerance)
            fields = precision_recall_f1(counts.true_positive, counts.false_positive, counts.false_negative)
            scores.append(fields["f1"])
        return scores

    return json_f1


def format_reward(pattern: re.Pattern) -> Callable:
    """1.0 when the whole completion matches `pattern` (compiled with re.DOTALL), else 0.0."""

    def matches_format(completions: list, **kwargs) -> list[float]:
        return [float(pattern.fullmatch(completion_text(c)) is not None) for c in completions]

    return matches_format


def length_reward(target_length: int) -> Callable:
    """1.0 up to `target_length` completion tokens, falling linearly to 0.0 at twice it (and beyond)."""

    def length(completions: list, completion_ids: list, **kwargs) -> list[float]:
        return [min(1.0, max(0.0, 2.0 - len(ids) / target_length)) for ids in completion_ids]

    return length


# ---------------------------------------------------------------------------------------------
# Building the recipe's rewards


def build_rewards(
    settings: list[RewardSettings],
    tokenizer,
    where: str,
    *,
    tolerance: float = TOLERANCE,
    family_box_format: str | None = None,
) -> tuple[list[Callable], list[float]]:
    """TRL reward functions (each with __name__ set to the reward's name as written in the recipe, e.g.
    'exact_match' or 'my_rewards:colour') and their weights, in order; each is guarded and carries the
    `tokenizer` (the processor) check_rewards encodes its completions with. `tolerance`:
    evaluation.numeric_tolerance; `family_box_format`: the model family's box convention (grounding.py), None
    where it has none."""
    if not settings:
        raise RewardError(f"{where}: a grpo stage needs at least one reward, e.g. `- name: exact_match`")
    functions = []
    for index, reward in enumerate(settings):
        built = _checked_reward_function(reward, f"{where}[{index}]", tolerance, tokenizer, family_box_format)
        function = guarded(built, reward.name)
        function.tokenizer = tokenizer
        functions.append(function)
    return functions, [float(reward.weight) for reward in settings]


def reward_problems(settings: list[RewardSettings], where: str) -> list[RewardError]:
    """Every reward that cannot be built (the recipe check reports them all at load, before any model)."""
    if not settings:
        return [RewardError(f"{where}: a grpo stage needs at least one reward, e.g. `- name: exact_match`")]
    problems = []
    for index, reward in enumerate(settings):
        try:
            # the model's family is not known at load: the iou reward's frame is resolved with the trainer
            _checked_reward_function(reward, f"{where}[{index}]", TOLERANCE, None, "same")
        except RewardError as error:
            problems.append(error)
    return problems


def _checked_reward_function(
    reward: RewardSettings, here: str, tolerance: float, processor, family_box_format: str | None
) -> Callable:
    for key, owner in ONLY_FOR.items():
        if getattr(reward, key) is not None and reward.name != owner:
            raise RewardError(
                f"{key_path(here, key)}: `{key}` belongs to the {owner} reward, not to {reward.name}; remove it"
            )
    return _reward_function(reward, here, tolerance, processor, family_box_format)


def _reward_function(
    reward: RewardSettings, here: str, tolerance: float, processor, family_box_format: str | None
) -> Callable:
    if reward.name == "exact_match":
        return exact_match_reward
    if reward.name == "json_f1":
        return json_f1_reward(tolerance)
    if reward.name == "iou":
        box_format = reward.box_format or family_box_format
        if box_format is None:
            raise RewardError(
                f"{key_path(here, 'box_format')}: this model's family has no known box convention; say how its "
                f"answers write a box: {', '.join(BOX_FORMATS)} (docs/recipes.md)"
            )
        return iou_reward(box_format, processor, _solutions, completion_text)
    if reward.name == "format":
        if not reward.pattern:
            raise RewardError(
                f"{key_path(here, 'pattern')}: the format reward needs a `pattern`, the regular expression the "
                "whole completion must match, e.g. '<think>.*?</think>\\s*<answer>.*?</answer>'"
            )
        try:
            return format_reward(re.compile(reward.pattern, re.DOTALL))
        except re.error as error:
            raise RewardError(
                f"{key_path(here, 'pattern')}: {reward.pattern!r} is not a valid regular expression ({error}); "
                "fix it (in YAML, single quotes keep backslashes as written)"
            ) from None
    if reward.name == "length":
        if reward.target_length is None or reward.target_length < 1:
            raise RewardError(
                f"{key_path(here, 'target_length')}: the length reward needs a `target_length` of at least 1 "
                "(completions up to that many tokens get the full reward)"
            )
        return length_reward(reward.target_length)
    return user_function(reward.name, here)


def user_function(name: str, here: str) -> Callable:
    """The user's `module:function`, imported from the working directory (or installed), and checked to
    take TRL's keyword arguments."""
    module_name, _, function_name = name.partition(":")
    if not module_name or not function_name:
        raise RewardError(
            f"{key_path(here, 'name')}: unknown reward {name!r}: the built-ins are {', '.join(BUILT_INS)}, or "
            "write `module:function` for your own (module.py in the working directory)"
            f"{did_you_mean(name, BUILT_INS)}"
        )
    # The CLI's entry point does not put the working directory on sys.path (python -m does): a recipe's
    # `my_rewards:colour` means ./my_rewards.py, wherever vlm-recipes is launched from.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and (module_name == error.name or module_name.startswith(error.name + ".")):
            raise RewardError(
                f"{key_path(here, 'name')}: no module {module_name!r} for reward {name!r}: it must be "
                f"importable from the working directory ({os.getcwd()}, e.g. {module_name}.py there) or "
                "installed"
            ) from None
        raise RewardError(f"{key_path(here, 'name')}: importing {module_name!r} failed: {error}") from error
    except Exception as error:
        raise RewardError(
            f"{key_path(here, 'name')}: importing {module_name!r} raised {type(error).__name__}: {error}"
        ) from error
    function = getattr(module, function_name, None)
    if function is None:
        public = [n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n])]
        raise RewardError(
            f"{key_path(here, 'name')}: module {module_name!r} ({module.__file__}) has no {function_name!r}"
            f"{did_you_mean(function_name, public)}"
        )
    if not callable(function):
        raise RewardError(
            f"{key_path(here, 'name')}: {name!r} is a {type(function).__name__}, not a function"
        )
    _check_signature(function, name, here)
    return function


def _check_signature(function: Callable, name: str, here: str) -> None:
    """TRL calls a reward with keywords only: `prompts`, `completions`, `completion_ids`, every dataset
    column and a few more, so a reward must take what it does not name as **kwargs (the names it does take
    are checked by calling it on a row, in check_rewards)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): check_rewards calls it before training
    by_position = [p for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if by_position or not any(p.kind is p.VAR_KEYWORD for p in parameters):
        raise RewardError(
            f"{key_path(here, 'name')}: {name!r} takes ({', '.join(map(str, parameters))}), which cannot take "
            f"TRL's keyword arguments; define it as `def {name.partition(':')[2]}(completions, **kwargs)`: TRL "
            "passes prompts, completions, completion_ids and every dataset column (e.g. solution) as lists, one "
            "item per completion, and trainer_state, log_extra, log_metric; return one float (or None) per "
            "completion"
        )


# ---------------------------------------------------------------------------------------------
# Guards: before training (one row) and during it (every batch)


def guarded(function: Callable, name: str | None = None) -> Callable:
    """The reward as TRL calls it during training: a raised exception, a wrong count or a non-number becomes
    RewardError naming the function (and the exception), so the stage stops with a clear message instead of
    a traceback deep in TRL. `name`: what the recipe calls it (default: the function's name)."""
    name = name or get_callable_name(function)
    if is_async_callable(function):  # TRL awaits async rewards together; keep it one

        async def reward(**kwargs):
            try:
                result = await function(**kwargs)
            except RewardError:
                raise
            except Exception as error:
                raise _raised(name, error) from error
            return _checked(name, result, len(kwargs["completions"]))

    else:

        def reward(**kwargs):
            try:
                result = function(**kwargs)
            except RewardError:
                raise
            except Exception as error:
                raise _raised(name, error) from error
            return _checked(name, result, len(kwargs["completions"]))

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = function.__doc__
    return reward


def _raised(name: str, error: Exception) -> RewardError:
    frames = traceback.extract_tb(error.__traceback__)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return RewardError(f"reward {name} raised {type(error).__name__}: {error}{at}")


def _checked(name: str, result, count: int) -> list:
    """`result` if it is one number (or None: does not apply) per completion, else RewardError."""
    if not isinstance(result, list):
        raise RewardError(
            f"reward {name} returned a {type(result).__name__}, not a list: return one float (or None) "
            "per completion"
        )
    if len(result) != count:
        raise RewardError(
            f"reward {name} returned {len(result)} rewards for {count} completions: return one per completion"
        )
    for index, value in enumerate(result):
        if value is not None and not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward {name} returned {value!r} ({type(value).__name__}) for completion {index}: return a "
                "float, or None where the reward does not apply"
            )
    return result


def check_rewards(functions: list[Callable], row: dict, where: str) -> None:
    """Call every reward once, before training, the way TRL will call it, on one prompt row (a dict with
    'prompt' (list of chat messages), 'solution' (str) and maybe other columns, 'images' possibly present)
    with two completions (the row's solution and an empty answer); raise RewardError naming the function when
    it raises, returns a non-list, the wrong count, or a non-number (None is allowed: TRL's 'does not apply')."""
    texts = [str(row.get("solution") or ""), ""]
    conversational = isinstance(row["prompt"], list)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    columns = {key: [value] * 2 for key, value in row.items() if key not in ("prompt", "completion")}
    for index, function in enumerate(functions):
        name = get_callable_name(function)
        kwargs = dict(
            columns,
            prompts=[row["prompt"]] * 2,
            completions=completions,
            completion_ids=[_token_ids(getattr(function, "tokenizer", None), t) for t in texts],
            trainer_state=TrainerState(),
            log_extra=lambda column, values: None,
            log_metric=lambda metric, value: None,
        )
        try:
            result = function(**kwargs)
            if inspect.isawaitable(result):
                result = asyncio.run(result)
            _checked(name, result, len(texts))
        except RewardError as error:
            raise RewardError(f"{where}[{index}]: checked on one training row, {error}") from error
        except Exception as error:
            raise RewardError(
                f"{where}[{index}]: checked on one training row, {_raised(name, error)}"
            ) from error


def _token_ids(tokenizer, text: str) -> list[int]:
    """The completion's token ids, as the tokenizer (or a processor's) encodes it; one per word without."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    if tokenizer is None:
        return list(range(len(text.split())))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
