"""Results in a notebook cell: the HTML behind every result object's `_repr_html_` (pandas', plotly's and
circuitsvis's convention), from the same pages the commands write.

A result shows what the command's printout shows, as small HTML tables, and, where the command writes a page
(report.html, inspect.html), that page inside an iframe whose `srcdoc` is the whole page, so that two results in one
notebook cannot clash (their element ids, styles and scripts live in separate documents). Text from the data is
always escaped; a missing or NaN number is an empty cell.

plotly.js (4.6 MB) travels once per notebook: the first result a kernel shows carries it as inert text (a script
element of type text/plain: assets/plotly_held.html) in the notebook's own page, and every result's page runs that
copy in its own document (its iframe shares the notebook's origin to read it, so it has no sandbox; three results
were 17 MB of notebook, now one copy and their data). Front ends that give every output a document of its own
(Colab) get it inlined in each, and `to_html()` (a view to keep as a file) always inlines it.
"""

from __future__ import annotations

import html
import math
import numbers
import sys
import threading
from collections.abc import Iterable, Sequence

import pandas as pd

from headscope.report.page import asset, fill_template, plotly_from_notebook, plotly_held

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


_PLOTLY = threading.Lock()
_plotly_sent = False  # has this kernel sent plotly.js to its notebook page


def send_plotly_again() -> None:
    """The next result shown carries plotly.js again (after clearing the output that held it)."""
    global _plotly_sent
    with _PLOTLY:
        _plotly_sent = False


def _own_documents() -> bool:
    """Does the front end give every output a document of its own, where no output can read another's (Colab)?"""
    return "google.colab" in sys.modules


def framed(page: str, *, share_plotly: bool = True, height: int = PAGE_HEIGHT) -> str:
    """A whole page in an iframe of its own (no id, style or script clash with anything else); its plotly.js read
    from the notebook's page where `share_plotly` (see the module's docstring), else inlined as in the file."""
    global _plotly_sent
    # A page that reads the notebook's copy of plotly.js must share the notebook's origin, and a sandbox that allows
    # both scripts and the same origin is no sandbox (Chromium says so on the console): such a frame has none. What
    # keeps the data's text from running is its escaping, tested, as in the files.
    sandbox, held = ' sandbox="allow-scripts"', ""
    if share_plotly and not _own_documents():
        page, sandbox = plotly_from_notebook(page), ""
        with _PLOTLY:
            held = "" if _plotly_sent else plotly_held()
            _plotly_sent = True
    source = html.escape(page, quote=True)
    return held + (
        f'<iframe srcdoc="{source}" style="width:100%;height:{height}px;border:1px solid #ddd"{sandbox} '
        f'loading="lazy"></iframe>'
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
