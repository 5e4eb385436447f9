"""tests/netutil.py's free ports: two runs asked for one after the other never overlap.

Nothing holds a run between `free_ports` and the test binding it, so the kernel could give
the next call's base inside the last run (CI: `Address already in use` when a recording
test's replay ports began two past its publishers')."""

from __future__ import annotations

from collections.abc import Iterator

import netutil
import pytest


def test_runs_asked_one_after_another_do_not_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    bases: Iterator[int] = iter([41000, 41002, 41001, 41005, 41003, 41100])
    monkeypatch.setattr(netutil, "free_port", lambda: next(bases))
    first = netutil.free_ports(3)
    second = netutil.free_ports(3)
    assert first == 41000
    assert {first, first + 1, first + 2}.isdisjoint({second, second + 1, second + 2})
