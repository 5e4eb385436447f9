#!/usr/bin/env bash
# Build an instrumented copy of the package's C extensions, away from the source tree:
#
#     fuzz/build.sh DIR CC "FLAGS"
#
# DIR gets a copy of src/kvindex (Python files) plus kvindex.index._core,
# kvindex.subscriber._recv, kvindex.service._lookupd and kvindex.store.sqlite._snapload
# compiled by CC with FLAGS
# (compile and link). Put DIR first on PYTHONPATH to run the tests or the fuzzer on it:
# the editable install's own .so files are never touched (other worktrees' builds, the
# lead's, stay as they are). Fails if an extension did not build (setup.py's optional
# build would only warn).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$1 cc=$2 flags=$3
python=${PYTHON:-.venv/bin/python}

rm -rf "$dir/kvindex" "$dir.tmp"
mkdir -p "$dir"
# The Python files only: the copy must not carry the editable install's .so files.
(cd src && find kvindex -name '*.py' -o -name 'py.typed' -o -path '*/static/*' -type f) |
    while read -r f; do mkdir -p "$dir/$(dirname "$f")" && cp "src/$f" "$dir/$f"; done
CC=$cc LDSHARED="$cc -shared" CFLAGS="$flags" LDFLAGS="$flags" \
    "$python" setup.py -q build_ext --build-lib "$dir" --build-temp "$dir.tmp" >"$dir.log" 2>&1 ||
    { cat "$dir.log"; exit 1; }
for ext in index/_core subscriber/_recv service/_lookupd store/sqlite/_snapload; do
    if ! ls "$dir"/kvindex/$ext.*.so >/dev/null 2>&1; then
        cat "$dir.log"
        echo "fuzz/build.sh: kvindex/$ext was not built with $cc $flags" >&2
        exit 1
    fi
done
echo "built $dir with $cc $flags"
