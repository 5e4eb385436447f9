#!/usr/bin/env python3
"""Record SGLang 0.5.23's own KV-event stream live and rewrite tests/data/sglang/.

    make sglang-record            # or: .venv/bin/python scripts/sglang_record.py [--out-dir D]

Builds (once) the SGLang venv (scripts/sglang-venv.sh), starts one driver per engine
(tests/interop/sglang_driver.py: SGLang's RadixCache, recorder and ZmqEventPublisher, two
DP ranks each), and records every rank with kvindex's own recorder (the library behind
`kvindex record`): the recorder starts while each engine's last rank has already
published its first batches (a late join, filled from the replay ROUTER), and stops once
every rank's last batch is in. Then it writes, per engine, SGLang's reference answers
(`NAME.json`: held pages per rank and medium, match_prefix of the probes), one recording
of the whole fleet (`fleet.kvr`) and `examples.json` (representative events and the
`/server_info` descriptors, pretty-printed for people).

Everything but ports, timestamps and the recording's byte layout is the same on every run
(seeded workloads, SGLang's SHA-256 page hashes).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvindex.recording import Writer
from kvindex.recording.recorder import record
from kvindex.subscriber import DecodeFailed, Delivery, InstanceSpec, Item, Replayed, SourceKey

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "interop" / "sglang_driver.py"
OUT_DIR = ROOT / "tests" / "data" / "sglang"

# name -> (topic, driver arguments). Each engine has two DP ranks; rank 1 joins late.
ENGINES: dict[str, tuple[str, list[str]]] = {
    "sgl-p1": (
        "",
        shlex.split(
            "--page-size 1 --lora --tiers --steps 70 --reset-at 35 --solo-steps 8 "
            "--capacity 768 --seed 1"
        ),
    ),
    "sgl-p16": (
        "sglang-kv",
        shlex.split(
            "--page-size 16 --lora --tiers --steps 120 --reset-at 60 --solo-steps 10 "
            "--capacity 1536 --seed 2"
        ),
    ),
    "sgl-bigram": (
        "",
        shlex.split(
            "--page-size 1 --bigram --tiers --steps 50 --solo-steps 6 --capacity 768 --seed 3"
        ),
    ),
    # A caller extra_key (not LoRA) namespaces SGLang's tree but, in the default event
    # format, not its events: kept apart so it does not blur the other engines' answers.
    "sgl-extra-key": (
        "",
        shlex.split(
            "--page-size 16 --extra-key --steps 60 --solo-steps 5 --capacity 1024 --seed 4"
        ),
    ),
}
MAX_RECORDING_BYTES = 2_000_000


def log(text: str) -> None:
    print(f"sglang-record: {text}", file=sys.stderr, flush=True)


def sglang_python() -> str:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "sglang-venv.sh")],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return proc.stdout.strip().splitlines()[-1]


@dataclass
class Engine:
    name: str
    topic: str
    proc: subprocess.Popen[str]
    out: Path
    ready: dict[str, Any] = field(default_factory=dict)
    done: dict[str, Any] = field(default_factory=dict)

    def wait_for(self, event: str, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("event") == event:
                return msg
        raise RuntimeError(
            f"{self.name}: the driver never said {event!r} (exit {self.proc.poll()})"
        )

    def spec(self) -> InstanceSpec:
        ranks = self.ready["ranks"]
        return InstanceSpec(self.name, ranks[0]["pub"], ranks[0]["replay"], self.topic, len(ranks))

    def say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.say("quit")
            except (BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start(python: str, name: str, topic: str, args: list[str], workdir: Path) -> Engine:
    out = workdir / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    cmd = [python, "-W", "ignore", str(DRIVER), "--topic", topic, "--out", str(out), *args]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, env=env
    )
    return Engine(name, topic, proc, out)


class Progress:
    """What the recorder has seen: seqs per source, and replays."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seqs: dict[SourceKey, set[int]] = {}
        self.replayed: dict[SourceKey, int] = {}

    def __call__(self, item: Item) -> None:
        with self.lock:
            if isinstance(item, Delivery | DecodeFailed):  # a seq done with either way
                self.seqs.setdefault(item.source, set()).add(item.seq)
            elif isinstance(item, Replayed):
                self.replayed[item.source] = self.replayed.get(item.source, 0) + item.count

    def complete(self, expected: dict[SourceKey, int]) -> bool:
        with self.lock:
            return all(self.seqs.get(src, set()) >= set(range(n)) for src, n in expected.items())


