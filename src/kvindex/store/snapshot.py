"""A snapshot as runs: one record per run, written when it changes, loaded in bulk.

A record holds a run as vLLM itself would have announced it: a BlockStored chain (its
blocks' hashes, the chain's parent, their tokens, block size, LoRA), then one hash-only
BlockStored for the blocks held in more than one copy; both msgpack-encoded, ready to be
concatenated into a batch. Loading a snapshot is then a few large `BatchDecoder.decode` +
`FleetIndex.apply` calls (the ingest fast path), with no Python work per block: the only
per-record work is putting each chain after the one holding its parent, so the prefix tree
is rebuilt (a chain whose parent is not held anywhere is loaded as it comes).

A record also keeps `keys` (its parent and hashes, for that ordering and to rebuild a
mirror) and, for SQL users, the blocks as JSON (see sqlite/tables.py's `cache_blocks` view).

Writing: a changed run is rewritten whole. A run some of whose blocks left is cut to the
blocks it still holds: cut into several runs if they are no longer contiguous (each keeps
the hash before it as its parent, as the block rows of earlier versions did).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Protocol

import msgspec

from kvindex.index import FleetIndex
from kvindex.store.mirror import PLACED, UNPLACED, Changes, Mirror, PublisherRuns, Run, RunKeys
from kvindex.store.rows import BlockRow
from kvindex.subscriber.messages import SourceKey
from kvindex.wire import (
    BatchDecoder,
    BigramBlockStored,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
    render_hash,
)
from kvindex.wire.packing import array_header

__all__ = [
    "IndexTarget",
    "LogTarget",
    "MirrorRow",
    "Record",
    "SnapshotPlan",
    "Stored",
    "load_runs",
    "mirror_rows",
    "plan_changes",
    "plan_source",
    "replay",
    "snapshot_batches",
]

CHUNK_EVENTS = 4096  # events per synthetic batch when loading
CHUNK_BYTES = 8 << 20  # and bytes (well under BatchDecoder's payload limit)

_encode = msgspec.msgpack.Encoder().encode
_json = msgspec.json.Encoder().encode
# A record's keys: [parent, hashes, [[position, copies], ...] or nil, [gone position, ...]
# or nil, bytes of its events that are the gone blocks' removal (the last event)]; records
# written before gone blocks were kept have the first three.
Keys = tuple[BlockHash | None, list[BlockHash], list[tuple[int, int]] | None, list[int] | None, int]
_decode_key_list = msgspec.msgpack.Decoder(list[Any]).decode


def _decode_keys(raw: bytes) -> Keys:
    fields = _decode_key_list(raw)
    parent, hashes, extras = fields[0], fields[1], fields[2]
    if len(fields) < 5:
        return parent, hashes, extras, None, 0
    return parent, hashes, extras, fields[3], fields[4]


def _held(keys: Keys) -> Iterator[BlockHash]:
    """The hashes a record holds (its gone blocks left out)."""
    gone = set(keys[3] or ())
    return (h for i, h in enumerate(keys[1]) if i not in gone)


@dataclass(slots=True)
class Record:
    """One run as persisted."""

    id: int
    rank: int  # see mirror.Run
    group: int
    medium: str
    size: int
    lora: str | None
    ts: float
    keys: bytes  # msgpack Keys (below)
    events: bytes  # msgpack BlockStored maps, concatenated
    n_events: int
    blocks_json: str | None = None  # [[hash, parent, tokens|null, copies], ...] for SQL


# What the loader needs of a record: rank, keys, events, n_events, ts.
Stored = tuple[Any, bytes, bytes, int, float]

# A record as a mirror loads it: id, rank, group, medium, size, lora, ts, keys, events,
# n_events.
MirrorRow = tuple[int, Any, int, str, int, str | None, float, bytes, bytes, int]


# -- writing ------------------------------------------------------------------------------


@dataclass
class SnapshotPlan:
    """A snapshot's writes for one publisher: records to (re)write, ids of records to drop.
    Mark `runs` saved once the writes are done."""

    records: list[Record] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    deletes: list[int] = field(default_factory=list)

    def done(self) -> None:
        for run in self.runs:
            run.saved = True


def plan_changes(
    mirror: Mirror, changes: Changes, view: bool = False
) -> dict[SourceKey, SnapshotPlan]:
    """The writes that bring a snapshot up to date with these changes of the mirror (after
    the records of `changes.cleared` publishers and `changes.removed` instances went)."""
    plans: dict[SourceKey, SnapshotPlan] = {}
    for source, runs in changes.dirty.items():
        src = mirror.sources.get(source)
        if src is not None:
            plans[source] = plan_source(mirror, src, runs, view)
    return plans


def plan_source(
    mirror: Mirror, src: PublisherRuns, runs: Iterable[Run], view: bool
) -> SnapshotPlan:
    """Records for these runs of one publisher (all of its runs for a full rewrite)."""
    plan = SnapshotPlan()
    for run in sorted(runs, key=lambda r: r.id):
        if src.runs.get(run.id) is not run:
            continue  # gone with a clear, or already cut
        parts = _cut(mirror, src, run)
        if not parts:
            src.drop(run)
            if run.saved:
                plan.deletes.append(run.id)
        for part in parts:
            plan.records.append(_record(src, part, view))
            plan.runs.append(part)
    return plan


def _cut(mirror: Mirror, src: PublisherRuns, run: Run) -> list[Run]:
    """The run cut down to what its record must say: [] if nothing any more.

    A block that left the pool stays in the record (stored, then removed when loaded) up
    to the run's last block still held or hung from: the index keeps a block's node while
    blocks hang from it, so what hangs from it comes back under the same node (a parent
    hash nobody holds could not place it). A block that moved to another run of the pool
    (re-placed, see Mirror._take_over) cuts the run instead: the piece after it hangs from
    its new run. The first piece keeps the run's id.
    """
    hashes = run.hashes
    blocks = src.pools[(run.group, run.medium)].blocks
    owners = [blocks.get(h) for h in hashes]
    if all(o is run for o in owners):
        return [run]
    segments: list[tuple[int, int]] = []
    start, last = 0, -1
    for i, owner in enumerate([*owners, False]):
        if owner is run or (owner is None and src.hung_from(hashes[i])):
            last = i
        elif owner is not None:  # moved elsewhere (or the end): a segment ends here
            if last >= start:
                segments.append((start, last + 1))
            start, last = i + 1, i
    if not segments:
        return []
    tokens, size, keys = run.flat_tokens(), run.size, run.event_keys()
    width = run.width
    pieces = [
        (
            hashes[a - 1] if a else run.parent,
            hashes[a:b],
            None if tokens is None else tokens[a * width : b * width],
            None if keys is None else keys.part(a, b),
        )
        for a, b in segments
    ]
    parent, run.hashes, run.tokens, run.keys = pieces[0]
    src.rehang(run, parent)
    parts = [run]
    for parent, part_hashes, cut, part_keys in pieces[1:]:
        part = Run(
            mirror.new_run_id(), run.group, run.medium, parent, part_hashes, size, run.lora,
            run.ts, cut, run.rank, keys=part_keys,
        )  # fmt: skip
        src.add(part, dirty=False)
        for h in part_hashes:
            if blocks.get(h) is run:
                blocks[h] = part
        parts.append(part)
    return parts


def _record(src: PublisherRuns, run: Run, view: bool) -> Record:
    hashes = run.hashes
    pool = src.pools[(run.group, run.medium)]
    held = [pool.blocks.get(h) is run for h in hashes]
    gone = [i for i, here in enumerate(held) if not here] or None
    copies = [pool.copies(h) if here else 0 for h, here in zip(hashes, held, strict=True)]
    extras = [(i, c) for i, c in enumerate(copies) if c > 1] or None
    run.compact()
    flat = run.flat_tokens()
    keys = run.event_keys()
    named = keys if flat else None  # a hash-only run's keys place nothing
    stored = hashes if not gone else _stand_ins(src, run, gone)
    chain = BlockStored(
        stored, run.parent, flat or [], run.size, medium=run.medium, lora_name=run.lora,
        group_idx=None if keys is not None and keys.legacy else run.group,
        extra_keys=_extra_keys(run, named, len(hashes)) if flat else None,
        cache_salt=None if named is None else named.salt,
        lookahead_token_ids=None if named is None else named.lookahead,
        lora_id=None if named is None else named.lora_id,
        kv_cache_spec_kind=None if keys is None else keys.spec_kind,
        kv_cache_spec_sliding_window=None if keys is None else keys.spec_window,
    )  # fmt: skip
    if keys is not None and keys.bigram and flat:
        events, n = _encode(_bigram_chain(chain, flat)), 1
    else:
        events, n = _encode(chain), 1
    if extras:
        more = [hashes[i] for i, c in extras for _ in range(c - 1)]
        events += _encode(BlockStored(more, None, [], 0, medium=run.medium, group_idx=run.group))
        n += 1
    tail = 0
    if gone:
        for i in gone:
            src.kept_for[hashes[i]] = run
        left = _encode(
            BlockRemoved([stored[i] for i in gone], medium=run.medium, group_idx=run.group)
        )
        events, n, tail = events + left, n + 1, len(left)
    return Record(
        run.id, run.rank, run.group, run.medium, run.size, run.lora, run.ts,
        _encode((run.parent, hashes, extras, gone, tail)), events, n,
        _blocks_json(run, copies, flat) if view else None,
    )  # fmt: skip


def _bigram_chain(chain: BlockStored, flat: list[int]) -> object:
    """A bigram run's chain as SGLang sends it: its tokens (the pairs, flattened) as pairs."""
    pairs = list(zip(flat[0::2], flat[1::2], strict=True))
    fields = msgspec.structs.asdict(chain)
    fields["token_ids"] = []
    return BigramBlockStored(**fields, token_pairs=pairs).wire()


