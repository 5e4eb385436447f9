"""What a router asks of kvindex besides plain lookups by token ids (docs/routing.md):

- `POST /v1/lookup` by `prompt` or chat `messages`, per `model`, tokenized by the model's
  tokenizer (`kvindex.runtime.tokenize`); `"score": true` answers with the routing score;
- `POST /v1/route`: look up, choose by the score, predict the prompt's blocks on the choice.

The peers' API (Dynamo's standalone indexer) is `kvindex.service.peers`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvindex.runtime import Fleet
from kvindex.runtime.engine_metrics import MetricsScraper
from kvindex.runtime.routing import NoCandidate, Router
from kvindex.runtime.stream_load import StreamLoads
from kvindex.runtime.tokenize import Chat, NoTokenizer, TokenizeFailed, Tokenizers
from kvindex.service.metrics import ServiceMetrics
from kvindex.service.schema import (
    ChatLookupRequest,
    LookupRequest,
    PromptLookupRequest,
    decode_body,
    decode_lookup,
    encode,
    error_body,
    mm_keys,
)

__all__ = ["AnyLookup", "Routing", "decode_any_lookup", "install_route", "lookup_answer"]


@dataclass
class Routing:
    """The router's parts a service holds: the score and predictions, the tokenizers, the
    engines' metrics."""

    fleet: Fleet
    router: Router
    tokenizers: Tokenizers
    scraper: MetricsScraper

    @classmethod
    def of(cls, fleet: Fleet, tokenizers: Tokenizers | None = None, **router: Any) -> Routing:
        scraper = MetricsScraper(lambda: _metrics_targets(fleet))
        scraper.on_sleep = fleet.sleep_state  # an engine asleep: its blocks are gone
        scraper.on_usage = fleet.usage_state  # idle with blocks: said and counted, kept
        scraper.on_pool = fleet.pool_state  # an events=none engine's pool, where unset
        return cls(
            fleet,
            # The engines' own load streams first (SGLang's, pushed), then their /metrics.
            Router(fleet, loads=[StreamLoads(fleet), scraper], **router),
            tokenizers or Tokenizers(fleet),
            scraper,
        )


def _metrics_targets(fleet: Fleet) -> list[tuple[str, str]]:
    return [(n, s.metrics_url) for n, s in list(fleet.specs.items()) if s.metrics_url]


AnyLookup = LookupRequest | PromptLookupRequest | ChatLookupRequest


def decode_any_lookup(raw: bytes) -> AnyLookup:
    """A `/v1/lookup` or `/v1/route` body: token ids, a prompt or chat messages."""
    try:
        keys = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, UnicodeDecodeError):
        return decode_lookup(raw)  # its errors, worded once
    if "prompt" in keys:
        prompt: PromptLookupRequest = decode_body(raw, PromptLookupRequest)
        return prompt
    if "messages" in keys:
        chat: ChatLookupRequest = decode_body(raw, ChatLookupRequest)
        return chat
    return decode_lookup(raw)


async def _token_ids(routing: Routing, body: AnyLookup) -> tuple[list[int], str | None]:
    """The body's token ids (tokenized by its model's tokenizer), and the model."""
    if isinstance(body, LookupRequest):
        return body.token_ids, body.model
    try:
        model, tokenizer = routing.tokenizers.get(body.model)
        if isinstance(body, PromptLookupRequest):
            tokens = await tokenizer.aencode_prompt(body.prompt, body.add_special_tokens)
        else:
            chat = Chat(
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=body.chat_template_kwargs or {},
                tools=body.tools,
            )
            tokens = await tokenizer.aencode_chat(chat)
    except NoTokenizer as exc:  # the model's tokenizer is not there: 404, like the model
        raise _Failed(404, str(exc)) from None
    except TokenizeFailed as exc:
        raise _Failed(exc.status, str(exc)) from None
    return tokens, model


class _Failed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _model_known(routing: Routing, model: str | None) -> None:
    if model is not None and not routing.fleet.serves(model):
        raise _Failed(404, f"no instance serves model {model!r} (model= in its spec)")


async def lookup_answer(
    routing: Routing, metrics: ServiceMetrics, body: AnyLookup, max_items: int
) -> Response:
    """`POST /v1/lookup` off the plain path: text or messages, a model, a score."""
    try:
        tokens, model = await _token_ids(routing, body)
        _model_known(routing, model)
    except _Failed as exc:
        return _json_error(exc.status, str(exc))
    if len(tokens) > max_items:
        return _json_error(
            422, f"the prompt has {len(tokens)} tokens, over the limit of {max_items}"
        )
    keys = mm_keys(body)
    start = time.perf_counter()
    kind = "tokens" if isinstance(body, LookupRequest) else "text"
    if body.score:
        scored = routing.router.lookup(
            tokens, model=model, lora_name=body.lora_name, cache_salt=body.cache_salt, **keys
        )
        metrics.lookups.observe(kind, time.perf_counter() - start, scored.hit)
        return Response(encode(scored), media_type="application/json")
    answer = routing.fleet.lookup(tokens, body.lora_name, body.cache_salt, model=model, **keys)
    metrics.lookups.observe(kind, time.perf_counter() - start, answer.hit)
    return Response(encode(answer), media_type="application/json")


def _json_error(status: int, message: str) -> Response:
    return Response(error_body(message), status, media_type="application/json")


def install_doctor(app: FastAPI, routing: Routing, metrics: ServiceMetrics) -> None:
    """`GET /v1/doctor`: what is mis-wired between kvindex and its engines
    (`kvindex.runtime.doctor`), one finding per engine and check."""
    from kvindex.runtime.doctor import DoctorReport, chat_template_findings, diagnose, report
    from kvindex.service.schema import operation_doc

    @app.get("/v1/doctor", **operation_doc(DoctorReport))
    async def doctor() -> Response:
        """Each check's finding per engine (`ok`, `problem` with its fix, or `note`);
        `ok` is false when any problem was found (docs/operations.md#doctor)."""
        findings = diagnose(routing.fleet, routing.scraper, routing.router, metrics.lookups.totals)
        findings += await chat_template_findings(routing.fleet, routing.tokenizers)
        return Response(encode(report(findings)), media_type="application/json")


def install_route(
    app: FastAPI, routing: Routing, metrics: ServiceMetrics, doc: dict[str, Any]
) -> None:
    """`/v1/route` on `app`; the router's parts go on `app.state.routing` (the lookup route
    reads them there)."""
    app.state.routing = routing

    @app.post("/v1/route", **doc)
    async def route(request: Request) -> Response:
        """Look up, choose by the routing score, and predict the prompt's blocks on the
        choice for the prediction TTL (until its real BlockStored arrives); 409 when no
        instance can take it (none serves the model, or all are down)."""
        body = decode_any_lookup(await request.body())  # BadBody: the app's JSON 4xx
        try:
            tokens, model = await _token_ids(routing, body)
            _model_known(routing, model)
        except _Failed as exc:
            return _json_error(exc.status, str(exc))
        keys = mm_keys(body)
        start = time.perf_counter()
        try:
            answer = routing.router.route(
                tokens, model=model, lora_name=body.lora_name, cache_salt=body.cache_salt, **keys
            )
        except NoCandidate as exc:
            return _json_error(409, f"no instance can take it: {exc}")
        hit = any(row.matched_blocks for row in answer.instances)
        metrics.lookups.observe("route", time.perf_counter() - start, hit)
        return Response(encode(answer), media_type="application/json")
