"""The simulated fleet (`kvindex.sim`): its wire output is exactly one vLLM generation's,
its pools stay within their sizes, and an index fed its stream equals its pools exactly
(duplicate copies, the CPU tier, LoRA, restarts, resets and DP ranks included), both
in process and over the real sockets through drops and engine restarts."""

from __future__ import annotations

import signal
import time
from collections import Counter
from typing import Any

import msgspec
import pytest
import zmq
from clitools import kvindex
from netutil import wait_until

from kvindex.index import FleetIndex
from kvindex.sim import SimBatch, SimConfig, SimRestart, SimulatedPublishers, Simulation, payloads
from kvindex.subscriber import Delivery, InstanceSpec, ReplayPolicy, SourceKey, Subscriber
from kvindex.wire import BatchDecoder, decode_batch, decode_seq
from kvindex.wire.events import _ArrayWireBatch, _MapWireBatch

pytestmark = pytest.mark.timeout(60)

U64 = 2**64
# Incidents often enough that a short run has several of each.
BUSY = {"restart_every": 300, "reset_every": 250, "gpu_blocks": 96, "cpu_blocks": 192}

STORED_033 = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
]
OFFLOADED_033 = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "group_idx",
]


def raw_events(config: SimConfig, batches: int) -> list[tuple[list[Any], SimBatch]]:
    sim = Simulation(config)
    out = []
    for item in sim.items(batches):
        if isinstance(item, SimBatch):
            out.append((msgspec.msgpack.decode(item.payload), item))
    return out


def is_hash(value: object, hashes: str) -> bool:
    if hashes == "int":
        return isinstance(value, int) and 0 <= value < U64
    return isinstance(value, bytes) and len(value) == 32


# -- the wire ------------------------------------------------------------------------------


def check_map_event(event: dict[str, Any], hashes: str, seen: Counter[str]) -> None:
    kind = event["type"]
    if kind == "BlockStored" and event["medium"] == "GPU":
        seen["gpu-store"] += 1
        assert list(event) == STORED_033  # vLLM's omit_defaults presence, in order
        n = len(event["block_hashes"])
        assert len(event["token_ids"]) == n * event["block_size"]
        lora = event["lora_name"]
        assert event["extra_keys"] == [[lora] if lora else None] * n
        assert (event["lora_id"] is None) == (lora is None)
        seen["lora"] += lora is not None
        parent = event["parent_block_hash"]
        assert parent is None or is_hash(parent, hashes)
    elif kind == "BlockStored":
        seen["cpu-store"] += 1
        assert list(event) == OFFLOADED_033 and event["medium"] == "CPU"
        assert len(event["block_hashes"]) == 1 and event["token_ids"] == []
    elif kind == "BlockRemoved":
        seen["remove-" + event["medium"]] += 1
        assert list(event) == ["type", "block_hashes", "medium", "group_idx"]
        if event["medium"] == "GPU":
            assert len(event["block_hashes"]) == 1  # one hash per event on the GPU path
    else:
        assert event == {"type": "AllBlocksCleared"}
        seen["clear"] += 1
    assert all(is_hash(h, hashes) for h in event.get("block_hashes", []))


@pytest.mark.parametrize("hashes", ["int", "bytes"])
def test_format_033_is_vllm_maps(hashes: str) -> None:
    config = SimConfig(format="0.33", hashes=hashes, dp=2, seed=1, **BUSY)  # type: ignore[arg-type]
    seen: Counter[str] = Counter()
    for batch, item in raw_events(config, 1500):
        assert isinstance(batch, list) and len(batch) == 3  # [ts, events, dp_rank]
        ts, events, rank = batch
        assert isinstance(ts, float) and rank == item.rank
        for event in events:
            assert isinstance(event, dict)
            check_map_event(event, hashes, seen)
    assert min(seen.values()) > 0 and len(seen) == 6, seen
    payload = raw_events(config, 1)[0][1].payload
    msgspec.msgpack.Decoder(_MapWireBatch).decode(payload)  # vLLM >= 0.24's typed decoders
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(_ArrayWireBatch).decode(payload)


