"""Sequence parallelism per family (issue 76): a training batch split over 2 gloo ranks by the package's own
path gives one process's loss and gradients, for the Qwen line and three other families, in fp32 and bf16.

One launch of 2 ranks serves every family and precision (a process's start and imports cost seconds). Each
rank runs the split of every case, the gradients summed over the ranks as DDP sums them; then each rank runs
half of the cases in one process: the reference (the whole batch at once) and the floor (the same rows as 2
micro-batches, accumulated: summation order only). Every parameter trains, so gradients reach the tower,
the projector and the language model alike; the batch's 3 images give the ranks unequal shares of the
tower's frames or tiles (speedups/tower_split.py). docs/results/parallel-tests.md holds what it measured.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

MODELS = (
    "demo:tiny-qwen2-vl",
    "demo:tiny-qwen2.5-vl",
    "demo:tiny-qwen3-vl",
    "demo:tiny-llava-onevision",
    "demo:tiny-internvl",
    "demo:tiny-smolvlm",
)
PRECISIONS = ("fp32", "bf16")
EVERY_ROLE = "every role trained"
# every family and precision with every role trained; and the stage's frozen-vision path once (tower and
# projector frozen: their features computed without autograd, methods/../speedups/frozen_vision.py)
CASES = [(m, p, EVERY_ROLE) for m in MODELS for p in PRECISIONS] + [
    ("demo:tiny-qwen2-vl", "fp32", "tower and projector frozen")
]
# Split wrongly too, to show the bound can fail: the subtle error in fp32 (each piece's positions restarting
# at 0), a gross one in bf16, whose floor is the gradients' own rounding (labels cut unshifted)
WRONG = {("demo:tiny-qwen2-vl", "fp32"): "positions", ("demo:tiny-qwen2-vl", "bf16"): "labels"}
# The split may be this many times the floor (measured: at most 3x). The floor is one sample of summation-
# order noise, and the split reorders more sums than 2 micro-batches do: each weight's gradient summed over 2
# pieces cut inside the rows, then over the ranks in the parameter's dtype. A wrong split: over 1000x.
FACTOR = 10
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8}  # a floor below it is read as it: one rounding
SENTENCE = "the red square sits left of a blue circle and a green triangle on a white ground"


def _image(shade: int):
    """A picture large enough for each tiny processor's most tokens (16 to 28 an image)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (128, 128), (shade, 200, 255 - shade))
    ImageDraw.Draw(image).rectangle((20, 40, 70, 90), fill=(220, 30, 30))
    return image


def _long_row(answer_words: int) -> dict:
    """Two turns, the image in the second: answers before and after it, so both pieces hold labels."""
    words = SENTENCE.split()
    answer = " ".join(words[i % len(words)] for i in range(answer_words))
    return {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say what you see in words."}]},
            {"role": "assistant", "content": [{"type": "text", "text": " ".join(words[:8])}]},
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "Where is the red square?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        "images": [_image(40)],
    }


def _short_row() -> dict:
    """Two images: with the long row's, 3 to share over 2 ranks, so one image's frames or tiles are cut."""
    question = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same colour?"}]
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
        ],
        "images": [_image(160), _image(100)],
    }


def _collator(model_dir: Path, family):
    """The processor and the collator an SFT stage builds (methods/sft.py): the processor loaded the family's
    way; TRL's training template, or the answers told by prefix."""
    from conftest import training_chat_template

    from vlm_recipes.data.collate import VideoCollator
    from vlm_recipes.methods.sft import answers_by_prefix
    from vlm_recipes.model.build import load_processor
    from vlm_recipes.recipes.schema import DataSettings

    processor = load_processor(str(model_dir), DataSettings(), family)
    by_prefix = answers_by_prefix(processor, None)
    return processor, VideoCollator(
        processor=processor,
        chat_template=None if by_prefix else training_chat_template(processor),
        assistant_only_loss=not by_prefix,
        answers_by_prefix=by_prefix,
    )


def _cut(ids, media_ids: set[int]) -> tuple[int, bool, float]:
    """Where a row (padded to an even length) is cut in 2, whether between two media tokens, and the middle
    of its media tokens."""
    import torch

    from vlm_recipes.speedups.sequence_parallel import padded_length

    cut = padded_length(len(ids), 2) // 2
    media = torch.isin(ids, torch.tensor(sorted(media_ids)))
    where = media.nonzero().flatten()
    return cut, bool(media[cut - 1] and media[cut]), (where[0] + where[-1]).item() / 2


def _training_batch(collator, media_ids: set[int]) -> tuple[dict, list[dict]]:
    """The batch of 2 rows (the second shorter: padded), the first's last answer as long as puts the middle
    cut inside its image's tokens; and the rows, for the floor's micro-batches."""
    words = 1
    for _ in range(8):  # each word more moves the cut by half its tokens: a few steps reach the image
        rows = [_long_row(words), _short_row()]
        batch = collator(rows)
        cut, inside, middle = _cut(batch["input_ids"][0], media_ids)
        if inside:
            return dict(batch), rows
        words = max(1, words + round(middle - cut))
    raise AssertionError(f"no answer length put the cut inside the image (last: {words} words)")


