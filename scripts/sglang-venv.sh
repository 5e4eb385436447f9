#!/usr/bin/env bash
# Create (once) a venv holding SGLang 0.5.23's real Python code on a CPU-only machine,
# for the SGLang interop recording and tests (tests/interop/sglang_driver.py).
#
#   scripts/sglang-venv.sh            # prints the venv's python as the last stdout line
#   KVINDEX_SGLANG_VENV=/some/dir scripts/sglang-venv.sh
#
# Idempotent: a marker file is written once everything is installed, the imports the
# driver needs work and SGLang's native page hash is built; with the marker present (and
# matching this script's package set) the script only prints the path (< 1 s).
# Progress and pip output go to stderr; stdout carries only the python path.
#
# Notes:
# - torch==2.13.0 is a CPU build that lies on this machine's disk (pip finds it through
#   the machine's pip config: find-links). Plain `pip` only: uv/poetry don't look there
#   and would download a multi-GB CUDA build.
# - sglang itself is installed with --no-deps (its metadata pins torch==2.14.1 and many
#   CUDA-only packages); then, also --no-deps, exactly what importing
#   sglang.srt.mem_cache.radix_cache, sglang.srt.mem_cache.events and
#   sglang.srt.disaggregation.kv_events (and server_args, for the /server_info descriptor)
#   needs, pinned to the versions this was worked out with (sglang's own pins where it
#   has them: transformers, tokenizers, sentencepiece, compressed-tensors, apache-tvm-ffi).
# - torchvision's PyPI wheels need CUDA torch; SGLang imports it only from multimodal
#   image helpers, so an inert stand-in package is installed instead
#   (scripts/sglang_venv/torchvision_standin.py).
# - The first use of SGLang's page hash compiles a C++ extension (g++, ninja, OpenSSL's
#   libcrypto headers: Debian's g++ and libssl-dev, which .ci/run installs; ninja comes
#   from PyPI into the venv). It is built here, into $VENV/torch-extensions.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${KVINDEX_SGLANG_VENV:-$HOME/.cache/kvindex-tests/sglang-0.5.23-venv}"
PY="$VENV/bin/python"
MARKER="$VENV/.kvindex-sglang-venv-complete"
TORCH_SPEC="torch==2.13.0"
SGLANG_SPEC="sglang==0.5.23"
DEPS=(
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-types==0.8.0
  anyio==4.16.0 apache-tvm-ffi==0.1.11 attrs==26.1.0 certifi==2026.10.19.post1
  charset-normalizer==3.5.2 compressed-tensors==0.18.0 dill==0.4.1 frozenlist==1.8.0
  gguf==0.19.0 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0
  idna==3.20 ipython==9.18.1 loguru==0.7.3 msgspec==0.22.0 multidict==7.2.1 ninja==1.13.2
  numpy==2.4.6 orjson==3.13.0 packaging==26.3 pillow==13.0.0 propcache==0.5.4 psutil==7.2.2
  pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0 PyYAML==6.0.4
  pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 safetensors==0.8.0 sentencepiece==0.2.1
  starlette==1.10.0 tokenizers==0.23.2 tqdm==4.70.1 traitlets==5.16.1 transformers==5.19.0
  triton==3.9.0 truststore==0.10.5 typing-inspection==0.4.5 urllib3==2.8.0 yarl==1.25.1
)
STANDIN="$HERE/sglang_venv/torchvision_standin.py"
# Bump when the package set or the stand-in changes, so existing venvs are completed again.
STAMP="v1 $TORCH_SPEC $SGLANG_SPEC ${DEPS[*]} $(cksum < "$STANDIN" | cut -d' ' -f1)"

log() { printf 'sglang-venv: %s\n' "$*" >&2; }
die() { printf 'sglang-venv: ERROR: %s\n' "$*" >&2; exit 1; }

