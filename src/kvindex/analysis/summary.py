"""The report as a readable terminal summary (rich)."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvindex.analysis.report import LOW_RATE, Report, namespace_label

__all__ = ["print_summary"]


def _n(x: float) -> str:
    return f"{x:,.0f}"


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _overview(r: Report) -> Text:
    gpu = sum(c.accesses for c in r.whatif.values())
    routable = r.routable_tokens / r.restored_tokens if r.restored_tokens else 0.0
    text = Text()
    text.append(f"{len(r.sources)} sources, {_n(r.batches)} batches over {r.duration:.1f} s\n")
    text.append(f"stored {_n(r.stored_blocks)} blocks, removed {_n(r.removed_blocks)}\n")
    text.append("re-stored after eviction: ", style="bold")
    share = r.restored_blocks / gpu if gpu else 0.0
    text.append(f"{_n(r.restored_blocks)} blocks = {_n(r.restored_tokens)} tokens ")
    text.append(f"({_pct(share)} of GPU stores)\n", style="yellow" if share >= 0.05 else "")
    text.append("KV-aware routing would have saved: ", style="bold")
    text.append(f"{_pct(routable)} of re-stored tokens\n", style="green" if routable else "")
    p = r.prefixes
    text.append(
        f"shared prefixes: {_pct(p.shared_share)} of {_n(p.sequences)} sequences; "
        f"{_pct(p.cross_instance_share)} of distinct blocks stored on 2+ instances"
    )
    return text


def _instances(r: Report) -> Table:
    table = Table(
        title="per instance",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    heads = ("instance", "stored", "removed", "peak", "re-stored", "waste", "routable", "life p50")
    for col in (*heads, f"LRU ≤{LOW_RATE:.0%}"):
        table.add_column(col, justify="left" if col == "instance" else "right")
    for row in r.sources:
        table.add_row(
            row.name,
            _n(row.stored_blocks),
            _n(row.removed_blocks),
            _n(row.peak_gpu_blocks),
            _n(row.restored_blocks),
            _pct(row.restore_share),
            _pct(row.routable_share) if row.restored_blocks else "-",
            "-" if row.lifetime_p50 is None else f"{row.lifetime_p50:.3g} s",
            _n(row.size_for_low_rate) if row.size_for_low_rate else "-",
        )
    return table


def _prefixes(r: Report, top: int = 5) -> Table | Text:
    rows = r.prefixes.top[:top]
    if not rows:
        return Text("no prefix shared by two different sequences", style="dim")
    table = Table(
        title="most shared prefixes",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for col in ("#", "tokens", "sequences", "stores", "instances", "namespace"):
        table.add_column(col, justify="left" if col in ("instances", "namespace") else "right")
    for i, p in enumerate(rows):
        tokens = "?" if p.tokens is None else _n(p.tokens)
        table.add_row(
            str(i + 1),
            tokens,
            _n(p.continuations),
            _n(p.stores),
            ", ".join(p.instances),
            namespace_label(p.lora_name, p.cache_salt),
        )
    return table


def _namespaces(r: Report) -> Table | Text:
    """Stores per namespace (the salt as its digest) and sessions, when there are any but
    plain requests."""
    rows = r.namespaces
    if not any(n.lora_name or n.cache_salt or n.sessions for n in rows):
        return Text("")
    table = Table(title="namespaces", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("namespace", "stored", "sessions"):
        table.add_column(col, justify="left" if col == "namespace" else "right")
    for n in rows:
        label = namespace_label(n.lora_name, n.cache_salt)
        table.add_row(label, _n(n.stored_blocks), _n(n.sessions) if n.sessions else "-")
    return table


def print_summary(report: Report, console: Console) -> None:
    title = f"KV-cache analysis of {report.file}"
    console.print(Panel(_overview(report), title=title, title_align="left", expand=False))
    console.print(Group(_instances(report), _prefixes(report), _namespaces(report)))
    if report.truncated:
        console.print(
            "note: the file ends mid-segment; read up to its last whole segment", style="yellow"
        )
    if report.damage:
        console.print(f"note: {report.damage}; read up to there", style="yellow")
