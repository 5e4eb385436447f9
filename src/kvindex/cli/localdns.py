"""A real `dnsmasq` on 127.0.0.1 that names the demo's engines (`kvindex demo`).

The demo finds its simulated vLLM engines as a fleet's are found: through DNS
(`--discover dns:...`). The name `_kvevents._tcp.demo.kvindex.test` has one SRV record per
engine (its target `NAME.demo.kvindex.test` -> 127.0.0.1, its port the engine's KV-event
port); `--local=/kvindex.test/` keeps every other name unanswered, never forwarded.
SRV records are command-line options, so `publish()` restarts dnsmasq on the same port
(the finder sees one unanswered round at most: the engines stay followed meanwhile).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["SRV_NAME", "LocalDns", "dnsmasq_binary", "free_dns_port"]

SRV_NAME = "_kvevents._tcp.demo.kvindex.test"
DOMAIN = "demo.kvindex.test"


def dnsmasq_binary() -> str | None:
    """dnsmasq (Debian's dnsmasq-base), if installed."""
    found = shutil.which("dnsmasq")
    if found is None and Path("/usr/sbin/dnsmasq").exists():
        found = "/usr/sbin/dnsmasq"
    return found


def free_dns_port() -> int:
    """A loopback port free for UDP and TCP both (dnsmasq listens on both)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket() as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise OSError("no loopback port free for UDP and TCP")


class LocalDns:
    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_dns_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvindex-demo-dns-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.engines: dict[str, int] = {}

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def publish(self, engines: dict[str, int]) -> None:
        """Serve exactly these engines (name -> KV-event port) from now on."""
        self.engines = dict(engines)
        self._stop()
        argv = [
            self.binary, "--keep-in-foreground", f"--port={self.port}",
            "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts",
            "--local-ttl=0", "--pid-file=", "--conf-file=/dev/null", "--local=/kvindex.test/",
            f"--log-facility={self.dir / 'dnsmasq.log'}",
        ]  # fmt: skip
        for name, port in sorted(self.engines.items()):
            argv.append(f"--srv-host={SRV_NAME},{name}.{DOMAIN},{port}")
            argv.append(f"--host-record={name}.{DOMAIN},127.0.0.1")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._answers():
                return
            time.sleep(0.02)
        exited = self.proc.poll() is not None and self.proc.stderr is not None
        err = self.proc.stderr.read().decode() if exited and self.proc.stderr else ""
        self._stop()
        raise OSError(f"dnsmasq did not start: {err.strip() or 'no answer in 5 s'}")

    def _answers(self) -> bool:
        import dns.exception
        import dns.message
        import dns.query

        try:
            query = dns.message.make_query(SRV_NAME, "SRV")
            dns.query.udp(query, "127.0.0.1", timeout=0.2, port=self.port)
            return True
        except (OSError, dns.exception.Timeout):
            return False

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def close(self) -> None:
        self._stop()
        shutil.rmtree(self.dir, ignore_errors=True)
