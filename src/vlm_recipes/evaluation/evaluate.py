"""Generation-based evaluation: batched greedy answers, exact match, and field-level scores for JSON answers.

Used after every stage (on the held-out split) and by scripts/predict.py, so both see the same prompts,
the same decoding and the same scoring.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from PIL import Image
from tqdm.auto import tqdm

from vlm_recipes.data.collate import attach_videos
from vlm_recipes.data.images import upright_rgb
from vlm_recipes.data.video import VideoLoader
from vlm_recipes.errors import DataError

# ---------------------------------------------------------------------------------------------
# Scoring (pure functions, tested against hand-computed cases)


def normalize_text(text: str) -> str:
    """Lower case, single spaces, no surrounding punctuation: `Red.` and ` red` are the same answer."""
    return re.sub(r"\s+", " ", text.strip().lower()).strip(" .!?;:,\"'")


THINK_END = "</think>"


def final_answer(text: str) -> str:
    """What a thinking model answers after its reasoning: the text after the last `</think>` (Qwen3.5's
    template opens `<think>` in the generation prompt and trains `<think>\n\n</think>\n\n` before every
    answer, so its generations start `</think>`), else the whole text. Scored as the answer; the rest is
    kept as `thinking` in predictions.jsonl."""
    return text.rsplit(THINK_END, 1)[1].strip() if THINK_END in text else text


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_text(prediction) == normalize_text(reference))


def parse_json_object(text: str) -> dict | None:
    """The first JSON object in a model's output (models often wrap it in prose or code fences)."""
    start = text.find("{")
    while start != -1:
        depth = 0
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                try:
                    value = json.loads(text[start : end + 1])
                except json.JSONDecodeError:
                    break
                return value if isinstance(value, dict) else None
        start = text.find("{", start + 1)
    return None


def flatten(obj: dict, prefix: str = "") -> dict[str, object]:
    """Nested objects become dotted keys: {"a": {"b": 1}} → {"a.b": 1}."""
    flat: dict[str, object] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _as_number(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace(",", ""))
        except ValueError:
            return None
    return None


def values_match(predicted, reference, tolerance: float) -> bool:
    """Numbers match within a relative tolerance (at least `tolerance` absolute); anything else as text."""
    ref_num, pred_num = _as_number(reference), _as_number(predicted)
    if ref_num is not None and pred_num is not None:
        return math.isclose(pred_num, ref_num, rel_tol=tolerance, abs_tol=tolerance)
    return normalize_text(str(predicted)) == normalize_text(str(reference))


@dataclass
class FieldCounts:
    true_positive: int = 0
    false_positive: int = 0
    false_negative: int = 0
    parsed: bool = True


def json_field_counts(prediction: str, reference: dict, tolerance: float) -> FieldCounts:
    """Per field: right value → TP; wrong value → FP and FN; missing → FN; extra → FP.
    Unparseable output scores every reference field as missed."""
    ref = flatten(reference)
    parsed = parse_json_object(prediction)
    if parsed is None:
        return FieldCounts(false_negative=len(ref), parsed=False)
    pred = flatten(parsed)
    counts = FieldCounts()
    for key, value in ref.items():
        if key in pred and values_match(pred[key], value, tolerance):
            counts.true_positive += 1
        else:
            counts.false_negative += 1
            counts.false_positive += key in pred
    counts.false_positive += sum(1 for key in pred if key not in ref)
    return counts


def precision_recall_f1(tp: int, fp: int, fn: int) -> dict[str, float]:
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def score_predictions(records: Iterable[dict], tolerance: float = 0.01) -> dict:
    """Aggregate scores over prediction records (`reference`, `output`, optional `task`).

    Exact match for every row; JSON field precision/recall/F1 for rows whose reference is a JSON object.
    Also broken down per task when rows carry one."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups["all"].append(record)
        if record.get("task"):
            groups[f"task:{record['task']}"].append(record)
    scores = {}
    for name, rows in groups.items():
        entry: dict = {
            "rows": len(rows),
            "exact_match": sum(exact_match(r["output"], r["reference"]) for r in rows) / len(rows),
        }
        total = FieldCounts()
        json_rows = 0
        for r in rows:
            reference = parse_json_object(r["reference"])
            if reference is None or not r["reference"].strip().startswith("{"):
                continue
            counts = json_field_counts(r["output"], reference, tolerance)
            json_rows += 1
            total.true_positive += counts.true_positive
            total.false_positive += counts.false_positive
            total.false_negative += counts.false_negative
            total.parsed = total.parsed and counts.parsed
            entry.setdefault("_parsed", 0)
            entry["_parsed"] += counts.parsed
        if json_rows:
            entry["json_fields"] = precision_recall_f1(
                total.true_positive, total.false_positive, total.false_negative
            )
            entry["json_fields"]["parse_rate"] = entry.pop("_parsed") / json_rows
            entry["json_fields"]["rows"] = json_rows
        scores[name] = entry
    return scores


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


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    return " ".join(p.get("text") or "" for p in content if p.get("type") == "text").strip()


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
        user_text = " ".join(_text_of(m["content"]) for m in messages[:last] if m["role"] == "user")
        prompts.append(
            Prompt(
                id=str(row.get("id") or index),
                messages=context,
                reference=_text_of(messages[last]["content"]),
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
