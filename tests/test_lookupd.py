"""The C lookup thread on the listening socket (kvindex.service.lookupd, _lookupd.c).

- It answers exactly what Python answers (`Fleet.lookup_json`, the answer of the fast path
  and of the route), on the random fleets of tests/test_core.py, over real sockets.
- It answers with the GIL held elsewhere the whole time: no Python runs for its lookups.
- What it does not take -- another path, a refused or odd header, a body of another shape,
  a request that does not arrive whole, instances that moved -- goes to Python, which
  answers it on the same connection (in `kvindex serve`, with every rule of the service).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest
from clitools import Proc, kvindex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from netutil import wait_until
from prometheus_client import CollectorRegistry
from test_core import BASE, block_hash, build, event_plan, feed, prompt_of
from test_fastpath import NAMES, fleet_over

from kvindex.index import COMPILED
from kvindex.runtime import Fleet
from kvindex.security.http import HttpGuard
from kvindex.service import fastpath, lookupd
from kvindex.service.metrics import LookupMetrics
from kvindex.subscriber import InstanceSpec, SourceKey, Status
from kvindex.wire import BlockStored, EventBatch
from kvindex.wire.hashes import render_hash
from kvindex.wire.publisher import Publisher

pytestmark = [
    pytest.mark.skipif(not COMPILED or lookupd.Server is None, reason="no compiled core"),
    pytest.mark.timeout(120),
]

TOKEN = "a-token-of-sixteen-chars"


def lookup_request(
    tokens: list[int], names: dict[str, str] | None = None, host: str = "127.0.0.1", **extra: str
) -> bytes:
    body = json.dumps({"token_ids": tokens, **(names or {})}).encode()
    head = f"POST /v1/lookup HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    for name, value in extra.items():
        head += f"{name.replace('_', '-')}: {value}\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


def read_response(sock: socket.socket, pending: bytearray) -> tuple[int, dict[str, str], bytes]:
    while b"\r\n\r\n" not in pending:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed"
        pending += chunk
    head, _, rest = bytes(pending).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed"
        rest += chunk
    pending[:] = rest[length:]
    return int(lines[0].split()[1]), headers, rest[:length]


@contextmanager
def thread_over(fleet: Any, guard: HttpGuard | None = None) -> Iterator[tuple[Any, int]]:
    """The lookup thread on a fresh listening socket over `fleet` (no event loop: what it
    hands over stays for `take`); yields it and its port."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    listener.setblocking(False)
    metrics = LookupMetrics(CollectorRegistry())
    thread = lookupd.LookupThread(
        fleet, listener, guard or HttpGuard(), 1 << 20, metrics, [(b"server", b"uvicorn")]
    )
    thread.refresh()
    thread.server.start()
    try:
        yield thread, listener.getsockname()[1]
    finally:
        thread.stop()
        listener.close()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(event_plan, max_size=40),
    st.dictionaries(st.sampled_from("abcde"), st.sampled_from(list(Status)), max_size=5),
)
def test_the_thread_answers_what_python_answers(
    plan: list[tuple[Any, ...]], shown: dict[str, Status]
) -> None:
    _, fast = feed(build(plan))
    fleet = fleet_over(fast, shown)
    try:
        with thread_over(fleet) as (thread, port), connect(port) as sock:
            pending = bytearray()
            asked = 0
            for p in range(len(BASE)):
                for variant in range(2):
                    tokens = prompt_of(p, variant)
                    for names in NAMES:
                        sock.sendall(lookup_request(tokens, names))
                        status, headers, body = read_response(sock, pending)
                        asked += 1
                        assert status == 200
                        assert headers["content-type"] == "application/json"
                        assert body == fleet.lookup_json(tokens, **names)[0], (tokens, names)
            answered, handed, stale, _, _ = thread.counts()
            assert (answered, handed, stale) == (asked, 0, 0)
            thread.read_samples()
            assert thread.metrics.totals[0] == asked
    finally:
        fleet.close()


class _Metrics:
    def __init__(self) -> None:
        self.lookups = LookupMetrics(CollectorRegistry())


