"""GLM-4.1V's chat template (zai-org/GLM-4.1V-9B-Thinking) and the variant stages train with.

The published text is the checkpoint's chat template at revision 3c1471e51dc811b589d4d12b1c1c7c1c941267c2 (its
`tokenizer_config.json`), as a public renderer-validation record quotes it with its sha256 (5232dbe7..., of
the JSON-quoted string), byte for byte. It writes `[gMASK]<sop>`, then `<|system|>`, `<|user|>` and
`<|assistant|>` turns with no end-of-turn token: the model ends its answer with the next role token or
<|endoftext|> (the generation config stops at <|endoftext|>, <|user|>, <|observation|>). An image part is
`<|begin_of_image|><|image|><|end_of_image|>`, a video part `<|begin_of_video|><|video|><|end_of_video|>`; the
processor expands <|image|> into the image's tokens and <|video|> into its frames.

Two things make it unusable for training as it is. It prints a system or assistant turn's content as it
comes (`{{ msg.content }}`): a turn of content parts, the shape every row has here, is printed as a Python
list (`[{'type': 'text', ...}]`). And it has no `{% generation %}` markers, and TRL ships no GLM-4V template.
`GLM4V_TRAINING_CHAT_TEMPLATE` is the same text with those contents printed as their text parts (a string
content renders exactly as published), and `{% generation %}` around each assistant turn's content; the last
turn of a conversation ends with <|endoftext|>, in the loss, as LLaMA-Factory's `glm4v` template (its
efficient EOS) and ms-swift's (its suffix) train it, so the model learns to stop
(tests/test_family_glm4v.py).
"""

from __future__ import annotations

GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>\n"
    "{%- for msg in messages %}\n"
    "    {%- if msg.role == 'system' %}\n"
    "<|system|>\n"
    "{{ msg.content }}\n"
    "    {%- elif msg.role == 'user' %}\n"
    "<|user|>{{ '\\n' }}\n"
    "\n"
    "        {%- if msg.content is string %}\n"
    "{{ msg.content }}\n"
    "        {%- else %}\n"
    "            {%- for item in msg.content %}\n"
    "                {%- if item.type == 'video' or 'video' in item %}\n"
    "<|begin_of_video|><|video|><|end_of_video|>\n"
    "                {%- elif item.type == 'image' or 'image' in item %}\n"
    "<|begin_of_image|><|image|><|end_of_image|>\n"
    "                {%- elif item.type == 'text' %}\n"
    "{{ item.text }}\n"
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "    {%- elif msg.role == 'assistant' %}\n"
    "        {%- if msg.metadata %}\n"
    "<|assistant|>{{ msg.metadata }}\n"
    "{{ msg.content }}\n"
    "        {%- else %}\n"
    "<|assistant|>\n"
    "{{ msg.content }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% endif %}"
)

STOP_TOKEN = "<|endoftext|>"  # the tokenizer's eos, and the first of the generation config's stop tokens

# a turn's content as text: a string as it is, content parts as their text parts
# (no `-` in its tags: the newline the published text writes before the content must stay)
_TEXT = (
    "{% if msg.content is string %}{{ msg.content }}{% else %}"
    "{% for item in msg.content %}{% if item.type == 'text' %}{{ item.text }}{% endif %}{% endfor %}"
    "{% endif %}"
)
# an assistant turn's content, marked for the loss; the conversation's last turn ends with the stop token
_ANSWER = "{% generation %}" + _TEXT + "{% if loop.last %}" + STOP_TOKEN + "{% endif %}{% endgeneration %}"


def _training_template() -> str:
    system = "<|system|>\n{{ msg.content }}\n"
    with_metadata = "<|assistant|>{{ msg.metadata }}\n{{ msg.content }}\n"
    plain = "<|assistant|>\n{{ msg.content }}\n"
    for published in (system, with_metadata, plain):
        assert GLM4V_CHAT_TEMPLATE.count(published) == 1, published
    return (
        GLM4V_CHAT_TEMPLATE.replace(system, "<|system|>\n" + _TEXT + "\n")
        .replace(with_metadata, "<|assistant|>{{ msg.metadata }}\n" + _ANSWER + "\n")
        .replace(plain, "<|assistant|>\n" + _ANSWER + "\n")
    )


GLM4V_TRAINING_CHAT_TEMPLATE = _training_template()
