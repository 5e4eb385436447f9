"""How many publishers one serve can follow, stated and enforced up front (real processes,
a real descriptor limit): hundreds of DP ranks are followed; what does not fit is refused
before anything is opened for it, the instances followed keep ingesting, and adding an
instance is all or nothing."""

from __future__ import annotations

import random
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from clitools import Proc, child_env
from netutil import serve_url, wait_until

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).parent
RANKS = 300


def port_run(count: int) -> int:
    """A base with `count` consecutive free ports below the ephemeral range (where a run
    that long is still to be found on a busy machine)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10_000, 32_000 - count)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {count} free ports")


class Ranks:
    """`tests/rankspub.py`: an engine with many DP ranks, as its own process."""

    def __init__(self, ranks: int) -> None:
        base = port_run(2 * ranks)
        self.pub, self.replay = base, base + ranks
        self.ranks = ranks
        self.proc = Proc(
            [sys.executable, str(HERE / "rankspub.py"), *map(str, (self.pub, self.replay, ranks))]
        )
        self.proc.wait_for(self.proc.out, lambda line: line == "ready", 60)

    def spec(self, name: str, dp: int | None = None) -> str:
        dp = self.ranks if dp is None else dp
        return f"{name}=tcp://127.0.0.1:{self.pub},replay=tcp://127.0.0.1:{self.replay},dp={dp}"

    def close(self) -> None:
        self.proc.kill()


@pytest.fixture
def ranks() -> Iterator[Ranks]:
    r = Ranks(RANKS)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def small() -> Iterator[Ranks]:
    r = Ranks(1)
    try:
        yield r
    finally:
        r.close()


def fd_limit(n: int) -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return limit


def serve(*args: str, nofile: int | None = None) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--store", "memory"]
    proc = subprocess.Popen(
        [*cmd, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        preexec_fn=fd_limit(nofile) if nofile else None,
    )
    return proc, serve_url(proc, proc.communicate)


def stop(proc: subprocess.Popen[str]) -> str:
    """Stop serve; what it wrote on stderr."""
    proc.terminate()
    try:
        return proc.communicate(timeout=15)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[1]


def instance(client: httpx.Client, name: str) -> dict:  # type: ignore[type-arg]
    r = client.get("/v1/instances")
    assert r.status_code == 200
    return next((i for i in r.json()["instances"] if i["name"] == name), {})


def advancing(client: httpx.Client, name: str) -> bool:
    """Whether the instance's last seq moves on (its ingest runs)."""
    before = instance(client, name)["last_seq"] or 0
    return wait_until(lambda: (instance(client, name)["last_seq"] or 0) > before + 3, 10)


def test_300_dp_ranks_with_replay_are_followed(ranks: Ranks, small: Ranks) -> None:
    # 300 ranks hold 1,200 ZMQ sockets with their replays: past libzmq's default context
    # limit (1,023), which used to leave the instance half added and ingest dead.
    proc, url = serve("--instance", small.spec("a"))
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            r = client.post("/v1/instances", json={"spec": ranks.spec("big")})
            assert r.status_code == 201, r.text
            want = {str(1000 + rank) for rank in range(RANKS)}

            def all_ranks_held() -> bool:
                got = client.get("/v1/instances/big/blocks").json()["block_hashes"]
                return want <= set(got)

            assert wait_until(all_ranks_held, 60)
            big = instance(client, "big")
            assert len(big["ranks"]) == RANKS and big["status"] == "live"
            assert advancing(client, "a") and advancing(client, "big")
            assert client.get("/healthz").json() == {"status": "ok"}
            assert client.delete("/v1/instances/big").status_code == 204
            assert client.post("/v1/instances", json={"spec": ranks.spec("big")}).status_code == 201
            assert wait_until(all_ranks_held, 60)
    finally:
        stop(proc)


def test_an_instance_over_the_descriptor_limit_is_refused_whole(small: Ranks) -> None:
    # 400 descriptors: room for a few dozen ranks, not 300.
    proc, url = serve("--instance", small.spec("a"), nofile=400)
    far = "big=tcp://127.0.0.1:1,replay=tcp://127.0.0.1:2,dp=300"
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            assert advancing(client, "a")
            for _ in range(2):  # refused the same way again: nothing was left behind
                r = client.post("/v1/instances", json={"spec": far})
                assert r.status_code == 409, r.text
                error = r.json()["error"]
                assert "can't follow instance 'big'" in error and "ulimit -n" in error
                assert "1800 file descriptors" in error and "limit is 400" in error
                assert [i["name"] for i in client.get("/v1/instances").json()["instances"]] == ["a"]
                assert client.delete("/v1/instances/big").status_code == 404
                assert client.get("/healthz").json() == {"status": "ok"}
                assert advancing(client, "a")  # ingest for the others never stopped
            fits = "few=tcp://127.0.0.1:1,replay=tcp://127.0.0.1:2,dp=10"
            assert client.post("/v1/instances", json={"spec": fits}).status_code == 201
            assert len(instance(client, "few")["ranks"]) == 10 and advancing(client, "a")
    finally:
        log = stop(proc)
    refusals = [line for line in log.splitlines() if "refused" in line]
    assert len(refusals) == 2 and refusals[0].startswith(
        "kvindex serve: WARNING POST /v1/instances refused: can't follow instance 'big': "
    )


