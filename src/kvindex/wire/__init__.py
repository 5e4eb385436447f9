"""`kvindex.wire`: vLLM's KV-event frames and payloads, every generation from 0.9 to 0.33."""

from kvindex.wire.decode import BatchDecoder, WireError, decode_batch, event_to_builtins
from kvindex.wire.events import (
    KNOWN_TYPES,
    MEDIUM_GPU,
    AllBlocksCleared,
    BigramBlockStored,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    UnknownEvent,
)
from kvindex.wire.frames import (
    END_SEQ,
    LiveFrame,
    ReplayFrame,
    decode_seq,
    encode_seq,
    parse_live,
    parse_replay,
    replay_request,
)
from kvindex.wire.hashes import parse_hash, render_hash

__all__ = [
    "END_SEQ",
    "KNOWN_TYPES",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BatchDecoder",
    "BigramBlockStored",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "LiveFrame",
    "ReplayFrame",
    "UnknownEvent",
    "WireError",
    "decode_batch",
    "decode_seq",
    "encode_seq",
    "event_to_builtins",
    "parse_hash",
    "parse_live",
    "parse_replay",
    "render_hash",
    "replay_request",
]
