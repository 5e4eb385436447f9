"""The engines' own load streams (SGLang's `LoadStat`, `kvindex.subscriber.engine_load`) as a
`LoadSource` for the routing score: pushed once a second or on change, so fresher than a
`/metrics` scrape, and tried before it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvindex.runtime.routing import Load
from kvindex.subscriber import SourceKey

if TYPE_CHECKING:
    from kvindex.runtime.fleet import Fleet

__all__ = ["StreamLoads"]


class StreamLoads:
    """Per DP rank, the newest reading of an instance's load stream (None: it has none)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def load(self, instance: str) -> Mapping[int, Load] | None:
        spec = self.fleet.specs.get(instance)
        if spec is None or spec.load_endpoint is None:
            return None
        found: dict[int, Load] = {}
        for rank in range(spec.dp):
            state = self.fleet.load.state(SourceKey(instance, rank))
            if state is None or state.reading is None:
                continue
            stat = state.reading.stat
            found[rank] = Load(
                waiting=stat.num_waiting_reqs,
                running=stat.num_running_reqs,
                kv_usage=stat.kv_usage,
                at=state.reading.received,
                block_size=spec.block_size,
                waiting_tokens=stat.num_waiting_uncached_tokens,
            )
        return found or None
