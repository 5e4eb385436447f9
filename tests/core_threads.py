"""Ingest, membership churn and every kind of question on one compiled index at once.

    python tests/core_threads.py [--seconds S] [--only names|all|exact]

Run by tests/test_core_threads.py (a child process: a crash fails the test, not the run)
and by `make sanitize`'s ThreadSanitizer stage (sanitize/run.sh). Prints "<case>: ok"
and exits 0 when no thread raised and the end state is exact; else prints what failed
and exits 1.

- `names` (issue 23's defect): one thread applies batches of 64 BlockStored with fresh
  lora_names (the core's name table grows and rehashes under the write lock) while two
  threads look up by lora_name, by rows and as JSON.
- `all`: two ingest threads (stores and removes, LoRA and salted namespaces, CPU and
  disk tiers, batches bigger than a slice), a thread removing and re-adding a third
  publisher every few ms (its bit handed back and forth: issue 27 points 1 and 5), and
  threads asking every kind of question: lookups (rows, JSON, local hashes, hashes),
  pools, hashes, copies, counts, stats, distinct counts, the tree walk, memory. At the
  end every instance is removed: no entry and no tree node may be left.
- `exact` (issue 23 item 2): four publishers applied at once, each on a thread of its
  own (what ingest workers do), their streams sharing prompts (so their chains meet in
  the tree), with LoRA and salted namespaces, bytes hashes, a CPU tier and a second
  group, removals and clears, while two threads ask every kind of question. At the end
  the index must equal the pure-Python reference fed the same streams one publisher
  after the other (tests/differential.py: pools, copies, stats, tree, every lookup):
  no publisher's state depends on another's, so any interleaving ends there. What a
  write side applied by several workers at once must keep (make sanitize runs it under
  ThreadSanitizer).
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable

from kvindex.index import ReferenceIndex
from kvindex.index.compiled import CompiledIndex
from kvindex.index.localhash import local_hashes
from kvindex.subscriber import SourceKey
from kvindex.wire import AllBlocksCleared, BatchDecoder, BlockRemoved, BlockStored, Event
from kvindex.wire.publisher import encode_batch

BS = 4
PROMPT = [(7 * i) % 997 for i in range(64 * BS)]


def _store(first: int, n: int, offset: int = 0, **fields: object) -> BlockStored:
    return BlockStored(
        block_hashes=list(range(first, first + n)),
        token_ids=PROMPT[offset * BS : (offset + n) * BS],
        block_size=BS,
        **fields,
    )


class Run:
    def __init__(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds
        self.errors: list[str] = []
        self.rounds: dict[str, int] = {}

    def loop(self, name: str, step: Callable[[int], object]) -> threading.Thread:
        def body() -> None:
            i = 0
            try:
                while time.monotonic() < self.until:
                    step(i)
                    i += 1
            except BaseException:
                self.errors.append(f"{name}: {traceback.format_exc()}")
            self.rounds[name] = i

        thread = threading.Thread(target=body, name=name)
        thread.start()
        return thread

    def join(self, threads: list[threading.Thread]) -> None:
        for thread in threads:
            thread.join()


def names(seconds: float) -> list[str]:
    index = CompiledIndex()
    run = Run(seconds)
    source = SourceKey("e")

    def ingest(i: int) -> None:
        events = [_store(i * 64 + k, 1, k % 60, lora_name=f"ad-{i}-{k}") for k in range(64)]
        index.apply_payload(source, encode_batch(events, ts=1.0))
        if i % 50 == 49:
            index.drop_source(source)  # names freed with their last namespace, too

    def ask(i: int) -> None:
        index.lookup(PROMPT[:16], lora_name=f"ad-{i % 40}-{i % 64}")

    def ask_json(i: int) -> None:
        slots = [(b'"e"', [0, 0])]
        index.lookup_json(PROMPT[:16], f"ad-{i % 40}-{i % 7}", None, slots, [b'"up"'])

    run.join([run.loop("ingest", ingest), run.loop("lookup", ask), run.loop("json", ask_json)])
    return run.errors


def everything(seconds: float) -> list[str]:
    index = CompiledIndex(local_hashes=True)
    index._core.set_slice(32)  # big batches cross slices
    run = Run(seconds)
    steady = [SourceKey("a"), SourceKey("b", 0)]
    churned = SourceKey("c")
    namespaces: list[dict[str, object]] = [
        {},
        {"lora_name": "ad"},
        {"medium": "CPU"},
        {"medium": "DISK", "lora_name": "ad"},
    ]

    def ingester(source: SourceKey, base: int) -> Callable[[int], None]:
        def step(i: int) -> None:
            first = base + (i % 500) * 64
            fields = namespaces[i % len(namespaces)]
            events: list[BlockStored | BlockRemoved] = [_store(first, 48, 0, **fields)]
            if i % 3 == 2:
                events.append(BlockRemoved(block_hashes=list(range(first, first + 16))))
            index.apply_payload(source, encode_batch(events, ts=1.0))

        return step

    def churn(i: int) -> None:
        if i % 2:
            index.remove_instance("c")
        else:
            index.apply_payload(churned, encode_batch([_store(9_000_000 + i, 40)], ts=1.0))
        time.sleep(0.002)

    hashes = list(range(10_000_000, 10_000_030))
    local = local_hashes(PROMPT[: 30 * BS], BS)

    def ask(i: int) -> None:
        kind = i % 9
        if kind == 0:
            index.lookup(PROMPT, lora_name="ad" if i % 2 else None)
        elif kind == 1:
            slots = [(f'"{name}"'.encode(), [0, 0]) for name in ("a", "b", "c")]
            index.lookup_json(PROMPT, None, None, slots, [b'"up"'] * 3)
        elif kind == 2:
            index.lookup_local_hashes(local)
        elif kind == 3:
            index.lookup_hashes(hashes)
        elif kind == 4:
            for name in ("a", "b", "c"):
                index.block_hashes(name, "CPU")
                index.blocks_by_medium(name)
        elif kind == 5:
            for source in (*steady, churned):
                index.copies(source)
                index.count(source, 0, "GPU", 10_000_001)
        elif kind == 6:
            for name in ("a", "b", "c"):
                index.cache_stats(name)
                index.block_count(name)
        elif kind == 7:
            sum(1 for _ in index.walk_tree())
        else:
            index.memory()
            index.entries()
            index.tree_nodes()

    threads = [
        run.loop("ingest-a", ingester(steady[0], 10_000_000)),
        run.loop("ingest-b", ingester(steady[1], 20_000_000)),
        run.loop("churn", churn),
        run.loop("ask-1", ask),
        run.loop("ask-2", lambda i: ask(i + 4)),
    ]
    run.join(threads)
    for name in ("a", "b", "c"):
        index.remove_instance(name)
    left = (index.entries(), index.tree_nodes())
    if left != (0, 0):
        run.errors.append(f"left after every instance was removed (entries, nodes): {left}")
    if min(run.rounds.values(), default=0) == 0:
        run.errors.append(f"a thread never ran: {run.rounds}")
    return run.errors


# `exact`: the shared prompts, the namespaces and pools a store may use, and the publishers.
EXACT_PROMPTS = [[(p * 7919 + 13 * i) % 30_011 for i in range(24 * BS)] for p in range(3)]
EXACT_VARIANTS: list[dict[str, object]] = [
    {},
    {"lora_name": "ad"},
    {"cache_salt": "t"},
    {"medium": "CPU"},
    {"group_idx": 1},
    {"lora_name": "ad", "medium": "CPU"},
]
EXACT_SOURCES = [SourceKey("a"), SourceKey("b", 0), SourceKey("b", 1), SourceKey("c")]


def _exact_hash(prompt: int, variant: int, block: int, as_bytes: bool) -> int | bytes:
    """The same content hashes alike for every publisher (vLLM's hashes are the blocks')."""
    value = (prompt * 1_000_003 + variant * 10_007 + block) * 2_654_435_761 % (1 << 62)
    return value.to_bytes(8, "little") + b"h" if as_bytes else value


def _exact_stream(seed: int, batches: int) -> list[bytes]:
    """One publisher's batches: stores of chains of the shared prompts (from their start or
    hanging from an earlier block), removals of what it holds, now and then a clear."""
    rng = random.Random(seed)
    held: dict[tuple[int | bytes, str | None, int | None], int] = {}
    out: list[bytes] = []
    for _ in range(batches):
        events: list[Event] = []
        for _ in range(rng.randint(1, 3)):
            roll = rng.random()
            if roll < 0.02:
                events.append(AllBlocksCleared())
                held.clear()
            elif roll < 0.35 and held:
                keys = rng.sample(sorted(held, key=repr), min(len(held), rng.randint(1, 6)))
                by_pool: dict[tuple[str | None, int | None], list[int | bytes]] = {}
                for h, medium, group in keys:
                    by_pool.setdefault((medium, group), []).append(h)
                    held[(h, medium, group)] -= 1
                    if held[(h, medium, group)] == 0:
                        del held[(h, medium, group)]
                for (medium, group), hashes in by_pool.items():
                    events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
            else:
                p, v = rng.randrange(len(EXACT_PROMPTS)), rng.randrange(len(EXACT_VARIANTS))
                as_bytes = p == 2
                first = rng.choice([0, 0, rng.randrange(24)])
                last = min(24, first + rng.randint(1, 12))
                fields = EXACT_VARIANTS[v]
                hashes = [_exact_hash(p, v, b, as_bytes) for b in range(first, last)]
                parent = _exact_hash(p, v, first - 1, as_bytes) if first else None
                events.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=parent,
                        token_ids=EXACT_PROMPTS[p][first * BS : last * BS],
                        block_size=BS,
                        **fields,  # type: ignore[arg-type]
                    )
                )
                medium = fields.get("medium")
                group = fields.get("group_idx")
                for h in hashes:
                    key = (h, medium if isinstance(medium, str) else None, group)  # type: ignore[misc]
                    held[key] = held.get(key, 0) + 1
        out.append(encode_batch(events, ts=1.0))
    return out


def exact(seconds: float) -> list[str]:
    errors: list[str] = []
    until = time.monotonic() + seconds
    rounds = 0
    while not errors and (rounds == 0 or time.monotonic() < until):
        errors = [f"round {rounds}: {e}" for e in _exact_round(rounds)]
        rounds += 1
    return errors


def _exact_round(seed: int) -> list[str]:
    import differential  # tests/, beside this file

    streams = {s: _exact_stream(seed * 10 + i, 150) for i, s in enumerate(EXACT_SOURCES)}
    index = CompiledIndex(local_hashes=True)
    index._core.set_slice(8)  # batches cross slices
    pure = ReferenceIndex()
    decoder = BatchDecoder()
    for source in EXACT_SOURCES:  # registered in one order: the same bits in both
        index.apply_payload(source, streams[source][0])
        pure.apply(source, decoder.decode(streams[source][0]))
    run = Run(0.0)  # its clock unused: the threads end with their streams
    done = threading.Event()

    def ingester(source: SourceKey) -> Callable[[int], None]:
        def step(i: int) -> None:
            payloads = streams[source]
            if i + 1 >= len(payloads):
                raise StopIteration
            index.apply_payload(source, payloads[i + 1])

        return step

    def ask(i: int) -> None:
        if done.is_set():
            raise StopIteration
        prompt = EXACT_PROMPTS[i % len(EXACT_PROMPTS)]
        kind = i % 6
        if kind == 0:
            index.lookup(prompt, lora_name="ad" if i % 2 else None)
        elif kind == 1:
            slots = [(f'"{s.instance}"'.encode(), [0, 0]) for s in EXACT_SOURCES]
            index.lookup_json(prompt, None, "t" if i % 2 else None, slots, [b'"up"'] * 4)
        elif kind == 2:
            index.lookup_hashes([_exact_hash(0, i % 6, b, False) for b in range(24)])
        elif kind == 3:
            index.lookup_local_hashes(local_hashes(prompt, BS))
        elif kind == 4:
            for source in EXACT_SOURCES:
                index.copies(source)
                index.cache_stats(source.instance)
        else:
            sum(1 for _ in index.walk_tree())

    writers = [_until_stop(run, f"ingest-{s}", ingester(s)) for s in EXACT_SOURCES]
    askers = [_until_stop(run, f"ask-{k}", lambda i, k=k: ask(i + 3 * k)) for k in (0, 1)]
    run.join(writers)
    done.set()
    run.join(askers)
    errors = list(run.errors)
    for source in EXACT_SOURCES:  # the reference: one publisher after the other
        for payload in streams[source][1:]:
            pure.apply(source, decoder.decode(payload))
    prompts = [(t, names) for t in EXACT_PROMPTS for names in _EXACT_NAMES]
    runs = [
        [_exact_hash(p, v, b, p == 2) for b in range(24)]
        for p in range(len(EXACT_PROMPTS))
        for v in range(len(EXACT_VARIANTS))
    ]
    local = [(local_hashes(t, BS, lo, salt), {}) for t in EXACT_PROMPTS for lo, salt in _LOCAL]
    try:
        differential.assert_same(pure, index, prompts, runs, local_runs=local)
    except AssertionError:
        errors.append(f"not the reference's state: {traceback.format_exc()}")
    # Every store carries its tokens, so every shared node keeps them: the reference's key.
    shared = [Counter(n for n in i.walk_tree() if n[3] & (n[3] - 1)) for i in (index, pure)]
    if shared[0] != shared[1] or not shared[0]:
        errors.append(f"shared nodes' tokens: {shared[0] - shared[1]} / {shared[1] - shared[0]}")
    return errors


_EXACT_NAMES: list[dict[str, object]] = [{}, {"lora_name": "ad"}, {"cache_salt": "t"}]
_LOCAL = [(None, None), ("ad", None), (None, "t")]


def _until_stop(run: Run, name: str, step: Callable[[int], object]) -> threading.Thread:
    """`run.loop`, ended by the step raising StopIteration rather than by the clock."""

    def body() -> None:
        i = 0
        try:
            while True:
                step(i)
                i += 1
        except StopIteration:
            pass
        except BaseException:
            run.errors.append(f"{name}: {traceback.format_exc()}")
        run.rounds[name] = i

    thread = threading.Thread(target=body, name=name)
    thread.start()
    return thread


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--only", choices=("names", "all", "exact"))
    args = parser.parse_args()
    status = 0
    for name, case in (("names", names), ("all", everything), ("exact", exact)):
        if args.only not in (None, name):
            continue
        errors = case(args.seconds)
        for error in errors:
            print(error)
        print(f"{name}: {'ok' if not errors else 'FAILED'}", flush=True)
        status |= bool(errors)
    return status


if __name__ == "__main__":
    sys.exit(main())
