"""What goes wrong on the links is visible: malformed frames, refused handshakes and refused
replay answers are counted per engine and rank in /v1/instances and /metrics; `last_seq`
is known right after a warm start; the SUB high-water mark is what the operator set."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq
from clitools import child_env, kvindex
from netutil import serve_url, wait_until
from service_workload import TestClient
from test_config import serve_args
from test_link_diagnostics import CurvePublisher

from kvindex.cli.config import load_settings
from kvindex.runtime import Fleet
from kvindex.service.app import create_app
from kvindex.subscriber import InstanceSpec, ReplayPolicy
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)


class GarbageReplay:
    """A ROUTER that answers every replay request with a one-frame message."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.router.poll(20):
                client = self.router.recv_multipart()[0]
                self.router.send_multipart([client, b"garbage"])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
def garbage() -> Iterator[GarbageReplay]:
    g = GarbageReplay()
    try:
        yield g
    finally:
        g.close()


@pytest.fixture
def curve_pub(tmp_path: Path) -> Iterator[CurvePublisher]:
    p = CurvePublisher(tmp_path)
    try:
        yield p
    finally:
        p.close()


def metric(text: str, name: str, engine: str) -> float:
    prefix = f'{name}{{engine="{engine}"}} '
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return float(line.removeprefix(prefix))


def test_malformed_frames_refused_handshakes_and_replays_are_counted_where_they_happen(
    garbage: GarbageReplay, curve_pub: CurvePublisher
) -> None:
    with Publisher("tcp://127.0.0.1:*") as garbled, Publisher("tcp://127.0.0.1:*") as lied_to:
        specs = [
            InstanceSpec("garbled", garbled.endpoint),
            InstanceSpec("refused", curve_pub.pub.endpoint),  # plain, at a CURVE publisher
            InstanceSpec("lied-to", lied_to.endpoint, garbage.endpoint),
        ]
        fleet = Fleet(specs, policy=ReplayPolicy(first_reply_timeout=0.5))
        with TestClient(create_app(fleet)) as client:

            def rows() -> dict[str, dict]:  # type: ignore[type-arg]
                body = client.get("/v1/instances").json()["instances"]
                return {row["name"]: row for row in body}

            assert wait_until(lambda: rows()["garbled"]["status"] == "live", 10)
            for _ in range(3):
                garbled.send_raw([b"", b"not a seq"])
            garbled.publish([BlockStored([1])])
            assert wait_until(lambda: rows()["garbled"]["malformed_messages"] == 3, 10)
            assert wait_until(lambda: rows()["refused"]["handshake_failures"] >= 1, 10)
            assert wait_until(lambda: rows()["lied-to"]["replay_refusals"] == 1, 10)
            seen = rows()
            assert seen["garbled"]["ranks"][0]["malformed_messages"] == 3
            assert seen["refused"]["ranks"][0]["handshake_failures"] >= 1
            lied = seen["lied-to"]
            assert lied["ranks"][0]["replay_refusals"] == 1 and lied["replay_failures"] == 1
            assert lied["malformed_messages"] == 1  # the reply that was no reply
            text = client.get("/metrics").text
            assert metric(text, "kvindex_malformed_messages_total", "garbled") == 3
            assert metric(text, "kvindex_handshake_failures_total", "refused") >= 1
            assert metric(text, "kvindex_replay_refusals_total", "lied-to") == 1
            assert metric(text, "kvindex_replay_failures_total", "lied-to") == 1
            assert metric(text, "kvindex_replay_refusals_total", "garbled") == 0


def test_last_seq_is_known_right_after_a_warm_start(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path}/kv.sqlite"
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        spec = f"a={pub.endpoint},replay={pub.replay_endpoint}"

        def serve() -> tuple[subprocess.Popen[str], str]:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvindex", "serve", "--store", store, "--http",
                 "127.0.0.1:0", "--instance", spec],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=child_env(),
            )  # fmt: skip
            return proc, serve_url(proc)

        def last_seq(url: str) -> object:
            return httpx.get(url + "v1/instances", timeout=5).json()["instances"][0]["last_seq"]

        for i in range(5):
            pub.publish([BlockStored([i])])
        proc, url = serve()
        try:
            assert wait_until(lambda: last_seq(url) == 4, 10)  # from the replay
        finally:
            proc.terminate()
            assert proc.wait(15) == 0
        proc, url = serve()  # the engine publishes nothing more
        try:
            assert last_seq(url) == 4
        finally:
            proc.terminate()
            proc.wait(15)


def test_the_sub_high_water_mark_is_the_one_set(tmp_path: Path) -> None:
    config = tmp_path / "k.toml"
    config.write_text("[server]\nsub_hwm = 321\n")
    endpoint = "tcp://127.0.0.1:1"
    for argv, want in [
        (["--config", str(config)], 321),
        (["--config", str(config), "--sub-hwm", "45"], 45),
        ([], 100_000),
    ]:
        settings = load_settings(serve_args(*argv, "--instance", f"a={endpoint}"))
        fleet = Fleet(settings.instances, sub_hwm=settings.sub_hwm)
        try:
            socks = [s for s in fleet.subscriber.sockets() if s.type == zmq.SUB]
            assert [s.getsockopt(zmq.RCVHWM) for s in socks] == [want]
        finally:
            fleet.close()


def test_serve_logs_a_refused_replay_in_one_line(garbage: GarbageReplay) -> None:
    with Publisher("tcp://127.0.0.1:*") as pub:
        spec = f"a={pub.endpoint},replay={garbage.endpoint}"
        proc = kvindex("serve", "--store", "memory", "--http", "127.0.0.1:0", "--instance", spec)
        try:
            line = proc.wait_for(proc.err, lambda x: "replay refused" in x, timeout=15)
            assert line == (
                "kvindex serve: WARNING a: replay refused: a reply that is no replay reply "
                "(replay reply of 1 frames, expected 3 or 4); not asking again for 1 s"
            )
        finally:
            proc.interrupt()
            assert proc.finish() == 0