def _stand_ins(src: PublisherRuns, run: Run, gone: list[int]) -> list[BlockHash]:
    """The run's hashes as its record stores them: a gone block nothing hangs from by hash
    is stored under a stand-in (32 bytes no engine makes, one per run and position), so
    that storing and removing it can't touch a copy of its hash the pool holds again."""
    stored = list(run.hashes)
    for i in gone:
        if not src.hung_from(stored[i]):
            stored[i] = _STAND_IN + run.id.to_bytes(8, "big") + i.to_bytes(8, "big")
    return stored


_STAND_IN = b"\x00kvindex-gone\x00\x00"  # 16 bytes, then run id and position


def _extra_keys(run: Run, keys: RunKeys | None, n: int) -> list[Any] | None:
    """The chain's extra keys as the store sent them; a run saved before runs kept their
    keys has only its LoRA name, which vLLM puts in each block's extra keys."""
    if keys is not None:
        return keys.extra
    return [[run.lora]] * n if run.lora is not None else None


def _blocks_json(run: Run, copies: list[int], flat: list[int] | None) -> str:
    """The blocks the run holds (copies > 0) as [hash, parent, tokens, copies] rows."""
    texts = [render_hash(h) for h in run.hashes]
    parents = [None if run.parent is None else render_hash(run.parent), *texts[:-1]]
    size = run.width
    tokens: list[list[int] | None] = (
        [None] * len(texts)
        if flat is None
        else [flat[i * size : (i + 1) * size] for i in range(len(texts))]
    )
    rows = zip(texts, parents, tokens, copies, strict=True)
    return _json([row for row in rows if row[3]]).decode()


