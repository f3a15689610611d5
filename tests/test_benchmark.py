"""The benchmark's code: its baseline runs, its arithmetic is right, its committed results and the tables in
docs/results/sft-vs-trl.md are what the script writes. Speed itself is measured by scripts/benchmark.py, never by a
test."""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
import time

import pytest
from conftest import REPO

from vlm_recipes.benchmarking import plain_trl_sft, sft_tables, sft_vs_trl
from vlm_recipes.benchmarking.flops import STEP_PARTS

RESULTS = REPO / "benchmarks" / "results" / "cpu-2-cores.json"  # the small model, fp32, every scenario
RESULTS_BF16 = REPO / "benchmarks" / "results" / "cpu-2-cores-bf16.json"  # the small model, bf16, first epoch
RESULTS_WIDE = (
    REPO / "benchmarks" / "results" / "cpu-2-cores-bf16-wide.json"
)  # the wide model, bf16, first epoch
# the overhead check (--ways trl,off): the small model and the wide one, fp32, first epoch
RESULTS_OVERHEAD = REPO / "benchmarks" / "results" / "overhead-cpu-2-cores.json"
RESULTS_OVERHEAD_WIDE = REPO / "benchmarks" / "results" / "overhead-cpu-2-cores-wide.json"
RESULTS_OVERHEAD_WIDE_R2_AGAIN = REPO / "benchmarks" / "results" / "overhead-cpu-2-cores-wide-r2-again.json"
TABLED_RESULTS = [
    RESULTS,
    RESULTS_BF16,
    RESULTS_WIDE,
    RESULTS_OVERHEAD,
    RESULTS_OVERHEAD_WIDE,
]  # a table each
ALL_RESULTS = [*TABLED_RESULTS, RESULTS_OVERHEAD_WIDE_R2_AGAIN]  # the wide r2 repeat is read in the text


def run(wall, rss, runtime, eval_loss, curve, fraction=1.0, samples=8, flops=None):
    """A run as run_ours/run_baseline return it, throughput added by the script's own code."""
    measured = {
        "wall_s": wall,
        "peak_rss_gb": rss,
        "peak_gpu_allocated_gb": None,
        "train_runtime_s": runtime,
        "final_loss": curve[max(curve)],
        "eval_loss": eval_loss,
        "loss_curve": curve,
        "vision_fraction_computed": fraction,
        "flops_skipped": 0.0,
        "time_to_first_step_s": 1.0,
        "step_time_median_s": 0.5,
        "step_time_p90_s": 0.7,
    }
    flops = flops or {"vision": 3e9, "projector": 1e9, "llm": 6e9}
    return sft_tables.with_throughput(measured, samples, flops, None)


def synthetic_report(
    stages, scenarios, model_name: str = "bench-qwen2-vl", ways: list[str] = sft_tables.WAYS
) -> dict:
    """The report main() writes, from made-up runs through the script's own functions."""
    import argparse

    from vlm_recipes.machine import detect_environment

    args = argparse.Namespace(threads=2, batch_size=4, repeats=1)
    flops = {stage: {"vision": 3e9, "projector": 1e9, "llm": 6e9} for stage in stages}
    shares = dict(zip(STEP_PARTS, (0.4, 0.05, 0.45, 0.1), strict=True))
    setup = {
        "rows": 8,
        "flops": flops,
        "last_layer_flops": dict.fromkeys(stages, 1e6),
        "peak_tflops": 0.5,
        "peak_source": "measured",
        "flop_shares": {stage: {model_name: shares, "Qwen2-VL-2B": shares} for stage in stages},
        "baseline_adapters": sft_vs_trl.like_for_like_adapters(ways, "fp32"),
    }
    model = {"name": model_name, "parameters": 16_700_000, "family": "qwen2-vl"}
    about = sft_vs_trl.describe_run(args, scenarios, detect_environment(), "fp32", model, setup)
    ways_of = {c: sft_vs_trl.ways_of(c, ways) for c in scenarios}
    runs = {
        c: {w: [run(20.0, 1.3, 10.0, 6.0, {1: 7.0, 5: 6.5}, samples=8)] for w in ways}
        for c, ways in ways_of.items()
    }
    return {
        "about": about,
        "stages": {s: {c: sft_tables.compare(runs[c]) for c in scenarios} for s in stages},
    }


