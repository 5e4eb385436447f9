"""Fixtures for interop with vLLM 0.33.0's own code, run in its own venv (see README.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import enginevenv
import pytest
from driver_proc import Driver, spawn

DRIVER = Path(__file__).with_name("vllm_driver.py")


@pytest.fixture(scope="session")
def vllm_python(request: pytest.FixtureRequest) -> str:
    """The vLLM venv's python (built before the tests start: tests/enginevenv.py)."""
    return enginevenv.python(request.config, enginevenv.VLLM)


@pytest.fixture
def start_driver(vllm_python: str, tmp_path: Path) -> Iterator[Any]:
    drivers: list[Driver] = []

    def start(name: str, pub: str, replay: str, *args: str) -> Driver:
        out = tmp_path / f"{name}-{len(drivers)}.json"
        driver = spawn(vllm_python, DRIVER, out, "--pub", pub, "--replay", replay, *args)
        drivers.append(driver)
        return driver

    yield start
    for d in drivers:
        d.stop()
