"""One policy's run: a fresh fleet, the trace's requests at their times, the figures.

Time is the model's (`engines`): the replay steps from one arrival to the next, lets every
engine finish what it has finished by then, and asks the policy where the request goes.
For the kvindex policies the engines are live: each publishes its events on a real vLLM
publisher (0.33's wire format, a replay endpoint) and its load on an SGLang-style load
stream, `serve` follows them, and **before every decision the replay checks that serve
has applied everything** (each engine's last seq, and its load as sent) - the check
Dynamo's A/B guide insists on, made per request. At the end of the run every engine's
pool is compared with the blocks serve holds for it.

With `events_none` K, the fleet's last K engines publish no KV events (their load stream
only): serve follows them as `events=none` instances, whose caches it learns from its own
routing (kvindex.runtime.approximate); their pools are left out of the comparison.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from kvindex.bench.e2e.probes import BenchError, http_json, wait_for, wait_live
from kvindex.bench.e2e.procs import Serve, child
from kvindex.bench.routing_ab.engines import Job, ModelEngine, chain_digests
from kvindex.bench.routing_ab.policies import KVINDEX, Oracle, Policy
from kvindex.bench.routing_ab.traces import TraceRequest
from kvindex.sim.encoding import encode_step, wire_hash
from kvindex.wire.engine_load import LOAD_TOPIC, LoadStat, encode_load
from kvindex.wire.frames import encode_seq
from kvindex.wire.publisher import Publisher

__all__ = ["LiveFleet", "RunResult", "Stopped", "replay"]

SYNC_TIMEOUT = 30.0


class Stopped(Exception):
    """The run was asked to stop (a signal): nothing more is replayed."""


@dataclass(slots=True)
class RunResult:
    policy: str
    jobs: list[Job]
    engines: list[ModelEngine]
    agreement: tuple[int, int] | None = None  # (decisions equal to the oracle's, decisions)
    applied: dict[str, Any] = field(default_factory=dict)
    wall_seconds: float = 0.0


class LiveFleet:
    """The engines' publishers and load streams, and serve's view of them."""

    def __init__(self, engines: Sequence[ModelEngine], workdir: Path, events_none: int = 0) -> None:
        self.engines = list(engines)
        self.workdir = workdir
        # the last `events_none` engines publish no KV events
        silent = self.engines[len(self.engines) - events_none :] if events_none else []
        self.silent = {e.name for e in silent}
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.pubs = [Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") for _ in engines]
        self.loads: list[zmq.Socket[bytes]] = []
        for _ in engines:
            sock = self.ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:*")
            self.loads.append(sock)
        self._load_seq = 0
        self._sent: dict[str, tuple[int, int, int]] = {}
        self.serve: Serve | None = None

    def specs(self) -> list[str]:
        out = []
        for e, pub, load in zip(self.engines, self.pubs, self.loads, strict=True):
            load_ep = load.getsockopt_string(zmq.LAST_ENDPOINT)
            if e.name in self.silent:
                out.append(
                    f"{e.name}=events=none,gpu_blocks={e.model.gpu_blocks},load={load_ep},"
                    f"block_size={e.model.block_size}"
                )
                continue
            out.append(
                f"{e.name}={pub.endpoint},replay={pub.replay_endpoint},load={load_ep},"
                f"block_size={e.model.block_size}"
            )
        return out

    def publish(self) -> None:
        """Every engine's new events as one batch, and every engine's load now."""
        ts = time.time()
        for e, pub, sock in zip(self.engines, self.pubs, self.loads, strict=True):
            events = e.take_events()
            if events and e.name not in self.silent:
                pub.publish_payload(encode_step(events, ts, 0, e.model.block_size))
            m = e.model
            stat = LoadStat(
                num_running_reqs=e.running,
                num_waiting_reqs=len(e.waiting),
                num_tokens=e.used_blocks * m.block_size,
                max_total_num_tokens=m.gpu_blocks * m.block_size,
                attn_dp_rank=0,
                max_running_requests=m.max_running,
                num_waiting_uncached_tokens=e.waiting_tokens,
            )
            self._sent[e.name] = (stat.num_running_reqs, stat.num_waiting_reqs, stat.num_tokens)
            payload = encode_load(stat)
            sock.send_multipart([LOAD_TOPIC.encode(), encode_seq(self._load_seq), payload])
        self._load_seq += 1

    def synced(self, url: str) -> bool:
        """Whether serve has applied every batch published and shows every load as sent."""
        views = {v["name"]: v for v in http_json(url, "/v1/instances")["instances"]}
        for e, pub in zip(self.engines, self.pubs, strict=True):
            view = views.get(e.name)
            if view is None or view["last_seq"] != (pub.next_seq - 1 if pub.next_seq else None):
                return False
            if not view["ranks"]:
                return False
            load = view["ranks"][0].get("load")
            shown = None
            if load is not None:
                shown = (load["running_requests"], load["waiting_requests"], load["kv_tokens_used"])
            if shown != self._sent.get(e.name):
                return False
        return True

    def sync(self, url: str) -> None:
        wait_for(
            "serve to apply every event and load", lambda: self.synced(url), SYNC_TIMEOUT, 0.0005
        )

    def compare(self, url: str) -> dict[str, Any]:
        """Every engine's pool against the blocks serve holds for it."""
        off = 0
        blocks = 0
        for e in self.engines:
            if e.name in self.silent:  # nothing published: serve's view is approximate
                continue
            truth = {str(wire_hash(d, "int")) for d in e.cached}
            held = {
                str(h) for h in http_json(url, f"/v1/instances/{e.name}/blocks")["block_hashes"]
            }
            off += len(truth ^ held)
            blocks += len(truth)
        batches = sum(p.next_seq for p in self.pubs)
        return {
            "exact": off == 0,
            "blocks_off": off,
            "blocks": blocks,
            "batches": batches,
            "engines_without_events": len(self.silent),
        }

    def close(self) -> None:
        for pub in self.pubs:
            pub.close()
        for sock in self.loads:
            sock.close(linger=0)


