"""What-if cache sizes: LRU simulated over a source's recorded GPU stores.

Each stored block is an access. Its LRU stack distance `d` is the number of distinct
other blocks stored since its previous store (Mattson's algorithm, with a Fenwick tree:
O(n log n)). An LRU cache of C blocks still holds it iff d < C, so one pass gives the
re-store count for every size: re-stores(C) = #{accesses with d >= C}. A cache at least
as large as the working set (distinct blocks) re-stores nothing.

The same distances tell which of the re-stores that really happened a cache of C blocks
would have avoided (those with d < C). Only stores are on the wire, so cache hits, which
refresh a block's recency in vLLM, are not seen (except with vLLM's full re-report mode):
the curve describes the stores-only LRU model, a good guide to size a cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Curve", "curve", "stack_distances"]

FIRST = -1  # the distance of a block's first store (a compulsory miss, not a re-store)


def stack_distances(accesses: Sequence[int]) -> npt.NDArray[np.int64]:
    """Per access, the number of distinct other blocks accessed since the previous access of
    the same block; FIRST for a first access."""
    n = len(accesses)
    tree = [0] * (n + 1)  # Fenwick tree over positions: 1 where a block was last accessed
    last: dict[int, int] = {}
    out = np.full(n, FIRST, dtype=np.int64)
    marked = 0  # markers in the whole tree (= distinct blocks so far)
    for i, block in enumerate(accesses):
        prev = last.get(block)
        if prev is not None:
            out[i] = marked - _prefix(tree, prev + 1)  # markers after prev
            _add(tree, prev + 1, -1)
            marked -= 1
        _add(tree, i + 1, 1)
        marked += 1
        last[block] = i
    return out


def _add(tree: list[int], pos: int, delta: int) -> None:
    n = len(tree)
    while pos < n:
        tree[pos] += delta
        pos += pos & -pos


def _prefix(tree: list[int], pos: int) -> int:
    total = 0
    while pos > 0:
        total += tree[pos]
        pos -= pos & -pos
    return total


@dataclass(frozen=True, slots=True)
class Curve:
    """Re-stores of one source against LRU cache size (in blocks)."""

    sizes: list[int]
    restores: list[int]  # simulated re-stores at each size
    avoided: list[int]  # of the re-stores that really happened, how many it would avoid
    accesses: int  # GPU block stores
    working_set: int  # distinct blocks stored
    observed_restores: int

    def size_for(self, max_rate: float) -> int | None:
        """The smallest size whose simulated re-store rate is at most `max_rate`."""
        for size, n in zip(self.sizes, self.restores, strict=True):
            if self.accesses and n / self.accesses <= max_rate:
                return size
        return None


def _grid(top: int, extra: Sequence[int], points: int) -> list[int]:
    sizes = np.unique(np.geomspace(1, max(top, 1), points).round().astype(np.int64))
    return sorted({int(s) for s in sizes} | {int(e) for e in extra if 0 < e <= top})


def curve(
    accesses: Sequence[int],
    restore_flags: Sequence[int],
    marks: Sequence[int] = (),
    points: int = 60,
) -> Curve:
    """The what-if curve of one source; `marks` are sizes to include exactly (e.g. the
    observed capacity)."""
    d = stack_distances(accesses)
    flags = np.frombuffer(bytes(restore_flags), dtype=np.uint8).astype(bool)
    seen = np.sort(d[d != FIRST])
    actual = np.sort(d[flags & (d != FIRST)])
    working_set = int(np.count_nonzero(d == FIRST))
    top = int(seen[-1]) + 1 if seen.size else 1
    sizes = _grid(max(top, working_set), marks, points)
    grid = np.asarray(sizes, dtype=np.int64)
    restores = seen.size - np.searchsorted(seen, grid, side="left")
    avoided = np.searchsorted(actual, grid, side="left")
    return Curve(
        sizes=sizes,
        restores=[int(x) for x in restores],
        avoided=[int(x) for x in avoided],
        accesses=len(accesses),
        working_set=working_set,
        observed_restores=int(flags.sum()),
    )
