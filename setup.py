"""The compiled core (kvindex.index._core), built by a plain `pip install -e .`.

Without a C compiler (or Python's headers) the build says so in one line and the package
installs anyway: kvindex then runs its pure-Python implementation (as it does with
KVINDEX_PURE=1).
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CORE = "src/kvindex/index/csrc"
# Extensions kvindex does without (what then), e.g. when a header is missing.
OPTIONAL = {
    "kvindex.store.sqlite._snapload": "a warm start reads the SQLite snapshot in Python "
    "(slower; install libsqlite3-dev to build it)",
}


class OptionalBuildExt(build_ext):
    """build_ext that falls back to pure Python instead of failing the install (one line
    says so)."""

    def run(self) -> None:
        self._failed: list[str] = []
        self._optional_failed: list[str] = []  # warnings, said only when the core built
        try:
            super().run()
        except Exception as exc:  # no compiler at all: distutils raises here
            self._failed.append(_first_line(exc))
        if self._failed:  # one line: the optional extensions' failures follow from it
            print(
                f"kvindex: WARNING: the compiled core was not built ({self._failed[0]}); "
                "the pure-Python implementation will be used",
                file=sys.stderr,
            )
            return
        for warning in self._optional_failed:
            print(warning, file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # the compiler or headers failed on this extension
            if ext.name in OPTIONAL:  # the rest runs without it
                self._optional_failed.append(
                    f"kvindex: WARNING: {ext.name} was not built ({_first_line(exc)}); "
                    f"{OPTIONAL[ext.name]}"
                )
                return
            self._failed.append(_first_line(exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


setup(
    ext_modules=[
        Extension(
            "kvindex.index._core",
            sources=[f"{CORE}/{name}" for name in ("core.c", "parse.c", "answer.c", "module.c")],
            depends=[
                f"{CORE}/{name}"
                for name in (
                    "core.h", "answer.h", "map.h", "maptmpl.h", "msgpack.h", "intern.h", "alloc.h",
                    "xxh3.h", "ingest_api.h", "lookup_api.h",
                )
            ],
            extra_compile_args=["-O2", "-std=gnu11", "-fvisibility=hidden", "-Wall"],
            extra_link_args=["-pthread"],
        ),
        Extension(
            "kvindex.service._lookupd",
            sources=["src/kvindex/service/_lookupd.c"],
            depends=[f"{CORE}/{name}" for name in ("lookup_api.h", "answer.h", "core.h")],
            extra_compile_args=["-O2", "-std=gnu11", "-fvisibility=hidden", "-Wall"],
            extra_link_args=["-pthread"],
        ),
        Extension(
            "kvindex.subscriber._recv",
            sources=["src/kvindex/subscriber/_recv.c"],
            depends=[f"{CORE}/ingest_api.h"],
            include_dirs=[CORE],
            extra_compile_args=["-O2", "-std=gnu11", "-fvisibility=hidden", "-Wall"],
            extra_link_args=["-ldl", "-lz"],
        ),
        Extension(
            "kvindex.store.sqlite._snapload",
            sources=["src/kvindex/store/sqlite/_snapload.c"],
            depends=[f"{CORE}/{name}" for name in ("ingest_api.h", "msgpack.h")],
            include_dirs=[CORE],
            libraries=["sqlite3"],
            extra_compile_args=["-O2", "-std=gnu11", "-fvisibility=hidden", "-Wall"],
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
