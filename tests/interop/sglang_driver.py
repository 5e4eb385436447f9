#!/usr/bin/env python3
"""Drive SGLang 0.5.23's real radix cache, KV-event recorder and ZMQ publisher on the CPU.

Run with the python of the venv made by ``scripts/sglang-venv.sh`` (never with the
project's own interpreter: this script imports SGLang and must not import kvindex).

One "engine" with ``--dp`` data-parallel ranks. Each rank owns a real
``sglang.srt.mem_cache.radix_cache.RadixCache`` (KV events enabled, page size
``--page-size``, EAGLE bigram keys with ``--bigram``) over a small token-slot allocator,
and a real ``ZmqEventPublisher`` made by SGLang's own ``EventPublisherFactory`` from a
``--kv-events-config`` JSON (PUB + replay ROUTER, ports offset by the rank as SGLang does).
A tiny scheduler loop mirrors what SGLang's scheduler does with the cache: match_prefix ->
lock -> allocate (evicting when the pool is full) -> insert the finished request's
page-aligned tokens -> free duplicate and partial-page slots -> unlock; after every step
the cache's ``take_events()`` go out as ``KVEventBatch(ts, events)`` (empty steps publish
nothing), exactly as ``SchedulerKvEventsPublisher.publish_kv_events`` does.

Workload (seeded): shared system prompts, multi-turn conversations, canned prompts that
arrive in every namespace (plain, ``cache_salt``, LoRA adapters, LoRA + salt, and a
caller ``extra_key``), several requests per step (so some inserts find their tokens
already cached), eviction pressure, ``--reset-at STEP`` on rank 0 (SGLang's
``RadixCache.reset()``: ``AllBlocksCleared``), and with ``--tiers`` the host/disk/external
media through the recorder's own ``record_store`` / ``record_remove`` with the medium as
HiCache passes it (a node is backed up after its parent, removed after its children;
splits carry the backup to both halves, as HiCache splits ``host_value``).

Late join: ``--solo-steps K`` runs K steps on the last rank alone, then prints
``{"event": "paused"}`` and waits for a line on stdin before running the rest on every
rank, so a subscriber started in between finds that rank's first batches only in the
replay buffer.

stdout: ``{"event": "ready", "ranks": [{"rank", "pub", "replay"}...]}`` once bound,
``{"event": "paused"}`` (with --solo-steps), ``{"event": "done", ...}`` once every batch is
sent and ``--out`` is written. The driver then keeps serving replays until stdin reaches
EOF (or a line ``quit``) or ``--linger`` seconds pass.

``--out`` JSON: see tests/interop/sglang.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import time
import uuid
from array import array
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

MEDIA = ("GPU", "CPU_PINNED", "DISK", "EXTERNAL")
SALTS = ("tenant-a", "tenant-b")
ADAPTERS = ("adapter-0", "adapter-1")
CALLER_EXTRA_KEY = "route-x"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="host the publishers bind")
    p.add_argument("--pub-base", type=int, default=0, help="PUB port of rank 0 (0: pick)")
    p.add_argument("--replay-base", type=int, default=0, help="replay port of rank 0 (0: pick)")
    p.add_argument("--topic", default="", help="ZMQ topic (SGLang's default is '')")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (one publisher each)")
    p.add_argument("--page-size", type=int, default=1, help="SGLang's page size (default 1)")
    p.add_argument("--bigram", action="store_true", help="EAGLE bigram keys (is_eagle)")
    p.add_argument("--format", choices=("default", "dynamo"), default="default")
    p.add_argument("--lora", action="store_true", help="LoRA adapters among the namespaces")
    p.add_argument("--no-salt", action="store_true", help="no cache_salt namespaces")
    p.add_argument("--tiers", action="store_true", help="host/disk/external media")
    p.add_argument(
        "--extra-key",
        action="store_true",
        help=f"requests with a caller extra_key ({CALLER_EXTRA_KEY!r}) among the namespaces",
    )
    p.add_argument("--steps", type=int, default=120, help="scheduler steps per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity", type=int, default=1024, help="KV slots (tokens) per rank")
    p.add_argument("--reset-at", type=int, default=None, metavar="STEP", help="reset rank 0")
    p.add_argument("--solo-steps", type=int, default=0, metavar="K", help="late-join pause")
    p.add_argument("--step-interval", type=float, default=0.0, help="seconds between steps")
    p.add_argument("--linger", type=float, default=600.0, help="max seconds to serve replays")
    p.add_argument("--out", required=True, help="where to write the reference JSON")
    a = p.parse_args(argv)
    if a.page_size < 1 or a.dp < 1 or a.capacity < 64 * a.page_size:
        p.error("need --page-size >= 1, --dp >= 1 and --capacity >= 64 pages")
    return a


ARGS = parse_args()
# SGLang's native page hash is a torch C++ extension: torch runs ninja (the venv's, from
# PyPI) on every load to see that it is up to date. The build stays inside the venv, where
# scripts/sglang-venv.sh made it.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch-extensions"))

import torch  # noqa: E402
from sglang.srt.disaggregation.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisherFactory,
    KVEventBatch,
    StorageMedium,
)
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.events import KVCacheEventRecorder, KvEventLoraNames  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.version import __version__ as SGLANG_VERSION  # noqa: E402

TIER_MEDIA = {
    "CPU_PINNED": StorageMedium.CPU,
    "DISK": StorageMedium.DISK,
    "EXTERNAL": StorageMedium.EXTERNAL,
}


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def medium_name(medium: Any) -> str:
    return medium.value if isinstance(medium, StorageMedium) else str(medium)


# --------------------------------------------------------------------------------------
# The KV pool: whole pages of token slots, as SGLang's paged allocator hands them out.
# --------------------------------------------------------------------------------------
class PageAllocator:
    """Token slots in pages of ``page_size``; the radix cache frees what it evicts."""

    device = "cpu"

    def __init__(self, capacity_tokens: int, page_size: int):
        self.page_size = page_size
        self.num_pages = capacity_tokens // page_size
        self.clear()

    def clear(self) -> None:
        self.free_pages = list(range(self.num_pages - 1, 0, -1))  # page 0 reserved
        self.used: set[int] = set()

    def available_tokens(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        pages = -(-num_tokens // self.page_size)
        if pages > len(self.free_pages):
            return None
        taken = [self.free_pages.pop() for _ in range(pages)]
        self.used.update(taken)
        slots = [p * self.page_size + i for p in taken for i in range(self.page_size)]
        return torch.tensor(slots[:num_tokens], dtype=torch.int64)

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        for page in sorted({int(s) // self.page_size for s in indices.tolist()}):
            if page not in self.used:
                raise AssertionError(f"page {page} freed twice")
            self.used.remove(page)
            self.free_pages.append(page)


# --------------------------------------------------------------------------------------
# The cache: SGLang's RadixCache, plus HiCache-style tier membership that follows splits.
# --------------------------------------------------------------------------------------
class TieredRadixCache(RadixCache):
    """RadixCache whose nodes can also be backed up on lower media.

    HiCache keeps a backed-up node's host copy per node and splits it with the node; the
    recorder then announces and removes pages per node. Here `tiers[medium]` is the set of
    nodes held on that medium, and a split puts both halves in every set the node was in.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.tiers: dict[str, set[Any]] = {m: set() for m in TIER_MEDIA}
        super().__init__(*args, **kwargs)

    def _split_node(self, key: Any, child: Any, split_len: int) -> Any:
        new_node = super()._split_node(key, child, split_len)
        for members in self.tiers.values():
            if child in members:
                members.add(new_node)
        return new_node

    def reset(self) -> None:
        for members in getattr(self, "tiers", {}).values():
            members.clear()
        super().reset()