def ask(thread: Any, port: int, request: bytes) -> bytes | None:
    """The thread's answer's body, or None when it handed the request to Python."""
    handed = thread.counts()[1]
    with connect(port) as sock:
        sock.sendall(request)
        sock.settimeout(0.05)
        pending = bytearray()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if thread.counts()[1] > handed:
                for fd, _, _ in thread.server.take():
                    os.close(fd)
                return None
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            assert chunk, "closed without an answer"
            pending += chunk
            if b"\r\n\r\n" in pending:
                sock.settimeout(10)
                status, _, body = read_response(sock, pending)
                assert status == 200
                return body
    raise AssertionError("neither answered nor handed over")


def hashes_request(body: bytes) -> bytes:
    head = "POST /v1/lookup/hashes HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


hash_texts = st.one_of(
    st.integers(-(2**63), 2**64 - 1).map(str),
    st.integers(0, 10**19).map(lambda v: "00" + str(v)),  # leading zeros
    st.binary(min_size=1, max_size=40).map(bytes.hex),
    st.binary(min_size=1, max_size=8).map(lambda b: b.hex().upper()),
    st.text("0123456789abcdef-", max_size=24),
    st.sampled_from(["-0", "-", "", "18446744073709551616", "-9223372036854775809", "x"]),
)


@st.composite
def hashes_bodies(draw: st.DrawFn, known: list[str]) -> bytes:
    texts = draw(st.lists(st.one_of(st.sampled_from(known), hash_texts), max_size=12))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
    fields: dict[str, Any] = {"block_hashes": texts}
    if draw(st.integers(0, 9)) == 0:
        fields["other"] = 1  # unknown fields: the route refuses
    return json.dumps(fields, separators=separators).encode()


def test_hash_lookups_are_answered_as_python_answers() -> None:
    """`POST /v1/lookup/hashes`: every body the thread takes gets the bytes Python's fast
    path gives it; the plain ones are all taken; the others go to Python."""
    plan = [("store", s, p, v, 0, 3, ns, pool, form, False)
            for s, p, v, ns, pool, form in [(0, 0, 0, 0, 0, 0), (1, 1, 1, 1, 2, 1),
                                            (2, 2, 0, 0, 3, 2), (3, 0, 1, 2, 5, 0)]]  # fmt: skip
    _, fast = feed(build(plan))
    fleet = fleet_over(fast, {"c": Status.DOWN})
    answerer = fastpath.LookupAnswerer(fleet, _Metrics(), 1 << 20)  # type: ignore[arg-type]
    known = sorted({render_hash(h) for name in fast.instances() for h in fast.block_hashes(name)})
    chains = [
        [render_hash(block_hash(prompt_of(p, v), n, ns, signed)) for n in range(5)]
        for p in range(3)
        for v in range(2)
        for ns in range(3)
        for signed in (False, True)
    ]
    assert known, "the plan stored nothing"
    try:
        with thread_over(fleet) as (thread, port):
            # what a router sends: the stored chains, whole and cut, and nothing
            hits = 0
            for texts in [*chains, *(c[:2] for c in chains), [], ["12", known[0]]]:
                body = json.dumps({"block_hashes": texts}).encode()
                got = ask(thread, port, hashes_request(body))
                assert got is not None, body
                assert got == answerer.answer(fastpath.HASHES_PATH, body)
                hits += json.loads(got)["best"] is not None
            assert hits > 0

            taken: list[bool] = []

            @settings(max_examples=150, deadline=None)
            @given(hashes_bodies(known))
            def each(body: bytes) -> None:
                got = ask(thread, port, hashes_request(body))
                expected = answerer.answer(fastpath.HASHES_PATH, body)
                taken.append(got is not None)
                if got is not None:  # never a body Python would not answer so
                    assert got == expected, body

            each()
            assert sum(taken) >= 5  # the plain ones are the thread's (about a fifth here)
            thread.read_samples()
            assert "hashes" in thread.metrics._children  # counted as kind hashes
    finally:
        fleet.close()


