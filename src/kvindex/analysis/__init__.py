"""`kvindex.analysis`: why a fleet's caches hit and miss, from a recorded event stream.

>>> from kvindex.analysis import analyze
>>> report = analyze("fleet.kvr")          # tables, curves and series (JSON-ready)
>>> report.sources[0].restored_tokens      # prefill tokens recomputed after evictions

`kvindex analyze FILE --html report.html` renders it (see `docs/analysis.md`).
"""

from kvindex.analysis.report import Prefixes, PrefixRow, Report, SourceRow, analyze, build_report
from kvindex.analysis.track import Tracker
from kvindex.analysis.whatif import Curve, curve, stack_distances

__all__ = [
    "Curve",
    "PrefixRow",
    "Prefixes",
    "Report",
    "SourceRow",
    "Tracker",
    "analyze",
    "build_report",
    "curve",
    "stack_distances",
]
