"""Prompts and chat messages as token ids: a real tokenizer built on the fly (no download)
and a real HTTP server answering `POST /tokenize` as vLLM does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from httpfixture import FakeEngine, serve_engine
from netutil import free_port
from tokenizer_fixture import PARTS, build_tokenizer
from tokenizers import Tokenizer as HfTokenizer

from kvindex.runtime.tokenize import (
    Chat,
    EngineTokenizer,
    LocalTokenizer,
    NoTokenizer,
    TokenizeFailed,
    TokenizerError,
    Tokenizers,
    parse_tokenizer_option,
)

pytestmark = pytest.mark.timeout(60)

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [{"type": "text", "text": "What is the capital"}, "of France?"]},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "model")


@pytest.fixture(scope="module")
def parts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "parts", template=PARTS)


def test_a_prompt_is_what_the_tokenizers_library_makes_of_it(model_dir: Path) -> None:
    tok = LocalTokenizer.load(model_dir)
    raw = HfTokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = "Route each request to the instance that already holds its prefix."
    assert tok.encode_prompt(prompt) == raw.encode(prompt).ids
    assert tok.encode_prompt(prompt)[0] == raw.token_to_id("<s>")  # BOS, as vLLM adds it
    assert (
        tok.encode_prompt(prompt, add_special_tokens=False)
        == raw.encode(prompt, add_special_tokens=False).ids
    )
    # the tokenizer.json itself names the same tokenizer
    assert LocalTokenizer.load(model_dir / "tokenizer.json").encode_prompt(prompt) == (
        tok.encode_prompt(prompt)
    )


def test_chat_messages_are_rendered_by_the_template_then_tokenized_without_specials(
    model_dir: Path,
) -> None:
    tok = LocalTokenizer.load(model_dir)
    text = tok.render(Chat(MESSAGES))
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital\nof France?<|im_end|>\n"  # parts joined by \n
        "<|im_start|>assistant\n"
    )
    raw = HfTokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.encode_chat(Chat(MESSAGES)) == raw.encode(text, add_special_tokens=False).ids
    no_prompt = tok.render(Chat(MESSAGES, add_generation_prompt=False))
    assert not no_prompt.endswith("assistant\n")
    # continue_final_message: the last message left open, as transformers cuts it
    cont = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    open_text = tok.render(Chat(cont, add_generation_prompt=False, continue_final_message=True))
    assert open_text.endswith("<|im_start|>assistant\nThe capital is")


def test_a_template_over_content_parts_sees_parts_special_tokens_and_tool_calls(
    parts_dir: Path,
) -> None:
    tok = LocalTokenizer.load(parts_dir)
    call = {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [
        {"role": "developer", "content": "Be brief."},  # unknown to the template: system
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    text = tok.render(Chat(messages))
    assert text.startswith("<s><|im_start|>system\nBe brief.<|im_end|>\n")
    assert "<|im_start|>user\nab<|im_end|>" in text  # parts kept as parts, looped over
    assert '"arguments": {"x": 1}' in text  # JSON arguments parsed, tojson unescaped
    with pytest.raises(TokenizeFailed, match="unknown role robot") as err:
        tok.render(Chat([{"role": "robot", "content": "hi"}]))
    assert err.value.status == 422


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "at least one message"),
        ([{"content": "no role"}], "string 'role'"),
        ([{"role": "user", "content": 5}], "string or a list of parts"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "only the engine's tokenizer",
        ),
    ],
)
def test_bad_messages_are_the_requests_fault(
    model_dir: Path, messages: list[dict[str, object]], message: str
) -> None:
    with pytest.raises(TokenizeFailed, match=message) as err:
        LocalTokenizer.load(model_dir).encode_chat(Chat(messages))
    assert err.value.status == 422


def test_loading_errors_are_usage_errors(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        LocalTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"not a tokenizer\.json"):
        LocalTokenizer.load(tmp_path)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    with pytest.raises(TokenizeFailed, match="no chat template") as err:
        LocalTokenizer.load(bare).encode_chat(Chat(MESSAGES))
    assert err.value.status == 422
    assert LocalTokenizer.load(bare).encode_prompt("Paris")  # prompts still work
    with pytest.raises(TokenizerError, match="MODEL=PATH"):
        parse_tokenizer_option("no-equals")
    assert parse_tokenizer_option("m=vllm") == ("m", "vllm")


def test_tokenizers_per_model_and_the_default(model_dir: Path) -> None:
    tokenizers = Tokenizers()
    with pytest.raises(NoTokenizer, match="no tokenizer is configured"):
        tokenizers.get(None)
    tokenizers.add("llama", str(model_dir))
    assert tokenizers.get(None)[0] == "llama"  # the only one is the default
    with pytest.raises(NoTokenizer, match="for model 'qwen'"):
        tokenizers.get("qwen")
    tokenizers.add("qwen", "vllm")
    assert tokenizers.models() == {"llama": "local", "qwen": "vllm"}
    with pytest.raises(NoTokenizer, match="say which model"):
        tokenizers.get(None)
    with pytest.raises(TokenizerError, match="already"):
        tokenizers.add("qwen", str(model_dir))


def test_the_engines_own_tokenize_gives_its_tokens(model_dir: Path) -> None:
    local = LocalTokenizer.load(model_dir)
    engine = FakeEngine(local)
    dead = f"http://127.0.0.1:{free_port()}"  # refuses connections: the next URL is tried
    with serve_engine(engine) as url:
        tok = EngineTokenizer("m", lambda: [dead, url])
        try:
            prompt = "The capital of France is Paris."
            assert tok.encode_prompt(prompt) == local.encode_prompt(prompt)
            assert tok.encode_chat(Chat(MESSAGES)) == local.encode_chat(Chat(MESSAGES))
            assert asyncio.run(tok.aencode_prompt(prompt)) == local.encode_prompt(prompt)
            path, body = engine.requests[-1]
            assert path == "/tokenize" and body == {"prompt": prompt, "add_special_tokens": True}
            chat_body = next(b for p, b in engine.requests if b and "messages" in b)
            assert chat_body["add_generation_prompt"] is True
            assert chat_body["add_special_tokens"] is False
            # the engine's 400 is the request's fault, with the engine's message
            with pytest.raises(TokenizeFailed, match="the engine refused it") as e:
                tok.encode_chat(Chat([{"role": "robot", "content": [{"type": "x"}]}]))
            assert e.value.status == 400
        finally:
            tok.close()
    with pytest.raises(TokenizeFailed, match="no engine answered") as err:
        EngineTokenizer("m", lambda: [dead]).encode_prompt("x")
    assert err.value.status == 502
    with pytest.raises(TokenizeFailed, match="http= URL") as err:
        EngineTokenizer("m", lambda: []).encode_prompt("x")
    assert err.value.status == 503


def test_an_engine_answer_without_tokens_is_the_engines_fault(model_dir: Path) -> None:
    engine = FakeEngine(None)  # answers 404 to /tokenize: not a vLLM server
    with serve_engine(engine) as url, pytest.raises(TokenizeFailed, match="answered 404") as err:
        EngineTokenizer("m", lambda: [url]).encode_prompt("x")
    assert err.value.status == 502
