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
    cases = p.add_subparsers(
        dest="bench_case",
        metavar="CASE",
        required=False,
        help="one case on its own (routing: the routing A/B); without it, the whole suite",
    )
    routing = cases.add_parser(
        "routing",
        help="replay a trace through modeled vLLM engines once per routing policy",
        description="Replay a Mooncake-format trace (--trace) or the built-in shared-prefix "
        "generator through modeled vLLM engines, once per policy on a fresh fleet (kvindex's "
        "/v1/route and longest match through a running serve, round-robin, least-loaded, an "
        "approximate cache-aware router, the oracle): hit rate, modeled TTFT, throughput "
        "(docs/routing.md).",
    )
    from kvindex.bench.routing_ab.options import add_arguments as routing_arguments

    routing_arguments(routing)
    routing.set_defaults(run=run_routing)


def run_routing(args: argparse.Namespace) -> int:
    from kvindex.bench.routing_ab.run import main
    from kvindex.cli.signals import stop_signals

    with stop_signals("bench routing") as stop:  # between two requests; serve stopped
        return main(args, stop)


def run(args: argparse.Namespace) -> int:
    from kvindex.bench.suite import run as run_suite

    return run_suite(args)
