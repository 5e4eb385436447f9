#!/usr/bin/env python3
"""Drive vLLM 0.33.0's real KV-cache manager and ZMQ event publisher on the CPU.

Run with the python of the venv made by ``scripts/vllm-venv.sh`` (never with the
project's own interpreter: this script imports vLLM and must not import kvindex).

It builds a real ``vllm.v1.core.kv_cache_manager.KVCacheManager`` (one full
attention KV-cache group, ``enable_kv_cache_events=True``) and runs a seeded,
multi-turn chat workload through it with a tiny scheduler loop that mirrors
vLLM's v1 scheduler (get_computed_blocks -> allocate_slots -> advance
num_computed_tokens -> append a sampled token -> free when finished; chunked
prefill under a token budget; preemption when the pool is full). After every
step the manager's ``take_events()`` are wrapped in
``KVEventBatch(ts=time.time(), events=...)`` and handed to the real
``vllm.distributed.kv_events.ZmqEventPublisher`` exactly as vLLM's scheduler
does (empty steps publish nothing).

Endpoints: vLLM binds an endpoint only when it contains ``*`` (``tcp://*:5557``)
and *connects* otherwise. For tests the driver binds the PUB socket on the
endpoint as given (``tcp://127.0.0.1:PORT``, port 0 allowed) unless
``--pub-connect`` is passed; the replay ROUTER is always bound (as in vLLM). The
actual endpoints are printed on stdout as a JSON line
``{"event": "ready", "pub": ..., "replay": ...}`` once bound, and
``{"event": "done", ...}`` after the last batch has been sent and --out written.

``--drop-rate P`` wraps the publisher's PUB socket so that a share P of the
live sends is silently skipped (seeded); the replay buffer still holds those
batches. Their seqs are listed in the output as ``dropped_seqs``.

The JSON written to --out holds the reference state read from the block pool
after the last step (see README.md next to this file).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter, deque
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pub", required=True, help="PUB endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--replay", required=True, help="ROUTER replay endpoint")
    p.add_argument(
        "--pub-connect",
        action="store_true",
        help="connect the PUB socket (vLLM's own rule for endpoints "
        "without '*') instead of binding it",
    )
    p.add_argument("--topic", default="", help="ZMQ topic (vLLM's default is '')")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-blocks", type=int, default=64, help="blocks in the pool, incl. vLLM's null block"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--token-budget",
        type=int,
        default=256,
        help="max tokens scheduled per step (chunked prefill)",
    )
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument(
        "--drop-rate",
        type=float,
        default=0.0,
        help="share of live PUB sends to drop silently (replay keeps them)",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="give some conversations a LoRA adapter (lora_name in events)",
    )
    p.add_argument(
        "--reset-at",
        type=int,
        default=None,
        metavar="STEP",
        help="at this step preempt all running requests and call "
        "reset_prefix_cache() (AllBlocksCleared)",
    )
    p.add_argument(
        "--hash-mode",
        choices=("int", "bytes"),
        default="int",
        help="int: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (vLLM's default); "
        "bytes: =0, raw digests on the wire (rendered as hex in --out)",
    )
    p.add_argument("--buffer-steps", type=int, default=10_000)
    p.add_argument(
        "--start-delay",
        type=float,
        default=0.0,
        help="seconds to sleep after binding, before the first step",
    )
    p.add_argument(
        "--step-interval", type=float, default=0.0, help="seconds to sleep between steps"
    )
    p.add_argument(
        "--linger",
        type=float,
        default=0.0,
        help="seconds to keep the publisher (and replay) alive at the end",
    )
    p.add_argument("--out", required=True, help="where to write the reference JSON")
    a = p.parse_args(argv)
    if not 0.0 <= a.drop_rate <= 1.0:
        p.error("--drop-rate must be within [0, 1]")
    if a.num_blocks < 4:
        p.error("--num-blocks must be at least 4")
    return a


ARGS = parse_args()
# Must be set before vLLM reads its environment.
os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if ARGS.hash_mode == "int" else "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_pub import DriverPublisher, wait_drained  # noqa: E402


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def render_hash(h):
    """A hash as it goes on the wire, made JSON-safe (bytes -> hex)."""
    return h.hex() if isinstance(h, (bytes, bytearray)) else h


# --------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------
class Conversation:
    def __init__(self, cid: int, system: list[int], lora: LoRARequest | None, turns: int):
        self.cid = cid
        self.history: list[int] = list(system)  # tokens of everything so far
        self.lora = lora
        self.turns_left = turns
        self.ready_at = 0  # step at which the next turn may arrive


class Driver:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        bs = args.block_size
        self.bs = bs
        self.max_model_len = (args.num_blocks - 1) * bs
        # Longest request we let a conversation reach: leaves room for others.
        self.max_request_tokens = max(2 * bs, (args.num_blocks - 1) * bs // 2)

        # The engine's own setup: sha256 (vLLM's default prefix_caching_hash_algo)
        # with NONE_HASH initialised from it, and the request block hasher.
        self.hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(self.hash_fn)
        self.block_hasher = get_request_block_hasher(bs, self.hash_fn)

        config = KVCacheConfig(
            num_blocks=args.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"],
                    FullAttentionSpec(
                        block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32
                    ),
                )
            ],
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=self.max_model_len,
            scheduler_block_size=bs,
            hash_block_size=bs,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.pool = self.manager.block_pool

        # Shared system prompts; some block-aligned so that identical prompts
        # recompute their last block (the prefix hit stops at num_tokens - 1)
        # and create duplicate physical copies of one hash.
        self.systems: list[list[int]] = []
        for i in range(4):
            n = self.rng.randint(2, 5) * bs + (0 if i % 2 == 0 else self.rng.randint(1, bs - 1))
            self.systems.append(self._tokens(n))
        # A few canned, block-aligned "popular questions" per system prompt.
        self.canned: list[list[int]] = []
        for s in self.systems:
            q = self._tokens(self.rng.randint(4, 30))
            full = s + q
            pad = (-len(full)) % bs
            self.canned.append(full + self._tokens(pad))
        self.loras = (
            [
                LoRARequest(
                    lora_name=f"adapter-{i}",
                    lora_int_id=i + 1,
                    lora_path=f"/nonexistent/adapter-{i}",
                )
                for i in range(2)
            ]
            if args.lora
            else []
        )

        self.conversations: list[Conversation] = []
        self.next_cid = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.owner: dict[str, Conversation | None] = {}
        self.max_tokens: dict[str, int] = {}
        self.next_rid = 0
        self.finished_histories: list[tuple[list[int], LoRARequest | None]] = []
        self.stats = Counter()

        # Events, mirrored in-process for a self-check (refcount per hash copy).
        self.event_counts = Counter()
        self.mirror: Counter = Counter()  # (group, wire hash) -> copies
        self.max_copies = 0

    # -- helpers ----------------------------------------------------------
    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randint(1000, 31999) for _ in range(n)]

    def _request(
        self, tokens: list[int], lora: LoRARequest | None, max_tokens: int, rid: str | None = None
    ) -> Request:
        if rid is None:
            rid = f"req-{self.next_rid}"
            self.next_rid += 1
        sp = SamplingParams(max_tokens=max_tokens)
        sp.update_from_generation_config({}, eos_token_id=2)
        return Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=sp,
            pooling_params=None,
            lora_request=lora,
            block_hasher=self.block_hasher,
        )

    def _submit(self, tokens, lora, conv) -> None:
        out = self.rng.randint(3, 40)
        if len(tokens) + out > self.max_request_tokens:
            if conv is not None:
                conv.turns_left = 0
            self.stats["skipped_too_long"] += 1
            return
        req = self._request(tokens, lora, out)
        self.owner[req.request_id] = conv
        self.max_tokens[req.request_id] = out
        self.waiting.append(req)
        self.stats["submitted"] += 1

    def arrivals(self, step: int) -> None:
        busy = {
            id(self.owner[r.request_id])
            for r in list(self.waiting) + self.running
            if self.owner[r.request_id] is not None
        }
        want = self.args.max_running + 2 - len(self.waiting) - len(self.running)
        for _ in range(max(0, min(want, self.rng.randint(0, 3)))):
            x = self.rng.random()
            ready = [
                c
                for c in self.conversations
                if c.turns_left > 0 and c.ready_at <= step and id(c) not in busy
            ]
            if ready and x < 0.55:
                conv = self.rng.choice(ready)
                conv.turns_left -= 1
                busy.add(id(conv))
                self._submit(conv.history + self._tokens(self.rng.randint(8, 40)), conv.lora, conv)
                self.stats["next_turns"] += 1
            elif x < 0.85:
                i = self.rng.randrange(len(self.canned))
                lora = (
                    self.rng.choice(self.loras) if self.loras and self.rng.random() < 0.3 else None
                )
                self._submit(self.canned[i], lora, None)
                self.stats["canned"] += 1
            else:
                # New conversation on a (Zipf-ish) popular system prompt.
                i = min(int(self.rng.paretovariate(1.2)) - 1, len(self.systems) - 1)
                lora = (
                    self.rng.choice(self.loras) if self.loras and self.rng.random() < 0.3 else None
                )
                conv = Conversation(self.next_cid, self.systems[i], lora, self.rng.randint(1, 5))
                self.next_cid += 1
                self.conversations.append(conv)
                conv.turns_left -= 1
                busy.add(id(conv))
                self._submit(conv.history + self._tokens(self.rng.randint(8, 60)), lora, conv)
                self.stats["new_conversations"] += 1

    def preempt(self, req: Request) -> None:
        self.manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.stats["preemptions"] += 1

    def finish(self, req: Request) -> None:
        self.manager.free(req)
        self.running.remove(req)
        conv = self.owner.pop(req.request_id)
        self.max_tokens.pop(req.request_id)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        toks = list(req.all_token_ids)
        self.finished_histories.append((toks, req.lora_request))
        if conv is not None:
            conv.history = toks
            conv.ready_at = self.step_no + self.rng.randint(1, 6)
        self.stats["finished"] += 1

    def schedule(self) -> list[tuple[Request, int]]:
        """One scheduler step; returns (request, tokens scheduled)."""
        budget = self.args.token_budget
        scheduled: list[tuple[Request, int]] = []
        # Running requests first (decode or the rest of a chunked prefill).
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while True:
                if self.manager.allocate_slots(req, n) is not None:
                    scheduled.append((req, n))
                    budget -= n
                    i += 1
                    break
                # Out of blocks: preempt the most recent request (vLLM's FCFS rule).
                victim = self.running.pop()
                self.preempt(victim)
                if victim is req:
                    break
        # Then waiting requests, FCFS, while blocks and budget last.
        while self.waiting and budget > 0 and len(self.running) < self.args.max_running:
            req = self.waiting[0]
            blocks, num_hit, _ = self.manager.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            if self.manager.allocate_slots(req, n, num_hit, blocks) is None:
                if not self.running and not scheduled:
                    # Cannot ever fit: drop it rather than stall.
                    self.waiting.popleft()
                    self.owner.pop(req.request_id, None)
                    self.stats["dropped_unschedulable"] += 1
                    continue
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            self.stats["prefix_hit_tokens"] += num_hit
            self.stats["prompt_tokens"] += req.num_tokens
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        return scheduled

    def after_step(self, scheduled) -> None:
        for req, n in scheduled:
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                # The model "samples" one token.
                req.append_output_token_ids(self.rng.randint(1000, 31999))
                if len(req.output_token_ids) >= self.max_tokens[req.request_id]:
                    self.finish(req)

    def reset(self) -> bool:
        # What Scheduler.reset_prefix_cache(reset_running_requests=True) does.
        while self.running:
            self.preempt(self.running.pop())
        ok = self.manager.reset_prefix_cache()
        self.stats["resets_ok" if ok else "resets_failed"] += 1
        return ok

    # -- events -------------------------------------------------------------
    def account(self, events) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self.event_counts["BlockStored"] += 1
                self.event_counts["BlockStored_hashes"] += len(ev.block_hashes)
                for h in ev.block_hashes:
                    key = (ev.group_idx or 0, render_hash(h))
                    if self.mirror[key] > 0:
                        self.event_counts["BlockStored_duplicate_copies"] += 1
                    self.mirror[key] += 1
                    self.max_copies = max(self.max_copies, self.mirror[key])
                if ev.lora_name is not None:
                    self.event_counts["BlockStored_with_lora"] += 1
            elif isinstance(ev, BlockRemoved):
                self.event_counts["BlockRemoved"] += 1
                self.event_counts["BlockRemoved_hashes"] += len(ev.block_hashes)
                for h in ev.block_hashes:
                    key = (ev.group_idx or 0, render_hash(h))
                    self.mirror[key] -= 1
                    if self.mirror[key] > 0:
                        self.event_counts["BlockRemoved_other_copy_left"] += 1
                    if self.mirror[key] <= 0:
                        del self.mirror[key]
            elif isinstance(ev, AllBlocksCleared):
                self.event_counts["AllBlocksCleared"] += 1
                self.mirror.clear()
            else:
                self.event_counts["unknown:" + type(ev).__name__] += 1

    # -- reference state ------------------------------------------------------
    def reference(self) -> dict:
        """Read the prefix cache straight out of vLLM's block pool."""
        copies: Counter = Counter()
        # BlockHashToBlockMap._cache: {key: KVCacheBlock | {block_id: KVCacheBlock}}
        for key, blocks in self.pool.cached_block_hash_to_block._cache.items():
            n = len(blocks) if isinstance(blocks, dict) else 1
            wire = render_hash(maybe_convert_block_hash(get_block_hash(key)))
            copies[(get_group_id(key), wire)] += n
        cached = [
            {"hash": h, "group": g, "copies": c}
            for (g, h), c in sorted(copies.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))
        ]
        mism = sorted(
            (
                {
                    "group": g,
                    "hash": h,
                    "pool": copies.get((g, h), 0),
                    "events": self.mirror.get((g, h), 0),
                }
                for (g, h) in set(copies) | set(self.mirror)
                if copies.get((g, h), 0) != self.mirror.get((g, h), 0)
            ),
            key=lambda d: str(d["hash"]),
        )
        return {
            "cached_hashes": sorted({h for (_, h) in copies}, key=str),
            "cached_blocks": cached,
            "num_cached_hashes": len(copies),
            "num_cached_copies": sum(copies.values()),
            "hashes_with_several_copies": sum(1 for c in copies.values() if c > 1),
            "events_self_check": {"ok": not mism, "mismatches": mism[:20]},
        }

    def probes(self) -> list[dict]:
        cand: list[tuple[str, list[int], LoRARequest | None]] = []
        for i, s in enumerate(self.systems):
            cand.append((f"system-{i}", s, None))
        for i, c in enumerate(self.canned[:2]):
            cand.append((f"canned-{i}", c, None))
        for j, (toks, lora) in enumerate(self.finished_histories[-4:]):
            cand.append((f"recent-history-{j}", toks, lora))
            if len(toks) > 2 * self.bs:
                # Same prompt with one token changed in its second block.
                t = list(toks)
                t[self.bs + 3] = 7
                cand.append((f"recent-history-{j}-diverged-block-1", t, lora))
        for j, req in enumerate(self.running[:2]):
            cand.append((f"running-{j}", list(req.all_token_ids), req.lora_request))
        if self.loras:
            cand.append(("system-0-with-lora", self.systems[0], self.loras[0]))
        cand.append(("unseen", self._tokens(5 * self.bs + 3), None))
        out = []
        for k, (name, toks, lora) in enumerate(cand):
            req = self._request(toks, lora, 1, rid=f"probe-{k}")
            hashes = list(req.block_hashes)  # vLLM's own hashes for this prompt
            n = 0
            for h in hashes:
                if self.pool.get_cached_block(h, [0]) is None:
                    break
                n += 1
            out.append(
                {
                    "name": name,
                    "lora_name": lora.lora_name if lora else None,
                    "token_ids": list(toks),
                    "block_hashes": [render_hash(maybe_convert_block_hash(h)) for h in hashes],
                    "num_cached_blocks": n,
                }
            )
        return out

    # -- main loop ------------------------------------------------------------
    def run(self, publisher: DriverPublisher) -> dict:
        published = 0
        reset_info = None
        t0 = time.time()
        for step in range(self.args.steps):
            self.step_no = step
            if self.args.reset_at is not None and step == self.args.reset_at:
                reset_info = {"step": step, "ok": self.reset()}
            self.arrivals(step)
            scheduled = self.schedule()
            self.after_step(scheduled)
            events = self.manager.take_events()
            if events:
                self.account(events)
                publisher.publish(KVEventBatch(ts=time.time(), events=events))
                published += 1
            if self.args.step_interval:
                time.sleep(self.args.step_interval)
        self.stats["run_seconds_x1000"] = int((time.time() - t0) * 1000)
        return {"published": published, "reset": reset_info}


