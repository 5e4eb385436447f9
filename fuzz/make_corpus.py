"""Write the seed corpus of the core fuzzer (fuzz/corpus/): real and realistic programs.

    python fuzz/make_corpus.py [--releases]

Seeds (each a program of fuzz/corediff.py: a few steps on up to four publishers):
- windows of the SGLang 0.5.23 recording (tests/data/sglang/fleet.kvr: real pages, salts,
  removals of a live server), with a publisher's restart or removal between some;
- the simulator's vLLM streams in both wire generations (maps >= 0.24, arrays <= 0.23),
  int and bytes hashes, with a CPU tier and LoRA adapters;
- hand-made batches of the shapes the model treats apart: salted and LoRA namespaces
  (vLLM's extra keys and SGLang's cache_salt), lora_id, hybrid groups with a sliding
  window spec, several pools and tiers, partial and hash-only blocks, duplicate copies,
  multimodal and lookahead keys, clears;
- with --releases, one batch of every field each cached vLLM release's own kv_events.py
  encodes (tests/vllm_releases.py; skipped where its sources are not cached).

Deterministic: the same files every run, so `git status` shows when a change of the
encoders changed the seeds.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fuzz"))

from program import CONTROL, WIDE, program  # noqa: E402

from kvindex.recording.format import BatchRec  # noqa: E402
from kvindex.recording.reader import records  # noqa: E402
from kvindex.sim import SimBatch, SimConfig, SimRestart, Simulation  # noqa: E402
from kvindex.wire import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from kvindex.wire.publisher import encode_batch  # noqa: E402

CORPUS = ROOT / "fuzz" / "corpus"
RESTART, REMOVE = CONTROL, CONTROL | 4
Step = tuple[int, bytes]


def sglang_seeds() -> Iterator[list[Step]]:
    by_publisher: dict[tuple[str, int], list[bytes]] = {}
    for rec in records(ROOT / "tests" / "data" / "sglang" / "fleet.kvr"):
        if isinstance(rec, BatchRec):
            by_publisher.setdefault((rec.instance, rec.rank), []).append(rec.payload)
    for n, payloads in enumerate(by_publisher.values()):
        source = n % 3
        for start in range(0, min(len(payloads), 90), 15):
            steps = [(source, p) for p in payloads[start : start + 4]]
            if start % 45 == 15:
                steps.insert(2, (RESTART | source, b""))
            elif start % 45 == 30:
                steps.append((REMOVE | source, b""))
            yield steps


def sim_seeds() -> Iterator[list[Step]]:
    for fmt in ("0.33", "0.23"):
        for hashes in ("int", "bytes"):
            config = SimConfig(
                instances=2,
                format=fmt,  # type: ignore[arg-type]
                hashes=hashes,  # type: ignore[arg-type]
                seed=3,
                block_size=4,
                gpu_blocks=24,
                cpu_blocks=48,
                cpu_every=1,
                restart_every=40,
                reset_every=30,
            )
            steps: list[Step] = []
            names: dict[tuple[str, int | None], int] = {}
            for item in Simulation(config).items(40):
                if isinstance(item, SimBatch):
                    key = (item.instance, item.rank)
                    source = names.setdefault(key, len(names) % 4)
                    steps.append((source, item.payload))
                elif isinstance(item, SimRestart):
                    for (instance, _), source in names.items():
                        if instance == item.instance:
                            steps.append((RESTART | source, b""))
                if len(steps) == 8:
                    yield steps
                    steps = []


def stored(first: int, count: int, **fields: Any) -> BlockStored:
    fields.setdefault("token_ids", list(range(100 + 4 * first, 100 + 4 * (first + count))))
    hashes = [1000 + i for i in range(first, first + count)]
    return BlockStored(hashes, 999 + first if first else None, block_size=4, **fields)


def shaped_seeds() -> Iterator[list[Step]]:
    def batch(events: list[Any], gen: str = "maps", rank: int | None = None) -> bytes:
        return encode_batch(events, 1.5, rank, gen)  # type: ignore[arg-type]

    for gen in ("maps", "arrays"):
        yield [(0, batch([stored(0, 3)], gen)), (0, batch([stored(3, 2)], gen))]
        yield [
            (0, batch([stored(0, 3, lora_name="ad", extra_keys=[["ad"]] * 3)], gen)),
            (1, batch([stored(0, 3, extra_keys=[["t1"], None, None], group_idx=0)], gen)),
            (2, batch([stored(0, 2, lora_id=7)], gen, 1)),
        ]
        yield [
            (0, batch([stored(0, 4, medium="GPU", group_idx=0)], gen)),
            (0, batch([stored(0, 4, medium="CPU", group_idx=0, token_ids=[])], gen)),
            (0, batch([BlockRemoved([1001, 1002], medium="GPU", group_idx=0)], gen)),
            (0, batch([BlockRemoved([1003], medium="CPU")], gen)),
        ]
        yield [
            (0, batch([stored(0, 3, group_idx=0, kv_cache_spec_kind="full_attention")], gen)),
            (
                0,
                batch(
                    [
                        stored(
                            0,
                            3,
                            group_idx=1,
                            kv_cache_spec_kind="sliding_window",
                            kv_cache_spec_sliding_window=8,
                        )
                    ],
                    gen,
                ),
            ),
            (1, batch([stored(0, 3), stored(0, 3), BlockRemoved([1000])], gen)),
            (1, batch([AllBlocksCleared(), stored(0, 1)], gen)),
        ]
    yield [
        (0, batch([stored(0, 3, cache_salt="tenant")])),
        (1, batch([stored(0, 3, cache_salt="tenant"), stored(3, 1, cache_salt="tenant")])),
        (0, batch([stored(0, 2, extra_keys=[[["img", 0]], None])])),
        (0, batch([stored(0, 2, lookahead_token_ids=[[1], [2]])])),
        (3, batch([BlockStored([b"\x07" * 32], None, [1, 2, 3, 4], 4)])),
        (3, batch([BlockStored([b"\x08" * 32], b"\x07" * 32, [5, 6, 7], 4)])),
        (REMOVE | 3, b""),
    ]
    # hybrid models: a mamba group, two sliding windows of different sizes, a CPU tier
    spec = {"kv_cache_spec_kind": "full_attention"}
    window = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}
    window16 = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 16}
    yield [
        (0, batch([stored(0, 4, group_idx=0, **spec), stored(0, 4, group_idx=1, **window)])),
        (0, batch([stored(0, 4, group_idx=2, **window16)])),
        (0, batch([stored(0, 4, group_idx=3, kv_cache_spec_kind="mamba")])),
        (0, batch([stored(0, 4, group_idx=0, medium="CPU", **spec)])),
        (0, batch([BlockRemoved([1001], group_idx=1)])),
        (1, batch([stored(0, 2, group_idx=0, **spec), stored(0, 2, group_idx=5, **window)])),
    ]
    # token ids past 32 bits (the Python path), and a lookup of them
    yield [(0, batch([stored(0, 2, token_ids=[2**40, 1, 2, 3, 4, 5, 6, 2**33])]))]
    # a wide fleet: 62 publishers before these, so a shared block's holders take two words
    yield [
        (WIDE | 0, batch([stored(0, 3)])),
        (1, batch([stored(0, 3)])),
        (2, batch([stored(0, 2)])),
        (3, batch([stored(0, 3), BlockRemoved([1002])])),
        (RESTART | 1, b""),
        (REMOVE | 2, b""),
    ]


def release_seeds() -> Iterator[list[Step]]:
    sys.path.insert(0, str(ROOT / "tests"))
    import vllm_releases as vr

    for version in ("0.9.0", "0.10.2", "0.14.0", "0.20.0", "0.23.0", "0.24.0", "0.33.0"):
        try:
            mod = vr.load_release(version)
        except Exception as exc:  # not cached here: say so and go on
            print(f"vLLM {version}: skipped ({exc})", file=sys.stderr)
            continue
        fields = dict(
            block_hashes=[11, 12],
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None, None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        rank = 0 if vr.has_dp_rank(mod) else None
        events = [vr.make_stored(mod, **fields), vr.make_removed(mod, block_hashes=[12])]
        payload = vr.encode_batch(mod, vr.make_batch(mod, 2.0, events, rank))
        cleared = vr.encode_batch(mod, vr.make_batch(mod, 3.0, [vr.make_cleared(mod)], rank))
        yield [(0, payload), (1, payload), (1, cleared)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", action="store_true", help="add the vLLM releases' seeds")
    args = parser.parse_args()
    CORPUS.mkdir(parents=True, exist_ok=True)
    groups = [("sglang", sglang_seeds()), ("sim", sim_seeds()), ("shape", shaped_seeds())]
    if args.releases:
        groups.append(("vllm", release_seeds()))
    written = 0
    for name, seeds in groups:
        for steps in seeds:
            data = program(steps)
            digest = hashlib.sha1(data).hexdigest()[:12]
            (CORPUS / f"{name}-{digest}").write_bytes(data)
            written += 1
    print(f"{written} seeds in {CORPUS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
