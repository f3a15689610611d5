"""Several processes: DDP on CPU with gloo (two stages), two nodes on localhost, and the launch decisions."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TRAIN, distance_and_share_beyond, run_train, single_image_demo_file
from safetensors.torch import load_file

from vlm_recipes.cli.train import main as train_main  # the one-process references run in this process
from vlm_recipes.decisions import Environment
from vlm_recipes.demo.models import ensure_demo_model
from vlm_recipes.errors import GuardError
from vlm_recipes.files import read_json
from vlm_recipes.launch.launcher import CONFIGS_DIR, launch_command, launch_environment
from vlm_recipes.model.guards import apply_parallelism
from vlm_recipes.plan import ModelFootprint, ParallelPlan, decide_parallel
from vlm_recipes.runs.layout import NodeSettings

QUICK = [
    "--max-steps",
    "3",
    "training.per_device_batch_size=4",
    "data.max_eval_samples=4",
    "evaluation.generate=false",
]
TWO_GPUS = Environment("cuda", 2, bf16_supported=True, gpu_name="H100")
EIGHT_GPUS = Environment("cuda", 8, bf16_supported=True, gpu_name="H100")
CPU = Environment("cpu", 0, bf16_supported=True)


def run_quick_r3(tmp_path, run_name: str, *flags: str):
    """r3-two-stage, shortened, run as a user runs it with `flags`, into tmp_path/r3-two-stage/run_name."""
    return run_train(
        "--recipe",
        "r3-two-stage",
        *flags,
        "--output-dir",
        str(tmp_path),
        "--run-name",
        run_name,
        *QUICK,
        timeout=600,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.e2e
def test_two_stage_ddp_with_two_cpu_processes(tmp_path, private_demo_cache):
    result = run_quick_r3(tmp_path, "ddp", "--parallel", "ddp", "--nproc-per-node", "2")
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / "r3-two-stage" / "ddp"
    assert read_json(run_dir / "run.json")["status"] == "finished"
    assert sorted(p.parent.name for p in run_dir.glob("*/DONE")) == [
        "stage-1-vision-full",
        "stage-2-llm-lora",
    ]
    assert len(list(run_dir.glob("*/final/config.json"))) == 2  # one final/ per stage, written once
    for stage_dir in run_dir.glob("stage-*"):
        decisions = {d["guard"]: d for d in read_json(stage_dir / "report.json")["decisions"]}
        assert decisions["same-start"]["choice"] == "identical on 2 ranks"  # stage 2 included: same final/
        assert decisions["parallelism"]["choice"].startswith("DistributedDataParallel")
        assert (
            "global batch 8 = 4 per device × 1 accumulation × 2 process(es)" in decisions["batch"]["choice"]
        )
        assert read_json(stage_dir / "metrics.json")["steps"] == 3


# FSDP against one process over the same global batch (16 = 8 per rank x 2, or 16 in one process), fp32,
# LoRA dropout off (each rank draws its own masks). Noise floor measured on a 2-core AMD EPYC: one process
# against 2 DDP ranks, summation order only, the same on a second run: Qwen2-VL's full vision stage 2.6e-6,
# its QLoRA adapters 1.1e-7, its LoRA adapters on the fp32 language model 4.9e-8; Gemma 3's full vision stage
# (SigLIP tower, language model under model.language_model) 3.8e-7, InternVL's (InternViT tiles, Qwen3)
# 6.0e-8 (demo-v4's rows). FSDP equal to DDP bit for bit, Gemma 3 3.1e-8 from it. Adam's steps amplify the
# noise of the few elements whose gradient is near eps (the largest distances, test_families.py): on
# demo-v5's rows InternVL's full vision stage ends 1.4e-4 apart at 1 element of its patch embedding (3 of
# 262,688 beyond 1e-6), Qwen2-VL's LoRA 8.3e-7 (none beyond 1e-6). Bounds: fewer than 0.1 % of the elements
# beyond 10x the floor, and none beyond 5e-4; training moves the weights by ~2e-3 (lr 1e-3, 3 steps), a
# wrong loss average by 3.9e-3, a rank left with its own buffers by 5.0e-2.
FSDP_PROOF = [
    "--max-steps",
    "3",
    "precision=fp32",
    "data.max_train_samples=32",
    "data.eval=null",
    "training.learning_rate=1e-3",
    "lora.dropout=0",
]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("recipe", "model", "overrides", "layer", "bound"),
    [
        ("r2-vision-only", "demo:tiny-qwen2-vl", [], "Qwen2VLDecoderLayer", 3e-5),
        ("r1-llm-only", "demo:tiny-qwen2-vl", [], "Qwen2VLDecoderLayer", 1e-6),
        # LoRA on an unquantized language model (its weights sharded, not replicated): the four families below
        ("r2-vision-only", "demo:tiny-gemma3", [], "Gemma3DecoderLayer", 4e-6),
        ("r2-vision-only", "demo:tiny-internvl", [], "Qwen3DecoderLayer", 6e-7),
        # the loss averaged over the global batch (methods/sft.py): without it 3.9e-3 apart on Qwen2.5-VL and
        # GLM-4V, whose classes say accepts_loss_kwargs = False; with it 9.3e-8 and 1.2e-7
        ("r1-llm-only", "demo:tiny-qwen2.5-vl", ["quantization.mode=none"], "Qwen2_5_VLDecoderLayer", 5e-7),
        ("r1-llm-only", "demo:tiny-glm4v", ["quantization.mode=none"], "Glm4vTextDecoderLayer", 5e-7),
        ("r1-llm-only", "demo:tiny-smolvlm", ["quantization.mode=none"], "LlamaDecoderLayer", 5e-7),
        # persistent buffers (methods/sharding.py): Gemma 4 did not start (accelerate#3898); its floor, 6.0e-6,
        # is Adam's: gradient elements near adam_epsilon (1e-8) move by lr/eps per unit of summation-order
        # noise (8.0e-8 with eps 1e-4). Rank 1 without rank 0's buffers: 5.0e-2
        ("r1-llm-only", "demo:tiny-gemma4", ["quantization.mode=none"], "Gemma4TextDecoderLayer", 6e-5),
    ],
    ids=[
        "full-vision",
        "qlora",
        "full-vision-gemma3",
        "full-vision-internvl",
        "lora-qwen2.5-vl",
        "lora-glm4v",
        "lora-smolvlm",
        "lora-gemma4",
    ],
)
def test_fsdp_on_two_cpu_ranks_ends_where_one_process_does(
    tmp_path, private_demo_cache, recipe, model, overrides, layer, bound
):
    """FSDP2 through accelerate and Trainer on 2 CPU ranks (gloo): the weights shard, each family's decoder
    layers are the units, the stage trains on the demo rows (one image, two images and video mixed where the
    model takes video, so the ranks' batches differ in kind), final/ is gathered, and the trained weights
    equal one process's within the summation-order floor."""
    common = ["--recipe", recipe, f"model={model}", "--output-dir", str(tmp_path), *FSDP_PROOF, *overrides]
    assert train_main([*common, "--run-name", "one", "training.per_device_batch_size=16"]) == 0
    two = run_train(
        *common,
        "--run-name",
        "fsdp",
        "--parallel",
        "fsdp",
        "--nproc-per-node",
        "2",
        "training.per_device_batch_size=8",
    )
    assert two.returncode == 0, two.stderr[-4000:]
    stage = next((tmp_path / recipe / "fsdp").glob("stage-1-*")).name
    decisions = {
        d["guard"]: d["choice"]
        for d in read_json(tmp_path / recipe / "fsdp" / stage / "report.json")["decisions"]
    }
    assert decisions["parallelism"].startswith("FSDP2")
    assert decisions["fsdp-on-cpu"] == "FSDP2 over gloo on 2 CPU processes"
    assert decisions["fsdp-units"] == f"each {layer}; the vision tower and projector in the root unit"
    assert ("fsdp-buffers" in decisions) == (model == "demo:tiny-gemma4")
    quantized = "quantization.mode=none" not in overrides
    if recipe == "r1-llm-only":
        assert ("fsdp-4bit" in decisions) == quantized
        if quantized:
            assert decisions["fsdp-4bit"].endswith("4-bit weights replicated on every rank, the rest sharded")
        weights = "adapter/adapter_model.safetensors"  # lora_B starts at zero: its size is how far it moved
        trained = {run: load_file(tmp_path / recipe / run / stage / weights) for run in ("one", "fsdp")}
        moved = max(t.abs().max().item() for k, t in trained["one"].items() if "lora_B" in k)
    else:
        weights = "final/model.safetensors"
        trained = {run: load_file(tmp_path / recipe / run / stage / weights) for run in ("one", "fsdp")}
        start = load_file(ensure_demo_model(model) / "model.safetensors")
        moved = max((trained["one"][k] - start[k]).abs().max().item() for k in start)
    assert trained["one"].keys() == trained["fsdp"].keys()
    distance, beyond = distance_and_share_beyond(trained["one"], trained["fsdp"], bound)
    print(f"FSDP vs one process: {distance:.2e} ({beyond:.3%} beyond {bound:g}), moved {moved:.2e}")
    assert moved > 30 * bound, moved
    assert distance < 5e-4 and beyond < 1e-3, (distance, beyond, moved)


# Rows without images beside rows with images, the tower training (issue 32; other projects' users saw ranks
# hang or fail under ZeRO-3 / FSDP: Qwen3-VL#126, LLaMA-Factory#5616, ms-swift#4918). Same global batch of
# 16, fp32, lr 1e-3, 2 steps: 2 x 8 rows on 2 ranks or 16 in one process. Floor measured on a 2-core AMD
# EPYC: one process against 2 DDP or FSDP ranks, 0 (bit for bit) with OMP_NUM_THREADS=1 (as under xdist),
# 6.0e-8 (one ulp of the weights) with the one process on 2 threads, the ranks on 1 (torchrun's default);
# FSDP equal to DDP. Bound: 10x the floor; training moves the tower by ~1.5e-3.
TEXT_BESIDE_IMAGES = ["--max-steps", "2", "precision=fp32", "data.eval=null", "training.learning_rate=1e-3"]
TEXT_BESIDE_IMAGES_BOUND = 6e-7


def rows_one_rank_text_the_other_images(directory: Path, per_rank: int = 8, steps: int = 2) -> Path:
    """A JSONL of text rows and one-image rows ordered so that in every step one rank's batch is text rows
    only and the other's image rows only (rank 0 text in even steps, rank 1 in odd ones); one process with
    a batch of `per_rank` gets a first batch of text rows only, then one of image rows.

    Certain, not probable: the order is accelerate's own sampler's (Trainer's `random` sampling with
    `use_seedable_sampler`: a permutation seeded by `data_seed`, the recipe's seed, in epoch 0), and each
    rank takes every other batch of `per_rank` from it (accelerate's BatchSamplerShard)."""
    from accelerate.data_loader import SeedableRandomSampler

    from vlm_recipes.recipe import load_recipe

    n = 2 * per_rank * steps
    seed = load_recipe("r2-vision-only").stages[0].training.seed
    order = list(SeedableRandomSampler(data_source=range(n), data_seed=seed))
    images = iter(json.loads(line) for line in single_image_demo_file(directory).read_text().splitlines())
    rows: list[dict] = [{}] * n
    for position, index in enumerate(order):
        step, rank = divmod(position // per_rank, 2)
        if rank == step % 2:
            rows[index] = {
                "messages": [
                    {"role": "user", "content": f"Spell the number {position} in words."},
                    {"role": "assistant", "content": "I will, in a moment."},
                ]
            }
        else:
            rows[index] = next(images)
    path = directory / "text-beside-images.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def final_weights(run_dir: Path) -> dict:
    return load_file(next(run_dir.glob("stage-1-*")) / "final" / "model.safetensors")


def is_tower(key: str) -> bool:
    return key.startswith("visual.")  # Qwen2-VL's saved names: tower and merger under visual., the rest LLM


@pytest.mark.e2e
def test_ranks_whose_batch_has_no_image_train_the_tower_as_one_process_does(tmp_path):
    """r2-vision-only (tower and projector trained, LLM frozen) with one rank's batch text rows only, the
    other's image rows only, as DDP and as FSDP on 2 CPU ranks: no hang, no unused-parameter error, and the
    trained weights equal one process's over the same global batch within the summation-order floor.
    Before the fix both failed on the text rank: "element 0 of tensors does not require grad"."""
    data = rows_one_rank_text_the_other_images(tmp_path)
    common = ["--recipe", "r2-vision-only", "--output-dir", str(tmp_path), *TEXT_BESIDE_IMAGES]
    common.append(f"data.train={data}")
    assert train_main([*common, "--run-name", "one", "training.per_device_batch_size=16"]) == 0
    trained = {"one": final_weights(tmp_path / "r2-vision-only" / "one")}
    for parallel in ("ddp", "fsdp"):
        two = run_train(
            *common,
            *("--run-name", parallel, "--parallel", parallel, "--nproc-per-node", "2"),
            "training.per_device_batch_size=8",
        )
        assert two.returncode == 0, (parallel, two.stderr[-4000:])
        run_dir = tmp_path / "r2-vision-only" / parallel
        trained[parallel] = final_weights(run_dir)
        report = read_json(next(run_dir.glob("stage-1-*")) / "report.json")
        decisions = {d["guard"]: d["choice"] for d in report["decisions"]}
        assert decisions["parallelism"].startswith(
            {"ddp": "DistributedDataParallel", "fsdp": "FSDP2"}[parallel]
        )
        assert decisions["rows-without-images"].endswith(
            "tower / projector tensors added to the input embeddings"
        )
    start = load_file(ensure_demo_model("demo:tiny-qwen2-vl") / "model.safetensors")
    moved = max((trained["one"][k] - start[k]).abs().max().item() for k in start if is_tower(k))
    assert moved > 30 * TEXT_BESIDE_IMAGES_BOUND, moved
    for run, final in trained.items():
        assert final.keys() == start.keys()
        assert all(torch.equal(final[k], start[k]) for k in start if not is_tower(k)), run  # LLM frozen
        distance = max((trained["one"][k] - final[k]).abs().max().item() for k in start)
        assert distance < TEXT_BESIDE_IMAGES_BOUND, (run, distance, moved)


@pytest.mark.e2e
def test_a_batch_of_text_rows_only_trains_a_vision_only_stage_in_one_process(tmp_path):
    """One process, r2-vision-only, a first batch of text rows only, then one of image rows: the first
    loss reaches no trained weight (backward failed: "element 0 of tensors does not require grad"). The
    stage trains the tower, the LLM unchanged."""
    data = rows_one_rank_text_the_other_images(tmp_path)
    common = ["--recipe", "r2-vision-only", "--output-dir", str(tmp_path), *TEXT_BESIDE_IMAGES]
    assert (
        train_main([*common, f"data.train={data}", "--run-name", "one", "training.per_device_batch_size=8"])
        == 0
    )
    start = load_file(ensure_demo_model("demo:tiny-qwen2-vl") / "model.safetensors")
    final = final_weights(tmp_path / "r2-vision-only" / "one")
    assert all(torch.equal(final[k], start[k]) for k in start if not is_tower(k))
    assert not all(torch.equal(final[k], start[k]) for k in start if is_tower(k))


def test_the_zero_through_the_embeddings_leaves_every_gradient_of_a_batch_with_images_as_it_was(
    demo_model_dir,
):
    """What makes a batch of text rows reach the trained tower (methods.trainer.
    every_batch_reaches_the_trained_tower) changes no gradient of a batch with images, bit for bit, so a
    one-process run is what it was; a batch of text rows gives the tower a zero gradient, the LLM none."""
    from conftest import single_image_demo_rows
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from vlm_recipes.methods.recipe_trainer import every_batch_reaches_the_trained_tower
    from vlm_recipes.model.build import build_stage_model
    from vlm_recipes.recipe import load_recipe

    built = build_stage_model(str(demo_model_dir), load_recipe("r2-vision-only").stages[0], "fp32", "cpu")
    collate = DataCollatorForVisionLanguageModeling(built.processor, assistant_only_loss=True)
    text_row = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say left."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "left"}]},
        ],
        "images": [],
    }
    with_images = collate([dict(r) for r in single_image_demo_rows(3)] + [text_row])
    text_only = collate([text_row, text_row])

    def gradients(batch) -> dict:
        built.model.zero_grad()
        built.model(**batch).loss.backward()
        return {n: p.grad for n, p in built.model.named_parameters() if p.requires_grad}

    before = gradients(with_images)
    assert every_batch_reaches_the_trained_tower(built.model, built.family).guard == "rows-without-images"
    after = gradients(with_images)
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert all(not g.any() for g in gradients(text_only).values())
    assert all(p.grad is None for p in built.model.parameters() if not p.requires_grad)


