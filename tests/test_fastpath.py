"""The compiled lookup path (kvindex.service.fastpath) against the reference path.

- The answer: `Fleet.lookup_json` (the walk and the whole answer written in C) must be the
  JSON of `Fleet.lookup` (rows in C, the answer in Python), on random fleets (the same
  streams as tests/test_core.py: several pools, lower tiers, hybrid groups, DP ranks,
  namespaces), with instances the index knows nothing of and every status.
- The request: a body the C reader takes must get exactly the answer the FastAPI route
  gives it (the same status and JSON); a body it leaves is the route's anyway.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core import BASE, build, event_plan, feed, prompt_of

from kvindex.index import COMPILED, ReferenceIndex, parse_lookup_body
from kvindex.runtime import Fleet
from kvindex.runtime.fleet import StatusReader
from kvindex.security.http import HttpGuard
from kvindex.service import fastpath
from kvindex.service.app import create_app
from kvindex.subscriber import InstanceSpec, SourceKey, Status
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.skipif(not COMPILED, reason="the compiled core is not built")

# "a" and "c" one rank, "b" two (as test_core's SOURCES), "d" three ranks the index never
# hears of, "e" one it never hears of.
SPECS = ["a=tcp://127.0.0.1:1", "b=tcp://127.0.0.1:3,dp=2", "c=tcp://127.0.0.1:5"]
SPECS += ["d=tcp://127.0.0.1:7,dp=3", "e=tcp://127.0.0.1:11"]
NAMES = [
    {},
    {"lora_name": "ad-1"},
    {"cache_salt": "t1"},
    {"lora_name": "ad-1", "cache_salt": "t1"},
    {"lora_name": "never-seen"},
]


class StatusFleet(Fleet):
    """A Fleet whose instances show the statuses a test gives them (down or replaying
    take real sockets and time: test_real_statuses_reach_the_answer has them), both to the
    reference answer (`status`) and to the compiled one (its per-rank readers)."""

    shown: dict[str, Status]

    def status(self, name: str) -> Status:
        return self.shown.get(name, Status.LIVE)

    def _status_sources(self, slots: Any) -> list[StatusReader]:
        def reader(source: SourceKey) -> Status:
            return self.shown.get(source.instance, Status.LIVE)

        return [(reader, [SourceKey(name)]) for name in sorted(self.specs)]


def fleet_over(index: Any, shown: dict[str, Status]) -> StatusFleet:
    fleet = StatusFleet([InstanceSpec.parse(s) for s in SPECS], index=index, ingest_workers=1)
    fleet.shown = shown
    return fleet


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(event_plan, max_size=50),
    st.dictionaries(st.sampled_from("abcde"), st.sampled_from(list(Status)), max_size=5),
)
def test_compiled_answer_is_the_reference_answer(
    plan: list[tuple[Any, ...]], shown: dict[str, Status]
) -> None:
    pure, fast = feed(build(plan))
    compiled, reference = fleet_over(fast, shown), fleet_over(pure, shown)
    try:
        for p in range(len(BASE)):
            for variant in range(3):
                tokens = prompt_of(p, variant)
                for names in NAMES:
                    answer = compiled.lookup(tokens, **names)
                    expected = msgspec.json.encode(answer)
                    got, hit = compiled.lookup_json(tokens, **names)
                    assert json.loads(got) == json.loads(expected), (tokens, names)
                    assert hit == answer.hit
                    packed = b"".join(t.to_bytes(4, "little") for t in tokens)
                    assert compiled.lookup_json(packed, **names)[0] == got
                    # the pure index's answer, encoded: the same JSON
                    assert json.loads(reference.lookup_json(packed, **names)[0]) == json.loads(got)
    finally:
        compiled.close()
        reference.close()


def test_the_answer_follows_membership_and_statuses() -> None:
    """The slots and statuses lookup_json caches are dropped when what they come from
    changes: an instance added or removed, a status that moved."""
    pure, fast = feed(build([("store", 0, 0, 0, 0, 3, 0, 0, 0, False)]))
    del pure
    fleet = fleet_over(fast, {"a": Status.LIVE})
    try:
        tokens = prompt_of(0, 0)
        first = json.loads(fleet.lookup_json(tokens)[0])
        assert first["best"] == "a"
        assert [r["name"] for r in first["instances"]] == ["a", "b", "c", "d", "e"]
        fleet.shown["a"] = Status.DOWN
        fleet.step()  # what moves a status: a read by the ingest worker
        down = json.loads(fleet.lookup_json(tokens)[0])
        assert down["best"] is None and down["instances"][0]["status"] == "down"
        fleet.remove_instance("e")
        fleet.add_instance(InstanceSpec.parse("f=tcp://127.0.0.1:13,dp=2"))
        rows = json.loads(fleet.lookup_json(tokens)[0])["instances"]
        assert [r["name"] for r in rows] == ["a", "b", "c", "d", "f"]
        assert rows[-1]["ranks"] == [
            {"rank": 0, "matched_blocks": 0},
            {"rank": 1, "matched_blocks": 0},
        ]
        assert json.loads(fleet.lookup_json(tokens)[0]) == json.loads(
            msgspec.json.encode(fleet.lookup(tokens))
        )
    finally:
        fleet.close()


def test_real_statuses_reach_the_answer() -> None:
    """live, connecting (a rank that never connects) and down (a publisher gone), as the
    subscriber tells them: the compiled answer shows what Fleet.status says."""
    pub = Publisher("tcp://127.0.0.1:*")
    specs = [
        InstanceSpec.parse(f"up={pub.endpoint}"),
        InstanceSpec.parse(f"half={pub.endpoint},dp=2"),  # rank 1 never connects
        InstanceSpec.parse("never=tcp://127.0.0.1:9"),
    ]
    fleet = Fleet(specs, ingest_workers=1)
    try:

        def shown() -> dict[str, str]:
            rows = json.loads(fleet.lookup_json([1, 2, 3, 4])[0])["instances"]
            return {row["name"]: row["status"] for row in rows}

        def step_until(wanted: dict[str, str]) -> None:
            deadline = time.monotonic() + 10
            while shown() != wanted:
                assert time.monotonic() < deadline, shown()
                fleet.step()
                time.sleep(0.01)

        step_until({"up": "live", "half": "connecting", "never": "connecting"})
        pub.close()
        step_until({"up": "down", "half": "down", "never": "connecting"})
        assert shown() == {name: str(fleet.status(name)) for name in ("up", "half", "never")}
    finally:
        fleet.close()
        pub.close()


# -- the request --------------------------------------------------------------------------

MAX_ITEMS = 40


async def _post(app: Any, body: bytes, chunk: int, path: str = "/v1/lookup") -> tuple[int, Any]:
    """POST to `path` of the ASGI app, the body in chunks of `chunk` bytes."""
    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [
        {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
        for i, part in enumerate(parts)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"host", b"test"), (b"content-type", b"application/json")]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "state": {},
    }
    await app(scope, receive, send)
    status = sent[0]["status"]
    raw = b"".join(m.get("body", b"") for m in sent[1:])
    return status, json.loads(raw)


token = st.one_of(
    st.integers(0, 2000),
    st.integers(0, 2**32 + 5),
    st.integers(-5, 2**53 + 5),
    st.floats(allow_nan=False, allow_infinity=False, min_value=-1, max_value=1e6),
    st.sampled_from([1.0, 0.0, 7.5, "3", None, True, [1]]),
)
name = st.one_of(
    st.none(),
    st.text(alphabet="abc-_.19", max_size=12),
    st.text(max_size=6),  # escapes, control characters, non-ASCII
    st.text(alphabet="x", min_size=1020, max_size=1030),
    st.integers(0, 3),
)
body_fields = st.fixed_dictionaries(
    {},
    optional={
        "token_ids": st.lists(token, max_size=MAX_ITEMS + 3)
        | st.lists(st.integers(0, 99), max_size=MAX_ITEMS + 3),
        "lora_name": name,
        "cache_salt": name,
        "extra": st.integers(),
    },
)


plain_fields = st.fixed_dictionaries(
    {"token_ids": st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 99), max_size=MAX_ITEMS)},
    optional={
        "lora_name": st.none() | st.text(alphabet="abc-_.19 ", max_size=12),
        "cache_salt": st.none() | st.text(alphabet="abc-_.19 ", max_size=12),
    },
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """Half what routers send (the C reader's to take), half anything near it."""
    plain = draw(st.booleans())
    fields = draw(plain_fields if plain else body_fields)
    indent = draw(st.sampled_from([None, 0, 2]))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
    text = json.dumps(fields, indent=indent, separators=separators).encode()
    if not plain and draw(st.booleans()):  # a broken byte or two
        for _ in range(draw(st.integers(1, 2))):
            at = draw(st.integers(0, len(text)))
            text = text[:at] + draw(st.binary(min_size=0, max_size=2)) + text[at + 1 :]
    if draw(st.booleans()):
        text = draw(st.sampled_from([b"", b" ", b"\n\t"])) + text + b" \r\n"
    return text


@pytest.fixture(scope="module")
def apps() -> Any:
    pure, fast = feed(build([("store", 0, 0, 0, 0, 3, 0, 0, 0, False)]))
    del pure
    fleet = Fleet([InstanceSpec.parse(s) for s in SPECS], index=fast, ingest_workers=1)
    app = create_app(fleet, manage_fleet=False, guard=HttpGuard(max_lookup_items=MAX_ITEMS))
    yield app
    fleet.close()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies(), chunk=st.sampled_from([1, 7, 4096]))
