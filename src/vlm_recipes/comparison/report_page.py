"""The files a comparison writes (comparison.md, comparison.png and the page comparison.html), and the report
page itself: one self-contained HTML file (comparison.html of `compare`, report.html of a `train` run) that
puts the image beside every answer.

What it holds, per eval set: the metrics table (mean ± std over seeds, marked where a recipe is further from
the best than the seed spread), every run's train and eval loss curves on shared axes, the per-task metrics
(and per source, where the eval is a mixture), each stage trained on a mixture's draw (source, format,
share, rows drawn, tokens, from its report.json), and the eval rows whose answers differ between the columns
(every recipe's and stage's answer) with each row's image(s) or a clip's frames, the question and the
reference, right and wrong marked. The page filters
the rows by task and by "any answer wrong".

Self-contained: images are embedded as JPEG thumbnails (data URIs), the curves as matplotlib's SVG, the
filter is a few lines of inline script; nothing is fetched, so it opens from disk in any browser. An image
or clip that is gone or cannot be decoded shows as a marked placeholder naming its path.
"""

from __future__ import annotations

import base64
import html
import io
import statistics
from pathlib import Path

from PIL import Image

from vlm_recipes.benchmark_metrics import METRICS
from vlm_recipes.comparison.answers import ROWS_SHOWN, WHEN, RowAnswers, format_scores
from vlm_recipes.comparison.mixture_table import mixture_html
from vlm_recipes.comparison.plot import EVERY_EVAL, draw_train_curves, plot_comparison
from vlm_recipes.comparison.run_summary import load_run
from vlm_recipes.comparison.tables import (
    MARKS,
    Comparison,
    RecipeRow,
    compare_runs,
    format_markdown,
    group_answers,
    marks_against_best,
    mixture_draws,
    rewards_note,
    spread_note,
    table_rows,
)
from vlm_recipes.data.images import upright_rgb

THUMBNAIL_SIDE = 160  # px, the longer side of an image on the page
CLIP_FRAMES = 4  # frames shown of a clip, evenly spaced
MOST_ROWS = 200  # answer rows on one page (those that show what differs first); keeps the page small


