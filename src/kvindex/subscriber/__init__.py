"""`kvindex.subscriber`: follow vLLM publishers and get every batch once, in order."""

from kvindex.subscriber.capacity import CapacityError, Need, SocketBudget, need_of_instances
from kvindex.subscriber.core import DEFAULT_SUB_HWM, Subscriber
from kvindex.subscriber.inorder import Applied
from kvindex.subscriber.messages import (
    Connection,
    DecodeFailed,
    Delivery,
    Discarded,
    Gap,
    Item,
    Lost,
    Malformed,
    Notice,
    Replayed,
    ReplayRefused,
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
    "DEFAULT_SUB_HWM",
    "Applied",
    "CapacityError",
    "Checkpoint",
    "Connection",
    "DecodeFailed",
    "Delivery",
    "Discarded",
    "Gap",
    "InstanceSpec",
    "Item",
    "Lost",
    "Malformed",
    "Need",
    "Notice",
    "ReplayPolicy",
    "ReplayRefused",
    "Replayed",
    "Restarted",
    "SocketBudget",
    "SourceKey",
    "SourceSpec",
    "SourceState",
    "SourceStats",
    "SpecError",
    "Status",
    "Subscriber",
    "Unreachable",
    "Unverified",
    "need_of_instances",
    "offset_endpoint",
    "payload_digest",
]
