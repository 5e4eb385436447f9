"""`kvindex analyze` on synthetic streams whose parameters and ground truth are known.

The generator below plays a small fleet: each instance is an LRU pool of `pool` blocks that
behaves like vLLM's (hits refresh a block's recency and send nothing, misses store blocks
and evict the least recently used ones, one BlockRemoved per evicted block), requests go to
a random instance, and a known share of them starts with one of a few popular prefixes.
It counts the truth as it goes (re-stores, and which of them another instance held), so
the analysis must recover it exactly; the shared-prefix share must match what was drawn.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from browserutil import CHROMIUM_ARGS
from clitools import kvindex

from kvindex.analysis import analyze, curve, stack_distances
from kvindex.recording import Writer
from kvindex.subscriber import Restarted, SourceKey
from kvindex.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvindex.wire.publisher import encode_batch

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16
T0 = 1_750_000_000.0


@dataclass
class Truth:
    requests: int = 0
    shared_sequences: int = 0
    sequences: int = 0
    stored: int = 0
    removed: int = 0
    restores: dict[str, int] = field(default_factory=dict)
    routable: dict[str, int] = field(default_factory=dict)
    working_set: dict[str, int] = field(default_factory=dict)


@dataclass
class Fleet:
    """The generator's state: one LRU pool per instance."""

    names: list[str]
    pool: int
    pools: dict[str, OrderedDict[int, None]] = field(default_factory=dict)
    ever: dict[str, set[int]] = field(default_factory=dict)
    seqs: dict[str, int] = field(default_factory=dict)
    truth: Truth = field(default_factory=Truth)

    def __post_init__(self) -> None:
        for name in self.names:
            self.pools[name], self.ever[name], self.seqs[name] = OrderedDict(), set(), 0
            self.truth.restores[name] = self.truth.routable[name] = 0

    def serve(self, name: str, blocks: list[tuple[int, list[int]]]) -> list[Event]:
        """A request's blocks (hash, tokens) on one instance: the events vLLM would send."""
        pool, events = self.pools[name], []
        hit = 0
        while hit < len(blocks) and blocks[hit][0] in pool:
            pool.move_to_end(blocks[hit][0])
            hit += 1
        new = blocks[hit:]
        for h, _ in new:
            if len(pool) >= self.pool:
                victim, _ = pool.popitem(last=False)
                events.append(BlockRemoved([victim]))
                self.truth.removed += 1
            self._count(name, h)
            pool[h] = None
        if new:
            parent = blocks[hit - 1][0] if hit else None
            tokens = [t for _, block in new for t in block]
            events.append(BlockStored([h for h, _ in new], parent, tokens, BLOCK))
            self.truth.stored += len(new)
        return events

    def _count(self, name: str, h: int) -> None:
        if h in self.ever[name]:
            self.truth.restores[name] += 1
            if any(h in self.pools[other] for other in self.names if other != name):
                self.truth.routable[name] += 1
        self.ever[name].add(h)

    def restart(self, name: str) -> None:
        self.pools[name].clear()
        self.seqs[name] = 0


def chain(token_blocks: list[list[int]]) -> list[tuple[int, list[int]]]:
    out, parent = [], 0
    for block in token_blocks:
        parent = hash((parent, tuple(block))) & (2**63 - 1)
        out.append((parent, block))
    return out


def synthesize(
    path: Path,
    *,
    instances: int = 3,
    pool: int = 48,
    requests: int = 600,
    shared_share: float = 0.4,
    prefixes: int = 4,
    prefix_blocks: int = 4,
    repeat_share: float = 0.1,
    restart_at: int | None = None,
    seed: int = 7,
) -> Truth:
    """Write a recording of a synthetic fleet to `path`; returns the ground truth."""
    rng = random.Random(seed)
    fleet = Fleet([f"vllm-{i}" for i in range(instances)], pool)
    popular = [[rand_block(rng) for _ in range(prefix_blocks)] for _ in range(prefixes)]
    uniques: list[list[list[int]]] = []
    with Writer(path) as w:
        w.session([])
        for i in range(requests):
            name = rng.choice(fleet.names)
            if restart_at == i:
                fleet.restart(name)
                w.notice(Restarted(SourceKey(name), 5, 0, "test"), received=T0 + i)
            blocks = draw(rng, fleet.truth, popular, uniques, shared_share, repeat_share)
            events = fleet.serve(name, chain(blocks))
            ts = T0 + i * 0.05
            seq = fleet.seqs[name]
            fleet.seqs[name] += 1
            w.batch(SourceKey(name), seq, encode_batch(events, ts), received=ts + 0.001)
    for name in fleet.names:
        fleet.truth.working_set[name] = len(fleet.ever[name])
    return fleet.truth