@pytest.mark.e2e
def test_bad_data_found_by_ddp_ranks_exits_2_like_a_single_process(tmp_path, private_demo_cache):
    """torchrun reports any failed rank as its own failure (exit 1, its traceback): the launcher gives the
    exit code of the error the ranks recorded."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n')
    result = run_quick_r3(tmp_path, "bad", "--nproc-per-node", "2", f"data.train={bad}")
    assert result.returncode == 2, result.stderr[-4000:]
    manifest = read_json(tmp_path / "r3-two-stage" / "bad" / "run.json")
    assert manifest["status"] == "failed" and manifest["error"].startswith("DataError")
    assert "the row needs a `messages` list" in manifest["error"]


@pytest.mark.e2e
def test_two_nodes_on_localhost_complete_a_stage(tmp_path, private_demo_cache):
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                *TRAIN,
                "--recipe",
                "r2-vision-only",
                "--output-dir",
                str(tmp_path),
                "--run-name",
                "mn",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                *QUICK,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-4000:]
    run_dir = tmp_path / "r2-vision-only" / "mn"
    assert read_json(run_dir / "run.json")["status"] == "finished"
    assert len(list(run_dir.glob("*/DONE"))) == 1
    report = read_json(run_dir / "stage-1-vision-full" / "report.json")
    assert {d["guard"]: d["choice"] for d in report["decisions"]}["same-start"] == "identical on 2 ranks"


# --- decisions (fake GPUs: this machine has none) -----------------------------------------------


def test_auto_with_two_fake_gpus_chooses_ddp_when_the_model_fits_one():
    plan, decision = decide_parallel("auto", TWO_GPUS, ModelFootprint(4.4, 10.0), gpu_memory_gb=80)
    assert plan == ParallelPlan("ddp", 2) and "fits one 80 GB GPU" in decision.reason
    plan, _ = decide_parallel(
        "auto", EIGHT_GPUS, ModelFootprint(4.4, 10.0), gpu_memory_gb=80, nproc_per_node=4
    )
    assert plan == ParallelPlan("ddp", 4)


def test_auto_with_two_fake_gpus_shards_a_model_too_big_for_one():
    plan, decision = decide_parallel("auto", TWO_GPUS, ModelFootprint(15.0, 120.0), gpu_memory_gb=80)
    assert plan.mode == "model-parallel" and plan.processes_per_node == 1
    assert "does not fit one 80 GB GPU" in decision.reason


def test_model_parallel_with_two_fake_gpus_keeps_trainer_on_one_device(tmp_path):
    from vlm_recipes.methods.sft import SFT
    from vlm_recipes.methods.trainer import ConfigInputs
    from vlm_recipes.recipe import load_recipe

    plan, _ = decide_parallel("model-parallel", TWO_GPUS)
    assert plan == ParallelPlan("model-parallel", 1)
    stage = load_recipe("r2-vision-only").stages[0]
    args = SFT().build_config(ConfigInputs(stage, tmp_path, "fp32", CPU, has_eval=False))
    assert args.n_gpu == 0
    args._n_gpu = 2  # what Trainer computes with two GPUs visible to one process (faked)
    apply_parallelism(args)
    assert args.n_gpu == 1


@pytest.mark.parametrize(
    ("requested", "env", "kwargs", "message"),
    [
        (
            "ddp",
            TWO_GPUS,
            {"max_memory_per_gpu": "20GiB"},
            "max_memory_per_gpu shards one model over several GPUs",
        ),
        ("ddp", CPU, {}, "needs at least 2 processes: add --nproc-per-node 2"),
        ("deepspeed", CPU, {"nproc_per_node": 2}, "--parallel deepspeed needs GPUs; on CPU use fsdp or ddp"),
        ("fsdp", CPU, {}, "--parallel fsdp needs at least 2 processes"),
        ("model-parallel", CPU, {}, "needs at least 2 visible GPUs"),
        ("ddp", TWO_GPUS, {"nproc_per_node": 4}, "--nproc-per-node 4 but only 2 GPU(s) are visible"),
    ],
)
def test_impossible_parallel_requests_fail_before_loading(requested, env, kwargs, message):
    with pytest.raises(GuardError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decide_parallel(requested, env, **kwargs)


def test_the_launching_process_leaves_the_training_libraries_to_the_ranks(tmp_path, private_demo_cache):
    """The process the user starts plans the run and launches the ranks; it trains nothing itself when every
    stage is launched, so it imports neither TRL, PEFT, bitsandbytes nor datasets (about 6 s of an
    interpreter's start on 2 cores, paid again by each rank). Planned as a launched run plans (a dry run, in
    a fresh interpreter: this one has them all), on a model already built, as a hub model is."""
    ensure_demo_model("demo:tiny-qwen2-vl")  # building a demo model trains its tokenizer (datasets, TRL)
    code = (
        "import sys; from vlm_recipes.cli.train import main; code = main(sys.argv[1:]); "
        "print(code, *sorted({'trl', 'peft', 'bitsandbytes', 'datasets'} & sys.modules.keys()))"
    )
    args = ["--recipe", "r1-llm-only", "--parallel", "fsdp", "--nproc-per-node", "2", "--dry-run"]
    result = subprocess.run(
        [sys.executable, "-c", code, *args, "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.stdout.splitlines()[-1] == "0", (result.stdout[-2000:], result.stderr[-2000:])


def test_launch_commands_for_one_and_several_nodes():
    """torchrun and accelerate both meet through c10d: on one node at a free local port, on several at node
    0's address; the rendezvous id and the restarts torchrun's elastic agent may make go with them."""
    single = launch_command(ParallelPlan("ddp", 2), ["--resume", "runs/x/y"], NodeSettings(), "r-run-stage1")
    assert single[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
    assert single[5:15] == [
        "--nnodes",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "localhost:0",
        "--rdzv_id",
        "r-run-stage1",
        "--max_restarts",
        "0",
    ]
    node = NodeSettings(2, 1, "10.0.0.1", 29500, max_restarts=3)
    multi = launch_command(ParallelPlan("ddp", 8, 2), ["--resume", "r"], node, "r-run-stage2")
    assert multi[5:15] == [
        "--nnodes",
        "2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "10.0.0.1:29500",
        "--rdzv_id",
        "r-run-stage2",
        "--max_restarts",
        "3",
    ]
    fsdp = launch_command(ParallelPlan("fsdp", 8, 2), [], node, "r-run-stage2")
    assert fsdp[1:5] == ["-m", "accelerate.commands.launch", "--config_file", str(CONFIGS_DIR / "fsdp.yaml")]
    assert fsdp[fsdp.index("--rdzv_backend") :][:4] == ["--rdzv_backend", "c10d", "--max_restarts", "3"]
    assert multi[15:17] == ["--rdzv_conf", "is_host=0"]  # node 1: node 0 hosts the store (test_hosts.py)
    # accelerate's parser takes no rendezvous id: torchrun's parser reads it from PET_RDZV_ID. This node's
    # address toward 10.0.0.1 and its interface, where this machine has a route (test_cluster.py)
    environment = launch_environment(ParallelPlan("fsdp", 8, 2), node, "r-run-stage2")
    assert {k: v for k, v in environment.items() if k not in ("PET_LOCAL_ADDR", "GLOO_SOCKET_IFNAME")} == {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PET_RDZV_ID": "r-run-stage2",
        "PET_RDZV_ENDPOINT": "10.0.0.1:29500",
        "PET_NNODES": "2",
    }
    zero3 = launch_command(ParallelPlan("deepspeed", 8), [], NodeSettings(accelerate_config="zero3"), "r")
    assert zero3[4] == str(CONFIGS_DIR / "zero3.yaml")
    with pytest.raises(GuardError, match="not one of ddp, fsdp, zero2, zero3"):
        launch_command(ParallelPlan("deepspeed", 8), [], NodeSettings(accelerate_config="zero4"), "r")


@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero2", "zero3"])
def test_shipped_accelerate_configs_are_valid(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(CONFIGS_DIR / f"{name}.yaml"))
    expected = {"ddp": "MULTI_GPU", "fsdp": "FSDP", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED"}[name]
    assert config.distributed_type.value == expected
    if name == "fsdp":
        assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"  # a file per rank
    assert Path(CONFIGS_DIR / f"{name}.yaml").read_text().startswith("#")


# Stages using the devices differently (stage 1 launched as 2 DDP processes, stage 2 in one process, the
# launching one or a resuming one after --until-stage 1): tests/test_family_features.py, on every family but
# Qwen2-VL.


def test_final_from_gathered_state_equals_final_from_the_live_model(demo_model_dir, tmp_path):
    """FSDP / DeepSpeed runs write final/ from the state dict accelerate gathers (every rank takes part).
    Accelerate runs FSDP only on GPUs; on CPU the same path is driven with an unsharded model, whose
    gathered state dict is the whole model: the result must equal final/ made from the live model."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForImageTextToText

    from vlm_recipes.model.build import build_stage_model
    from vlm_recipes.recipe import load_recipe
    from vlm_recipes.stages.outputs import model_for_final

    stage = load_recipe(
        "r1-llm-only", ["stages.llm-lora.quantization.mode=none", "stages.llm-lora.train.projector=full"]
    ).stages[0]
    built = build_stage_model(str(demo_model_dir), stage, "fp32", "cpu")
    torch.manual_seed(0)
    with torch.no_grad():  # as if trained: adapters and the fully trained projector moved
        for param in built.model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.01)
    gathered = Accelerator(cpu=True).get_state_dict(built.model)
    built.model.save_pretrained(tmp_path / "adapter-gathered", state_dict=gathered)
    from_gathered = model_for_final(
        built, built.model, tmp_path / "adapter-gathered", False, gathered_state=gathered
    ).state_dict()
    built.model.save_pretrained(tmp_path / "adapter-live")
    from_live = model_for_final(built, built.model, tmp_path / "adapter-live", False).state_dict()
    assert from_gathered.keys() == from_live.keys()
    for name, value in from_live.items():
        assert torch.allclose(from_gathered[name], value, atol=1e-6), name
    projector = next(n for n in from_live if "merger" in n and n.endswith("weight"))
    source = AutoModelForImageTextToText.from_pretrained(demo_model_dir).state_dict()[projector]
    assert not torch.equal(from_live[projector], source), "the trained projector reached final/"
