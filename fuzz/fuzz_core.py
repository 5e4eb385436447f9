"""atheris harness: the compiled core against the pure-Python reference (`make fuzz`).

    python fuzz/fuzz_core.py [libFuzzer flags] WORK_CORPUS fuzz/corpus

Each input is a program of payloads and restarts over four publishers (fuzz/corediff.py);
the two implementations must agree on every verdict, count, pool, lookup and tree, and
hold nothing once every publisher is dropped. A disagreement or a crash stops the run
with the input saved (crash-*). Mutations are msgpack-aware (fuzz/mutate.py), mixed with
libFuzzer's own.

Coverage: the Python of both implementations is instrumented by atheris. The C is too
when the package comes from an instrumented build (`make fuzz` puts one first on
PYTHONPATH, built by fuzz/build.sh with clang's -fsanitize-coverage): its coverage
counters then go to atheris's libFuzzer, so new paths in the C parser and core count.
"""

from __future__ import annotations

import ctypes
import os
import random
import sys
from collections.abc import Callable

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mutate import mutate

_rng = random.Random()
_check: Callable[[bytes], None] | None = None


def test_one(data: bytes) -> None:
    global _check
    if _check is None:  # the first run: libFuzzer is loaded now (see _load_package)
        _check = _load_package()
    _check(data)


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    _rng.seed(seed)
    return mutate(data, _rng, max_size, raw=atheris.Mutate)


def _libfuzzer_global() -> None:
    """An instrumented extension calls libFuzzer's coverage hooks (__sanitizer_cov_*),
    which live in the atheris core that Setup() loaded privately: made global here, before
    the extension loads, they resolve to it (and the extension's counters register with
    the libFuzzer that runs)."""
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps]
    for path in paths:
        if "atheris" in path and os.path.basename(path).startswith("core_with_libfuzzer"):
            ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL | os.RTLD_NOLOAD)
            return


def _load_package() -> Callable[[bytes], None]:
    """The package, imported once Fuzz() has loaded atheris's libFuzzer (it does so only
    then), so that an instrumented extension can link to it."""
    _libfuzzer_global()
    with atheris.instrument_imports(include=["kvindex", "corediff"]):
        import corediff

        import kvindex.index._core as core

    print(f"fuzz_core: the core from {core.__file__}", file=sys.stderr)
    return corediff.check


def main() -> None:
    atheris.Setup(sys.argv, test_one, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
