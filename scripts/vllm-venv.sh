#!/usr/bin/env bash
# Create (once) a venv holding vLLM 0.33.0's real Python code on a CPU-only
# machine, for the interop tests in tests/interop/.
#
#   scripts/vllm-venv.sh            # prints the venv's python as the last stdout line
#   KVINDEX_VLLM_VENV=/some/dir scripts/vllm-venv.sh
#
# Idempotent: a marker file is written when everything is installed and the
# imports the tests need work; with the marker present (and matching this
# script's package set) the script only prints the path (< 1 s).
# Progress and pip output go to stderr; stdout carries only the python path.
#
# Notes:
# - torch==2.13.0 is a CPU build that lies on this machine's disk (pip finds it
#   through the machine's pip config: find-links). Plain `pip` only: uv/poetry
#   don't look there and would download a multi-GB CUDA build.
# - vllm itself is installed with --no-deps (its metadata pins torch==2.14.0 and
#   many CUDA-only packages); then only what the KV-cache manager and the ZMQ
#   event publisher import is installed, with vllm's own version specifiers
#   for those packages where it has one.
# - vllm imports `openai_harmony`; vllm 0.33.0's metadata requires the
#   distribution `oss-harmony` (a fork of `openai-harmony` that provides the
#   same module). We install `oss-harmony`.
# - einops: a ModelConfig (what vLLM's real Scheduler and offloading connector
#   are built from) inspects the model class, whose attention layers import it.
set -euo pipefail

VENV="${KVINDEX_VLLM_VENV:-${KVINDEX_TEST_CACHE:-$HOME/.cache/kvindex-tests}/vllm-0.33-venv}"
PY="$VENV/bin/python"
MARKER="$VENV/.kvindex-vllm-venv-complete"
TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm==0.33.0"
DEPS=(
  msgspec pyzmq numpy packaging psutil regex pydantic cbor2 transformers
  aiohttp requests oss-harmony openai pillow pybase64 cachetools cloudpickle
  uvloop py-cpuinfo prometheus_client xgrammar fastapi partial-json-parser
  llguidance pyyaml einops
)
# Bump when the package set or the import check changes, so existing venvs are
# completed again (pip skips what is already there).
STAMP="v3 $TORCH_SPEC $VLLM_SPEC ${DEPS[*]}"

log() { printf 'vllm-venv: %s\n' "$*" >&2; }
die() { printf 'vllm-venv: ERROR: %s\n' "$*" >&2; exit 1; }

if [[ -f "$MARKER" && -x "$PY" && "$(cat "$MARKER" 2>/dev/null)" == "$STAMP" ]]; then
  echo "$PY"
  exit 0
fi

command -v python3.11 >/dev/null 2>&1 || die "python3.11 not found on PATH"
mkdir -p "$(dirname "$VENV")" || die "cannot create $(dirname "$VENV")"

# One installer at a time (parallel test workers); the winner's marker
# satisfies the others.
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
  # Filtered out: pip's per-location warnings about the machine's local indexes,
  # and its resolver report that vllm's (deliberately skipped) CUDA-side
  # requirements are missing or pinned differently (torch==2.14.0, ...).
  "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | grep -v -e "^WARNING: Location 'file://" \
              -e "^vllm 0\.33\.0 requires " \
              -e "^ERROR: pip's dependency resolver does not currently take" >&2
  return "${PIPESTATUS[0]}"
}

log "installing $TORCH_SPEC (CPU build from the local wheel directory)"
pip_install "$TORCH_SPEC" || die "pip install $TORCH_SPEC failed"
"$PY" -W ignore -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' \
  || die "torch in $VENV is not 2.13.0"

log "installing $VLLM_SPEC --no-deps"
pip_install --no-deps "$VLLM_SPEC" || die "pip install --no-deps $VLLM_SPEC failed"

# Turn the dependency names into requirements carrying vllm's own specifiers
# (e.g. transformers<5.21.0,>=5.16.1, xgrammar==0.2.8) where vllm has one.
mapfile -t REQS < <("$PY" - "${DEPS[@]}" <<'EOF'
import sys, importlib.metadata as md
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
wanted = {canonicalize_name(n): n for n in sys.argv[1:]}
found = {}
for r in md.requires("vllm") or []:
    req = Requirement(r)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    n = canonicalize_name(req.name)
    if n in wanted:
        found[n] = f"{req.name}{req.specifier}"
for n, name in wanted.items():
    print(found.get(n, name))
EOF
) || die "could not read vllm's requirements"
[[ ${#REQS[@]} -eq ${#DEPS[@]} ]] || die "requirement list incomplete: ${REQS[*]}"

log "installing dependencies: ${REQS[*]}"
pip_install "${REQS[@]}" || die "pip install of vllm's dependencies failed"

# torchvision / torchaudio / torchcodec are built against one torch release
# each; a copy from PyPI (pulled in by anything, e.g. a `pip install vllm` with
# its dependencies) is for torch 2.14 and breaks `import transformers` here
# ("operator torchvision::nms does not exist"). vLLM's KV-cache code needs none
# of them and transformers imports them only when present, so they go.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Torch must still be the CPU build (nothing above may replace it).
"$PY" -W ignore -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' \
  || die "a dependency replaced torch 2.13.0"

log "checking imports"
"$PY" - >&2 <<'EOF' || die "vLLM imports failed in $VENV (see above)"
import msgspec, zmq, openai_harmony  # noqa: F401
from vllm.distributed.kv_events import (  # noqa: F401
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher,
)
from vllm.lora.request import LoRARequest  # noqa: F401
from vllm.sampling_params import SamplingParams  # noqa: F401
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: F401
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401
from vllm.v1.core.kv_cache_utils import (  # noqa: F401
    get_request_block_hasher, init_none_hash, maybe_convert_block_hash,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig  # noqa: F401
from vllm.v1.request import Request  # noqa: F401
# vllm_model_driver.py: the v1 Scheduler, the offloading connector, hybrid specs.
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: F401
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec  # noqa: F401
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: F401
import einops  # noqa: F401
import vllm
assert vllm.__version__ == "0.33.0", vllm.__version__
print("vllm-venv: imports ok, vllm", vllm.__version__)
EOF

printf '%s' "$STAMP" > "$MARKER" || die "could not write $MARKER"
log "done in $(( $(date +%s) - start )) s; size $(du -sh "$VENV" | cut -f1)"
echo "$PY"
