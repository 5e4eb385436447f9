"""Dynamo's local block hashes (kvindex.index.localhash) and lookups by them.

The known answers are Dynamo's own: `dynamo._core.compute_block_hash_for_seq` of
ai-dynamo-runtime 1.6.1, run once (tests/test_dynamo_compat.py checks them against the
binding wherever it installs). A lookup by local hashes must give what a lookup by the
tokens they were made of gives, in the namespace whose seed made them.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvindex.index import ReferenceIndex
from kvindex.index.localhash import (
    as_signed,
    as_unsigned,
    local_hashes,
    namespace_seed,
)
from kvindex.subscriber import SourceKey
from kvindex.wire import BlockStored, EventBatch

BS = 16
TOKENS = list(range(2000, 2016))

# (tokens, block size, lora_name, cache_salt) -> Dynamo 1.6.1's hashes (u64)
KNOWN: list[tuple[list[int], int, str | None, str | None, list[int]]] = [
    (TOKENS, 16, None, None, [11352803401149365244]),
    (TOKENS, 16, "ad", None, [12766135117000811553]),
    (TOKENS, 16, None, "s", [18214828920962347900]),
    (TOKENS, 16, "ad", "s", [8973600311020563481]),
    (TOKENS, 16, "", "", [11352803401149365244]),  # empty strings count as absent
    (list(range(1, 40)), 16, None, None, [16863443419780771464, 2287610619914608821]),
]


@pytest.mark.parametrize("tokens, size, lora, salt, want", KNOWN)
def test_local_hashes_are_dynamo_s(
    tokens: list[int], size: int, lora: str | None, salt: str | None, want: list[int]
) -> None:
    assert local_hashes(tokens, size, lora, salt) == want


def test_the_core_s_xxh3_is_xxhash_s() -> None:
    """The compiled core's own XXH3-64 (csrc/xxh3.h) over every length class."""
    import random

    import xxhash

    core = pytest.importorskip("kvindex.index._core")
    rng = random.Random(7)
    for n in [*range(0, 260), 511, 1023, 1024, 1025, 2048, 2049, 4097, 9000]:
        data = rng.randbytes(n)
        for seed in (0, 1337, 2**64 - 1, rng.getrandbits(64)):
            assert core.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed=seed), n


def test_seed_and_wire_forms() -> None:
    assert namespace_seed() == 1337
    assert as_signed(2**64 - 1) == -1 and as_unsigned(-1) == 2**64 - 1
    assert as_signed(5) == 5 and as_unsigned(as_signed(2**63)) == 2**63
    assert local_hashes(TOKENS[:15], 16) == []  # no full block
    with pytest.raises(ValueError):
        local_hashes([2**32], 1)
    with pytest.raises(ValueError):
        local_hashes(TOKENS, 0)


def chain(tokens: list[int], tag: str, **fields: Any) -> BlockStored:
    blocks = len(tokens) // BS
    hashes = [hash((tag, *tokens[: (i + 1) * BS])) & (2**63 - 1) for i in range(blocks)]
    return BlockStored(hashes, None, tokens[: blocks * BS], BS, **fields)


A = list(range(5000, 5000 + 6 * BS))
B = A[: 2 * BS] + list(range(9000, 9000 + 3 * BS))


@pytest.fixture(params=["pure", "compiled"])
def index(request: pytest.FixtureRequest) -> Any:
    if request.param == "pure":
        ix: Any = ReferenceIndex()
    else:
        compiled = pytest.importorskip("kvindex.index.compiled")
        ix = compiled.CompiledIndex(local_hashes=True)
    events = {
        "plain": [chain(A, "a"), chain(B, "b")],
        "lora": [chain(A, "l", lora_name="ad", extra_keys=[["ad"]] * 6)],
        "salted": [chain(A[: 4 * BS], "s", extra_keys=[["s"]] + [None] * 3, group_idx=0)],
        "mm": [
            chain(A[: 3 * BS], "m", extra_keys=[None, [("img", 0)], None], group_idx=0),
        ],
    }
    for name, evs in events.items():
        ix.apply(SourceKey(name), EventBatch(0.0, evs, None))
    return ix


def matched(answer: Any) -> list[Any]:
    return [r for r in answer if r.matched_blocks]


