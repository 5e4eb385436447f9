"""`kvindex.index`: the exact state of a fleet's prefix caches, and token-prefix lookups.

`FleetIndex` is the compiled index (`kvindex.index.compiled`, C) when it was built and
`KVINDEX_PURE` is not set, else the pure-Python reference (`kvindex.index.fleet`). Both
give identical state and answers (tests/test_core.py holds them to it).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvindex.index.base import LookupRow
from kvindex.index.fleet import FleetIndex as PureFleetIndex
from kvindex.index.stats import CacheStats, RateWindow

__all__ = [
    "COMPILED",
    "CacheStats",
    "FleetIndex",
    "LookupRow",
    "PureFleetIndex",
    "RateWindow",
]


def _compiled() -> type[PureFleetIndex] | None:
    if os.environ.get("KVINDEX_PURE", "") not in ("", "0"):
        return None
    try:
        from kvindex.index.compiled import CompiledIndex
    except ImportError:  # not built (no compiler at install time): the reference serves
        return None
    return CompiledIndex  # type: ignore[return-value]


if TYPE_CHECKING:
    FleetIndex = PureFleetIndex
    COMPILED: bool
else:
    _chosen = _compiled()
    COMPILED = _chosen is not None
    FleetIndex = _chosen or PureFleetIndex
