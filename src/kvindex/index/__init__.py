"""`kvindex.index`: the exact state of a fleet's prefix caches, and token-prefix lookups.

`FleetIndex` is the compiled index (`kvindex.index.compiled`, C) when it was built and
`KVINDEX_PURE` is not set, else the pure-Python reference (`kvindex.index.reference`). Both
give identical state and answers (tests/test_core.py holds them to it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvindex.index.base import AnswerSlot, LookupRow
from kvindex.index.reference import ReferenceIndex
from kvindex.index.stats import CacheStats, RateWindow

if TYPE_CHECKING:
    from kvindex.index.compiled import CompiledIndex

__all__ = [
    "COMPILED",
    "CacheStats",
    "FleetIndex",
    "LookupRow",
    "RateWindow",
    "ReferenceIndex",
    "compiled_index",
    "json_answerer",
    "parse_lookup_body",
]


def _compiled() -> type[ReferenceIndex] | None:
    if os.environ.get("KVINDEX_PURE", "") not in ("", "0"):
        return None
    try:
        from kvindex.index.compiled import CompiledIndex
    except ImportError:  # not built (no compiler at install time): the reference serves
        return None
    return CompiledIndex  # type: ignore[return-value]


if TYPE_CHECKING:
    FleetIndex = ReferenceIndex
    COMPILED: bool
else:
    _chosen = _compiled()
    COMPILED = _chosen is not None
    FleetIndex = _chosen or ReferenceIndex


def compiled_index(index: Any) -> CompiledIndex | None:
    """`index` as the compiled index, or None (the pure reference, or a core not built)."""
    if not COMPILED:
        return None
    from kvindex.index.compiled import CompiledIndex

    return index if isinstance(index, CompiledIndex) else None


class JsonAnswerer(Protocol):
    def lookup_json(
        self,
        token_ids: Sequence[int] | bytes,
        lora_name: str | None,
        cache_salt: str | None,
        slots: list[AnswerSlot],
        statuses: list[bytes],
    ) -> tuple[bytes, bool]: ...

    def answer_core(self) -> object: ...

    def sources_gen(self) -> int: ...


def json_answerer(index: Any) -> JsonAnswerer | None:
    """What writes `index`'s lookup answers as JSON in C (`lookup_json(token_ids,
    lora_name, cache_salt, slots, statuses)`, and the C lookup thread through
    `answer_core()`): a compiled index, or one in shards; None for the pure reference."""
    compiled = compiled_index(index)
    if compiled is not None:
        return compiled
    from kvindex.index.sharded import ShardedIndex

    return index if isinstance(index, ShardedIndex) else None


def parse_lookup_body(body: bytes, max_items: int) -> tuple[bytes, str | None, str | None] | None:
    """A `/v1/lookup` body read in C (see kvindex.index.compiled.parse_lookup_body); always
    None without the compiled core: the caller's decoder then reads it."""
    if not COMPILED:
        return None
    from kvindex.index.compiled import parse_lookup_body as parse

    return parse(body, max_items)
