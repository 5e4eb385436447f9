"""The process's heap by its allocators' own statistics (issue 23 item 4).

A process's resident set is an upper bound of what it holds: it keeps pages the allocators
have freed but not returned, and what a burst left behind. The allocators know exactly
what is live:

- `core`: the compiled core's C (every allocation of it is counted: index/csrc/alloc.h);
- `malloc`: what glibc's malloc has handed out and not had back (`mallinfo2`: in-use
  chunks plus mmapped blocks): the core's C again, ZMQ's buffers, and Python's objects
  over 512 bytes (large lists, bytes, dicts' tables);
- `pymalloc`: Python's small-object allocator, the bytes of its live blocks (what
  `sys._debugmallocstats` reports as "bytes in allocated blocks"); its arenas are mmapped
  apart from malloc, so this adds to `malloc`.

`malloc + pymalloc` is the heap the process uses (`total`). `serve` exports them as
`kvindex_heap_bytes{allocator=...}`; the bench's end-to-end memory case reports the growth
of `total` over its fill per entry beside the resident set's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import sys
import tempfile
import threading
from dataclasses import dataclass

__all__ = ["HeapBytes", "heap_bytes"]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc before 2.33
        return None
    function.restype = _Mallinfo2
    function.argtypes = []
    return function  # type: ignore[no-any-return]


_MALLINFO2 = _mallinfo2()
_PYMALLOC_LINE = re.compile(rb"^# bytes in allocated blocks\s*=\s*([\d,]+)\s*$", re.M)
_CAPTURE = threading.Lock()


@dataclass(frozen=True, slots=True)
class HeapBytes:
    """Bytes live in each allocator (None: this platform does not say)."""

    core: int
    malloc: int | None
    pymalloc: int | None

    @property
    def total(self) -> int | None:
        """The heap in use: malloc's and pymalloc's (the core's is inside malloc's)."""
        if self.malloc is None or self.pymalloc is None:
            return None
        return self.malloc + self.pymalloc


def heap_bytes() -> HeapBytes:
    """The allocators' statistics now (a few ms on a big heap: pymalloc's walks its pools)."""
    return HeapBytes(_core_bytes(), _malloc_bytes(), _pymalloc_bytes())


def _core_bytes() -> int:
    try:
        from kvindex.index._core import allocated
    except ImportError:  # the pure-Python index: no C
        return 0
    return int(allocated()[0])


def _malloc_bytes() -> int | None:
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    if not (info.arena or info.hblkhd or info.uordblks):
        return None  # a malloc that keeps no statistics (AddressSanitizer's, say)
    return int(info.uordblks + info.hblkhd)


def _pymalloc_bytes() -> int | None:
    """pymalloc's live bytes. CPython says them only by writing its statistics to the C
    stderr: they are read from a file put in stderr's place for the call, and whatever
    else came in meanwhile (another thread's line) is written to stderr after."""
    if not hasattr(sys, "_debugmallocstats"):
        return None
    with _CAPTURE, tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(capture.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        capture.seek(0)
        text = capture.read()
    found = _PYMALLOC_LINE.search(text)
    start = text.find(b"Small block threshold")
    foreign = text[:start] if start > 0 else b""
    if foreign:
        os.write(2, foreign)
    if found is None:  # PYTHONMALLOC=malloc: no pymalloc, all of it is in malloc's figure
        return 0
    return int(found.group(1).replace(b",", b""))
