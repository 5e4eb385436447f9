#!/usr/bin/env python3
"""vLLM 0.33.0's own answers for prompts over salted, LoRA, multimodal, hybrid and offloaded caches.

Run with the python of the venv made by ``scripts/vllm-venv.sh`` (this script imports
vLLM and never kvindex). Every scenario is one engine stand-in with its own real
``ZmqEventPublisher`` (PUB + replay ROUTER); each runs a small seeded workload of
requests over shared prefixes, then asks vLLM itself, for groups of probe prompts, what
it would reuse. See README.md next to this file for what each scenario drives.

- ``keys``: one full-attention group; ``KVCacheManager`` driven by a small scheduler
  loop (chunked prefill, decode) with plain, salted (``cache_salt``), LoRA (name +
  path), multimodal (``mm_features``) and prompt-embeds requests.
- ``hybrid-swa``, ``hybrid-sizes``, ``mamba-align``: vLLM's real v1 ``Scheduler``
  (so its ``HybridKVCacheCoordinator``) over full attention + sliding window (16/16
  and 32/16 tokens per block) and full attention + Mamba in "align" mode (64-token
  blocks, 16-token hashes: partial-block entries and fine-grained hits).
- ``cpu``: the real ``Scheduler`` with vLLM's ``OffloadingConnector`` (its CPU
  offloading manager, its ``OffloadingEventsTracker`` with
  ``self_describing_kv_events``), the worker side of the connector included; only
  the data copy itself is skipped (transfers complete at once). GPU and CPU events are
  published in the same batches, as vLLM's scheduler does.

Expected answers (per probe, for a FRESH request of those tokens, LoRA and salt):
``KVCacheManager.get_computed_blocks(request, max_cache_hit_length=len(tokens))``
(the longest prefix vLLM would reuse, without the scheduler's "recompute the last
token" cap, which is recorded beside it), for ``cpu`` then the connector's own
``get_num_new_matched_tokens`` from that GPU hit, and for hybrid engines the
coordinator's ``find_longest_cache_hit_per_group``.

stdout: ``{"event": "ready", "scenarios": {name: {"pub", "replay"}}}`` once bound, then
``{"event": "done", ...}`` after every batch was sent and --out written.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCENARIOS = ("keys", "hybrid-swa", "hybrid-sizes", "mamba-align", "cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset")
    p.add_argument(
        "--host", default="tcp://127.0.0.1", help="every PUB/ROUTER binds HOST:0 (a free port)"
    )
    p.add_argument("--seed", type=int, default=20)
    p.add_argument(
        "--hash-seed",
        default="0",
        help="Python's hash seed for this process: it fixes the iteration order of vLLM's "
        "sets (the order of CPU stores within a batch). vLLM's NONE_HASH keeps its default.",
    )
    p.add_argument(
        "--wait-go",
        action="store_true",
        help="after 'ready', wait for a line on stdin before running the workloads",
    )
    p.add_argument("--linger", type=float, default=0.0, help="seconds to serve replays at the end")
    p.add_argument("--out", required=True, help="where to write the reference JSON")
    a = p.parse_args(argv)
    unknown = set(a.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios: {sorted(unknown)}")
    return a


ARGS = parse_args()
if os.environ.get("PYTHONHASHSEED") != ARGS.hash_seed:
    # The hash seed only takes effect at interpreter start: start again with it.
    os.execve(
        sys.executable,
        [sys.executable, *sys.argv],
        {**os.environ, "PYTHONHASHSEED": ARGS.hash_seed},
    )
# vLLM derives NONE_HASH from PYTHONHASHSEED when set; unset it, so hashes are vLLM's defaults.
del os.environ["PYTHONHASHSEED"]
# Must be set before vLLM reads its environment.
os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # vLLM's CPU platform: configs build without a GPU
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import msgspec  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    BlockHash,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
    to_event_extra_keys,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    OffloadingWorker,
    TransferResult,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_pub import DriverPublisher, wait_drained  # noqa: E402

F32 = torch.float32
EOS = 2
MAX_MODEL_LEN = 2048
IMAGE_TOKEN = 31990  # the placeholder id an image run is written with


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def jsonable(obj: Any) -> Any:
    """Wire values made JSON-safe: bytes become {"bytes": hex} (hashes are ints here)."""
    if isinstance(obj, (bytes, bytearray)):
        return {"bytes": bytes(obj).hex()}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


_ENCODER = msgspec.msgpack.Encoder()


def wire_event(ev: Any) -> dict[str, Any]:
    """The event exactly as a subscriber decodes it (msgpack map, None fields dropped)."""
    return jsonable(msgspec.msgpack.decode(_ENCODER.encode(ev)))


def tiny_model_config(d: Path) -> ModelConfig:
    """A model config vLLM accepts offline: a two-layer Llama's config.json (in `d`), no
    weights. The Scheduler reads only lengths and flags from it; the KV-cache layout is
    given explicitly (one KVCacheConfig per scenario)."""
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "num_hidden_layers": 2,
                "vocab_size": 32000,
                "max_position_embeddings": MAX_MODEL_LEN,
                "rms_norm_eps": 1e-5,
                "torch_dtype": "float32",
                "bos_token_id": 1,
                "eos_token_id": EOS,
            }
        )
    )
    return ModelConfig(
        model=str(d), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype="float32"
    )


# --------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------
@dataclass
class Spec:
    """One request (or probe): tokens and the keys vLLM hashes besides them."""

    name: str
    tokens: list[int]
    max_tokens: int = 4
    lora: tuple[str, str] | None = None  # (name, path)
    salt: str | None = None
    mm: list[tuple[str, int, int]] = field(default_factory=list)  # (identifier, offset, len)
    embeds_seed: int | None = None  # prompt embeddings instead of token ids

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_tokens": len(self.tokens),
            "lora_name": self.lora[0] if self.lora else None,
            "lora_path": self.lora[1] if self.lora else None,
            "cache_salt": self.salt,
            "mm_features": [{"identifier": i, "offset": o, "length": n} for i, o, n in self.mm],
            "prompt_embeds": self.embeds_seed is not None,
        }


class RequestFactory:
    """Builds vLLM ``Request`` objects the way the engine core does (block hasher set)."""

    def __init__(self, hash_block_size: int):
        self.hasher = get_request_block_hasher(hash_block_size, get_hash_fn_by_name("sha256"))
        self.lora_ids: dict[tuple[str, str], int] = {}
        self.count = 0

    def build(self, spec: Spec, rid: str | None = None) -> Request:
        if rid is None:
            rid = f"{spec.name}-{self.count}"
            self.count += 1
        sp = SamplingParams(max_tokens=spec.max_tokens)
        sp.update_from_generation_config({}, eos_token_id=EOS)
        lora = None
        if spec.lora is not None:
            lora_id = self.lora_ids.setdefault(spec.lora, len(self.lora_ids) + 1)
            lora = LoRARequest(lora_name=spec.lora[0], lora_int_id=lora_id, lora_path=spec.lora[1])
        mm = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=ident,
                mm_position=PlaceholderRange(offset=offset, length=length),
            )
            for ident, offset, length in spec.mm
        ] or None
        embeds = None
        tokens: list[int] | None = list(spec.tokens)
        if spec.embeds_seed is not None:
            g = torch.Generator().manual_seed(spec.embeds_seed)
            embeds = torch.randn(len(spec.tokens), 8, generator=g)
            tokens = None  # vLLM then holds token id 0 at every position
        return Request(
            request_id=rid,
            prompt_token_ids=tokens,
            prompt_embeds=embeds,
            sampling_params=sp,
            pooling_params=None,
            mm_features=mm,
            lora_request=lora,
            cache_salt=spec.salt,
            block_hasher=self.hasher,
        )


# --------------------------------------------------------------------------
# Publishing and the in-process mirror of what was published
# --------------------------------------------------------------------------
class Tap:
    """Stands where vLLM's scheduler keeps its publisher: records every batch, then hands
    it to the real ZmqEventPublisher unchanged."""

    def __init__(self, publisher: DriverPublisher):
        self.publisher = publisher
        self.batches: list[dict[str, Any]] = []
        self.mirror: Counter[tuple[int, str, int]] = Counter()  # (group, medium, hash)
        self.counts: Counter[str] = Counter()

    def publish(self, batch: KVEventBatch) -> None:
        self.account(batch.events)
        self.batches.append(
            {"seq": len(self.batches), "events": [wire_event(e) for e in batch.events]}
        )
        self.publisher.publish(batch)

    def shutdown(self) -> None:  # vLLM's scheduler calls it; the driver owns the publisher
        pass

    def account(self, events: Sequence[Any]) -> None:
        for i, ev in enumerate(events):
            later = {
                h for e in events[i + 1 :] if isinstance(e, BlockStored) for h in e.block_hashes
            }
            name = type(ev).__name__
            self.counts[name] += 1
            if isinstance(ev, BlockStored):
                self.counts[f"{name}:{ev.medium}"] += 1
                if not ev.block_hashes:
                    self.counts["BlockStored:no_hashes"] += 1
                if ev.parent_block_hash is not None and ev.parent_block_hash in later:
                    self.counts["BlockStored:parent_stored_later_in_batch"] += 1
                if len(ev.block_hashes) * ev.block_size != len(ev.token_ids):
                    self.counts["BlockStored:tokens_cover_other_blocks"] += 1
                for h in ev.block_hashes:
                    self.mirror[(ev.group_idx or 0, ev.medium or "GPU", h)] += 1
            elif isinstance(ev, BlockRemoved):
                self.counts[f"{name}:{ev.medium}"] += 1
                for h in ev.block_hashes:
                    key = (ev.group_idx or 0, ev.medium or "GPU", h)
                    self.mirror[key] -= 1
                    if self.mirror[key] <= 0:
                        del self.mirror[key]
            elif isinstance(ev, AllBlocksCleared):
                self.mirror.clear()


def pools_json(copies: Counter[tuple[int, str, int]]) -> list[dict[str, Any]]:
    pools: dict[tuple[int, str], dict[str, int]] = {}
    for (group, medium, h), n in sorted(copies.items()):
        pools.setdefault((group, medium), {})[str(h)] = n
    return [{"group": g, "medium": m, "copies": c} for (g, m), c in sorted(pools.items())]


def self_check(pool: Counter[tuple[int, str, int]], tap: Tap) -> dict[str, Any]:
    """The published events, replayed (stores - removes per hash), equal vLLM's pools."""
    bad = []
    for key in sorted(set(pool) | set(tap.mirror)):
        if pool.get(key, 0) != tap.mirror.get(key, 0):
            group, medium, h = key
            bad.append(
                {"group": group, "medium": medium, "hash": h, "pool": pool.get(key, 0)}
                | {"events": tap.mirror.get(key, 0)}
            )
    return {"ok": not bad, "mismatches": bad[:20]}


