"""Every request and answer of the HTTP API, written once, as msgspec structs.

The same struct decodes a request body (msgspec: a 2,048-token prompt in ~50 us, errors
that name the element, `$.token_ids[3]`), encodes an answer, and is the OpenAPI schema of
both (`openapi_paths` below, from msgspec's JSON Schema): what the schema says is what the
server checks. Nothing here needs FastAPI: the lookup fast path in front of the app
decodes and encodes with the same structs and the same error shape (`error_body`).

Errors are always `{"error": "..."}`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

import msgspec

from kvindex.index.multimodal import MMFeature
from kvindex.runtime import InstanceMatch, InstanceView, LookupAnswer, RankMatch, RankView
from kvindex.runtime.approximate import ApproxStats
from kvindex.runtime.discovery import DiscoveryView
from kvindex.runtime.doctor import DoctorReport, Finding
from kvindex.runtime.finders import FleetChange, FoundBy
from kvindex.runtime.routing import RouteAnswer, ScoredAnswer
from kvindex.subscriber import InstanceSpec, SpecError, Status
from kvindex.subscriber.spec import DISCOVERY_SCHEMES

__all__ = [
    "MAX_LOOKUP_ITEMS",
    "MAX_TOKEN_ID",
    "AddInstanceByFields",
    "AddInstanceBySpec",
    "BadBody",
    "BlocksAnswer",
    "ChatLookupRequest",
    "ErrorAnswer",
    "HashLookupRequest",
    "HealthAnswer",
    "InstanceAnswer",
    "InstancesAnswer",
    "LookupRequest",
    "MMInput",
    "PromptLookupRequest",
    "decode_body",
    "decode_lookup",
    "encode",
    "error_body",
    "instance_answer",
    "mm_keys",
    "schema_components",
    "spec_of",
]

MAX_LOOKUP_ITEMS = 1_000_000  # token ids or block hashes in one lookup
# Token ids are vocabulary indices; the bound is JSON's largest exact integer, so that the
# documented maximum means the same to every JSON parser (a client's, a schema checker's).
MAX_TOKEN_ID = 2**53 - 1
MAX_PROMPT_CHARS = 16 * 1024 * 1024  # a prompt to tokenize (the body limit bounds it too)
# A hash as `render_hash` writes it: decimal (an int) or lowercase hex (bytes).
HASH_PATTERN = r"^([0-9]{1,20}|-[0-9]{1,18}|([0-9a-f]{2}){1,128})$"

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
Name = Annotated[str, msgspec.Meta(max_length=1024)]


# -- requests ---------------------------------------------------------------------------

MAX_MM_INPUTS = 100_000  # multimodal inputs of one prompt


class MMInput(msgspec.Struct, forbid_unknown_fields=True):
    """One multimodal input of the prompt as vLLM's request holds it: its identifier (the
    `MultiModalFeatureSpec`'s, the input's hash) and its placeholder tokens' `offset` and
    `length` (`PlaceholderRange`)."""

    identifier: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    offset: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
    length: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]


# One multimodal key of a block as vLLM's events carry it: [identifier, offset in the block]
# (0.20 on), or the bare identifier (0.17-0.19). (No length bound on the strings: msgspec
# 0.22 mis-decodes a constrained str in a union with a tuple; the body limit bounds them.)
MMKeyBody = str | tuple[str, int]
MMFeatures = Annotated[list[MMInput], msgspec.Meta(max_length=MAX_MM_INPUTS)]
ExtraKeys = Annotated[
    list[Annotated[list[MMKeyBody], msgspec.Meta(max_length=1024)] | None],
    msgspec.Meta(max_length=MAX_LOOKUP_ITEMS),
]


class LookupRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /v1/lookup`: the prompt's token ids; `lora_name` and `cache_salt` name the
    namespace its blocks were cached under (salted or LoRA blocks match only a lookup
    that names the same). An image prompt's blocks from its first image on match only with
    its multimodal keys: `mm_features` (its inputs; each block's keys derived as vLLM
    0.33 derives them) or `extra_keys` (per block, its multimodal keys as the events carry
    them), not both."""

    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_LOOKUP_ITEMS)]
    lora_name: Name | None = None
    cache_salt: Name | None = None
    # Only that model's instances answer (`model=` in their specs); a model no instance
    # serves is a 404.
    model: Name | None = None
    # Answer with the routing score (kvindex.runtime.routing): `best` follows it, `why`
    # says how it won, predicted blocks counted.
    score: bool = False
    mm_features: MMFeatures | None = None
    extra_keys: ExtraKeys | None = None


class PromptLookupRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /v1/lookup` by text: the model's tokenizer (`serve --tokenizer`) makes the
    token ids, with the special tokens a completion gets (vLLM's default)."""

    prompt: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]
    model: Name | None = None  # may be left out when one model has a tokenizer
    lora_name: Name | None = None
    cache_salt: Name | None = None
    add_special_tokens: bool = True
    score: bool = False
    mm_features: MMFeatures | None = None
    extra_keys: ExtraKeys | None = None


class ChatLookupRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /v1/lookup` by OpenAI chat messages, rendered by the model's chat template as
    vLLM's `/tokenize` renders them (the same switches and defaults)."""

    messages: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1, max_length=100_000)]
    model: Name | None = None
    lora_name: Name | None = None
    cache_salt: Name | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    score: bool = False
    mm_features: MMFeatures | None = None
    extra_keys: ExtraKeys | None = None


class HashLookupRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /v1/lookup/hashes`: block hashes, written as the API writes them."""

    # The pattern is documented, and checked by parse_hash (a 400 naming the bad hash).
    block_hashes: Annotated[
        list[
            Annotated[
                str, msgspec.Meta(max_length=256, extra_json_schema={"pattern": HASH_PATTERN})
            ]
        ],
        msgspec.Meta(max_length=MAX_LOOKUP_ITEMS),
    ]


# -- the peers' API (Dynamo's standalone indexer: docs/peers.md) ---------------------------

_U32 = 2**32 - 1
_I64 = 2**63 - 1
_ENDPOINT = r"^(tcp|ipc|inproc)://\S+$"


class RegisterRequest(msgspec.Struct):
    """Dynamo's `POST /register`: one worker's DP rank."""

    instance_id: Annotated[int, msgspec.Meta(ge=0)]
    endpoint: Annotated[str, msgspec.Meta(max_length=1024, pattern=_ENDPOINT)]
    model_name: Annotated[str, msgspec.Meta(pattern=r"^[^\s,=]{1,256}$")]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    replay_endpoint: Annotated[str, msgspec.Meta(max_length=1024, pattern=_ENDPOINT)] | None = None
    dp_rank: Annotated[int, msgspec.Meta(ge=0, le=1023)] = 0
    routing_group: Annotated[str, msgspec.Meta(max_length=256)] = "default"
    tenant_id: Any = None  # accepted and ignored, as Dynamo does
    additional_salt: str | None = None
    additionalsalt: str | None = None


class UnregisterRequest(msgspec.Struct):
    instance_id: Annotated[int, msgspec.Meta(ge=0)]
    model_name: Annotated[str, msgspec.Meta(max_length=256)]
    routing_group: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    dp_rank: Annotated[int, msgspec.Meta(ge=0, le=1023)] | None = None


class QueryRequest(msgspec.Struct):
    token_ids: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0, le=_U32)]], msgspec.Meta(max_length=MAX_LOOKUP_ITEMS)
    ]
    model_name: Annotated[str, msgspec.Meta(max_length=256)]
    routing_group: Annotated[str, msgspec.Meta(max_length=256)] = "default"
    lora_name: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    tenant_id: Any = None
    # kvindex's own (Dynamo ignores unknown fields): an image prompt's multimodal keys, as
    # in /v1/lookup
    mm_features: MMFeatures | None = None
    extra_keys: ExtraKeys | None = None


class QueryByHashRequest(msgspec.Struct):
    block_hashes: Annotated[
        list[Annotated[int, msgspec.Meta(ge=-_I64 - 1, le=_I64)]],
        msgspec.Meta(max_length=MAX_LOOKUP_ITEMS),
    ]
    model_name: Annotated[str, msgspec.Meta(max_length=256)]
    routing_group: Annotated[str, msgspec.Meta(max_length=256)] = "default"
    lora_name: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    # Refused (400, Dynamo's words) when given: the hashes carry the salt in their seed.
    # Documented as null only; decoded as any string so that the refusal is Dynamo's.
    cache_salt: Annotated[
        str | None,
        msgspec.Meta(
            extra_json_schema={
                "type": "null",
                "description": "not accepted: the block hashes carry the salt (400)",
            },
        ),
    ] = None


class PeerInstance(msgspec.Struct):
    """The Mooncake RFC's per-worker detail: matched tokens, cumulative over tiers."""

    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int


class QueryAnswer(msgspec.Struct):
    scores: dict[str, dict[str, int]]
    frequencies: list[int]
    instances: dict[str, PeerInstance]


class PeerStatus(msgspec.Struct):
    status: str


class AddInstanceBySpec(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /v1/instances` with a spec: `NAME=EP[,replay=EP][,topic=T][,dp=N]`, or an
    SGLang engine by its URL, `NAME=sglang+http://HOST:PORT` (its publishers are read from
    its /server_info)."""

    spec: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class AddInstanceByFields(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /v1/instances` field by field."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    endpoint: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    replay_endpoint: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    topic: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    dp: int | None = None


# -- answers ----------------------------------------------------------------------------


class ErrorAnswer(msgspec.Struct):
    error: str


class HealthAnswer(msgspec.Struct, omit_defaults=True):
    """`ok`, or `degraded` (lookups still answered from memory) with the reason; `starting`
    (503) until `min_engines` found engines are live."""

    status: Literal["ok", "degraded", "starting"]
    reason: str | None = None


class InstanceAnswer(msgspec.Struct):
    """One instance: status (the worst of its DP ranks), counters summed over ranks,
    blocks (the union over ranks), and each rank's detail."""

    name: str
    status: Status
    last_seq: int | None
    blocks: int
    gaps: int
    replayed_batches: int
    lost_batches: int
    decode_errors: int
    publisher_restarts: int
    # Messages that are not vLLM's frame layout (skipped), ZMTP/CURVE handshakes the links
    # failed, replay requests that ended without all they asked for, and replay answers
    # refused (a seq not asked for or out of order, a batch the live stream contradicts,
    # no reply, past the deadline or byte budget).
    malformed_messages: int
    handshake_failures: int
    replay_failures: int
    replay_refusals: int
    dp: int
    endpoint: str
    replay_endpoint: str | None
    topic: str
    spec: str
    blocks_by_medium: dict[str, int]
    # The same blocks per tier: gpu, cpu, disk, external (every engine's medium names map
    # to these).
    blocks_by_tier: dict[str, int]
    stored: int
    removed: int
    clears: int
    batches: int
    ingest_lag_seconds: float | None
    last_batch_age_seconds: float | None
    # Why the publisher can't be followed (a host that doesn't resolve, nothing
    # listening, a refused CURVE handshake), once diagnosed; null otherwise.
    problem: str | None
    ranks: list[RankView]
    # For an engine named by its URL (sglang+http://...): its /server_info, whether its
    # publishers are known, why the last read failed, its block size; null otherwise.
    discovery: DiscoveryView | None = None
    # For an engine found by --discover: how (k8s: namespace, pod, UID; dns: the name
    # asked) and its address; null for an instance named by hand.
    found: FoundBy | None = None
    # An engine without KV events (`events=none`): true, and `approximate_cache` says what
    # kvindex assumes it holds (the blocks /v1/route sent there, within its pool and TTL).
    approximate: bool = False
    approximate_cache: ApproxStats | None = None


