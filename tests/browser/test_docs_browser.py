"""`/docs` renders in chromium with every request off this host blocked (an air-gapped
cluster): Swagger UI's own script draws one block per API operation, and nothing was
even asked of another host. Skips without Debian's chromium (.ci/run installs it)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from browserutil import CHROMIUM_ARGS
from clitools import Proc, kvindex

pytestmark = pytest.mark.timeout(90)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(
        "chromium is not installed (apt-get install chromium; .ci/run does)",
        allow_module_level=True,
    )

from playwright.sync_api import Route, sync_playwright  # noqa: E402


@pytest.fixture(scope="module")
def serve() -> Iterator[str]:
    proc: Proc = kvindex("serve", "--store", "memory", "--http", "127.0.0.1:0")
    try:
        line = proc.wait_for(proc.out, lambda s: "listening on" in s, timeout=20)
        yield line.split("listening on ")[1].split()[0].rstrip("/")
    finally:
        proc.interrupt()
        proc.finish()


def test_api_docs_render_without_any_other_host(serve: str) -> None:
    here = urlsplit(serve).netloc
    elsewhere: list[str] = []

    def only_here(route: Route) -> None:
        if urlsplit(route.request.url).netloc in (here, ""):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.route("**/*", only_here)
            page.goto(serve + "/docs")
            page.wait_for_selector(".opblock", timeout=30_000)
            operations = page.locator(".opblock").count()
            spec = page.evaluate("fetch('/openapi.json').then(r => r.json())")
        finally:
            browser.close()
    expected = sum(len(methods) for methods in spec["paths"].values())
    assert operations >= expected > 5
    assert elsewhere == [] and errors == []
