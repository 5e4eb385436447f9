"""tests/netutil.py's free ports: two runs asked for one after the other never overlap.

Nothing holds a run between `free_ports` and the test binding it, so the kernel could give
the next call's base inside the last run (CI: `Address already in use` when a recording
test's replay ports began two past its publishers')."""

from __future__ import annotations

import netutil
import pytest


def test_runs_asked_one_after_another_do_not_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    base = netutil.free_ports(6)  # six free ports in a row: the runs below are among them
    monkeypatch.setattr(netutil, "_HANDED", {})  # none handed out yet
    offers = iter([base, base + 2, base + 3])  # the kernel's offers: the second overlaps
    monkeypatch.setattr(netutil, "free_port", lambda: next(offers))
    first = netutil.free_ports(3)
    second = netutil.free_ports(3)
    assert (first, second) == (base, base + 3)
