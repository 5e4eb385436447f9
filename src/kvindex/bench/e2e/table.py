"""The end-to-end cases' rows in the bench table: kvindex's figure (with its ratio to
Dynamo's standalone indexer where the target is one), the baselines measured in the same
run, and the target."""

from __future__ import annotations

from typing import Any

__all__ = ["table_rows"]

Row = tuple[str, str, str, str]


def table_rows(results: dict[str, Any]) -> list[Row]:
    """(case, kvindex, baseline, target) rows for the bench table."""
    return [
        *_ingest_rows(results),
        _workers_row(results.get("e2e_ingest_workers", {})),
        _cpu_row(results),
        _gil_row(results),
        *_lookup_rows(results.get("e2e_lookup", {})),
        _fresh_row(results.get("e2e_freshness", {})),
        _warm_row(results.get("e2e_warm_restart", {})),
        *_routing_rows(results.get("e2e_routing", {})),
        _chat_row(results.get("e2e_chat_lookup", {})),
    ]


def _failed(case: dict[str, Any]) -> str | None:
    if not case:
        return "not run"
    if "error" in case:
        return f"failed: {str(case['error'])[:160]}"
    if "skipped" in case:
        return f"skipped: {case['skipped']}"
    return None


def _m(per_s: float) -> str:
    return f"{per_s / 1e6:.2f} M/s"


def _rate(case: dict[str, Any], label: str) -> str:
    failed = _failed(case)
    if failed:
        return f"{label} {failed}"
    text = f"{label} {_m(case['per_s'])}"
    if "blocks_off" in case:
        off = case["blocks_off"]
        text += ", exact" if off == 0 else f", {off:,} blocks off"
    return text


def _ingest(case: dict[str, Any]) -> str:
    failed = _failed(case)
    if failed:
        return failed
    text = _m(case["per_s"])
    if "persist_lag_seconds" in case:
        text += f" (applied {_m(case['applied_per_s'])})"
    if "vs_dynamo" in case:
        text += f", {case['vs_dynamo']:.2f}x Dynamo"
    trouble = [f"{k} {case[k]}" for k in ("gaps", "replayed_batches", "lost_batches") if case[k]]
    if not case["exact"]:
        trouble.append("NOT EXACT")
    return text + (f" [{', '.join(trouble)}]" if trouble else "")


def _ingest_rows(results: dict[str, Any]) -> list[Row]:
    work = results.get("e2e_workload", {})
    what = f"{work.get('instances', '?')} publishers, {work.get('block_events', 0) / 1e6:.2g}M"
    memory = results.get("e2e_ingest_memory", {})
    dynamo = _rate(results.get("e2e_ingest_dynamo", {}), "Dynamo standalone")
    naive = _rate(results.get("e2e_naive", {}), "naive SUB consumer")
    return [
        (
            f"e2e ingest: {what} block events -> serve, memory store (until applied)",
            _ingest(memory),
            f"{dynamo}; {naive}",
            ">= 2.0x Dynamo",
        ),
        (
            "e2e ingest: the same, SQLite store (until committed)",
            _ingest(results.get("e2e_ingest_sqlite", {})),
            f"{dynamo}; {_sqlite_python(results.get('e2e_ingest_sqlite_python', {}))}",
            ">= 1.5x Dynamo",
        ),
        (
            "e2e ingest: the same, Redis store (until in Redis)",
            _ingest(results.get("e2e_ingest_redis", {})),
            _rate(memory, "serve, memory store"),
            ">= 0.3 M/s",
        ),
    ]


def _sqlite_python(case: dict[str, Any]) -> str:
    """The SQLite case with every batch through Python (KVINDEX_C_INGEST=0), same run."""
    failed = _failed(case)
    label = "serve with every batch in Python (KVINDEX_C_INGEST=0)"
    return f"{label} {failed}" if failed else f"{label} {_ingest(case)}"


