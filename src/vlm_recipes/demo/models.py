"""The `demo:` registry: tiny offline models (one or more per family) and the synthetic datasets.

Recipes name ``demo:tiny-qwen2-vl`` as their model and ``demo:train`` / ``demo:eval`` as their data, so
every recipe runs end to end on a laptop CPU without a model hub. Each model is built by its family's
``build_tiny`` on first use, deterministically (fixed seeds, no network), and cached under
``cache_dir() / VERSION``; later calls only check that the files are there.
"""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.data import VERSION, tokenizer_corpus
from vlm_recipes.errors import UnsupportedModelError
from vlm_recipes.families import FAMILIES, family_of_demo_model
from vlm_recipes.files import build_dir_atomically, cache_dir

DEMO_MODEL_ID = "demo:tiny-qwen2-vl"  # the embedded default's model
DEMO_MODEL_IDS = tuple(model_id for family in FAMILIES for model_id in family.demo_models)

_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "processor_config.json",
    "chat_template.jinja",
)


def ensure_demo_model(model_id: str = DEMO_MODEL_ID) -> Path:
    """The directory of a demo model (weights, processor, tokenizer, chat template); built on first use."""
    found = family_of_demo_model(model_id)
    if found is None:
        raise UnsupportedModelError(
            f"unknown demo model {model_id!r}; demo models: {', '.join(DEMO_MODEL_IDS)}"
        )
    family, dims = found
    name = model_id.removeprefix("demo:")
    return build_dir_atomically(
        cache_dir() / VERSION / name,
        _MODEL_FILES,
        lambda out: family.build_tiny(out, dims, tokenizer_corpus()),
        f"demo model {name}",
    )


def resolve_model_source(source: str) -> str:
    """Map the demo model ids to their local directories; return anything else unchanged."""
    if source in DEMO_MODEL_IDS:
        return str(ensure_demo_model(source))
    return source
