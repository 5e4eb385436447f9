"""The SQLite snapshot loaded in C (kvindex.store.sqlite.fastload, `_snapload.c`): the index
it makes is the one the Python loader makes, into the compiled index and into the pure
one; a record it does not take as the reference would is left to Python whole; a damaged
record is the same one-line error either way."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_store_sqlite import (
    B0,
    B1,
    PROMPTS,
    A,
    Harness,
    apply_rich,
    chain_hash,
    rich_ops,
    rich_store,
    same_state,
)

from kvindex.index import ReferenceIndex
from kvindex.store import StoreError
from kvindex.store.base import LoadResult
from kvindex.store.sqlite import SQLiteStore
from kvindex.subscriber import Delivery
from kvindex.wire import BigramBlockStored, BlockRemoved, BlockStored, decode_batch
from kvindex.wire.publisher import encode_batch

compiled = pytest.importorskip("kvindex.index.compiled")
fastload = pytest.importorskip("kvindex.store.sqlite.fastload")
pytest.importorskip("kvindex.store.sqlite._snapload")

SOURCES = (A, B0, B1)


@contextlib.contextmanager
def python_loader() -> Iterator[None]:
    """Every load in Python (the reference), as with KVINDEX_SNAPSHOT_LOAD=python."""
    before = os.environ.get("KVINDEX_SNAPSHOT_LOAD")
    os.environ["KVINDEX_SNAPSHOT_LOAD"] = "python"
    try:
        yield
    finally:
        if before is None:
            del os.environ["KVINDEX_SNAPSHOT_LOAD"]
        else:
            os.environ["KVINDEX_SNAPSHOT_LOAD"] = before


def load(path: Path, index: Any, in_c: bool) -> LoadResult:
    with contextlib.nullcontext() if in_c else python_loader():
        return SQLiteStore(path).load(index)


def three_loads(path: Path, c_takes_it: bool = True) -> tuple[Any, Any, Any]:
    """The store loaded in C into the compiled index, in Python into the compiled index
    and in Python into the pure one; their load results agree. `c_takes_it`: the C
    loader loads this snapshot (rather than leaving it to Python)."""
    taken = fastload.load_in_c(path, compiled.CompiledIndex()) is not None
    assert taken == c_takes_it
    in_c, in_py, pure = compiled.CompiledIndex(), compiled.CompiledIndex(), ReferenceIndex()
    results = [load(path, in_c, True), load(path, in_py, False), load(path, pure, False)]
    assert len({(r.blocks_restored, r.log_batches_replayed) for r in results}) == 1
    assert results[0].checkpoints == results[1].checkpoints == results[2].checkpoints
    return in_c, in_py, pure


def publishers(index: Any) -> list[Any]:
    """Each publisher's core bit, last batch time and seq, in registration order."""
    return [(k, p.bit, p.last_ts, p.last_seq) for k, p in index._sources.items()]


def identical(in_c: Any, in_py: Any, pure: Any) -> None:
    same_state(in_c, in_py, PROMPTS)
    same_state(in_c, pure, PROMPTS)
    for name in ("a", "b"):
        assert in_c.cache_stats(name) == in_py.cache_stats(name) == pure.cache_stats(name)
    assert publishers(in_c) == publishers(in_py)
    assert [k for k, *_ in publishers(in_c)] == [k for k, *_ in publishers(pure)]
    assert in_c.entries() == in_py.entries() == pure.entries()
    assert in_c.tree_nodes() == in_py.tree_nodes()
    assert in_c.memory() == in_py.memory()
    assert in_c.slow_batches == in_py.slow_batches


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rich_ops, st.lists(st.integers(0, 49), max_size=3))
def test_the_c_load_makes_the_index_the_python_load_makes(
    tmp_path_factory: pytest.TempPathFactory, plan: list[Any], compact_at: list[int]
) -> None:
    h = Harness(tmp_path_factory.mktemp("db") / "s.sqlite")
    for i, op in enumerate(plan):
        apply_rich(h, [op])
        if i in compact_at:
            h.writer.compact()
    identical(*three_loads(h.path))  # snapshot + log tail, as after a crash
    h.writer.compact()
    identical(*three_loads(h.path))  # the snapshot alone
    h.writer.close()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rich_ops, st.integers(2, 3))