def key_tree(value):
    """The nested keys of a JSON value (a list: its first item's), without the values."""
    if isinstance(value, dict):
        return {key: key_tree(item) for key, item in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [key_tree(value[0])]
    return None


# what a results file records since the bf16 probe (git 814e823): the machine's answer, the baseline's adapters
KEYS_SINCE_THE_PROBE = [("machine", "instruction_set"), ("machine", "bf16"), ("baseline_adapters",)]


def ways_asked(report: dict) -> list[str]:
    """The ways a results file's command asked for (`--ways`, or `--without-overhead-check`: TRL and on)."""
    command = report["about"]["command"]
    if "--without-overhead-check" in command:
        return [sft_tables.BASELINE, sft_tables.SPEEDUPS_ON]
    asked = re.search(r"--ways (\S+)", command)
    return [sft_vs_trl.WAY_NAMES[n] for n in asked.group(1).split(",")] if asked else sft_tables.WAYS


@pytest.mark.parametrize("results", ALL_RESULTS, ids=lambda path: path.stem)
def test_committed_results_have_the_keys_the_script_writes(results):
    committed = json.loads(results.read_text())
    stages, scenarios = list(committed["stages"]), list(committed["about"]["scenarios"])
    asked = re.search(r"--scenarios (\S+)", committed["about"]["command"])
    stages_asked = re.search(r"--stages (\S+)", committed["about"]["command"])
    assert stages == (stages_asked.group(1).split(",") if stages_asked else list(sft_vs_trl.RECIPES)), (
        "the stages its command asked for (both by default)"
    )
    assert scenarios == (asked.group(1).split(",") if asked else list(sft_tables.SCENARIOS)), (
        "the scenarios its command asked for (all of them by default)"
    )
    written = synthetic_report(stages, scenarios, committed["about"]["model"]["name"], ways_asked(committed))
    for tree in (committed, written):
        for scenario in (s for stage in tree["stages"].values() for s in stage.values()):
            # each run as its process reported it: what the summaries read must be there
            for each in (run for way_runs in scenario.pop("runs").values() for run in way_runs):
                measured = set(sft_tables.MEASURED) - {"peak_gpu_allocated_gb"}  # on a GPU only
                assert {*measured, "loss_curve", "vision_fraction_computed", "flops_skipped"} <= set(each)
        for stage in tree["about"]["flops_per_sample_by_role"]:  # any model: the roles are the keys
            assert set(tree["about"]["flops_per_sample_by_role"][stage]) == {"vision", "projector", "llm"}
    for *path, key in KEYS_SINCE_THE_PROBE:  # a file measured before the bf16 probe (machine.py) lacks them
        committed_part, written_part = committed["about"], written["about"]
        for step in path:
            committed_part, written_part = committed_part[step], written_part[step]
        if key not in committed_part:
            del written_part[key]
    assert key_tree(committed) == key_tree(written)
    assert committed["about"]["git_sha"] and "-dirty" not in committed["about"]["git_sha"]


@pytest.mark.parametrize("results", TABLED_RESULTS, ids=lambda path: path.stem)
def test_readme_tables_are_generated_from_the_committed_results(results):
    readme, report = (REPO / sft_tables.TABLES_DOC).read_text(), json.loads(results.read_text())
    first, last = sft_tables.readme_markers(report)
    block = readme[readme.index(first) + len(first) : readme.index(last)]
    assert block.strip() == sft_tables.render_tables(report).strip(), (
        f"{sft_tables.TABLES_DOC}'s benchmark tables differ from {results.relative_to(REPO)}: "
        f"run `python scripts/benchmark.py --readme {results.relative_to(REPO)}`"
    )


# An x86 core's fp32 matmul peak: 2 FMA units x 16 fp32 lanes (AVX512) x 2 FLOPs x 4 GHz = 0.256 TFLOP/s. A CPU
# that emulates bf16 converts its operands to fp32 first, so its bf16 matmul never beats that.
EMULATED_BF16_CEILING_PER_THREAD_TFLOPS = 0.256


@pytest.mark.parametrize("results", [RESULTS_BF16, RESULTS_WIDE], ids=lambda path: path.stem)
def test_committed_bf16_results_were_measured_in_bf16_on_a_cpu_that_computes_it_natively(results):
    about = json.loads(results.read_text())["about"]
    machine = about["machine"]
    assert about["precision"] == "bf16"
    if "instruction_set" in machine:  # recorded since the bf16 probe (machine.py)
        assert "bf16 native" in machine["description"], machine
    else:  # recorded under the old check (oneDNN's, which said yes where bf16 is emulated): the peak decides
        per_thread = about["peak_tflops"] / machine["threads"]
        assert about["peak_source"].startswith("measured") and "bf16" in about["peak_source"]
        assert per_thread > EMULATED_BF16_CEILING_PER_THREAD_TFLOPS, (per_thread, machine)
    assert about["git_sha"] and "-dirty" not in about["git_sha"]


@pytest.mark.parametrize(
    "results",
    [[RESULTS_OVERHEAD], [RESULTS_OVERHEAD_WIDE, RESULTS_OVERHEAD_WIDE_R2_AGAIN]],
    ids=["small", "wide"],
)
def test_the_published_overhead_check_has_the_runner_level_with_plain_trl_computing_the_same(results):
    """docs/performance.md's claim: with its speed-ups off, vlm-recipes trains at >= 0.97x plain TRL's samples/s,
    the median of every committed run of the stage (at least 3 a way; the wide r2 stage was measured twice and
    both are published), each stage computing what TRL computes (the same eval loss to 4 digits)."""
    runs: dict[str, dict[str, list[float]]] = {}
    for path in results:
        report = json.loads(path.read_text())
        assert report["about"]["precision"] == "fp32" and "-dirty" not in report["about"]["git_sha"]
        for stage, scenarios in report["stages"].items():
            compared = scenarios["first-epoch"]
            assert set(compared["summary"]) == {sft_tables.BASELINE, sft_tables.OURS}
            ours, theirs = (
                compared["summary"][way]["eval_loss"] for way in (sft_tables.OURS, sft_tables.BASELINE)
            )
            assert round(ours, 4) == round(theirs, 4), f"{path.name} {stage}: not the same computation"
            for way, way_runs in compared["runs"].items():
                runs.setdefault(stage, {}).setdefault(way, []).extend(
                    run["samples_per_s"] for run in way_runs
                )
    for stage, by_way in runs.items():
        assert min(len(samples) for samples in by_way.values()) >= 3, stage
        ratio = statistics.median(by_way[sft_tables.OURS]) / statistics.median(by_way[sft_tables.BASELINE])
        assert ratio >= 0.97, f"{stage}: {ratio:.3f}x plain TRL"


def test_committed_wide_results_name_the_wide_model_its_peak_and_shares_near_qwen2_vl_2bs():
    about = json.loads(RESULTS_WIDE.read_text())["about"]
    assert about["model"]["name"] == "bench-qwen2-vl-wide" and about["peak_source"].startswith("measured")
    for stage, (ours, theirs) in ((s, tuple(m.values())) for s, m in about["flop_shares"].items()):
        assert max(abs(ours[part] - theirs[part]) for part in STEP_PARTS) < 0.10, stage


def test_summary_is_the_median_and_ratios_are_ours_over_trl():
    baseline = [run(w, 1.0, t, 6.0, {1: 7.0}) for w, t in ((30.0, 10.0), (31.0, 12.0), (90.0, 11.0))]
    ours = [run(w, 0.9, t, 6.03, {1: 7.07}) for w, t in ((15.0, 5.0), (16.0, 4.0), (14.0, 6.0))]
    compared = sft_tables.compare({sft_tables.BASELINE: baseline, sft_tables.SPEEDUPS_ON: ours})
    assert compared["summary"][sft_tables.BASELINE]["wall_s"] == 31.0, (
        "the median, not the mean (90 s is an outlier)"
    )
    assert compared["summary"][sft_tables.BASELINE]["train_runtime_s"] == 11.0
    versus = compared["versus_trl"][sft_tables.SPEEDUPS_ON]
    assert versus["wall_s"] == pytest.approx(15.0 / 31.0)
    assert versus["samples_per_s"] == pytest.approx((8 / 5.0) / (8 / 11.0)), "median samples/s over runs"
    assert versus["peak_rss_gb"] == pytest.approx(0.9)
    assert versus["eval_loss_change"] == pytest.approx(0.005)
    assert versus["loss_curve_gap"] == pytest.approx(0.01)


def test_loss_curve_gap_compares_the_steps_both_logged_whatever_their_key_type():
    ours = {"1": 2.0, "5": 1.1, "10": 9.0}  # as read back from JSON
    baseline = {1: 2.0, 5: 1.0}
    assert sft_tables.loss_curve_gap(ours, baseline) == pytest.approx(0.1)
    assert sft_tables.loss_curve_gap({3: 1.0}, baseline) is None


def test_model_flops_count_only_the_tower_work_actually_run():
    flops = {"vision": 3e9, "projector": 1e9, "llm": 6e9}
    cold = run(10, 1, 2.0, 6.0, {1: 7.0}, fraction=1.0, flops=flops)
    warm = run(10, 1, 2.0, 6.0, {1: 7.0}, fraction=0.0, flops=flops)
    third = run(10, 1, 2.0, 6.0, {1: 7.0}, fraction=1 / 3, flops=flops)
    assert cold["model_tflops_per_s"] == pytest.approx(8 * 10e9 / 2.0 / 1e12)
    assert warm["model_tflops_per_s"] == pytest.approx(8 * 6e9 / 2.0 / 1e12), (
        "cached features: no tower FLOPs"
    )
    assert third["model_tflops_per_s"] == pytest.approx(8 * (6e9 + 4e9 / 3) / 2.0 / 1e12)
    assert sft_tables.fraction_computed({"in_training": {"hits": 6, "misses": 2}}) == 0.25
    assert sft_tables.fraction_computed(None) == 1.0


def test_model_flops_leave_out_what_the_last_layer_skipped_at_unlabelled_positions():
    counted = {"in_training": {"labelled": 30, "positions": 130}}
    assert sft_tables.flops_skipped(counted, 2e6) == 100 * 2e6
    assert sft_tables.flops_skipped(None, 2e6) == 0.0
    whole = run(10, 1, 2.0, 6.0, {1: 7.0})
    cut = sft_tables.with_throughput(
        {**whole, "flops_skipped": 4e9}, 8, {"vision": 3e9, "projector": 1e9, "llm": 6e9}, None
    )
    assert cut["model_tflops_per_s"] == pytest.approx((8 * 10e9 - 4e9) / 2.0 / 1e12)


def test_last_layer_flops_per_position_are_its_output_projection_mlp_and_lm_head():
    import torch
    from transformers import AutoModelForImageTextToText

    from vlm_recipes.benchmarking.flops import last_layer_flops_per_position
    from vlm_recipes.demo.models import ensure_demo_model
    from vlm_recipes.model.build import detect_family

    family, config = detect_family(str(ensure_demo_model()))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    text = config.get_text_config()
    o_proj = text.num_attention_heads * (text.hidden_size // text.num_attention_heads) * text.hidden_size
    mlp, lm_head = 3 * text.hidden_size * text.intermediate_size, text.vocab_size * text.hidden_size
    frozen_llm = {"vision": "full", "projector": "full", "llm": "frozen"}
    assert last_layer_flops_per_position(model, family, frozen_llm) == 4 * (o_proj + mlp + lm_head)


def test_the_wide_bench_model_has_qwen2_vl_2bs_shapes_and_flop_shares():
    """`demo:bench-qwen2-vl-wide`, built offline as the bench builds it, against Qwen2-VL-2B built from its
    published config.json on the meta device: every weight the two share by name has the same shape except
    the vocabulary's rows (cut with the depths, 1/7); each part's share of a training step's FLOPs on the
    bench data is within 10 points of the real model's, in r1's modes and in r2's."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlm_recipes.benchmarking.bench_model import model_about, reference_model, token_counts
    from vlm_recipes.demo.dataset import ensure_bench_dataset
    from vlm_recipes.demo.models import ensure_demo_model
    from vlm_recipes.model.build import detect_family

    model_dir = ensure_demo_model("demo:bench-qwen2-vl-wide")
    family, config = detect_family(str(model_dir))
    with torch.device("meta"):
        wide_model = AutoModelForImageTextToText.from_config(config)
    real_model = reference_model()
    wide, real = dict(wide_model.named_parameters()), dict(real_model.named_parameters())
    text, real_text = config.get_text_config(), real_model.config.get_text_config()
    assert (text.num_hidden_layers, config.vision_config.depth) == (4, 5)
    assert text.vocab_size == -(-real_text.vocab_size * 4 // 28 // 64) * 64
    vocab_rows = {"model.language_model.embed_tokens.weight", "lm_head.weight"}
    differ = {
        name: (tuple(p.shape), tuple(real[name].shape))
        for name, p in wide.items()
        if name not in vocab_rows and p.shape != real[name].shape
    }
    assert not differ, f"shapes unlike Qwen2-VL-2B's: {differ}"
    heads = wide_model.get_output_embeddings().weight, real_model.get_output_embeddings().weight
    assert [tuple(head.shape) for head in heads] == [(text.vocab_size, 1536), (151936, 1536)]
    assert set(wide) <= set(real), "no weight the real model lacks"
    assert config.tie_word_embeddings and config.vision_config.embed_dim == 1280

    counts = token_counts(model_dir, ensure_bench_dataset() / "bench.jsonl", 128)
    r1 = {"vision": "frozen", "projector": "frozen", "llm": "lora"}
    r2 = {"vision": "full", "projector": "full", "llm": "frozen"}
    _, _, _, shares = model_about(model_dir, {"llm-lora": r1, "vision-full": r2}, counts)
    for stage, (ours, theirs) in ((s, tuple(by_model.values())) for s, by_model in shares.items()):
        gaps = {part: abs(ours[part] - theirs[part]) for part in ours}
        assert max(gaps.values()) < 0.10, f"{stage}: shares {ours} against Qwen2-VL-2B's {theirs}"
        assert theirs["LM head"] > 0.04 and theirs["vision tower"] > 0.3, "the real step, as measured"


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("stage", "adapters", "trained_in"),
    [
        ("llm-lora", None, ["torch.bfloat16"]),  # TRL's cast of QLoRA adapters, whatever the precision
        ("llm-lora", "fp32", ["torch.float32"]),  # the overhead check's like-for-like baseline in fp32
        ("vision-full", None, ["torch.float32"]),
    ],
)
def test_baseline_script_runs_qlora_and_vision_stages(
    stage, adapters, trained_in, tmp_path, private_demo_cache
):
    """The plain-TRL baseline stays runnable, the QLoRA one included (its numbers are the benchmark's)."""
    from vlm_recipes.demo.dataset import ensure_bench_dataset
    from vlm_recipes.demo.models import ensure_demo_model

    out = tmp_path / "baseline.json"
    model = ensure_demo_model("demo:bench-qwen2-vl")
    data = ensure_bench_dataset() / "bench.jsonl"
    args = [f"--stage={stage}", f"--model={model}", f"--data={data}", "--rows=4", "--batch-size=2"]
    if adapters:
        args.append(f"--adapter-dtype={adapters}")
    plain_trl_sft.main([*args, "--steps=2", "--eval-rows=2", f"--out={out}"])
    measured = json.loads(out.read_text())
    assert measured["steps"] == 2 and math.isfinite(measured["eval_loss"])
    assert measured["trainable_dtypes"] == trained_in
    assert measured["step_time_median_s"] > 0 and measured["time_to_first_step_s"] > 0


def test_step_times_include_loading_the_batch(tmp_path):
    """Trainer fetches a step's batch before `on_step_begin`: the timer must count that time too."""
    import torch
    from transformers import Trainer, TrainingArguments

    from vlm_recipes.methods.callbacks import StepTimer

    class SlowRows(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            time.sleep(0.05)
            return {"x": torch.ones(2), "labels": torch.zeros(1)}

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, x, labels):
            return {"loss": ((self.linear(x) - labels) ** 2).mean()}

    timer = StepTimer()
    args = TrainingArguments(
        tmp_path,
        per_device_train_batch_size=2,
        max_steps=3,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
    )
    Trainer(model=Tiny(), args=args, train_dataset=SlowRows(), callbacks=[timer]).train()
    assert len(timer.step_times) == 3
    assert min(timer.step_times) >= 2 * 0.05, "two rows of 50 ms each are loaded in every step"


def test_the_overhead_check_alone_has_its_own_tables_and_a_like_for_like_baseline():
    """`--ways trl,off --scenarios first-epoch`: the runner's own cost, in its own block of docs/results/sft-vs-trl.md;
    in fp32 TRL's QLoRA adapters are kept in fp32 as ours are, and the table says so."""
    report = synthetic_report(
        list(sft_vs_trl.RECIPES), ["first-epoch"], ways=[sft_tables.BASELINE, sft_tables.OURS]
    )
    assert report["about"]["baseline_adapters"] == "fp32"
    assert sft_tables.readme_markers(report)[0] == "<!-- benchmark table (speed-ups off): begin -->"
    assert "QLoRA adapters recast to fp32 once SFTTrainer is built" in sft_tables.render_tables(report)
    assert (
        sft_vs_trl.like_for_like_adapters(sft_tables.WAYS, "fp32") is None
    )  # the headline: TRL as users run it
    assert sft_vs_trl.like_for_like_adapters([sft_tables.BASELINE, sft_tables.OURS], "bf16") is None


def test_a_scenario_with_nothing_to_compare_is_refused(monkeypatch, capsys):
    argv = ["--ways", "trl,off", "--scenarios", "first-epoch,three-epochs", "--model", "demo:bench-qwen2-vl"]
    with pytest.raises(SystemExit) as refused:
        sft_vs_trl.main(argv)
    assert (
        refused.value.code == 2 and "--scenarios three-epochs: no way to compare" in capsys.readouterr().err
    )


def test_readme_tables_refuse_a_missing_file_or_markers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--readme", str(tmp_path / "absent.json")])
    with pytest.raises(SystemExit) as refused:
        sft_vs_trl.main()
    assert refused.value.code == 2 and "absent.json: no such results file" in capsys.readouterr().err
    readme = tmp_path / "performance.md"
    readme.write_text("# no tables here\n")
    with pytest.raises(SystemExit) as refused:
        sft_tables.update_readme(json.loads(RESULTS.read_text()), readme)
    assert refused.value.code == 2 and "mark where the tables go" in capsys.readouterr().err
    assert readme.read_text() == "# no tables here\n", "nothing written"