def run(out_dir: Path) -> None:
    python = sglang_python()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sglang-record-") as tmp:
        workdir = Path(tmp)
        engines = [start(python, n, t, a, workdir) for n, (t, a) in ENGINES.items()]
        try:
            recording = _record(engines, workdir)
            _write(engines, recording, out_dir)
        finally:
            for engine in engines:
                engine.stop()


def _record(engines: list[Engine], workdir: Path) -> Path:
    for engine in engines:
        engine.ready = engine.wait_for("ready", 180)
    for engine in engines:
        engine.wait_for("paused", 180)
    log("every engine's late rank has published its first batches; recording starts")
    path = workdir / "fleet.kvr"
    progress = Progress()
    stop = threading.Event()
    writer = Writer(path, append=False)
    specs = [engine.spec() for engine in engines]
    failure: list[BaseException] = []

    def follow() -> None:
        try:
            record(specs, writer, stop=stop.is_set, on_item=progress)
        except BaseException as exc:  # reported by the main thread
            failure.append(exc)

    thread = threading.Thread(target=follow, name="recorder")
    thread.start()
    try:
        time.sleep(2.0)  # the SUB sockets connect before the first live batch
        for engine in engines:
            engine.say("go")
        expected: dict[SourceKey, int] = {}
        for engine in engines:
            engine.done = engine.wait_for("done", 300)
            for rank, count in engine.done["published"].items():
                expected[SourceKey(engine.name, int(rank))] = count
        deadline = time.monotonic() + 120
        while not progress.complete(expected):
            if failure or time.monotonic() > deadline:
                raise RuntimeError(f"the recorder did not get every batch: {failure}")
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join(30)
        writer.close()
    if failure:
        raise RuntimeError(f"the recorder failed: {failure[0]!r}")
    late = {src: n for src, n in progress.replayed.items() if n}
    log(f"recorded {sum(expected.values())} batches; replayed on late join: {late}")
    for engine in engines:
        src = SourceKey(engine.name, len(engine.ready["ranks"]) - 1)
        if not progress.replayed.get(src):
            raise RuntimeError(f"{src!r} joined late but nothing was replayed")
    return path


def _write(engines: list[Engine], recording: Path, out_dir: Path) -> None:
    size = recording.stat().st_size
    if size > MAX_RECORDING_BYTES:
        raise RuntimeError(f"the recording is {size} bytes (over {MAX_RECORDING_BYTES})")
    examples: dict[str, Any] = {}
    for engine in engines:
        ref = json.loads(engine.out.read_text())
        bad = {r: x["events_self_check"] for r, x in ref["ranks"].items()}
        if not all(check["ok"] for check in bad.values()):
            raise RuntimeError(f"{engine.name}: SGLang's events don't add up to its cache: {bad}")
        examples[engine.name] = {
            "engine": ref["engine"],
            "kv_events_config": ref["kv_events_config"],
            "server_info_kv_events": ref["server_info_kv_events"],
            "events": {kind: _shorten(ev) for kind, ev in ref["examples"].items()},
        }
        (out_dir / f"{engine.name}.json").write_text(json.dumps(ref, separators=(",", ":")))
    (out_dir / "examples.json").write_text(json.dumps(examples, indent=1) + "\n")
    shutil.copyfile(recording, out_dir / "fleet.kvr")
    log(
        f"wrote {out_dir}: fleet.kvr ({size} bytes), "
        + ", ".join(f"{e.name}.json" for e in engines)
    )


def _shorten(event: dict[str, Any], keep: int = 4) -> dict[str, Any]:
    """An example event with long lists cut to their first items (for reading only);
    `_cut` gives the full lengths."""
    out: dict[str, Any] = {}
    cut: dict[str, int] = {}
    for key, value in event.items():
        if isinstance(value, list) and len(value) > keep:
            out[key], cut[key] = value[:keep], len(value)
        else:
            out[key] = value
    if cut:
        out["_cut"] = cut
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = p.parse_args()
    run(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
