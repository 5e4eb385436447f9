"""`NAME=sglang+http://HOST:PORT`: an SGLang engine's publishers read from its /server_info.

Against `sglang_fake.FakeSGLang` (a real HTTP server and real publishers on loopback,
answering as SGLang 0.5.23 does) and its faults, produced for real: the engine down at
start, restarted on new ports (and with another DP size), without KV events, answering
something that is not JSON, or wanting an API key.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from netutil import free_port, serve_url, wait_until
from service_workload import TestClient
from sglang_fake import FakeSGLang, load_stat

from kvindex.runtime import Fleet
from kvindex.service.app import create_app
from kvindex.subscriber import InstanceSpec, SpecError
from kvindex.subscriber.server_info import (
    DiscoveryError,
    Failure,
    KvEventsDescriptor,
    fetch_descriptor,
    resolve,
)
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine() -> Iterator[FakeSGLang]:
    with FakeSGLang() as fake:
        yield fake


def spec_of(fake: FakeSGLang, name: str = "sgl", options: str = "") -> InstanceSpec:
    return InstanceSpec.parse(f"{name}={fake.url}{options}")


# -- the spec ---------------------------------------------------------------------------------


def test_spec_names_the_engine_by_url_and_renders_it_back() -> None:
    spec = InstanceSpec.parse("sgl=sglang+http://10.0.0.5:30000,api_key_env=SGL_KEY")
    assert spec.pending and spec.sources() == [] and spec.dp == 0
    assert spec.base_url == "http://10.0.0.5:30000"
    assert spec.render() == "sgl=sglang+http://10.0.0.5:30000,api_key_env=SGL_KEY"
    assert InstanceSpec.parse("s=sglang+https://[::1]:8443/").url_host == "[::1]"
    plain = InstanceSpec.parse("v=tcp://h:5557,dp=2,load=tcp://h:5560")
    assert [ep for _, ep in plain.load_sources()] == ["tcp://h:5560", "tcp://h:5561"]
    assert InstanceSpec.parse(plain.render()) == plain


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("s=sglang+http://h", "sglang+http://HOST:PORT"),
        ("s=sglang+http://h:99999", "not a TCP port"),
        ("s=sglang+ftp://h:1", "not a ZMQ endpoint"),
        ("s=sglang+http://h:1,dp=2", "unknown option 'dp=2'"),
        ("s=sglang+http://h:1,api_key=secret", "unknown option 'api_key=secret'"),
        ("s=sglang+http://h:1,api_key_env=A,api_key_file=f", "not both"),
        ("s=sglang+http://h:1,api_key_env=1BAD", "not an environment variable"),
        ("s=tcp://h:1,api_key_env=K", "unknown option"),
    ],
)
def test_bad_specs_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(SpecError, match=says.replace("(", r"\(").replace("+", r"\+")):
        InstanceSpec.parse(text)


# -- reading /server_info -------------------------------------------------------------------


def test_descriptor_of_a_wildcard_host_dials_the_url_host(engine: FakeSGLang) -> None:
    engine.start_publishers(dp=2, load=True, block_size=1)
    engine.start_http()
    spec = spec_of(engine)
    found = resolve(spec, fetch_descriptor(spec))
    base = engine.descriptor["endpoint_port_base"]
    assert found.endpoint == f"tcp://127.0.0.1:{base}" and found.dp == 2
    replay = engine.descriptor["replay_endpoint_port_base"]
    assert found.replay_endpoint == f"tcp://127.0.0.1:{replay}"
    load = engine.descriptor["load_endpoint_port_base"]
    assert (found.load_endpoint, found.load_topic) == (f"tcp://127.0.0.1:{load}", "load")
    assert found.block_size == 1 and not found.pending
    assert [s.endpoint for s in found.sources()] == [
        f"tcp://127.0.0.1:{base}",
        f"tcp://127.0.0.1:{base + 1}",
    ]
    assert found.render() == spec.render()  # a persisted spec is discovered again


@pytest.mark.parametrize(
    ("host", "dialled"),
    [("*", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("10.1.2.3", "10.1.2.3"),
     ("fd00::5", "[fd00::5]")],
)  # fmt: skip
def test_advertised_hosts(host: str, dialled: str) -> None:
    spec = InstanceSpec.parse("s=sglang+http://127.0.0.1:30000")
    desc = KvEventsDescriptor("zmq", host, 5557, replay_endpoint_port_base=5558)
    found = resolve(spec, desc)
    assert found.endpoint == f"tcp://{dialled}:5557"
    assert found.replay_endpoint == f"tcp://{dialled}:5558" and found.load_endpoint is None


def failure(spec: InstanceSpec) -> DiscoveryError:
    with pytest.raises(DiscoveryError) as caught:
        resolve(spec, fetch_descriptor(spec, timeout=2))
    assert "\n" not in str(caught.value)
    return caught.value


def test_every_way_a_read_fails_is_one_line(engine: FakeSGLang, tmp_path: Path) -> None:
    spec = spec_of(engine)
    down = failure(spec)  # nothing listens yet
    assert down.failure == Failure.DOWN and "does not answer" in str(down)
    engine.start_publishers()
    engine.start_http()
    engine.publishing = False
    off = failure(spec)
    assert off.failure == Failure.NO_KV_EVENTS and "--kv-events-config" in str(off)
    engine.publishing = True
    engine.raw = b"<html>not json</html>"
    assert failure(spec).failure == Failure.BAD_ANSWER
    engine.raw = b'{"model_path": "x"}'  # no kv_events key at all: an older SGLang
    assert "no kv_events key" in str(failure(spec))
    engine.raw = b'{"kv_events": {"publisher": "zmq", "endpoint_port_base": "x"}}'
    assert failure(spec).failure == Failure.BAD_ANSWER
    engine.raw, engine.status = b'{"error": "boom"}', 500
    assert "HTTP 500" in str(failure(spec))
    engine.raw, engine.status = None, 200
    engine.descriptor["endpoint_port_base"] = 65535
    engine.descriptor["dp_size"] = 4
    assert "past port 65535" in str(failure(spec))


def test_api_key_by_env_or_file_never_on_the_command_line(
    engine: FakeSGLang, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.api_key = "s3cret"
    engine.start_publishers()
    engine.start_http()
    missing = failure(spec_of(engine))
    assert missing.failure == Failure.API_KEY and "wants an API key" in str(missing)
    monkeypatch.setenv("SGL_KEY", "wrong")
    refused = failure(spec_of(engine, options=",api_key_env=SGL_KEY"))
    assert "refused the API key (HTTP 401)" in str(refused) and "wrong" not in str(refused)
    monkeypatch.setenv("SGL_KEY", "s3cret")
    spec = spec_of(engine, options=",api_key_env=SGL_KEY")
    assert not resolve(spec, fetch_descriptor(spec)).pending
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    spec = spec_of(engine, options=f",api_key_file={key}")
    assert not resolve(spec, fetch_descriptor(spec)).pending
    unread = failure(spec_of(engine, options=f",api_key_file={tmp_path / 'none'}"))
    assert unread.failure == Failure.API_KEY and "can't read" in str(unread)
    monkeypatch.delenv("SGL_KEY")
    assert "is not set" in str(failure(spec_of(engine, options=",api_key_env=SGL_KEY")))


# -- the fleet follows what it reads -------------------------------------------------------


def instance(client: TestClient, name: str = "sgl") -> dict[str, Any]:
    rows = client.get("/v1/instances").json()["instances"]
    row: dict[str, Any] = next(r for r in rows if r["name"] == name)
    return row


def stored(h: int, tokens: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored([h], parent, tokens, len(tokens), medium="GPU")


def test_engine_down_at_start_is_connecting_then_followed(engine: FakeSGLang) -> None:
    fleet = Fleet([spec_of(engine)])
    with TestClient(create_app(fleet)) as client:
        assert wait_until(lambda: instance(client)["problem"] is not None)
        row = instance(client)
        assert row["status"] == "connecting" and row["ranks"] == []
        assert "does not answer" in row["problem"] and row["discovery"]["resolved"] is False
        assert row["spec"] == f"sgl={engine.url}"
        engine.start_publishers(dp=2)
        engine.publishers[0].publish([stored(11, [1, 2, 3, 4])])
        engine.publishers[1].publish([stored(12, [5, 6, 7, 8])])
        engine.start_http()  # the engine comes up: found at the next retry (1 s)
        assert wait_until(lambda: instance(client)["blocks"] == 2, timeout=15)
        row = instance(client)
        assert row["status"] == "live" and row["dp"] == 2 and row["problem"] is None
        assert row["discovery"]["resolved"] and row["discovery"]["block_size"] == 16
        assert row["endpoint"] == f"tcp://127.0.0.1:{engine.descriptor['endpoint_port_base']}"
        answer = client.post("/v1/lookup", json={"token_ids": [5, 6, 7, 8]}).json()
        assert answer["best"] == "sgl" and answer["instances"][0]["best_rank"] == 1


def test_restart_on_new_ports_is_followed(engine: FakeSGLang) -> None:
    """The engine restarts with another DP size on other ports: the seq goes back / the
    link goes down, kvindex reads /server_info again and follows the new publishers; what
    the old process held is gone, what the new one publishes is there."""
    engine.start_publishers(dp=1)
    engine.start_http()
    fleet = Fleet([spec_of(engine)])
    with TestClient(create_app(fleet)) as client:
        assert wait_until(lambda: instance(client)["status"] == "live", timeout=15)
        engine.publishers[0].publish([stored(1, [1, 2, 3, 4])])
        assert wait_until(lambda: instance(client)["blocks"] == 1)
        old_port = engine.descriptor["endpoint_port_base"]
        engine.restart(dp=2)
        assert engine.descriptor["endpoint_port_base"] != old_port
        for rank, pub in enumerate(engine.publishers):
            pub.publish([stored(100 + rank, [9, 9, 9, rank])])

        def moved() -> bool:
            row = instance(client)
            return row["dp"] == 2 and row["status"] == "live" and row["blocks"] == 2

        assert wait_until(moved, timeout=20), instance(client)
        held = client.get("/v1/instances/sgl/blocks").json()["block_hashes"]
        assert held == ["100", "101"]  # the old engine's block went with it
        assert instance(client)["discovery"]["reads"] >= 2


def test_server_info_is_read_again_while_well_and_unchanged_ranks_stay(
    engine: FakeSGLang,
) -> None:
    """No restart, no link trouble: the engine gains a DP rank, switches its load stream
    on, then loses two ranks. The periodic read follows each change; the ranks whose
    publisher did not change keep what is indexed without asking for it again (no new
    replay), the ranks gone are dropped (hooks see them restarted)."""
    engine.start_publishers(dp=2, spare=1)
    engine.start_http()
    fleet = Fleet([spec_of(engine)], discovery_interval=0.3)
    restarted: list[Any] = []
    fleet.on_item.append(
        lambda item: restarted.append(item.source) if "Restarted" in type(item).__name__ else None
    )
    with TestClient(create_app(fleet)) as client:
        assert wait_until(lambda: instance(client)["status"] == "live", timeout=15)
        for rank, pub in enumerate(engine.publishers):
            pub.publish([stored(10 + rank, [1, 2, 3, rank])])
        assert wait_until(lambda: instance(client)["blocks"] == 2)
        replays = [pub.replays_served for pub in engine.publishers]

        engine.add_rank().publish([stored(12, [1, 2, 3, 2])])
        grown = lambda: instance(client)["dp"] == 3 and instance(client)["blocks"] == 3  # noqa: E731
        assert wait_until(grown, timeout=10), instance(client)
        assert [pub.replays_served for pub in engine.publishers[:2]] == replays
        assert restarted == []

        engine.start_load()

        def loaded() -> bool:  # a gauge re-sent, as SGLang does, until it is read
            for rank in range(3):
                engine.publish_load(rank, load_stat(rank, 0, 100, 1000, rank))
            return all(r["load"] and r["load"]["readings"] for r in instance(client)["ranks"])

        assert wait_until(loaded, timeout=10), instance(client)
        assert instance(client)["blocks"] == 3

        engine.drop_ranks(1)
        shrunk = lambda: instance(client)["dp"] == 1 and instance(client)["blocks"] == 1  # noqa: E731
        assert wait_until(shrunk, timeout=10), instance(client)
        assert client.get("/v1/instances/sgl/blocks").json()["block_hashes"] == ["10"]
        assert engine.publishers[0].replays_served == replays[0]
        assert sorted(restarted) == [("sgl", 1), ("sgl", 2)]
        assert instance(client)["discovery"]["reads"] >= 3


def test_no_periodic_read_with_interval_zero(engine: FakeSGLang) -> None:
    engine.start_publishers(dp=1, spare=1)
    engine.start_http()
    fleet = Fleet([spec_of(engine)], discovery_interval=0)
    with TestClient(create_app(fleet)) as client:
        assert wait_until(lambda: instance(client)["status"] == "live", timeout=15)
        seen = engine.requests
        engine.add_rank()
        time.sleep(1.5)
        assert engine.requests == seen and instance(client)["dp"] == 1


def test_post_instances_by_url(engine: FakeSGLang) -> None:
    with TestClient(create_app(Fleet())) as client:
        down = client.post("/v1/instances", json={"spec": f"sgl={engine.url}"})
        assert down.status_code == 201 and down.json()["status"] == "connecting"
        assert client.delete("/v1/instances/sgl").status_code == 204
        engine.start_publishers()
        engine.start_http()
        engine.publishing = False
        off = client.post("/v1/instances", json={"spec": f"sgl={engine.url}"})
        assert off.status_code == 422 and "--kv-events-config" in off.json()["error"]
        assert client.get("/v1/instances").json()["instances"] == []
        engine.publishing = True
        added = client.post("/v1/instances", json={"spec": f"sgl={engine.url}"})
        assert added.status_code == 201, added.text
        port = engine.descriptor["endpoint_port_base"]
        assert added.json()["endpoint"] == f"tcp://127.0.0.1:{port}"
        again = client.post("/v1/instances", json={"spec": f"sgl={engine.url}"})
        assert again.status_code == 409
        engine.api_key = "k"
        keyless = client.post("/v1/instances", json={"spec": f"other={engine.url}"})
        assert keyless.status_code == 422 and "API key" in keyless.json()["error"]


# -- kvindex serve ----------------------------------------------------------------------------


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--store", "memory",
         *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )  # fmt: skip


def test_serve_refuses_an_engine_without_kv_events_in_one_line(engine: FakeSGLang) -> None:
    engine.start_publishers()
    engine.start_http()
    engine.publishing = False
    proc = serve("--instance", f"sgl={engine.url}")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and out == ""
    assert err.count("\n") == 1 and "--kv-events-config" in err and "instance sgl" in err


def test_serve_starts_with_the_engine_down_and_finds_it(engine: FakeSGLang, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k\n")
    engine.api_key = "k"
    proc = serve("--instance", f"sgl={engine.url},api_key_file={key}")
    try:
        assert proc.stderr is not None
        url = serve_url(proc)
        warning = proc.stderr.readline()
        assert "WARNING sgl:" in warning and "does not answer" in warning
        with httpx.Client(base_url=url, timeout=5) as client:
            row = client.get("/v1/instances").json()["instances"][0]
            assert row["status"] == "connecting"
            engine.start_publishers()
            engine.publishers[0].publish([stored(7, [1, 2, 3, 4])])
            engine.start_http()

            def found() -> bool:
                row = client.get("/v1/instances").json()["instances"][0]
                return bool(row["status"] == "live" and row["blocks"] == 1)

            assert wait_until(found, timeout=15)
    finally:
        proc.terminate()
        proc.wait(10)


def test_config_file_names_an_engine_by_url(engine: FakeSGLang, tmp_path: Path) -> None:
    engine.api_key = "k"
    engine.start_publishers(dp=2)
    engine.start_http()
    config = tmp_path / "kvindex.toml"
    config.write_text(
        f'[[instances]]\nname = "sgl"\nendpoint = "{engine.url}"\napi_key_env = "SGL_KEY"\n'
    )
    proc = serve("--config", str(config), env={"SGL_KEY": "k"})
    try:
        url = serve_url(proc)
        row = httpx.get(url + "v1/instances", timeout=5).json()["instances"][0]
        assert row["dp"] == 2 and row["spec"] == f"sgl={engine.url},api_key_env=SGL_KEY"
    finally:
        proc.terminate()
        proc.wait(10)
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[[instances]]\nname = "sgl"\nendpoint = "{engine.url}"\ndp = 2\n')
    proc = serve("--config", str(bad))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "instances[0]" in err and "'dp'" in err


def test_the_fake_engine_picks_other_ports_when_its_first_are_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A port found free can be taken before the fake engine binds it (the membership
    stress test's engine restart failed so, 'Address already in use', and never came
    back): it picks again. A Publisher whose replay port is taken keeps nothing bound."""
    import socket

    import sglang_fake

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    real = sglang_fake.free_ports
    picks = iter([port, port, port])  # live, replay, load: all on the taken port first
    monkeypatch.setattr(sglang_fake, "free_ports", lambda n: next(picks, None) or real(n))
    live = free_port()
    # The error kept (as a caller that retries or logs it keeps it) keeps the half-made
    # Publisher alive through its traceback: its live socket must be closed all the same.
    with pytest.raises(zmq.ZMQError) as failed:
        Publisher(f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{port}")

    def bindable(port: int) -> bool:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    # The live port is let go (libzmq's I/O thread unbinds a closed socket a moment later).
    assert wait_until(lambda: bindable(live), 5), failed
    engine = FakeSGLang()
    try:
        engine.start_publishers(1)
        assert engine.descriptor["endpoint_port_base"] != port
        assert len(engine.publishers) == 1
    finally:
        engine.close()
        taken.close()