class InstancesAnswer(msgspec.Struct):
    instances: list[InstanceAnswer]
    # The latest engines --discover added and removed (oldest first, at most 200), why.
    history: list[FleetChange] = msgspec.field(default_factory=list)


class BlocksAnswer(msgspec.Struct):
    name: str
    medium: str | None
    count: int
    block_hashes: list[str]


def instance_answer(view: InstanceView) -> InstanceAnswer:
    spec, totals = view.spec, view.totals()
    return InstanceAnswer(
        name=view.name,
        status=view.status,
        last_seq=view.last_seq,
        blocks=view.blocks,
        gaps=totals["gaps"],
        replayed_batches=totals["replayed_batches"],
        lost_batches=totals["lost_batches"],
        decode_errors=totals["decode_errors"],
        publisher_restarts=totals["publisher_restarts"],
        malformed_messages=totals["malformed_messages"],
        handshake_failures=totals["handshake_failures"],
        replay_failures=totals["replay_failures"],
        replay_refusals=totals["replay_refusals"],
        dp=spec.dp,
        endpoint=spec.endpoint,
        replay_endpoint=spec.replay_endpoint,
        topic=spec.topic,
        spec=spec.render(),
        blocks_by_medium=view.blocks_by_medium,
        blocks_by_tier=view.blocks_by_tier,
        stored=view.stored,
        removed=view.removed,
        clears=view.clears,
        batches=view.batches,
        ingest_lag_seconds=view.ingest_lag_seconds,
        last_batch_age_seconds=view.last_batch_age_seconds,
        problem=view.problem,
        ranks=view.ranks,
        discovery=view.discovery,
        found=view.found,
        approximate=view.approximate,
        approximate_cache=view.approximate_cache,
    )


