"""Prompts and chat messages as token ids, per model: what a router holds, made lookupable.

A model's tokenizer is one of two kinds (`serve --tokenizer MODEL=PATH|vllm`):

- **local** (`PATH`: a Hugging Face model directory or a `tokenizer.json`): the `tokenizers`
  library loads `tokenizer.json`; chat messages are rendered with the chat template of the
  model's `tokenizer_config.json` (or `chat_template.jinja` / `chat_template.json` beside
  it) the way transformers' `apply_chat_template` renders it (jinja2's immutable sandbox,
  `trim_blocks`, `lstrip_blocks`, the loop controls, its `tojson`, `raise_exception` and
  `strftime_now`, the special tokens as variables), then tokenized without adding special
  tokens, as vLLM's chat route does. A prompt is tokenized with them (`add_special_tokens`,
  vLLM's default for a completion). Needs the `tokenize` extra (`tokenizers`, `jinja2`).
- **the engine's own** (`vllm`): `POST /tokenize` on an instance of that model (its spec's
  `http=` URL), vLLM's own tokenization exactly, chat template and all.

Messages are normalized as vLLM normalizes them before its template: text parts of a
content list joined by newlines for a template that reads `content` as a string (or kept as
`{"type": "text", "text": ...}` parts for one that loops over them), tool-call arguments
given as JSON text parsed into objects, a `developer` message made a `system` one for a
template that does not know the role. Images and other non-text parts can only be
tokenized by the engine (their placeholders are the model processor's).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from kvindex.runtime.prefix_tokens import DEFAULT_MAX_BYTES, CacheStats, PrefixTokens, safe_markers
from kvindex.security.engines import engine_hosts

if TYPE_CHECKING:
    from kvindex.runtime.fleet import Fleet

__all__ = [
    "ENGINE",
    "Chat",
    "EngineTokenizer",
    "LocalTokenizer",
    "NoTokenizer",
    "TokenizeFailed",
    "Tokenizer",
    "TokenizerError",
    "Tokenizers",
    "parse_tokenizer_option",
]

log = logging.getLogger(__name__)

ENGINE = "vllm"  # `--tokenizer MODEL=vllm`: ask the instance's own POST /tokenize
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_OFFLOAD_TO_THREAD = 64 * 1024  # characters: longer texts are tokenized off the loop


class TokenizerError(ValueError):
    """A tokenizer that can't be loaded or configured (a usage error at start)."""


class NoTokenizer(LookupError):
    """No tokenizer is configured for the model asked for."""


class TokenizeFailed(Exception):
    """The prompt or messages could not be tokenized: `status` is the HTTP status that
    says whose fault it is (4xx: the request's; 502/503: the engine's or its absence)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Chat:
    """OpenAI chat messages and the template switches of vLLM's `/tokenize`, with its
    defaults (a generation prompt, no special tokens beyond the template's)."""

    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tools: Sequence[Mapping[str, Any]] | None = None

    def check(self) -> None:
        if not self.messages:
            raise TokenizeFailed(422, "messages must hold at least one message")
        if self.continue_final_message and self.add_generation_prompt:
            raise TokenizeFailed(
                422, "continue_final_message and add_generation_prompt can't both be true"
            )

    def engine_body(self) -> dict[str, Any]:
        """The body of vLLM's `POST /tokenize` for these messages."""
        body: dict[str, Any] = {
            "messages": list(self.messages),
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "add_special_tokens": self.add_special_tokens,
        }
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        if self.tools is not None:
            body["tools"] = list(self.tools)
        return body


class Tokenizer(Protocol):
    """How one model's prompts become token ids."""

    kind: str  # "local" or "vllm"

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, chat: Chat) -> list[int]: ...

    async def aencode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]: ...

    async def aencode_chat(self, chat: Chat) -> list[int]: ...


# -- local: tokenizers + a chat template ---------------------------------------------------