def tree_nodes(cache: RadixCache) -> list[Any]:
    out, stack = [], list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


class Namespace:
    """What a request is cached under: SGLang's extra_key (caller key + LoRA id) and salt."""

    def __init__(self, salt: str | None, adapter: str | None, caller_key: str | None):
        self.salt = salt
        self.adapter = adapter
        self.caller_key = caller_key
        # Req: extra_key = (extra_key or "") + lora_id; lora ids are uuid hex (32 chars).
        lora_id = uuid.uuid5(uuid.NAMESPACE_URL, f"kvindex/{adapter}").hex if adapter else None
        self.lora_id = lora_id
        self.extra_key = ((caller_key or "") + lora_id) if lora_id else caller_key

    def label(self) -> str:
        parts = [f"salt={self.salt}"] if self.salt else []
        parts += [f"lora={self.adapter}"] if self.adapter else []
        parts += [f"extra_key={self.caller_key}"] if self.caller_key else []
        return ",".join(parts) or "plain"


PLAIN = Namespace(None, None, None)


class Rank:
    """One DP rank: its cache, allocator, publisher and event bookkeeping."""

    def __init__(self, rank: int, args: argparse.Namespace, config: str, names: KvEventLoraNames):
        self.rank = rank
        self.args = args
        self.alloc = PageAllocator(args.capacity, args.page_size)
        # What RadixCache.create_simulated builds, with our allocator and EAGLE flag.
        self.cache = TieredRadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=self.alloc,
                page_size=args.page_size,
                is_eagle=args.bigram,
                enable_kv_cache_events=True,
                dynamo_kv_event_format=args.format == "dynamo",
                kv_event_lora_names=names,
            )
        )
        self.publisher = EventPublisherFactory.create(config, attn_dp_rank=rank)
        self.published = 0
        self.mirror: Counter[tuple[str, int]] = Counter()  # (medium, hash) -> copies
        self.counts: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()
        self.examples: dict[str, Any] = {}

    # -- requests ------------------------------------------------------------------------
    def key(self, tokens: list[int], ns: Namespace) -> RadixKey:
        return RadixKey(
            array("q", tokens), ns.extra_key, is_bigram=self.args.bigram, cache_salt=ns.salt
        )

    def admit(self, tokens: list[int], ns: Namespace, rng: random.Random) -> dict | None:
        """match_prefix, lock, allocate the rest (evicting if needed)."""
        match = self.cache.match_prefix(MatchPrefixParams(key=self.key(tokens, ns)))
        prefix = match.device_prefix_len
        lock = self.cache.lock(match.last_device_node)
        output = [rng.randint(1000, 31999) for _ in range(rng.randint(3, 24))]
        full = tokens + output
        need = len(full) - prefix
        slots = self.alloc.alloc(need)
        if slots is None:
            short = need - self.alloc.available_tokens() + self.args.page_size
            self.cache.evict(EvictParams(num_tokens=short))
            self.stats["evictions"] += 1
            slots = self.alloc.alloc(need)
        if slots is None:
            self.cache.unlock(lock)
            self.stats["not_admitted"] += 1
            return None
        row = torch.cat([self.cache.path_device_indices(match.last_device_node)[:prefix], slots])
        self.stats["hit_tokens"] += prefix
        self.stats["prompt_tokens"] += len(tokens)
        return {"full": full, "ns": ns, "row": row, "lock": lock, "prefix": prefix}

    def finish(self, req: dict) -> None:
        """What cache_finished_req does: insert the computed tokens (the last sampled one
        has no KV yet), page-aligned; free duplicates and the partial page; unlock."""
        key = self.key(req["full"][:-1], req["ns"]).page_aligned(self.args.page_size)
        row = req["row"]
        res = self.cache.insert(InsertParams(key=key, value=row[: len(key)].clone()))
        if res.prefix_len > req["prefix"]:
            self.alloc.free_segment(row[req["prefix"] : res.prefix_len])
            self.stats["duplicate_tokens_freed"] += res.prefix_len - req["prefix"]
        if len(row) > len(key):
            self.alloc.free_segment(row[len(key) :])
        self.cache.unlock(req["lock"])

    def reset(self) -> None:
        self.cache.reset()  # SGLang's flush_cache: the tree (AllBlocksCleared) and the pool
        self.alloc.clear()
        self.stats["resets"] += 1

    # -- lower media -----------------------------------------------------------------------
    def node_hashes(self, node: Any) -> list[int]:
        """The page hashes the recorder announces for `node` (SGLang's own code, on a
        scratch recorder sharing the cache's settings)."""
        scratch = KVCacheEventRecorder(
            enabled=True,
            page_size=self.args.page_size,
            dynamo_format=self.args.format == "dynamo",
            lora_names=self.cache.kv_events.lora_names,
        )
        scratch.record_remove(node)
        return [h for ev in scratch.take() for h in ev.block_hashes]

    def tier_step(self, rng: random.Random) -> None:
        medium = rng.choices(list(TIER_MEDIA), weights=(6, 3, 2))[0]
        members = self.cache.tiers[medium]
        if members and rng.random() < 0.35:
            leaves = [n for n in members if not any(m.parent is n for m in members)]
            node = rng.choice(sorted(leaves, key=lambda n: n.id))
            self.cache.kv_events.record_remove(node, medium=TIER_MEDIA[medium])
            members.discard(node)
            self.stats[f"tier_remove_{medium}"] += 1
            return
        held = {h for n in members for h in self.node_hashes(n)}
        root = self.cache.root_node
        candidates = [
            n
            for n in tree_nodes(self.cache)
            if n not in members
            and (n.parent is root or n.parent in members)
            and not held.intersection(self.node_hashes(n))
        ]
        if candidates:
            node = rng.choice(sorted(candidates, key=lambda n: n.id))
            self.cache.kv_events.record_store(node, medium=TIER_MEDIA[medium])
            members.add(node)
            self.stats[f"tier_store_{medium}"] += 1

    # -- events ---------------------------------------------------------------------------
    def publish(self) -> None:
        events = self.cache.take_events()
        if not events:
            return
        self.account(events)
        self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
        self.published += 1

    def account(self, events: list[Any]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                medium = medium_name(ev.medium)
                self.counts["BlockStored"] += 1
                self.counts["BlockStored_pages"] += len(ev.block_hashes)
                for h in ev.block_hashes:
                    self.mirror[(medium, h)] += 1
                self._example(ev, medium)
            elif isinstance(ev, BlockRemoved):
                medium = medium_name(ev.medium)
                self.counts["BlockRemoved"] += 1
                self.counts["BlockRemoved_pages"] += len(ev.block_hashes)
                for h in ev.block_hashes:
                    self.mirror[(medium, h)] -= 1
                    if self.mirror[(medium, h)] == 0:
                        del self.mirror[(medium, h)]
                self._example(ev, medium)
            elif isinstance(ev, AllBlocksCleared):
                self.counts["AllBlocksCleared"] += 1
                self.mirror.clear()
            else:
                self.counts["unknown:" + type(ev).__name__] += 1

    def _example(self, ev: Any, medium: str) -> None:
        kind = type(ev).__name__
        tags = [kind, medium]
        if isinstance(ev, BlockStored):
            tags += ["salt"] if ev.cache_salt else []
            tags += ["lora"] if ev.lora_name else []
            tags += ["root"] if ev.parent_block_hash is None else ["child"]
        else:
            tags += ["several"] if len(ev.block_hashes) > 1 else ["one"]
        self.examples.setdefault(":".join(tags), ev)

    # -- what SGLang holds ------------------------------------------------------------------
    def held(self) -> dict[str, Counter[int]]:
        held: dict[str, Counter[int]] = {m: Counter() for m in MEDIA}
        for node in tree_nodes(self.cache):
            held["GPU"].update(self.node_hashes(node))
        for medium, members in self.cache.tiers.items():
            for node in members:
                held[medium].update(self.node_hashes(node))
        return held


# --------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------
class Workload:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        ps = args.page_size
        unit = max(ps, 16)
        self.systems = [self.tokens(self.rng.randint(2, 6) * unit + i * 3) for i in range(4)]
        self.canned = [s + self.tokens(self.rng.randint(5, 2 * unit)) for s in self.systems[:3]]
        self.namespaces = [PLAIN]
        if not args.no_salt:
            self.namespaces += [Namespace(SALTS[0], None, None), Namespace(SALTS[1], None, None)]
        if args.lora:
            self.namespaces += [
                Namespace(None, ADAPTERS[0], None),
                Namespace(None, ADAPTERS[1], None),
            ]
        if args.lora and not args.no_salt:
            self.namespaces.append(Namespace(SALTS[0], ADAPTERS[0], None))
        if args.extra_key:
            self.namespaces.append(Namespace(None, None, CALLER_EXTRA_KEY))
        self.max_tokens = args.capacity // 3
        # Per rank: conversations (history, namespace) and finished requests.
        self.conversations: dict[int, list[list[Any]]] = {r: [] for r in range(args.dp)}
        self.finished: dict[int, list[tuple[list[int], Namespace]]] = {
            r: [] for r in range(args.dp)
        }

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randint(1000, 31999) for _ in range(n)]

    def namespace(self) -> Namespace:
        # Plain traffic dominates, as in a real fleet; every namespace shows up.
        return self.rng.choices(self.namespaces, weights=[6] + [2] * (len(self.namespaces) - 1))[0]

    def arrivals(self, rank: int) -> list[tuple[list[int], Namespace, list[Any] | None]]:
        out = []
        convs = self.conversations[rank]
        for _ in range(self.rng.randint(1, 3)):
            x = self.rng.random()
            ready = [c for c in convs if c[2] > 0]
            if ready and x < 0.45:
                conv = self.rng.choice(ready)
                conv[2] -= 1
                out.append((conv[0] + self.tokens(self.rng.randint(4, 30)), conv[1], conv))
            elif x < 0.8:
                out.append((list(self.rng.choice(self.canned)), self.namespace(), None))
            else:
                system = self.systems[min(int(self.rng.paretovariate(1.3)) - 1, 3)]
                conv = [system, self.namespace(), self.rng.randint(1, 4)]
                convs.append(conv)
                out.append((system + self.tokens(self.rng.randint(4, 40)), conv[1], conv))
        return [a for a in out if len(a[0]) + 40 <= self.max_tokens]


