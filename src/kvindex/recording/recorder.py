"""Recording a fleet: a `Subscriber` (gap-free, restart-aware) feeding a `Writer`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvindex.recording.writer import Writer
from kvindex.subscriber import (
    Delivery,
    InstanceSpec,
    Item,
    ReplayPolicy,
    Subscriber,
)

__all__ = ["Limits", "record"]

_POLL_SECONDS = 0.25  # the longest a stop request or a due flush waits


@dataclass(frozen=True, slots=True)
class Limits:
    """When a recording stops by itself (None: never)."""

    duration: float | None = None
    max_batches: int | None = None


@dataclass(slots=True)
class _Run:
    started: float = field(default_factory=time.monotonic)
    batches: int = 0


def _open(
    specs: Sequence[InstanceSpec], writer: Writer, policy: ReplayPolicy | None, catch_up: bool
) -> Subscriber:
    # Continue where the file stopped: the publisher's replay fills what was published
    # while nobody recorded (and tells a restart apart from more of the same stream).
    ours = {source.source for spec in specs for source in spec.sources()}
    resume = {key: cp for key, cp in writer.checkpoints.items() if key in ours}
    return Subscriber(
        instances=specs, resume=resume, policy=policy, keep_payload=True, catch_up=catch_up
    )


def record(
    specs: Sequence[InstanceSpec],
    writer: Writer,
    *,
    limits: Limits = Limits(),
    stop: Callable[[], bool] = lambda: False,
    on_item: Callable[[Item], None] | None = None,
    policy: ReplayPolicy | None = None,
    catch_up: bool = True,
    tick: Callable[[int], None] | None = None,
) -> int:
    """Record every batch of `specs` (and the notices between them) until `limits` are
    reached or `stop()` is true; returns the number of batches recorded. Flushes whole
    segments as it goes; the caller closes the writer.

    A source the file has no checkpoint for starts at its first live batch, or with
    everything its replay buffer holds if `catch_up`; one it has continues where the file
    stopped. `tick(batches)` is called a few times a second (for progress)."""
    writer.session([spec.render() for spec in specs])
    run = _Run()
    deadline = None if limits.duration is None else run.started + limits.duration
    with _open(specs, writer, policy, catch_up) as sub:
        while not stop() and not _reached(run, limits):
            timeout = _POLL_SECONDS
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    break
            _take(sub.poll(timeout), writer, run, limits, on_item)
            writer.tick()
            if tick is not None:
                tick(run.batches)
    return run.batches


def _reached(run: _Run, limits: Limits) -> bool:
    return limits.max_batches is not None and run.batches >= limits.max_batches


def _take(
    items: list[Item],
    writer: Writer,
    run: _Run,
    limits: Limits,
    on_item: Callable[[Item], None] | None,
) -> None:
    now = time.time()
    for item in items:
        if _reached(run, limits) and isinstance(item, Delivery):
            return  # --max-batches: not one more
        writer.item(item, now)
        run.batches += isinstance(item, Delivery)
        if on_item is not None:
            on_item(item)