class LocalTokenizer:
    """A Hugging Face tokenizer read from disk (`tokenizer.json` and its config)."""

    kind = "local"

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | dict[str, str] | None,
        special_tokens: dict[str, Any],
        source: str,
        cache_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self._tokenizer = tokenizer
        self._templates = chat_template
        self._special = special_tokens
        self.source = source
        self.prefixes = PrefixTokens(self._raw, _cacheable(tokenizer), cache_bytes)
        self._wrap = _special_wrap(tokenizer) if self.prefixes.enabled else None

    @classmethod
    def load(cls, path: str | Path, cache_bytes: int = DEFAULT_MAX_BYTES) -> LocalTokenizer:
        """From a model directory (holding `tokenizer.json`) or a `tokenizer.json`; the
        chat template and special tokens from the files beside it."""
        try:
            from tokenizers import Tokenizer as HfTokenizer
        except ImportError:
            raise TokenizerError(
                "a tokenizer from a file needs the tokenizers library: "
                "pip install 'kvindex[tokenize]'"
            ) from None
        where = Path(path)
        file = where / "tokenizer.json" if where.is_dir() else where
        if not file.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json there")
        try:
            tokenizer = HfTokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own types for a bad file
            raise TokenizerError(
                f"{file}: not a tokenizer.json the tokenizers library reads: {exc}"
            ) from None
        folder = file.parent
        config = _read_json(folder / "tokenizer_config.json")
        special = _special_tokens(config, _read_json(folder / "special_tokens_map.json"))
        template = _chat_template(folder, config)
        return cls(tokenizer, template, special, str(file), cache_bytes)

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's ids, through the prefix cache (`kvindex.runtime.prefix_tokens`):
        special tokens, where asked for, are what the tokenizer's post-processor adds
        around any text (found at load; without such a fixed wrap, a full encoding)."""
        if not add_special_tokens:
            return self.prefixes.encode(prompt)
        if self._wrap is None:
            ids: list[int] = self._tokenizer.encode(prompt, add_special_tokens=True).ids
            return ids
        before, after = self._wrap
        return [*before, *self.prefixes.encode(prompt), *after]

    def cache_stats(self) -> CacheStats:
        return self.prefixes.stats()

    def _raw(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def encode_chat(self, chat: Chat) -> list[int]:
        text = self.render(chat)
        return self.encode_prompt(text, add_special_tokens=chat.add_special_tokens)

    async def aencode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """As `encode_prompt`; what is left to tokenize after the prefix cache is tokenized
        off the event loop when it is long."""
        if add_special_tokens and self._wrap is None:
            return await self._athread(self.encode_prompt, prompt, True)
        plan = self.prefixes.plan(prompt)
        ids = plan.ids
        if ids is None:
            ids = self.prefixes.complete(plan, await self._athread(self._raw, plan.rest))
        if ids is None:
            plan = plan.missed()
            ids = self.prefixes.complete(plan, await self._athread(self._raw, plan.rest))
        assert ids is not None  # a missed plan always completes
        if not add_special_tokens or self._wrap is None:
            return ids
        before, after = self._wrap
        return [*before, *ids, *after]

    async def _athread(self, fn: Callable[..., list[int]], text: str, *more: Any) -> list[int]:
        if len(text) < _OFFLOAD_TO_THREAD:
            return fn(text, *more)
        return await asyncio.to_thread(fn, text, *more)

    async def aencode_chat(self, chat: Chat) -> list[int]:
        text = self.render(chat)
        return await self.aencode_prompt(text, chat.add_special_tokens)

    def template(self, tools: bool = False) -> str:
        """The chat template to render with (the `tool_use` one of several, with tools)."""
        templates = self._templates
        if templates is None:
            raise TokenizeFailed(
                422, f"the tokenizer {self.source} has no chat template: send a prompt instead"
            )
        if isinstance(templates, str):
            return templates
        if tools and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise TokenizeFailed(
            422, f"the tokenizer {self.source} has several chat templates, none default"
        )

    def render(self, chat: Chat) -> str:
        """The messages as the model's chat template writes them (a string)."""
        chat.check()
        template = self.template(tools=chat.tools is not None)
        messages = normalize_messages(chat.messages, template)
        variables = {**self._special, **dict(chat.chat_template_kwargs)}
        try:
            return _render(
                template,
                messages,
                tools=list(chat.tools) if chat.tools is not None else None,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                variables=variables,
            )
        except TokenizeFailed:
            raise
        except Exception as exc:  # the template's own raise_exception, or a bad variable
            raise TokenizeFailed(422, f"the chat template refused the messages: {exc}") from None


def _cacheable(tokenizer: Any) -> dict[str, int]:
    """The markers the prefix cache may cut at; none (no cache) for a tokenizer that
    truncates or pads (an encoding's length is then not its text's)."""
    if getattr(tokenizer, "truncation", None) or getattr(tokenizer, "padding", None):
        return {}
    return safe_markers(tokenizer)


