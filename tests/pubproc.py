"""A vLLM-like engine as its own process, for tests that kill it (SIGKILL) mid-stream.

    python tests/pubproc.py ENDPOINT REPLAY_ENDPOINT SEED TURNS [DROP_RATE]

Runs `TURNS` turns of a conversation workload (`service_workload`) on a `Publisher` bound
to the given endpoints, prints `seq N` after every batch, then the reference state as
`held H1 H2 ...` (rendered hashes), and waits (replay still served) until killed.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from service_workload import Conversation, RefRank

from kvindex.wire import render_hash
from kvindex.wire.publisher import Publisher


def main() -> None:
    endpoint, replay, seed, turns = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    drop_rate = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    rng = random.Random(seed)
    drops = random.Random(seed + 1)
    pub = Publisher(endpoint, replay, drop=lambda seq: drops.random() < drop_rate)
    ref = RefRank(pub)
    convs = [Conversation(rng, i) for i in range(4)]
    time.sleep(0.3)  # subscribers reconnect
    for _ in range(turns):
        for conv in convs:
            ref.serve(conv.next_prompt())
            ref.evict(rng, rng.randrange(0, 3))
            print(f"seq {pub.next_seq - 1}", flush=True)
            time.sleep(0.002)
    pub.drop = None
    pub.publish([])  # never dropped: the tail can be seen missing
    print("held " + " ".join(sorted(render_hash(h) for h in ref.held())), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
