"""How many publishers this process can follow, counted before a socket is opened.

Each publisher followed (one DP rank of an instance) holds ZMQ sockets and file
descriptors for as long as it is followed:

- its SUB socket, and the pair of PAIR sockets of the SUB's monitor: 3 sockets, each with
  a mailbox (an eventfd), plus the TCP connection: 4 descriptors;
- with a replay endpoint, a DEALER while a replay runs (every rank may replay at once,
  after a fleet-wide reconnect): 1 socket, 2 descriptors (mailbox, connection);
- with a load stream (SGLang's, `kvindex.subscriber.engine_load`), its SUB: 1 socket, 2
  descriptors (mailbox, connection).

A ZMQ context refuses sockets past its MAX_SOCKETS (1,023 by default: ~250 publishers with
replay), and the process its descriptors past RLIMIT_NOFILE (`ulimit -n`, often 1,024).
So the subscribers' context is made here with its socket limit raised before its first
socket, the descriptor limit is raised to the hard limit, and a `SocketBudget` per context
counts what every instance followed holds: an instance that does not fit is refused with
a `CapacityError` that says what it needs, what is free and how to raise the limit, before
anything is opened for it. What is already followed is never touched.
"""

from __future__ import annotations

import os
import resource
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import zmq

from kvindex.subscriber.spec import InstanceSpec

__all__ = [
    "FDS_RESERVED",
    "CapacityError",
    "Need",
    "SocketBudget",
    "budget_of",
    "need_of",
    "need_of_instances",
    "need_of_load",
    "raise_fd_limit",
    "subscriber_context",
]

# Descriptors left for everything else in the process: HTTP clients, the store's files and
# sockets, logs, Python's own.
FDS_RESERVED = 256
_SOCKETS_PER_SOURCE = 3  # SUB + its monitor's two PAIR sockets
_FDS_PER_SOURCE = 4  # their mailboxes + the TCP connection
_SOCKETS_PER_REPLAY = 1  # the DEALER of a replay request
_FDS_PER_REPLAY = 2  # its mailbox + its connection
_SOCKETS_PER_LOAD = 1  # a load stream's SUB (no monitor, no replay)
_FDS_PER_LOAD = 2  # its mailbox + its connection


class CapacityError(ValueError):
    """An instance (or a fleet) needs more sockets or descriptors than this process may
    open; the message says what it needs, what is free, and how to raise the limit."""


@dataclass(frozen=True, slots=True)
class Need:
    """Sockets and file descriptors held while following some publishers."""

    sockets: int = 0
    fds: int = 0
    sources: int = 0

    def __add__(self, other: Need) -> Need:
        return Need(
            self.sockets + other.sockets, self.fds + other.fds, self.sources + other.sources
        )


def need_of(sources: int, replay: bool) -> Need:
    """What following `sources` publishers (DP ranks) holds, with or without replay."""
    sockets = _SOCKETS_PER_SOURCE + (_SOCKETS_PER_REPLAY if replay else 0)
    fds = _FDS_PER_SOURCE + (_FDS_PER_REPLAY if replay else 0)
    return Need(sources * sockets, sources * fds, sources)


def need_of_load(ranks: int) -> Need:
    """What following `ranks` ranks' load streams holds (publishers are not counted: the
    load SUB of a rank goes with its KV-event one)."""
    return Need(ranks * _SOCKETS_PER_LOAD, ranks * _FDS_PER_LOAD)


def need_of_instances(specs: Iterable[InstanceSpec]) -> Need:
    """What following these instances (every DP rank of each, its load stream too) holds."""
    total = Need()
    for s in specs:
        total += need_of(0 if s.events_none else s.dp, s.replay_endpoint is not None)
        total += need_of_load(len(s.load_sources()))
    return total


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = 1 << 20
    if soft == resource.RLIM_INFINITY:
        return unlimited
    target = unlimited if hard == resource.RLIM_INFINITY else hard
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a hard limit the kernel caps lower (nr_open)
            pass
    return int(soft)


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64  # no procfs: a guess on the safe side


