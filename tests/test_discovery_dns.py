"""`--discover dns:HOST:PORT`: engines found through a real `dnsmasq` on loopback.

The engines are real publishers bound to 127.0.0.2, .3, .4 on one port (as pods behind a
headless Service are), the names served by dnsmasq (tests/dnsmasq.py) and changed as the
test goes: engines join and leave with the answer, each one's index stays exactly what its
publisher's pool holds, a server that stops answering changes nothing, NXDOMAIN empties the
set, SRV records name their own ports. Then `kvindex serve` itself, with its start gate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from clitools import kvindex
from dnsmasq import Dnsmasq
from ipengine import Engine, exact
from netutil import free_port, free_ports, wait_until

from kvindex.runtime import Fleet
from kvindex.runtime.finders import Reconciler, finder_of
from kvindex.runtime.finders.dnsfind import DnsFinder, dns_server, parse_dns

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    with Dnsmasq(tmp_path / "dns") as server:
        yield server


def test_parse_says_what_is_wrong() -> None:
    target = parse_dns("dns:vllm.inference.svc.cluster.local:6000?replay=none&dp=2&http=8000")
    assert (target.host, target.port, target.replay_port(6000)) == (
        "vllm.inference.svc.cluster.local",
        6000,
        None,
    )
    assert parse_dns("dns:engines.test").port == 5557
    assert parse_dns("dns:engines.test").replay_port(5557) == 5558
    assert parse_dns("dns:engines.test?replay=7000").replay_port(5557) == 7000
    for bad, says in [
        ("dns::5557", "dns:HOST"),
        ("dns:h:99999", "port"),
        ("dns:h?dp=0", "dp must be"),
        ("dns:h?replay=x", "replay"),
        ("dns:h?colour=red", "unknown option 'colour'"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_dns(bad)
    assert dns_server("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert dns_server("10.0.0.10") == ("10.0.0.10", 53)
    with pytest.raises(ValueError, match="k8s: or dns:"):
        finder_of("consul:x", Reconciler(Fleet(ingest_workers=1)), interval=1)


def test_engines_join_and_leave_with_the_answer(dnsmasq: Dnsmasq) -> None:
    port = free_ports(2)
    engines = {ip: Engine(ip, port, seed) for seed, ip in enumerate(["127.0.0.2", "127.0.0.3"])}
    names = {ip: f"fleet.test@{ip}:{port}" for ip in ["127.0.0.2", "127.0.0.3", "127.0.0.4"]}
    dnsmasq.hosts({"fleet.test": ["127.0.0.2", "127.0.0.3"]})
    fleet = Fleet(ingest_workers=1)
    reconciler = Reconciler(fleet)
    target = parse_dns(f"dns:fleet.test:{port}")
    finder = DnsFinder(target, reconciler, interval=0.1, server=("127.0.0.1", dnsmasq.port))
    reconciler.finders.append(finder)
    asyncio.run(fleet.start())
    reconciler.start()
    try:
        assert wait_until(lambda: set(fleet.specs) == {names["127.0.0.2"], names["127.0.0.3"]})
        spec = fleet.specs[names["127.0.0.2"]]
        assert (spec.endpoint, spec.replay_endpoint) == (
            f"tcp://127.0.0.2:{port}",
            f"tcp://127.0.0.2:{port + 1}",
        )
        assert fleet.instance_view(names["127.0.0.3"]).found == fleet.found[names["127.0.0.3"]]
        assert fleet.found[names["127.0.0.3"]].how == "dns"
        time.sleep(0.3)  # the SUB sockets connect
        for engine in engines.values():
            engine.work()
        for ip, engine in engines.items():
            assert wait_until(lambda ip=ip, e=engine: exact(fleet, names[ip], e)), ip

        # .3 leaves the answer: removed with its blocks; .4 joins and is followed exactly
        engines["127.0.0.4"] = Engine("127.0.0.4", port, 7)
        dnsmasq.hosts({"fleet.test": ["127.0.0.2", "127.0.0.4"]})
        # The removal drops the spec first, then the index's blocks, and the reconciler
        # writes its history once the removal returned: wait for all three.
        assert wait_until(lambda: set(fleet.specs) == {names["127.0.0.2"], names["127.0.0.4"]})
        assert wait_until(lambda: names["127.0.0.3"] not in fleet.index.instances())
        assert wait_until(lambda: any(c.change == "removed" for c in reconciler.history))
        removed = [c for c in reconciler.history if c.change == "removed"]
        assert [(c.name, c.why) for c in removed] == [
            (names["127.0.0.3"], "gone from fleet.test's answer")
        ]
        time.sleep(0.3)
        for ip in ("127.0.0.2", "127.0.0.4"):
            engines[ip].work()
        for ip in ("127.0.0.2", "127.0.0.4"):
            assert wait_until(lambda ip=ip: exact(fleet, names[ip], engines[ip])), ip

        # the server stops answering: nothing changes, the problem is said; it comes back
        dnsmasq.stop()
        rounds = finder.rounds
        assert wait_until(lambda: finder.problem is not None, 10)
        assert "engines kept" in (finder.problem or "")
        assert set(fleet.specs) == {names["127.0.0.2"], names["127.0.0.4"]}
        assert finder.rounds == rounds
        engines["127.0.0.2"].work()
        assert wait_until(lambda: exact(fleet, names["127.0.0.2"], engines["127.0.0.2"]))
        dnsmasq.start()
        assert wait_until(lambda: finder.rounds > rounds and finder.problem is None, 10)
        assert set(fleet.specs) == {names["127.0.0.2"], names["127.0.0.4"]}

        # the name is gone (NXDOMAIN): every engine it found is removed
        dnsmasq.hosts({"other.test": ["127.0.0.9"]})
        assert wait_until(lambda: not fleet.specs)
        assert wait_until(lambda: not fleet.index.instances())  # just after the specs
        # counted on the finder's thread just after the fleet let go of the instance
        assert wait_until(lambda: reconciler.removed == 3)
        assert reconciler.added == 3
    finally:
        reconciler.stop()
        asyncio.run(fleet.stop())
        for engine in engines.values():
            engine.close()


def test_srv_records_name_their_ports(dnsmasq: Dnsmasq) -> None:
    base = free_ports(4)
    engines = [Engine("127.0.0.1", base, 1), Engine("127.0.0.1", base + 2, 2)]
    dnsmasq.srv(
        [("_kv._tcp.fleet.test", "e0.test", base), ("_kv._tcp.fleet.test", "e1.test", base + 2)],
        {"e0.test": "127.0.0.1", "e1.test": "127.0.0.1"},
    )
    fleet = Fleet(ingest_workers=1)
    reconciler = Reconciler(fleet)
    finder = DnsFinder(
        parse_dns("dns:_kv._tcp.fleet.test"),
        reconciler,
        interval=0.1,
        server=("127.0.0.1", dnsmasq.port),
    )
    reconciler.finders.append(finder)
    names = [f"e0.test@127.0.0.1:{base}", f"e1.test@127.0.0.1:{base + 2}"]
    asyncio.run(fleet.start())
    reconciler.start()
    try:
        assert wait_until(lambda: sorted(fleet.specs) == sorted(names))
        assert fleet.found[names[1]].dns_name == "e1.test"
        time.sleep(0.3)
        for engine in engines:
            engine.work()
        for name, engine in zip(names, engines, strict=True):
            assert wait_until(lambda n=name, e=engine: exact(fleet, n, e)), name
        # one record goes: its engine goes with it
        dnsmasq.srv([("_kv._tcp.fleet.test", "e0.test", base)], {"e0.test": "127.0.0.1"})
        assert wait_until(lambda: list(fleet.specs) == names[:1])
    finally:
        reconciler.stop()
        asyncio.run(fleet.stop())
        for engine in engines:
            engine.close()


def test_serve_waits_for_min_engines_and_shows_how_each_was_found(
    dnsmasq: Dnsmasq, tmp_path: Path
) -> None:
    port = free_ports(2)
    engines = [Engine("127.0.0.2", port, 1)]
    dnsmasq.hosts({"fleet.test": ["127.0.0.2"]})
    config = tmp_path / "kvindex.toml"
    config.write_text(
        f'[server]\ndiscover = ["dns:fleet.test:{port}"]\ndns_server = "{dnsmasq.server}"\n'
        "discovery_interval = 0.2\n[routing]\nmin_engines = 2\n",
        encoding="utf-8",
    )
    http = free_port()
    proc = kvindex(
        "serve", "--config", str(config), "--store", "memory", "--http", f"127.0.0.1:{http}"
    )
    url = f"http://127.0.0.1:{http}"
    try:
        proc.listening_url(timeout=30)
        assert wait_until(lambda: len(httpx.get(f"{url}/v1/instances").json()["instances"]) == 1)
        health = httpx.get(f"{url}/healthz")
        assert health.status_code == 503
        assert health.json() == {
            "status": "starting",
            "reason": "1 of min_engines 2 found engines live",
        }
        engines.append(Engine("127.0.0.3", port, 2))
        dnsmasq.hosts({"fleet.test": ["127.0.0.2", "127.0.0.3"]})
        assert wait_until(lambda: httpx.get(f"{url}/healthz").status_code == 200, 15)
        answer = httpx.get(f"{url}/v1/instances").json()
        found = {i["name"]: i["found"] for i in answer["instances"]}
        assert found[f"fleet.test@127.0.0.3:{port}"] == {
            "how": "dns",
            "source": f"dns:fleet.test:{port}",
            "address": f"127.0.0.3:{port}",
            "dns_name": "fleet.test",
        }
        assert [(c["name"], c["change"]) for c in answer["history"]] == [
            (f"fleet.test@127.0.0.2:{port}", "added"),
            (f"fleet.test@127.0.0.3:{port}", "added"),
        ]
        metrics = httpx.get(f"{url}/metrics").text.splitlines()
        assert 'kvindex_engines_found{how="dns"} 2.0' in metrics
        assert 'kvindex_discovery_changes_total{change="added"} 2.0' in metrics
        assert "kvindex_engine_sleep_resets_total 0.0" in metrics
        # the gate stays open when the fleet shrinks: a router keeps this replica
        dnsmasq.hosts({"fleet.test": ["127.0.0.2"]})
        assert wait_until(lambda: len(httpx.get(f"{url}/v1/instances").json()["instances"]) == 1)
        assert httpx.get(f"{url}/healthz").json()["status"] == "ok"
        assert any("fleet.test@127.0.0.3" in line and "removed" in line for line in proc.err)
        proc.interrupt()
        assert proc.finish(15) == 0
    finally:
        proc.kill()
        for engine in engines:
            engine.close()


def test_bad_discover_values_are_one_line_errors() -> None:
    proc = kvindex(
        "serve", "--store", "memory", "--http", "127.0.0.1:0", "--discover", "dns:h?dp=x"
    )
    assert proc.finish(20) == 2
    assert any("dp must be 1 to 256" in line for line in proc.err), proc.err
    proc = kvindex("serve", "--store", "memory", "--http", "127.0.0.1:0", "--min-engines", "2")
    assert proc.finish(20) == 2
    assert any("--min-engines counts engines found by --discover" in line for line in proc.err)


def test_demo_finds_its_engines_through_a_real_dnsmasq() -> None:
    """`make demo`: the vLLM engines are found through DNS (a dnsmasq the demo runs), the
    last one joining the answer later; the SGLang one is named by its URL."""
    proc = kvindex(
        "demo", "--http", "127.0.0.1:0", "--instances", "2", "--sglang", "0",
        "--join-after", "2", "--duration", "30",
    )  # fmt: skip
    try:
        line = proc.wait_for(proc.out, lambda s: "dashboard at" in s, timeout=30)
        url = line.split("dashboard at ")[1].split()[0].rstrip("/")
        assert any("found through DNS: --discover dns:_kvevents._tcp" in s for s in proc.out)

        def found() -> dict[str, Any]:
            return {
                i["name"]: i["found"] for i in httpx.get(f"{url}/v1/instances").json()["instances"]
            }

        assert wait_until(lambda: len(found()) == 1, 15)
        assert wait_until(lambda: len(found()) == 2, 15)  # vllm-1 joined the answer
        for name, how in found().items():
            assert name.startswith(("vllm-0.demo.kvindex.test@127.0.0.1:", "vllm-1.demo"))
            assert how["how"] == "dns" and how["dns_name"] == name.split("@")[0]
        history = httpx.get(f"{url}/v1/instances").json()["history"]
        assert [c["change"] for c in history] == ["added", "added"]
        assert wait_until(
            lambda: all(
                i["blocks"] > 0 for i in httpx.get(f"{url}/v1/instances").json()["instances"]
            ),
            15,
        )
        proc.interrupt()
        assert proc.finish(20) == 0
    finally:
        proc.kill()