def test_a_body_gets_the_routes_answer(apps: Any, body: bytes, chunk: int) -> None:
    taken = parse_lookup_body(body, MAX_ITEMS) is not None
    got = asyncio.run(_post(apps, body, chunk))
    saved = fastpath.parse_lookup_body
    fastpath.parse_lookup_body = lambda _body, _limit: None  # every body to the route
    try:
        expected = asyncio.run(_post(apps, body, chunk))
    finally:
        fastpath.parse_lookup_body = saved
    assert got == expected, (body, taken)
    if taken:
        assert got[0] == 200


hash_text = st.one_of(
    st.integers(-(2**63) - 2, 2**64 + 2).map(str),
    st.binary(min_size=0, max_size=40).map(bytes.hex),
    st.text(alphabet="0123456789abcdefABCDEF-x ", max_size=24),
    st.text(max_size=4),
)
hash_bodies = st.fixed_dictionaries(
    {},
    optional={
        "block_hashes": st.lists(hash_text | st.integers() | st.none(), max_size=MAX_ITEMS + 3),
        "extra": st.integers(),
    },
).map(lambda fields: json.dumps(fields).encode()) | st.binary(max_size=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=hash_bodies, chunk=st.sampled_from([1, 4096]))
def test_a_hashes_body_gets_the_routes_answer(apps: Any, body: bytes, chunk: int) -> None:
    """`/v1/lookup/hashes` answered past the stack says what the route says, refusals
    included (they are the route's)."""
    path = "/v1/lookup/hashes"
    got = asyncio.run(_post(apps, body, chunk, path))
    saved = fastpath.LookupAnswerer._by_hashes
    fastpath.LookupAnswerer._by_hashes = lambda _self, _body: None  # type: ignore[method-assign]
    try:
        expected = asyncio.run(_post(apps, body, chunk, path))
    finally:
        fastpath.LookupAnswerer._by_hashes = saved  # type: ignore[method-assign]
    assert got == expected, body