def run_step(rank: Rank, wl: Workload, step: int) -> None:
    if rank.rank == 0 and wl.args.reset_at is not None and step == wl.args.reset_at:
        rank.reset()
    admitted = []
    for tokens, ns, conv in wl.arrivals(rank.rank):
        req = rank.admit(tokens, ns, wl.rng)
        if req is not None:
            admitted.append((req, conv))
    for req, conv in admitted:  # a batch of requests finishing in one step
        rank.finish(req)
        wl.finished[rank.rank].append((req["full"], req["ns"]))
        if conv is not None:
            conv[0] = req["full"]
    if wl.args.tiers and wl.rng.random() < 0.5:
        rank.tier_step(wl.rng)
    rank.publish()


# --------------------------------------------------------------------------------------
# Probes: SGLang's own match_prefix on fresh keys, and the probe's own page hashes.
# --------------------------------------------------------------------------------------
def page_hashes(
    args: argparse.Namespace, names: KvEventLoraNames, tokens: list[int], ns: Namespace
) -> list[int]:
    """The hashes SGLang announces for this prompt's pages (a scratch cache inserts it)."""
    scratch = RadixCache.create_simulated(
        page_size=args.page_size,
        enable_kv_cache_events=True,
        dynamo_kv_event_format=args.format == "dynamo",
        kv_event_lora_names=names,
    )
    scratch.is_eagle = args.bigram
    key = RadixKey(array("q", tokens), ns.extra_key, is_bigram=args.bigram, cache_salt=ns.salt)
    scratch.insert(InsertParams(key=key))
    return [
        h for ev in scratch.take_events() if isinstance(ev, BlockStored) for h in ev.block_hashes
    ]


