"""The speed-ups of issue 7, each checked against training without it: padding-free packing with
multimodal RoPE and per-sample attention, sparse LoRA dropout, the frozen vision tower without
autograd, the vision feature and preprocessed sample caches, and (issue 16) length-grouped batches and
dataloader workers; the last layer at the loss positions only, the patch embedding as a matmul. Some are
exact, some within fp32 rounding, and some change training by what they are (packing in bf16 rounds
through other kernels, length-grouped batches are other batches, sparse dropout draws another random
stream): each test bounds that change (docs/performance.md's table of the three kinds).

Tests on a model run for every family's tiny model (`tiny_family`); those that train through the CLI
use the default (Qwen2-VL). The stage-level proofs at the end compare trained weights with one shared run
without speed-ups: equal bit for bit, a distance far below how far training moved them, or, where the
speed-up changes training by design, what it must keep (each row once an epoch, the dropout rate)."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_reads_back_the_batch, model_inputs, single_image_demo_rows, training_chat_template
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.trainer_pt_utils import LengthGroupedSampler
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from vlm_recipes.caches.preprocessed import PreprocessedSampleCollator
from vlm_recipes.cli.train import main
from vlm_recipes.data.rows import undecoded
from vlm_recipes.model.build import build_stage_model
from vlm_recipes.recipe import load_recipe
from vlm_recipes.speedups import packing
from vlm_recipes.speedups.frozen_vision import VisionFeatureCache, run_without_grad
from vlm_recipes.speedups.liger import use_liger_kernels
from vlm_recipes.speedups.loss_positions import (
    LastLayerAtLossPositions,
    loss_positions_refusal,
    text_decoder_layers,
)
from vlm_recipes.speedups.packing import PER_SAMPLE_SDPA, PaddingFreeVisionCollator, attend_per_sample
from vlm_recipes.speedups.patch_embedding import use_matmul_patch_embedding
from vlm_recipes.speedups.sparse_dropout import SparseDropout
from vlm_recipes.stages import run as stage_run

PER_SAMPLE_LOSS_TOLERANCE = 1e-5  # fp32 on CPU; observed differences are ~5e-7 (summation order)


@pytest.fixture(scope="module")
def family(tiny_family):
    return tiny_family[0]


@pytest.fixture(scope="module")
def tiny(tiny_family):
    model_dir = tiny_family[1]
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    return model, processor


@pytest.fixture(scope="module")
def rows():
    """Rows of different lengths, one of them a long answer, and one text-only row."""
    ds = single_image_demo_rows(6)
    picked = [dict(ds[i]) for i in range(6)]
    text_only = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say left."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "left"}]},
        ],
        "images": [],
    }
    return picked[:2] + [text_only] + picked[2:]


def padded_collator(processor):
    """TRL's vision collator as SFTTrainer builds it (assistant-only loss, training chat template)."""
    return DataCollatorForVisionLanguageModeling(
        processor, assistant_only_loss=True, chat_template=training_chat_template(processor)
    )


def image_inputs(owner, batch) -> tuple:
    """The positional arguments of the encoder owner's `get_image_features` that the batch holds, in the
    signature's order: Qwen's pixels and image grids, SmolVLM's pixel attention mask, Gemma 4's patch positions,
    LFM2-VL's patch grids and mask (Gemma 3: pixels only). The first two are what the feature cache keys."""
    inputs = []
    for name in inspect.signature(owner.get_image_features).parameters:
        if name not in batch:
            break
        inputs.append(batch[name])
    return tuple(inputs)


