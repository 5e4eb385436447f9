"""The requests a simulated fleet serves: multi-turn chats over shared system prompts.

A few system prompts of different lengths are shared by many conversations (the most
popular ones by most). A conversation stays on its home instance (sticky routing) except
for the occasional turn a router sends elsewhere, so the same prefixes end up cached on
several instances. Each turn re-sends the whole history plus a new user message; the
engine appends the answer it generates. Some conversations run under a LoRA adapter (their
blocks hash differently and are published with `lora_name`), some (when the shape asks
for it: SGLang's `cache_salt`) under a salt of their own, and some one-shot jobs send
the same block-aligned prompt twice at once (vLLM then caches a second physical copy of
the last block, which it recomputes).

Block hashes chain like vLLM's: `H(parent or NONE_HASH, block tokens, extra keys)`, a
32-byte digest; a salted chain starts from a root of its own (as SGLang seeds a salted
request's chain from its salt). How it goes on the wire (int or bytes) is the encoder's
business.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Adapter",
    "Conversation",
    "Digest",
    "RecentPrompt",
    "Request",
    "Workload",
    "WorkloadShape",
    "block_digest",
    "extend_chain",
]

Digest = bytes
"""A block's 32-byte hash (vLLM's sha256 digest); the wire shows it as an int or as bytes."""

NONE_HASH: Digest = hashlib.sha256(b"kvindex-sim NONE_HASH").digest()
VOCAB = 32_000


def _unit(block_size: int) -> int:
    """Prompt lengths are drawn in units of this many tokens: the block size, or 16 for
    page size 1 (SGLang's default), so one-token pages serve prompts of a usual length."""
    return block_size if block_size > 1 else 16


def block_digest(
    parent: Digest | None, tokens: Sequence[int], lora: str | None, salt: str | None = None
) -> Digest:
    """The hash of one full block under its parent (and LoRA adapter, an extra key); a
    salted chain's first block hangs from the salt's own root."""
    if parent is None and salt is not None:
        parent = hashlib.sha256(NONE_HASH + b"salt:" + salt.encode()).digest()
    h = hashlib.sha256(parent or NONE_HASH)
    h.update(array("q", tokens).tobytes())
    if lora is not None:
        h.update(b"\x00lora:" + lora.encode())
    return h.digest()


def extend_chain(
    digests: list[Digest],
    tokens: Sequence[int],
    block_size: int,
    lora: str | None,
    salt: str | None = None,
) -> None:
    """Append the hashes of the full blocks of `tokens` that `digests` does not cover yet."""
    for i in range(len(digests), len(tokens) // block_size):
        parent = digests[-1] if digests else None
        page = tokens[i * block_size : (i + 1) * block_size]
        digests.append(block_digest(parent, page, lora, salt))


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter: `name` is what events carry (`lora_name`), `ident` is `lora_id`."""

    name: str
    ident: int


@dataclass(slots=True)
class Conversation:
    ident: int
    home: int  # the instance its turns usually go to
    lora: Adapter | None
    history: list[int]
    digests: list[Digest]  # chain over the history's full blocks
    turns_left: int
    ready_at: int = 0  # tick from which the user sends the next turn
    busy: bool = False
    salt: str | None = None  # SGLang's cache_salt: a namespace of its own


@dataclass(slots=True)
class Request:
    """One request: the prompt, then the tokens generated so far, and their block hashes."""

    ident: int
    tokens: list[int]
    digests: list[Digest]
    prompt_len: int
    output_len: int
    lora: Adapter | None
    conversation: Conversation | None = None
    kind: str = "chat"
    salt: str | None = None

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora.name


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """The knobs of the workload (the defaults look like a chat service's)."""

    block_size: int = 16
    system_prompts: int = 6
    lora_adapters: int = 2
    lora_share: float = 0.15  # conversations under an adapter
    duplicate_share: float = 0.04  # requests that are a pair of identical aligned prompts
    wander_share: float = 0.15  # turns a router sends away from the conversation's home
    conversations_per_instance: int = 12
    max_history: int = 3_000  # tokens; a longer conversation ends
    user_tokens: tuple[int, int] = (12, 160)
    output_tokens: tuple[int, int] = (16, 240)
    think_ticks: tuple[int, int] = (0, 60)
    salt_share: float = 0.0  # conversations under a cache_salt (SGLang); 0: none
    salts: int = 3  # how many distinct salts (tenants) there are


@dataclass(frozen=True, slots=True)
class RecentPrompt:
    """A prompt recently handed to an instance (the dashboard's lookup box offers them)."""

    instance: int
    lora_name: str | None
    token_ids: list[int]
    kind: str
    tick: int
    salt: str | None = None


class Workload:
    """Hands each engine its next request; learns how each one ended."""

    def __init__(self, rng: random.Random, instances: int, shape: WorkloadShape) -> None:
        self.rng = rng
        self.instances = instances
        self.shape = shape
        self.adapters = [Adapter(f"adapter-{i}", i + 1) for i in range(shape.lora_adapters)]
        self.systems = [self._system_prompt(i) for i in range(shape.system_prompts)]
        # Zipf-like popularity: the first system prompt is used most.
        self.weights = [1.0 / (i + 1) for i in range(len(self.systems))]
        self.conversations: list[Conversation] = []
        self.twins: dict[int, deque[Request]] = {}
        self.recent: deque[RecentPrompt] = deque(maxlen=32)
        self._next_id = 0

    def _system_prompt(self, i: int) -> list[int]:
        bs = self.shape.block_size
        # Some are block-aligned (their last block is recomputed when fully cached), some not.
        blocks = self.rng.randint(4, 48)
        extra = 0 if i % 2 == 0 or bs == 1 else self.rng.randint(1, bs - 1)
        return self.tokens(blocks * _unit(bs) + extra)

    def tokens(self, n: int) -> list[int]:
        rand = self.rng.randrange
        return [rand(VOCAB) for _ in range(n)]

    def _ident(self) -> int:
        self._next_id += 1
        return self._next_id

    # -- handing out requests ----------------------------------------------------------

    def next_request(self, instance: int, engine: int, tick: int) -> Request | None:
        """The next request for `engine` (a DP rank of `instance`), or None: nobody has
        anything to say right now."""
        twins = self.twins.get(engine)
        if twins:
            return twins.popleft()
        if self.rng.random() < self.shape.duplicate_share:
            return self._duplicated_job(engine)
        conversation = self._ready_conversation(instance, tick)
        if conversation is None:
            conversation = self._new_conversation(instance)
        if conversation is None:
            return None
        return self._turn(conversation)

    def _ready_conversation(self, instance: int, tick: int) -> Conversation | None:
        ready = [c for c in self.conversations if not c.busy and c.ready_at <= tick]
        if not ready:
            return None
        home = [c for c in ready if c.home == instance]
        if home and self.rng.random() >= self.shape.wander_share:
            return self.rng.choice(home)
        away = [c for c in ready if c.home != instance]
        return self.rng.choice(away) if away else None

    def _new_conversation(self, instance: int) -> Conversation | None:
        mine = sum(c.home == instance for c in self.conversations)
        if mine >= self.shape.conversations_per_instance:
            return None
        system = self.rng.choices(self.systems, self.weights)[0]
        lora = None
        if self.adapters and self.rng.random() < self.shape.lora_share:
            lora = self.rng.choice(self.adapters)
        conversation = Conversation(
            ident=self._ident(),
            home=instance,
            lora=lora,
            history=list(system),
            digests=[],
            turns_left=self.rng.randint(2, 9),
        )
        if self.shape.salt_share and self.rng.random() < self.shape.salt_share:
            conversation.salt = f"tenant-{self.rng.randrange(self.shape.salts)}"
        self.conversations.append(conversation)
        return conversation

    def _turn(self, conversation: Conversation) -> Request:
        lo, hi = self.shape.user_tokens
        prompt = conversation.history + self.tokens(self.rng.randint(lo, hi))
        conversation.busy = True
        return Request(
            ident=self._ident(),
            tokens=prompt,
            digests=list(conversation.digests),
            prompt_len=len(prompt),
            output_len=self.rng.randint(*self.shape.output_tokens),
            lora=conversation.lora,
            conversation=conversation,
            salt=conversation.salt,
        )

    def _duplicated_job(self, engine: int) -> Request:
        """A block-aligned one-shot prompt sent twice at once (say, n=2 sampling)."""
        bs = self.shape.block_size
        system = self.rng.choices(self.systems, self.weights)[0]
        body = self.tokens(self.rng.randint(1, 8) * _unit(bs))
        prompt = system[: len(system) // bs * bs] + body
        output = self.rng.randint(*self.shape.output_tokens)
        first, second = (
            Request(self._ident(), list(prompt), [], len(prompt), output, None, kind="pair")
            for _ in range(2)
        )
        self.twins.setdefault(engine, deque()).append(second)
        return first

    # -- outcomes ----------------------------------------------------------------------

    def started(self, request: Request, instance: int, tick: int) -> None:
        """An engine admitted the request: its prompt is cached there now."""
        prompt = request.tokens[: request.prompt_len]
        self.recent.append(
            RecentPrompt(instance, request.lora_name, prompt, request.kind, tick, request.salt)
        )

    def finished(self, request: Request, tick: int) -> None:
        """The request completed: its conversation's history now holds the answer."""
        conversation = request.conversation
        if conversation is None:
            return
        conversation.busy = False
        conversation.turns_left -= 1
        conversation.history = request.tokens
        conversation.digests = request.digests
        if conversation.turns_left <= 0 or len(request.tokens) > self.shape.max_history:
            self.conversations.remove(conversation)
            return
        conversation.ready_at = tick + self.rng.randint(*self.shape.think_ticks)

    def aborted(self, request: Request, tick: int) -> None:
        """The request was lost (engine restart, or it can never fit): the user retries."""
        conversation = request.conversation
        if conversation is not None:
            conversation.busy = False
            conversation.ready_at = tick + self.rng.randint(*self.shape.think_ticks)

    def refused(self, request: Request) -> None:
        """The request can never fit the engine's pool: its user gives up."""
        conversation = request.conversation
        if conversation is not None and conversation in self.conversations:
            self.conversations.remove(conversation)

    def forget_engine(self, engine: int) -> None:
        """Drop the pending twin of an engine that restarted."""
        self.twins.pop(engine, None)