def test_the_head_is_uvicorns() -> None:
    """Status line, date, the server's default headers, type and length, as the Python
    fast path writes them; pipelined requests are answered in order."""
    _, fast = feed(build([("store", 0, 0, 0, 0, 3, 0, 0, 0, False)]))
    fleet = fleet_over(fast, {})
    try:
        with thread_over(fleet) as (_, port), connect(port) as sock:
            tokens = prompt_of(0, 0)
            sock.sendall(lookup_request(tokens) + lookup_request(tokens[:16]))
            pending = bytearray()
            first = read_response(sock, pending)
            second = read_response(sock, pending)
            assert list(first[1]) == ["date", "server", "content-type", "content-length"]
            assert first[1]["date"].endswith(" GMT") and first[1]["server"] == "uvicorn"
            assert first[2] == fleet.lookup_json(tokens)[0]
            assert second[2] == fleet.lookup_json(tokens[:16])[0]
    finally:
        fleet.close()


_CLIENT = textwrap.dedent(
    """
    import json, socket, sys, time
    port, rounds = int(sys.argv[1]), int(sys.argv[2])
    body = json.dumps({"token_ids": list(range(10, 30))}).encode()
    req = (b"POST /v1/lookup HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nContent-Length: %d\\r\\n\\r\\n"
           % len(body) + body)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    worst, answers = 0.0, set()
    for _ in range(rounds):
        start = time.perf_counter()
        sock.sendall(req)
        data = b""
        while b"\\r\\n\\r\\n" not in data:
            data += sock.recv(65536)
        head, _, rest = data.partition(b"\\r\\n\\r\\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\\r\\n")[0])
        while len(rest) < length:
            rest += sock.recv(65536)
        worst = max(worst, time.perf_counter() - start)
        answers.add(rest)
    print(json.dumps({"worst": worst, "answers": [a.decode() for a in answers]}))
    """
)


