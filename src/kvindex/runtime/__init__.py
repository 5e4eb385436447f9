"""`kvindex.runtime`: the fleet that ingests, and the views every face renders.

`Fleet` follows a set of instances (one `Subscriber`, one `FleetIndex`) inside an event
loop; `InstanceView`, `RankView`, `FleetSummary` and `LookupAnswer` are what the HTTP API,
the dashboard, the metrics and a library caller read of it. The stores and the service sit
above this layer; it imports neither.
"""

from kvindex.runtime.fleet import (
    DuplicateInstance,
    Fleet,
    IngestStats,
    MembershipChange,
    MembershipFeed,
    UnknownInstance,
)
from kvindex.runtime.ingest import WorkerUnavailable
from kvindex.runtime.views import (
    RECOVERY_COUNTERS,
    STATUS_ORDER,
    FleetSummary,
    InstanceMatch,
    InstanceView,
    LookupAnswer,
    RankMatch,
    RankView,
    StoreHealth,
    worst_status,
)

__all__ = [
    "RECOVERY_COUNTERS",
    "STATUS_ORDER",
    "DuplicateInstance",
    "Fleet",
    "FleetSummary",
    "IngestStats",
    "InstanceMatch",
    "InstanceView",
    "LookupAnswer",
    "MembershipChange",
    "MembershipFeed",
    "RankMatch",
    "RankView",
    "StoreHealth",
    "UnknownInstance",
    "WorkerUnavailable",
    "worst_status",
]
