"""A stand-in SGLang engine for discovery tests: real HTTP and real ZMQ on loopback.

`FakeSGLang` answers `GET /server_info` as SGLang 0.5.23 does (`kv_events`, the descriptor
of `describe_kv_events_publisher`, or `null` with publishing off; `Authorization: Bearer`
checked when it has an API key), and runs one KV-event publisher per DP rank (PUB +
replay ROUTER, `kvindex.wire.publisher.Publisher`) and, if asked, one load PUB per rank
sending `[b"load", seq, msgpack LoadStat]` as SGLang's `SchedulerLoadPublisher` does.

Faults are real: the HTTP server is not listening until `start_http` (an engine down at
start), `stop_http` closes its socket, `restart` moves the publishers to new ports (seqs
from 0) and the descriptor with them, `answer_raw` makes it answer anything at all.
"""

from __future__ import annotations

import errno
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import zmq
from netutil import free_port, free_ports

from kvindex.wire.publisher import Publisher

__all__ = ["FakeSGLang", "load_stat"]


def load_stat(
    running: int,
    waiting: int,
    tokens: int,
    capacity: int,
    rank: int,
    *,
    max_running: int = 64,
    extra: tuple[int, ...] = (0, 0, 0, 0),
) -> bytes:
    """SGLang 0.5.23's `LoadStat` as its publisher encodes it: a tagged positional array,
    `["LoadStat", num_running_reqs, num_waiting_reqs, num_tokens, max_total_num_tokens,
    attn_dp_rank, num_waiting_uncached_tokens, num_total_tokens, max_running_requests,
    total_prefill_uncached_tokens, total_prefill_busy_us]`."""
    waiting_uncached, total_tokens, prefill_tokens, busy_us = extra
    fields = [running, waiting, tokens, capacity, rank, waiting_uncached, total_tokens]
    fields += [max_running, prefill_tokens, busy_us]
    return msgspec.msgpack.encode(["LoadStat", *fields])


class FakeSGLang:
    """One SGLang engine: its HTTP server and its publishers (see the module doc)."""

    def __init__(self, *, api_key: str | None = None, host: str = "*") -> None:
        self.http_port = free_port()
        self.api_key = api_key
        self.endpoint_host = host  # what /server_info advertises (a wildcard by default)
        self.publishing = True  # False: `kv_events: null` (no --kv-events-config)
        self.raw: bytes | None = None  # answer these bytes instead of /server_info
        self.status = 200
        self.requests = 0
        self.publishers: list[Publisher] = []
        self.load_sockets: list[zmq.Socket[bytes]] = []
        self.descriptor: dict[str, Any] = {}
        self._load_seq = 0
        self._load_base = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"sglang+http://127.0.0.1:{self.http_port}"

    # -- HTTP ------------------------------------------------------------------------------

    def start_http(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.requests += 1
                if self.path != "/server_info":
                    self._send(404, b'{"detail": "Not Found"}')
                    return
                wanted = None if fake.api_key is None else f"Bearer {fake.api_key}"
                if wanted is not None and self.headers.get("Authorization") != wanted:
                    self._send(401, b'{"error": "Unauthorized"}')
                    return
                if fake.raw is not None:
                    self._send(fake.status, fake.raw)
                    return
                self._send(fake.status, json.dumps(fake.server_info()).encode())

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.http_port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop_http(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def server_info(self) -> dict[str, Any]:
        """What SGLang's /server_info holds that matters here (and some that does not)."""
        return {
            "model_path": "fake/model",
            "page_size": self.descriptor.get("block_size", 16),
            "kv_events": dict(self.descriptor) if self.publishing else None,
            "version": "0.5.23",
        }

    # -- publishers --------------------------------------------------------------------------

    def start_publishers(
        self,
        dp: int = 1,
        *,
        replay: bool = True,
        load: bool = False,
        block_size: int = 16,
        spare: int = 0,
    ) -> None:
        """`spare`: ranks the port runs leave room for (`add_rank`, `start_load`). A port
        found free can be taken before it is bound (a serve's outgoing connections take
        ephemeral ports): then the runs are picked again."""
        for attempt in range(5):
            base = free_ports(dp + spare)
            replay_base = free_ports(dp + spare) if replay else None
            self._load_base = free_ports(dp + spare)
            try:
                for rank in range(dp):
                    replay_at = None if replay_base is None else replay_base + rank
                    self.publishers.append(
                        Publisher(
                            f"tcp://127.0.0.1:{base + rank}",
                            None if replay_at is None else f"tcp://127.0.0.1:{replay_at}",
                            dp_rank=rank,
                        )
                    )
                break
            except zmq.ZMQError as exc:
                self.stop_publishers()  # those bound before the one that failed
                if exc.errno != errno.EADDRINUSE or attempt == 4:
                    raise
        self.descriptor = {
            "publisher": "zmq",
            "endpoint_host": self.endpoint_host,
            "endpoint_port_base": base,
            "topic": "",
            "block_size": block_size,
            "dp_size": dp,
        }
        if replay_base is not None:
            self.descriptor["replay_endpoint_port_base"] = replay_base
        if load:
            self.start_load()

    def start_load(self) -> None:
        """Switch the load stream on: a load PUB per rank, advertised (no restart)."""
        for rank in range(len(self.publishers)):
            sock = zmq.Context.instance().socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"tcp://127.0.0.1:{self._load_base + rank}")
            self.load_sockets.append(sock)
        self.descriptor["load_endpoint_port_base"] = self._load_base
        self.descriptor["load_topic"] = "load"

    def add_rank(self) -> Publisher:
        """One more DP rank at base + rank, advertised (the others untouched: no restart)."""
        rank = len(self.publishers)
        replay = self.descriptor.get("replay_endpoint_port_base")
        pub = Publisher(
            f"tcp://127.0.0.1:{self.descriptor['endpoint_port_base'] + rank}",
            None if replay is None else f"tcp://127.0.0.1:{replay + rank}",
            dp_rank=rank,
        )
        self.publishers.append(pub)
        self.descriptor["dp_size"] = rank + 1
        return pub

    def drop_ranks(self, dp: int) -> None:
        """Keep only the first `dp` ranks, advertised so (the others closed)."""
        for pub in self.publishers[dp:]:
            pub.close()
        del self.publishers[dp:]
        self.descriptor["dp_size"] = dp

    def stop_publishers(self) -> None:
        for pub in self.publishers:
            pub.close()
        for sock in self.load_sockets:
            sock.close(linger=0)
        self.publishers, self.load_sockets = [], []

    def restart(self, dp: int | None = None, **options: Any) -> None:
        """A new engine process: new publishers on new ports, seqs from 0, and /server_info
        down meanwhile."""
        dp = len(self.publishers) if dp is None else dp
        self.stop_http()
        self.stop_publishers()
        self.start_publishers(dp, **options)
        self.start_http()

    def publish_load(self, rank: int, payload: bytes) -> None:
        self.load_sockets[rank].send_multipart(
            [b"load", self._load_seq.to_bytes(8, "big"), payload]
        )
        self._load_seq += 1

    def close(self) -> None:
        self.stop_http()
        self.stop_publishers()

    def __enter__(self) -> FakeSGLang:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