def probe_candidates(
    wl: Workload, ranks: list[Rank]
) -> list[tuple[str, str, list[int], Namespace]]:
    """(scenario, name, tokens, namespace) for each probe."""
    salted = Namespace(SALTS[0], None, None)
    cand: list[tuple[str, str, list[int], Namespace]] = []
    for i, s in enumerate(wl.systems):
        cand.append(("plain", f"system-{i}", s, PLAIN))
        if not wl.args.no_salt:
            cand.append(("salted", f"system-{i}+{SALTS[0]}", s, salted))
    for i, c in enumerate(wl.canned):
        for ns in wl.namespaces:
            scenario = scenario_of(ns)
            cand.append((scenario, f"canned-{i}[{ns.label()}]", c, ns))
    for r in range(len(ranks)):
        for j, (toks, ns) in enumerate(wl.finished[r][-6:]):
            name = f"rank{r}-recent-{j}[{ns.label()}]"
            cand.append((scenario_of(ns), name, toks, ns))
            if ns is not PLAIN:
                cand.append((scenario_of(ns) + "-asked-plain", name + "-asked-plain", toks, PLAIN))
            if ns.salt:
                other = SALTS[1] if ns.salt == SALTS[0] else SALTS[0]
                wrong = Namespace(other, ns.adapter, ns.caller_key)
                cand.append(("salted-wrong-salt", name + f"-asked-{other}", toks, wrong))
            if len(toks) > 3 * wl.args.page_size:
                t = list(toks)
                t[wl.args.page_size + 1] = 7  # diverges in the second page
                cand.append(("diverged", name + "-diverged", t, ns))
    for r, rank in enumerate(ranks):  # prompts whose pages sit on lower media
        for medium, members in sorted(rank.cache.tiers.items()):
            deepest = sorted(members, key=lambda n: (-depth(n), n.id))[:2]
            for k, node in enumerate(deepest):
                toks, ns = path_tokens(node, wl.args.bigram)
                cand.append(("tier", f"rank{r}-{medium}-{k}[{ns.label()}]", toks, ns))
    cand.append(("unseen", "unseen", wl.tokens(5 * max(wl.args.page_size, 8) + 3), PLAIN))
    return cand


