"""Sequence parallelism (`sequence_parallel_size`): one row split over CPU ranks (gloo) ends where one process
ends; what cannot be split is refused at load, with the reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from safetensors.torch import load_file

from vlm_recipes.cli.train import main as train_main
from vlm_recipes.demo.long_rows import long_video_rows
from vlm_recipes.files import read_json

FIRST_GRADIENTS = [sys.executable, str(REPO / "tests" / "first_gradients.py")]  # saves step 1's gradients

# One stage training every role: the tower by LoRA (its frames are split over the group, so its gradients
# come back through the gather), the projector fully, the language model by LoRA; fp32, LoRA dropout off
# (each rank would draw its own masks), 2 steps of 2 video rows each. (A fully trained tower's LayerNorm
# weights have elements with gradients near 1e-9, which AdamW's division turns from rounding noise into
# weight differences of 1e-5: the gradients then agree within the floor, the weights need not.)
ROLES = ["quantization.mode=none", "train.vision=lora", "train.projector=full", "train.llm=lora"]
PROOF = [
    "--recipe",
    "r1-llm-only",
    *ROLES,
    "data.eval=null",
    "data.max_length=8192",
    "data.video_max_pixels=200704",  # 448x448 frames: 256 tokens per pair of frames
    "precision=fp32",
    "lora.dropout=0",
    "training.learning_rate=1e-3",
    "training.logging_steps=1",
    "evaluation.generate=false",
    "--max-steps",
    "2",
]


def trained(run_dir: Path) -> dict:
    stage = run_dir / "stage-1-llm-lora"
    weights = load_file(stage / "final" / "model.safetensors")
    return {k: v for k, v in weights.items() if "visual" in k or "language_model" in k}


def apart(one: dict, other: dict) -> float:
    assert one.keys() == other.keys()
    return max((one[k].float() - other[k].float()).abs().max().item() for k in one)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference, in this process: the global batch of 2 rows in one micro-batch; and the floor: the same
    rows as 2 micro-batches of 1, accumulated (summation order only)."""
    from vlm_recipes.demo.models import ensure_demo_model

    root = tmp_path_factory.mktemp("sequence-parallel")
    data = long_video_rows(root / "data")
    common = [*PROOF, f"data.train={data}", "--output-dir", str(root)]
    runs = {}
    for name, batch in (
        ("one", ["training.per_device_batch_size=2"]),
        (
            "floor",
            [
                "training.per_device_batch_size=1",
                "training.gradient_accumulation_steps=2",
            ],
        ),
    ):
        os.environ["VLM_RECIPES_GRADIENTS"] = str(root / f"{name}-gradients.safetensors")
        from first_gradients import install, uninstall

        install()
        try:
            assert train_main([*common, "--run-name", name, *batch]) == 0
        finally:
            uninstall()
            del os.environ["VLM_RECIPES_GRADIENTS"]
        runs[name] = root / "r1-llm-only" / name
    start = load_file(ensure_demo_model("demo:tiny-qwen2-vl") / "model.safetensors")
    return root, common, runs, start