def test_lookups_are_answered_while_python_holds_the_gil() -> None:
    """A client process asks 200 lookups while this process's only Python thread spins
    with a switch interval of 10 s: nothing else can run Python meanwhile, so every answer
    comes from the thread with no GIL."""
    _, fast = feed(build([("store", 0, 0, 0, 0, 3, 0, 0, 0, False)]))
    fleet = fleet_over(fast, {})
    interval = sys.getswitchinterval()
    try:
        expected = fleet.lookup_json(list(range(10, 30)))[0]
        with thread_over(fleet) as (thread, port):
            client = subprocess.Popen(
                [sys.executable, "-c", _CLIENT, str(port), "200"],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                sys.setswitchinterval(10.0)
                deadline = time.monotonic() + 60
                spins = 0
                while client.poll() is None and time.monotonic() < deadline:
                    spins += 1  # Python, holding the GIL (no other Python thread wants it)
                sys.setswitchinterval(interval)
                out, _ = client.communicate(timeout=30)
            finally:
                sys.setswitchinterval(interval)
                client.kill()
                client.wait()
            assert client.returncode == 0
            result = json.loads(out)
            assert result["answers"] == [expected.decode()]
            assert thread.counts()[:2] == (200, 0)
            assert spins > 0
    finally:
        fleet.close()


def test_stop_frees_what_the_server_holds() -> None:
    """serve freezes its objects (gc.freeze), so the Server lives to the process's end:
    what it holds (the samples' ring, the answers, the limits, its reference to the core)
    stayed until then, a leak LeakSanitizer reported at every serve's exit. `stop` now
    closes it: the core's reference is given back, a closed server refuses new answers
    and a start, and its counts stay readable."""
    _, fast = feed(build([("store", 0, 0, 0, 0, 3, 0, 0, 0, False)]))
    fleet = fleet_over(fast, {})
    try:
        with thread_over(fleet) as (thread, port), connect(port) as sock:
            sock.sendall(lookup_request(list(range(10, 30)), {}))
            status, _, _ = read_response(sock, bytearray())
            assert status == 200
            core = thread.core
            held = sys.getrefcount(core)
            thread.stop()
            assert sys.getrefcount(core) == held - 1
            with pytest.raises(RuntimeError, match="closed"):
                thread.server.set_answer([], [], 0)
            with pytest.raises(RuntimeError):
                thread.server.start()
            assert thread.server.samples() == [] and thread.server.take() == []
            assert thread.counts()[:2] == (1, 0)
            thread.refresh()  # nothing to push to: no error
    finally:
        fleet.close()


def test_lookups_beside_ingest() -> None:
    """The thread's lookups (by tokens with LoRA names and salts, and by hashes) while
    another thread applies batches with fresh names and new publishers, for 2 s: every
    answer well formed, none of a moved layout (those are handed over). Under
    ThreadSanitizer (make sanitize) this is the lock's and the names' test."""
    _, fast = feed(build([("store", 0, 0, 0, 0, 3, 0, 0, 0, False)]))
    fleet = fleet_over(fast, {})
    stop = threading.Event()

    def ingest() -> None:
        i = 0
        while not stop.is_set():
            source = SourceKey("e", 0) if i % 1000 else SourceKey(f"new-{i}")
            event = BlockStored([10_000 + i], None, [i % 97] * 16, 16, lora_name=f"ad-{i % 7}")
            fleet.index.apply(source, EventBatch(0.0, [event]), i)
            i += 1

    writer = threading.Thread(target=ingest, daemon=True)
    try:
        with thread_over(fleet) as (thread, port):
            writer.start()
            deadline = time.monotonic() + 2
            asked = answered = 0
            while time.monotonic() < deadline:
                names = {"lora_name": f"ad-{asked % 9}", "cache_salt": "t1"} if asked % 2 else {}
                for request in (
                    lookup_request([asked % 97] * 32, names),
                    hashes_request(b'{"block_hashes": ["%d"]}' % (10_000 + asked)),
                ):
                    body = ask(thread, port, request)  # None: handed over (a moved layout)
                    if body is not None:
                        assert json.loads(body)["instances"]
                        answered += 1
                asked += 1
                thread.refresh()  # as the event loop does every 10 ms
            assert answered >= 1  # most, unless new publishers came right before each
    finally:
        stop.set()
        writer.join(10)
        fleet.close()


def test_moved_publishers_are_handed_over() -> None:
    """A publisher the core made after the thread got its instances: the lookup (and its
    connection) goes to Python with every byte read, never an answer naming old bits."""
    _, fast = feed(build([("store", 0, 0, 0, 0, 3, 0, 0, 0, False)]))
    fleet = fleet_over(fast, {})
    try:
        with thread_over(fleet) as (thread, port), connect(port) as sock:
            fleet.index.apply(
                SourceKey("e"), EventBatch(0.0, [BlockStored([5], None, [1] * 16, 16)]), 0
            )
            request = lookup_request(prompt_of(0, 0))
            sock.sendall(request)
            assert wait_until(lambda: thread.counts()[1] == 1, 10)
            taken = thread.server.take()
            assert len(taken) == 1 and taken[0][1:] == (request, False)
            os.close(taken[0][0])
            assert thread.counts()[2] == 1  # stale
            thread.refresh()
            with connect(port) as again:
                again.sendall(request)
                assert read_response(again, bytearray())[2] == fleet.lookup_json(prompt_of(0, 0))[0]
    finally:
        fleet.close()


def test_refresh_beside_instances_added_and_removed() -> None:
    """The event loop's refresh reads the instances and their statuses while a worker adds
    and removes one: of one membership, never a name whose publisher the worker already
    dropped (CI's two-replica stress test logged `KeyError: c0` from the timer: refresh
    read the slots, then the statuses, with the removal in between)."""
    with Publisher("tcp://127.0.0.1:*") as stable, Publisher("tcp://127.0.0.1:*") as churned:
        fleet = Fleet([InstanceSpec("s", stable.endpoint)], ingest_workers=1)
        churn = InstanceSpec("c0", churned.endpoint)
        stop = threading.Event()
        errors: list[str] = []

        def churning() -> None:
            while not stop.is_set():
                fleet.add_instance(churn)
                fleet.remove_instance("c0")

        async def main() -> int:
            await fleet.start()
            refreshed = 0
            worker = threading.Thread(target=churning)
            try:
                with thread_over(fleet) as (thread, _):
                    worker.start()
                    deadline = time.monotonic() + 3
                    while time.monotonic() < deadline:
                        try:
                            thread.refresh()
                            refreshed += 1
                        except Exception as exc:  # the timer's callback: logged, 10 ms on
                            errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                stop.set()
                if worker.is_alive() or worker.ident is not None:
                    worker.join(30)
                await fleet.stop()
            return refreshed

        refreshed = asyncio.run(main())
    assert errors[:3] == []
    assert refreshed > 100


# -- in kvindex serve ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Proc, int, list[int]]]:
    pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    proc = kvindex(
        "serve", "--store", "memory", "--http", "127.0.0.1:0", "--token", TOKEN,
        "--request-timeout", "2", "--max-body-bytes", "200000",
        "--instance", f"a={pub.endpoint},replay={pub.replay_endpoint}",
    )  # fmt: skip
    tokens = list(range(64))
    try:
        port = urlsplit(proc.listening_url(timeout=10)).port or 0
        time.sleep(0.5)  # the SUB socket connects
        pub.publish([BlockStored([1, 2, 3, 4], None, tokens, 16)])

        def found() -> bool:
            with connect(port) as sock:
                sock.sendall(lookup_request(tokens, Authorization=f"Bearer {TOKEN}"))
                return json.loads(read_response(sock, bytearray())[2])["best"] == "a"

        assert wait_until(found, 10)
        yield proc, port, tokens
    finally:
        proc.interrupt()
        proc.finish()
        pub.close()


def thread_counts(port: int) -> dict[str, float]:
    with connect(port) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        text = read_response(sock, bytearray())[2].decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith(("kvindex_lookup_thread_", "kvindex_lookup_requests_total")):
            name, _, value = line.rpartition(" ")
            counts[name] = float(value)
    return counts


def test_serve_answers_in_the_thread_and_hands_over_the_rest(
    served: tuple[Proc, int, list[int]],
) -> None:
    _, port, tokens = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = thread_counts(port)
    with connect(port) as sock:
        pending = bytearray()
        sock.sendall(lookup_request(tokens, **auth))
        status, _, answer = read_response(sock, pending)
        assert status == 200 and json.loads(answer)["best"] == "a"
        # the same connection, another path and a lookup pipelined behind it: Python
        # answers both, in order, then gives the connection back
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + lookup_request(tokens, **auth)
        )
        assert read_response(sock, pending)[0] == 200
        assert read_response(sock, pending)[2] == answer
        given_back = "kvindex_lookup_thread_given_back_total"
        assert wait_until(lambda: thread_counts(port)[given_back] > before[given_back], 10)
        sock.sendall(lookup_request(tokens, **auth))  # the thread's again
        assert read_response(sock, pending)[2] == answer
    after = thread_counts(port)
    answered = "kvindex_lookup_thread_answered_total"
    assert after[answered] - before[answered] == 2
    handed = "kvindex_lookup_thread_handed_over_total"
    assert after[handed] - before[handed] >= 1  # the metrics scrapes are handed over too
    requests = 'kvindex_lookup_requests_total{kind="tokens"}'
    assert after[requests] - before[requests] == 3  # the thread's answers counted too
    # and timed by stage: each of its answers once in each (its receive time known here)
    for stage in ("queue", "parse", "answer", "total"):
        count = f'kvindex_lookup_thread_stage_seconds_count{{stage="{stage}"}}'
        assert after[count] - before[count] == 2, stage


