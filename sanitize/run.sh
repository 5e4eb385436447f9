#!/usr/bin/env bash
# `make sanitize`: the C extensions under AddressSanitizer + UndefinedBehaviorSanitizer
# (gcc), with LeakSanitizer at every Python process's exit.
#
#     sanitize/run.sh [pytest args...]      (default: the tests that drive the C)
#
# 1. Builds kvindex.index._core and kvindex.subscriber._recv with -fsanitize=address,
#    undefined into build/sanitize (a copy of the package: the in-place .so files, which
#    other checkouts' runs use, stay as they are).
# 2. Runs the tests with that copy first on PYTHONPATH and gcc's libasan preloaded (the
#    python binary isn't built with ASan, so the runtime must come first). Any ASan or
#    UBSan error aborts the process; a leak of our C's makes it exit 23. Reports also
#    go to build/sanitize/reports/, checked at the end, so one from a subprocess whose
#    exit code a test ignores still fails the run.
# 3. Runs sanitize/churn.py under valgrind's memcheck on the ordinary build: a second
#    opinion on uninitialised reads, and a definite-leak count of blocks our C allocated.
# 4. ThreadSanitizer (gcc, build/tsan): the in-order path in C on ingest threads while other
#    threads read the index, and the C sequencer's differential streams
#    (tests/test_ingest_c.py, tests/test_inorder.py); ingest, membership churn and every
#    kind of lookup at once on the library API (tests/test_core_threads.py, whose child
#    processes run tests/core_threads.py under TSan too: it reports issue 23's names read
#    outside the lock on the core before the fold; its `exact` case applies four
#    publishers on four threads at once and compares the end with the reference); serve's C lookup thread answering by
#    tokens and by hashes while another thread applies batches with new names and
#    publishers, and every test of the lookup thread, serve's included (tests/test_lookupd.py,
#    tests/test_fastpath_serve.py: their hand-overs to Python are where the thread and
#    Python share sockets; ~25 s under TSan). Reports go to build/tsan/reports; libzmq's
#    own hand-offs are suppressed
#    (sanitize/tsan.supp says why). And an index in shards (tests/test_sharded.py): lookups
#    walking every shard, on Python's call and on the C thread, while two threads apply
#    into their own shards.
#
# LeakSanitizer records one frame above malloc, so sanitize/lsan.supp can name who
# called malloc: CPython and the libraries it loads are suppressed, our C never is.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
out=build/sanitize
flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"

bash fuzz/build.sh "$out" gcc "$flags"
asan=$(gcc -print-file-name=libasan.so)
reports=$out/reports
rm -rf "$reports" && mkdir -p "$reports"

if [ $# -eq 0 ]; then
    set -- tests/test_core*.py tests/test_index*.py tests/test_subscriber.py tests/test_hostile.py \
        tests/test_lookupd.py tests/test_inorder.py tests/test_ingest_c.py tests/test_store_fastload.py \
        tests/test_sharded.py
fi
status=0
env LD_PRELOAD="$asan" PYTHONPATH="$out" \
    ASAN_OPTIONS="detect_leaks=1:malloc_context_size=2:log_path=$PWD/$reports/asan:strict_string_checks=1:detect_invalid_pointer_pairs=1" \
    LSAN_OPTIONS="suppressions=$PWD/sanitize/lsan.supp:print_suppressions=0" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$PWD/$reports/ubsan" \
    "$python" -m pytest -q -p no:cacheprovider "$@" || status=$?

# Every report file in DIR is a finding (for ASan, UBSan, or leaks left after the
# suppressions; for TSan, races left after its); then the tests' own exit STATUS.
check_reports() {
    local dir=$1 what=$2 status=$3
    if ls "$dir"/* >/dev/null 2>&1; then
        for f in "$dir"/*; do
            echo "== $f"
            head -c 20000 "$f"
        done
        echo "make sanitize: $what reports above" >&2
        exit 1
    fi
    if [ "$status" -ne 0 ]; then
        echo "make sanitize: the tests failed under $what (exit $status)" >&2
        exit "$status"
    fi
    echo "sanitize: no $what report"
}
check_reports "$reports" "ASan, UBSan or LeakSanitizer" "$status"

tsan_out=build/tsan
bash fuzz/build.sh "$tsan_out" gcc "-fsanitize=thread -g -O1"
tsan_reports=$tsan_out/reports
rm -rf "$tsan_reports" && mkdir -p "$tsan_reports"
tsan_status=0
env LD_PRELOAD="$(gcc -print-file-name=libtsan.so)" PYTHONPATH="$tsan_out" \
    TSAN_OPTIONS="suppressions=$PWD/sanitize/tsan.supp:log_path=$PWD/$tsan_reports/tsan:report_signal_unsafe=0" \
    "$python" -m pytest -q -p no:cacheprovider tests/test_ingest_c.py tests/test_inorder.py \
    tests/test_core_threads.py tests/test_lookupd.py tests/test_fastpath_serve.py \
    tests/test_sharded.py ||
    tsan_status=$?
check_reports "$tsan_reports" ThreadSanitizer "$tsan_status"

if command -v valgrind >/dev/null; then
    # CPython has valgrind false positives of its own (int.from_bytes...): the log is
    # read for records through our C rather than trusting valgrind's exit code.
    PYTHONMALLOC=malloc valgrind -q --tool=memcheck --leak-check=full \
        --show-leak-kinds=definite --track-origins=yes --log-file="$reports/valgrind.log" \
        "$python" sanitize/churn.py --cycles 5 --steps 1500
    "$python" sanitize/valgrind_leaks.py "$reports/valgrind.log"
else
    echo "sanitize: valgrind not installed; its churn run is skipped"
fi
