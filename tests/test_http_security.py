"""HTTP guards: bearer tokens (constant-time, /healthz and /metrics rules), lookup and body
limits, the body deadline, TLS, and `serve`'s flags for them."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from netutil import serve_url, wait_until
from service_workload import TestClient

from kvindex.cli.serve import DEFAULT_HTTP
from kvindex.runtime import Fleet
from kvindex.security.http import HttpGuard
from kvindex.service.app import create_app
from kvindex.subscriber import InstanceSpec
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

TOKEN = "t0ken-of-the-main-api-0123456789"
METRICS = "metrics-token-abcdefghijklmnop"


@pytest.fixture(scope="module")
def pub() -> Iterator[Publisher]:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as p:
        yield p


def client_for(pub: Publisher, guard: HttpGuard) -> TestClient:
    fleet = Fleet([InstanceSpec("a", pub.endpoint, pub.replay_endpoint)])
    return TestClient(create_app(fleet, guard=guard), raise_server_exceptions=False)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_token_guards_every_endpoint_but_healthz_and_metrics(pub: Publisher) -> None:
    with client_for(pub, HttpGuard(token=TOKEN)) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/metrics").status_code == 200
        for method, path in [
            ("GET", "/v1/instances"),
            ("GET", "/v1/instances/a/blocks"),
            ("GET", "/v1/stats"),
            ("POST", "/v1/lookup"),
            ("POST", "/v1/instances"),
            ("DELETE", "/v1/instances/a"),
            ("GET", "/v1/dashboard/stream"),
            ("GET", "/docs"),
            ("GET", "/openapi.json"),
            ("GET", "/nothing"),
        ]:
            for headers in ({}, bearer("wrong"), {"Authorization": f"Basic {TOKEN}"}):
                r = client.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, headers)
                assert r.json()["error"] and r.headers["www-authenticate"].startswith("Bearer")
        ok = client.get("/v1/instances", headers=bearer(TOKEN))
        assert ok.status_code == 200 and ok.json()["instances"][0]["name"] == "a"
        r = client.get("/v1/instances", headers={"authorization": f"bearer {TOKEN}"})
        assert r.status_code == 200  # the scheme is case-insensitive
        r = client.post("/v1/lookup", json={"token_ids": [1]}, headers=bearer(TOKEN))
        assert r.status_code == 200
        schema = client.get("/openapi.json", headers=bearer(TOKEN)).json()
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert schema["paths"]["/healthz"]["get"]["security"] == []


def test_metrics_token(pub: Publisher) -> None:
    with client_for(pub, HttpGuard(token=TOKEN, metrics_token=METRICS)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=bearer("nope")).status_code == 401
        assert client.get("/metrics", headers=bearer(METRICS)).status_code == 200
        assert client.get("/metrics", headers=bearer(TOKEN)).status_code == 200
        assert client.get("/v1/stats", headers=bearer(METRICS)).status_code == 401
    with client_for(pub, HttpGuard(metrics_token=METRICS)) as client:  # only /metrics guarded
        assert client.get("/v1/stats").status_code == 200
        assert client.get("/metrics").status_code == 401


def test_lookup_size_limit_is_configurable(pub: Publisher) -> None:
    with client_for(pub, HttpGuard(max_lookup_items=10)) as client:
        assert client.post("/v1/lookup", json={"token_ids": list(range(10))}).status_code == 200
        r = client.post("/v1/lookup", json={"token_ids": list(range(11))})
        assert r.status_code == 422 and "limit of 10" in r.json()["error"]
        r = client.post("/v1/lookup/hashes", json={"block_hashes": ["1"] * 11})
        assert r.status_code == 422 and "block_hashes" in r.json()["error"]


def test_a_body_that_never_arrives_times_out(pub: Publisher) -> None:
    fleet = Fleet([])
    app = create_app(fleet, manage_fleet=False, guard=HttpGuard(request_timeout=0.3))
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(30)  # a client that trickles nothing
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/lookup",
        "raw_path": b"/v1/lookup",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"20")],
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 1),
        "scheme": "http",
        "root_path": "",
        "state": {},
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 5))
    fleet.close()
    assert sent[0]["status"] == 408
    assert b"not received" in sent[1]["body"]


# -- serve as a process ---------------------------------------------------------------


def self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def serve(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvindex", "serve", "--store", "memory", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return proc, serve_url(proc, lambda: proc.stderr.read() if proc.stderr else "")


def test_serve_with_tls_and_a_token_from_the_environment(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    proc, url = serve(
        "--http", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key),
        "--request-timeout", "1",
        env={"KVINDEX_TOKEN": TOKEN},
    )  # fmt: skip
    try:
        assert url.startswith("https://127.0.0.1:")
        verify = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=url, verify=verify, timeout=5) as client:
            assert wait_until(lambda: client.get("/healthz").status_code == 200)
            assert client.get("/v1/instances").status_code == 401
            assert client.get("/v1/instances", headers=bearer(TOKEN)).status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
            httpx.get(url.replace("https", "http") + "healthz", timeout=2)
        host, port = url.split("//")[1].rstrip("/").split(":")
        raw = socket.create_connection((host, int(port)), timeout=5)
        tls = verify.wrap_socket(raw, server_hostname="127.0.0.1")
        tls.sendall(  # a trickling client: headers, then never the promised body
            b"POST /v1/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\n".encode()
            + b"Content-Length: 100\r\n\r\n{"
        )
        answer = tls.recv(4096)
        tls.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_serve_binds_loopback_by_default_and_warns_when_exposed() -> None:
    assert DEFAULT_HTTP.startswith("127.0.0.1:")
    proc, _ = serve("--http", "0.0.0.0:0")
    try:
        assert proc.stderr is not None
        warning = proc.stderr.readline()
        assert "warning" in warning and "without --token" in warning
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


@pytest.mark.parametrize(
    "args",
    [
        ["--tls-cert", "/nonexistent.pem"],
        ["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"],
        ["--token", "short"],
        ["--token", ""],
        ["--max-lookup-tokens", "0"],
        ["--request-timeout", "nan"],
    ],
)
def test_serve_rejects_bad_security_flags_in_one_line(args: list[str]) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvindex",
            "serve",
            "--store",
            "memory",
            "--http",
            "127.0.0.1:0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 2, (args, proc.stderr)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_dashboard_page_is_open_and_its_data_takes_the_session_cookie(pub: Publisher) -> None:
    # A browser can't put a bearer header on an EventSource: the page (no data in it) is
    # open, `/?token=` trades the token for the dashboard's session cookie, and the
    # dashboard's data paths accept that cookie (and only those).
    with client_for(pub, HttpGuard(token=TOKEN)) as client:
        assert client.get("/").status_code == 200
        assert client.get("/dashboard/dashboard.js").status_code == 200
        assert client.get("/?token=wrong", follow_redirects=False).status_code == 401
        assert "kvindex_session" not in client.cookies
        r = client.get(f"/?token={TOKEN}", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/"
        assert client.cookies["kvindex_session"] != TOKEN  # never the token itself
        assert client.get("/v1/dashboard/snapshot").status_code == 200
        body = {"token_ids": [1]}
        assert client.post("/v1/dashboard/lookup", json=body).json()["instances"][0]["name"] == "a"
        # the cookie opens the dashboard's paths only
        assert client.get("/v1/instances").status_code == 401
        assert client.post("/v1/lookup", json=body).status_code == 401
        # an explicit header wins over the cookie
        r = client.get("/v1/dashboard/snapshot", headers=bearer("wrong"))
        assert r.status_code == 401
