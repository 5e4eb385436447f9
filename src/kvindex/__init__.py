"""kvindex: an exact, fast index of vLLM's KV-cache events.

The layers, each usable on its own:
- `kvindex.wire`: frames and payloads of every vLLM release from 0.9 to 0.33;
- `kvindex.subscriber`: `Subscriber`, gap-free, restart-aware delivery of batches;
- `kvindex.index`: `FleetIndex`, exact per-instance block state and prefix lookups;
- `kvindex.runtime`: `Fleet`, the ingest loop of `kvindex serve`, and the views (instances,
  fleet totals, lookup answers) that every face renders;
- `kvindex.store`: where that state persists (memory, SQLite, Redis);
- `kvindex.service`: the HTTP API, the dashboard and the metrics of `kvindex serve`.
"""

from kvindex.subscriber import (
    Checkpoint,
    DecodeFailed,
    Delivery,
    Gap,
    InstanceSpec,
    Lost,
    Notice,
    Replayed,
    Restarted,
    SourceKey,
    Subscriber,
    Unverified,
)
from kvindex.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
    decode_batch,
    render_hash,
)

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Checkpoint",
    "DecodeFailed",
    "Delivery",
    "EventBatch",
    "Gap",
    "InstanceSpec",
    "Lost",
    "Notice",
    "Replayed",
    "Restarted",
    "SourceKey",
    "Subscriber",
    "UnknownEvent",
    "Unverified",
    "__version__",
    "decode_batch",
    "render_hash",
]
