"""`--discover 'k8s:NAMESPACE?selector=LABELS'`: engines that are Kubernetes pods.

The official client library (`kubernetes`) lists the namespace's pods by label selector,
then watches from the list's resource version, as client-go's informers do:

- each event moves the resource version on; `BOOKMARK` events (asked for with
  `allowWatchBookmarks`) move it on without a change;
- a watch that ends (the server's timeout, a dropped connection) is opened again from the
  last resource version: nothing is listed again, nothing missed;
- `410 Gone` (the version is too old: compacted away), as an HTTP status or as an `ERROR`
  event, lists again from now and replaces the whole answer;
- any other failure is retried with backoff (0.5 s doubling to 30 s), said once.

A pod is an engine while it is Running, has an IP, is Ready and is not being deleted;
otherwise (deleted, not Ready, evicted) it is removed with its blocks. It is named by the
pod's name; a pod replaced under the same name has a new UID and is a new generation (the
old one's blocks are dropped before the new one is followed). How to follow it comes from
the pod's annotations (docs/discovery.md):

    kvindex.io/events-port   KV-event PUB port (default 5557)
    kvindex.io/replay-port   replay ROUTER port (default 5558; "none": no replay)
    kvindex.io/topic         ZMQ topic (default: all)
    kvindex.io/dp            data-parallel ranks on ports +0..+dp-1 (default 1)
    kvindex.io/model         the model it serves (lookups naming a model)
    kvindex.io/http-port     its HTTP server (/metrics, /tokenize; default: none; SGLang's
                             /server_info: 30000)
    kvindex.io/kind          vllm (default), sglang (its publishers read from
                             /server_info, as `sglang+http://` does), or auto (sglang
                             where GET /server_info answers with KV events, else vllm)

Credentials: inside a pod, its service account; elsewhere the kubeconfig
($KUBECONFIG or ~/.kube/config, or `kubeconfig=PATH` and `context=NAME` in the value).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from kvindex.runtime.finders.common import EngineOptions, FinderThread, log, tcp
from kvindex.runtime.finders.reconcile import Found, FoundBy, Reconciler
from kvindex.subscriber import InstanceSpec

__all__ = ["ANNOTATIONS", "K8sFinder", "K8sTarget", "engine_of_pod", "parse_k8s"]

PREFIX = "kvindex.io/"
ANNOTATIONS = {
    "events-port": "5557",
    "replay-port": "5558",
    "topic": "",
    "dp": "1",
    "model": "",
    "http-port": "",
    "kind": "vllm",
}
KINDS = ("vllm", "sglang", "auto")
SGLANG_HTTP_PORT = "30000"  # SGLang's default --port
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_SECONDS = 300  # the server ends each watch after this (then it is opened again)
READ_TIMEOUT = 90.0  # no byte for this long (bookmarks come every minute): reconnect
_OPTIONS = {"selector", "kubeconfig", "context"}


@dataclass(frozen=True, slots=True)
class K8sTarget:
    source: str
    namespace: str
    selector: str
    kubeconfig: str | None = None
    context: str | None = None


def parse_k8s(text: str) -> K8sTarget:
    """`k8s:[NAMESPACE]?selector=LABELS[&kubeconfig=PATH][&context=NAME]` (ValueError).
    No namespace: the pod's own (its service account's)."""
    body, _, query = text.removeprefix("k8s:").partition("?")
    fields: dict[str, str] = {}
    for key, values in parse_qs(query, keep_blank_values=True).items():
        if key not in _OPTIONS:
            raise ValueError(
                f"--discover {text!r}: unknown option {key!r} (selector, kubeconfig, context)"
            )
        fields[key] = values[-1]
    if not fields.get("selector"):
        raise ValueError(f"--discover {text!r} needs ?selector=LABELS (e.g. app=vllm)")
    namespace = body.strip("/")
    if not namespace:
        try:
            namespace = SA_NAMESPACE.read_text(encoding="utf-8").strip()
        except OSError:
            raise ValueError(
                f"--discover {text!r}: no namespace given and not in a pod (k8s:NAMESPACE?...)"
            ) from None
    return K8sTarget(
        text, namespace, fields["selector"], fields.get("kubeconfig"), fields.get("context")
    )


def _annotation(pod: Mapping[str, Any], key: str) -> str:
    annotations = pod.get("metadata", {}).get("annotations") or {}
    return str(annotations.get(PREFIX + key, ANNOTATIONS[key])).strip()


def _port(value: str, what: str) -> int:
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"annotation {PREFIX}{what} must be a port, got {value!r}")
    return int(value)


def _ready(pod: Mapping[str, Any]) -> str | None:
    """Why the pod is not an engine now (None: it is)."""
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return "being deleted"
    if status.get("phase") != "Running":
        return f"phase {status.get('phase') or 'unknown'}"
    if not status.get("podIP"):
        return "no pod IP"
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            return None if condition.get("status") == "True" else "not Ready"
    return "not Ready"


def engine_of_pod(
    pod: Mapping[str, Any], source: str, probe: Callable[[InstanceSpec], bool] | None = None
) -> Found:
    """The engine a Ready pod is (ValueError: an annotation is wrong). `probe` says
    whether an SGLang spec's /server_info answers (kind `auto`)."""
    meta, ip = pod["metadata"], pod["status"]["podIP"]
    kind = _annotation(pod, "kind").lower()
    if kind not in KINDS:
        raise ValueError(f"annotation {PREFIX}kind must be vllm, sglang or auto, got {kind!r}")
    if kind != "vllm":
        server = _port(_annotation(pod, "http-port") or SGLANG_HTTP_PORT, "http-port")
        model = _annotation(pod, "model")
        text = f"{meta['name']}=sglang+http://{tcp(ip, server)}"
        text += f",model={model}" if model else ""
        sglang = InstanceSpec.parse(text)
        if kind == "sglang" or (probe is not None and probe(sglang)):
            return Found(sglang, _found_by(meta, source, tcp(ip, server)))
    port = _port(_annotation(pod, "events-port"), "events-port")
    replay_text = _annotation(pod, "replay-port")
    replay = None if replay_text == "none" else _port(replay_text, "replay-port")
    dp = _annotation(pod, "dp")
    if not dp.isdigit() or not 1 <= int(dp) <= 256:
        raise ValueError(f"annotation {PREFIX}dp must be 1 to 256, got {dp!r}")
    http = _annotation(pod, "http-port")
    options = EngineOptions(
        replay_port=replay,
        topic=_annotation(pod, "topic"),
        dp=int(dp),
        model=_annotation(pod, "model") or None,
        http_port=_port(http, "http-port") if http else None,
    )
    spec = options.spec(meta["name"], ip, port, replay)
    return Found(spec, _found_by(meta, source, tcp(ip, port)))