def test_a_connection_that_never_looks_up_stays_with_python(
    served: tuple[Proc, int, list[int]],
) -> None:
    """Handed over, given back, handed over again with nothing answered by the thread:
    Python keeps it, rather than passing it back and forth at every request."""
    _, port, _ = served
    before = thread_counts(port)
    with connect(port) as sock:
        pending = bytearray()
        for _ in range(5):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_response(sock, pending)[0] == 200
            time.sleep(0.05)  # given back, if it is, before the next
    after = thread_counts(port)
    given_back = "kvindex_lookup_thread_given_back_total"
    handed = "kvindex_lookup_thread_handed_over_total"
    # this connection: over, back, over, then kept (5 and 4 if it bounced each time);
    # the scrape after it: once over; the scrape before it: given back after it counted
    assert after[handed] - before[handed] == 2 + 1
    assert 1 <= after[given_back] - before[given_back] <= 1 + 1


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        ({}, 401),  # no token: Python words the refusal
        ({"Authorization": "Bearer not-the-token-at-all"}, 401),
        ({"Authorization": f"Basic {TOKEN}"}, 401),
        ({"Authorization": f"Bearer {TOKEN}", "host": "evil.example"}, 400),
        ({"Authorization": f"Bearer {TOKEN}", "host": "[::1]:8080"}, 200),  # IPv6: Python's
        ({"Authorization": f"Bearer {TOKEN}", "Connection": "close"}, 200),
        ({"Authorization": f"Bearer {TOKEN}", "Expect": "100-continue"}, 200),
    ],
)
def test_what_the_thread_does_not_take_python_answers(
    served: tuple[Proc, int, list[int]], extra: dict[str, str], status: int
) -> None:
    _, port, tokens = served
    host = extra.pop("host", "127.0.0.1")
    before = thread_counts(port)["kvindex_lookup_thread_answered_total"]
    with connect(port) as sock:
        sock.sendall(lookup_request(tokens, host=host, **extra))
        pending = bytearray()
        got, _, body = read_response(sock, pending)
        if got == 100:  # uvicorn's answer to Expect, then the answer
            got, _, body = read_response(sock, pending)
    assert got == status, body
    if status == 200:
        assert json.loads(body)["best"] == "a"
    assert thread_counts(port)["kvindex_lookup_thread_answered_total"] == before