def _trained_model(model_dir: Path, family, dtype, roles: str):
    """The model as a stage loads it, with the LM head SFTTrainer adds: every parameter trained, or the
    tower and projector frozen and run without autograd, as a stage runs them."""
    from trl.trainer.utils import add_fused_lm_head

    from vlm_recipes.model.build import load_model
    from vlm_recipes.recipes.schema import QuantizationSettings
    from vlm_recipes.speedups.frozen_vision import run_without_grad

    model = load_model(str(model_dir), QuantizationSettings(), family, dtype, "cpu")
    add_fused_lm_head(model)
    model.train().requires_grad_(True)
    if roles != EVERY_ROLE:
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(family.role_of(name) == "llm")
        run_without_grad(model, family)
    return model


def _step(model, batches: list[dict], count: int, split=None, release=None) -> tuple[float, dict]:
    """Forward and backward of each batch, the loss summed over its tokens and divided by the global batch's
    token count (as methods/sft_trainer.py's compute_loss), the gradients accumulated: (loss, gradients)."""
    loss = 0.0
    model.zero_grad(set_to_none=True)
    for batch in batches:
        inputs = split(batch) if split is not None else dict(batch)
        piece = -model(**inputs, fused_lm_head=True).log_probs.sum() / count
        piece.backward()
        if release is not None:
            release()
        loss += piece.item()
    return loss, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _summed_over_ranks(loss: float, grads: dict) -> tuple[float, dict]:
    """What DDP does with a step's gradients: summed over the ranks, in their dtype (one flat buffer per
    dtype, as its buckets); the loss likewise."""
    import torch
    from torch import distributed as dist

    for dtype in {g.dtype for g in grads.values()}:
        names = [n for n, g in grads.items() if g.dtype == dtype]
        flat = torch.cat([grads[n].flatten() for n in names])
        dist.all_reduce(flat)
        for name, part in zip(names, flat.split([grads[n].numel() for n in names]), strict=True):
            grads[name] = part.view_as(grads[name])
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item(), {n: g.float() for n, g in grads.items()}


def _wrong_split(kind: str, shard, model, family):
    """The shard's split made wrong: `positions`, each piece's restarting at 0 (what the language model would
    count on its piece were it not handed the whole row's); `labels`, cut without the shift."""
    from torch import nn

    from vlm_recipes.speedups.sequence_parallel import language_model_of

    if kind == "positions":

        def restart(module, args, kwargs):
            if shard.length is not None:
                kwargs["position_ids"] = kwargs["position_ids"] - kwargs["position_ids"][..., :1]
            return args, kwargs

        language_model_of(model, family).register_forward_pre_hook(restart, with_kwargs=True)
        return shard.split

    def unshifted(batch):
        inputs = shard.split(batch)
        labels = batch["labels"]
        inputs["shift_labels"] = shard.piece(
            nn.functional.pad(labels, (0, shard.length - labels.shape[1]), value=-100)
        )
        return inputs

    return unshifted