def test_serve_refuses_a_fleet_over_the_limit_at_start_in_one_line(tmp_path: Path) -> None:
    flags = [
        f"--instance=e{i}=tcp://127.0.0.1:{20_000 + i},replay=tcp://127.0.0.1:{30_000 + i}"
        for i in range(252)
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvindex",
            "serve",
            "--store",
            "memory",
            "--http",
            "127.0.0.1:0",
            *flags,
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        preexec_fn=fd_limit(400),
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("kvindex serve: error: can't follow 252 instances: ")
    assert "1512 file descriptors" in proc.stderr and "ulimit -n" in proc.stderr


def test_serve_follows_252_instances_given_at_start() -> None:
    # 252 instances with replay: 1,008 ZMQ sockets once each asks its replay at start, past
    # libzmq's default limit, which used to end ingest for all of them.
    flags = [
        f"--instance=e{i}=tcp://127.0.0.1:{20_000 + i},replay=tcp://127.0.0.1:{30_000 + i}"
        for i in range(252)
    ]
    proc, url = serve(*flags)
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            time.sleep(3)  # every join's replay is asked (and times out: nobody listens)
            assert client.get("/healthz").json() == {"status": "ok"}
            assert len(client.get("/v1/instances").json()["instances"]) == 252
    finally:
        stop(proc)


ROLLBACK = """
import resource, sys, time, zmq
from kvindex.subscriber import InstanceSpec, Subscriber
from kvindex.subscriber.capacity import budget_of
resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))
ctx = zmq.Context()
ctx.set(zmq.MAX_SOCKETS, 10_000)
budget_of(ctx).max_fds = 1_000_000  # a budget that lets it try: the kernel says no
sub = Subscriber(context=ctx)
try:
    sub.add_instance(InstanceSpec("big", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", dp=100))
except zmq.ZMQError as exc:
    print("refused:", exc)
print("left:", sub.instances, len(sub.sockets()), sub.budget.used.sources)
# libzmq closes a socket's descriptors on its reaper thread, a moment after close(): a
# loaded machine may still be short of them right after the rollback
deadline = time.monotonic() + 10
while True:
    try:
        sub.add_instance(InstanceSpec("small", "tcp://127.0.0.1:1", dp=2))
        break
    except zmq.ZMQError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
print("small:", sorted(sub.instances), len(sub.sockets()))
sub.close()
"""


def test_an_instance_that_runs_out_of_descriptors_midway_leaves_nothing_behind() -> None:
    # The budget is made to let it try; the kernel refuses a descriptor at some rank: the
    # ranks opened before it are closed again, and the name is free.
    out = subprocess.run(
        [sys.executable, "-c", ROLLBACK], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "refused: Too many open files"
    assert lines[1] == "left: {} 0 0"
    assert lines[2] == "small: ['small'] 4"


LOAD_BUDGET = """
from kvindex.runtime import Fleet
from kvindex.subscriber import CapacityError, InstanceSpec
from kvindex.subscriber.capacity import budget_of, subscriber_context
budget = budget_of(subscriber_context())
budget.max_fds = 100  # room for 16 ranks with replay (6 descriptors each), 12 with load too

def spec(name, dp, load=True):
    text = f"{name}=tcp://127.0.0.1:1,replay=tcp://127.0.0.1:2000,dp={dp}"
    return InstanceSpec.parse(text + (",load=tcp://127.0.0.1:3000" if load else ""))

try:
    Fleet([spec("big", 14)])
except CapacityError as exc:
    print("start:", exc)
fleet = Fleet()
for attempt in range(2):
    try:
        fleet.add_instance(spec("big", 14))
    except CapacityError as exc:
        print("add:", exc)
    print("left:", sorted(fleet.specs), budget.used, fleet.load.state(("big", 0)))
fleet.add_instance(spec("big", 14, load=False))
print("without load:", sorted(fleet.specs), budget.used)
fleet.remove_instance("big")
fleet.add_instance(spec("a", 10))
try:
    fleet.add_instance(spec("b", 3))
except CapacityError as exc:
    print("b:", exc)
fleet.add_instance(spec("b", 3, load=False))
print("end:", sorted(fleet.specs), budget.used)
fleet.close()
"""


def test_load_stream_sockets_count_in_the_budget() -> None:
    # SGLang's load stream holds one SUB per rank (2 descriptors): an instance whose KV
    # sockets fit but whose load sockets don't is refused whole, before anything opens.
    out = subprocess.run(
        [sys.executable, "-c", LOAD_BUDGET], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("start: can't follow instance 'big': its 14 publishers need ")
    assert "112 file descriptors" in lines[0]
    assert lines[1] == "add: " + lines[0].removeprefix("start: ")
    empty = "left: [] Need(sockets=0, fds=0, sources=0) None"
    assert lines[2] == lines[4] == empty and lines[3] == lines[1]
    assert lines[5] == "without load: ['big'] Need(sockets=56, fds=84, sources=14)"
    assert lines[6].startswith("b: can't follow instance 'b': its 3 publishers need 24 ")
    assert lines[7] == "end: ['a', 'b'] Need(sockets=62, fds=98, sources=13)"
