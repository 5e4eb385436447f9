"""What is mis-wired between kvindex and its engines (issue 25): `GET /v1/doctor`,
`kvindex doctor`.

A router fed by kvindex answers zero or wrong scores for reasons no error names: events
never enabled, no replay endpoint, a block size or hash seed that differs between engine
and index, chats tokenized without the engine's chat template, an engine's `/metrics` out
of reach, clocks apart. Each check reads what serve already knows (the instances' links
and counters, the engines' `/metrics` as scraped for load, the lookups answered, the
tokenizers) and gives one `Finding` per engine and check: `ok`, a `problem` (with its
fix) or a `note` (nothing to judge by yet).

A problem, by check:

- `events`: the link is not live; or the engine's `/metrics` counts prefix-cache queries
  while no event batch ever came (events disabled, or published elsewhere); or batches
  were lost or undecodable.
- `replay`: the spec has no replay endpoint (a gap can't be filled), or replays failed.
  (An engine without events by its spec, `events=none`, gets a note for both instead.)
- `block_size`: the engine's `/metrics` (`cache_config_info`) and kvindex (what its
  routing answers showed: `/v1/route` and scored lookups, or the spec's `block_size=`)
  disagree.
- `metrics`: the engine's `/metrics` can't be read (the score's load parts are left out).
- `clock`: batches are applied more than `max_lag` seconds after the engine stamped them
  while nothing is queued (the engine's clock is behind).
- `lookups`: of at least `min_lookups` lookups, `no_match_share` or more matched nothing
  while the engines hold blocks and reuse their own caches (block size, hash seed, salt
  or tokenization differ between router and engine).
- `chat_template`: a model's chats are tokenized (locally) otherwise than its engine's
  `POST /tokenize` tokenizes the same messages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from kvindex.subscriber import Status

if TYPE_CHECKING:
    from kvindex.runtime.engine_metrics import EngineFigures, MetricsScraper
    from kvindex.runtime.fleet import Fleet
    from kvindex.runtime.routing import Router
    from kvindex.runtime.tokenize import Tokenizers
    from kvindex.runtime.views import InstanceView

__all__ = ["DoctorReport", "Finding", "Thresholds", "chat_template_findings", "diagnose"]

Verdict = Literal["ok", "problem", "note"]
PROBE_CHAT = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Where is the prefix of this prompt cached?"},
]


class Finding(msgspec.Struct, frozen=True):
    check: str
    engine: str | None
    verdict: Verdict
    message: str
    fix: str | None = None

    def line(self) -> str:
        where = f"{self.engine}: " if self.engine else ""
        text = f"[{self.verdict}] {self.check}: {where}{self.message}"
        return text + (f" -> {self.fix}" if self.fix else "")


class DoctorReport(msgspec.Struct, frozen=True):
    ok: bool  # no problem found
    problems: int
    findings: list[Finding]


@dataclass(frozen=True, slots=True)
class Thresholds:
    max_lag: float = 30.0  # seconds from an engine's stamp to applied, nothing queued
    min_lookups: int = 20
    no_match_share: float = 0.9
    engine_hit_rate: float = 0.2  # an engine reusing this share of its prompt tokens


def report(findings: list[Finding]) -> DoctorReport:
    problems = sum(f.verdict == "problem" for f in findings)
    return DoctorReport(problems == 0, problems, findings)


def diagnose(
    fleet: Fleet,
    scraper: MetricsScraper | None,
    router: Router | None,
    lookups: tuple[int, int],
    thresholds: Thresholds | None = None,
) -> list[Finding]:
    """Every check but the chat template's (`chat_template_findings`, which asks engines)."""
    t = thresholds or Thresholds()
    figures = scraper.figures() if scraper is not None else {}
    errors = scraper.errors() if scraper is not None else {}
    backlog = fleet.backlog
    out: list[Finding] = []
    for view in fleet.instance_views():
        engine = figures.get(view.name, {})
        out.append(_events(view, engine))
        out.append(_replay(view))
        out.append(_block_size(view, engine, router))
        out.append(_metrics(view, errors.get(view.name)))
        out.append(_clock(view, backlog, t))
    out.append(_lookups(fleet, figures, lookups, t))
    return out