# -- decoding ---------------------------------------------------------------------------


class BadBody(Exception):
    """A request body that is not the JSON asked for: answered 400 (not JSON) or 422."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code


_encoder = msgspec.json.Encoder()
encode = _encoder.encode
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def mm_keys(
    body: LookupRequest | PromptLookupRequest | ChatLookupRequest | QueryRequest,
) -> dict[str, Any]:
    """A lookup body's multimodal keys as the lookups take them (`mm_features=`,
    `extra_keys=`; none: {}). BadBody (422) for both at once."""
    if body.mm_features and body.extra_keys:
        raise BadBody(422, "invalid body: give mm_features or extra_keys, not both")
    if body.mm_features:
        return {
            "mm_features": [MMFeature(f.identifier, f.offset, f.length) for f in body.mm_features]
        }
    if body.extra_keys and any(body.extra_keys):
        return {"extra_keys": body.extra_keys}
    return {}


def decode_body(raw: bytes, kind: type[Any]) -> Any:
    """`raw` as a `kind` (one of the request structs); BadBody if it is not."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    if not raw.strip():
        raise BadBody(400, "a JSON body is required")
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise BadBody(422, f"invalid body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadBody(400, f"body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec's, for a string that is not UTF-8
        raise BadBody(400, f"body is not valid UTF-8: {exc}") from None


class _LenientLookup(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: Annotated[list[int | float], msgspec.Meta(max_length=MAX_LOOKUP_ITEMS)]
    lora_name: Name | None = None
    cache_salt: Name | None = None
    model: Name | None = None
    score: bool = False
    mm_features: MMFeatures | None = None
    extra_keys: ExtraKeys | None = None


def decode_lookup(raw: bytes) -> LookupRequest:
    """A lookup body. JSON Schema counts `1.0` as an integer: token ids written so are
    accepted too (off the fast path: only once the strict decoder refused the body)."""
    try:
        body: LookupRequest = decode_body(raw, LookupRequest)
        return body
    except BadBody as exc:
        if exc.status_code != 422:
            raise
        lenient = _integral(raw)
        if lenient is None:
            raise
        return lenient


def _integral(raw: bytes) -> LookupRequest | None:
    try:
        body = msgspec.json.decode(raw, type=_LenientLookup)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    tokens = []
    for value in body.token_ids:
        if isinstance(value, float) and not value.is_integer():
            return None
        if not 0 <= value <= MAX_TOKEN_ID:
            return None
        tokens.append(int(value))
    return LookupRequest(
        tokens,
        body.lora_name,
        body.cache_salt,
        body.model,
        body.score,
        body.mm_features,
        body.extra_keys,
    )


class _AddInstanceAny(msgspec.Struct, forbid_unknown_fields=True):
    spec: str | None = None
    name: str | None = None
    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str | None = None
    dp: int | None = None


def spec_of(raw: bytes) -> InstanceSpec:
    """The instance a `POST /v1/instances` body names: one of the two shapes (BadBody if
    it is neither, SpecError if the spec itself is bad)."""
    fields = msgspec.structs.asdict(decode_body(raw, _AddInstanceAny))
    given = {k for k, v in fields.items() if v is not None}
    if "spec" in given:
        if given != {"spec"}:
            raise BadBody(400, "give either 'spec' or the fields (name, endpoint, ...), not both")
        return InstanceSpec.parse(decode_body(raw, AddInstanceBySpec).spec, from_client=True)
    if not {"name", "endpoint"} <= given:
        raise BadBody(400, "'name' and 'endpoint' are required (or a 'spec')")
    body: AddInstanceByFields = decode_body(raw, AddInstanceByFields)
    if body.endpoint.startswith(DISCOVERY_SCHEMES):  # an SGLang engine by its URL
        if given != {"name", "endpoint"}:
            raise BadBody(400, "an SGLang URL goes alone: its /server_info says the rest")
        return InstanceSpec.parse(f"{body.name}={body.endpoint}", from_client=True)
    try:
        return InstanceSpec(
            name=body.name,
            endpoint=body.endpoint,
            replay_endpoint=body.replay_endpoint or None,
            topic=body.topic or "",
            dp=1 if body.dp is None else body.dp,
        ).client_checked()
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def error_body(message: str) -> bytes:
    """The one error shape: `{"error": "..."}`."""
    return encode(ErrorAnswer(message))


# -- the OpenAPI document ---------------------------------------------------------------

ANSWERS: tuple[type[Any], ...] = (
    ErrorAnswer, HealthAnswer, InstancesAnswer, InstanceAnswer, BlocksAnswer, LookupAnswer,
    InstanceMatch, RankMatch, ScoredAnswer, RouteAnswer, QueryAnswer, PeerInstance, PeerStatus,
    DoctorReport, Finding,
)  # fmt: skip
REQUESTS: tuple[type[Any], ...] = (
    LookupRequest, PromptLookupRequest, ChatLookupRequest, HashLookupRequest,
    AddInstanceBySpec, AddInstanceByFields, RegisterRequest, UnregisterRequest, QueryRequest,
    QueryByHashRequest,
)  # fmt: skip
REF = "#/components/schemas/{name}"


def schema_components() -> dict[str, Any]:
    """The JSON Schema of every request and answer, as OpenAPI components."""
    _, components = msgspec.json.schema_components([*REQUESTS, *ANSWERS], ref_template=REF)
    return components


def ref(kind: type[Any]) -> dict[str, str]:
    return {"$ref": REF.format(name=kind.__name__)}


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def operation_doc(
    answer: type[Any] | None,
    *,
    status: int = 200,
    body: Iterable[type[Any]] = (),
    errors: Iterable[int] = (),
) -> dict[str, Any]:
    """`responses` and `openapi_extra` for a route: its answer, its body (one of the
    `body` structs), and its error statuses, each `{"error": ...}`."""
    responses: dict[int | str, Any] = {
        code: {"description": "error", "content": json_content(ref(ErrorAnswer))} for code in errors
    }
    if answer is not None:
        responses[status] = {"description": "answer", "content": json_content(ref(answer))}
    else:
        responses[status] = {"description": "done"}
    kinds = list(body)
    extra: dict[str, Any] = {}
    if kinds:
        schema = ref(kinds[0]) if len(kinds) == 1 else {"oneOf": [ref(k) for k in kinds]}
        extra["requestBody"] = {"required": True, "content": json_content(schema)}
    return {"responses": responses, "openapi_extra": extra}
