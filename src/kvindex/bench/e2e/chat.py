"""The chat lookup case (issue 25): `POST /v1/lookup` by chat messages, turn >= 10 of a
conversation with an ~8k-token history, beside the lookup by the same token ids, in the same
run on the same serve.

A word-level tokenizer with a ChatML template (`<|im_start|>` / `<|im_end|>` added tokens,
word `tN` = token id N) is served by `--tokenizer`; `chats` conversations grow turn by
turn (a system prompt, then questions and answers of random words), and the engine (one
real publisher) holds each turn's tokens, as the fresh tokenizer makes them. From turn 10
on, each turn is asked three ways, interleaved on one keep-alive connection: by messages
(the history as the router resends it, a new question at the end: the prefix cache
tokenizes only that), by the same token ids with the model (the FastAPI route, as the
messages take) and by token ids alone (the plain path). Every answer's matched blocks are
checked against the ids a fresh tokenization gives.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from kvindex.bench.e2e.probes import Client, wait_for, wait_live
from kvindex.bench.e2e.procs import Serve, child
from kvindex.bench.e2e.runs import attempt, summarize_ms
from kvindex.bench.plan import EndToEnd

__all__ = ["CHAT_KINDS", "chat_case"]

MODEL = "chat"
VOCAB = 32_000
BLOCK = 16
CHAT_KINDS = ("messages", "token_ids_model", "token_ids")
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)


def chat_tokenizer(folder: Path) -> Path:
    """Word-level (`tN` = id N) with ChatML's markers as added tokens and its template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    for word in ("system", "user", "assistant"):
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(
        [AddedToken(m, normalized=False, special=True) for m in ("<|im_start|>", "<|im_end|>")]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHATML, "model_max_length": 1 << 24}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"t{rng.randrange(1, VOCAB)}" for _ in range(n))


def chat_case(sizes: EndToEnd, workdir: Path) -> dict[str, Any]:
    try:
        import tokenizers  # noqa: F401  (the tokenize extra)
    except ImportError:
        return {"skipped": "the tokenize extra is not installed (pip install 'kvindex[tokenize]')"}
    return attempt(lambda: _run(sizes, workdir))


def _run(sizes: EndToEnd, workdir: Path) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from kvindex.runtime.tokenize import Chat, LocalTokenizer
    from kvindex.wire import BlockStored
    from kvindex.wire.publisher import Publisher

    folder = chat_tokenizer(workdir / "chat-tokenizer")
    fresh = Tokenizer.from_file(str(folder / "tokenizer.json"))
    renderer = LocalTokenizer.load(folder, cache_bytes=0)
    chats, turns = (4, 12) if sizes.lookups < 100 else (24, 14)
    rng = random.Random(25)
    # ~8k tokens by turn 10: a 3,000-word system prompt, 150-word questions, 350-word answers
    histories = [[{"role": "system", "content": _words(rng, 3_000)}] for _ in range(chats)]
    pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    args = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--store",
            "memory", "--instance", f"e0={pub.endpoint},replay={pub.replay_endpoint},"
            f"model={MODEL}", "--tokenizer", f"{MODEL}={folder}"]  # fmt: skip
    latencies: dict[str, list[float]] = {k: [] for k in CHAT_KINDS}
    wrong = dict.fromkeys(CHAT_KINDS, 0)
    tokens: list[int] = []
    held: list[int] = [0] * chats
    try:
        with child(args, workdir / "serve-chat.log", cwd=workdir) as c:
            url = Serve(c).wait_url(60)
            wait_live(url, sizes.timeout)
            client = Client(url)
            for turn in range(turns):
                for k, history in enumerate(histories):
                    history.append({"role": "user", "content": _words(rng, 150)})
                    ids = fresh.encode(renderer.render(Chat(history)), add_special_tokens=False).ids
                    held[k] = _store(pub, ids, held[k], BlockStored)
                    _wait_held(url, sum(held), sizes.timeout)
                    if turn >= 10:
                        tokens.append(len(ids))
                        _ask(client, history, ids, latencies, wrong)
                    else:  # the router asked at this turn too: its prefix cache saw it
                        _ask(client, history, ids, None, wrong)
                    history.append({"role": "assistant", "content": _words(rng, 350)})
            metrics = _cache_metrics(url)
            client.close()
    finally:
        pub.close()
    out: dict[str, Any] = {
        "chats": chats,
        "turns": turns,
        "tokens_p50": sorted(tokens)[len(tokens) // 2],
    }
    for kind in CHAT_KINDS:
        out[kind] = {**summarize_ms(latencies[kind]), "wrong_answers": wrong[kind]}
    for kind in ("token_ids_model", "token_ids"):
        out[f"messages_vs_{kind}"] = out["messages"]["p50_ms"] / out[kind]["p50_ms"]
    out["tokenizer_cache"] = metrics
    return out


def _store(pub: Any, ids: list[int], held: int, stored: Any) -> int:
    """Publish the prompt's whole blocks past the `held` first ones; the new count."""
    whole = len(ids) // BLOCK
    if whole > held:
        hashes = [hash(tuple(ids[: BLOCK * (i + 1)])) & ((1 << 63) - 1) for i in range(held, whole)]
        parent = hash(tuple(ids[: BLOCK * held])) & ((1 << 63) - 1) if held else None
        pub.publish([stored(hashes, parent, ids[BLOCK * held : BLOCK * whole], BLOCK)])
    return max(held, whole)


def _wait_held(url: str, blocks: int, timeout: float) -> None:
    from kvindex.bench.e2e.probes import instances

    wait_for(
        "serve to hold the turn", lambda: instances(url)[0]["blocks"] == blocks, timeout, 0.002
    )


def _ask(
    client: Client,
    history: list[dict[str, str]],
    ids: list[int],
    latencies: dict[str, list[float]] | None,
    wrong: dict[str, int],
) -> None:
    bodies = {
        "messages": {"messages": history, "model": MODEL},
        "token_ids_model": {"token_ids": ids, "model": MODEL},
        "token_ids": {"token_ids": ids},
    }
    want = len(ids) // BLOCK
    for kind in CHAT_KINDS:
        request = client.prepare("POST", "/v1/lookup", msgspec.json.encode(bodies[kind]))
        start = time.perf_counter()
        answer = client.send(request)
        took = time.perf_counter() - start
        if latencies is not None:
            latencies[kind].append(took)
        rows = msgspec.json.decode(answer)["instances"]
        wrong[kind] += rows[0]["matched_blocks"] != want


def _cache_metrics(url: str) -> dict[str, float]:
    from kvindex.bench.e2e.probes import metrics_text

    out = {}
    for line in metrics_text(url).splitlines():
        if line.startswith("kvindex_tokenizer_cache_"):
            out[line.split("{")[0].removeprefix("kvindex_tokenizer_cache_")] = float(
                line.rsplit(" ", 1)[1]
            )
    return out
