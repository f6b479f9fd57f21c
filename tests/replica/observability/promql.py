"""The metric names a Grafana dashboard queries: every PromQL expression of every panel.

Not a PromQL parser: it drops what can hold no metric name (strings, label matchers, range and
subquery brackets, ``by (...)``-style label lists, Grafana variables), then keeps the
identifiers that are neither followed by ``(`` (functions, aggregations) nor keywords.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
            "group_left", "group_right", "inf", "nan", "atan2", "start", "end"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_IDENT = re.compile(r"(?<![\w:.])[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{[^}]*\})?\s*,")


def metric_names(expr: str) -> set[str]:
    """The metric names in one PromQL expression (Grafana variables allowed)."""
    s = _STRING.sub('""', expr)
    s = _VARIABLE.sub("", s)
    s = _MATCHERS.sub("", s)
    s = _RANGE.sub("", s)
    s = _LABEL_LIST.sub("", s)
    names = set()
    for m in _IDENT.finditer(s):
        if s[m.end():].lstrip().startswith("(") or m.group(0).lower() in KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", [])


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    return [(p.get("title", ""), t["expr"]) for p in panels(dashboard)
            for t in p.get("targets", []) if t.get("expr")]


def variable_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Metric names the templating variables query (``label_values(metric, label)``)."""
    out = set()
    for v in dashboard.get("templating", {}).get("list", []):
        q = v.get("query")
        text = q.get("query", "") if isinstance(q, dict) else str(q or "")
        out |= set(_LABEL_VALUES.findall(text))
    return out


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data