def write_report_page(comparison: Comparison, path: Path, title: str = "Recipe comparison") -> Path:
    """Write the page to `path` (written whole, then renamed into place)."""
    from vlm_recipes.files import write_atomically

    page = render_page(comparison, title)
    write_atomically(path, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
    return path


def write_comparison(
    run_dirs: list[Path], out_dir: Path, answer_rows: int = ROWS_SHOWN
) -> tuple[Comparison, Path, Path, Path]:
    """Load runs, compare, write comparison.md, comparison.png and the page comparison.html into out_dir."""
    comparison = compare_runs([load_run(Path(d)) for d in run_dirs])
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_comparison(comparison, out_dir / "comparison.png")
    md = out_dir / "comparison.md"
    md.write_text(format_markdown(comparison, png.name, answer_rows))
    page = write_report_page(comparison, out_dir / "comparison.html")
    return comparison, md, png, page


def write_run_page(run_dir: Path) -> Path:
    """A finished run's own page, `<run>/report.html`: its stages are the answers' columns."""
    run = load_run(run_dir)
    return write_report_page(
        compare_runs([run]), run_dir / "report.html", f"{run.recipe}: run {run_dir.name}"
    )


def render_page(comparison: Comparison, title: str) -> str:
    parts = [f"<h1>{_text(title)}</h1>"]
    parts += [f'<p class="warning">⚠ {_text(w)}</p>' for w in comparison.warnings]
    for signature, rows in comparison.groups.items():
        parts.append(f"<section><h2>Eval set <code>{_text(signature)}</code></h2>")
        parts.append(metrics_table(rows))
        parts += [
            f'<p class="note">{_text(note)}</p>' for note in (spread_note(rows), rewards_note(rows)) if note
        ]
        parts.append(f"<h3>Loss curves</h3>\n{curves_svg(rows)}")
        parts.append(task_table(rows))
        parts.append(task_table(rows, by="source"))  # an eval mixture's sources (data.eval as a list)
        parts.append(mixture_html(mixture_draws(rows)))  # each stage trained on a mixture: its draw
        parts.append(answers_section(group_answers(rows, count=10**9)))
        parts.append("</section>")
    return PAGE.format(title=_text(title), style=STYLE, body="\n".join(parts), script=SCRIPT)


# ------------------------------------------------------------------------------------------------ tables


def metrics_table(rows: list[RecipeRow]) -> str:
    """compare's table: a cell further from the best than the seed spread is marked `*` and shaded."""
    header, body = table_rows(rows)
    head = "".join(f"<th>{_text(h)}</th>" for h in header)
    lines = []
    for cells in body:
        marked = [f'<td class="{_mark_class(c)}">{_text(c)}</td>' for c in cells]
        lines.append(f"<tr>{''.join(marked)}</tr>")
    return f'<table class="metrics"><tr>{head}</tr>{"".join(lines)}</table>'


def _mark_class(cell: str) -> str:
    return "beyond" if cell.endswith(" *") else "best" if cell.endswith(" (best)") else ""


def task_table(rows: list[RecipeRow], by: str = "task") -> str:
    """Exact match (and JSON field F1 where a group's references are JSON, each benchmark metric where it
    scored a group's rows) per task (`by` "task") or per source of an eval mixture (`by` "source") and
    recipe, mean ± std, marked against the group's best as the metrics table is."""
    scores = {"task": "task_scores", "source": "source_scores"}[by]
    groups = sorted({group for row in rows for run in row.runs for group in getattr(run, scores)})
    if not groups:
        return ""
    labels = task_metric_labels()
    metrics = [m for m in labels if any(_task_values(r, g, m, scores) for r in rows for g in groups)]
    body = []
    for group in groups:
        cells = [f"<td>{_text(group)}</td>"]
        for metric in metrics:
            values = {row.recipe: _task_values(row, group, metric, scores) for row in rows}
            marks = marks_against_best({r: v for r, v in values.items() if v}, higher_is_better=True)
            for row in rows:
                shown = _mean_std(values[row.recipe]) + MARKS[marks.get(row.recipe, "")]
                cells.append(f'<td class="{_mark_class(shown)}">{_text(shown)}</td>')
        body.append(f'<tr class="{by}-row">{"".join(cells)}</tr>')
    recipes = "".join(f"<th>{_text(row.recipe)}</th>" for row in rows)
    head = f"<tr><th rowspan=2>{by}</th>" + "".join(
        f"<th colspan={len(rows)}>{_text(labels[m])}</th>" for m in metrics
    )
    head += f"</tr><tr>{recipes * len(metrics)}</tr>"
    return f'<h3>Per-{by} metrics</h3><table class="metrics">{head}{"".join(body)}</table>'


def task_metric_labels() -> dict[str, str]:
    """A task's scores by their headings: exact match, JSON field F1, each benchmark metric's."""
    return {attr: label for attr, label, _ in EVERY_EVAL} | {
        m: metric.heading for m, metric in METRICS.items()
    }


def _task_values(row: RecipeRow, group: str, metric: str, scores: str = "task_scores") -> list[float]:
    """A task's (or a source's: `scores` "source_scores") `metric` in each of the row's runs that has it."""
    return [
        getattr(run, scores)[group][metric]
        for run in row.runs
        if metric in getattr(run, scores).get(group, {})
    ]


def _mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


# ------------------------------------------------------------------------------------------------ curves


def curves_svg(rows: list[RecipeRow]) -> str:
    """Every run's train and eval loss on shared axes (plot.py's train-curve panel), as inline SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(9, 4), dpi=100)
    draw_train_curves(axis, rows, [f"C{i % 10}" for i in range(len(rows))])
    fig.tight_layout()
    out = io.StringIO()
    fig.savefig(out, format="svg")
    plt.close(fig)
    svg = out.getvalue()
    return f'<div class="plot">{svg[svg.index("<svg") :]}</div>'


# ------------------------------------------------------------------------------------------------ answers


def answers_section(answers: list[RowAnswers]) -> str:
    """The eval rows (at most MOST_ROWS, those that show what training changed first), with filters by task,
    by "answers differ" (on at first where there are several columns: the rows where the recipes differ)
    and by "any answer wrong"."""
    if not answers:
        return ""
    columns = [who for who, _ in answers[0].answers]
    shown = answers[:MOST_ROWS]
    differ = sum(row.answers_differ() for row in shown)
    intro = (
        f"<h3>Answers</h3><p class=note>{len(shown)} of {len(answers)} eval rows, {differ} of them answered "
        f"differently; {_text(WHEN)}.</p>"
    )
    tasks = sorted({row.task for row in shown if row.task})
    options = "".join(f'<option value="{_text(t)}">{_text(t)}</option>' for t in tasks)
    differ_filter = (
        '<label><input type="checkbox" class="differ-filter" checked> answers differ</label> '
        if len(columns) > 1
        else ""
    )
    filters = (
        '<div class="filters"><label>task <select class="task-filter"><option value="">every task</option>'
        f'{options}</select></label> {differ_filter}<label><input type="checkbox" class="wrong-filter"> '
        'any answer wrong</label> <span class="shown-count"></span></div>'
    )
    head = "".join(f"<th>{_text(c)}</th>" for c in ["media", "question", "reference", *columns])
    body = "".join(_answer_row(row) for row in shown)
    return f'{intro}<div class="answers">{filters}<table class="answers"><tr>{head}</tr>{body}</table></div>'


def _answer_row(row: RowAnswers) -> str:
    wrong = any(right is False for right in row.right)
    media = "".join(image_html(p) for p in row.images) + "".join(clip_html(p) for p in row.videos)
    cells = [
        f'<td class="media">{media or "<span class=note>text only</span>"}</td>',
        f'<td class="question"><span class="id">{_text(row.id)}</span>'
        + (f' <span class="task">{_text(row.task)}</span>' if row.task else "")
        + f"<br>{_text(row.prompt)}</td>",
        f'<td class="reference">{_text(row.reference)}</td>',
    ]
    for (who, answer), right, scores in zip(row.answers, row.right, row.scores, strict=True):
        if answer is None:
            cells.append(f'<td class="answer unasked" data-who="{_text(who)}">not evaluated on this row</td>')
            continue
        verdict = {True: "right", False: "wrong", None: "unscored"}[right]
        sign = {True: "✓ ", False: "✗ ", None: ""}[right]
        scored = f'<span class="scores">{_text(format_scores(scores))}</span>' if scores else ""
        cells.append(
            f'<td class="answer {verdict}" data-who="{_text(who)}"><span class="sign">{sign}</span>'
            f'<span class="output">{_text(answer)}</span>{scored}</td>'
        )
    task = _text(row.task or "")
    return f'<tr class="answer-row" data-id="{_text(row.id)}" data-task="{task}" data-wrong="{int(wrong)}" data-differ="{int(row.answers_differ())}">{"".join(cells)}</tr>'


def image_html(path: str) -> str:
    """The image as an embedded thumbnail, or a marked placeholder naming what is wrong with it."""
    try:
        with Image.open(path) as opened:
            image = upright_rgb(opened)
            image.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
            return f'<img class="thumb" src="{_jpeg_uri(image)}" title="{_text(path)}" alt="image">'
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        return _missing("image", path, exc)


def clip_html(path: str) -> str:
    """A clip's frames, evenly spaced, as thumbnails in a strip; a marked placeholder if it cannot be read."""
    from vlm_recipes.data.video import FramePlan, VideoSampling, decode_frames, read_header

    try:
        header = read_header(
            Path(path), VideoSampling(fps=2.0, max_frames=CLIP_FRAMES, min_pixels=0, max_pixels=0)
        )
        count = min(CLIP_FRAMES, header.frames)
        indices = tuple(round(i * (header.frames - 1) / max(count - 1, 1)) for i in range(count))
        scale = THUMBNAIL_SIDE / 2 / max(header.height, header.width)
        size = (max(1, round(header.height * scale)), max(1, round(header.width * scale)))
        frames = decode_frames(Path(path), FramePlan(indices, header.frames, header.fps, *size))
    except Exception as exc:  # any reader's failure (a missing file, a damaged container) is a placeholder
        return _missing("clip", path, exc)
    shown = []
    for frame in frames:
        image = Image.fromarray(frame.clamp(0, 255).byte().permute(1, 2, 0).numpy())
        shown.append(f'<img class="frame" src="{_jpeg_uri(image)}" alt="frame">')
    return f'<span class="clip" title="{_text(path)}">{"".join(shown)}</span>'


def _jpeg_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _missing(kind: str, path: str, exc: Exception) -> str:
    why = (
        "no such file" if not path or not Path(path).exists() else f"cannot be decoded ({type(exc).__name__})"
    )
    name = Path(path).name or "(no path)"
    return f'<span class="missing-media" title="{_text(path)}">{kind} {_text(why)}:<br>{_text(name)}</span>'


def _text(value: object) -> str:
    """Shown as text, never as markup (a model's answer may hold any); a control character, which a browser
    would drop or hide, as a visible �."""
    shown = "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in str(value))
    return html.escape(shown, quote=True)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{style}</style></head>
<body>
{body}
<script>{script}</script>
</body></html>
"""

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; text-align: left; }
th { background: #f3f3f3; }
td.beyond { background: #fde7e7; } td.best { background: #e6f4e6; }
.note { color: #555; font-size: 12px; } .warning { color: #a40; }
.plot svg { max-width: 100%; height: auto; }
td.media { min-width: 170px; } img.thumb { display: block; margin-bottom: 4px; }
img.frame { margin-right: 2px; } .clip { display: block; white-space: nowrap; }
.missing-media { display: inline-block; border: 2px dashed #c33; color: #c33; padding: 1em; font-size: 12px; }
td.question { min-width: 10em; max-width: 16em; } td.reference { max-width: 18em; overflow-wrap: anywhere; }
td.answer { max-width: 22em; overflow-wrap: anywhere; }
td.answer.right { background: #e6f4e6; } td.answer.wrong { background: #fde7e7; }
td.answer.unasked { color: #999; font-style: italic; }
.scores { display: block; color: #555; font-size: 12px; margin-top: 2px; }
.sign { font-weight: bold; } .id { color: #888; font-size: 12px; } .task { background: #eef; padding: 0 4px; }
.filters { margin: 0.5em 0; }
"""

# The filters: a row is shown when its task matches the chosen one (or every task) and, with each box ticked,
# some answer in it is wrong / its answers differ.
SCRIPT = """
function applyFilters(section) {
  const task = section.querySelector('.task-filter').value;
  const wrongOnly = section.querySelector('.wrong-filter').checked;
  const differ = section.querySelector('.differ-filter');
  const differOnly = differ !== null && differ.checked;
  const rows = section.querySelectorAll('tr.answer-row');
  let shown = 0;
  rows.forEach(row => {
    const visible = (!task || row.dataset.task === task) && (!wrongOnly || row.dataset.wrong === '1')
      && (!differOnly || row.dataset.differ === '1');
    row.hidden = !visible;
    shown += visible;
  });
  section.querySelector('.shown-count').textContent = shown + ' of ' + rows.length + ' rows shown';
}
document.querySelectorAll('div.answers').forEach(section => {
  section.querySelectorAll('.task-filter, .wrong-filter, .differ-filter').forEach(
    control => control.addEventListener('change', () => applyFilters(section)));
  applyFilters(section);
});
"""
