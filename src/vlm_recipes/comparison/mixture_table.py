"""The draw of each stage trained on a mixture of sources, as its report.json records it (`data.mixture`):
a line per recipe and stage under `compare`'s table, and a small table per stage on the report page
(source, format, share, rows drawn, tokens). Read from the run's files only; nothing is drawn again."""

from __future__ import annotations

import html

from vlm_recipes.recipes.data_sources import DataSource, entry_share

# (recipe, stage, its report.json's data.mixture): one per stage trained on a mixture, of each recipe's first run
Draw = tuple[str, str, list[dict]]


def share(source: dict) -> str:
    """A weight as the recipe wrote it (`0.7`); `samples 100` or `all rows` otherwise."""
    if source.get("weight") is not None:
        return f"{source['weight']:g}"
    return entry_share(DataSource(source["source"], None, source.get("samples")))


def mixture_line(draw: Draw) -> str:
    """`mixture (r3-two-stage-mixture, llm-lora): demo:train 0.7 → 118 rows, demo:pretraining-train 0.3 → 50 rows`"""
    recipe, stage, sources = draw
    drawn = ", ".join(f"{s['source']} {share(s)} → {s['rows']:,} rows" for s in sources)
    return f"mixture ({recipe}, {stage}): {drawn}"


def mixture_html(draws: list[Draw]) -> str:
    """A table per stage trained on a mixture ("" without one)."""
    if not draws:
        return ""
    parts = ["<h3>Training mixtures</h3>"]
    head = "".join(f"<th>{h}</th>" for h in ("source", "format", "share", "rows drawn", "tokens"))
    for recipe, stage, sources in draws:
        body = "".join(
            '<tr class="mixture-row">'
            + "".join(
                f"<td>{html.escape(str(cell))}</td>"
                for cell in (
                    s["source"],
                    s["format"],
                    entry_share(DataSource(s["source"], s.get("weight"), s.get("samples"))),
                    f"{s['rows']:,}",
                    f"{s['tokens']:,}",
                )
            )
            + "</tr>"
            for s in sources
        )
        caption = f"<caption>{html.escape(recipe)} / {html.escape(stage)}</caption>"
        parts.append(f'<table class="metrics mixture">{caption}<tr>{head}</tr>{body}</table>')
    return "".join(parts)
