"""TRL's vision collator, with videos, and every image upright and in RGB (data/images.py).

TRL's DataCollatorForVisionLanguageModeling gives the processor a row's `images` and nothing else, so a row
with a `{"type": "video"}` part ends in the processor's "Found 1 <|video_pad|> tokens in the text but no
videos were passed". `VideoCollator` decodes each row's videos the qwen-vl-utils way (data/video.py), puts
the frames in the video parts, and tells the processor what they are: already sampled and sized, taken at
these times (`video_metadata`: Qwen2.5-VL's `second_per_grid_ts`, Qwen3-VL's `<t seconds>`). Batches
without a video are TRL's own; with one, everything but the videos (template, assistant mask, padding,
labels) is done as TRL does it.

The loss reads the assistant's answers only. TRL marks them from the chat template's {% generation %}
markers, swapping in its training variant of a template it knows; for a template with neither (a model the
generic family trains), `answers_by_prefix` tells each answer's tokens by rendering the conversation up to
it: what the conversation before it renders to with the generation prompt, and through it, are the
start of the whole row's tokens (checked), and the answer is what lies between.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import transformers
from packaging.version import Version
from trl.data_utils import prepare_multimodal_messages
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from vlm_recipes.data.images import upright_rgb
from vlm_recipes.data.video import VideoLoader
from vlm_recipes.errors import DataError

SEAM_TOKENS = 2  # tokens at the end of a rendered prefix that may merge with what follows in the whole row


@dataclass
class VideoCollator(DataCollatorForVisionLanguageModeling):
    videos: VideoLoader | None = None  # None: the model takes no video (such rows are refused earlier)
    # The chat template has no {% generation %} markers and TRL no training variant of it: TRL labels every
    # token (assistant_only_loss off), and the answers' tokens are told by rendering each one's prefix
    answers_by_prefix: bool = False

    @classmethod
    def extending(
        cls,
        collator: DataCollatorForVisionLanguageModeling,
        videos: VideoLoader | None,
        answers_by_prefix: bool = False,
    ):
        """The collator SFTTrainer built (its processor, training chat template, padding), with videos."""
        settings = {f.name: getattr(collator, f.name) for f in fields(DataCollatorForVisionLanguageModeling)}
        return cls(**settings, videos=videos, answers_by_prefix=answers_by_prefix)

    def _collate_language_modeling(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        examples = [with_upright_images(example) for example in examples]
        output = self._collate_with_videos(examples)
        if self.answers_by_prefix:
            self._label_answers_by_prefix(examples, output)
        return output

    def _collate_with_videos(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if self.videos is None or not any(example.get("videos") for example in examples):
            return super()._collate_language_modeling(examples)
        messages, metadata = [], []
        for example in examples:
            conversation = prepare_multimodal_messages(
                example["messages"], images=example.get("images") or []
            )
            videos = [self.videos.load(path) for path in example.get("videos") or []]
            messages.append(attach_videos(conversation, [frames for frames, _ in videos]))
            metadata += [about for _, about in videos]
        template_kwargs = self.template_kwargs(videos_kwargs=self.videos.processor_kwargs(metadata))
        output = self.processor.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=True,
            return_dict=True,
            return_tensors=self.return_tensors,
            return_assistant_tokens_mask=self.assistant_only_loss,
            **template_kwargs,
        )
        labels = output["input_ids"].clone()
        labels[output["attention_mask"] == 0] = -100
        if self.assistant_only_loss:
            labels[output.pop("assistant_masks") == 0] = -100
        output["labels"] = labels
        return output

    def template_kwargs(self, **extra) -> dict[str, Any]:
        """TRL's processor arguments (sft_trainer.DataCollatorForVisionLanguageModeling), plus `extra`, as
        `apply_chat_template` takes them."""
        processor_kwargs = {
            "padding": True,
            "padding_side": "right",
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "truncation": self.max_length is not None,
            "max_length": self.max_length,
            "add_special_tokens": False,
            **extra,
        }
        if Version(transformers.__version__) >= Version("5.4.0"):
            return {"processor_kwargs": processor_kwargs}
        return processor_kwargs

    def _label_answers_by_prefix(self, examples: list[dict[str, Any]], output: dict[str, Any]) -> None:
        """Keep the labels of each assistant turn only: the tokens between the conversation before it
        rendered with the generation prompt and the conversation through it, each rendered and processed
        on its own (`answers_by_prefix`)."""
        for row, example in enumerate(examples):
            conversation = prepare_multimodal_messages(
                example["messages"], images=example.get("images") or []
            )
            ids = output["input_ids"][row].tolist()
            keep = torch.zeros(len(ids), dtype=torch.bool)
            for index, message in enumerate(conversation):
                if message["role"] != "assistant":
                    continue
                start = self._rendered_ids(conversation[:index], ids, add_generation_prompt=True)
                end = self._rendered_ids(conversation[: index + 1], ids)
                keep[start:end] = True
            output["labels"][row][~keep] = -100

    def _rendered_ids(
        self, conversation: list[dict], ids: list[int], add_generation_prompt: bool = False
    ) -> int:
        """Where `conversation`, rendered and processed alone, stops agreeing with the whole row's `ids`. A
        token at the seam may differ (a generation prompt ending in a space, which the answer's first
        token absorbs in the whole row); more than that, and the template renders the start differently."""
        rendered = self.processor.apply_chat_template(
            [conversation],
            chat_template=self.chat_template,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs(padding=False),
        )["input_ids"][0]
        agreeing = 0
        for token, whole in zip(rendered, ids, strict=False):
            if token != whole:
                break
            agreeing += 1
        if len(rendered) - agreeing > SEAM_TOKENS:
            raise DataError(
                f"the chat template renders a conversation's first {len(conversation)} message(s) as other "
                "tokens than the start of the whole conversation, so each answer's tokens cannot be told: "
                "give the model a chat template with {% generation %} markers around the assistant's output"
            )
        return agreeing


class UprightImagesCollator:
    """A collator (TRL's preference collator) given every row's images upright and in RGB first."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        return self.inner([with_upright_images(example) for example in examples])

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def with_upright_images(example: dict[str, Any]) -> dict[str, Any]:
    """The row with its images as a photo viewer shows them (data/images.py); a new dict."""
    if not example.get("images"):
        return example
    return {**example, "images": [upright_rgb(image) for image in example["images"]]}


def attach_videos(messages: list[dict], videos: list) -> list[dict]:
    """The `{"type": "video"}` parts receive the row's videos (decoded frames) in order; new dicts, the
    row's own are left as they are."""
    videos = list(videos)
    attached = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                {**part, "video": videos.pop(0)}
                if isinstance(part, dict) and part.get("type") == "video"
                else part
                for part in content
            ]
        attached.append({**message, "content": content})
    return attached
