"""What an event does to a publisher's pools: the rules, written once.

A publisher (one engine's DP rank) holds its blocks in *pools*, one per (KV-cache group,
medium). Every consumer of the stream that counts what a publisher holds -- the index
(`fleet.py`, and the compiled core behind `compiled.py`, which applies the same rules in
C), the stores' mirror (`kvindex.store.mirror`), the analysis tracker
(`kvindex.analysis.track`) and the simulator's reference pools (`kvindex.sim`) -- keys its
pools with `pool_of` and applies these rules; tests/test_pool_rules.py feeds one stream
to all of them and compares what each holds:

- `BlockStored` adds one copy of each of its hashes to the pool `pool_of(group_idx,
  medium)`: a hash stored twice is held twice (vLLM stores a block again while an earlier
  copy is still cached, e.g. one per KV-cache group, or from the offload tier), and
  removing it once leaves it held.
- `BlockRemoved` takes one copy of each hash from that pool; a hash the pool does not hold
  is ignored (the subscriber joined after its store, or a replay was lost).
- `AllBlocksCleared` and a publisher restart (its seq going back: a new engine process)
  empty every pool of the publisher, all groups and media.
- A missing group is group 0 and a missing or empty medium is the GPU (vLLM before 0.11
  sent neither; SGLang sends its medium always).

Where each consumer differs is only what it keeps beside the copies: the index a prefix
tree, the mirror the runs its snapshot writes, the tracker the timelines of a report.
"""

from __future__ import annotations

from kvindex.wire.events import MEDIUM_GPU, BlockHash

__all__ = ["DEFAULT_MEDIUM", "DEFAULT_POOL", "PoolCopies", "PoolKey", "pool_of"]

DEFAULT_MEDIUM = MEDIUM_GPU

PoolKey = tuple[int, str]  # (group_idx, medium)
DEFAULT_POOL: PoolKey = (0, DEFAULT_MEDIUM)

# What one publisher holds: pool -> block hash -> copies (every consumer can say this).
PoolCopies = dict[PoolKey, dict[BlockHash, int]]


def pool_of(group_idx: int | None, medium: str | None) -> PoolKey:
    """The pool an event names: group 0 and the GPU where it names none."""
    return (group_idx or 0, medium or DEFAULT_MEDIUM)
