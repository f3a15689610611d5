"""Cache hygiene (issue 16): keys cover the versions of the libraries that made an entry, the speed-up
caches stay under `training.cache_max_gb` (least recently used entries evicted first), and preprocessed
pixels are stored as codebooks that read back bit for bit."""

from __future__ import annotations

import os
from importlib import metadata

import pytest
import torch
from conftest import TINY_MODELS, single_image_demo_rows
from safetensors.torch import load_file
from transformers import AutoProcessor
from trl.chat_template_utils import get_training_chat_template
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from vlm_recipes.caches.preprocessed import PreprocessedSampleCollator
from vlm_recipes.caches.storage import CacheBudget, compact_pixels, expand_pixels
from vlm_recipes.caches.token_counts import remembered_token_counts
from vlm_recipes.data.rows import undecoded
from vlm_recipes.demo.models import ensure_demo_model
from vlm_recipes.files import write_safetensors


def collator_of(name: str):
    """TRL's vision collator for a family's tiny processor, as SFTTrainer builds it."""
    processor = AutoProcessor.from_pretrained(ensure_demo_model(TINY_MODELS[name]))
    return DataCollatorForVisionLanguageModeling(
        processor, assistant_only_loss=True, chat_template=get_training_chat_template(processor)
    )


@pytest.fixture(scope="module")
def qwen_collator():
    return collator_of("qwen2-vl")


@pytest.fixture(scope="module")
def rows():
    return [dict(row) for row in undecoded(single_image_demo_rows(4))]  # images as file references


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


# --------------------------------------------------------------------------- codebooks


# Qwen2-VL: patch rows [patches, 3 * 2 * 14 * 14]; SmolVLM: tiles [1, tiles, 3, H, W]; Gemma 3: [1, 3, H, W]
@pytest.mark.parametrize("name", ["qwen2-vl", "smolvlm", "gemma3"])
def test_processed_pixels_read_back_bit_for_bit_from_one_byte_codes(name, tmp_path):
    collator = collator_of(name)
    rows = single_image_demo_rows(2)
    sample = {k: v for k, v in collator([dict(rows[0])]).items() if isinstance(v, torch.Tensor)}
    write_safetensors(tmp_path / "entry.safetensors", compact_pixels(sample))
    stored = load_file(str(tmp_path / "entry.safetensors"))
    assert stored["pixel_values.codes"].dtype == torch.uint8, "at most 256 values per colour channel"
    assert same(expand_pixels(stored), sample)
    pixels = sample["pixel_values"]
    assert stored["pixel_values.codes"].numel() + stored["pixel_values.codebook"].nbytes < pixels.nbytes / 3


def test_codebooks_keep_every_bit_or_store_the_tensor_as_is():
    generator = torch.Generator().manual_seed(0)
    few = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1.5], dtype=torch.float32)
    image = torch.randint(0, 100, (1, 3, 128, 128), generator=generator) * 2
    image[..., 5] = 255  # never in the every-4th-element sample
    tensors = {
        "few": few[torch.randint(0, 5, (2, 3, 40, 40), generator=generator)],  # -0.0 apart from 0.0
        "half": (torch.randint(0, 200, (3, 64, 64), generator=generator) / 7).to(torch.bfloat16),
        "wide": torch.randint(0, 1000, (50_000,), generator=generator) / 7,  # int16 codes
        # an 8-bit image's steps (the codes by arithmetic), one value too rare for its sample to hold
        "steps": (image / 255 - 0.48) / 0.27,
        "many": torch.randn(3, 64, 64, generator=generator),  # all distinct: stored as is
        "small": torch.randn(10, generator=generator),
        "ids": torch.arange(5000),
    }
    stored = compact_pixels(tensors)
    assert {"few.codes", "half.codes", "wide.codes", "steps.codes", "many", "small", "ids"} <= stored.keys()
    assert stored["steps.codes"].dtype == torch.uint8
    assert stored["wide.codes"].dtype == torch.int16
    back = expand_pixels(stored)
    assert back.keys() == tensors.keys()
    for key, tensor in tensors.items():  # bit for bit (torch.equal would call NaN unequal to itself)
        assert back[key].dtype == tensor.dtype and back[key].shape == tensor.shape
        assert torch.equal(back[key].view(torch.uint8), tensor.view(torch.uint8)), key


# --------------------------------------------------------------------------- library versions


