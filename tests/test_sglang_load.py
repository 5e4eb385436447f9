"""SGLang's load stream: advertised in /server_info, followed per DP rank, shown per rank in
/v1/instances and /metrics.

Against `sglang_fake.FakeSGLang` (real HTTP, real ZMQ PUB sockets sending SGLang's framing
and `LoadStat` encoding), and once against SGLang 0.5.23's own `LoadStat` and load socket
from the SGLang venv. PUB/SUB drops what is sent before the subscription lands, as SGLang's
heartbeat (a reading re-sent every second) makes up for: the tests re-send until seen.
"""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Iterator
from typing import Any

import enginevenv
import pytest
from netutil import free_port, wait_until
from service_workload import TestClient
from sglang_fake import FakeSGLang, load_stat

from kvindex.runtime import Fleet
from kvindex.service.app import create_app
from kvindex.subscriber import InstanceSpec, SourceKey
from kvindex.subscriber.engine_load import LoadFollower
from kvindex.wire.engine_load import LoadStat, LoadStatError, decode_load

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine() -> Iterator[FakeSGLang]:
    with FakeSGLang() as fake:
        yield fake


def ranks_of(client: TestClient, name: str = "sgl") -> list[dict[str, Any]]:
    rows = client.get("/v1/instances").json()["instances"]
    ranks: list[dict[str, Any]] = next(r for r in rows if r["name"] == name)["ranks"]
    return ranks


def test_load_stat_decodes_sglang_shapes() -> None:
    full = decode_load(load_stat(3, 2, 600, 1000, 1, extra=(40, 900, 7, 8)))
    assert (full.num_running_reqs, full.num_waiting_reqs, full.num_tokens) == (3, 2, 600)
    assert full.attn_dp_rank == 1 and full.num_waiting_uncached_tokens == 40
    assert full.kv_usage == 0.6
    # SGLang's first six positions are its stable prefix: a shorter or longer array decodes.
    import msgspec

    short = decode_load(msgspec.msgpack.encode(["LoadStat", 1, 0, 5, 0, None]))
    assert short.max_running_requests == 0 and short.kv_usage is None
    longer = decode_load(msgspec.msgpack.encode(["LoadStat", 1, 0, 5, 10, 0, 0, 0, 0, 0, 0, 99]))
    assert longer.num_tokens == 5
    for bad in (b"\xc1", msgspec.msgpack.encode(["KvMetrics", 1, 2]),
                msgspec.msgpack.encode(["LoadStat", -1, 0, 0, 0])):  # fmt: skip
        with pytest.raises(LoadStatError):
            decode_load(bad)


def test_discovered_load_per_rank_in_instances_and_metrics(engine: FakeSGLang) -> None:
    engine.start_publishers(dp=2, load=True)
    engine.start_http()
    fleet = Fleet([InstanceSpec.parse(f"sgl={engine.url}")])
    with TestClient(create_app(fleet)) as client:
        assert wait_until(lambda: len(ranks_of(client)) == 2, timeout=15)

        def loaded() -> bool:
            engine.publish_load(0, load_stat(4, 1, 300, 1200, 0, max_running=32))
            engine.publish_load(1, load_stat(0, 0, 0, 1200, 1))
            return all(rank["load"] is not None for rank in ranks_of(client))

        assert wait_until(loaded, timeout=15, step=0.05)
        first, second = (rank["load"] for rank in ranks_of(client))
        assert first["running_requests"] == 4 and first["waiting_requests"] == 1
        assert first["kv_tokens_used"] == 300 and first["kv_tokens_total"] == 1200
        assert first["kv_usage"] == 0.25 and first["max_running_requests"] == 32
        assert second["running_requests"] == 0 and second["kv_usage"] == 0.0
        assert first["age_seconds"] < 10 and first["malformed"] == 0

        # A newer reading replaces the older; a payload that is no LoadStat is skipped.
        engine.publish_load(0, b"not msgpack \xc1")
        engine.publish_load(0, load_stat(9, 5, 1100, 1200, 0))
        assert wait_until(lambda: ranks_of(client)[0]["load"]["running_requests"] == 9)
        assert ranks_of(client)[0]["load"]["malformed"] == 1

        metrics = client.get("/metrics").text
        assert 'kvindex_engine_running_requests{engine="sgl",rank="0"} 9.0' in metrics
        assert 'kvindex_engine_waiting_requests{engine="sgl",rank="1"} 0.0' in metrics
        assert 'kvindex_engine_kv_tokens_capacity{engine="sgl",rank="1"} 1200.0' in metrics

        def dashboard_load() -> Any:
            rows = client.get("/v1/dashboard/snapshot").json()["snapshot"]["instances"]
            return rows[0]["load"] if rows else None

        assert wait_until(lambda: (dashboard_load() or {}).get("running") == 9, timeout=5)
        assert dashboard_load()["waiting"] == 5 and dashboard_load()["kv_usage"] == 1100 / 1200
        assert [r["rank"] for r in dashboard_load()["ranks"]] == [0, 1]


