"""`kvindex.service`: the fleet runtime, its HTTP API and its Prometheus metrics."""

from kvindex.service.runtime import (
    DuplicateInstance,
    Fleet,
    InstanceView,
    RankView,
    UnknownInstance,
)

__all__ = ["DuplicateInstance", "Fleet", "InstanceView", "RankView", "UnknownInstance"]