def token_losses(model, batch) -> torch.Tensor:
    """The loss of every labelled token, in order (the causal shift applied)."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch["labels"]
    log_probs = F.log_softmax(logits[:, :-1].float(), -1)
    target = labels[:, 1:]
    mask = target != -100
    return -log_probs[mask].gather(-1, target[mask][:, None])[:, 0]


@pytest.fixture(scope="module")
def tiny_per_sample(tiny_family):
    """The tiny model with its text attention switched to sdpa_per_sample, as padding_free does."""
    model_dir = tiny_family[1]
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert attend_per_sample(model) == "sdpa"
    assert model.config.text_config._attn_implementation == PER_SAMPLE_SDPA
    assert model.config.vision_config._attn_implementation == "sdpa", "the vision tower is not packed"
    return model, AutoProcessor.from_pretrained(model_dir)


@pytest.mark.parametrize("attention", ["sdpa with a block mask", PER_SAMPLE_SDPA])
def test_packed_per_sample_losses_equal_unpacked(tiny, tiny_per_sample, family, rows, attention):
    if why := family.padding_free_refusal():  # refused at the data check: tests/test_family_gemma3.py
        pytest.skip(why)
    model, processor = tiny if attention != PER_SAMPLE_SDPA else tiny_per_sample
    padded = padded_collator(processor)
    packed = PaddingFreeVisionCollator(padded, family.rope_index(model), family.rope_index_keys)(
        [dict(r) for r in rows]
    )
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    one_by_one = [token_losses(model, padded([dict(r)])) for r in rows]
    together = token_losses(model, packed)
    assert together.shape == torch.cat(one_by_one).shape
    assert (together - torch.cat(one_by_one)).abs().max() < PER_SAMPLE_LOSS_TOLERANCE
    if attention == PER_SAMPLE_SDPA and family.text_positions_reach_attention:
        lengths = [padded([dict(r)])["input_ids"].shape[1] for r in rows]
        assert packing._last_lengths[1] == lengths, "each sample was attended on its own"


def test_per_sample_attention_leaves_padded_batches_to_sdpa(tiny, tiny_per_sample, rows):
    """Unpacked batches (eval with padding, generation) take exactly the sdpa path they took before."""
    batch = padded_collator(tiny[1])([dict(r) for r in rows])
    assert torch.equal(token_losses(tiny[0], batch), token_losses(tiny_per_sample[0], batch))


def test_per_sample_attention_generates_what_sdpa_generates(tiny, tiny_per_sample, rows):
    """Generation (a KV cache; left padding beyond one row) never takes the per-sample path."""
    processor = AutoProcessor.from_pretrained(tiny_per_sample[0].name_or_path)  # its own: padded left
    processor.tokenizer.padding_side = "left"
    for batch in ([rows[0]], rows[:3]):
        prompts = [{**r, "messages": r["messages"][:1]} for r in batch]
        inputs = model_inputs(processor, prompts, add_generation_prompt=True)
        generated = [
            model.generate(**inputs, max_new_tokens=8, do_sample=False)
            for model, _ in (tiny, tiny_per_sample)
        ]
        assert torch.equal(*generated)


@pytest.mark.parametrize("p", [0.05, 0.3])
def test_sparse_dropout_drops_each_element_independently_with_probability_p(p):
    torch.manual_seed(0)
    n_blocks, block = 2000, 1000
    x = torch.randn(n_blocks, block, requires_grad=True)
    y = SparseDropout(p).train()(x)
    dropped = y == 0
    rate = dropped.float().mean().item()
    assert abs(rate - p) < 5 * (p * (1 - p) / x.numel()) ** 0.5, "the drop rate is p"
    per_block = dropped.float().sum(dim=1)
    binomial_variance = block * p * (1 - p)
    assert per_block.var().item() == pytest.approx(binomial_variance, rel=0.1), "drops are independent"
    assert torch.allclose(y[~dropped], x[~dropped] / (1 - p)), "the rest is scaled by 1/(1-p)"
    y.sum().backward()
    assert torch.equal(x.grad == 0, dropped), "no gradient through a dropped element"
    assert torch.allclose(x.grad[~dropped], torch.tensor(1 / (1 - p)))
    eval_input = torch.randn(10, 10)
    assert SparseDropout(p).eval()(eval_input) is eval_input, "eval mode is the identity"
    torch.manual_seed(1)
    first = SparseDropout(p).train()(torch.ones(100, 100))
    torch.manual_seed(1)
    assert torch.equal(first, SparseDropout(p).train()(torch.ones(100, 100))), "seeded like torch"


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_sparse_dropout_replays_its_mask_under_activation_checkpointing(use_reentrant):
    """Recomputation in backward must drop the same positions, or the gradient is wrong."""
    layer, dropout = torch.nn.Linear(64, 64), SparseDropout(0.3).train()
    x = torch.randn(32, 64, requires_grad=True)

    def block(t):
        return layer(dropout(t)).relu()

    torch.manual_seed(0)
    block(x).sum().backward()
    expected, x.grad = x.grad.clone(), None
    torch.manual_seed(0)
    checkpoint(block, x, use_reentrant=use_reentrant).sum().backward()
    assert torch.equal(x.grad, expected)


def test_packed_batch_keeps_each_samples_own_positions(tiny, family, rows):
    if why := family.padding_free_refusal():
        pytest.skip(why)
    model, processor = tiny
    padded = padded_collator(processor)
    packed = PaddingFreeVisionCollator(padded, family.rope_index(model), family.rope_index_keys)(
        [dict(r) for r in rows]
    )
    start = 0
    for row in rows:
        alone = padded([dict(row)])
        length = alone["input_ids"].shape[1]
        if family.rope_index(model) is None:  # 1-D RoPE (SmolVLM): [1, total] positions
            assert packed["position_ids"][0, start : start + length].tolist() == list(range(length))
            assert packed["labels"][0, start] == -100
            start += length
            continue
        own, _ = model.model.get_rope_index(
            input_ids=alone["input_ids"],
            mm_token_type_ids=alone["mm_token_type_ids"],
            image_grid_thw=alone.get("image_grid_thw"),
            attention_mask=alone["attention_mask"],
        )
        positions = packed["position_ids"][:, 0, start : start + length]
        assert positions[0].tolist() == list(range(length)), "text positions restart with every sample"
        assert torch.equal(positions[1:], own[:, 0]), "the 3-D mRoPE positions are the sample's own"
        assert packed["labels"][0, start] == -100, "no sample learns to predict the next one's start"
        start += length
    assert start == packed["input_ids"].shape[1], "no padding"


def test_last_layer_at_loss_positions_returns_the_whole_layers_hidden_states_there(tiny_family, rows):
    """The cut last layer (output projection, residuals and MLP at the labelled positions only) returns the
    final hidden states the whole layer returns at those positions, for every family it accepts."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_family[1], dtype=torch.float32).eval()
    decoder = tiny_family[0].decoder_layer  # its layer's parts by the family's names (GLM-4V's post-norms)
    if why := loss_positions_refusal(model, decoder):
        assert "DeepStack" in why, why  # the tiny Qwen3-VL: DeepStack after each of its 3 layers
        pytest.skip(why)
    batch = padded_collator(AutoProcessor.from_pretrained(tiny_family[1]))([dict(r) for r in rows])
    backbone_inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        whole = model.model(**backbone_inputs).last_hidden_state
        cut = LastLayerAtLossPositions(model, decoder)
        inputs = cut.select(batch)
        at_positions = model.model(**backbone_inputs).last_hidden_state
    labelled = batch["labels"][:, 1:] != -100
    assert cut.positions.numel() == labelled.sum() < whole.shape[0] * whole.shape[1] / 2
    assert torch.equal(inputs["shift_labels"][0], batch["labels"][:, 1:][labelled]), (
        "the next tokens, in order"
    )
    assert at_positions.shape == (1, labelled.sum(), whole.shape[-1])
    assert (at_positions[0] - whole.flatten(0, 1)[cut.positions]).abs().max() < PER_SAMPLE_LOSS_TOLERANCE
    cut.positions = None
    with torch.no_grad():
        assert torch.equal(model.model(**backbone_inputs).last_hidden_state, whole), "unset: the whole layer"


