"""Many DP ranks of one vLLM-like engine as their own process (a PUB and a replay ROUTER per
rank, on consecutive ports, as vLLM binds them):

    python tests/rankspub.py PUB_BASE REPLAY_BASE RANKS

Rank r stores block `1000 + r` first, prints `ready` once every rank has, then publishes
a batch on rank 0 (block `100000 + n`) every 50 ms, until killed.
"""

from __future__ import annotations

import sys
import time

from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher


def main() -> None:
    pub_base, replay_base, ranks = (int(a) for a in sys.argv[1:4])
    pubs = [
        Publisher(
            f"tcp://127.0.0.1:{pub_base + r}", f"tcp://127.0.0.1:{replay_base + r}", dp_rank=r
        )
        for r in range(ranks)
    ]
    for r, pub in enumerate(pubs):
        pub.publish([BlockStored([1000 + r], None, [r] * 4, 4)])
    print("ready", flush=True)
    n = 0
    while True:
        time.sleep(0.05)
        pubs[0].publish([BlockStored([100_000 + n], None, [n] * 4, 4)])
        n += 1


if __name__ == "__main__":
    main()