if [[ -f "$MARKER" && -x "$PY" && "$(cat "$MARKER" 2>/dev/null)" == "$STAMP" ]]; then
  echo "$PY"
  exit 0
fi

command -v python3.11 >/dev/null 2>&1 || die "python3.11 not found on PATH"
command -v g++ >/dev/null 2>&1 || die "g++ not found (Debian: apt-get install g++)"
[[ -f /usr/include/openssl/sha.h ]] || die "OpenSSL headers missing (Debian: apt-get install libssl-dev)"
mkdir -p "$(dirname "$VENV")" || die "cannot create $(dirname "$VENV")"

# One installer at a time (parallel test workers); the winner's marker satisfies the others.
if command -v flock >/dev/null 2>&1; then
  exec 9>"$VENV.lock" || die "cannot open $VENV.lock"
  flock 9 || die "cannot lock $VENV.lock"
  if [[ -f "$MARKER" && -x "$PY" && "$(cat "$MARKER" 2>/dev/null)" == "$STAMP" ]]; then
    echo "$PY"
    exit 0
  fi
fi

start=$(date +%s)
rm -f "$MARKER"
if [[ ! -x "$PY" ]]; then
  log "creating venv at $VENV"
  python3.11 -m venv "$VENV" >&2 || die "python3.11 -m venv $VENV failed"
fi

pip_install() {
  # Filtered out: pip's per-location warnings about the machine's local indexes, and its
  # resolver report that sglang's (deliberately skipped) requirements are missing.
  "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | grep -v -e "^WARNING: Location 'file://" \
              -e "^sglang 0\.5\.23 requires " \
              -e "^ERROR: pip's dependency resolver does not currently take" >&2
  return "${PIPESTATUS[0]}"
}
torch_is_cpu_2_13() {
  "$PY" -W ignore -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)'
}

log "installing $TORCH_SPEC (CPU build from the local wheel directory)"
pip_install "$TORCH_SPEC" || die "pip install $TORCH_SPEC failed"
torch_is_cpu_2_13 || die "torch in $VENV is not 2.13.0"

log "installing $SGLANG_SPEC and ${#DEPS[@]} dependencies, all --no-deps"
pip_install --no-deps "$SGLANG_SPEC" "${DEPS[@]}" || die "pip install --no-deps failed"
torch_is_cpu_2_13 || die "a dependency replaced torch 2.13.0"

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if "$PY" -m pip show -q torchvision >/dev/null 2>&1; then
  die "a real torchvision is installed in $VENV (it needs CUDA torch): remove the venv"
fi
mkdir -p "$SITE/torchvision" && cp "$STANDIN" "$SITE/torchvision/__init__.py" \
  || die "could not install the torchvision stand-in"

log "checking imports and building SGLang's native page hash (first time: ~15 s)"
PATH="$VENV/bin:$PATH" TORCH_EXTENSIONS_DIR="$VENV/torch-extensions" "$PY" -W ignore - >&2 <<'EOF' \
  || die "SGLang imports or the native hash build failed in $VENV (see above)"
import zmq, msgspec  # noqa: F401
from sglang.srt.disaggregation.kv_events import (  # noqa: F401
    EventPublisherFactory, KVEventBatch, StorageMedium, ZmqEventPublisher,
)
from sglang.srt.mem_cache.events import KVCacheEventRecorder, KvEventLoraNames  # noqa: F401
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: F401
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.runtime_context import describe_kv_events_publisher  # noqa: F401
from sglang.srt.server_args import ServerArgs  # noqa: F401
from sglang.version import __version__
assert __version__ == "0.5.23", __version__
assert len(get_hash_str([1, 2, 3, 4], None, page_size=2)) == 2
print("sglang-venv: imports ok, native hash built, sglang", __version__)
EOF

printf '%s' "$STAMP" > "$MARKER" || die "could not write $MARKER"
log "done in $(( $(date +%s) - start )) s; size $(du -sh "$VENV" | cut -f1)"
echo "$PY"