def test_matmul_patch_embedding_gives_the_convolutions_patch_embeddings_and_features(
    tiny_family, family, rows
):
    """The patch embeddings themselves (Gemma 3's tiny projector zeroes its features) and the features."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_family[1], dtype=torch.float32).eval()
    batch = padded_collator(AutoProcessor.from_pretrained(tiny_family[1]))([dict(r) for r in rows])
    owner, tower = family.image_encoder_owner(model), family.vision_tower(model)
    convolutions = [m for m in tower.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
    if not convolutions:  # Gemma 4's processor cuts the patches; its tower embeds them by a linear layer
        own = f"tests/test_family_{family.name.replace('-', '_')}.py"
        pytest.skip(f"the {family.name} tower has no patch convolution: {own}")
    embedded = []
    for module in convolutions:
        module.register_forward_hook(lambda _, args, out: embedded.append(out))
    with torch.no_grad():
        convolution = owner.get_image_features(*image_inputs(owner, batch), return_dict=True).pooler_output
        assert use_matmul_patch_embedding(tower), "every family's tower embeds its patches by a convolution"
        matmul = owner.get_image_features(*image_inputs(owner, batch), return_dict=True).pooler_output
    assert embedded and len(embedded) % 2 == 0
    half = len(embedded) // 2
    for a, b in [*zip(embedded[:half], embedded[half:], strict=True), *zip(convolution, matmul, strict=True)]:
        assert a.shape == b.shape
        assert a.numel() == 0 or (a - b).abs().max() <= PER_SAMPLE_LOSS_TOLERANCE * a.abs().max(), family.name
    assert max(a.abs().max() for a in embedded) > 0


def test_liger_kernels_stay_off_on_a_cpu_with_the_reason(demo_model_dir):
    """Liger's kernels are Triton's: asked for on a CPU, the model is left as it is and the reason logged
    (tests/test_on_a_gpu.py trains with them on a GPU)."""
    model = AutoModelForImageTextToText.from_pretrained(demo_model_dir, dtype=torch.float32)
    forwards = {name: module.forward for name, module in model.named_modules()}
    decision = use_liger_kernels(model)
    assert decision.guard == "liger-kernels" and decision.choice == "off"
    assert "Triton kernels for CUDA" in decision.reason and "computes on cpu" in decision.reason
    assert {name: module.forward for name, module in model.named_modules()} == forwards


@pytest.fixture()
def llm_lora_model(tiny_family):
    stage = load_recipe("r1-llm-only", ["stages.llm-lora.quantization.mode=none"]).stages[0]
    return build_stage_model(str(tiny_family[1]), stage, "fp32", "cpu").model


def test_frozen_vision_gets_no_autograd_even_with_checkpointing(llm_lora_model, tiny, family, rows):
    """transformers' enable_input_require_grads hooks the vision patch embedding too: without the guard,
    backward would run through the whole frozen tower."""
    model = llm_lora_model
    _, processor = tiny
    batch = padded_collator(processor)([dict(r) for r in rows[:2]])
    model.base_model.model.activation_checkpointing_enable()
    model.enable_input_require_grads()
    owner = family.image_encoder_owner(model)

    def feature_requires_grad() -> bool:
        out = owner.get_image_features(*image_inputs(owner, batch), return_dict=True)
        return out.pooler_output[0].requires_grad

    # Qwen2-VL and Qwen2.5-VL name their patch embedding as the tower's input embedding, so transformers
    # hooks it; Qwen3-VL's, Qwen3.5's, Gemma 4's and GLM-4V's towers name none and run without the waste, the
    # guard changing nothing there.
    unhooked = ("qwen3-vl", "qwen3.5", "qwen3.5-moe", "gemma4", "glm4v", "glm4v-moe")
    assert feature_requires_grad() or family.name in unhooked, "the waste this guard removes is real"
    run_without_grad(model, family)
    assert not feature_requires_grad()
    loss = model(**batch).loss
    loss.backward()
    vision_side = ("vision", "projector")
    assert all(
        p.grad is None
        for n, p in model.named_parameters()
        if family.role_of(n.removeprefix("base_model.model.")) in vision_side
    )
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_vision_feature_cache_hits_match_computed_features(tiny_family, rows, tmp_path):
    """Cold and warm, the forward is the uncached one bit for bit: every tensor the model reads from the
    image features is cached per image (Qwen3-VL: the DeepStack features as well as the merged tokens)."""
    family, model_dir = tiny_family
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    batch = padded_collator(processor)([dict(r) for r in rows])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    owner = family.image_encoder_owner(model)
    with torch.no_grad():
        expected = model(**inputs).logits
        computed = owner.get_image_features(*image_inputs(owner, batch), return_dict=True)
    cache = VisionFeatureCache(tmp_path, model, family).install()
    units = family.image_units(*image_inputs(owner, batch)[:2])  # SmolVLM, InternVL: one entry per tile
    images = len(units)
    # one computation and entry per distinct image (SmolVLM, InternVL: blank tiles of different images share
    # one): the batch's other copies are hits already
    distinct = len({pixels.numpy().tobytes() for pixels, _ in units})
    with torch.no_grad():
        first = model(**inputs).logits
        assert (cache.hits, cache.misses) == (images - distinct, distinct)
        second = model(**inputs).logits
        assert (cache.hits, cache.misses) == (2 * images - distinct, distinct)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    stored = [load_file(str(path)) for path in sorted(cache.directory.glob("*/*.safetensors"))]
    assert len(stored) == distinct
    assert {frozenset(s) for s in stored} == {frozenset(family.split_image_features(computed)[0])}

    # other processor settings: other pixel values, so other keys (never a stale hit)
    if family.name == "smolvlm":  # one tile side less: other tiles
        edge = (
            processor.image_processor.size["longest_edge"]
            - processor.image_processor.max_image_size["longest_edge"]
        )
        processor.image_processor.size = {"longest_edge": edge}
    elif family.name in ("gemma3", "llava-onevision", "internvl"):  # fixed tile sizes: another normalization
        processor.image_processor.image_mean = [0.25, 0.25, 0.25]
    elif family.name == "gemma4":  # a larger token budget: other sizes, other padding
        processor.image_processor.max_soft_tokens = 140
    elif family.name == "mistral3":  # a shorter longest edge: every demo image shrunk to other sizes
        processor.image_processor.size = {"longest_edge": 56}
    elif hasattr(processor.image_processor, "merge_size"):  # the Qwen line's pixel budget: other sizes
        processor.image_processor.size = {"shortest_edge": 28 * 28 * 100, "longest_edge": 28 * 28 * 400}
    else:  # any other processor: another normalization
        processor.image_processor.image_mean = [0.25, 0.25, 0.25]
    smaller = padded_collator(processor)([dict(r) for r in rows])
    with torch.no_grad():
        model(**{k: v for k, v in smaller.items() if k != "labels"})
    other = {pixels.numpy().tobytes() for pixels, _ in family.image_units(*image_inputs(owner, smaller)[:2])}
    assert cache.misses == distinct + len(other)

    # other tower weights: another cache directory
    with torch.no_grad():
        next(family.vision_tower(model).parameters()).add_(1e-3)
    assert VisionFeatureCache(tmp_path, model, family).directory != cache.directory


def test_preprocessed_samples_assemble_to_exactly_the_collators_batch(tiny, family, rows, tmp_path):
    """Cold (images decoded from their files) and warm (read back), the batch is TRL's, tensor for tensor."""
    _, processor = tiny
    padded = padded_collator(processor)
    expected = padded([dict(r) for r in rows])
    files = [dict(r) for r in undecoded(single_image_demo_rows(6))]
    as_stored = files[:2] + [rows[2]] + files[2:]  # images as file references, the text-only row as is
    cached = PreprocessedSampleCollator(padded, tmp_path, image_padding=family.image_padding)
    assert_reads_back_the_batch(cached, as_stored, expected)
    assert (cached.misses, cached.hits) == (len(rows), len(rows))


