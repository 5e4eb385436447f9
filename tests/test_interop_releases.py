"""Interop with the real publisher code of every vLLM schema generation (0.9 -> 0.33).

Each release's own `ZmqEventPublisher` (its kv_events.py fetched from its PyPI wheel, see
vllm_releases.py) publishes batches of its own event classes, with a share of live sends
dropped; our Subscriber must deliver every batch exactly once, in order, and decode each
event to the same field values the release put in.
"""

from __future__ import annotations

import random
import time
import types
from typing import Any

import msgspec
import pytest
import vllm_releases as vr
from netutil import free_port

from kvindex.subscriber import Delivery, Item, Lost, ReplayPolicy, Subscriber
from kvindex.wire import AllBlocksCleared, BlockRemoved, BlockStored

pytestmark = pytest.mark.interop

POLICY = ReplayPolicy(first_reply_timeout=1.0, idle_timeout=0.5, deadline=10, max_attempts=4)


@pytest.fixture(scope="module", params=vr.RELEASES)
def release(request: pytest.FixtureRequest) -> types.ModuleType:
    try:
        return vr.load_release(request.param)
    except vr.ReleaseUnavailable as exc:
        pytest.skip(f"vLLM {request.param} sources unavailable: {exc}")


class _DroppingSocket:
    """Stands in for the release's PUB socket and silently drops a share of live sends."""

    def __init__(self, sock: Any, rate: float, seed: int) -> None:
        self._sock, self._rate, self._rng = sock, rate, random.Random(seed)
        self.dropped = 0
        self.sends = 0

    def send_multipart(self, frames: Any, *args: Any, **kwargs: Any) -> Any:
        self.sends += 1
        if self._rng.random() < self._rate:
            self.dropped += 1
            return None
        return self._sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _hash(mod: types.ModuleType, rng: random.Random) -> int | bytes:
    # 0.9.x typed hashes as int (signed 64-bit); later releases also publish digest bytes.
    if mod.VLLM_VERSION.startswith("0.9") or rng.random() < 0.5:
        return (
            rng.randrange(-(2**63), 2**63)
            if mod.VLLM_VERSION.startswith("0.9")
            else rng.randrange(2**64)
        )
    return rng.randbytes(32)


def _events(mod: types.ModuleType, rng: random.Random, i: int) -> list[Any]:
    full = {
        "block_hashes": [_hash(mod, rng) for _ in range(rng.randint(1, 4))],
        "parent_block_hash": _hash(mod, rng) if i % 3 else None,
        "token_ids": [rng.randrange(50_000) for _ in range(32)],
        "block_size": 16,
        "lora_id": 3 if i % 5 == 0 else None,
        "medium": "GPU" if i % 2 else "CPU",
        "lora_name": "adapter-a" if i % 5 == 0 else None,
        "extra_keys": [["salt"], None] if i % 7 == 0 else None,
        "group_idx": i % 2,
        "kv_cache_spec_kind": "full_attention",
        "kv_cache_spec_sliding_window": None,
        "locality": "LOCAL",
        "ownership": None,
        "session_id": f"s{i}",
        "lookahead_token_ids": None,
    }
    events = [vr.make_stored(mod, **full)]
    if i % 4 == 1:
        events.append(vr.make_removed(mod, block_hashes=[full["block_hashes"][0]], medium="GPU"))
    if i % 50 == 49:
        events.append(vr.make_cleared(mod))
    return events


def _check_same(theirs: Any, ours: Any) -> None:
    kind = type(theirs).__name__
    assert isinstance(
        ours,
        {
            "BlockStored": BlockStored,
            "BlockRemoved": BlockRemoved,
            "AllBlocksCleared": AllBlocksCleared,
        }[kind],
    )
    ours_fields = msgspec.structs.asdict(ours)
    for name, value in msgspec.structs.asdict(theirs).items():
        if name == "extra_keys" and value is not None:
            value = [list(v) if v is not None else None for v in value]
        assert ours_fields[name] == value, (kind, name)


def _collect(sub: Subscriber, n: int, timeout: float = 20) -> list[Item]:
    items: list[Item] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sum(isinstance(i, Delivery) for i in items) < n:
        items.extend(sub.poll(0.05))
    return items


def test_real_publisher_batches_arrive_once_in_order_and_decode_exactly(
    release: types.ModuleType,
) -> None:
    rng = random.Random(release.VLLM_VERSION)
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    publisher = vr.start_publisher(release, pub_ep, replay_ep, buffer_steps=1000)
    sent: list[list[Any]] = []
    try:
        # Some batches exist before we subscribe (late join) ...
        for i in range(15):
            events = _events(release, rng, i)
            sent.append(events)
            publisher.publish(vr.make_batch(release, time.time(), events))
        time.sleep(0.3)
        with Subscriber(pub_ep, replay=replay_ep, policy=POLICY) as sub:
            items = _collect(sub, 15)
            # ... then a quarter of the live sends are lost on the wire.
            dropping = _DroppingSocket(publisher._pub, 0.25, 1)
            publisher._pub = dropping
            for i in range(15, 160):
                events = _events(release, rng, i)
                sent.append(events)
                publisher.publish(vr.make_batch(release, time.time(), events))
                items.extend(sub.poll(0))
            # The release's publisher thread sends from a queue: let it finish these first.
            deadline = time.monotonic() + 10
            while dropping.sends < 145 and time.monotonic() < deadline:
                items.extend(sub.poll(0.01))
            publisher._pub = dropping._sock
            last = _events(release, rng, 160)
            sent.append(last)
            publisher.publish(vr.make_batch(release, time.time(), last))
            items += _collect(sub, len(sent) - sum(isinstance(i, Delivery) for i in items))
    finally:
        publisher.shutdown()
    got = [i for i in items if isinstance(i, Delivery)]
    assert [d.seq for d in got] == list(range(len(sent)))
    assert not [i for i in items if isinstance(i, Lost)]
    assert dropping.dropped > 10
    for delivery, events in zip(got, sent, strict=True):
        assert len(delivery.batch.events) == len(events)
        for ours, theirs in zip(delivery.batch.events, events, strict=True):
            _check_same(theirs, ours)
        expected_rank = None if release.VLLM_VERSION == "0.9.0" else 0
        assert delivery.batch.data_parallel_rank == expected_rank
