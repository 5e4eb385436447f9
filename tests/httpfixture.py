"""Small real HTTP servers on loopback for the router tests: a vLLM-like engine that answers
`POST /tokenize` (with a real tokenizer) and `GET /metrics` (Prometheus text it is told),
and kvindex's own app under uvicorn on a thread (`serve_app`)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvindex.runtime.tokenize import Chat, LocalTokenizer, TokenizeFailed


class FakeEngine:
    """What the handler serves: the tokenizer behind `/tokenize`, the `/metrics` text, and
    the requests seen (path, body)."""

    def __init__(self, tokenizer: LocalTokenizer | None = None, name: str = "engine") -> None:
        self.tokenizer = tokenizer
        self.name = name  # said in its completions
        self.metrics = ""
        self.metrics_status = 200
        self.requests: list[tuple[str, Any]] = []


def vllm_metrics(
    waiting: float,
    running: float,
    kv: float,
    queries: float = 0,
    hits: float = 0,
    engine: int = 0,
    block_size: int = 16,
) -> str:
    """The lines of vLLM's `/metrics` the scraper reads, as vLLM 0.33 writes them."""
    labels = f'engine="{engine}",model_name="m"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {running}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} {waiting}\n"
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv}\n"
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of tokens.\n"
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        f"vllm:prefix_cache_queries_total{{{labels}}} {queries}\n"
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of tokens.\n"
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        f"vllm:prefix_cache_hits_total{{{labels}}} {hits}\n"
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{block_size}",{labels},num_gpu_blocks="2048"}} 1.0\n'
    )


def _handler(engine: FakeEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            engine.requests.append((self.path, None))
            if self.path == "/metrics":
                self._send(engine.metrics_status, engine.metrics.encode(), "text/plain")
            else:
                self._send(404, b'{"detail":"Not Found"}')

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            engine.requests.append((self.path, body))
            if self.path in ("/v1/completions", "/v1/chat/completions"):
                self._complete(body)
                return
            if self.path != "/tokenize" or engine.tokenizer is None:
                self._send(404, b'{"detail":"Not Found"}')
                return
            # vLLM's /tokenize: a completion body or a chat body, its error shape on a 400
            try:
                if "messages" in body:
                    chat = Chat(
                        body["messages"],
                        add_generation_prompt=body.get("add_generation_prompt", True),
                        add_special_tokens=body.get("add_special_tokens", False),
                    )
                    tokens = engine.tokenizer.encode_chat(chat)
                else:
                    tokens = engine.tokenizer.encode_prompt(
                        body["prompt"], body.get("add_special_tokens", True)
                    )
            except TokenizeFailed as exc:
                error = {"error": {"message": str(exc), "type": "BadRequestError", "code": 400}}
                self._send(400, json.dumps(error).encode())
                return
            answer = {"count": len(tokens), "max_model_len": 4096, "tokens": tokens}
            self._send(200, json.dumps(answer).encode())

        def _complete(self, body: dict[str, Any]) -> None:
            """An OpenAI answer naming the engine; with `stream`, as server-sent events."""
            text = f"from {engine.name}"
            if not body.get("stream"):
                answer = {"object": "text_completion", "choices": [{"index": 0, "text": text}]}
                self._send(200, json.dumps(answer).encode())
                return
            chunks = [{"choices": [{"index": 0, "text": word}]} for word in text.split()]
            events = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
            self._send(200, "".join(events).encode(), "text/event-stream")

    return Handler


@contextmanager
def serve_engine(engine: FakeEngine) -> Iterator[str]:
    """Serve `engine` on a free loopback port; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(engine))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """An ASGI app (kvindex's) under uvicorn on a thread, on a free loopback port; yields
    its base URL. Its lifespan runs: a Fleet given to `create_app` ingests meanwhile."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started and thread.is_alive():
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