# -- the checks ---------------------------------------------------------------------------


def _events(view: InstanceView, engine: Mapping[int, EngineFigures]) -> Finding:
    name = view.name
    if view.spec.events_none:  # no events by design: nothing to arrive
        cache = view.approximate_cache
        held = f": {cache.blocks:,} blocks routed there held" if cache is not None else ""
        return Finding(
            "events", name, "note", f"events=none: its cache is learnt from routing{held}"
        )
    queries = sum(f.queries or 0 for f in engine.values())
    if view.batches == 0 and queries > 0:
        return Finding(
            "events",
            name,
            "problem",
            f"the engine has served ({queries:,.0f} prefix-cache query tokens on its /metrics) "
            "but not one KV event batch came: events are disabled or published elsewhere",
            'start vLLM with --kv-events-config \'{"enable_kv_cache_events": true, '
            '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": '
            '"tcp://*:5558"}\' and point the spec at that endpoint',
        )
    if view.status != Status.LIVE:
        said = f" ({view.problem})" if view.problem else ""
        return Finding(
            "events",
            name,
            "problem",
            f"the link is {view.status.value}{said}",
            "check that the engine runs and that its publisher endpoint is reachable from here",
        )
    lost, bad = view.total("lost_batches"), view.total("decode_errors")
    if lost or bad:
        return Finding(
            "events",
            name,
            "problem",
            f"{lost} batches lost, {bad} undecodable: kvindex's view may miss blocks",
            "give the engine a replay endpoint (and a larger buffer), check its vLLM version",
        )
    if view.batches == 0:
        return Finding("events", name, "note", "live, no batch yet (nothing served?)")
    lag = view.ingest_lag_seconds
    said = f", applied {lag:.2f} s after the engine's stamp" if lag is not None else ""
    return Finding("events", name, "ok", f"{view.batches:,} batches arrived and applied{said}")


def _replay(view: InstanceView) -> Finding:
    spec = view.spec
    if spec.pending or spec.discover is not None:
        return Finding("replay", view.name, "note", "publishers read from the engine's URL")
    if spec.events_none:
        return Finding("replay", view.name, "note", "events=none: no publisher to replay from")
    if spec.replay_endpoint is None:
        return Finding(
            "replay",
            view.name,
            "problem",
            "no replay endpoint: a dropped batch or a kvindex restart leaves a gap for good",
            "set vLLM's replay_endpoint (--kv-events-config) and add replay=tcp://HOST:PORT "
            "to the spec",
        )
    failures = view.total("replay_failures")
    if failures:
        return Finding(
            "replay",
            view.name,
            "problem",
            f"{failures} replay requests failed at {spec.replay_endpoint}",
            "check the replay endpoint's address and that the engine binds it",
        )
    return Finding("replay", view.name, "ok", f"replay at {spec.replay_endpoint}")


def _block_size(
    view: InstanceView, engine: Mapping[int, EngineFigures], router: Router | None
) -> Finding:
    theirs = {f.block_size for f in engine.values() if f.block_size}
    ours = router.seen_block_size(view.name) if router is not None else None
    source = "its routing answers"
    if ours is None and view.spec.block_size is not None:
        ours, source = view.spec.block_size, "its spec's block_size="
    if not theirs or ours is None:
        return Finding("block_size", view.name, "note", "not known on both sides yet")
    if theirs != {ours}:
        return Finding(
            "block_size",
            view.name,
            "problem",
            f"the engine's /metrics says block size {sorted(theirs)[0]}, kvindex has "
            f"{ours} from {source}: no prompt will match as the engine reuses it",
            "give the spec the engine's block_size= and let the router hash with it",
        )
    return Finding("block_size", view.name, "ok", f"{ours} on both sides")


def _metrics(view: InstanceView, error: str | None) -> Finding:
    url = view.spec.metrics_url
    if url is None:
        return Finding(
            "metrics",
            view.name,
            "note",
            "no http= or metrics= in the spec: routing scores without this engine's load",
        )
    if error is not None:
        return Finding(
            "metrics",
            view.name,
            "problem",
            f"{url} can't be read ({error}): the score's load parts are left out",
            "give the spec the engine's reachable http= (or metrics=) URL",
        )
    return Finding("metrics", view.name, "ok", f"{url} read for load")


