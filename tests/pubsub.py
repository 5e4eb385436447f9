"""Joining a test Publisher and a Subscriber so that live batches are sure to arrive."""

from __future__ import annotations

import time

from kvindex.subscriber import Connection, Item, Subscriber
from kvindex.wire.publisher import Publisher


def joined(pub: Publisher, sub: Subscriber, timeout: float = 5.0) -> list[Item]:
    """Poll `sub` until it reports its connection, then wait until its subscription has
    reached `pub` (made with `subscriptions=True`); returns what was polled meanwhile.

    The SUB's handshake is reported before the publisher's socket has attached it, and a
    batch sent in between is dropped: the subscriber then replays it (it sees the gap at
    the next batch), but a test that expects a *live* batch must wait for the attach."""
    items: list[Item] = []
    deadline = time.monotonic() + timeout
    while not any(isinstance(i, Connection) and i.connected for i in items):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the subscriber did not connect within {timeout:g} s")
        items.extend(sub.poll(0.05))
    pub.wait_for_subscriber(max(0.1, deadline - time.monotonic()))
    return items
