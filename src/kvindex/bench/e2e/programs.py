"""The child programs the end-to-end cases run, each in a fresh interpreter
(`procs.bench_child(role, ...)`): the publishers, the naive subscriber, and the HTTP
lookup and freshness clients. Each says what it did in JSON lines on stdout."""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from kvindex.bench.common import BLOCK, percentile
from kvindex.bench.e2e.child import paced_steps, say
from kvindex.bench.e2e.probes import Client, connect, request
from kvindex.bench.e2e.streams import MARKER_BASE, Item, marker_payload, read_items

__all__ = ["FRESH_PAUSE", "child_main"]

FRESH_PAUSE = 0.001  # seconds between two freshness polls


def child_main(argv: list[str]) -> None:
    """`procs.bench_child(role, ...)`'s entry point, in the child process."""
    role, args = argv[0], argv[1:]
    if role == "publish":
        publish_main(args[0], int(args[1]))
    elif role == "naive":
        naive_main(json.loads(args[0]), int(args[1]), int(args[2]), float(args[3]))
    elif role == "lookups":
        lookups_main(args[0], args[1], Path(args[2]), int(args[3]), int(args[4]), float(args[5]))
    elif role == "fresh":
        fresh_main(args[0], int(args[1]), args[2], float(args[3]))
    elif role == "routes":
        from kvindex.bench.e2e.routing import routes_main

        routes_main(args[0], Path(args[1]), int(args[2]), float(args[3]))
    else:
        raise SystemExit(f"unknown bench child {role!r}")


# -- the publishers ---------------------------------------------------------------------------


def publish_main(items_file: str, count: int) -> None:
    """Publishers on free loopback ports, sending what stdin's commands say."""
    from kvindex.wire.publisher import Publisher

    items = read_items(items_file)
    room = len(items) + 100_000  # the replay buffer can answer for the whole run
    pubs = [
        Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", hwm=0, buffer_steps=room)
        for _ in range(count)
    ]
    say({"op": "endpoints", "endpoints": [[p.endpoint, p.replay_endpoint] for p in pubs]})
    commands: queue.Queue[dict[str, Any]] = queue.Queue()
    stop = threading.Event()
    threading.Thread(target=_read_commands, args=(commands, stop), daemon=True).start()
    sender = _Sender(pubs, items, stop)
    try:
        while (command := commands.get())["op"] != "exit":
            sender.handle(command)
    finally:
        for p in pubs:
            p.close()


def _read_commands(commands: queue.Queue[dict[str, Any]], stop: threading.Event) -> None:
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "stop":
            stop.set()
        else:
            commands.put(command)
    stop.set()
    commands.put({"op": "exit"})


class _Sender:
    def __init__(self, pubs: list[Any], items: list[Item], stop: threading.Event) -> None:
        self.pubs = pubs
        self.items = items
        self.cursor = 0
        self.stop = stop

    def next_seqs(self) -> list[int]:
        return [int(p.next_seq) for p in self.pubs]

    def handle(self, command: dict[str, Any]) -> None:
        op = command["op"]
        if op == "burst":
            self.burst(command.get("count"), command.get("file"))
        elif op == "paced":
            self.stop.clear()
            self.paced(command)
        elif op == "stats":
            say({"op": "stats", "replays_served": sum(p.replays_served for p in self.pubs)})

    def burst(self, count: int | None, file: str | None) -> None:
        if file:
            items = read_items(file)
        else:
            end = len(self.items) if count is None else self.cursor + count
            items, self.cursor = self.items[self.cursor : end], min(end, len(self.items))
        pubs = self.pubs
        t0 = time.time()
        for idx, payload in items:
            pubs[idx].publish_payload(payload)
        t1 = time.time()
        say(
            {
                "op": "burst",
                "t0": t0,
                "t1": t1,
                "batches": len(items),
                "next_seqs": self.next_seqs(),
            }
        )

    def paced(self, command: dict[str, Any]) -> None:
        """Send `rate` batches/s for `seconds` (or until stopped or out of items), in
        slices of about half a millisecond; and `markers` marker batches on the first
        publisher, one every `marker_every` seconds, each send stamped."""
        rate, seconds = float(command["rate"]), float(command["seconds"])
        markers, every = int(command["markers"]), float(command["marker_every"])
        stamps: list[float] = []
        sent, items, pubs = 0, self.items, self.pubs
        t0, m0 = time.time(), time.monotonic()
        say({"op": "started", "t0": t0})
        while not self.stop.is_set():
            elapsed = time.monotonic() - m0
            if elapsed >= seconds or (self.cursor >= len(items) and len(stamps) >= markers):
                break
            if len(stamps) < markers and elapsed >= (len(stamps) + 0.5) * every:
                payload = marker_payload(len(stamps))
                stamps.append(time.time())
                pubs[0].publish_payload(payload)
            while sent < rate * elapsed and self.cursor < len(items):
                idx, payload = items[self.cursor]
                pubs[idx].publish_payload(payload)
                self.cursor += 1
                sent += 1
            time.sleep(0.0005)
        exhausted = self.cursor >= len(items)
        done = {"t0": t0, "t1": time.time(), "batches": sent, "markers": stamps}
        say({"op": "paced", **done, "exhausted": exhausted, "next_seqs": self.next_seqs()})


# -- the naive subscriber ---------------------------------------------------------------------


