"""`vlm-recipes eval --lmms-eval TASK RUN`: without lmms-eval, the install hint (exit 2, no traceback); a run
without a finished stage and a model lmms-eval has no name for, refused naming them; the lmms-eval command
line for a stage; lmms-eval's results JSON (laid out as lmms-eval 0.7.3 writes it) filed beside the stage's
metrics, and a failed lmms-eval run filing nothing, both through a stand-in `lmms_eval` module; the real
lmms-eval on a tiny trained run where it is installed (skipped, with the reason, where it is not)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, run_train
from test_families import TINY_RUN

from vlm_recipes.cli import main as vlm_recipes
from vlm_recipes.cli.lmms_eval import (
    INSTALL_HINT,
    file_result,
    find_stage,
    format_table,
    lmms_eval_command,
    lmms_eval_model_for,
    lmms_eval_models,
    new_results,
    output_dir,
    result_path,
    results_files,
    weights_not_loaded,
)
from vlm_recipes.errors import BadInput

LMMS_EVAL_ABSENT = "lmms-eval is not installed (pip install 'vlm-recipes[lmms-eval]')"


def fake_stage(directory: Path, model_type: str = "qwen2_vl", done: bool = True) -> Path:
    """A stage directory whose final/ has the files runs/layout.py's model_dir_problem asks for (no weights
    are read here), DONE written when `done`."""
    final = directory / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text(json.dumps({"model_type": model_type}))
    (final / "model.safetensors").write_bytes(b"")
    (final / "preprocessor_config.json").write_text("{}")
    if done:
        (directory / "DONE").write_text("{}")
    return directory


def fake_run(directory: Path, stages: dict[str, bool]) -> Path:
    """A run directory: run.json and a stage directory per name, finished or not."""
    directory.mkdir(parents=True)
    (directory / "run.json").write_text(json.dumps({"status": "running", "stages": []}))
    for name, done in stages.items():
        fake_stage(directory / name, done=done)
    return directory


def eval_command(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m vlm_recipes eval ARGS` in a fresh process, as a user runs it."""
    command = [sys.executable, "-m", "vlm_recipes", "eval", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)


# ------------------------------------------------------------------------------------ without lmms-eval


