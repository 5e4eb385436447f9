"""Soak: `kvindex serve` follows 3 engines at a steady rate for a while, with random faults
(drop bursts, engine restarts, replay outages); reports state exactness and memory.

    python scripts/soak.py [--seconds 300] [--rate 150]

Faults happen during the first 85% of the run. Then every engine restarts (an outage's
losses only last until the engine's next restart) and traffic goes on with drops only, so
at the end every instance must be `live` and hold exactly what its engine holds. The
service's RSS is sampled every 4 s: the last quarter's median must stay within 25% (+20
MB) of the second quarter's. Exit code 0 only if both hold.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from service_workload import Conversation, RefRank  # noqa: E402

from kvindex.wire import render_hash  # noqa: E402
from kvindex.wire.publisher import Publisher  # noqa: E402

CACHE_BLOCKS = 1500  # per engine: evict beyond this, like a full GPU pool


class Engine:
    def __init__(self, name: str, rng: random.Random) -> None:
        self.name = name
        self.rng = rng
        self.ref = RefRank(Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=5000))
        self.convs = [Conversation(rng, i) for i in range(8)]
        self.turns = 0
        self.drop_rate = 0.0
        self.ref.pub.drop = lambda seq: self.rng.random() < self.drop_rate

    @property
    def spec(self) -> str:
        pub = self.ref.pub
        return f"{self.name}={pub.endpoint},replay={pub.replay_endpoint}"

    def step(self) -> None:
        i = self.rng.randrange(len(self.convs))
        if len(self.convs[i].tokens) > 400:  # a finished conversation makes room for a new one
            self.turns += 1
            self.convs[i] = Conversation(self.rng, 1000 + self.turns)
        prompt = self.convs[i].next_prompt()
        self.ref.serve(prompt)
        if self.rng.random() < 0.2:
            self.ref.copy_again(prompt)
        self.ref.evict(self.rng, max(0, sum(self.ref.gpu.values()) - CACHE_BLOCKS))

    def held(self) -> set[str]:
        return {render_hash(h) for h in self.ref.held()}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def healthy(client: httpx.Client) -> bool:
    for _ in range(3):  # a keep-alive connection the server just closed is no failure
        try:
            return client.get("/healthz").status_code == 200
        except httpx.TransportError:
            time.sleep(0.1)
    return False


def start_service(engines: list[Engine]) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--store", "memory"]
    for e in engines:
        cmd += ["--instance", e.spec]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        raise SystemExit(f"serve did not start: {line!r}")
    return proc, line.split("listening on ")[1].split()[0]


class Faults:
    """At most one fault at a time, each lasting a few seconds."""

    def __init__(self, engines: list[Engine], rng: random.Random) -> None:
        self.engines, self.rng = engines, rng
        self.until = 0.0
        self.active: Engine | None = None
        self.counts = {"drops": 0, "restart": 0, "outage": 0}

    def end(self) -> None:
        if self.active is not None:
            self.active.drop_rate, self.active.ref.pub.replay_paused = 0.02, False
            self.active = None

    def tick(self, now: float) -> None:
        if self.active is not None and now >= self.until:
            self.end()
        if self.active is None and self.rng.random() < 0.02:
            engine = self.active = self.rng.choice(self.engines)
            kind = self.rng.choice(list(self.counts))
            self.counts[kind] += 1
            self.until = now + self.rng.uniform(1, 4)
            if kind == "drops":
                engine.drop_rate = 0.3
            elif kind == "restart":
                engine.ref.restart()
            else:  # the replay socket hangs while batches are dropped: real losses
                engine.ref.pub.replay_paused, engine.drop_rate = True, 0.05


def run(seconds: float, rate: float) -> int:
    rng = random.Random(2024)
    engines = [Engine(f"vllm-{i}", rng) for i in range(3)]
    for e in engines:
        e.drop_rate = 0.02
    proc, url = start_service(engines)
    faults = Faults(engines, rng)
    samples: list[tuple[float, float]] = []
    started = time.monotonic()
    fault_end = started + 0.85 * seconds
    next_sample, settled = started, False
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            while (now := time.monotonic()) < started + seconds:
                if now < fault_end:
                    faults.tick(now)
                elif not settled:
                    settled = True
                    faults.end()
                    for e in engines:
                        e.ref.restart()  # losses of the fault phase end with this epoch
                rng.choice(engines).step()
                if now >= next_sample:
                    next_sample += 4
                    samples.append((now - started, rss_mb(proc.pid)))
                    assert healthy(client), "service unhealthy"
                time.sleep(max(0.0, 1 / rate - (time.monotonic() - now)))
            return report(client, engines, faults, samples)
    finally:
        proc.terminate()
        proc.wait(10)
        for e in engines:
            e.ref.pub.close()


def report(
    client: httpx.Client,
    engines: list[Engine],
    faults: Faults,
    samples: list[tuple[float, float]],
) -> int:
    for e in engines:
        e.drop_rate = 0.0
        e.ref.pub.publish([])  # the tail becomes visible
    deadline = time.monotonic() + 60
    exact: dict[str, bool] = {}
    while time.monotonic() < deadline:
        rows = {i["name"]: i for i in client.get("/v1/instances").json()["instances"]}
        for e in engines:
            blocks = set(client.get(f"/v1/instances/{e.name}/blocks").json()["block_hashes"])
            live = rows[e.name]["status"] == "live"
            exact[e.name] = live and rows[e.name]["last_seq"] == e.ref.pub.next_seq - 1
            exact[e.name] &= blocks == e.held()
        if all(exact.values()):
            break
        time.sleep(0.5)
    stats = client.get("/v1/stats").json()
    quarter = max(1, len(samples) // 4)
    early = statistics.median(r for _, r in samples[quarter : 2 * quarter] or samples)
    late = statistics.median(r for _, r in samples[-quarter:])
    flat = late <= early * 1.25 + 20
    print(f"faults: {faults.counts}; batches applied: {stats['batches']}")
    lost, restarts = stats["lost_batches"], stats["publisher_restarts"]
    print(f"lost batches (fault phase): {lost}, engine restarts seen: {restarts}")
    for e in engines:
        print(f"{e.name}: {'exact' if exact.get(e.name) else 'NOT EXACT'} ({len(e.held())} blocks)")
    print("RSS MB (t, rss): " + ", ".join(f"{t:.0f}s {r:.0f}" for t, r in samples))
    print(f"memory: {early:.1f} MB -> {late:.1f} MB ({'flat' if flat else 'GROWING'})")
    ok = all(exact.values()) and flat
    print("soak: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--rate", type=float, default=150, help="batches per second, total")
    args = parser.parse_args()
    sys.exit(run(args.seconds, args.rate))


if __name__ == "__main__":
    main()
