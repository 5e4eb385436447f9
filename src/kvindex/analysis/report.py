"""The analysis of a recording as plain data: tables, curves and series (JSON-ready)."""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec

from kvindex.analysis.content import NO_PARENT, ContentIds, token_count
from kvindex.analysis.series import (
    bin_sum,
    bin_width,
    histogram,
    log_edges,
    percentile,
    thin_steps,
)
from kvindex.analysis.track import SourceTrack, Tracker
from kvindex.analysis.whatif import Curve, curve
from kvindex.recording import NoticeRec, Reader
from kvindex.wire import MEDIUM_GPU, render_hash

__all__ = ["PrefixRow", "Prefixes", "Report", "SourceRow", "analyze", "build_report"]

LOW_RATE = 0.01  # the re-store rate a cache size is suggested for


@dataclass(slots=True)
class SourceRow:
    """One source (instance, or instance[rank]) in numbers."""

    name: str
    instance: str
    rank: int
    batches: int
    stored_blocks: int
    removed_blocks: int
    clears: int
    restarts: int
    lost_batches: int
    peak_gpu_blocks: int
    final_blocks: dict[str, int]
    working_set: int
    restored_blocks: int
    restored_tokens: int
    restore_share: float  # re-stored / stored GPU blocks
    routable_blocks: int
    routable_tokens: int
    routable_share: float  # of the re-stores, held elsewhere in the fleet at that moment
    lifetime_p50: float | None
    lifetime_p90: float | None
    size_for_low_rate: int | None  # LRU blocks for a re-store rate <= LOW_RATE
    size_for_none: int | None  # LRU blocks for no re-store at all


@dataclass(slots=True)
class PrefixRow:
    """A prefix that several different sequences shared (a branching point)."""

    tokens: int | None  # None: unknown (the chain's start unseen, or stored by hash only)
    blocks: int | None
    continuations: int  # distinct sequences that went on from it
    branches: int  # distinct next blocks
    stores: int
    instances: list[str]
    first_tokens: list[int]
    block_hash: str
    lora_name: str | None = None
    cache_salt: str | None = None  # its digest (`salt:...`), never the salt


@dataclass(slots=True)
class NamespaceRow:
    """What one namespace stored: a LoRA adapter and/or a cache salt (shown as its digest),
    or neither (plain requests); `sessions` counts the distinct `session_id`s seen."""

    lora_name: str | None
    cache_salt: str | None
    stored_blocks: int
    sessions: int


@dataclass(slots=True)
class Prefixes:
    sequences: int  # distinct sequences (leaves of the prefix tree)
    shared_sequences: int  # that share a prefix with another sequence
    shared_share: float
    distinct_blocks: int
    cross_instance_blocks: int  # distinct blocks stored on two or more instances
    cross_instance_share: float
    top: list[PrefixRow] = field(default_factory=list)


@dataclass(slots=True)
class Rates:
    """Per-bin counts per source (blocks, tokens); rates are these / bin_seconds."""

    bin_seconds: float
    t: list[float]
    stored: dict[str, list[float]]
    removed: dict[str, list[float]]
    restored: dict[str, list[float]]
    restored_tokens: dict[str, list[float]]
    routable_tokens: dict[str, list[float]]


@dataclass(slots=True)
class Steps:
    t: list[float]
    n: list[int]


@dataclass(slots=True)
class Lifetimes:
    """Seconds from a block's store to its removal: a histogram on shared log edges."""

    edges: list[float]
    counts: dict[str, list[int]]
    still_held: dict[str, int]


@dataclass(slots=True)
class Report:
    file: str
    generated: float
    start: float | None  # the first batch's time (the publishers' clock, Unix seconds)
    duration: float
    batches: int
    stored_blocks: int
    removed_blocks: int
    restored_blocks: int
    restored_tokens: int
    routable_blocks: int
    routable_tokens: int
    sources: list[SourceRow]
    prefixes: Prefixes
    rates: Rates
    occupancy: dict[str, dict[str, Steps]]  # source -> medium -> steps
    duplication: dict[str, Steps]  # "held" (distinct GPU blocks), "shared" (on >= 2)
    lifetimes: Lifetimes
    whatif: dict[str, Curve]
    notices: dict[str, dict[str, int]]
    namespaces: list[NamespaceRow] = field(default_factory=list)
    damage: str | None = None
    truncated: bool = False

    def to_json(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=1)