def _special_wrap(tokenizer: Any) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after any text (BOS, EOS...), if the
    same for several probes; None if it depends on the text."""
    wraps = set()
    for probe in ("a", "hello world", " x\n\ny ", "0"):
        raw = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe, add_special_tokens=True).ids
        at = next(
            (i for i in range(len(full) - len(raw) + 1) if full[i : i + len(raw)] == raw), None
        )
        if not raw or at is None:
            return None
        wraps.add((tuple(full[:at]), tuple(full[at + len(raw) :])))
    if len(wraps) != 1:
        return None
    before, after = wraps.pop()
    return list(before), list(after)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: can't read it: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    return data


def _token_text(value: Any) -> Any:
    """A special token as the config writes it: a string, or an AddedToken object."""
    if isinstance(value, dict) and "content" in value:
        return value["content"]
    return value


def _special_tokens(config: dict[str, Any], special_map: dict[str, Any]) -> dict[str, Any]:
    """The variables a chat template sees besides the messages: the special tokens (as
    transformers' `special_tokens_map` gives them, the map file over the config)."""
    out: dict[str, Any] = {}
    for source in (config, special_map):
        for key in _SPECIAL_TOKENS:
            if source.get(key) is not None:
                out[key] = _token_text(source[key])
        extra = source.get("additional_special_tokens")
        if isinstance(extra, list) and extra:
            out["additional_special_tokens"] = [_token_text(t) for t in extra]
    return out


def _chat_template(folder: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The chat template(s): `chat_template.jinja` (transformers 4.43+ saves it so), else
    `chat_template.json`, else `tokenizer_config.json`'s `chat_template` (a string or a
    list of named templates)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    found = _read_json(folder / "chat_template.json").get("chat_template")
    if found is None:
        found = config.get("chat_template")
    if found is None or isinstance(found, str):
        return found
    if isinstance(found, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in found
    ):
        return {t["name"]: t["template"] for t in found}
    raise TokenizerError(f"{folder}: chat_template must be a string or a list of named templates")


# -- the chat template, as transformers renders it ------------------------------------------


_compiled: dict[str, Any] = {}


def _environment() -> Any:
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise TokenizeFailed(
            503, "rendering chat templates needs jinja2: pip install 'kvindex[tokenize]'"
        ) from None

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant tracker): the
        body as it is (the mask it tracks is not needed to tokenize)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # transformers' own: no HTML escaping, and the same options
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _compile(template: str) -> Any:
    compiled = _compiled.get(template)
    if compiled is None:
        if len(_compiled) > 32:  # templates given per request are not kept forever
            _compiled.clear()
        compiled = _compiled[template] = _environment().from_string(template)
    return compiled


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _render(
    template: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[Any] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    variables: dict[str, Any],
) -> str:
    """transformers' `render_jinja_template` for one conversation."""
    if continue_final_message:
        # As transformers does: mark the end of the last message, cut the rendering there.
        last = messages[-1]
        content = last.get("content")
        if isinstance(content, str):
            last["content"] = content + _CONTINUE_TAG
        else:
            raise TokenizeFailed(422, "continue_final_message needs a final message with text")
    text: str = _compile(template).render(
        messages=messages,
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    if continue_final_message:
        where = text.rfind(_CONTINUE_TAG.strip())
        if where < 0:
            raise TokenizeFailed(422, "the chat template dropped the final message to continue")
        if text[where : where + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            text = text[:where]
        else:
            text = text[:where].rstrip()
    return text


def _reads_content_parts(template: str) -> bool:
    """Whether a template loops over a message's `content` (vLLM's "openai" content
    format: text parts stay a list of parts) rather than printing it as a string."""
    import jinja2.nodes

    try:
        tree = _environment().parse(template)
    except Exception:
        return False
    for loop in tree.find_all(jinja2.nodes.For):
        node = loop.iter
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
            return True
        if (
            isinstance(node, jinja2.nodes.Getitem)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content"
        ):
            return True
    return False


_content_parts: dict[str, bool] = {}


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], template: str
) -> list[dict[str, Any]]:
    """OpenAI messages as vLLM hands them to a chat template (see the module doc)."""
    parts_format = _content_parts.get(template)
    if parts_format is None:
        parts_format = _content_parts[template] = _reads_content_parts(template)
    knows_developer = re.search(r"""["']developer["']""", template) is not None
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise TokenizeFailed(422, f"messages[{i}] must be an object with a string 'role'")
        out.append(_normalize(message, i, parts_format, knows_developer))
    return out


