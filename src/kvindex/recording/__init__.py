"""`kvindex.recording`: record a fleet's KV-event stream to a file, read it back, replay it.

>>> import kvindex.recording as rec
>>> for item in rec.read("fleet.kvr"):     # RecordedBatch (a Delivery) and notices
...     index.handle(item)
>>> with rec.Writer("mine.kvr") as w:      # what `kvindex record` uses
...     w.batch(SourceKey("vllm-0"), seq, payload)

The file format is described in `kvindex.recording.format`.
"""

from kvindex.recording.format import (
    BatchRec,
    HeaderRec,
    NoticeRec,
    Record,
    RecordingError,
    SessionRec,
)
from kvindex.recording.reader import (
    Reader,
    RecordedBatch,
    checkpoints,
    read,
    records,
    to_item,
)
from kvindex.recording.writer import Writer

__all__ = [
    "BatchRec",
    "HeaderRec",
    "NoticeRec",
    "Reader",
    "Record",
    "RecordedBatch",
    "RecordingError",
    "SessionRec",
    "Writer",
    "checkpoints",
    "read",
    "records",
    "to_item",
]
