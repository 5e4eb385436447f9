"""The index sharded by publisher (issue 23 item 2): what it costs in memory and lookup time
and what it gives ingest, measured beside one index in the same run
(docs/performance.md, "How ingest scales"; Dynamo's and llm-d's shape).

The lookup bench's fill (`kvindex.bench.workloads.fill`: 64 x 100k blocks by default, the
README's lookup row) is applied, as vLLM batches, to 1, 2, 4, 8, 16 sub-indexes, each
holding the publishers assigned to it (round-robin, or `--assign fnv`: FNV-1a of the
publisher's name modulo the shards, llm-d's way); then the bench's 512-block prompts
(`workloads.prompts`) are looked up over every shard and the answers merged. Per shard
count, each in fresh processes:

- `c` (bench/pub_shards.c, built against the core's sources): the core's counted bytes
  and the RSS growth per entry; lookups with the prompt's keys digested once and every
  shard walked under its read lock (`once`), digested again per shard (`per_shard`: what
  the compiled API, which takes tokens, costs), the digest alone (`hash`), and the
  digest plus the slowest shard's walk (`slowest_shard`: the floor of walking the shards
  in parallel threads, their hand-off not counted);
- `py`: the same shards as `CompiledIndex`es in process, the way the probe measures
  one (`FleetIndex.lookup` on a list of ints, the README's 30 us row), one call per
  shard and the rows merged (`list`), and every shard asked with the prompt as uint32
  bytes (`bytes`: what the HTTP fast path's `parse_lookup` hands the core, made before
  the clock starts); their RSS and allocator bytes per entry;
- `apply`: bench/apply_ceiling's "a core each" case generalised: k threads, each applying
  its publishers' batches of the drain stream (`--apply-instances` publishers) to a core
  of its own, against 1 thread; with `one_lock` (k threads, one core) beside.

Every shard count's merged answers must equal one index's (per prompt, per publisher),
in C and in Python, or the run fails; the apply cases must leave each publisher holding
what one thread does.

    python bench/pub_shards.py [--instances 64] [--per-instance 100000] [--prompts 500]
        [--shards 1,2,4,8,16] [--repeats 3] [--rounds 3] [--assign rr|fnv]
        [--apply-instances 16] [--apply-events 1000000] [--no-apply] [--no-py]

Prints one JSON object: per shard count the best of `--repeats` processes (each the
median of `--rounds` passes over the prompts), the load averages and the time.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "src/kvindex/index/csrc"
EVENTS_PER_BATCH = 64


def build(out: Path) -> None:
    sources = [str(CSRC / n) for n in ("core.c", "parse.c", "answer.c")]
    cmd = ["cc", "-O2", "-std=gnu11", "-pthread", f"-I{CSRC}", "-o", str(out)]
    subprocess.run([*cmd, str(ROOT / "bench/pub_shards.c"), *sources], check=True)


def dump(path: Path, instances: int, per_instance: int, prompt_count: int) -> int:
    """The fill as vLLM batches (up to 64 stores of one publisher each, in the fill's
    order) and the prompts' tokens; returns the entries."""
    from kvindex.bench.common import BLOCK
    from kvindex.bench.workloads import FillSpec, fill, prompts
    from kvindex.wire import BlockStored
    from kvindex.wire.publisher import encode_batch

    spec = FillSpec(instances, per_instance)
    asked = prompts(spec, prompt_count)
    batches: list[tuple[int, bytes]] = []
    events: list[BlockStored] = []
    owner, entries = -1, 0

    def flush() -> None:
        if events:
            batches.append((owner, encode_batch(events, ts=0.0)))
            events.clear()

    for s in fill(spec):
        if s.instance != owner or len(events) == EVENTS_PER_BATCH:
            flush()
            owner = s.instance
        events.append(BlockStored(s.hashes, s.parent, s.tokens, BLOCK, medium="GPU"))
        entries += len(s.hashes)
    flush()
    ptokens = len(asked[0].tokens)
    with path.open("wb") as f:
        f.write(struct.pack("<IIII", instances, len(batches), len(asked), ptokens))
        for inst, payload in batches:
            f.write(struct.pack("<II", inst, len(payload)))
            f.write(payload)
        for p in asked:
            if len(p.tokens) != ptokens:
                raise SystemExit("prompts of differing lengths")
            f.write(p.tokens.astype("<u4").tobytes())
    return entries


def read_dump(path: Path) -> tuple[int, list[tuple[int, bytes]], list[list[int]]]:
    data = path.read_bytes()
    npubs, nbatches, nprompts, ptokens = struct.unpack_from("<IIII", data, 0)
    at = 16
    batches = []
    for _ in range(nbatches):
        inst, n = struct.unpack_from("<II", data, at)
        batches.append((inst, data[at + 8 : at + 8 + n]))
        at += 8 + n
    prompts = []
    for _ in range(nprompts):
        prompts.append(array("I", data[at : at + 4 * ptokens]).tolist())
        at += 4 * ptokens
    return npubs, batches, prompts