def _clock(view: InstanceView, backlog: int, t: Thresholds) -> Finding:
    lag = view.ingest_lag_seconds
    if lag is None:
        return Finding("clock", view.name, "note", "no batch applied yet")
    if lag > t.max_lag and backlog == 0:
        return Finding(
            "clock",
            view.name,
            "problem",
            f"batches are applied {lag:.0f} s after the engine stamped them, with nothing "
            "queued: the engine's clock is behind this host's",
            "synchronize the clocks (NTP); ages and lags in kvindex are off until then",
        )
    return Finding("clock", view.name, "ok", f"stamps {lag:.2f} s behind on arrival")


def _lookups(
    fleet: Fleet,
    figures: Mapping[str, Mapping[int, EngineFigures]],
    lookups: tuple[int, int],
    t: Thresholds,
) -> Finding:
    asked, hits = lookups
    if asked < t.min_lookups:
        return Finding("lookups", None, "note", f"{asked} lookups so far: too few to judge")
    missed = 1 - hits / asked
    reusing = [
        name
        for name, ranks in figures.items()
        if any((f.lifetime_hit_rate or 0) >= t.engine_hit_rate for f in ranks.values())
    ]
    held = fleet.summary().blocks
    if missed >= t.no_match_share and reusing and held:
        return Finding(
            "lookups",
            None,
            "problem",
            f"{missed:.0%} of {asked:,} lookups matched nothing, while {', '.join(reusing[:3])} "
            f"reuse their own caches and kvindex holds {held:,} blocks: the router's prompts "
            "are not hashed as the engines hash them",
            "check the block size, PYTHONHASHSEED / --prefix-caching-hash-algo, cache_salt "
            "and that chats are tokenized with the engine's chat template (kvindex doctor's "
            "other lines)",
        )
    return Finding("lookups", None, "ok", f"{1 - missed:.0%} of {asked:,} lookups matched")


async def chat_template_findings(fleet: Fleet, tokenizers: Tokenizers) -> list[Finding]:
    """Per model with a local tokenizer and an engine with `http=`: the probe chat
    tokenized locally and by the engine's `POST /tokenize`, compared."""
    from kvindex.runtime.tokenize import Chat, EngineTokenizer, LocalTokenizer, TokenizeFailed

    out = []
    for model, kind in tokenizers.models().items():
        if kind != "local":
            out.append(Finding("chat_template", None, "ok", f"{model}: tokenized by the engine"))
            continue
        _, local = tokenizers.get(model)
        assert isinstance(local, LocalTokenizer)
        urls = [s.http for s in list(fleet.specs.values()) if s.model == model and s.http]
        if not urls:
            out.append(Finding("chat_template", None, "note", f"{model}: no engine with http="))
            continue
        engine = EngineTokenizer(model, _fixed(urls))
        try:
            theirs = await engine.aencode_chat(Chat(PROBE_CHAT))
            ours = local.encode_chat(Chat(PROBE_CHAT))
        except TokenizeFailed as exc:
            out.append(_template_failed(model, exc))
            continue
        finally:
            await engine.aclose()
        out.append(_template_compared(model, ours, theirs))
    return out


def _fixed(urls: list[str]) -> Callable[[], list[str]]:
    return lambda: list(urls)


def _template_failed(model: str, exc: Any) -> Finding:
    return Finding(
        "chat_template",
        None,
        "problem",
        f"{model}: a chat could not be tokenized both ways ({exc})",
        "give the local tokenizer the engine's chat template, or use --tokenizer MODEL=vllm",
    )


def _template_compared(model: str, ours: list[int], theirs: list[int]) -> Finding:
    if ours == theirs:
        return Finding("chat_template", None, "ok", f"{model}: chats tokenized as the engine does")
    return Finding(
        "chat_template",
        None,
        "problem",
        f"{model}: a chat tokenizes to {len(ours)} ids here and {len(theirs)} on the engine "
        "(another chat template or tokenizer): lookups by messages match less or nothing",
        "point --tokenizer at the engine's own model directory, or use --tokenizer MODEL=vllm",
    )
