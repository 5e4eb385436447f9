"""The routing bench's engines: vLLM's prefix cache with a bounded pool, and a service-time
model that turns cache hits into time to first token.

**The pool** is vLLM v1's (as `kvindex.sim.engine` keeps it): `gpu_blocks` physical blocks,
a free queue in LRU order whose front is evicted when a block is needed (a cached block
keeps its hash while free, until reused: then one `BlockRemoved`), a request reusing the
longest cached prefix of its prompt but at most `(n - 1) // block_size` blocks (vLLM
recomputes the last token), full blocks cached when the request is scheduled (one
`BlockStored` with their parent and tokens), a finished request's blocks freed tail first.
The answer's full blocks are cached when the request finishes (vLLM caches them as they
fill; a later turn of the chat reuses them either way).

**The service-time model** (docs/routing.md states it), per engine, in simulated seconds:

- at most `max_running` requests run at once; the others wait in arrival order (as they
  do, too, while the pool has no room for a request's blocks: prompt and answer are
  reserved when it is scheduled);
- prefill is one at a time (a prefill saturates the GPU): a scheduled request's prefill
  starts when the previous one ends and takes `prefill_overhead + prefill_per_token x`
  its uncached prompt tokens; its first token comes at the end of its prefill
  (TTFT = that time - arrival: waiting, the prefills ahead of it, its own);
- decoding is batched: a request then takes `decode_per_token` per output token, however
  many others decode beside it.

Left out: chunked prefill mixing with decode steps, decode slowing with the batch's size,
preemption, CPU offloading of evicted blocks, the network.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from kvindex.sim.engine import GPU, Removed, SimEvent, Stored

__all__ = ["Job", "ModelEngine", "ServiceModel", "chain_digests"]

ROOT = hashlib.sha256(b"kvindex routing bench root").digest()


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """What an engine's time goes into (the module doc)."""

    prefill_per_token: float = 1.0e-4  # s per uncached prompt token (10k tokens/s)
    prefill_overhead: float = 0.005  # s per prefill
    decode_per_token: float = 0.02  # s per output token (one decode step)
    max_running: int = 32
    block_size: int = 16
    gpu_blocks: int = 4_096