def _apart(got: tuple[float, dict], want: tuple[float, dict], family) -> dict:
    """The loss's distance relative to it; and per role, the gradients' largest distance relative to the
    role's largest gradient (a parameter's own would read noise as signal where its gradient is 0 but for
    rounding: a key projection's bias)."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert grads.keys() == ref_grads.keys(), sorted(grads.keys() ^ ref_grads.keys())[:5]
    scale, distance = {}, {}
    for name, ref in ref_grads.items():
        role = family.role_of(name) or "other"
        scale[role] = max(scale.get(role, 0.0), ref.abs().max().item())
        distance[role] = max(distance.get(role, 0.0), (grads[name] - ref).abs().max().item())
    return {"loss": abs(loss - ref_loss) / abs(ref_loss), **{r: distance[r] / scale[r] for r in scale}}


class _Said(logging.Handler):
    """What the sequence-parallel modules log: where the first row is cut, how the tower's work is split."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _ranks(rank: int, init: str, out: str) -> None:
    """Rank `rank` of 2: every case split; then its half of the cases' references and floors."""
    import copy

    import torch
    from torch import distributed as dist

    from vlm_recipes.demo.models import DEMO_MODELS, ensure_demo_model
    from vlm_recipes.speedups.sequence_parallel import sequence_shard_for

    torch.set_num_threads(1)  # the same summation order on every CPU
    torch.set_float32_matmul_precision("highest")  # fp32 matmuls in fp32 (oneDNN may take bf16 otherwise)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    said = _Said()
    logging.getLogger("vlm_recipes.speedups").addHandler(said)
    logging.getLogger("vlm_recipes.speedups").setLevel(logging.INFO)
    for model_id in MODELS[rank::2]:  # built once, half by each rank
        ensure_demo_model(model_id)
    dist.barrier()
    cases = {}
    for model_id in MODELS:
        family = DEMO_MODELS[model_id].family
        processor, collator = _collator(ensure_demo_model(model_id), family)
        media = {getattr(processor, n, None) for n in ("image_token_id", "video_token_id")} - {None}
        batch, rows = _training_batch(collator, media)
        cases[model_id] = {
            "family": family,
            "processor": processor,
            "batch": batch,
            "micro_batches": [dict(collator([row])) for row in rows],
            "count": int((batch["labels"][:, 1:] != -100).sum()),  # the global batch's tokens
        }
    kept = {}
    for index, (model_id, precision, roles) in enumerate(CASES):
        case = cases[model_id]
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
        model = _trained_model(ensure_demo_model(model_id), case["family"], dtype, roles)
        one_process = copy.deepcopy(model) if index % 2 == rank else None  # taken before the shard's hooks
        said.lines.clear()
        shard = sequence_shard_for(model, case["family"], case["processor"], 2)
        split = _summed_over_ranks(*_step(model, [case["batch"]], case["count"], shard.split, shard.release))
        wrong = None
        if kind := WRONG.get((model_id, precision)):
            wrong_split = _wrong_split(kind, shard, model, case["family"])
            wrong = _summed_over_ranks(
                *_step(model, [case["batch"]], case["count"], wrong_split, shard.release)
            )
        if one_process is not None:
            kept[(model_id, precision, roles)] = (one_process, split, wrong, said.lines[:])
    results = []
    for (model_id, precision, roles), (one_process, split, wrong, logged) in kept.items():
        case, family = cases[model_id], cases[model_id]["family"]
        loss, grads = _step(one_process, [case["batch"]], case["count"])
        reference = loss, {n: g.float().clone() for n, g in grads.items()}
        floor = _step(one_process, case["micro_batches"], case["count"])
        floor = floor[0], {n: g.float() for n, g in floor[1].items()}
        results.append(
            {
                "model": model_id,
                "precision": precision,
                "roles": roles,
                "tokens": case["batch"]["attention_mask"].sum(-1).tolist(),
                "labelled": case["count"],
                "logged": logged,  # the split's own account: where the row was cut, the tower's shares
                "split": _apart(split, reference, family),
                "floor": _apart(floor, reference, family),
                "wrong": _apart(wrong, reference, family) if wrong is not None else None,
                "wrong kind": WRONG.get((model_id, precision)),
            }
        )
    Path(f"{out}-{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_a_batch_split_over_two_ranks_trains_as_one_process_in_every_proven_family(tmp_path):
    """Per family and precision: 2 rows (the second padded; the first cut at its middle inside its image's
    tokens; the tower's work shared unequally) split over 2 ranks, the gradients summed over them, against
    one process on the whole batch: the loss and each role's gradients (tower, projector, language model)
    within FACTOR times the floor measured beside them (one unit roundoff of the precision where the floor
    is less); a wrong split far outside."""
    from torch import multiprocessing

    out = str(tmp_path / "rank")
    multiprocessing.spawn(_ranks, args=(f"file://{tmp_path / 'store'}", out), nprocs=2)
    results = [r for rank in range(2) for r in json.loads(Path(f"{out}-{rank}.json").read_text())]
    assert sorted((r["model"], r["precision"], r["roles"]) for r in results) == sorted(CASES)
    # docs/results/parallel-tests.md's table (pytest -s -n 0 prints it)
    print(
        "\n| model | precision | tokens | tower's units per rank | loss | tower | projector | language model |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for r in sorted(results, key=lambda r: CASES.index((r["model"], r["precision"], r["roles"]))):
        cells = [
            f"{r['split'][k]:.1e} / {r['floor'][k]:.1e}" if k in r["split"] else "frozen"
            for k in ("loss", "vision", "projector", "llm")
        ]
        tokens = " + ".join(map(str, r["tokens"]))
        units = re.search(r"encodes (\S+ \w+) per rank", " ".join(r["logged"]))
        row = [r["model"].removeprefix("demo:"), r["precision"], tokens, units[1] if units else "all", *cells]
        print(f"| {' | '.join(row)} |")
    for r in results:
        said = "\n".join(r["logged"])  # the split's own log: the cut, then the tower's shares
        assert re.search(r"cut at token\(s\) \[\d+\]: 1 of them inside an image's or video's tokens", said), r
        assert re.search(r"the vision tower encodes [1-9]\d*/[1-9]\d* (frames|tiles) per rank", said), r
        assert r["tokens"][1] < r["tokens"][0], r  # the second row padded
        trained = {"vision", "projector", "llm"} if r["roles"] == EVERY_ROLE else {"llm"}
        assert r["split"].keys() - {"loss"} == trained, r  # every trained role's gradients compared
        for what, distance in r["split"].items():
            assert distance <= FACTOR * max(r["floor"][what], UNIT_ROUNDOFF[r["precision"]]), (what, r)
    for r in (r for r in results if r["wrong"] is not None):
        beyond = max(
            r["wrong"][role] / (FACTOR * max(r["floor"][role], UNIT_ROUNDOFF[r["precision"]]))
            for role in r["wrong"]
            if role != "loss"
        )
        print(f"split wrongly ({r['wrong kind']}): {beyond:.0f}x the bound, {r['wrong']}")
        assert beyond > 10, r