def test_without_lmms_eval_the_command_says_how_to_install_it(tmp_path, monkeypatch):
    stage = fake_stage(tmp_path / "stage-1-sft")
    env = dict(os.environ)
    if importlib.util.find_spec("lmms_eval") is not None:  # hide an installed one from the command's process
        hider = tmp_path / "hide"
        hider.mkdir()
        (hider / "sitecustomize.py").write_text(
            "import importlib.util\n_find = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: None if name == 'lmms_eval' else _find(name, *a)\n"
        )
        env["PYTHONPATH"] = os.pathsep.join([str(hider), env.get("PYTHONPATH", "")])
    done = eval_command("--lmms-eval", "mme", str(stage), env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"error: lmms-eval is not installed: {INSTALL_HINT}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (stage / "lmms-eval").exists() and not result_path(stage, "mme").exists()


@pytest.mark.parametrize(
    "stages, why",
    [
        ({"stage-1-sft": False}, "none of its stages finished (stage-1-sft: no DONE"),
        ({}, "it has no stage directory yet"),
    ],
    ids=["unfinished", "no-stage"],
)
def test_a_run_without_a_finished_stage_is_refused_naming_it(tmp_path, capsys, stages, why):
    run = fake_run(tmp_path / "runs" / "r1" / "t", stages)
    assert vlm_recipes(["eval", "--lmms-eval", "mme", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"error: {run}: no finished stage to evaluate: {why}" in err


def test_a_path_that_is_no_run_or_stage_is_refused(tmp_path, capsys):
    assert vlm_recipes(["eval", "--lmms-eval", "mme", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
    assert vlm_recipes(["eval", "--lmms-eval", "mme", str(tmp_path)]) == 2
    assert "neither a run directory (run.json) nor a stage directory (final/)" in capsys.readouterr().err
    stage = fake_stage(tmp_path / "stage-1-sft")
    (stage / "final" / "model.safetensors").unlink()
    assert vlm_recipes(["eval", "--lmms-eval", "mme", str(stage)]) == 2
    assert "final: not a whole model directory (no model.safetensors)" in capsys.readouterr().err


def test_the_last_finished_stage_of_a_run_is_taken(tmp_path):
    """Stages in their index order (stage-10 after stage-2), the last with DONE and a whole final/."""
    stages = {"stage-1-a": True, "stage-2-b": True, "stage-10-c": True, "stage-11-d": False}
    run = fake_run(tmp_path / "run", stages)
    assert find_stage(run) == run / "stage-10-c"
    assert find_stage(run / "stage-2-b") == run / "stage-2-b"  # a stage directory named itself


@pytest.mark.parametrize(
    "model_type, name",
    [
        ("qwen2_vl", "qwen2_vl"),
        ("qwen2_5_vl", "qwen2_5_vl"),
        ("qwen3_vl", "qwen3_vl"),
        ("llava_onevision", "llava_hf"),  # transformers' format, not the LLaVA-NeXT repository's
        ("internvl", "internvl_hf"),  # transformers' InternVL, not OpenGVLab's remote code
    ],
)
def test_the_lmms_eval_model_follows_the_configs_model_type(tmp_path, model_type, name):
    stage = fake_stage(tmp_path / "s", model_type)
    assert lmms_eval_model_for(stage / "final") == name == lmms_eval_models()[model_type]


def test_a_family_module_names_its_lmms_eval_model_and_no_table_elsewhere(tmp_path, monkeypatch):
    """A family added to the registry brings its lmms-eval model, or why there is none, with it: nothing else
    lists model types."""
    from vlm_recipes import families
    from vlm_recipes.families.base import LLAVA_STYLE_ROLES, Family

    class NewFamily(Family):
        lmms_eval_models = {"new_vlm": "new_vlm_hf"}
        no_lmms_eval_model = {"new_vlm_moe": "new_vlm_hf loads the dense class only"}

    new = NewFamily(name="new-vlm", model_types=("new_vlm", "new_vlm_moe"), role_prefixes=LLAVA_STYLE_ROLES)
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, new))
    assert lmms_eval_model_for(fake_stage(tmp_path / "dense", "new_vlm") / "final") == "new_vlm_hf"
    with pytest.raises(BadInput, match="new_vlm_hf loads the dense class only"):
        lmms_eval_model_for(fake_stage(tmp_path / "moe", "new_vlm_moe") / "final")


def test_a_model_type_without_an_lmms_eval_model_is_a_clear_error(tmp_path, capsys):
    stage = fake_stage(tmp_path / "s", "blip-2")
    with pytest.raises(BadInput, match=r"model_type `blip-2` has no lmms-eval model .*--model"):
        lmms_eval_model_for(stage / "final")
    assert vlm_recipes(["eval", "--lmms-eval", "mme", str(stage)]) == 2
    err = capsys.readouterr().err
    assert "model_type `blip-2`" in err and "--model" in err and "Traceback" not in err
    dense_glm = fake_stage(tmp_path / "g", "glm4v")  # lmms-eval's glm4v would load it as the MoE model
    with pytest.raises(BadInput, match="glm4v loads the MoE class unless the path contains `Flash`"):
        lmms_eval_model_for(dense_glm / "final")


def value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_the_lmms_eval_command_line_for_a_stage(tmp_path):
    stage = fake_stage(tmp_path / "stage-1-sft")
    final = (stage / "final").resolve()
    command = lmms_eval_command(stage, "mme", "qwen2_vl", limit=2, batch_size=4, device="cpu", python="py")
    assert command[:3] == ["py", "-m", "lmms_eval"]
    assert value(command, "--model") == "qwen2_vl"
    assert value(command, "--model_args") == f"pretrained={final},device_map=cpu"
    assert value(command, "--tasks") == "mme"
    assert value(command, "--batch_size") == "4"
    assert value(command, "--output_path") == str((stage / "lmms-eval" / "mme").resolve())
    assert value(command, "--limit") == "2" and value(command, "--device") == "cpu"
    assert "--log_samples" in command
    plain = lmms_eval_command(stage, "mme", "qwen2_vl")
    assert value(plain, "--model_args") == f"pretrained={final}"
    assert "--limit" not in plain and "--device" not in plain and plain[0] == sys.executable
    with pytest.raises(BadInput, match="one lmms-eval task name"):
        lmms_eval_command(stage, "mme,pope", "qwen2_vl")
    commas = fake_stage(tmp_path / "a,b")
    with pytest.raises(BadInput, match="cannot take a model path with `,`"):
        lmms_eval_command(commas, "mme", "qwen2_vl")


# ------------------------------------------------------------------------- lmms-eval's results, filed

# A results JSON as lmms-eval 0.7.3 writes it: lmms_eval/evaluator.py `evaluate` builds "results" (each task's
# "alias" and "<metric>,<filter>" keys, from evaluator_utils.py `consolidate_results` and
# `TaskOutput.calculate_aggregate_metric`: a stderr of one sample is "N/A"), "n-samples" and "higher_is_better";
# `simple_evaluate` adds "config" (limit among its keys), "lmms_eval_version" (a git branch@sha) and "date";
# loggers/evaluation_tracker.py `save_results_aggregated` writes it to
# <output_path>/<model name sanitized>/<date>_results.json. Keys trimmed, values as a real run wrote them.
RESULTS = {
    "results": {
        "mme": {
            "alias": "mme",
            "mme_cognition_score,none": 57.5,
            "mme_cognition_score_stderr,none": "N/A",
            "mme_perception_score,none": 301.25,
            "mme_perception_score_stderr,none": "N/A",
        }
    },
    "group_subtasks": {"mme": []},
    "configs": {"mme": {"task": "mme", "dataset_path": "lmms-lab-encoder/MME"}},
    "versions": {"mme": "Yaml"},
    "n-shot": {"mme": 0},
    "higher_is_better": {"mme": {"mme_cognition_score": True, "mme_perception_score": True}},
    "n-samples": {"mme": {"original": 2374, "effective": 8}},
    "config": {"model": "qwen2_vl", "model_args": "pretrained=/x/final", "batch_size": "1", "limit": 8.0},
    "git_hash": None,
    "git_branch": None,
    "lmms_eval_version": "unknown@unknown",
    "date": "20261128_140249",
    "task_hashes": {},
    "model_name": "/x/final",
    "model_name_sanitized": "stage-1-sft__final",
}


def write_results(stage: Path, task: str, results: dict, date: str = "20261128_140249") -> Path:
    path = output_dir(stage, task) / "stage-1-sft__final" / f"{date}_results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    return path


def test_lmms_evals_results_are_filed_beside_the_stages_metrics(tmp_path):
    stage = fake_stage(tmp_path / "stage-1-sft")
    results = write_results(stage, "mme", RESULTS)
    about = {"stage": str(stage), "lmms_eval_model": "qwen2_vl", "lmms_eval_version": "0.7.3"}
    path, record = file_result(stage, "mme", results, about, ["python", "-m", "lmms_eval"])
    assert path == stage / "lmms-eval-mme.json"
    assert json.loads(path.read_text()) == record
    assert record["task"] == "mme" and record["lmms_eval_version"] == "0.7.3" and record["limit"] == 8.0
    assert record["metrics"] == {
        "mme": {"mme_cognition_score,none": 57.5, "mme_perception_score,none": 301.25}
    }
    assert record["stderr"] == {
        "mme": {"mme_cognition_score_stderr,none": None, "mme_perception_score_stderr,none": None}
    }
    assert record["samples"] == {"mme": {"original": 2374, "effective": 8}}
    assert record["results_file"] == str(results) and record["command"] == ["python", "-m", "lmms_eval"]
    assert sorted(p.name for p in stage.iterdir()) == ["DONE", "final", "lmms-eval", "lmms-eval-mme.json"]
    table = format_table(record).splitlines()
    assert table[0].split() == ["task", "metric", "value"]
    assert table[1].split() == ["mme", "mme_cognition_score", "57.5"]
    assert table[2].split() == ["mme", "mme_perception_score", "301.2"]


def test_a_group_and_its_subtasks_are_filed_and_a_missing_task_is_not(tmp_path):
    stage = fake_stage(tmp_path / "stage-1-sft")
    grouped = {
        **RESULTS,
        "results": {
            "grp": {"alias": "grp", "acc,none": 0.5, "acc_stderr,none": 0.1},
            "grp_a": {
                "alias": " - grp_a",
                "acc,none": 0.25,
                "acc_stderr,none": 0.2,
                "acc_stderr_clt,none": 0.1,
            },
            "grp_b": {"alias": " - grp_b", "acc,none": 0.75, "acc_stderr,none": "N/A"},
        },
    }
    _, record = file_result(stage, "grp", write_results(stage, "grp", grouped), {}, [])
    assert record["metrics"] == {
        "grp": {"acc,none": 0.5},
        "grp_a": {"acc,none": 0.25},
        "grp_b": {"acc,none": 0.75},
    }
    assert record["stderr"]["grp_a"] == {"acc_stderr,none": 0.2, "acc_stderr_clt,none": 0.1}
    assert "0.25  ± 0.2" in format_table(record)
    with pytest.raises(ValueError, match="no `pope` in its results"):
        file_result(stage, "pope", write_results(stage, "pope", grouped), {}, [])
    assert not result_path(stage, "pope").exists()


def test_only_a_results_file_the_run_wrote_counts(tmp_path):
    stage = fake_stage(tmp_path / "stage-1-sft")
    old = write_results(stage, "mme", RESULTS, date="20260101_000000")
    before = results_files(output_dir(stage, "mme"))
    assert new_results(output_dir(stage, "mme"), before) is None
    new = write_results(stage, "mme", RESULTS, date="20261128_140249")
    assert new_results(output_dir(stage, "mme"), before) == new != old


def test_a_class_that_loads_another_architecture_is_told_from_its_load_report():
    """transformers' load report in lmms-eval's log, as lmms-eval's glm4v class (the MoE one, for a path
    without `Flash`) printed it loading the tiny dense GLM-4V: what main refuses to file."""
    log = """
Key                                                                | Status     |
-------------------------------------------------------------------+------------+-
model.language_model.layers.{0, 1}.post_self_attn_layernorm.weight | UNEXPECTED |
model.language_model.layers.1.mlp.shared_experts.gate_proj.weight  | MISSING    |
model.language_model.layers.0.mlp.up_proj.weight                   | MISSING    |

Notes:
- UNEXPECTED:	can be ignored when loading from different task/architecture; not ok if you expect identical arch.
- MISSING:	those params were newly initialized because missing from the checkpoint.
"""
    assert weights_not_loaded(log) == {"UNEXPECTED": 1, "MISSING": 2}
    assert weights_not_loaded("Loading weights: 100%|##########| 58/58 [00:00<00:00]") == {}


# A stand-in for lmms-eval's `python -m lmms_eval`: it writes a results JSON where lmms-eval does (as above),
# or, as lmms-eval does after an error in the evaluation (__main__.py `cli_evaluate`), exits 0 writing none;
# or crashes.
FAKE_LMMS_EVAL = """
import json, os, sys
def value(flag):
    return sys.argv[sys.argv.index(flag) + 1]
mode = os.environ["FAKE_LMMS_EVAL"]
print("fake lmms-eval", mode, sys.argv[1:])
if mode == "crash":
    sys.exit(3)
if mode == "ok":
    results = json.loads(os.environ["FAKE_RESULTS"])
    pretrained = value("--model_args").split(",")[0].removeprefix("pretrained=")
    folder = os.path.join(value("--output_path"), "__".join(pretrained.split("/")[-2:]))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "20261128_140249_results.json"), "w") as out:
        json.dump(results, out)
"""


@pytest.mark.parametrize("mode", ["ok", "swallowed", "crash"])
def test_the_command_files_a_result_only_when_lmms_eval_wrote_one(tmp_path, mode):
    fake = tmp_path / "fake" / "lmms_eval"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(textwrap.dedent(FAKE_LMMS_EVAL))
    stage = fake_stage(tmp_path / "runs" / "r1" / "t" / "stage-1-sft")
    (stage.parent / "run.json").write_text("{}")
    env = {
        **os.environ,
        "PYTHONPATH": str(fake.parent),
        "FAKE_LMMS_EVAL": mode,
        "FAKE_RESULTS": json.dumps(RESULTS),
    }
    done = eval_command("--lmms-eval", "mme", str(stage.parent), "--limit", "8", env=env)
    log = stage / "lmms-eval" / "mme" / "lmms-eval.log"
    assert "fake lmms-eval" in log.read_text() and "fake lmms-eval" in done.stdout  # shown and kept
    if mode == "ok":
        assert done.returncode == 0, done.stderr[-2000:]
        filed = json.loads(result_path(stage, "mme").read_text())
        assert filed["metrics"]["mme"]["mme_perception_score,none"] == 301.25
        assert filed["stage"] == str(stage) and filed["lmms_eval_model"] == "qwen2_vl"
        assert "--limit 8: a check, not the benchmark's score" in done.stdout
        assert f"filed: {result_path(stage, 'mme')}" in done.stdout
        return
    assert done.returncode == (3 if mode == "crash" else 1)
    why = "exit code 3" if mode == "crash" else "it wrote no results"
    assert f"error: lmms-eval failed ({why}" in done.stderr and f"its log is {log}" in done.stderr
    assert not result_path(stage, "mme").exists() and "Traceback" not in done.stderr
    assert [p.name for p in stage.iterdir() if p.name.startswith("lmms-eval")] == ["lmms-eval"]


# ------------------------------------------------------------------------------- the real lmms-eval


# A task of one's own (lmms-eval's task YAML, https://github.com/EvolvingLMMs-Lab/lmms-eval docs/task_guide.md
# form): its rows in a local JSON Lines file, read by `datasets`' json builder, so no hub is asked.
LOCAL_TASK = """
task: vlm_recipes_check
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
generation_kwargs:
  max_new_tokens: 4
  temperature: 0
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  - version: 0.0
"""
LOCAL_TASK_FUNCTIONS = """
from PIL import Image


def doc_to_visual(doc):
    return [Image.open(doc["image"]).convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """r1-llm-only trained for two steps on the tiny demo Qwen2-VL: runs/r1-llm-only/t. Only where
    lmms-eval is installed: skipped, with the reason, before any training where it is not."""
    pytest.importorskip("lmms_eval", reason=LMMS_EVAL_ABSENT)
    out = tmp_path_factory.mktemp("runs")
    done = run_train("--recipe", "r1-llm-only", "--output-dir", str(out), "--run-name", "t", *TINY_RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "r1-llm-only" / "t"


@pytest.mark.e2e
def test_lmms_eval_runs_a_local_task_on_a_tiny_trained_stage(tmp_path, tiny_run):
    """Needs lmms-eval (pip install 'vlm-recipes[lmms-eval]'), nothing else: the task is a local one (its
    YAML under --include-path, its two rows' images made here), so no hub is asked. About a minute on a CPU."""
    pytest.importorskip("lmms_eval", reason=LMMS_EVAL_ABSENT)
    from PIL import Image

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = []
    for color in ("red", "blue", "green"):
        Image.new("RGB", (64, 64), color).save(tasks / f"{color}.png")
        rows.append({"image": str(tasks / f"{color}.png"), "question": "What color is it?", "answer": color})
    (tasks / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "vlm_recipes_check.yaml").write_text(LOCAL_TASK.format(rows=tasks / "rows.jsonl"))
    (tasks / "utils.py").write_text(LOCAL_TASK_FUNCTIONS)
    args = ["--lmms-eval", "vlm_recipes_check", str(tiny_run), "--limit", "2", "--device", "cpu"]
    done = eval_command(*args, "--include-path", str(tasks))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stage = tiny_run / "stage-1-llm-lora"
    filed = json.loads(result_path(stage, "vlm_recipes_check").read_text())
    assert set(filed["metrics"]["vlm_recipes_check"]) == {"exact_match,none"}
    assert filed["samples"]["vlm_recipes_check"] == {"original": 3, "effective": 2}
    assert filed["limit"] == 2 and filed["lmms_eval_model"] == "qwen2_vl" and filed["lmms_eval_version"]
    assert Path(filed["results_file"]).is_file()
    assert list((stage / "lmms-eval" / "vlm_recipes_check").glob("*/*_samples_vlm_recipes_check.jsonl"))


@pytest.mark.e2e
@pytest.mark.skipif(
    not os.environ.get("VLM_RECIPES_LMMS_EVAL_TASK"),
    reason="set VLM_RECIPES_LMMS_EVAL_TASK to an lmms-eval task whose hub dataset is reachable",
)
def test_lmms_eval_runs_a_hub_task_on_a_tiny_trained_stage(tiny_run):
    """Needs lmms-eval (pip install 'vlm-recipes[lmms-eval]'), the Hugging Face hub reachable (the task's
    dataset is downloaded: MME's is about 1 GB) and $VLM_RECIPES_LMMS_EVAL_TASK naming the task (mme, pope,
    ...); two of its samples are run on the CPU."""
    pytest.importorskip("lmms_eval", reason=LMMS_EVAL_ABSENT)
    task = os.environ["VLM_RECIPES_LMMS_EVAL_TASK"]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    done = eval_command("--lmms-eval", task, str(tiny_run), "--limit", "2", "--device", "cpu", env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    filed = json.loads(result_path(tiny_run / "stage-1-llm-lora", task).read_text())
    assert filed["task"] == task and filed["metrics"][task] and filed["limit"] == 2
