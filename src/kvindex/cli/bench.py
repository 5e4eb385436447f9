"""`kvindex bench [--quick | --smoke] [--out PATH] ...`: the benchmark suite on this machine.

The same suite and options as `python -m kvindex.bench` (`make bench`): ingest, lookup,
memory and restart figures beside baselines measured in the same run, as a table, a JSON
file and PNG plots. See `kvindex.bench`.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    from kvindex.bench.plan import add_arguments

    p = sub.add_parser(
        "bench",
        help="benchmark kvindex on this machine beside same-run baselines",
        description="Ingest, lookup, memory and restart figures beside a naive consumer "
        "and NVIDIA Dynamo (its standalone indexer and radix tree, when installed), "
        "measured in the same run.",
    )
    add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvindex.bench.suite import run as run_suite

    return run_suite(args)
