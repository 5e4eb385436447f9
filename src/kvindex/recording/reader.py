"""Reading recordings: raw records, or the Subscriber's own items for notebooks and tools."""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import zstandard

from kvindex.recording.format import (
    MAGIC,
    MAX_SEGMENT,
    SEGMENT_HEAD,
    BatchRec,
    HeaderRec,
    NoticeRec,
    Record,
    RecordingError,
    split_records,
)
from kvindex.subscriber import (
    Checkpoint,
    Connection,
    DecodeFailed,
    Delivery,
    Gap,
    Item,
    Lost,
    Malformed,
    Notice,
    Replayed,
    Restarted,
    SourceKey,
    Unreachable,
    Unverified,
    payload_digest,
)
from kvindex.wire import BatchDecoder, WireError

__all__ = ["Reader", "RecordedBatch", "advance", "checkpoints", "read", "records", "to_item"]

_NOTICES: dict[str, type[Notice]] = {
    cls.__name__: cls
    for cls in (
        Restarted,
        Gap,
        Lost,
        Unverified,
        Replayed,
        DecodeFailed,
        Malformed,
        Connection,
        Unreachable,
    )
}
_MAX_RECORDS_BLOB = 1 << 31


@dataclass(frozen=True, slots=True)
class RecordedBatch(Delivery):
    """A recorded `Delivery`: the decoded batch, its raw `payload` and its receive time
    (`received`, wall clock). Works wherever a Delivery does (`FleetIndex.handle`, ...)."""

    received: float = 0.0


class Reader:
    """The records of a recording file, in order, up to its last whole segment.

    After (or during) iteration: `end` is the offset just past the last whole segment read,
    `truncated` says the file goes on with an incomplete segment (cut mid-write), `damage`
    describes a complete segment that failed its checks (reading stopped there), and
    `skipped` counts records of a type this version does not know.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.end = 0
        self.segments = 0
        self.truncated = False
        self.damage: str | None = None
        self.skipped = 0
        self.header: HeaderRec | None = None

    def __iter__(self) -> Iterator[Record]:
        try:
            with open(self.path, "rb") as f:
                yield from self._segments(f)
        except OSError as exc:
            raise RecordingError(f"can't read {self.path}: {exc.strerror or exc}") from None

    def _segments(self, f: IO[bytes]) -> Iterator[Record]:
        decompressor = zstandard.ZstdDecompressor()
        while True:
            frame = self._next_frame(f)
            if frame is None:
                return
            try:
                blob = decompressor.decompress(frame, max_output_size=_MAX_RECORDS_BLOB)
                recs, skipped = split_records(blob)
            except (zstandard.ZstdError, RecordingError) as exc:
                self.damage = f"segment at offset {self.end} can't be decoded: {exc}"
                return
            self._check_header(recs)
            self.end = f.tell()
            self.segments += 1
            self.skipped += skipped
            yield from recs

    def _next_frame(self, f: IO[bytes]) -> bytes | None:
        head = f.read(SEGMENT_HEAD.size)
        if not head:
            return None
        if head[:4] != MAGIC[: len(head)]:
            if self.end == 0:
                raise RecordingError(f"{self.path} is not a kvindex recording")
            self.damage = f"no segment starts at offset {self.end}"
            return None
        if len(head) < SEGMENT_HEAD.size:
            self.truncated = True
            return None
        _, length, crc = SEGMENT_HEAD.unpack(head)
        if length > MAX_SEGMENT:
            self.damage = f"segment at offset {self.end} claims {length} bytes"
            return None
        frame = f.read(length)
        if len(frame) < length:
            self.truncated = True
            return None
        if zlib.crc32(frame) != crc:
            self.damage = f"segment at offset {self.end} fails its checksum"
            return None
        return frame

    def _check_header(self, recs: list[Record]) -> None:
        if self.header is not None:
            return
        if not recs or not isinstance(recs[0], HeaderRec):
            raise RecordingError(f"{self.path} does not start with a recording header")
        self.header = recs[0]


def records(path: str | os.PathLike[str]) -> Iterator[Record]:
    """Every record of a recording (header, sessions, batches, notices), in file order."""
    return iter(Reader(path))


def _notice(rec: NoticeRec) -> Notice:
    cls = _NOTICES.get(rec.kind, Notice)
    names = {f.name for f in dataclasses.fields(cls)} - {"source"}
    kwargs: dict[str, Any] = {k: v for k, v in rec.fields.items() if k in names}
    return cls(SourceKey(rec.instance, rec.rank), **kwargs)


def to_item(rec: BatchRec | NoticeRec, decoder: BatchDecoder | None = None) -> Item:
    """A batch or notice record as the Subscriber item it was recorded from."""
    if isinstance(rec, NoticeRec):
        return _notice(rec)
    source = SourceKey(rec.instance, rec.rank)
    try:
        batch = (decoder or BatchDecoder()).decode(rec.payload)
    except WireError as exc:
        return DecodeFailed(source, rec.seq, str(exc))
    size = len(rec.payload)
    return RecordedBatch(source, rec.seq, batch, rec.replayed, size, rec.payload, rec.received)


def read(path: str | os.PathLike[str], *, notices: bool = True) -> Iterator[Item]:
    """The recorded stream as the Subscriber delivered it: `RecordedBatch` items (a
    `Delivery` with the raw payload and receive time) and, unless `notices=False`, the
    notices (`Restarted`, `Lost`, ...) between them.

    >>> index = FleetIndex()
    >>> for item in kvindex.recording.read("fleet.kvr"):
    ...     index.handle(item)
    """
    decoder = BatchDecoder()
    for rec in records(path):
        if isinstance(rec, BatchRec) or (notices and isinstance(rec, NoticeRec)):
            yield to_item(rec, decoder)


def checkpoints(path: str | os.PathLike[str]) -> dict[SourceKey, Checkpoint]:
    """Where each recorded source stopped (to resume following it without a gap)."""
    last: dict[SourceKey, Checkpoint] = {}
    for rec in records(path):
        if isinstance(rec, BatchRec | NoticeRec):
            advance(last, rec)
    return last


def advance(last: dict[SourceKey, Checkpoint], rec: BatchRec | NoticeRec) -> None:
    """Move a source's checkpoint past one more record of it."""
    source = SourceKey(rec.instance, rec.rank)
    if isinstance(rec, BatchRec):
        last[source] = Checkpoint(rec.seq + 1, payload_digest(rec.payload))
    elif rec.kind == "Restarted":
        last.pop(source, None)  # a new stream, of which nothing is recorded yet
    elif rec.kind == "Lost" and isinstance(rec.fields.get("last"), int):
        # Already reported lost: don't ask for them again (nor report them twice).
        after = rec.fields["last"] + 1
        if source not in last or last[source].next_seq < after:
            last[source] = Checkpoint(after, None)
