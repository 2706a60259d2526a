"""circuit.html: the circuit as a graph, its faithfulness curve and its strongest edges, self-contained like
report.html (page.py fills the shell; assets/circuit.js draws it with Plotly). Never imports torch."""

from __future__ import annotations

import numpy as np
import pandas as pd

from headscope.report import palette
from headscope.report.page import page_html
from headscope.summary import model_name

PAGE_EDGES = 500  # the strongest edges the page carries (every edge is in edges.parquet)
SHOWN_EDGES = 40  # drawn at first when the smallest faithful circuit is larger, or there is none


def _value(value):
    """JSON-ready: a float rounded to 6 significant digits, NaN and missing as null, numpy's scalars as Python's."""
    if value is None or value is pd.NA:
        return None
    if isinstance(value, float | np.floating):
        return None if np.isnan(value) else float(f"{value:.6g}")
    if isinstance(value, np.bool_):
        return bool(value)
    return int(value) if isinstance(value, np.integer) else value


def _column(frame: pd.DataFrame, name: str) -> list:
    return [_value(v) for v in frame[name].tolist()] if name in frame else [None] * len(frame)


def circuit_page(edges: pd.DataFrame, nodes: pd.DataFrame, record: dict) -> str:
    """The whole circuit.html, as a string."""
    carried = edges.nsmallest(PAGE_EDGES, "rank")
    circuit = record.get("circuit")
    first = circuit["edges"] if circuit is not None and circuit["edges"] <= 200 else SHOWN_EDGES
    title = f"{model_name(record)}: {record['method']} on {record['pairs']['count']} pairs"
    edge_names = ("sender", "receiver", "channel", "score", "score_ci_low", "score_ci_high", "exact", "rank",
                  "in_circuit", "sender_role")  # fmt: skip
    node_names = ("node", "layer", "head", "kind", "dla", "dla_ci_low", "dla_ci_high", "in_circuit", "role")
    data = {
        "title": title,
        "model": model_name(record),
        "architecture": {key: record["model"]["architecture"][key] for key in ("layers", "heads", "kv_heads")},
        "method": record["method"],
        "steps": record.get("steps"),
        "selection": record.get("selection", "top"),
        "m": {"clean": record["m"]["clean"], "corrupt": record["m"]["corrupt"]},
        "edge_count": record["graph"]["edges"],
        "edges": {name: _column(carried, name) for name in edge_names},
        "nodes": {name: _column(nodes, name) for name in node_names},
        "curve": record.get("faithfulness", []),
        "target": record.get("target"),
        "circuit": circuit,
        "cpr": record.get("cpr"),
        "cmd": record.get("cmd"),
        "first": int(min(first, len(carried))),
        "palette": palette.as_dict(),
    }
    return page_html("headscope circuit", "circuit.html", "circuit.js", title, data)
