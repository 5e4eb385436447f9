"""The routing cases (issue 15): what a router's requests cost on `kvindex serve`, each
beside its baseline in the same run.

One serve follows a filled fleet (the lookup case's fill, on `ROUTING_INSTANCES`
publishers: 512-block prompts, `model=bench` on every instance) with a word-level
tokenizer (`--tokenizer bench=DIR`: word `tN` is token id N, so a prompt written in its
words tokenizes to exactly the fill's token ids and every answer can be checked against
the fill's truth). A client child then sends, one after the other on one keep-alive
connection, one request of each kind per step (one step every `lookup_interval` seconds,
`lookups` steps), so every kind meets the same machine:

- `lookup`: `POST /v1/lookup {"token_ids"}`, the plain path (answered in the HTTP
  protocol): the baseline of everything else;
- `lookup_model`: the same with `"model"`: the FastAPI route a router's lookup takes;
- `prompt`: `{"prompt", "model"}`: tokenized in serve, then looked up (the baseline is
  `lookup_model`: the difference is the tokenization);
- `route`: `POST /v1/route {"token_ids", "model"}`: scored, the choice recorded as a
  prediction (its baseline too is `lookup_model`).

Latency = the client's round trip; every answer's matched blocks are checked against the
fill. Beside it, in the bench process, tokenization alone: kvindex's `LocalTokenizer`
encoding the same prompts as text, with the word-level tokenizer and with a byte-level
BPE trained on the fly (what a real model's tokenizer costs per token).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import msgspec

from kvindex.bench.common import median
from kvindex.bench.e2e.child import paced_steps, say
from kvindex.bench.e2e.probes import wait_applied, wait_live
from kvindex.bench.e2e.procs import bench_child, child, publishers, serve
from kvindex.bench.e2e.runs import attempt, summarize_ms
from kvindex.bench.e2e.streams import Filled, filled, write_items
from kvindex.bench.plan import EndToEnd
from kvindex.bench.workloads import FillSpec

__all__ = ["KINDS", "MODEL", "ROUTING_INSTANCES", "routing_case", "word_prompt"]

MODEL = "bench"
ROUTING_INSTANCES = 8  # publishers of the fill (the lookup case's blocks per instance)
VOCAB = 32_000  # the fill's token ids (workloads)
# Each kind's path and body; `baseline` is what its cost is read against.
KINDS = ("lookup", "lookup_model", "prompt", "route")
BASELINE = {"lookup_model": "lookup", "prompt": "lookup_model", "route": "lookup_model"}


def word_prompt(tokens: list[int]) -> str:
    """The text that the word-level tokenizer turns into exactly `tokens`."""
    return " ".join(f"t{t}" for t in tokens)


def request_body(kind: str, tokens: list[int]) -> tuple[str, bytes]:
    """(path, JSON body) of one request of `kind` for a prompt of `tokens`."""
    if kind == "lookup":
        return "/v1/lookup", msgspec.json.encode({"token_ids": tokens})
    if kind == "prompt":
        body: dict[str, Any] = {"prompt": word_prompt(tokens), "model": MODEL}
        return "/v1/lookup", msgspec.json.encode(body)
    path = "/v1/route" if kind == "route" else "/v1/lookup"
    return path, msgspec.json.encode({"token_ids": tokens, "model": MODEL})


def word_tokenizer(folder: Path) -> Path:
    """A Hugging Face tokenizer whose word `tN` is token id N, nothing added."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1 << 24}))
    return folder


