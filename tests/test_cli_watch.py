"""`kvindex watch` as a user runs it: a subprocess following a real publisher on loopback.

Each test publishes known batches through `kvindex.wire.publisher.Publisher` (the real
wire: PUB + ROUTER on free ports) and checks what the command prints, line by line.
Batches published before the command starts reach it through its initial replay; batches
published after it reports the connection arrive live.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from clitools import Proc, child_env, kvindex

from kvindex.cli import main
from kvindex.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(30)

LOOPBACK = "tcp://127.0.0.1:*"
TS = 1_750_000_000.25  # a fixed batch timestamp, so `ts` can be compared exactly


@pytest.fixture
def pub() -> Iterator[Publisher]:
    with Publisher(LOOPBACK, LOOPBACK) as p:
        yield p


def watch(p: Publisher, *args: str) -> Proc:
    assert p.replay_endpoint is not None
    return kvindex("watch", p.endpoint, "--replay", p.replay_endpoint, *args)


def wait_live(cli: Proc, lines: list[str]) -> None:
    """Until the command's SUB socket is connected (and, a moment later, subscribed)."""
    cli.wait_for(lines, lambda line: line.endswith(": connected"))
    time.sleep(0.3)


def json_lines(cli: Proc) -> list[dict[str, Any]]:
    return [json.loads(line) for line in cli.out]


def summary_of(lines: list[str]) -> str:
    (line,) = [line for line in lines if line.startswith("summary: ")]
    return line


def stored(hashes: list[Any], parent: Any, n_tokens: int = 16, **kw: Any) -> BlockStored:
    return BlockStored(hashes, parent, list(range(n_tokens * len(hashes))), n_tokens, **kw)


# -- JSON output -------------------------------------------------------------------------


def test_json_lines_equal_what_was_published(pub: Publisher) -> None:
    digest = bytes(range(32))
    pub.publish(
        [
            stored([7, -9_000_000_000, 2**64 - 1], None, medium="GPU", lora_name="ad"),
            stored([digest], -9_000_000_000, extra_keys=[[b"\x01\xfe", "salt", 3]]),
        ],
        ts=TS,
    )
    cli = watch(pub, "--json", "--max-batches", "4")
    cli.wait_for(cli.out, lambda line: '"seq":0' in line)
    wait_live(cli, cli.err)
    pub.publish([BlockRemoved([digest], medium="CPU"), BlockRemoved([-9_000_000_000])], ts=TS + 1)
    pub.publish([AllBlocksCleared()], ts=TS + 2)
    # An event type this kvindex does not know (a future vLLM): shown with its tag and fields.
    future = {"type": "BlockMoved", "block_hashes": [5, b"\xab"], "blob": b"\x0a\x0b", "n": 1}
    pub.publish_payload(msgspec.msgpack.encode([TS + 3, [future], 0]))
    assert cli.finish() == 0

    head = {"instance": "vllm", "dp_rank": 0}
    expected = [
        {**head, "seq": 0, "ts": TS, "replayed": True, "type": "BlockStored",
         "block_hashes": ["7", "-9000000000", "18446744073709551615"],
         "parent_block_hash": None, "token_ids": list(range(48)), "block_size": 16,
         "medium": "GPU", "lora_name": "ad", "extra_keys": None},
        {**head, "seq": 0, "ts": TS, "replayed": True, "type": "BlockStored",
         "block_hashes": [digest.hex()], "parent_block_hash": "-9000000000",
         "token_ids": list(range(16)), "block_size": 16, "medium": None, "lora_name": None,
         "extra_keys": [["01fe", "salt", 3]]},
        {**head, "seq": 1, "ts": TS + 1, "replayed": False, "type": "BlockRemoved",
         "block_hashes": [digest.hex()], "medium": "CPU"},
        {**head, "seq": 1, "ts": TS + 1, "replayed": False, "type": "BlockRemoved",
         "block_hashes": ["-9000000000"], "medium": None},
        {**head, "seq": 2, "ts": TS + 2, "replayed": False, "type": "AllBlocksCleared"},
        {**head, "seq": 3, "ts": TS + 3, "replayed": False, "type": "BlockMoved",
         "block_hashes": ["5", "ab"], "blob": "0a0b", "n": 1},
    ]  # fmt: skip
    got = json_lines(cli)
    assert len(got) == len(expected), got
    pairs = zip(got, expected, strict=True)
    assert [{k: line.get(k) for k in want} for line, want in pairs] == expected
    # Every field of the event is there under vLLM's name, even when unset.
    assert {"lora_id", "group_idx", "kv_cache_spec_kind", "locality"} <= set(got[0])
    # Notices and the summary went to stderr only.
    assert any("replayed 1 batches (seq 0..0)" in line for line in cli.err)
    assert summary_of(cli.err).startswith("summary: 4 batches in ")
    assert "BlockStored 2, BlockRemoved 2, AllBlocksCleared 1, BlockMoved 1;" in cli.err[-1]


