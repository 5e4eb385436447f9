"""atheris harness: payload bytes -> BatchDecoder -> FleetIndex.apply (`make fuzz`).

    python fuzz/fuzz_wire.py [libFuzzer flags, e.g. -max_total_time=60 fuzz/corpus]

Fails on anything but WireError from the decoder, any exception from the index, or an
index that does not free its tree once the source is dropped. Seeds: real payloads of
both generations.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from kvindex.index import FleetIndex
    from kvindex.subscriber import SourceKey
    from kvindex.wire import BatchDecoder, BlockRemoved, BlockStored, WireError
    from kvindex.wire.publisher import encode_batch

SOURCE = SourceKey("fuzz")
decoder = BatchDecoder(max_payload=1 << 20)


def test_one(data: bytes) -> None:
    try:
        batch = decoder.decode(data)
    except WireError:
        return
    index = FleetIndex()
    index.apply(SOURCE, batch)
    index.lookup(list(range(64)))
    index.drop_source(SOURCE)
    if index.tree_nodes() or index.entries():
        raise AssertionError("the index kept state of a dropped source")


def seeds() -> list[bytes]:
    events = [
        BlockStored([1, 2], None, list(range(32)), 16, medium="GPU", lora_name="a"),
        BlockRemoved([b"\x01" * 32], medium="CPU"),
    ]
    return [encode_batch(events, 1.0, 0, g) for g in ("maps", "arrays")]  # type: ignore[arg-type]


def main() -> None:
    if len(sys.argv) > 1 and not sys.argv[-1].startswith("-"):
        import os

        os.makedirs(sys.argv[-1], exist_ok=True)
        for i, seed in enumerate(seeds()):
            with open(os.path.join(sys.argv[-1], f"seed-{i}"), "wb") as f:
                f.write(seed)
    atheris.Setup(sys.argv, test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
