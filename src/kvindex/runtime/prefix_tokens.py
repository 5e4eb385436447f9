"""Tokenize each prefix once: a bounded cache of token ids by text prefix (issue 25).

Chats resend their whole history every turn, and a router asking by text pays the
tokenizer for all of it every time. This cache keeps the token ids of texts it tokenized
and, for a new text, reuses those of its longest already-tokenized prefix that ends at a
**safe boundary**, tokenizing only the rest.

Safe boundaries are the tokenizer's own added tokens (the chat template's markers:
`<|im_start|>`, `<|eot_id|>`, `[INST]`...), in the form the Hugging Face `tokenizers`
library gives them: it cuts a text at its added tokens *before* normalizing and
pre-tokenizing, so what lies on either side of one is tokenized independently of the
other. Only added tokens that match the raw text exactly qualify (not `normalized`, no
`lstrip`/`rstrip`/`single_word`, which would let a match reach past its text). The rest is
tokenized from the boundary's marker on (`<|im_start|>assistant\n...`), so it starts after
an added token as it does in the whole text (a SentencePiece-style prefix space sees the
same context), and the marker's id must come back first: otherwise, and whenever the
rest's markers can't be matched to its text, the text is tokenized whole. Every hit thus
gives the ids a fresh tokenization gives (the property tests hold it over random texts and
chat histories, byte-level BPE and SentencePiece-style tokenizers).

Bounded: entries (a text, its ids, the token counts at its boundaries) are kept in LRU
order within `max_bytes` (the text, 36 bytes a token id, the index keys counted);
`stats()` says the bytes held,
hits, misses and tokens reused (`/metrics`). Thread-safe.
"""

from __future__ import annotations

import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_MAX_BYTES", "CacheStats", "Plan", "PrefixTokens", "safe_markers"]

DEFAULT_MAX_BYTES = 64 << 20
_INDEXED_EDGES = 4  # boundaries indexed per text: its first and last few
_KEY_OVERHEAD = 120  # bytes an index key costs beside the text (dict slot, tuple)
_TOKEN_BYTES = 36  # a kept token id: its list slot and, at worst, an int object of its own
_WINDOW = 64  # characters before a prefix's end that its key hashes (then compared whole)


def _key(text: str, end: int) -> tuple[int, int]:
    """A prefix's index key: its length and a hash of its last characters (cheap for a
    long text; a match is then compared whole)."""
    return end, hash(text[max(0, end - _WINDOW) : end])


def safe_markers(tokenizer: Any) -> dict[str, int]:
    """The added tokens of a `tokenizers.Tokenizer` that cut a text safely (module doc)."""
    out: dict[str, int] = {}
    for token_id, added in tokenizer.get_added_tokens_decoder().items():
        if added.normalized or added.lstrip or added.rstrip or added.single_word:
            continue
        if added.content:
            out[str(added.content)] = int(token_id)
    return out


@dataclass(slots=True)
class _Entry:
    text: str
    ids: list[int]
    counts: list[int]  # tokens up to the end of each boundary of `text`, in order
    keys: list[tuple[int, int]] = field(default_factory=list)  # its index keys
    size: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """`PrefixTokens.plan`'s answer (see there)."""

    text: str
    bounds: list[tuple[int, int, int]]  # (start, end, marker id) of each marker in `text`
    ids: list[int] | None  # the whole text's ids, found
    rest: str  # what to tokenize: from the longest cached prefix's marker on, or all
    found: tuple[_Entry, int, int] | None  # that prefix: (entry, boundary, its index there)

    def missed(self) -> Plan:
        """The plan of tokenizing it whole."""
        return Plan(self.text, self.bounds, None, self.text, None)


@dataclass(frozen=True, slots=True)
class CacheStats:
    bytes: int
    max_bytes: int
    entries: int
    hits: int
    misses: int
    reused_tokens: int
    tokenized_tokens: int