def scenario_of(ns: Namespace) -> str:
    if ns.caller_key:
        return "extra-key"
    if ns.adapter and ns.salt:
        return "lora-salted"
    if ns.adapter:
        return "lora"
    return "salted" if ns.salt else "plain"


def depth(node: Any) -> int:
    d = 0
    while node.parent is not None:
        d, node = d + 1, node.parent
    return d


def path_tokens(node: Any, bigram: bool) -> tuple[list[int], Namespace]:
    """The raw tokens from the root to `node` (and its namespace)."""
    parts = []
    key = node.key
    while node.parent is not None:
        parts.append(list(node.key.token_ids[: node.key._raw_len()]))
        node = node.parent
    tokens: list[int] = []
    for part in reversed(parts):
        # Bigram slices share a boundary token with the next slice.
        tokens = tokens[:-1] + part if bigram and tokens else tokens + part
    ns = Namespace(key.cache_salt, None, None)
    ns.extra_key = key.extra_key
    ns.adapter = next(
        (
            a
            for a in ADAPTERS
            if key.extra_key
            and key.extra_key.endswith(uuid.uuid5(uuid.NAMESPACE_URL, f"kvindex/{a}").hex)
        ),
        None,
    )
    ns.caller_key = (
        CALLER_EXTRA_KEY if key.extra_key and key.extra_key.startswith(CALLER_EXTRA_KEY) else None
    )
    return tokens, ns


