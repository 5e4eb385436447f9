"""bench/pub_shards.py (the index sharded by publisher): a small run holds every shard
count's merged answers to one index's, and that one index answers as the bench's own
consumer does. No timing is asserted (the machine is shared)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvindex.bench.consumers import Kvindex
from kvindex.bench.workloads import FillSpec, fill, prompts

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench/pub_shards.py"

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def _load() -> Any:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import pub_shards
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return pub_shards


def test_assignments_cover_the_shards_and_fnv_is_fnv1a() -> None:
    m = _load()
    assert m.fnv1a32(b"") == 0x811C9DC5 and m.fnv1a32(b"a") == 0xE40C292C  # the spec's vectors
    assert m.assignment(8, 4, "rr") == [0, 1, 2, 3, 0, 1, 2, 3]
    fnv = m.assignment(64, 16, "fnv")
    assert fnv == [m.fnv1a32(f"i{i}".encode()) % 16 for i in range(64)]
    assert all(0 <= s < 16 for s in fnv)


def test_sharded_lookups_merge_to_one_index_answers(tmp_path: Path) -> None:
    spec, count = FillSpec(8, 3000), 40
    cmd = [sys.executable, str(SCRIPT), "--instances", "8", "--per-instance", "3000"]
    cmd += ["--prompts", str(count), "--shards", "1,2,4", "--repeats", "1", "--rounds", "1"]
    cmd += ["--apply-instances", "4", "--apply-events", "20000"]
    env = dict(os.environ, KVINDEX_BENCH_CACHE=str(tmp_path / "cache"))
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=110)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    lookups = out["lookups"]
    assert lookups["exact"] and lookups["entries"] == spec.entries
    # The one index of the harness answers what the bench's consumer (the probe's) does.
    ours = Kvindex(spec.instances)
    ours.build(fill(spec))
    want = hashlib.sha256()
    for p in prompts(spec, count):
        want.update(json.dumps(ours.depths(ours.query(p.tokens.tolist(), p.hashes))).encode())
    assert lookups["matches_digest"] == want.hexdigest()
    for kind in ("c", "py"):
        assert sorted(lookups[kind]) == ["1", "2", "4"]
        for got in lookups[kind].values():
            assert got["digest"] == want.hexdigest() and got["entries"] == spec.entries
            assert got["alloc_bytes_per_entry"] > 0
    # a shard's walk is at most as deep as the one index's, and there are more of them
    steps = [lookups["c"][n]["mean_steps"] for n in ("1", "2", "4")]
    assert steps == sorted(steps) and steps[0] > 0
    cases = out["apply"]["cases"]
    assert set(cases) == {"core_each_1", "core_each_2", "core_each_4", "one_lock_2", "one_lock_4"}
    assert len({(c["digest"], c["entries"]) for c in cases.values()}) == 1