def naive_main(endpoints: list[str], warmup: int, total: int, timeout: float) -> None:
    """The naive consumer (`consumers.Naive`) on SUB sockets. Says `warm` once `warmup`
    batches arrived and `done` (with its end time) after `total`."""
    import zmq

    from kvindex.wire import render_hash

    ctx: Any = zmq.Context.instance()
    socks = []
    for endpoint in endpoints:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        socks.append(sock)
    time.sleep(0.5)  # the subscriptions reach the publishers
    say({"op": "ready"})
    sub = _NaiveSubscriber(socks)
    deadline = time.monotonic() + timeout
    sub.receive(warmup, deadline)
    say({"op": "warm"})
    sub.receive(total, deadline)
    t_done = time.time()
    blocks = [sorted(render_hash(h) for h in held) for held in sub.naive.held()]
    say(
        {
            "op": "done",
            "t_done": t_done,
            "received": sub.received,
            "gaps": sub.gaps,
            "blocks": blocks,
        }
    )
    for sock in socks:
        sock.close(linger=0)


class _NaiveSubscriber:
    """SUB sockets feeding one `consumers.Naive`; counts batches and sequence gaps."""

    def __init__(self, socks: list[Any]) -> None:
        import zmq

        from kvindex.bench.consumers import Naive

        self.socks = socks
        self.poller = zmq.Poller()
        for sock in socks:
            self.poller.register(sock, zmq.POLLIN)
        self.where = {sock: i for i, sock in enumerate(socks)}
        self.naive = Naive(len(socks))
        self.next_seq = [0] * len(socks)
        self.received = 0
        self.gaps = 0

    def receive(self, until: int, deadline: float) -> None:
        """Until `until` batches in all have arrived (or the deadline passed)."""
        import zmq

        apply, again = self.naive.apply, zmq.Again
        while self.received < until and time.monotonic() < deadline:
            for sock, _ in self.poller.poll(100):
                i = self.where[sock]
                while self.received < until:
                    try:
                        _topic, seq_bytes, payload = sock.recv_multipart(zmq.NOBLOCK)
                    except again:
                        break
                    seq = int.from_bytes(seq_bytes, "big")
                    self.gaps += seq != self.next_seq[i]
                    self.next_seq[i] = seq + 1
                    self.received += 1
                    apply(i, payload)


# -- the HTTP clients ------------------------------------------------------------------------


# Per API: the lookup path, the empty GET, a lookup body, and its answer as matched blocks
# per instance key (kvindex: the instance's name; Dynamo: the worker id, matched tokens
# per DP rank, the best rank counting).
_LOOKUP = {"kvindex": "/v1/lookup", "dynamo": "/query"}
_FLOOR = {"kvindex": "/healthz", "dynamo": "/health"}


def _body(api: str, tokens: list[int]) -> bytes:
    if api == "dynamo":
        from kvindex.bench.e2e.dynamo import MODEL

        return msgspec.json.encode({"token_ids": tokens, "model_name": MODEL})
    return msgspec.json.encode({"token_ids": tokens})


def _matched(api: str, answer: Any) -> dict[str, int]:
    if api == "dynamo":
        scores = answer["scores"]
        return {w: max(ranks.values()) // BLOCK for w, ranks in scores.items() if ranks}
    return {row["name"]: row["matched_blocks"] for row in answer["instances"]}


def lookups_main(
    api: str, url: str, prompts_file: Path, count: int, gets: int, interval: float
) -> None:
    """`gets` empty GETs back to back, then `count` lookups, one every `interval` seconds
    (lookup i asks prompt i % P), each kind on its own keep-alive connection
    (`probes.Client`), as a router's lookups and a health checker's probes come: serve's
    lookup thread hands a connection that sent anything but lookups to Python for good."""
    prompts = msgspec.msgpack.decode(prompts_file.read_bytes(), type=list[list[int]])
    client, probe = Client(url), Client(url)
    lookups = [client.prepare("POST", _LOOKUP[api], _body(api, p)) for p in prompts]
    floor = probe.prepare("GET", _FLOOR[api])
    for prepared in lookups[:3]:  # warm the connections and the handlers up
        client.send(prepared)
        probe.send(floor)
    say({"op": "ready"})
    sys.stdin.readline()  # go
    clock = time.perf_counter
    floor_times: list[float] = []
    for _ in range(gets):
        start = clock()
        probe.send(floor)
        floor_times.append(clock() - start)
    probe.close()
    latencies: list[float] = []
    answers: list[dict[str, int]] = []
    for i in paced_steps(count, interval):
        start = clock()
        answer = client.send(lookups[i % len(lookups)])
        latencies.append(clock() - start)
        answers.append(_matched(api, msgspec.json.decode(answer)))
    client.close()
    say({"op": "done", "latencies": latencies, "floor": floor_times, "answers": answers})


def fresh_main(url: str, count: int, instance: str, timeout: float) -> None:
    """Poll for the marker chain; stamp each marker when an answer first shows it."""
    hashes = [str(MARKER_BASE + j) for j in range(count)]
    conn = connect(url)
    request(conn, "POST", "/v1/lookup/hashes", msgspec.json.encode({"block_hashes": hashes[:1]}))
    say({"op": "ready"})
    seen: list[float | None] = [None] * count
    cycles: list[float] = []
    k = 0
    deadline = time.monotonic() + timeout
    while k < count and time.monotonic() < deadline:
        body = msgspec.json.encode({"block_hashes": hashes[k : k + 64]})
        sent = time.time()
        answer = request(conn, "POST", "/v1/lookup/hashes", body)
        now = time.time()
        cycles.append(now - sent + FRESH_PAUSE)
        rows = [r["matched_blocks"] for r in answer["instances"] if r["name"] == instance]
        visible = rows[0] if rows else 0
        seen[k : k + visible] = [now] * visible
        k += visible
        time.sleep(FRESH_PAUSE)
    conn.close()
    cycle = percentile(sorted(cycles), 0.5) if cycles else 0.0
    say({"op": "done", "seen": seen, "cycle_p50": cycle, "polls": len(cycles)})
