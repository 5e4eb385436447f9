"""CI's hypothesis profile (tests/conftest.py, set by .ci/run): a failing example is
reported as found, with the blob that reproduces it, not shrunk first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

TESTS = Path(__file__).parent

# A property that fails from 12,321 on: shrunk, the example is 12,321; found, it is
# whatever number first failed. (The limit is computed: hypothesis draws the literals in a
# test's source, and found 12,345 itself unshrunk 3 times in 40.)
PROPERTY = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import conftest  # loads the profile KVINDEX_HYPOTHESIS names
from hypothesis import given, strategies as st

LIMIT = 111 * 111

@given(st.integers(0, 2**32))
def prop(x):
    assert x < LIMIT

try:
    prop()
except AssertionError as exc:
    print("\\n".join(exc.__notes__))
"""


def _report(tmp_path: Path, profile: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "KVINDEX_HYPOTHESIS"}
    if profile is not None:
        env["KVINDEX_HYPOTHESIS"] = profile
    done = subprocess.run(
        [sys.executable, "-c", PROPERTY],
        cwd=tmp_path,  # its own example database: nothing replayed from another run
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    )
    return done.stdout


def test_ci_reports_the_example_found_with_its_blob(tmp_path: Path) -> None:
    report = _report(tmp_path, "ci")
    assert "@reproduce_failure(" in report, report
    assert "x=12321," not in report, report


def test_the_default_profile_shrinks(tmp_path: Path) -> None:
    report = _report(tmp_path, None)
    assert "x=12321," in report, report
    assert "@reproduce_failure(" not in report, report
