"""The report as one self-contained HTML page: tables, and the figures as embedded PNGs.

No script, no external resource (not even a favicon request): it opens from a file, in a
mail attachment or behind any proxy the same way.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Iterable, Sequence
from html import escape

from kvindex import __version__
from kvindex.analysis.plots import colors, render_all
from kvindex.analysis.report import LOW_RATE, Report, SourceRow, namespace_label

__all__ = ["render_html"]

NONE = "\N{EN DASH}"

_CSS = """
:root { --ink:#1f2430; --muted:#667085; --line:#e4e7ec; --bg:#f5f6f8; --card:#fff;
        --accent:#4C72B0; --good:#2f8f4e; --warn:#b54708; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
       font:14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width:1280px; margin:0 auto; padding:28px 28px 48px; }
header h1 { margin:0 0 4px; font-size:24px; letter-spacing:-0.01em; }
header p { margin:0; color:var(--muted); }
.kpis { display:grid; grid-template-columns:repeat(auto-fit,minmax(190px,1fr)); gap:12px;
        margin:22px 0 8px; }
.kpi { background:var(--card); border:1px solid var(--line); border-radius:10px;
       padding:14px 16px; }
.kpi .label { color:var(--muted); font-size:12px; text-transform:uppercase;
              letter-spacing:.04em; }
.kpi .value { font-size:24px; font-weight:650; margin-top:4px; }
.kpi .note { color:var(--muted); font-size:12.5px; margin-top:2px; }
.kpi.warn .value { color:var(--warn); } .kpi.good .value { color:var(--good); }
section { margin-top:30px; }
section h2 { font-size:17px; margin:0 0 4px; }
section > p.lead { margin:0 0 12px; color:var(--muted); max-width:980px; }
.grid { display:grid; grid-template-columns:repeat(auto-fit,minmax(560px,1fr)); gap:14px; }
figure { margin:0; background:var(--card); border:1px solid var(--line); border-radius:10px;
         padding:10px; }
figure img { width:100%; height:auto; display:block; }
.table-wrap { background:var(--card); border:1px solid var(--line); border-radius:10px;
              overflow-x:auto; }
table { border-collapse:collapse; width:100%; font-size:13px; }
th, td { padding:7px 12px; text-align:right; white-space:nowrap;
         border-bottom:1px solid var(--line); }
