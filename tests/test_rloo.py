"""RLOO stages (method: rloo): TRL's RLOOTrainer on GRPO's prompt rows and rewards. A stage trains and moves
its weights, scores its eval prompts at its start and end, and its `rloo:` settings reach TRL's RLOOConfig;
GRPO-only keys and bad settings are refused at load under the rloo section's name."""

from __future__ import annotations

import pytest
from test_grpo import _exits_2, assert_moved, base_weights, colour_rows, final_weights, moving_grpo_recipe

from vlm_recipes.cli.train import main
from vlm_recipes.files import read_json


def rloo_recipe(directory, monkeypatch, data: str, training: str, settings: str = ""):
    """A one-stage RLOO recipe: moving_grpo_recipe's stage (LoRA on the language model, the first_token_even
    reward, which varies within every group on random weights) with its method and section renamed."""
    recipe = moving_grpo_recipe(directory, monkeypatch, data, training)
    text = recipe.read_text().replace("method: grpo", "method: rloo").replace("    grpo: {", "    rloo: {")
    recipe.write_text(text.replace("rewards: [", f"{settings}rewards: ["))
    return recipe


@pytest.mark.e2e
@pytest.mark.parametrize("precision", ["bf16", "fp32"])  # set explicitly: CPUs with and without native bf16
def test_an_rloo_stage_trains_moves_its_weights_and_scores_its_start_and_end(
    tmp_path, monkeypatch, capsys, private_demo_cache, precision
):
    _, prompts = colour_rows(tmp_path / "data", 4, seed=0, side=64)
    _, eval_prompts = colour_rows(tmp_path / "eval", 4, seed=1, side=64)
    recipe = rloo_recipe(
        tmp_path,
        monkeypatch,
        f"{{train: {prompts}, eval: {eval_prompts}}}",
        "{max_steps: 2, per_device_batch_size: 8, learning_rate: 1.0e-3, logging_steps: 1}",
        "beta: 0.05, normalize_advantages: true, sample_with_merged_lora: true, inverse_cdf_sampling: true, ",
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
    stage = tmp_path / "grpo" / "t" / "stage-1-grpo"
    assert_moved(final_weights(stage), base_weights())
    metrics, report = read_json(stage / "metrics.json"), read_json(stage / "report.json")
    assert [p["step"] for p in metrics["reward_curve"]] == [1, 2]
    assert metrics["eval_at_start"]["eval_reward"] is not None and metrics["eval_reward"] is not None
    decisions = {d["guard"]: d["choice"] for d in report["decisions"]}
    assert decisions["precision"] == precision
    assert decisions["rloo-reference"] == "the model with its LoRA adapter switched off"  # beta 0.05
    assert {"merged-sampling", "inverse-cdf-sampling"} <= decisions.keys()
    assert " → " in capsys.readouterr().out  # the end-of-run table: the eval reward from start to end


def test_rloo_settings_reach_trls_rlooconfig(tmp_path, monkeypatch):
    from vlm_recipes.decisions import Environment
    from vlm_recipes.methods.rloo import RLOO
    from vlm_recipes.methods.trainer import ConfigInputs
    from vlm_recipes.recipe import load_recipe

    settings = "beta: 0.0, normalize_advantages: true, epsilon: 0.1, epsilon_high: 0.3, temperature: 0.7, "
    recipe = rloo_recipe(tmp_path, monkeypatch, "{train: demo:prompt-train, eval: null}", "{}", settings)
    stage = load_recipe(str(recipe)).stages[0]
    config = RLOO().build_config(
        ConfigInputs(stage, tmp_path / "out", "fp32", Environment("cpu", 0, False), has_eval=False)
    )
    assert type(config).__name__ == "RLOOConfig"
    assert (config.beta, config.normalize_advantages, config.epsilon, config.epsilon_high) == (
        0.0,
        True,
        0.1,
        0.3,
    )
    assert (config.num_generations, config.max_completion_length, config.temperature) == (4, 4, 0.7)
    assert config.reward_weights == [1.0]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ("loss_type: dapo, ", "rloo.loss_type"),  # GRPO's loss: not a key of the rloo section
        ("num_generations: 3, ", "not a multiple of rloo.num_generations"),
    ],
    ids=["grpo-only-key", "partial-groups"],
)
def test_bad_rloo_settings_are_refused_at_load_under_the_rloo_section(
    tmp_path, monkeypatch, capsys, settings, message
):
    recipe = rloo_recipe(tmp_path, monkeypatch, "{train: demo:prompt-train, eval: null}", "{}", settings)
    recipe.write_text(recipe.read_text().replace("num_generations: 4, max_completion_length: 4, ", ""))
    err = _exits_2(recipe, tmp_path, capsys)
    assert message in err
