"""Liger's kernels reach every family's decoder that Liger has functions for (speedups/liger.py): each family's
tiny model patched on the CPU, nothing run (Triton needs CUDA; tests/test_on_a_gpu.py trains with them), and
every RMSNorm, LayerNorm, MLP and expert bank of its language model then runs Liger's kernel, counted against
the model's own modules; a family whose type and parts Liger's table lacks is left as it is, saying so.
docs/results/liger-kernels.md's "Liger's kernels by family" is what the code prints.

Liger patches transformers' modeling modules for the whole process (classes and functions, besides the
model's own modules), so the patching runs in a process of its own (one for all the families), which prints
what it found as JSON."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, TINY_MODELS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel (pip install -e '.[dev]')"
)

# Run in its own process: every family's tiny model (on the meta device) patched by the product's code, then
# its language model's layers read by this test's own rules, not the product's.
PATCH_EVERY_FAMILY = textwrap.dedent(
    """
    import json, logging
    from collections import Counter
    from torch import nn
    from vlm_recipes.benchmarking import liger_table
    from vlm_recipes.speedups import liger

    logging.disable(logging.WARNING)

    def own_kind(module):
        # the layers a decoder has, by transformers' class names; an RMSNorm without a weight (Gemma 4's
        # v_norm) has nothing to fuse, and a gated one (Qwen3.5's linear attention's) is another function
        name = type(module).__name__
        if name.endswith("RMSNorm") and getattr(module, "weight", None) is not None:
            return "norm"
        if isinstance(module, nn.LayerNorm):
            return "norm"
        if name.lower().endswith("mlp"):
            return "mlp"
        if name.endswith("Experts"):
            return "experts"
        return None

    def runs_liger(module):
        forward = getattr(module.__dict__.get("forward"), "__func__", None)
        return (forward is not None and forward.__module__.startswith("liger_kernel.")) or type(
            module
        ).__module__.startswith("liger_kernel.")

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    rows = []
    families = {}
    for name, model, patch in liger_table.patched_demo_models():
        parts = [model.config, model.config.get_text_config(), getattr(model.config, "vision_config", None)]
        types = [getattr(config, "model_type", None) for config in parts]
        rows.append((name, model, patch))
        own, unpatched = Counter(), []
        for module_name, module in model.get_decoder().named_modules():
            if kind := own_kind(module):
                own[kind] += 1
                if not runs_liger(module):
                    unpatched.append(f"{module_name} ({type(module).__name__})")
        patched = isinstance(patch, liger.LigerPatch)
        families[name] = {
            "own": own,
            "unpatched": unpatched,
            "path": patch.path if patched else None,
            "why": None if patched else str(patch),
            "reported": patch.language_model if patched else {},
            "counts": patch.counts() if patched else None,
            # Liger's own table has a function for the model type or one of its parts
            "liger_knows": any(t in MODEL_TYPE_TO_APPLY_LIGER_FN for t in types),
        }
    print(json.dumps({"families": families, "markdown": liger_table.markdown(rows)}))
    """
)


@pytest.fixture(scope="module")
def every_family():
    """What patching found in each family's model (the demo models built into the suite's private cache)."""
    done = subprocess.run(
        [sys.executable, "-c", PATCH_EVERY_FAMILY], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_norm_and_mlp_of_every_familys_decoder_runs_a_liger_kernel(every_family):
    families = every_family["families"]
    assert set(TINY_MODELS) <= set(families)
    for name in TINY_MODELS:
        found = families[name]
        if not found["liger_knows"]:  # no function for the type nor its parts: off, the reason in the table
            assert found["path"] is None and "Liger has no kernels for model type" in found["why"], found
            continue
        assert found["path"] in ("a", "b", "c"), f"{name}: no Liger kernels ({found['why']})"
        assert not found["unpatched"], f"{name}: left as torch's: {found['unpatched']}"
        own, reported = found["own"], found["reported"]
        assert own.get("norm") and own.get("mlp"), f"{name}: the rules find the decoder's layers ({own})"
        # what the decision reports, against the model's own modules
        norms = reported.get("RMSNorm", 0) + reported.get("LayerNorm", 0)
        mlps = reported.get("SwiGLU", 0) + reported.get("GEGLU", 0)
        assert (norms, mlps, reported.get("SwiGLU experts", 0)) == (
            own.get("norm", 0),
            own.get("mlp", 0),
            own.get("experts", 0),
        ), f"{name}: reported {found['counts']}, the decoder has {own}"
    # the families whose Liger function cannot import its fused-loss module under transformers 5.24 get their
    # layers through it all the same (path b), and LLaVA-OneVision and Mistral 3 through their parts' (c)
    paths = {name: families[name]["path"] for name in TINY_MODELS}
    assert {n for n, p in paths.items() if p == "c"} == {"llava-onevision", "mistral3"}, paths


def test_the_docs_table_is_what_the_code_prints(every_family):
    """docs/results/liger-kernels.md's "Liger's kernels by family" is `python -m vlm_recipes.benchmarking.liger_table`'s output."""
    lines = (
        (REPO / "docs" / "results" / "liger-kernels.md")
        .read_text()
        .split("Liger's kernels by family", 1)[1]
        .splitlines()
    )
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    printed = every_family["markdown"]
    assert "".join(f"{line}\n" for line in lines[start:end]) == printed, (
        "docs/results/liger-kernels.md's table differs from the code's; paste `python -m vlm_recipes.benchmarking.liger_table`:\n"
        + printed
    )


def test_the_tables_models_are_the_registrys(monkeypatch):
    """A family added to FAMILIES has its row when the table is printed again, and so has each type the generic
    family trains with knowledge of its own (GENERIC_WITH_KNOWLEDGE): no list of models elsewhere."""
    from vlm_recipes import families
    from vlm_recipes.benchmarking.liger_table import demo_models
    from vlm_recipes.families.base import LLAVA_STYLE_ROLES, Family

    new = Family(name="new-vlm", model_types=("new_vlm",), role_prefixes=LLAVA_STYLE_ROLES)
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, new))
    monkeypatch.setattr(
        families, "GENERIC_WITH_KNOWLEDGE", {"molmo2": families.GENERIC_WITH_KNOWLEDGE["molmo2"]}
    )
    models = demo_models()
    assert models["new-vlm"] == "demo:tiny-new-vlm" and models["molmo2"] == "demo:tiny-molmo2"
    assert list(models)[: len(TINY_MODELS)] == list(TINY_MODELS) and "llama4" not in models