def bpe_tokenizer(folder: Path, corpus: list[str]) -> Path:
    """A byte-level BPE (8,000 tokens) trained on `corpus`, as a model directory holds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8_000,
        special_tokens=["<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1 << 24}))
    return folder


def routing_case(sizes: EndToEnd, workdir: Path) -> dict[str, Any]:
    """The fill, serve and the client (see the module doc); then tokenization alone."""
    try:
        import tokenizers  # noqa: F401  (the tokenize extra)
    except ImportError:
        return {"skipped": "the tokenize extra is not installed (pip install 'kvindex[tokenize]')"}
    started = time.monotonic()
    fleet = filled(FillSpec(ROUTING_INSTANCES, sizes.lookup_blocks), sizes.prompts)
    out: dict[str, Any] = {
        "instances": fleet.spec.instances,
        "per_instance": fleet.spec.per_instance,
        "entries": fleet.entries,
        "prompts": len(fleet.prompts),
        "prompt_tokens": len(fleet.prompts[0]),
        "steps": sizes.lookups,
        "prepare_seconds": time.monotonic() - started,
    }
    out["http"] = attempt(lambda: _http(fleet, sizes, workdir))
    out["tokenize"] = attempt(lambda: _tokenize_alone(fleet, workdir))
    return out


def _http(fleet: Filled, sizes: EndToEnd, workdir: Path) -> dict[str, Any]:
    fill_file, prompts_file = workdir / "routing-fill.msgpack", workdir / "routing-prompts.msgpack"
    write_items(fill_file, fleet.items)
    prompts_file.write_bytes(msgspec.msgpack.encode(fleet.prompts))
    words = word_tokenizer(workdir / "routing-words")
    names = [f"vllm-{i}" for i in range(fleet.spec.instances)]
    with (
        publishers(workdir, fill_file, len(names), "routing") as pub,
        serve(
            workdir,
            names,
            pub.endpoints,
            "memory",
            "routing",
            spec_options=f",model={MODEL}",
            options=("--tokenizer", f"{MODEL}={words}"),
        ) as srv,
    ):
        wait_live(srv.url, sizes.timeout)
        sent = pub.burst(sizes.timeout)
        wait_applied(srv.url, names, sent["next_seqs"], sizes.timeout)
        args = bench_child(
            "routes", srv.url, str(prompts_file), str(sizes.lookups), str(sizes.lookup_interval)
        )
        with child(args, workdir / "routes.log") as client:
            client.expect("ready", 120)
            client.send({"op": "go"})
            done = client.expect("done", sizes.timeout + sizes.lookups * len(KINDS) * 0.2)
    out: dict[str, Any] = {}
    for kind in KINDS:
        answers: list[dict[str, int]] = done["answers"][kind]
        wrong = sum(
            [a.get(name, 0) for name in names] != fleet.depth[i % len(fleet.prompts)]
            for i, a in enumerate(answers)
        )
        out[kind] = {**summarize_ms(done["latencies"][kind]), "wrong_answers": wrong}
    for kind, base in BASELINE.items():
        out[kind]["p50_extra_ms"] = out[kind]["p50_ms"] - out[base]["p50_ms"]
        out[kind]["p50_vs_baseline"] = out[kind]["p50_ms"] / out[base]["p50_ms"]
    return out


def _tokenize_alone(fleet: Filled, workdir: Path) -> dict[str, Any]:
    """kvindex's LocalTokenizer on each prompt as text: median seconds per prompt."""
    from kvindex.runtime.tokenize import LocalTokenizer

    rng = random.Random(15)
    vocabulary = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(5_000)
    ]
    corpus = [" ".join(rng.choices(vocabulary, k=200)) for _ in range(500)]
    bpe = LocalTokenizer.load(bpe_tokenizer(workdir / "routing-bpe", corpus))
    words = LocalTokenizer.load(workdir / "routing-words")
    texts = {
        "word_level": [word_prompt(p) for p in fleet.prompts],
        # About as many BPE tokens as the fill's prompts have: text of the trained words.
        "bpe": [" ".join(rng.choices(vocabulary, k=len(p) // 2)) for p in fleet.prompts],
    }
    out: dict[str, Any] = {}
    for name, tok in (("word_level", words), ("bpe", bpe)):
        seconds, tokens = [], []
        for text in texts[name]:
            start = time.perf_counter()
            ids = tok.encode_prompt(text, False)
            seconds.append(time.perf_counter() - start)
            tokens.append(len(ids))
        out[name] = {
            "p50_ms": median(seconds) * 1e3,
            "tokens_per_prompt": median([float(t) for t in tokens]),
            "us_per_token": median([s / max(1, t) for s, t in zip(seconds, tokens, strict=True)])
            * 1e6,
        }
    out["word_level"]["exact"] = all(
        words.encode_prompt(word_prompt(p), False) == p for p in fleet.prompts[:4]
    )
    return out


def routes_main(url: str, prompts_file: Path, steps: int, interval: float) -> None:
    """The client child: per step, one request of each kind (prompt i % P at step i), on
    one keep-alive connection; latencies and matched blocks per kind."""
    import sys

    from kvindex.bench.e2e.probes import Client

    prompts = msgspec.msgpack.decode(prompts_file.read_bytes(), type=list[list[int]])
    client = Client(url)
    prepared = {
        kind: [client.prepare("POST", *request_body(kind, p)) for p in prompts] for kind in KINDS
    }
    for kind in KINDS:  # warm the connection, the handlers and the tokenizer up
        for request in prepared[kind][:3]:
            client.send(request)
    say({"op": "ready"})
    sys.stdin.readline()  # go
    clock = time.perf_counter
    latencies: dict[str, list[float]] = {kind: [] for kind in KINDS}
    answers: dict[str, list[dict[str, int]]] = {kind: [] for kind in KINDS}
    for i in paced_steps(steps, interval):
        for kind in KINDS:
            start = clock()
            answer = client.send(prepared[kind][i % len(prompts)])
            latencies[kind].append(clock() - start)
            rows = msgspec.json.decode(answer)["instances"]
            answers[kind].append({row["name"]: row["matched_blocks"] for row in rows})
    client.close()
    say({"op": "done", "latencies": latencies, "answers": answers})
