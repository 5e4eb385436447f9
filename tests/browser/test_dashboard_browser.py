"""The dashboard in a real browser: Playwright driving Debian's chromium (never a browser
download) against `kvindex demo`. The page must show live data whose numbers change,
agree with `/v1/instances` once the load pauses, and answer a lookup from its own lookup
box with the router's pick highlighted. The live page's screenshot is saved as
docs/dashboard.png, the picture the README shows.

`.ci/run` installs chromium; without it (a developer machine) the test skips."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from browserutil import CHROMIUM_ARGS
from clitools import ROOT, Proc, kvindex
from netutil import wait_until

pytestmark = pytest.mark.timeout(90)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# The README's picture is refreshed only on request (KVINDEX_UPDATE_DOCS=1), so that a test
# run leaves the tracked file alone; otherwise the screenshot still proves the page renders.
SCREENSHOT = (
    ROOT / "docs" / "dashboard.png"
    if os.environ.get("KVINDEX_UPDATE_DOCS") == "1"
    else Path(tempfile.gettempdir()) / "kvindex-dashboard.png"
)
LOAD_SECONDS = 22.0

if not Path(CHROMIUM).exists():
    pytest.skip(
        "chromium is not installed (apt-get install chromium; .ci/run does)",
        allow_module_level=True,
    )

from playwright.sync_api import BrowserContext, Page, sync_playwright  # noqa: E402


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrowserContext]:
    """Chromium, launched before the demo starts: its launch (seconds on a loaded machine)
    must not eat into the demo's LOAD_SECONDS of live traffic, which the page must see."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            viewport={"width": 1440, "height": 900},
            color_scheme="dark",
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="module")
def demo(browser: BrowserContext) -> Iterator[tuple[Proc, str]]:
    proc = kvindex(
        "demo",
        "--no-discover",  # the README's picture shows the engines by their short names
        "--instances",
        "4",
        "--http",
        "127.0.0.1:0",
        "--seed",
        "2",  # has two restarts and two resets early on
        # busier than the default demo, so that a short run shows evictions, restarts,
        # resets and replays (the screenshot is the README's picture)
        "--rate",
        "60",
        "--gpu-blocks",
        "1024",
        "--restart-every",
        "8",
        "--reset-every",
        "6",
        "--pause-after",
        str(LOAD_SECONDS),
        "--duration",
        "80",
    )
    try:
        line = proc.wait_for(proc.out, lambda s: "dashboard at http" in s, timeout=20)
        yield proc, line.split("dashboard at ")[1].split()[0]
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def page(browser: BrowserContext, demo: tuple[Proc, str]) -> Iterator[Page]:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(demo[1])
    yield page
    assert not errors, errors


def rows(page: Page) -> dict[str, dict[str, Any]]:
    """The instances table as the page shows it."""
    found: list[dict[str, Any]] = page.evaluate(
        """() => [...document.querySelectorAll('#instances-body tr[data-instance]')].map(tr => ({
            name: tr.dataset.instance,
            blocks: Number(tr.dataset.blocks),
            last_seq: tr.dataset.lastSeq === '' ? null : Number(tr.dataset.lastSeq),
            gpu: tr.querySelector('[data-col=gpu]').textContent,
            lower: tr.querySelector('[data-col=lower]').textContent,
            status: tr.querySelector('.pill').textContent,
        }))"""
    )
    return {row["name"]: row for row in found}


def fleet_blocks(page: Page) -> int:
    return int(page.get_attribute("[data-testid=fleet-blocks]", "data-value") or 0)


