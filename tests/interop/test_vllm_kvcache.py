"""The index equals vLLM 0.33's own block pool, driven through its real KVCacheManager.

Three engines (the real KVCacheManager + ZmqEventPublisher, CPU only) run a multi-turn chat
workload with eviction pressure; live sends are dropped at random; the subscriber starts
late; one engine has LoRA requests, one resets its prefix cache, and one is restarted (a
new process on the same ports, with another workload). At the end, each instance's blocks
must be exactly the pool's cached hashes (with copy counts) and each probe prompt's match
must be the number of leading blocks the pool holds by vLLM's own request block hashes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from driver_proc import Driver
from follow import caught_up, run_until
from netutil import free_port

from kvindex.index import FleetIndex
from kvindex.subscriber import InstanceSpec, Lost, ReplayPolicy, SourceKey, Subscriber

# The drivers' vLLM import may take minutes of wall time on a loaded machine (their
# readiness wait goes on while they use CPU: driver_proc.Driver.wait_ready).
pytestmark = [pytest.mark.interop, pytest.mark.timeout(360)]

COMMON = [
    "--steps",
    "300",
    "--num-blocks",
    "48",
    "--block-size",
    "16",
    "--drop-rate",
    "0.2",
    "--step-interval",
    "0.004",
    "--linger",
    "60",
]


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def expected_copies(reference: dict[str, Any]) -> dict[int, int]:
    copies: dict[int, int] = {}
    for block in reference["reference"]["cached_blocks"]:
        copies[int(block["hash"])] = copies.get(int(block["hash"]), 0) + block["copies"]
    return copies


def test_index_equals_block_pool(start_driver: Any) -> None:
    eps = {name: endpoints() for name in ("a", "b", "c")}
    drivers = {
        "a": start_driver("a", *eps["a"], "--seed", "1", *COMMON),
        "b": start_driver("b", *eps["b"], "--seed", "2", "--lora", *COMMON),
        "c": start_driver("c", *eps["c"], "--seed", "3", "--reset-at", "150", *COMMON),
    }
    for d in drivers.values():
        d.wait_ready()
    time.sleep(0.5)  # the service starts late: part of each stream is only in the replay buffer
    index = FleetIndex()
    policy = ReplayPolicy(first_reply_timeout=2, idle_timeout=1, max_attempts=5)
    specs = [InstanceSpec(n, pub, rep) for n, (pub, rep) in eps.items()]
    # The same fleet through `kvindex serve` and its HTTP API, beside the library.
    http = f"127.0.0.1:{free_port()}"
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvindex",
            "serve",
            "--store",
            "memory",
            "--http",
            http,
            *[arg for spec in specs for arg in ("--instance", spec.render())],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _check_library_and_service(start_driver, drivers, eps, index, specs, policy, http)
    finally:
        serve.terminate()
        serve.wait(10)


def _get(http: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://{http}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def _service_caught_up(http: str, refs: dict[str, Any]) -> bool:
    try:
        rows = {r["name"]: r for r in _get(http, "/v1/instances")["instances"]}
    except OSError:
        return False
    return all(
        rows.get(n, {}).get("last_seq") == r["published_batches"] - 1
        and rows[n]["status"] == "live"
        and rows[n]["publisher_restarts"] == (1 if n == "a" else 0)
        for n, r in refs.items()
    )


def _check_library_and_service(
    start_driver: Any,
    drivers: dict[str, Any],
    eps: dict[str, tuple[str, str]],
    index: FleetIndex,
    specs: list[InstanceSpec],
    policy: ReplayPolicy,
    http: str,
) -> None:
    with Subscriber(instances=specs, policy=policy) as sub:
        refs = {n: d.wait_done() for n, d in drivers.items()}
        assert all(r["dropped_seqs"] for r in refs.values())
        items = run_until(
            sub,
            index,
            lambda: all(caught_up(sub, n, r["published_batches"]) for n, r in refs.items()),
            60,
        )
        # Engine restart: a new process on a's ports, with another workload.
        drivers["a"].stop()
        drivers["a"] = start_driver("a2", *eps["a"], "--seed", "9", *COMMON)
        drivers["a"].wait_ready()
        refs["a"] = drivers["a"].wait_done()
        items += run_until(
            sub, index, lambda: caught_up(sub, "a", refs["a"]["published_batches"]), 60
        )
        assert sub.stats(SourceKey("a")).publisher_restarts == 1
    assert not [i for i in items if isinstance(i, Lost)]
    for name, ref in refs.items():
        copies = expected_copies(ref)
        assert index.block_hashes(name) == set(copies), name
        pools = index.copies(SourceKey(name))
        held: dict[int, int] = {}
        for pool in pools.values():
            for h, n in pool.items():
                held[int(h)] = held.get(int(h), 0) + n
        assert held == copies, name
        assert ref["probes"], name
        for probe in ref["probes"]:
            rows = {r.instance: r for r in index.lookup(probe["token_ids"], probe["lora_name"])}
            assert rows[name].matched_blocks == probe["num_cached_blocks"], (name, probe)
    assert any(p["num_cached_blocks"] > 0 for r in refs.values() for p in r["probes"])
    assert refs["c"]["event_counts"]["AllBlocksCleared"] >= 1
    # The service saw the same fleet: its answers must equal the block pools too.
    deadline = time.monotonic() + 30
    while not _service_caught_up(http, refs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _service_caught_up(http, refs), _get(http, "/v1/instances")
    for name, ref in refs.items():
        blocks = _get(http, f"/v1/instances/{name}/blocks")["block_hashes"]
        assert len(blocks) == len(set(blocks))
        assert {int(h) for h in blocks} == set(expected_copies(ref)), name
        for probe in ref["probes"]:
            body = {"token_ids": probe["token_ids"], "lora_name": probe["lora_name"]}
            rows = {r["name"]: r for r in _get(http, "/v1/lookup", body)["instances"]}
            assert rows[name]["matched_blocks"] == probe["num_cached_blocks"], (name, probe)


def _driver_of(code: str, tmp_path: Path) -> Driver:
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return Driver(proc, tmp_path / "out.json")


def test_the_readiness_wait_fails_on_a_hang_not_on_a_slow_import(tmp_path: Path) -> None:
    """wait_ready goes on while the driver uses CPU (a slow vLLM import on a loaded
    machine) and fails soon on one that uses none (blocked: a hang)."""
    hung = _driver_of("import time; time.sleep(60)", tmp_path)
    busy = _driver_of(
        "import json, time\nend = time.thread_time() + 3\nwhile time.thread_time() < end: pass\n"
        "print(json.dumps({'event': 'ready'}), flush=True)\ntime.sleep(60)",
        tmp_path,
    )
    try:
        start = time.monotonic()
        with pytest.raises(AssertionError, match="used no CPU for 2 s"):
            hung.wait_ready(timeout=30, stall=2)
        assert time.monotonic() - start < 10
        assert busy.wait_ready(timeout=60, stall=2) == {"event": "ready"}  # 3 CPU s
    finally:
        hung.stop()
        busy.stop()
