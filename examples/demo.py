"""The kvindex demonstration: a small simulated vLLM fleet and the tools following it.

    python examples/demo.py [--instances 3] [--duration 15]      (what `make demo` runs)

Starts vLLM-compatible publishers (PUB + replay ROUTER) on free loopback ports, drives them
with a synthetic multi-turn chat workload, and runs, as separate processes, `kvindex watch`
on the first instance and the example scripts against the fleet, printing their output with
a prefix each. The workload is built to show what matters to a subscriber:

- shared system prompts, so the same block hashes appear on several instances;
- a fixed-size block pool per instance with LRU eviction, so blocks are stored *and* removed;
- parent hashes chained block to block, as vLLM does;
- a few live messages of instance 0 lost on the wire (filled again from its replay buffer),
  a prefix-cache reset (AllBlocksCleared) on instance 1 and an engine restart of the last.

Ctrl+C stops everything cleanly; each tool prints its final summary first.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kvindex import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.wire import Event
from kvindex.wire.publisher import Publisher

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 16
COLORS = ["36", "33", "35", "32", "34", "31"]  # ANSI: one per child's prefix


# -- the workload ------------------------------------------------------------------------


def block_hash(parent: int | None, tokens: list[int]) -> int:
    """A chained block hash, an unsigned 64-bit int like vLLM's default on the wire."""
    data = (parent or 0).to_bytes(8, "big") + b"".join(t.to_bytes(4, "big") for t in tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def chain(tokens: list[int]) -> list[tuple[int, int | None, list[int]]]:
    """(hash, parent hash, tokens) of every full block of a prompt."""
    out: list[tuple[int, int | None, list[int]]] = []
    parent = None
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        block = tokens[start : start + BLOCK_SIZE]
        h = block_hash(parent, block)
        out.append((h, parent, block))
        parent = h
    return out


@dataclass
class BlockPool:
    """One engine's prefix cache: `capacity` blocks, least recently used evicted first."""

    capacity: int
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def run(self, tokens: list[int]) -> list[Event]:
        """Schedule a request: reuse its cached prefix, store the rest, evict to make room."""
        blocks = chain(tokens)
        hit = 0
        while hit < len(blocks) and blocks[hit][0] in self.lru:
            self.lru.move_to_end(blocks[hit][0])
            hit += 1
        new = blocks[hit:]
        events: list[Event] = [
            BlockRemoved([h], medium="GPU")  # one hash per event, as vLLM's GPU path
            for h in self._evict(len(new), protected={h for h, _, _ in blocks})
        ]
        if new:
            tokens_new = [t for _, _, block in new for t in block]
            events.append(
                BlockStored([h for h, _, _ in new], new[0][1], tokens_new, BLOCK_SIZE, medium="GPU")
            )
            self.lru.update((h, None) for h, _, _ in new)
        return events

    def _evict(self, room: int, protected: set[int]) -> list[int]:
        """Free `room` blocks, least recently used first, never one the request uses."""
        evicted: list[int] = []
        while len(self.lru) + room > self.capacity:
            victim = next((h for h in self.lru if h not in protected), None)
            if victim is None:
                break
            del self.lru[victim]
            evicted.append(victim)
        return evicted

    def clear(self) -> None:
        self.lru.clear()


class ChatWorkload:
    """Conversations on a few shared system prompts; each turn re-sends the whole history."""

    def __init__(self, instances: int, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.instances = instances
        self.systems = [self.tokens(n) for n in (96, 64, 160)]
        self.conversations: list[tuple[int, list[int]]] = []  # (instance, history)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(32_000) for _ in range(n)]

    def next_request(self) -> tuple[int, list[int]]:
        """(instance, prompt tokens) of the next request."""
        if not self.conversations or self.rng.random() < 0.3:
            system = self.rng.choice(self.systems)
            instance = self.rng.randrange(self.instances)
            self.conversations.append((instance, list(system)))
            self.conversations = self.conversations[-12:]  # users leave, eventually
        i = self.rng.randrange(len(self.conversations))
        instance, history = self.conversations[i]
        history += self.tokens(self.rng.randint(10, 60))  # the user's turn
        prompt = list(history)
        history += self.tokens(self.rng.randint(20, 80))  # the assistant's answer
        if len(history) > 480:  # long enough: this user is done
            del self.conversations[i]
        return instance, prompt


class Fleet:
    """Publishers driven by the workload on a background thread."""

    def __init__(self, instances: int, rate: float) -> None:
        # Instance 0 loses ~3% of its live messages on the wire (never the replay buffer).
        rng = random.Random(3)
        self.publishers = [
            Publisher(
                "tcp://127.0.0.1:*",
                "tcp://127.0.0.1:*",
                drop=(lambda seq: seq > 5 and rng.random() < 0.03) if i == 0 else None,
            )
            for i in range(instances)
        ]
        self.pools = [BlockPool(capacity=64) for _ in range(instances)]
        self.workload = ChatWorkload(instances)
        self.rate = rate
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def specs(self) -> list[str]:
        return [
            f"vllm-{i}={p.endpoint},replay={p.replay_endpoint}"
            for i, p in enumerate(self.publishers)
        ]

    def _run(self) -> None:
        step = 0
        while not self.stop.wait(1.0 / self.rate):
            step += 1
            instance, prompt = self.workload.next_request()
            events = self.pools[instance].run(prompt)
            if events:
                self.publishers[instance].publish(events)
            self._incidents(step)

    def _incidents(self, step: int) -> None:
        last = len(self.publishers) - 1
        if step == 60 and last >= 1:  # an operator resets the prefix cache of instance 1
            self.pools[1].clear()
            self.publishers[1].publish([AllBlocksCleared()])
        if step == 100 and last >= 2:  # the last engine restarts: seq 0, empty cache
            self.pools[last].clear()
            self.publishers[last].restart()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        for p in self.publishers:
            p.close()


# -- the tools following it --------------------------------------------------------------


def tool_commands(fleet: Fleet, duration: float, db: str) -> dict[str, list[str]]:
    py = sys.executable
    first = fleet.publishers[0]
    one = [first.endpoint, "--replay", str(first.replay_endpoint)]
    second = fleet.publishers[min(1, len(fleet.publishers) - 1)]
    stop = ["--duration", f"{duration:g}"]
    name = ["--name", "vllm-0"]
    every = ["--every", "3", *stop]
    instances = [arg for spec in fleet.specs() for arg in ("--instance", spec)]
    return {
        "watch": [py, "-m", "kvindex", "watch", *one, *name, *stop],
        "cache_stats": [py, str(HERE / "cache_stats.py"), *one, *name, *every],
        "sqlite_backup": [py, str(HERE / "sqlite_backup.py"), *one, *name, "--db", db, *every],
        "block_locations": [py, str(HERE / "block_locations.py"), *instances, "--top", "3", *every],
        "activity": [
            py,
            str(HERE / "activity_monitor.py"),
            second.endpoint,
            "--replay",
            str(second.replay_endpoint),
            "--name",
            "vllm-1",
            *every,
        ],
    }


def relay(name: str, color: str, stream: IO[str], lock: threading.Lock, tty: bool) -> None:
    """Print a child's output lines with its name in front."""
    prefix = f"\x1b[{color}m{name:>15}\x1b[0m │ " if tty else f"{name:>15} | "
    for line in stream:
        with lock:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()


def start_tools(
    commands: dict[str, list[str]], relays: list[threading.Thread]
) -> list[subprocess.Popen[str]]:
    tty = sys.stdout.isatty()
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    if tty:
        env["FORCE_COLOR"] = "1"  # keep rich's colours although the child writes to a pipe
    lock = threading.Lock()
    procs = []
    for (name, argv), color in zip(commands.items(), COLORS, strict=False):
        # Own session: Ctrl+C reaches the demo only, which then stops each child once.
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        assert proc.stdout is not None
        thread = threading.Thread(
            target=relay, args=(name, color, proc.stdout, lock, tty), daemon=True
        )
        thread.start()
        relays.append(thread)
        procs.append(proc)
    return procs


def stop_tools(procs: list[subprocess.Popen[str]], grace: float) -> None:
    """Wait for the tools to end by themselves; interrupt, then kill, the late ones."""
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # they print their summary on SIGINT
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=3, choices=range(1, 7))
    parser.add_argument("--duration", type=float, default=15.0, help="seconds (15)")
    parser.add_argument("--rate", type=float, default=12.0, help="requests per second (12)")
    args = parser.parse_args()

    fleet = Fleet(args.instances, args.rate)
    print("kvindex demo: simulated vLLM instances (PUB endpoint, replay endpoint):")
    for spec in fleet.specs():
        print(f"  {spec}")
    print(f"following them for {args.duration:g} s (Ctrl+C stops)\n", flush=True)
    relays: list[threading.Thread] = []
    with tempfile.TemporaryDirectory(prefix="kvindex-demo-") as tmp:
        procs = start_tools(tool_commands(fleet, args.duration, f"{tmp}/backup.sqlite"), relays)
        fleet.thread.start()
        try:
            stop_tools(procs, grace=args.duration + 5)
        except KeyboardInterrupt:
            # From here on a second Ctrl+C is ignored: stopping takes at most a few seconds.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            print("\nstopping…", flush=True)
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            stop_tools(procs, grace=5)
        finally:
            fleet.close()
            for thread in relays:  # the tools' last lines (their summaries) come through
                thread.join(timeout=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
