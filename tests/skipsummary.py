"""A pytest plugin: the run ends with one line saying what it skipped and why (and which
expected failures it carried), so a machine without redis-server or chromium is told so
instead of passing with less than it seems. Loaded by conftest.py.

    skipped 3: chromium is not installed (apt-get install chromium; .ci/run does) (2), ...
"""

from __future__ import annotations

from collections import Counter

import pytest

__all__ = ["summary_line"]

_skips: Counter[str] = Counter()
_xfails: Counter[str] = Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and hasattr(report, "wasxfail"):
        _xfails[str(report.wasxfail) or "no reason given"] += 1
    elif report.skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        _skips[reason.removeprefix("Skipped: ")] += 1


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # A whole module skipped at import (`pytest.skip(..., allow_module_level=True)`).
    if report.skipped and isinstance(report.longrepr, tuple):
        _skips[report.longrepr[2].removeprefix("Skipped: ")] += 1


def summary_line(skips: Counter[str], xfails: Counter[str]) -> str:
    def part(counts: Counter[str]) -> str:
        return "; ".join(
            f"{reason} ({n})" if n > 1 else reason for reason, n in counts.most_common()
        )

    line = f"skipped {sum(skips.values())}: {part(skips)}" if skips else "skipped nothing"
    if xfails:
        line += f"; expected to fail {sum(xfails.values())}: {part(xfails)}"
    return line


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line(summary_line(_skips, _xfails))
