"""The tokenizer prefix cache (issue 25): ids identical to a fresh tokenization, always,
over random texts and chat histories, on real tokenizer files built on the spot (byte-level
BPE with a ChatML template, and SentencePiece-style: a Metaspace pre-tokenizer that
prepends its space to the first section only, and a Llama-2 style normalizer); memory
bounded by its setting; the reuse it exists for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_fixture import CORPUS, build_tokenizer

from kvindex.runtime.tokenize import Chat, LocalTokenizer

tokenizers = pytest.importorskip("tokenizers")

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def _sentencepiece(folder: Path, style: str) -> Path:
    """A SentencePiece-style BPE: `metaspace` (prefix space on the first section only) or
    `llama` (a normalizer that prepends it and turns spaces into it, byte fallback)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if style == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback()])
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=specials)
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": MISTRAL}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    _ = trainers
    return folder


@pytest.fixture(scope="module", params=["bytelevel", "metaspace", "llama"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "bytelevel":
        build_tokenizer(folder)
    else:
        _sentencepiece(folder, request.param)
    fresh = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    return LocalTokenizer.load(folder), fresh


WORDS = st.sampled_from(
    ["the", " cache", "Paris", "\n", "\n\n", "  ", " ", "é", "日本", "'s", "?", "<|im_start|>",
     "<|im_end|>", "[INST]", "</s>", "<s>", "prefix", "▁x", "blocks.", "\t", "!!"]
)  # fmt: skip
TEXT = st.lists(WORDS, max_size=12).map("".join)
SCOPED = HealthCheck.function_scoped_fixture


@settings(max_examples=60, deadline=None, suppress_health_check=[SCOPED])
@given(turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=6), system=TEXT)
def test_chat_histories_tokenize_as_a_fresh_tokenizer_does(pair: tuple, turns, system) -> None:
    cached, fresh = pair
    messages: list[dict[str, str]] = []
    if system and cached.source.find("bytelevel") >= 0:
        messages.append({"role": "system", "content": system})
    for question, answer in turns:
        messages.append({"role": "user", "content": question})
        chat = Chat(messages)
        text = cached.render(chat)
        want = fresh.encode(text, add_special_tokens=False).ids
        assert cached.encode_chat(chat) == want
        messages.append({"role": "assistant", "content": answer})


@settings(max_examples=80, deadline=None, suppress_health_check=[SCOPED])
@given(pieces=st.lists(TEXT, min_size=1, max_size=5), cut=st.integers(0, 200), flag=st.booleans())
def test_texts_sharing_prefixes_tokenize_as_a_fresh_tokenizer_does(
    pair: tuple, pieces: list[str], cut: int, flag: bool
) -> None:
    cached, fresh = pair
    text = ""
    for piece in pieces:
        for candidate in (text + piece, (text + piece)[: cut % (len(text + piece) + 1)] + piece):
            got = cached.encode_prompt(candidate, add_special_tokens=flag)
            assert got == fresh.encode(candidate, add_special_tokens=flag).ids
        text += piece


def test_a_long_chat_reuses_its_history_and_memory_stays_bounded(tmp_path: Path) -> None:
    folder = build_tokenizer(tmp_path / "tok")
    fresh = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    small = LocalTokenizer.load(folder, cache_bytes=200_000)
    messages = [{"role": "system", "content": " ".join(CORPUS[:5]) * 4}]
    for turn in range(12):
        messages.append({"role": "user", "content": f"question {turn}: {CORPUS[turn % 5]}"})
        want = fresh.encode(small.render(Chat(messages)), add_special_tokens=False).ids
        assert small.encode_chat(Chat(messages)) == want
        messages.append({"role": "assistant", "content": CORPUS[(turn + 2) % 5] * 3})
        stats = small.cache_stats()
        assert stats.bytes <= stats.max_bytes == 200_000
    stats = small.cache_stats()
    assert stats.misses == 1 and stats.hits == 11  # only the first turn was tokenized whole
    assert stats.reused_tokens > 5 * stats.tokenized_tokens
    # the same text again: a whole hit; a cache of 0 bytes keeps nothing and still answers
    assert (
        small.encode_chat(Chat(messages))
        == fresh.encode(small.render(Chat(messages)), add_special_tokens=False).ids
    )
    off = LocalTokenizer.load(folder, cache_bytes=0)
    assert off.encode_chat(Chat(messages)) == small.encode_chat(Chat(messages))
    assert off.cache_stats().entries == 0 and off.cache_stats().bytes == 0


def test_serve_chat_lookups_reuse_the_cache_and_metrics_report_it(tmp_path: Path) -> None:
    """Through the HTTP API: every turn's chat lookup matches what the engine holds for
    the freshly tokenized chat, the cache serves the history, and /metrics reports its
    memory under its bound (--tokenizer-cache-mb's)."""
    from contextlib import ExitStack

    import httpx
    from httpfixture import serve_app
    from netutil import wait_until

    from kvindex.runtime import Fleet
    from kvindex.runtime.tokenize import Tokenizers
    from kvindex.service.app import create_app
    from kvindex.service.lookups import Routing
    from kvindex.subscriber import InstanceSpec
    from kvindex.wire import BlockStored
    from kvindex.wire.publisher import Publisher

    folder = build_tokenizer(tmp_path / "tok")
    fresh = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    with ExitStack() as stack:
        pub = stack.enter_context(Publisher("tcp://127.0.0.1:*"))
        fleet = Fleet([InstanceSpec("m0", pub.endpoint, model="m")])
        toks = Tokenizers(fleet, cache_bytes=1 << 20)
        toks.add("m", str(folder))
        url = stack.enter_context(serve_app(create_app(fleet, routing=Routing.of(fleet, toks))))
        client = stack.enter_context(httpx.Client(base_url=url, timeout=10))
        renderer = LocalTokenizer.load(folder, cache_bytes=0)
        messages = [{"role": "system", "content": " ".join(CORPUS[:5])}]
        held = 0
        for turn in range(4):
            messages.append({"role": "user", "content": CORPUS[turn % 5]})
            ids = fresh.encode(renderer.render(Chat(messages)), add_special_tokens=False).ids
            whole = len(ids) // 16
            hashes = [hash(tuple(ids[: 16 * (i + 1)])) for i in range(held, whole)]
            parent = hash(tuple(ids[: 16 * held])) if held else None
            pub.publish([BlockStored(hashes, parent, ids[16 * held : 16 * whole], 16)])
            held = whole
            assert wait_until(lambda w=whole: fleet.index.block_count("m0") == w, timeout=10)
            answer = client.post("/v1/lookup", json={"messages": messages, "model": "m"}).json()
            assert answer["instances"][0]["matched_blocks"] == whole
            messages.append({"role": "assistant", "content": CORPUS[(turn + 1) % 5]})
        metrics = client.get("/metrics").text
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("kvindex_tokenizer_cache_") and 'model="m"' in line
        }
        assert values["kvindex_tokenizer_cache_max_bytes"] == 1 << 20
        assert 0 < values["kvindex_tokenizer_cache_bytes"] <= 1 << 20
        assert values["kvindex_tokenizer_cache_hits_total"] == 3
        assert values["kvindex_tokenizer_cache_misses_total"] == 1
        assert values["kvindex_tokenizer_cache_reused_tokens_total"] > 0


def test_cache_size_by_flag_or_file_and_bad_ones_are_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    from kvindex.cli import build_parser
    from kvindex.cli.config import load_settings

    def settings(*argv: str) -> object:
        return load_settings(build_parser().parse_args(["serve", *argv])).tokenizer_cache_mb

    assert settings() is None  # the default, 64 MiB
    config = tmp_path / "k.toml"
    config.write_text("[server]\ntokenizer_cache_mb = 8\n")
    assert settings("--config", str(config)) == 8.0
    assert settings("--config", str(config), "--tokenizer-cache-mb", "0") == 0.0
    for argv, said in (
        (["--tokenizer-cache-mb", "-1"], "must be a number of MiB"),
        (["--config", str(tmp_path / "bad.toml")], "server.tokenizer_cache_mb must be"),
    ):
        (tmp_path / "bad.toml").write_text('[server]\ntokenizer_cache_mb = "big"\n')
        proc = subprocess.run(
            [sys.executable, "-m", "kvindex", "serve", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and said in proc.stderr
        assert len(proc.stderr.strip().splitlines()) <= 2  # argparse: usage + the error
