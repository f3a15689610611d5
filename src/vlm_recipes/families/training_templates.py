"""What the training variants of published chat templates share: the published text cut at anchors that must
each stand in it once, and a turn's body put inside {% generation %} when the turn is the assistant's. A
variant renders exactly the published text; only the assistant-only loss reads its markers."""

from __future__ import annotations


def cut_at(template: str, *anchors: str) -> list[str]:
    """The text before each anchor in turn, then what follows the last; each anchor must stand exactly once
    in what the one before it left (else ValueError: the published text changed)."""
    pieces = []
    for anchor in anchors:
        if (count := template.count(anchor)) != 1:
            raise ValueError(f"the chat template holds {count} of {anchor!r}, not 1: not the published text")
        before, template = template.split(anchor)
        pieces.append(before)
    return [*pieces, template]


def turn_bodies_in_the_loss(template: str, header: str, loop_end: str) -> str:
    """`template` with each turn's body (from its `header` to `loop_end`, the end of the messages loop) inside
    {% generation %} when the turn is the assistant's and as it was otherwise: the answer and its
    end-of-turn marked for the loss (the stop token trained, as TRL's qwen2_5_vl training template does)."""
    before, body, after = cut_at(template, header, loop_end)
    marked = (
        "{% if message['role'] == 'assistant' %}{% generation %}"
        + body
        + "{% endgeneration %}{% else %}"
        + body
        + "{% endif %}"
    )
    return before + header + marked + loop_end + after
