"""The index against SGLang 0.5.23's own cache, from a recording of SGLang's own run.

`tests/data/sglang/` holds one recording (`fleet.kvr`, made with kvindex's recorder) of
four SGLang engines, each two DP ranks of SGLang's real `RadixCache` + `KVCacheEventRecorder`
+ `ZmqEventPublisher` (tests/interop/sglang_driver.py), and per engine SGLang's own
answers (`NAME.json`): the pages each rank holds per medium, and `match_prefix` for probe
prompts. `make sglang-record` re-runs SGLang live and rewrites them.

- `sgl-p1`: page size 1 (SGLang's default), salts, LoRA, host/disk/external media, a reset.
- `sgl-p16`: page size 16, the same namespaces and media, a reset, a topic.
- `sgl-bigram`: EAGLE bigram keys (token pages as pairs), salts, media.
- `sgl-extra-key`: a caller `extra_key` (not LoRA), which SGLang's default event format
  leaves out of both the hashes and the events.

Each engine's rank 1 joined late (its first batches came from the replay ROUTER).

The recording is replayed the way `kvindex serve` ingests (every item through
`FleetIndex.handle`). A probe's expected answer is what SGLang would reuse: its
`match_prefix` pages on the GPU, then the run its lower media hold from there
(`reuse_pages`, the interface's `matched_blocks`), per DP rank. Checks that fail today
are strict xfails, one per engine and scenario, each saying why: remove a marker when the
model it waits for lands.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import enginevenv
import msgspec
import pytest
from warm_restart import restarted_through_store

import kvindex.recording as recording
from kvindex.index import FleetIndex
from kvindex.subscriber import (
    InstanceSpec,
    Lost,
    Replayed,
    ReplayPolicy,
    SourceKey,
    Subscriber,
)
from kvindex.wire import AllBlocksCleared, BlockStored

DATA = Path(__file__).parent / "data" / "sglang"
DRIVER = Path(__file__).parent / "interop" / "sglang_driver.py"
ENGINES = ("sgl-p1", "sgl-p16", "sgl-bigram", "sgl-extra-key")
MEDIA = ("GPU", "CPU_PINNED", "DISK", "EXTERNAL")

# -- why checks fail today ---------------------------------------------------------------

# (engine, scenario) -> why kvindex's lookups differ from SGLang's today.
LOOKUP_XFAIL: dict[tuple[str, str], str] = {}
# (engine, rank) -> why the pages kvindex holds differ from SGLang's today.
HELD_XFAIL: dict[tuple[str, int], str] = {}


# -- the recording, replayed ---------------------------------------------------------------


@cache
def reference(engine: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / f"{engine}.json").read_text())
    return data


@pytest.fixture(scope="module")
def live() -> FleetIndex:
    index = FleetIndex()
    for item in recording.read(DATA / "fleet.kvr"):
        index.handle(item)
    return index


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> FleetIndex:
    """The same stream through the SQLite store and a warm restart (issue 20: the same
    answers before and after)."""
    items = list(recording.read(DATA / "fleet.kvr"))
    return restarted_through_store(items, tmp_path_factory.mktemp("sglang") / "s.sqlite")


@pytest.fixture(params=["live", "restarted"])
def replayed(request: pytest.FixtureRequest) -> FleetIndex:
    index: FleetIndex = request.getfixturevalue(request.param)
    return index


def held_by_index(index: FleetIndex, source: SourceKey) -> dict[str, dict[int, int]]:
    """Per medium, hash -> copies (summed over KV groups) the index holds for `source`."""
    out: dict[str, Counter[int]] = {m: Counter() for m in MEDIA}
    for (_, medium), pool in index.copies(source).items():
        out.setdefault(medium, Counter()).update(
            {h: c for h, c in pool.items() if isinstance(h, int)}
        )
    return {m: dict(c) for m, c in out.items()}


def held_by_sglang(engine: str, rank: int) -> dict[str, dict[int, int]]:
    held = reference(engine)["ranks"][str(rank)]["held"]
    return {m: {h: c for h, c in held[m]} for m in MEDIA}


def probes(engine: str, scenario: str) -> list[dict[str, Any]]:
    return [p for p in reference(engine)["probes"] if p["scenario"] == scenario]


def scenarios() -> Iterator[Any]:
    for engine in ENGINES:
        for scenario in sorted({p["scenario"] for p in reference(engine)["probes"]}):
            reason = LOOKUP_XFAIL.get((engine, scenario))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(engine, scenario, marks=marks, id=f"{engine}-{scenario}")


def ranks() -> Iterator[Any]:
    for engine in ENGINES:
        for rank in sorted(int(r) for r in reference(engine)["ranks"]):
            reason = HELD_XFAIL.get((engine, rank))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(engine, rank, marks=marks, id=f"{engine}-rank{rank}")


def lookup_ranks(index: FleetIndex, engine: str, probe: dict[str, Any]) -> dict[int, int]:
    """kvindex's matched blocks per DP rank of `engine` for one probe."""
    kwargs: dict[str, Any] = {}
    if probe["lora_name"] is not None:
        kwargs["lora_name"] = probe["lora_name"]
    if probe["cache_salt"] is not None:
        kwargs["cache_salt"] = probe["cache_salt"]  # the model of issue 20
    rows = index.lookup(probe["token_ids"], **kwargs)
    row = next(r for r in rows if r.instance == engine)
    return {int(rank): blocks for rank, blocks in row.ranks.items()}


