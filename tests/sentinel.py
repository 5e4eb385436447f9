"""Redis with failover, for real: a `redis-server` primary, one replica, and three
`redis-sentinel` processes on free loopback ports (Debian's packages redis-server and
redis-sentinel), the master named `kvtest`. `kill_master()` SIGKILLs the primary;
`master_port()` asks a Sentinel which server is the master now."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from netutil import free_port, wait_until

MASTER = "kvtest"


def _command(port: int, *words: str, timeout: float = 0.5) -> bytes:
    """One RESP command to 127.0.0.1:port, its raw reply (b"" if none)."""
    request = f"*{len(words)}\r\n".encode()
    for word in words:
        request += f"${len(word.encode())}\r\n{word}\r\n".encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(request)
            time.sleep(0.02)
            return s.recv(4096)
    except OSError:
        return b""


class SentinelCluster:
    def __init__(self, workdir: Path, down_after_ms: int = 500) -> None:
        self.server = shutil.which("redis-server")
        self.sentinel = shutil.which("redis-sentinel")
        if self.server is None or self.sentinel is None:
            pytest.skip("redis-server / redis-sentinel are not installed")
        self.dir = workdir
        self.ports = [free_port(), free_port()]  # primary, replica
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.down_after_ms = down_after_ms
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER}/0"

    def start(self) -> None:
        primary, replica = self.ports
        self.start_server(primary)
        self.start_server(replica, replica_of=primary)
        for port in self.sentinel_ports:
            conf = self.dir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.dir}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}\n"
                f"sentinel failover-timeout {MASTER} 5000\n"
                f"sentinel parallel-syncs {MASTER} 1\n",
                encoding="utf-8",
            )
            log = self.dir / f"sentinel-{port}.log"
            self.procs[port] = subprocess.Popen(
                [self.sentinel, str(conf), "--logfile", str(log)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        assert wait_until(lambda: all(self._sees_replica(p) for p in self.sentinel_ports), 20)

    def _sees_replica(self, sentinel_port: int) -> bool:
        reply = _command(sentinel_port, "SENTINEL", "REPLICAS", MASTER)
        return str(self.ports[1]).encode() in reply and b"master_link_down" not in reply

    def start_server(self, port: int, replica_of: int | None = None, fresh: bool = False) -> None:
        data = self.dir / f"redis-{port}"
        if fresh and data.exists():
            shutil.rmtree(data)
        data.mkdir(exist_ok=True)
        args = [self.server or "", "--port", str(port), "--bind", "127.0.0.1"]
        args += ["--dir", str(data), "--appendonly", "yes", "--save", ""]
        args += ["--protected-mode", "no", "--logfile", str(data / "redis.log")]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        assert wait_until(lambda: _command(port, "PING").startswith(b"+PONG"), 10)

    def master_port(self) -> int | None:
        for port in self.sentinel_ports:
            reply = _command(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
            lines = reply.split(b"\r\n")
            if len(lines) >= 5 and lines[4].isdigit():
                return int(lines[4])
        return None

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(5)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        self.procs.clear()
