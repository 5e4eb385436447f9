"""The Redis store's layout: its URL, its keys, how entries and rows are encoded, its Lua.

Keys (all under `kvindex:`), per publisher `S` = (instance, rank) written `{rank}:{name}`:
- `instances` (hash): name -> spec text, the whole fleet; `ctl` (stream): every change to
  it (`op` = `a` add / `x` remove), so replicas follow membership in order.
- `log:S` (stream): the shared ordered log of S: `k=b` a batch (`s` seq, `p` raw payload
  as vLLM sent it), `k=r` the publisher restarted, `k=l` seqs `f..t` are lost.
- `cp:S` (hash): where the log of S stands (`n` next seq, `d` digest of the last batch,
  `l` lost since the last restart). The append script checks and moves it atomically with
  each XADD, which is what makes appends idempotent by seq across replicas.
- `snap:S` (hash): the compacted state of S as of log entry `pos`: one field per run of
  blocks (see snapshot.py), run id -> its record, and the field "" -> the cursor (pos,
  next seq, digest, lost, last seq) at that entry, with the format (2) and which replica
  wrote it. One HGETALL reads both consistently. (Format 1, before runs: one field per
  block (group, medium, hash) -> (parent, tokens, size, lora, copies, stored at); still
  read, and rewritten as runs by the next compaction.)
- `status` (hash): S -> what the replica ingesting S last said about it (status, counters).
- `compactor` (string with expiry): which replica compacts now.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import msgspec
import redis
from redis.sentinel import Sentinel

from kvindex.store.base import StoreError
from kvindex.store.rows import BlockRow
from kvindex.store.snapshot import MirrorRow, Record
from kvindex.subscriber.messages import SourceKey
from kvindex.subscriber.spec import InstanceSpec, SpecError
from kvindex.subscriber.state import Checkpoint

PREFIX = "kvindex:"
_OPTIONS = {"ingest", "buffer", "compact"}


@dataclass(frozen=True, slots=True)
class IngestPolicy:
    """Which instances this replica subscribes to; it serves the others from Redis.

    `all` (the default) ingests every instance of the fleet (replicas doing the same
    append each batch once); `none` only serves; `a,b` ingests those names."""

    names: frozenset[str] | None = None  # None = all

    @classmethod
    def parse(cls, text: str) -> IngestPolicy:
        if text == "all":
            return cls(None)
        if text == "none":
            return cls(frozenset())
        names = frozenset(n for n in text.split(",") if n)
        if not names:
            raise StoreError("ingest= takes all, none or NAME[,NAME...]")
        return cls(names)

    def ingests(self, name: str) -> bool:
        return self.names is None or name in self.names

    def render(self) -> str:
        if self.names is None:
            return "all"
        return ",".join(sorted(self.names)) or "none"


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """`redis://HOST:PORT/DB[?ingest=all|none|NAMES][&buffer=N][&compact=SECONDS]`, or the
    same behind Sentinel: `redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER/DB[?...]`."""

    url: str  # what `client()` connects to (our options removed)
    ingest: IngestPolicy = field(default_factory=IngestPolicy)
    buffer: int = 200_000  # items held while Redis is away, before relying on replay
    compact: float = 2.0  # seconds between compactions

    @classmethod
    def parse(cls, url: str) -> RedisConfig:
        parts = urlsplit(url)
        sentinel = parts.scheme == SENTINEL_SCHEME
        if parts.scheme not in ("redis", SENTINEL_SCHEME) or not parts.netloc:
            raise StoreError(f"store URL {url!r} must be redis://HOST:PORT/DB")
        try:
            if sentinel:
                master, db = _sentinel_path(parts.path)
                _sentinels(parts.netloc)
                path = f"/{master}/{db}"
            else:
                if not parts.hostname:
                    raise ValueError("no host")
                _ = parts.port
                path = "/" + (parts.path.strip("/") or "0")
                if not path[1:].isdigit():
                    raise ValueError(f"database {path[1:]!r} is not a number")
            query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
            unknown = set(query) - _OPTIONS
            if unknown:
                raise ValueError(f"unknown option {sorted(unknown)[0]!r} (ingest, buffer, compact)")
            base = urlunsplit((parts.scheme, parts.netloc, path, "", ""))
            return cls(
                base,
                IngestPolicy.parse(query.get("ingest", "all")),
                int(query.get("buffer", "200000")),
                float(query.get("compact", "2.0")),
            )
        except ValueError as exc:
            raise StoreError(f"store URL {url!r}: {exc}") from None

    @property
    def where(self) -> str:
        """HOST:PORT/DB (or Sentinel's master and sentinels), without credentials."""
        parts = urlsplit(self.url)
        if parts.scheme == SENTINEL_SCHEME:
            master, db = _sentinel_path(parts.path)
            hosts = ",".join(f"{h}:{p}" for h, p in _sentinels(parts.netloc))
            return f"master {master!r} (db {db}) of Sentinel {hosts}"
        return f"{parts.hostname}:{parts.port or 6379}{parts.path}"


SENTINEL_SCHEME = "redis+sentinel"


def _sentinel_path(path: str) -> tuple[str, int]:
    master, _, db = path.strip("/").partition("/")
    db = db or "0"
    if not master or not db.isdigit():
        raise ValueError("must be redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER/DB")
    return master, int(db)


def _sentinels(netloc: str) -> list[tuple[str, int]]:
    """`[user:password@]HOST:PORT,HOST:PORT` -> [(host, port)] (26379 by default)."""
    hosts = netloc.rpartition("@")[2]
    out = []
    for item in hosts.split(","):
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "26379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"Sentinel address {item!r} must be HOST:PORT")
        out.append((host, int(port)))
    return out


def client(url: str, **options: Any) -> redis.Redis:
    """A client of `url` (RedisConfig.url): redis-py's own for `redis://`; for
    `redis+sentinel://` one that asks the Sentinels for the master at each (re)connection
    and drops a connection to a master that became a replica (a failover), so the next
    command reaches the new master. `options`: redis-py's socket timeouts and the like."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        return redis.Redis.from_url(url, **options)
    master, db = _sentinel_path(parts.path)
    userinfo = parts.netloc.rpartition("@")[0]
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    timeouts = {k: v for k, v in options.items() if k.startswith("socket_")}
    auth: dict[str, Any] = {}
    if password:
        auth["password"] = password
    if username:
        auth["username"] = username
    sentinel = Sentinel(_sentinels(parts.netloc), sentinel_kwargs=timeouts, **auth)
    master_client: redis.Redis = sentinel.master_for(master, db=db, **options)
    return master_client


# -- keys ------------------------------------------------------------------------------

INSTANCES = PREFIX + "instances"
CTL = PREFIX + "ctl"
STATUS = PREFIX + "status"
COMPACTOR = PREFIX + "compactor"


def tag(source: SourceKey) -> str:
    return f"{source.rank}:{source.instance}"


def untag(text: str) -> SourceKey:
    rank, _, name = text.partition(":")
    return SourceKey(name, int(rank))


def log_key(source: SourceKey) -> str:
    return f"{PREFIX}log:{tag(source)}"


def cp_key(source: SourceKey) -> str:
    return f"{PREFIX}cp:{tag(source)}"


def snap_key(source: SourceKey) -> str:
    return f"{PREFIX}snap:{tag(source)}"


def sources_of(spec_text: str) -> list[SourceKey]:
    """The publishers of a registered instance (its DP ranks)."""
    try:
        return [s.source for s in InstanceSpec.parse(spec_text).sources()]
    except SpecError:
        return []


# -- stream ids ------------------------------------------------------------------------

StreamId = tuple[int, int]
Fields = dict[bytes, bytes]
RawEntry = tuple[bytes, Fields]
ZERO: StreamId = (0, 0)


def parse_id(value: bytes | str) -> StreamId:
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def render_id(value: StreamId) -> str:
    return f"{value[0]}-{value[1]}"


# -- cursors: where a reader stands in one publisher's log ------------------------------


@dataclass(slots=True)
class Cursor:
    """A position in the log of one publisher, and the checkpoint it implies."""

    pos: StreamId = ZERO
    next_seq: int = 0
    digest: int | None = None
    lost: int = 0
    last_seq: int | None = None

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.next_seq, self.digest, self.lost)

    def pack(self, writer: str = "") -> bytes:
        """As a snapshot's "" field: with the format and the replica that wrote it."""
        fields = [render_id(self.pos), self.next_seq, self.digest, self.lost, self.last_seq]
        return _encode([*fields, SNAPSHOT_FORMAT, writer])

    @classmethod
    def unpack(cls, data: bytes) -> Cursor:
        pos, next_seq, digest, lost, last_seq, *_ = msgspec.msgpack.decode(data)
        return cls(parse_id(pos), next_seq, digest, lost, last_seq)


SNAPSHOT_FORMAT = 2  # runs (1: one field per block)

# Which snapshot of a publisher a mirror's saved runs are: its writer and position.
SnapshotId = tuple[str, StreamId]


def snapshot_id(cursor_field: bytes | None) -> SnapshotId | None:
    """The writer and position of a snapshot, from its "" field; None for none or for a
    format 1 snapshot (its fields are blocks, not runs: it must be rewritten whole)."""
    if not cursor_field:
        return None
    fields = msgspec.msgpack.decode(cursor_field)
    if len(fields) < 7 or fields[5] != SNAPSHOT_FORMAT:
        return None
    return str(fields[6]), parse_id(fields[0])


def snapshot_format(fields: dict[bytes, bytes]) -> int:
    cursor = fields.get(b"")
    if cursor is None:
        return SNAPSHOT_FORMAT if len(fields) == 0 else 1
    decoded = msgspec.msgpack.decode(cursor)
    return int(decoded[5]) if len(decoded) >= 7 else 1


# -- log entries ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """One log entry: kind b (batch), r (restart) or l (lost seqs first..last)."""

    id: StreamId
    kind: str
    seq: int = 0
    payload: bytes = b""
    last: int = 0


def parse_entry(entry_id: bytes | str, fields: dict[bytes, bytes]) -> Entry:
    kind = fields.get(b"k", b"?").decode()
    eid = parse_id(entry_id)
    if kind == "b":
        return Entry(eid, kind, int(fields[b"s"]), fields[b"p"])
    if kind == "l":
        return Entry(eid, kind, int(fields[b"f"]), last=int(fields[b"t"]))
    return Entry(eid, kind)


# -- snapshot rows ----------------------------------------------------------------------
# Hashes go into msgpack as they are: an int hash (vLLM's are within int64/uint64, which
# msgpack holds exactly) or bytes, so the field of a block is exact and unique.

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode
_decode_field = msgspec.msgpack.Decoder(tuple[int, str, int | bytes]).decode
_decode_value = msgspec.msgpack.Decoder(
    tuple[int | bytes | None, list[int] | None, int, str | None, int, float]
).decode


def row_field(group: int, medium: str, block_hash: bytes | int) -> bytes:
    return _encode((group, medium, block_hash))


def row_value(row: BlockRow) -> bytes:
    return _encode(
        (row.parent_hash, row.token_ids, row.block_size, row.lora_name, row.copies, row.stored_at)
    )


def decode_rows(source: SourceKey, fields: dict[bytes, bytes]) -> list[BlockRow]:
    """Snapshot fields (the cursor field excluded) as rows."""
    rows: list[BlockRow] = []
    append = rows.append
    for name, value in fields.items():
        if name:
            group, medium, block_hash = _decode_field(name)
            parent, tokens, size, lora, copies, stored = _decode_value(value)
            append(
                BlockRow(
                    source, group, medium, block_hash, parent, tokens, size, lora, copies, stored
                )
            )
    return rows


# A run record as a field: run id -> (rank, group, medium, size, lora, ts, keys, n_events,
# events); see snapshot.Record.
_RecordValue = tuple[int, int, str, int, str | None, float, bytes, int, bytes]
_decode_record = msgspec.msgpack.Decoder(_RecordValue).decode  # type: ignore[arg-type]
_decode_run_id = msgspec.msgpack.Decoder(int).decode


def record_field(record: Record) -> tuple[bytes, bytes]:
    value = (
        record.rank, record.group, record.medium, record.size, record.lora, record.ts,
        record.keys, record.n_events, record.events,
    )  # fmt: skip
    return _encode(record.id), _encode(value)


def run_field(run_id: int) -> bytes:
    return _encode(run_id)


def decode_records(fields: dict[bytes, bytes]) -> list[MirrorRow]:
    """A format 2 snapshot's records (the cursor field excluded), oldest run first."""
    out: list[MirrorRow] = []
    for name, value in fields.items():
        if name:
            rank, group, medium, size, lora, ts, keys, n, events = _decode_record(value)
            out.append((_decode_run_id(name), rank, group, medium, size, lora, ts, keys, events, n))
    out.sort(key=lambda row: row[0])
    return out


def pack(value: Any) -> bytes:
    return _encode(value)


def unpack(data: bytes) -> Any:
    return _decode(data)


# -- Lua ---------------------------------------------------------------------------------

# Appends a run of items of one publisher, each only if it is the next one: a batch whose
# seq is below the log's next seq is a duplicate (another replica, or a retry, appended
# it) and is skipped; one above it is a gap, where the script stops so the caller can fill
# it. A batch also names the digest of the batch before it as its sender saw it, which
# must be the log's last one: so a replica lagging behind a publisher restart that
# another replica already logged can't slip its old batches into the new stream (from
# such a conflict on, the sender is `diverged` and its items are skipped until it sees
# the restart too). A restart is applied only if the log stands exactly where the sender
# stood when it saw the restart (so two replicas seeing one restart append it once).
# Nothing is appended for an instance no longer registered (it was removed while this
# replica still followed it). KEYS: cp, log, instances. ARGV: name, diverged (0/1), then
# per item: kind, a, b, prev, payload. Returns {items done, code (0 done, -1 gap,
# -2 unregistered), next seq, conflicts, diverged}.
APPEND = """
-- Seqs and counts are u64: past 2**53 a Lua number (a double) would round them, so they
-- stay decimal strings here, compared and added digit by digit.
local function lt(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function add(a, b)
  local out, carry, i, j = {}, 0, #a, #b
  while i > 0 or j > 0 or carry > 0 do
    local d = carry + (i > 0 and a:byte(i) - 48 or 0) + (j > 0 and b:byte(j) - 48 or 0)
    table.insert(out, 1, string.char(48 + d % 10))
    carry = math.floor(d / 10)
    i, j = i - 1, j - 1
  end
  local r = table.concat(out):gsub('^0+', '')
  return r == '' and '0' or r
end
local function sub(a, b)  -- a - b, a >= b
  local out, borrow, i, j = {}, 0, #a, #b
  while i > 0 do
    local d = a:byte(i) - 48 - borrow - (j > 0 and b:byte(j) - 48 or 0)
    borrow = d < 0 and 1 or 0
    table.insert(out, 1, string.char(48 + d + 10 * borrow))
    i, j = i - 1, j - 1
  end
  local r = table.concat(out):gsub('^0+', '')
  return r == '' and '0' or r
end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 0 then return {0, -2, '0', 0, 0} end
local cp = redis.call('HMGET', KEYS[1], 'n', 'd', 'l')
local n = cp[1] or '0'
local d = cp[2] or ''
local lost = cp[3] or '0'
local done = 0
local code = 0
local conflicts = 0
local diverged = ARGV[2] == '1'
for i = 3, #ARGV, 5 do
  local kind, a, b = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if diverged and kind ~= 'r' then
    conflicts = conflicts + 1
  elseif kind == 'b' then
    if lt(n, a) then code = -1 break end
    if a == n and d ~= '' and ARGV[i + 3] ~= d then
      conflicts = conflicts + 1
      diverged = true
    elseif a == n then
      redis.call('XADD', KEYS[2], '*', 'k', 'b', 's', a, 'p', ARGV[i + 4])
      n = add(a, '1')
      d = b
    end
  elseif kind == 'l' then
    local last = b
    if lt(n, a) then code = -1 break end
    if not lt(last, n) then
      redis.call('XADD', KEYS[2], '*', 'k', 'l', 'f', n, 't', last)
      lost = add(lost, add(sub(last, n), '1'))
      n = add(last, '1')
      d = ''
    end
  elseif kind == 'r' then
    if lt(n, a) and not diverged then code = -1 break end
    diverged = false
    if a == n and b == d then
      redis.call('XADD', KEYS[2], '*', 'k', 'r')
      n = '0'
      d = ''
      lost = '0'
    end
  end
  done = done + 1
end
redis.call('HSET', KEYS[1], 'n', n, 'd', d, 'l', lost)
return {done, code, n, conflicts, diverged and 1 or 0}
"""

# Registers an instance (or changes its spec) and tells the other replicas; the entry
# names the replica that wrote it (`by`), which does not apply it again. A changed spec
# drops the keys of the publishers it no longer has, if the spec registered is still the
# one the caller read (`old`; else -1: read again). KEYS: instances, ctl, status, then the
# dropped publishers' keys. ARGV: name, spec, by, old ('' for none), then the dropped
# publishers' status fields.
REGISTER = """
local now = redis.call('HGET', KEYS[1], ARGV[1])
if now == ARGV[2] then return 0 end
if (now or '') ~= ARGV[4] then return -1 end
for i = 4, #KEYS do redis.call('DEL', KEYS[i]) end
for i = 5, #ARGV do redis.call('HDEL', KEYS[3], ARGV[i]) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', 10000, '*', 'op', 'a', 'name', ARGV[1],
  'spec', ARGV[2], 'by', ARGV[3])
return 1
"""

# Forgets an instance: its registration, logs, checkpoints and snapshots, and tells the
# other replicas (the entry names the replica that wrote it, as REGISTER's). KEYS:
# instances, ctl, status, then its per-publisher keys. ARGV: name, by, then the status
# fields of its publishers.
REMOVE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
for i = 4, #KEYS do redis.call('DEL', KEYS[i]) end
for i = 3, #ARGV do redis.call('HDEL', KEYS[3], ARGV[i]) end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', 10000, '*', 'op', 'x', 'name', ARGV[1], 'by', ARGV[2])
return 1
"""

# Puts back a publisher's checkpoint that Redis lost (see Worker._refill), unless the log
# already stands there or further (another replica refilled it, or appended since): a
# checkpoint never moves back. KEYS: cp. ARGV: next seq, digest, lost (decimal strings).
RESTORE_CP = """
local n = redis.call('HGET', KEYS[1], 'n') or '0'
local want = ARGV[1]
if #n > #want or (#n == #want and n >= want) then return 0 end
redis.call('HSET', KEYS[1], 'n', want, 'd', ARGV[2], 'l', ARGV[3])
return 1
"""

# Takes or renews the compaction lock. KEYS: compactor. ARGV: owner, milliseconds.
LOCK = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
