"""Ingest, membership churn and every kind of question on one compiled index at once.

    python tests/core_threads.py [--seconds S] [--only names]

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
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import traceback
from collections.abc import Callable

from kvindex.index.compiled import CompiledIndex
from kvindex.index.localhash import local_hashes
from kvindex.subscriber import SourceKey
from kvindex.wire import BlockRemoved, BlockStored
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--only", choices=("names", "all"))
    args = parser.parse_args()
    status = 0
    for name, case in (("names", names), ("all", everything)):
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