def probes(
    args: argparse.Namespace,
    wl: Workload,
    ranks: list[Rank],
    names: KvEventLoraNames,
    held: dict[int, dict[str, Counter[int]]],
) -> list[dict[str, Any]]:
    out = []
    unit = "bigram" if args.bigram else "token"
    for scenario, name, toks, ns in probe_candidates(wl, ranks):
        hashes = page_hashes(args, names, toks, ns)
        per_rank = {}
        for rank in ranks:
            key = rank.key(toks, ns)
            matched = rank.cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len
            pages = matched // args.page_size
            gpu = held[rank.rank]["GPU"]
            runs = {m: leading(hashes, held[rank.rank][m]) for m in MEDIA}
            lower = [held[rank.rank][m] for m in TIER_MEDIA]
            reuse = pages + leading(hashes[pages:], set().union(*lower))
            per_rank[str(rank.rank)] = {
                "match_prefix_units": matched,
                "match_prefix_pages": pages,
                "gpu_run_pages": leading(hashes, gpu),
                "runs_by_medium": runs,
                "reuse_pages": reuse,
            }
        out.append(
            {
                "scenario": scenario,
                "name": name,
                "token_ids": toks,
                "cache_salt": ns.salt,
                "lora_name": ns.adapter,
                "extra_key": ns.caller_key,
                "unit": unit,
                "page_hashes": hashes,
                "ranks": per_rank,
            }
        )
    return out