def _found_by(meta: Mapping[str, Any], source: str, address: str) -> FoundBy:
    return FoundBy(
        "k8s",
        source,
        address,
        namespace=meta.get("namespace"),
        pod=meta["name"],
        uid=meta.get("uid"),
    )


class Gone(Exception):
    """410 Gone: the resource version is too old; list again."""


class K8sFinder(FinderThread):
    """List + watch of one namespace's pods by selector, handed to `reconciler`."""

    def __init__(self, target: K8sTarget, reconciler: Reconciler, api: Any = None) -> None:
        super().__init__(f"discover {target.source}")
        self.target = target
        self.reconciler = reconciler
        self._api = api
        self._pods: dict[str, dict[str, Any]] = {}  # by name: the last object seen
        self._bad: dict[str, str] = {}  # pod -> why its annotations can't be followed (said once)
        self.resource_version: str | None = None  # None: list (again) first
        self.lists = 0  # lists made (1 + relists after 410 Gone)
        self.watches = 0  # watches opened
        self.bookmarks = 0
        self.events = 0
        self._response: Any = None
        self._response_lock = threading.Lock()
        self._probed: dict[tuple[str, str], bool] = {}  # (UID, URL) -> /server_info answers

    # -- the client --------------------------------------------------------------------

    def _core(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            configuration = client.Configuration()
            if os.environ.get("KUBERNETES_SERVICE_HOST") and not self.target.kubeconfig:
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            else:
                config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=self.target.kubeconfig,
                    context=self.target.context,
                    client_configuration=configuration,
                )
            self._api = client.CoreV1Api(client.ApiClient(configuration))
        return self._api

    # -- the loop ----------------------------------------------------------------------

    def step(self) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            if self.resource_version is None:
                self._list()
            self._watch()
        except Gone:
            self.resource_version = None  # at once: list again from now
        except ApiException as exc:
            if exc.status == 410:
                self.resource_version = None
                return
            raise

    def _list(self) -> None:
        response = self._core().list_namespaced_pod(
            self.target.namespace,
            label_selector=self.target.selector,
            _preload_content=False,
            _request_timeout=(10, 60),
        )
        try:
            body = json.loads(response.data)
        finally:
            response.release_conn()
        self._pods = {pod["metadata"]["name"]: pod for pod in body.get("items") or []}
        self.resource_version = body["metadata"]["resourceVersion"]
        self.lists += 1
        self._apply("not in the pod list")

    def _watch(self) -> None:
        from kubernetes.watch.watch import iter_resp_lines

        response = self._core().list_namespaced_pod(
            self.target.namespace,
            label_selector=self.target.selector,
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=self.resource_version,
            timeout_seconds=WATCH_SECONDS,
            _preload_content=False,
            _request_timeout=(10, READ_TIMEOUT),
        )
        with self._response_lock:
            self._response = response
        self.watches += 1
        try:
            if self.stopping:
                return
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                if self.stopping:
                    return
                self._event(json.loads(line))
        finally:
            with self._response_lock:
                self._response = None
            response.release_conn()

    def _event(self, event: Mapping[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", "410 Gone"))
            raise RuntimeError(f"watch error: {obj.get('message') or obj}")
        version = obj.get("metadata", {}).get("resourceVersion")
        if kind == "BOOKMARK":
            self.bookmarks += 1
        elif kind in ("ADDED", "MODIFIED"):
            self._pods[obj["metadata"]["name"]] = obj
            self.events += 1
        elif kind == "DELETED":
            self._pods.pop(obj["metadata"]["name"], None)
            self.events += 1
        if version:
            self.resource_version = version
        if kind != "BOOKMARK":
            self._apply("deleted")

    def _apply(self, why_missing: str) -> None:
        """Hand the engines among the pods known to the reconciler; a pod known but not an
        engine now is removed with its reason."""
        found: dict[str, Found] = {}
        for name, pod in sorted(self._pods.items()):
            if _ready(pod) is not None:
                continue
            try:
                found[name] = engine_of_pod(pod, self.target.source, self._probe)
            except (ValueError, KeyError) as exc:
                if self._bad.get(name) != str(exc):
                    self._bad[name] = str(exc)
                    log.warning("pod %s: not followed: %s", name, exc)
        for name, engine in self.reconciler.engines().items():
            if name not in found and engine.by.source == self.target.source:
                known = self._pods.get(name)
                why = why_missing if known is None else (_ready(known) or "bad annotations")
                self.reconciler.gone(self.target.source, name, f"pod {why}")
        self.reconciler.replace(self.target.source, found)

    def _probe(self, spec: InstanceSpec) -> bool:
        """Kind `auto`: does the pod's /server_info describe KV events (SGLang)? Asked
        once per pod generation and address."""
        from kvindex.subscriber.server_info import DiscoveryError, fetch_descriptor

        pod = self._pods.get(spec.name, {})
        key = (str(pod.get("metadata", {}).get("uid", spec.name)), spec.discover or "")
        if key not in self._probed:
            try:
                fetch_descriptor(spec, timeout=2.0)
                self._probed[key] = True
            except DiscoveryError:
                self._probed[key] = False
        return self._probed[key]

    def _interrupt(self) -> None:
        with self._response_lock:
            response = self._response
        if response is not None:
            shutdown = getattr(response, "shutdown", None)
            try:
                (shutdown or response.close)()
            except Exception:  # it is being torn down either way
                pass
