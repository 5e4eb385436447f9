"""Issue 17 point 7, end to end: `kvindex serve` (memory store) follows one publisher that
sends a huge BlockStored, then removes it all (leaf first), while a client posts
/v1/lookup in a loop and polls /v1/stats (which counts the instance's blocks).

    python scripts/huge_batch_serve.py BLOCKS

Prints the lookups' latency (median, longest) and serve's peak RSS (VmHWM) for each.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx

from kvindex.wire import BlockHash, BlockRemoved, BlockStored
from kvindex.wire.publisher import Publisher, encode_batch

BS = 16


def peak_rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(status.read().split("VmHWM:")[1].split()[0]) // 1024


def main() -> None:
    n = int(sys.argv[1])
    pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    spec = f"a={pub.endpoint},replay={pub.replay_endpoint}"
    cmd = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [*cmd, "--store", "memory", "--instance", spec],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().split("listening on ")[1].split()[0]
    hashes: list[BlockHash] = list(range(1, n + 1))
    tokens = [i % 50_000 for i in range(n * BS)]
    stored = encode_batch([BlockStored(hashes, None, tokens, BS)], 1.0, 0)
    removed = encode_batch([BlockRemoved(hashes[::-1])], 2.0, 0)
    del tokens
    print(f"payload {len(stored) / 1e6:.1f} MB")
    client = httpx.Client(base_url=url, timeout=30)
    while client.get("/v1/stats").json()["batches"] == 0:
        pub.publish([BlockStored([10**9], None, list(range(BS)), BS)])
        time.sleep(0.02)
    waits: list[float] = []
    stop = threading.Event()

    def look() -> None:
        body = {"token_ids": list(range(BS * 4))}
        while not stop.is_set():
            t = time.perf_counter()
            assert client.post("/v1/lookup", json=body).status_code == 200
            waits.append(time.perf_counter() - t)
            time.sleep(0.002)

    thread = threading.Thread(target=look)
    thread.start()
    for name, payload, blocks in (("stored", stored, n + 1), ("removed", removed, 1)):
        waits.clear()
        t = time.perf_counter()
        pub.publish_payload(payload)
        while client.get("/v1/stats").json().get("blocks") != blocks:
            time.sleep(0.01)
        took = time.perf_counter() - t
        time.sleep(0.1)
        ws = sorted(waits)
        print(
            f"{name}: applied in {took * 1e3:.0f} ms; {len(ws)} lookups, median "
            f"{ws[len(ws) // 2] * 1e3:.1f} ms, longest (ms) {[round(w * 1e3, 1) for w in ws[-5:]]}"
            f"; serve's peak RSS {peak_rss_mb(proc.pid)} MB"
        )
    stop.set()
    thread.join()
    proc.terminate()
    proc.wait(10)
    pub.close()


if __name__ == "__main__":
    main()