def leading(hashes: list[int], held: Any) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------
def free_base(host: str, count: int, avoid: set[int]) -> int:
    """A port p with p .. p+count-1 all free now (SGLang puts rank r at base + r)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + count > 65535 or avoid & set(range(base, base + count)):
            continue
        try:
            socks = []
            for port in range(base, base + count):
                t = socket.socket()
                socks.append(t)
                t.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port range")


def kv_events_config(args: argparse.Namespace) -> str:
    pub = args.pub_base or free_base(args.host, args.dp, set())
    replay = args.replay_base or free_base(args.host, args.dp, set(range(pub, pub + args.dp)))
    return json.dumps(
        {
            "publisher": "zmq",
            "endpoint": f"tcp://{args.host}:{pub}",
            "replay_endpoint": f"tcp://{args.host}:{replay}",
            "bind": True,  # a concrete loopback address, bound (SGLang's `bind` option)
            "topic": args.topic,
            "buffer_steps": 10_000,
            "format": args.format,
        }
    )


def server_info_kv_events(args: argparse.Namespace, config: str) -> dict[str, Any]:
    """`/server_info`'s `kv_events` for this config and, for contrast, for the usual
    wildcard config with the load stream on (`--load-publish-endpoint auto`), both from
    SGLang's own `describe_kv_events_publisher`."""
    from sglang.srt.runtime_context import describe_kv_events_publisher
    from sglang.srt.server_args import ServerArgs

    def describe(cfg: str, load: str | None) -> Any:
        sa = ServerArgs(
            model_path="dummy",
            kv_events_config=cfg,
            page_size=args.page_size,
            dp_size=args.dp,
            load_publish_endpoint=load,
            device="cpu",
        )
        return describe_kv_events_publisher(sa)

    wildcard = json.dumps(
        {
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "topic": args.topic,
        }
    )
    return {"this_run": describe(config, None), "wildcard_with_load": describe(wildcard, "auto")}


def event_json(ev: Any) -> Any:
    import msgspec

    return msgspec.msgpack.decode(msgspec.msgpack.encode(ev))