def rand_block(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(BLOCK)]


def draw(
    rng: random.Random,
    truth: Truth,
    popular: list[list[list[int]]],
    uniques: list[list[list[int]]],
    shared_share: float,
    repeat_share: float,
) -> list[list[int]]:
    """A request's token blocks: a repeat of an earlier unique prompt, a popular prefix and
    a fresh suffix, or a fresh prompt."""
    truth.requests += 1
    if uniques and rng.random() < repeat_share:
        return rng.choice(uniques)  # the same sequence again: not a new one
    truth.sequences += 1
    suffix = [rand_block(rng) for _ in range(rng.randint(1, 3))]
    if rng.random() < shared_share:
        truth.shared_sequences += 1
        return rng.choice(popular) + suffix
    prompt = [rand_block(rng) for _ in range(2)] + suffix
    uniques.append(prompt)
    return prompt


# -- the what-if model on its own -------------------------------------------------------


def test_stack_distances_match_a_naive_lru() -> None:
    rng = random.Random(1)
    accesses = [rng.randrange(30) for _ in range(2000)]
    got = stack_distances(accesses).tolist()
    for size in (1, 3, 10, 29, 30):
        lru: OrderedDict[int, None] = OrderedDict()
        misses = 0
        for i, block in enumerate(accesses):
            if block in lru:
                lru.move_to_end(block)
                assert got[i] < size
            else:
                misses += got[i] != -1  # a re-access that missed
                assert got[i] == -1 or got[i] >= size
                lru[block] = None
                if len(lru) > size:
                    lru.popitem(last=False)
        c = curve(accesses, bytes(len(accesses)), marks=[size])
        assert c.restores[c.sizes.index(size)] == misses


# -- the analysis recovers what was generated -----------------------------------------


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Truth]:
    path = tmp_path_factory.mktemp("analyze") / "fleet.kvr"
    truth = synthesize(path, restart_at=400)
    return path, truth


def test_totals_capacity_and_restores_are_recovered(stream: tuple[Path, Truth]) -> None:
    path, truth = stream
    report = analyze(path)
    rows = {row.name: row for row in report.sources}
    assert sorted(rows) == ["vllm-0", "vllm-1", "vllm-2"]
    assert report.stored_blocks == truth.stored
    assert report.removed_blocks == truth.removed
    assert sum(r.restarts for r in rows.values()) == 1
    for name, row in rows.items():
        assert row.peak_gpu_blocks == 48  # the pool size: eviction pressure recovered
        assert row.restored_blocks == truth.restores[name] > 0
        assert row.routable_blocks == truth.routable[name]
        assert row.restored_tokens == truth.restores[name] * BLOCK
        assert row.working_set == truth.working_set[name]
    assert 0 < report.routable_blocks < report.restored_blocks


def test_what_if_curve_reaches_zero_at_the_working_set(stream: tuple[Path, Truth]) -> None:
    path, truth = stream
    report = analyze(path)
    for name, c in report.whatif.items():
        assert c.restores == sorted(c.restores, reverse=True)  # bigger never worse
        assert c.restores[0] > 0
        at = {size: n for size, n in zip(c.sizes, c.restores, strict=True)}
        assert at[max(c.sizes)] == 0
        assert max(c.sizes) <= truth.working_set[name]
        assert all(n == 0 for size, n in at.items() if size >= truth.working_set[name])
        # A cache as large as the working set avoids every re-store that happened.
        assert c.avoided[-1] == c.observed_restores == truth.restores[name]
        row = next(r for r in report.sources if r.name == name)
        assert row.size_for_none is not None and row.size_for_none <= truth.working_set[name]


@pytest.mark.parametrize("share", [0.2, 0.6])
def test_shared_prefix_share_is_recovered(tmp_path: Path, share: float) -> None:
    path = tmp_path / "s.kvr"
    truth = synthesize(path, shared_share=share, requests=500, seed=3)
    prefixes = analyze(path).prefixes
    assert prefixes.sequences == truth.sequences
    assert prefixes.shared_sequences == truth.shared_sequences
    assert abs(prefixes.shared_share - share) < 0.08
    top = prefixes.top[0]  # a popular prefix: 4 blocks of 16 tokens, on every instance
    assert (top.tokens, top.blocks) == (64, 4)
    assert top.instances == ["vllm-0", "vllm-1", "vllm-2"]
    assert len({row.block_hash for row in prefixes.top[:4]}) == 4


def test_a_single_instance_fleet_has_nothing_to_route(tmp_path: Path) -> None:
    path = tmp_path / "one.kvr"
    truth = synthesize(path, instances=1, requests=300)
    report = analyze(path)
    assert report.sources[0].restored_blocks == truth.restores["vllm-0"] > 0
    assert report.routable_blocks == 0
    assert report.prefixes.cross_instance_blocks == 0


