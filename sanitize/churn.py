"""Churn the compiled core and watch what it holds: its C allocations and the RSS.

    python sanitize/churn.py [--cycles N] [--steps N]

Runs tests/test_core_leaks.py's workload (many publishers; stores of every shape,
removals, clears, restarts, instances removed, lookups, tree walks; new hashes, adapters
and salts each cycle), dropping everything after each cycle. Prints, per cycle, the
core's allocations (kvindex.index._core.allocated()) and the process's RSS; fails if the
allocations after a cycle grow past the first cycles' level, if the RSS keeps growing,
or if a deleted index leaves any allocation behind. `make sanitize` runs it under
valgrind; a long run (`--cycles 200`) is the RSS check of a long churn.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from test_core_leaks import Churn, CompiledIndex, allocated


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=12)
    parser.add_argument("--steps", type=int, default=400, help="events per cycle")
    args = parser.parse_args()
    before = allocated()
    index = CompiledIndex(seed=5, local_hashes=True)
    churn = Churn(index, seed=2)
    warm = max(3, args.cycles // 4)
    levels, rss = [], []
    for cycle in range(args.cycles):
        churn.cycle(args.steps)
        levels.append(allocated())
        rss.append(rss_kib())
        print(f"cycle {cycle:4d}: core {levels[-1][0]:9d} B in {levels[-1][1]:5d} blocks, "
              f"RSS {rss[-1]:7d} KiB", flush=True)  # fmt: skip
    del index, churn
    after = allocated()
    failures = []
    if after != before:
        failures.append(f"a deleted index left {after} (before: {before})")
    if args.cycles > warm:
        top = max(level[0] for level in levels[:warm])
        if max(level[1] for level in levels[warm:]) > levels[warm - 1][1]:
            failures.append("the core's blocks grew after the warm-up cycles")
        if max(level[0] for level in levels[warm:]) > top + 16 * 1024:
            failures.append("the core's bytes grew after the warm-up cycles")
        # RSS: the allocator keeps some; a leak grows it cycle after cycle.
        if rss[-1] > max(rss[:warm]) * 1.2 + 4096:
            failures.append(f"RSS grew from {max(rss[:warm])} to {rss[-1]} KiB")
    for failure in failures:
        print("churn:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
