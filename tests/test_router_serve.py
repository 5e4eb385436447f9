"""`kvindex serve` as a router runs it, as its own process over real HTTP and ZMQ: the
routing score's weights and the prediction TTL from the config file and the flags; the
peers' `/register` (routing group, block size) kept by a SQLite store across a restart."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from clitools import Proc, kvindex

from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(90)


def started(proc: Proc) -> str:
    """The base URL serve says it listens on."""
    line = proc.wait_for(proc.out, lambda text: "listening on" in text, timeout=30)
    return line.split("listening on ")[1].split()[0].rstrip("/")


def test_serve_scores_and_predicts_with_the_weights_and_ttl_it_is_given(tmp_path: Path) -> None:
    config = tmp_path / "k.toml"
    config.write_text("[routing]\nprediction_ttl = 3\n[routing.weights]\ncpu = 0.5\nqueue = 1.5\n")
    with Publisher("tcp://127.0.0.1:*") as pub:
        proc = kvindex(
            "serve", "--config", str(config), "--store", "memory", "--http", "127.0.0.1:0",
            "--instance", f"e0={pub.endpoint}", "--weights", "queue=0.25,kv=0",
            "--prediction-ttl", "7",
        )  # fmt: skip
        try:
            with httpx.Client(base_url=started(proc), timeout=10) as client:
                scored = client.post("/v1/lookup", json={"token_ids": [1] * 32, "score": True})
                assert scored.json()["weights"] == {  # the flag's queue over the file's
                    "prefix": 3.0, "queue": 0.25, "running": 1.0, "kv": 0.0, "predicted": 1.0,
                    "tiers": {"gpu": 1.0, "cpu": 0.5, "disk": 0.5, "external": 0.5},
                }  # fmt: skip
                routed = client.post("/v1/route", json={"token_ids": list(range(32))}).json()
                assert routed["best"] == "e0"
                assert routed["predicted"] == {
                    "instance": "e0", "rank": 0, "blocks": 2, "ttl_seconds": 7.0
                }  # fmt: skip
        finally:
            proc.interrupt()
            assert proc.finish(15) == 0
