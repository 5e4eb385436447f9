"""`SimulatedPublishers`: a `Simulation` published on the real wire, at a target rate.

Each engine (instance, DP rank) gets a vLLM-compatible publisher: PUB for live batches and
a ROUTER for replay, rank r on port + r as vLLM binds them. Instance i uses PUB ports
`base + 2 * dp * i + r` and replay ports `base + 2 * dp * i + dp + r`, so with `dp=1` the
first instance sits on vLLM's usual 5557/5558. The replay reply layout follows the wire
format (3 frames for 0.23, 4 for 0.33).

An engine restart is what it looks like on the wire: the instance's publishers are closed
and new ones bound on the same ports, with seq back at 0 and an empty replay buffer.

With the `sglang` format each instance is an SGLang 0.5.23 engine: besides its PUB and
replay ports (`base + (3 * dp + 1) * i`, replay `+ dp`), a load PUB per rank (`+ 2 * dp`)
sending `LoadStat` as SGLang's `SchedulerLoadPublisher` does (`[b"load", seq, payload]`,
on every batch of that rank and at least once a second), and an HTTP server (`+ 3 * dp`)
whose `GET /server_info` carries the `kv_events` descriptor SGLang advertises: its spec is
`NAME=sglang+http://HOST:PORT`, found by discovery as a real engine is.

A background thread publishes; `reference()` and `recent_prompts()` may be called from
other threads (a lock guards the simulation).
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import zmq

from kvindex.sim.engine import Engine
from kvindex.sim.simulation import Reference, SimBatch, SimConfig, SimItem, Simulation
from kvindex.subscriber import InstanceSpec
from kvindex.wire.engine_load import LOAD_TOPIC, LoadStat, encode_load
from kvindex.wire.frames import encode_seq
from kvindex.wire.publisher import Publisher

__all__ = ["PortsBusy", "SimulatedPublishers", "free_port_run"]

_BIND_RETRY_SECONDS = 3.0
_LOAD_HEARTBEAT = 1.0  # SGLang's LOAD_PUBLISH_HEARTBEAT_S
SGLANG_VERSION = "0.5.23"  # the release whose wire and /server_info the simulator speaks


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
        ports = self._stride * config.instances
        self.base_port = base_port or free_port_run(ports, host)
        if self.base_port + ports > 65536:
            raise PortsBusy(f"{ports} ports from {self.base_port} run past 65535")
        self._drop_rng = random.Random(config.seed + 1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.published = 0
        self.publishers: list[Publisher] = []
        self.load_sockets: list[zmq.Socket[bytes]] = []  # SGLang: one per engine
        self._load_seqs: list[int] = []
        self._load_sent = 0.0  # monotonic time of the last heartbeat round
        self._http: list[ThreadingHTTPServer] = []  # SGLang: one per instance
        try:
            for engine in self.sim.engines:
                self.publishers.append(self._bind(engine.instance, engine.index % config.dp))
            if config.is_sglang:
                self._open_sglang()
        except BaseException:
            self.close()
            raise

    # -- endpoints -----------------------------------------------------------------------

    @property
    def _stride(self) -> int:
        """Ports per instance: PUB and replay per rank (and SGLang's load per rank + HTTP)."""
        dp = self.config.dp
        return 3 * dp + 1 if self.config.is_sglang else 2 * dp

    def _ports(self, instance: int) -> tuple[int, int]:
        dp = self.config.dp
        pub = self.base_port + self._stride * instance
        return pub, pub + dp

    def _sglang_ports(self, instance: int) -> tuple[int, int]:
        """An SGLang instance's load port base and HTTP port."""
        pub, _ = self._ports(instance)
        return pub + 2 * self.config.dp, pub + 3 * self.config.dp

    def _endpoint(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{port}"

    def specs(self) -> list[InstanceSpec]:
        """One spec per instance, as `kvindex serve --instance` takes them (an SGLang one
        by its URL: discovery reads its ports)."""
        out = []
        host = f"[{self.host}]" if ":" in self.host else self.host
        for i in range(self.config.instances):
            if self.config.is_sglang:
                url = f"sglang+http://{host}:{self._sglang_ports(i)[1]}"
                out.append(InstanceSpec.parse(f"{self.config.name(i)}={url}"))
                continue
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
        for sock in self.load_sockets:
            sock.close(linger=0)
        self.load_sockets = []
        for server in self._http:
            server.shutdown()
            server.server_close()
        self._http = []

    def __enter__(self) -> SimulatedPublishers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        interval = 1.0 / self.rate
        next_at = time.monotonic()
        while not self._stop.is_set():
            if self.load_sockets and time.monotonic() - self._load_sent >= _LOAD_HEARTBEAT:
                with self._lock:
                    self._heartbeat()
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
            if self.load_sockets:
                self._send_load(index)
                if time.monotonic() - self._load_sent >= _LOAD_HEARTBEAT:
                    self._heartbeat()
            return
        instance = self.sim.names.index(item.instance)
        for rank in range(self.config.dp):
            index = instance * self.config.dp + rank
            self.publishers[index].close()
            self.publishers[index] = self._bind(instance, rank, retry=True)

    # -- SGLang: load stream and /server_info ---------------------------------------------

    def _open_sglang(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        for engine in self.sim.engines:
            load_base, _ = self._sglang_ports(engine.instance)
            sock = ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 64)
            self.load_sockets.append(sock)
            self._load_seqs.append(0)
            port = load_base + engine.index % self.config.dp
            try:
                sock.bind(self._endpoint(port))
            except zmq.ZMQError as exc:
                raise PortsBusy(f"can't bind port {port}: {exc}") from None
        for i in range(self.config.instances):
            self._http.append(self._serve_http(i))

    def server_info(self, instance: int) -> dict[str, Any]:
        """What SGLang's `GET /server_info` says that matters here: `kv_events` is
        `describe_kv_events_publisher`'s descriptor, its keys in SGLang's order."""
        cfg = self.config
        pub, replay = self._ports(instance)
        load, _ = self._sglang_ports(instance)
        descriptor: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint_host": self.host,
            "endpoint_port_base": pub,
            "topic": "",
            "block_size": cfg.block_size,
            "dp_size": cfg.dp,
            "load_endpoint_port_base": load,
            "load_topic": LOAD_TOPIC,
            "replay_endpoint_port_base": replay,
        }
        return {
            "model_path": "kvindex-sim",
            "page_size": cfg.block_size,
            "dp_size": cfg.dp,
            "version": SGLANG_VERSION,
            "kv_events": descriptor,
        }

    def _serve_http(self, instance: int) -> ThreadingHTTPServer:
        _, port = self._sglang_ports(instance)
        body = json.dumps(self.server_info(instance)).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, answer = (200, body) if self.path == "/server_info" else (404, b"{}")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass  # a quiet engine: the simulator prints its own lines

        try:
            server = ThreadingHTTPServer((self.host, port), Handler)
        except OSError as exc:
            raise PortsBusy(f"can't bind port {port}: {exc}") from None
        server.daemon_threads = True
        name = f"kvindex-sim-http-{instance}"
        threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
        return server

    def load_stat(self, engine: Engine) -> LoadStat:
        """The engine's load now, as SGLang's scheduler reports it (tokens are KV slots)."""
        spec = engine.spec
        used = engine.used_blocks * spec.block_size
        waiting = sum(len(r.tokens) for r in engine.waiting)
        return LoadStat(
            num_running_reqs=len(engine.running),
            num_waiting_reqs=len(engine.waiting),
            num_tokens=used,
            max_total_num_tokens=spec.gpu_blocks * spec.block_size,
            attn_dp_rank=engine.index % self.config.dp,
            num_waiting_uncached_tokens=waiting,
            num_total_tokens=used + waiting,
            max_running_requests=spec.max_running,
        )

    def _send_load(self, index: int) -> None:
        payload = encode_load(self.load_stat(self.sim.engines[index]))
        seq = self._load_seqs[index]
        self._load_seqs[index] = seq + 1
        try:
            self.load_sockets[index].send_multipart(
                [LOAD_TOPIC.encode(), encode_seq(seq), payload], zmq.NOBLOCK
            )
        except zmq.Again:
            pass  # a gauge: a slow reader gets the next one

    def _heartbeat(self) -> None:
        """Every rank's load again (SGLang re-sends an unchanged gauge every second)."""
        self._load_sent = time.monotonic()
        for index in range(len(self.load_sockets)):
            self._send_load(index)

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
