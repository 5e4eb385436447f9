"""Engines named by their URL (`NAME=sglang+http://HOST:PORT`): found, and found again.

`Discovery` keeps, for every such engine, what its `/server_info` last said, and reads it
on its own thread (an HTTP request must never hold up ingest or an answer):

- at once for an engine added without its publishers (`InstanceSpec.pending`); until a
  read succeeds the engine is `connecting` (it has no ranks yet) and its problem says why
  (one warning line in the log when the problem appears or changes, never a flood);
- again when the engine restarted (its seq went back), its link went down or can't be
  followed: a restarted engine may publish on new ports. Reads back off on failure
  (1 s, doubling to a minute) and stop at the first success;
- and every `interval` seconds while all is well (30 s by default; 0: never): an engine
  reconfigured without a restart kvindex could see (its load stream switched on, DP ranks
  added) is followed within that time;
- whatever a read finds that differs from what is followed (ports, ranks, topic, load
  stream) is handed to `apply` (the Fleet follows the new publishers in the old ones'
  place).

Nothing here is ever fatal: a configuration mistake (no KV events, an API key refused)
is shown as the engine's problem and retried slowly, since the engine may be restarted
with the right flags; `kvindex serve` checks for those at start (`first_read`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvindex.subscriber import InstanceSpec
from kvindex.subscriber.server_info import (
    DiscoveryError,
    KvEventsDescriptor,
    fetch_descriptor,
    resolve,
)

__all__ = ["DEFAULT_INTERVAL", "Discovery", "DiscoveryView", "first_read"]

log = logging.getLogger(__name__)

Fetch = Callable[[InstanceSpec], KvEventsDescriptor]
MIN_BACKOFF = 1.0
MAX_BACKOFF = 60.0
MIN_INTERVAL = 1.0  # two reads of one engine at least this far apart
DEFAULT_INTERVAL = 30.0  # seconds between two reads of an engine that is well


class DiscoveryView(msgspec.Struct, frozen=True, gc=False):
    """What `/v1/instances` shows of how an engine named by its URL was found."""

    url: str  # its /server_info
    resolved: bool  # its publishers are known (and followed)
    problem: str | None  # why the last read gave none (the publishers followed stay)
    block_size: int | None  # as the engine advertises it (its page size)
    load_stream: bool  # it advertises a load stream (and kvindex follows it)
    reads: int
    failures: int
    last_read: float | None  # wall time of the last successful read


def first_read(spec: InstanceSpec, timeout: float = 3.0) -> InstanceSpec:
    """Read an engine's publishers once, now; raises `DiscoveryError`."""
    return resolve(spec, fetch_descriptor(spec, timeout))


@dataclass(slots=True)
class _Target:
    spec: InstanceSpec  # as followed now (pending, or resolved)
    next_read: float | None  # monotonic time of the next read, None: none planned
    backoff: float = MIN_BACKOFF
    problem: str | None = None
    reads: int = 0
    failures: int = 0
    last_read: float | None = None
    last_attempt: float = float("-inf")

    def view(self) -> DiscoveryView:
        spec = self.spec
        return DiscoveryView(
            url=(spec.base_url or "") + "/server_info",
            resolved=not spec.pending,
            problem=self.problem,
            block_size=spec.block_size,
            load_stream=spec.load_endpoint is not None,
            reads=self.reads,
            failures=self.failures,
            last_read=self.last_read,
        )


