"""Generation-based evaluation: batched greedy answers, exact match, field-level scores for JSON answers and
the benchmarks' own metrics (evaluation/benchmarks.py); where each eval row's images and videos are
(`row_media`), kept beside its answer in predictions.jsonl.

Used after every stage (on the held-out split) and by scripts/predict.py, so both see the same prompts,
the same decoding and the same scoring.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from tqdm.auto import tqdm

from vlm_recipes.benchmark_metrics import METRICS
from vlm_recipes.benchmark_metrics.metric import Box, Targets
from vlm_recipes.benchmark_metrics.vqa_accuracy import exact_match_score
from vlm_recipes.data.collate import attach_videos
from vlm_recipes.data.images import upright_rgb
from vlm_recipes.data.mixture import MIXTURE_SOURCE_COLUMN
from vlm_recipes.data.video import VideoLoader
from vlm_recipes.errors import DataError
from vlm_recipes.evaluation.benchmarks import answer_scores, choose_eval_metrics, row_targets
from vlm_recipes.methods.grounding import in_image_pixels, resized_size
from vlm_recipes.scoring import THINK_END, final_answer, first_box, score_predictions, text_of

# ---------------------------------------------------------------------------------------------
# Generation


@dataclass
class Prompt:
    id: str
    messages: list[dict]  # conversation up to (not including) the answer, images attached to image parts
    reference: str | None = None
    task: str | None = None
    text: str = field(default="")  # the user's words, for predictions.jsonl
    videos: list[str] = field(default_factory=list)  # for the video parts, decoded batch by batch
    targets: Targets | None = None  # what the row carries for the benchmarks' metrics
    source: str | None = None  # an eval mixture's row: its source, as the recipe names it


def attach_images(messages: list[dict], images: list) -> list[dict]:
    """Content parts `{"type": "image"}` receive the row's images in order, as processors expect."""
    images = list(images or [])
    attached = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            attached.append({"role": message["role"], "content": [{"type": "text", "text": content}]})
            continue
        parts = []
        for part in content:
            if part.get("type") == "image":
                image = images.pop(0)
                parts.append(
                    {
                        "type": "image",
                        "image": upright_rgb(image) if isinstance(image, Image.Image) else image,
                    }
                )
            elif part.get("type") == "video":
                parts.append({"type": "video"})  # frames attached when its batch is generated
            elif part.get("type") == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
        attached.append({"role": message["role"], "content": parts})
    return attached


def conversation_of(row: dict) -> tuple[list[dict], int]:
    """The row's conversation and the index of its last assistant turn, the answer scored. A preference row
    (method: dpo) is its prompt followed by the chosen answer, a prompt row (method: grpo) its prompt
    followed by its solution."""
    if "messages" in row:
        messages = row["messages"]
    elif "chosen" in row:
        messages = row["prompt"] + row["chosen"]
    else:
        solution = [{"type": "text", "text": row.get("solution") or ""}]
        messages = row["prompt"] + [{"role": "assistant", "content": solution}]
    return messages, max(i for i, m in enumerate(messages) if m["role"] == "assistant")


def prompts_from_rows(rows: Iterable[dict], source: str = "eval") -> list[Prompt]:
    """Split each conversation before its last assistant turn: the prompt, and the reference answer; with
    what the row carries for the benchmarks' metrics (a DataError naming `source` and the row where that
    cannot be read)."""
    prompts = []
    for index, row in enumerate(rows):
        messages, last = conversation_of(row)
        context = attach_images(messages[:last], row.get("images"))
        user_text = " ".join(text_of(m["content"]) for m in messages[:last] if m["role"] == "user")
        reference = text_of(messages[last]["content"])
        row_id = str(row.get("id") or index)
        prompts.append(
            Prompt(
                id=row_id,
                messages=context,
                reference=reference,
                task=row.get("task"),
                text=user_text,
                videos=list(row.get("videos") or []),
                targets=row_targets(row, reference, f"{source} row {row_id}"),
                source=row.get(MIXTURE_SOURCE_COLUMN),
            )
        )
    return prompts


def eval_targets(rows, source: str) -> list[Targets]:
    """What every eval row carries for the benchmarks' metrics, read without decoding an image (the data
    check, before the model loads): a DataError naming the row where a value cannot be read."""
    if hasattr(rows, "column_names"):
        rows = rows.select_columns([c for c in rows.column_names if c not in ("images", "videos")])
    targets = []
    for index, row in enumerate(rows):
        messages, last = conversation_of(row)
        where = f"{source} row {row.get('id') or index}"
        targets.append(row_targets(row, text_of(messages[last]["content"]), where))
    return targets


