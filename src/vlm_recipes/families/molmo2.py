"""Molmo2 (`molmo2`, allenai/Molmo2-4B and its kin): trained through the generic family's roles, with the
published chat template (`MOLMO2_CHAT_TEMPLATE`) swapped for a training variant that can be trained.

The published template (CHAT_TEMPLATE of olmo/hf_model/convert_molmo2_to_hf.py in github.com/allenai/molmo2,
the script that wrote the checkpoints' template) writes every image placeholder first, before the first turn,
then the turns:

    <|image|><|im_start|>user\\n{question}<|im_end|>\\n <|im_start|>assistant\\n{answer}<|im_end|>\\n<|im_start|>user...

An assistant turn opens with a space (`{% else %} {# assistant #}`) that the generation prompt
(`<|im_start|>assistant\\n`) lacks, and the `<|im_end|>` closing an answer is written by the next user turn, so
a conversation's last answer ends with no end token. It has no `{% generation %}` markers and TRL has no
training variant of it. Trained as is:
- the answers could only be told by rendering each one's prefix (data/collate.py), and the prefix with the
  generation prompt does not agree with the whole conversation (no space before `<|im_start|>assistant`):
  the runner refuses the rows;
- the last answer's `<|im_end|>` (the token generation stops on: the config's eos) would never be in the
  loss, and the model would never learn to stop.

`MOLMO2_TRAINING_CHAT_TEMPLATE` renders, for every conversation the published template renders, the same text
except that the last assistant answer is followed by `<|im_end|>`: each assistant turn writes its answer and
its own closing `<|im_end|>` inside `{% generation %}` (so the stop token is in the loss), and a later user
turn writes only the `\\n` after it. A prompt ending on a user turn (what generation renders, with or without
the generation prompt) renders exactly as published. The header (` <|im_start|>assistant\\n`, its space kept)
stays out of the loss.

It also starts with `bos_token` (Molmo2's conversion sets bos = eos = `<|im_end|>`): Molmo2Processor prepends
the bos to every text that does not start with it (transformers' stopgap until the hub templates write it,
allenai/Molmo2-4B#4), after the template was rendered, so the `{% generation %}` spans transformers'
`apply_chat_template` computes on the rendered text would land `len(bos_token)` characters early in the
processed one and mark the wrong tokens. Written by the template, the processor adds none: the same tokens.

What else the model needs holds already: Molmo2ForConditionalGeneration refuses to train without
`mm_token_type_ids` (its image tokens attend to each other bidirectionally), which Molmo2Processor returns with
every call and TRL's vision collator passes on with the rest of the processor's output; and the image tokens
(`<im_patch>`, `<im_col>`, ...) have ids past the LM head's vocabulary (the embedding's additional_vocab_size
rows), which sit before the first answer, outside every `{% generation %}` span: the assistant-only mask sets
their labels to -100.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vlm_recipes.families.generic_family import GenericFamily

# The published chat template byte for byte (CHAT_TEMPLATE of olmo/hf_model/convert_molmo2_to_hf.py in
# github.com/allenai/molmo2; the demo's tiny Molmo2 ships it too).
MOLMO2_CHAT_TEMPLATE = (
    "{% set DEMO_STYLES = ["
    "'point_count','pointing','cosyn_point','user_qa','long_caption','short_caption',"
    "'video_long_caption','video_short_caption','video_point_track_per_frame',"
    "'video_point_track_start_end','video_point_track_all_frames','video_single_point_track_start_end',"
    "'video_transcript','video_clip_caption_start_end','video_clip_caption_start_end_in_seconds',"
    "'video_clip_transcript_start_end','video_clip_transcript_start_end_in_seconds',"
    "'video_frame_caption_timestamp','video_frame_caption_timestamp_in_seconds',"
    "'correction_qa','text_sft','video_point','video_point_count','video_count','video_count_point',"
    "'multi_image_pointing','multi_image_counting','multi_image_point_then_count',"
    "'multi_image_count_then_point','demo','a_okvqa_mc','ai2_diagram_no_letter','ai2_diagram','science_qa',"
    "'multi_image_mc','multi_image_mc_exp','mantis_instruct_mc',"
    "'video_multiple_choice','video_multiple_choice_count_without_pointing',"
    "'video_multiple_choice_multiple_correct','video_multiple_choice_w_subtitle'] %}"
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% set has_subtitle = messages and messages[0]['role'].lower() == 'subtitle' %}"
    "{% for message in messages %}{% if message['content'] is not string %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% elif content['type'] == 'video' or 'video' in content or 'video_url' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if image_count.value == 1 %}{{ '<|image|>' }}{% elif image_count.value > 1 %}"
    "{% for i in range(image_count.value) %}{{ 'Image ' ~ (i + 1) ~ '<|image|>' }}{% endfor %}{% endif %}"
    "{% for _ in range(video_count.value) %}{{ '<|video|>' }}{% endfor %}"
    "{% if has_subtitle %}{{ messages[0]['content'] }}{% endif %}"
    "{% for message in messages %}{% set role = message['role'].lower() %}"
    "{% if role == 'subtitle' %}{% continue %}{% endif %}"
    "{% set conv_index = loop.index - (1 if has_subtitle else 0) %}"
    "{%- if (conv_index % 2 == 1 and role != 'user') or (conv_index % 2 == 0 and role != 'assistant') -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{% if message['content'] is string %}{% set text_content = message['content'] %}{% else %}"
    "{% set m = namespace(text='') %}{% for content in message['content'] %}{% if content['type'] == 'text' %}"
    "{% if content['style'] is defined and content['style'] not in DEMO_STYLES %}"
    "{% set seg = content['style'] ~ ': ' ~ content['text'] %}{% else %}{% set seg = content['text'] %}"
    "{% endif %}{% set m.text = m.text ~ ('' if not m.text else ' ') ~ seg %}{% endif %}{% endfor %}"
    "{% set text_content = m.text %}{% endif %}"
    "{% if role == 'user' %}"
    "{% if not (has_subtitle and loop.index == 2) and not (not has_subtitle and loop.first) %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>user\\n' }}{{ text_content }}{{ '<|im_end|>\\n' }}"
    "{% else %} {# assistant #}{{ '<|im_start|>assistant\\n' }}{{ text_content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _replaced(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise AssertionError(f"the published Molmo2 template holds {text.count(old)} of {old!r}, not 1")
    return text.replace(old, new)


# A user turn after an answer writes only the "\n" after the answer's <|im_end|> (the answer wrote it)
_USER_AFTER_ANSWER = "{{ '<|im_end|>\\n' }}{% endif %}{{ '<|im_start|>user\\n' }}"
# The assistant turn: its header (the space kept) out of the loss, the answer and its <|im_end|> in it
_ASSISTANT_TURN = "{% else %} {# assistant #}{{ '<|im_start|>assistant\\n' }}{{ text_content }}{% endif %}"
# The first placeholder the published template writes (after its `{% set %}`s, which write nothing)
_FIRST_OUTPUT = "{% if image_count.value == 1 %}"

MOLMO2_TRAINING_CHAT_TEMPLATE = _replaced(
    _replaced(
        _replaced(
            MOLMO2_CHAT_TEMPLATE,
            _USER_AFTER_ANSWER,
            "{{ '\\n' }}{% endif %}{{ '<|im_start|>user\\n' }}",
        ),
        _ASSISTANT_TURN,
        "{% else %} {# assistant #}{{ '<|im_start|>assistant\\n' }}"
        "{% generation %}{{ text_content }}{{ '<|im_end|>' }}{% endgeneration %}{% endif %}",
    ),
    _FIRST_OUTPUT,
    "{{ bos_token }}" + _FIRST_OUTPUT,
)


@dataclass(frozen=True)
class Molmo2Family(GenericFamily):
    """Molmo2 through the generic family's roles, trained with `MOLMO2_TRAINING_CHAT_TEMPLATE`: the published
    text but for the `<|im_end|>` after the last answer (and the bos the processor would prepend anyway),
    each answer and its `<|im_end|>` marked for the loss."""

    training_chat_templates: ClassVar[dict[str, str]] = {MOLMO2_CHAT_TEMPLATE: MOLMO2_TRAINING_CHAT_TEMPLATE}