def expected_ranks(probe: dict[str, Any]) -> dict[int, int]:
    """What SGLang would reuse per rank: GPU pages from the first, then lower media."""
    return {int(rank): answer["reuse_pages"] for rank, answer in probe["ranks"].items()}


def wire_answer(probe: dict[str, Any]) -> dict[int, int]:
    """For the caller extra_key engine: what the wire shows. Its pages' hashes and events
    equal a plain request's, so no index can tell the two apart: the answer is the run of
    the probe's page hashes SGLang holds (that engine has no lower media)."""
    return {int(rank): answer["gpu_run_pages"] for rank, answer in probe["ranks"].items()}


# -- the recording holds what it should -------------------------------------------------


def test_recording_covers_late_join_reset_media_and_shapes() -> None:
    """The recorded stream exercises what the other tests rely on."""
    replays: set[SourceKey] = set()
    lost: list[Lost] = []
    clears: Counter[SourceKey] = Counter()
    media: set[str] = set()
    salted = lora = bigram = 0
    for item in recording.read(DATA / "fleet.kvr"):
        if isinstance(item, Replayed) and item.count:
            replays.add(item.source)
        elif isinstance(item, Lost):
            lost.append(item)
        elif isinstance(item, recording.RecordedBatch):
            for ev in item.batch.events:
                clears[item.source] += isinstance(ev, AllBlocksCleared)
                if isinstance(ev, BlockStored):
                    media.add(ev.medium or "GPU")
                    lora += ev.lora_name is not None
            # Read from the raw payload: independent of what kvindex decodes.
            for raw in msgspec.msgpack.decode(item.payload or b"[0, []]")[1]:
                salted += "cache_salt" in raw
                tokens = raw.get("token_ids") or [0]
                bigram += isinstance(tokens[0], list)
    assert not lost
    assert {SourceKey(e, 1) for e in ENGINES} <= replays  # every late rank was replayed
    assert all(clears[SourceKey(e, 0)] >= 1 for e in ENGINES)  # construction / reset
    assert clears[SourceKey("sgl-p1", 0)] == 2 and clears[SourceKey("sgl-p16", 0)] == 2
    assert set(MEDIA) <= media
    assert salted and lora and bigram


@pytest.mark.parametrize("engine", ENGINES)
def test_references_are_consistent(engine: str) -> None:
    """SGLang's events, summed in the driver, equal its cache; SGLang's match_prefix
    equals the run of the probe's own page hashes in its GPU pages (except where a caller
    extra_key shares plain hashes)."""
    ref = reference(engine)
    assert ref["sglang_version"] == "0.5.23"
    for rank in ref["ranks"].values():
        assert rank["events_self_check"]["ok"], rank["events_self_check"]
    for probe in ref["probes"]:
        for answer in probe["ranks"].values():
            if engine != "sgl-extra-key":
                assert answer["match_prefix_pages"] == answer["gpu_run_pages"], probe["name"]
            assert answer["reuse_pages"] >= answer["match_prefix_pages"]


# -- held pages per rank and medium ---------------------------------------------------------


@pytest.mark.parametrize(("engine", "rank"), list(ranks()))
def test_held_pages_equal_sglang(replayed: FleetIndex, engine: str, rank: int) -> None:
    got = held_by_index(replayed, SourceKey(engine, rank))
    want = held_by_sglang(engine, rank)
    for medium in MEDIA:
        missing = {h: c for h, c in want[medium].items() if got[medium].get(h) != c}
        extra = {h: c for h, c in got[medium].items() if h not in want[medium]}
        assert not missing and not extra, (
            f"{medium}: {len(missing)} pages differ or are missing "
            f"(e.g. {list(missing.items())[:3]}), {len(extra)} extra"
        )