def _cpu_row(results: dict[str, Any]) -> Row:
    """serve's CPU seconds per million block events over the burst (its HTTP answers to
    the bench's polls included; the store's worker process apart), beside Dynamo's."""
    label = "e2e serve CPU seconds per M block events over the burst (memory / SQLite store)"
    memory, sqlite = results.get("e2e_ingest_memory", {}), results.get("e2e_ingest_sqlite", {})

    def cpu(case: dict[str, Any]) -> str:
        failed = _failed(case)
        if failed or "serve_cpu_seconds_per_m_events" not in case:
            return failed or "-"
        text = f"{case['serve_cpu_seconds_per_m_events']:.2f} s"
        if "cpu_vs_dynamo" in case:
            text += f" ({case['cpu_vs_dynamo']:.2f}x Dynamo)"
        worker = case.get("store_worker_cpu_seconds_per_m_events")
        return text if worker is None else f"{text} + the writer {worker:.2f} s"

    dynamo = results.get("e2e_ingest_dynamo", {})
    theirs = _failed(dynamo) or (
        f"{dynamo['cpu_seconds_per_m_events']:.2f} s"
        if "cpu_seconds_per_m_events" in dynamo
        else "-"
    )
    python = results.get("e2e_ingest_sqlite_python", {})
    base = f"Dynamo standalone {theirs}"
    if not _failed(python) and "serve_cpu_seconds_per_m_events" in python:
        base += f"; SQLite with every batch in Python {cpu(python)}"
    return (label, f"memory {cpu(memory)}; SQLite {cpu(sqlite)}", base, "-")


def _gil_row(results: dict[str, Any]) -> Row:
    """serve's ingest threads' time holding the GIL per batch over the burst (its own
    counters, /v1/stats), and the share of the batches the C path took."""
    label = "e2e GIL held per batch by serve's ingest threads over the burst (memory / SQLite)"

    def gil(case: dict[str, Any]) -> str:
        failed = _failed(case)
        if failed or "serve_gil_us_per_batch" not in case:
            return failed or "-"
        share = case["serve_batches_in_c"] / max(1, case["serve_batches"])
        return f"{case['serve_gil_us_per_batch']:.2f} us ({share:.0%} of batches in C)"

    memory, sqlite = results.get("e2e_ingest_memory", {}), results.get("e2e_ingest_sqlite", {})
    python = results.get("e2e_ingest_sqlite_python", {})
    return (
        label,
        f"memory {gil(memory)}; SQLite {gil(sqlite)}",
        f"SQLite with every batch in Python {gil(python)}",
        "<= 1 us",
    )


def _workers_row(case: dict[str, Any]) -> Row:
    """serve's ingest with 1 ingest worker beside the default of one per core (2 here)."""
    label = "e2e ingest by ingest workers: the same stream, memory store, 2 workers vs 1"
    shards = case.get("workers", {}).get("2", {}).get("serve_index_shards")
    if shards is not None:
        label += f" (the index in {shards} shard{'s' if shards > 1 else ''})"
    failed = _failed(case)
    if failed:
        return (label, failed, "-", "-")
    two, one = case["workers"].get("2", {}), case["workers"].get("1", {})
    ours = _ingest(two)
    if "speedup" in case:
        ours += f" ({case['speedup']:.2f}x 1 worker)"
    return (label, ours, f"1 worker {_ingest(one)}", "-")


def _latency(phase: dict[str, Any], unit: str = "ms") -> str:
    if unit == "us":
        return f"p50 {phase['p50_ms'] * 1e3:,.0f} us, p99 {phase['p99_ms'] * 1e3:,.0f} us"
    return f"p50 {phase['p50_ms']:.2f} ms, p99 {phase['p99_ms']:.2f} ms"


def _ratio(phase: dict[str, Any]) -> str:
    if "p50_vs_dynamo" not in phase:
        return ""
    return f" (p50 {phase['p50_vs_dynamo']:.2f}x, p99 {phase['p99_vs_dynamo']:.2f}x Dynamo)"


def _exact(side: dict[str, Any]) -> str:
    return ", exact" if side.get("exact") else f", {side.get('wrong_answers', '?')} WRONG ANSWERS"


