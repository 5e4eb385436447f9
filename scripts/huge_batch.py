"""Issue 17 point 7: how long lookups wait while another thread applies one huge batch to
the compiled index.

    python scripts/huge_batch.py BLOCKS [stored|leaf|hashonly]

A BlockStored of BLOCKS blocks (16 tokens each; `hashonly`: none), then a BlockRemoved of
them (root first; `leaf`: leaf first), each applied while a thread looks up in a loop.
"""

from __future__ import annotations

import resource
import sys
import threading
import time

from kvindex.index.compiled import CompiledIndex
from kvindex.subscriber.messages import SourceKey
from kvindex.wire import BlockHash, BlockRemoved, BlockStored
from kvindex.wire.publisher import encode_batch

BS = 16


def main() -> None:
    n = int(sys.argv[1])
    kind = sys.argv[2] if len(sys.argv) > 2 else "stored"
    index = CompiledIndex()
    tokens = [i % 50_000 for i in range(n * BS)] if kind != "hashonly" else []
    hashes: list[BlockHash] = list(range(1, n + 1))
    stored = encode_batch([BlockStored(hashes, None, tokens, BS)], 1.0, 0)
    gone = hashes[::-1] if kind == "leaf" else hashes
    removed = encode_batch([BlockRemoved(gone)], 2.0, 0)
    del tokens
    print(f"payload {len(stored) / 1e6:.1f} MB")
    other = encode_batch([BlockStored([10**9], None, list(range(BS)), BS)], 1.0, 0)
    index.apply_payload(SourceKey("b"), other, 1)
    waits: list[float] = []
    stop = threading.Event()

    def look() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            index.lookup(list(range(BS)))
            waits.append(time.perf_counter() - t)
            time.sleep(0.001)

    thread = threading.Thread(target=look)
    thread.start()
    time.sleep(0.05)
    for name, payload in (("stored", stored), ("removed", removed)):
        waits.clear()
        t = time.perf_counter()
        index.apply_payload(SourceKey("a"), payload, 1)
        took = time.perf_counter() - t
        time.sleep(0.02)
        ws = sorted(waits)
        top = [round(w * 1e3, 1) for w in ws[-8:]]
        print(
            f"{name}: applied in {took * 1e3:.0f} ms; {len(ws)} lookups, median "
            f"{ws[len(ws) // 2] * 1e3:.2f} ms, longest (ms) {top}"
        )
    stop.set()
    thread.join()
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")


if __name__ == "__main__":
    main()
