"""Shared fixtures: every test builds the demo model and data into a private cache, never the user's."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def gpus_on_this_machine() -> list[str]:
    """The ids of the GPUs this process may use (`nvidia-smi -L`, within CUDA_VISIBLE_DEVICES if set), found
    without starting CUDA (torch caches its device count at the first question)."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    ids = [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [i for i in (v.strip() for v in visible.split(",")) if i in ids]
    return ids


# The suite takes the CPU path on every machine, a GPU machine too: CI's path, the noise floors the proofs
# were measured on, DDP and FSDP on CPU ranks. Seen on an H100 with the GPU visible: 4-bit models land on
# cuda beside inputs on the CPU, the cuDNN convolution's TF32 moves a proof past its CPU floor, and every
# `--nproc-per-node 2` run is refused for want of a second GPU. What a GPU changes is tested by
# tests/test_on_a_gpu.py, through the user's command with --gpu, which makes the GPU visible again to that
# process alone. Set before anything imports torch.
# pytest-xdist's workers inherit the emptied CUDA_VISIBLE_DEVICES from the controller, which imported this
# file first: they read the GPUs it found from GPUS_FOUND (seen on an H100: every GPU test skipped otherwise).
GPUS_FOUND = "VLM_RECIPES_TESTS_GPUS"
GPUS = os.environ[GPUS_FOUND].split(",") if os.environ.get(GPUS_FOUND) else gpus_on_this_machine()
os.environ[GPUS_FOUND] = ",".join(GPUS)
os.environ["CUDA_VISIBLE_DEVICES"] = ""

if "PYTEST_XDIST_WORKER" in os.environ:
    # Two workers share the cores: torch's OpenMP threads from both would fight over them (steps 50x
    # slower seen). One thread each, inherited by the runs the tests start.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--every-family",
        action="store_true",
        help="also run the every_family tests (each family's demo model pretrained: 20-30 min, 2 cores)",
    )


# The files that take minutes on 2 cores (--durations on an AVX2 AMD EPYC, 2026-11-26), longest first. xdist
# hands each worker a whole file (--dist loadfile) in collection order (--no-loadscope-reorder): the long files
# start first and the short ones fill in at the end, so the two workers end together. In xdist's own order
# (most tests first) the last file, test_fsdp_stages.py, ran 4 minutes alone while the other worker idled.
LONGEST_FILES_FIRST = (
    "test_parallel.py",  # ~9 min: FSDP and DDP on two CPU ranks, each rank a process
    "test_family_features.py",  # ~8 min: 12 families' DDP run, then resumed
    "test_families.py",  # ~7 min: every family's seed recipes in bf16 and fp32
    "test_demo_pretraining.py",  # ~5 min: the Qwen2-VL demo model's pretraining, then the teaching tests
    "test_fsdp_stages.py",
    "test_resume.py",
    "test_grpo.py",
    "test_dpo.py",
    "test_speedups.py",
    "test_data_formats.py",
)