def test_the_fronts_header_limit_holds_for_the_thread() -> None:
    """serve's --max-header-bytes: a lookup whose head is over it is never the thread's
    (Python's limits layer answers 431)."""
    pub = Publisher("tcp://127.0.0.1:*")
    proc = kvindex(
        "serve", "--store", "memory", "--http", "127.0.0.1:0", "--max-header-bytes", "1024",
        "--instance", f"a={pub.endpoint}",
    )  # fmt: skip
    try:
        port = urlsplit(proc.listening_url(timeout=10)).port or 0
        tokens = list(range(32))
        with connect(port) as sock:
            sock.sendall(lookup_request(tokens, X_Padding="p" * 600))  # under 1 KiB: taken
            assert read_response(sock, bytearray())[0] == 200
        with connect(port) as sock:
            sock.sendall(lookup_request(tokens, X_Padding="p" * 2000))
            assert read_response(sock, bytearray())[0] == 431
    finally:
        proc.interrupt()
        proc.finish()
        pub.close()


def test_max_connections_counts_the_threads_connections_too() -> None:
    """serve's --max-connections is one cap over the connections the thread holds and
    Python's: past it, a lookup (the thread's) and a GET (Python's) both get 503."""
    pub = Publisher("tcp://127.0.0.1:*")
    proc = kvindex(
        "serve", "--store", "memory", "--http", "127.0.0.1:0", "--max-connections", "4",
        "--instance", f"a={pub.endpoint}",
    )  # fmt: skip
    held: list[socket.socket] = []
    try:
        port = urlsplit(proc.listening_url(timeout=10)).port or 0
        tokens = list(range(32))
        health = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        # three connections the thread holds (idle after a lookup), one Python keeps (a
        # health checker's: handed over twice with nothing answered by the thread)
        for _ in range(3):
            sock = connect(port)
            held.append(sock)
            sock.sendall(lookup_request(tokens))
            assert read_response(sock, bytearray())[0] == 200
        checker = connect(port)
        held.append(checker)
        pending = bytearray()
        for _ in range(3):
            checker.sendall(health)
            assert read_response(checker, pending)[0] == 200
            time.sleep(0.05)
        for request in (lookup_request(tokens), health):
            with connect(port) as sock:
                sock.sendall(request)
                status, headers, body = read_response(sock, bytearray())
                assert status == 503, body
                assert b"over 4 connections" in body and headers["connection"] == "close"
        # one closed: room again, for either kind
        held.pop(0).close()
        for request in (lookup_request(tokens), health):

            def admitted(request: bytes = request) -> bool:
                with connect(port) as sock:
                    sock.sendall(request)
                    return read_response(sock, bytearray())[0] == 200

            assert wait_until(admitted, 10)
    finally:
        for sock in held:
            sock.close()
        proc.interrupt()
        proc.finish()
        pub.close()
