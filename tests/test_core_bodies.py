"""module.c has one way into the core (issue 26): a static read of its source.

Every entry point of `Core` parses its arguments, then hands a body to `core_run`, the
one function that gives the GIL away, and `core_locked`, the one that takes the index's
lock. The names a lookup asks for were once resolved before the lock was taken (issue
23): an ingest thread interning a name meanwhile could move the table under the read.
These checks keep that class of bug from being written again: no entry point takes the
lock or releases the GIL itself, none reads the core outside a body, and bodies run
without the GIL call nothing of Python's C API.
"""

from __future__ import annotations

import re
from pathlib import Path

MODULE = Path(__file__).resolve().parents[1] / "src/kvindex/index/csrc/module.c"

# Entry points that read nothing of the core under its lock: the digest reads the seed only;
# ingest_api hands out the C ingest loop's table (its one function: see below).
NO_LOCK = {"Core_key_digest", "Core_init", "Core_dealloc", "Core_ingest_api"}
# Tests' hook between two slices (its own mutex, not the index's lock).
NO_LOCK |= {"Core_pause_slices", "Core_slices_paused", "Core_resume_slices"}
# A medium's tier from its name alone.
NO_LOCK |= {"Core_tier_of"}


def _functions(source: str) -> dict[str, str]:
    """Every top-level function of a C file: name -> its whole text (signature + body)."""
    out: dict[str, str] = {}
    for match in re.finditer(
        r"^(?:static )?[A-Za-z_][\w \*]*?\b(\w+)\(([^;{]*?)\)\s*\{", source, re.M
    ):
        depth, i = 0, match.end() - 1
        while True:
            if source[i] == "{":
                depth += 1
            elif source[i] == "}":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        out[match.group(1)] = source[match.start() : i + 1]
    return out


def _methods(source: str) -> list[str]:
    table = source[source.index("static PyMethodDef Core_methods[]") :]
    table = table[table.index("{") + 1 : table.index("};")]
    return re.findall(r"\bCore_\w+", table)


SOURCE = MODULE.read_text()
FUNCTIONS = _functions(SOURCE)


def test_the_functions_are_found() -> None:
    assert {"core_run", "core_locked", "Core_lookup", "Core_apply_payload"} <= set(FUNCTIONS)
    assert len(_methods(SOURCE)) >= 20


def test_only_core_locked_takes_the_lock() -> None:
    for name, text in FUNCTIONS.items():
        if name in ("core_locked", "Core_init", "Core_dealloc"):
            continue
        assert not re.search(r"pthread_rwlock_\w+\(", text), f"{name} takes the lock itself"


def test_only_core_run_gives_the_gil_away() -> None:
    for name, text in FUNCTIONS.items():
        if name == "core_run":
            continue
        for token in ("Py_BEGIN_ALLOW_THREADS", "Py_END_ALLOW_THREADS", "PyEval_SaveThread"):
            assert token not in text, f"{name} gives the GIL away itself ({token})"


def test_every_entry_point_goes_through_the_runner() -> None:
    for name in _methods(SOURCE):
        text = FUNCTIONS[name]
        assert "core_entry(" in text or "core_ready(" in text, f"{name} has no entry guard"
        if name in NO_LOCK:
            continue
        runs = "core_run(" in text or re.search(r"\bpub_list\(", text)
        assert runs, f"{name} does not go through core_run"


def test_no_entry_point_reads_the_core_outside_a_body() -> None:
    """An entry point's own text may name the core only to digest a key (the seed)."""
    for name in _methods(SOURCE):
        text = FUNCTIONS[name].replace("key_digest(&self->core", "")
        assert "->core" not in text, f"{name} reads the core outside core_run's body"


def test_bodies_run_without_the_gil_touch_no_python() -> None:
    bodies = set(re.findall(r"core_run\(self, RUN_(?:WRITE_NOGIL|READ_NOGIL|NOGIL), (\w+)", SOURCE))
    bodies |= set(re.findall(r"core_locked\(self, 1, (\w+)", SOURCE))  # slices: no GIL
    assert {"parse_and_apply", "apply_sliced", "apply_one_slice", "remove_body"} <= bodies
    for name in bodies:
        text = FUNCTIONS[name]
        body = text[text.index("{") :]
        assert not re.search(r"\bPy[A-Z_]\w*", body), (
            f"{name} runs without the GIL and calls Python"
        )


def test_the_c_ingest_entry_runs_apply_payloads_body_and_no_python() -> None:
    """The C ingest loop (_recv.c) calls in without the GIL, through `ingest_apply`: it
    must run the very RUN_NOGIL body apply_payload runs, and touch nothing of Python's."""
    text = FUNCTIONS["ingest_apply"]
    assert "parse_batch(" in text and "apply_sliced(" in text
    assert not re.search(r"\bPy[A-Z_]\w*", text)
    assert "INGEST_API" in FUNCTIONS["Core_ingest_api"]