def main() -> int:
    args = ARGS
    drv = Driver(args)

    DriverPublisher.bind_pub = not args.pub_connect
    DriverPublisher.drop_rate = args.drop_rate
    DriverPublisher.drop_seed = args.seed
    publisher = DriverPublisher(
        data_parallel_rank=0,
        endpoint=args.pub,
        replay_endpoint=args.replay,
        buffer_steps=args.buffer_steps,
        topic=args.topic,
    )
    emit(
        {
            "event": "ready",
            "pub": publisher.bound_pub,
            "replay": publisher.bound_replay,
            "pid": os.getpid(),
        }
    )
    try:
        if args.start_delay > 0:
            time.sleep(args.start_delay)
        res = drv.run(publisher)
        drained = wait_drained(publisher)
        n = res["published"]
        dropped = sorted(publisher.lossy.dropped) if publisher.lossy else []
        out = {
            "vllm_version": vllm.__version__,
            "hash_mode": args.hash_mode,
            "topic": args.topic,
            "pub": publisher.bound_pub,
            "replay": publisher.bound_replay,
            "seed": args.seed,
            "steps": args.steps,
            "num_blocks": args.num_blocks,
            "block_size": args.block_size,
            "lora": args.lora,
            "published_batches": n,
            "first_seq": 0 if n else None,
            "last_seq": n - 1 if n else None,
            "dropped_seqs": dropped,
            "drained": drained,
            "reset": res["reset"],
            "event_counts": dict(drv.event_counts),
            "max_copies_seen": drv.max_copies,
            "workload": dict(drv.stats),
            "reference": drv.reference(),
            "probes": drv.probes(),
        }
        path = Path(args.out)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        os.replace(tmp, path)
        emit({"event": "done", "published_batches": n, "dropped": len(dropped), "out": str(path)})
        if args.linger > 0:
            time.sleep(args.linger)
    finally:
        publisher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