def fnv1a32(data: bytes) -> int:
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def assignment(instances: int, shards: int, how: str) -> list[int]:
    """Each publisher's shard: round-robin, or FNV-1a of its name (llm-d hashes the pod)."""
    if how == "fnv":
        return [fnv1a32(f"i{i}".encode()) % shards for i in range(instances)]
    return [i % shards for i in range(instances)]


def digest(depths: list[list[int]]) -> str:
    """As the probe's `matches_digest`: what every prompt matched, per publisher."""
    h = hashlib.sha256()
    for d in depths:
        h.update(json.dumps(d).encode())
    return h.hexdigest()


def _percentiles(times: list[float]) -> tuple[float, float]:
    from kvindex.bench.common import percentile

    times.sort()
    return percentile(times, 0.50) * 1e6, percentile(times, 0.99) * 1e6


def child(path: Path, assign: list[int], rounds: int) -> dict[str, Any]:
    """The shards as CompiledIndexes in this process: memory, then lookups."""
    from kvindex.bench.common import rss_bytes, trim_heap
    from kvindex.index import _core
    from kvindex.index.compiled import CompiledIndex
    from kvindex.subscriber.messages import SourceKey

    npubs, batches, prompts = read_dump(path)
    nshards = max(assign) + 1
    gc.collect()
    trim_heap()
    rss0, alloc0 = rss_bytes(), _core.allocated()[0]
    shards = [CompiledIndex() for _ in range(nshards)]
    sources = [SourceKey(f"i{i}") for i in range(npubs)]
    start = time.perf_counter()
    slow = 0
    for inst, payload in batches:
        slow += not shards[assign[inst]].apply_payload(sources[inst], payload).fast
    build_s = time.perf_counter() - start
    del batches
    gc.collect()
    rss_delta, alloc = rss_bytes() - rss0, _core.allocated()[0] - alloc0
    entries = sum(s._core.entries() for s in shards)
    structures = sum(sum(s._core.memory().values()) for s in shards)
    order = {f"i{i}": i for i in range(npubs)}

    def depths(rows: list[Any]) -> list[int]:
        out = [0] * npubs
        for row in rows:
            out[order[row.instance]] = row.matched_blocks
        return out

    def ask_list(tokens: list[int]) -> list[Any]:
        rows: list[Any] = []
        for s in shards:
            rows.extend(s.lookup(tokens))
        return rows

    def ask_bytes(data: bytes) -> list[Any]:
        rows: list[Any] = []
        for s in shards:
            rows.extend(s.lookup(data))  # type: ignore[arg-type]  # the core takes uint32 bytes
        return rows

    as_bytes = [array("I", t).tobytes() for t in prompts]
    answers = [depths(ask_list(t)) for t in prompts]
    if any(depths(ask_bytes(b)) != a for b, a in zip(as_bytes, answers, strict=True)):
        raise SystemExit("lookups by bytes and by list disagree")
    out: dict[str, Any] = {
        "shards": nshards,
        "entries": entries,
        "slow_batches": slow,
        "build_s": build_s,
        "rss_delta_bytes": rss_delta,
        "alloc_bytes": alloc,
        "structure_bytes": structures,
        "digest": digest(answers),
    }
    asks: tuple[tuple[str, Callable[[Any], list[Any]], list[Any]], ...] = (
        ("list", ask_list, prompts),
        ("bytes", ask_bytes, as_bytes),
    )
    for name, ask, given in asks:
        p50s, p99s = [], []
        for _ in range(rounds):
            times = []
            for tokens in given:
                t0 = time.perf_counter()
                ask(tokens)
                times.append(time.perf_counter() - t0)
            p50, p99 = _percentiles(times)
            p50s.append(p50)
            p99s.append(p99)
        out[name] = {
            "p50_us": statistics.median(p50s),
            "p99_us": statistics.median(p99s),
            "round_p50_us": p50s,
            "round_p99_us": p99s,
        }
    return out


def _best(runs: list[dict[str, Any]], modes: tuple[str, ...]) -> dict[str, Any]:
    """The first run's figures, each mode's p50 and p99 the best over the runs."""
    out = dict(runs[0])
    for m in modes:
        out[m] = {
            "p50_us": min(r[m]["p50_us"] for r in runs),
            "p99_us": min(r[m]["p99_us"] for r in runs),
            "runs_p50_us": [round(r[m]["p50_us"], 2) for r in runs],
            "runs_p99_us": [round(r[m]["p99_us"], 2) for r in runs],
        }
    out["rss_delta_bytes_runs"] = [r["rss_delta_bytes"] for r in runs]
    return out