def gpu_pool(block_pool: Any) -> Counter[tuple[int, str, int]]:
    """Hash -> copies straight from vLLM's block pool (BlockHashToBlockMap)."""
    out: Counter[tuple[int, str, int]] = Counter()
    for key, blocks in block_pool.cached_block_hash_to_block._cache.items():
        n = len(blocks) if isinstance(blocks, dict) else 1
        wire = maybe_convert_block_hash(get_block_hash(key))
        out[(get_group_id(key), block_pool.medium, wire)] += n
    return out


# --------------------------------------------------------------------------
# Engine stand-ins
# --------------------------------------------------------------------------
class Engine:
    """What every scenario shares: a request factory, a tap, probes and the reference."""

    name: str
    hash_block_size: int
    manager: KVCacheManager
    factory: RequestFactory
    tap: Tap

    def __init__(self, name: str, seed: int):
        self.name = name
        self.rng = random.Random(f"{name}-{seed}")
        self.requests_run: list[dict[str, Any]] = []

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randint(1000, 31000) for _ in range(n)]

    # -- what vLLM would reuse --------------------------------------------------
    def gpu_hit(self, req: Request, max_len: int) -> int:
        return self.manager.get_computed_blocks(req, max_cache_hit_length=max_len)[1]

    def per_group_hit(self, req: Request, max_len: int) -> dict[str, int] | None:
        coordinator = self.manager.coordinator
        if not isinstance(coordinator, HybridKVCacheCoordinator):
            return None
        _, hits = coordinator.find_longest_cache_hit_per_group(req.block_hashes, max_len)
        return {str(g): n for g, n in enumerate(hits)}

    def reconciled_groups(self, req: Request, max_len: int) -> dict[str, int]:
        blocks = self.manager.get_computed_blocks(req, max_cache_hit_length=max_len)[0]
        return {
            str(g): sum(1 for b in group if not b.is_null) for g, group in enumerate(blocks.blocks)
        }

    def lower_tier_hit(self, req: Request, gpu_tokens: int) -> int | None:
        return None

    def probe(self, spec: Spec, keyed: Spec | None = None) -> dict[str, Any]:
        req = self.factory.build(spec, rid=f"probe-{spec.name}")
        n = len(spec.tokens)
        gpu = self.gpu_hit(req, n)
        cpu = self.lower_tier_hit(req, gpu)
        bs = self.hash_block_size
        total = gpu + (cpu or 0)
        out = {
            "name": spec.name,
            "token_ids": list(spec.tokens),
            "lora_name": spec.lora[0] if spec.lora else None,
            "lora_path": spec.lora[1] if spec.lora else None,
            "cache_salt": spec.salt,
            # The request's multimodal inputs (a router's lookup supplies them), and the
            # per-block multimodal keys vLLM's own code derives from them, as its events
            # publish them (generate_block_hash_extra_keys, then to_event_extra_keys).
            "mm_features": spec.describe()["mm_features"],
            "event_mm_keys": event_mm_keys(req, bs),
            "block_size": bs,
            "expected": {
                "tokens": total,
                "blocks": total // bs,
                "by_tier": {"gpu": gpu // bs, **({"cpu": cpu // bs} if cpu is not None else {})},
                "by_tier_tokens": {"gpu": gpu, **({"cpu": cpu} if cpu is not None else {})},
            },
            # What the scheduler itself asks: the same lookup capped at len - 1 tokens.
            "scheduler_default_gpu_tokens": self.manager.get_computed_blocks(req)[1],
        }
        groups = self.per_group_hit(req, n)
        if groups is not None:
            out["expected"]["by_group_tokens"] = groups
            out["reconciled_blocks_per_group"] = self.reconciled_groups(req, n)
        if spec.mm:
            # The same tokens (LoRA, salt) without the inputs: what a lookup without the keys
            # must say.
            bare = Spec(spec.name, spec.tokens, lora=spec.lora, salt=spec.salt)
            plain = self.factory.build(bare, rid=f"probe-plain-{spec.name}")
            out["expected_without_keys_tokens"] = self.gpu_hit(plain, n)
        if keyed is not None:
            # The request that stored these tokens, asked with its own keys (the probes
            # named mm-* ask so themselves; shown here for reference).
            kreq = self.factory.build(keyed, rid=f"probe-keyed-{spec.name}")
            out["source_request"] = keyed.describe()
            out["source_request_gpu_tokens"] = self.gpu_hit(kreq, len(keyed.tokens))
        return out

    def check_quiet(self) -> None:
        """Probing must not have changed the cache: no events may be pending."""
        left = self.manager.take_events()
        if left:
            raise RuntimeError(f"{self.name}: probes produced events: {left[:3]}")


def event_mm_keys(req: Request, block_size: int) -> list[list[list[Any]] | None]:
    """Per whole block of a fresh request, the multimodal keys vLLM publishes for it:
    its own extra keys (from block 0, the input index carried along, as the block hasher
    does) through to_event_extra_keys, the [identifier, offset] entries only (the bare
    LoRA name and salt strings are the namespace's)."""
    out: list[list[list[Any]] | None] = []
    mm_idx = 0
    for b in range(req.num_tokens // block_size):
        keys, mm_idx = generate_block_hash_extra_keys(
            req, b * block_size, (b + 1) * block_size, mm_idx
        )
        (event,) = to_event_extra_keys([keys]) or [None]
        mm = [list(k) for k in event or () if isinstance(k, tuple)]
        out.append(mm or None)
    return out


class KeysEngine(Engine):
    """One full-attention group; KVCacheManager under a small scheduler loop (it takes
    multimodal requests, which vLLM's own Scheduler would hand to an encoder)."""

    def __init__(self, seed: int, tap: Tap, block_size: int = 16, num_blocks: int = 160):
        super().__init__("keys", seed)
        self.tap = tap
        self.hash_block_size = block_size
        self.factory = RequestFactory(block_size)
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[full_attention("layer", block_size)],
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.budget = 64
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.max_tokens: dict[str, int] = {}

    def submit(self, specs: Sequence[Spec]) -> None:
        for spec in specs:
            req = self.factory.build(spec)
            self.max_tokens[req.request_id] = spec.max_tokens
            self.waiting.append(req)
            self.requests_run.append(spec.describe())

    def run(self) -> None:
        steps = 0
        while self.waiting or self.running:
            scheduled = self.schedule()
            for req, n in scheduled:
                req.num_computed_tokens += n
                if req.num_computed_tokens >= req.num_tokens:
                    req.append_output_token_ids(self.rng.randint(1000, 31000))
                    if len(req.output_token_ids) >= self.max_tokens[req.request_id]:
                        self.manager.free(req)
                        self.running.remove(req)
                        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            events = self.manager.take_events()
            if events:
                self.tap.publish(KVEventBatch(ts=time.time(), events=events))
            steps += 1
            if steps > 10_000:
                raise RuntimeError("keys: workload does not finish")

    def schedule(self) -> list[tuple[Request, int]]:
        """vLLM's order: running requests (decode, rest of a chunked prefill), then
        waiting ones after get_computed_blocks, under a token budget."""
        budget = self.budget
        out: list[tuple[Request, int]] = []
        for req in list(self.running):
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            if self.manager.allocate_slots(req, n) is None:
                raise RuntimeError("keys: pool too small for the workload")
            out.append((req, n))
            budget -= n
        while self.waiting and budget > 0:
            req = self.waiting[0]
            blocks, hit, _ = self.manager.get_computed_blocks(req)
            n = min(req.num_tokens - hit, budget)
            if self.manager.allocate_slots(req, n, hit, blocks) is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = hit
            self.running.append(req)
            out.append((req, n))
            budget -= n
        return out

    def reference(self) -> dict[str, Any]:
        pool = gpu_pool(self.manager.block_pool)
        return {"pools": pools_json(pool), "events_self_check": self_check(pool, self.tap)}


class InstantTransfers(OffloadingWorker):
    """The data mover under vLLM's OffloadingConnectorWorker: every store and load
    completes at once (CPU-only tests have no GPU memory to copy). All bookkeeping
    (jobs, completions, the CPU manager, the event tracker) is vLLM's."""

    def __init__(self) -> None:
        self.done: list[int] = []

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self.done.append(job_id)
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        self.done.append(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return [TransferResult(job_id=j, success=True) for j in done]

    def wait(self, job_ids: set[int]) -> None:
        pass


class SchedEngine(Engine):
    """vLLM's real v1 Scheduler (and its KV connector, for the CPU tier), set up the way
    EngineCore sets it up, with a model runner that samples one token per finished
    prefill step and runs the connector's worker-side calls in the model runner's order."""

    def __init__(
        self,
        name: str,
        seed: int,
        tap: Tap,
        model_config: ModelConfig,
        groups: list[KVCacheGroupSpec],
        cache: dict[str, Any],
        num_blocks: int,
        budget: int = 64,
        offload: dict[str, Any] | None = None,
    ):
        super().__init__(name, seed)
        self.tap = tap
        transfer = None
        if offload is not None:
            transfer = KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config=offload,
            )
        vc = VllmConfig(
            model_config=copy.deepcopy(model_config),
            cache_config=CacheConfig(enable_prefix_caching=True, **cache),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=budget,
                max_num_seqs=8,
                max_model_len=MAX_MODEL_LEN,
                is_encoder_decoder=False,
            ),
            # The scheduler publishes through whatever stands in its kv_event_publisher;
            # "null" here, then the real ZmqEventPublisher (through the tap) below.
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
            kv_transfer_config=transfer,
        )
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=vc.cache_config.prefix_cache_retention_interval,
        )
        vc.cache_config.num_gpu_blocks = num_blocks
        # As EngineCore: block sizes, then the hit alignment the connector reads too.
        sched_bs, hash_bs = resolve_kv_cache_block_sizes(config, vc)
        config.hash_block_size = hash_bs
        config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
            config, vc, sched_bs, hash_bs
        )
        self.hash_block_size = hash_bs
        self.scheduler_block_size = sched_bs
        self.vllm_config = vc
        self.kv_cache_config = config
        self.scheduler = Scheduler(
            vllm_config=vc,
            kv_cache_config=config,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=sched_bs,
            hash_block_size=hash_bs,
            log_stats=False,
        )
        self.scheduler.kv_event_publisher.shutdown()
        self.scheduler.kv_event_publisher = tap
        self.manager = self.scheduler.kv_cache_manager
        self.factory = RequestFactory(hash_bs)
        self.worker: OffloadingConnector | None = None
        if offload is not None:
            self.worker = OffloadingConnector(vc, KVConnectorRole.WORKER, config)
            assert self.worker.connector_worker is not None
            self.worker.connector_worker.worker = InstantTransfers()
            self.forward_context = ForwardContext(
                no_compile_layers={}, attn_metadata={}, slot_mapping={}
            )

    def config_json(self) -> dict[str, Any]:
        return {
            "scheduler_block_size": self.scheduler_block_size,
            "hash_block_size": self.hash_block_size,
            "cache_hit_alignment_tokens": self.kv_cache_config.cache_hit_alignment_tokens,
            "prefix_cache_retention_interval": (
                self.kv_cache_config.prefix_cache_retention_interval
            ),
            "groups": [
                {"group": i, "spec": type(g.kv_cache_spec).__name__, **group_params(g)}
                for i, g in enumerate(self.kv_cache_config.kv_cache_groups)
            ],
        }

    def submit(self, specs: Sequence[Spec]) -> None:
        for spec in specs:
            self.scheduler.add_request(self.factory.build(spec))
            self.requests_run.append(spec.describe())

    def busy(self) -> bool:
        connector = self.scheduler.connector
        return self.scheduler.has_requests() or (
            connector is not None and connector.has_pending_push_work()
        )

    def run(self) -> None:
        steps = 0
        while self.busy():
            self.step()
            steps += 1
            if steps > 10_000:
                raise RuntimeError(f"{self.name}: workload does not finish")

    def step(self) -> None:
        out = self.scheduler.schedule()
        connector_output = None
        if self.worker is not None:
            # The model runner's calls, in its order (gpu_model_runner + the
            # KV connector mixin); the worker stores a step's jobs at the next step.
            meta = out.kv_connector_metadata
            self.worker.handle_preemptions(meta)
            self.worker.bind_connector_metadata(meta)
            self.worker.start_load_kv(self.forward_context)
            self.worker.wait_for_save()
            sending, recving = self.worker.get_finished(out.finished_req_ids)
            worker_meta = self.worker.build_connector_worker_meta()
            self.worker.clear_connector_metadata()
            connector_output = KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                kv_connector_worker_meta=worker_meta,
            )
        ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in ids:
            req = self.scheduler.requests[rid]
            # A step that ends a prefill (or decodes) samples one token.
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([self.rng.randint(1000, 31000)] if done else [])
        self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={rid: i for i, rid in enumerate(ids)},
                sampled_token_ids=sampled,
                kv_connector_output=connector_output,
            ),
        )

    # -- the CPU tier ------------------------------------------------------------
    def lower_tier_hit(self, req: Request, gpu_tokens: int) -> int | None:
        connector = self.scheduler.connector
        if connector is None:
            return None
        cs = connector.connector_scheduler
        cs.on_new_request(req)
        try:
            ext, _ = cs.get_num_new_matched_tokens(req, gpu_tokens)
        finally:
            # The scheduler's step would end in build_connector_meta, which releases
            # the manager; a probe has no step, so release it and forget the probe.
            cs._release_step()
            cs._req_status.pop(req.request_id, None)
        return ext or 0

    def cpu_pool(self) -> Counter[tuple[int, str, int]]:
        out: Counter[tuple[int, str, int]] = Counter()
        connector = self.scheduler.connector
        if connector is None:
            return out
        manager = connector.connector_scheduler.manager
        for key, chunk in manager._policy.chunks.items():
            if chunk.is_ready:  # stores still being written are not announced yet
                h = maybe_convert_block_hash(BlockHash(get_offload_block_hash(key)))
                out[(get_offload_group_idx(key), "CPU", h)] += 1
        return out

    def reference(self) -> dict[str, Any]:
        pool = gpu_pool(self.manager.block_pool) + self.cpu_pool()
        return {"pools": pools_json(pool), "events_self_check": self_check(pool, self.tap)}

    def check_quiet(self) -> None:
        super().check_quiet()
        connector = self.scheduler.connector
        if connector is not None:
            left = list(connector.take_events())
            if left:
                raise RuntimeError(f"{self.name}: probes produced connector events: {left[:3]}")