def test_second_stage_reads_the_samples_the_first_stage_preprocessed(tmp_path, monkeypatch):
    monkeypatch.setenv("VLM_RECIPES_SPEEDUP_CACHE", str(tmp_path / "speedups"))
    code = main(
        [
            "--recipe",
            "r3-two-stage",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "cached",
            "--max-steps",
            "2",
            "data.max_train_samples=8",
            "data.max_eval_samples=4",
            "evaluation.generate=false",
            "training.preprocessed_cache=true",
        ]
    )
    assert code == 0
    stages = sorted((tmp_path / "r3-two-stage" / "cached").glob("stage-*"))
    first, second = (json.loads((d / "metrics.json").read_text())["preprocessed_cache"] for d in stages)
    assert first["misses"] > 0
    assert second["misses"] == 0 and second["hits"] > 0, "same processor settings: every row was ready"


# Stage-level proofs (issue 16): r1's stage trained for a few steps with and without a speed-up, from the
# same start. Where the arithmetic is the same the weights must end equal, bit for bit; elsewhere their
# distance must be far below how far training moved them, so that a proof can fail.
PROOF_STEPS = 4  # 2 epochs of 16 rows: the second epoch reads what the caches wrote in the first
PROOF_LEARNING_RATE = 2e-3  # 10x r1's: 4 steps move the LoRA weights by ~0.6 and the eval loss by ~0.2


