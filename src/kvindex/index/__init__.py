"""`kvindex.index`: the exact state of a fleet's prefix caches, and token-prefix lookups."""

from kvindex.index.fleet import FleetIndex, LookupRow
from kvindex.index.stats import CacheStats, RateWindow

__all__ = ["CacheStats", "FleetIndex", "LookupRow", "RateWindow"]