def pytest_collection_modifyitems(config, items):
    """Long files first (LONGEST_FILES_FIRST; the rest in their own order). The every_family tests pretrain
    13 demo models, beyond CI's budget: run on request, else skipped saying how."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    # a stable sort: each file's tests keep their order, and the files not listed theirs
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if config.getoption("--every-family"):
        return
    skip = pytest.mark.skip(
        reason="pretrains every family's demo model (20-30 min, 2 cores): pytest --every-family -m every_family"
    )
    for item in items:
        if "every_family" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def private_demo_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("vlm-recipes-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLM_RECIPES_CACHE", str(cache))
        # The demo models' random weights: every family's is built in seconds, and the mechanics the tests
        # check need no pretraining (tests/test_demo_pretraining.py takes the pretrained ones).
        mp.setenv("VLM_RECIPES_DEMO_WEIGHTS", "untrained")
        mp.setenv("HF_HUB_OFFLINE", "1")  # tests never reach a hub
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        fix_the_cpus_bf16_answer()
        yield cache


def torch_global_state() -> dict:
    """What one test could leave behind for the next on the same worker and change its arithmetic: autocast
    on the CPU, fp32 matmuls allowed a lower precision (oneDNN computes them in bf16 on an AVX512-BF16 CPU),
    the thread count (the summation order), the default dtype, gradients off."""
    import torch

    return {
        "cpu autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "fp32 precision": getattr(torch.backends, "fp32_precision", None),
        "mkldnn fp32 precision": getattr(
            getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", None
        ),
        "threads": torch.get_num_threads(),
        "default dtype": torch.get_default_dtype(),
        "grad enabled": torch.is_grad_enabled(),
    }


@pytest.fixture(autouse=True)
def torch_state_left_as_found(request):
    """A test that changes torch's global state fails here, naming what it changed, and the state is put back:
    a later test on the same worker never inherits it (packed-video losses once differed by 5e-4 in the full
    suite, not alone)."""
    before = torch_global_state()
    yield
    after = torch_global_state()
    changed = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    if changed:
        import torch

        torch.set_autocast_enabled("cpu", before["cpu autocast"][0])
        torch.set_autocast_dtype("cpu", before["cpu autocast"][1])
        torch.set_float32_matmul_precision(before["float32 matmul precision"])
        torch.set_num_threads(before["threads"])
        torch.set_default_dtype(before["default dtype"])
        torch.set_grad_enabled(before["grad enabled"])
        if before["fp32 precision"] is not None:
            torch.backends.fp32_precision = before["fp32 precision"]
        if before["mkldnn fp32 precision"] is not None:
            torch.backends.mkldnn.matmul.fp32_precision = before["mkldnn fp32 precision"]
        pytest.fail(f"{request.node.nodeid} changed torch's global state (before, after): {changed}")


def fix_the_cpus_bf16_answer() -> None:
    """Every test takes the same path on every CPU: this machine's answer to "native bf16?" is kept as "no"
    in the private cache (the answer the product keeps per machine after its probe), so `precision: auto`
    trains in fp32, at full speed on any CPU, in this process and every run a test starts. A test that needs
    bf16 sets `precision: bf16`; tests/test_machine.py injects the instruction set and the probe's timings
    to test the decision itself. The answer is kept per thread count: it is kept for every count a run
    here can take (1 in an xdist worker and in each rank of a CPU group, the cores outside them)."""
    import torch

    from vlm_recipes.machine import CpuBf16, cpu_bf16_on, cpu_instruction_set, remember_cpu_bf16

    instruction_set = cpu_instruction_set()
    fixed = "tests/conftest.py: the suite takes the fp32 path of precision: auto on every CPU"
    for threads in range(1, max(os.cpu_count() or 1, torch.get_num_threads()) + 1):
        remember_cpu_bf16(CpuBf16(instruction_set, native=False, reason=fixed), threads)
    cpu_bf16_on.cache_clear()


@pytest.fixture(scope="session")
def demo_model_dir(private_demo_cache) -> Path:
    from vlm_recipes.demo.models import ensure_demo_model

    return ensure_demo_model()


# LLaMA-Factory's sharegpt `tags` for OpenAI-style messages (dataset_info.json), as the data tests write them
OPENAI_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}


def _tiny_models() -> dict[str, str]:
    """Each registered family's tiny offline model by the family's name (its `demo:tiny-<name>`), in the
    registry's order: a family added to FAMILIES joins every test that iterates these, and `tiny_family`."""
    from vlm_recipes.families import FAMILIES

    return {family.name: f"demo:tiny-{family.name}" for family in FAMILIES}


TINY_MODELS = _tiny_models()  # tests that hold for every family take `tiny_family`


