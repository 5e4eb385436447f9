"""`GET /`: a minimal page listing the instances (the live dashboard will replace it).

Kept apart from the API so the dashboard can be swapped without touching `app.py`: the app
only calls `render_dashboard(fleet)`.
"""

from __future__ import annotations

from html import escape

from kvindex.service.runtime import Fleet

__all__ = ["render_dashboard"]

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvindex</title>
<meta http-equiv="refresh" content="5">
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.3em .8em;text-align:right}}
td:first-child,th:first-child{{text-align:left}}</style></head>
<body><h1>kvindex</h1><p>{count} instance(s) &middot; <a href="/docs">API docs</a>
&middot; <a href="/v1/stats">stats</a> &middot; <a href="/metrics">metrics</a></p>
<table><tr><th>instance</th><th>status</th><th>blocks</th><th>last seq</th><th>gaps</th>
<th>lost</th><th>restarts</th></tr>
{rows}
</table></body></html>
"""


def render_dashboard(fleet: Fleet) -> str:
    rows = []
    for view in fleet.instance_views():
        cells = [
            escape(view.name),
            view.status.value,
            str(view.blocks),
            "" if view.last_seq is None else str(view.last_seq),
            str(view.total("gaps")),
            str(view.total("lost_batches")),
            str(view.total("publisher_restarts")),
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return _PAGE.format(count=len(rows), rows="\n".join(rows))
