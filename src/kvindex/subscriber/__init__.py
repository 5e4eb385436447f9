"""`kvindex.subscriber`: follow vLLM publishers and get every batch once, in order."""

from kvindex.subscriber.core import Subscriber
from kvindex.subscriber.messages import (
    Connection,
    DecodeFailed,
    Delivery,
    Gap,
    Item,
    Lost,
    Malformed,
    Notice,
    Replayed,
    Restarted,
    SourceKey,
    SourceStats,
    Status,
    Unreachable,
    Unverified,
)
from kvindex.subscriber.spec import InstanceSpec, SourceSpec, SpecError, offset_endpoint
from kvindex.subscriber.state import Checkpoint, ReplayPolicy, SourceState, payload_digest

__all__ = [
    "Checkpoint",
    "Connection",
    "DecodeFailed",
    "Delivery",
    "Gap",
    "InstanceSpec",
    "Item",
    "Lost",
    "Malformed",
    "Notice",
    "ReplayPolicy",
    "Replayed",
    "Restarted",
    "SourceKey",
    "SourceSpec",
    "SourceState",
    "SourceStats",
    "SpecError",
    "Status",
    "Subscriber",
    "Unreachable",
    "Unverified",
    "offset_endpoint",
    "payload_digest",
]
