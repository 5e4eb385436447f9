"""Issue 28, finding 4: an API client's spec makes kvindex connect only to engine hosts on
the allow-list (kvindex.security.engines): endpoints, `http=`, `metrics=`, an SGLang URL,
and every call of the tokenizer delegation and the metrics scraper. Real serve processes
and a capture listener on 127.0.0.1. Every host that is allowed (and so connected to) is
on the loopback; hosts elsewhere only ever appear in specs that must be refused (and
192.0.2.0/24 is the documentation range)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from clitools import Proc, kvindex
from netutil import free_port
from test_secrets_from_clients import CaptureListener

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def listener() -> Iterator[CaptureListener]:
    capture = CaptureListener()
    yield capture
    capture.close()


def serve(*args: str) -> tuple[Proc, str]:
    proc = kvindex("serve", "--store", "memory", "--http", "127.0.0.1:0", *args)
    return proc, proc.listening_url()


def stop(proc: Proc) -> None:
    proc.interrupt()
    assert proc.finish() == 0


def test_metrics_and_http_to_a_host_off_the_list_are_refused(listener: CaptureListener) -> None:
    # `metrics=` was fetched every scrape interval from any host and path a client named.
    here = f"127.0.0.1:{listener.port}"
    proc, url = serve("--engine-hosts", "127.0.0.2,localhost")
    other = f"127.0.0.2:{free_port()}"  # allowed: nothing listens there
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            for spec in [
                f"a=tcp://{other},metrics=http://{here}/latest/meta-data",
                f"a=tcp://{other},http=http://{here}",
                f"a=tcp://{here}",
                f"a=tcp://{other},replay=tcp://{here}",
                f"a=sglang+http://{here}",
                f"a=tcp://{other},http=http://[::ffff:127.0.0.1]:{listener.port}",
                f"a=tcp://{other},http=http://2130706433:8000",  # 127.0.0.1 by inet_aton
                f"a=tcp://{other},http=http://localhost.evil.test:8000",
                "a=tcp://192.0.2.1:5557",
            ]:
                r = c.post("/v1/instances", json={"spec": spec})
                assert r.status_code == 400, (spec, r.text)
                assert "not an engine host" in r.json()["error"], r.text
            # a trailing `?` would make the `/tokenize` appended a query on the client's path
            for spec in [
                f"a=tcp://{other},http=http://127.0.0.2:8000/admin?",
                f"a=tcp://{other},metrics=http://user@127.0.0.2:8000/m",
                f"a=tcp://{other},http=http://127.0.0.2:8000/x#frag",
            ]:
                r = c.post("/v1/instances", json={"spec": spec})
                assert r.status_code == 400 and "query" in r.json()["error"], (spec, r.text)
            r = c.post("/register", json={
                "instance_id": 1, "dp_rank": 0, "endpoint": f"tcp://{here}",
                "model_name": "m", "block_size": 16,
            })  # fmt: skip
            assert r.status_code == 400, r.text
            allowed = f"a=tcp://{other},http=http://localhost:{free_port()}"
            assert c.post("/v1/instances", json={"spec": allowed}).status_code == 201
            time.sleep(1.5)  # a scrape interval: nothing reaches the listener
    finally:
        stop(proc)
    assert listener.connections == 0 and not listener.received


def test_by_default_the_loopback_and_the_configured_engines_hosts_are_allowed() -> None:
    proc, url = serve()  # the API on the loopback: the loopback is allowed
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            r = c.post("/v1/instances", json={"spec": f"a=tcp://127.0.0.1:{free_port()}"})
            assert r.status_code == 201, r.text
            r = c.post("/v1/instances", json={"spec": "b=tcp://192.0.2.1:5557"})
            assert r.status_code == 400 and "not an engine host" in r.json()["error"]
    finally:
        stop(proc)
    # an explicit list replaces the loopback; a configured engine's hosts are always in
    configured = f"cfg=tcp://127.0.0.3:{free_port()},http=http://localhost:{free_port()}"
    proc, url = serve("--engine-hosts", "127.0.0.2", "--instance", configured)
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            for spec, status in [
                (f"a=tcp://127.0.0.2:{free_port()}", 201),  # listed
                (f"b=tcp://127.0.0.3:{free_port()}", 201),  # a configured engine's host
                (f"c=tcp://127.0.0.2:{free_port()},http=http://localhost:{free_port()}", 201),
                (f"d=tcp://127.0.0.1:{free_port()}", 400),  # the loopback is no longer in
                ("e=tcp://db.internal:5432", 400),  # a name no one listed
            ]:
                r = c.post("/v1/instances", json={"spec": spec})
                assert r.status_code == status, (spec, r.text)
    finally:
        stop(proc)


def test_serve_refuses_a_bad_engine_host_entry_in_one_line() -> None:
    proc = kvindex("serve", "--store", "memory", "--http", "127.0.0.1:0", "--engine-hosts", "a b")
    assert proc.finish(30) == 2 and len(proc.err) == 1 and "engine-hosts" in proc.err[0]


def test_engine_hosts_entries_sources_and_call_time_checks(listener: CaptureListener) -> None:
    from kvindex.runtime.tokenize import EngineTokenizer, TokenizeFailed
    from kvindex.security.engines import EngineHosts, engine_hosts

    hosts = EngineHosts(["10.0.0.0/8", "*.svc.cluster.local", "vllm-0"])
    assert hosts.allows("10.2.3.4") and hosts.allows("[::ffff:10.2.3.4]")
    assert hosts.allows("a.ns.svc.cluster.local") and hosts.allows("VLLM-0.")
    assert not hosts.allows("svc.cluster.local.evil") and not hosts.allows("127.0.0.1")
    assert not hosts.allows("167772161")  # 10.0.0.1 as one number: a name, not listed
    hosts.add("10.9.9.9", "discovery")
    hosts.add("pod-1.example", "discovery")
    hosts.add("pod-1.example", "config")
    hosts.remove("pod-1.example", "discovery")
    assert hosts.allows("pod-1.example")  # the config still holds it
    hosts.remove("pod-1.example", "config")
    assert not hosts.allows("pod-1.example")
    with pytest.raises(ValueError):
        hosts.add("not a host")
    # The tokenizer delegation asks the list at every call: a host dropped is not called.
    here = f"http://127.0.0.1:{listener.port}"
    engine_hosts.install(EngineHosts(["127.0.0.2"]))
    try:
        tok = EngineTokenizer("m", lambda: [here])
        with pytest.raises(TokenizeFailed) as err:
            tok.encode_prompt("hello")
        assert err.value.status == 503 and "allowed engine host" in str(err.value)
        tok.close()
    finally:
        engine_hosts.install(None)
    assert listener.connections == 0


def test_engines_discovery_finds_join_the_list_while_they_are_found() -> None:
    # Issue 24's finders add engines directly; their hosts must be on the list for as
    # long as they are found (their http= is scraped and asked to tokenize), no longer.
    import asyncio

    from kvindex.runtime import Fleet
    from kvindex.runtime.finders.reconcile import Found, FoundBy, Reconciler
    from kvindex.security.engines import EngineHosts, engine_hosts
    from kvindex.subscriber import InstanceSpec

    hosts = EngineHosts(["127.0.0.1"])
    hosts.add("127.0.0.20", "config")  # an operator's engine on a host a pod shares
    engine_hosts.install(hosts)
    fleet = Fleet(ingest_workers=1)
    reconciler = Reconciler(fleet)
    asyncio.run(fleet.start())
    try:
        port = free_port()
        found = {}
        for ip in ("127.0.0.7", "127.0.0.20"):
            spec = InstanceSpec(
                f"pods@{ip}", f"tcp://{ip}:{port}", http=f"http://pod-{ip[-1]}.ns.svc:8000"
            )
            found[spec.name] = Found(spec, FoundBy("dns", "dns:pods:1", f"{ip}:{port}"))
        reconciler.replace("dns:pods", found)
        assert set(fleet.specs) == set(found)
        assert hosts.allows("127.0.0.7") and hosts.allows("pod-7.ns.svc")
        assert engine_hosts.allows_url("http://pod-7.ns.svc:8000/metrics")
        reconciler.replace("dns:pods", {})
        assert not fleet.specs
        assert not hosts.allows("127.0.0.7") and not hosts.allows("pod-7.ns.svc")
        assert hosts.allows("127.0.0.20")  # still the operator's
    finally:
        engine_hosts.install(None)
        asyncio.run(fleet.stop())