th { color:var(--muted); font-weight:600; font-size:12px; background:#fafbfc; }
th:first-child, td:first-child { text-align:left; }
td.text { text-align:left; font-family:ui-monospace, SFMono-Regular, Menlo, monospace;
          font-size:12px; color:#475467; }
tr:last-child td { border-bottom:none; }
.swatch { display:inline-block; width:10px; height:10px; border-radius:2px;
          margin-right:7px; vertical-align:baseline; }
.alert { background:#fffaeb; border:1px solid #fedf89; border-radius:10px;
         padding:10px 14px; margin-top:16px; color:#93370d; }
footer { margin-top:36px; color:var(--muted); font-size:12.5px; max-width:980px; }
"""


def _num(n: float) -> str:
    if abs(n) >= 10_000_000:
        return f"{n / 1e6:.1f}M"
    if abs(n) >= 100_000:
        return f"{n / 1e3:.0f}k"
    return f"{n:,.0f}"


def _pct(x: float) -> str:
    return f"{x:.1%}" if x < 0.1 else f"{x:.0%}"


def _secs(x: float | None) -> str:
    if x is None:
        return NONE
    if x >= 3600:
        return f"{x / 3600:.1f} h"
    if x >= 60:
        return f"{x / 60:.1f} min"
    return f"{x:.3g} s"


def _span(seconds: float) -> str:
    return _secs(seconds) if seconds else "an instant"


def _kpi(label: str, value: str, note: str, tone: str = "") -> str:
    return (
        f'<div class="kpi {tone}"><div class="label">{escape(label)}</div>'
        f'<div class="value">{escape(value)}</div><div class="note">{escape(note)}</div></div>'
    )


def _kpis(r: Report) -> str:
    gpu_stores = sum(c.accesses for c in r.whatif.values())
    waste = r.restored_blocks / gpu_stores if gpu_stores else 0.0
    routable = r.routable_tokens / r.restored_tokens if r.restored_tokens else 0.0
    sizes = [row.size_for_low_rate for row in r.sources if row.size_for_low_rate]
    cards = [
        _kpi("Blocks stored", _num(r.stored_blocks), f"{_num(r.removed_blocks)} removed"),
        _kpi(
            "Recompute waste",
            f"{_num(r.restored_tokens)} tokens",
            f"{_num(r.restored_blocks)} blocks re-stored: {_pct(waste)} of stores",
            "warn" if waste >= 0.05 else "",
        ),
        _kpi(
            "KV-aware routing",
            _pct(routable),
            f"of re-stored tokens were held by another instance ({_num(r.routable_tokens)})",
            "good" if routable >= 0.2 else "",
        ),
        _kpi(
            "Shared prefixes",
            _pct(r.prefixes.shared_share),
            f"of {_num(r.prefixes.sequences)} distinct sequences share a prefix",
        ),
        _kpi(
            "Cross-instance blocks",
            _pct(r.prefixes.cross_instance_share),
            f"{_num(r.prefixes.cross_instance_blocks)} of {_num(r.prefixes.distinct_blocks)} "
            "distinct blocks stored on 2+ instances",
        ),
    ]
    if sizes:
        cards.append(
            _kpi(
                "Cache for ≤ 1 % re-stores",
                f"{_num(max(sizes))} blocks",
                "largest per-instance LRU size needed (what-if)",
            )
        )
    return '<div class="kpis">' + "".join(cards) + "</div>"


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(rows_cells) + "</tr>" for rows_cells in rows)
    table = f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"
    return f'<div class="table-wrap">{table}</div>'


def _td(value: str, cls: str = "") -> str:
    return f'<td class="{cls}">{escape(value)}</td>' if cls else f"<td>{escape(value)}</td>"


def _name_cell(name: str, color: str) -> str:
    return f'<td><span class="swatch" style="background:{color}"></span>{escape(name)}</td>'


def _source_rows(r: Report, palette: dict[str, str]) -> list[list[str]]:
    out = []
    for row in r.sources:
        out.append(
            [
                _name_cell(row.name, palette[row.name]),
                _td(_num(row.batches)),
                _td(_num(row.stored_blocks)),
                _td(_num(row.removed_blocks)),
                _td(_num(row.peak_gpu_blocks)),
                _td(_num(row.working_set)),
                _td(f"{_num(row.restored_blocks)} ({_pct(row.restore_share)})"),
                _td(_num(row.restored_tokens)),
                _td(_pct(row.routable_share) if row.restored_blocks else NONE),
                _td(f"{_secs(row.lifetime_p50)} / {_secs(row.lifetime_p90)}"),
                _td(_num(row.size_for_low_rate) if row.size_for_low_rate else NONE),
                _td(_events(row)),
            ]
        )
    return out


def _events(row: SourceRow) -> str:
    parts = []
    if row.restarts:
        parts.append(f"{row.restarts} restart{'s' * (row.restarts > 1)}")
    if row.clears:
        parts.append(f"{row.clears} clear{'s' * (row.clears > 1)}")
    if row.lost_batches:
        parts.append(f"{row.lost_batches} lost")
    return ", ".join(parts) or NONE


_SOURCE_HEAD = (
    "instance",
    "batches",
    "stored",
    "removed",
    "peak GPU blocks",
    "working set",
    "re-stored blocks",
    "re-stored tokens",
    "routable",
    "lifetime p50 / p90",
    f"LRU size ≤ {LOW_RATE:.0%}",
    "stream events",
)


def _prefix_table(r: Report) -> str:
    rows = []
    for i, p in enumerate(r.prefixes.top):
        first = ", ".join(str(t) for t in p.first_tokens)
        rows.append(
            [
                _td(f"#{i + 1}"),
                _td("?" if p.tokens is None else _num(p.tokens)),
                _td(_num(p.continuations)),
                _td(_num(p.branches)),
                _td(_num(p.stores)),
                _td(", ".join(p.instances), "text"),
                _td(namespace_label(p.lora_name, p.cache_salt), "text"),
                _td(f"[{first}, …]" if first else NONE, "text"),
                _td(p.block_hash[:20] + ("…" if len(p.block_hash) > 20 else ""), "text"),
            ]
        )
    if not rows:
        return '<p class="lead">No prefix was shared by two different sequences.</p>'
    head = (
        "",
        "tokens",
        "sequences",
        "branches",
        "stores",
        "instances",
        "namespace",
        "first tokens",
        "last block hash",
    )
    return _table(head, rows)


def _namespace_section(r: Report) -> str:
    """Stores per namespace (LoRA adapter, cache salt as its digest) and their sessions:
    shown when the stream has any but plain requests."""
    rows = r.namespaces
    if not any(n.lora_name or n.cache_salt or n.sessions for n in rows):
        return ""
    body = [
        [
            _td(namespace_label(n.lora_name, n.cache_salt), "text"),
            _td(_num(n.stored_blocks)),
            _td(_num(n.sessions) if n.sessions else NONE),
        ]
        for n in rows
    ]
    return _section(
        "Namespaces",
        "Blocks stored per namespace: a LoRA adapter, a cache salt (shown as a digest, "
        "never the salt), or plain requests; and the distinct sessions that stored them.",
        _table(("namespace", "stored blocks", "sessions"), body),
    )


def _figures(pngs: dict[str, bytes], names: Sequence[str]) -> str:
    items = [
        f'<figure><img alt="{escape(n)}" src="data:image/png;base64,'
        f'{base64.b64encode(pngs[n]).decode()}"></figure>'
        for n in names
        if n in pngs
    ]
    return f'<div class="grid">{"".join(items)}</div>' if items else ""


def _section(title: str, lead: str, body: str) -> str:
    return f'<section><h2>{escape(title)}</h2><p class="lead">{escape(lead)}</p>{body}</section>'


def _notices(r: Report) -> str:
    kinds = sorted({k for counts in r.notices.values() for k in counts})
    if not kinds:
        return ""
    rows = [[_td(name)] + [_td(str(c.get(k, 0))) for k in kinds] for name, c in r.notices.items()]
    lead = (
        "What the subscriber reported while recording: gaps filled from the replay buffer, "
        "restarts of the engine, batches lost for good."
    )
    return _section("Stream notices", lead, _table(("instance", *kinds), rows))


def _alerts(r: Report) -> str:
    notes = []
    if r.truncated:
        notes.append(
            "The file ends with an incomplete segment (a recorder stopped mid-write): "
            "it was read up to the last whole segment."
        )
    if r.damage:
        notes.append(f"The file is damaged ({r.damage}): it was read up to that point.")
    return "".join(f'<div class="alert">{escape(n)}</div>' for n in notes)


def _header(r: Report) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.start)) if r.start else NONE
    return (
        "<header><h1>KV-cache analysis</h1>"
        f'<p><span title="{escape(r.file)}">{escape(os.path.basename(r.file))}</span> · '
        f"{len(r.sources)} sources · {_num(r.batches)} batches over "
        f"{_span(r.duration)} from {when}</p></header>"
    )


_FOOTER = (
    "Re-stores are GPU blocks stored again after the same instance evicted them (or lost them "
    "to a clear or restart): prefill work done twice. Blocks are identified by content "
    "(parent, tokens, LoRA, extra keys), so hashes seeded per process still match. The "
    "what-if curves simulate an LRU cache of each size over the recorded stores; cache hits "
    "are not on the wire, so they model a stores-only LRU. Routable: at the moment of the "
    "re-store, another instance (or DP rank) held the block."
)


def render_html(report: Report) -> str:
    """The whole report page."""
    pngs = render_all(report)
    palette = colors(report)
    body = [
        _header(report),
        _alerts(report),
        _kpis(report),
        _section(
            "Instances",
            "Per instance (and DP rank): traffic, the largest GPU pool seen, how much was "
            "recomputed after eviction, and the LRU size that keeps re-stores under 1 %.",
            _table(_SOURCE_HEAD, _source_rows(report, palette)),
        ),
        _section(
            "Cache contents and traffic",
            "Blocks each instance held, per medium, and how fast blocks entered and left.",
            _figures(pngs, ("occupancy", "rates")),
        ),
        _section(
            "Recompute waste",
            "Blocks stored again after their instance had evicted them, over time; and the "
            "share another instance held at that moment, which KV-aware routing would have "
            "served from cache.",
            _figures(pngs, ("restores", "routing")),
        ),
        _section(
            "Sizing: lifetimes and what-if caches",
            "How long blocks stayed before eviction, and re-stores an LRU cache of each size "
            "would have had (top), or would have avoided of those that happened (bottom).",
            _figures(pngs, ("lifetimes", "whatif")),
        ),
        _section(
            "Prefix popularity",
            f"{_pct(report.prefixes.shared_share)} of the {_num(report.prefixes.sequences)} "
            "distinct sequences share a prefix with another. The prefixes below are where "
            "sequences branch apart, most shared first.",
            _figures(pngs, ("prefixes", "duplication")) + _prefix_table(report),
        ),
        _namespace_section(report),
        _notices(report),
        f"<footer>{escape(_FOOTER)}<br>kvindex {escape(__version__)}</footer>",
    ]
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,">'
        f"<title>KV-cache analysis · {escape(os.path.basename(report.file))}</title>"
        f"<style>{_CSS}</style>"
        f"</head><body><main>{''.join(body)}</main></body></html>"
    )
