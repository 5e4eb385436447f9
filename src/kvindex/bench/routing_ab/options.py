"""`kvindex bench routing`'s options, apart from the bench (no numpy or sockets imported):
`kvindex`'s command line offers them without loading it."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["MIXED", "POLICIES", "add_arguments"]

# kvindex's two policies (through serve), then the baselines (policies.py)
POLICIES = ("kvindex", "kvindex_longest", "round_robin", "least_loaded", "approximate", "oracle")
# kvindex's /v1/route on a fleet where some engines publish no KV events (--events-none)
MIXED = "kvindex_mixed"


def add_arguments(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the generator's quick trace (~1 min)")
    mode.add_argument("--smoke", action="store_true", help="a toy trace (seconds)")
    p.add_argument("--trace", type=Path, metavar="FILE", help="a Mooncake-format trace (JSONL)")
    p.add_argument("--limit", type=int, metavar="N", help="only the trace's first N requests")
    p.add_argument("--speedup", type=float, default=1.0, help="divide the trace's times by this")
    p.add_argument("--engines", type=int, help="engines in the fleet (default 8)")
    p.add_argument("--gpu-blocks", type=int, help="each engine's pool in blocks")
    p.add_argument("--rate", type=float, help="the generator's requests per second")
    p.add_argument(
        "--skew", type=float, help="the generator's group popularity: Zipf's exponent (0: even)"
    )
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, of {', '.join(POLICIES)}, {MIXED} (default: all but {MIXED})",
    )
    p.add_argument(
        "--events-none",
        type=int,
        metavar="K",
        help=f"also run {MIXED}: kvindex's /v1/route on a fleet whose last K engines publish "
        "no KV events (events=none instances: kvindex learns their caches from its own "
        f"routing); {MIXED} in --policies without it: half the engines",
    )
    p.add_argument(
        "--weights",
        metavar="NAME=VALUE[,...]",
        help="the routing score's weights for serve's /v1/route and the oracle "
        "(serve --weights; docs/routing.md)",
    )
    p.add_argument(
        "--out",
        default="bench/routing_ab.json",
        metavar="PATH",
        help="results JSON; the plot goes beside it (default: bench/routing_ab.json)",
    )
