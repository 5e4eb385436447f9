"""Read a valgrind memcheck log (sanitize/run.sh): fail on a memory error or a definite
leak whose stack runs through kvindex's C extensions. CPython's own (its known false
positives without its suppression file, the blocks it leaves at exit) are counted only."""

from __future__ import annotations

import re
import sys

OURS = re.compile(r"csrc/|_recv\.c|kvindex/index/_core|kvindex/subscriber/_recv")
ERROR = re.compile(r"Invalid (read|write|free)|uninitialised|Mismatched free|overlap")


def main(path: str) -> int:
    with open(path) as f:
        records = re.split(r"\n==\d+== \n", f.read())
    errors = [r for r in records if ERROR.search(r)]
    leaks = [r for r in records if "definitely lost" in r]
    ours = [r for r in errors + leaks if OURS.search(r)]
    for record in ours:
        print(record)
    print(
        f"valgrind: {len(errors)} memory errors and {len(leaks)} definite leaks in all, "
        f"{len(ours)} through our C"
    )
    return 1 if ours else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
