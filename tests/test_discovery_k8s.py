"""`--discover 'k8s:NAMESPACE?selector=LABELS'`: engines that are pods, through the official
client library against tests/kubeapi.py (a real HTTP server speaking the API's list/watch
protocol: chunked watch streams, resource versions, bookmarks, 410 Gone, dropped
connections; pods validated by the Kubernetes schema).

The engines are real publishers on 127.0.0.x; the pods point at them. Pods become Ready,
lose readiness, change IP, are replaced under the same name (a new UID: a new engine whose
old blocks must not survive), are deleted while the watch is down and the history compacted
(a relist must find it); each engine's index stays exactly its publisher's pool.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from clitools import kvindex
from ipengine import Engine, exact
from kubeapi import KubeAPI, pod
from netutil import free_port, free_ports, wait_until

from kvindex.runtime import Fleet
from kvindex.runtime.finders import Reconciler
from kvindex.runtime.finders.k8sfind import K8sFinder, engine_of_pod, parse_k8s

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def kube() -> Iterator[KubeAPI]:
    with KubeAPI() as api:
        yield api


def annotations(port: int) -> dict[str, str]:
    return {"kvindex.io/events-port": str(port), "kvindex.io/replay-port": str(port + 1)}


def test_parse_and_annotations() -> None:
    target = parse_k8s("k8s:inference?selector=app=vllm,tier!=cpu&kubeconfig=/k&context=c")
    assert (target.namespace, target.selector, target.kubeconfig, target.context) == (
        "inference",
        "app=vllm,tier!=cpu",
        "/k",
        "c",
    )
    with pytest.raises(ValueError, match="needs \\?selector"):
        parse_k8s("k8s:inference")
    with pytest.raises(ValueError, match="unknown option 'label'"):
        parse_k8s("k8s:inference?label=x")
    # the documented defaults: vLLM's 5557/5558, one rank, all topics
    found = engine_of_pod(pod("p", "10.1.2.3", uid="u1"), "k8s:x?selector=a")
    assert (found.spec.endpoint, found.spec.replay_endpoint) == (
        "tcp://10.1.2.3:5557",
        "tcp://10.1.2.3:5558",
    )
    assert (found.spec.dp, found.spec.topic, found.spec.model, found.spec.http) == (
        1,
        "",
        None,
        None,
    )
    assert (found.by.pod, found.by.uid, found.by.namespace) == ("p", "u1", "inference")
    given = {
        "kvindex.io/events-port": "6000",
        "kvindex.io/replay-port": "none",
        "kvindex.io/dp": "2",
        "kvindex.io/topic": "kv",
        "kvindex.io/model": "meta-llama/Llama-3.1-8B",
        "kvindex.io/http-port": "8000",
    }
    spec = engine_of_pod(pod("p", "fd00::5", annotations=given), "s").spec
    assert (spec.endpoint, spec.replay_endpoint, spec.dp, spec.topic) == (
        "tcp://[fd00::5]:6000",
        None,
        2,
        "kv",
    )
    assert (spec.model, spec.http) == ("meta-llama/Llama-3.1-8B", "http://[fd00::5]:8000")
    with pytest.raises(ValueError, match="events-port must be a port"):
        engine_of_pod(pod("p", "10.0.0.1", annotations={"kvindex.io/events-port": "x"}), "s")


def test_pods_followed_through_readiness_moves_replacements_and_a_relist(
    kube: KubeAPI, tmp_path: Path
) -> None:
    port = free_ports(2)
    engines: dict[str, Engine] = {}
    fleet = Fleet(ingest_workers=1)
    reconciler = Reconciler(fleet)
    target = parse_k8s(
        f"k8s:inference?selector=app=vllm&kubeconfig={kube.kubeconfig(tmp_path / 'kubeconfig')}"
    )
    finder = K8sFinder(target, reconciler)
    reconciler.finders.append(finder)
    ann = annotations(port)
    engines["a"] = Engine("127.0.0.2", port, 1)
    a = pod("vllm-a", "127.0.0.2", annotations=ann)
    kube.put(a)
    kube.put(pod("vllm-b", None, ready=False, phase="Pending", annotations=ann))
    kube.put(pod("other", "127.0.0.9", labels={"app": "web"}, annotations=ann))  # not selected
    asyncio.run(fleet.start())
    reconciler.start()
    try:
        assert wait_until(lambda: set(fleet.specs) == {"vllm-a"})
        assert fleet.found["vllm-a"].uid == a["metadata"]["uid"]
        time.sleep(0.3)
        engines["a"].work()
        assert wait_until(lambda: exact(fleet, "vllm-a", engines["a"]))

        # b is scheduled, gets an IP, becomes Ready: followed from then on
        engines["b"] = Engine("127.0.0.3", port, 2)
        b = pod("vllm-b", "127.0.0.3", ready=False, annotations=ann)
        kube.put(b)
        time.sleep(0.3)
        assert "vllm-b" not in fleet.specs  # Running with an IP, but not Ready
        b["status"]["conditions"][0]["status"] = "True"
        kube.put(b)
        assert wait_until(lambda: set(fleet.specs) == {"vllm-a", "vllm-b"})
        time.sleep(0.3)
        engines["b"].work()
        assert wait_until(lambda: exact(fleet, "vllm-b", engines["b"]))

        # a loses readiness: removed with its blocks, said why
        a["status"]["conditions"][0]["status"] = "False"
        kube.put(a)
        assert wait_until(lambda: "vllm-a" not in fleet.specs)
        assert wait_until(lambda: "vllm-a" not in fleet.index.instances())  # just after
        assert wait_until(lambda: reconciler.history[-1].why == "pod not Ready")

        # a is replaced under the same name (a new UID, a fresh engine on another IP):
        # nothing of the old one survives, the new one is exact
        engines["a"].close()
        engines["a"] = Engine("127.0.0.4", port, 3)
        a2 = pod("vllm-a", "127.0.0.4", annotations=ann)
        kube.delete("vllm-a")
        kube.put(a2)
        assert wait_until(lambda: fleet.found.get("vllm-a", None) is not None)
        assert fleet.found["vllm-a"].uid == a2["metadata"]["uid"] != a["metadata"]["uid"]
        time.sleep(0.3)
        engines["a"].work()
        assert wait_until(lambda: exact(fleet, "vllm-a", engines["a"]))

        # b moves (the same UID, a new IP: a new engine there) without a restart of ours
        engines["b"].close()
        engines["b"] = Engine("127.0.0.5", port, 4)
        b["status"]["podIP"], b["status"]["podIPs"] = "127.0.0.5", [{"ip": "127.0.0.5"}]
        kube.put(b)
        assert wait_until(
            lambda: (
                fleet.found.get("vllm-b") is not None
                and fleet.found["vllm-b"].address == f"127.0.0.5:{port}"
            )
        )
        assert any(c.why.startswith("moved: 127.0.0.3") for c in reconciler.history)
        time.sleep(0.3)
        engines["b"].work()
        assert wait_until(lambda: exact(fleet, "vllm-b", engines["b"]))

        # a bookmark moves the version on; a dropped watch resumes from it: no relist
        assert finder.lists == 1
        version = kube.bookmark()
        assert wait_until(lambda: finder.resource_version == version)
        assert finder.bookmarks >= 1
        watches = finder.watches
        kube.drop_watches()
        assert wait_until(lambda: finder.watches > watches and kube.watching == 1)
        assert f"watch {version}" in kube.requests and finder.lists == 1

        # while the watch is down, b is deleted and the history compacted: the watch
        # gets 410 Gone, lists again, and finds b gone
        kube.while_down(lambda: (kube.delete("vllm-b"), kube.compact()))
        assert wait_until(lambda: "vllm-b" not in fleet.specs)
        assert any(r.startswith("410 ") for r in kube.requests)
        assert finder.lists == 2
        assert set(fleet.specs) == {"vllm-a"}
        engines["a"].work()
        assert wait_until(lambda: exact(fleet, "vllm-a", engines["a"]))
    finally:
        reconciler.stop()
        asyncio.run(fleet.stop())
        for engine in engines.values():
            engine.close()


def test_gone_as_an_error_event_lists_again(kube: KubeAPI, tmp_path: Path) -> None:
    """etcd's compaction reported mid-stream: a 200 watch whose first event is ERROR 410."""
    port = free_ports(2)
    kube.gone_as_event = True
    fleet = Fleet(ingest_workers=1)
    reconciler = Reconciler(fleet)
    config = kube.kubeconfig(tmp_path / "kubeconfig")
    finder = K8sFinder(
        parse_k8s(f"k8s:inference?selector=app=vllm&kubeconfig={config}"), reconciler
    )
    reconciler.finders.append(finder)
    kube.put(pod("vllm-a", "127.0.0.2", annotations=annotations(port)))
    asyncio.run(fleet.start())
    reconciler.start()
    try:
        assert wait_until(lambda: set(fleet.specs) == {"vllm-a"} and kube.watching == 1)
        kube.while_down(
            lambda: (
                kube.put(pod("vllm-c", "127.0.0.3", annotations=annotations(port))),
                kube.compact(),
            )
        )
        assert wait_until(lambda: set(fleet.specs) == {"vllm-a", "vllm-c"})
        assert finder.lists == 2
        assert any(r.startswith("410 ") for r in kube.requests)
    finally:
        reconciler.stop()
        asyncio.run(fleet.stop())


