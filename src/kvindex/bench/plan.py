"""The bench's modes and options: what `--smoke`, `--quick` and the full run measure.

Kept apart from the suite (no numpy, matplotlib or index imports) so that `kvindex`'s
command line can offer `kvindex bench`'s options without loading the bench.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

__all__ = ["PLANS", "EndToEnd", "Plan", "add_arguments", "plan_from"]


@dataclass(frozen=True, slots=True)
class EndToEnd:
    """The sizes of the end-to-end cases (`kvindex.bench.e2e`)."""

    ingest_instances: int  # publishers of the ingest cases
    ingest_events: int  # measured block events, after the warm-up
    ingest_runs: int  # each ingest case: best of N runs, interleaved
    lookup_instances: int  # publishers of the HTTP lookup case, each ...
    lookup_blocks: int  # ... holding this many blocks of the fill
    prompts: int  # distinct 512-block prompts (HTTP lookups)
    lookups: int  # per phase (HTTP lookups), one every `lookup_interval` seconds
    lookup_interval: float
    gets: int  # empty GETs per phase (the HTTP floor)
    fresh_instances: int  # publishers of the freshness case
    fresh_seconds: float  # the freshness case's paced phase
    marker_every: float  # seconds between two freshness markers
    warm_blocks: int  # warm restart
    timeout: float  # for any one wait


E2E_SMOKE = EndToEnd(3, 40_000, 1, 4, 300, 6, 40, 0.005, 40, 3, 1.0, 0.01, 4_000, 60.0)
E2E_QUICK = EndToEnd(4, 200_000, 2, 64, 2_000, 32, 200, 0.005, 200, 4, 1.5, 0.01, 100_000, 120.0)
E2E_FULL = EndToEnd(
    4, 1_000_000, 3, 64, 20_000, 64, 1_200, 0.005, 1_000, 8, 8.0, 0.01, 1_000_000, 600.0
)


@dataclass(frozen=True, slots=True)
class Plan:
    """The sizes of one mode."""

    mode: str
    ingest_instances: tuple[int, ...]
    ingest_events: int  # measured block events per instance count, after the warm-up
    slices: int  # ingest and store cases: the measured stream in N timed slices, best of N
    gpu_blocks: int  # per instance: the steady-state cache size of the ingest workload
    store_instances: int
    warm_blocks: int
    warm_loads: int  # warm restart: best of N loads
    lookup_instances: tuple[tuple[int, int], ...]  # (instances, blocks per instance)
    lookup_entries: tuple[tuple[int, int], ...]  # the same, growing total entries
    prompts: int  # distinct 512-block prompts per lookup case
    rounds: int  # lookup rounds over the prompts: median of the per-round percentiles
    # Dynamo's radix tree through its Python binding (lookups and memory): its fill is
    # slow, bigger cases skip it.
    dynamo_max_entries: int
    e2e: EndToEnd


PLANS = {
    "smoke": Plan(
        mode="smoke",
        ingest_instances=(1, 4),
        ingest_events=3_000,
        slices=2,
        gpu_blocks=128,
        store_instances=4,
        warm_blocks=2_000,
        warm_loads=2,
        lookup_instances=((1, 300), (4, 300)),
        lookup_entries=((4, 1_000),),
        prompts=12,
        rounds=2,
        dynamo_max_entries=10_000,
        e2e=E2E_SMOKE,
    ),
    "quick": Plan(
        mode="quick",
        ingest_instances=(1, 8, 64, 256),
        ingest_events=100_000,
        slices=3,
        gpu_blocks=1024,
        store_instances=8,
        warm_blocks=100_000,
        warm_loads=2,
        lookup_instances=((1, 1_000), (8, 1_000), (64, 1_000), (256, 1_000)),
        lookup_entries=((64, 15_625),),  # 1M entries
        prompts=100,
        rounds=3,
        dynamo_max_entries=1_100_000,
        e2e=E2E_QUICK,
    ),
    "full": Plan(
        mode="full",
        ingest_instances=(1, 8, 64, 256),
        ingest_events=1_000_000,
        slices=5,
        gpu_blocks=1024,
        store_instances=8,
        warm_blocks=1_000_000,
        warm_loads=3,
        lookup_instances=((1, 20_000), (8, 20_000), (64, 20_000), (256, 20_000)),
        # 1M, 5M, the lookup target's case (64 x 100k = 6.4M) and 20M entries.
        lookup_entries=((64, 15_625), (64, 78_125), (64, 100_000), (64, 312_500)),
        prompts=500,
        rounds=5,
        dynamo_max_entries=6_500_000,
        e2e=E2E_FULL,
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m kvindex.bench` and `kvindex bench`."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller cases, under 2 minutes (CI)")
    mode.add_argument("--smoke", action="store_true", help="toy sizes, seconds (the tests)")
    parser.add_argument(
        "--out",
        default="bench/results.json",
        metavar="PATH",
        help="results JSON; the PNG plots go beside it (default: bench/results.json)",
    )
    parser.add_argument(
        "--events", type=int, help="measured ingest block events per instance count"
    )
    parser.add_argument(
        "--instances", metavar="N,N,...", help="instance counts of the scaling curves"
    )
    parser.add_argument(
        "--lookup",
        action="append",
        metavar="INSTANCESxBLOCKS",
        help="a lookup case (blocks per instance), repeatable; replaces the instance curve",
    )
    parser.add_argument(
        "--entries",
        metavar="E,E,...",
        help="total entries of the lookup/memory curve at 64 instances (e.g. 1M,5M,20M)",
    )
    parser.add_argument("--warm-blocks", type=int, help="blocks in the warm-restart store")
    parser.add_argument(
        "--repeats",
        type=int,
        help="timed slices per ingest case (best of N), lookup rounds (median of N), loads",
    )
    parser.add_argument("--no-dynamo", action="store_true", help="leave out the Dynamo baselines")
    parser.add_argument("--no-e2e", action="store_true", help="leave out the end-to-end cases")
    parser.add_argument(
        "--only",
        choices=[
            "routing",
            "ingest_workers",
            "lookup",
            "page_shapes",
            "drain",
            "shards",
            "stores",
            "warm_restart",
            "routing_ab",
            "chat_lookup",
        ],
        help="run only this case (the routing, ingest-workers or lookup end-to-end case, or the "
        "in-process page shapes, drain, shards, stores or warm restart, the latter with its e2e "
        "case too) and put its results into --out's existing ones (the table and README then show "
        "it beside the last full run's); routing_ab: the routing policies' A/B (`kvindex "
        "bench routing`), into routing_ab.json beside --out",
    )


def plan_from(args: argparse.Namespace) -> Plan:
    plan = PLANS["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.events:
        plan = replace(plan, ingest_events=args.events)
    if args.instances:
        counts = tuple(_ints(args.instances))
        per = plan.lookup_instances[0][1]
        plan = replace(
            plan, ingest_instances=counts, lookup_instances=tuple((n, per) for n in counts)
        )
    if args.lookup:
        plan = replace(plan, lookup_instances=tuple(_pair(case) for case in args.lookup))
    if args.entries:
        entries = _ints(args.entries)
        plan = replace(plan, lookup_entries=tuple((64, max(1, e // 64)) for e in entries))
    if args.warm_blocks:
        plan = replace(plan, warm_blocks=args.warm_blocks)
    if args.repeats:
        n = args.repeats
        plan = replace(plan, slices=n, rounds=n, warm_loads=n)
    return plan


def _ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        scale = {"K": 1_000, "M": 1_000_000}.get(part[-1:], 1)
        out.append(int(float(part.rstrip("KM")) * scale))
    return out


def _pair(text: str) -> tuple[int, int]:
    instances, _, blocks = text.lower().partition("x")
    return _ints(instances)[0], _ints(blocks)[0]