@dataclasses.dataclass
class TrainedStage:
    """A stage trained in this process: its trainable tensors at the start and the end, its trainer."""

    initial: dict[str, torch.Tensor]
    trained: dict[str, torch.Tensor]
    trainer: object
    stage_dir: Path

    @property
    def moved(self) -> float:
        """How far training moved the weights."""
        return distance(self.trained, self.initial)

    def metrics(self) -> dict:
        return json.loads((self.stage_dir / "metrics.json").read_text())


def trainable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The L2 distance between two sets of the same tensors, taken as one vector."""
    assert a.keys() == b.keys()
    return sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a).sqrt().item()


CACHES = {"preprocessed": "preprocessed_cache", "vision-features": "vision_feature_cache"}  # dir: metrics key


def train_stage(
    directory: Path,
    run_name: str,
    overrides: list[str],
    lora_dropout: float = 0.0,
    dropout_seed: int | None = None,
    recipe: str = "r1-llm-only",
    precision: str = "fp32",
    rows_reversed: bool = False,
) -> TrainedStage:
    """r1's stage for PROOF_STEPS steps on 16 rows, in this process (an interpreter start costs more than the
    stage), its speed-up caches under `directory`. LoRA dropout is off unless asked: packing lays the
    tensors out differently, so dropout would draw other masks. `dropout_seed` reseeds torch's generator
    just before training: the same start and data order (seeded apart), another dropout stream. `precision`
    is explicit (what `auto` picks depends on the CPU): fp32 proofs are exact or near it, bf16 ones are
    bounded by the bf16 noise floor (`bf16_noise_floor`)."""
    captured, original_train = {}, stage_run.train

    def train_capturing_weights(ctx, trainer, callbacks, resume_from):
        captured["initial"] = trainable_tensors(trainer.model)
        if rows_reversed:  # each batch's rows in the opposite order: the same sums, added in another order
            collate = trainer.data_collator
            trainer.data_collator = lambda rows: collate(rows[::-1])
        if dropout_seed is not None:
            torch.manual_seed(dropout_seed)
        output = original_train(ctx, trainer, callbacks, resume_from)
        captured["trained"], captured["trainer"] = trainable_tensors(trainer.model), trainer
        return output

    stage = {"r1-llm-only": "llm-lora", "r2-vision-only": "vision-full"}[recipe]
    args = [
        *("--recipe", recipe, "--output-dir", str(directory), "--run-name", run_name),
        *("--max-steps", str(PROOF_STEPS), "data.max_train_samples=16", "data.max_eval_samples=8"),
        f"training.learning_rate={PROOF_LEARNING_RATE}",
        *([f"stages.llm-lora.lora.dropout={lora_dropout}"] if stage == "llm-lora" else []),
        "evaluation.generate=false",
        "training.save_steps=0",  # no checkpoints to write
        "training.report_to=[none]",
        f"precision={precision}",
        *overrides,
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLM_RECIPES_SPEEDUP_CACHE", str(directory / "speedup-cache"))
        mp.setattr(stage_run, "train", train_capturing_weights)
        assert main(args) == 0
    stage_dir = directory / recipe / run_name / f"stage-1-{stage}"
    return TrainedStage(captured["initial"], captured["trained"], captured["trainer"], stage_dir)


def assert_learns_exactly_what_the_baseline_does(run: TrainedStage, baseline: TrainedStage) -> None:
    assert run.initial.keys() == baseline.initial.keys()
    assert all(torch.equal(run.initial[k], baseline.initial[k]) for k in run.initial), "the same start"
    differ = [k for k in run.trained if not torch.equal(run.trained[k], baseline.trained[k])]
    assert not differ, f"{len(differ)} trained tensors differ, e.g. {differ[0]}"


@pytest.fixture(scope="module")
def proof_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("proofs")


def checked_baseline(run: TrainedStage) -> TrainedStage:
    unchanged = [k for k in run.trained if torch.equal(run.trained[k], run.initial[k])]
    assert not unchanged, (
        f"every trainable tensor trained: an equality of weights then means something ({unchanged})"
    )
    return run


@pytest.fixture(scope="module")
def baseline(proof_dir) -> TrainedStage:
    """The stage in fp32 without any speed-up: every fp32 proof compares with this one run."""
    return checked_baseline(train_stage(proof_dir, "baseline", []))


@pytest.fixture(scope="module")
def baseline_bf16(proof_dir) -> TrainedStage:
    """The same stage in bf16 (autocast, trained weights in fp32 masters): the bf16 proofs' reference."""
    return checked_baseline(train_stage(proof_dir, "baseline-bf16", [], precision="bf16"))


# A bf16 proof passes within this many times the bf16 noise floor. The floor is measured, not assumed: the
# same padded training with each batch's rows in the opposite order, the same sums added in another order,
# so all that differs is where bf16 rounds (1.3e-5 of what training moved where first measured, 1.4e-4 on an
# AMD EPYC with AVX512-BF16, against 1.6e-6 in fp32).
NOISE_FLOOR_MARGIN = 3.0


