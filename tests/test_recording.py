"""Recording files, `kvindex record` and `kvindex replay` on real sockets (loopback).

The central check: a stream recorded from publishers, replayed by `kvindex replay` and
recorded again gives the same batches (payload bytes, seqs, per-source order, restarts).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from clitools import Proc, kvindex
from netutil import free_ports

from kvindex.recording import (
    BatchRec,
    NoticeRec,
    RecordedBatch,
    RecordingError,
    Writer,
    checkpoints,
    read,
    records,
)
from kvindex.recording.format import SEGMENT_HEAD
from kvindex.recording.reader import Reader
from kvindex.recording.replay import Target, open_publishers, plan, replay, serve_specs
from kvindex.subscriber import Delivery, Restarted, SourceKey, Subscriber
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher, encode_batch

pytestmark = pytest.mark.timeout(45)

A = SourceKey("a")


def payload(i: int, rank: int = 0, ts: float | None = None) -> bytes:
    """Batch i; its time is 1e9 + i seconds unless given (replay paces by it)."""
    events = [BlockStored([i], None, list(range(i, i + 16)), 16)]
    return encode_batch(events, 1e9 + i if ts is None else ts, rank)


def write_batches(path: Path, n: int, **kw: int) -> list[int]:
    """n batches of source A; returns the file offsets after each flushed segment."""
    ends = []
    with Writer(path, segment_bytes=kw.get("segment_bytes", 300)) as w:
        for i in range(n):
            w.batch(A, i, payload(i), received=1000.0 + i)
            if w.size and (not ends or ends[-1] != w.size):
                ends.append(w.size)
    return ends


def seqs_in(path: Path) -> list[int]:
    return [r.seq for r in records(path) if isinstance(r, BatchRec)]


# -- the file ---------------------------------------------------------------------------


def test_read_gives_deliveries_with_payload_and_receive_time(tmp_path: Path) -> None:
    path = tmp_path / "r.kvr"
    with Writer(path) as w:
        w.batch(A, 0, payload(0), received=5.0)
        w.notice(Restarted(A, 0, 0, "seq went back"), received=6.0)
        w.batch(A, 0, payload(7), received=7.0, replayed=True)
    items = list(read(path))
    first, restart, second = items
    assert isinstance(first, RecordedBatch) and isinstance(first, Delivery)
    assert (first.seq, first.payload, first.received) == (0, payload(0), 5.0)
    assert first.batch.events == [BlockStored([0], None, list(range(16)), 16)]
    assert restart == Restarted(A, 0, 0, "seq went back")
    assert isinstance(second, RecordedBatch) and second.replayed and second.payload == payload(7)
    assert list(read(path, notices=False)) == [first, second]


def test_cut_anywhere_reads_up_to_the_last_whole_segment(tmp_path: Path) -> None:
    path = tmp_path / "r.kvr"
    ends = write_batches(path, 60)
    data = path.read_bytes()
    assert len(ends) >= 5  # small segments: several of them
    cut = tmp_path / "cut.kvr"
    for offset in range(ends[1] - 3, len(data), 7):  # mid-head, mid-frame, on boundaries
        cut.write_bytes(data[:offset])
        whole = [e for e in ends if e <= offset]
        reader = Reader(cut)
        got = [r.seq for r in reader if isinstance(r, BatchRec)]
        assert reader.end == whole[-1]
        assert reader.truncated == (offset != whole[-1])
        assert got == list(range(len(got)))  # a prefix, in order
        full = Reader(path)
        expect = [r.seq for r in full if isinstance(r, BatchRec)]
        assert got == expect[: len(got)]


def test_appending_to_a_cut_file_drops_the_partial_segment_and_continues(tmp_path: Path) -> None:
    path = tmp_path / "r.kvr"
    ends = write_batches(path, 40)
    data = path.read_bytes()
    path.write_bytes(data[: ends[2] + SEGMENT_HEAD.size + 5])  # killed mid-segment
    kept = seqs_in(path)
    assert checkpoints(path)[A].next_seq == kept[-1] + 1
    with Writer(path) as w:
        assert w.checkpoints[A].next_seq == kept[-1] + 1
        w.batch(A, 100, payload(100))
    assert seqs_in(path) == [*kept, 100]
    assert not Reader(path).truncated and sum(1 for _ in Reader(path)) > 0


def test_damaged_files_are_refused_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "r.kvr"
    ends = write_batches(path, 40)
    data = bytearray(path.read_bytes())
    data[ends[0] + SEGMENT_HEAD.size + 3] ^= 0xFF  # a flipped bit in the second segment
    path.write_bytes(bytes(data))
    reader = Reader(path)
    assert len(list(reader)) > 0 and reader.damage and "checksum" in reader.damage
    with pytest.raises(RecordingError, match="damaged"):
        Writer(path)
    other = tmp_path / "other.txt"
    other.write_bytes(b"hello, not a recording\n")
    with pytest.raises(RecordingError, match="not a kvindex recording"):
        list(read(other))
    with pytest.raises(RecordingError, match="not a kvindex recording"):
        Writer(other)
    assert other.read_bytes() == b"hello, not a recording\n"


def test_subscriber_keep_payload_hands_out_the_raw_bytes() -> None:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        pub.publish_payload(payload(3))
        for keep in (True, False):
            with Subscriber(pub.endpoint, pub.replay_endpoint, keep_payload=keep) as sub:
                deadline = time.monotonic() + 10
                got: list[Delivery] = []
                while not got and time.monotonic() < deadline:
                    got = [i for i in sub.poll(0.05) if isinstance(i, Delivery)]
            assert got and got[0].payload == (payload(3) if keep else None)


def test_replay_plan_puts_ranks_of_an_instance_on_consecutive_ports() -> None:
    sources = [SourceKey("a"), SourceKey("b", 0), SourceKey("b", 1), SourceKey("c")]
    targets = plan(sources, "tcp://127.0.0.1:6000", "tcp://127.0.0.1:7000")
    assert [t.endpoint[-4:] for t in targets] == ["6000", "6001", "6002", "6003"]
    assert serve_specs(targets) == [
        "a=tcp://127.0.0.1:6000,replay=tcp://127.0.0.1:7000",
        "b=tcp://127.0.0.1:6001,replay=tcp://127.0.0.1:7001,dp=2",
        "c=tcp://127.0.0.1:6003,replay=tcp://127.0.0.1:7003",
    ]
    with pytest.raises(ValueError, match="no endpoint"):
        plan(sources)


# -- the commands -----------------------------------------------------------------------


def instance_flags(pub_base: int, rep_base: int) -> list[str]:
    """`a` (one rank) and `b` (two DP ranks) on consecutive ports from the bases."""
    return [
        f"--instance=a=tcp://127.0.0.1:{pub_base},replay=tcp://127.0.0.1:{rep_base}",
        f"--instance=b=tcp://127.0.0.1:{pub_base + 1},replay=tcp://127.0.0.1:{rep_base + 1},dp=2",
    ]


class Fleet:
    """Instance `a` (one rank) and `b` (two DP ranks) on consecutive loopback ports."""

    def __init__(self) -> None:
        self.pub_base, self.rep_base = free_ports(3), free_ports(3)
        self.drop = {4, 5}
        self.a = self._pub(0, drop=True)
        self.b = [self._pub(1), self._pub(2)]

    def _pub(self, i: int, drop: bool = False) -> Publisher:
        return Publisher(
            f"tcp://127.0.0.1:{self.pub_base + i}",
            f"tcp://127.0.0.1:{self.rep_base + i}",
            drop=(lambda seq: seq in self.drop) if drop else None,
        )

    def specs(self) -> list[str]:
        return instance_flags(self.pub_base, self.rep_base)

    def run_workload(self) -> int:
        """Publish with a gap (seqs 4, 5 of `a` dropped live) and a restart of `a`."""
        n = 0
        for i in range(12):
            self.a.publish_payload(payload(i, ts=time.time()))
            for rank, pub in enumerate(self.b):
                pub.publish_payload(payload(100 + i, rank, ts=time.time()))
            n += 3
            time.sleep(0.005)
        time.sleep(0.4)
        self.drop = set()
        self.a.restart()
        for i in range(6):
            self.a.publish_payload(payload(50 + i, ts=time.time()))
            n += 1
            time.sleep(0.005)
        return n

    def close(self) -> None:
        for pub in (self.a, *self.b):
            pub.close()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    yield f
    f.close()


def wait_connected(proc: Proc, n: int) -> None:
    deadline = time.monotonic() + 10
    while sum(line.endswith(": connected") for line in proc.err) < n:
        assert time.monotonic() < deadline, proc.err
        time.sleep(0.02)
    time.sleep(0.3)  # connected, and a moment later subscribed


def per_source(path: Path) -> dict[SourceKey, list[tuple[object, ...]]]:
    """What must survive a replay: each source's batches (seq, payload) and restarts."""
    out: dict[SourceKey, list[tuple[object, ...]]] = {}
    for rec in records(path):
        if isinstance(rec, BatchRec):
            out.setdefault(SourceKey(rec.instance, rec.rank), []).append((rec.seq, rec.payload))
        elif isinstance(rec, NoticeRec) and rec.kind in ("Restarted", "Lost"):
            out.setdefault(SourceKey(rec.instance, rec.rank), []).append((rec.kind,))
    return out