def test_dashboard_live_numbers_lookup_and_screenshot(page: Page, demo: tuple[Proc, str]) -> None:
    proc, url = demo
    page.wait_for_selector("#instances-body tr[data-instance]", timeout=15_000)
    page.wait_for_function("document.getElementById('conn').dataset.state === 'live'")
    # the demo's SGLang engine (found by its URL) beside the vLLM ones
    assert sorted(rows(page)) == ["sglang-0", "vllm-0", "vllm-1", "vllm-2", "vllm-3"]

    # live: the numbers move from one snapshot to the next (while the demo's load runs)
    first = fleet_blocks(page)
    assert not any("load paused" in line for line in list(proc.out)), (
        f"the demo's {LOAD_SECONDS:g} s of load were over before the page was live"
    )
    page.wait_for_function(
        f"Number(document.querySelector('[data-testid=fleet-blocks]').dataset.value) !== {first}",
        timeout=10_000,
    )
    page.wait_for_function(
        "Number(document.querySelector('[data-testid=fleet-events]').dataset.value) > 0"
    )
    assert page.locator(".u-over").count() == 2  # both charts drawn

    run_lookup_from_the_page(page)
    if SCREENSHOT.parent.name == "docs":
        time.sleep(12.0)  # a few more seconds of history for the README's picture
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.stat().st_size > 10_000

    # paused: the fleet comes to rest (a batch dropped last is still fetched by replay),
    # and from then on the page's numbers equal the API's, exactly
    proc.wait_for(proc.out, lambda s: "load paused" in s, timeout=LOAD_SECONDS + 10)
    assert wait_until(lambda: not disagreements(page, url), timeout=12, step=0.3), disagreements(
        page, url
    )
    check_lookup_matches_the_api(page, url)


def _lower_tiers(tiers: dict[str, int]) -> str:
    """The page's lower-tier cell: the cpu, disk and external blocks, or a dash."""
    lower = [tiers[t] for t in ("cpu", "disk", "external") if t in tiers]
    return f"{sum(lower):,}" if lower else "\u2013"  # an en dash


def disagreements(page: Page, url: str) -> list[str]:
    """Where the page differs from /v1/instances (empty: nowhere)."""
    api = {i["name"]: i for i in httpx.get(url + "v1/instances").json()["instances"]}
    shown = rows(page)
    wrong = []
    for name, want in api.items():
        row = shown[name]
        expected = {
            "blocks": want["blocks"],
            "last_seq": want["last_seq"],
            "gpu": f"{want['blocks_by_tier'].get('gpu', 0):,}",
            "lower": _lower_tiers(want["blocks_by_tier"]),
            "status": want["status"],
        }
        wrong += [f"{name}.{k}: {row[k]} != {v}" for k, v in expected.items() if row[k] != v]
    if fleet_blocks(page) != sum(i["blocks"] for i in api.values()):
        wrong.append("fleet blocks")
    if page.get_attribute("[data-testid=fleet-events]", "data-value") != "0":
        wrong.append("still moving")
    return wrong


def run_lookup_from_the_page(page: Page) -> None:
    page.wait_for_function("document.querySelectorAll('#recent option').length > 1")
    page.select_option("#recent", index=1)  # the newest prompt: runs the lookup
    page.wait_for_selector("#lookup-result tr.pick", timeout=10_000)
    matched = page.eval_on_selector_all(
        "#lookup-result tr[data-instance]", "trs => trs.map(tr => Number(tr.dataset.matched))"
    )
    pick = int(page.get_attribute("#lookup-result tr.pick", "data-matched") or -1)
    assert pick == max(matched) > 0
    assert "router pick" in page.inner_text("#lookup-result tr.pick").lower()


def check_lookup_matches_the_api(page: Page, url: str) -> None:
    with page.expect_request("**/v1/dashboard/lookup") as sent:
        page.click("[data-testid=lookup-go]")
    page.wait_for_function("document.getElementById('lookup-result').dataset.state === 'done'")
    body = json.loads(sent.value.post_data or "{}")
    tokens = [int(t) for t in page.input_value("#tokens").replace(",", " ").split()]
    lora = page.input_value("#lora") or None
    assert body["token_ids"] == tokens and body.get("lora_name") == lora
    # the page's own request (an SGLang prompt's cache_salt included) against the API's answer
    answer = httpx.post(url + "v1/lookup", json=body).json()
    shown = page.eval_on_selector_all(
        "#lookup-result tr[data-instance]",
        "trs => trs.map(tr => [tr.dataset.instance, Number(tr.dataset.matched)])",
    )
    assert shown == [[r["name"], r["matched_blocks"]] for r in answer["instances"]]
    picks = page.locator("#lookup-result tr.pick")
    if answer["best"] is None:  # the prompt was evicted everywhere meanwhile: no pick shown
        assert picks.count() == 0
    else:  # the API's best, or (a tie) the instance the chosen prompt came from
        picked = picks.get_attribute("data-instance")
        matched = {r["name"]: r["matched_blocks"] for r in answer["instances"]}
        origin = (page.text_content("#recent option:checked") or "").split(" · ")[0]
        assert picked == answer["best"] or (
            picked == origin and matched[origin] == matched[answer["best"]]
        ), (picked, origin, answer)