@pytest.fixture(scope="module")
def bf16_noise_floor(proof_dir, baseline_bf16) -> float:
    """|reversed rows - baseline| / |trained - initial| of two equivalent padded bf16 runs."""
    reordered = train_stage(proof_dir, "baseline-bf16-reversed", [], precision="bf16", rows_reversed=True)
    assert all(torch.equal(reordered.initial[k], baseline_bf16.initial[k]) for k in reordered.initial)
    floor = distance(reordered.trained, baseline_bf16.trained) / baseline_bf16.moved
    print(f"bf16 noise floor: |rows reversed - baseline| / |trained - initial| = {floor:.1e}")
    assert 0 < floor < 1e-3, "bf16 rounds, far less than training moves"
    return floor


def assert_within_bf16_noise(name: str, run: TrainedStage, baseline_bf16: TrainedStage, floor: float) -> None:
    ratio = distance(run.trained, baseline_bf16.trained) / baseline_bf16.moved
    bound = NOISE_FLOOR_MARGIN * floor
    print(
        f"{name} (bf16): |sped up - baseline| / |trained - initial| = {ratio:.1e}; bound {bound:.1e} "
        f"= {NOISE_FLOOR_MARGIN} x the bf16 noise floor {floor:.1e}"
    )
    assert ratio < bound, (ratio, bound)


# Packing is not exact in bf16: packed rows go through other kernels and shapes (per-sample causal attention on
# each sample's slice instead of the masked dense one over padded rows, one [1, total] row in every matmul
# instead of [8, longest]), which round otherwise; the rows-reversed floor above, where only the order of a
# batch's sums moves, is too narrow for that (1.4e-4; packing 2.3e-2). The floor here is the same padded bf16
# training through other shapes: each batch of 8 computed as two micro-batches of 4, each padded to its own
# longest row, their gradients summed: in fp32 the same training within 5.6e-6 of what it moved (the loss is
# the mean over the global batch's labelled tokens however it is split:
# test_families::test_gradient_accumulation_trains_as_one_batch_does). Measured (AMD EPYC with AVX512-BF16,
# 1 and 2 threads alike): that floor 1.7e-2 of what training moved; packed bf16 2.3e-2 from padded bf16
# (1.4x the floor, under NOISE_FLOOR_MARGIN x it: 5.0e-2, a twentieth of what training moved); the sample's
# image positions flattened to its text positions (each image token's 3-D mRoPE lost) 0.235 (14x).
MICRO_BATCHES = ["training.per_device_batch_size=4", "training.gradient_accumulation_steps=2"]


def test_padding_free_stage_in_bf16_ends_within_the_bf16_floor_of_other_shapes(baseline_bf16, proof_dir):
    """Packed bf16 against padded bf16: the weights end at a distance below NOISE_FLOOR_MARGIN x the floor of
    the same padded training split into micro-batches (measured here), itself far below what training moved."""
    micro = train_stage(proof_dir, "micro-batches-bf16", MICRO_BATCHES, precision="bf16")
    floor = distance(micro.trained, baseline_bf16.trained) / baseline_bf16.moved
    packed = train_stage(proof_dir, "padding-free-bf16", ["training.padding_free=true"], precision="bf16")
    ratio = distance(packed.trained, baseline_bf16.trained) / baseline_bf16.moved
    bound = NOISE_FLOOR_MARGIN * floor
    print(
        f"padding_free (bf16): |packed - padded| / |trained - initial| = {ratio:.1e}; bound {bound:.1e} = "
        f"{NOISE_FLOOR_MARGIN} x the floor of other shapes {floor:.1e} (2 micro-batches of 4 against 8)"
    )
    assert 0 < floor < 0.05, "bf16 rounds through other shapes, far less than training moves"
    assert ratio < bound, (ratio, bound)


def test_padding_free_stage_ends_where_padded_training_does(baseline, proof_dir):
    """Packed (fp32, per-sample attention), the weights end at a distance from the padded run's below 1e-4
    of how far training moved them (1e-6 seen: summation order); a wrong position or a sample attending
    to another moves them further than that. TRL counts the same real tokens both ways."""
    packed = train_stage(proof_dir, "padding-free", ["training.padding_free=true"])
    ratio = distance(packed.trained, baseline.trained) / baseline.moved
    print(f"padding_free (fp32): |packed - padded| / |trained - initial| = {ratio:.1e}")
    assert ratio < 1e-4, ratio
    tokens = {
        way: m["train_tokens_per_second"] * m["train_runtime_s"]
        for way, m in (("packed", packed.metrics()), ("padded", baseline.metrics()))
    }
    assert tokens["packed"] == pytest.approx(tokens["padded"], rel=1e-3), "TRL counts real tokens both ways"