def test_json_lines_of_sglang_events(pub: Publisher) -> None:
    """SGLang's own fields: `session_id` and `lora_name` as sent, the salt as its short
    digest (never the salt itself), a bigram page's pairs as its `token_ids`; no decode
    error for the pairs."""
    salted = {
        "type": "BlockStored", "block_hashes": [-5, 6], "parent_block_hash": None,
        "token_ids": [1, 2], "block_size": 1, "lora_id": None, "medium": "CPU_PINNED",
        "cache_salt": "tenant-secret", "session_id": "sess-1", "lora_name": "adapter-0",
    }  # fmt: skip
    bigram = {**salted, "block_hashes": [7], "token_ids": [[1, 2]], "medium": "GPU"}
    del bigram["cache_salt"], bigram["session_id"], bigram["lora_name"]
    pub.publish_payload(msgspec.msgpack.encode([TS, [salted], 0]))
    pub.publish_payload(msgspec.msgpack.encode([TS, [bigram], 0]))
    cli = watch(pub, "--json", "--max-batches", "2")
    assert cli.finish() == 0
    first, second = json_lines(cli)
    digest = "salt:" + hashlib.sha256(b"tenant-secret").hexdigest()[:12]
    assert first["cache_salt"] == digest
    assert (first["session_id"], first["lora_name"], first["medium"]) == (
        "sess-1", "adapter-0", "CPU_PINNED"
    )  # fmt: skip
    assert not any("tenant-secret" in line for line in cli.out + cli.err)
    assert second["token_ids"] == [[1, 2]] and second["block_hashes"] == ["7"]
    assert second["cache_salt"] is None and "token_pairs" not in second
    assert "decode errors 0" in summary_of(cli.err)


def test_gaps_are_filled_by_replay_in_order(pub: Publisher) -> None:
    dropped = {2, 3, 6}
    pub.drop = lambda seq: seq in dropped
    pub.publish([stored([0], None)])
    cli = watch(pub, "--json", "--max-batches", "9")
    wait_live(cli, cli.err)
    for seq in range(1, 9):
        pub.publish([stored([seq], seq - 1)], ts=TS + seq)
    assert cli.finish() == 0

    got = json_lines(cli)
    assert [line["seq"] for line in got] == list(range(9))
    assert [line["block_hashes"] for line in got] == [[str(s)] for s in range(9)]
    assert [line["replayed"] for line in got] == [s in dropped or s == 0 for s in range(9)]
    assert pub.dropped == 3
    assert any("gap: missed seq 2..3, replaying" in line for line in cli.err)
    assert any("gap: missed seq 6..6, replaying" in line for line in cli.err)
    summary = summary_of(cli.err)
    assert "summary: 9 batches" in summary
    assert "gaps 2, replayed 4, lost 0, restarts 0, decode errors 0" in summary


def test_restart_and_undecodable_batch_are_reported_on_stderr(pub: Publisher) -> None:
    pub.publish([stored([1], None)])
    cli = watch(pub, "--json", "--max-batches", "3")
    wait_live(cli, cli.err)
    pub.publish_payload(b"\xc1 not msgpack")  # seq 1: skipped with a notice
    pub.publish([stored([2], 1)])  # seq 2
    pub.restart()
    pub.publish([stored([3], None)])  # seq 0 of a new engine
    assert cli.finish() == 0

    assert [(line["seq"], line["block_hashes"]) for line in json_lines(cli)] == [
        (0, ["1"]),
        (2, ["2"]),
        (0, ["3"]),
    ]
    err = "\n".join(cli.err)
    assert "seq 1 skipped" in err
    assert "publisher restarted" in err
    assert "restarts 1, decode errors 1" in summary_of(cli.err)


def test_closed_stdout_ends_quietly(pub: Publisher, tmp_path: Path) -> None:
    pub.publish([stored([0], None)])
    argv = ["watch", pub.endpoint, "--replay", str(pub.replay_endpoint), "--json"]
    with (tmp_path / "err").open("w+") as err:
        # Plain Popen: the pipe must have no reader thread left when it is closed.
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvindex", *argv, "--duration", "20"],
            stdout=subprocess.PIPE,
            stderr=err,
            env=child_env(),
        )
        assert proc.stdout is not None
        assert b'"seq":0' in proc.stdout.readline()
        proc.stdout.close()  # like `| head -1`
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            pub.publish([stored([1], None)])  # the next write finds the pipe closed
            time.sleep(0.05)
        assert proc.wait(5) == 0
        err.seek(0)
        lines = err.read().splitlines()
    assert not any("Traceback" in line for line in lines), lines
    assert summary_of(lines).startswith("summary: ")


# -- human output ------------------------------------------------------------------------


