"""Events as JSON records and as one readable line; shared by the commands that print them.

JSON follows interface.md: vLLM's field names, block hashes through `render_hash` (an int as
decimal, bytes as lowercase hex), and any other bytes (inside `extra_keys`, or in an unknown
event) as hex too, since JSON has no bytes and base64 would read as a different hash.
SGLang's fields are there under their own names: `session_id`, `lora_name`, and
`cache_salt` as a short digest (`salt:` + 12 hex digits: the salt itself isolates a
tenant's cache and is never printed); a bigram page's `token_ids` are its pairs.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import msgspec
from rich.text import Text

from kvindex.index.namespaces import salt_digest
from kvindex.subscriber import Delivery
from kvindex.wire import (
    AllBlocksCleared,
    BigramBlockStored,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    UnknownEvent,
    render_hash,
)

__all__ = ["batch_line", "delivery_records", "event_fields", "short_hash"]

# Fields known to hold only ints/strings: copied as they are, so that thousands of token
# ids are not walked in Python looking for bytes.
_PLAIN_FIELDS = frozenset({"token_ids", "lookahead_token_ids"})
_MAX_ITEMS_SHOWN = 6
_SHORT_HEX = 16
_RESERVED = frozenset({"instance", "seq", "ts", "dp_rank", "replayed", "type"})
_SHORT_NAMES = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "clear"}


def _hexify(value: Any) -> Any:
    """Bytes anywhere inside `value` as lowercase hex (JSON can't carry bytes)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, list | tuple):
        return [_hexify(item) for item in value]
    if isinstance(value, dict):
        return {_hexify(k) if isinstance(k, bytes) else k: _hexify(v) for k, v in value.items()}
    return value


def _unknown_value(name: str, value: Any) -> Any:
    # Hash fields keep the interface's rendering whatever event carries them.
    if name == "block_hashes" and isinstance(value, list):
        return [render_hash(h) if isinstance(h, int | bytes) else _hexify(h) for h in value]
    if name == "parent_block_hash" and isinstance(value, int | bytes):
        return render_hash(value)
    return _hexify(value)


def _unknown_fields(event: UnknownEvent) -> dict[str, Any]:
    # An event type this kvindex does not know (a newer vLLM): its fields are still shown,
    # under their own names for the map form, or as a positional list for the array form.
    try:
        raw = msgspec.msgpack.decode(event.raw)
    except msgspec.DecodeError:
        return {}
    if isinstance(raw, dict):
        # Its own keys never replace the record's (`seq`, `ts`, ... and `type`).
        return {
            str(k): _unknown_value(str(k), v) for k, v in raw.items() if str(k) not in _RESERVED
        }
    if isinstance(raw, list):
        return {"fields": _hexify(raw[1:])}
    return {}


def event_fields(event: Event) -> dict[str, Any]:
    """`{"type": ..., field: value, ...}` under vLLM's names, JSON-ready."""
    out: dict[str, Any] = {"type": event.type_name}
    if isinstance(event, UnknownEvent):
        out.update(_unknown_fields(event))
        return out
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if name == "block_hashes":
            value = [render_hash(h) for h in value]
        elif name == "parent_block_hash":
            value = None if value is None else render_hash(value)
        elif name == "cache_salt":
            value = salt_digest(value)
        elif name == "token_pairs":
            continue  # shown as the event's token_ids, below
        elif name not in _PLAIN_FIELDS:
            value = _hexify(value)
        out[name] = value
    if isinstance(event, BigramBlockStored):
        out["token_ids"] = [list(pair) for pair in event.token_pairs]
    return out


def delivery_records(delivery: Delivery) -> Iterable[dict[str, Any]]:
    """One JSON-ready record per event of a delivered batch, in batch order."""
    batch = delivery.batch
    rank = batch.data_parallel_rank
    head = {
        "instance": delivery.instance,
        "seq": delivery.seq,
        "ts": batch.ts,
        # vLLM 0.9.0 sent no rank: the subscriber's own rank for the socket is the truth then.
        "dp_rank": delivery.rank if rank is None else rank,
        "replayed": delivery.replayed,
    }
    for event in batch.events:
        yield {**head, **event_fields(event)}


def short_hash(value: BlockHash) -> str:
    """A hash for reading: ints whole (at most 20 digits), digests cut to 16 hex digits."""
    text = render_hash(value)
    return text if isinstance(value, int) or len(text) <= _SHORT_HEX else text[:_SHORT_HEX] + "…"


def _append_hashes(text: Text, hashes: list[BlockHash]) -> None:
    text.append(f" n={len(hashes)}")
    if hashes:
        text.append(" first=")
        text.append(short_hash(hashes[0]), style="bold")


def _removed_text(run: list[BlockRemoved]) -> Text:
    text = Text()
    text.append("removed", style="yellow")
    _append_hashes(text, [h for event in run for h in event.block_hashes])
    if run[0].medium is not None:
        text.append(f" medium={run[0].medium}")
    if len(run) > 1:
        text.append(f" ({len(run)} events)")
    return text


def _runs(events: list[Event]) -> list[list[Event]]:
    """Events to show as one item each, but consecutive BlockRemoved of one medium together:
    vLLM's GPU path sends one hash per event, and an eviction burst would fill the line."""
    runs: list[list[Event]] = []
    for event in events:
        last = runs[-1][-1] if runs else None
        if (
            isinstance(event, BlockRemoved)
            and isinstance(last, BlockRemoved)
            and last.medium == event.medium
        ):
            runs[-1].append(event)
        else:
            runs.append([event])
    return runs


def _run_text(run: list[Event]) -> Text:
    if len(run) > 1:
        return _removed_text([e for e in run if isinstance(e, BlockRemoved)])
    return _event_text(run[0])


def _event_text(event: Event) -> Text:
    if isinstance(event, BlockStored):
        text = Text()
        text.append("stored", style="green")
        _append_hashes(text, event.block_hashes)
        parent = "-" if event.parent_block_hash is None else short_hash(event.parent_block_hash)
        if isinstance(event, BigramBlockStored):
            text.append(f" parent={parent} bigram pairs={len(event.token_pairs)}")
        else:
            text.append(f" parent={parent} tokens={len(event.token_ids)}")
        if event.medium is not None:
            text.append(f" medium={event.medium}")
        if event.lora_name is not None:
            text.append(f" lora={event.lora_name}")
        elif event.lora_id is not None:  # before vLLM 0.14 only the process-local id
            text.append(f" lora_id={event.lora_id}")
        if event.cache_salt is not None:
            text.append(f" {salt_digest(event.cache_salt)}")
        if event.session_id is not None:
            text.append(f" session={event.session_id}")
        return text
    if isinstance(event, BlockRemoved):
        return _removed_text([event])
    if isinstance(event, AllBlocksCleared):
        return Text("ALL BLOCKS CLEARED", style="bold magenta")
    return Text(f"unknown event {event.type_name!r}", style="italic dim")


def _clock(ts: float) -> str:
    """Local wall-clock time of the batch as the publisher stamped it, to the millisecond."""
    try:
        return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"
    except (OverflowError, OSError, ValueError):  # a publisher's nonsense (inf, nan, 1e300)
        return f"ts={ts!r}"


def batch_line(delivery: Delivery) -> Text:
    """One readable line for a delivered batch: seq, time, rank, counts, each event."""
    batch = delivery.batch
    rank = delivery.rank if batch.data_parallel_rank is None else batch.data_parallel_rank
    line = Text()
    line.append(f"#{delivery.seq}", style="bold")
    line.append(f" {_clock(batch.ts)} dp{rank}", style="dim")
    if delivery.replayed:
        line.append(" replayed", style="cyan")
    line.append(f" {len(batch.events)} event{'s' if len(batch.events) != 1 else ''}")
    if batch.malformed_events:
        line.append(f" ({batch.malformed_events} malformed)", style="red")
    runs = _runs(batch.events)
    for run in runs[:_MAX_ITEMS_SHOWN]:
        line.append(" | ", style="dim")
        line.append_text(_run_text(run))
    rest = [event for run in runs[_MAX_ITEMS_SHOWN:] for event in run]
    hidden = Counter(_SHORT_NAMES.get(e.type_name, e.type_name) for e in rest)
    if hidden:
        counts = ", ".join(f"{n} {name}" for name, n in hidden.items())
        line.append(f" | … {hidden.total()} more events ({counts})", style="dim")
    return line