@pytest.mark.parametrize(
    "body",
    [
        b'{"token_ids": [1, 2, 3]}',
        b'{"token_ids":[]}',
        b' {"cache_salt": null, "token_ids": [0, 4294967295], "lora_name": "ad-1"} ',
        json.dumps({"token_ids": list(range(MAX_ITEMS))}).encode(),
    ],
)
def test_plain_bodies_take_the_fast_path(body: bytes) -> None:
    """The shapes routers send are read in C (the property test above would pass just as
    well if nothing were)."""
    assert parse_lookup_body(body, MAX_ITEMS) is not None


@pytest.mark.parametrize(
    "body",
    [
        b'{"token_ids": [1.0]}',  # the route's lenient reading of integral floats
        b'{"token_ids": [01]}',
        b'{"token_ids": [4294967296]}',  # past 32 bits: the route's wide path
        b'{"token_ids": [1], "lora_name": "caf\\u00e9"}',
        b'{"token_ids": [1], "token_ids": [2]}',
        b'{"token_ids": [1], "model": "x"}',
        json.dumps({"token_ids": list(range(MAX_ITEMS + 1))}).encode(),  # over the limit
        b'{"lora_name": "a"}',
    ],
)
def test_other_bodies_are_left_to_the_route(body: bytes) -> None:
    assert parse_lookup_body(body, MAX_ITEMS) is None


def test_the_pure_index_answers_lookup_json() -> None:
    """Fleet.lookup_json over the pure index encodes the reference answer."""
    fleet = fleet_over(ReferenceIndex(), {})
    try:
        got, hit = fleet.lookup_json([1, 2, 3, 4])
        assert not hit
        assert json.loads(got)["best"] is None
        assert len(json.loads(got)["instances"]) == 5
    finally:
        fleet.close()