class Discovery:
    """Reads engines' `/server_info` on a thread of its own; `apply(spec)` gets every new
    resolution (called from that thread). `interval`: seconds between two reads of an
    engine that is well (0: only when something looks wrong)."""

    def __init__(
        self,
        apply: Callable[[InstanceSpec], None],
        *,
        fetch: Fetch | None = None,
        timeout: float = 3.0,
        min_backoff: float = MIN_BACKOFF,
        max_backoff: float = MAX_BACKOFF,
        interval: float = DEFAULT_INTERVAL,
    ) -> None:
        if interval < 0:
            raise ValueError("interval must be 0 (never) or positive")
        self.interval = interval
        self._apply = apply
        self._fetch: Fetch = fetch or (lambda spec: fetch_descriptor(spec, timeout))
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._targets: dict[str, _Target] = {}
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- membership (any thread) ---------------------------------------------------------

    def track(self, spec: InstanceSpec) -> None:
        """Follow an engine named by its URL: read it now if its publishers are unknown."""
        with self._wake:
            now = time.monotonic()
            self._targets[spec.name] = _Target(spec, now if spec.pending else self._next(now))
            if not spec.pending:
                self._targets[spec.name].last_read = time.time()
            self._wake.notify()

    def _next(self, now: float) -> float | None:
        """When to read an engine that is well next (None: not unless asked)."""
        return now + self.interval if self.interval else None

    def forget(self, name: str) -> None:
        with self._wake:
            self._targets.pop(name, None)

    def tracks(self, name: str) -> bool:
        return name in self._targets

    def reread(self, name: str, why: str) -> None:
        """Read the engine again soon (it restarted, or its link is down): its publishers
        may have moved. Cheap for an engine not named by its URL (nothing happens)."""
        with self._wake:
            target = self._targets.get(name)
            if target is None:
                return
            soonest = max(time.monotonic(), target.last_attempt + MIN_INTERVAL)
            if target.next_read is None or target.next_read > soonest:
                log.info("%s: reading %s again (%s)", name, target.view().url, why)
                target.next_read = soonest
                target.backoff = self._min_backoff
                self._wake.notify()

    def view(self, name: str) -> DiscoveryView | None:
        target = self._targets.get(name)
        return None if target is None else target.view()

    # -- the thread ----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="kvindex-discovery", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def step(self) -> bool:
        """Read every engine that is due now (tests drive a Discovery not started this way);
        True if any was read."""
        due = self._due(time.monotonic())
        for name, spec in due:
            self._read(name, spec)
        return bool(due)

    def _run(self) -> None:
        while True:
            with self._wake:
                if self._stopping:
                    return
                wait = self._wait(time.monotonic())
                if wait > 0:
                    self._wake.wait(wait)
                    continue
            self.step()

    def _wait(self, now: float) -> float:
        planned = [t.next_read for t in self._targets.values() if t.next_read is not None]
        return min((max(0.0, at - now) for at in planned), default=3600.0)

    def _due(self, now: float) -> list[tuple[str, InstanceSpec]]:
        with self._wake:
            due = [
                (name, t.spec)
                for name, t in self._targets.items()
                if t.next_read is not None and t.next_read <= now
            ]
            for name, _ in due:
                target = self._targets[name]
                target.next_read = None
                target.last_attempt = now
        return due

    def _read(self, name: str, spec: InstanceSpec) -> None:
        try:
            found = resolve(spec, self._fetch(spec))
        except DiscoveryError as exc:
            self._failed(name, str(exc))
            return
        changed = found != spec
        if changed:
            try:
                self._apply(found)
            except Exception as exc:  # e.g. a socket the new ports can't give
                log.warning("%s: could not follow its new publishers: %s", name, exc)
                self._failed(name, f"could not follow its publishers: {exc}")
                return
        with self._wake:
            target = self._targets.get(name)
            if target is None:
                return
            if target.problem is not None:
                log.warning("%s: %s answers again", name, target.view().url)
            target.spec = found
            target.problem = None
            target.backoff = self._min_backoff
            target.reads += 1
            target.last_read = time.time()
            if target.next_read is None:  # (a reread asked meanwhile stays planned)
                target.next_read = self._next(time.monotonic())

    def _failed(self, name: str, problem: str) -> None:
        with self._wake:
            target = self._targets.get(name)
            if target is None:
                return
            if problem != target.problem:
                retry = f"retrying in {target.backoff:.0f} s"
                log.warning("%s: %s (%s)", name, problem, retry)
            target.problem = problem
            target.failures += 1
            target.next_read = time.monotonic() + target.backoff
            target.backoff = min(self._max_backoff, target.backoff * 2)