def test_record_replay_record_gives_identical_batches(fleet: Fleet, tmp_path: Path) -> None:
    first, second = tmp_path / "first.kvr", tmp_path / "second.kvr"
    rec = kvindex("record", *fleet.specs(), "--out", str(first), "--max-batches", "42")
    wait_connected(rec, 3)
    total = fleet.run_workload()
    assert total == 42
    assert rec.finish(20) == 0, rec.err
    recorded = per_source(first)
    a_batches = [e for e in recorded[A] if len(e) == 2]
    assert [s for s, _ in a_batches] == [*range(12), *range(6)]  # gap filled, restart kept
    assert ("Restarted",) in recorded[A]
    kinds = [r.kind for r in records(first) if isinstance(r, NoticeRec) and r.instance == "a"]
    assert "Gap" in kinds and "Replayed" in kinds  # seqs 4, 5 came from the replay buffer
    assert [s for s, _ in recorded[SourceKey("b", 1)]] == list(range(12))

    flags = instance_flags(free_ports(3), free_ports(3))
    play = kvindex("replay", str(first), *flags, "--speed", "2", "--wait", "3", "--hold", "10")
    try:
        play.wait_for(play.out, lambda line: line.startswith("follow it with: kvindex serve"))
        rec2 = kvindex(
            "record", *flags, "--out", str(second), "--max-batches", "42", "--from", "oldest"
        )
        assert rec2.finish(25) == 0, (rec2.err, play.out, play.err)
    finally:
        play.interrupt(signal.SIGTERM)
        assert play.finish(10) == 0, play.err
    assert per_source(second) == recorded
    serve_line = f"follow it with: kvindex serve {flags[0].replace('=', ' ', 1)} "
    assert any(line.startswith(serve_line) for line in play.out), play.out