@pytest.fixture(scope="session", params=list(TINY_MODELS))
def tiny_family(request, private_demo_cache):
    """(family, model directory) of one family's tiny model; each is built once per session."""
    from vlm_recipes.demo.models import DEMO_MODELS, ensure_demo_model

    family = DEMO_MODELS[TINY_MODELS[request.param]].family
    return family, ensure_demo_model(TINY_MODELS[request.param])


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    """Write a module into a fresh working directory (a user's reward functions); its imports are forgotten
    afterwards, so a later test writing a module of the same name imports its own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # build_rewards puts the working directory on it
    written = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


@pytest.fixture()
def in_repo(monkeypatch):
    """Run with the repository as working directory (recipes/ found as a user would)."""
    monkeypatch.chdir(REPO)
    return REPO


def write_recipe(directory: Path, name: str, text: str) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(text)
    return path


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false")


def training_chat_template(processor) -> str | None:
    """The chat template TRL's collator trains with: TRL's training variant of the processor's (None: the
    processor's own), or, for a template TRL has none for (Gemma 4's), the family's (load_processor's)."""
    from trl.chat_template_utils import get_training_chat_template

    from vlm_recipes.families import FAMILIES

    try:
        return get_training_chat_template(processor)
    except ValueError:
        for family in FAMILIES:
            if template := family.training_chat_template(processor):
                return template
        raise


def distance_and_share_beyond(one: dict, other: dict, threshold: float) -> tuple[float, float]:
    """Two sets of trained weights (name -> tensor): their largest element distance, and the share of the
    elements further apart than `threshold`. Adam's first steps move an element by about lr x g / (|g| +
    eps): the few elements whose gradient is near eps carry summation-order noise far beyond the rest, so the
    proofs bound both."""
    apart = [(one[k] - other[k]).abs() for k in one]
    distance = max(t.max().item() for t in apart)
    share = sum(int((t > threshold).sum()) for t in apart) / sum(t.numel() for t in apart)
    return distance, share


def model_inputs(processor, rows, **kwargs):
    """A padded batch of model inputs for dataset rows (their images attached to the image parts)."""
    from vlm_recipes.evaluation.generation import attach_images

    messages = [attach_images(row["messages"], row["images"]) for row in rows]
    return processor.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"padding": True},
        **kwargs,
    )


TRAIN = [sys.executable, str(REPO / "scripts" / "train_recipe.py")]  # the user's command, as a subprocess
# the same command, killed at $VLM_RECIPES_FAULT (tests/fault_injection.py)
TRAIN_WITH_FAULT = [sys.executable, str(REPO / "tests" / "fault_injection.py")]


def run_train(
    *args: str, timeout: int = 600, env: dict | None = None, fault: str | None = None
) -> subprocess.CompletedProcess:
    """`train_recipe.py ARGS` in a fresh process, as a user runs it; output captured as text. With `fault`,
    the process is killed at that point (see tests/fault_injection.py)."""
    command = TRAIN
    if fault:
        env = {**(env if env is not None else os.environ), "VLM_RECIPES_FAULT": fault}
        command = TRAIN_WITH_FAULT
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, env=env)


def folder_like_a_clone(folder: Path) -> Path:
    """A folder the shipped sbatch example runs from as from a clone: it runs `.venv/bin/python
    scripts/train_recipe.py`. Here .venv is this interpreter's environment (a git worktree has none of its
    own) and scripts/ the repository's."""
    folder.mkdir(parents=True)
    (folder / "scripts").symlink_to(REPO / "scripts")
    if sys.prefix != sys.base_prefix:  # a virtual environment: the whole of it (pyvenv.cfg beside bin/)
        (folder / ".venv").symlink_to(sys.prefix)
    else:
        (folder / ".venv" / "bin").mkdir(parents=True)
        (folder / ".venv" / "bin" / "python").symlink_to(sys.executable)
    return folder


