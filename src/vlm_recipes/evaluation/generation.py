"""Generation-based evaluation: batched greedy answers, exact match, and field-level scores for JSON answers;
where each eval row's images and videos are (`row_media`), kept beside its answer in predictions.jsonl.

Used after every stage (on the held-out split) and by scripts/predict.py, so both see the same prompts,
the same decoding and the same scoring.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from tqdm.auto import tqdm

from vlm_recipes.data.collate import attach_videos
from vlm_recipes.data.images import upright_rgb
from vlm_recipes.data.video import VideoLoader
from vlm_recipes.errors import DataError
from vlm_recipes.scoring import THINK_END, exact_match, final_answer, score_predictions, text_of

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


def prompts_from_rows(rows: Iterable[dict]) -> list[Prompt]:
    """Split each conversation before its last assistant turn: the prompt, and the reference answer.
    A preference row (method: dpo) is scored as its prompt followed by the chosen answer, a prompt row
    (method: grpo) as its prompt followed by its solution."""
    prompts = []
    for index, row in enumerate(rows):
        if "messages" in row:
            messages = row["messages"]
        elif "chosen" in row:
            messages = row["prompt"] + row["chosen"]
        else:
            solution = [{"type": "text", "text": row.get("solution") or ""}]
            messages = row["prompt"] + [{"role": "assistant", "content": solution}]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        context = attach_images(messages[:last], row.get("images"))
        user_text = " ".join(text_of(m["content"]) for m in messages[:last] if m["role"] == "user")
        prompts.append(
            Prompt(
                id=str(row.get("id") or index),
                messages=context,
                reference=text_of(messages[last]["content"]),
                task=row.get("task"),
                text=user_text,
                videos=list(row.get("videos") or []),
            )
        )
    return prompts


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
) -> tuple[dict, list[dict]]:
    """Generate for every row and score: returns (scores, prediction records)."""
    prompts = prompts_from_rows(rows)
    answers = generate_answers(
        model, processor, prompts, max_new_tokens, batch_size, desc, autocast_dtype, videos
    )
    records = []
    for p, generated in zip(prompts, answers, strict=True):
        answer = final_answer(generated)
        record = {"id": p.id, "task": p.task, "prompt": p.text, "reference": p.reference, "output": answer}
        if answer != generated:
            record["thinking"] = generated.rsplit(THINK_END, 1)[0]
        records.append(record | {"exact_match": exact_match(answer, p.reference or "")})
    return score_predictions(records, tolerance), records


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
