"""The dashboard's session cookie and the Host check in a real browser (Debian's chromium
driven by Playwright) against a real `kvindex serve`: `/?token=` leaves an HttpOnly,
SameSite=Strict cookie scoped to the dashboard's paths (no script reads it, it opens
nothing else) and the token leaves the address bar; a name rebound to the service's
address (chromium's resolver maps it, as a DNS-rebinding attacker's DNS would) reads
nothing, even with no token set.

`.ci/run` installs chromium; without it (a developer machine) the test skips."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from browserutil import CHROMIUM, CHROMIUM_ARGS
from clitools import Proc, kvindex

from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(90)

if not Path(CHROMIUM).exists():
    pytest.skip(
        "chromium is not installed (apt-get install chromium; .ci/run does)",
        allow_module_level=True,
    )

from playwright.sync_api import BrowserContext, sync_playwright  # noqa: E402

TOKEN = "a-dashboard-token-0123456789"
REBOUND = "rebound.test"  # the attacker's name, resolved to the service's address


@pytest.fixture(scope="module")
def pub() -> Iterator[Publisher]:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as p:
        p.publish([BlockStored([77], None, list(range(4)), 4)])
        yield p


def serve(pub: Publisher, token: str | None) -> tuple[Proc, str]:
    env_token = {"KVINDEX_TOKEN": token} if token else {}
    os.environ.update(env_token)  # the child inherits it (never a flag `ps` shows)
    try:
        proc = kvindex(
            "serve", "--store", "memory", "--http", "127.0.0.1:0",
            "--instance", f"a={pub.endpoint},replay={pub.replay_endpoint}",
        )  # fmt: skip
    finally:
        for key in env_token:
            del os.environ[key]
    line = proc.wait_for(proc.out, lambda s: "listening on" in s, timeout=20)
    return proc, line.split("listening on ")[1].split()[0]


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrowserContext]:
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            args=[*CHROMIUM_ARGS, f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1"],
        )
        try:
            yield context
        finally:
            context.close()


def test_the_token_becomes_an_httponly_cookie_for_the_dashboard_only(
    pub: Publisher, browser: BrowserContext
) -> None:
    proc, url = serve(pub, TOKEN)
    try:
        page = browser.new_page()
        page.goto(f"{url}?token={TOKEN}")
        assert page.url == url  # the token left the address bar (and the history)
        (cookie,) = [c for c in browser.cookies() if c["name"].startswith("kvindex")]
        assert cookie["name"] == "kvindex_session" and cookie["value"] != TOKEN
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert cookie["path"] == "/v1/dashboard/" and not cookie["secure"]  # plain HTTP
        assert page.evaluate("document.cookie") == ""  # no script reads it
        # The page's stream and lookup box work with it ...
        page.wait_for_selector("#instances-body tr[data-instance=a]", timeout=15_000)
        page.fill("#tokens", ", ".join(map(str, range(8))))
        page.click("[data-testid=lookup-go]")
        page.wait_for_function("document.getElementById('lookup-result').dataset.state === 'done'")
        matched = page.get_attribute("#lookup-result tr[data-instance=a]", "data-matched")
        assert matched == "1"
        # ... and it opens nothing else.
        status = page.evaluate("fetch('/v1/instances').then(r => r.status)")
        assert status == 401
        page.close()
    finally:
        proc.interrupt()
        assert proc.finish() == 0


def test_a_rebound_name_reads_nothing_even_without_a_token(
    pub: Publisher, browser: BrowserContext
) -> None:
    proc, url = serve(pub, None)
    port = url.rstrip("/").rsplit(":", 1)[1]
    try:
        page = browser.new_page()
        for host, status in [(REBOUND, 400), ("localhost", 200), ("127.0.0.1", 200)]:
            response = page.goto(f"http://{host}:{port}/v1/instances")
            assert response is not None and response.status == status, (host, response)
            if status == 400:
                assert "is not served here" in response.json()["error"]
            else:
                assert response.json()["instances"][0]["name"] == "a"
        page.close()
    finally:
        proc.interrupt()
        assert proc.finish() == 0