def test_sparse_lora_dropout_stage_drops_at_p_and_differs_from_torch_dropout_only_by_the_stream(
    proof_dir, monkeypatch
):
    """Sparse dropout draws other random numbers than torch's, so the weights cannot be equal. What this
    proves: in the stage every LoRA dropout is swapped and drops a fraction p of what it sees (within 5
    sigma over ~2.4e6 elements: 1.1 p fails), and from the same start and data order the sparse run ends
    no further from a torch-dropout run than a second torch-dropout run with another dropout stream does
    (the dropout noise itself; too wide to see a wrong p, which the drop count sees)."""
    p = 0.05  # r1's
    seen = {"dropped": 0, "elements": 0}
    forward = SparseDropout.forward

    def counting_forward(self, x):
        out = forward(self, x)
        if self.training:
            seen["dropped"] += int(((out == 0) & (x != 0)).sum())
            seen["elements"] += int((x != 0).sum())
        return out

    torch_dropout = train_stage(proof_dir, "torch-dropout", [], lora_dropout=p)
    other_stream = train_stage(proof_dir, "torch-dropout-other", [], lora_dropout=p, dropout_seed=1234)
    monkeypatch.setattr(SparseDropout, "forward", counting_forward)
    sparse = train_stage(proof_dir, "sparse-dropout", ["training.sparse_lora_dropout=true"], lora_dropout=p)
    report = json.loads((sparse.stage_dir / "report.json").read_text())
    swapped = next(d for d in report["decisions"] if d["guard"] == "sparse-lora-dropout")
    assert swapped["choice"].startswith(f"{len(report['lora_targets'])} LoRA dropouts"), "every one"
    rate, n = seen["dropped"] / seen["elements"], seen["elements"]
    assert abs(rate - p) < 5 * (p * (1 - p) / n) ** 0.5, f"drop rate {rate} over {n} elements"
    for run in (sparse, other_stream):
        assert all(torch.equal(run.initial[k], torch_dropout.initial[k]) for k in run.initial), "same start"
    noise = distance(other_stream.trained, torch_dropout.trained)
    ratio, noise_ratio = distance(sparse.trained, torch_dropout.trained) / noise, noise / torch_dropout.moved
    print(
        f"sparse_lora_dropout (fp32): drop rate {rate:.4f} over {n} elements; |sparse - torch| / |torch - torch, "
        f"other stream| = {ratio:.2f}; dropout noise / |trained - initial| = {noise_ratio:.2f}"
    )
    assert ratio < 1.5, ratio
    assert noise < 0.5 * torch_dropout.moved, "the dropout noise is below what training moved"


@pytest.mark.parametrize("cache", ["preprocessed_cache", "vision_feature_cache"])
def test_cached_stage_learns_exactly_what_the_uncached_one_does(baseline, proof_dir, cache):
    """Cold (the second epoch reads what the first wrote) and warm (everything read back), the weights
    equal the uncached run's bit for bit. The warm feature-cache run generates its eval answers too:
    generate() goes through the cache."""
    cold = train_stage(proof_dir, f"{cache}-cold", [f"training.{cache}=true"])
    generate = (
        ["evaluation.generate=true", "evaluation.max_new_tokens=4"] if cache == "vision_feature_cache" else []
    )
    warm = train_stage(proof_dir, f"{cache}-warm", [f"training.{cache}=true", *generate])
    cold_stats, warm_stats = cold.metrics()[cache], warm.metrics()[cache]
    assert cold_stats["misses"] > 0 and cold_stats["hits"] > 0
    assert warm_stats["misses"] == 0 and warm_stats["hits"] == cold_stats["hits"] + cold_stats["misses"]
    assert_learns_exactly_what_the_baseline_does(cold, baseline)
    assert_learns_exactly_what_the_baseline_does(warm, baseline)


def damage(path: Path, how: int) -> None:
    """Cut an entry short, garble its tensor bytes (its header still parses), or empty it."""
    data = path.read_bytes()
    if how == 0:
        path.write_bytes(data[: len(data) // 2])
    elif how == 1:
        middle = len(data) - 64
        path.write_bytes(
            data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 16]) + data[middle + 16 :]
        )
    else:
        path.write_bytes(b"")


def test_a_stage_on_damaged_cache_entries_learns_exactly_what_the_uncached_one_does(baseline, proof_dir):
    """Both speed-up caches filled by one run, then every entry damaged (cut short, garbled, emptied: a copy
    cut off, a network filesystem, bit rot): the next run counts each as damaged, makes it again, and ends
    with the uncached run's weights bit for bit."""
    both = ["training.preprocessed_cache=true", "training.vision_feature_cache=true"]
    directory = proof_dir / "damaged-caches"
    train_stage(directory, "fill", both)
    entries = {kind: sorted((directory / "speedup-cache" / kind).rglob("*.safetensors")) for kind in CACHES}
    for paths in entries.values():
        assert paths
        for i, path in enumerate(paths):
            damage(path, i % 3)
    again = train_stage(directory, "on-damaged-entries", both)
    for kind, key in CACHES.items():
        stats = again.metrics()[key]
        assert stats["damaged"] == len(entries[kind]) == stats["misses"], (kind, stats)
    assert_learns_exactly_what_the_baseline_does(again, baseline)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-checkpointing", "activation-checkpointing"])
