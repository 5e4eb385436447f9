"""A vLLM-like engine at an address of its own (127.0.0.x): its publisher on IP:PORT (replay
on PORT + 1) and the truth of its pool, for the discovery tests (engines found by DNS
names and Kubernetes pods, several on one port as pods behind a Service are)."""

from __future__ import annotations

import random

from service_workload import Conversation, RefRank

from kvindex.runtime import Fleet
from kvindex.wire.publisher import Publisher


class Engine:
    def __init__(self, ip: str, port: int, seed: int) -> None:
        self.ip = ip
        self.pub = Publisher(f"tcp://{ip}:{port}", f"tcp://{ip}:{port + 1}")
        self.ref = RefRank(self.pub)
        self.rng = random.Random(seed)
        self.convs = [Conversation(self.rng, i) for i in range(3)]

    def work(self, turns: int = 3) -> None:
        for _ in range(turns):
            for conv in self.convs:
                self.ref.serve(conv.next_prompt())
                self.ref.evict(self.rng, self.rng.randrange(0, 3))

    def close(self) -> None:
        self.pub.close()


def exact(fleet: Fleet, name: str, engine: Engine) -> bool:
    """The fleet follows `name` and holds exactly the engine's pool."""
    return fleet.has_instance(name) and fleet.block_hashes(name) == engine.ref.held()
