"""Service test helpers: a reference model of vLLM's prefix cache (what each rank must
hold), and starlette's TestClient imported without its deprecation noise.

`RefRank` publishes through a `Publisher` exactly what a vLLM block pool would announce
(one BlockStored per new physical copy, one BlockRemoved per evicted copy, clears and
restarts) and keeps the reference state beside it. Hashes chain like vLLM's
(`H(parent, block tokens)`), so a lookup's expected answer is the number of leading
blocks of the prompt whose hashes the rank holds.
"""

from __future__ import annotations

import hashlib
import random
import warnings
from collections import Counter
from dataclasses import dataclass, field

from kvindex.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored
from kvindex.wire.publisher import Publisher

with warnings.catch_warnings():
    # This starlette asks for an `httpx2` package that does not exist yet; httpx works.
    warnings.filterwarnings("ignore", message=".*httpx2")
    from fastapi.testclient import TestClient

__all__ = ["BLOCK", "Conversation", "RefRank", "TestClient", "block_hash", "chain"]

BLOCK = 4


def block_hash(parent: int | None, tokens: list[int]) -> int:
    data = repr((parent, tokens)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def chain(tokens: list[int], size: int = BLOCK) -> list[int]:
    """The hashes of the prompt's full blocks, each chained to the previous one."""
    out: list[int] = []
    parent: int | None = None
    for i in range(len(tokens) // size):
        parent = block_hash(parent, tokens[i * size : (i + 1) * size])
        out.append(parent)
    return out


@dataclass
class RefRank:
    """One engine (one DP rank): its publisher and the hashes its block pool holds."""

    pub: Publisher
    gpu: Counter[int] = field(default_factory=Counter)
    cpu: Counter[bytes] = field(default_factory=Counter)

    def held(self) -> set[int | bytes]:
        return set(self.gpu) | set(self.cpu)

    def matched(self, tokens: list[int]) -> int:
        n = 0
        for h in chain(tokens):
            if h not in self.gpu:
                break
            n += 1
        return n

    def serve(self, prompt: list[int]) -> None:
        """Schedule a prompt: its uncached tail becomes new physical copies (a block that
        is cached again after a miss before it gets a second copy, as in vLLM)."""
        hashes = chain(prompt)
        start = self.matched(prompt)
        if start == len(hashes):
            return
        parent = hashes[start - 1] if start else None
        tokens = prompt[start * BLOCK : len(hashes) * BLOCK]
        self.pub.publish([BlockStored(list[BlockHash](hashes[start:]), parent, tokens, BLOCK)])
        self.gpu.update(hashes[start:])

    def copy_again(self, prompt: list[int]) -> None:
        """A second physical copy of the prompt's cached blocks (vLLM announces each)."""
        hashes = chain(prompt)[: self.matched(prompt)]
        if hashes:
            tokens = prompt[: len(hashes) * BLOCK]
            self.pub.publish([BlockStored(list[BlockHash](hashes), None, tokens, BLOCK)])
            self.gpu.update(hashes)

    def evict(self, rng: random.Random, count: int) -> None:
        for _ in range(count):
            if not self.gpu:
                return
            h = rng.choice(sorted(self.gpu))
            self.pub.publish([BlockRemoved([h])])
            self.gpu[h] -= 1
            if not self.gpu[h]:
                del self.gpu[h]

    def offload(self, digests: list[bytes]) -> None:
        self.pub.publish([BlockStored(list(digests), None, [], 0, medium="CPU")])
        self.cpu.update(digests)

    def drop_offloaded(self, digest: bytes) -> None:
        self.pub.publish([BlockRemoved([digest], medium="CPU")])
        self.cpu[digest] -= 1
        if not self.cpu[digest]:
            del self.cpu[digest]

    def clear(self) -> None:
        self.pub.publish([AllBlocksCleared()])
        self.gpu.clear()
        self.cpu.clear()

    def restart(self) -> None:
        self.pub.restart()
        self.gpu.clear()
        self.cpu.clear()


class Conversation:
    """A multi-turn chat: a shared system prompt, then user and assistant turns."""

    SYSTEM = list(range(1000, 1010))  # 2.5 blocks shared by every conversation

    def __init__(self, rng: random.Random, ident: int) -> None:
        self.rng = rng
        self.tokens = [*self.SYSTEM, 50_000 + ident]

    def next_prompt(self) -> list[int]:
        """The prompt of the next turn: the history plus a reply and a new user message."""
        self.tokens += [self.rng.randrange(2000) for _ in range(self.rng.randrange(3, 12))]
        return list(self.tokens)
