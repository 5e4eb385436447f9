"""The routing bench's requests: the Mooncake trace format, and a shared-prefix generator.

A request is its arrival time and its prompt and answer as *segments*: (segment id, length)
pieces whose tokens are drawn from the id alone (`segment_tokens`), so two requests that
share a segment share its tokens, and a prompt is only materialized when an engine or a
router needs it (a full trace would not fit in memory as token lists).

**Mooncake** (`read_mooncake`): JSON lines, one request each, as FAST'25 Mooncake's traces
and Dynamo's A/B guide (aiperf) use them:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`timestamp` in milliseconds, `hash_ids` one id per 512-token block of the input (identical
ids: identical prefix; the last block may be partial). The answer's tokens are the
request's own (an answer is never reused by a later request of the trace).

**Shared prefix** (`shared_prefix`): `groups` long system prompts, each used by `users`
users whose chats run `turns` turns: a turn's prompt is the system prompt, every earlier
question and answer of the chat, and a new question (the shape of inference-perf's
`shared_prefix` data and `vllm bench serve --dataset-name prefix_repetition`, made
multi-turn); with `skew`, groups are not alike: a chat's group is drawn by Zipf's law
(group g with weight 1 / (g + 1)^skew), as a few applications' prompts dominate real
traffic. Chats start spread over the trace; a turn follows the chat's previous one after a
think time. The same seed gives the same trace.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "MOONCAKE_BLOCK",
    "SharedPrefix",
    "TraceError",
    "TraceRequest",
    "read_mooncake",
    "segment_tokens",
    "shared_prefix",
]

MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces
VOCAB = 32_000
_OUTPUT_BASE = 1 << 48  # answers' segment ids (above any trace's hash ids)
Segment = tuple[int, int]  # (segment id, tokens)


class TraceError(ValueError):
    """A trace file that is not in the Mooncake format (the message names the line)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: when it arrives (seconds from the trace's start), its prompt and its
    answer as segments (`segment_tokens` makes their tokens)."""

    id: int
    at: float
    prompt: tuple[Segment, ...]
    output: tuple[Segment, ...]

    @property
    def prompt_len(self) -> int:
        return sum(n for _, n in self.prompt)

    @property
    def output_len(self) -> int:
        return sum(n for _, n in self.output)

    def prompt_tokens(self, seed: int = 0) -> np.ndarray:
        return _join(self.prompt, seed)

    def output_tokens(self, seed: int = 0) -> np.ndarray:
        return _join(self.output, seed)


def segment_tokens(segment: int, length: int, seed: int = 0) -> np.ndarray:
    """The first `length` tokens of segment `segment` (uint32; the same for the same ids)."""
    rng = np.random.default_rng([seed, segment])
    return rng.integers(1, VOCAB, size=length, dtype=np.uint32)


def _join(segments: tuple[Segment, ...], seed: int) -> np.ndarray:
    if not segments:
        return np.zeros(0, dtype=np.uint32)
    return np.concatenate([segment_tokens(s, n, seed) for s, n in segments])


# -- Mooncake ----------------------------------------------------------------------------


def read_mooncake(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a Mooncake trace file, in arrival order (times from the first)."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            rows.append(_mooncake_row(line, number))
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    start = rows[0][0]
    out = []
    for i, (ts, length, output, hash_ids) in enumerate(rows):
        prompt = _mooncake_prompt(length, hash_ids)
        out.append(TraceRequest(i, (ts - start) / 1000.0, prompt, ((_OUTPUT_BASE + i, output),)))
    return out


def _mooncake_row(line: str, number: int) -> tuple[float, int, int, list[int]]:
    try:
        row = json.loads(line)
        ts = float(row["timestamp"])
        length = int(row["input_length"])
        output = int(row["output_length"])
        hash_ids = [int(h) for h in row["hash_ids"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"line {number}: not a Mooncake trace row ({exc})") from None
    if length <= 0 or output < 0 or not hash_ids or any(h < 0 for h in hash_ids):
        raise TraceError(f"line {number}: input_length, output_length or hash_ids out of range")
    if not (len(hash_ids) - 1) * MOONCAKE_BLOCK < length <= len(hash_ids) * MOONCAKE_BLOCK:
        raise TraceError(
            f"line {number}: {len(hash_ids)} hash_ids of {MOONCAKE_BLOCK} tokens "
            f"can't make input_length {length}"
        )
    return ts, length, output, hash_ids


def _mooncake_prompt(length: int, hash_ids: list[int]) -> tuple[Segment, ...]:
    last = length - (len(hash_ids) - 1) * MOONCAKE_BLOCK
    return tuple(
        (h, last if i == len(hash_ids) - 1 else MOONCAKE_BLOCK) for i, h in enumerate(hash_ids)
    )


# -- the shared-prefix generator ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """The generator's shape (`shared_prefix`)."""

    groups: int = 16
    system_tokens: int = 6_000
    users: int = 10  # chats per group
    turns: int = 5  # per chat
    question_tokens: int = 256
    answer_tokens: int = 128
    rate: float = 10.0  # requests per second while chats run (module doc)
    think_seconds: float = 10.0  # mean time from one turn of a chat to its next
    skew: float = 0.0  # groups' popularity: Zipf's exponent (0: every group alike)
    seed: int = 0

    @property
    def requests(self) -> int:
        return self.groups * self.users * self.turns


def shared_prefix(shape: SharedPrefix) -> list[TraceRequest]:
    """The generated trace, in arrival order."""
    rng = random.Random(shape.seed)
    chats = shape.groups * shape.users
    # chats start over `requests / rate` seconds: `rate` requests a second once the chats
    # are under way (fewer while the first start and the last end)
    window = shape.requests / shape.rate
    timed: list[tuple[float, tuple[Segment, ...], tuple[Segment, ...]]] = []
    weights = [1.0 / (g + 1) ** shape.skew for g in range(shape.groups)]
    for chat in range(chats):
        group = chat % shape.groups if not shape.skew else _draw(rng, weights)
        at = rng.uniform(0.0, window)
        for prompt, answer in _chat(shape, group, chat):
            timed.append((at, prompt, answer))
            at += rng.expovariate(1.0 / shape.think_seconds) if shape.think_seconds else 0.0
    timed.sort(key=lambda t: t[0])
    return [TraceRequest(i, at, p, a) for i, (at, p, a) in enumerate(timed)]


def _draw(rng: random.Random, weights: list[float]) -> int:
    return rng.choices(range(len(weights)), weights)[0]


def _chat(
    shape: SharedPrefix, group: int, chat: int
) -> Iterator[tuple[tuple[Segment, ...], tuple[Segment, ...]]]:
    """Each turn's (prompt, answer): segment ids 1.. system prompts, then per chat and turn
    a question and an answer."""
    history: list[Segment] = [(1 + group, shape.system_tokens)]
    base = 1 + shape.groups + 2 * shape.turns * chat
    for turn in range(shape.turns):
        history.append((base + 2 * turn, shape.question_tokens))
        answer = ((base + 2 * turn + 1, shape.answer_tokens),)
        yield tuple(history), answer
        history.extend(answer)
