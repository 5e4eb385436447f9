"""kvindex: an exact, fast index of vLLM's KV-cache events.

The layers, each usable on its own:
- `kvindex.wire`: frames and payloads of every vLLM release from 0.9 to 0.33;
- `kvindex.subscriber`: `Subscriber`, gap-free, restart-aware delivery of batches;
"""

from kvindex.subscriber import (
    Checkpoint,
    Delivery,
    InstanceSpec,
    Lost,
    Notice,
    Restarted,
    SourceKey,
    Subscriber,
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
    "Delivery",
    "EventBatch",
    "InstanceSpec",
    "Lost",
    "Notice",
    "Restarted",
    "SourceKey",
    "Subscriber",
    "UnknownEvent",
    "__version__",
    "decode_batch",
    "render_hash",
]
