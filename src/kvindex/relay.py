"""`Relay`: follow one vLLM publisher over loopback and republish it over CURVE.

vLLM's publisher has no encryption and no authentication, so it should bind to localhost
only; a relay beside it follows it gap-free (kvindex's own Subscriber: replay, restarts,
losses), keeps its own replay buffer and republishes every batch on a CURVE PUB + ROUTER
pair that only allow-listed client keys may use (ZAP).

What downstream sees is vLLM's wire, seq for seq and byte for byte:
- every batch keeps its upstream seq and payload, so a downstream subscriber's checksums
  and checkpoints stay valid across relay restarts (a restarted relay catches up from the
  upstream buffer before it binds, and answers the anchor check with the same bytes);
- a batch that arrived live upstream is sent live; one that had to be replayed upstream
  is sent live only if it directly follows the last live one, else it is only buffered
  (a subscriber sees a gap and replays it from the relay) -- so seqs never go back live;
- an upstream engine restart clears the relay's buffer and the new stream starts at its
  own seq 0 again: downstream sees the seq go back (or, for an idle restart, its idle
  probe finds other bytes under its last seq) and treats it as the engine restart it is;
- batches lost upstream are missing from the relay too: downstream reports them lost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvindex.security.curve import server_setup
from kvindex.subscriber import (
    Delivery,
    InstanceSpec,
    Item,
    ReplayPolicy,
    Restarted,
    SourceKey,
    Status,
    Subscriber,
)
from kvindex.wire.publisher import Publisher

__all__ = ["ZAP_DOMAIN", "Relay", "RelayStats"]

log = logging.getLogger(__name__)

ZAP_DOMAIN = "kvindex"


@dataclass(slots=True)
class RelayStats:
    forwarded: int = 0  # batches buffered (and served by the replay socket)
    sent_live: int = 0  # of those, sent on the PUB socket
    restarts: int = 0  # upstream engine restarts passed on
    refused: int = 0  # CURVE clients ZAP turned away


class _AllowList:
    """ZAP's CURVE credentials callback: only the listed public keys get in."""

    def __init__(self, relay_stats: RelayStats, keys: Iterable[str]) -> None:
        self.stats = relay_stats
        self.keys = frozenset(k.encode() for k in keys)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            self.stats.refused += 1
        return ok


class Relay:
    """Follows `upstream` and republishes it on `bind` (+ `replay_bind`) over CURVE.

    `allow` lists the client public keys (Z85) let in; None lets any CURVE client in
    (encryption without client authentication). Call `step()` in a loop, then `close()`.
    """

    def __init__(
        self,
        upstream: InstanceSpec,
        bind: str,
        *,
        server_secret: str,
        allow: Iterable[str] | None,
        replay_bind: str | None = None,
        buffer_steps: int = 10_000,
        policy: ReplayPolicy | None = None,
        ready_timeout: float = 30.0,
    ) -> None:
        if upstream.dp != 1:
            raise ValueError("a relay follows one publisher (one DP rank): run one per rank")
        self.upstream = upstream
        self.stats = RelayStats()
        self._bind, self._replay_bind = bind, replay_bind
        self._secret = server_secret
        self._buffer_steps = buffer_steps
        self._source = SourceKey(upstream.name, 0)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth = ThreadAuthenticator(self._ctx, log=log)
        self._auth.start()
        if allow is None:
            self._auth.configure_curve(domain=ZAP_DOMAIN, location=zmq.auth.CURVE_ALLOW_ANY)
        else:
            self._auth.configure_curve_callback(ZAP_DOMAIN, _AllowList(self.stats, allow))
        self.subscriber = Subscriber(instances=[upstream], policy=policy, decode=False)
        self._pub: Publisher | None = None
        self._early: list[tuple[int, bytes]] = []  # caught up before binding
        self._ready_by = time.monotonic() + ready_timeout
        self._last_live: int | None = None

    # -- what callers read -------------------------------------------------------------

    @property
    def bound(self) -> bool:
        return self._pub is not None

    @property
    def endpoint(self) -> str | None:
        return None if self._pub is None else self._pub.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return None if self._pub is None else self._pub.replay_endpoint

    @property
    def upstream_status(self) -> Status:
        return self.subscriber.status(self._source)

    # -- the loop ----------------------------------------------------------------------

    def step(self, timeout: float = 0.1) -> list[Item]:
        """Wait up to `timeout` for upstream traffic, pass it on; returns what it saw."""
        items = self.subscriber.poll(timeout)
        for item in items:
            self._handle(item)
        if self._pub is None and self._ready():
            self._open()
        return items

    def _ready(self) -> bool:
        # Bind only once caught up: a downstream subscriber that reconnects to a restarted
        # relay must find the batch it holds last in our buffer, not an empty one.
        status = self.upstream_status
        caught_up = status in (Status.LIVE, Status.INCOMPLETE)
        return caught_up or time.monotonic() >= self._ready_by

    def _open(self) -> None:
        self._pub = Publisher(
            self._bind,
            self._replay_bind,
            topic=self.upstream.topic,
            buffer_steps=self._buffer_steps,
            context=self._ctx,
            setup=server_setup(self._secret),
        )
        for seq, payload in self._early:
            self._pub.put(seq, payload, live=False)
        self._early = []

    def _handle(self, item: Item) -> None:
        if isinstance(item, Delivery) and item.payload is not None:
            self._forward(item.seq, item.payload, item.replayed)
        elif isinstance(item, Restarted):
            self.stats.restarts += 1
            self._last_live = None
            self._early = []
            if self._pub is not None:
                self._pub.restart()

    def _forward(self, seq: int, payload: bytes, replayed: bool) -> None:
        self.stats.forwarded += 1
        if self._pub is None:
            self._early.append((seq, payload))
            del self._early[: -self._buffer_steps]
            return
        last = self._last_live
        live = not replayed or (last is not None and seq == last + 1)
        self._pub.put(seq, payload, live=live)
        if live:
            self._last_live = seq
            self.stats.sent_live += 1

    def close(self) -> None:
        self.subscriber.close()
        if self._pub is not None:
            self._pub.close()
        self._auth.stop()
        self._ctx.destroy(linger=0)

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
