"""`GET /v1/doctor` and `kvindex doctor` (issue 25): each mis-wiring produced for real
(silent and live publishers on loopback, engines' `/metrics` and `/tokenize` served over
real HTTP, a port nobody listens on, batches stamped two minutes ago, lookups by tokens the
engine never cached, a tokenizer with another chat template) and found, with its fix;
a fleet wired right has no problem and the command exits 0."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpfixture import FakeEngine, serve_app, serve_engine, vllm_metrics
from netutil import wait_until
from tokenizer_fixture import PARTS, build_tokenizer

from kvindex.runtime import Fleet
from kvindex.runtime.tokenize import LocalTokenizer, Tokenizers
from kvindex.service.app import create_app
from kvindex.service.lookups import Routing
from kvindex.subscriber import InstanceSpec
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(90)

TOKENS = list(range(100, 164))  # 4 blocks of 16


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served(specs: list[InstanceSpec], tokenizers: Tokenizers | None = None) -> Iterator[str]:
    fleet = Fleet(specs)
    routing = Routing.of(fleet, tokenizers) if tokenizers is not None else Routing.of(fleet)
    with serve_app(create_app(fleet, routing=routing)) as url:
        yield url


def findings(url: str) -> dict[tuple[str, str | None], dict[str, Any]]:
    doc = httpx.get(url + "/v1/doctor", timeout=10).json()
    return {(f["check"], f["engine"]): f for f in doc["findings"]}


def verdict(url: str, check: str, engine: str | None) -> str | None:
    found = findings(url).get((check, engine))
    return None if found is None else str(found["verdict"])


def test_each_miswiring_is_found_with_its_fix(tmp_path: Path) -> None:
    serving = FakeEngine()  # serves, its prefix cache reused, block size 16
    serving.metrics = vllm_metrics(waiting=0, running=2, kv=0.3, queries=5000, hits=2500)
    with ExitStack() as stack:
        silent = stack.enter_context(Publisher("tcp://127.0.0.1:*"))  # events never sent
        late = stack.enter_context(Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
        engine_url = stack.enter_context(serve_engine(serving))
        specs = [
            InstanceSpec("quiet", silent.endpoint, http=engine_url),
            InstanceSpec(
                "skewed",
                late.endpoint,
                late.replay_endpoint,
                http=engine_url,
                block_size=32,  # as a router was told; the engine says 16
            ),
            InstanceSpec(
                "nometrics",
                late.endpoint,
                late.replay_endpoint,
                http=f"http://127.0.0.1:{closed_port()}",
            ),
        ]
        url = stack.enter_context(served(specs))
        # batches stamped two minutes ago: the engine's clock is behind
        stamp = time.time() - 120
        late.publish([BlockStored([1, 2, 3, 4], None, TOKENS, 16)], ts=stamp)

        def all_found() -> bool:
            late.publish([BlockStored([9], None, list(range(16)), 16)], ts=time.time() - 120)
            for _ in range(3):  # lookups by tokens no engine holds (another tokenization)
                httpx.post(url + "/v1/lookup", json={"token_ids": list(range(900, 964))})
            f = findings(url)
            return all(
                f.get(key, {}).get("verdict") == "problem"
                for key in (
                    ("events", "quiet"),
                    ("replay", "quiet"),
                    ("block_size", "skewed"),
                    ("metrics", "nometrics"),
                    ("clock", "skewed"),
                    ("lookups", None),
                )
            )

        assert wait_until(all_found, timeout=30, step=0.3), findings(url)
        f = findings(url)
        assert "not one KV event batch came" in f[("events", "quiet")]["message"]
        assert "--kv-events-config" in f[("events", "quiet")]["fix"]
        assert "no replay endpoint" in f[("replay", "quiet")]["message"]
        assert "block size 16, kvindex has 32" in f[("block_size", "skewed")]["message"]
        assert "left out" in f[("metrics", "nometrics")]["message"]
        assert "clock is behind" in f[("clock", "skewed")]["message"]
        assert "matched nothing" in f[("lookups", None)]["message"]
        for key in (("replay", "skewed"), ("events", "skewed"), ("metrics", "skewed")):
            assert f[key]["verdict"] == "ok", f[key]
        doc = httpx.get(url + "/v1/doctor", timeout=10).json()
        said = {(x["check"], x["engine"]) for x in doc["findings"] if x["verdict"] == "problem"}
        assert said == {
            ("events", "quiet"),
            ("replay", "quiet"),
            ("block_size", "skewed"),
            ("metrics", "nometrics"),
            ("clock", "skewed"),
            ("clock", "nometrics"),  # it follows the same late publisher
            ("lookups", None),
        }
        assert doc["ok"] is False and doc["problems"] == 7

        # the command: one line per problem with its fix, exit 1
        proc = subprocess.run(
            [sys.executable, "-m", "kvindex", "doctor", "--url", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 1, proc.stderr
        lines = proc.stdout.strip().splitlines()
        problems = [line for line in lines if line.startswith("[problem]")]
        assert len(problems) == 7 and all(" -> " in line for line in problems)
        assert lines[-1] == "7 problem(s) found"


def test_a_chat_template_other_than_the_engines_is_found(tmp_path: Path) -> None:
    ours = build_tokenizer(tmp_path / "ours")  # ChatML
    theirs = LocalTokenizer.load(build_tokenizer(tmp_path / "theirs", template=PARTS))
    with ExitStack() as stack:
        pub = stack.enter_context(Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
        engine_url = stack.enter_context(serve_engine(FakeEngine(theirs)))
        spec = InstanceSpec("e0", pub.endpoint, pub.replay_endpoint, model="m", http=engine_url)
        fleet_specs = [spec]
        tokenizers = Tokenizers()
        tokenizers.add("m", str(ours))
        url = stack.enter_context(served(fleet_specs, tokenizers))
        f = findings(url)[("chat_template", None)]
        assert f["verdict"] == "problem" and "m: a chat tokenizes to" in f["message"]
        assert "--tokenizer" in f["fix"]
    same = LocalTokenizer.load(ours)
    with ExitStack() as stack:
        pub = stack.enter_context(Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
        engine_url = stack.enter_context(serve_engine(FakeEngine(same)))
        spec = InstanceSpec("e0", pub.endpoint, pub.replay_endpoint, model="m", http=engine_url)
        tokenizers = Tokenizers()
        tokenizers.add("m", str(ours))
        url = stack.enter_context(served([spec], tokenizers))
        assert verdict(url, "chat_template", None) == "ok"


def test_a_fleet_wired_right_has_no_problem_and_the_command_exits_0() -> None:
    engine = FakeEngine()
    engine.metrics = vllm_metrics(waiting=0, running=1, kv=0.1, queries=640, hits=320)
    with ExitStack() as stack:
        pub = stack.enter_context(Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
        engine_url = stack.enter_context(serve_engine(engine))
        spec = InstanceSpec("e0", pub.endpoint, pub.replay_endpoint, http=engine_url)
        url = stack.enter_context(served([spec]))

        def healthy() -> bool:
            pub.publish([BlockStored([1, 2, 3, 4], None, TOKENS, 16)])
            httpx.post(url + "/v1/route", json={"token_ids": TOKENS})  # what a router asks
            f = findings(url)
            return all(f.get((c, "e0"), {}).get("verdict") == "ok"
                       for c in ("events", "replay", "block_size", "metrics", "clock"))  # fmt: skip

        assert wait_until(healthy, timeout=30, step=0.3), findings(url)
        proc = subprocess.run(
            [sys.executable, "-m", "kvindex", "doctor", "--url", url, "--all"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.strip().splitlines()[-1] == "no problem found"
        assert "[ok] block_size: e0: 16 on both sides" in proc.stdout


def test_doctor_against_nothing_is_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvindex", "doctor", "--url", f"http://127.0.0.1:{closed_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("kvindex doctor: error: can't ask")


@contextmanager
def caching_engine(
    engine: FakeEngine, pub: Publisher, lora_name: str | None
) -> Iterator[threading.Event]:
    """The engine's completions cached and published as vLLM would (whole blocks of the
    prompt's tokens), under `lora_name` if given; set the event to publish nothing."""
    stop, mute = threading.Event(), threading.Event()

    def watch() -> None:
        seen = 0
        while not stop.is_set():
            for path, body in engine.requests[seen:]:
                if path == "/v1/completions" and not mute.is_set():
                    assert engine.tokenizer is not None
                    ids = engine.tokenizer.encode_prompt(body["prompt"])
                    whole = len(ids) // 16
                    hashes = [hash(tuple(ids[: 16 * (i + 1)])) for i in range(whole)]
                    pub.publish([BlockStored(hashes, None, ids[: 16 * whole], 16,
                                             lora_name=lora_name)])  # fmt: skip
            seen = len(engine.requests)
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield mute
    finally:
        stop.set()
        thread.join(5)


