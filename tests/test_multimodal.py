"""Lookups that supply a multimodal prompt's keys (issue 15): vLLM's per-block derivation,
the pure and compiled indexes, and the HTTP API (`/v1/lookup`, `/v1/route`, `/query`).

The engine side is proved against vLLM 0.33 itself in tests/interop/test_vllm_model.py
(probes with images, expected from `get_computed_blocks`); here, the derivation's known
answers (the same cases) and the plumbing, on a real server over real ZMQ.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from httpfixture import serve_app

from kvindex.index import FleetIndex, ReferenceIndex
from kvindex.index.multimodal import MMFeature, PromptKeys, mm_extra_keys
from kvindex.runtime import Fleet
from kvindex.service.app import create_app
from kvindex.service.lookups import Routing
from kvindex.subscriber import InstanceSpec, SourceKey
from kvindex.wire import BlockStored, EventBatch
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)
BS = 16
IMAGE = 31990


def test_per_block_keys_are_vllm_s() -> None:
    """`_gen_mm_extra_hash_keys` of vLLM 0.33 through `to_event_extra_keys`, by hand: the
    scenario of tests/interop (an image of 40 tokens at 32; two images sharing a block)."""
    a = [MMFeature("img-A", 32, 40)]
    assert mm_extra_keys(a, BS, 6) == [
        None,
        None,
        [["img-A", 0]],
        [["img-A", -16]],
        [["img-A", -32]],  # tokens 64-79 hold the image's last 8
        None,
    ]
    two = [MMFeature("img-C", 32, 6), MMFeature("img-D", 40, 20)]
    assert mm_extra_keys(two, BS, 5) == [
        None,
        None,
        [["img-C", 0], ["img-D", 8]],  # a block holding one's end and the next's start
        [["img-D", -8]],
        None,  # the image ends at 60: a block starting at 64 (>= its end) has no key
    ]
    # An input ending exactly at a block's start: that block has none (`>=` in 0.33).
    assert mm_extra_keys([MMFeature("x", 0, 16)], BS, 2) == [[["x", 0]], None]
    # Other block sizes: the same inputs keyed per size.
    assert mm_extra_keys(a, 32, 3) == [None, [["img-A", 0]], [["img-A", -32]]]
    assert mm_extra_keys([], BS, 2) == [None, None]


def vllm_event(
    tokens: list[int], features: list[MMFeature], lora: str | None = None, salt: str | None = None
) -> BlockStored:
    """A BlockStored as vLLM 0.33 publishes a fresh request's blocks (bare LoRA name first,
    multimodal keys, the salt last in block 0)."""
    blocks = len(tokens) // BS
    extra: list[Any] = []
    for i, mm in enumerate(mm_extra_keys(features, BS, blocks)):
        keys = ([lora] if lora else []) + [tuple(k) for k in mm or []]
        keys += [salt] if salt and i == 0 else []
        extra.append(keys or None)
    hashes = [hash(("mm", lora, salt, tuple(tokens[: (i + 1) * BS]), i)) for i in range(blocks)]
    return BlockStored(
        hashes, None, tokens[: blocks * BS], BS, extra_keys=extra, lora_name=lora, group_idx=0
    )


def prompt(image: int = 40) -> list[int]:
    return list(range(1000, 1032)) + [IMAGE] * image + list(range(2000, 2024))


@pytest.mark.parametrize("kind", ["pure", "default"])
def test_lookups_with_keys_match_the_image_s_blocks(kind: str) -> None:
    index = ReferenceIndex() if kind == "pure" else FleetIndex()
    tokens = prompt()  # 96 tokens: 6 blocks; the image in blocks 2-4
    a = [MMFeature("img-A", 32, 40)]
    index.apply(SourceKey("plain"), EventBatch(0.0, [vllm_event(tokens, a)], None))
    index.apply(SourceKey("lora"), EventBatch(0.0, [vllm_event(tokens, a, "ad", "s")], None))

    def blocks(**kw: Any) -> dict[str, int]:
        return {r.instance: r.matched_blocks for r in index.lookup(tokens, **kw)}

    assert blocks() == {"plain": 2, "lora": 0}  # without keys: up to the image
    assert blocks(mm_features=a) == {"plain": 6, "lora": 0}
    as_dicts = [{"identifier": "img-A", "offset": 32, "length": 40}]
    assert blocks(mm_features=as_dicts) == {"plain": 6, "lora": 0}
    assert blocks(extra_keys=mm_extra_keys(a, BS, 6)) == {"plain": 6, "lora": 0}
    # Another image, another offset: the blocks from it on differ. A length reaching into
    # one more block keys that block too (the length itself is no key: 48 ends at 80).
    assert blocks(mm_features=[MMFeature("img-B", 32, 40)]) == {"plain": 2, "lora": 0}
    assert blocks(mm_features=[MMFeature("img-A", 33, 40)]) == {"plain": 2, "lora": 0}
    assert blocks(mm_features=[MMFeature("img-A", 32, 56)]) == {"plain": 5, "lora": 0}
    assert blocks(mm_features=[MMFeature("img-A", 32, 48)]) == {"plain": 6, "lora": 0}
    # The namespace still rules: the LoRA + salted copy only for its adapter and salt.
    assert blocks(mm_features=a, lora_name="ad", cache_salt="s") == {"plain": 0, "lora": 6}
    assert blocks(lora_name="ad", cache_salt="s") == {"plain": 0, "lora": 2}
    with pytest.raises(ValueError, match="not both"):
        index.lookup(tokens, mm_features=a, extra_keys=mm_extra_keys(a, BS, 6))


def test_pure_and_compiled_agree_over_block_sizes() -> None:
    compiled = pytest.importorskip("kvindex.index.compiled")
    tokens = prompt(56)
    a = [MMFeature("img-A", 32, 56)]
    pure, fast = ReferenceIndex(), compiled.CompiledIndex(seed=3)
    for size in (16, 32):
        blocks = len(tokens) // size
        extra = [
            None if k is None else [tuple(x) for x in k] for k in mm_extra_keys(a, size, blocks)
        ]
        event = BlockStored(list(range(size, size + blocks)), None, tokens[: blocks * size], size)
        event.extra_keys = extra
        for index in (pure, fast):
            index.apply(SourceKey(f"bs{size}"), EventBatch(0.0, [event], None))
    for kw in ({}, {"mm_features": a}, {"mm_features": [MMFeature("img-A", 40, 8)]}):
        assert fast.lookup(tokens, **kw) == pure.lookup(tokens, **kw)
    rows = {r.instance: r.matched_tokens for r in pure.lookup(tokens, mm_features=a)}
    assert rows == {"bs16": 112, "bs32": 96}
    # The same keys, given per block of 16: they key the 16-token tree, not the 32 one.
    by_16 = {"extra_keys": mm_extra_keys(a, 16, 7)}
    assert fast.lookup(tokens, **by_16) == pure.lookup(tokens, **by_16)
    assert {r.instance: r.matched_tokens for r in pure.lookup(tokens, **by_16)} == {
        "bs16": 112,
        "bs32": 32,
    }


def test_prompt_keys_fingerprint_tells_inputs_apart() -> None:
    one = PromptKeys.of([MMFeature("a", 0, 4)])
    two = PromptKeys.of([MMFeature("a", 0, 5)])
    assert one is not None and two is not None
    assert one.fingerprint() != two.fingerprint()
    assert PromptKeys.of() is None and PromptKeys.of([], [None, None]) is None


def until(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def test_http_lookups_route_and_query_take_the_keys() -> None:
    tokens = prompt()
    a = {"identifier": "img-A", "offset": 32, "length": 40}
    with ExitStack() as stack:
        pub = stack.enter_context(Publisher("tcp://127.0.0.1:*"))
        fleet = Fleet([InstanceSpec("v0", pub.endpoint, model="m")])
        app = create_app(fleet, routing=Routing.of(fleet))
        url = stack.enter_context(serve_app(app))
        client = stack.enter_context(httpx.Client(base_url=url, timeout=10))
        event = vllm_event(tokens, [MMFeature(**a)])

        def matched(body: dict[str, Any], path: str = "/v1/lookup") -> Any:
            answer = client.post(path, json={"token_ids": tokens, **body})
            assert answer.status_code == 200, answer.text
            return answer.json()

        assert until(lambda: (pub.publish([event]), matched({}))[1]["best"] is not None)
        plain = matched({})["instances"][0]["matched_blocks"]
        assert plain == 2
        assert matched({"mm_features": [a]})["instances"][0]["matched_blocks"] == 6
        per_block = [[["img-A", 0]] if i == 2 else None for i in range(6)]
        per_block[3], per_block[4] = [["img-A", -16]], [["img-A", -32]]
        assert matched({"extra_keys": per_block})["instances"][0]["matched_blocks"] == 6
        keyed = matched({"mm_features": [a], "model": "m", "score": True})
        assert keyed["best"] == "v0" and keyed["instances"][0]["matched_blocks"] == 6
        route = matched({"mm_features": [a], "model": "m"}, "/v1/route")
        assert route["best"] == "v0" and route["instances"][0]["matched_blocks"] == 6, route
        # A route of an image nobody holds predicts its blocks for the same keys only.
        z = {**a, "identifier": "img-Z"}
        matched({"mm_features": [z], "model": "m"}, "/v1/route")
        again = matched({"mm_features": [z], "model": "m", "score": True})
        assert again["instances"][0]["predicted_blocks"] == 4, again  # 2 held + 4
        plain_again = matched({"model": "m", "score": True})
        assert plain_again["instances"][0]["predicted_blocks"] == 0, plain_again
        peer = client.post(
            "/query", json={"token_ids": tokens, "model_name": "m", "mm_features": [a]}
        ).json()
        assert peer["instances"]["v0"]["longest_matched"] == 96
        peer = client.post("/query", json={"token_ids": tokens, "model_name": "m"}).json()
        assert peer["instances"]["v0"]["longest_matched"] == 32
        both = client.post(
            "/v1/lookup", json={"token_ids": tokens, "mm_features": [a], "extra_keys": per_block}
        )
        assert both.status_code == 422 and "not both" in both.json()["error"]
        bad = client.post("/v1/lookup", json={"token_ids": tokens, "mm_features": [{"offset": 1}]})
        assert bad.status_code == 422, bad.text
