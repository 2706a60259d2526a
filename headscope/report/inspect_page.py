"""inspect.html: one view per chosen head and text, self-contained like report.html (page.py fills the shell).

The page carries each view's weights as 16-bit integers (weight x 65535, rounded: 4-5 significant digits) within
VIEW_BYTES; texts longer than PAGE_MAX_TOKENS, and views beyond the budget, are left to attention.parquet, which
holds every weight exactly, and the page says which. With --why it carries each explained row's matrix of
contrasts (query senders by key senders), the strongest senders of each side by name and the rest summed, for
WHY_ROWS rows; qk.parquet holds every pair.
"""

from __future__ import annotations

import base64

import numpy as np
import pandas as pd

from headscope.labels import PROBE_ROLES
from headscope.report import palette
from headscope.report.page import page_html
from headscope.summary import model_name

VIEW_BYTES = 48_000_000  # raw bytes of weights the page may carry (base64 adds a third)
PAGE_MAX_TOKENS = 1_024  # a longer text's (t, t) view is more cells than a browser heatmap shows usefully
WHY_SENDERS = 12  # each side's senders a --why matrix shows by name (the rest summed into "others")
WHY_ROWS = 2_000  # explained rows whose matrix the page carries (about 1 kB each); the rest are in qk.parquet


class PageViews:
    """The views the page carries, collected as `inspect` runs (one text at a time)."""

    def __init__(self, budget: int = VIEW_BYTES) -> None:
        self.budget = budget
        self.views: list[dict] = []
        self.left_out: list[tuple[int, tuple[int, int], str]] = []  # (text, head, why)
        self.why: list[dict] = []  # --why: each explained row's matrix of contrasts, reduced (why_matrix)
        self.why_left_out = 0

    def add_why(self, text_id: int, pair: tuple[int, int], names: list[str], row: int, key: int,
                contrast: np.ndarray) -> None:  # fmt: skip
        if len(self.why) >= WHY_ROWS:
            self.why_left_out += 1
            return
        self.why.append({"text": text_id, "head": f"{pair[0]}.{pair[1]}", "row": row, "key": key,
                         **why_matrix(names, contrast)})  # fmt: skip

    def add(self, text_id: int, pair: tuple[int, int], matrix: np.ndarray, visible: np.ndarray) -> None:
        t = matrix.shape[0]
        size = 2 * t * t
        if t > PAGE_MAX_TOKENS:
            self.left_out.append((text_id, pair, f"{t:,} tokens, more than the page shows ({PAGE_MAX_TOKENS:,})"))
            return
        if size > self.budget:
            self.left_out.append((text_id, pair, "beyond the page's size budget"))
            return
        self.budget -= size
        weights = np.where(visible, np.nan_to_num(matrix, nan=0.0), 0.0)
        quantised = np.clip(np.round(weights * 65535), 0, 65535).astype("<u2")
        self.views.append(
            {
                "text": text_id,
                "head": f"{pair[0]}.{pair[1]}",
                "weights": base64.b64encode(quantised.tobytes()).decode("ascii"),
                "visible": base64.b64encode(np.packbits(visible, bitorder="little").tobytes()).decode("ascii"),
            }
        )


def why_matrix(names: list[str], contrast: np.ndarray, shown: int = WHY_SENDERS) -> dict:
    """One explained row's (query senders, key senders) contrasts as the page draws them: each side's `shown`
    senders with the largest side sums by size, the others summed into one "others" row and column, so that the
    margins (each side's sums) and the total stay exact."""

    def pick(side: np.ndarray) -> tuple[list[int], bool]:
        order = [int(i) for i in np.argsort(-np.abs(side), kind="stable")]
        return order[:shown], len(order) > shown

    (rows, more_rows), (columns, more_columns) = pick(contrast.sum(1)), pick(contrast.sum(0))
    row_groups = [[i] for i in rows] + ([sorted(set(range(len(names))) - set(rows))] if more_rows else [])
    column_groups = [[i] for i in columns] + ([sorted(set(range(len(names))) - set(columns))] if more_columns else [])
    reduced = _members(row_groups, len(names)) @ contrast @ _members(column_groups, len(names)).T

    def label(group: list[int]) -> str:
        return names[group[0]] if len(group) == 1 else f"others ({len(group)})"

    def rounded(values) -> list:
        return [float(f"{v:.5g}") for v in values]

    return {
        "query": [label(g) for g in row_groups], "keys": [label(g) for g in column_groups],
        "contrast": [rounded(line) for line in reduced], "query_side": rounded(reduced.sum(1)),
        "key_side": rounded(reduced.sum(0)), "total": float(contrast.sum()),
    }  # fmt: skip


def _members(groups: list[list[int]], count: int) -> np.ndarray:
    """(groups, count): 1 where a sender belongs to a group."""
    members = np.zeros((len(groups), count))
    for index, group in enumerate(groups):
        members[index, group] = 1.0
    return members


def inspect_page(record: dict, tokens: pd.DataFrame, views: PageViews) -> str:
    """The whole inspect.html, as a string."""
    title = f"{model_name(record)}: {len(record['heads'])} heads on {len(record['texts'])} texts"
    by_text = {text_id: part["token"].tolist() for text_id, part in tokens.groupby("text_id", sort=True)}
    data = {
        "title": title,
        "model": model_name(record),
        "texts": [
            {
                "id": entry["text_id"],
                "label": entry["label"],
                "source": entry["source"],
                "tokens": by_text[i],
                "exemplars": entry.get("exemplars", []),
            }
            for i, entry in enumerate(record["texts"])
        ],
        "heads": [{"name": name, "role": record["roles"].get(name)} for name in record["heads"]],
        "roles_from": record["roles_from"],
        "probe_roles": list(PROBE_ROLES),
        "summary": record["summary"],
        "views": views.views,
        "left_out": [{"text": t, "head": f"{p[0]}.{p[1]}", "why": why} for t, p, why in views.left_out],
        "why": views.why,
        "why_left_out": views.why_left_out,
        "palette": palette.as_dict(),
    }
    return page_html("headscope inspect", "inspect.html", "inspect.js", title, data)
