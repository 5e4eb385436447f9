"""The engines a finder (Kubernetes, DNS) sees, made the fleet's: added, replaced, removed.

A finder hands its whole answer at once (`Reconciler.replace(key, found)`): every engine it
sees now, by name. The reconciler compares it with what that finder added before and changes
the fleet through its public `add_instance` / `remove_instance`:

- a name new to the fleet is added; one the fleet already follows with the same spec (restored
  from the store at a warm start, or added by another replica sharing a Redis store) is taken
  over as it is, its blocks kept;
- a name whose spec or generation changed (a pod replaced under the same name has a new UID,
  a pod that moved has a new IP) is removed, its blocks dropped, then added afresh: nothing of
  the old generation survives;
- a name the finder no longer sees is removed (its blocks dropped), said once in the log and
  in `history` (what `/v1/instances` shows).

A name another finder or a static `--instance` already holds is left alone (one warning).
An engine the fleet refuses (its sockets don't fit, a bad spec) is logged and tried again on
the finder's next answer. `min_engines` is the start gate: `starting()` says why serving
should wait until that many found engines are live, once; after that it never closes again
(a fleet scaled down must not take every replica out of its router's rotation).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import msgspec
import zmq

from kvindex.runtime.finders.common import FinderThread
from kvindex.security.engines import engine_hosts
from kvindex.subscriber import InstanceSpec, Status

__all__ = ["FleetChange", "Found", "FoundBy", "Reconciler"]

log = logging.getLogger("kvindex.discover")

HISTORY = 200  # changes kept for /v1/instances


class FoundBy(msgspec.Struct, frozen=True, omit_defaults=True):
    """How an engine was found: what `/v1/instances` shows as its `found`."""

    how: Literal["k8s", "dns"]
    source: str  # the --discover value
    address: str  # IP:PORT of its KV-event publisher
    namespace: str | None = None  # k8s: the pod's namespace, name and UID
    pod: str | None = None
    uid: str | None = None
    dns_name: str | None = None  # dns: the name asked (the SRV target where there is one)


class FleetChange(msgspec.Struct, frozen=True, omit_defaults=True):
    """One engine a finder added or removed, when and why."""

    at: float  # Unix time
    name: str
    change: Literal["added", "removed"]
    why: str
    found: FoundBy | None = None


@dataclass(frozen=True, slots=True)
class Found:
    """An engine a finder sees: the spec to follow and how it was found."""

    spec: InstanceSpec
    by: FoundBy

    def same_generation(self, other: Found) -> bool:
        """The same engine, followed the same way (a new pod UID or spec is a new one)."""
        return self.spec == other.spec and self.by.uid == other.by.uid


class FleetLike(Protocol):
    """What the reconciler needs of `kvindex.runtime.Fleet`."""

    found: dict[str, FoundBy]

    @property
    def specs(self) -> Mapping[str, InstanceSpec]: ...

    def has_instance(self, name: str) -> bool: ...

    def add_instance(self, spec: InstanceSpec) -> None: ...

    def remove_instance(self, name: str) -> None: ...

    def status(self, name: str) -> Status: ...


class Reconciler:
    """Applies finders' answers to a fleet (thread-safe: each finder has its own thread)."""

    def __init__(self, fleet: FleetLike, *, min_engines: int = 0) -> None:
        self._fleet = fleet
        self._lock = threading.RLock()
        self._owned: dict[str, tuple[str, Found]] = {}  # name -> (finder key, what it saw)
        self._refused: dict[str, str] = {}  # name -> why the fleet refused it (said once)
        self._conflicts: set[str] = set()
        self.history: deque[FleetChange] = deque(maxlen=HISTORY)
        self.min_engines = min_engines
        self._opened = min_engines <= 0
        self.added = 0  # counters since start (for /metrics and tests)
        self.removed = 0
        self.finders: list[FinderThread] = []  # started and stopped with the service

    def start(self) -> None:
        """Start every finder (once the fleet's ingest runs: they add instances)."""
        for finder in self.finders:
            finder.start()

    def stop(self) -> None:
        """Stop every finder (before the fleet stops); waits a few seconds at most each."""
        for finder in self.finders:
            finder.stop()

    # -- what finders call ---------------------------------------------------------------

    def replace(self, key: str, found: Mapping[str, Found], why_gone: str = "") -> None:
        """Finder `key` sees exactly `found` now; `why_gone`: why the rest are gone."""
        with self._lock:
            mine = {name for name, (owner, _) in self._owned.items() if owner == key}
            for name in sorted(mine - found.keys()):
                self._drop(name, why_gone or f"no longer found by {key}")
            for name, engine in sorted(found.items()):
                self._take(key, name, engine)

    def gone(self, key: str, name: str, why: str) -> None:
        """Finder `key` saw engine `name` go (a pod deleted or not Ready)."""
        with self._lock:
            owned = self._owned.get(name)
            if owned is not None and owned[0] == key:
                self._drop(name, why)

    # -- views -------------------------------------------------------------------------

    def engines(self) -> dict[str, Found]:
        with self._lock:
            return {name: found for name, (_, found) in self._owned.items()}

    def live(self) -> int:
        """Found engines whose every rank is live now."""
        count = 0
        for name in list(self.engines()):
            try:
                count += self._fleet.status(name) == Status.LIVE
            except KeyError:  # removed meanwhile
                pass
        return count

    def starting(self) -> str | None:
        """Why serving still waits (fewer than `min_engines` found engines live), or None.
        Once the gate opened it stays open."""
        if self._opened:
            return None
        live = self.live()
        if live >= self.min_engines:
            self._opened = True
            log.warning("%d engine(s) found live: ready (min_engines %d)", live, self.min_engines)
            return None
        return f"{live} of min_engines {self.min_engines} found engines live"

    # -- inside ------------------------------------------------------------------------

    def _take(self, key: str, name: str, engine: Found) -> None:
        owned = self._owned.get(name)
        if owned is not None and not self._fleet.has_instance(name):  # deleted by the API
            del self._owned[name]
            owned = None
        if owned is not None and owned[0] != key:
            self._conflict(name, f"already found by {owned[0]}; {key} leaves it")
            return
        if owned is not None and owned[1].same_generation(engine):
            if owned[1].by != engine.by:  # e.g. a pod's other fields: nothing to follow anew
                self._owned[name] = (key, engine)
                self._fleet.found[name] = engine.by
            return
        if owned is not None:
            self._drop(name, _why_new(owned[1], engine))
        elif self._fleet.has_instance(name):
            if self._fleet.specs.get(name) != engine.spec and name not in self._fleet.found:
                self._conflict(name, "an instance of that name is configured; discovery leaves it")
                return
            if self._fleet.specs.get(name) == engine.spec:  # warm start, or another replica
                self._own(key, name, engine, "found again (its state kept)")
                return
            self._remove(name)  # a stale generation restored from the store
        # How it was found is set first: a view never shows the engine without it.
        self._fleet.found[name] = engine.by
        try:
            self._fleet.add_instance(engine.spec)
        except (ValueError, KeyError, zmq.ZMQError) as exc:  # CapacityError, SpecError too
            self._fleet.found.pop(name, None)
            why = str(exc)
            if self._refused.get(name) != why:
                log.warning("%s (found by %s): not followed: %s", name, key, why)
            self._refused[name] = why
            return
        self._own(key, name, engine, f"found by {key} at {engine.by.address}")

    def _own(self, key: str, name: str, engine: Found, why: str) -> None:
        # Its hosts join the engine allow-list (its http= is scraped and asked to tokenize)
        # for as long as discovery holds it.
        for host in engine.spec.hosts():
            engine_hosts.add(host, f"discovery:{name}")
        self._refused.pop(name, None)
        self._conflicts.discard(name)
        self._owned[name] = (key, engine)
        self._fleet.found[name] = engine.by
        self.added += 1
        self._note(name, "added", why, engine.by)

    def _drop(self, name: str, why: str) -> None:
        _, engine = self._owned.pop(name)
        self._remove(name)
        for host in engine.spec.hosts():
            engine_hosts.remove(host, f"discovery:{name}")
        self.removed += 1
        self._note(name, "removed", why, engine.by)

    def _remove(self, name: str) -> None:
        self._fleet.found.pop(name, None)
        try:
            self._fleet.remove_instance(name)
        except KeyError:  # removed through the API meanwhile
            pass

    def _note(self, name: str, change: Literal["added", "removed"], why: str, by: FoundBy) -> None:
        log.warning("%s %s: %s", name, change, why)
        self.history.append(FleetChange(time.time(), name, change, why, by))

    def _conflict(self, name: str, why: str) -> None:
        if name not in self._conflicts:
            log.warning("%s: %s", name, why)
            self._conflicts.add(name)


def _why_new(old: Found, new: Found) -> str:
    if old.by.uid != new.by.uid:
        return f"replaced: pod UID {old.by.uid} -> {new.by.uid} (a new generation)"
    if old.by.address != new.by.address:
        return f"moved: {old.by.address} -> {new.by.address}"
    return "its spec changed (annotations)"