def test_restart_drops_the_old_engines_load(engine: FakeSGLang) -> None:
    """After a restart (new ports, another DP size), only the new engine's readings show."""
    engine.start_publishers(dp=1, load=True)
    engine.start_http()
    fleet = Fleet([InstanceSpec.parse(f"sgl={engine.url}")])
    with TestClient(create_app(fleet)) as client:

        def loaded(rank: int, running: int) -> bool:
            engine.publish_load(rank, load_stat(running, 0, 1, 10, rank))
            load = ranks_of(client)[rank]["load"] if len(ranks_of(client)) > rank else None
            return load is not None and load["running_requests"] == running

        assert wait_until(lambda: loaded(0, 7), timeout=15, step=0.05)
        engine.restart(dp=2, load=True)
        engine.publishers[0].publish([])  # an empty batch: the seq goes back to 0

        def moved() -> bool:
            ranks = ranks_of(client)
            return len(ranks) == 2 and ranks[0]["load"] is None

        assert wait_until(moved, timeout=20)
        assert wait_until(lambda: loaded(1, 3), timeout=15, step=0.05)


def test_plain_spec_with_load_option_and_no_load_stream() -> None:
    """`load=` in a spec follows a load stream without discovery; an instance with none
    shows `load: null` and no load metrics."""
    import zmq

    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    specs = [
        InstanceSpec.parse(f"a=tcp://127.0.0.1:{free_port()},load=tcp://127.0.0.1:{port}"),
        InstanceSpec.parse(f"b=tcp://127.0.0.1:{free_port()}"),
    ]
    try:
        with TestClient(create_app(Fleet(specs))) as client:

            def loaded() -> bool:
                pub.send_multipart([b"load", bytes(8), load_stat(2, 0, 5, 50, 0)])
                return ranks_of(client, "a")[0]["load"] is not None

            assert wait_until(loaded, timeout=15, step=0.05)
            assert ranks_of(client, "b")[0]["load"] is None
            assert (
                'engine="b"'
                not in client.get("/metrics")
                .text.split("kvindex_engine_running_requests")[1]
                .split("# HELP")[0]
            )
    finally:
        pub.close(linger=0)


def test_follower_forgets_and_stops_cleanly() -> None:
    follower = LoadFollower()
    spec = InstanceSpec.parse(f"x=tcp://127.0.0.1:{free_port()},dp=2,load=tcp://127.0.0.1:6000")
    follower.follow(spec)
    assert follower.state(SourceKey("x", 1)) is not None
    follower.start()
    follower.forget("x")
    assert follower.state(SourceKey("x", 0)) is None
    follower.stop(timeout=5)
    follower.stop()  # twice is fine
    follower.follow(spec)  # after stop: nothing opens, nothing raises


# -- SGLang's own LoadStat and load socket -------------------------------------------------