def split_run(root: Path, common: list[str], name: str, processes: int, per_device: int, how: list[str]):
    env = {**os.environ, "VLM_RECIPES_GRADIENTS": str(root / f"{name}-gradients.safetensors")}
    flags = ["--run-name", name, f"training.per_device_batch_size={per_device}", *how]
    flags += ["--nproc-per-node", str(processes), "stages.1.sequence_parallel_size=2"]
    result = subprocess.run(
        [*FIRST_GRADIENTS, *common, *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result, root / "r1-llm-only" / name


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("processes", "per_device", "how"),
    [
        (2, 2, ["--parallel", "ddp"]),
        # FSDP2 over the data x sequence grid, attention and the tower recomputed in the backward, the row
        # packed padding-free (its positions padded with the row, per-sample attention over the whole row)
        (4, 1, ["--parallel", "fsdp", "training.gradient_checkpointing=true", "training.padding_free=true"]),
    ],
    ids=["1x2-ddp", "2x2-fsdp-checkpointing-padding-free"],
)
def test_a_video_row_split_over_sequence_ranks_trains_as_one_process(one_process, processes, per_device, how):
    """Rows of 4,135 tokens (one video each) on `processes` gloo ranks as data groups of 2 sequence ranks (1
    group of 2 rows, or 2 groups of 1 row: a global batch of 2 either way): each rank encodes half the frames;
    the cut falls inside the video's tokens; the first step's loss and gradients and the final weights equal one process's within the floor,
    one process against itself with the batch accumulated as two micro-batches, and training moved the weights
    more than 100x that floor."""
    root, common, runs, start = one_process
    result, run_dir = split_run(root, common, f"sp-{processes}", processes, per_device, how)
    cut = re.search(
        r"first row \((\d+) tokens, padded to \d+\) cut at token\(s\) \[(\d+)\]: (.*)", result.stderr
    )
    assert cut, result.stderr[-4000:]
    assert int(cut[1]) >= 4000 and cut[3] == "1 of them inside an image's or video's tokens", cut[0]
    # each rank of a group encodes half the frames (a video is 16 temporal patches here), then gathers
    tower = re.search(r"the vision tower encodes (\d+)/(\d+) frames per rank of (\d+)", result.stderr)
    assert tower and tower[1] == tower[2] and int(tower[3]) == 16 * per_device, result.stderr[-4000:]
    decisions = {
        d["guard"]: d["choice"] for d in read_json(run_dir / "stage-1-llm-lora" / "report.json")["decisions"]
    }
    groups = processes // 2
    assert decisions["sequence-parallel"].startswith(f"{groups} data group(s) x 2 sequence ranks")
    assert f"global batch 2 = {per_device} per device" in decisions["batch"]
    if "training.padding_free=true" in how:
        assert decisions["per-sample-attention"] == "text attention sdpa_per_sample"

    losses = {
        name: read_json(path / "stage-1-llm-lora" / "metrics.json")["loss_curve"][0]["loss"]
        for name, path in {**runs, "split": run_dir}.items()
    }
    gradients = {
        name: load_file(root / f"{name}-gradients.safetensors")
        for name in ("one", "floor", f"sp-{processes}")
    }
    weights = {name: trained(path) for name, path in {**runs, "split": run_dir}.items()}
    floor = {
        "loss": abs(losses["one"] - losses["floor"]),
        "gradients": apart(gradients["one"], gradients["floor"]),
        "weights": apart(weights["one"], weights["floor"]),
    }
    split = {
        "loss": abs(losses["one"] - losses["split"]),
        "gradients": apart(gradients["one"], gradients[f"sp-{processes}"]),
        "weights": apart(weights["one"], weights["split"]),
    }
    moved = apart(weights["one"], {k: start[k] for k in weights["one"]})
    print(f"floor {floor}, split {split}, moved {moved:.2e}")
    for what in floor:
        # a floor of 0 (bit for bit) is read as one ulp of the values compared
        bound = 10 * max(floor[what], 1e-7 if what == "loss" else 6e-8)
        assert split[what] <= bound, (what, split, floor)
    assert moved > 100 * max(floor["weights"], 6e-8), (moved, floor)


def test_a_stage_that_cannot_split_its_rows_is_refused_at_load_naming_the_key_and_the_fix():
    from vlm_recipes.recipe import load_recipe
    from vlm_recipes.recipes.validate import RecipeError

    with pytest.raises(RecipeError) as error:
        load_recipe("r5-sft-then-dpo", ["stages.3.sequence_parallel_size=2"])
    assert "stages[2].sequence_parallel_size: is proven for sft stages only" in str(error.value)
    overrides = [
        "stages.1.sequence_parallel_size=2",
        "stages.1.parallel=single",
        "training.loss_positions_only=true",
    ]
    with pytest.raises(RecipeError) as error:
        load_recipe("r1-llm-only", overrides)
    message = str(error.value)
    assert "stages[0].parallel: with sequence_parallel_size 2: needs one process per rank" in message
    assert "stages[0].training.loss_positions_only: with sequence_parallel_size 2:" in message
    with pytest.raises(RecipeError, match="sequence_parallel_size: must be at least 1, got 0"):
        load_recipe("r1-llm-only", ["stages.1.sequence_parallel_size=0"])


def test_ranks_that_do_not_form_whole_sequence_groups_are_refused():
    from vlm_recipes.decisions import Environment
    from vlm_recipes.errors import GuardError
    from vlm_recipes.plan import decide_parallel

    cpu = Environment("cpu", 0, bf16_supported=True)
    plan, _ = decide_parallel("ddp", cpu, nproc_per_node=4, sequence_parallel_size=2)
    assert plan.world_size == 4
    with pytest.raises(GuardError, match="does not divide the 3 processes: set --nproc-per-node"):
        decide_parallel("fsdp", cpu, nproc_per_node=3, sequence_parallel_size=2)
    with pytest.raises(GuardError, match="run the stage with --parallel ddp or fsdp"):
        decide_parallel("auto", cpu, sequence_parallel_size=2)


@pytest.mark.parametrize(
    ("model", "size", "changed", "why"),
    [
        ("demo:tiny-qwen2-vl", 2, {}, None),
        ("demo:tiny-qwen2-vl", 4, {}, "its 4 query heads and 2 key/value heads must both divide"),
        ("demo:tiny-qwen3-vl", 2, {"num_experts": 4}, "a mixture-of-experts language model is not proven"),
        (
            "demo:tiny-qwen2-vl",
            2,
            {"use_sliding_window": True, "sliding_window": 64},
            "sliding-window layers",
        ),
        ("demo:tiny-qwen3.5", 2, {}, "linear-attention layers (Gated DeltaNet)"),
        ("demo:tiny-gemma3", 2, {}, "attend to each other both ways"),
        ("demo:tiny-llama4", 2, {}, "not proven equal to one process yet"),
    ],
)
def test_a_family_or_head_count_that_cannot_be_split_is_refused_with_its_reason(model, size, changed, why):
    from transformers import AutoConfig

    from vlm_recipes.demo.models import config_source
    from vlm_recipes.families import family_for_config
    from vlm_recipes.speedups.sequence_parallel import sequence_parallel_refusal

    config = AutoConfig.from_pretrained(config_source(model))
    text_config = config.get_text_config()
    for key, value in changed.items():  # what a real model of the family may have and the demo model lacks
        setattr(text_config, key, value)
    refusal = sequence_parallel_refusal(family_for_config(config), text_config, size)
    assert (refusal is None) if why is None else (why in refusal), refusal


def test_the_dry_run_states_each_ranks_share_of_the_longest_row(capsys):
    flags = ["--recipe", "r1-llm-only", "stages.1.sequence_parallel_size=2", "data.max_length=8191"]
    assert train_main([*flags, "--parallel", "ddp", "--nproc-per-node", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (
        "2 data group(s) x 2 sequence ranks: the longest row data.max_length allows, 8,191 tokens, is 4,096 per "
        "rank (padded to 8,192); per rank the language model's activations are 1/2"
    ) in out
    assert "global batch" not in out or "/ 2 sequence ranks" in out


def test_data_check_measures_the_longest_row_as_the_group_holds_it(tmp_path, capsys):
    from vlm_recipes.cli.data_check import main as data_main
    from vlm_recipes.speedups.sequence_parallel import group_share

    rows = long_video_rows(tmp_path, n=1)
    overrides = ["data.max_length=8192", "data.video_max_pixels=200704", "stages.1.sequence_parallel_size=2"]
    assert data_main(["check", str(rows), *overrides]) == 0
    assert (
        "sequence_parallel_size 2: the longest row, 4,139 tokens, is 2,070 per rank (padded to 4,140); within "
        "data.max_length 8,192, which the group holds as 4,096 per rank"
    ) in capsys.readouterr().out
    assert "over data.max_length 4,096, which the group holds as 2,048 per rank" in group_share(4139, 2, 4096)


def _attend_split(rank: int, init: str, out: str) -> None:
    """Rank `rank` of 2: its half of a left-padded batch through the Ulysses exchange and sdpa."""
    import torch
    from torch import distributed as dist
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from vlm_recipes.speedups.packing import per_sample_sdpa_attention
    from vlm_recipes.speedups.ulysses_attention import RowMask, ulysses_attention

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, :3] = 0  # the second row left-padded by 3

    class Layer(torch.nn.Module):
        num_key_value_groups, is_causal, training = 1, True, False

    piece = slice(4 * rank, 4 * rank + 4)
    local = [t[:, :, piece].detach().requires_grad_() for t in (q, k, v)]
    group = dist.new_group([0, 1])
    output, _ = ulysses_attention(sdpa_attention_forward, group, 2, RowMask(padding), Layer(), *local)
    output.sum().backward()
    # a packed row (padding-free): samples of 3 and 5 tokens, the cut at 4 inside the second
    packed = [t[:1, :, piece].detach() for t in (q, k, v)]
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    per_sample, _ = ulysses_attention(
        per_sample_sdpa_attention, group, 2, RowMask(positions=positions), Layer(), *packed
    )
    torch.save(
        {"output": output.detach(), "grads": [t.grad for t in local], "packed": per_sample},
        f"{out}-{rank}.pt",
    )
    dist.destroy_process_group()


def test_ulysses_attention_over_two_ranks_equals_attention_over_the_whole_padded_row(tmp_path):
    """The all-to-all around sdpa, with a left-padded row (the whole row's mask built by the exchange's side):
    each rank's output and the gradients of its q, k, v equal those of sdpa over the whole row, on every
    real token; and a packed row cut inside a sample is attended per sample, as over the whole row."""
    import torch
    from torch import multiprocessing
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from vlm_recipes.speedups.packing import per_sample_sdpa_attention

    out = str(tmp_path / "rank")
    multiprocessing.spawn(_attend_split, args=(f"file://{tmp_path / 'store'}", out), nprocs=2)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, :3] = 0

    class Layer(torch.nn.Module):
        num_key_value_groups, is_causal, training = 1, True, False

    real = padding.bool()
    # causal over real keys; a padded query attends to itself only (it would attend to nothing: NaN)
    mask = (torch.ones(8, 8, dtype=torch.bool).tril() & real[:, None, None, :]) | torch.eye(
        8, dtype=torch.bool
    )
    whole, _ = sdpa_attention_forward(Layer(), q, k, v, mask)
    whole.sum().backward()
    for rank in range(2):
        got = torch.load(f"{out}-{rank}.pt")
        piece = slice(4 * rank, 4 * rank + 4)
        kept = real[:, piece]
        assert torch.allclose(got["output"][kept], whole[:, piece][kept], atol=1e-6)
        for grad, full in zip(got["grads"], (q.grad, k.grad, v.grad), strict=True):
            assert torch.allclose(
                grad.transpose(1, 2)[kept], full[:, :, piece].transpose(1, 2)[kept], atol=1e-6
            )
    # the packed row: each sample attended on its own, as per-sample attention does over the whole row
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    packed = [t[:1].detach() for t in (q, k, v)]
    alone, _ = per_sample_sdpa_attention(Layer(), *packed, None, position_ids=positions)
    across, _ = sdpa_attention_forward(
        Layer(), *packed, None
    )  # one causal row: the second sample sees the first
    split = torch.cat([torch.load(f"{out}-{rank}.pt")["packed"] for rank in range(2)], dim=1)
    assert torch.allclose(split, alone, atol=1e-6)
    assert (split[:, 3:] - across[:, 3:]).abs().max() > 1e-2
