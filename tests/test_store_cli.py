"""`kvindex export` and `kvindex stats` read a store offline, log tail included."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_store_sqlite import B0, BS, A, Harness

from kvindex.store.protocol import Group, LostMark
from kvindex.wire import BlockRemoved, BlockStored


def kvindex(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvindex", *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def store(tmp_path: Path) -> str:
    h = Harness(tmp_path / "s.sqlite")
    h.batch(A, BlockStored([1, 2], None, list(range(8)), BS))
    h.batch(A, BlockStored([1], None, list(range(4)), BS))  # a second copy of block 1
    h.writer.compact()
    # After the snapshot: only in the log.
    h.batch(A, BlockRemoved([2]), BlockStored([b"\xff" * 8], None, [], 0, medium="CPU"))
    h.batch(B0, BlockStored([-7], None, [9] * BS, BS, lora_name="x", extra_keys=[["x"]]))
    h.writer.commit([Group(0, [LostMark("b", 0, 1, 3)])])  # seqs 1..3 of b lost
    h.writer.close()
    return f"sqlite:///{h.path}"


def test_export_jsonl_includes_the_log_tail(store: str) -> None:
    proc = kvindex("export", "--store", store)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    got = {(r["instance"], r["medium"], r["block_hash"]): r for r in records}
    assert set(got) == {("a", "GPU", "1"), ("a", "CPU", "ffffffffffffffff"), ("b", "GPU", "-7")}
    assert got[("a", "GPU", "1")]["copies"] == 2
    assert got[("a", "GPU", "1")]["token_ids"] == [0, 1, 2, 3]
    assert got[("b", "GPU", "-7")]["lora"] == "x"
    assert got[("a", "CPU", "ffffffffffffffff")]["token_ids"] is None


def test_export_csv(store: str, tmp_path: Path) -> None:
    out = tmp_path / "blocks.csv"
    assert kvindex("export", "--store", store, "--format", "csv", "--out", str(out)).returncode == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert len(rows) == 3 and rows[0]["instance"] == "a"
    assert {r["block_hash"]: r["token_ids"] for r in rows}["1"] == "0 1 2 3"


def test_stats_json(store: str) -> None:
    proc = kvindex("stats", "--store", store, "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["instances"]["a"]["blocks_by_medium"] == {"CPU": 1, "GPU": 1}
    assert summary["instances"]["b"]["incomplete"] is True
    assert summary["instances"]["a"]["ranks"]["0"]["next_seq"] == 3
    assert summary["total_blocks"] == 3
    assert summary["log_batches_not_compacted"] == 2


def test_stats_table(store: str) -> None:
    proc = kvindex("stats", "--store", store)
    assert proc.returncode == 0 and "incomplete" in proc.stdout


@pytest.mark.parametrize(
    "url", ["memory", "sqlite:///", "sqlite:////nonexistent/dir/x.sqlite", "ftp://x"]
)
def test_bad_stores_are_one_line_errors(url: str) -> None:
    for cmd in ("export", "stats"):
        proc = kvindex(cmd, "--store", url)
        assert proc.returncode == 2, (cmd, url, proc.stderr)
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_export_into_a_pipe_closed_early_ends_quietly(tmp_path: Path) -> None:
    """`kvindex export ... | head`: no BrokenPipeError traceback, exit 0."""
    h = Harness(tmp_path / "big.sqlite")
    n = 5000  # far more than a pipe's buffer holds
    h.batch(A, BlockStored(list(range(n)), None, list(range(n * BS)), BS))
    h.writer.close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvindex", "export", "--store", f"sqlite:///{h.path}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert json.loads(proc.stdout.readline())["instance"] == "a"
    proc.stdout.close()  # what `head -1` does once it has its line
    assert proc.wait(60) == 0
    assert proc.stderr.read() == ""


@pytest.mark.parametrize("command", ["export", "stats"])
def test_store_commands_describe_themselves(command: str) -> None:
    proc = kvindex(command, "--help")
    assert proc.returncode == 0
    usage, description = proc.stdout.split("\n\n")[:2]
    assert usage.startswith(f"usage: kvindex {command}")
    assert len(description.split()) > 8 and not description.startswith("options")