def full_attention(name: str, block_size: int) -> KVCacheGroupSpec:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=F32)
    return KVCacheGroupSpec([name], spec)


def sliding_window(name: str, block_size: int, window: int) -> KVCacheGroupSpec:
    spec = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=F32, sliding_window=window
    )
    return KVCacheGroupSpec([name], spec)


def mamba_align(name: str, block_size: int) -> KVCacheGroupSpec:
    spec = MambaSpec(
        block_size=block_size, shapes=((1, 1),), dtypes=(F32,), mamba_cache_mode="align"
    )
    return KVCacheGroupSpec([name], spec)


def group_params(group: KVCacheGroupSpec) -> dict[str, Any]:
    spec = group.kv_cache_spec
    out: dict[str, Any] = {"block_size": spec.block_size}
    if isinstance(spec, SlidingWindowSpec):
        out["sliding_window"] = spec.sliding_window
    if isinstance(spec, MambaSpec):
        out["mamba_cache_mode"] = spec.mamba_cache_mode
    return out


# --------------------------------------------------------------------------
# Scenarios: workloads over shared prefixes, then probes
# --------------------------------------------------------------------------
# (the engine, its probes, extra reference fields)
Scenario = tuple[Engine, list[dict[str, Any]], dict[str, Any]]


def run_keys(seed: int, tap: Tap) -> Scenario:
    eng = KeysEngine(seed, tap)
    t = eng.tokens
    sys_p, sys_mm = t(40), t(32)
    q1, q2, q3, text = t(50), t(50), t(44), t(24)
    img40, img32 = [IMAGE_TOKEN] * 40, [IMAGE_TOKEN] * 32
    lora_x, lora_x2 = ("adapter-x", "/adapters/x"), ("adapter-x", "/adapters/x-v2")
    mm_a = Spec("mm-image-a", sys_mm + img40 + text, mm=[("img-A", 32, 40)])
    mm_b = Spec("mm-image-b", sys_mm + img40 + text, mm=[("img-B", 32, 40)])
    mm_off = Spec("mm-image-offset", sys_p + img32 + text, mm=[("img-A", 40, 32)])
    # Two images starting in one block (32-47): that block carries two mm keys.
    mm_two = Spec(
        "mm-two-images",
        sys_mm + [IMAGE_TOKEN] * 6 + text[:2] + [IMAGE_TOKEN] * 20 + text,
        mm=[("img-C", 32, 6), ("img-D", 40, 20)],
    )
    embeds = Spec("prompt-embeds", [0] * 64, embeds_seed=seed)
    phases = [
        # The multimodal request comes first: it alone stores the SYS_MM blocks.
        [mm_a, Spec("plain", sys_p + q1, max_tokens=6)],
        [
            Spec("salted-a", sys_p + q1, salt="tenant-a"),
            Spec("salted-b", sys_p + q2, salt="tenant-b"),
        ],
        [
            Spec("lora-x", sys_p + q1, lora=lora_x),
            Spec("lora-x-other-path", sys_p + q1, lora=lora_x2),
        ],
        [Spec("lora-x-salted", sys_p + q3, lora=lora_x, salt="tenant-a"), mm_b, mm_off],
        [mm_two, embeds],
    ]
    for phase in phases:
        eng.submit(phase)
        eng.run()
    ref = eng.reference()
    probes = [
        eng.probe(Spec("plain", sys_p + q1)),
        eng.probe(Spec("plain-prefix-of-salted", sys_p + q2)),
        eng.probe(Spec("salted-a", sys_p + q1, salt="tenant-a")),
        eng.probe(Spec("salted-b-on-other-question", sys_p + q1, salt="tenant-b")),
        eng.probe(Spec("salted-b", sys_p + q2, salt="tenant-b")),
        eng.probe(Spec("unseen-salt", sys_p + q1, salt="tenant-z")),
        eng.probe(Spec("salted-only-without-salt", sys_p + q3)),
        eng.probe(Spec("lora-x", sys_p + q1, lora=lora_x)),
        eng.probe(Spec("lora-x-other-path", sys_p + q1, lora=lora_x2)),
        eng.probe(Spec("lora-x-salted", sys_p + q3, lora=lora_x, salt="tenant-a")),
        eng.probe(Spec("lora-x-salted-without-salt", sys_p + q3, lora=lora_x)),
        eng.probe(Spec("unseen-lora", sys_p + q1, lora=("adapter-y", "/adapters/y"))),
        eng.probe(Spec("plain-tokens-of-mm-request", mm_a.tokens), keyed=mm_a),
        eng.probe(Spec("plain-mm-system-prompt", sys_mm)),
        eng.probe(Spec("plain-tokens-of-mm-offset-request", mm_off.tokens), keyed=mm_off),
        eng.probe(Spec("plain-tokens-of-two-image-request", mm_two.tokens), keyed=mm_two),
        eng.probe(Spec("plain-tokens-of-embeds-request", embeds.tokens), keyed=embeds),
        eng.probe(Spec("unseen", t(70))),
        # Image prompts asked with their inputs (issue 15): a lookup that supplies them.
        eng.probe(Spec("mm-image-a", mm_a.tokens, mm=mm_a.mm)),
        eng.probe(Spec("mm-image-b", mm_b.tokens, mm=mm_b.mm)),
        eng.probe(Spec("mm-image-offset", mm_off.tokens, mm=mm_off.mm)),
        eng.probe(Spec("mm-two-images", mm_two.tokens, mm=mm_two.mm)),
        eng.probe(Spec("mm-unseen-image", mm_a.tokens, mm=[("img-Z", 32, 40)])),
        eng.probe(Spec("mm-image-a-one-later", mm_a.tokens, mm=[("img-A", 33, 39)])),
        eng.probe(Spec("mm-image-a-longer", mm_a.tokens + t(16), mm=mm_a.mm)),
        eng.probe(Spec("mm-image-a-salted", mm_a.tokens, mm=mm_a.mm, salt="tenant-a")),
        eng.probe(
            Spec("mm-two-images-swapped", mm_two.tokens, mm=[("img-D", 32, 6), ("img-C", 40, 20)])
        ),
    ]
    eng.check_quiet()
    config = {"groups": [{"group": 0, "spec": "FullAttentionSpec", "block_size": 16}]}
    return eng, probes, {"config": config, "reference": ref}


