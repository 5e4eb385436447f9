#!/usr/bin/env bash
# Build OUT: clang's ASan runtime with its libFuzzer linked in, one shared library to
# LD_PRELOAD under a Python that is not instrumented (what atheris calls
# asan_with_fuzzer.so; its wheel carries none). Preloaded, atheris runs on this libFuzzer,
# and an extension built with -fsanitize=address,fuzzer-no-link-style coverage reports
# both its coverage and its memory errors to it.
#
#     fuzz/asan_libfuzzer.sh OUT [CLANG]
set -euo pipefail
out=$1 clang=${2:-clang-14}
rt=$("$clang" -print-runtime-dir 2>/dev/null || true)
[ -f "$rt/libclang_rt.asan-x86_64.a" ] ||
    rt=$(dirname "$("$clang" -print-file-name=libclang_rt.asan-x86_64.a)")
for lib in asan fuzzer_no_main asan_cxx; do
    [ -f "$rt/libclang_rt.$lib-x86_64.a" ] || {
        echo "fuzz/asan_libfuzzer.sh: no libclang_rt.$lib in $rt (apt-get install libclang-rt-14-dev)" >&2
        exit 1
    }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/asan" "$work/fuzzer"
(cd "$work/asan" && ar x "$rt/libclang_rt.asan-x86_64.a" && rm -f asan_preinit.cpp.o)  # no .preinit_array in a DSO
(cd "$work/fuzzer" && ar x "$rt/libclang_rt.fuzzer_no_main-x86_64.a")
mkdir -p "$(dirname "$out")"
"$clang" -shared -o "$out" "$work"/asan/*.o "$work"/fuzzer/*.o \
    -Wl,--whole-archive "$rt/libclang_rt.asan_cxx-x86_64.a" -Wl,--no-whole-archive \
    -lpthread -ldl -lrt -lm -lstdc++
echo "built $out"