def chain_digests(tokens: np.ndarray, block_size: int) -> list[bytes]:
    """The chained hash of every full block of `tokens` (a router's or an engine's)."""
    data = tokens.astype(np.uint32, copy=False).tobytes()
    width = 4 * block_size
    out: list[bytes] = []
    parent = ROOT
    for i in range(len(tokens) // block_size):
        parent = hashlib.sha256(parent + data[i * width : (i + 1) * width]).digest()
        out.append(parent)
    return out


@dataclass(slots=True)
class Job:
    """One request on its way through an engine; the figures are filled as it goes."""

    id: int
    at: float
    prompt: np.ndarray  # uint32 token ids
    output: np.ndarray
    digests: list[bytes]  # of the prompt's full blocks
    engine: int = -1
    hit_tokens: int = 0
    first_token: float | None = None
    finished: float | None = None
    refused: bool = False
    blocks: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.at


class ModelEngine:
    """One engine: its pool, its queue and its clock (`advance`, `arrive`); the events it
    produced since the last `take_events`."""

    def __init__(self, index: int, name: str, model: ServiceModel) -> None:
        self.index = index
        self.name = name
        self.model = model
        size = model.gpu_blocks
        self.digest: list[bytes | None] = [None] * size
        self.refs = [0] * size
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(size))
        self.cached: dict[bytes, list[int]] = {}
        self.running = 0
        self.waiting: deque[Job] = deque()
        self._finishes: list[tuple[float, int, Job]] = []
        self._prefill_free = 0.0
        self._events: list[SimEvent] = []
        self.jobs = 0
        self.now = 0.0

    # -- what a router may read -----------------------------------------------------------

    @property
    def load(self) -> int:
        return self.running + len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - len(self.free) / self.model.gpu_blocks

    @property
    def used_blocks(self) -> int:
        return self.model.gpu_blocks - len(self.free)

    @property
    def waiting_tokens(self) -> int:
        """Uncached prompt tokens waiting for prefill (SGLang's load stream says it):
        the scheduled prefills' rest and the waiting requests' uncached tokens."""
        m = self.model
        ahead = max(0.0, self._prefill_free - self.now) / m.prefill_per_token
        queued = sum(len(j.prompt) - self.matched(j.digests) * m.block_size for j in self.waiting)
        return int(ahead) + queued

    def matched(self, digests: list[bytes]) -> int:
        """How many leading blocks of a prompt the pool holds (the engine's truth)."""
        n = 0
        for d in digests:
            if d not in self.cached:
                break
            n += 1
        return n

    def take_events(self) -> list[SimEvent]:
        events, self._events = self._events, []
        return events

    # -- time --------------------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Finish every request done by `now`, scheduling waiting ones as room frees."""
        self.now = max(self.now, now)
        while self._finishes and self._finishes[0][0] <= now:
            at, _, job = heapq.heappop(self._finishes)
            self._finish(job)
            self._schedule(at)

    def next_event(self) -> float | None:
        return self._finishes[0][0] if self._finishes else None

    def arrive(self, job: Job, now: float) -> None:
        job.engine = self.index
        self.jobs += 1
        self.now = max(self.now, now)
        if -(-(len(job.prompt) + len(job.output)) // self.model.block_size) > len(self.refs):
            job.refused = True  # it can never fit this pool
            return
        self.waiting.append(job)
        self._schedule(now)

    # -- the pool -------------------------------------------------------------------------

    def _schedule(self, now: float) -> None:
        while self.waiting and self.running < self.model.max_running:
            if not self._start(self.waiting[0], now):
                return
            self.waiting.popleft()

    def _start(self, job: Job, now: float) -> bool:
        m = self.model
        bs = m.block_size
        n = len(job.prompt)
        hits = self._hits(job.digests[: (n - 1) // bs])
        need = -(-(n + len(job.output)) // bs) - len(hits)
        if need > len(self.free) - sum(1 for b in hits if self.refs[b] == 0):
            return False
        for b in hits:
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1
        job.blocks = hits + [self._allocate() for _ in range(need)]
        self._cache(job, len(hits), job.digests, job.prompt)
        job.hit_tokens = len(hits) * bs
        start = max(now, self._prefill_free)
        self._prefill_free = start + m.prefill_overhead + m.prefill_per_token * (n - len(hits) * bs)
        job.first_token = self._prefill_free
        job.finished = job.first_token + m.decode_per_token * len(job.output)
        heapq.heappush(self._finishes, (job.finished, job.id, job))
        self.running += 1
        return True

    def _hits(self, digests: list[bytes]) -> list[int]:
        hits = []
        for d in digests:
            ids = self.cached.get(d)
            if not ids:
                break
            hits.append(ids[0])
        return hits

    def _allocate(self) -> int:
        b, _ = self.free.popitem(last=False)
        d = self.digest[b]
        if d is not None:  # a cached block reused: its hash is evicted
            copies = self.cached[d]
            copies.remove(b)
            if not copies:
                del self.cached[d]
            self.digest[b] = None
            self._events.append(Removed([d], GPU))
        self.refs[b] = 1
        return b

    def _cache(self, job: Job, start: int, digests: list[bytes], tokens: np.ndarray) -> None:
        """Give the job's blocks `start`.. of `digests` their hashes: one BlockStored."""
        if start >= len(digests):
            return
        for i in range(start, len(digests)):
            b = job.blocks[i]
            self.digest[b] = digests[i]
            self.cached.setdefault(digests[i], []).append(b)
        bs = self.model.block_size
        parent = digests[start - 1] if start else None
        chunk = tokens[start * bs : len(digests) * bs].tolist()
        self._events.append(Stored(digests[start:], parent, chunk, None))

    def _finish(self, job: Job) -> None:
        """The answer's full blocks are cached, then every block freed, tail first."""
        bs = self.model.block_size
        whole = np.concatenate([job.prompt, job.output])
        full = len(whole) // bs
        done = len(job.digests)
        if full > done:
            digests = job.digests + _extend(job.digests, whole, bs, done, full)
            self._cache(job, done, digests, whole)
        for b in reversed(job.blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None
        job.blocks = []
        self.running -= 1


def _extend(digests: list[bytes], tokens: np.ndarray, bs: int, start: int, end: int) -> list[bytes]:
    data = tokens.astype(np.uint32, copy=False).tobytes()
    parent = digests[-1] if digests else ROOT
    out = []
    for i in range(start, end):
        parent = hashlib.sha256(parent + data[4 * bs * i : 4 * bs * (i + 1)]).digest()
        out.append(parent)
    return out
