"""What the service and a store's worker process say to each other: one set of messages
for both backends (SQLite's writer, Redis's worker).

Service -> worker, in `Group`s (one ZMQ message each, numbered in sending order; its msgpack
may come in several frames, joined on receipt: `group_frames`, `decode_frames`): what the
index applied (`AppliedBatch`, `AppliedBatches`, `RestartMark`, `LostMark`), the fleet's membership
(`SaveInstance`, `RemoveInstance`), the status of the publishers this replica ingests
(`StatusReport`, Redis only) and control (`ControlRequest`: sync, compact, stop).

Worker -> service: `WorkerReport`s, saying up to which group everything is durable
(`committed`), which requests are done, and why the worker can't write, if it can't. The
service keeps every group not yet committed, so that a worker started again after a crash
is handed them again: each message is applied idempotently (a batch by its seq, a
restart and a lost run by where the log stands), so a group applied twice changes nothing.

Every field is exact: seqs are whole numbers of any size up to 2**64 - 1 (msgpack holds
them as they are).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

from kvindex.wire.packing import array_header

__all__ = [
    "AppliedBatch",
    "AppliedBatches",
    "ControlRequest",
    "Group",
    "LostMark",
    "Message",
    "Outgoing",
    "OutgoingGroup",
    "PackedBatches",
    "RemoveInstance",
    "RestartMark",
    "SaveInstance",
    "StatusReport",
    "WorkerReport",
    "decode_frames",
    "decode_group",
    "decode_report",
    "encode_report",
    "group_frames",
    "pack_payloads",
]


class _PublisherMessage(msgspec.Struct, array_like=True, gc=False):
    """What every message about one publisher starts with: its instance and DP rank
    (array-like, so these are the first two items on the wire)."""

    instance: str
    rank: int


class AppliedBatch(_PublisherMessage, tag="b"):
    """A batch the index applied, as the publisher sent it (`payload`: raw msgpack)."""

    seq: int
    payload: bytes


class AppliedBatches(_PublisherMessage, tag="B"):
    """Consecutive batches the index applied (the C path's of one read): seqs `first_seq`,
    `first_seq + 1`, ..., each as the publisher sent it. One message, not one per batch;
    the worker takes them as that many `AppliedBatch`es (`batches()`)."""

    first_seq: int
    payloads: list[bytes]

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.payloads) - 1

    def batches(self) -> list[AppliedBatch]:
        instance, rank, first = self.instance, self.rank, self.first_seq
        return [AppliedBatch(instance, rank, first + i, p) for i, p in enumerate(self.payloads)]


class PackedBatches(_PublisherMessage, tag="B"):
    """`AppliedBatches` as the service sends it: its payloads already packed as the msgpack
    array a list of bytes encodes to (by the C receive, `Applied.packed`), carried as they
    are; the worker decodes it as an `AppliedBatches` (`count` trails, and is ignored)."""

    first_seq: int
    payloads: msgspec.Raw
    count: int

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.count - 1


def pack_payloads(payloads: list[bytes]) -> bytes:
    """Payloads packed as `PackedBatches.payloads` carries them."""
    return msgspec.msgpack.encode(payloads)


class RestartMark(_PublisherMessage, tag="r"):
    """The publisher restarted: what the store holds of it goes."""


class LostMark(_PublisherMessage, tag="l"):
    """Seqs `first..last` of the publisher could not be had (counted, never applied)."""

    first: int
    last: int


class SaveInstance(msgspec.Struct, tag="i", array_like=True, gc=False):
    """An instance added (its spec, as `InstanceSpec.render` writes it)."""

    name: str
    spec: str


class RemoveInstance(msgspec.Struct, tag="x", array_like=True, gc=False):
    """An instance removed: everything of it goes."""

    name: str


class StatusReport(msgspec.Struct, tag="s", array_like=True):
    """How the publishers this replica ingests are doing (tag -> fields), for the other
    replicas (Redis only)."""

    report: dict[str, Any]


class ControlRequest(msgspec.Struct, tag="q", array_like=True, gc=False):
    """Control: `sync` (answered once everything before it is durable), `compact` (once a
    snapshot is written), `stop` (finish, then exit)."""

    kind: Literal["sync", "compact", "stop"]
    token: int


Message = (
    AppliedBatch
    | AppliedBatches
    | RestartMark
    | LostMark
    | SaveInstance
    | RemoveInstance
    | StatusReport
    | ControlRequest
)


class Group(msgspec.Struct, array_like=True):
    """Messages handed over together; `id` counts groups from 1 for the worker's life."""

    id: int
    messages: list[Message]


# What the service sends: a Message, or the C path's batches packed (read as AppliedBatches).
Outgoing = Message | PackedBatches


class OutgoingGroup(msgspec.Struct, array_like=True):
    """A `Group` as the service writes it (its messages may be PackedBatches)."""

    id: int
    messages: list[Outgoing]


class WorkerReport(msgspec.Struct, array_like=True, gc=False):
    """The worker's news: every group up to `committed` is durable; `done` lists the
    tokens of requests answered; `error` is why it can't write now ("" when it can);
    `refused`: batches this worker process refused as written already (a group handed
    again after a restart; any other is a batch lost to the store), since it started."""

    committed: int
    done: list[int] = []
    error: str = ""
    refused: int = 0


decode_group = msgspec.msgpack.Decoder(Group).decode


# What `group_frames` writes before a PackedBatches's payloads: its array header (6 items:
# the tag, then its five fields) in place of the 4 its first items encode to alone.
_PACKED_ITEMS = b"\x96"
_PACKED_TAG = PackedBatches.__struct_config__.tag


def group_frames(
    encode: Callable[[Any], bytes], group_id: int, messages: list[Outgoing]
) -> list[bytes | memoryview]:
    """`OutgoingGroup(group_id, messages)` encoded, in frames that join to exactly what
    `encode` makes of it whole: each PackedBatches's payloads a frame of their own, as
    they are (the C receive's buffer: never copied here), the rest encoded between them.
    A group without one is one frame."""
    frames: list[bytes | memoryview] = []
    head = [b"\x92", encode(group_id), array_header(len(messages))]
    for message in messages:
        if isinstance(message, PackedBatches):
            start = (_PACKED_TAG, message.instance, message.rank, message.first_seq)
            head.append(_PACKED_ITEMS + encode(start)[1:])
            frames.append(b"".join(head))
            frames.append(memoryview(message.payloads))
            head = [encode(message.count)]
        else:
            head.append(encode(message))
    frames.append(b"".join(head))
    return frames


def decode_frames(frames: Sequence[bytes | memoryview]) -> Group:
    """A group as `group_frames` sent it, its frames joined (a copy in the worker's
    process, not the service's)."""
    return decode_group(frames[0] if len(frames) == 1 else b"".join(frames))


decode_report = msgspec.msgpack.Decoder(WorkerReport).decode
encode_report = msgspec.msgpack.Encoder().encode
