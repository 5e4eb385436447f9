"""Venvs of the engines' own code (vLLM 0.33, SGLang 0.5.23) for interop tests, built
before any test runs, never inside one.

A cold build takes minutes (scripts/vllm-venv.sh about 2, scripts/sglang-venv.sh about
1.5); pytest-timeout would charge that to the first test needing it (a fresh machine's
`make test` failed that way). `tests/conftest.py` calls `prepare` once collection is done:
a venv is built only when a selected test uses its fixture, and the fixture then reads
the outcome. `KVINDEX_SKIP_VLLM=1` / `KVINDEX_SKIP_SGLANG=1` skip those tests without
building anything.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Engine:
    name: str
    script: str  # under scripts/; prints the venv's python as its last stdout line
    fixture: str  # the fixture through which tests get that python
    skip_env: str
    timeout: float  # seconds for a cold build


@dataclass(frozen=True)
class Venv:
    python: str | None = None
    skip: str | None = None
    error: str | None = None


VLLM = Engine("vLLM", "vllm-venv.sh", "vllm_python", "KVINDEX_SKIP_VLLM", 1500)
SGLANG = Engine("SGLang", "sglang-venv.sh", "sglang_python", "KVINDEX_SKIP_SGLANG", 1800)
ENGINES = (VLLM, SGLANG)

_KEYS = {engine.name: pytest.StashKey[Venv]() for engine in ENGINES}


def prepare(session: pytest.Session) -> None:
    """Build now the venvs that selected tests need."""
    if session.config.option.collectonly:
        return
    for engine in ENGINES:
        if any(engine.fixture in getattr(i, "fixturenames", ()) for i in session.items):
            session.config.stash[_KEYS[engine.name]] = build(engine)


def build(engine: Engine) -> Venv:
    if os.environ.get(engine.skip_env) == "1":
        return Venv(skip=f"{engine.skip_env}=1")
    try:
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / engine.script)],
            capture_output=True,
            text=True,
            timeout=engine.timeout,
        )
    except subprocess.TimeoutExpired:
        return Venv(error=f"scripts/{engine.script} took over {engine.timeout:.0f} s")
    if proc.returncode != 0:
        return Venv(error=f"could not build the {engine.name} venv:\n{proc.stderr[-3000:]}")
    return Venv(python=proc.stdout.strip().splitlines()[-1])


def python(config: pytest.Config, engine: Engine) -> str:
    """The venv's python for a test (skips or fails it as the build went)."""
    venv = config.stash.get(_KEYS[engine.name], None) or build(engine)
    if venv.skip:
        pytest.skip(venv.skip)
    if venv.error or venv.python is None:
        pytest.fail(venv.error or f"no {engine.name} venv")
    return venv.python