def test_the_c_load_into_shards_is_the_python_load(
    tmp_path_factory: pytest.TempPathFactory, plan: list[Any], shards: int
) -> None:
    """An index in shards (kvindex.index.sharded) loads in C too, every publisher through
    its own shard's Core: the state, lookups and numbering of the Python load into one
    index (and into shards), snapshot and log tail."""
    from kvindex.index.sharded import ShardedIndex

    h = Harness(tmp_path_factory.mktemp("db") / "s.sqlite")
    apply_rich(h, plan)
    sharded = ShardedIndex(shards)
    assert fastload.available(sharded)
    assert fastload.load_in_c(h.path, ShardedIndex(shards)) is not None  # taken in C
    in_c, in_py, one = load(h.path, sharded, True), ShardedIndex(shards), ReferenceIndex()
    load(h.path, in_py, False)
    load(h.path, one, False)
    for index in (in_py, one):
        same_state(sharded, index, PROMPTS)
        assert sharded.source_bits() == index.source_bits()
    assert sharded.entries() == one.entries() and in_c.blocks_restored >= 0
    assert [s.instances() for s in sharded.shards] == [s.instances() for s in in_py.shards]
    h.writer.close()


@pytest.mark.parametrize("bigram", [False, True], ids=["plain", "bigram"])
def test_a_hash_stored_again_with_other_tokens_comes_back_at_the_first_tokens(
    tmp_path: Path, bigram: bool
) -> None:
    """One publisher's pool stores hashes 1, 2 for tokens `first`, then the same hashes for
    other tokens `second`: a hash collision, which no engine's stream holds (vLLM hashes
    the parent hash, the tokens and the extra keys with SHA-256, or a 64-bit hash in
    releases before it; SGLang with SHA-256 cut to 64 bits, a bigram page over both
    tokens of every pair: tests/test_store_sqlite.py's chain_hash once left the last
    pair's second token out, and its random plans drew this). The live index, compiled
    and pure alike, takes the second store as a second copy of each block and hangs the
    blocks at the second's tokens; the snapshot keeps the run the first store made and
    counts the copies, so after a restart (every loader, both indexes) the blocks are at
    the first's tokens. Pools, copies and lookups by hash come back the same; lookups by
    the tokens do not (docs/store.md, Limits)."""
    first, second = list(range(100, 109)), list(range(200, 209))

    def store(tokens: list[int]) -> BlockStored:
        if bigram:  # page i: the units (t[j], t[j + 1]) of its 4 positions
            pairs = [(tokens[j], tokens[j + 1]) for j in range(8)]
            return BigramBlockStored([1, 2], None, block_size=4, token_pairs=pairs)
        return BlockStored([1, 2], None, tokens[:8], 4)

    h = Harness(tmp_path / "s.sqlite")
    pure_live = ReferenceIndex()
    for seq, tokens in enumerate((first, second)):
        h.batch(A, store(tokens))
        pure_live.handle(Delivery(A, seq, decode_batch(encode_batch([store(tokens)]))))
    h.writer.compact()

    def matched(index: Any, tokens: list[int]) -> int:
        return sum(r.matched_blocks for r in index.lookup(tokens))

    for live in (h.reference, pure_live):
        assert nonempty_copies(live) == {(0, "GPU"): {1: 2, 2: 2}}
        assert (matched(live, first), matched(live, second)) == (0, 2)
    for restarted in three_loads(h.path):
        assert nonempty_copies(restarted) == nonempty_copies(h.reference)
        assert rows(restarted.lookup_hashes([1, 2])) == rows(h.reference.lookup_hashes([1, 2]))
        assert (matched(restarted, first), matched(restarted, second)) == (2, 0)
    h.writer.close()


