"""TRL's vision collator, with videos, and every image upright and in RGB (data/images.py).

TRL's DataCollatorForVisionLanguageModeling gives the processor a row's `images` and nothing else, so a row
with a `{"type": "video"}` part ends in the processor's "Found 1 <|video_pad|> tokens in the text but no
videos were passed". `VideoCollator` decodes each row's videos the qwen-vl-utils way (data/video.py), puts
the frames in the video parts, and tells the processor what they are: already sampled and sized, taken at
these times (`video_metadata`: Qwen2.5-VL's `second_per_grid_ts`, Qwen3-VL's `<t seconds>`). Batches
without a video are TRL's own; with one, everything but the videos (template, assistant mask, padding,
labels) is done as TRL does it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import transformers
from packaging.version import Version
from trl.data_utils import prepare_multimodal_messages
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from vlm_recipes.data.images import upright_rgb
from vlm_recipes.data.video import VideoLoader


@dataclass
class VideoCollator(DataCollatorForVisionLanguageModeling):
    videos: VideoLoader | None = None  # None: the model takes no video (such rows are refused earlier)

    @classmethod
    def extending(cls, collator: DataCollatorForVisionLanguageModeling, videos: VideoLoader | None):
        """The collator SFTTrainer built (its processor, training chat template, padding), with videos."""
        settings = {f.name: getattr(collator, f.name) for f in fields(DataCollatorForVisionLanguageModeling)}
        return cls(**settings, videos=videos)

    def _collate_language_modeling(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        examples = [with_upright_images(example) for example in examples]
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
        # TRL's arguments (sft_trainer.DataCollatorForVisionLanguageModeling), plus the videos'
        processor_kwargs = {
            "padding": True,
            "padding_side": "right",
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "truncation": self.max_length is not None,
            "max_length": self.max_length,
            "add_special_tokens": False,
            "videos_kwargs": self.videos.processor_kwargs(metadata),
        }
        if Version(transformers.__version__) >= Version("5.4.0"):
            template_kwargs = {"processor_kwargs": processor_kwargs}
        else:
            template_kwargs = processor_kwargs
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
