"""What the finders share: a stoppable thread with backoff, and the engine spec of an address."""

from __future__ import annotations

import abc
import logging
import threading

from kvindex.subscriber import InstanceSpec

__all__ = ["MAX_BACKOFF", "MIN_BACKOFF", "EngineOptions", "FinderThread", "log", "tcp"]

log = logging.getLogger("kvindex.discover")

MIN_BACKOFF = 0.5
MAX_BACKOFF = 30.0


def tcp(ip: str, port: int) -> str:
    """`IP:PORT`, an IPv6 address in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class EngineOptions:
    """How an address found becomes an InstanceSpec: ports, topic, DP size, model, HTTP."""

    __slots__ = ("dp", "http_port", "model", "replay_port", "topic")

    def __init__(
        self,
        *,
        replay_port: int | None,
        topic: str = "",
        dp: int = 1,
        model: str | None = None,
        http_port: int | None = None,
    ) -> None:
        self.replay_port = replay_port
        self.topic = topic
        self.dp = dp
        self.model = model
        self.http_port = http_port

    def spec(self, name: str, ip: str, port: int, replay_port: int | None) -> InstanceSpec:
        """The engine at `ip`: KV events on `port`, replay on `replay_port` (None: none)."""
        http = f"http://{tcp(ip, self.http_port)}" if self.http_port else None
        return InstanceSpec(
            name=name,
            endpoint=f"tcp://{tcp(ip, port)}",
            replay_endpoint=None if replay_port is None else f"tcp://{tcp(ip, replay_port)}",
            topic=self.topic,
            dp=self.dp,
            model=self.model,
            http=http,
        )


class FinderThread(abc.ABC):
    """A finder's loop on a daemon thread: `step()` runs until `stop()`; a failing step is
    retried with backoff (MIN_BACKOFF doubling to MAX_BACKOFF), its reason logged when it
    changes, never a flood."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.problem: str | None = None  # why the last step failed (None: it did not)
        self.failures = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvindex-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._interrupt()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep `seconds` unless stopped first (True: stopped)."""
        return self._stop.wait(seconds)

    def _run(self) -> None:
        backoff = MIN_BACKOFF
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # a finder never dies: it says why, and retries
                if self._stop.is_set():
                    return
                self.failures += 1
                why = self.describe(exc)
                if why != self.problem:
                    log.warning("%s: %s (retrying with backoff)", self.name, why)
                self.problem = why
                self.wait(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)
                continue
            if self.problem is not None:
                log.warning("%s: answering again", self.name)
            self.problem = None
            backoff = MIN_BACKOFF

    @abc.abstractmethod
    def step(self) -> None:
        """One round (a resolve then the wait, a list then a watch): raises on failure."""

    def describe(self, exc: Exception) -> str:
        return f"{type(exc).__name__}: {exc}"

    def _interrupt(self) -> None:
        """Wake a step blocked on I/O (a watch stream) when stopping (a waiting one wakes
        by the event alone)."""
        self._stop.set()
