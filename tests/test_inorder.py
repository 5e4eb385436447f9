"""The in-order path in C (subscriber/inorder.py, _recv.c's Sequencer) against the Python
state machine it stands in for (subscriber/state.py), the reference.

Hypothesis drives one publisher's stream (in order, dropped, duplicated, restarted, late
joins, resumes), link changes, replay replies good and bad, replay ends and errors, and
the passing of time into two states: the reference `SourceState` alone, and a second
`SourceState` with a C `Sequencer` beside it, driven the way `Subscriber` drives it (armed
at a poll's start when the state is plain and the poll made no item for the publisher
yet; a live batch offered to C first; the state handed back before Python decides
anything). Every input must give the same decisions on both (a batch C takes counts as
the `Deliver` the reference made of it), and the same counters, status and checkpoint
after each; once the C side is disarmed, the same digests kept. The C path through real
sockets and the core is in tests/test_runtime.py and tests/test_ingest_drain.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.subscriber import SourceKey, payload_digest
from kvindex.subscriber.inorder import Applied, InOrder, available
from kvindex.subscriber.state import Checkpoint, Deliver, ReplayPolicy, SourceState, StartReplay

pytestmark = pytest.mark.skipif(not available(), reason="the C receive was not built")

KEY = SourceKey("i", 0)


def payload(epoch: int, seq: int) -> bytes:
    return f"{epoch}:{seq}".encode()


@dataclass
class Pair:
    """The reference and the C-backed state, fed the same inputs."""

    ref: SourceState
    cand: SourceState
    inorder: InOrder
    applied: list[Applied] = field(default_factory=list)
    touched: bool = False  # the candidate's Python made an item for it in this poll
    taken_by_c: int = 0

    @classmethod
    def make(
        cls, policy: ReplayPolicy, has_replay: bool, resume: Checkpoint | None, catch_up: bool
    ) -> Pair:
        def state() -> SourceState:
            return SourceState(
                KEY, has_replay=has_replay, resume=resume, policy=policy, catch_up=catch_up
            )

        applied: list[Applied] = []
        cand = state()
        return cls(state(), cand, InOrder(cand, applied), applied)

    def python(self, ref_out: list[Any], cand_out: list[Any]) -> None:
        assert cand_out == ref_out
        if cand_out:
            self.touched = True

    def poll(self) -> None:
        """A poll's start: every item before is applied; C may be armed."""
        self.touched = False
        if not self.inorder.armed:
            self.inorder.arm(7)

    def live(self, seq: int, data: bytes, now: float) -> None:
        ref_out = self.ref.on_live(seq, data, now)
        if self.inorder.armed and not self.touched and self.inorder.offer(seq, data, now):
            self.taken_by_c += 1
            assert ref_out == [Deliver(seq, data, False)], "C took a batch Python would not deliver"
            return
        self.inorder.disarm()
        self.python(ref_out, self.cand.on_live(seq, data, now))

    def other(self, name: str, *args: Any) -> None:
        ref_out: list[Any] = getattr(self.ref, name)(*args)
        self.inorder.disarm()
        self.python(ref_out, getattr(self.cand, name)(*args))

    def compare(self) -> None:
        """Counters, status and checkpoint alike, whether or not C holds the latest."""
        assert self.inorder.checkpoint() == self.ref.checkpoint()
        assert self.cand.stats == self.ref.stats
        assert self.cand.status == self.ref.status
        assert self.cand.next_seq == self.ref.next_seq
        assert self.cand.next_deadline == self.ref.next_deadline

    def settle(self) -> None:
        self.inorder.disarm()
        self.compare()
        assert list(self.cand._digests.items()) == list(self.ref._digests.items())
        assert self.cand._replayed == self.ref._replayed
        assert self.cand.last_live == self.ref.last_live
        delivered_in_c = sum(a.batches for a in self.applied)
        assert delivered_in_c == self.taken_by_c


# One input: (kind, a, b). The publisher's model turns them into seqs and payloads.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("next"), st.integers(1, 12), st.just(0)),  # in-order batches
        st.tuples(st.just("drop"), st.integers(1, 3), st.just(0)),  # lost on the wire
        st.tuples(st.just("dup"), st.integers(0, 5), st.just(0)),  # an old one again
        st.tuples(st.just("restart"), st.just(0), st.just(0)),  # a new engine process
        st.tuples(st.just("poll"), st.just(0), st.just(0)),
        st.tuples(st.just("link"), st.booleans(), st.just(0)),
        st.tuples(st.just("reply"), st.integers(-1, 3), st.booleans()),  # offset, good
        st.tuples(st.just("reply_run"), st.integers(1, 8), st.booleans()),  # a whole answer
        st.tuples(st.just("end"), st.just(0), st.just(0)),
        st.tuples(st.just("error"), st.booleans(), st.just(0)),
        st.tuples(st.just("tick"), st.sampled_from([0.1, 0.6, 1.5, 3.0, 70.0]), st.just(0)),
    ),
    max_size=80,
)


