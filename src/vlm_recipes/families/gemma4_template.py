"""Gemma 4's chat template for training: the published template with `{% generation %}` markers, so that
TRL's assistant-only loss trains on exactly what the model writes in its turn, and renders the same text.

The published templates (google/gemma-4-*-it; every revision TRL 1.16 stores as trl/chat_templates/
gemma4*.jinja) have no generation markers, and TRL ships no training variant of them:
`get_training_chat_template` raises for them. A model turn renders as

    <|turn>model\\n [<|channel>thought\\n{reasoning}\\n<channel|>] [<|tool_call>call:name{...}<tool_call|>]...
        [<|tool_response>response:name{...}<tool_response|>]... {content} <turn|>\\n

(the thinking channel only for a turn after the last user message; a turn that ends on a tool call whose
response is not there yet ends with `<|tool_response>`, the token the model stops on to hand over to the
tool, instead of `<turn|>`). In the loss: the thinking channel, the tool calls, the content and the turn's
end (`<turn|>\\n`, or `<|tool_response>`): what the model writes. Out of it: the `<|turn>model\\n` header,
with the empty thought channel some revisions print after it when thinking is off (the generation prompt
writes both at inference), and the tool responses the template inlines into the model turn (the tool
writes them).

`training_template` inserts the markers at anchors of the published text, then checks its result: every
probe conversation renders byte for byte as the published template renders it, and the loss of a plain
answer covers exactly the answer and `<turn|>\\n`. The revisions that write a turn's content through
`captured_content` (TRL's gemma4, gemma4_v4 and gemma4_v5, the current one) pass; the two older ones
(gemma4_v2, the release revision, and gemma4_v3) have no anchors and get None.
"""

from __future__ import annotations

import re
from functools import lru_cache

from vlm_recipes.families.training_templates import cut_at

_THINKING = "{#- Render reasoning/reasoning_content as thinking channel -#}"
_TOOL_RESPONSES = "{%- set ns_tr_out = namespace(flag=false) -%}"
_CONTENT = "{{- captured_content -}}"
_GENERATION_PROMPT = "{%- if add_generation_prompt -%}"
# what ends a model turn: the handover to a tool, or the end of the turn (as the template writes them)
_TURN_ENDS = ("{{- '<|tool_response>' -}}", "{{- '<turn|>\\n' -}}")
_PROBE_ANSWER = "The answer is 4."

# Conversations whose rendering the training template must reproduce byte for byte: a plain answer, a
# system prompt with an image and two turns, a final turn with its thinking, a tool call and its response.
_PROBES = (
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": _PROBE_ANSWER}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Red."}]},
        {"role": "user", "content": [{"type": "text", "text": "And the shape?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A square."}]},
    ],
    [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "7 has no divisor but 1 and 7."},
    ],
    [
        {"role": "user", "content": "What is 2 * 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}
            ],
        },
        {"role": "tool", "name": "multiply", "content": "6"},
        {"role": "assistant", "content": "It is 6."},
    ],
)


def _in_loss(output: str) -> str:
    """A template output tag, in the loss when the turn is the model's."""
    return (
        "{%- if role == 'model' -%}{%- generation -%}" + output + "{%- endgeneration -%}"
        "{%- else -%}" + output + "{%- endif -%}"
    )


def _with_markers(template: str) -> str | None:
    """The published template with generation markers at its anchors (None: an anchor is missing)."""
    try:
        pieces = cut_at(template, _THINKING, _TOOL_RESPONSES, _CONTENT, _GENERATION_PROMPT)
    except ValueError:  # an anchor missing or repeated: not a text this knows how to mark
        return None
    # model_output: the thinking channel and the tool calls (empty in a user's turn), captured, then written
    # in the loss
    head, model_output, responses, end_of_turn, generation_prompt = pieces
    for end in _TURN_ENDS:
        if end_of_turn.count(end) != 1:
            return None
        end_of_turn = end_of_turn.replace(end, _in_loss(end))
    return (
        head
        + _THINKING
        + "{%- set model_output -%}"
        + model_output
        + "{%- endset -%}"
        + _in_loss("{{- model_output -}}")
        + _TOOL_RESPONSES
        + responses
        + _in_loss(_CONTENT)
        + end_of_turn
        + _GENERATION_PROMPT
        + generation_prompt
    )


def _renders_the_same(published: str, training: str) -> bool:
    """Every probe renders byte for byte as the published template renders it (with and without the
    generation prompt), and the loss of the plain answer is the answer and the end of its turn."""
    from transformers.utils.chat_template_utils import render_jinja_template

    special = {"bos_token": "<bos>", "eos_token": "<eos>"}
    for prompt in (False, True):
        kwargs = {"conversations": _PROBES, "add_generation_prompt": prompt, **special}
        expected, _ = render_jinja_template(chat_template=published, **kwargs)
        rendered, _ = render_jinja_template(chat_template=training, **kwargs)
        if rendered != expected:
            return False
    [text], [spans] = render_jinja_template(
        conversations=_PROBES[:1], chat_template=training, return_assistant_tokens_mask=True, **special
    )
    return "".join(text[start:end] for start, end in spans) == _PROBE_ANSWER + "<turn|>\n"


@lru_cache(maxsize=8)
def training_template(template: str) -> str | None:
    """The training variant of a published Gemma 4 chat template (None: not one this knows how to mark,
    or the marked template would render differently)."""
    training = _with_markers(template)
    if training is None or not _renders_the_same(template, training):
        return None
    return training


def has_generation_markers(template: str) -> bool:
    """The template marks what the model generates already (this module's output, saved with a stage's
    final/ model, or a template that came marked)."""
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def looks_like_gemma4(template: str) -> bool:
    """A Gemma 4 chat template (its turns open with `<|turn>`)."""
    return "<|turn>" in template
