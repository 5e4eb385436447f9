"""The recording file format: zstd-compressed segments of length-prefixed msgpack records.

A file is a sequence of segments, each independently decodable:

    segment = b"KVRS" | u32 BE: frame length | u32 BE: CRC-32 of the frame | frame
    frame   = one zstd frame (content size and checksum included) of
              record* where record = u32 BE: length | msgpack map tagged by "type"

The first record of a file is a `HeaderRec`; each recording session (a file can be
appended to) starts with a `SessionRec`. Then `BatchRec` (one published batch: its
source, seq, receive time and the raw payload, byte for byte) and `NoticeRec` (a
restart, lost batches, ... as the Subscriber announced them) in delivery order.

A writer only ever appends whole segments with one write and flushes after each, so a
file cut anywhere (a killed process, a full disk) reads up to its last whole segment.
Unknown record types are skipped by readers, so newer writers can add some.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import msgspec

__all__ = [
    "FORMAT",
    "MAGIC",
    "SEGMENT_HEAD",
    "VERSION",
    "BatchRec",
    "HeaderRec",
    "NoticeRec",
    "Record",
    "RecordingError",
    "SessionRec",
    "frame_records",
    "segment",
    "split_records",
]

FORMAT = "kvindex-recording"
VERSION = 1
MAGIC = b"KVRS"
SEGMENT_HEAD = struct.Struct(">4sII")  # magic, frame length, CRC-32 of the frame
_LENGTH = struct.Struct(">I")
MAX_SEGMENT = 1 << 30  # a frame length above this is damage, not data


class RecordingError(ValueError):
    """A file that is not a kvindex recording, or is damaged where it can't be read past."""


class HeaderRec(msgspec.Struct, tag="header", tag_field="type", omit_defaults=True):
    created: float
    kvindex: str
    format: str = FORMAT
    version: int = VERSION


class SessionRec(msgspec.Struct, tag="session", tag_field="type", omit_defaults=True):
    """A recording run started: what it followed (instance specs, as `serve` takes them)."""

    started: float
    instances: list[str] = []


class BatchRec(msgspec.Struct, tag="batch", tag_field="type", omit_defaults=True, gc=False):
    """One published batch as it came off the wire; `received` is wall-clock time."""

    instance: str
    rank: int
    seq: int
    received: float
    payload: bytes
    replayed: bool = False


class NoticeRec(msgspec.Struct, tag="notice", tag_field="type", omit_defaults=True):
    """A Subscriber notice: `kind` is its class name, `fields` its own fields."""

    instance: str
    rank: int
    received: float
    kind: str
    fields: dict[str, Any] = {}
    text: str = ""


Record = HeaderRec | SessionRec | BatchRec | NoticeRec

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def encode_record(record: Record, into: bytearray) -> None:
    """Append one length-prefixed record to `into`."""
    start = len(into)
    into.extend(b"\0\0\0\0")
    _encoder.encode_into(record, into, -1)
    _LENGTH.pack_into(into, start, len(into) - start - 4)


def frame_records(blob: bytes | bytearray, compressor: Any) -> bytes:
    """A whole segment (head and zstd frame) holding the records in `blob`."""
    frame: bytes = compressor.compress(bytes(blob))
    return segment(frame)


def segment(frame: bytes) -> bytes:
    return SEGMENT_HEAD.pack(MAGIC, len(frame), zlib.crc32(frame)) + frame


def split_records(blob: bytes) -> tuple[list[Record], int]:
    """The records of one decompressed segment, and how many were of an unknown type."""
    records: list[Record] = []
    skipped = 0
    view = memoryview(blob)
    pos = 0
    while pos < len(blob):
        if pos + 4 > len(blob):
            raise RecordingError("a record's length runs past its segment")
        (length,) = _LENGTH.unpack_from(blob, pos)
        end = pos + 4 + length
        if end > len(blob):
            raise RecordingError("a record runs past its segment")
        try:
            records.append(_decoder.decode(view[pos + 4 : end]))
        except msgspec.ValidationError:
            skipped += 1  # a record type (or field) of a newer writer
        except msgspec.DecodeError as exc:
            raise RecordingError(f"a record is not msgpack: {exc}") from None
        pos = end
    return records, skipped
