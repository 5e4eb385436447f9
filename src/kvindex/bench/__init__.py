"""`kvindex.bench`: the benchmark suite (`make bench`, `kvindex bench`,
`python -m kvindex.bench`).

Every kvindex figure stands beside baselines measured in the same run, on the same input:
a naive consumer (untyped msgpack + a dict of sets) and, when `ai-dynamo-runtime` is
installed (the `[bench]` extra), NVIDIA Dynamo: its standalone KV indexer end to end (the
peer a user would pick instead of `kvindex serve`) and its Rust radix tree through the
Python binding in process (lookups and memory).

- `workloads`: the simulator's steady-state stream (ingest) and large filled fleets with
  512-block prompts that partly hit (lookups, memory); generated workloads are cached.
- `consumers`: kvindex and naive (ingest, build, look up) and Dynamo's radix tree (build,
  look up).
- `cases`: ingest scaling, the SQLite/Redis stores, warm restart, lookups and memory
  (built in a fresh process per consumer by `probe`).
- `e2e`: ZMQ into `serve` and into Dynamo's standalone indexer, HTTP lookups idle and
  under load beside it, freshness, warm restart.
- `report`: the table, and the README's benchmark section; `plots`: the scaling PNGs.
- `suite`: the modes (`--smoke`, `--quick`, full) and the command line.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """`python -m kvindex.bench [ARGS]`; returns the exit code."""
    # Imported here, not at the top: `probe` processes import this package and must not
    # pay for matplotlib and the rest of the suite.
    from kvindex.bench.suite import main as suite_main

    return suite_main(argv)
