"""The in-order path in C: one publisher's `SourceState` with a C `Sequencer` beside it.

While the Python state is plain (`SourceState.plain`: no replay, nothing held, no check
pending), the C loop (`_recv.ingest_live`) takes every live batch whose seq is the one due:
it checks the seq, digests the payload and applies it through the compiled core, without
the GIL and without a Python object per batch. What it changed (next seq, last live seq,
digests, counters) sits in the Sequencer until Python needs it:

- `sync()` after every C read: the counters and seqs into the state (a few integers, once
  per read of a socket, not per batch), and what the index's bookkeeping needs (`Applied`);
- `disarm()` before Python decides anything for this publisher again (the message C
  stopped at, a replay reply, a link change, a tick, a close): the digests too, so the
  state is exactly what `on_live` would have made of each batch.

With `keep_payloads` (a persistent store, which logs every batch the index applied), the
C path also keeps the payloads of the batches it applied, and `sync()` hands them over with
the counters: one buffer per publisher and read (`Applied.packed`: a msgpack array of the
payloads, as a store's message carries it), never an object per batch, and never copied
under the GIL: a read-only memoryview of the very buffer C kept them in (its own from then
on), which the store's link sends as a frame of its own.

Python arms it again only at the start of a poll (`Subscriber._process`): the items Python
produced for the publisher before are all applied by then, so C never applies a batch
ahead of one Python still holds. `tests/test_inorder.py` holds the two paths to the same
decisions on hypothesis streams.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvindex.subscriber.messages import SourceKey
from kvindex.subscriber.state import Checkpoint, SourceState

__all__ = ["Applied", "InOrder", "available"]

_Sequencer: Any
try:  # the C receive; absent without a compiler at install time
    from kvindex.subscriber._recv import Sequencer as _Sequencer
except ImportError:  # pragma: no cover - the pure-Python install
    _Sequencer = None


def available() -> bool:
    return _Sequencer is not None


class Applied(NamedTuple):
    """Batches the C path applied for one publisher since the last sync."""

    source: SourceKey
    batches: int
    last_seq: int
    ts: float | None  # the last batch's (None: offered without an apply, in tests)
    counts: tuple[int, int, int]  # block events stored, removed, and clears
    # With keep_payloads: every batch of this sync as the publisher sent it, seqs
    # last_seq - batches + 1 .. last_seq in order, packed as one msgpack array of bin (what
    # `msgspec.msgpack.encode(list_of_payloads)` gives): read-only, over the C buffer
    # itself, freed with its last reference.
    packed: memoryview | None = None


class InOrder:
    """The C sequencer of one publisher, kept in step with its Python `SourceState`."""

    def __init__(
        self, state: SourceState, sink: list[Applied], keep_payloads: bool = False
    ) -> None:
        """`sink` gets an `Applied` for each sync that found batches applied in C, with
        their payloads if `keep_payloads`."""
        if _Sequencer is None:
            raise RuntimeError("the C receive (kvindex.subscriber._recv) was not built")
        self.state = state
        self.sequencer = _Sequencer(state.policy.digests_kept, keep_payloads)
        self.keep_payloads = keep_payloads
        self._sink = sink

    @property
    def armed(self) -> bool:
        return bool(self.sequencer.armed)

    def arm(self, bit: int) -> bool:
        """Let C take the batches due, if the state is plain; True if it may now."""
        state = self.state
        if not state.plain or state.next_seq < 0 or state.next_seq >= 1 << 64:
            return False
        self.sequencer.arm(state.next_seq, state.last_live, bit)
        return True

    def sync(self) -> None:
        """Bring the state's counters and seqs up to date (the digests stay in C)."""
        if not self.sequencer.armed:
            return
        received, delivered, next_seq, last_live, ts, traffic, counts = self.sequencer.take()
        if not received:
            return
        self.state.advanced(delivered, next_seq, last_live, traffic)
        packed = None
        if self.keep_payloads and delivered:
            kept = self.sequencer.kept()
            # Every batch C delivered since the last sync, and only those (offer() keeps
            # none: tests only, never with keep_payloads).
            if kept is None or kept[1] != delivered or kept[0] + delivered != next_seq:
                raise RuntimeError("the C path's kept payloads do not match its deliveries")
            packed = kept[2]
        applied = Applied(self.state.source, delivered, next_seq - 1, ts, counts, packed)
        self._sink.append(applied)

    def disarm(self) -> None:
        """Hand everything back to the state (digests included) and stop the C path."""
        if not self.sequencer.armed:
            return
        self.sync()
        digests = self.sequencer.digests()
        if digests:
            state = self.state
            state.advanced(0, state.next_seq, state.last_live, None, digests)
        self.sequencer.disarm()

    def offer(self, seq: int, payload: bytes, now: float) -> bool:
        """The sequencing decision alone (no socket, no apply): True if C took the batch."""
        return bool(self.sequencer.offer(seq, payload, now))

    def checkpoint(self) -> Checkpoint:
        """The state's checkpoint, with the digest C holds for the last batch."""
        self.sync()
        state = self.state
        cp = state.checkpoint()
        if self.sequencer.armed and state.next_seq > 0:
            digest = self.sequencer.digest(state.next_seq - 1)
            if digest is not None:
                return cp._replace(last_digest=digest)
        return cp