def _load(side: dict[str, Any]) -> str:
    ran_out = " [the stream ran out before the lookups ended]" if side["load_ran_out"] else ""
    return f" (load {side['load_achieved_per_s'] / 1e3:.0f}k/s){ran_out}"


def _python(case: dict[str, Any], phase: str) -> str:
    """The same serve answering every lookup in Python (--lookup-thread off), same run."""
    python = case.get("kvindex_python")
    if not python or _failed(python) or phase not in python:
        return ""
    return f"; serve --lookup-thread off {_latency(python[phase])}{_exact(python)}"


def _lookup_rows(case: dict[str, Any]) -> list[Row]:
    size = f"{case.get('instances', '?')} x {case.get('per_instance', 0):,} blocks"
    failed = _failed(case)
    ours, theirs = case.get("kvindex", {}), case.get("dynamo", {})
    ours_failed = failed or _failed(ours)
    theirs_failed = failed or _failed(theirs)
    rows: list[Row] = []
    for phase, label, target in (
        ("idle", "idle", "p50 <= 0.5x Dynamo"),
        ("loaded", "under a 200k/s stream", "p50 <= 0.5x Dynamo, p99 <= 0.8x Dynamo"),
    ):
        name = f"e2e POST /v1/lookup vs Dynamo POST /query, 512-block prompt, {size}, {label}"
        if ours_failed:
            mine = ours_failed
        else:
            mine = _latency(ours[phase]) + _ratio(ours[phase]) + _exact(ours)
            if phase == "loaded":
                mine += _load(ours)
        theirs_text = theirs_failed or _latency(theirs[phase]) + _exact(theirs)
        if phase == "loaded" and not theirs_failed:
            theirs_text += _load(theirs)
        rows.append((name, mine, f"Dynamo standalone {theirs_text}{_python(case, phase)}", target))
    floor = "floor_idle"
    rows.append(
        (
            "e2e empty GET, idle: serve GET /healthz vs Dynamo GET /health",
            ours_failed or _latency(ours[floor], "us") + _ratio(ours[floor]),
            f"Dynamo standalone {theirs_failed or _latency(theirs[floor], 'us')}",
            "-",
        )
    )
    rows.append(_memory_row(case, ours_failed, theirs_failed))
    return rows


def _memory_row(case: dict[str, Any], ours_failed: str | None, theirs_failed: str | None) -> Row:
    ours, theirs = case.get("kvindex", {}), case.get("dynamo", {})
    entries = case.get("entries", 0)

    def per(side: dict[str, Any], failed: str | None) -> str:
        value = side.get("bytes_per_entry")
        return failed or ("-" if value is None else f"{value:.0f} B")

    mine = per(ours, ours_failed)
    if "memory_vs_dynamo" in ours:
        mine += f", {ours['memory_vs_dynamo']:.2f}x Dynamo"
    if not ours_failed and ours.get("heap_bytes_per_entry") is not None:
        mine += f"; by the allocators' statistics {ours['heap_bytes_per_entry']:.0f} B"
        if "heap_vs_dynamo" in ours:
            mine += f", {ours['heap_vs_dynamo']:.2f}x Dynamo's RSS"
        if ours.get("core_bytes_per_entry") is not None:
            mine += f" (the core's C {ours['core_bytes_per_entry']:.0f} B)"
    return (
        f"e2e memory per (instance, block) entry: process RSS growth over a "
        f"{entries / 1e6:.3g}M-entry fill (and the heap's, by its allocators)",
        mine,
        f"Dynamo standalone {per(theirs, theirs_failed)}",
        "<= 1.0x Dynamo",
    )


def _fresh_row(case: dict[str, Any]) -> Row:
    name = "e2e freshness: publish -> visible over HTTP, at 100k/s"
    target = "p99 <= 10 ms"
    failed = _failed(case)
    if failed:
        return (name, failed, "-", target)
    ours = _latency(case)
    missing = case["markers"] - case["markers_seen"]
    if missing:
        ours += f" [{missing} markers never seen]"
    return (name, ours, f"resolution {case['resolution_ms']:.2f} ms (one poll)", target)