def test_a_new_library_version_gives_new_cache_keys(qwen_collator, rows, tmp_path, monkeypatch):
    processor = qwen_collator.processor
    counted = []

    def count():
        counted.append(1)
        return [(1, 0)] * len(rows)

    before = PreprocessedSampleCollator(qwen_collator, tmp_path).directory
    remembered_token_counts(rows, processor, count)
    remembered_token_counts(rows, processor, count)
    assert len(counted) == 1
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "99.0" if name == "tokenizers" else real(name))
    assert PreprocessedSampleCollator(qwen_collator, tmp_path).directory != before
    remembered_token_counts(rows, processor, count)
    assert len(counted) == 2, "counted again under the new tokenizers"


# --------------------------------------------------------------------------- the size cap


def old_entries(root, ages: list[int], size: int = 1000) -> list:
    """Entries of an earlier run, `ages` seconds since their last use."""
    paths = []
    for i, age in enumerate(ages):
        path = root / "preprocessed" / "digest" / f"{i}.safetensors"
        write_safetensors(path, {"x": torch.zeros(size // 4)})
        used = path.stat().st_mtime - age
        os.utime(path, (used, used))
        paths.append(path)
    return paths


def on_disk(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


def test_cache_cap_evicts_the_least_recently_used_entries(tmp_path, caplog):
    paths = old_entries(tmp_path, [50, 40, 30, 20, 10])
    size = paths[0].stat().st_size
    budget = CacheBudget(tmp_path, max_bytes=int(3.5 * size))
    new = tmp_path / "vision-features" / "digest" / "ab" / "new.safetensors"
    write_safetensors(new, {"x": torch.zeros(1000 // 4)})
    budget.written(new)  # 6 entries: down to 90% of 3.5, the three oldest go
    assert [p.exists() for p in paths] == [False, False, False, True, True]
    assert new.exists() and on_disk(tmp_path) == budget.total <= budget.max_bytes
    with caplog.at_level("INFO", logger="vlm_recipes.caches.storage"):
        stats = budget.eviction_stats("preprocessed", (0, 0))
        budget.eviction_stats("preprocessed", (0, 0))
    assert stats == {"evicted": 3, "evicted_gb": round(3 * size / 1e9, 4)}
    assert len([r for r in caplog.records if "evicted" in r.message]) == 1, "logged once"


def test_a_read_makes_an_entry_recently_used(qwen_collator, rows, tmp_path, tmp_path_factory):
    root = tmp_path / "preprocessed"
    earlier = PreprocessedSampleCollator(qwen_collator, root)  # an earlier run, without a cap
    earlier(rows[:3])
    written = sorted(earlier.directory.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    for age, path in zip([30, 20, 10], written, strict=True):  # last used 30, 20 and 10 s ago
        os.utime(path, (path.stat().st_mtime - age,) * 2)
    probe = tmp_path_factory.mktemp("fourth-entry")  # the fourth entry's size, written elsewhere
    PreprocessedSampleCollator(qwen_collator, probe / "preprocessed")(rows[3:4])
    smallest = min(p.stat().st_size for p in written)
    # the fourth entry passes the cap, and evicting any one of the three brings the cache back under it
    budget = CacheBudget(tmp_path, max_bytes=on_disk(tmp_path) + on_disk(probe) - smallest // 2)
    cached = PreprocessedSampleCollator(qwen_collator, root, budget)
    cached(rows[:1])  # the oldest entry, read: now the most recently used
    cached(rows[3:4])  # a fourth entry passes the cap
    assert (cached.hits, cached.misses) == (1, 1)
    assert [p.exists() for p in written] == [True, False, True], "the least recently used one went"
    assert cached.stats()["evicted"] == 1


def test_a_stage_remembers_its_token_counts_and_the_next_stage_on_the_same_rows_reads_them(
    private_demo_cache, tmp_path, monkeypatch
):
    """The length check is data/'s, the remembering caches/' (handed down by the stage: data/ imports
    nothing from caches/): one run leaves its rows' counts on disk, and a second run over the same rows
    and processor counts nothing."""
    from vlm_recipes.cli.train import main
    from vlm_recipes.data import lengths

    counted = []
    count = lengths._count_tokens
    monkeypatch.setattr(lengths, "_count_tokens", lambda *a: counted.append(1) or count(*a))
    args = ["--recipe", "r1-llm-only", "--output-dir", str(tmp_path), "--max-steps", "1", "data.eval=null"]
    args += ["data.max_train_samples=6", "data.train=demo:eval"]  # rows no other test counts first
    assert main([*args, "--run-name", "one"]) == 0
    assert counted and list((private_demo_cache / "token-counts").glob("*.json"))
    counted.clear()
    assert main([*args, "--run-name", "two"]) == 0
    assert counted == [], "the second run read the counts the first one remembered"