def test_dashboard_fits_a_420_px_screen_and_says_what_its_numbers_are(
    page: Page, demo: tuple[Proc, str], tmp_path: Path
) -> None:
    """Issue 14: the header wrapped and the matrix was clipped at 420 px; the sharing
    matrix refreshed every 5 s without saying so; units were unexplained."""
    narrow = page.context.new_page()
    try:
        narrow.set_viewport_size({"width": 420, "height": 900})
        narrow.goto(demo[1])
        narrow.wait_for_selector("#instances-body tr[data-instance]", timeout=15_000)
        narrow.wait_for_selector("table.matrix", timeout=15_000)
        narrow.wait_for_selector("[data-testid=spark-range]", timeout=15_000)
        sizes = narrow.evaluate(
            """() => ({
                page: document.documentElement.scrollWidth,
                header: document.querySelector('header.top').getBoundingClientRect().height,
                matrixOverflow: getComputedStyle(document.getElementById('matrix')).overflowX,
                matrixRight: document.getElementById('matrix').getBoundingClientRect().right,
            })"""
        )
        hint = narrow.text_content("[data-testid=sharing-hint]") or ""
        note = narrow.text_content(".matrix-note") or ""
        units = narrow.eval_on_selector_all(
            "#prefixes .score small", "els => els.map(e => e.textContent)"
        )
        narrow.screenshot(path=str(tmp_path / "narrow.png"), full_page=True)
    finally:
        narrow.close()
    assert sizes["page"] <= 420, sizes  # nothing runs off the screen
    assert sizes["header"] <= 60, sizes  # one line, not wrapped
    assert sizes["matrixOverflow"] == "auto" and sizes["matrixRight"] <= 420, sizes
    assert re.search(r"every \d+ s · as of ", hint), hint
    assert "updated every second" in note
    assert set(units) <= {"blocks \N{MULTIPLICATION SIGN} instances"}


def test_lookup_tie_prefers_the_instance_the_prompt_came_from(page: Page) -> None:
    rows = [
        {"name": "vllm-2", "status": "live", "matched_blocks": 70},
        {"name": "vllm-3", "status": "live", "matched_blocks": 70},
        {"name": "vllm-1", "status": "down", "matched_blocks": 70},
        {"name": "vllm-0", "status": "live", "matched_blocks": 12},
    ]
    pick = "(a) => window.kvindexPickRow(a.rows, a.best, a.origin).pick.name"
    assert page.evaluate(pick, {"rows": rows, "best": "vllm-2", "origin": "vllm-3"}) == "vllm-3"
    assert page.evaluate(pick, {"rows": rows, "best": "vllm-2", "origin": None}) == "vllm-2"
    assert page.evaluate(pick, {"rows": rows, "best": "vllm-2", "origin": "vllm-0"}) == "vllm-2"
    assert page.evaluate(pick, {"rows": rows, "best": "vllm-2", "origin": "vllm-1"}) == "vllm-2"


def test_dashboard_shows_what_the_doctor_finds(page: Page, demo: tuple[Proc, str]) -> None:
    """The Doctor card renders GET /v1/doctor: its problems (each with its fix) or, with
    none, how many checks passed; the count agrees with the endpoint's."""
    page.wait_for_selector("[data-testid=doctor][data-problems]", timeout=30_000)

    def agrees() -> bool:
        doc = httpx.get(demo[1].rstrip("/") + "/v1/doctor", timeout=10).json()
        shown = page.get_attribute("[data-testid=doctor]", "data-problems")
        return shown == str(doc["problems"])

    assert wait_until(agrees, timeout=40, step=1.0)
    text = page.text_content("[data-testid=doctor]") or ""
    if page.get_attribute("[data-testid=doctor]", "data-problems") == "0":
        assert "No problem found" in text and "checks passed" in text
    else:
        assert "→" in text  # each problem with its fix