def analyze(path: str | os.PathLike[str], top: int = 15) -> Report:
    """Read a recording and analyse it."""
    reader = Reader(path)
    tracker = Tracker()
    notices: dict[str, Counter[str]] = {}
    for rec in reader:
        tracker.feed(rec)
        if isinstance(rec, NoticeRec):
            notices.setdefault(_name(rec.instance, rec.rank), Counter())[rec.kind] += 1
    report = build_report(tracker, os.fspath(path), top)
    report.notices = {k: dict(v) for k, v in notices.items()}
    report.damage, report.truncated = reader.damage, reader.truncated
    return report


def _name(instance: str, rank: int) -> str:
    return f"{instance}[{rank}]" if rank else instance


def build_report(tracker: Tracker, file: str, top: int = 15) -> Report:
    t0 = tracker.t0 or 0.0
    duration = max(0.0, (tracker.t1 or t0) - t0)
    rows, curves = [], {}
    for src in tracker.sources.values():
        row, c = _source_row(src)
        rows.append(row)
        curves[row.name] = c
    return Report(
        file=file,
        generated=time.time(),
        start=tracker.t0,
        duration=duration,
        batches=sum(r.batches for r in rows),
        stored_blocks=sum(r.stored_blocks for r in rows),
        removed_blocks=sum(r.removed_blocks for r in rows),
        restored_blocks=sum(r.restored_blocks for r in rows),
        restored_tokens=sum(r.restored_tokens for r in rows),
        routable_blocks=sum(r.routable_blocks for r in rows),
        routable_tokens=sum(r.routable_tokens for r in rows),
        sources=rows,
        prefixes=_prefixes(tracker.content, top),
        rates=_rates(tracker, t0, duration),
        occupancy=_occupancy(tracker, t0),
        duplication=_duplication(tracker, t0),
        lifetimes=_lifetimes(tracker),
        whatif=curves,
        notices={},
        namespaces=_namespaces(tracker),
    )


def namespace_label(lora_name: str | None, cache_salt: str | None) -> str:
    """How a namespace is shown: `plain`, the adapter, the salt's digest, or both."""
    parts = [p for p in (lora_name, cache_salt) if p is not None]
    return " + ".join(parts) if parts else "plain"


def _namespaces(tracker: Tracker) -> list[NamespaceRow]:
    rows = [
        NamespaceRow(lora, salt, track.stored, len(track.sessions))
        for (lora, salt), track in tracker.namespaces.items()
    ]
    rows.sort(key=lambda r: (-r.stored_blocks, r.lora_name or "", r.cache_salt or ""))
    return rows


def _source_row(src: SourceTrack) -> tuple[SourceRow, Curve]:
    name = _name(src.key.instance, src.key.rank)
    s = src.series
    peak = max(src.occupancy[MEDIUM_GPU][1], default=0) if MEDIUM_GPU in src.occupancy else 0
    c = curve(src.accesses, src.restore_flags, marks=[peak] if peak else [])
    restored, routable = sum(s.restored), sum(s.routable)
    gpu_stores = len(src.accesses)
    row = SourceRow(
        name=name,
        instance=src.key.instance,
        rank=src.key.rank,
        batches=src.counts["batches"],
        stored_blocks=sum(s.stored),
        removed_blocks=sum(s.removed),
        clears=src.counts["clears"],
        restarts=src.counts["restarts"],
        lost_batches=src.counts["lost_batches"],
        peak_gpu_blocks=peak,
        final_blocks={m: n for m, n in src.held.items() if n},
        working_set=c.working_set,
        restored_blocks=restored,
        restored_tokens=sum(s.restored_tokens),
        restore_share=restored / gpu_stores if gpu_stores else 0.0,
        routable_blocks=routable,
        routable_tokens=sum(s.routable_tokens),
        routable_share=routable / restored if restored else 0.0,
        lifetime_p50=percentile(src.lifetimes, 50),
        lifetime_p90=percentile(src.lifetimes, 90),
        size_for_low_rate=c.size_for(LOW_RATE),
        size_for_none=c.size_for(0.0),
    )
    return row, c