def test_hybrid_groups_sharing_hashes_over_other_tokens_come_back_as_they_were(
    tmp_path: Path,
) -> None:
    """Where engines do send one hash for different token ids: vLLM's hybrid models, whose
    KV cache groups of larger blocks hash every `hash_block_size` tokens and name a block
    by the hash of its last unit, so group 1's 8-token block 0 is group 0's hash 1 over
    tokens 0-7 where group 0 has tokens 4-7. A restart puts both groups back as the live
    index holds them, group 1's removal included."""
    prompt = PROMPTS[0]
    unit = [chain_hash(prompt, i, None) for i in range(4)]
    h = Harness(tmp_path / "s.sqlite")
    h.batch(A, BlockStored(unit, None, prompt, 4, group_idx=0))
    h.batch(A, BlockStored([unit[1], unit[3]], None, prompt, 8, group_idx=1))
    h.batch(A, BlockRemoved([unit[3]], group_idx=1))
    h.writer.compact()
    (live,) = h.reference.lookup(prompt)
    assert (live.matched_blocks, live.by_group) == (2, {0: 4, 1: 1})
    for restarted in three_loads(h.path):
        same_state(restarted, h.reference, PROMPTS)
        for tokens in (prompt[:8], prompt):
            (row,) = restarted.lookup(tokens)
            (want,) = h.reference.lookup(tokens)
            assert (row.matched_blocks, row.by_group) == (want.matched_blocks, want.by_group)
    h.writer.close()


def nonempty_copies(index: Any) -> dict[Any, Any]:
    return {pool: dict(held) for pool, held in index.copies(A).items() if held}


def rows(answer: list[Any]) -> list[Any]:
    return [(r.instance, r.matched_blocks, r.ranks, r.by_tier) for r in answer]


def test_batches_the_fast_parser_leaves_are_applied_in_python_in_order(tmp_path: Path) -> None:
    """A multimodal chain (the fast parser leaves it to kvindex.wire) between plain ones:
    the batch holding it, and every one after it, go through Python's apply_payload."""
    h = Harness(tmp_path / "s.sqlite")
    h.batch(A, rich_store(0, 0, 4, None, "GPU", True))
    h.batch(A, rich_store(1, 0, 4, "m", "GPU", True))
    h.batch(B0, rich_store(2, 0, 3, None, "GPU", True))
    h.batch(B0, BlockRemoved([chain_hash(PROMPTS[2], 1, None)]))
    h.writer.compact()
    in_c, in_py, pure = three_loads(h.path)
    assert in_c.slow_batches > 0  # handed back, not dropped
    identical(in_c, in_py, pure)
    same_state(in_c, h.reference, PROMPTS)
    h.writer.close()


def test_many_records_cut_into_batches_as_the_python_loader_cuts_them(tmp_path: Path) -> None:
    """More records than one load batch takes (4096 events), blocks gone from runs (the
    removals applied last), chains hung from other runs' blocks, several publishers."""
    h = Harness(tmp_path / "s.sqlite")
    for source in SOURCES:
        for start in range(0, 5000, 500):
            events = [
                BlockStored([(i << 8) | 1, (i << 8) | 2], None, [i % 97] * 8, 4)
                for i in range(start, start + 500)
            ]
            h.batch(source, *events)
        h.batch(source, *[BlockRemoved([(i << 8) | 1]) for i in range(0, 5000, 7)])
        h.batch(source, BlockStored([b"x" * 32], (3 << 8) | 2, [1, 2, 3, 4], 4))
    h.writer.compact()
    in_c, in_py, pure = three_loads(h.path)
    identical(in_c, in_py, pure)
    h.writer.close()


