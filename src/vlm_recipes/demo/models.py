"""The `demo:` registry: tiny offline models (one or more per family) and the synthetic datasets.

Recipes name ``demo:tiny-qwen2-vl`` as their model and ``demo:train`` / ``demo:eval`` as their data, so
every recipe runs end to end on a laptop CPU without a model hub. ``DEMO_MODELS`` lists them: each id's
family, its builder in ``demo/tiny/`` and the settings it builds. A model is built on first use,
deterministically (fixed seeds, no network), and cached under ``cache_dir() / VERSION``; later calls only
check that the files are there. The families know nothing of these models: the table is the demo's.

The ``demo:tiny-*`` models are then pretrained once (demo/pretraining.yaml: shapes asked their colour, kind
and place, in words, yes/no and JSON), so that a recipe starts from a small model that sees and says
something, as it would from a real one, rather than from random weights. ``VLM_RECIPES_DEMO_WEIGHTS=untrained`` gives the random
weights instead: the test suite's default, where only the mechanics are tested and every family's model is
built in seconds.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vlm_recipes.demo.dataset import VERSION, tokenizer_corpus
from vlm_recipes.demo.tiny import (
    gemma3,
    gemma4,
    glm4v,
    internvl,
    kimi_k25,
    lfm2_vl,
    llama4,
    llava_onevision,
    minicpm_v,
    mistral3,
    molmo2,
    qwen2_5_vl,
    qwen2_vl,
    qwen3_5,
    qwen3_omni,
    qwen3_vl,
    smolvlm,
)
from vlm_recipes.errors import UnsupportedModelError
from vlm_recipes.families.base import Family
from vlm_recipes.families.gemma3 import GEMMA3
from vlm_recipes.families.gemma4 import GEMMA4
from vlm_recipes.families.glm4v import GLM4V, GLM4V_MOE
from vlm_recipes.families.internvl import INTERNVL
from vlm_recipes.families.llava_onevision import LLAVA_ONEVISION
from vlm_recipes.families.mistral3 import MISTRAL3
from vlm_recipes.families.qwen2_5_vl import QWEN2_5_VL
from vlm_recipes.families.qwen2_vl import QWEN2_VL
from vlm_recipes.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from vlm_recipes.families.qwen3_vl import QWEN3_VL
from vlm_recipes.families.smolvlm import SMOLVLM
from vlm_recipes.files import build_dir_atomically, cache_dir, read_json, write_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoModel:
    """A demo:… model: the family it is a model of (None: a model type no family module names, trained
    through the generic family), its builder (real processor class, special tokens and chat template, a
    tokenizer trained on the demo texts, random weights) and the settings it builds."""

    family: Family | None
    build: Callable[[Path, dict, list[str]], None]  # (out, dims, tokenizer corpus)
    dims: dict


DEMO_MODELS: dict[str, DemoModel] = {
    "demo:tiny-qwen2-vl": DemoModel(QWEN2_VL, qwen2_vl.build_tiny_qwen2_vl, qwen2_vl.TINY),
    # ~16M parameters, for scripts/benchmark.py
    "demo:bench-qwen2-vl": DemoModel(QWEN2_VL, qwen2_vl.build_tiny_qwen2_vl, qwen2_vl.BENCH),
    # Qwen2-VL-2B's widths, 1/7 of its depth (CPU bench)
    "demo:bench-qwen2-vl-wide": DemoModel(QWEN2_VL, qwen2_vl.build_tiny_qwen2_vl, qwen2_vl.BENCH_WIDE),
    # Qwen2-VL-2B's dimensions, random weights (GPU bench)
    "demo:qwen2-vl-2b-shaped": DemoModel(QWEN2_VL, qwen2_vl.build_tiny_qwen2_vl, qwen2_vl.QWEN2_VL_2B_SHAPED),
    "demo:tiny-qwen2.5-vl": DemoModel(QWEN2_5_VL, qwen2_5_vl.build_tiny_qwen2_5_vl, qwen2_5_vl.TINY),
    "demo:tiny-qwen3-vl": DemoModel(QWEN3_VL, qwen3_vl.build_tiny_qwen3_vl, qwen3_vl.TINY),
    "demo:tiny-qwen3.5": DemoModel(QWEN3_5, qwen3_5.build_tiny_qwen3_5, qwen3_5.TINY),
    "demo:tiny-qwen3.5-moe": DemoModel(QWEN3_5_MOE, qwen3_5.build_tiny_qwen3_5, qwen3_5.TINY_MOE),
    "demo:tiny-smolvlm": DemoModel(SMOLVLM, smolvlm.build_tiny_smolvlm, smolvlm.TINY),
    "demo:tiny-gemma3": DemoModel(GEMMA3, gemma3.build_tiny_gemma3, gemma3.TINY),
    "demo:tiny-gemma4": DemoModel(GEMMA4, gemma4.build_tiny_gemma4, gemma4.TINY),
    "demo:tiny-llava-onevision": DemoModel(
        LLAVA_ONEVISION, llava_onevision.build_tiny_llava_onevision, llava_onevision.TINY
    ),
    "demo:tiny-mistral3": DemoModel(MISTRAL3, mistral3.build_tiny_mistral3, mistral3.TINY),
    "demo:tiny-glm4v": DemoModel(GLM4V, glm4v.build_tiny_glm4v, glm4v.TINY),
    "demo:tiny-glm4v-moe": DemoModel(GLM4V_MOE, glm4v.build_tiny_glm4v, glm4v.TINY_MOE),
    "demo:tiny-internvl": DemoModel(INTERNVL, internvl.build_tiny_internvl, internvl.TINY),
    # model types without a family module, trained through the generic family
    "demo:tiny-lfm2-vl": DemoModel(None, lfm2_vl.build_tiny_lfm2_vl, lfm2_vl.TINY),
    "demo:tiny-minicpm-v4.6": DemoModel(None, minicpm_v.build_tiny_minicpm_v, minicpm_v.TINY),
    "demo:tiny-molmo2": DemoModel(None, molmo2.build_tiny_molmo2, molmo2.TINY),
    "demo:tiny-kimi-k2.5": DemoModel(None, kimi_k25.build_tiny_kimi_k25, kimi_k25.TINY),
    "demo:tiny-llama4": DemoModel(None, llama4.build_tiny_llama4, llama4.TINY),
    "demo:tiny-qwen3-omni-thinker": DemoModel(None, qwen3_omni.build_tiny_qwen3_omni, qwen3_omni.TINY),
}
DEMO_MODEL_ID = "demo:tiny-qwen2-vl"  # the embedded default's model
DEMO_MODEL_IDS = tuple(DEMO_MODELS)
WEIGHTS_ENV = "VLM_RECIPES_DEMO_WEIGHTS"  # pretrained (default) or untrained
PRETRAINED_PREFIX = "demo:tiny-"  # the benchmark's bench-* and *-shaped models keep random weights
PRETRAINING_RECIPE = Path(__file__).with_name("pretraining.yaml")

_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "processor_config.json",
    "chat_template.jinja",
)


def ensure_demo_model(model_id: str = DEMO_MODEL_ID, weights: str | None = None) -> Path:
    """The directory of a demo model (weights, processor, tokenizer, chat template); built on first use, and
    for a ``demo:tiny-*`` model pretrained on first use unless VLM_RECIPES_DEMO_WEIGHTS (or `weights`) is
    `untrained`."""
    demo = DEMO_MODELS.get(model_id)
    if demo is None:
        raise UnsupportedModelError(
            f"unknown demo model {model_id!r}; demo models: {', '.join(DEMO_MODEL_IDS)}"
        )
    name = model_id.removeprefix("demo:")
    untrained = build_dir_atomically(
        cache_dir() / VERSION / name,
        _MODEL_FILES,
        lambda out: demo.build(out, demo.dims, tokenizer_corpus()),
        f"demo model {name}",
    )
    if not model_id.startswith(PRETRAINED_PREFIX) or (weights or demo_weights()) == "untrained":
        return untrained
    return build_dir_atomically(
        cache_dir() / VERSION / f"{name}-pretrained",
        (*_MODEL_FILES, "pretraining.json"),
        lambda out: pretrain(untrained, out),
        f"pretrained demo model {name}",
    )


def demo_weights() -> str:
    """What `demo:tiny-*` means here: `pretrained` (default) or `untrained` (VLM_RECIPES_DEMO_WEIGHTS)."""
    value = os.environ.get(WEIGHTS_ENV, "pretrained")
    if value not in ("pretrained", "untrained"):
        raise UnsupportedModelError(f"{WEIGHTS_ENV}={value!r}: use pretrained or untrained")
    return value


def pretrain(untrained: Path, out: Path) -> None:
    """Run demo/pretraining.yaml on the untrained model, in a process of its own (a run of the runner, with
    its guards and its freeze audit), and keep its final/ with the run's log and metrics in `out`.

    A separate process: the pretraining may start inside another run (the first stage that names the model),
    whose lock, logging and Trainer state it must not touch."""
    started = time.time()
    log.info(
        "Pretraining demo model %s once (%s: shapes' colours, kinds and places, about a minute on 2 cores); "
        "cached in %s",
        untrained.name,
        PRETRAINING_RECIPE.name,
        out.parent,
    )
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".pretraining-") as runs:
        command = [sys.executable, "-m", "vlm_recipes", "train", "--recipe", str(PRETRAINING_RECIPE)]
        command += ["--output-dir", runs, "--run-name", "run", f"model={untrained}"]
        with open(out / "pretraining.log", "w", encoding="utf-8") as log_file:
            done = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, check=False)
        if done.returncode != 0:
            kept = out.parent / f"{untrained.name}-pretraining-failed.log"
            shutil.copyfile(out / "pretraining.log", kept)
            raise RuntimeError(f"pretraining demo model {untrained.name} failed; its log: {kept}")
        stage = Path(runs) / "pretraining" / "run" / "stage-1-pretraining"
        for path in (stage / "final").iterdir():
            shutil.copy2(path, out / path.name)
        metrics = read_json(stage / "metrics.json")
    summary = {
        "recipe": PRETRAINING_RECIPE.name,
        "from": str(untrained),
        "steps": metrics["steps"],
        "final_train_loss": metrics["final_train_loss"],
        "eval_loss": metrics["eval_loss"],
        "eval": metrics.get("eval"),
        "wall_time_s": round(time.time() - started, 1),
    }
    write_json(out / "pretraining.json", summary)
    exact = (metrics.get("eval") or {}).get("all", {}).get("exact_match")
    log.info(
        "Pretrained demo model %s in %.0f s: eval loss %.3f, exact match %s on its held-out questions",
        untrained.name,
        summary["wall_time_s"],
        metrics["eval_loss"],
        "-" if exact is None else f"{exact:.3f}",
    )


def config_source(source: str) -> str:
    """Where a model's config is read for a plan on the meta device: for a demo model its untrained directory
    (built in seconds; the same config as the pretrained one), so `--dry-run` never waits for a pretraining."""
    if source in DEMO_MODEL_IDS:
        return str(ensure_demo_model(source, weights="untrained"))
    return source


def resolve_model_source(source: str) -> str:
    """Map the demo model ids to their local directories; return anything else unchanged."""
    if source in DEMO_MODEL_IDS:
        return str(ensure_demo_model(source))
    return source
