"""ZMQ frames of vLLM's publisher: live messages and replay replies.

Live (every release): `[topic, seq, payload]`, seq 8 bytes big-endian unsigned.
Replay request (DEALER -> ROUTER): `[b"", start_seq]`.
Replay reply: `[b"", seq, payload]` up to vLLM 0.25, `[b"", topic, seq, payload]` from 0.26;
the end marker has seq `ff * 8` and an empty payload.
"""

from __future__ import annotations

from typing import NamedTuple

from kvindex.wire.decode import WireError

__all__ = [
    "END_SEQ",
    "LiveFrame",
    "ReplayFrame",
    "encode_seq",
    "parse_live",
    "parse_replay",
    "replay_request",
]

END_SEQ_BYTES = b"\xff" * 8
END_SEQ = -1
"""`ReplayFrame.seq` of the end marker."""


class LiveFrame(NamedTuple):
    topic: bytes
    seq: int
    payload: bytes


class ReplayFrame(NamedTuple):
    seq: int  # END_SEQ for the end marker
    payload: bytes


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"seq frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def parse_live(frames: list[bytes]) -> LiveFrame:
    """Split a live PUB message; raises `WireError` for a wrong frame count or seq width."""
    if len(frames) != 3:
        raise WireError(f"live message of {len(frames)} frames, expected 3")
    topic, seq, payload = frames
    return LiveFrame(topic, decode_seq(seq), payload)


def parse_replay(frames: list[bytes]) -> ReplayFrame:
    """Split a replay reply as a DEALER receives it, in either layout."""
    if len(frames) == 4:  # vLLM >= 0.26: [b"", topic, seq, payload]
        empty, _topic, seq, payload = frames
    elif len(frames) == 3:  # vLLM <= 0.25: [b"", seq, payload]
        empty, seq, payload = frames
    else:
        raise WireError(f"replay reply of {len(frames)} frames, expected 3 or 4")
    if empty:
        raise WireError("replay reply without the empty delimiter frame")
    if seq == END_SEQ_BYTES:
        return ReplayFrame(END_SEQ, b"")
    return ReplayFrame(decode_seq(seq), payload)


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to ask for every buffered batch with seq >= start_seq."""
    return [b"", encode_seq(start_seq)]