def test_sigterm_flushes_and_exits_0(fleet: Fleet, tmp_path: Path) -> None:
    path = tmp_path / "r.kvr"
    rec = kvindex("record", *fleet.specs(), "--out", str(path), "--flush-interval", "60")
    wait_connected(rec, 3)
    for i in range(5):
        fleet.b[0].publish_payload(payload(i))
    time.sleep(0.5)
    rec.interrupt(signal.SIGTERM)
    assert rec.finish(10) == 0, rec.err
    assert [s for s, _ in per_source(path)[SourceKey("b")]] == list(range(5))
    assert any(line.startswith("recorded 5 batches") for line in rec.err)


def test_a_second_recording_continues_the_file_without_a_gap(fleet: Fleet, tmp_path: Path) -> None:
    path = tmp_path / "r.kvr"
    fleet.drop = set()
    for i in range(4):
        fleet.a.publish_payload(payload(i))
    rec = kvindex(
        "record", *fleet.specs()[:1], "--out", str(path), "--max-batches", "4", "--from", "oldest"
    )
    assert rec.finish(15) == 0, rec.err
    for i in range(4, 9):  # published while nobody records
        fleet.a.publish_payload(payload(i))
    rec = kvindex("record", *fleet.specs()[:1], "--out", str(path), "--max-batches", "5")
    assert rec.finish(15) == 0, rec.err
    assert any("continuing 1 recorded sources" in line for line in rec.err)
    assert seqs_in(path) == list(range(9))
    assert sum(isinstance(r, NoticeRec) and r.kind == "Lost" for r in records(path)) == 0