def start_serve(fleet: LiveFleet, workdir: Path, tag: str, options: Sequence[str] = ()) -> Any:
    args = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--store", "memory"]
    for spec in fleet.specs():
        args += ["--instance", spec]
    return child([*args, *options], workdir / f"serve-{tag}.log", cwd=workdir)


def make_job(req: TraceRequest, block_size: int, seed: int) -> Job:
    prompt = req.prompt_tokens(seed)
    return Job(req.id, req.at, prompt, req.output_tokens(seed), chain_digests(prompt, block_size))


def replay(
    trace: Sequence[TraceRequest],
    engines: list[ModelEngine],
    policy: Policy,
    *,
    fleet: LiveFleet | None = None,
    url: str | None = None,
    seed: int = 0,
    stop: Callable[[], bool] | None = None,
) -> RunResult:
    """Run `trace` through `engines` with `policy` (and through serve at `url` if `fleet`)."""
    started = time.perf_counter()
    oracle = Oracle(engines) if fleet is not None else None
    equal = 0
    jobs = []
    for req in trace:
        if stop is not None and stop():
            raise Stopped
        for e in engines:
            e.advance(req.at)
        job = make_job(req, engines[0].model.block_size, seed)
        if fleet is not None and url is not None:
            fleet.publish()
            fleet.sync(url)
        best: set[int] = set()
        if oracle is not None:
            scores = oracle.scores(job, engines)
            top = max(scores.values())
            best = {i for i, e in enumerate(engines) if scores[e.name] >= top - 1e-9}
        chosen = policy.choose(job, engines)
        equal += chosen in best
        engines[chosen].arrive(job, req.at)
        jobs.append(job)
    _drain(engines)
    result = RunResult(policy.name, jobs, engines)
    if fleet is not None and url is not None:
        fleet.publish()
        fleet.sync(url)
        result.applied = fleet.compare(url)
        result.agreement = (equal, len(jobs))
    result.wall_seconds = time.perf_counter() - started
    return result


def _drain(engines: Sequence[ModelEngine]) -> None:
    """Run every engine until it has nothing left to do."""
    while True:
        times = [t for e in engines if (t := e.next_event()) is not None]
        if not times:
            return
        now = min(times)
        for e in engines:
            e.advance(now)


def live_run(
    trace: Sequence[TraceRequest],
    engines: list[ModelEngine],
    make_policy: Callable[[str], Policy],
    workdir: Path,
    seed: int = 0,
    options: Sequence[str] = (),
    stop: Callable[[], bool] | None = None,
    events_none: int = 0,
) -> RunResult:
    """`replay` with a kvindex policy: publishers, serve, the run, everything stopped (the
    last `events_none` engines publishing no KV events)."""
    fleet = LiveFleet(engines, workdir, events_none)
    try:
        with start_serve(fleet, workdir, engines[0].name + str(id(fleet)), options) as c:
            srv = Serve(c)
            url = srv.wait_url(60)
            wait_live(url, 60)
            fleet.publish()
            fleet.sync(url)
            policy = make_policy(url)
            if policy.name not in KVINDEX:
                raise BenchError(f"{policy.name} is not a kvindex policy")
            try:
                return replay(trace, engines, policy, fleet=fleet, url=url, seed=seed, stop=stop)
            finally:
                close = getattr(policy, "close", None)
                if close is not None:
                    close()
    finally:
        fleet.close()