def demo_split(source: str, split: str, n: int | None = None):
    """A demo data id's rows (`demo:train`, ...) without its video rows, loaded and checked as a stage loads
    them: the id resolved to its file first, as the runner does when it plans a stage."""
    from vlm_recipes.data.rows import load_split
    from vlm_recipes.demo.dataset import resolve_data_source

    return load_split(source, split, n, path=resolve_data_source(source, with_videos=False))


def demo_paths(settings) -> dict[str, str]:
    """Where a stage's demo data ids are (video rows left out), as the runner hands them to the stage."""
    from vlm_recipes.demo.dataset import resolve_data_source

    return {s: resolve_data_source(s, with_videos=False) for s in (settings.train, settings.eval) if s}


def single_image_demo_rows(n: int | None = None):
    """The demo train split's one-image rows (tasks shapes and nutrition), loaded as load_split loads them
    (images decodable). Tests of image mechanics use these; two-image and video rows have their own."""
    from vlm_recipes.data.rows import load_split
    from vlm_recipes.demo.dataset import ensure_demo_dataset

    ds, _ = load_split(str(ensure_demo_dataset() / "train-images.jsonl"), "train", None)
    keep = [i for i, task in enumerate(ds["task"]) if task in ("shapes", "nutrition")]
    return ds.select(keep[:n] if n else keep)


def single_image_demo_file(directory: Path, split: str = "train") -> Path:
    """A JSONL of the demo split's one-image rows, image paths made absolute: data for a speed-up a family
    refuses on samples of several images (LLaVA-OneVision's feature cache)."""
    import json

    from vlm_recipes.demo.dataset import ensure_demo_dataset

    root = ensure_demo_dataset()
    rows = [json.loads(line) for line in (root / f"{split}-images.jsonl").read_text().splitlines()]
    kept = [
        {**row, "images": [str(root / p) for p in row["images"]]}
        for row in rows
        if row["task"] in ("shapes", "nutrition")
    ]
    path = directory / f"{split}-one-image.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in kept))
    return path


def assert_reads_back_the_batch(cached, stored: list[dict], expected: dict) -> None:
    """A preprocessed-sample cache gives the collator's batch, tensor for tensor, cold (each row through the
    collator) and warm (read back)."""
    import torch

    for attempt in ("cold", "warm"):
        batch = cached([dict(r) for r in stored])
        assert batch.keys() == expected.keys(), attempt
        for key, value in expected.items():
            assert torch.equal(batch[key], value), (attempt, key)


def model_torch_can_count(model_dir, family):
    """The tiny model in fp32 with kernels torch's counter sees: eager attention (torch 2.14's counter does
    not see the CPU SDPA kernel, 2.15's does) and, for an MoE, one matmul per expert (transformers'
    default grouped kernel is invisible to it)."""
    import torch
    from transformers import AutoModelForImageTextToText

    moe = {"experts_implementation": "eager"} if "moe" in family.name else {}
    return AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", **moe
    )


def assert_image_tokens_attend_both_ways(model_dir, batch: dict, is_image, token_types: str) -> None:
    """With the collator's `token_types` (1 on image tokens), Gemma lets an image's tokens attend to each
    other both ways: the first image token's output changes (it sees its image's later tokens), the text
    before the image does not. On the batch's first row."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    first = is_image[0].nonzero()[0].item()
    inputs = {k: v[:1] for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        both_ways = model(**inputs).logits[0]
        causal = model(**{k: v for k, v in inputs.items() if k != token_types}).logits[0]
    assert torch.equal(both_ways[:first], causal[:first])
    assert not torch.allclose(both_ways[first], causal[first]), "the first image token sees its image"


def assert_padding_free_refused_before_loading(code: int, err: str, family: str) -> None:
    """A family whose image tokens attend both ways refuses padding-free packing at the data check."""
    assert code == 2, err
    assert f"training.padding_free is refused for {family}" in err
    assert "bidirectionally among each image's tokens" in err and "padding_free: false" in err
    assert "loading" not in err, "refused before the model loads"