# -- the command and its report ---------------------------------------------------------


def test_analyze_command_writes_html_and_json(stream: tuple[Path, Truth], tmp_path: Path) -> None:
    path, truth = stream
    html, out = tmp_path / "report.html", tmp_path / "report.json"
    cli = kvindex("analyze", str(path), "--html", str(html), "--json", str(out))
    assert cli.finish(60) == 0, cli.err
    text = "\n".join(cli.out)
    assert "vllm-0" in text and "re-stored" in text
    data = json.loads(out.read_bytes())
    assert data["stored_blocks"] == truth.stored
    assert sum(data["rates"]["stored"]["vllm-1"]) == sum(
        r["stored_blocks"] for r in data["sources"] if r["name"] == "vllm-1"
    )
    page = html.read_text()
    assert page.count('src="data:image/png;base64,') >= 6
    assert "<script" not in page


def test_analyze_usage_errors(tmp_path: Path) -> None:
    missing = kvindex("analyze", str(tmp_path / "nope.kvr"))
    assert missing.finish(30) == 2
    assert len(missing.err) == 1 and "can't read" in missing.err[0]


def test_report_renders_in_headless_chromium(stream: tuple[Path, Truth], tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    path, _ = stream
    html = tmp_path / "report.html"
    assert kvindex("analyze", str(path), "--html", str(html)).finish(60) == 0
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(html.as_uri())
            page.wait_for_load_state("load")
            images = page.eval_on_selector_all("img", "els => els.map(e => e.naturalWidth)")
            shot = tmp_path / "analysis.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert len(images) >= 6 and all(w > 0 for w in images)  # every plot decoded
    assert shot.stat().st_size > 10_000
    if UPDATE_DOCS:
        from PIL import Image  # matplotlib's own dependency

        with Image.open(shot) as image:  # 256 colours: a third of the bytes, same look
            image.convert("RGB").quantize(256).save(ROOT / "docs" / "analysis.png", optimize=True)


# KVINDEX_UPDATE_DOCS=1: also refresh the README's screenshot, docs/analysis.png.
UPDATE_DOCS = os.environ.get("KVINDEX_UPDATE_DOCS") == "1"


# -- the fixes of issue 14: each test fails without its fix ----------------------------------


def offload_stream(path: Path, seed: int = 7) -> dict[str, set[int]]:
    """Three instances that store GPU blocks (unique tokens), offload some to CPU by hash
    only (as vLLM's offload connector reports them), evict, clear and restart; returns the
    GPU blocks each holds at the end."""
    rng = random.Random(seed)
    names = ["vllm-0", "vllm-1", "vllm-2"]
    gpu: dict[str, set[int]] = {n: set() for n in names}
    seqs = dict.fromkeys(names, 0)
    next_hash = 1
    with Writer(path) as w:
        for step in range(3000):
            name = rng.choice(names)
            ts = T0 + step * 0.01
            roll = rng.random()
            events: list[Event] = []
            if roll < 0.5 or not gpu[name]:
                hashes = list(range(next_hash, next_hash + 4))
                next_hash += 4
                tokens = [t for h in hashes for t in [h] * BLOCK]  # content unique to it
                events.append(BlockStored(hashes, None, tokens, BLOCK))
                gpu[name].update(hashes)
            elif roll < 0.7:
                h = rng.choice(sorted(gpu[name]))
                events.append(BlockStored([h], None, [], BLOCK, medium="CPU"))
            elif roll < 0.95:
                h = rng.choice(sorted(gpu[name]))
                events.append(BlockRemoved([h]))
                gpu[name].discard(h)
            elif roll < 0.98:
                events.append(AllBlocksCleared())
                gpu[name].clear()
            else:
                w.notice(Restarted(SourceKey(name), seqs[name] - 1, 0, "test"), received=ts)
                seqs[name] = 0
                gpu[name].clear()
                continue
            w.batch(SourceKey(name), seqs[name], encode_batch(events, ts), received=ts)
            seqs[name] += 1
    return gpu


def test_duplication_chart_ends_at_what_the_pools_hold(tmp_path: Path) -> None:
    """The chart used to count a block offloaded by hash as released never: it grew at
    every clear or restart (40,154 distinct blocks against pools of about 2,000 each)."""
    path = tmp_path / "offload.kvr"
    final = offload_stream(path)
    report = analyze(path)
    held = report.duplication["held"]
    assert held.n[-1] == sum(len(blocks) for blocks in final.values())
    assert held.n[-1] == sum(row.final_blocks.get("GPU", 0) for row in report.sources)
    assert report.duplication["shared"].n[-1] == 0  # no content in common


def test_a_clear_shows_on_the_duplication_chart_at_once(tmp_path: Path) -> None:
    path = tmp_path / "clear.kvr"
    tokens = list(range(2 * BLOCK))
    with Writer(path) as w:
        for i, name in enumerate(["a", "b"]):
            ts = T0 + i
            w.batch(
                SourceKey(name),
                0,
                encode_batch([BlockStored([1, 2], None, tokens, BLOCK)], ts),
                received=ts,
            )
        w.batch(SourceKey("a"), 1, encode_batch([AllBlocksCleared()], T0 + 5), received=T0 + 5)
    report = analyze(path)
    assert report.duplication["held"].n == [2, 2, 2]
    assert report.duplication["shared"].n == [0, 2, 0]  # the clear ends the sharing


def test_prefixes_of_offloaded_blocks_are_the_blocks_not_zero_token_nodes(tmp_path: Path) -> None:
    """A prefix offloaded by hash only read '0 tok': it is the GPU block with its tokens."""
    path = tmp_path / "p.kvr"
    root = list(range(BLOCK))
    with Writer(path) as w:
        events: list[Event] = [BlockStored([10], None, root, BLOCK)]
        for i in range(3):  # three sequences branch off the root block
            events.append(BlockStored([20 + i], 10, [100 + i] * BLOCK, BLOCK))
        events.append(BlockStored([10, 20], None, [], BLOCK, medium="CPU"))  # offloaded
        events += [BlockStored([30 + i], 20, [], BLOCK, medium="CPU") for i in range(2)]
        w.batch(SourceKey("a"), 0, encode_batch(events, T0), received=T0)
    report = analyze(path)
    rows = report.prefixes.top
    assert rows and all(row.tokens != 0 for row in rows)
    first = rows[0]
    assert (first.tokens, first.first_tokens[:3]) == (BLOCK, [0, 1, 2])
    assert first.continuations == 4  # 21, 22, and 20's two hash-only children
    assert [row.tokens for row in rows] == [BLOCK, 2 * BLOCK]


def test_sglang_namespaces_and_sessions(tmp_path: Path) -> None:
    """SGLang's `cache_salt`, `lora_name` and `session_id` reach the report: equal tokens
    under another salt are another block (no false sharing), each namespace's stores and
    sessions are counted, and the salt is only ever shown as its digest."""
    path = tmp_path / "sgl.kvr"
    tokens = list(range(2 * BLOCK))
    salt = "tenant-secret-salt"
    with Writer(path) as w:
        for i, (name, ns) in enumerate([("a", {}), ("b", {"cache_salt": salt})]):
            events: list[Event] = [
                BlockStored([10 + i], None, tokens[:BLOCK], BLOCK, session_id="s1", **ns),
                BlockStored([20 + i], 10 + i, tokens[BLOCK:], BLOCK, session_id="s2", **ns),
                BlockStored([30 + i], 10 + i, [7] * BLOCK, BLOCK, lora_name="ad", **ns),
            ]
            w.batch(SourceKey(name), 0, encode_batch(events, T0 + i), received=T0 + i)
    report = analyze(path)
    digest = "salt:" + hashlib.sha256(salt.encode()).hexdigest()[:12]
    rows = {(n.lora_name, n.cache_salt): (n.stored_blocks, n.sessions) for n in report.namespaces}
    assert rows == {(None, None): (2, 2), ("ad", None): (1, 0), (None, digest): (2, 2),
                    ("ad", digest): (1, 0)}  # fmt: skip
    assert report.prefixes.cross_instance_blocks == 0  # the salted chain is another one
    assert {(p.cache_salt, p.instances[0]) for p in report.prefixes.top} == {
        (None, "a"), (digest, "b")
    }  # fmt: skip
    out = tmp_path / "r.html"
    cli = kvindex("analyze", str(path), "--html", str(out), "--json", str(tmp_path / "r.json"))
    assert cli.finish(60) == 0, cli.err
    for text in (out.read_text(), (tmp_path / "r.json").read_text(), "\n".join(cli.out)):
        assert digest in text and salt not in text


def test_an_empty_recording_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "empty.kvr"
    with Writer(path) as w:
        w.session(["a=tcp://10.0.0.5:5557"])
        w.notice(Restarted(SourceKey("a"), None, 0, "test"), received=T0)
    html = tmp_path / "r.html"
    cli = kvindex("analyze", str(path), "--html", str(html))
    assert cli.finish(60) == 2
    assert cli.err == [
        f"kvindex analyze: error: {path} holds no batches to analyse (notices: 1 Restarted)"
    ]
    assert not html.exists()