def hybrid_workload(eng: SchedEngine) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Shared prefixes with divergence points inside and at block edges, a long chunked
    prefill and an identical re-send (duplicate copies)."""
    t = eng.tokens
    sys_p = t(100)
    b = sys_p + t(60)
    long_p = t(200)
    phases = [
        [Spec("a", sys_p + t(20), max_tokens=12)],
        [Spec("b", b, max_tokens=20)],
        [Spec("c", b + t(3), max_tokens=3), Spec("d-long", long_p, max_tokens=8)],
        [Spec("e-resend-long", long_p, max_tokens=2), Spec("f", sys_p + t(37), max_tokens=5)],
    ]
    for phase in phases:
        eng.submit(phase)
        eng.run()
    ref = eng.reference()
    probes = [
        eng.probe(Spec("system-prompt", sys_p)),
        eng.probe(Spec("b", b)),
        eng.probe(Spec("b-plus-3", b + t(3))),
        eng.probe(Spec("b-first-144", b[:144])),
        eng.probe(Spec("long", long_p)),
        eng.probe(Spec("long-first-120", long_p[:120])),
        eng.probe(Spec("long-diverged-at-100", long_p[:100] + t(60))),
        eng.probe(Spec("system-plus-unseen", sys_p + t(50))),
        eng.probe(Spec("unseen", t(90))),
    ]
    eng.check_quiet()
    return probes, ref


def run_hybrid(name: str, seed: int, tap: Tap, model_config: ModelConfig) -> Scenario:
    if name == "hybrid-swa":
        groups = [full_attention("full", 16), sliding_window("swa", 16, 32)]
        cache: dict[str, Any] = {"block_size": 16}
    elif name == "hybrid-sizes":
        groups = [full_attention("full", 32), sliding_window("swa", 16, 32)]
        cache = {"block_size": 16}
    else:  # mamba-align: 64-token blocks, 16-token hashes (vLLM's prefix_match_unit)
        groups = [full_attention("full", 64), mamba_align("mamba", 64)]
        cache = {"block_size": 64, "mamba_cache_mode": "align", "prefix_match_unit": 16}
    # Pools small enough that the workload evicts (group by group), chosen so that the
    # groups' hits diverge at the end (one group holds more than the coordinator uses).
    num_blocks = {"hybrid-swa": 40, "hybrid-sizes": 22, "mamba-align": 14}[name]
    eng = SchedEngine(name, seed, tap, model_config, groups, cache, num_blocks=num_blocks)
    probes, ref = hybrid_workload(eng)
    return eng, probes, {"config": eng.config_json(), "reference": ref}


def run_cpu(seed: int, tap: Tap, model_config: ModelConfig) -> Scenario:
    groups = [full_attention("full", 16)]
    offload = {
        # 60 chunks of one block (128-byte pages padded to vLLM's 4 KiB alignment): the
        # last filler makes it evict its least recent chunks.
        "cpu_bytes_to_use": 4096 * 60,
        "self_describing_kv_events": True,
    }
    cache = {"block_size": 16}
    # 23 usable GPU blocks of 16 tokens.
    eng = SchedEngine("cpu", seed, tap, model_config, groups, cache, num_blocks=24, offload=offload)
    t = eng.tokens
    sys_p = t(48)
    a = sys_p + t(40)
    b = sys_p + t(56)
    c = sys_p + t(40)
    unique = t(160)
    phases = [
        [Spec("plain-a", a, max_tokens=4)],
        [Spec("salted-a", a, salt="tenant-a", max_tokens=4)],
        [Spec("salted-only-b", b, salt="tenant-a", max_tokens=4)],
        # A salted prompt nobody asks for plain, prefilled in chunks over several steps.
        [Spec("salted-unique", unique, salt="tenant-c", max_tokens=2)],
        # Fillers push everything above out of the GPU (it stays on the CPU).
        *[[Spec(f"filler-{i}", t(96), max_tokens=2)] for i in range(4)],
        # A new question on the shared system prompt: loads it back from the CPU.
        [Spec("plain-system-again", sys_p + t(20), max_tokens=2)],
        [Spec("plain-c", c, max_tokens=2)],
        # 19 blocks: the GPU evicts c's tail (vLLM frees tails first) but keeps the system
        # prompt; the CPU evicts its least recent chunks.
        [Spec("last-filler", t(304), max_tokens=2)],
    ]
    for phase in phases:
        eng.submit(phase)
        eng.run()
    ref = eng.reference()
    probes = [
        eng.probe(Spec("plain-a", a)),
        eng.probe(Spec("salted-a", a, salt="tenant-a")),
        eng.probe(Spec("salted-a-other-salt", a, salt="tenant-b")),
        eng.probe(Spec("salted-only-b-without-salt", b)),
        eng.probe(Spec("salted-only-b", b, salt="tenant-a")),
        eng.probe(Spec("salted-unique", unique, salt="tenant-c")),
        eng.probe(Spec("salted-unique-without-salt", unique)),
        eng.probe(Spec("plain-c", c)),
        eng.probe(Spec("system-prompt", sys_p)),
        eng.probe(Spec("system-plus-unseen", sys_p + t(30))),
        eng.probe(Spec("unseen", t(64))),
    ]
    eng.check_quiet()
    return eng, probes, {"config": eng.config_json() | {"offload": offload}, "reference": ref}


def main() -> int:
    args = ARGS
    names = args.scenarios.split(",")
    init_none_hash(get_hash_fn_by_name("sha256"))
    publishers: dict[str, DriverPublisher] = {}
    for name in names:
        publishers[name] = DriverPublisher(
            data_parallel_rank=0,
            endpoint=f"{args.host}:0",
            replay_endpoint=f"{args.host}:0",
            buffer_steps=100_000,
            topic="",
        )
    emit(
        {
            "event": "ready",
            "pid": os.getpid(),
            "scenarios": {
                n: {"pub": p.bound_pub, "replay": p.bound_replay} for n, p in publishers.items()
            },
        }
    )
    model_dir = tempfile.TemporaryDirectory(prefix="kvindex-tiny-llama-")
    try:
        if args.wait_go:
            sys.stdin.readline()
        model_config = tiny_model_config(Path(model_dir.name))
        out: dict[str, Any] = {"vllm_version": vllm.__version__, "seed": args.seed, "scenarios": {}}
        for name in names:
            tap = Tap(publishers[name])
            t0 = time.time()
            if name == "keys":
                eng, probes, extra = run_keys(args.seed, tap)
            elif name == "cpu":
                eng, probes, extra = run_cpu(args.seed, tap, model_config)
            else:
                eng, probes, extra = run_hybrid(name, args.seed, tap, model_config)
            out["scenarios"][name] = {
                "pub": publishers[name].bound_pub,
                "replay": publishers[name].bound_replay,
                "published_batches": len(tap.batches),
                "event_counts": dict(tap.counts),
                "seconds": round(time.time() - t0, 2),
                **extra,
                "requests": eng.requests_run,
                "probes": probes,
                "batches": tap.batches,
            }
        drained = all(wait_drained(p) for p in publishers.values())
        out["drained"] = drained
        path = Path(args.out)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        os.replace(tmp, path)
        emit(
            {
                "event": "done",
                "out": str(path),
                "published_batches": {
                    n: s["published_batches"] for n, s in out["scenarios"].items()
                },
            }
        )
        if args.linger > 0:
            time.sleep(args.linger)
    finally:
        for p in publishers.values():
            p.shutdown()
        model_dir.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