def test_usage_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    rec = kvindex("record", "--out", str(tmp_path / "x.kvr"))
    assert rec.finish(10) == 2
    assert rec.err == [
        "kvindex record: error: nothing to record: give an ENDPOINT or --instance SPEC"
    ]
    junk = tmp_path / "junk"
    junk.write_bytes(b"junk")
    play = kvindex("replay", str(junk), "--pub", "tcp://127.0.0.1:1")
    assert play.finish(10) == 2
    assert play.err == [f"kvindex replay: error: {junk} is not a kvindex recording"]
    assert not os.path.exists(tmp_path / "x.kvr")


# -- where a recording starts, and its progress --------------------------------------------


@pytest.mark.parametrize(("start", "first"), [("now", 10), ("oldest", 0)])
def test_record_from_now_or_oldest(fleet: Fleet, tmp_path: Path, start: str, first: int) -> None:
    fleet.drop = set()
    for i in range(10):  # in the replay buffer before the recording starts
        fleet.a.publish_payload(payload(i))
    path = tmp_path / "r.kvr"
    wanted = str(13 - first)
    rec = kvindex(
        "record", *fleet.specs()[:1], "--out", str(path), "--from", start, "--max-batches", wanted
    )  # fmt: skip
    wait_connected(rec, 1)
    time.sleep(0.3)  # a catch-up (--from oldest) is under way or done
    for i in range(10, 13):
        fleet.a.publish_payload(payload(i))
    assert rec.finish(15) == 0, rec.err
    assert seqs_in(path) == list(range(first, 13))
    assert not [r for r in records(path) if isinstance(r, NoticeRec) and r.kind == "Lost"]


def test_record_from_now_still_fills_gaps_after_its_start() -> None:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        for i in range(10):
            pub.publish_payload(payload(i))
        with Subscriber(pub.endpoint, replay=pub.replay_endpoint, catch_up=False) as sub:
            deadline = time.monotonic() + 10
            got: list[int] = []
            while not got:  # until the subscription is through: that batch is the start
                assert time.monotonic() < deadline
                pub.publish_payload(payload(pub.next_seq))
                got += [d.seq for d in sub.poll(0.05) if isinstance(d, Delivery)]
            # The loop may have sent more than the first batch it saw: go on after them.
            start, base = got[0], pub.next_seq
            pub.publish_payload(payload(base))
            pub.drop = lambda seq: seq == base + 1  # lost on the wire, kept for replay
            pub.publish_payload(payload(base + 1))
            pub.drop = None
            pub.publish_payload(payload(base + 2))
            end = base + 3
            while len(got) < end - start and time.monotonic() < deadline:
                got += [d.seq for d in sub.poll(0.05) if isinstance(d, Delivery)]
            assert start >= 10 and got == list(range(start, end))
            assert sub.stats(SourceKey("vllm")).lost_batches == 0


