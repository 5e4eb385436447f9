"""Shared fixtures. Helpers live in netutil.py (tests/ is on sys.path)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from netutil import free_port


@pytest.fixture
def port() -> int:
    return free_port()
