"""The typed (pure-Python) decode of an ordinary vLLM 0.33 batch, timed for an A/B between
two checkouts of kvindex: `python scripts/decode_ab.py CHECKOUT` prints microseconds per
batch for CHECKOUT's `kvindex.wire` (run it alternately for two checkouts; the best of 7
rounds of 20,000 decodes each). Used to show that accepting SGLang's bigram pages did not
slow the decode of ordinary batches (issue 19): a git worktree at 9655110^ beside main."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import msgspec


def stored(first: int, blocks: int) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(range(first, first + blocks)),
        "parent_block_hash": first - 1,
        "token_ids": list(range(16 * blocks)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": None,
        "group_idx": 0,
    }


def main() -> None:
    sys.path.insert(0, str(Path(sys.argv[1]) / "src"))
    from kvindex.wire.decode import decode_batch

    events = [stored(i * 10, 1) for i in range(20)]
    events.append({"type": "BlockRemoved", "block_hashes": [5, 6], "medium": "GPU"})
    payload = msgspec.msgpack.encode([time.time(), events, 0])
    assert len(decode_batch(payload).events) == 21
    best = float("inf")
    for _ in range(7):
        started = time.perf_counter()
        for _ in range(20_000):
            decode_batch(payload)
        best = min(best, (time.perf_counter() - started) / 20_000)
    print(f"{sys.argv[1]}: {best * 1e6:.2f} us/batch")


if __name__ == "__main__":
    main()