# -- loading into an index ----------------------------------------------------------------


class LogTarget(Protocol):
    """What log entries are applied to: a mirror, or an index (see IndexTarget)."""

    def apply_payload(self, source: SourceKey, payload: bytes) -> None: ...

    def restart(self, source: SourceKey) -> None: ...

    def remove_instance(self, name: str) -> None: ...


class IndexTarget:
    """Logged entries straight into an index (a service's warm start)."""

    def __init__(self, index: FleetIndex) -> None:
        self.index = index
        self._decoder = BatchDecoder()

    def apply_payload(self, source: SourceKey, payload: bytes) -> None:
        try:
            self.index.apply_payload(source, payload)
        except WireError:
            return  # the service skipped it too

    def restart(self, source: SourceKey) -> None:
        self.index.drop_source(source)

    def remove_instance(self, name: str) -> None:
        self.index.remove_instance(name)


def replay(index: FleetIndex, source: SourceKey, stored: Iterable[Stored]) -> int:
    """Load one publisher's records into `index`; returns the blocks they hold. The batches
    go in as payloads: the compiled index parses them without a Python object per block."""
    blocks = 0
    for payload, n in _payloads(list(stored)):
        index.apply_payload(source, payload)
        blocks += n
    return blocks


def snapshot_batches(stored: Iterable[Stored]) -> Iterator[EventBatch]:
    """One publisher's records as the batches that rebuild them (parents first)."""
    decoder = BatchDecoder()
    for payload, _ in _payloads(list(stored)):
        yield decoder.decode(payload)


def _payloads(stored: list[Stored]) -> Iterator[tuple[bytes, int]]:
    """(batch payload, blocks in it): the records' events, parents first, in large
    batches."""
    if not stored:
        return
    keys = [_decode_keys(s[1]) for s in stored]
    ts = _encode(max(s[4] for s in stored))
    chunk: list[bytes] = []
    events = size = blocks = 0
    # Blocks gone from their pools are removed once every record is in: until then they
    # hold the nodes that the blocks hanging from them, in any record, are placed under.
    removals: list[bytes] = []
    for i in _parents_first(stored, keys):
        record, tail = stored[i], keys[i][4]
        data, n = record[2], record[3]
        if tail:
            data, n = data[:-tail], n - 1
            removals.append(record[2][-tail:])
        chunk.append(data)
        held = len(keys[i][1]) - len(keys[i][3] or ())
        events, size, blocks = events + n, size + len(data), blocks + held
        if events >= CHUNK_EVENTS or size >= CHUNK_BYTES:
            yield b"\x92" + ts + array_header(events) + b"".join(chunk), blocks
            chunk, events, size, blocks = [], 0, 0, 0
    if chunk:
        yield b"\x92" + ts + array_header(events) + b"".join(chunk), blocks
    for start in range(0, len(removals), CHUNK_EVENTS):
        part = removals[start : start + CHUNK_EVENTS]
        yield b"\x92" + ts + array_header(len(part)) + b"".join(part), 0


