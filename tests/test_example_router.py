"""examples/kv_router.py, run as a user runs it (its own process), in front of two engines
(real HTTP servers answering OpenAI completions) and kvindex (real HTTP, real ZMQ
publishers, a real tokenizer): each request goes where its prefix is cached, answers and
streams pass through unchanged, and without kvindex it still serves, round robin."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from httpfixture import FakeEngine, serve_app, serve_engine
from test_router_service import stored, until
from tokenizer_fixture import build_tokenizer

from kvindex.runtime import Fleet
from kvindex.runtime.tokenize import Chat, LocalTokenizer, Tokenizers
from kvindex.service.app import create_app
from kvindex.service.lookups import Routing
from kvindex.subscriber import InstanceSpec
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(90)
EXAMPLE = Path(__file__).parents[1] / "examples" / "kv_router.py"
BS = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def proxy(kvindex: str, engines: dict[str, str]) -> Iterator[httpx.Client]:
    """The example on a free port; a client on it."""
    port = free_port()
    args = [sys.executable, str(EXAMPLE), "--kvindex", kvindex, "--listen", f"127.0.0.1:{port}"]
    for name, url in engines.items():
        args += ["--engine", f"{name}={url}"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:

            def up() -> bool:
                assert proc.poll() is None, proc.stderr and proc.stderr.read()
                try:
                    return client.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            assert until(up, 30)
            yield client
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_example_router_sends_each_request_where_its_prefix_is(tmp_path: Path) -> None:
    model_dir = build_tokenizer(tmp_path / "model")
    local = LocalTokenizer.load(model_dir)
    prompt = "The router sends this prompt where its prefix is already cached. " * 3
    messages = [{"role": "user", "content": "Which engine holds this conversation?"}]
    engines = {name: FakeEngine(name=name) for name in ("m0", "m1")}
    with ExitStack() as stack:
        pubs = {n: stack.enter_context(Publisher("tcp://127.0.0.1:*")) for n in engines}
        urls = {n: stack.enter_context(serve_engine(e)) for n, e in engines.items()}
        fleet = Fleet([InstanceSpec(n, pubs[n].endpoint, model="m") for n in engines])
        tokenizers = Tokenizers(fleet)
        tokenizers.add("m", str(model_dir))
        kvindex = stack.enter_context(
            serve_app(create_app(fleet, routing=Routing.of(fleet, tokenizers)))
        )
        client = stack.enter_context(proxy(kvindex, urls))

        prompt_ids = local.encode_prompt(prompt)
        chat_ids = local.encode_chat(Chat(messages))
        pubs["m1"].publish([stored(prompt_ids)])  # m1 holds the prompt
        pubs["m0"].publish([stored(chat_ids)])  # m0 the conversation
        assert until(lambda: fleet.index.block_count("m1") == len(prompt_ids) // BS)
        assert until(lambda: fleet.index.block_count("m0") == len(chat_ids) // BS)

        body = {"model": "m", "prompt": prompt, "max_tokens": 8}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvindex-instance"] == "m1"
        assert answer.headers["x-kvindex-route"] == "kvindex"
        assert answer.json()["choices"][0]["text"] == "from m1"
        assert engines["m1"].requests[-1] == ("/v1/completions", body)  # forwarded unchanged

        chat = {"model": "m", "messages": messages, "stream": True}
        streamed = client.post("/v1/chat/completions", json=chat)
        assert streamed.headers["x-kvindex-instance"] == "m0"
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.endswith("data: [DONE]\n\n") and '"m0"' in streamed.text

        by_ids = client.post("/v1/completions", json={"model": "m", "prompt": prompt_ids})
        assert by_ids.headers["x-kvindex-instance"] == "m1"
        batch = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]})
        assert batch.headers["x-kvindex-route"] == "round robin: no single prompt"
        unknown = client.post("/v1/completions", json={"model": "other", "prompt": prompt})
        assert unknown.headers["x-kvindex-route"] == "round robin: kvindex 404"
        assert client.post("/v1/completions", content=b"{").status_code == 400

    # no kvindex at all: every engine still gets requests, in turn
    with ExitStack() as stack:
        urls = {n: stack.enter_context(serve_engine(e)) for n, e in engines.items()}
        gone = f"http://127.0.0.1:{free_port()}"
        client = stack.enter_context(proxy(gone, urls))
        went = [
            client.post("/v1/completions", json={"model": "m", "prompt": prompt}) for _ in range(2)
        ]
        assert {a.headers["x-kvindex-instance"] for a in went} == {"m0", "m1"}
        assert all("kvindex unreachable" in a.headers["x-kvindex-route"] for a in went)