def wait_drained(ranks: list[Rank], timeout: float = 30.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(r.publisher._event_queue.unfinished_tasks == 0 for r in ranks):
            return True
        time.sleep(0.01)
    return False


def bound(rank: Rank) -> dict[str, Any]:
    pub = rank.publisher
    return {"rank": rank.rank, "pub": pub._local_pub_endpoint, "replay": pub._local_replay_endpoint}


def linger(seconds: float) -> None:
    import select

    deadline = time.time() + seconds
    while time.time() < deadline:
        ready, _, _ = select.select([sys.stdin], [], [], 0.5)
        if ready:
            line = sys.stdin.readline()
            if not line or line.strip() == "quit":
                return


def main() -> int:
    args = ARGS
    config = kv_events_config(args)
    names = KvEventLoraNames()
    for adapter in ADAPTERS:  # what the scheduler does when a request names its adapter
        ns = Namespace(None, adapter, None)
        names.register(SimpleNamespace(lora_id=ns.lora_id, extra_key=ns.extra_key), adapter)
        names.register(lora_id=ns.lora_id, lora_name=adapter)  # load-time registration
    ranks = [Rank(r, args, config, names) for r in range(args.dp)]
    wl = Workload(args)
    emit({"event": "ready", "ranks": [bound(r) for r in ranks], "pid": os.getpid()})
    t0 = time.time()
    try:
        late = ranks[-1]
        for step in range(args.solo_steps):
            run_step(late, wl, step)
        if args.solo_steps:
            wait_drained(ranks)
            emit({"event": "paused", "published": late.published})
            sys.stdin.readline()
        for step in range(args.steps):
            for rank in ranks:
                if rank is late and step < args.solo_steps:
                    continue
                run_step(rank, wl, step)
            if args.step_interval:
                time.sleep(args.step_interval)
        drained = wait_drained(ranks)
        held = {r.rank: r.held() for r in ranks}
        out = {
            "sglang_version": SGLANG_VERSION,
            "engine": {
                "page_size": args.page_size,
                "bigram": args.bigram,
                "format": args.format,
                "dp": args.dp,
                "lora": args.lora,
                "salts": [] if args.no_salt else list(SALTS),
                "tiers": args.tiers,
                "extra_key": CALLER_EXTRA_KEY if args.extra_key else None,
                "topic": args.topic,
                "seed": args.seed,
                "steps": args.steps,
                "capacity_tokens": args.capacity,
                "reset_at": args.reset_at,
                "solo_steps": args.solo_steps,
                "lora_names": {
                    ADAPTERS[i]: Namespace(None, a, None).lora_id for i, a in enumerate(ADAPTERS)
                },
            },
            "kv_events_config": json.loads(config),
            "server_info_kv_events": server_info_kv_events(args, config),
            "drained": drained,
            "ranks": {
                str(r.rank): {
                    "endpoints": bound(r),
                    "published_batches": r.published,
                    "last_seq": r.published - 1,
                    "event_counts": dict(r.counts),
                    "workload": dict(r.stats),
                    "held": {m: sorted(c.items()) for m, c in held[r.rank].items()},
                    "events_self_check": self_check(r, held[r.rank]),
                }
                for r in ranks
            },
            "examples": {k: event_json(v) for r in ranks for k, v in sorted(r.examples.items())},
            "probes": probes(args, wl, ranks, names, held),
            "run_seconds": round(time.time() - t0, 2),
        }
        path = Path(args.out)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1) + "\n")
        os.replace(tmp, path)
        emit(
            {
                "event": "done",
                "published": {str(r.rank): r.published for r in ranks},
                "out": str(path),
            }
        )
        linger(args.linger)
    finally:
        for r in ranks:
            r.publisher.shutdown()
    return 0


def self_check(rank: Rank, held: dict[str, Counter[int]]) -> dict[str, Any]:
    """The events, replayed in-process (stores - removes per medium and hash), must equal
    what the cache holds."""
    from_events: dict[tuple[str, int], int] = dict(rank.mirror)
    from_cache = {(m, h): c for m, counter in held.items() for h, c in counter.items()}
    bad = sorted(
        (
            {
                "medium": m,
                "hash": h,
                "cache": from_cache.get((m, h), 0),
                "events": from_events.get((m, h), 0),
            }
            for (m, h) in set(from_events) | set(from_cache)
            if from_events.get((m, h), 0) != from_cache.get((m, h), 0)
        ),
        key=lambda d: (d["medium"], d["hash"]),
    )
    return {"ok": not bad, "mismatches": bad[:20]}


if __name__ == "__main__":
    sys.exit(main())