class PrefixTokens:
    """Token ids by text prefix, for one tokenizer's raw encoding (no special tokens)."""

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        markers: Mapping[str, int],
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self._encode = encode
        self._ids = dict(markers)
        self._marker_ids = frozenset(self._ids.values())
        # longest first: a marker that is a prefix of another never cuts the longer one
        alternatives = sorted(self._ids, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[tuple[int, int], list[tuple[_Entry, int]]] = {}  # key -> (entry, i)
        self._ends: dict[int, int] = {}  # prefix lengths indexed -> how many keys
        self._whole: dict[tuple[int, int], list[_Entry]] = {}  # whole text's key -> entries
        self._bytes = 0
        self.hits = self.misses = self.reused = self.tokenized = 0

    @property
    def enabled(self) -> bool:
        return self._pattern is not None and self.max_bytes > 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                self._bytes,
                self.max_bytes,
                len(self._entries),
                self.hits,
                self.misses,
                self.reused,
                self.tokenized,
            )

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids, as the raw encoding gives them."""
        plan = self.plan(text)
        if plan.ids is not None:
            return plan.ids
        ids = self.complete(plan, self._encode(plan.rest))
        if ids is None:
            plan = plan.missed()
            ids = self.complete(plan, self._encode(plan.rest))
        assert ids is not None  # a missed plan always completes
        return ids

    def plan(self, text: str) -> Plan:
        """What `text` needs: its ids (`ids`: found whole), or the part to tokenize
        (`rest`: after the longest cached prefix, or all of it) for `complete`. An async
        caller tokenizes `rest` where it likes (a long one off its event loop)."""
        if self._pattern is None or self.max_bytes <= 0:
            return Plan(text, [], None, text, None)
        key = _key(text, len(text))
        with self._lock:
            same = next((e for e in self._whole.get(key, ()) if e.text == text), None)
            if same is not None:
                self._entries.move_to_end(id(same))
                self.hits += 1
                self.reused += len(same.ids)
                return Plan(text, [], list(same.ids), "", None)
        bounds = [(m.start(), m.end(), self._ids[m.group()]) for m in self._pattern.finditer(text)]
        with self._lock:
            found = self._longest(text, bounds)
        if found is None:
            return Plan(text, bounds, None, text, None)
        return Plan(text, bounds, None, text[bounds[found[1]][0] :], found)

    def complete(self, plan: Plan, rest: list[int]) -> list[int] | None:
        """The text's ids from its plan and the rest's ids; None when the rest's tokens
        don't start with its boundary's marker (then `plan.missed()`: tokenize it whole)."""
        if self._pattern is None or self.max_bytes <= 0:
            return rest
        if plan.found is None:
            counts = self._counts(rest, 0, len(plan.bounds))
            with self._lock:
                self.misses += 1
                self.tokenized += len(rest)
                if counts is not None:
                    self._insert(plan.text, rest[:], counts, plan.bounds)
            return rest
        return self._extend(plan, rest, *plan.found)

    # -- the parts ----------------------------------------------------------------------

    def _longest(
        self, text: str, bounds: list[tuple[int, int, int]]
    ) -> tuple[_Entry, int, int] | None:
        """(entry, boundary index in `text`, its index in the entry) of the longest cached
        prefix of `text` ending at one of its boundaries."""
        ends = self._ends
        for i in range(len(bounds) - 1, -1, -1):
            end = bounds[i][1]
            if end not in ends:
                continue
            rows = self._index.get(_key(text, end))
            if not rows:
                continue
            prefix = text[:end]
            for entry, e_i in rows:
                if entry.text.startswith(prefix):
                    self._entries.move_to_end(id(entry))
                    return entry, i, e_i
        return None

    def _extend(
        self, plan: Plan, rest: list[int], entry: _Entry, i: int, e_i: int
    ) -> list[int] | None:
        """The prefix's ids up to boundary `i`'s marker, and the rest (tokenized from the
        marker on); None when the rest's tokens don't start with the marker."""
        marker = plan.bounds[i][2]
        kept = entry.counts[e_i] - 1  # the tokens before the marker
        if not rest or rest[0] != marker:
            return None
        ids = entry.ids[:kept]
        ids.extend(rest)
        counts = self._counts(rest, kept, len(plan.bounds) - i)
        with self._lock:
            self.hits += 1
            self.reused += kept
            self.tokenized += len(rest)
            if counts is not None:
                whole = entry.counts[:e_i] + counts
                self._insert(plan.text, ids[:], whole, plan.bounds)
        return ids

    def _counts(self, ids: list[int], offset: int, expect: int) -> list[int] | None:
        """The token count at the end of each marker in `ids` (plus `offset`), if there
        are exactly `expect` of them (each of the text's markers became its token)."""
        marker_ids = self._marker_ids
        counts = [offset + k + 1 for k, t in enumerate(ids) if t in marker_ids]
        return counts if len(counts) == expect else None

    def _insert(
        self, text: str, ids: list[int], counts: list[int], bounds: list[tuple[int, int, int]]
    ) -> None:
        if not bounds:
            return
        entry = _Entry(text, ids, counts)
        self._whole.setdefault(_key(text, len(text)), []).append(entry)
        picks = sorted({*range(min(_INDEXED_EDGES, len(bounds))),
                        *range(max(0, len(bounds) - _INDEXED_EDGES), len(bounds))})  # fmt: skip
        for i in picks:
            if counts[i] <= 1:
                continue  # a marker at the very start: nothing before it to reuse
            end = bounds[i][1]
            key = _key(text, end)
            self._index.setdefault(key, []).append((entry, i))
            entry.keys.append(key)
            self._ends[end] = self._ends.get(end, 0) + 1
        entry.size = sys.getsizeof(text) + _TOKEN_BYTES * len(ids) + _KEY_OVERHEAD * len(picks)
        if entry.size > self.max_bytes:
            self._forget(entry)
            return
        self._entries[id(entry)] = entry
        self._bytes += entry.size
        while self._bytes > self.max_bytes and self._entries:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.size
            self._forget(old)

    def _forget(self, entry: _Entry) -> None:
        whole = _key(entry.text, len(entry.text))
        same = self._whole.get(whole)
        if same is not None:
            same[:] = [e for e in same if e is not entry]
            if not same:
                del self._whole[whole]
        for key in entry.keys:
            rows = self._index.get(key)
            if rows is None:
                continue
            for row in [r for r in rows if r[0] is entry]:
                rows.remove(row)
                end = key[0]
                left = self._ends.get(end, 1) - 1
                if left:
                    self._ends[end] = left
                else:
                    self._ends.pop(end, None)
            if not rows:
                del self._index[key]
        entry.keys.clear()