_SGLANG_SENDER = """
import sys, time
import zmq
from sglang.srt.disaggregation.kv_events import LOAD_TOPIC
from sglang.srt.managers.scheduler_components import load_publisher as lp

sock = lp._open_pub_socket(sys.argv[1])
for seq in range(200):  # ~10 s of readings, as its heartbeat would re-send them
    stat = lp.LoadStat(num_running_reqs=5, num_waiting_reqs=2, num_tokens=640,
                       max_total_num_tokens=2048, attn_dp_rank=0,
                       num_waiting_uncached_tokens=96, num_total_tokens=900,
                       max_running_requests=48, total_prefill_uncached_tokens=4096,
                       total_prefill_busy_us=1234)
    sock.send_multipart((LOAD_TOPIC.encode(), seq.to_bytes(8, "big"), lp._encoder.encode(stat)))
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def sglang_python(request: pytest.FixtureRequest) -> str:
    return enginevenv.python(request.config, enginevenv.SGLANG)


@pytest.mark.interop
def test_sglang_own_load_stat_is_followed(sglang_python: str) -> None:
    port = free_port()
    sender = subprocess.Popen(
        [sglang_python, "-W", "ignore", "-c", textwrap.dedent(_SGLANG_SENDER),
         f"tcp://127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    follower = LoadFollower()
    try:
        spec = InstanceSpec.parse(f"s=tcp://127.0.0.1:{free_port()},load=tcp://127.0.0.1:{port}")
        follower.follow(spec)

        def read() -> bool:
            follower.step(timeout=0.1)
            state = follower.state(SourceKey("s", 0))
            return state is not None and state.reading is not None

        assert wait_until(read, timeout=45), sender.stderr.read() if sender.poll() else ""
        state = follower.state(SourceKey("s", 0))
        assert state is not None and state.reading is not None and state.malformed == 0
        assert state.reading.stat == LoadStat(5, 2, 640, 2048, 0, 96, 900, 48, 4096, 1234)
    finally:
        follower.stop()
        sender.kill()
        sender.wait(10)


def test_routing_score_weighs_the_load_stream() -> None:
    """Two SGLang engines holding the same prefix: /v1/route sends the prompt to the one
    whose load stream says it is idle, then to the other once the loads swap."""
    from kvindex.service.peers import install_peers  # noqa: F401 (the app installs it)
    from kvindex.wire import BlockStored

    with FakeSGLang() as busy, FakeSGLang() as idle:
        for fake in (busy, idle):
            fake.start_publishers(dp=1, load=True)
            fake.start_http()
        fleet = Fleet([InstanceSpec.parse(f"busy={busy.url}"),
                       InstanceSpec.parse(f"idle={idle.url}")])  # fmt: skip
        tokens = list(range(16))
        with TestClient(create_app(fleet)) as client:

            def ready() -> bool:
                for fake in (busy, idle):
                    fake.publishers[0].publish([BlockStored([7], None, tokens, 16, medium="GPU")])
                rows = client.get("/v1/instances").json()["instances"]
                return all(r["blocks"] == 1 for r in rows)

            assert wait_until(ready, timeout=15, step=0.1)

            def routed_to(name: str, loads: dict[str, int]) -> bool:
                for fake, running in ((busy, loads["busy"]), (idle, loads["idle"])):
                    fake.publish_load(0, load_stat(running, running, running * 10, 1000, 0))
                answer = client.post("/v1/route", json={"token_ids": tokens}).json()
                return bool(answer.get("best") == name)

            assert wait_until(lambda: routed_to("idle", {"busy": 60, "idle": 0}), step=0.1)
            assert wait_until(lambda: routed_to("busy", {"busy": 0, "idle": 60}), step=0.1)


def test_backlog_weighs_the_uncached_tokens_waiting_for_prefill() -> None:
    """`backlog` (off by default): two engines with the same prefix and the same request
    counts; the one whose load stream says less uncached prefill waits there wins, and the
    answer shows the part."""
    from kvindex.runtime.routing import Weights
    from kvindex.service.lookups import Routing
    from kvindex.wire import BlockStored

    with FakeSGLang() as slow, FakeSGLang() as quick:
        for fake in (slow, quick):
            fake.start_publishers(dp=1, load=True)
            fake.start_http()
        fleet = Fleet([InstanceSpec.parse(f"slow={slow.url}"),
                       InstanceSpec.parse(f"quick={quick.url}")])  # fmt: skip
        weights = Weights(backlog=3.0, queue=0, running=0, kv=0)
        routing = Routing.of(fleet, weights=weights)
        tokens = list(range(32))
        with TestClient(create_app(fleet, routing=routing)) as client:

            def ready() -> bool:
                for fake in (slow, quick):
                    fake.publishers[0].publish([BlockStored([7], None, tokens[:16], 16)])
                rows = client.get("/v1/instances").json()["instances"]
                return all(r["blocks"] == 1 for r in rows)

            assert wait_until(ready, timeout=15, step=0.1)

            def answer(waiting: dict[str, int]) -> dict[str, Any]:
                for fake, name in ((slow, "slow"), (quick, "quick")):
                    stat = load_stat(2, 2, 100, 1000, 0, extra=(waiting[name], 0, 0, 0))
                    fake.publish_load(0, stat)
                body: dict[str, Any] = client.post("/v1/lookup", json={"token_ids": tokens,
                                                   "score": True}).json()  # fmt: skip
                return body

            def quick_wins() -> bool:
                return answer({"slow": 4000, "quick": 400})["best"] == "quick"

            assert wait_until(quick_wins, step=0.1)
            rows = {r["name"]: r for r in answer({"slow": 4000, "quick": 400})["instances"]}
            # the prompt's own uncached 16 tokens are added to what waits there
            assert rows["quick"]["candidates"][0]["parts"]["backlog"] == 3.0
            slow_part = rows["slow"]["candidates"][0]["parts"]["backlog"]
            assert slow_part == pytest.approx(3.0 * 416 / 4016, abs=1e-6)
            assert wait_until(lambda: answer({"slow": 400, "quick": 4000})["best"] == "slow")