@torch.no_grad()
def generate_answers(
    model,
    processor,
    prompts: list[Prompt],
    max_new_tokens: int = 64,
    batch_size: int = 8,
    desc: str = "generating",
    autocast_dtype: torch.dtype | None = None,
    videos: VideoLoader | None = None,
) -> list[str]:
    """Greedy answers, batched with left padding (generation continues from each prompt's end).

    A model mid-training mixes fp32 trainable and half-precision frozen weights: it must generate under
    the autocast it trained with (`autocast_dtype`), or fp32 activations meet bf16 weights. Videos are
    decoded one batch at a time (`videos`: how, for this model)."""
    tokenizer = processor.tokenizer
    previous_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    device = next(p.device for p in model.parameters())
    # A mixture of experts whose config asks for router logits (TRL turns them on to train with the
    # load-balancing loss) computes that loss in every forward, and in a cached decoding step it sets one
    # new token against the whole attention mask (transformers 5.23's load_balancing_loss_func raises):
    # generation asks for none.
    moe = (
        {"output_router_logits": False}
        if hasattr(model.config.get_text_config(), "output_router_logits")
        else {}
    )
    outputs: list[str] = []
    try:
        for start in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch", leave=False):
            batch = prompts[start : start + batch_size]
            messages, processor_kwargs = with_videos(batch, videos)
            inputs = processor.apply_chat_template(
                messages,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                processor_kwargs={"padding": True, **processor_kwargs},
            ).to(device)
            with torch.autocast(
                device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
            ):
                generated = model.generate(
                    **inputs,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    **moe,
                )
            new_tokens = generated[:, inputs["input_ids"].shape[1] :]
            outputs += [t.strip() for t in processor.batch_decode(new_tokens, skip_special_tokens=True)]
    finally:
        tokenizer.padding_side = previous_side
        model.train(was_training)
    return outputs


def with_videos(batch: list[Prompt], videos: VideoLoader | None) -> tuple[list[list[dict]], dict]:
    """The batch's conversations with their videos' frames attached, and the processor's video arguments."""
    if not any(p.videos for p in batch):
        return [p.messages for p in batch], {}
    if videos is None:
        raise DataError("a prompt has a video but the model takes no video")
    loaded = [[videos.load(path) for path in p.videos] for p in batch]
    messages = [
        attach_videos(p.messages, [frames for frames, _ in v]) for p, v in zip(batch, loaded, strict=True)
    ]
    metadata = [about for v in loaded for _, about in v]
    return messages, {"videos_kwargs": videos.processor_kwargs(metadata)}


def evaluate_generation(
    model,
    processor,
    rows,
    max_new_tokens: int,
    batch_size: int,
    tolerance: float,
    desc: str = "generating",
    autocast_dtype: torch.dtype | None = None,
    videos: VideoLoader | None = None,
    metrics: Sequence[str] | None = None,
    box_format: str | None = None,
) -> tuple[dict, list[dict]]:
    """Generate for every row and score: returns (scores, prediction records). `metrics`: what the answers
    are scored by besides exact match (benchmarks.choose_eval_metrics; None: what the rows carry), each row's
    score in its record, their means in the scores. `box_format`: the frame the model writes boxes in
    (methods/grounding.py), for rows whose reference box is a `solution` in the image's pixels; None: read
    as written."""
    prompts = prompts_from_rows(rows)
    if metrics is None:
        metrics, _ = choose_eval_metrics(None, [p.targets for p in prompts], "the eval rows")
    answers = generate_answers(
        model, processor, prompts, max_new_tokens, batch_size, desc, autocast_dtype, videos
    )
    records = []
    for p, generated in zip(prompts, answers, strict=True):
        answer = final_answer(generated)
        record = {"id": p.id, "task": p.task, "prompt": p.text, "reference": p.reference, "output": answer}
        if p.source is not None:
            record["source"] = p.source  # scored per source too (scoring.score_predictions)
        if answer != generated:
            record["thinking"] = generated.rsplit(THINK_END, 1)[0]
        # the best over the row's accepted answers (a DocVQA row's few `answers`), read by score_predictions
        record["exact_match"] = exact_match_score(answer, p.targets, p.reference or "")
        box = answer_box_in_pixels(answer, p, processor, box_format)
        records.append(record | answer_scores(answer, p.targets, metrics, box))
    return score_predictions(records, tolerance, [m for m in metrics if m in METRICS]), records


def answer_box_in_pixels(answer: str, prompt: Prompt, processor, box_format: str | None) -> Box | None:
    """The answer's box in pixels of the row's first image, for a row whose reference box is a `solution`
    (pixels, as the iou reward reads it) and a model writing boxes in another frame; None otherwise (the
    answer's box is read as written)."""
    targets = prompt.targets
    if targets is None or not targets.box_in_pixels or box_format in (None, "same", "pixels"):
        return None
    box = first_box(answer)
    image = next(
        (p["image"] for m in prompt.messages for p in m["content"] if p.get("type") == "image"), None
    )
    if box is None or image is None:
        return None
    if not isinstance(image, Image.Image):
        with Image.open(image) as opened:
            size = opened.size
    else:
        size = image.size
    resized = resized_size(processor, *size) if box_format == "resized_pixels" else None
    return in_image_pixels(box, box_format, size, resized)


def row_media(rows, spill_dir: Path) -> list[dict[str, list[str]]]:
    """Per eval row, where its images and videos are, for the report page to show beside the answers: an
    image's file where it has one, else its bytes written to `spill_dir` (a dataset that embeds them)."""
    from vlm_recipes.data.rows import undecoded

    count = len(rows)
    images = undecoded(rows)["images"] if "images" in rows.column_names else [[]] * count
    videos = rows["videos"] if "videos" in rows.column_names else [[]] * count
    media = []
    for i, (row_images, row_videos) in enumerate(zip(images, videos, strict=True)):
        paths = []
        for k, image in enumerate(row_images or []):
            path, data = image.get("path"), image.get("bytes")
            if path and Path(path).is_file():
                paths.append(str(Path(path).resolve()))
            elif data:
                spill_dir.mkdir(parents=True, exist_ok=True)
                (spill_dir / f"{i}-{k}").write_bytes(data)
                paths.append(str((spill_dir / f"{i}-{k}").resolve()))
            else:
                paths.append(path or "")  # gone: the page shows a marked placeholder
        media.append({"images": paths, "videos": [str(v) for v in row_videos or []]})
    return media