def _prefixes(content: ContentIds, top: int) -> Prefixes:
    nodes = content.nodes
    leaves = content.leaves()
    roots = [cid for cid, node in enumerate(nodes) if node.parent == NO_PARENT]
    sequences = sum(leaves[r] for r in roots)
    shared = sum(leaves[r] for r in roots if leaves[r] > 1)
    real = [n for n in nodes if n.block_size]  # stand-ins for unseen parents left out
    cross = sum(1 for n in real if len(n.instances) > 1)
    branching = [cid for cid, node in enumerate(nodes) if node.children > 1]
    branching.sort(key=lambda cid: (-leaves[cid], -nodes[cid].depth, cid))
    rows = [_prefix_row(content, cid, leaves[cid]) for cid in branching[:top]]
    return Prefixes(
        sequences=sequences,
        shared_sequences=shared,
        shared_share=shared / sequences if sequences else 0.0,
        distinct_blocks=len(real),
        cross_instance_blocks=cross,
        cross_instance_share=cross / len(real) if real else 0.0,
        top=rows,
    )


def _prefix_row(content: ContentIds, cid: int, continuations: int) -> PrefixRow:
    node = content.nodes[cid]
    known = node.depth > 0
    return PrefixRow(
        tokens=token_count(node),
        blocks=node.depth if known else None,
        continuations=continuations,
        branches=node.children,
        stores=node.stores,
        instances=sorted(node.instances),
        first_tokens=content.prefix_tokens(cid) if known else [],
        block_hash=render_hash(node.block_hash),
        lora_name=node.lora_name,
        cache_salt=node.salt,
    )


def _rates(tracker: Tracker, t0: float, duration: float) -> Rates:
    width = bin_width(duration)
    n = max(1, int(duration // width) + 1)
    rates = Rates(width, [i * width for i in range(n)], {}, {}, {}, {}, {})
    for src in tracker.sources.values():
        name, s = _name(src.key.instance, src.key.rank), src.series
        for target, values in (
            (rates.stored, s.stored),
            (rates.removed, s.removed),
            (rates.restored, s.restored),
            (rates.restored_tokens, s.restored_tokens),
            (rates.routable_tokens, s.routable_tokens),
        ):
            target[name] = [float(x) for x in bin_sum(s.t, values, t0, width, n)]
    return rates


def _occupancy(tracker: Tracker, t0: float) -> dict[str, dict[str, Steps]]:
    out: dict[str, dict[str, Steps]] = {}
    for src in tracker.sources.values():
        media = out.setdefault(_name(src.key.instance, src.key.rank), {})
        for medium, (ts, ns) in sorted(src.occupancy.items()):
            t, v = thin_steps([x - t0 for x in ts], ns)
            media[medium] = Steps(t, v)
    return out


def _duplication(tracker: Tracker, t0: float) -> dict[str, Steps]:
    ts, held, shared = tracker.duplication
    rel = [x - t0 for x in ts]
    return {"held": Steps(*thin_steps(rel, held)), "shared": Steps(*thin_steps(rel, shared))}


def _lifetimes(tracker: Tracker) -> Lifetimes:
    values = [src.lifetimes for src in tracker.sources.values()]
    edges = log_edges([min(v) for v in values if v], [max(v) for v in values if v])
    out = Lifetimes(edges, {}, {})
    for src in tracker.sources.values():
        name = _name(src.key.instance, src.key.rank)
        out.counts[name] = histogram(src.lifetimes, edges)
        out.still_held[name] = len(src.since)
    return out