def test_bigram_pages_as_serve_takes_them() -> None:
    """The payloads as `kvindex serve` applies them (the compiled parser declines pairs,
    the Python decoder takes them): no decode error, every rank's pages equal SGLang's,
    every page placed in the token tree (in bigram trees of their own), and every probe's
    lookup equals what SGLang would reuse."""
    index = FleetIndex()
    malformed = unknown = 0
    for item in recording.read(DATA / "fleet.kvr"):
        if item.source.instance != "sgl-bigram":
            continue
        if isinstance(item, recording.RecordedBatch) and item.payload is not None:
            result = index.apply_payload(item.source, item.payload, item.seq)
            malformed += result.malformed_events
            unknown += result.unknown_events
        else:
            index.handle(item)
    assert (malformed, unknown) == (0, 0)
    for rank in (0, 1):
        got = held_by_index(index, SourceKey("sgl-bigram", rank))
        assert got == held_by_sglang("sgl-bigram", rank)
    stats = index.cache_stats("sgl-bigram")
    assert stats.active > 0 and stats.unplaced == 0
    assert index.tree_nodes() > 0
    for probe in reference("sgl-bigram")["probes"]:
        assert lookup_ranks(index, "sgl-bigram", probe) == expected_ranks(probe), probe["name"]


# -- lookups against SGLang's match_prefix ---------------------------------------------------


@pytest.mark.parametrize(("engine", "scenario"), list(scenarios()))
def test_lookup_equals_sglang(replayed: FleetIndex, engine: str, scenario: str) -> None:
    wrong = []
    for probe in probes(engine, scenario):
        want = wire_answer(probe) if engine == "sgl-extra-key" else expected_ranks(probe)
        try:
            got = lookup_ranks(replayed, engine, probe)
        except TypeError as exc:  # no cache_salt keyword yet
            wrong.append(f"{probe['name']}: {exc}")
            continue
        if got != want:
            wrong.append(f"{probe['name']}: SGLang {want}, kvindex {got}")
    assert not wrong, f"{len(wrong)} probes differ:\n" + "\n".join(wrong[:12])


# -- live: SGLang's own code, followed by the Subscriber --------------------------------------


@pytest.fixture(scope="module")
def sglang_python(request: pytest.FixtureRequest) -> str:
    """The SGLang venv's python (built before the tests start: tests/enginevenv.py)."""
    return enginevenv.python(request.config, enginevenv.SGLANG)


@pytest.mark.interop
def test_live_engine_equals_sglang(sglang_python: str, tmp_path: Path) -> None:
    """A live page-16 engine (LoRA, lower media, a reset, rank 1 joining late; no salts,
    whose lookups wait for issue 20): the index follows it through the Subscriber, holds
    exactly SGLang's pages per rank and medium, and every probe's lookup equals what
    SGLang would reuse."""
    out = tmp_path / "live.json"
    args = (
        "--page-size 16 --lora --no-salt --tiers --steps 60 --reset-at 30 --solo-steps 6 --seed 7"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    proc = subprocess.Popen(
        [sglang_python, "-W", "ignore", str(DRIVER), "--out", str(out), *args.split()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        ready = _wait_for(proc, "ready", 90)
        _wait_for(proc, "paused", 60)
        pub, replay = ready["ranks"][0]["pub"], ready["ranks"][0]["replay"]
        spec = InstanceSpec("live", pub, replay, "", len(ready["ranks"]))
        policy = ReplayPolicy(first_reply_timeout=2, idle_timeout=1, max_attempts=5)
        index = FleetIndex()
        with Subscriber(instances=[spec], policy=policy) as sub:
            _poll(sub, index, 1.0)  # connected before the engine goes on
            _say(proc, "go")
            published = _wait_for(proc, "done", 90)["published"]
            want = {SourceKey("live", int(r)): n - 1 for r, n in published.items()}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(
                index.source_state(src)[0] == last for src, last in want.items()
            ):
                _poll(sub, index, 0.1)
        ref = json.loads(out.read_text())
    finally:
        _say(proc, "quit")
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for src, last in want.items():
        assert index.source_state(src)[0] == last
        held = ref["ranks"][str(src.rank)]["held"]
        assert held_by_index(index, src) == {m: {h: c for h, c in held[m]} for m in MEDIA}
    scenarios = Counter(probe["scenario"] for probe in ref["probes"])
    assert {"plain", "lora", "lora-asked-plain", "tier", "unseen"} <= set(scenarios)
    for probe in ref["probes"]:
        assert lookup_ranks(index, "live", probe) == expected_ranks(probe), probe["name"]


def _poll(sub: Subscriber, index: FleetIndex, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for item in sub.poll(0.05):
            index.handle(item)


def _say(proc: subprocess.Popen[str], line: str) -> None:
    try:
        assert proc.stdin is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    except (BrokenPipeError, ValueError):
        pass


def _wait_for(proc: subprocess.Popen[str], event: str, timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("event") == event:
                return msg
        elif proc.poll() is not None:
            break
    raise AssertionError(f"the SGLang driver never said {event!r} (exit {proc.poll()})")