def lookups(args: argparse.Namespace, shard_counts: list[int], tmp: Path) -> dict[str, Any]:
    exe, stream = tmp / "pub_shards", tmp / "fill.bin"
    build(exe)
    t0 = time.perf_counter()
    entries = dump(stream, args.instances, args.per_instance, args.prompts)
    print(f"fill dumped: {entries:,} entries, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {"c": {}, "py": {}}
    for rep in range(args.repeats):
        for n in shard_counts:  # the shard counts alternate, repeat by repeat
            assign = assignment(args.instances, n, args.assign)
            arg = ",".join(map(str, assign))
            got = subprocess.run(
                [str(exe), str(stream), str(n), arg, str(args.rounds)],
                check=True,
                capture_output=True,
                text=True,
            )
            c = json.loads(got.stdout)
            c["digest"] = digest(c.pop("depths"))
            runs["c"].setdefault(n, []).append(c)
            if not args.no_py:
                cmd = [sys.executable, __file__, "--child", str(stream), arg, str(args.rounds)]
                got = subprocess.run(cmd, check=True, capture_output=True, text=True)
                runs["py"].setdefault(n, []).append(json.loads(got.stdout))
            print(f"repeat {rep + 1}: {n} shards done", file=sys.stderr)
    out: dict[str, Any] = {"entries": entries}
    one = runs["c"][shard_counts[0]][0]["digest"]
    for kind, modes in (
        ("c", ("once", "per_shard", "hash", "slowest_shard")),
        ("py", ("list", "bytes")),
    ):
        for n, reps in runs[kind].items():
            for r in reps:
                if r["digest"] != one:
                    raise SystemExit(f"{kind}, {n} shards: the merged answers are not one index's")
                if r["entries"] != entries:
                    raise SystemExit(f"{kind}, {n} shards: {r['entries']} entries, not {entries}")
            best = _best(reps, modes)
            best["alloc_bytes_per_entry"] = best["alloc_bytes"] / entries
            best["rss_bytes_per_entry"] = min(best["rss_delta_bytes_runs"]) / entries
            out.setdefault(kind, {})[n] = best
    out["exact"] = True
    out["matches_digest"] = one
    return out


def apply_rates(args: argparse.Namespace, shard_counts: list[int], tmp: Path) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "bench"))
    import apply_ceiling

    exe, stream = tmp / "apply_ceiling", tmp / "stream.bin"
    apply_ceiling.build(exe)
    apply_ceiling.dump(stream, args.apply_instances, args.apply_events, 1024)
    cases = {f"core_each_{k}": (k, k) for k in shard_counts if k <= args.apply_instances}
    cases.update({f"one_lock_{k}": (k, 1) for k in shard_counts if 1 < k <= args.apply_instances})
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeats):
        for case, (threads, cores) in cases.items():
            run = subprocess.run(
                [str(exe), str(stream), str(threads), str(cores)],
                check=True,
                capture_output=True,
                text=True,
            )
            got = json.loads(run.stdout)
            if case not in best or got["per_s"] > best[case]["per_s"]:
                best[case] = got
    one = best["core_each_1"]
    for case, got in best.items():
        got["vs_one_thread"] = got["per_s"] / one["per_s"]
        if (got["digest"], got["entries"]) != (one["digest"], one["entries"]):
            raise SystemExit(f"{case}: the publishers hold other blocks than one thread's")
    return {"instances": args.apply_instances, "events": args.apply_events, "cases": best}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        path, arg, rounds = sys.argv[2], sys.argv[3], int(sys.argv[4])
        print(json.dumps(child(Path(path), [int(x) for x in arg.split(",")], rounds)))
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--per-instance", type=int, default=100_000)
    parser.add_argument("--prompts", type=int, default=500)
    parser.add_argument("--shards", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per case")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the prompts each")
    parser.add_argument("--assign", choices=("rr", "fnv"), default="rr")
    parser.add_argument("--apply-instances", type=int, default=16)
    parser.add_argument("--apply-events", type=int, default=1_000_000)
    parser.add_argument("--no-apply", action="store_true")
    parser.add_argument("--no-py", action="store_true")
    args = parser.parse_args()
    shard_counts = [int(x) for x in args.shards.split(",")]
    if shard_counts[0] != 1:
        raise SystemExit("--shards must start with 1 (the one index every count is held to)")
    out: dict[str, Any] = {
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "instances": args.instances,
        "per_instance": args.per_instance,
        "prompts": args.prompts,
        "assign": args.assign,
        "load_averages": [os.getloadavg()],
    }
    with tempfile.TemporaryDirectory(prefix="kvindex-pubshards-") as tmp:
        out["lookups"] = lookups(args, shard_counts, Path(tmp))
        out["load_averages"].append(os.getloadavg())
        if not args.no_apply:
            out["apply"] = apply_rates(args, shard_counts, Path(tmp))
            out["load_averages"].append(os.getloadavg())
    out["ended_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