def test_record_prints_progress(fleet: Fleet, tmp_path: Path) -> None:
    rec = kvindex(
        "record", *fleet.specs()[:1], "--out", str(tmp_path / "r.kvr"),
        "--duration", "2", "--progress", "0.5",
    )  # fmt: skip
    assert rec.finish(15) == 0, rec.err
    progress = [line for line in rec.err if line.startswith("recording: ")]
    assert len(progress) >= 2, rec.err
    assert re.fullmatch(
        r"recording: \d+ batches in \d+ of 2 s \([\d.]+/s\), [\d,]+ bytes written", progress[0]
    )


# -- replay: pace, progress, where and why it stopped ---------------------------------------


def recording_of(path: Path, times: list[tuple[float, float]]) -> None:
    """One batch of source A per (engine time, receive time)."""
    with Writer(path, segment_bytes=300) as w:
        w.session(["a=tcp://127.0.0.1:1"])
        for seq, (ts, received) in enumerate(times):
            w.batch(A, seq, payload(seq, ts=ts), received=received)


def replay_taking(path: Path, speed: float) -> float:
    pubs = open_publishers([Target(A, "tcp://127.0.0.1:*")])
    try:
        return replay(str(path), pubs, speed=speed).elapsed
    finally:
        for pub in pubs.values():
            pub.close()


def test_replay_paces_by_the_batches_own_times_not_receive_times(tmp_path: Path) -> None:
    caught_up = tmp_path / "caught_up.kvr"  # published over 2 s, received at once (a catch-up)
    recording_of(caught_up, [(1e9 + i * 0.1, 5e9) for i in range(21)])
    assert replay_taking(caught_up, speed=2.0) >= 0.9  # 2 s of engine time at 2x
    bunched = tmp_path / "bunched.kvr"  # published at once, received over 20 s
    recording_of(bunched, [(1e9, 5e9 + i) for i in range(21)])
    assert replay_taking(bunched, speed=1.0) < 0.9


def test_replay_of_a_damaged_file_says_where_it_stopped_and_fails(tmp_path: Path) -> None:
    path = tmp_path / "r.kvr"
    recording_of(path, [(1e9 + i * 0.001, 1e9) for i in range(60)])
    data = bytearray(path.read_bytes())
    cut_at = len(data) // 2
    data[cut_at] ^= 0xFF
    path.write_bytes(bytes(data))
    readable = seqs_in(path)
    assert 0 < len(readable) < 60
    proc = kvindex("replay", str(path), "--pub", f"tcp://127.0.0.1:{free_ports(1)}", "--wait", "0")
    assert proc.finish(20) == 1
    assert re.fullmatch(
        rf"replay stopped at batch {len(readable)} \(a seq {readable[-1]}\) after [\d.]+ s: "
        r"the file is damaged: segment at offset \d+ fails its checksum; the rest can't be read",
        proc.out[-1],
    ), proc.out[-3:]


def test_replay_prints_progress_and_its_total(tmp_path: Path) -> None:
    path = tmp_path / "r.kvr"
    recording_of(path, [(1e9 + i * 0.1, 1e9) for i in range(21)])  # 2 s
    proc = kvindex(
        "replay", str(path), "--pub", f"tcp://127.0.0.1:{free_ports(1)}", "--wait", "0",
        "--hold", "0", "--progress", "0.5",
    )  # fmt: skip
    assert proc.finish(20) == 0, proc.err
    assert proc.out[0].startswith(f"replaying {path} (21 batches, 0:02 of recorded time) at 1x")
    progress = [line for line in proc.out if line.startswith("replaying: ")]
    assert len(progress) >= 2, proc.out
    assert re.fullmatch(
        r"replaying: \d+ of 21 batches \(\d+%\), 0:0\d of 0:02 recorded time", progress[0]
    )
    assert re.fullmatch(r"replayed 21 batches \(0 restarts\) in [\d.]+ s", proc.out[-1])
