"""Issue 28: a token holder may look up, not change the fleet unless it holds the admin
token; limits that bound what one client can hold (the peers' /query, dashboard streams);
the relay's secret key kept private. Real serve processes and sockets on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from clitools import Proc, kvindex
from netutil import free_port, wait_until
from service_workload import TestClient

from kvindex.runtime import Fleet
from kvindex.security.curve import generate_keys
from kvindex.security.http import HttpGuard
from kvindex.service.app import create_app
from kvindex.subscriber import InstanceSpec
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

QUERY = "query-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
METRICS = "metrics-token-0123456789abcd"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def pub() -> Iterator[Publisher]:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as p:
        yield p


def client_for(pub: Publisher, guard: HttpGuard) -> TestClient:
    fleet = Fleet([InstanceSpec("a", pub.endpoint, pub.replay_endpoint)])
    return TestClient(create_app(fleet, guard=guard), raise_server_exceptions=False)


def register(worker: int, port: int) -> dict[str, object]:
    return {
        "instance_id": worker,
        "dp_rank": 0,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "model_name": "m",
        "block_size": 16,
    }


def test_the_query_token_reads_and_only_the_admin_token_changes_the_fleet(
    pub: Publisher,
) -> None:
    guard = HttpGuard(token=QUERY, admin_token=ADMIN, metrics_token=METRICS)
    spec = {"spec": f"b=tcp://127.0.0.1:{free_port()}"}
    with client_for(pub, guard) as client:
        # the query token reads and looks up
        assert client.get("/v1/instances", headers=bearer(QUERY)).status_code == 200
        lookup = client.post("/v1/lookup", json={"token_ids": [1]}, headers=bearer(QUERY))
        assert lookup.status_code == 200
        # ... and changes nothing: 403 (a valid token that is not enough), nothing added
        for method, path, body in [
            ("POST", "/v1/instances", spec),
            ("DELETE", "/v1/instances/a", None),
            ("DELETE", "/v1/instances/a/", None),
            ("POST", "/register", register(7, free_port())),
            ("POST", "/unregister", {"instance_id": 7, "model_name": "m"}),
        ]:
            r = client.request(method, path, json=body, headers=bearer(QUERY))
            assert r.status_code == 403, (method, path, r.text)
            assert "admin token" in r.json()["error"]
            for wrong in ({}, bearer("wrong-token-0123456789"), bearer(METRICS)):
                r = client.request(method, path, json=body, headers=wrong)
                assert r.status_code in (401, 403) and r.status_code != 200, (method, path)
        names = [
            i["name"]
            for i in client.get("/v1/instances", headers=bearer(QUERY)).json()["instances"]
        ]
        assert names == ["a"]
        # the admin token changes the fleet, and reads too
        assert client.post("/v1/instances", json=spec, headers=bearer(ADMIN)).status_code == 201
        assert client.delete("/v1/instances/b", headers=bearer(ADMIN)).status_code == 204
        assert client.get("/v1/stats", headers=bearer(ADMIN)).status_code == 200
        assert client.get("/metrics", headers=bearer(ADMIN)).status_code == 200
        r = client.post("/register", json=register(8, free_port()), headers=bearer(ADMIN))
        assert r.status_code == 201, r.text
        doc = client.get("/openapi.json", headers=bearer(QUERY)).json()
        assert "403" in doc["paths"]["/v1/instances"]["post"]["responses"]
        assert "403" not in doc["paths"]["/v1/instances"]["get"]["responses"]


def test_without_an_admin_token_or_with_fleet_changes_off_nobody_changes_the_fleet(
    pub: Publisher,
) -> None:
    spec = {"spec": f"b=tcp://127.0.0.1:{free_port()}"}
    for guard in (
        HttpGuard(token=QUERY),  # a query token alone: the fleet is the operator's
        HttpGuard(token=QUERY, admin_token=ADMIN, fleet_changes=False),
        HttpGuard(fleet_changes=False),  # no token at all, fleet changes off
    ):
        configured = [t for t in (guard.token, guard.admin_token) if t]
        with client_for(pub, guard) as client:
            for headers in [bearer(t) for t in configured] or [{}]:
                r = client.post("/v1/instances", json=spec, headers=headers)
                assert r.status_code == 403, (guard, r.text)
                r = client.delete("/v1/instances/a", headers=headers)
                assert r.status_code == 403
                r = client.post("/register", json=register(9, free_port()), headers=headers)
                assert r.status_code == 403
            if configured:  # no valid token: 401, as anywhere else
                r = client.post("/v1/instances", json=spec)
                assert r.status_code == 401
            readers = bearer(QUERY) if guard.token else {}
            names = [
                i["name"] for i in client.get("/v1/instances", headers=readers).json()["instances"]
            ]
            assert names == ["a"]


def test_only_an_admin_token_leaves_reads_open_and_fleet_changes_closed(pub: Publisher) -> None:
    with client_for(pub, HttpGuard(admin_token=ADMIN)) as client:
        assert client.get("/v1/instances").status_code == 200
        spec = {"spec": f"b=tcp://127.0.0.1:{free_port()}"}
        assert client.post("/v1/instances", json=spec).status_code == 401
        assert client.post("/v1/instances", json=spec, headers=bearer(ADMIN)).status_code == 201


def serve(*args: str) -> tuple[Proc, str]:
    proc = kvindex("serve", "--store", "memory", "--http", "127.0.0.1:0", *args)
    return proc, proc.listening_url()


def test_serve_takes_the_admin_token_from_its_config_file_and_refuses_fleet_changes(
    tmp_path: Path,
) -> None:
    (tmp_path / "query").write_text(QUERY + "\n")
    (tmp_path / "admin").write_text(ADMIN + "\n")
    config = tmp_path / "kvindex.toml"
    config.write_text(
        f'[server]\ntoken_file = "{tmp_path / "query"}"\n'
        f'admin_token_file = "{tmp_path / "admin"}"\n'
    )
    spec = {"spec": f"b=tcp://127.0.0.1:{free_port()}"}
    with ExitStack() as stack:
        proc, url = serve("--config", str(config))
        stack.callback(proc.finish)
        stack.callback(proc.interrupt)
        with httpx.Client(base_url=url, timeout=5) as c:
            assert c.post("/v1/instances", json=spec, headers=bearer(QUERY)).status_code == 403
            assert c.post("/v1/instances", json=spec, headers=bearer(ADMIN)).status_code == 201
    assert proc.proc.returncode == 0
    with ExitStack() as stack:
        proc, url = serve("--config", str(config), "--no-fleet-changes")
        stack.callback(proc.finish)
        stack.callback(proc.interrupt)
        with httpx.Client(base_url=url, timeout=5) as c:
            r = c.post("/v1/instances", json=spec, headers=bearer(ADMIN))
            assert r.status_code == 403 and "--no-fleet-changes" in r.json()["error"]


@pytest.mark.parametrize(
    "args",
    [["--admin-token", "short"], ["--token", QUERY, "--admin-token", QUERY]],
)
def test_serve_refuses_a_bad_admin_token_in_one_line(args: list[str]) -> None:
    serve_args = ["serve", "--store", "memory", "--http", "127.0.0.1:0", *args]
    proc = subprocess.run(
        [sys.executable, "-m", "kvindex", *serve_args],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "admin-token" in proc.stderr


# -- limits that bound one client -----------------------------------------------------------


def test_peer_queries_are_held_to_the_lookup_limit(pub: Publisher) -> None:
    with client_for(pub, HttpGuard(max_lookup_items=10)) as client:
        fine = {"token_ids": list(range(10)), "model_name": "m"}
        assert client.post("/query", json=fine).status_code == 404  # no indexer for m
        r = client.post("/query", json={**fine, "token_ids": list(range(11))})
        assert r.status_code == 422 and "limit of 10" in r.json()["error"]
        r = client.post("/query_by_hash", json={"block_hashes": list(range(11)), "model_name": "m"})
        assert r.status_code == 422 and "block_hashes" in r.json()["error"]


def test_dashboard_streams_are_capped(tmp_path: Path) -> None:
    with ExitStack() as stack:
        proc, url = serve("--max-streams", "2")
        stack.callback(proc.finish)
        stack.callback(proc.interrupt)
        clients = [stack.enter_context(httpx.Client(base_url=url, timeout=5)) for _ in range(4)]
        first = stack.enter_context(clients[0].stream("GET", "/v1/dashboard/stream"))
        second = stack.enter_context(clients[1].stream("GET", "/v1/dashboard/stream"))
        assert first.status_code == 200 and second.status_code == 200
        lines = first.iter_lines()  # kept: a dropped iterator closes its response
        assert next(lines).startswith("retry:")  # the streams are open
        r = clients[2].get("/v1/dashboard/stream")
        assert r.status_code == 503 and "2 dashboard streams" in r.json()["error"]
        assert r.headers["retry-after"]
        assert clients[2].get("/v1/instances").status_code == 200  # the rest still answers
        lines.close()
        first.close()

        # the server sees the stream gone at its next write (a snapshot a second)
        def reopens() -> bool:
            with clients[3].stream("GET", "/v1/dashboard/stream") as third:
                return third.status_code == 200

        assert wait_until(reopens, timeout=10, step=0.2)


# -- the relay's secret key -----------------------------------------------------------------


def test_the_relay_refuses_a_server_key_others_can_read(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path, "server")
    client = generate_keys(tmp_path, "client")
    os.chmod(keys.secret, 0o644)
    relay = [
        sys.executable, "-m", "kvindex", "relay",
        "--from", f"tcp://127.0.0.1:{free_port()}",
        "--bind", f"tcp://127.0.0.1:{free_port()}",
        "--server-key", str(keys.secret), "--allow", str(client.public), "--duration", "0.3",
    ]  # fmt: skip
    refused = subprocess.run(relay, capture_output=True, text=True, timeout=20)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.count("\n") == 1 and "chmod 600" in refused.stderr
    os.chmod(keys.secret, 0o600)
    ran = subprocess.run(relay, capture_output=True, text=True, timeout=20)
    assert ran.returncode == 0, ran.stderr
