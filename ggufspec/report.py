"""Rows (lists of dicts) to a terminal table, Markdown, CSV or JSON. The only tabulate importer."""

from __future__ import annotations

import csv
import io
import json

from tabulate import tabulate


def table(rows: list[dict], columns: list[tuple[str, str]] | None = None, fmt: str = "simple") -> str:
    """columns: (key, header) pairs; missing values print as '-'."""
    if not rows:
        return "(nothing to show)"
    columns = columns or [(k, k) for k in rows[0]]
    body = [[_cell(r.get(k)) for k, _ in columns] for r in rows]
    return tabulate(body, headers=[h for _, h in columns], tablefmt=fmt, disable_numparse=True)


def markdown(rows: list[dict], columns=None) -> str:
    return table(rows, columns, fmt="github")


def to_csv(rows: list[dict], columns=None) -> str:
    keys = [k for k, _ in columns] if columns else list(rows[0]) if rows else []
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _plain(r.get(k)) for k in keys})
    return buf.getvalue()


def to_json(obj) -> str:
    return json.dumps(obj, indent=2, default=str)


def _plain(v):
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return "" if v is None else v


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"
