"""One definition of what an event does to a pool (kvindex.wire.pools), held by every
consumer that counts what a publisher holds: the same stream goes to the pure-Python index,
the compiled index, the stores' mirror and the analysis tracker, and all four must hold the
same copies of the same hashes in the same (group, medium) pools, publisher by publisher.

The streams are test_core's hypothesis streams (every event shape: both wire generations,
namespaces, own keys, hash-only and skipped-block events, bigram pages, several groups and
media, duplicate copies, clears and restarts) and the recording of SGLang's own engines in
tests/data/sglang/. The simulator's reference pools are held to the index by
tests/test_sim.py the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core import SOURCES, build, event_plan, payload_of

from kvindex.analysis.track import Tracker
from kvindex.index import FleetIndex, ReferenceIndex
from kvindex.recording import BatchRec, NoticeRec
from kvindex.recording.reader import records
from kvindex.store.mirror import Mirror
from kvindex.subscriber import SourceKey
from kvindex.wire import BatchDecoder, WireError
from kvindex.wire.pools import DEFAULT_POOL, PoolCopies, pool_of

RECORDING = Path(__file__).parent / "data" / "sglang" / "fleet.kvr"


class Consumers:
    """The four consumers, fed alike."""

    def __init__(self) -> None:
        self.pure, self.fast = ReferenceIndex(), FleetIndex()
        self.mirror, self.tracker = Mirror(), Tracker()
        self.decoder = BatchDecoder()
        self.seq = 0

    def batch(self, source: SourceKey, payload: bytes) -> None:
        self.seq += 1
        try:
            self.pure.apply(source, self.decoder.decode(payload), self.seq)
        except WireError:
            pass  # every consumer counts it and skips it
        self.fast.apply_payload(source, payload, self.seq)
        self.mirror.apply_payload(source, payload)
        rec = BatchRec(source.instance, source.rank, self.seq, float(self.seq), payload)
        self.tracker.feed(rec)

    def restart(self, source: SourceKey) -> None:
        self.pure.drop_source(source)
        self.fast.drop_source(source)
        self.mirror.restart(source)
        notice = NoticeRec(source.instance, source.rank, float(self.seq), "Restarted")
        self.tracker.feed(notice)

    def held(self, source: SourceKey) -> dict[str, PoolCopies]:
        """What each consumer says the publisher holds (empty pools left out)."""

        def nonempty(copies: PoolCopies) -> PoolCopies:
            return {pool: held for pool, held in copies.items() if held}

        return {
            "pure index": nonempty(self.pure.copies(source)),
            "compiled index": nonempty(self.fast.copies(source)),
            "store mirror": self.mirror.copies(source),
            "analysis tracker": self.tracker.copies(source),
        }

    def assert_agree(self, sources: list[SourceKey]) -> None:
        for source in sources:
            held = self.held(source)
            reference = held.pop("pure index")
            for who, copies in held.items():
                assert copies == reference, (source, who)


# Instances removed ("drop") are a runtime act the tracker of a recording never sees.
streams = st.lists(event_plan.filter(lambda step: step[0] != "drop"), max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams)
def test_every_consumer_holds_the_same_pools(plan: list[tuple[Any, ...]]) -> None:
    consumers = Consumers()
    for source, kind, what in build(plan):
        if kind == "batch":
            batch, arrays = what
            consumers.batch(source, payload_of(batch, arrays))
        else:
            consumers.restart(source)
    consumers.assert_agree(SOURCES)


def test_sglang_engines_own_stream_is_held_alike_by_every_consumer() -> None:
    """SGLang's recorded engines (page 1 and 16, bigram pages, extra keys, host and disk
    media, two DP ranks, resets) through all four consumers."""
    consumers = Consumers()
    sources: set[SourceKey] = set()
    for rec in records(RECORDING):
        if isinstance(rec, BatchRec):
            source = SourceKey(rec.instance, rec.rank)
            sources.add(source)
            consumers.batch(source, rec.payload)
        elif isinstance(rec, NoticeRec) and rec.kind == "Restarted":
            consumers.restart(SourceKey(rec.instance, rec.rank))
    assert len(sources) >= 4
    media = {m for s in sources for _, m in consumers.pure.copies(s)}
    assert {"GPU", "CPU_PINNED"} <= media, media  # more than one tier in the stream
    consumers.assert_agree(sorted(sources, key=str))


def test_the_pool_an_event_names() -> None:
    assert pool_of(None, None) == DEFAULT_POOL == (0, "GPU")
    assert pool_of(0, "") == (0, "GPU")  # an empty medium is the GPU, as no medium
    assert pool_of(2, "CPU") == (2, "CPU")