def test_keys_the_c_loader_does_not_take_are_left_to_python_whole(tmp_path: Path) -> None:
    """A record whose keys name a hash that is neither an int nor bytes: the C loader
    applies nothing and answers None; the Python loader loads it as it always did."""
    h = Harness(tmp_path / "s.sqlite")
    h.batch(A, rich_store(0, 0, 4, None, "GPU", True))
    h.batch(B0, rich_store(1, 0, 2, None, "GPU", True))
    h.writer.compact()
    h.writer.close()
    db = sqlite3.connect(h.path)
    run, keys = db.execute("SELECT run, keys FROM runs ORDER BY run LIMIT 1").fetchone()
    fields = msgspec.msgpack.decode(keys)
    fields[1] = [*fields[1], "not a hash"]
    db.execute("UPDATE runs SET keys = ? WHERE run = ?", (msgspec.msgpack.encode(fields), run))
    db.commit()
    db.close()
    index = compiled.CompiledIndex()
    assert fastload.load_in_c(h.path, index) is None
    assert index.entries() == 0 and not index._sources  # nothing applied, nobody registered
    identical(*three_loads(h.path, c_takes_it=False))


def damage(path: Path, what: str) -> None:
    db = sqlite3.connect(path)
    (run,) = db.execute("SELECT run FROM runs ORDER BY run LIMIT 1 OFFSET 1").fetchone()
    if what == "events":  # truncated: the batch holding it does not decode
        cut = "UPDATE runs SET events = substr(events, 1, length(events) - 3) WHERE run = ?"
        db.execute(cut, (run,))
    else:  # not msgpack
        db.execute("UPDATE runs SET keys = x'c1c1' WHERE run = ?", (run,))
    db.commit()
    db.close()


@pytest.mark.parametrize("what", ["events", "keys"])
def test_a_damaged_record_is_the_same_one_line_error_either_way(tmp_path: Path, what: str) -> None:
    h = Harness(tmp_path / "s.sqlite")
    for p in range(3):
        h.batch(A, rich_store(p, 0, 3, None, "GPU", True))
    h.writer.compact()
    h.writer.close()
    damage(h.path, what)
    errors = []
    for in_c in (True, False):
        with pytest.raises(StoreError) as caught:
            load(h.path, compiled.CompiledIndex(), in_c)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
    assert f"the store {h.path} is damaged (a snapshot record does not load" in errors[0]
    assert "kvindex store check" in errors[0]
    # and `kvindex store check`, which the line points to, says so too (exit 1)
    url = f"sqlite:///{h.path}"
    check = [sys.executable, "-m", "kvindex", "store", "check", url]
    out = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "a snapshot record does not load" in out.stdout


@pytest.mark.parametrize("loader", ["c", "python"])
def test_serve_says_ok_only_once_the_whole_store_is_loaded(tmp_path: Path, loader: str) -> None:
    """serve loads on a thread while it imports (cli/serve._open_store_importing): the first
    /healthz ok already sees every block the store holds, never part of them."""
    import json
    import signal
    import time
    import urllib.error
    import urllib.request

    from netutil import free_port, track

    from kvindex.bench.cases import _build_sqlite

    path = tmp_path / "s.sqlite"
    held = _build_sqlite(path, 40_000)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvindex", "serve", "--http", f"127.0.0.1:{port}"]
    cmd += ["--store", f"sqlite:///{path}"]
    for i in range(4):
        cmd += ["--instance", f"i{i}=tcp://127.0.0.1:{free_port()}"]
    env = dict(os.environ, KVINDEX_SNAPSHOT_LOAD=loader)
    proc = track(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))

    def get(route: str) -> Any:
        with urllib.request.urlopen(url + route, timeout=5) as answer:
            return json.loads(answer.read())

    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
            try:
                if get("/healthz")["status"] == "ok":
                    break
            except (OSError, urllib.error.HTTPError):
                pass
            time.sleep(0.005)
        blocks = sum(view["blocks"] for view in get("/v1/instances")["instances"])
        assert blocks == held == 40_000
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
