"""The routing bench's run: every policy on a fresh fleet, the table, the plot, the JSON."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvindex.bench.common import machine_info
from kvindex.bench.routing_ab.engines import ModelEngine, ServiceModel
from kvindex.bench.routing_ab.figures import figures, plot, table
from kvindex.bench.routing_ab.options import MIXED, POLICIES, add_arguments
from kvindex.bench.routing_ab.policies import (
    KVINDEX,
    Approximate,
    KvindexLongest,
    KvindexMixed,
    KvindexRoute,
    LeastLoaded,
    Oracle,
    Policy,
    RoundRobin,
)
from kvindex.bench.routing_ab.replay import Stopped, live_run, replay
from kvindex.bench.routing_ab.traces import (
    SharedPrefix,
    TraceError,
    TraceRequest,
    read_mooncake,
    shared_prefix,
)
from kvindex.runtime.routing import Weights

__all__ = ["MODES", "RoutingPlan", "add_arguments", "main", "run_mode", "run_routing"]

# sgl-router's `max_tree_size` (tokens): its approximate tree is pruned to this, every
# `eviction_interval` (120 s); nothing else tells it what an engine evicted.
SGLANG_MAX_TREE_TOKENS = 1 << 26


@dataclass(frozen=True, slots=True)
class RoutingPlan:
    mode: str
    engines: int
    model: ServiceModel
    shape: SharedPrefix
    weights: dict[str, float] = field(default_factory=dict)  # serve --weights, the oracle's
    events_none: int = 0  # kvindex_mixed: the last K engines publish no KV events


MODES = {
    # seconds: the whole pipeline on a toy trace (the tests)
    "smoke": RoutingPlan(
        "smoke",
        4,
        ServiceModel(gpu_blocks=600),
        SharedPrefix(groups=6, system_tokens=1_024, users=3, turns=3, rate=12.0, think_seconds=3),
    ),
    # about a minute: the README's quick form
    # about a minute (the README's quick form): 8 engines whose pools (1,600 blocks of 16
    # tokens each, 12,800 in all) hold about half the trace's working set
    "quick": RoutingPlan("quick", 8, ServiceModel(gpu_blocks=1_600), SharedPrefix(rate=20.0)),
    # the quick form's shape, longer: 48 chats a group (about as many at once), 7 turns
    "full": RoutingPlan(
        "full",
        8,
        ServiceModel(gpu_blocks=1_600),
        SharedPrefix(groups=16, users=48, turns=7, rate=20.0),
    ),
}


def plan_of(args: argparse.Namespace) -> RoutingPlan:
    plan = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    model = plan.model
    if args.gpu_blocks:
        model = replace(model, gpu_blocks=args.gpu_blocks)
    shape = plan.shape if not args.rate else replace(plan.shape, rate=args.rate)
    if args.skew is not None:
        shape = replace(shape, skew=args.skew)
    weights = parse_weights(args.weights) if args.weights else {}
    engines = args.engines or plan.engines
    none = engines // 2 if args.events_none is None else args.events_none
    if not 0 <= none <= engines:
        raise ValueError(f"--events-none must be between 0 and the {engines} engines, got {none}")
    return replace(
        plan, engines=engines, model=model, shape=shape, weights=weights, events_none=none
    )


def parse_weights(text: str) -> dict[str, float]:
    """`--weights NAME=VALUE[,...]`; ValueError names a bad one."""
    values = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        try:
            values[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--weights: {part!r} must be NAME=NUMBER, e.g. queue=1.5")
    Weights.of(values)
    return values


def load_trace(args: argparse.Namespace, plan: RoutingPlan) -> tuple[list[TraceRequest], str]:
    if args.trace is not None:
        trace = read_mooncake(args.trace, args.limit)
        name = f"Mooncake trace {args.trace.name}"
    else:
        trace = shared_prefix(plan.shape)[: args.limit]
        s = plan.shape
        name = (
            f"shared prefix: {s.groups} groups x {s.system_tokens}-token system prompts, "
            f"{s.users} chats each, {s.turns} turns"
        )
    if args.speedup != 1.0:
        trace = [replace(r, at=r.at / args.speedup) for r in trace]
    return trace, name


def make_policy(
    name: str, engines: list[ModelEngine], url: str | None, weights: dict[str, float]
) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "approximate":
        return Approximate(SGLANG_MAX_TREE_TOKENS // engines[0].model.block_size)
    if name == "oracle":
        return Oracle(engines, Weights.of(weights))
    if url is None:
        raise ValueError(f"{name} needs serve")
    if name == MIXED:
        return KvindexMixed(url)
    return KvindexRoute(url) if name == "kvindex" else KvindexLongest(url)


def fleet(plan: RoutingPlan) -> list[ModelEngine]:
    return [ModelEngine(i, f"engine-{i}", plan.model) for i in range(plan.engines)]


def run_policy(
    name: str,
    trace: Sequence[TraceRequest],
    plan: RoutingPlan,
    workdir: Path,
    stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    engines = fleet(plan)
    if name in KVINDEX:
        options = ["--weights", _weights_text(plan.weights)] if plan.weights else []
        result = live_run(
            trace,
            engines,
            lambda url: make_policy(name, engines, url, plan.weights),
            workdir,
            options=options,
            stop=stop,
            events_none=plan.events_none if name == MIXED else 0,
        )
    else:
        policy = make_policy(name, engines, None, plan.weights)
        result = replay(trace, engines, policy, stop=stop)
    return figures(result)


def _weights_text(weights: dict[str, float]) -> str:
    return ",".join(f"{k}={v:g}" for k, v in weights.items())


def run_routing(
    trace: Sequence[TraceRequest],
    plan: RoutingPlan,
    policies: Sequence[str],
    workdir: Path,
    stop: Callable[[], bool] | None = None,
) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for name in policies:
        _say(f"{name}: {len(trace)} requests on {plan.engines} fresh engines")
        try:
            results[name] = run_policy(name, trace, plan, workdir, stop)
        except Stopped:
            raise
        except Exception as exc:  # one broken policy must not lose the others' figures
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        _say(f"{name}: {json.dumps({k: v for k, v in results[name].items() if k != 'per_engine'})}")
    return results


def _say(message: str) -> None:
    print(f"[routing] {message}", file=sys.stderr, flush=True)


def main(args: argparse.Namespace, stop: Callable[[], bool] | None = None) -> int:
    """The command; `stop` (a signal came) ends it between two requests, serve stopped,
    nothing written."""
    try:
        plan = plan_of(args)
    except ValueError as exc:
        print(f"kvindex bench routing: {exc}", file=sys.stderr)
        return 2
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.events_none is not None and MIXED not in policies:
        policies.append(MIXED)
    unknown = sorted(set(policies) - {*POLICIES, MIXED})
    if unknown:
        print(
            f"kvindex bench routing: unknown policy {unknown[0]!r} "
            f"({', '.join((*POLICIES, MIXED))})",
            file=sys.stderr,
        )
        return 2
    try:
        trace, trace_name = load_trace(args, plan)
    except (OSError, TraceError) as exc:
        print(f"kvindex bench routing: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvindex-routing-") as tmp:
        try:
            results = run_routing(trace, plan, policies, Path(tmp), stop)
        except Stopped:
            print("kvindex bench routing: stopped; no results written", file=sys.stderr)
            return 0
    title = f"{trace_name}; {len(trace)} requests, {plan.engines} engines"
    if MIXED in policies:
        title += f" ({MIXED}: {plan.events_none} without KV events)"
    doc = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "mode": plan.mode,
        "trace": trace_name,
        "requests": len(trace),
        "engines": plan.engines,
        "engines_without_events": plan.events_none if MIXED in policies else 0,
        "service_model": asdict(plan.model),
        "weights": Weights.of(plan.weights).as_dict(),
        "machine": machine_info(),
        "policies": results,
    }
    png = plot(results, out.with_suffix(".png"), title)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(title)
    for row in table(results):
        print(row)
    print(f"written: {out} and {png}")
    return 0


def run_mode(mode: str, out: Path) -> int:
    """The generator's trace in `mode` (`smoke`, `quick`, `full`), every policy, into `out`
    (`python -m kvindex.bench --only routing_ab`)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--out", str(out)] + ([f"--{mode}"] if mode != "full" else [])
    return main(parser.parse_args(argv))
