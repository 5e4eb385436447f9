"""A real `dnsmasq` on 127.0.0.1 (a free port) serving names a test changes as it goes.

A records come from a hosts directory dnsmasq watches (inotify: a change is served at
once, TTL 0); SRV records are command-line options, so `srv()` restarts it on the same
port. `--local=/test/` makes it answer for `*.test` alone (NXDOMAIN / no answer for what
it does not hold, never a forward). Stopping it leaves the port silent: a server down."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from netutil import wait_until

from kvindex.cli.localdns import free_dns_port

DNSMASQ = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"


class Dnsmasq:
    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.hostsdir = workdir / "hosts"
        self.hostsdir.mkdir(parents=True, exist_ok=True)
        self.port = free_dns_port()
        self.srv_records: list[tuple[str, str, int]] = []  # (name, target, port)
        self.targets: dict[str, str] = {}  # SRV target -> IP
        self.proc: subprocess.Popen[bytes] | None = None
        self._generation = 0

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [
            DNSMASQ, "--keep-in-foreground", f"--port={self.port}",
            "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts",
            f"--hostsdir={self.hostsdir}", "--local-ttl=0", "--pid-file=", "--user=root",
            "--local=/test/", f"--log-facility={self.dir / 'dnsmasq.log'}", "--conf-file=/dev/null",
        ]  # fmt: skip
        argv += [f"--srv-host={n},{t},{p}" for n, t, p in self.srv_records]
        argv += [f"--host-record={t},{ip}" for t, ip in self.targets.items()]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        started = wait_until(lambda: self._answers() or self.proc.poll() is not None, 10)
        if self.proc.poll() is not None:
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            raise RuntimeError(f"dnsmasq exited at start: {err.strip()}")
        assert started, "dnsmasq did not answer in 10 s"

    def _answers(self) -> bool:
        import dns.message
        import dns.query

        try:
            query = dns.message.make_query("probe.test", "A")
            dns.query.udp(query, "127.0.0.1", timeout=0.2, port=self.port)
            return True
        except (OSError, dns.exception.Timeout):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def hosts(self, names: dict[str, list[str]]) -> None:
        """Serve exactly these A/AAAA records (name -> addresses) from now on."""
        self._generation += 1
        lines = [f"{ip} {name}" for name, ips in names.items() for ip in ips]
        new = self.dir / f"hosts.{self._generation}"
        new.write_text("\n".join(lines) + "\n", encoding="utf-8")
        new.rename(self.hostsdir / "fleet")  # dnsmasq reads it again when it moves in
        time.sleep(0.05)

    def srv(self, records: list[tuple[str, str, int]], targets: dict[str, str]) -> None:
        """Serve these SRV records (name, target, port) and targets' addresses: restarts."""
        self.srv_records, self.targets = list(records), dict(targets)
        self.stop()
        self.start()

    def __enter__(self) -> Dnsmasq:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