class Publisher:
    def __init__(self, start: int) -> None:
        self.epoch, self.next = 0, start
        self.sent: dict[tuple[int, int], bytes] = {}

    def send(self) -> tuple[int, bytes]:
        seq = self.next
        self.next += 1
        data = payload(self.epoch, seq)
        self.sent[(self.epoch, seq)] = data
        return seq, data


def run(pair: Pair, pub: Publisher, ops: list[tuple[str, Any, Any]]) -> None:
    now = 0.0
    pair.other("start", now)
    pair.other("on_connection", True, now)
    pair.poll()
    for kind, a, b in ops:
        now += 0.01
        req = _current(pair.ref)  # the replay request running, if any (the same on both)
        if kind == "next":
            for _ in range(a):
                pair.live(*pub.send(), now)
        elif kind == "drop":
            pub.next += a
        elif kind == "dup":
            seq = max(0, pub.next - 1 - a)
            pair.live(seq, payload(pub.epoch, seq), now)
        elif kind == "restart":
            pub.epoch, pub.next = pub.epoch + 1, 0
        elif kind == "poll":
            pair.poll()
        elif kind == "link":
            pair.other("on_connection", a, now)
        elif kind in ("reply", "reply_run") and req is not None:
            count = a if kind == "reply_run" else 1
            first = req.start + (0 if kind == "reply_run" else a)
            for seq in range(first, first + count):
                if seq < 0 or seq >= pub.next:
                    pair.other("on_replay_end", req.req_id, now)
                    break
                data = payload(pub.epoch, seq) if b else b"forged"
                pair.other("on_replay_frame", req.req_id, seq, data, now)
                if _current(pair.ref) != req:
                    break
        elif kind == "end" and req is not None:
            pair.other("on_replay_end", req.req_id, now)
        elif kind == "error" and req is not None:
            pair.other("on_replay_error", req.req_id, "broken", now, a)
        elif kind == "tick":
            now += a
            pair.other("on_tick", now)
        pair.compare()
    pair.settle()


def _current(state: SourceState) -> StartReplay | None:
    r = state._replay
    return None if r is None else StartReplay(r.req_id, r.start)


@settings(max_examples=300, deadline=None)
@given(
    ops=OPS,
    has_replay=st.booleans(),
    catch_up=st.booleans(),
    resume_at=st.none() | st.integers(0, 6),
    kept=st.sampled_from([2, 5, 4096]),
)
def test_c_path_decides_as_the_reference(
    ops: list[tuple[str, Any, Any]],
    has_replay: bool,
    catch_up: bool,
    resume_at: int | None,
    kept: int,
) -> None:
    policy = ReplayPolicy(
        first_reply_timeout=0.5, idle_timeout=0.5, deadline=5.0, max_attempts=2, digests_kept=kept
    )
    pub = Publisher(resume_at or 0)
    resume = None
    if resume_at is not None:
        last = payload(0, resume_at - 1) if resume_at else None
        resume = Checkpoint(resume_at, None if last is None else payload_digest(last))
    pair = Pair.make(policy, has_replay, resume, catch_up)
    run(pair, pub, ops)


def test_long_in_order_run_goes_through_c_and_keeps_the_last_digests() -> None:
    """The ordinary case: everything after the first poll is C's, and what it hands back
    is what the reference kept (the bound on digests included)."""
    policy = ReplayPolicy(digests_kept=8)
    pair = Pair.make(policy, False, None, True)
    run(pair, Publisher(0), [("poll", 0, 0), ("next", 12, 0), ("next", 12, 0)])
    assert pair.taken_by_c == 24
    assert list(pair.cand._digests) == list(range(16, 24))


def test_gap_and_restarts_go_back_to_python() -> None:
    pair = Pair.make(ReplayPolicy(), False, None, True)
    ops: list[tuple[str, Any, Any]] = [
        ("poll", 0, 0),
        ("next", 3, 0),  # 0-2: C's
        ("drop", 1, 0),
        ("next", 1, 0),  # 4: a gap, Python's (3 is lost: no replay)
        ("poll", 0, 0),
        ("next", 2, 0),  # 5-6: C's
        ("dup", 1, 0),  # 5 again, at or below the last live seq: a restart (0-4 lost)
        ("poll", 0, 0),
        ("restart", 0, 0),
        ("next", 2, 0),  # 0-1 of a new stream: a restart again, Python's, and so is 1
        ("poll", 0, 0),  # (an item of this poll is not applied yet: C must not overtake)
        ("next", 2, 0),  # 2-3: C's
    ]
    run(pair, Publisher(0), ops)
    stats = pair.ref.stats
    assert (stats.gaps, stats.lost_batches, stats.publisher_restarts) == (2, 6, 2)
    assert pair.taken_by_c == 3 + 2 + 2