def _normalize(
    message: Mapping[str, Any], i: int, parts_format: bool, knows_developer: bool
) -> dict[str, Any]:
    role = message["role"]
    texts = _texts(message.get("content"), i)
    result: dict[str, Any] = {"role": role}
    if parts_format and role != "tool":
        result["content"] = [{"type": "text", "text": t} for t in texts]
    else:
        result["content"] = "\n".join(texts)
    if role == "assistant":
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            result["tool_calls"] = [_tool_call(call, i) for call in calls]
        reasoning = message.get("reasoning")
        if isinstance(reasoning, str):
            result["reasoning"] = result["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        result["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    if role == "developer" and not knows_developer:
        result["role"] = "system"
    return result


def _texts(content: Any, i: int) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise TokenizeFailed(422, f"messages[{i}].content must be a string or a list of parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise TokenizeFailed(
                422,
                f"messages[{i}] has a {kind!r} part: only the engine's tokenizer renders "
                "non-text content (--tokenizer MODEL=vllm)",
            )
    return texts


def _tool_call(call: Any, i: int) -> Any:
    if not isinstance(call, dict):
        raise TokenizeFailed(422, f"messages[{i}].tool_calls entries must be objects")
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError:
            parsed = {}
        function = {**function, "arguments": parsed if isinstance(parsed, dict) else {}}
    elif arguments is None:
        function = {**function, "arguments": {}}
    return {**call, "function": function}


# -- the engine's own: POST /tokenize --------------------------------------------------------


class EngineTokenizer:
    """vLLM's `POST /tokenize` on an instance serving the model: `urls()` gives the base
    URLs to try, in order (the next one when one can't be reached)."""

    kind = ENGINE

    def __init__(self, model: str, urls: Callable[[], list[str]], timeout: float = 10.0) -> None:
        self.model = model
        self._urls = urls
        self._timeout = timeout
        self._client: httpx.Client | None = None
        self._async: httpx.AsyncClient | None = None

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self._ask({"prompt": prompt, "add_special_tokens": add_special_tokens})

    def encode_chat(self, chat: Chat) -> list[int]:
        chat.check()
        return self._ask(chat.engine_body())

    async def aencode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return await self._aask({"prompt": prompt, "add_special_tokens": add_special_tokens})

    async def aencode_chat(self, chat: Chat) -> list[int]:
        chat.check()
        return await self._aask(chat.engine_body())

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    async def aclose(self) -> None:
        if self._async is not None:
            await self._async.aclose()
            self._async = None

    def _targets(self) -> list[str]:
        # Each call asks the engine allow-list: a host dropped from it is called no more.
        urls = [url for url in self._urls() if engine_hosts.allows_url(url)]
        if not urls:
            raise TokenizeFailed(
                503,
                f"no instance of model {self.model!r} has an http= URL to tokenize with "
                "(its vLLM server, e.g. http=http://HOST:8000, on an allowed engine host)",
            )
        return [url.rstrip("/") + "/tokenize" for url in urls]

    def _ask(self, body: dict[str, Any]) -> list[int]:
        if self._client is None:
            self._client = httpx.Client(timeout=self._timeout)
        failures = []
        for url in self._targets():
            try:
                reply = self._client.post(url, json=body)
            except httpx.HTTPError as exc:
                failures.append(f"{url}: {exc or type(exc).__name__}")
                continue
            return _tokens(url, reply.status_code, reply.content)
        raise TokenizeFailed(502, "no engine answered /tokenize: " + "; ".join(failures))

    async def _aask(self, body: dict[str, Any]) -> list[int]:
        if self._async is None:
            self._async = httpx.AsyncClient(timeout=self._timeout)
        failures = []
        for url in self._targets():
            try:
                reply = await self._async.post(url, json=body)
            except httpx.HTTPError as exc:
                failures.append(f"{url}: {exc or type(exc).__name__}")
                continue
            return _tokens(url, reply.status_code, reply.content)
        raise TokenizeFailed(502, "no engine answered /tokenize: " + "; ".join(failures))


def _tokens(url: str, status: int, content: bytes) -> list[int]:
    """The token ids of vLLM's answer (`{"tokens": [...], "count", "max_model_len"}`); its
    error for the request (4xx) as the request's, anything else as the engine's."""
    try:
        data = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    # A failed call's body stays in the log, never in the answer: `http=` may name any
    # server the allow-list lets through, and its pages are not the client's to read.
    if 400 <= status < 500 and status not in (404, 405):  # no /tokenize there: not the request's
        log.info("%s refused a /tokenize request (%d): %s", url, status, _said(data, content))
        raise TokenizeFailed(
            422 if status == 422 else 400,
            f"the engine refused it (HTTP {status}; its message is in kvindex's log)",
        )
    if status != 200 or not isinstance(data, dict):
        log.warning("%s answered /tokenize with %d: %s", url, status, _said(data, content))
        raise TokenizeFailed(502, f"{url} answered {status}")
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise TokenizeFailed(502, f"{url} answered without a list of token ids")
    return tokens


def _said(data: Any, content: bytes) -> str:
    """The message of a vLLM error body (`{"error": {"message"}}`, or FastAPI's detail)."""
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])[:300]
        for key in ("message", "detail", "error"):
            if data.get(key) is not None:
                return str(data[key])[:300]
    return content[:300].decode("utf-8", "replace")


