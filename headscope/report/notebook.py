"""Results in a notebook cell: the HTML behind every result object's `_repr_html_` (pandas', plotly's and
circuitsvis's convention), from the same pages the commands write.

A result shows what the command's printout shows, as small HTML tables, and, where the command writes a page
(report.html, inspect.html), that page inside an iframe whose `srcdoc` is the whole page: self-contained and
offline like the file (plotly inlined), and isolated, so that two results in one notebook cannot clash (their
element ids, styles and scripts live in separate documents). Text from the data is always escaped; a missing or
NaN number is an empty cell.
"""

from __future__ import annotations

import html
import math
import numbers
from collections.abc import Iterable, Sequence

import pandas as pd

from headscope.report.page import asset, fill_template

PAGE_HEIGHT = 720  # pixels: an iframe does not size itself to its page; the page scrolls inside it


def cell(value) -> str:
    """One value as table text: numbers to 4 significant places, NaN, NA and None as nothing, text escaped."""
    if value is None or (not isinstance(value, str) and pd.api.types.is_scalar(value) and pd.isna(value)):
        return ""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return f"{int(value):,}"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return f"{float(value):.4g}" if math.isfinite(float(value)) else ""
    return html.escape(str(value))


def table(columns: Sequence[str], rows: Iterable[Sequence], caption: str | None = None) -> str:
    head = "".join(f'<th style="text-align:left;padding:2px 8px">{html.escape(c)}</th>' for c in columns)
    body = "".join(
        "<tr>" + "".join(f'<td style="padding:2px 8px">{cell(v)}</td>' for v in row) + "</tr>" for row in rows
    )
    title = f'<caption style="text-align:left;font-weight:600">{html.escape(caption)}</caption>' if caption else ""
    return f'<table style="border-collapse:collapse">{title}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def facts(pairs: Iterable[tuple[str, object]]) -> str:
    """A line of `name: value` facts (the printout's header)."""
    parts = [f"<b>{html.escape(name)}</b> {cell(value)}" for name, value in pairs if value is not None]
    return f'<p style="margin:4px 0">{" · ".join(parts)}</p>'


def framed(page: str, height: int = PAGE_HEIGHT) -> str:
    """A whole page in an isolated iframe (its own document: no id, style or script clash with anything else)."""
    source = html.escape(page, quote=True)
    return (
        f'<iframe srcdoc="{source}" style="width:100%;height:{height}px;border:1px solid #ddd" '
        f'sandbox="allow-scripts" loading="lazy"></iframe>'
    )


def block(title: str, *parts: str) -> str:
    """One result: a title and its parts, styled inline (nothing leaks into the notebook's own styles)."""
    return fill_template(asset("notebook_block.html").strip(), {"TITLE": html.escape(title), "PARTS": "".join(parts)})


def progress(stage: str, bar: tuple[int, int, str] | None, detail: str, lines: Sequence[tuple[str, str]]) -> str:
    """The notebook's progress display: the stage, the pass's bar (done, total, its words) and detail (rate,
    time left), and the notes and warnings so far; every text escaped."""
    shown = {
        "STAGE": f"<p style='margin:0'><b>{html.escape(stage)}</b></p>" if stage else "",
        "BAR": "",
        "LINES": "".join(f"<p style='margin:0'>{kind}: {html.escape(text)}</p>" for kind, text in lines),
    }
    if bar is not None:
        done, total, words = bar
        shown["BAR"] = (f"<p style='margin:0'><progress value='{done}' max='{max(total, 1)}' style='width:16em'>"
                        f"</progress> {html.escape(words)} {html.escape(detail)}</p>")  # fmt: skip
    return fill_template(asset("notebook_progress.html").strip(), shown)


def effect_grid(effects: pd.DataFrame, layers: int | None, heads: int | None, cell_px: int = 14) -> str:
    """Each head's effect as a small heatmap (layers down, heads across; red where it carries the behaviour, blue
    where it pushes the other way, white at 0, grey where not measured), each cell's value in its tooltip. Plain
    HTML: no script, nothing to load."""
    if effects.empty or not layers or not heads:
        return ""
    values = {(int(r.layer), int(r.head)): float(r.effect) for r in effects.itertuples()}
    finite = [abs(v) for v in values.values() if math.isfinite(v)]
    top = max(finite, default=0.0) or 1.0
    rows = []
    for layer in range(layers):
        cells = []
        for head in range(heads):
            value = values.get((layer, head))
            if value is None or not math.isfinite(value):
                colour, tip = "#e5e5e5", f"{layer}.{head}: not measured"
            else:
                share = min(abs(value) / top, 1.0)
                fade = round(255 * (1 - share))
                colour = f"rgb(255,{fade},{fade})" if value > 0 else f"rgb({fade},{fade},255)"
                tip = f"{layer}.{head}: {value:+.3f}"
            cells.append(f'<td title="{html.escape(tip)}" style="width:{cell_px}px;height:{cell_px}px;'
                         f'background:{colour};padding:0"></td>')  # fmt: skip
        label = f'<th style="font-weight:normal;font-size:10px;padding:0 4px 0 0;text-align:right">{layer}</th>'
        rows.append(f"<tr>{label}{''.join(cells)}</tr>")
    caption = (f'<caption style="text-align:left;font-size:11px">effect per head (layer down, head across; '
               f"red up to {top:+.3f}, blue down to {-top:+.3f})</caption>")  # fmt: skip
    return f'<table style="border-collapse:collapse;margin:6px 0">{caption}{"".join(rows)}</table>'