def rows(answer: Any) -> dict[str, int]:
    return {r.instance: r.matched_blocks for r in answer if r.matched_blocks}


def test_a_lookup_by_local_hashes_is_the_lookup_by_their_tokens(index: Any) -> None:
    for tokens in (A, B, A[: 3 * BS] + [1] * BS, [7] * BS):
        for lora, salt in [(None, None), ("ad", None), (None, "s"), ("ad", "s")]:
            by_hash = index.lookup_local_hashes(local_hashes(tokens, BS, lora, salt))
            # (rows matching nothing may differ in the block size they report: which
            # trees a lookup walked)
            assert matched(by_hash) == matched(index.lookup(tokens, lora, salt)), (
                tokens[:2],
                lora,
                salt,
            )
    assert rows(index.lookup_local_hashes(local_hashes(A, BS))) == {"plain": 6, "mm": 1}
    assert rows(index.lookup_local_hashes(local_hashes(A, BS, "ad"))) == {"lora": 6}
    assert rows(index.lookup_local_hashes(local_hashes(A, BS, None, "s"))) == {"salted": 4}
    # Signed as on the wire, a LoRA restriction, a block size, nothing.
    signed = [as_signed(h) for h in local_hashes(A, BS)]
    assert rows(index.lookup_local_hashes(signed)) == {"plain": 6, "mm": 1}
    assert rows(index.lookup_local_hashes(local_hashes(A, BS, "ad"), "other")) == {}
    assert rows(index.lookup_local_hashes(local_hashes(A, BS), block_size=32)) == {}
    assert rows(index.lookup_local_hashes([])) == {}


def test_query_by_hash_over_http_json_and_msgpack() -> None:
    """The peers' /query_by_hash on a real server over a real publisher: Dynamo's shape,
    the answer of /query for the same prompt, JSON and msgpack."""
    import time
    from contextlib import ExitStack

    import httpx
    import msgspec
    from httpfixture import serve_app

    from kvindex.index import FleetIndex
    from kvindex.runtime import Fleet
    from kvindex.service.app import create_app
    from kvindex.service.lookups import Routing
    from kvindex.subscriber import InstanceSpec
    from kvindex.wire.publisher import Publisher

    with ExitStack() as stack:
        pub = stack.enter_context(Publisher("tcp://127.0.0.1:*"))
        fleet = Fleet(
            [InstanceSpec("w", pub.endpoint, model="m")], index=FleetIndex(local_hashes=True)
        )
        url = stack.enter_context(serve_app(create_app(fleet, routing=Routing.of(fleet))))
        client = stack.enter_context(httpx.Client(base_url=url, timeout=10))
        query = {"token_ids": A, "model_name": "m"}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pub.publish([chain(A, "a")])
            if client.post("/query", json=query).json()["scores"]:
                break
            time.sleep(0.05)
        by_tokens = client.post("/query", json=query).json()
        assert by_tokens["scores"] == {"w": {"0": 6 * BS}}
        body = {"block_hashes": [as_signed(h) for h in local_hashes(A, BS)], "model_name": "m"}
        assert client.post("/query_by_hash", json=body).json() == by_tokens
        packed = client.post(
            "/query_by_hash",
            content=msgspec.msgpack.encode(body),
            headers={"content-type": "application/msgpack"},
        )
        assert packed.headers["content-type"] == "application/msgpack"
        assert msgspec.msgpack.decode(packed.content) == by_tokens
        half = {**body, "block_hashes": [*body["block_hashes"][:3], 1]}
        assert client.post("/query_by_hash", json=half).json()["scores"] == {"w": {"0": 3 * BS}}
        too_big = {**body, "block_hashes": [2**63]}
        assert client.post("/query_by_hash", json=too_big).status_code == 422


def test_serve_keeps_local_hashes_when_asked() -> None:
    """`serve --local-hashes` (or `[routing] local_hashes`): the index it opens keeps them,
    through a warm load from the store as well."""
    from kvindex.cli.serve import _open_store

    store, index, _ = _open_store("memory", True)
    assert index.local_hashes
    index.apply(SourceKey("w"), EventBatch(0.0, [chain(A, "a")], None))
    assert rows(index.lookup_local_hashes(local_hashes(A, BS))) == {"w": 6}
    store.close()
    store, index, _ = _open_store("memory")
    assert not index.local_hashes
    store.close()