# -- per model ------------------------------------------------------------------------------


def parse_tokenizer_option(text: str) -> tuple[str, str]:
    """`MODEL=PATH` or `MODEL=vllm` -> (model, source); raises TokenizerError."""
    model, sep, source = text.partition("=")
    if not sep or not model or not source:
        raise TokenizerError(f"--tokenizer {text!r} must be MODEL=PATH or MODEL={ENGINE}")
    return model, source


class Tokenizers:
    """The tokenizer of each model (`add`), and the prompts and messages they encode.

    `fleet` gives the engine tokenizer its URLs: the `http=` of the model's instances,
    the live ones first."""

    def __init__(self, fleet: Fleet | None = None, cache_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._fleet = fleet
        self._by_model: dict[str, Tokenizer] = {}
        self.cache_bytes = cache_bytes  # each local tokenizer's prefix cache

    def add(self, model: str, source: str) -> Tokenizer:
        """`source` is a path (a local tokenizer, loaded now) or `vllm`."""
        if model in self._by_model:
            raise TokenizerError(f"model {model!r} has a tokenizer already")
        tokenizer: Tokenizer
        if source == ENGINE:
            tokenizer = EngineTokenizer(model, lambda: self._engine_urls(model))
        else:
            tokenizer = LocalTokenizer.load(source, self.cache_bytes)
        self._by_model[model] = tokenizer
        return tokenizer

    def cache_stats(self) -> dict[str, CacheStats]:
        """Each local tokenizer's prefix cache, by model."""
        return {
            model: t.cache_stats()
            for model, t in sorted(self._by_model.items())
            if isinstance(t, LocalTokenizer)
        }

    def models(self) -> dict[str, str]:
        """Each model with a tokenizer, and its kind (`local` or `vllm`)."""
        return {model: t.kind for model, t in sorted(self._by_model.items())}

    def default_model(self) -> str | None:
        """The model a prompt without one is for: the only model with a tokenizer."""
        return next(iter(self._by_model)) if len(self._by_model) == 1 else None

    def get(self, model: str | None) -> tuple[str, Tokenizer]:
        """The model (the default one for None) and its tokenizer; raises NoTokenizer."""
        name = model if model is not None else self.default_model()
        if name is None:
            if not self._by_model:
                raise NoTokenizer("no tokenizer is configured (serve --tokenizer MODEL=PATH|vllm)")
            raise NoTokenizer("say which model the prompt is for ('model')")
        tokenizer = self._by_model.get(name)
        if tokenizer is None:
            raise NoTokenizer(
                f"no tokenizer is configured for model {name!r} "
                f"(serve --tokenizer {name}=PATH|{ENGINE})"
            )
        return name, tokenizer

    def _engine_urls(self, model: str) -> list[str]:
        if self._fleet is None:
            return []
        from kvindex.subscriber import Status

        specs = [s for s in list(self._fleet.specs.values()) if s.model == model and s.http]
        live = {s.name for s in specs if self._fleet.status(s.name) == Status.LIVE}
        specs.sort(key=lambda s: (s.name not in live, s.name))
        return [s.http for s in specs if s.http]

    async def aclose(self) -> None:
        for tokenizer in self._by_model.values():
            if isinstance(tokenizer, EngineTokenizer):
                await tokenizer.aclose()

    def close(self) -> None:
        for tokenizer in self._by_model.values():
            if isinstance(tokenizer, EngineTokenizer):
                tokenizer.close()
