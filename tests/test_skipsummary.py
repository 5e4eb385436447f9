"""`make test` ends with one line saying what it skipped and why (tests/skipsummary.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_pytest(tmp: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "skipsummary",
            str(tmp),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
    )
    return proc.stdout.strip().splitlines()


def test_the_run_ends_with_what_it_skipped_and_why(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "@pytest.mark.parametrize('i', [1, 2])\n"
        "def test_no_redis(i): pytest.skip('redis-server is not installed')\n"
        "@pytest.mark.xfail(strict=True, reason='issue 14: pending')\n"
        "def test_pending(): assert False\n"
    )
    (tmp_path / "test_b.py").write_text(
        "import pytest\npytest.skip('chromium is not installed', allow_module_level=True)\n"
    )
    lines = run_pytest(tmp_path)
    assert lines[-2] == (
        "skipped 3: redis-server is not installed (2); chromium is not installed; "
        "expected to fail 1: issue 14: pending"
    ), lines
    assert "1 passed, 3 skipped, 1 xfailed" in lines[-1]


def test_a_run_that_skipped_nothing_says_so(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text("def test_ok(): pass\n")
    lines = run_pytest(tmp_path)
    assert lines[-2:][0] == "skipped nothing" and "1 passed" in lines[-1], lines
