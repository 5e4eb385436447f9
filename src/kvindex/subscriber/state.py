"""Sequencing of one publisher, without any I/O (so it can be tested exhaustively).

`SourceState` is fed what the sockets produced (live messages, replay replies, connection
changes, the passing of time) and answers with what to do: deliver a payload, tell the
user something (`Notice`), start or stop a replay request. The driver in `core.py` owns
the sockets and decodes delivered payloads.

The invariants it keeps:
- every seq is delivered at most once, in increasing order, and any seq it skips is
  reported as `Lost` (never silently);
- a publisher restart is reported (`Restarted`) before anything of the new stream;
- it never waits on a publisher without a deadline.

How a restart is recognised: a live seq at or below the last *live* seq seen (messages that
queued while a replay ran are above it, so they are not mistaken for one); and, when a
replay starts right after what was already delivered, by asking for the last delivered seq
again and comparing its payload checksum — a restarted publisher's buffer holds other
batches under the same seqs, or none at all.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from kvindex.subscriber.messages import (
    Gap,
    Lost,
    Notice,
    Replayed,
    Restarted,
    SourceKey,
    SourceStats,
    Status,
    Unverified,
)

__all__ = [
    "Checkpoint",
    "Deliver",
    "ReplayPolicy",
    "SourceState",
    "StartReplay",
    "StopReplay",
    "payload_digest",
]


def payload_digest(payload: bytes) -> int:
    """A checksum of a payload, stable across processes (it is persisted in checkpoints)."""
    return zlib.crc32(payload)


class Checkpoint(NamedTuple):
    """Where a consumer stopped: the next seq it needs, and the digest of the one before."""

    next_seq: int
    last_digest: int | None = None
    lost_since_restart: int = 0  # so a resumed source stays `incomplete` if it was


class Deliver(NamedTuple):
    seq: int
    payload: bytes
    replayed: bool


class StartReplay(NamedTuple):
    req_id: int
    start: int


class StopReplay(NamedTuple):
    req_id: int


Output = Deliver | Notice | StartReplay | StopReplay


@dataclass(frozen=True, slots=True)
class ReplayPolicy:
    first_reply_timeout: float = 2.0  # for the publisher to start answering
    idle_timeout: float = 1.0  # between two replies
    deadline: float = 60.0  # for one whole request
    max_attempts: int = 3  # consecutive requests that recover nothing
    # After this long without traffic, ask the replay whether batches were published that
    # never arrived (a dropped last batch is otherwise invisible until the next one).
    idle_probe: float | None = 2.0
    max_pending: int = 200_000  # live messages held while a replay runs
    digests_kept: int = 4096  # recent (seq, digest) pairs for duplicate/restart checks


@dataclass(slots=True)
class _Replay:
    req_id: int
    start: int
    verify_seq: int | None
    attempt: int
    check: bool  # checks the stream after a reconnect: never cut short by live traffic
    deadline: float
    idle_deadline: float
    verified: bool = False
    frames: int = 0
    delivered: int = 0
    first_delivered: int = 0


class SourceState:
    """The sequencing state of one publisher (one instance's DP rank)."""

    def __init__(
        self,
        source: SourceKey,
        *,
        has_replay: bool,
        resume: Checkpoint | None = None,
        policy: ReplayPolicy | None = None,
        catch_up: bool = True,
    ) -> None:
        """`catch_up=False` (and no `resume`): start at the first batch that arrives live
        rather than with what the publisher's replay buffer already holds; the replay
        still fills gaps from there on."""
        self.source = source
        self.has_replay = has_replay
        self.policy = policy or ReplayPolicy()
        self.stats = SourceStats()
        self.next_seq = 0
        self._last_live: int | None = None
        self._digests: OrderedDict[int, int] = OrderedDict()
        self._pending: dict[int, bytes] = {}
        self._replay: _Replay | None = None
        self._req_ids = 0
        self._ever_connected = False
        self._anchor: tuple[int, int] | None = None
        self._suspect = False
        self._unverified = False
        self._probe_at: float | None = None
        self._await_live = not catch_up and resume is None
        if resume is not None:
            self.next_seq = resume.next_seq
            if resume.last_digest is not None and resume.next_seq > 0:
                self._digests[resume.next_seq - 1] = resume.last_digest
            self.stats.lost_since_restart = resume.lost_since_restart

    # -- what the driver reads -------------------------------------------------------

    @property
    def replaying(self) -> bool:
        return self._replay is not None

    @property
    def replay_deadline(self) -> float | None:
        r = self._replay
        return None if r is None else min(r.deadline, r.idle_deadline)

    @property
    def next_deadline(self) -> float | None:
        """When `on_tick` next has something to do."""
        if self._replay is not None:
            return self.replay_deadline
        if self._probe_at is not None and self.stats.connected:
            return self._probe_at
        return None

    @property
    def status(self) -> Status:
        if self._ever_connected and not self.stats.connected:
            return Status.DOWN
        if self._replay is not None:
            return Status.REPLAYING
        if self.stats.lost_since_restart or self._unverified:
            return Status.INCOMPLETE
        if self.stats.connected or self.stats.received:
            return Status.LIVE
        return Status.CONNECTING

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(
            self.next_seq, self._digests.get(self.next_seq - 1), self.stats.lost_since_restart
        )

    # -- inputs ----------------------------------------------------------------------

    def start(self, now: float) -> list[Output]:
        """Catch up with what the publisher already holds (a late join, or a resume)."""
        out: list[Output] = []
        if self.has_replay and not self._await_live:
            self._start_replay(now, out, attempt=1)
        return out

    def on_connection(self, connected: bool, now: float) -> list[Output]:
        out: list[Output] = []
        was_connected = self.stats.connected
        self.stats.connected = connected
        if not connected and was_connected:
            # Remember where the old link ended: after a reconnect, the publisher must still
            # hold that very batch, or it is a new process (an engine restart). Until that is
            # checked, nothing more is delivered, and answers the old process may still send
            # to a running replay are not wanted.
            last = self.next_seq - 1
            digest = self._digests.get(last)
            self._anchor = (last, digest) if digest is not None else None
            self._suspect = True
            self._pending = {}  # the check's replay fetches them again, from the right process
            if self._replay is not None:
                out.append(StopReplay(self._replay.req_id))
                self._replay = None
        elif connected and not was_connected and self._ever_connected:
            self._check_anchor(now, out)
        if connected:
            self._arm_probe(now)
        self._ever_connected |= connected
        return out

    def on_live(self, seq: int, payload: bytes, now: float) -> list[Output]:
        out: list[Output] = []
        self.stats.received += 1
        self._arm_probe(now)
        if self._await_live:  # the stream starts here for us: nothing before it is missing
            self._await_live = False
            self.next_seq = seq
        if self._last_live is not None and seq <= self._last_live:
            self._restart(seq, out)
        elif seq < self.next_seq:
            known = self._digests.get(seq)
            if (known is None and self._last_live is None) or (
                known is not None and known != payload_digest(payload)
            ):
                self._restart(seq, out)
            else:
                self._last_live = seq
                self.stats.duplicates += 1
                return out
        self._last_live = seq
        self._accept_live(seq, payload, now, out)
        return out

    def on_replay_frame(self, req_id: int, seq: int, payload: bytes, now: float) -> list[Output]:
        out: list[Output] = []
        r = self._replay
        if r is None or r.req_id != req_id or seq < r.start:
            return out
        r.frames += 1
        r.idle_deadline = now + self.policy.idle_timeout
        if r.verify_seq is not None and not r.verified:
            r.verified = True
            if seq == r.verify_seq:
                if payload_digest(payload) != self._digests.get(seq):
                    self._restart_during_replay(r, seq, now, out)
                return out
            # The buffer no longer reaches back to the batch we know, so we can't tell a
            # long absence from an engine restart. Keep the state, report what is missing
            # (below), and say the stream is unverified when no seq is visibly missing.
            if seq == self.next_seq:
                self._mark_unverified(r.verify_seq, "the replay buffer no longer holds it", out)
        if seq < self.next_seq:
            known = self._digests.get(seq)
            if known is not None and known != payload_digest(payload):
                self._restart_during_replay(r, seq, now, out)
            return out
        if seq > self.next_seq:
            if r.delivered:
                # Replies went missing in the middle (the ROUTER's send HWM dropped them).
                self._retry(r, now, out, "replay reply skipped seqs")
                return out
            self._lose(
                self.next_seq, seq - 1, "the publisher's replay buffer no longer holds them", out
            )
        self._deliver(seq, payload, True, out)
        if not r.delivered:
            r.first_delivered = seq
        r.delivered += 1
        self._pending.pop(seq, None)
        if self._pending and self.next_seq >= min(self._pending):
            self._finish_replay(r, out)
            self._flush_pending(now, out)
        return out

    def on_replay_end(self, req_id: int, now: float) -> list[Output]:
        out: list[Output] = []
        r = self._replay
        if r is None or r.req_id != req_id:
            return out
        if r.verify_seq is not None and r.frames == 0:
            # It holds nothing at or after a seq we already got from it: another stream.
            self._restart_during_replay(r, None, now, out, "replay holds nothing we had")
            return out
        if self._pending and self.next_seq < min(self._pending):
            self._retry(r, now, out, "replay ended before the missing batches")
            return out
        self._finish_replay(r, out)
        self._flush_pending(now, out)
        return out

    def on_tick(self, now: float) -> list[Output]:
        out: list[Output] = []
        r = self._replay
        if r is not None:
            if now >= min(r.deadline, r.idle_deadline):
                self._retry(r, now, out, "replay request timed out")
        elif self._probe_at is not None and now >= self._probe_at and self.stats.connected:
            self._probe_at = None  # one probe per quiet spell; traffic re-arms it
            if self.has_replay and not self._suspect and not self._await_live:
                self._start_replay(now, out, attempt=self.policy.max_attempts, probe=True)
        return out

    def _arm_probe(self, now: float) -> None:
        if self.policy.idle_probe is not None:
            self._probe_at = now + self.policy.idle_probe

    # -- internals -------------------------------------------------------------------

    def _check_anchor(self, now: float, out: list[Output]) -> None:
        anchor, self._anchor = self._anchor, None
        self._suspect = False
        if not self.has_replay or self._await_live:
            self._flush_pending(now, out)
            return
        verify_seq = None
        if anchor is not None:
            verify_seq, digest = anchor
            self._digests[verify_seq] = digest  # may have been pruned meanwhile
        self._start_replay(now, out, attempt=1, verify_seq=verify_seq, check=True)

    def _accept_live(self, seq: int, payload: bytes, now: float, out: list[Output]) -> None:
        r = self._replay
        if r is not None and seq == self.next_seq and not r.check and not self._pending:
            # A catch-up replay is moot once the very next batch arrives live.
            self._finish_replay(r, out)
        if self._replay is not None or self._suspect:
            self._hold(seq, payload)
        elif seq == self.next_seq:
            self._deliver(seq, payload, False, out)
        elif seq > self.next_seq:
            self.stats.gaps += 1
            if not self.has_replay:
                self._lose(self.next_seq, seq - 1, "no replay endpoint", out)
                self._deliver(seq, payload, False, out)
                return
            out.append(Gap(self.source, self.next_seq, seq - 1))
            self._hold(seq, payload)
            self._start_replay(now, out, attempt=1)

    def _hold(self, seq: int, payload: bytes) -> None:
        # Past the bound, newer messages are let go: the next live one then shows a gap
        # and a replay fetches them again.
        if len(self._pending) < self.policy.max_pending:
            self._pending[seq] = payload

    def _deliver(self, seq: int, payload: bytes, replayed: bool, out: list[Output]) -> None:
        digests = self._digests
        digests[seq] = payload_digest(payload)
        if len(digests) > self.policy.digests_kept:
            digests.popitem(last=False)
        self.next_seq = seq + 1
        stats = self.stats
        stats.delivered += 1
        stats.last_seq = seq
        if replayed:
            stats.replayed_batches += 1
        out.append(Deliver(seq, payload, replayed))

    def _lose(self, first: int, last: int, reason: str, out: list[Output]) -> None:
        count = last - first + 1
        self.stats.lost_batches += count
        self.stats.lost_since_restart += count
        self.next_seq = last + 1
        out.append(Lost(self.source, first, last, reason))

    def _flush_pending(self, now: float, out: list[Output]) -> None:
        pending = self._pending
        for seq in [s for s in pending if s < self.next_seq]:
            del pending[seq]
            self.stats.duplicates += 1
        while self.next_seq in pending:
            self._deliver(self.next_seq, pending.pop(self.next_seq), False, out)
        if pending:  # a live message went missing while the replay ran
            self.stats.gaps += 1
            out.append(Gap(self.source, self.next_seq, min(pending) - 1))
            self._start_replay(now, out, attempt=1)

    def _start_replay(
        self,
        now: float,
        out: list[Output],
        attempt: int,
        verify_seq: int | None = None,
        check: bool = False,
        probe: bool = False,
    ) -> None:
        if verify_seq is None:
            verify = self.next_seq - 1
            verify_seq = verify if verify >= 0 and verify in self._digests else None
        self._req_ids += 1
        r = _Replay(
            req_id=self._req_ids,
            start=self.next_seq if verify_seq is None else verify_seq,
            verify_seq=verify_seq,
            attempt=attempt,
            # A probe of an idle stream is a courtesy: it gives way to live traffic and
            # its failure proves nothing.
            check=check or (verify_seq is not None and not probe),
            deadline=now + self.policy.deadline,
            idle_deadline=now + self.policy.first_reply_timeout,
        )
        self._replay = r
        self.stats.replay_requests += 1
        out.append(StartReplay(r.req_id, r.start))

    def _finish_replay(self, r: _Replay, out: list[Output]) -> None:
        out.append(StopReplay(r.req_id))
        self._replay = None
        if r.delivered:
            out.append(Replayed(self.source, r.first_delivered, r.delivered))

    def _retry(self, r: _Replay, now: float, out: list[Output], reason: str) -> None:
        self._finish_replay(r, out)
        self.stats.replay_failures += 1
        attempt = 1 if r.delivered else r.attempt + 1
        if attempt <= self.policy.max_attempts:
            verify = None if r.verified else r.verify_seq
            self._start_replay(now, out, attempt, verify, check=r.check)
            return
        if r.check and r.verify_seq is not None and not r.verified:
            # After a reconnect the publisher never let us check it is the same process:
            # what follows may belong to a new stream, so the state can't be called exact.
            self._mark_unverified(r.verify_seq, reason, out)
        if self._pending:
            first_held = min(self._pending)
            if first_held > self.next_seq:
                self._lose(self.next_seq, first_held - 1, reason, out)
            self._flush_pending(now, out)
        # With nothing pending, nothing is known to be missing: the publisher may simply be
        # down. Its next live message (or reconnection) resumes the catch-up.

    def _mark_unverified(self, anchor: int, reason: str, out: list[Output]) -> None:
        self.stats.unverified_reconnects += 1
        self._unverified = True
        out.append(Unverified(self.source, anchor, reason))

    def _restart(self, seq: int, out: list[Output]) -> None:
        if self._replay is not None:
            out.append(StopReplay(self._replay.req_id))
            self._replay = None
        self._reset(seq, out)

    def _restart_during_replay(
        self, r: _Replay, seq: int | None, now: float, out: list[Output], reason: str = ""
    ) -> None:
        out.append(StopReplay(r.req_id))
        self._replay = None
        # Live messages held so far may be of either stream: let them go; the replay from 0
        # fetches the new stream's from its buffer, and later ones arrive live.
        self._reset(seq, out, reason)
        self._start_replay(now, out, attempt=1)

    def _reset(self, new_seq: int | None, out: list[Output], reason: str = "") -> None:
        last = self.next_seq - 1 if self.next_seq else None
        self.stats.publisher_restarts += 1
        self.stats.lost_since_restart = 0
        out.append(Restarted(self.source, last, new_seq, reason))
        self.next_seq = 0
        self._last_live = None
        self._digests.clear()
        self._pending = {}
        self._anchor = None
        self._unverified = False
