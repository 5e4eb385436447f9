"""`SimulatedPublishers`: a `Simulation` published on the real wire, at a target rate.

Each engine (instance, DP rank) gets a vLLM-compatible publisher: PUB for live batches and
a ROUTER for replay, rank r on port + r as vLLM binds them. Instance i uses PUB ports
`base + 2 * dp * i + r` and replay ports `base + 2 * dp * i + dp + r`, so with `dp=1` the
first instance sits on vLLM's usual 5557/5558. The replay reply layout follows the wire
format (3 frames for 0.23, 4 for 0.33).

An engine restart is what it looks like on the wire: the instance's publishers are closed
and new ones bound on the same ports, with seq back at 0 and an empty replay buffer.

A background thread publishes; `reference()` and `recent_prompts()` may be called from
other threads (a lock guards the simulation).
"""

from __future__ import annotations

import random
import socket
import threading
import time
from typing import Any

import zmq

from kvindex.sim.simulation import Reference, SimBatch, SimConfig, SimItem, Simulation
from kvindex.subscriber import InstanceSpec
from kvindex.wire.publisher import Publisher

__all__ = ["PortsBusy", "SimulatedPublishers", "free_port_run"]

_BIND_RETRY_SECONDS = 3.0


class PortsBusy(OSError):
    """The ports asked for (or a run of free ones) could not be had."""


def free_port_run(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A base port with `count` consecutive ports free on `host` (checked by binding)."""
    for _ in range(attempts):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = int(probe.getsockname()[1])
        if base + count >= 65535:
            continue
        if _all_free(host, base, count):
            return base
    raise PortsBusy(f"no run of {count} free ports on {host}")


def _all_free(host: str, base: int, count: int) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in range(base, base + count):
            s = socket.socket()
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


class SimulatedPublishers:
    """Publishes a simulated fleet over ZeroMQ from a background thread."""

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        rate: float = 20.0,
        host: str = "127.0.0.1",
        base_port: int | None = None,
        drop: float = 0.0,
        buffer_steps: int = 10_000,
    ) -> None:
        self.config = config = config or SimConfig()
        if rate <= 0:
            raise ValueError("rate must be positive")
        if not 0.0 <= drop < 1.0:
            raise ValueError("drop must be in [0, 1)")
        self.sim = Simulation(config, clock=time.time)
        self.rate = rate
        self.host = host
        self.drop = drop
        self.buffer_steps = buffer_steps
        ports = 2 * config.dp * config.instances
        self.base_port = base_port or free_port_run(ports, host)
        if self.base_port + ports > 65536:
            raise PortsBusy(f"{ports} ports from {self.base_port} run past 65535")
        self._drop_rng = random.Random(config.seed + 1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.published = 0
        self.publishers: list[Publisher] = []
        try:
            for engine in self.sim.engines:
                self.publishers.append(self._bind(engine.instance, engine.index % config.dp))
        except BaseException:
            self.close()
            raise

    # -- endpoints -----------------------------------------------------------------------

    def _ports(self, instance: int) -> tuple[int, int]:
        dp = self.config.dp
        pub = self.base_port + 2 * dp * instance
        return pub, pub + dp

    def _endpoint(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{port}"

    def specs(self) -> list[InstanceSpec]:
        """One spec per instance, as `kvindex serve --instance` takes them."""
        out = []
        for i in range(self.config.instances):
            pub, replay = self._ports(i)
            out.append(
                InstanceSpec(
                    name=self.config.name(i),
                    endpoint=self._endpoint(pub),
                    replay_endpoint=self._endpoint(replay),
                    dp=self.config.dp,
                )
            )
        return out

    def _bind(self, instance: int, rank: int, *, retry: bool = False) -> Publisher:
        """The publisher of one engine; `retry` (a restart) waits a little for the ports
        its predecessor just released."""
        pub, replay = self._ports(instance)
        deadline = time.monotonic() + (_BIND_RETRY_SECONDS if retry else 0.0)
        while True:
            try:
                return Publisher(
                    self._endpoint(pub + rank),
                    self._endpoint(replay + rank),
                    buffer_steps=self.buffer_steps,
                    reply_layout=3 if self.config.format == "0.23" else 4,
                    dp_rank=rank,
                    drop=self._dropper() if self.drop else None,
                )
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    raise PortsBusy(
                        f"can't bind port {pub + rank} or {replay + rank}: {exc}"
                    ) from None
                time.sleep(0.02)

    def _dropper(self) -> Any:
        rng = self._drop_rng
        drop = self.drop
        return lambda seq: seq > 0 and rng.random() < drop

    # -- running -------------------------------------------------------------------------

    def start(self) -> None:
        """Publish from a background thread at `rate` batches per second (fleet-wide)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="kvindex-sim", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop publishing (the publishers stay bound: replay requests are still answered)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def close(self) -> None:
        self.stop()
        for publisher in self.publishers:
            publisher.close()
        self.publishers = []

    def __enter__(self) -> SimulatedPublishers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        interval = 1.0 / self.rate
        next_at = time.monotonic()
        while not self._stop.is_set():
            if not self.publish_one():
                continue
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
            elif delay < -1.0:
                next_at = time.monotonic()  # far behind: don't burst to catch up

    def publish_one(self) -> bool:
        """Advance the simulation by one item and put it on the wire; True for a batch."""
        with self._lock:
            item = self.sim.next_item()
            self._send(item)
        return isinstance(item, SimBatch)

    def publish(self, batches: int) -> None:
        """Publish `batches` batches now, as fast as possible (tests, benchmarks)."""
        done = 0
        while done < batches:
            done += self.publish_one()

    def _send(self, item: SimItem) -> None:
        if isinstance(item, SimBatch):
            index = self.sim.names.index(item.instance) * self.config.dp + item.rank
            self.publishers[index].publish_payload(item.payload)
            self.published += 1
            return
        instance = self.sim.names.index(item.instance)
        for rank in range(self.config.dp):
            index = instance * self.config.dp + rank
            self.publishers[index].close()
            self.publishers[index] = self._bind(instance, rank, retry=True)

    # -- for tests and the dashboard -----------------------------------------------------

    def reference(self) -> Reference:
        with self._lock:
            return self.sim.reference()

    def recent_prompts(self, limit: int = 12) -> list[dict[str, Any]]:
        with self._lock:
            return self.sim.recent_prompts(limit)

    def next_seqs(self) -> dict[tuple[str, int], int]:
        """Per (instance, rank), the seq its next batch will get."""
        with self._lock:
            return {
                (self.config.name(i // self.config.dp), i % self.config.dp): p.next_seq
                for i, p in enumerate(self.publishers)
            }