def test_human_lines_notices_and_summary(pub: Publisher) -> None:
    digest = bytes(range(32))
    pub.publish([stored([11, 12], None, medium="GPU", lora_name="ad")], ts=TS)
    pub.publish([BlockRemoved([12]), BlockRemoved([13]), stored([digest], 11)], ts=TS + 1)
    cli = watch(pub, "--max-batches", "4")
    wait_live(cli, cli.out)
    pub.publish([AllBlocksCleared()], ts=TS + 2)
    pub.publish([stored([14], None, lora_id=3)], ts=float("inf"))  # a broken publisher clock
    assert cli.finish() == 0

    batches = [line for line in cli.out if line.startswith("#")]
    assert len(batches) == 4
    clock = time.strftime("%H:%M:%S", time.localtime(TS))
    assert batches[0] == (
        f"#0 {clock}.250 dp0 replayed 1 event | "
        "stored n=2 first=11 parent=- tokens=32 medium=GPU lora=ad"
    )
    assert re.fullmatch(
        # One hash per BlockRemoved (vLLM's GPU path): consecutive ones are shown together.
        r"#1 \S+ dp0 replayed 3 events \| removed n=2 first=12 \(2 events\) \| "
        r"stored n=1 first=0001020304050607… parent=11 tokens=16",
        batches[1],
    )
    assert re.fullmatch(r"#2 \S+ dp0 1 event \| ALL BLOCKS CLEARED", batches[2])
    assert batches[3] == "#3 ts=inf dp0 1 event | stored n=1 first=14 parent=- tokens=16 lora_id=3"
    assert "▶ vllm: replayed 2 batches (seq 0..1)" in cli.out
    assert cli.out[-1] == summary_of(cli.out)
    assert re.fullmatch(
        r"summary: 4 batches in [\d.]+ s; events: BlockStored 3, BlockRemoved 2, "
        r"AllBlocksCleared 1; gaps 0, replayed 2, lost 0, restarts 0, decode errors 0",
        cli.out[-1],
    )
    assert cli.err == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_prints_summary_and_exits_0(pub: Publisher, sig: int) -> None:
    pub.publish([stored([1], None)])
    cli = watch(pub)
    cli.wait_for(cli.out, lambda line: line.startswith("#0 "))
    cli.interrupt(sig)
    assert cli.finish() == 0
    assert "summary: 1 batches" in cli.out[-1]
    assert not any("Traceback" in line for line in cli.err)


def test_duration_ends_the_watch_without_any_publisher() -> None:
    started = time.monotonic()
    cli = kvindex("watch", "tcp://127.0.0.1:9", "--duration", "0.5")
    assert cli.finish() == 0
    assert time.monotonic() - started < 8
    assert cli.out[-1].startswith("summary: 0 batches in 0.")


# -- usage errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["watch"],
        ["watch", "not-an-endpoint"],
        ["watch", "tcp://127.0.0.1:99999"],
        ["watch", "tcp://127.0.0.1:5557", "--replay", "127.0.0.1:5558"],
        ["watch", "tcp://127.0.0.1:5557", "--max-batches", "0"],
        ["watch", "tcp://127.0.0.1:5557", "--max-batches", "ten"],
        ["watch", "tcp://127.0.0.1:5557", "--duration", "-1"],
        ["watch", "tcp://127.0.0.1:5557", "--dp", "0"],
        ["watch", "tcp://127.0.0.1:5557", "--no-such-flag"],
        ["watch", "tcp://127.0.0.1:5557", "--name", "bad name"],
    ],
)
def test_bad_usage_is_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors leave through sys.exit
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert "error: " in err


@pytest.mark.parametrize("module", ["kvindex", "kvindex.cli"])
def test_bad_usage_from_the_command_line(module: str) -> None:
    cli = Proc([sys.executable, "-m", module, "watch", "udp://nowhere"])
    assert cli.finish() == 2
    assert cli.out == []
    assert cli.err == [
        "kvindex watch: error: endpoint 'udp://nowhere' is not a ZMQ endpoint "
        "(tcp://HOST:PORT, ipc://PATH)"
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "f.kvr", "--speed", "-3"], "'-3' must be a positive number (see"),
        (["simulate", "--rate", "-1"], "'-1' must be a positive number (see"),
        (["replay", "f.kvr", "--speed", "fast"], "'fast' is not a number (see"),
        (["watch", "tcp://h:1", "--duration", "-1"], "must be a positive number of seconds"),
        (["watch", "tcp://h:1", "--duration", "nan"], "'nan' is not a number of seconds"),
        (["replay", "f.kvr", "--wait", "-1"], "must be 0 or a positive number of seconds"),
        (["record", "tcp://h:1", "--out", "x", "--progress", "0"], "positive number of seconds"),
    ],
)
def test_number_flags_say_what_they_want(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err, err


def test_every_option_of_every_command_has_help() -> None:
    from kvindex.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    missing = [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, sub in commands.items()
        for action in sub._actions
        if action.help is None and action.dest != "help"
    ]
    assert missing == []
    assert all(sub.description for sub in commands.values())