_lock = threading.Lock()
_context: zmq.Context[zmq.Socket[bytes]] | None = None
_budgets: weakref.WeakKeyDictionary[zmq.Context[zmq.Socket[bytes]], SocketBudget] = (
    weakref.WeakKeyDictionary()
)


def subscriber_context() -> zmq.Context[zmq.Socket[bytes]]:
    """The ZMQ context subscribers use by default: one per process, its socket limit set
    (before its first socket: libzmq sizes its socket table then) as far as the descriptor
    limit, itself raised as far as allowed, can go."""
    global _context
    with _lock:
        if _context is None or _context.closed:
            fds = raise_fd_limit()
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            ctx.set(zmq.MAX_SOCKETS, max(1, min(fds, ctx.get(zmq.SOCKET_LIMIT))))
            _context = ctx
        return _context


def budget_of(ctx: zmq.Context[zmq.Socket[bytes]]) -> SocketBudget:
    """The budget of `ctx`'s sockets, shared by every Subscriber on it."""
    with _lock:
        budget = _budgets.get(ctx)
        if budget is None:
            budget = _budgets[ctx] = SocketBudget(ctx.get(zmq.MAX_SOCKETS))
        return budget


class SocketBudget:
    """What the subscribers of one ZMQ context may hold, and what each instance holds.

    The limits are taken once, when the budget is made (the first Subscriber on that
    context): the context's socket limit, and the descriptors this process may open beyond
    those already open and `FDS_RESERVED` for everything else."""

    def __init__(self, max_sockets: int, max_fds: int | None = None) -> None:
        fd_limit = raise_fd_limit()
        self.fd_limit = fd_limit
        self.max_sockets = max_sockets
        self.max_fds = max_fds if max_fds is not None else fd_limit - _open_fds() - FDS_RESERVED
        self._held: dict[tuple[int, str], Need] = {}
        self._lock = threading.Lock()

    @property
    def used(self) -> Need:
        with self._lock:
            return sum(self._held.values(), Need())

    def free(self) -> Need:
        used = self.used
        return Need(max(0, self.max_sockets - used.sockets), max(0, self.max_fds - used.fds))

    def check(self, need: Need, what: str) -> None:
        """Raise CapacityError if `need` does not fit beside what is held now."""
        with self._lock:
            used = sum(self._held.values(), Need())
        self._check(need, used, what)

    def reserve(self, owner: int, name: str, need: Need, what: str | None = None) -> None:
        """Hold `need` for instance `name` of `owner` (a Subscriber), in place of what it
        held, or raise CapacityError (what it held stays held then)."""
        with self._lock:
            key = (owner, name)
            used = sum((n for k, n in self._held.items() if k != key), Need())
            self._check(need, used, what or f"instance {name!r}")
            self._held[key] = need

    def release(self, owner: int, name: str) -> None:
        with self._lock:
            self._held.pop((owner, name), None)

    def _check(self, need: Need, used: Need, what: str) -> None:
        free_sockets = self.max_sockets - used.sockets
        free_fds = self.max_fds - used.fds
        if need.sockets <= free_sockets and need.fds <= free_fds:
            return
        ranks = f"{need.sources} publisher{'s' if need.sources != 1 else ''}"
        held = (
            f"; the {used.sources} publishers followed hold {used.fds} descriptors and "
            f"{used.sockets} sockets"
            if used.sources
            else ""
        )
        if need.fds > free_fds:
            raise CapacityError(
                f"can't follow {what}: its {ranks} need {need.fds} file descriptors and "
                f"{max(0, free_fds)} are free (the process limit is {self.fd_limit}, "
                f"ulimit -n{held}): raise the limit (ulimit -n, systemd LimitNOFILE=, a "
                "container's nofile ulimit) and restart, or follow fewer"
            )
        raise CapacityError(
            f"can't follow {what}: its {ranks} need {need.sockets} ZMQ sockets and "
            f"{max(0, free_sockets)} are free (the ZMQ context's limit is "
            f"{self.max_sockets}{held}): follow fewer"
        )
