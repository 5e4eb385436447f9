"""Schemathesis against the OpenAPI spec, in process (ASGI): for a bounded number of
generated requests per operation, never a 5xx, and every answer conforms to the spec
(status code documented, JSON that matches the documented schema).

POST /v1/instances is left out: generated endpoints would make the service connect to
arbitrary hosts (tests/test_service_api.py covers that operation with fixed cases)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, settings
from service_workload import TestClient

from kvindex.runtime import Fleet
from kvindex.security.http import HttpGuard
from kvindex.service.app import create_app
from kvindex.subscriber import InstanceSpec, SourceKey
from kvindex.wire import BlockRemoved, BlockStored, EventBatch

pytestmark = pytest.mark.timeout(120)


def _app(manage_fleet: bool = True) -> Any:
    # Nothing publishes: the index is filled directly, so every read has something to
    # show, and no socket traffic changes it under the generated requests.
    fleet = Fleet([InstanceSpec("a", "tcp://127.0.0.1:9", "tcp://127.0.0.1:9")])
    source = SourceKey("a")
    fleet.index.apply(source, EventBatch(1.0, [BlockStored([1, 2], None, list(range(8)), 4)]))
    fleet.index.apply(
        source, EventBatch(2.0, [BlockStored([b"\x01" * 32], None, [], 0, medium="CPU")])
    )
    fleet.index.apply(source, EventBatch(3.0, [BlockRemoved([2])]))
    return create_app(fleet, manage_fleet=manage_fleet)


# The spec as the app publishes it; the cases go over HTTP to the app served for real
# below (its lifespan runs ingest in the server's loop, as under `kvindex serve`).
_spec_app = _app(manage_fleet=False)
schema = schemathesis.openapi.from_dict(_spec_app.openapi())
_spec_app.state.fleet.close()
schema = schema.exclude(method="POST", path="/v1/instances")
# Registering connects to the endpoint: the schema can't say which endpoints connect
# (tests/test_router_service.py registers for real).
schema = schema.exclude(method="POST", path="/register")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """The app on a real server (its lifespan runs ingest, so /healthz is ok)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_app(), log_level="error", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started and thread.is_alive():
            threading.Event().wait(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


@schema.parametrize()
@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api_conforms_to_its_openapi(case: schemathesis.Case, base_url: str) -> None:
    case.call_and_validate(base_url=base_url)  # every check, the `Allow` of a 405 too


def test_a_405_allows_every_method_of_the_path() -> None:
    app = _app(manage_fleet=False)
    with TestClient(app) as client:
        r = client.put("/v1/instances")
        assert r.status_code == 405 and r.json() == {"error": "Method Not Allowed"}
        assert set(r.headers["allow"].split(", ")) == {"GET", "POST"}
        r = client.post("/v1/instances/a")
        assert set(r.headers["allow"].split(", ")) == {"DELETE"}
    app.state.fleet.close()


def test_post_instances_schema_and_server_agree_on_an_empty_body() -> None:
    app = _app(manage_fleet=False)
    doc = app.openapi()
    body = doc["paths"]["/v1/instances"]["post"]["requestBody"]["content"]["application/json"]
    validator = jsonschema.Draft202012Validator({**body["schema"], "components": doc["components"]})
    with TestClient(app) as client:
        for sent, valid in (
            ({}, False),
            ({"name": "x"}, False),
            ({"spec": "x=tcp://127.0.0.1:9"}, True),
            ({"name": "y", "endpoint": "tcp://127.0.0.1:9", "dp": 2}, True),
            ({"spec": "z=tcp://127.0.0.1:9", "name": "z"}, False),
        ):
            assert validator.is_valid(sent) == valid, sent
            r = client.post("/v1/instances", json=sent)
            assert (r.status_code == 201) == valid, (sent, r.text)
            assert valid or "error" in r.json()
    app.state.fleet.close()


def test_401_is_documented_wherever_a_token_is_asked_for() -> None:
    fleet = Fleet()
    doc = create_app(fleet, guard=HttpGuard(token="t")).openapi()
    fleet.close()
    assert doc["paths"]["/v1/lookup"]["post"]["responses"]["401"]["content"]
    assert "401" in doc["paths"]["/v1/instances"]["get"]["responses"]
    assert "401" not in doc["paths"]["/healthz"]["get"]["responses"]
    assert "401" not in doc["paths"]["/metrics"]["get"]["responses"]  # no metrics token
    open_app = _app(manage_fleet=False)
    open_app.state.fleet.close()
    assert "401" not in open_app.openapi()["paths"]["/v1/lookup"]["post"]["responses"]


def _raw(port: int, request: bytes) -> int:
    """The status a real server answers to `request`, sent as is over a socket."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)
        answer = conn.recv(4096)
    return int(answer.split(b" ", 2)[1])


def test_what_the_guard_answers_is_documented_where_it_answers_it() -> None:
    # A refused Host (400, any path) and a body that never arrives (408, where a body is
    # read): answered by the guard before any route, produced here on a real server.
    fleet = Fleet()
    guard = HttpGuard(request_timeout=0.3, allowed_hosts=("localhost",))
    app = create_app(fleet, guard=guard, manage_fleet=False)
    doc = app.openapi()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started and thread.is_alive():
            threading.Event().wait(0.01)
        port = sock.getsockname()[1]
        foreign = b"GET /healthz HTTP/1.1\r\nHost: rebound.example\r\n\r\n"
        assert _raw(port, foreign) == 400
        assert "400" in doc["paths"]["/healthz"]["get"]["responses"]
        slow = b"POST /v1/lookup HTTP/1.1\r\nHost: localhost\r\nContent-Length: 50\r\n\r\n{"
        assert _raw(port, slow) == 408
        assert "408" in doc["paths"]["/v1/lookup"]["post"]["responses"]
        assert "408" not in doc["paths"]["/healthz"]["get"]["responses"]  # no body read
        assert "401" not in doc["paths"]["/v1/lookup"]["post"]["responses"]  # no token
    finally:
        server.should_exit = True
        thread.join(10)
        fleet.close()
