"""`kvindex simulate --format sglang`: simulated SGLang 0.5.23 engines. Their wire is
SGLang's (fields, media, signed hashes, merged events), an index fed their stream equals
their pools (page size 1 and 16, salted chains, the host and disk tiers), and `kvindex
serve` finds them by URL (`sglang+http://`, their `/server_info`) and follows their
pools and load stream exactly, over the real sockets."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import httpx
import msgspec
import pytest
from clitools import child_env, kvindex
from netutil import serve_url, wait_until
from service_workload import TestClient

from kvindex.index import FleetIndex
from kvindex.runtime import Fleet
from kvindex.service.app import create_app
from kvindex.sim import SimBatch, SimConfig, SimRestart, SimulatedPublishers, Simulation
from kvindex.subscriber import SourceKey
from kvindex.wire import BatchDecoder

pytestmark = pytest.mark.timeout(90)

I64 = 2**63
# Small pools (in tokens, whatever the page size) and frequent incidents: every tier fills
# and evicts in a short run.
TOKENS = 1536


def config(page: int, **over: Any) -> SimConfig:
    blocks = TOKENS // page
    base: dict[str, Any] = {
        "instances": 3,
        "dp": 2,
        "format": "sglang",
        "block_size": page,
        "seed": 7,
        "gpu_blocks": blocks,
        "cpu_blocks": 2 * blocks,
        "disk_blocks": 2 * blocks,
        "restart_every": 400,
        "reset_every": 350,
        "name_prefix": "sglang",
    }
    base.update(over)
    return SimConfig(**base)


def copies(index: FleetIndex, source: SourceKey) -> dict[Any, Any]:
    return {pool: held for pool, held in index.copies(source).items() if held}


# -- the wire --------------------------------------------------------------------------------


STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]


@pytest.mark.parametrize("page", [1, 16])
def test_events_are_sglangs(page: int) -> None:
    sim = Simulation(config(page, restart_every=0))
    seen: Counter[tuple[str, str]] = Counter()
    for item in sim.items(1500):
        assert isinstance(item, SimBatch)
        ts, events, rank = msgspec.msgpack.decode(item.payload)
        assert isinstance(ts, float) and rank == item.rank
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                # omit_defaults: the fields without a default always, the others when set
                assert list(event)[:6] == STORED_KEYS and event["lora_id"] is None
                assert set(event) - set(STORED_KEYS) <= {"medium", "cache_salt", "lora_name"}
                assert event["block_size"] == page
                assert len(event["token_ids"]) == page * len(event["block_hashes"])
                seen[kind, event["medium"]] += 1
                seen["salt", ""] += "cache_salt" in event
            elif kind == "BlockRemoved":
                assert list(event) == ["type", "block_hashes", "medium"]
                seen[kind, event["medium"]] += 1
            else:
                assert event == {"type": "AllBlocksCleared"}
            for h in event.get("block_hashes", []):
                assert isinstance(h, int) and -I64 <= h < I64
        # the recorder merges consecutive removals of one medium
        kinds = [(e["type"], e.get("medium")) for e in events]
        pairs = itertools.pairwise(kinds)
        assert not any(a == b and a[0] == "BlockRemoved" for a, b in pairs)
    for medium in ("GPU", "CPU_PINNED", "DISK"):
        assert seen["BlockStored", medium] and seen["BlockRemoved", medium], seen
    assert seen["salt", ""], seen


@pytest.mark.parametrize("page", [1, 16])
def test_index_fed_in_process_equals_the_pools(page: int) -> None:
    sim = Simulation(config(page))
    index = FleetIndex()
    decoder = BatchDecoder()
    media: set[str] = set()
    for _ in range(6):
        for item in sim.items(250):
            if isinstance(item, SimRestart):
                for rank in range(sim.config.dp):
                    index.drop_source(SourceKey(item.instance, rank))
                continue
            index.apply(item.source, decoder.decode(item.payload), item.seq)
        for source, pools in sim.reference().items():
            assert copies(index, source) == pools, source
            media.update(medium for _, medium in pools)
    assert media == {"GPU", "CPU_PINNED", "DISK"}
    assert sim.restarts and sim.resets


def test_salted_pages_match_only_their_salt() -> None:
    sim = Simulation(config(16, restart_every=0, reset_every=0))
    index = FleetIndex()
    for item in sim.items(600):
        assert isinstance(item, SimBatch)
        index.apply(item.source, BatchDecoder().decode(item.payload), item.seq)
    salted = [p for p in sim.recent_prompts(32) if p["cache_salt"] and not p["lora_name"]]
    assert salted
    prompt = salted[0]
    full = len(prompt["token_ids"]) // 16

    def matched(salt: str | None) -> int:
        rows = index.lookup(prompt["token_ids"], None, salt)
        return max((r.matched_blocks for r in rows if r.instance == prompt["instance"]), default=0)

    assert matched(prompt["cache_salt"]) >= full - 1
    assert matched(None) == 0 and matched("another-tenant") == 0


# -- found by URL, followed over the wire -----------------------------------------------------


def settle(fleet: Fleet, live: SimulatedPublishers) -> None:
    reference = live.reference()

    def equal() -> bool:
        return all(copies(fleet.index, s) == pools for s, pools in reference.items())

    assert wait_until(equal, timeout=20), {
        str(s): (
            {k: len(v) for k, v in copies(fleet.index, s).items()},
            {k: len(v) for k, v in p.items()},
        )
        for s, p in reference.items()
    }


@pytest.mark.parametrize("page", [1, 16])
def test_fleet_discovers_the_simulated_engines_and_equals_their_pools(page: int) -> None:
    cfg = config(page, instances=2, restart_every=0, reset_every=0, seed=11)
    with SimulatedPublishers(cfg, rate=400) as live:
        specs = live.specs()
        assert all(s.pending and s.discover for s in specs)
        fleet = Fleet(specs)
        with TestClient(create_app(fleet)):
            live_now = lambda: all(fleet.status(s.name).value == "live" for s in specs)  # noqa: E731
            assert wait_until(live_now, 15)
            live.start()
            time.sleep(2.0)
            live.stop()
            settle(fleet, live)
            held = Counter(m for pools in live.reference().values() for _, m in pools)
            assert held["GPU"] and held["CPU_PINNED"], held
            assert any(r["cache_salt"] for r in live.recent_prompts(32))
            view = fleet.instance_view("sglang-1")
            assert view.discovery is not None and view.discovery.block_size == page
            assert view.discovery.load_stream
            loads = [rank.load for rank in view.ranks]
            assert all(load is not None and load.readings for load in loads)


def test_serve_follows_simulate_by_url() -> None:
    """Two processes, as a user runs them: `kvindex simulate --format sglang` prints the
    URLs, `kvindex serve --instance NAME=sglang+http://...` follows every rank and tier."""
    sim = kvindex(
        "simulate", "--format", "sglang", "--instances", "2", "--dp", "2", "--base-port", "0",
        "--rate", "200", "--gpu-blocks", "1024", "--restart-every", "0", "--reset-every", "0",
    )  # fmt: skip
    serve = None
    try:
        sim.wait_for(sim.out, lambda s: s.startswith("  kvindex serve"), timeout=15)
        assert "SGLang 0.5.23 wire format, page size 1" in sim.out[0]
        flags = sim.out[-1].split()[2:]
        assert next(f for f in flags if f != "--instance").startswith("sglang-0=sglang+http://")
        serve = subprocess.Popen(
            [sys.executable, "-m", "kvindex", "serve", "--store", "memory", "--http",
             "127.0.0.1:0", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        )  # fmt: skip
        url = serve_url(serve)
        with httpx.Client(base_url=url, timeout=10) as client:

            def every_tier() -> bool:
                rows = client.get("/v1/instances").json()["instances"]
                return (
                    len(rows) == 2
                    and all(
                        r["status"] == "live"
                        and len(r["ranks"]) == 2
                        and r["blocks_by_medium"].get("GPU")
                        and all(rank["load"] and rank["load"]["readings"] for rank in r["ranks"])
                        for r in rows
                    )
                    and any(r["blocks_by_medium"].get("CPU_PINNED") for r in rows)
                )

            assert wait_until(every_tier, timeout=30), client.get("/v1/instances").json()
            row = client.get("/v1/instances").json()["instances"][0]
            assert row["discovery"]["block_size"] == 1 and row["discovery"]["load_stream"]
            cpu = client.get("/v1/instances/sglang-1/blocks?medium=cpu").json()
            assert cpu["block_hashes"]
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait(15)
        sim.kill()


# -- the command line -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--format", "sglang", "--hashes", "bytes"], "SGLang publishes int hashes only"),
        (["--format", "sglang", "--page-size", "0"], "--page-size"),
        (["--format", "sglang", "--page-size", "4096"], "at most 1024 tokens per block"),
        (["--format", "sglang", "--gpu-blocks", "4"], "--gpu-blocks must be at least 8"),
        (["--format", "sglan"], "invalid choice: 'sglan'"),
    ],
)
def test_bad_flags_are_one_line_errors(flags: list[str], says: str) -> None:
    proc = kvindex("simulate", "--base-port", "0", "--duration", "1", *flags)
    assert proc.finish() == 2
    errors = [line for line in proc.err if "error" in line]
    assert len(errors) == 1 and says in errors[0], proc.err
    assert not any("Traceback" in line for line in proc.err)


def test_busy_http_port_is_a_usage_error() -> None:
    with SimulatedPublishers(config(16, instances=1, dp=1)) as live:
        sim = kvindex(
            "simulate", "--format", "sglang", "--instances", "1", "--base-port",
            str(live.base_port), "--duration", "1",
        )  # fmt: skip
        assert sim.finish() == 2
        assert len(sim.err) == 1 and "can't bind port" in sim.err[0], sim.err
