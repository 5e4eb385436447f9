"""The dashboard's session cookie and the Host allow-list, request by request (the browser
test, tests/browser/test_faults_http_browser.py, runs them in chromium)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_workload import TestClient
from test_config import serve_args

from kvindex.cli.common import UsageError
from kvindex.cli.config import load_settings
from kvindex.cli.httpopts import http_options
from kvindex.runtime import Fleet
from kvindex.security.http import HttpGuard, default_allowed_hosts
from kvindex.service.app import create_app
from kvindex.subscriber import InstanceSpec
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

TOKEN = "t0ken-of-the-main-api-0123456789"


@pytest.fixture(scope="module")
def pub() -> Iterator[Publisher]:
    with Publisher("tcp://127.0.0.1:*") as p:
        yield p


def client(pub: Publisher, guard: HttpGuard, base_url: str = "http://testserver") -> TestClient:
    fleet = Fleet([InstanceSpec("a", pub.endpoint)])
    return TestClient(create_app(fleet, guard=guard), base_url=base_url)


def test_the_session_cookie_is_httponly_strict_scoped_and_secure_over_tls(pub: Publisher) -> None:
    for base, secure in [("http://testserver", ""), ("https://testserver", "; Secure")]:
        with client(pub, HttpGuard(token=TOKEN), base) as c:
            r = c.get(f"/?token={TOKEN}&view=compact", follow_redirects=False)
            assert r.status_code == 303 and r.headers["location"] == "/?view=compact"
            session, expired = r.headers.get_list("set-cookie")
            value = session.split(";")[0].removeprefix("kvindex_session=")
            assert session == (
                f"kvindex_session={value}; Path=/v1/dashboard/; HttpOnly; SameSite=Strict{secure}"
            )
            assert TOKEN not in session and len(value) == 64
            # the cookie earlier versions' page set (the token itself, for the whole host)
            assert expired == f"kvindex_token=; Path=/; Max-Age=0; SameSite=Strict{secure}"
            assert r.headers["referrer-policy"] == "no-referrer"


def test_a_metrics_token_does_not_open_a_dashboard_session(pub: Publisher) -> None:
    metrics = "metrics-token-abcdefghijklmnop"
    with client(pub, HttpGuard(token=TOKEN, metrics_token=metrics)) as c:
        assert c.get(f"/?token={metrics}", follow_redirects=False).status_code == 401
        assert "kvindex_session" not in c.cookies


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("localhost", 200),
        ("LOCALHOST.:8080", 200),  # case and a trailing dot don't make another name
        ("kvindex.example.com", 200),
        ("127.0.0.1:8080", 200),  # IP literals always pass: rebinding needs a name
        ("[::1]:8080", 200),
        ("10.1.2.3", 200),
        ("evil.example", 400),
        ("kvindex.example.com.evil.example", 400),
        ("localhost.evil.example:8080", 400),
    ],
)
def test_host_names_not_on_the_list_are_refused(pub: Publisher, host: str, status: int) -> None:
    guard = HttpGuard(allowed_hosts=("localhost", "kvindex.example.com"))
    with client(pub, guard) as c:
        for path in ("/v1/instances", "/healthz", "/"):
            r = c.get(path, headers={"host": host})
            assert r.status_code == status, (path, r.text)
            if status == 400:
                assert f"Host '{host.split(':')[0]}' is not served here" in r.json()["error"]


def test_serve_allows_its_bind_name_localhost_and_what_it_is_told() -> None:
    assert default_allowed_hosts("127.0.0.1") == ["localhost"]
    assert default_allowed_hosts("kvindex.internal") == ["kvindex.internal", "localhost"]
    machine = default_allowed_hosts("0.0.0.0")
    assert socket.gethostname().lower() in machine and "localhost" in machine
    for argv, want in [
        ([], ("localhost",)),
        (["--allowed-hosts", "a.example,B.example"], ("localhost", "a.example", "b.example")),
        (["--allowed-hosts", "*"], ("*",)),
    ]:
        args = serve_args(*argv)
        options = http_options(args, load_settings(args).http_options, bind_host="127.0.0.1")
        assert options.guard.allowed_hosts == want


def test_the_config_file_adds_host_names(tmp_path: Path) -> None:
    config = tmp_path / "k.toml"
    config.write_text('[server]\nallowed_hosts = ["x.example"]\n')
    args = serve_args("--config", str(config))
    options = http_options(args, load_settings(args).http_options, bind_host="127.0.0.1")
    assert options.guard.allowed_hosts == ("localhost", "x.example")
    config.write_text('[server]\nallowed_hosts = "x.example"\n')
    with pytest.raises(UsageError, match=r"server.allowed_hosts must be an array of host names"):
        load_settings(serve_args("--config", str(config)))
