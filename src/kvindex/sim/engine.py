"""One simulated vLLM engine (one DP rank): a bounded block pool with prefix caching.

It follows vLLM v1's `BlockPool` and `KVCacheManager` where events are concerned:

- `gpu_blocks` physical blocks; a free queue in LRU order (evicted from the front; a
  finished request's blocks are freed tail first, so its last blocks go first);
- a cached block keeps its hash while free, until it is reallocated: then it is evicted
  (one `BlockRemoved` per evicted copy, one hash per event, as on vLLM's GPU path);
- a request reuses the longest cached prefix of its prompt, but at most `(n - 1) //
  block_size` blocks (vLLM recomputes the last token, so a fully cached block-aligned
  prompt recomputes its last block into a second physical copy);
- full blocks are cached when they are scheduled: one `BlockStored` per request and step
  with the new blocks' hashes, their parent and their tokens. A hash cached in several
  physical blocks is announced once per copy;
- with a CPU tier (`cpu_blocks > 0`), a finished request's full blocks are offloaded
  (hash-only stores, medium "CPU"); the tier evicts in LRU order;
- SGLang's HiCache tiers (`page_tiers`): the CPU tier's stores carry each page's parent,
  tokens, adapter and salt (as SGLang's recorder publishes host pages), and with a disk
  tier (`disk_blocks > 0`) what the CPU tier evicts moves there (LRU as well);
- `reset_prefix_cache` preempts the running requests and drops every hash
  (`AllBlocksCleared`); `restart` is a new process: everything is gone, silently.

The events are kept in an internal form (digests, not wire hashes); `encoding` turns them
into one vLLM release's payload.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvindex.sim.workload import Adapter, Digest, Request, Workload, extend_chain

__all__ = [
    "Cleared",
    "Engine",
    "EngineSpec",
    "Offloaded",
    "Page",
    "Removed",
    "SimEvent",
    "Stored",
]

GPU = "GPU"
CPU = "CPU"
DISK = "DISK"


@dataclass(frozen=True, slots=True)
class Stored:
    """Full blocks entered the GPU prefix cache (one request, one step)."""

    digests: list[Digest]
    parent: Digest | None
    token_ids: list[int]
    lora: Adapter | None
    salt: str | None = None


@dataclass(frozen=True, slots=True)
class Page:
    """What a lower tier keeps of a block beside its hash (SGLang publishes it)."""

    parent: Digest | None
    tokens: list[int]
    lora: Adapter | None
    salt: str | None


@dataclass(frozen=True, slots=True)
class Offloaded:
    """Blocks were copied to a lower tier: hash-only (vLLM's CPU tier), or with their
    pages (`pages`, one per digest: SGLang's host and disk tiers)."""

    digests: list[Digest]
    medium: str = CPU
    pages: list[Page] | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    digests: list[Digest]
    medium: str


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


SimEvent = Stored | Offloaded | Removed | Cleared


@dataclass(frozen=True, slots=True)
class EngineSpec:
    block_size: int = 16
    gpu_blocks: int = 1024
    cpu_blocks: int = 0  # 0: no CPU offload tier
    disk_blocks: int = 0  # 0: no disk tier below the CPU one (SGLang HiCache's storage)
    page_tiers: bool = False  # lower tiers publish pages, not bare hashes (SGLang)
    max_running: int = 6
    decode_tokens: int = 8  # tokens generated per request and step


@dataclass(slots=True)
class _Running:
    request: Request
    blocks: list[int]  # physical block ids, in token order
    cached: int  # how many leading blocks carry their hash
    done: bool = False


@dataclass(slots=True)
class _Pool:
    """The GPU block pool: per physical block its hash and reference count."""

    size: int
    digest: list[Digest | None] = field(default_factory=list)
    refs: list[int] = field(default_factory=list)
    free: OrderedDict[int, None] = field(default_factory=OrderedDict)
    cached: dict[Digest, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.digest = [None] * self.size
        self.refs = [0] * self.size
        self.free = OrderedDict.fromkeys(range(self.size))


class Engine:
    """A vLLM engine's prefix cache, stepped by the simulation."""

    def __init__(self, index: int, instance: int, spec: EngineSpec, rng: random.Random) -> None:
        self.index = index  # among all engines of the fleet
        self.instance = instance
        self.spec = spec
        self.rng = rng
        self.pool = _Pool(spec.gpu_blocks)
        self.cpu: OrderedDict[Digest, Page | None] = OrderedDict()
        self.disk: OrderedDict[Digest, Page | None] = OrderedDict()
        self.running: list[_Running] = []
        self.waiting: deque[Request] = deque()

    # -- the reference state -----------------------------------------------------------

    def gpu_copies(self) -> dict[Digest, int]:
        """Every cached hash and its number of physical copies."""
        return {d: len(ids) for d, ids in self.pool.cached.items()}

    def cpu_digests(self) -> list[Digest]:
        return list(self.cpu)

    def disk_digests(self) -> list[Digest]:
        return list(self.disk)

    @property
    def used_blocks(self) -> int:
        return self.pool.size - len(self.pool.free)

    # -- one step ------------------------------------------------------------------------

    def step(self, workload: Workload, tick: int) -> list[SimEvent]:
        """Decode the running requests, finish those that are done, admit new ones."""
        events: list[SimEvent] = []
        for run in self.running:
            self._decode(run, events)
        for run in [r for r in self.running if r.done]:
            self.running.remove(run)
            self._finish(run, events)
            workload.finished(run.request, tick)
        self._admit(workload, tick, events)
        return events

    def _admit(self, workload: Workload, tick: int, events: list[SimEvent]) -> None:
        while len(self.running) < self.spec.max_running:
            request = (
                self.waiting[0]
                if self.waiting
                else workload.next_request(self.instance, self.index, tick)
            )
            if request is None:
                return
            if self.waiting:
                self.waiting.popleft()
            if self._blocks_for(len(request.tokens)) > self.pool.size:
                workload.refused(request)  # can never fit
                continue
            if not self._start(request, events):
                self.waiting.appendleft(request)  # not enough free blocks yet
                return
            workload.started(request, self.instance, tick)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.spec.block_size)

    def _start(self, request: Request, events: list[SimEvent]) -> bool:
        bs = self.spec.block_size
        tokens = request.tokens
        extend_chain(request.digests, tokens, bs, request.lora_name, request.salt)
        hits = self._hits(request.digests[: (len(tokens) - 1) // bs])
        pool = self.pool
        need = self._blocks_for(len(tokens)) - len(hits)
        if need > len(pool.free) - sum(1 for b in hits if pool.refs[b] == 0):
            return False
        for b in hits:
            if pool.refs[b] == 0:
                del pool.free[b]
            pool.refs[b] += 1
        blocks = hits + [self._allocate(events) for _ in range(need)]
        run = _Running(request, blocks, len(hits))
        self._cache_full(run, events)
        self.running.append(run)
        return True

    def _hits(self, digests: list[Digest]) -> list[int]:
        hits: list[int] = []
        for d in digests:
            ids = self.pool.cached.get(d)
            if not ids:
                break
            hits.append(ids[0])
        return hits

    def _allocate(self, events: list[SimEvent]) -> int:
        pool = self.pool
        b, _ = pool.free.popitem(last=False)
        d = pool.digest[b]
        if d is not None:  # a cached block is reused: its hash is evicted
            copies = pool.cached[d]
            copies.remove(b)
            if not copies:
                del pool.cached[d]
            pool.digest[b] = None
            events.append(Removed([d], GPU))
        pool.refs[b] = 1
        return b

    def _cache_full(self, run: _Running, events: list[SimEvent]) -> None:
        """Give the request's newly full blocks their hashes: one BlockStored."""
        request = run.request
        bs = self.spec.block_size
        full = len(request.tokens) // bs
        if full <= run.cached:
            return
        extend_chain(request.digests, request.tokens, bs, request.lora_name, request.salt)
        pool = self.pool
        start = run.cached
        for i in range(start, full):
            b = run.blocks[i]
            d = request.digests[i]
            pool.digest[b] = d
            pool.cached.setdefault(d, []).append(b)
        run.cached = full
        parent = request.digests[start - 1] if start else None
        tokens = request.tokens[start * bs : full * bs]
        digests = request.digests[start:full]
        events.append(Stored(digests, parent, tokens, request.lora, request.salt))

    def _decode(self, run: _Running, events: list[SimEvent]) -> None:
        request = run.request
        left = request.prompt_len + request.output_len - len(request.tokens)
        count = min(self.spec.decode_tokens, left)
        request.tokens.extend(self.rng.randrange(32_000) for _ in range(count))
        need = self._blocks_for(len(request.tokens))
        while len(run.blocks) < need:
            if not self.pool.free:  # no room: stop here (vLLM would preempt someone)
                del request.tokens[len(run.blocks) * self.spec.block_size :]
                run.done = True
                break
            run.blocks.append(self._allocate(events))
        self._cache_full(run, events)
        if len(request.tokens) >= request.prompt_len + request.output_len:
            run.done = True

    def _finish(self, run: _Running, events: list[SimEvent]) -> None:
        pool = self.pool
        for b in reversed(run.blocks):  # tail first: the last blocks are evicted first
            pool.refs[b] -= 1
            if pool.refs[b] == 0:
                pool.free[b] = None
        if self.spec.cpu_blocks:
            self._offload(run.request, run.cached, events)

    def _offload(self, request: Request, cached: int, events: list[SimEvent]) -> None:
        cpu = self.cpu
        first = max(0, cached - self.spec.cpu_blocks)
        new: list[Digest] = []
        pages: list[Page] = []
        for i in range(first, cached):
            d = request.digests[i]
            if d in cpu:
                cpu.move_to_end(d)
                continue
            page = self._page(request, i) if self.spec.page_tiers else None
            cpu[d] = page
            new.append(d)
            if page is not None:
                pages.append(page)
        evicted: list[tuple[Digest, Page | None]] = []
        while len(cpu) > self.spec.cpu_blocks:
            evicted.append(cpu.popitem(last=False))
        if new:
            events.append(Offloaded(new, CPU, pages if self.spec.page_tiers else None))
        if evicted:
            events.append(Removed([d for d, _ in evicted], CPU))
            if self.spec.disk_blocks:
                self._to_disk(evicted, events)

    def _page(self, request: Request, i: int) -> Page:
        bs = self.spec.block_size
        parent = request.digests[i - 1] if i else None
        return Page(parent, request.tokens[i * bs : (i + 1) * bs], request.lora, request.salt)

    def _to_disk(self, demoted: list[tuple[Digest, Page | None]], events: list[SimEvent]) -> None:
        """What the CPU tier evicted goes one tier down (HiCache's storage), LRU too."""
        disk = self.disk
        new: list[Digest] = []
        pages: list[Page] = []
        for d, page in demoted:
            if d in disk:
                disk.move_to_end(d)
                continue
            disk[d] = page
            new.append(d)
            if page is not None:
                pages.append(page)
        evicted = []
        while len(disk) > self.spec.disk_blocks:
            d, _ = disk.popitem(last=False)
            evicted.append(d)
        if new:
            events.append(Offloaded(new, DISK, pages if self.spec.page_tiers else None))
        if evicted:
            events.append(Removed(evicted, DISK))

    # -- incidents -----------------------------------------------------------------------

    def reset_prefix_cache(self) -> list[SimEvent]:
        """Preempt every running request (they wait to run again) and drop every hash."""
        for run in reversed(self.running):
            self.waiting.appendleft(run.request)  # it recomputes what it had, later
        self.running.clear()
        self.pool = _Pool(self.spec.gpu_blocks)
        self.cpu.clear()
        self.disk.clear()
        return [Cleared()]

    def restart(self) -> list[Request]:
        """A new engine process: nothing cached, nothing running. Returns the requests lost."""
        lost = [run.request for run in self.running] + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        self.pool = _Pool(self.spec.gpu_blocks)
        self.cpu.clear()
        self.disk.clear()
        return lost
