"""vLLM 0.33.0's real ``ZmqEventPublisher`` with the two hooks the interop drivers need.

Imported by the drivers that run in the vLLM venv (``vllm_driver.py``,
``vllm_model_driver.py``); never by kvindex's own tests. The importer must set
vLLM's environment (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` ...) before importing this.

- ``bind_pub``: vLLM binds an endpoint only when it contains ``*`` and connects
  otherwise; for tests the PUB socket is bound on ``tcp://127.0.0.1:PORT`` (port 0
  allowed) and the bound endpoints are read back (``bound_pub``, ``bound_replay``).
- ``drop_rate``: a seeded share of live PUB sends is skipped (the replay buffer keeps
  those batches); their seqs are in ``lossy.dropped``.
"""

from __future__ import annotations

import random
import time
from typing import Any

import zmq
from vllm.distributed.kv_events import ZmqEventPublisher


class _LossyPub:
    """Proxy for the PUB socket that silently skips a share of sends."""

    def __init__(self, sock: Any, rate: float, rng: random.Random):
        self._sock, self._rate, self._rng = sock, rate, rng
        self.dropped: list[int] = []

    def send_multipart(self, frames: Any, *a: Any, **kw: Any) -> Any:
        if self._rng.random() < self._rate:
            self.dropped.append(int.from_bytes(frames[1], "big"))
            return None
        return self._sock.send_multipart(frames, *a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class DriverPublisher(ZmqEventPublisher):
    bind_pub = True
    drop_rate = 0.0
    drop_seed = 0

    @staticmethod
    def _is_bind_endpoint(endpoint: str) -> bool:
        if DriverPublisher.bind_pub:
            return True
        return ZmqEventPublisher._is_bind_endpoint(endpoint)

    def _socket_setup(self) -> None:
        super()._socket_setup()
        # Runs in __init__, before the publisher thread starts: safe to touch
        # the sockets here.
        self.bound_pub = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or self._endpoint
        self.bound_replay = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        )
        self.lossy = None
        if self.drop_rate > 0:
            self.lossy = _LossyPub(
                self._pub, self.drop_rate, random.Random(f"drop-{self.drop_seed}")
            )
            self._pub = self.lossy


def wait_drained(publisher: ZmqEventPublisher, timeout: float = 30.0) -> bool:
    """Wait until the publisher thread has sent every queued batch."""
    deadline = time.time() + timeout
    q = publisher._event_queue
    while time.time() < deadline:
        if q.unfinished_tasks == 0:
            return True
        time.sleep(0.01)
    return False