@pytest.mark.parametrize("hashes", ["int", "bytes"])
def test_format_023_is_full_length_positional_arrays(hashes: str) -> None:
    config = SimConfig(format="0.23", hashes=hashes, seed=2, **BUSY)  # type: ignore[arg-type]
    lengths: Counter[tuple[str, int]] = Counter()
    for batch, _ in raw_events(config, 1500):
        _ts, events, _rank = batch
        for event in events:
            assert isinstance(event, list)
            lengths[(event[0], len(event))] += 1
            if event[0] == "BlockStored":
                medium = event[6]
                # the offloading path of vLLM <= 0.23 always publishes raw digests
                kind = hashes if medium == "GPU" else "bytes"
                assert all(is_hash(h, kind) for h in event[1])
                if medium == "GPU":
                    assert event[9:] == [0, "full_attention", None]
            elif event[0] == "BlockRemoved":
                kind = hashes if event[2] == "GPU" else "bytes"
                assert all(is_hash(h, kind) for h in event[1])
    # every field present: BlockStored 12 items with its tag, BlockRemoved 4, the clear 1
    assert set(lengths) == {("BlockStored", 12), ("BlockRemoved", 4), ("AllBlocksCleared", 1)}
    payload = raw_events(config, 1)[0][1].payload
    msgspec.msgpack.Decoder(_ArrayWireBatch).decode(payload)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(_MapWireBatch).decode(payload)


def test_same_seed_same_bytes() -> None:
    config = SimConfig(seed=7, **BUSY)
    assert payloads(config, 400) == payloads(config, 400)
    assert payloads(config, 50) != payloads(SimConfig(seed=8, **BUSY), 50)


# -- the pools -----------------------------------------------------------------------------


def test_eviction_keeps_every_pool_within_its_size() -> None:
    config = SimConfig(instances=3, dp=2, seed=3, gpu_blocks=40, cpu_blocks=80, cpu_every=1)
    sim = Simulation(config)
    removed = 0
    for item in sim.items(2000):
        removed += getattr(item, "removed", 0)
        for engine in sim.engines:
            assert sum(engine.gpu_copies().values()) <= config.gpu_blocks
            assert len(engine.cpu_digests()) <= config.cpu_blocks
            assert engine.used_blocks <= config.gpu_blocks
    assert removed > 1000  # the pools were full and evicted all along


def feed(sim: Simulation, index: FleetIndex, batches: int, stats: Counter[str]) -> None:
    decoder = BatchDecoder()
    for item in sim.items(batches):
        if isinstance(item, SimRestart):
            stats["restarts"] += 1
            for rank in range(sim.config.dp):
                index.drop_source(SourceKey(item.instance, rank))
            continue
        index.apply(item.source, decoder.decode(item.payload), item.seq)
        for pools in sim.reference().values():
            stats["duplicates"] += any(n > 1 for pool in pools.values() for n in pool.values())


def copies(index: FleetIndex, source: SourceKey) -> dict[Any, Any]:
    return {pool: held for pool, held in index.copies(source).items() if held}


@pytest.mark.parametrize(("fmt", "hashes"), [("0.33", "int"), ("0.23", "bytes")])
def test_index_fed_in_process_equals_the_pools(fmt: str, hashes: str) -> None:
    config = SimConfig(instances=3, dp=2, format=fmt, hashes=hashes, seed=4, **BUSY)  # type: ignore[arg-type]
    sim = Simulation(config)
    index = FleetIndex()
    stats: Counter[str] = Counter()
    for _ in range(10):
        feed(sim, index, 150, stats)
        reference = sim.reference()
        assert set(reference) == {SourceKey(f"vllm-{i}", r) for i in range(3) for r in range(2)}
        for source, pools in reference.items():
            assert copies(index, source) == pools, source
    media = {medium for pools in reference.values() for _, medium in pools}
    assert media == {"GPU", "CPU"}
    assert stats["restarts"] and sim.resets and stats["duplicates"], (stats, sim.resets)