def _warm_row(case: dict[str, Any]) -> Row:
    target = "<= 1 s to healthz (1M blocks)"
    name = f"e2e warm restart: serve on a {case.get('blocks', 0):,}-block SQLite store"
    failed = _failed(case)
    if failed:
        return (name, failed, "-", target)
    ours = f"{case['healthz_seconds']:.2f} s to healthz"
    ours += f", {case['blocks_listed_seconds']:.2f} s to all blocks counted"
    base = f"empty memory store: {case['cold_healthz_seconds']:.2f} s"
    if "python_healthz_seconds" in case:
        base = (
            f"the snapshot read in Python: {case['python_healthz_seconds']:.2f} s to healthz, "
            f"{case['python_blocks_listed_seconds']:.2f} s to all counted; {base}"
        )
    return (name, ours, base, target)


def _routing_rows(case: dict[str, Any]) -> list[Row]:
    """A router's requests beside their baselines (`routing`); tokenization alone."""
    size = f"{case.get('instances', '?')} x {case.get('per_instance', 0):,} blocks"
    tokens = f"{case.get('prompt_tokens', 0):,}-token prompt"
    http = case.get("http", {})
    failed = _failed(case) or _failed(http)

    def side(kind: str) -> str:
        phase = http[kind]
        text = _latency(phase)
        if "p50_extra_ms" in phase:
            text += f" (p50 +{phase['p50_extra_ms']:.2f} ms)"
        wrong = phase["wrong_answers"]
        return text + (", exact" if wrong == 0 else f", {wrong} WRONG ANSWERS")

    plain = "" if failed else f"POST /v1/lookup token ids (plain path): {side('lookup')}"
    rows: list[Row] = [
        (
            f"e2e POST /v1/lookup by prompt text (tokenized in serve), {tokens}, {size}",
            failed or side("prompt"),
            failed or f"the same token ids with the model: {side('lookup_model')}; {plain}",
            "-",
        ),
        (
            f"e2e POST /v1/route (score + prediction), {tokens}, {size}",
            failed or side("route"),
            failed or f"POST /v1/lookup, same token ids and model: {side('lookup_model')}",
            "-",
        ),
    ]
    alone = case.get("tokenize", {})
    alone_failed = _failed(case) or _failed(alone)
    if alone_failed:
        mine = alone_failed
    else:
        mine = "; ".join(
            f"{label} p50 {alone[key]['p50_ms']:.2f} ms "
            f"({alone[key]['tokens_per_prompt']:,.0f} tokens, "
            f"{alone[key]['us_per_token']:.2f} us/token)"
            for key, label in (("word_level", "word-level"), ("bpe", "byte-level BPE"))
        )
    rows.append(
        (
            "tokenization alone (kvindex's LocalTokenizer, in process), per prompt",
            mine,
            failed or f"plain lookup round trip {_latency(http['lookup'])}",
            "-",
        )
    )
    return rows


def _chat_row(case: dict[str, Any]) -> Row:
    """A chat's lookup by messages (the tokenizer's prefix cache) beside its token ids."""
    failed = _failed(case)
    label = "e2e POST /v1/lookup by chat messages, turn >= 10, 8k-token history"
    if failed:
        return (label, failed, failed, "p50 <= 1.5x the lookup by token ids")

    def side(kind: str) -> str:
        phase = case[kind]
        wrong = phase["wrong_answers"]
        return _latency(phase) + (", exact" if wrong == 0 else f", {wrong} WRONG ANSWERS")

    cache = case.get("tokenizer_cache", {})
    hits, misses = cache.get("hits_total", 0), cache.get("misses_total", 0)
    mine = (
        f"{side('messages')} ({case['messages_vs_token_ids_model']:.2f}x with the model, "
        f"{case['messages_vs_token_ids']:.2f}x the plain path; {case['tokens_p50']:,} tokens; "
        f"prefix cache {hits:.0f} hits, {misses:.0f} misses)"
    )
    base = (
        f"POST /v1/lookup, the same token ids with the model: {side('token_ids_model')}; "
        f"plain path: {side('token_ids')}"
    )
    return (label, mine, base, "p50 <= 1.5x the lookup by token ids")