def test_an_api_server_away_is_retried_and_stop_is_prompt(tmp_path: Path) -> None:
    """No server at the kubeconfig's address: the finder says why once and backs off; a
    stop while a watch is open returns at once."""
    fleet = Fleet(ingest_workers=1)
    reconciler = Reconciler(fleet)
    with KubeAPI() as kube:
        config = kube.kubeconfig(tmp_path / "kubeconfig")
    finder = K8sFinder(
        parse_k8s(f"k8s:inference?selector=app=vllm&kubeconfig={config}"), reconciler
    )
    finder.start()
    try:
        assert wait_until(lambda: finder.problem is not None, 15)
        assert not fleet.specs
    finally:
        started = time.monotonic()
        finder.stop()
        assert time.monotonic() - started < 5
    with KubeAPI() as kube:
        config = kube.kubeconfig(tmp_path / "kubeconfig2")
        finder = K8sFinder(
            parse_k8s(f"k8s:inference?selector=app=vllm&kubeconfig={config}"), reconciler
        )
        finder.start()
        assert wait_until(lambda: kube.watching == 1)
        started = time.monotonic()
        finder.stop()
        assert time.monotonic() - started < 2


def test_serve_discovers_pods(kube: KubeAPI, tmp_path: Path) -> None:
    port = free_ports(2)
    engine = Engine("127.0.0.2", port, 5)
    config = kube.kubeconfig(tmp_path / "kubeconfig")
    a = pod("vllm-a", "127.0.0.2", annotations=annotations(port))
    kube.put(a)
    http = free_port()
    proc = kvindex(
        "serve", "--store", "memory", "--http", f"127.0.0.1:{http}", "--min-engines", "1",
        "--discover", f"k8s:inference?selector=app=vllm&kubeconfig={config}",
    )  # fmt: skip
    url = f"http://127.0.0.1:{http}"
    try:
        proc.listening_url(timeout=30)
        assert wait_until(lambda: httpx.get(f"{url}/healthz").status_code == 200, 15)
        (instance,) = httpx.get(f"{url}/v1/instances").json()["instances"]
        assert instance["name"] == "vllm-a"
        assert instance["found"] == {
            "how": "k8s",
            "source": f"k8s:inference?selector=app=vllm&kubeconfig={config}",
            "address": f"127.0.0.2:{port}",
            "namespace": "inference",
            "pod": "vllm-a",
            "uid": a["metadata"]["uid"],
        }
        engine.work()
        hashes = {h for h in engine.ref.held()}
        assert wait_until(
            lambda: httpx.get(f"{url}/v1/instances/vllm-a/blocks").json()["count"] == len(hashes)
        )
        kube.delete("vllm-a")
        assert wait_until(lambda: httpx.get(f"{url}/v1/instances").json()["instances"] == [])
        history = httpx.get(f"{url}/v1/instances").json()["history"]
        assert [(c["change"], c["why"]) for c in history] == [
            (
                "added",
                f"found by k8s:inference?selector=app=vllm&kubeconfig={config} at 127.0.0.2:{port}",
            ),
            ("removed", "pod deleted"),
        ]
        proc.interrupt()
        assert proc.finish(15) == 0
    finally:
        proc.kill()
        engine.close()