@pytest.mark.parametrize("wiring", ["right", "lora", "muted"])
def test_the_engine_probe_finds_a_served_prompt_or_says_why_not(
    tmp_path: Path, wiring: str
) -> None:
    engine = FakeEngine(LocalTokenizer.load(build_tokenizer(tmp_path / "tok")))
    with ExitStack() as stack:
        pub = stack.enter_context(Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
        engine_url = stack.enter_context(serve_engine(engine))
        lora = "adapter" if wiring == "lora" else None
        mute = stack.enter_context(caching_engine(engine, pub, lora))
        if wiring == "muted":
            mute.set()
        spec = InstanceSpec("e0", pub.endpoint, pub.replay_endpoint, http=engine_url)
        url = stack.enter_context(served([spec]))
        assert wait_until(lambda: verdict(url, "events", "e0") in ("ok", "note"), timeout=15)
        time.sleep(0.5)  # the SUB's subscription reaches the publisher
        proc = subprocess.run(
            [sys.executable, "-m", "kvindex", "doctor", "--url", url, "--all",
             "--engine", f"e0={engine_url}", "--model", "m"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        line = next(x for x in proc.stdout.splitlines() if "served_prompt" in x)
        if wiring == "right":
            assert line.startswith("[ok] served_prompt: e0: a prompt the engine just served")
        else:
            assert line.startswith("[problem] served_prompt: e0: the engine served a new")
            assert proc.returncode == 1
        assert any(p == "/v1/completions" for p, _ in engine.requests)


def test_an_engine_without_events_by_its_spec_is_no_problem() -> None:
    """events=none: an engine serving (its /metrics counts prefix-cache queries) with no
    batch ever and no replay endpoint is what the spec says, not a mis-wiring."""
    engine = FakeEngine()
    engine.metrics = vllm_metrics(waiting=0, running=1, kv=0.1, queries=640, hits=320)
    with serve_engine(engine) as engine_url:
        spec = InstanceSpec.parse(f"n0=events=none,http={engine_url},block_size=16")
        with served([spec]) as url:
            httpx.post(url + "/v1/route", json={"token_ids": TOKENS})
            assert wait_until(lambda: verdict(url, "metrics", "n0") == "ok", timeout=30)
            found = findings(url)
            assert found[("events", "n0")]["verdict"] == "note"
            assert "4 blocks routed there" in found[("events", "n0")]["message"]
            assert found[("replay", "n0")]["verdict"] == "note"
            assert httpx.get(url + "/v1/doctor", timeout=10).json()["problems"] == 0
