"""Fixtures for interop with vLLM 0.33.0's own code, run in its own venv (see README.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from driver_proc import Driver, spawn

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("vllm_driver.py")
sys.path.insert(0, str(ROOT / "tests"))


def _skip_vllm() -> bool:
    return os.environ.get("KVINDEX_SKIP_VLLM") == "1"


_VENV: dict[str, str] = {}  # "python" or "error": the outcome of the one build


def _build_vllm_venv() -> None:
    """Run scripts/vllm-venv.sh once (a no-op under 1 s when the venv is complete)."""
    if _VENV:
        return
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "vllm-venv.sh")],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if proc.returncode != 0:
        _VENV["error"] = f"could not build the vLLM venv:\n{proc.stderr[-3000:]}"
    else:
        _VENV["python"] = proc.stdout.strip().splitlines()[-1]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the vLLM venv once tests are collected, before any runs: a cold build takes
    minutes and must not count against the first interop test's timeout."""
    needed = any("vllm_python" in getattr(i, "fixturenames", ()) for i in session.items)
    if _skip_vllm() or not needed or session.config.option.collectonly:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not _VENV:
        reporter.write_line("vllm-venv: checking (a cold build takes ~2 min, once)")
    _build_vllm_venv()


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM venv's python (cached under ~/.cache/kvindex-tests)."""
    if _skip_vllm():
        pytest.skip("KVINDEX_SKIP_VLLM=1")
    _build_vllm_venv()  # already done at collection, unless the fixture came in another way
    if "error" in _VENV:
        pytest.fail(_VENV["error"])
    return _VENV["python"]


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