# -- over the wire ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["0.33", "0.23"])
def test_index_fed_over_sockets_equals_the_pools(fmt: str) -> None:
    """Live messages dropped (filled from replay), engines restarted by closing and
    re-binding their sockets, DP ranks on port + r: at rest, the index equals the pools."""
    config = SimConfig(instances=2, dp=2, format=fmt, seed=5, **BUSY)  # type: ignore[arg-type]
    index = FleetIndex()
    policy = ReplayPolicy(idle_probe=0.3)  # a batch dropped last is asked for soon
    with (
        SimulatedPublishers(config, rate=500, drop=0.03) as live,
        Subscriber(instances=live.specs(), policy=policy) as sub,
    ):
        time.sleep(0.3)  # let the subscriptions settle
        live.start()
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            for item in sub.poll(0.05):
                index.handle(item)
        live.stop()
        reference = live.reference()

        def settled() -> bool:
            for item in sub.poll(0.05):
                index.handle(item)
            return all(copies(index, source) == pools for source, pools in reference.items())

        assert wait_until(settled, timeout=15.0), {
            str(s): (len(copies(index, s).get((0, "GPU"), {})), len(p.get((0, "GPU"), {})))
            for s, p in reference.items()
        }
        gaps = sum(sub.stats(s).gaps for s in sub.sources())
        restarts = sum(sub.stats(s).publisher_restarts for s in sub.sources())
    assert live.sim.restarts and gaps and restarts, (live.sim.restarts, gaps, restarts)


def test_replay_reply_layout_follows_the_format() -> None:
    for fmt, frames in (("0.23", 3), ("0.33", 4)):
        config = SimConfig(instances=1, format=fmt, seed=6)  # type: ignore[arg-type]
        with SimulatedPublishers(config, rate=100) as live:
            live.publish(3)
            replay = live.specs()[0].replay_endpoint
            assert replay is not None
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay)
            try:
                dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                replies = []
                while dealer.poll(2000):
                    replies.append(dealer.recv_multipart())
                    if replies[-1][-2] == b"\xff" * 8:
                        break
            finally:
                dealer.close()
        assert [len(r) for r in replies] == [frames] * 4, fmt
        assert [decode_seq(r[-2]) for r in replies[:3]] == [0, 1, 2]
        decode_batch(replies[0][-1])


def test_recent_prompts_are_cached_where_they_ran() -> None:
    sim = Simulation(SimConfig(instances=3, seed=9, restart_every=0, reset_every=0))
    index = FleetIndex()
    for item in sim.items(300):
        assert isinstance(item, SimBatch)
        index.apply(item.source, decode_batch(item.payload), item.seq)
    prompt = sim.recent_prompts(1)[0]
    rows = {r.instance: r for r in index.lookup(prompt["token_ids"], prompt["lora_name"])}
    full = len(prompt["token_ids"]) // prompt["block_size"]
    assert rows[prompt["instance"]].matched_blocks >= full - 1  # the last block may be recomputed


# -- kvindex simulate ------------------------------------------------------------------------


def test_cli_prints_specs_serve_can_follow_and_stops_on_ctrl_c() -> None:
    sim = kvindex("simulate", "--instances", "2", "--dp", "2", "--base-port", "0", "--rate", "50")
    try:
        sim.wait_for(sim.out, lambda s: s.startswith("  kvindex serve"), timeout=10)
        specs = [InstanceSpec.parse(line.strip()) for line in sim.out if line.startswith("  vllm-")]
        assert [(s.name, s.dp) for s in specs] == [("vllm-0", 2), ("vllm-1", 2)]
        with Subscriber(instances=specs) as sub:
            got: set[SourceKey] = set()

            def every_rank_delivers() -> bool:
                got.update(d.source for d in sub.poll(0.05) if isinstance(d, Delivery))
                return len(got) == 4

            assert wait_until(every_rank_delivers)
        sim.interrupt(signal.SIGINT)
        assert sim.finish() == 0
        assert "published" in sim.out[-1]
    finally:
        sim.kill()


def test_cli_busy_port_is_a_usage_error() -> None:
    with SimulatedPublishers(SimConfig(instances=1)) as live:
        busy = live.base_port
        sim = kvindex("simulate", "--instances", "1", "--base-port", str(busy), "--duration", "1")
        assert sim.finish() == 2
        assert len(sim.err) == 1 and "can't bind port" in sim.err[0]