def _parents_first(stored: list[Stored], keys: list[Keys]) -> list[int]:
    """Record positions in the order that rebuilds the prefix tree as it was: chains the
    index could not place first (nothing of the publisher is in the tree yet, so they are
    not placed now either), then the others as stored (oldest first: mostly right
    already), each placed chain after the one holding its parent.

    Only hashes some chain names as its parent matter: a set of those (one per record at
    most) is intersected with each record's hashes, in C, rather than every hash indexed.
    """
    ranks = [record[0] for record in stored]
    wanted = {k[0] for k, r in zip(keys, ranks, strict=True) if r == PLACED and k[0] is not None}
    holder: dict[BlockHash, int] = {}  # parent hash -> the first placed record holding it
    if wanted:
        for i, (k, r) in enumerate(zip(keys, ranks, strict=True)):
            if r == PLACED:
                for h in wanted.intersection(k[1]):  # gone blocks too: see _payloads
                    holder.setdefault(h, i)
    order = [i for i, r in enumerate(ranks) if r == UNPLACED]
    done = bytearray(len(stored))
    waiting: dict[int, list[int]] = {}  # record -> records to put right after it

    def emit(first: int) -> None:
        stack = [first]
        while stack:
            i = stack.pop()
            if not done[i]:
                done[i] = 1
                order.append(i)
                stack.extend(reversed(waiting.pop(i, ())))

    for i, (k, r) in enumerate(zip(keys, ranks, strict=True)):
        if r == UNPLACED:
            continue
        j = holder.get(k[0]) if r == PLACED and k[0] is not None else None
        if j is None or j == i or done[j]:
            emit(i)
        else:
            waiting.setdefault(j, []).append(i)
    for i, r in enumerate(ranks):  # left: a cycle of parents (an insane publisher)
        if r != UNPLACED and not done[i]:
            emit(i)
    return order


# -- loading into a mirror ----------------------------------------------------------------


def load_runs(mirror: Mirror, source: SourceKey, rows: Iterable[MirrorRow]) -> int:
    """Put one publisher's records into a mirror (as saved runs); returns its blocks."""
    src = mirror.source(source)
    blocks = 0
    for run_id, rank, group, medium, size, lora, ts, keys, events, n in rows:
        decoded = _decode_keys(keys)
        parent, hashes, extras = decoded[0], decoded[1], decoded[2]
        run = Run(
            run_id, group, medium, parent, hashes, size, lora, ts, None, rank,
            array_header(n) + events,
        )  # fmt: skip
        run.saved = True
        pool = src.pool((group, medium))
        held = list(_held(decoded))
        pool.blocks.update(zip(held, repeat(run)))
        for i in decoded[3] or ():
            src.kept_for[hashes[i]] = run
        for i, copies in extras or ():
            pool.extra[hashes[i]] = copies - 1
        src.add(run, dirty=False)
        mirror.next_id = max(mirror.next_id, run_id + 1)
        blocks += len(held)
    return blocks


# -- rows (export) -------------------------------------------------------------------------


def mirror_rows(mirror: Mirror) -> list[BlockRow]:
    """Every block the mirror holds, one row per (publisher, pool, hash)."""
    rows: list[BlockRow] = []
    for source, src in mirror.sources.items():
        for run in src.runs.values():
            rows.extend(_run_rows(source, src, run))
    return rows


def _run_rows(source: SourceKey, src: PublisherRuns, run: Run) -> Iterator[BlockRow]:
    live = src.members(run)
    if not live:
        return
    pool = src.pools[(run.group, run.medium)]
    flat = run.flat_tokens()
    size, hashes, width = run.size, run.hashes, run.width
    for i in live:
        h = hashes[i]
        own = None if flat is None else flat[i * width : (i + 1) * width]
        parent = hashes[i - 1] if i else run.parent
        yield BlockRow(
            source, run.group, run.medium, h, parent, own, size, run.lora, pool.copies(h), run.ts
        )
