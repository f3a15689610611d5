"""The features tests elsewhere prove on Qwen2-VL, on every other family's tiny model: one shared run per
family, r3-two-stage with the preprocessed sample cache, its stages using the devices differently. The
user's command trains stage 1 as 2 DDP CPU processes (gloo) it launches and stage 2 in one process. On
Qwen2.5-VL that is one command, whose own process trains stage 2 once the ranks have ended; on the others the
command runs `--until-stage 1` and this process resumes the run, training stage 2 without another
interpreter's start. Each test below checks one feature on that run. (A run killed mid-stage and resumed:
tests/test_resume.py, tests/test_fsdp_stages.py.)"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import TINY_MODELS, run_train

from vlm_recipes.cli.compare import main as compare_main
from vlm_recipes.cli.inspect_checkpoint import main as inspect_main
from vlm_recipes.cli.train import main as train_main
from vlm_recipes.files import read_json

pytestmark = pytest.mark.e2e

NEW_FAMILIES = [model for family, model in TINY_MODELS.items() if family != "qwen2-vl"]
ONE_COMMAND = "demo:tiny-qwen2.5-vl"  # the launching process trains stage 2 (runner.launch_stages)
STAGES = ("stage-1-vision-full", "stage-2-llm-lora")
TINY = [
    "--max-steps",
    "2",
    "training.per_device_batch_size=4",  # 8 rows over 2 ranks: one step per epoch
    "data.max_train_samples=8",
    "data.max_eval_samples=4",
    "evaluation.max_new_tokens=4",
    "training.preprocessed_cache=true",
    "stages.2.parallel=single",  # stage 2 in one process, the resuming one
    "precision=bf16",  # what every GPU trains in, whatever this CPU has (test_families runs both)
]


@dataclass
class SharedRun:
    model: str
    run_dir: Path
    first: subprocess.CompletedProcess  # the user's command (--until-stage 1 but on ONE_COMMAND)
    done_before: dict[str, str]  # stage directory -> its DONE marker when that command ended
    resumed: int | None  # the resuming command's exit code (None: one command ran both stages)


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def shared_run(request, tmp_path_factory, private_demo_cache) -> SharedRun:
    from vlm_recipes.demo.models import ensure_demo_model

    model = request.param
    ensure_demo_model(model)  # built once here, not raced by the ranks
    out = tmp_path_factory.mktemp(model.removeprefix("demo:"))
    env = {**os.environ, "VLM_RECIPES_SPEEDUP_CACHE": str(out / "speedups")}  # cold: stage 1 writes it
    # With --until-stage 1 the command only launches, so it imports no training library: the 2 ranks pay
    # the imports, and this process, which has them, trains stage 2.
    until = [] if model == ONE_COMMAND else ["--until-stage", "1"]
    first = run_train(
        "--recipe",
        "r3-two-stage",
        f"model={model}",
        "--nproc-per-node",
        "2",
        *until,
        "--output-dir",
        str(out),
        "--run-name",
        "run",
        *TINY,
        env=env,
        timeout=300,
    )
    run_dir = out / "r3-two-stage" / "run"
    done_before = {p.parent.name: p.read_text() for p in run_dir.glob("stage-*/DONE")}
    if not until:
        return SharedRun(model, run_dir, first, done_before, None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLM_RECIPES_SPEEDUP_CACHE", env["VLM_RECIPES_SPEEDUP_CACHE"])
        resumed = train_main(["--resume", str(run_dir)])
    return SharedRun(model, run_dir, first, done_before, resumed)


def decisions(stage_dir: Path) -> dict[str, str]:
    return {d["guard"]: d["choice"] for d in read_json(stage_dir / "report.json")["decisions"]}


def test_stage_1_then_stage_2_each_trained_once(shared_run):
    run = shared_run
    assert run.first.returncode == 0, run.first.stderr[-3000:]
    if run.resumed is None:  # one command: its process trained stage 2 after the ranks ended
        assert sorted(run.done_before) == list(STAGES)
    else:
        assert list(run.done_before) == [STAGES[0]], "--until-stage 1 ended after stage 1, stage 2 not begun"
        assert run.resumed == 0
    assert (run.run_dir / STAGES[0] / "DONE").read_text() == run.done_before[STAGES[0]]  # not retrained
    manifest = read_json(run.run_dir / "run.json")
    assert manifest["status"] == "finished" and len(manifest["stages"]) == 2
    assert all((run.run_dir / stage / "DONE").is_file() for stage in STAGES)
    assert [read_json(run.run_dir / s / "metrics.json")["steps"] for s in STAGES] == [2, 2]


def test_stage_1_ran_as_ddp_on_two_ranks_and_stage_2_in_one_process(shared_run):
    launch = decisions(shared_run.run_dir / STAGES[0])
    assert launch["same-start"] == "identical on 2 ranks"
    assert launch["parallelism"].startswith("DistributedDataParallel")
    assert "× 2 process(es)" in launch["batch"]
    manifest = read_json(shared_run.run_dir / "run.json")
    assert "--nproc-per-node 2" in manifest["command"]  # the user's command, not the launcher's
    second = decisions(shared_run.run_dir / STAGES[1])
    assert second["same-start"] == "one rank" and second["parallelism"].startswith("single device")


def test_stage_2_read_the_samples_stage_1_preprocessed(shared_run):
    first, second = (
        read_json(shared_run.run_dir / stage / "metrics.json")["preprocessed_cache"] for stage in STAGES
    )
    assert first["misses"] > 0  # each rank wrote its shard
    assert second["hits"] > 0 and second["misses"] == 0, "same processor settings: every row was ready"


def test_freeze_audit_keeps_frozen_roles_identical(shared_run):
    manifest = read_json(shared_run.run_dir / "run.json")
    for stage, recipe_stage in zip(STAGES, manifest["resolved_recipe"]["stages"], strict=True):
        audit = read_json(shared_run.run_dir / stage / "report.json")["freeze_audit"]
        assert "other" not in audit, f"{stage}: parameters outside every role"
        for role, mode in recipe_stage["train"].items():
            if mode == "frozen":
                assert audit[role]["changed"] == 0 and audit[role]["identical"] > 0, (stage, role)
            else:
                assert audit[role]["changed"] > 0, (stage, role, mode)


def test_compare_script_tables_the_run(shared_run, tmp_path, capsys):
    # The scripts' own entry points, in this process (tests/test_cli.py starts them as commands)
    assert compare_main([str(shared_run.run_dir), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "r3-two-stage" in out and "llm-lora" in out
    assert (tmp_path / "cmp" / "comparison.md").is_file()


def test_inspect_puts_every_parameter_of_final_in_a_role(shared_run, capsys):
    final = shared_run.run_dir / STAGES[1] / "final"
    assert inspect_main([str(final)]) == 0
    stdout = capsys.readouterr().out
    family = shared_run.model.removeprefix("demo:tiny-")
    assert f": {family}, loaded none" in stdout
    rows = {line.split()[0] for line in stdout.splitlines() if line.split()}
    # a head tied to the input embedding (Gemma 3, as published) is that parameter, counted under llm
    tied = read_json(final / "config.json").get("tie_word_embeddings", False)
    assert {"vision", "projector", "llm", *([] if tied else ["lm_head"])} <= rows
    assert "other" not in rows
