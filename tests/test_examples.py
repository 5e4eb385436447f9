"""The example scripts, each run as a user runs it against real publishers on loopback.

Every scenario is published before the script starts, so the script receives it through
its initial replay and `--max-batches` ends it right after the last batch: the checks are
exact, and nothing depends on timing.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clitools import Proc, example

from kvindex.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(30)

LOOPBACK = "tcp://127.0.0.1:*"
TS = 1_750_000_000.5


@pytest.fixture
def pub() -> Iterator[Publisher]:
    with Publisher(LOOPBACK, LOOPBACK) as p:
        yield p


def endpoints(p: Publisher) -> list[str]:
    return [p.endpoint, "--replay", str(p.replay_endpoint)]


def run(proc: Proc) -> list[str]:
    assert proc.finish() == 0, proc.err
    assert not any("Traceback" in line for line in proc.err), proc.err
    return proc.out


def stored(hashes: list[Any], parent: Any = None, **kw: Any) -> BlockStored:
    tokens = list(range(100, 100 + 16 * len(hashes)))
    return BlockStored(hashes, parent, tokens, 16, **kw)


# -- cache_stats -------------------------------------------------------------------------


def test_cache_stats_counts_copies(pub: Publisher) -> None:
    pub.publish([stored([1, 2, 3])])
    pub.publish([stored([1], None)])  # a second physical copy of block 1
    pub.publish([BlockRemoved([1]), BlockRemoved([2])])  # 1 keeps a copy, 2 is gone
    pub.publish([BlockRemoved([3], medium="CPU")])  # another medium's copy: GPU 3 stays
    pub.publish([AllBlocksCleared()])
    pub.publish([stored([5, 6])])
    out = run(example("cache_stats.py", *endpoints(pub), "--max-batches", "6"))
    assert out[-1] == "final: stored 6  removed 3  clears 1  active 2 blocks  (6 batches)"


def test_cache_stats_active_before_the_clear(pub: Publisher) -> None:
    pub.publish([stored([1, 2, 3])])
    pub.publish([stored([1], None)])
    pub.publish([BlockRemoved([1]), BlockRemoved([2])])
    out = run(example("cache_stats.py", *endpoints(pub), "--max-batches", "3"))
    assert out[-1] == "final: stored 4  removed 2  clears 0  active 2 blocks  (3 batches)"


# -- sqlite_backup -----------------------------------------------------------------------

A, B, C, E, F = 2**64 - 5, -42, 7, 99, 100
D = bytes(range(32))


def table(db: Path) -> set[tuple[Any, ...]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT instance, dp_rank, group_idx, medium, block_hash, parent_hash, token_ids,"
            " block_size, lora_name, copies, stored_at FROM blocks"
        ).fetchall()
    return set(rows)


def tokens(first: int) -> str:
    return json.dumps(list(range(first, first + 16)))


def test_sqlite_backup_table_follows_the_cache(pub: Publisher, tmp_path: Path) -> None:
    db = tmp_path / "kv.sqlite"
    chain = BlockStored([A, B], None, list(range(32)), 16, lora_name="ad")
    pub.publish([chain, BlockStored([C], B, list(range(32, 48)), 16, lora_name="ad")], ts=TS)
    # A duplicate copy of A, and a hash-only offloaded block (CPU, bytes hash, no tokens).
    dup = BlockStored([A], None, list(range(16)), 16, lora_name="ad")
    pub.publish([dup, BlockStored([D], None, [], 16, medium="CPU", group_idx=1)], ts=TS + 1)
    pub.publish([BlockRemoved([A]), BlockRemoved([B])], ts=TS + 2)  # A keeps one copy
    out = run(example("sqlite_backup.py", *endpoints(pub), "--db", str(db), "--max-batches", "3"))

    assert out[-1].startswith("final: 3 blocks (3 copies) in the table")
    assert table(db) == {
        ("vllm", 0, 0, "GPU", str(A), None, tokens(0), 16, "ad", 1, TS),
        ("vllm", 0, 0, "GPU", "7", "-42", tokens(32), 16, "ad", 1, TS),
        ("vllm", 0, 1, "CPU", D.hex(), None, None, 16, None, 1, TS + 1),
    }

    # A second run resumes from the saved checkpoint: only the new batches are applied.
    pub.publish([AllBlocksCleared()], ts=TS + 3)
    pub.publish([BlockStored([E], None, list(range(16)), 16)], ts=TS + 4)
    out = run(example("sqlite_backup.py", *endpoints(pub), "--db", str(db), "--max-batches", "2"))
    assert table(db) == {("vllm", 0, 0, "GPU", "99", None, tokens(0), 16, None, 1, TS + 4)}

    # The engine restarts while the backup is away: the next run notices and starts over.
    pub.restart()
    pub.publish([BlockStored([F], None, list(range(16)), 16)], ts=TS + 5)
    out = run(example("sqlite_backup.py", *endpoints(pub), "--db", str(db), "--max-batches", "1"))
    assert any("publisher restarted" in line for line in out)
    assert table(db) == {("vllm", 0, 0, "GPU", "100", None, tokens(0), 16, None, 1, TS + 5)}


# -- block_locations ---------------------------------------------------------------------


def test_block_locations_across_instances() -> None:
    with (
        Publisher(LOOPBACK, LOOPBACK) as a,
        Publisher(LOOPBACK, LOOPBACK) as b,
        Publisher(LOOPBACK, LOOPBACK) as c,
    ):
        a.publish([stored([1, 2, 3])])
        a.publish([stored([1]), BlockRemoved([1])])  # a second copy of 1 came and went
        b.publish([stored([1, 2])])
        b.publish([BlockRemoved([2])])
        c.publish([stored([1, 4])])
        c.publish([AllBlocksCleared()])
        specs = [
            arg
            for name, p in (("a", a), ("b", b), ("c", c))
            for arg in ("--instance", f"{name}={p.endpoint},replay={p.replay_endpoint}")
        ]
        out = run(example("block_locations.py", *specs, "--list", "--max-batches", "6"))
    final = out[out.index("final: 3 distinct blocks; 2 on 1 instance, 1 on 2 instances") :]
    assert [line.split() for line in final[1:]] == [["1", "a,b"], ["2", "a"], ["3", "a"]]


def test_block_locations_rejects_a_bad_spec() -> None:
    proc = example("block_locations.py", "--instance", "a=udp://x:1")
    assert proc.finish() == 2
    assert "not a ZMQ endpoint" in proc.err[-1]


# -- activity_monitor --------------------------------------------------------------------


def test_activity_monitor_counts_the_last_window(pub: Publisher) -> None:
    now = time.time()
    pub.publish([stored(list(range(10)))], ts=now - 300)  # long before the window
    pub.publish([stored([1, 2, 3]), BlockRemoved([9])], ts=now - 30)
    pub.publish([AllBlocksCleared()], ts=now - 5)
    pub.publish([BlockRemoved([1])], ts=now - 1)
    proc = example("activity_monitor.py", *endpoints(pub), "--every", "0.2", "--duration", "0.9")
    out = run(proc)
    assert out[-1].endswith("per minute (last 60 s): stored 3  removed 2  clears 1  net +1")
    periodic = [line for line in out[:-1] if "per minute" in line]
    assert periodic and periodic[-1].endswith("stored 3  removed 2  clears 1  net +1")


# -- the demo ----------------------------------------------------------------------------


def test_demo_runs_every_tool_and_stops_cleanly_on_ctrl_c() -> None:
    demo = example("demo.py", "--duration", "30", "--rate", "30")
    # Once instance 0 evicts blocks (its pool is full), the workload has shown everything.
    demo.wait_for(demo.out, lambda line: "watch | #" in line and "removed" in line)
    time.sleep(0.3)  # the other tools follow the same stream: let them catch up
    demo.interrupt()  # Ctrl+C: the tools print their final summaries, the demo exits 0
    out = run(demo)
    by_tool: dict[str, list[str]] = {}
    for line in out:
        name, sep, text = line.partition(" | ")
        if sep:
            by_tool.setdefault(name.strip(), []).append(text)
    assert set(by_tool) == {"watch", "cache_stats", "sqlite_backup", "block_locations", "activity"}
    assert any(line.startswith("#") for line in by_tool["watch"])
    assert by_tool["watch"][-1].startswith("summary: ")
    for tool in ("cache_stats", "sqlite_backup", "activity"):
        assert by_tool[tool][-1].startswith("final: "), by_tool[tool]
    assert any(line.startswith("final: ") for line in by_tool["block_locations"])
    # The workload really stores blocks, and shares system prompts across instances.
    stats = by_tool["cache_stats"][-1]
    assert int(stats.split("stored ")[1].split()[0]) > 0
    assert any(" on 2 instances" in line or " on 3 instances" in line for line in out)
