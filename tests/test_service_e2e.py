"""`kvindex serve` as a subprocess against two publishers (one with dp=2): the served state
must equal the reference block pools exactly, through drops, duplicate messages and
copies, evictions, a clear, an engine restart and a late start of the service."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import pytest
from netutil import free_ports, serve_url, wait_until
from service_workload import Conversation, RefRank

from kvindex.wire import render_hash
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)


@dataclass
class Fleet:
    ranks: dict[str, list[RefRank]]

    def all(self) -> list[RefRank]:
        return [r for ranks in self.ranks.values() for r in ranks]


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    pub_base, replay_base = free_ports(2), free_ports(2)
    pubs = {
        "a": [Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")],
        "b": [
            Publisher(
                f"tcp://127.0.0.1:{pub_base + r}", f"tcp://127.0.0.1:{replay_base + r}", dp_rank=r
            )
            for r in range(2)
        ],
    }
    try:
        yield Fleet({name: [RefRank(p) for p in ps] for name, ps in pubs.items()})
    finally:
        for ps in pubs.values():
            for p in ps:
                p.close()


def start_service(fleet: Fleet, errors: IO[str]) -> tuple[subprocess.Popen[str], str]:
    a = fleet.ranks["a"][0].pub
    b = fleet.ranks["b"][0].pub
    cmd = [
        sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0",
        "--instance", f"a={a.endpoint},replay={a.replay_endpoint}",
        "--instance", f"b={b.endpoint},replay={b.replay_endpoint},dp=2",
    ]  # fmt: skip
    # stderr goes to a file: nobody reads it while the test runs, and a full pipe blocks.
    # The default store (sqlite:///kvindex.sqlite) goes to a scratch working directory.
    workdir = tempfile.mkdtemp(prefix="kvindex-e2e-")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True, cwd=workdir)
    return proc, serve_url(proc, lambda: (errors.seek(0), errors.read())[1])


def ranks_state(client: httpx.Client) -> dict[tuple[str, int], tuple[str, int | None]]:
    out = {}
    for inst in client.get("/v1/instances").json()["instances"]:
        for rank in inst["ranks"]:
            out[(inst["name"], rank["rank"])] = (rank["status"], rank["last_seq"])
    return out


def sync(fleet: Fleet, client: httpx.Client) -> None:
    """Publish a batch nobody drops on every rank, then wait until the service applied
    everything each publisher sent (the tail of a stream is only seen missing once a
    later batch arrives)."""
    for rank in fleet.all():
        rank.pub.drop = None
        rank.pub.publish([])
    want = {
        (name, i): ("live", r.pub.next_seq - 1)
        for name, ranks in fleet.ranks.items()
        for i, r in enumerate(ranks)
    }
    assert wait_until(lambda: ranks_state(client) == want, timeout=20), (
        ranks_state(client),
        want,
    )


def expected_match(ranks: list[RefRank], prompt: list[int]) -> int:
    return max(r.matched(prompt) for r in ranks)


@pytest.mark.parametrize("seed", [11, 23])
def test_served_state_equals_reference_pools(fleet: Fleet, seed: int) -> None:
    rng = random.Random(seed)
    convs = [Conversation(rng, i) for i in range(6)]
    homes = [fleet.all()[i % 3] for i in range(6)]  # a, b[0], b[1], a, ...
    for conv, home in zip(convs, homes, strict=True):
        home.serve(conv.next_prompt())  # before the service starts: found by replay

    with tempfile.TemporaryFile("w+") as errors:
        run_service(fleet, convs, homes, rng, errors)


def run_service(
    fleet: Fleet,
    convs: list[Conversation],
    homes: list[RefRank],
    rng: random.Random,
    errors: IO[str],
) -> None:
    proc, url = start_service(fleet, errors)
    try:
        with httpx.Client(base_url=url, timeout=5) as client:
            assert wait_until(
                lambda: all(s == "live" for s, _ in ranks_state(client).values()), timeout=15
            )
            run_workload(fleet, convs, homes, rng, client)
            check_state(fleet, convs, client)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def run_workload(
    fleet: Fleet,
    convs: list[Conversation],
    homes: list[RefRank],
    rng: random.Random,
    client: httpx.Client,
) -> None:
    a, (b0, b1) = fleet.ranks["a"][0], fleet.ranks["b"]
    for turn in range(8):
        for r in fleet.all():
            r.pub.drop = lambda seq: rng.random() < 0.15
        for conv, home in zip(convs, homes, strict=True):
            prompt = conv.next_prompt()
            home.serve(prompt)
            if rng.random() < 0.3:
                home.copy_again(prompt)
            home.evict(rng, rng.randrange(0, 3))
        if turn == 6:
            a.offload([bytes([i]) * 32 for i in range(5)])
            a.drop_offloaded(bytes([1]) * 32)
        if turn == 3:
            b1.clear()
        if turn == 5:
            sync(fleet, client)  # the engine restarts after everything so far was seen
            a.restart()
            a.serve(convs[0].next_prompt())
            b0.serve(convs[0].tokens)  # the same prompt, also on b
    sync(fleet, client)


def check_state(fleet: Fleet, convs: list[Conversation], client: httpx.Client) -> None:
    for name, ranks in fleet.ranks.items():
        held = set().union(*(r.held() for r in ranks))
        assert len(held) > 20, name  # the workload leaves a real cache behind
        got = client.get(f"/v1/instances/{name}/blocks").json()["block_hashes"]
        assert len(got) == len(set(got))
        assert set(got) == {render_hash(h) for h in held}, name
        gpu = client.get(f"/v1/instances/{name}/blocks", params={"medium": "GPU"}).json()
        assert set(gpu["block_hashes"]) == {str(h) for r in ranks for h in r.gpu}
    cpu = client.get("/v1/instances/a/blocks", params={"medium": "CPU"}).json()["block_hashes"]
    assert set(cpu) == {bytes([i]).hex() * 32 for i in (0, 2, 3, 4)}
    assert set(cpu) == {render_hash(h) for h in fleet.ranks["a"][0].cpu}

    hits = 0
    for conv in convs:
        prompt = [*conv.tokens, 7, 7, 7, 7, 7]
        answer = client.post("/v1/lookup", json={"token_ids": prompt}).json()
        rows = {row["name"]: row for row in answer["instances"]}
        for name, ranks in fleet.ranks.items():
            want = expected_match(ranks, prompt)
            assert rows[name]["matched_blocks"] == want, (name, conv.tokens[:12])
            assert rows[name]["ranks"] == [
                {"rank": i, "matched_blocks": r.matched(prompt)} for i, r in enumerate(ranks)
            ]
            hits += want > 0
        best = max(rows.values(), key=lambda r: r["matched_blocks"])["matched_blocks"]
        assert (answer["best"] is None) == (best == 0)
    assert hits > 0

    instances = {i["name"]: i for i in client.get("/v1/instances").json()["instances"]}
    assert instances["a"]["publisher_restarts"] >= 1
    assert sum(i["gaps"] for i in instances.values()) > 0
    assert all(i["lost_batches"] == 0 and i["status"] == "live" for i in instances.values())
    assert instances["b"]["clears"] == 1 and instances["b"]["dp"] == 2


def test_serve_rejects_bad_flags_in_one_line() -> None:
    cases = [
        ["--store", "sqlite:///"],
        ["--store", "sqlite:////proc/no-such-dir/kvindex.sqlite"],
        ["--store", "nonsense"],
        ["--http", "localhost"],
        ["--instance", "x"],
        ["--instance", "a=tcp://127.0.0.1:1", "--instance", "a=tcp://127.0.0.1:2"],
        ["--config", "/nonexistent/kvindex.toml"],
        ["--bogus"],
    ]
    for args in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "kvindex", "serve", *args],
            capture_output=True,
            text=True,
            timeout=20,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stdout == "" and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_serve_reads_a_config_file(tmp_path: Path) -> None:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        config = tmp_path / "kvindex.toml"
        config.write_text(
            '[server]\nhttp = "127.0.0.1:0"\nstore = "memory"\n\n'
            f'[[instances]]\nname = "c"\nendpoint = "{pub.endpoint}"\n'
            f'replay_endpoint = "{pub.replay_endpoint}"\ndp = 1\n'
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvindex", "serve", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            url = serve_url(proc)
            with httpx.Client(base_url=url, timeout=5) as client:
                names = [i["name"] for i in client.get("/v1/instances").json()["instances"]]
                assert names == ["c"]
                assert client.get("/healthz").json() == {"status": "ok"}
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10) == 0
        bad = tmp_path / "bad.toml"
        bad.write_text('[[instances]]\nname = "c"\nendpoint = "nope"\n')
        out = subprocess.run(
            [sys.executable, "-m", "kvindex", "serve", "--config", str(bad)],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert out.returncode == 2 and "instances[0]" in out.stderr


def test_serve_stops_at_once_with_a_dashboard_stream_open(tmp_path: Path) -> None:
    import signal
    import time
    import urllib.request

    proc = subprocess.Popen(
        [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--store", "memory"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    url = serve_url(proc)
    stream = urllib.request.urlopen(url + "v1/dashboard/stream", timeout=10)
    assert stream.readline()  # the stream is open and talking
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 0
    assert time.monotonic() - started < 3  # not the 5 s graceful timeout
    stream.close()
    assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