def test_sglang_pods_by_kind_or_by_probing(kube: KubeAPI, tmp_path: Path) -> None:
    """`kvindex.io/kind: sglang` follows the pod by its /server_info; `auto` probes it: an
    SGLang engine there is one, a port that does not answer it is a vLLM engine."""
    from sglang_fake import FakeSGLang

    with FakeSGLang() as sglang, FakeSGLang() as probed:
        for fake in (sglang, probed):
            fake.start_publishers(dp=1, load=False, block_size=1)
            fake.start_http()
        port = free_ports(2)
        fleet = Fleet(ingest_workers=1)
        reconciler = Reconciler(fleet)
        config = kube.kubeconfig(tmp_path / "kubeconfig")
        target = parse_k8s(f"k8s:inference?selector=app=vllm&kubeconfig={config}")
        finder = K8sFinder(target, reconciler)
        reconciler.finders.append(finder)
        sglang_port, probed_port = (str(f.http_port) for f in (sglang, probed))
        kube.put(
            pod(
                "sgl",
                "127.0.0.1",
                annotations={"kvindex.io/kind": "sglang", "kvindex.io/http-port": sglang_port},
            )
        )
        kube.put(
            pod(
                "auto-sgl",
                "127.0.0.1",
                annotations={"kvindex.io/kind": "auto", "kvindex.io/http-port": probed_port},
            )
        )
        silent = str(free_port())  # nothing answers /server_info there
        kube.put(
            pod(
                "auto-vllm",
                "127.0.0.1",
                annotations={
                    **annotations(port),
                    "kvindex.io/kind": "auto",
                    "kvindex.io/http-port": silent,
                },
            )
        )
        asyncio.run(fleet.start())
        reconciler.start()
        try:
            assert wait_until(lambda: set(fleet.specs) == {"sgl", "auto-sgl", "auto-vllm"}, 15)
            assert fleet.specs["sgl"].discover == f"sglang+http://127.0.0.1:{sglang_port}"
            assert fleet.specs["auto-sgl"].discover == f"sglang+http://127.0.0.1:{probed_port}"
            assert fleet.specs["auto-vllm"].discover is None
            assert fleet.specs["auto-vllm"].endpoint == f"tcp://127.0.0.1:{port}"
            base = sglang.descriptor["endpoint_port_base"]
            assert wait_until(lambda: fleet.specs["sgl"].endpoint == f"tcp://127.0.0.1:{base}", 15)
        finally:
            reconciler.stop()
            asyncio.run(fleet.stop())