def test_loss_positions_only_stage_ends_where_the_whole_last_layer_does(baseline, proof_dir, checkpointing):
    """The last layer and LM head at the labelled positions only: the weights end at a distance from the
    baseline's below 1e-4 of how far training moved them (the rounding of products with fewer rows). The
    eval answers are generated after training: generation runs the whole layer. With activation
    checkpointing the backward recomputes the cut layer, with the same positions (cleared before it, the
    recompute's whole-length output would not match what the forward saved)."""
    cut = train_stage(
        proof_dir,
        "loss-positions-only" + ("-checkpointed" if checkpointing else ""),
        [
            "training.loss_positions_only=true",
            f"training.gradient_checkpointing={str(checkpointing).lower()}",
            "evaluation.generate=true",
            "evaluation.max_new_tokens=4",
        ],
    )
    ratio = distance(cut.trained, baseline.trained) / baseline.moved
    print(
        f"loss_positions_only (fp32, checkpointing {checkpointing}): |cut - whole| / |trained - initial| = {ratio:.1e}"
    )
    assert ratio < 1e-4, ratio
    assert text_decoder_layers(cut.trainer.model)[-1].gradient_checkpointing is checkpointing
    assert cut.trainer.loss_positions.positions is None
    assert cut.metrics()["eval_loss"] == pytest.approx(baseline.metrics()["eval_loss"], rel=1e-5)


def test_loss_positions_only_stage_in_bf16_ends_within_the_bf16_noise_floor(
    baseline_bf16, bf16_noise_floor, proof_dir
):
    cut = train_stage(
        proof_dir, "loss-positions-only-bf16", ["training.loss_positions_only=true"], precision="bf16"
    )
    assert_within_bf16_noise("loss_positions_only", cut, baseline_bf16, bf16_noise_floor)


def test_vision_feature_cache_in_bf16_learns_exactly_what_the_uncached_stage_does(baseline_bf16, proof_dir):
    """The features are stored as the bf16 autocast made them (the key names the autocast dtype) and read
    back unchanged: bit for bit, in bf16 as in fp32."""
    cached = train_stage(
        proof_dir, "feature-cache-bf16", ["training.vision_feature_cache=true"], precision="bf16"
    )
    assert cached.metrics()["vision_feature_cache"]["hits"] > 0
    assert_learns_exactly_what_the_baseline_does(cached, baseline_bf16)


def test_matmul_patch_embedding_stage_ends_where_the_convolution_does(proof_dir):
    """r2's stage, its tower training in full, so the patch embedding's weight gradient comes from the
    matmul: the weights end at a distance from the convolution's below 1e-3 of how far training moved them
    (3.8e-5 seen: Adam's first steps turn the rounding of near-zero gradients into whole steps; the patch's
    pixels taken in the wrong order give 0.64)."""
    convolution = train_stage(proof_dir, "r2-convolution", [], recipe="r2-vision-only")
    matmul = train_stage(
        proof_dir, "r2-matmul", ["training.matmul_patch_embedding=true"], recipe="r2-vision-only"
    )
    assert not any(torch.equal(convolution.trained[k], convolution.initial[k]) for k in convolution.trained)
    ratio = distance(matmul.trained, convolution.trained) / convolution.moved
    print(f"matmul_patch_embedding (fp32): |matmul - convolution| / |trained - initial| = {ratio:.1e}")
    assert ratio < 1e-3, ratio


def test_dataloader_workers_learn_exactly_what_the_main_process_does(baseline, proof_dir):
    """Workers only collate: the sampler and every random draw stay in the main process."""
    workers = train_stage(proof_dir, "workers", ["training.dataloader_workers=2"])
    assert workers.trainer.args.dataloader_num_workers == 2
    assert_learns_exactly_what_the_baseline_does(workers, baseline)


def eval_loss(stage: TrainedStage, weights: dict[str, torch.Tensor]) -> float:
    """The token-mean loss of the stage's eval rows in one padded batch, its model holding `weights`: one
    measurement for every run (Trainer's eval_loss averages per-batch means, and under group_by_length it
    groups the eval batches too, so its number moves with the batching)."""
    model = stage.trainer.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                p.copy_(weights[name])
        model.eval()
        batch = stage.trainer.data_collator([dict(row) for row in stage.trainer.eval_dataset])
        return model(**batch).loss.item()


def test_group_by_length_sees_every_row_once_per_epoch_and_reaches_random_batches_eval_loss(
    baseline, proof_dir, monkeypatch
):
    """Other batches, so other weights (half as far apart as training moved them). What this proves: every
    epoch still takes each row exactly once, in length-grouped batches (exact), and the eval loss after 4
    steps, measured the same way for both, is within a fifth of what those steps gained: 0.11 seen (0.023
    of 0.196), while seeds 1-3 of random batches differ from seed 42 by up to 0.06. The loss bound is
    coarse: 4 steps on only the 8 longest rows also pass it (0.03); the epoch check catches that."""
    epochs, draw = [], LengthGroupedSampler.__iter__

    def recording_draw(self):
        order = list(draw(self))
        if len(order) == 16:  # the train rows (the eval rows are grouped too)
            epochs.append(order)
        return iter(order)

    monkeypatch.setattr(LengthGroupedSampler, "__iter__", recording_draw)
    grouped = train_stage(proof_dir, "group-by-length", ["training.group_by_length=true"])
    assert len(epochs) == 2 and all(sorted(order) == list(range(16)) for order in epochs), epochs
    before = eval_loss(baseline, baseline.initial)
    random_batches = eval_loss(baseline, baseline.trained)
    by_length = eval_loss(baseline, grouped.trained)
    ratio = abs(by_length - random_batches) / (before - random_batches)
    print(f"group_by_length (fp32): |eval loss grouped - random| / eval loss gained = {ratio:.3f}")
    assert before - random_batches > 0.1, "the steps train"
    assert ratio < 0.2, ratio
