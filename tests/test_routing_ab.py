"""The routing bench (issue 25): its traces, its engine model, and a whole run through a real
`kvindex serve` (`kvindex bench routing --smoke`)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvindex.bench.routing_ab.engines import Job, ModelEngine, ServiceModel, chain_digests
from kvindex.bench.routing_ab.policies import Approximate, Oracle
from kvindex.bench.routing_ab.traces import (
    SharedPrefix,
    TraceError,
    read_mooncake,
    shared_prefix,
)
from kvindex.sim.engine import Removed, Stored


def _rows(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_rows_share_tokens_where_they_share_hash_ids(tmp_path: Path) -> None:
    trace = _rows(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 2500, "input_length": 1100, "output_length": 7, "hash_ids": [1, 2, 9]},
            {"timestamp": 1000, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]},
        ],
    )
    first, second = read_mooncake(trace)
    assert (first.at, second.at) == (0.0, 1.5)  # sorted, seconds from the first
    a, b = first.prompt_tokens(), second.prompt_tokens()
    assert (len(a), len(b), first.output_len) == (700, 1100, 3)
    assert np.array_equal(a, b[:700])  # ids 1, 2: the same 700 tokens
    assert not np.array_equal(b[700:1024], second.output_tokens()[:1])


@pytest.mark.parametrize(
    ("row", "said"),
    [
        ({"timestamp": 0, "input_length": 10, "output_length": 1}, "line 1: not a Mooncake"),
        ({"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}, "can't make"),
        ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}, "out of range"),
    ],
)
def test_mooncake_refuses_a_bad_row_by_its_line(
    tmp_path: Path, row: dict[str, object], said: str
) -> None:
    with pytest.raises(TraceError, match=said):
        read_mooncake(_rows(tmp_path / "t.jsonl", [row]))


def test_shared_prefix_chats_grow_by_their_answers() -> None:
    shape = SharedPrefix(groups=3, system_tokens=64, users=2, turns=3, rate=50.0, seed=4)
    trace = shared_prefix(shape)
    assert len(trace) == shape.requests == 18
    assert [r.at for r in trace] == sorted(r.at for r in trace)
    assert trace == shared_prefix(shape)  # deterministic by seed
    by_len = sorted(trace, key=lambda r: r.prompt_len)
    longest = by_len[-1]
    earlier = [r for r in trace if longest.prompt[: len(r.prompt)] == r.prompt and r != longest]
    assert len(earlier) == 2  # the chat's two earlier turns
    turn = max(earlier, key=lambda r: r.prompt_len)
    grown = np.concatenate([turn.prompt_tokens(), turn.output_tokens()])
    assert np.array_equal(longest.prompt_tokens()[: len(grown)], grown)
    skewed = shared_prefix(SharedPrefix(groups=8, users=20, turns=1, skew=1.5, seed=1))
    firsts = [r.prompt[0][0] for r in skewed]
    assert firsts.count(1) > 3 * firsts.count(8)  # group 1 (Zipf's first) is the most asked


def _job(i: int, at: float, tokens: np.ndarray, output: int = 16, bs: int = 16) -> Job:
    out = np.arange(1000 + i, 1000 + i + output, dtype=np.uint32)
    return Job(i, at, tokens, out, chain_digests(tokens, bs))


def test_engine_caches_evicts_and_times_as_stated() -> None:
    model = ServiceModel(
        prefill_per_token=0.001, prefill_overhead=0.01, decode_per_token=0.1, gpu_blocks=8
    )
    e = ModelEngine(0, "e0", model)
    prompt = np.arange(1, 65, dtype=np.uint32)  # 4 blocks
    first = _job(0, 0.0, prompt)
    e.arrive(first, 0.0)
    assert first.first_token == pytest.approx(0.01 + 0.064)  # no hit: 64 tokens of prefill
    (stored,) = e.take_events()
    assert isinstance(stored, Stored) and len(stored.digests) == 4 and stored.parent is None
    e.advance(10.0)  # finished: the answer's block cached too
    (answer,) = e.take_events()
    assert isinstance(answer, Stored) and answer.parent == first.digests[-1]
    again = _job(1, 10.0, prompt)
    e.arrive(again, 10.0)
    # at most (n - 1) // 16 = 3 blocks reused: the last one is recomputed (a second copy)
    assert again.hit_tokens == 48
    assert again.ttft == pytest.approx(0.01 + 0.016)
    (copy,) = e.take_events()  # the recomputed last block: a second copy, announced
    assert isinstance(copy, Stored) and copy.digests == first.digests[3:]
    e.advance(20.0)
    (answer2,) = e.take_events()
    assert isinstance(answer2, Stored)
    other = _job(2, 20.0, np.arange(500, 564, dtype=np.uint32))
    e.arrive(other, 20.0)  # 5 blocks of a full pool: the LRU front of the free queue goes
    events = e.take_events()
    removed = [d for ev in events if isinstance(ev, Removed) for d in ev.digests]
    # free queue: the never-used block, then the first request's tail first (its answer, its
    # 4th block), then the second's tail first (its answer, its copy of the 4th block)
    d3 = first.digests[3]
    assert removed == [answer.digests[0], d3, answer2.digests[0], d3]
    assert e.matched(first.digests) == 3 and e.matched(other.digests) == 4


def test_engine_queues_past_its_running_limit_and_prefills_one_at_a_time() -> None:
    model = ServiceModel(
        prefill_per_token=0.001, prefill_overhead=0.0, decode_per_token=1.0, max_running=2
    )
    e = ModelEngine(0, "e0", model)
    jobs = [_job(i, 0.0, np.arange(100 * i + 1, 100 * i + 33, dtype=np.uint32)) for i in range(3)]
    for job in jobs:
        e.arrive(job, 0.0)
    assert (e.running, len(e.waiting)) == (2, 1)
    assert [j.first_token for j in jobs[:2]] == pytest.approx([0.032, 0.064])
    e.advance(100.0)
    # the third waited for the first to finish (0.032 + 16 output tokens x 1 s)
    assert jobs[2].first_token == pytest.approx(16.032 + 0.032)


def test_oracle_prefers_the_engine_holding_the_prompt() -> None:
    model = ServiceModel(gpu_blocks=64)
    engines = [ModelEngine(i, f"e{i}", model) for i in range(3)]
    prompt = np.arange(1, 257, dtype=np.uint32)
    engines[2].arrive(_job(0, 0.0, prompt), 0.0)
    for e in engines:
        e.advance(100.0)
    job = _job(1, 100.0, prompt)
    assert Oracle(engines).choose(job, engines) == 2
    approx = Approximate(capacity=1000)
    assert approx.choose(job, engines) == 0  # it never saw the prompt go anywhere
    assert approx.choose(_job(2, 100.0, prompt), engines) == 0  # now it has


def test_routing_bench_smoke_through_serve(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvindex", "bench", "routing", "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    policies = doc["policies"]
    assert set(policies) == {
        "kvindex",
        "kvindex_longest",
        "round_robin",
        "least_loaded",
        "approximate",
        "oracle",
    }
    kv = policies["kvindex"]
    assert kv["applied"]["exact"] and kv["applied"]["batches"] > 0
    assert kv["oracle_decisions"] >= 0.99
    assert kv["hit_tokens"] > policies["round_robin"]["hit_tokens"]
    assert kv["hit_tokens"] >= 0.98 * policies["oracle"]["hit_tokens"]
    assert sum(kv["per_engine"]) == doc["requests"]
    assert (tmp_path / "r.png").stat().st_size > 0
    assert "| kvindex |" in proc.stdout


def test_routing_bench_half_the_fleet_without_events(tmp_path: Path) -> None:
    """`--events-none 2`: kvindex_mixed runs beside kvindex on 2 of 4 engines publishing
    nothing (events=none in serve); serve's view of the others stays exact, and routing on
    what it sent the silent ones still beats round-robin's hits."""
    out = tmp_path / "r.json"
    args = ["--smoke", "--events-none", "2", "--policies", "kvindex,round_robin"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvindex", "bench", "routing", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["engines_without_events"] == 2
    policies = doc["policies"]
    assert set(policies) == {"kvindex", "round_robin", "kvindex_mixed"}
    mixed = policies["kvindex_mixed"]
    assert mixed["applied"]["engines_without_events"] == 2 and mixed["applied"]["exact"]
    assert mixed["applied"]["batches"] > 0  # the two engines with events published
    assert sum(mixed["per_engine"]) == doc["requests"] and min(mixed["per_engine"]) > 0
    assert mixed["hit_tokens"] > policies["round_robin"]["hit_tokens"]
    assert "| kvindex_mixed |" in proc.stdout and "2 engines without KV events" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "kvindex", "bench", "routing", "--smoke", "--events-none", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("kvindex bench routing: --events-none")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_routing_bench_bad_trace_is_one_line(tmp_path: Path) -> None:
    bad = _rows(tmp_path / "bad.jsonl", [{"timestamp": "x"}])
    for trace in (bad, tmp_path / "missing.jsonl"):
        proc = subprocess.run(
            [sys.executable, "-m", "kvindex", "bench", "routing", "--trace", str(trace)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("kvindex bench routing: ")


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_routing_bench_stops_cleanly_on_a_signal(tmp_path: Path, signum: int) -> None:
    """A stop between two requests: serve (its child) stopped, exit 0, nothing written."""
    out = tmp_path / "r.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvindex", "bench", "routing", "--quick", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stderr is not None
        line = ""
        while "[routing] kvindex:" not in line:  # the first policy, through serve, started
            line = proc.stderr.readline()
            assert line, "the bench ended before its first policy"
        deadline = time.monotonic() + 30
        while not _children(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        children = _children(proc.pid)
        assert children, "no serve child seen"
        time.sleep(1.0)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "stopped; no results written" in err
        assert not out.exists()
        for child in children:
            assert not Path(f"/proc/{child}").exists() or "zombie" in _state(child)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"
