"""`Writer`: appends records to a recording file in whole, flushed segments."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import IO, Any

import zstandard

from kvindex import __version__
from kvindex.recording.format import (
    BatchRec,
    HeaderRec,
    NoticeRec,
    Record,
    RecordingError,
    SessionRec,
    encode_record,
    frame_records,
)
from kvindex.recording.reader import Reader, advance
from kvindex.subscriber import Checkpoint, Delivery, Item, Notice, SourceKey

__all__ = ["Writer"]

DEFAULT_SEGMENT_BYTES = 1 << 20
DEFAULT_FLUSH_INTERVAL = 1.0


class Writer:
    """Writes a recording: records are buffered and written as one zstd segment when the
    buffer reaches `segment_bytes` (uncompressed) or `flush_interval` seconds have passed
    since its first record (checked on each write and on `tick()`).

    An existing file is continued: a cut-off last segment (a killed writer) is dropped
    first, and `checkpoints` tells where each recorded source stopped. A file damaged
    elsewhere is refused (`RecordingError`) rather than written past.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        append: bool = True,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        flush_interval: float = DEFAULT_FLUSH_INTERVAL,
        level: int = 3,
    ) -> None:
        self.path = os.fspath(path)
        self.segment_bytes = segment_bytes
        self.flush_interval = flush_interval
        self.checkpoints: dict[SourceKey, Checkpoint] = {}
        self.batches = 0
        self.notices = 0
        self.segments = 0
        self.raw_bytes = 0
        self._compressor = zstandard.ZstdCompressor(
            level=level, write_checksum=True, write_content_size=True
        )
        self._buf = bytearray()
        self._buf_since: float | None = None
        self._file = self._open(append)
        self.size = self._file.tell()  # bytes in the file: whole segments only
        if self.size == 0:
            self.write(HeaderRec(created=time.time(), kvindex=__version__))

    def _open(self, append: bool) -> IO[bytes]:
        try:
            if not append or not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
                return open(self.path, "wb")
            end = self._resume_point()
            f = open(self.path, "r+b")  # noqa: SIM115 (kept open: closed by close())
        except OSError as exc:
            raise RecordingError(f"can't write {self.path}: {exc.strerror or exc}") from None
        f.truncate(end)
        f.seek(end)
        return f

    def _resume_point(self) -> int:
        reader = Reader(self.path)
        for rec in reader:
            if isinstance(rec, BatchRec | NoticeRec):
                advance(self.checkpoints, rec)
        if reader.damage is not None:
            raise RecordingError(f"{self.path} is damaged ({reader.damage}); not appending")
        return reader.end

    # -- records -------------------------------------------------------------------------

    def write(self, record: Record) -> None:
        encode_record(record, self._buf)
        if self._buf_since is None:
            self._buf_since = time.monotonic()
        if len(self._buf) >= self.segment_bytes:
            self.flush()

    def session(self, instances: list[str]) -> None:
        """Mark the start of a recording run (what it follows, as instance specs)."""
        self.write(SessionRec(started=time.time(), instances=instances))

    def batch(
        self,
        source: SourceKey,
        seq: int,
        payload: bytes,
        received: float | None = None,
        replayed: bool = False,
    ) -> None:
        """Record one published batch, its payload byte for byte."""
        when = time.time() if received is None else received
        rec = BatchRec(source.instance, source.rank, seq, when, payload, replayed)
        self.write(rec)
        advance(self.checkpoints, rec)
        self.batches += 1

    def notice(self, notice: Notice, received: float | None = None) -> None:
        """Record a Subscriber notice (restart, lost batches, gap, replay, ...)."""
        fields = {
            f.name: _plain(getattr(notice, f.name))
            for f in dataclasses.fields(notice)
            if f.name != "source"
        }
        rec = NoticeRec(
            notice.instance,
            notice.rank,
            time.time() if received is None else received,
            type(notice).__name__,
            fields,
            notice.describe(),
        )
        self.write(rec)
        advance(self.checkpoints, rec)
        self.notices += 1

    def item(self, item: Item, received: float | None = None) -> None:
        """Record what a `Subscriber(keep_payload=True)` yielded."""
        if isinstance(item, Delivery):
            if item.payload is None:
                raise ValueError("a Delivery without its payload: use keep_payload=True")
            self.batch(item.source, item.seq, item.payload, received, item.replayed)
        else:
            self.notice(item, received)

    # -- segments ------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """Write the buffered records if they have waited `flush_interval` seconds."""
        since = self._buf_since
        now = time.monotonic() if now is None else now
        if since is not None and now - since >= self.flush_interval:
            self.flush()

    def flush(self) -> None:
        """Write the buffered records as one segment and hand it to the OS."""
        if not self._buf:
            return
        data = frame_records(self._buf, self._compressor)
        self._file.write(data)
        self._file.flush()
        self.size += len(data)
        self.raw_bytes += len(self._buf)
        self.segments += 1
        self._buf.clear()
        self._buf_since = None

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(value: Any) -> Any:
    """A notice field as msgpack can carry it."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    return str(value)
