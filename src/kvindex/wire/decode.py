"""Decoding `EventBatch` payloads of every vLLM generation, fast.

The hot path is one typed msgspec decode of the whole batch (no per-event Python work).
A batch's events are all arrays (vLLM <= 0.23) or all maps (>= 0.24); the decoder tries the
generation that worked last first, so a steady stream costs one decode call per batch.

Only when neither typed decoder accepts a payload does the slow path run: it splits the
batch into raw events and decodes them one by one, so that one unknown event type (a newer
vLLM) or one malformed event costs that event, not the batch. SGLang's bigram pages (token
ids as pairs) are taken there too (`BigramBlockStored`): a stream of them costs the slow
path, ordinary batches nothing.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvindex.wire.events import (
    KNOWN_TYPES,
    ArrayEvent,
    Event,
    EventBatch,
    MapEvent,
    UnknownEvent,
    _ArrayWireBatch,
    _BigramWireBatch,
    _MapWireBatch,
    _RawWireBatch,
    _WireBigramBlockStored,
)

__all__ = ["BatchDecoder", "WireError", "decode_batch"]

# A payload over this size is refused before decoding (vLLM batches are one engine step:
# kilobytes to a few megabytes).
DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024

# What a hostile payload can make msgspec raise: a decode error; a RecursionError for values
# nested deeper than the interpreter's recursion limit (`[[[[...]]]]` in `extra_keys`); a
# UnicodeDecodeError (a ValueError) for a string that is not UTF-8. None may escape as
# anything but a malformed payload or event.
_FAILED = (msgspec.DecodeError, RecursionError, ValueError)


class WireError(ValueError):
    """A payload or frame that is not a vLLM event batch at all."""


def _batch(wire: Any) -> EventBatch:
    return EventBatch(wire.ts, wire.events, wire.data_parallel_rank)


class BatchDecoder:
    """Decodes payloads into `EventBatch`; keeps no state but which generation came last.

    One decoder per stream is cheapest (its generation guess stays right), but sharing one is
    correct too.
    """

    __slots__ = (
        "_any",
        "_array",
        "_bigram",
        "_bigram_batch",
        "_event_array",
        "_event_map",
        "_map",
        "_max",
        "_prefer_map",
        "_raw",
    )

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self._map = msgspec.msgpack.Decoder(_MapWireBatch)
        self._array = msgspec.msgpack.Decoder(_ArrayWireBatch)
        self._raw = msgspec.msgpack.Decoder(_RawWireBatch)
        self._event_map = msgspec.msgpack.Decoder(MapEvent)
        self._event_array = msgspec.msgpack.Decoder(ArrayEvent)
        self._bigram = msgspec.msgpack.Decoder(_WireBigramBlockStored)
        self._bigram_batch = msgspec.msgpack.Decoder(_BigramWireBatch)
        self._any = msgspec.msgpack.Decoder()
        self._max = max_payload
        self._prefer_map = True

    def decode(self, payload: bytes | memoryview) -> EventBatch:
        """Decode one payload. Raises `WireError` if it is not an event batch."""
        if len(payload) > self._max:
            raise WireError(f"payload of {len(payload)} bytes exceeds the {self._max} byte limit")
        first, second = (self._map, self._array) if self._prefer_map else (self._array, self._map)
        try:
            return _batch(first.decode(payload))
        except _FAILED:
            pass
        try:
            batch = _batch(second.decode(payload))
        except _FAILED:
            return self._decode_bigram(payload)
        self._prefer_map = not self._prefer_map
        return batch

    def _decode_bigram(self, payload: bytes | memoryview) -> EventBatch:
        """A batch of SGLang bigram pages (and removals) in one typed decode; else the
        slow path, event by event."""
        try:
            wire = self._bigram_batch.decode(payload)
        except _FAILED:
            return self._decode_slowly(payload)
        events: list[Event] = [
            e.event() if isinstance(e, _WireBigramBlockStored) else e for e in wire.events
        ]
        return EventBatch(wire.ts, events, wire.data_parallel_rank)

    def _decode_slowly(self, payload: bytes | memoryview) -> EventBatch:
        try:
            wire = self._raw.decode(payload)
        except _FAILED as exc:
            raise WireError(f"not an event batch: {exc}") from None
        events: list[Event] = []
        malformed = unknown = 0
        for raw in wire.events:
            event = self._decode_event(raw)
            if event is None:
                malformed += 1
                continue
            unknown += isinstance(event, UnknownEvent)
            events.append(event)
        return EventBatch(wire.ts, events, wire.data_parallel_rank, malformed, unknown)

    def _decode_event(self, raw: msgspec.Raw) -> Event | None:
        data = bytes(raw)
        for decoder in (self._event_map, self._event_array):
            try:
                event: Event = decoder.decode(data)
                return event
            except _FAILED:
                continue
        try:
            tag = _tag_of(self._any.decode(data))
        except _FAILED:
            return None
        if tag is not None and tag not in KNOWN_TYPES:
            return UnknownEvent(tag, data)
        if tag == "BlockStored":
            try:
                return self._bigram.decode(data).event()
            except _FAILED:
                return None
        return None


def _tag_of(value: Any) -> str | None:
    if isinstance(value, dict):
        tag = value.get("type")
    elif isinstance(value, list) and value:
        tag = value[0]
    else:
        return None
    return tag if isinstance(tag, str) else None


_default_decoder = BatchDecoder()


def decode_batch(payload: bytes | memoryview) -> EventBatch:
    """Decode one payload with a shared decoder. Raises `WireError` if it is malformed."""
    return _default_decoder.decode(payload)


def event_to_builtins(event: Event) -> dict[str, Any]:
    """The event as a plain dict under vLLM's field names, with `type` first."""
    if isinstance(event, UnknownEvent):
        return {"type": event.type_name}
    out: dict[str, Any] = {"type": event.type_name}
    for name in event.__struct_fields__:
        out[name] = getattr(event, name)
    return out
