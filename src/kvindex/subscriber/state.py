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

What a replay answers is checked, not trusted. Each reply must carry the seq that is due
(the one asked for, then each next one, in order, and never past the gap being filled); a
reply that is no reply, a batch that differs from the one the live stream brought, or an
answer still going past the request's deadline or byte budget ends the replay
(`ReplayRefused`). What it did not bring is `Lost`, and the endpoint is left alone for a
backoff that doubles with each failure in a row: meanwhile gaps are lost at once, so live
batches are never held back for a replay that won't come, and a broken endpoint can't make
us loop. A replayed batch that the live stream contradicts later drops the source's state
(`Discarded`). So `live` means: every seq since the last restart applied as published.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from kvindex.subscriber.messages import (
    Discarded,
    Gap,
    Lost,
    Notice,
    Replayed,
    ReplayRefused,
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
    deadline: float = 60.0  # for one whole request: an answer still going then is refused
    max_bytes: int = 2 << 30  # payload bytes one request may bring; past that, refused
    max_attempts: int = 3  # requests in a row that get no answer, before giving up
    # After a replay failed, no request to that endpoint for `backoff` seconds, doubling with
    # each failure in a row up to `max_backoff` (gaps meanwhile are lost at once).
    backoff: float = 1.0
    max_backoff: float = 60.0
    reply_queue: int = 1_000  # replies queued on the replay socket (its receive HWM)
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
    # `verify_seq` is a batch from before a link break or a resume: another batch there
    # means another engine process. Otherwise the live stream ran on meanwhile, and another
    # batch there means the replay endpoint does not serve that stream.
    anchored: bool
    attempt: int
    check: bool  # checks the stream after a reconnect: never cut short by live traffic
    probe: bool  # asks an idle stream for batches it may have missed: proves nothing
    deadline: float
    idle_deadline: float
    verified: bool = False
    frames: int = 0
    bytes: int = 0
    delivered: int = 0
    first_delivered: int = 0


_RESTART = "restart"  # `_behind`'s verdict for a batch of another engine process


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
        self._replayed: set[int] = set()  # kept digests that came from a replay, not live
        self._replayed_high: int | None = None  # the highest seq a replay delivered
        self._pending: dict[int, bytes] = {}
        self._replay: _Replay | None = None
        self._req_ids = 0
        self._failures = 0  # replay requests failed in a row
        self._backoff_until: float | None = None
        self._backoff_reason = ""
        self._ever_connected = False
        self._anchor: tuple[int, int] | None = None
        self._suspect = False
        self._unverified = False
        self._probe_at: float | None = None
        self._await_live = not catch_up and resume is None
        if resume is not None:
            self.next_seq = resume.next_seq
            if resume.next_seq > 0:
                self.stats.last_seq = resume.next_seq - 1
                if resume.last_digest is not None:
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

    # -- the in-order path done elsewhere (the C loop: subscriber/inorder.py) --------

    @property
    def plain(self) -> bool:
        """Whether a live batch with the seq due would simply be delivered: no replay
        running, nothing held, no reconnect check pending, not waiting for the first live
        batch. Only then may the in-order path run outside this class (`advanced`)."""
        return (
            self._replay is None
            and not self._suspect
            and not self._await_live
            and not self._pending
        )

    @property
    def last_live(self) -> int | None:
        return self._last_live

    def advanced(
        self,
        delivered: int,
        next_seq: int,
        last_live: int | None,
        traffic: float | None,
        digests: list[tuple[int, int]] | None = None,
    ) -> None:
        """`delivered` live batches, each the one due, were delivered elsewhere (in a plain
        state): what `on_live` would have done for each. `digests` (the last ones, in order):
        the (seq, digest) pairs to keep, as `_deliver` keeps them; None while the other
        side still holds them (taken later, before this state decides anything again)."""
        stats = self.stats
        stats.received += delivered
        stats.delivered += delivered
        if delivered:
            stats.last_seq = next_seq - 1
        self.next_seq = next_seq
        self._last_live = last_live
        if traffic is not None:
            self._arm_probe(traffic)
        if digests:
            self._keep_digests(digests)

    def _keep_digests(self, pairs: list[tuple[int, int]]) -> None:
        """`_deliver`'s bookkeeping for many batches at once: the oldest go past the bound."""
        digests, kept = self._digests, self.policy.digests_kept
        if len(pairs) >= kept:
            self._replayed.difference_update(digests)
            digests.clear()
            pairs = pairs[-kept:]
        else:
            for _ in range(len(digests) + len(pairs) - kept):
                oldest, _ = digests.popitem(last=False)
                self._replayed.discard(oldest)
        digests.update(pairs)

    # -- inputs ----------------------------------------------------------------------

    def start(self, now: float) -> list[Output]:
        """Catch up with what the publisher already holds (a late join, or a resume)."""
        out: list[Output] = []
        if self.has_replay and not self._await_live:
            resumed = self.next_seq > 0 and (self.next_seq - 1) in self._digests
            self._start_replay(now, out, attempt=1, anchored=resumed)
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
            # A live batch contradicting a replayed one is a lie only within one link: after
            # the break, it may be a new engine's (a restart, which the check tells).
            self._replayed.clear()
            self._replayed_high = None
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
            why = self._behind(seq, payload)
            if why is None:
                self._last_live = seq
                self.stats.duplicates += 1
                return out
            if why is _RESTART:
                self._restart(seq, out)
            else:
                self._discard(now, why, out)
        self._last_live = seq
        self._accept_live(seq, payload, now, out)
        return out

    def on_replay_frame(self, req_id: int, seq: int, payload: bytes, now: float) -> list[Output]:
        """One reply of replay request `req_id`: it must be the seq that is due (the one
        asked for, then each next one, in order, within the gap); anything else ends it."""
        out: list[Output] = []
        r = self._replay
        if r is None or r.req_id != req_id:
            return out
        r.frames += 1
        r.bytes += len(payload)
        r.idle_deadline = now + self.policy.idle_timeout
        if r.bytes > self.policy.max_bytes:
            budget = self.policy.max_bytes
            self._refuse(r, now, out, f"the replay went past its byte budget ({budget} bytes)")
            return out
        if r.verify_seq is not None and not r.verified:
            r.verified = True
            if seq == r.verify_seq:
                self._check_verified(r, seq, payload, now, out)
                return out
            if seq < r.verify_seq:
                self._refuse(r, now, out, f"asked for seq {r.verify_seq}, the replay sent {seq}")
                return out
            # The buffer no longer reaches back to the batch we know, so we can't tell a
            # long absence from an engine restart. Keep the state, report what is missing
            # (below), and say the stream is unverified when no seq is visibly missing.
            if r.anchored:
                self._mark_unverified(r.verify_seq, "the replay buffer no longer holds it", out)
        if seq < self.next_seq:
            self._refuse(r, now, out, f"the replay sent seq {seq} where {self.next_seq} was due")
            return out
        if seq > self.next_seq:
            if r.frames > 1:
                # Replies went missing in the middle (the ROUTER's send HWM dropped them).
                self._retry(r, now, out, "replay reply skipped seqs")
                return out
            if self._lose_hole(r, seq, now, out):
                return out
        held = self._pending.pop(seq, None)
        if held is not None and payload_digest(held) != payload_digest(payload):
            self._pending[seq] = held  # the live batch is the one published
            self._refuse(r, now, out, f"the replay's batch of seq {seq} differs from the live one")
            return out
        self._deliver(seq, payload, True, out)
        if not r.delivered:
            r.first_delivered = seq
        r.delivered += 1
        if self._pending and self.next_seq >= min(self._pending):
            self._finish_replay(r, out)
            self._succeeded()
            self._flush_pending(now, out)
        return out

    def on_replay_end(self, req_id: int, now: float) -> list[Output]:
        out: list[Output] = []
        r = self._replay
        if r is None or r.req_id != req_id:
            return out
        if r.verify_seq is not None and r.frames == 0:
            if r.anchored:
                # It holds nothing at or after a seq we already got from it: another stream.
                self._restart_during_replay(r, None, now, out, "replay holds nothing we had")
            else:
                why = f"the replay holds nothing from seq {r.verify_seq}, which it published"
                self._refuse(r, now, out, why)
            return out
        if self._pending and self.next_seq < min(self._pending):
            self._retry(r, now, out, "replay ended before the missing batches")
            return out
        self._finish_replay(r, out)
        self._succeeded()
        self._flush_pending(now, out)
        return out

    def on_replay_error(self, req_id: int, reason: str, now: float, refused: bool) -> list[Output]:
        """Replay request `req_id` can't go on: its endpoint sent something that is no reply
        (`refused`), or its socket could not be opened. It ends now; no retry."""
        out: list[Output] = []
        r = self._replay
        if r is not None and r.req_id == req_id:
            if refused:
                self._refuse(r, now, out, reason)
            else:
                self._finish_replay(r, out)
                self.stats.replay_failures += 1
                self._give_up(r, now, out, reason)
        return out

    def on_tick(self, now: float) -> list[Output]:
        out: list[Output] = []
        r = self._replay
        if r is not None:
            if now >= r.deadline:
                deadline = self.policy.deadline
                self._refuse(r, now, out, f"the replay was still answering after {deadline:g} s")
            elif now >= r.idle_deadline:
                self._retry(r, now, out, "replay request timed out")
        elif self._probe_at is not None and now >= self._probe_at and self.stats.connected:
            self._probe_at = None  # one probe per quiet spell; traffic re-arms it
            quiet = not self._suspect and not self._await_live
            if self.has_replay and quiet and self._may_replay(now):
                self._start_replay(now, out, attempt=self.policy.max_attempts, probe=True)
        return out

    def _arm_probe(self, now: float) -> None:
        if self.policy.idle_probe is not None:
            self._probe_at = now + self.policy.idle_probe

    # -- internals -------------------------------------------------------------------

    def _behind(self, seq: int, payload: bytes) -> str | None:
        """A live batch with a seq already delivered (and past the last live one): None if
        it is that very batch again, `_RESTART` if it is another engine's, else the reason
        why what a replay delivered can't stand."""
        known = self._digests.get(seq)
        if known is not None:
            if known == payload_digest(payload):
                self._replayed.discard(seq)  # confirmed live
                return None
            if seq in self._replayed:
                return f"the replay's batch of seq {seq} differs from the live one"
            return _RESTART
        high = self._replayed_high
        if high is not None and seq <= high and self.next_seq - seq > self.policy.digests_kept:
            # Its digest is gone because the replay delivered more than we keep since: no
            # publisher's replay runs that far ahead of its own live stream.
            return (
                f"the replay ran ahead of the live stream (delivered up to seq {high}, "
                f"and seq {seq} arrived live after it)"
            )
        if self._last_live is None and high is None:  # resumed past it: a new stream
            return _RESTART
        return None  # a late copy of a batch reported lost

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
        if not self._may_replay(now):
            if verify_seq is not None:
                self._mark_unverified(verify_seq, self._why_no_replay(), out)
            self._flush_pending(now, out)
            return
        self._start_replay(
            now, out, attempt=1, verify_seq=verify_seq, check=True, anchored=verify_seq is not None
        )

    def _check_verified(
        self, r: _Replay, seq: int, payload: bytes, now: float, out: list[Output]
    ) -> None:
        if payload_digest(payload) == self._digests.get(seq):
            return
        if r.anchored:
            self._restart_during_replay(r, seq, now, out)
        else:
            why = f"the replay's batch of seq {seq} differs from the one received live"
            self._refuse(r, now, out, why)

    def _lose_hole(self, r: _Replay, seq: int, now: float, out: list[Output]) -> bool:
        """The first reply is past the seq asked for: the publisher's buffer no longer holds
        the start. True if the reply is past the whole gap too (the replay is over)."""
        why = "the publisher's replay buffer no longer holds them"
        end = min(self._pending) if self._pending else None
        if end is not None and seq > end:
            self._lose(self.next_seq, end - 1, why, out)
            self._finish_replay(r, out)
            self._succeeded()
            self._flush_pending(now, out)
            return True
        self._lose(self.next_seq, seq - 1, why, out)
        return False

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
            if self.has_replay and self._may_replay(now):
                out.append(Gap(self.source, self.next_seq, seq - 1))
                self._hold(seq, payload)
                self._start_replay(now, out, attempt=1)
                return
            self._lose(self.next_seq, seq - 1, self._why_no_replay(), out)
            self._deliver(seq, payload, False, out)

    def _hold(self, seq: int, payload: bytes) -> None:
        # Past the bound, newer messages are let go: the next live one then shows a gap
        # and a replay fetches them again.
        if len(self._pending) < self.policy.max_pending:
            self._pending[seq] = payload

    def _deliver(self, seq: int, payload: bytes, replayed: bool, out: list[Output]) -> None:
        digests = self._digests
        digests[seq] = payload_digest(payload)
        if len(digests) > self.policy.digests_kept:
            oldest, _ = digests.popitem(last=False)
            self._replayed.discard(oldest)
        self.next_seq = seq + 1
        stats = self.stats
        stats.delivered += 1
        stats.last_seq = seq
        if replayed:
            stats.replayed_batches += 1
            self._replayed.add(seq)
            if self._replayed_high is None or seq > self._replayed_high:
                self._replayed_high = seq
        out.append(Deliver(seq, payload, replayed))

    def _lose(self, first: int, last: int, reason: str, out: list[Output]) -> None:
        if last < first:
            return
        count = last - first + 1
        self.stats.lost_batches += count
        self.stats.lost_since_restart += count
        self.next_seq = last + 1
        out.append(Lost(self.source, first, last, reason))

    def _flush_pending(self, now: float, out: list[Output]) -> None:
        """Deliver the live batches held while a replay ran, as far as they follow on; a
        hole among them is replayed (or lost, when no replay may be asked now)."""
        pending = self._pending
        for seq in sorted(s for s in pending if s < self.next_seq):
            why = self._behind(seq, pending.pop(seq))
            if why is not None and why is not _RESTART:
                self._discard(now, why, out)
                break
            self.stats.duplicates += 1
        while pending:
            while self.next_seq in pending:
                self._deliver(self.next_seq, pending.pop(self.next_seq), False, out)
            if not pending:
                return
            # A live message went missing while the replay ran.
            self.stats.gaps += 1
            first_held = min(pending)
            if self.has_replay and self._may_replay(now):
                out.append(Gap(self.source, self.next_seq, first_held - 1))
                self._start_replay(now, out, attempt=1)
                return
            self._lose(self.next_seq, first_held - 1, self._why_no_replay(), out)

    def _may_replay(self, now: float) -> bool:
        """False while the replay endpoint is left alone after a failure (see `_fail`)."""
        return self._backoff_until is None or now >= self._backoff_until

    def _why_no_replay(self) -> str:
        if not self.has_replay:
            return "no replay endpoint"
        return f"not asking the replay endpoint for a while after: {self._backoff_reason}"

    def _start_replay(
        self,
        now: float,
        out: list[Output],
        attempt: int,
        verify_seq: int | None = None,
        check: bool = False,
        probe: bool = False,
        anchored: bool = False,
    ) -> None:
        if verify_seq is None:
            verify = self.next_seq - 1
            verify_seq = verify if verify >= 0 and verify in self._digests else None
        self._req_ids += 1
        r = _Replay(
            req_id=self._req_ids,
            start=self.next_seq if verify_seq is None else verify_seq,
            verify_seq=verify_seq,
            anchored=anchored and verify_seq is not None,
            attempt=attempt,
            # A probe of an idle stream is a courtesy: it gives way to live traffic and
            # its failure proves nothing.
            check=check or (verify_seq is not None and not probe),
            probe=probe,
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
        """The request got nothing more in time, or its replies skipped seqs: ask again from
        where it stopped (at once after progress; a few times in all without), else give up.
        An endpoint that failed before gets one request, not `max_attempts`."""
        self._finish_replay(r, out)
        self.stats.replay_failures += 1
        attempt = 1 if r.delivered else r.attempt + 1
        attempts = self.policy.max_attempts if self._failures == 0 else 1
        if attempt <= attempts:
            verify = None if r.verified else r.verify_seq
            self._start_replay(
                now, out, attempt, verify, check=r.check, probe=r.probe, anchored=r.anchored
            )
            return
        self._give_up(r, now, out, reason)

    def _refuse(self, r: _Replay, now: float, out: list[Output], reason: str) -> None:
        """An answer that is not what was asked for: the replay ends here, and is not asked
        again before the backoff is over."""
        self._finish_replay(r, out)
        self.stats.replay_failures += 1
        self.stats.replay_refusals += 1
        out.append(ReplayRefused(self.source, reason, self._backoff_after(now, reason)))
        if r.delivered and not self._pending:
            # An answer with no live batch held to bound it: what it delivered may be
            # invented. If the live stream contradicts it, it goes (`_behind`).
            self._unverified = True
        self._give_up(r, now, out, reason, counted=True)

    def _give_up(
        self, r: _Replay, now: float, out: list[Output], reason: str, counted: bool = False
    ) -> None:
        """The replay brought what it brought: what is known missing is lost, the live
        batches held flow again, and the endpoint is left alone for a while."""
        if not counted:
            self._backoff_after(now, reason)
        if r.anchored and not r.verified and r.verify_seq is not None:
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

    def _backoff_after(self, now: float, reason: str) -> float:
        """A replay request failed: no other for a while, doubling with each failure in a
        row (a lying or broken endpoint can't make us loop, nor hold live batches back)."""
        self._failures += 1
        policy = self.policy
        backoff = min(policy.max_backoff, policy.backoff * float(2 ** min(self._failures - 1, 30)))
        self._backoff_until = now + backoff
        self._backoff_reason = reason
        return backoff

    def _succeeded(self) -> None:
        self._failures = 0
        self._backoff_until = None

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
        if self._may_replay(now):
            self._start_replay(now, out, attempt=1)

    def _reset(self, new_seq: int | None, out: list[Output], reason: str = "") -> None:
        last = self.next_seq - 1 if self.next_seq else None
        self.stats.publisher_restarts += 1
        self.stats.lost_since_restart = 0
        out.append(Restarted(self.source, last, new_seq, reason))
        self._forget_stream()
        self._last_live = None
        self._pending = {}
        self._unverified = False

    def _discard(self, now: float, reason: str, out: list[Output]) -> None:
        """What a replay delivered is contradicted by the live stream: drop the state (as
        for a restart, though the engine did not restart) and follow the live stream from
        here; the batches before it are lost, and the endpoint is left alone for a while."""
        if self._replay is not None:
            out.append(StopReplay(self._replay.req_id))
            self._replay = None
        self.stats.replay_refusals += 1
        self._backoff_after(now, reason)
        last = self.next_seq - 1 if self.next_seq else None
        out.append(Discarded(self.source, last, None, reason))
        self._forget_stream()
        self._unverified = False  # nothing a replay brought is left; the losses tell the rest

    def _forget_stream(self) -> None:
        self.next_seq = 0
        self._digests.clear()
        self._replayed.clear()
        self._replayed_high = None
        self._anchor = None
