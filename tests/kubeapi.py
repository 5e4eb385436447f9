"""A small real HTTP server that speaks the Kubernetes API's list/watch protocol for pods.

No kube-apiserver can run here (no package, no container images), so the discovery's
tests drive the official client library against this: `GET /api/v1/namespaces/NS/pods`
with `labelSelector` answers a PodList carrying the current resourceVersion; with
`watch=true` it streams, chunked, one JSON event a line, every change after the asked
resourceVersion and then the live ones, until `timeoutSeconds`, like the real server:

- `BOOKMARK` events (to a watch that asked `allowWatchBookmarks`) carry a newer
  resourceVersion and nothing else;
- a resourceVersion older than the compacted history is answered `410 Gone`, either as
  the HTTP status (a `Status` body) or, as etcd's compaction shows mid-stream, as an
  `ERROR` event with code 410 in a 200 stream (`gone_as_event`);
- `drop_watches()` closes every open watch connection abruptly (no final chunk), as a
  restarted API server or a load balancer's idle timeout does.

Every pod put here is first validated against the Kubernetes schema (kubernetes-validate,
strict), so the objects the client reads are ones a real server could hold. A bearer token
is required, as a real server's is.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate

TOKEN = "kubeapi-test-token"  # a test server's bearer token
SCHEMA_VERSION = kubernetes_validate.latest_version()


def pod(
    name: str,
    ip: str | None,
    *,
    ready: bool = True,
    phase: str = "Running",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    uid: str | None = None,
    namespace: str = "inference",
) -> dict[str, Any]:
    """A vLLM pod as the API holds it (metadata, spec, status)."""
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"},
            {"type": "PodScheduled", "status": "True"},
        ],
    }
    if ip is not None:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or str(uuid.uuid4()),
            "labels": labels if labels is not None else {"app": "vllm"},
            "annotations": annotations or {},
        },
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.33.0",
                    "ports": [{"containerPort": 5557}, {"containerPort": 5558}],
                }
            ]
        },
        "status": status,
    }


def _matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based selectors (`a=b,c=d`, `a!=b`, `a` for presence)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("==", 1) if "==" in term else term.split("=", 1)
            if labels.get(key) != value:
                return False
        elif term not in labels:
            return False
    return True


class KubeAPI:
    """The server and the pods it holds; the test changes them as it goes."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._rv = 100
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._log: list[tuple[int, str, dict[str, Any]]] = []  # (rv, type, object)
        self._compacted = 0  # events at or before this rv are gone: older watches get 410
        self._epoch = 0  # drop_watches() bumps it: streams of an older epoch end abruptly
        self.gone_as_event = False
        self.requests: list[str] = []  # "list" / "watch RV" / "410 RV", in order
        self.watching = 0  # watch streams open now
        handler = self._handler()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "test", "cluster": {"server": self.url}}],
                    "users": [{"name": "kvindex", "user": {"token": TOKEN}}],
                    "contexts": [
                        {"name": "test", "context": {"cluster": "test", "user": "kvindex"}}
                    ],
                    "current-context": "test",
                }
            ),
            encoding="utf-8",
        )
        return path

    # -- what tests do -----------------------------------------------------------------

    def put(self, obj: dict[str, Any]) -> str:
        """Create or update a pod (ADDED / MODIFIED); its new resourceVersion."""
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        with self._lock:
            kind = "MODIFIED" if key in self._pods else "ADDED"
            return self._record(kind, key, copy.deepcopy(obj))

    def delete(self, name: str, namespace: str = "inference") -> str:
        with self._lock:
            obj = self._pods[(namespace, name)]
            return self._record("DELETED", (namespace, name), copy.deepcopy(obj))

    def compact(self) -> None:
        """Forget the history so far: a watch from an older version is answered 410."""
        with self._lock:
            self._compacted = self._rv

    def drop_watches(self) -> None:
        """End every open watch abruptly (the connection closed mid-stream)."""
        with self._lock:
            self._epoch += 1
            self._lock.notify_all()

    def while_down(self, change: Callable[[], object]) -> None:
        """Drop every watch and make `change` before any can reconnect (one locked step):
        what `change` does is seen only by a watch from before it, or a list."""
        with self._lock:
            self._epoch += 1
            change()
            self._lock.notify_all()

    def bookmark(self) -> str:
        """Advance the version with no change to the pods watched (another kind changed)
        and send open watches a BOOKMARK carrying it."""
        with self._lock:
            self._rv += 1
            self._log.append((self._rv, "BOOKMARK", {}))
            self._lock.notify_all()
            return str(self._rv)

    def _record(self, kind: str, key: tuple[str, str], obj: dict[str, Any]) -> str:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        if kind == "DELETED":
            del self._pods[key]
        else:
            self._pods[key] = obj
        self._log.append((self._rv, kind, obj))
        self._lock.notify_all()
        return str(self._rv)

    # -- serving -----------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._status(401, "Unauthorized", "Unauthorized")
                    return
                url = urlsplit(self.path)
                parts = url.path.strip("/").split("/")
                if (
                    len(parts) != 5
                    or parts[:3] != ["api", "v1", "namespaces"]
                    or parts[4] != "pods"
                ):
                    self._status(404, "NotFound", f"{url.path} not found")
                    return
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                namespace, selector = parts[3], query.get("labelSelector", "")
                if query.get("watch") in ("true", "1"):
                    api._watch(self, namespace, selector, query)
                else:
                    api._list(self, namespace, selector)

            def _status(self, code: int, reason: str, message: str) -> None:
                body = json.dumps(
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": message,
                        "reason": reason,
                        "code": code,
                    }
                ).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def _selected(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return [
            obj
            for (ns, _), obj in sorted(self._pods.items())
            if ns == namespace and _matches(obj["metadata"].get("labels") or {}, selector)
        ]

    def _list(self, handler: Any, namespace: str, selector: str) -> None:
        with self._lock:
            body = json.dumps(
                {
                    "kind": "PodList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": self._selected(namespace, selector),
                }
            ).encode()
            self.requests.append("list")
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def _watch(self, handler: Any, namespace: str, selector: str, query: dict[str, str]) -> None:
        since = int(query.get("resourceVersion") or 0)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        timeout = float(query.get("timeoutSeconds") or 300)
        with self._lock:
            gone = since < self._compacted
            self.requests.append(f"410 {since}" if gone else f"watch {since}")
            epoch = self._epoch
        if gone and not self.gone_as_event:
            handler._status(
                410, "Expired", f"too old resource version: {since} ({self._compacted})"
            )
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        if gone:
            error = {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": f"too old resource version: {since} ({self._compacted})",
                "reason": "Expired",
                "code": 410,
            }
            self._send(handler, {"type": "ERROR", "object": error})
            self._end(handler)
            return
        self._stream(handler, namespace, selector, since, bookmarks, timeout, epoch)

    def _stream(
        self,
        handler: Any,
        namespace: str,
        selector: str,
        since: int,
        bookmarks: bool,
        timeout: float,
        epoch: int,
    ) -> None:
        import time

        deadline = time.monotonic() + timeout
        sent = since
        with self._lock:
            self.watching += 1
        try:
            while True:
                with self._lock:
                    while (
                        self._epoch == epoch
                        and not (self._log and self._log[-1][0] > sent)
                        and time.monotonic() < deadline
                    ):
                        self._lock.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                    if self._epoch != epoch:
                        handler.close_connection = True
                        handler.connection.shutdown(socket.SHUT_RDWR)
                        return  # abruptly: no final chunk
                    pending = [e for e in self._log if e[0] > sent]
                    if not pending and time.monotonic() >= deadline:
                        break
                events = []
                for rv, kind, obj in pending:
                    sent = rv
                    if kind == "BOOKMARK":
                        if bookmarks:
                            meta = {"resourceVersion": str(rv)}
                            events.append(
                                {
                                    "type": kind,
                                    "object": {"kind": "Pod", "apiVersion": "v1", "metadata": meta},
                                }
                            )
                        continue
                    meta = obj["metadata"]
                    if meta["namespace"] == namespace and _matches(
                        meta.get("labels") or {}, selector
                    ):
                        events.append({"type": kind, "object": obj})
                for event in events:
                    self._send(handler, event)
            self._end(handler)
        except OSError:
            return
        finally:
            with self._lock:
                self.watching -= 1

    @staticmethod
    def _send(handler: Any, event: dict[str, Any]) -> None:
        line = json.dumps(event).encode() + b"\n"
        handler.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
        handler.wfile.flush()

    @staticmethod
    def _end(handler: Any) -> None:
        handler.wfile.write(b"0\r\n\r\n")
        handler.wfile.flush()

    def __enter__(self) -> KubeAPI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop_watches()
        self.server.shutdown()
        self.server.server_close()
