"""SGLang's load stream: one `LoadStat` gauge per scheduler (DP rank), as 0.5.23 sends it.

Each rank binds its own PUB socket (`/server_info`'s `load_endpoint_port_base` + rank,
`--load-publish-endpoint`) and sends `[b"load", seq (8 bytes, big-endian), payload]`, the
KV-event socket's framing, with no replay: a gauge re-sent at least once a second while
unchanged (`LOAD_PUBLISH_HEARTBEAT_S`) and at once when it changes. The payload is a tagged
positional msgpack array (`sglang/srt/managers/scheduler_components/load_publisher.py`):

    ["LoadStat", num_running_reqs, num_waiting_reqs, num_tokens, max_total_num_tokens,
     attn_dp_rank, num_waiting_uncached_tokens, num_total_tokens, max_running_requests,
     total_prefill_uncached_tokens, total_prefill_busy_us]

The first six positions are the stable prefix (SGLang's routers ignore appended fields):
missing trailing fields take their defaults and extra ones are ignored, so an older or a
newer SGLang decodes too. (`KvMetrics`, the other load struct in SGLang's source, travels
only between SGLang's own processes; it is not what the advertised stream carries.)
"""

from __future__ import annotations

import msgspec

__all__ = ["LOAD_TOPIC", "LoadStat", "LoadStatError", "decode_load", "encode_load"]

LOAD_TOPIC = "load"  # SGLang's LOAD_TOPIC (also advertised as `load_topic`)


class LoadStat(msgspec.Struct, array_like=True, tag=True, frozen=True, gc=False):
    """One scheduler's load now (SGLang's field names; tokens are KV slots)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int  # KV tokens in use
    max_total_num_tokens: int  # KV capacity in tokens; 0 when unknown
    attn_dp_rank: int | None = None  # informational: a reading is keyed by its socket
    num_waiting_uncached_tokens: int = 0  # uncached prompt tokens waiting for prefill
    num_total_tokens: int = 0  # KV tokens in use plus queued requests' tokens
    max_running_requests: int = 0  # the scheduler's running-request limit; 0: unknown
    total_prefill_uncached_tokens: int = 0  # cumulative
    total_prefill_busy_us: int = 0  # cumulative prefill step time

    @property
    def kv_usage(self) -> float | None:
        """KV tokens in use over capacity (None when the capacity is unknown)."""
        if self.max_total_num_tokens <= 0:
            return None
        return self.num_tokens / self.max_total_num_tokens


class LoadStatError(ValueError):
    """A load payload that is not a `LoadStat`."""


_decoder = msgspec.msgpack.Decoder(LoadStat)
_encoder = msgspec.msgpack.Encoder()


def decode_load(payload: bytes) -> LoadStat:
    """The `LoadStat` in one load message's payload; raises `LoadStatError`."""
    try:
        stat = _decoder.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise LoadStatError(f"not a LoadStat: {exc}") from None
    counts = (stat.num_running_reqs, stat.num_waiting_reqs, stat.num_tokens)
    if min(*counts, stat.max_total_num_tokens) < 0:
        raise LoadStatError("not a LoadStat: a negative count")
    return stat


def encode_load(stat: LoadStat) -> bytes:
    """`stat` as SGLang's publisher encodes it (the simulator and tests send these)."""
    return _encoder.encode(stat)
