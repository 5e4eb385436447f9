"""CURVE: `kvindex keys`, instance specs with keys, and `Relay` (vLLM on loopback,
republished over CURVE with ZAP): exact state through it, upstream restarts and relay
restarts passed on correctly, and unauthorised subscribers refused."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth
from clitools import kvindex
from netutil import free_port

from kvindex.index import FleetIndex
from kvindex.relay import Relay
from kvindex.security.curve import (
    KeyFileError,
    generate_keys,
    is_key,
    read_public_key,
    read_secret_key,
)
from kvindex.subscriber import (
    Delivery,
    InstanceSpec,
    Item,
    ReplayPolicy,
    Restarted,
    SourceKey,
    SpecError,
    Subscriber,
)
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

FAST = ReplayPolicy(first_reply_timeout=0.5, idle_timeout=0.3, deadline=5.0, idle_probe=0.5)


def stored(i: int) -> list[BlockStored]:
    return [BlockStored([i], None, [i] * 4, 4)]


# -- keys ----------------------------------------------------------------------------------


def test_keys_command_writes_a_pair_with_a_private_secret(tmp_path: Path) -> None:
    proc = kvindex("keys", "--out", str(tmp_path / "k"), "--name", "server")
    assert proc.finish() == 0, proc.err
    public = proc.out[0]
    assert is_key(public)
    secret_file = tmp_path / "k" / "server.key_secret"
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    assert read_public_key(str(tmp_path / "k" / "server.key")) == public
    assert read_public_key(str(secret_file)) == public  # the public half of a secret file
    assert read_secret_key(secret_file)[0] == public
    again = kvindex("keys", "--out", str(tmp_path / "k"), "--name", "server")
    assert again.finish() == 2 and "exists" in again.err[0] and len(again.err) == 1
    forced = kvindex("keys", "--out", str(tmp_path / "k"), "--name", "server", "--force")
    assert forced.finish() == 0 and forced.out[0] != public


def test_key_files_are_checked(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path, "c")
    with pytest.raises(KeyFileError, match="public key, not a secret"):
        read_secret_key(keys.public)
    (tmp_path / "junk").write_text("not a key\n")
    with pytest.raises(KeyFileError, match="Z85"):
        read_public_key(str(tmp_path / "junk"))
    with pytest.raises(KeyFileError, match="can't read"):
        read_public_key(str(tmp_path / "missing"))
    # pyzmq's own certificate files are read too
    public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "pyzmq")
    public = read_public_key(public_file)
    assert read_secret_key(secret_file)[0] == public


def test_instance_spec_curve_options(tmp_path: Path) -> None:
    server, client = generate_keys(tmp_path, "s"), generate_keys(tmp_path, "c")
    text = f"r=tcp://127.0.0.1:6557,replay=tcp://127.0.0.1:6558,curve={server.public}"
    spec = InstanceSpec.parse(f"{text},client_key={client.secret}")
    assert spec.curve == server.public_key and spec.client_key == str(client.secret)
    (source,) = spec.sources()
    assert source.curve is not None and source.curve.public_key == client.public_key
    assert client.public_key not in repr(source.curve) or "secret" not in repr(source.curve)
    assert InstanceSpec.parse(spec.render()) == spec
    assert str(client.secret) in spec.render() and source.curve.secret_key not in spec.render()
    ephemeral = InstanceSpec.parse(f"r=tcp://h:1,curve={server.public_key}").sources()[0]
    assert ephemeral.curve is not None and is_key(ephemeral.curve.public_key)
    for bad, why in [
        (f"r=tcp://h:1,client_key={client.secret}", "needs curve"),
        ("r=tcp://h:1,curve=short", "curve=short"),
        (f"r=tcp://h:1,curve={server.public_key},client_key={client.public}", "not a secret"),
        (f"r=tcp://h:1,curve={server.public_key},client_key={tmp_path}/none", "can't read"),
        ("r=tcp://h:1,cruve=x", "unknown option"),
    ]:
        with pytest.raises(SpecError, match=why):
            InstanceSpec.parse(bad)


# -- the relay -----------------------------------------------------------------------------


class RelayThread:
    """A Relay stepped on its own thread (its sockets are used by that thread only)."""

    def __init__(self, relay_factory: object) -> None:
        self.factory = relay_factory
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.relay: Relay | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "relay did not bind"

    def _run(self) -> None:
        self.relay = self.factory()  # type: ignore[operator]
        try:
            while not self.stop.is_set():
                self.relay.step(0.02)
                if self.relay.bound:
                    self.ready.set()
        finally:
            self.relay.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.server = generate_keys(tmp, "server")
        self.client = generate_keys(tmp, "client")
        self.intruder = generate_keys(tmp, "intruder")
        self.pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        self.ports = (free_port(), free_port())
        self.relay: RelayThread | None = None

    def start_relay(self) -> RelayThread:
        upstream = InstanceSpec("up", self.pub.endpoint, self.pub.replay_endpoint)
        secret = read_secret_key(self.server.secret)[1]

        def make() -> Relay:
            return Relay(
                upstream,
                f"tcp://127.0.0.1:{self.ports[0]}",
                replay_bind=f"tcp://127.0.0.1:{self.ports[1]}",
                server_secret=secret,
                allow=[self.client.public_key],
                policy=FAST,
            )

        self.relay = RelayThread(make)
        return self.relay

    def spec(self, name: str = "r", client: Path | None = None, curve: bool = True) -> InstanceSpec:
        text = f"{name}=tcp://127.0.0.1:{self.ports[0]},replay=tcp://127.0.0.1:{self.ports[1]}"
        if curve:
            text += f",curve={self.server.public_key}"
            text += f",client_key={client or self.client.secret}"
        return InstanceSpec.parse(text)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    s = Setup(tmp_path)
    try:
        yield s
    finally:
        if s.relay is not None:
            s.relay.close()
        s.pub.close()


def follow(sub: Subscriber, index: FleetIndex, until: object, timeout: float = 10) -> list[Item]:
    items: list[Item] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until(items):  # type: ignore[operator]
        for item in sub.poll(0.05):
            index.handle(item)
            items.append(item)
    return items


def seqs(items: list[Item]) -> list[int]:
    return [i.seq for i in items if isinstance(i, Delivery)]


def test_relay_passes_every_batch_with_its_seq_and_bytes(setup: Setup) -> None:
    for i in range(30):
        setup.pub.publish(stored(i))  # before the relay: it catches up by replay
    setup.start_relay()
    index = FleetIndex()
    with Subscriber(instances=[setup.spec()], policy=FAST, keep_payload=True) as sub:
        items = follow(sub, index, lambda it: len(seqs(it)) >= 30)
        setup.pub.drop = lambda seq: seq % 5 == 0  # dropped upstream: replayed twice over
        for i in range(30, 80):
            setup.pub.publish(stored(i))
            time.sleep(0.002)
        setup.pub.drop = None
        setup.pub.publish(stored(80))
        items += follow(sub, index, lambda it: 80 in seqs(items + it))
        assert seqs(items) == list(range(81))
        sent = dict(setup.pub._buffer)
        assert all(d.payload == sent[d.seq] for d in items if isinstance(d, Delivery))
        assert index.block_hashes("r") == set(range(81))
        stats = sub.stats(SourceKey("r"))
        assert stats.lost_batches == 0 and stats.publisher_restarts == 0 and stats.gaps > 0
    assert setup.relay is not None and setup.relay.relay is not None
    assert setup.relay.relay.stats.forwarded == 81


def test_unauthorised_subscribers_are_refused(setup: Setup) -> None:
    relay = setup.start_relay()
    setup.pub.publish(stored(1))
    intruder = setup.spec("x", client=setup.intruder.secret)
    ephemeral = InstanceSpec.parse(
        f"e=tcp://127.0.0.1:{setup.ports[0]},replay=tcp://127.0.0.1:{setup.ports[1]},"
        f"curve={setup.server.public_key}"
    )
    plain = setup.spec("p", curve=False)
    with Subscriber(instances=[intruder, ephemeral, plain], policy=FAST) as sub:
        deadline = time.monotonic() + 1.5
        items: list[Item] = []
        while time.monotonic() < deadline:
            items += sub.poll(0.05)
            setup.pub.publish(stored(2))
        assert seqs(items) == []
        for name in ("x", "e", "p"):  # the handshake never succeeds: never live
            assert sub.status(SourceKey(name)) in ("connecting", "replaying", "down"), name
        for name in ("x", "e"):  # CURVE links count as up only after a handshake
            assert not sub.stats(SourceKey(name)).connected
        refused = sub.stats(SourceKey("x")).handshake_failures
        assert refused >= 1
    assert relay.relay is not None and relay.relay.stats.refused >= 2


def test_upstream_restart_reaches_downstream_as_a_restart(setup: Setup) -> None:
    setup.start_relay()
    index = FleetIndex()
    with Subscriber(instances=[setup.spec()], policy=FAST) as sub:
        follow(sub, index, lambda it: any(getattr(i, "connected", False) for i in it))
        time.sleep(0.2)
        for i in range(10):
            setup.pub.publish(stored(i))
        follow(sub, index, lambda it: 9 in seqs(it))
        setup.pub.restart()  # a new engine: seq 0 again, empty cache
        for i in range(100, 104):
            setup.pub.publish(stored(i))
        after = follow(sub, index, lambda it: 3 in seqs(it))
        kinds = [type(i) for i in after if isinstance(i, Restarted | Delivery)]
        assert kinds[0] is Restarted
        assert index.block_hashes("r") == {100, 101, 102, 103}
        assert sub.stats(SourceKey("r")).lost_batches == 0


def test_relay_restart_is_invisible_downstream(setup: Setup) -> None:
    relay = setup.start_relay()
    index = FleetIndex()
    with Subscriber(instances=[setup.spec()], policy=FAST) as sub:
        follow(sub, index, lambda it: any(getattr(i, "connected", False) for i in it))
        time.sleep(0.2)
        for i in range(20):
            setup.pub.publish(stored(i))
        follow(sub, index, lambda it: 19 in seqs(it))
        relay.close()  # the relay goes away; the engine goes on
        for i in range(20, 30):
            setup.pub.publish(stored(i))
        setup.start_relay()  # catches up from the engine's buffer, then binds again
        setup.pub.publish(stored(30))
        items = follow(sub, index, lambda it: 30 in seqs(it))
        assert not any(isinstance(i, Restarted) for i in items)
        assert seqs(items) == list(range(20, 31))
        assert index.block_hashes("r") == set(range(31))
        stats = sub.stats(SourceKey("r"))
        assert stats.publisher_restarts == 0 and stats.lost_batches == 0


def test_serve_follows_a_relay_cli_over_curve(setup: Setup, tmp_path: Path) -> None:
    for i in range(5):
        setup.pub.publish(stored(i))
    relay = kvindex(
        "relay", "--from", f"{setup.pub.endpoint},replay={setup.pub.replay_endpoint}",
        "--bind", f"tcp://127.0.0.1:{setup.ports[0]}",
        "--replay-bind", f"tcp://127.0.0.1:{setup.ports[1]}",
        "--server-key", str(setup.server.secret), "--allow", str(setup.client.public),
    )  # fmt: skip
    watch = None
    try:
        relay.wait_for(relay.out, lambda line: "serving" in line)
        watch = kvindex(
            "watch", f"tcp://127.0.0.1:{setup.ports[0]}",
            "--replay", f"tcp://127.0.0.1:{setup.ports[1]}",
            "--curve", str(setup.server.public), "--client-key", str(setup.client.secret),
            "--json", "--max-batches", "6",
        )  # fmt: skip
        watch.wait_for(watch.out, lambda line: '"seq":4' in line)
        setup.pub.publish(stored(5))
        assert watch.finish() == 0
        assert [line.split('"seq":')[1].split(",")[0] for line in watch.out] == [
            str(i) for i in range(6)
        ]
    finally:
        if watch is not None:
            watch.kill()
        relay.interrupt(15)
        assert relay.finish() == 0, relay.err


def test_relay_cli_rejects_bad_keys_in_one_line(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path, "k")
    cases = [
        ["--server-key", str(keys.public), "--allow-any"],
        ["--server-key", str(keys.secret), "--allow", "nope"],
        ["--server-key", str(keys.secret)],
    ]
    for extra in cases:
        proc = kvindex(
            "relay", "--from", "tcp://127.0.0.1:1", "--bind", "tcp://127.0.0.1:2", *extra
        )
        assert proc.finish() == 2, (extra, proc.err)
        assert len(proc.err) == 1 and "Traceback" not in proc.err[0], proc.err
