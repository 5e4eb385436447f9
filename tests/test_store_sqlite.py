"""The SQLite store: what it writes and loads back equals the index it mirrors."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.index import FleetIndex
from kvindex.store import StoreError, open_store
from kvindex.store.rows import BlockRow, events_from_rows, hash_key, key_hash
from kvindex.store.sqlite import SQLiteStore, WriterOptions, _Writer
from kvindex.subscriber import Delivery, Lost, Restarted, SourceKey
from kvindex.wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvindex.wire.publisher import encode_batch

BS = 4
A, B0, B1 = SourceKey("a"), SourceKey("b", 0), SourceKey("b", 1)


@pytest.mark.parametrize("value", [0, -1, -(2**63), 2**63, 2**64 - 1, b"", b"\x00" * 32])
def test_hash_keys_are_exact(value: int | bytes) -> None:
    assert key_hash(hash_key(value)) == value
    assert type(key_hash(hash_key(value))) is type(value)


def test_int_and_bytes_keys_never_collide() -> None:
    assert hash_key(1) != hash_key(b"\x01") and hash_key(0) != hash_key(b"")


def test_rows_come_back_parents_first_with_copies() -> None:
    child = BlockRow(A, 0, "GPU", 2, 1, [5, 6, 7, 8], BS, None, 3, 0.0)
    parent = BlockRow(A, 0, "GPU", 1, None, [1, 2, 3, 4], BS, None, 1, 0.0)
    index = FleetIndex()
    for source, batch in events_from_rows([child, parent]):
        index.apply(source, batch)
    assert index.lookup([1, 2, 3, 4, 5, 6, 7, 8])[0].matched_blocks == 2
    assert index.count(A, 0, "GPU", 2) == 3


class Harness:
    """The writer, in process (same code as the child process), and a reference index."""

    def __init__(self, path: Path, compact_rows: int = 1_000_000) -> None:
        self.path = path
        self.writer = _Writer(str(path), WriterOptions(0.01, 1e9, compact_rows))
        self.reference = FleetIndex()
        self.seqs: dict[SourceKey, int] = {}

    def batch(self, source: SourceKey, *events: object) -> None:
        payload = encode_batch(list(events))  # type: ignore[arg-type]
        seq = self.seqs.get(source, 0)
        self.seqs[source] = seq + 1
        self.reference.handle(Delivery(source, seq, decode_batch(payload)))
        self.writer._commit([("b", source.instance, source.rank, seq, payload)], None)

    def restart(self, source: SourceKey) -> None:
        self.seqs[source] = 0
        self.reference.handle(Restarted(source))
        self.writer._commit([("r", source.instance, source.rank)], None)

    def reload(self) -> tuple[FleetIndex, object]:
        index = FleetIndex()
        return index, SQLiteStore(self.path).load(index)


def nonempty(pools: dict) -> dict:
    return {k: v for k, v in pools.items() if v}


def matches(index: FleetIndex, prompt: list[int], lora: str | None) -> dict:
    return {
        (r.instance, rank): n
        for r in index.lookup(prompt, lora)
        for rank, n in r.ranks.items()
        if n
    }


def same_state(a: FleetIndex, b: FleetIndex, prompts: list[list[int]]) -> None:
    for name in ("a", "b"):
        assert a.block_hashes(name) == b.block_hashes(name), name
        for source in (A, B0, B1):
            assert nonempty(a.copies(source)) == nonempty(b.copies(source)), source
    for prompt in prompts:
        for lora in (None, "x"):
            assert matches(a, prompt, lora) == matches(b, prompt, lora)


PROMPTS = [list(range(16)), [*range(8), 50, 51, 52, 53, 54, 55, 56, 57], list(range(100, 112))]


def chain_hash(prompt: list[int], n: int, lora: str | None) -> int:
    return hash((lora, tuple(prompt[: (n + 1) * BS]))) & (2**64 - 1)


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "remove", "clear", "restart", "compact"]),
        st.sampled_from([A, B0, B1]),
        st.integers(0, 2),
        st.integers(1, 4),
        st.sampled_from([None, "x"]),
        st.sampled_from(["GPU", "CPU"]),
    ),
    max_size=40,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops)
def test_snapshot_plus_log_loads_back_exactly(
    tmp_path_factory: pytest.TempPathFactory, plan: list
) -> None:
    h = Harness(tmp_path_factory.mktemp("db") / "s.sqlite")
    for kind, source, p, n, lora, medium in plan:
        prompt = PROMPTS[p]
        if kind == "store":
            last = min(n, len(prompt) // BS)
            hashes = [chain_hash(prompt, i, lora) for i in range(last)]
            extra = [[lora]] * last if lora else None
            h.batch(
                source,
                BlockStored(
                    hashes,
                    None,
                    prompt[: last * BS],
                    BS,
                    medium=medium,
                    lora_name=lora,
                    extra_keys=extra,
                ),
            )
        elif kind == "remove":
            h.batch(source, BlockRemoved([chain_hash(prompt, n % 2, lora)], medium=medium))
        elif kind == "clear":
            h.batch(source, AllBlocksCleared())
        elif kind == "restart":
            h.restart(source)
        else:
            h.writer.compact()
    loaded, _ = h.reload()  # snapshot + log tail, as after a crash
    same_state(loaded, h.reference, PROMPTS)
    h.writer.compact()
    loaded, result = h.reload()  # snapshot only
    same_state(loaded, h.reference, PROMPTS)
    assert result.log_batches_replayed == 0  # type: ignore[attr-defined]
    h.writer.close()


def test_checkpoints_restarts_and_lost_persist(tmp_path: Path) -> None:
    h = Harness(tmp_path / "s.sqlite")
    for i in range(3):
        h.batch(A, BlockStored([i], None, [i] * BS, BS))
    h.writer._commit([("l", "a", 0, 2)], None)
    _, result = h.reload()
    checkpoint = result.checkpoints[A]  # type: ignore[attr-defined]
    assert (checkpoint.next_seq, checkpoint.lost_since_restart) == (3, 2)
    assert checkpoint.last_digest is not None
    h.restart(A)
    _, result = h.reload()
    assert result.checkpoints[A] == (0, None, 0)  # type: ignore[attr-defined]


def test_cache_blocks_view_is_readable_by_sqlite(tmp_path: Path) -> None:
    h = Harness(tmp_path / "s.sqlite")
    h.batch(
        A,
        BlockStored(
            [2**64 - 1, b"\xab" * 4],
            None,
            list(range(8)),
            BS,
            lora_name="x",
            extra_keys=[["x"], ["x"]],
        ),
    )
    h.batch(
        A, BlockStored([2**64 - 1], None, list(range(4)), BS, lora_name="x", extra_keys=[["x"]])
    )  # a second copy
    h.writer.compact()
    db = sqlite3.connect(tmp_path / "s.sqlite")
    rows = db.execute(
        "SELECT instance, block_hash, parent_hash, token_ids, block_size, lora, medium, copies,"
        " stored_at FROM cache_blocks ORDER BY block_hash"
    ).fetchall()
    assert [r[:8] for r in rows] == [
        ("a", "18446744073709551615", None, "[0,1,2,3]", 4, "x", "GPU", 2),
        ("a", "abababab", "18446744073709551615", "[4,5,6,7]", 4, "x", "GPU", 1),
    ]
    assert all(r[8] for r in rows)


def test_writer_process_end_to_end(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite", WriterOptions(0.01, 0.2, 100))
    index = FleetIndex()
    store.load(index)
    store.start()
    try:
        for seq in range(300):
            payload = encode_batch(
                [BlockStored([seq], None, [seq] * BS, BS)]
                + ([BlockRemoved([seq - 100])] if seq >= 100 else [])
            )
            item = Delivery(A, seq, decode_batch(payload), payload=payload)
            index.handle(item)
            store.record(item)
        store.record(Lost(A, 300, 301))
        store.sync()
        store.compact()
    finally:
        store.close()
    loaded = FleetIndex()
    result = SQLiteStore(tmp_path / "s.sqlite").load(loaded)
    assert loaded.block_hashes("a") == index.block_hashes("a") == set(range(200, 300))
    assert result.checkpoints[A].next_seq == 300 and result.checkpoints[A].lost_since_restart == 2


def test_record_without_payload_is_refused(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite")
    store.start()
    try:
        with pytest.raises(StoreError, match="keep payloads"):
            store.record(Delivery(A, 0, decode_batch(encode_batch([]))))
    finally:
        store.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite:///", "no path"),
        ("mysql://x", "unknown store"),
        ("sqlite:////proc/x/y.db", "cannot"),
    ],
)
def test_bad_store_urls(url: str, message: str) -> None:
    with pytest.raises(StoreError, match=message):
        open_store(url).load(FleetIndex())


def test_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "other.sqlite"
    sqlite3.connect(path).execute("CREATE TABLE t (x)").connection.commit()
    with pytest.raises(StoreError, match="not a kvindex store"):
        open_store(f"sqlite:///{path}").load(FleetIndex())


def test_hash_only_copy_keeps_the_tokens_of_the_first_store(tmp_path: Path) -> None:
    h = Harness(tmp_path / "s.sqlite")
    h.batch(A, BlockStored([1], None, [1, 2, 3, 4], BS))
    h.batch(A, BlockStored([1], None, [], 0))  # another copy, announced without tokens
    h.writer.compact()
    loaded, _ = h.reload()
    assert loaded.lookup([1, 2, 3, 4])[0].matched_blocks == 1
    assert loaded.count(A, 0, "GPU", 1) == 2
    # And when the hash-only copy reached the snapshot first, a later store adds the tokens.
    h2 = Harness(tmp_path / "t.sqlite")
    h2.batch(A, BlockStored([1], None, [], 0))
    h2.writer.compact()
    h2.batch(A, BlockStored([1], None, [1, 2, 3, 4], BS))
    h2.writer.compact()
    loaded, _ = h2.reload()
    assert h2.reference.lookup([1, 2, 3, 4])[0].matched_blocks == 1
    assert loaded.lookup([1, 2, 3, 4])[0].matched_blocks == 1
    assert loaded.count(A, 0, "GPU", 1) == 2
