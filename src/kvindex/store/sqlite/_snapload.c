/* kvindex.store.sqlite._snapload: a SQLite store's snapshot into the compiled core, in C
 * and without the GIL (a warm start's load; store/snapshot.py's `replay` is the reference).
 *
 * One call, `load(path, api, core, register)` (`core` a Core, or a tuple of Cores: an index
 * in shards, whose `register` then answers (bit, shard) -- the publisher's Core in the
 * tuple):
 *   1. without the GIL: read every `runs` row (one sqlite3_step loop, in one read
 *      transaction), group them by publisher (instance, rank) in the order they first
 *      come, read each record's keys (msgpack [parent, hashes, extras, gone, tail]);
 *   2. with the GIL, briefly: `register(instance, rank)` gives each publisher's core bit,
 *      in that order (as the Python loader's first apply_payload of each would);
 *   3. without the GIL: put each publisher's records parents first
 *      (snapshot._parents_first, step for step), cut them into the very batches
 *      snapshot._payloads makes, and apply each as it is made (in one reused buffer)
 *      through the core's ingest API (ingest_api.h).
 *
 * So a serve that loads on a thread leaves the GIL to its imports for all but step 2.
 * Anything it does not take as the reference would -- a key that is neither an int nor
 * bytes, a column of an unexpected type, keys that do not decode -- makes it apply nothing
 * and answer "fallback": the Python loader then does it all, and says what is wrong the
 * way it always has. A batch the core's fast parser does not take (KV_APPLY_SLOW) stops
 * the applying: it and every batch after it are handed back, in order, for Python's
 * apply_payload (which decodes it in Python, or refuses it with a WireError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sqlite3.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ingest_api.h"
#include "msgpack.h"

#define CHUNK_EVENTS 4096     /* snapshot.CHUNK_EVENTS */
#define CHUNK_BYTES (8 << 20) /* snapshot.CHUNK_BYTES */
#define HASH_ONLY 0
#define UNPLACED 1
#define PLACED 2

/* -- growable arrays ---------------------------------------------------------------- */

static int grow(void **items, size_t *cap, size_t need, size_t size) {
    if (need <= *cap)
        return 1;
    size_t n = *cap ? *cap : 16;
    while (n < need)
        n *= 2;
    void *p = realloc(*items, n * size);
    if (p == NULL)
        return 0;
    *items = p;
    *cap = n;
    return 1;
}

/* A block hash as a key: an int (its msgpack kind and 64 bits) or bytes. Python's
 * BlockHash: an int never equals bytes, and -1 is not 2**64 - 1. */
enum { K_UINT = 0, K_NEG = 1, K_BIN = 2 };
typedef struct {
    int kind;
    uint32_t len;        /* K_BIN */
    const uint8_t *data; /* K_BIN: into the record's keys */
    uint64_t v;          /* K_UINT, K_NEG */
} hkey;

static uint64_t mix64(uint64_t x) { /* splitmix64's finalizer */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static uint64_t hkey_hash(const hkey *k) {
    if (k->kind != K_BIN)
        return mix64(k->v ^ ((uint64_t)k->kind << 62));
    uint64_t h = 0xcbf29ce484222325ULL ^ k->len; /* FNV-1a, then mixed */
    for (uint32_t i = 0; i < k->len; i++)
        h = (h ^ k->data[i]) * 0x100000001b3ULL;
    return mix64(h + 2);
}

static int hkey_eq(const hkey *a, const hkey *b) {
    if (a->kind != b->kind)
        return 0;
    if (a->kind != K_BIN)
        return a->v == b->v;
    return a->len == b->len && memcmp(a->data, b->data, a->len) == 0;
}

/* One hash (or key) read from msgpack: 1, or 0 if it is not an int or bytes. */
static int read_hkey(mp_reader *r, hkey *k) {
    uint8_t t;
    if (!mp_peek(r, &t))
        return 0;
    if (t == 0xc4 || t == 0xc5 || t == 0xc6) {
        k->kind = K_BIN;
        k->v = 0;
        return mp_bin(r, &k->data, &k->len);
    }
    int kind;
    if (!mp_int(r, &kind, &k->v))
        return 0;
    k->kind = kind == MP_NEGATIVE ? K_NEG : K_UINT;
    k->data = NULL;
    k->len = 0;
    return 1;
}

/* -- one load's state ---------------------------------------------------------------- */

typedef struct {
    int src;          /* publisher (index into sources) */
    int64_t placed;   /* HASH_ONLY, UNPLACED, PLACED */
    int64_t n_events; /* events in `events` */
    double ts;
    size_t keys_off, events_off; /* into the arena */
    size_t keys_len, events_len;
    /* from the keys */
    int has_parent;
    hkey parent;
    size_t hashes_at; /* offset of the hashes array in the keys */
    uint32_t n_hashes, n_gone;
    uint64_t tail;
} record;

typedef struct {
    char *instance;
    size_t instance_len;
    int64_t rank;
    uint64_t hash;
    int *recs; /* its records, oldest first */
    size_t n_recs, cap_recs;
    uint32_t bit;
    void *core; /* the Core its batches go to (a borrowed reference: `load` holds them) */
    /* applied */
    int64_t counts[3];
    double ts;
    int applied; /* batches applied in C */
    long long blocks;
} source;

typedef struct {
    int src;
    uint8_t *data;
    size_t len;
} chunk;

typedef struct {
    uint8_t *arena; /* every row's keys and events */
    size_t arena_len, arena_cap;
    record *recs;
    size_t n_recs, cap_recs;
    source *srcs;
    size_t n_srcs, cap_srcs;
    int *src_slots; /* open addressing over sources: index + 1, 0 = empty */
    size_t src_mask;
    chunk *chunks; /* batches not applied (after one the fast parser left): Python's */
    size_t n_chunks, cap_chunks;
    uint8_t *buf; /* the batch being applied (one buffer, reused) */
    size_t buf_cap;
    const kv_ingest_api *api;
    void *core;
    int collect; /* a batch was left to Python: this one and every one after are kept */
    char fallback[200]; /* why the Python loader must do it; "" if not */
    int sql_rc;         /* an SQLite error: its code and message */
    char sql_msg[300];
    int nomem;
} load_state;

static void state_free(load_state *st) {
    free(st->arena);
    free(st->recs);
    for (size_t i = 0; i < st->n_srcs; i++) {
        free(st->srcs[i].instance);
        free(st->srcs[i].recs);
    }
    free(st->srcs);
    free(st->src_slots);
    for (size_t i = 0; i < st->n_chunks; i++)
        free(st->chunks[i].data);
    free(st->chunks);
    free(st->buf);
}

static uint64_t source_hash(const char *s, size_t n, int64_t rank) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 0x100000001b3ULL;
    return mix64(h ^ (uint64_t)rank);
}

static int source_rehash(load_state *st, size_t slots) {
    int *table = calloc(slots, sizeof(int));
    if (table == NULL)
        return 0;
    for (size_t i = 0; i < st->n_srcs; i++) {
        size_t at = st->srcs[i].hash & (slots - 1);
        while (table[at])
            at = (at + 1) & (slots - 1);
        table[at] = (int)i + 1;
    }
    free(st->src_slots);
    st->src_slots = table;
    st->src_mask = slots - 1;
    return 1;
}

/* The publisher (instance, rank): found, or added last. -1: no memory. */
static int source_of(load_state *st, const char *s, size_t n, int64_t rank) {
    uint64_t h = source_hash(s, n, rank);
    size_t at = h & st->src_mask;
    for (int i; (i = st->src_slots[at]) != 0; at = (at + 1) & st->src_mask) {
        source *src = &st->srcs[i - 1];
        if (src->hash == h && src->rank == rank && src->instance_len == n &&
            memcmp(src->instance, s, n) == 0)
            return i - 1;
    }
    if (!grow((void **)&st->srcs, &st->cap_srcs, st->n_srcs + 1, sizeof(source)))
        return -1;
    source *src = &st->srcs[st->n_srcs];
    memset(src, 0, sizeof *src);
    src->instance = malloc(n + 1);
    if (src->instance == NULL)
        return -1;
    memcpy(src->instance, s, n);
    src->instance[n] = 0;
    src->instance_len = n;
    src->rank = rank;
    src->hash = h;
    st->n_srcs++;
    if (st->n_srcs * 2 > st->src_mask + 1)
        return source_rehash(st, (st->src_mask + 1) * 2) ? (int)st->n_srcs - 1 : -1;
    st->src_slots[at] = (int)st->n_srcs;
    return (int)st->n_srcs - 1;
}

static size_t arena_put(load_state *st, const void *data, size_t len) {
    size_t at = st->arena_len;
    if (!grow((void **)&st->arena, &st->arena_cap, at + len + 1, 1)) {
        st->nomem = 1;
        return 0;
    }
    if (len)
        memcpy(st->arena + at, data, len);
    st->arena_len += len;
    return at;
}

/* -- step 1a: the rows --------------------------------------------------------------- */

static void sql_failed(load_state *st, sqlite3 *db, int rc) {
    st->sql_rc = rc;
    snprintf(st->sql_msg, sizeof st->sql_msg, "%s",
             db != NULL ? sqlite3_errmsg(db) : sqlite3_errstr(rc));
}

static const char *SELECT_RUNS =
    "SELECT instance, rank, placed, keys, events, n_events, stored_at FROM runs ORDER BY run";

static void read_rows(load_state *st, const char *path) {
    sqlite3 *db = NULL;
    sqlite3_stmt *stmt = NULL;
    int rc = sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, NULL);
    if (rc != SQLITE_OK) {
        sql_failed(st, db, rc);
        sqlite3_close(db);
        return;
    }
    sqlite3_busy_timeout(db, 30000); /* as tables.connect's connections wait */
    /* One read transaction: the rows of one snapshot, whatever a writer does meanwhile.
     * Not memory-mapped (PRAGMA mmap_size): the scan was 0.03-0.06 s faster alone but no
     * faster beside serve's imports, and the mapped file (313 MB for 1M blocks) counted in
     * the process's peak RSS (360 MiB against 194 without). */
    rc = sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
    if (rc == SQLITE_OK)
        rc = sqlite3_prepare_v2(db, SELECT_RUNS, -1, &stmt, NULL);
    while (rc == SQLITE_OK || rc == SQLITE_ROW) {
        rc = sqlite3_step(stmt);
        if (rc != SQLITE_ROW)
            break;
        if (sqlite3_column_type(stmt, 0) != SQLITE_TEXT ||
            sqlite3_column_type(stmt, 1) != SQLITE_INTEGER ||
            sqlite3_column_type(stmt, 2) != SQLITE_INTEGER ||
            sqlite3_column_type(stmt, 3) != SQLITE_BLOB ||
            sqlite3_column_type(stmt, 4) != SQLITE_BLOB ||
            sqlite3_column_type(stmt, 5) != SQLITE_INTEGER ||
            sqlite3_column_type(stmt, 6) != SQLITE_FLOAT) {
            snprintf(st->fallback, sizeof st->fallback, "a runs row of unexpected types");
            break;
        }
        const char *instance = (const char *)sqlite3_column_text(stmt, 0);
        size_t instance_len = (size_t)sqlite3_column_bytes(stmt, 0);
        int src = instance == NULL ? -1
                                   : source_of(st, instance, instance_len,
                                               sqlite3_column_int64(stmt, 1));
        if (src < 0 ||
            !grow((void **)&st->recs, &st->cap_recs, st->n_recs + 1, sizeof(record))) {
            st->nomem = 1;
            break;
        }
        source *s = &st->srcs[src];
        if (!grow((void **)&s->recs, &s->cap_recs, s->n_recs + 1, sizeof(int))) {
            st->nomem = 1;
            break;
        }
        s->recs[s->n_recs++] = (int)st->n_recs;
        record *r = &st->recs[st->n_recs++];
        memset(r, 0, sizeof *r);
        r->src = src;
        r->placed = sqlite3_column_int64(stmt, 2);
        r->n_events = sqlite3_column_int64(stmt, 5);
        r->ts = sqlite3_column_double(stmt, 6);
        const void *keys = sqlite3_column_blob(stmt, 3);
        r->keys_len = (size_t)sqlite3_column_bytes(stmt, 3);
        r->keys_off = arena_put(st, keys, r->keys_len);
        const void *events = sqlite3_column_blob(stmt, 4);
        r->events_len = (size_t)sqlite3_column_bytes(stmt, 4);
        r->events_off = arena_put(st, events, r->events_len);
        if (st->nomem)
            break;
    }
    if (!st->nomem && !st->fallback[0] && rc != SQLITE_DONE)
        sql_failed(st, db, rc);
    sqlite3_finalize(stmt);
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    sqlite3_close(db);
}

/* -- step 1b: keys, order, batches --------------------------------------------------- */

/* A record's keys, as snapshot._decode_keys reads them: 0 if the reference would not
 * take them as this code does (the Python loader then decides). */
static int read_keys(load_state *st, record *r) {
    mp_reader rd = {st->arena + r->keys_off, st->arena + r->keys_off + r->keys_len};
    uint32_t n, i;
    if (!mp_array(&rd, &n) || n < 3)
        return 0;
    if (mp_nil(&rd))
        r->has_parent = 0;
    else if (read_hkey(&rd, &r->parent))
        r->has_parent = 1;
    else
        return 0;
    r->hashes_at = (size_t)(rd.p - st->arena);
    if (!mp_array(&rd, &r->n_hashes))
        return 0;
    for (i = 0; i < r->n_hashes; i++) {
        hkey k;
        if (!read_hkey(&rd, &k))
            return 0;
    }
    if (!mp_skip(&rd)) /* extras: the loader does not read them */
        return 0;
    r->n_gone = 0;
    r->tail = 0;
    if (n >= 5) {
        if (!mp_nil(&rd)) {
            if (!mp_array(&rd, &r->n_gone))
                return 0;
            for (i = 0; i < r->n_gone; i++)
                if (!mp_skip(&rd))
                    return 0;
        }
        int kind;
        if (!mp_int(&rd, &kind, &r->tail) || kind != MP_UINT)
            return 0;
    }
    for (i = 5; i < n; i++) /* fields past the fifth: read by nobody, but well formed */
        if (!mp_skip(&rd))
            return 0;
    return rd.p == rd.end; /* msgspec refuses trailing bytes */
}

/* parent hash -> the first placed record holding it (-1: none yet). Open addressing. */
typedef struct {
    hkey key;
    uint64_t hash;
    int holder;
    int used;
} wslot;

typedef struct {
    wslot *slots;
    size_t mask;
} wset;

static wslot *wset_find(wset *w, const hkey *k, uint64_t h) {
    size_t at = h & w->mask;
    while (w->slots[at].used) {
        if (w->slots[at].hash == h && hkey_eq(&w->slots[at].key, k))
            return &w->slots[at];
        at = (at + 1) & w->mask;
    }
    return &w->slots[at];
}

/* snapshot._parents_first for one publisher's records `idx` (n of them), into `order`.
 * 0: no memory. */
static int parents_first(load_state *st, const int *idx, size_t n, int *order) {
    size_t size = 16;
    while (size < 2 * n + 16)
        size *= 2;
    wset w = {calloc(size, sizeof(wslot)), size - 1};
    int *holder_of = malloc((n + 1) * sizeof(int)); /* record -> holder of its parent */
    int *wait_head = malloc((n + 1) * sizeof(int)), *wait_tail = malloc((n + 1) * sizeof(int));
    int *wait_next = malloc((n + 1) * sizeof(int)), *stack = malloc((n + 1) * sizeof(int));
    uint8_t *done = calloc(n + 1, 1);
    int ok = w.slots && holder_of && wait_head && wait_tail && wait_next && stack && done;
    if (!ok)
        goto out;
    size_t i, out_n = 0;
    /* wanted: the parents placed records name */
    for (i = 0; i < n; i++) {
        record *r = &st->recs[idx[i]];
        if (r->placed == PLACED && r->has_parent) {
            uint64_t h = hkey_hash(&r->parent);
            wslot *s = wset_find(&w, &r->parent, h);
            if (!s->used)
                *s = (wslot){r->parent, h, -1, 1};
        }
    }
    /* holder: for each wanted hash, the first placed record holding it (gone blocks too) */
    for (i = 0; i < n; i++) {
        record *r = &st->recs[idx[i]];
        if (r->placed != PLACED)
            continue;
        mp_reader rd = {st->arena + r->hashes_at, st->arena + r->keys_off + r->keys_len};
        uint32_t m = 0;
        mp_array(&rd, &m); /* read once already: well formed */
        for (uint32_t j = 0; j < m; j++) {
            hkey k;
            read_hkey(&rd, &k);
            wslot *s = wset_find(&w, &k, hkey_hash(&k));
            if (s->used && s->holder < 0)
                s->holder = (int)i;
        }
    }
    for (i = 0; i < n; i++) {
        record *r = &st->recs[idx[i]];
        holder_of[i] = -1;
        if (r->placed == PLACED && r->has_parent)
            holder_of[i] = wset_find(&w, &r->parent, hkey_hash(&r->parent))->holder;
        wait_head[i] = wait_tail[i] = wait_next[i] = -1;
    }
    for (i = 0; i < n; i++) /* chains the index can't place go first */
        if (st->recs[idx[i]].placed == UNPLACED)
            order[out_n++] = (int)i;
#define EMIT(first)                                                                          \
    do {                                                                                     \
        size_t top = 0;                                                                      \
        stack[top++] = (first);                                                              \
        while (top) {                                                                        \
            int k = stack[--top];                                                            \
            if (done[k])                                                                     \
                continue;                                                                    \
            done[k] = 1;                                                                     \
            order[out_n++] = k;                                                              \
            /* its waiting records, first on top (pushed reversed) */                        \
            size_t at = top;                                                                 \
            for (int c = wait_head[k]; c >= 0; c = wait_next[c])                             \
                stack[top++] = c;                                                            \
            for (size_t a = at, b = top; a + 1 < b; a++, b--) {                              \
                int t = stack[a];                                                            \
                stack[a] = stack[b - 1];                                                     \
                stack[b - 1] = t;                                                            \
            }                                                                                \
            wait_head[k] = -1; /* popped: waiting.pop(i) */                                  \
        }                                                                                    \
    } while (0)
    for (i = 0; i < n; i++) {
        record *r = &st->recs[idx[i]];
        if (r->placed == UNPLACED)
            continue;
        int j = holder_of[i];
        if (j < 0 || j == (int)i || done[j]) {
            EMIT((int)i);
        } else { /* after its parent's record */
            if (wait_head[j] < 0)
                wait_head[j] = (int)i;
            else
                wait_next[wait_tail[j]] = (int)i;
            wait_tail[j] = (int)i;
        }
    }
    for (i = 0; i < n; i++) /* left: a cycle of parents (an insane publisher) */
        if (st->recs[idx[i]].placed != UNPLACED && !done[i])
            EMIT((int)i);
#undef EMIT
out:
    free(w.slots);
    free(holder_of);
    free(wait_head);
    free(wait_tail);
    free(wait_next);
    free(stack);
    free(done);
    return ok;
}

static size_t array_header(uint8_t *p, size_t n) { /* snapshot.array_header */
    if (n < 16) {
        p[0] = (uint8_t)(0x90 | n);
        return 1;
    }
    if (n < (1 << 16)) {
        p[0] = 0xdc, p[1] = (uint8_t)(n >> 8), p[2] = (uint8_t)n;
        return 3;
    }
    p[0] = 0xdd;
    for (int i = 0; i < 4; i++)
        p[1 + i] = (uint8_t)(n >> (24 - 8 * i));
    return 5;
}

typedef struct {
    const uint8_t *data;
    size_t len;
} piece;

/* One batch [ts, [events...]] of these pieces: applied (built in the reused buffer), or,
 * once one was left to Python, kept for it. 0: no memory (here or in the core). */
static int emit_chunk(load_state *st, int src, const uint8_t ts[9], const piece *pieces,
                      size_t n_pieces, size_t events, size_t bytes) {
    if (!grow((void **)&st->buf, &st->buf_cap, 1 + 9 + 5 + bytes, 1))
        return 0;
    uint8_t *p = st->buf;
    *p++ = 0x92;
    memcpy(p, ts, 9);
    p += 9;
    p += array_header(p, events);
    for (size_t i = 0; i < n_pieces; i++) {
        memcpy(p, pieces[i].data, pieces[i].len);
        p += pieces[i].len;
    }
    size_t len = (size_t)(p - st->buf);
    if (!st->collect) {
        source *s = &st->srcs[src];
        double batch_ts = 0;
        int64_t counts[3] = {0, 0, 0};
        /* The core copies what it keeps: the buffer is free again once this returns. */
        int rc = st->api->apply(s->core, s->bit, st->buf, len, &batch_ts, counts, NULL);
        if (rc == KV_APPLY_NOMEM)
            return 0;
        if (rc == KV_APPLY_DONE) {
            for (int k = 0; k < 3; k++)
                s->counts[k] += counts[k];
            s->ts = batch_ts;
            s->applied++;
            return 1;
        }
        st->collect = 1; /* left to Python: so is every batch after it, in order */
    }
    if (!grow((void **)&st->chunks, &st->cap_chunks, st->n_chunks + 1, sizeof(chunk)))
        return 0;
    uint8_t *data = malloc(len);
    if (data == NULL)
        return 0;
    memcpy(data, st->buf, len);
    st->chunks[st->n_chunks++] = (chunk){src, data, len};
    return 1;
}

/* snapshot._payloads for one publisher: its records' events, parents first, in batches;
 * then the removals of blocks gone from their pools; each applied as it is made (see
 * emit_chunk). 0: no memory. */
static int source_batches(load_state *st, int src) {
    source *s = &st->srcs[src];
    size_t n = s->n_recs, i;
    int *order = malloc((n + 1) * sizeof(int));
    piece *pieces = malloc((n + 1) * sizeof(piece)), *removals = malloc((n + 1) * sizeof(piece));
    int ok = order && pieces && removals && parents_first(st, s->recs, n, order);
    if (!ok)
        goto out;
    double ts = st->recs[s->recs[0]].ts;
    for (i = 1; i < n; i++) /* max(): the first of equal ones, NaN as Python compares it */
        if (st->recs[s->recs[i]].ts > ts)
            ts = st->recs[s->recs[i]].ts;
    uint8_t ts_bytes[9] = {0xcb};
    uint64_t bits;
    memcpy(&bits, &ts, 8);
    for (int b = 0; b < 8; b++)
        ts_bytes[1 + b] = (uint8_t)(bits >> (56 - 8 * b));
    size_t n_pieces = 0, n_removals = 0, events = 0, bytes = 0;
    for (i = 0; i < n; i++) {
        record *r = &st->recs[s->recs[order[i]]];
        const uint8_t *data = st->arena + r->events_off;
        size_t len = r->events_len;
        int64_t count = r->n_events;
        if (r->tail) { /* data[:-tail], and data[-tail:] to remove at the end */
            size_t tail = r->tail < len ? (size_t)r->tail : len;
            len -= tail;
            count -= 1;
            removals[n_removals++] = (piece){data + len, tail};
        }
        pieces[n_pieces++] = (piece){data, len};
        events += (size_t)count;
        bytes += len;
        s->blocks += (long long)r->n_hashes - (long long)r->n_gone;
        if (events >= CHUNK_EVENTS || bytes >= CHUNK_BYTES) {
            if (!emit_chunk(st, src, ts_bytes, pieces, n_pieces, events, bytes))
                goto nomem;
            n_pieces = events = bytes = 0;
        }
    }
    if (n_pieces && !emit_chunk(st, src, ts_bytes, pieces, n_pieces, events, bytes))
        goto nomem;
    for (i = 0; i < n_removals; i += CHUNK_EVENTS) {
        size_t part = n_removals - i < CHUNK_EVENTS ? n_removals - i : CHUNK_EVENTS;
        size_t len = 0;
        for (size_t j = 0; j < part; j++)
            len += removals[i + j].len;
        if (!emit_chunk(st, src, ts_bytes, removals + i, part, part, len))
            goto nomem;
    }
    goto out;
nomem:
    ok = 0;
out:
    free(order);
    free(pieces);
    free(removals);
    return ok;
}

static void prepare(load_state *st, const char *path) {
    st->src_slots = calloc(16, sizeof(int));
    st->src_mask = 15;
    if (st->src_slots == NULL) {
        st->nomem = 1;
        return;
    }
    read_rows(st, path);
    if (st->nomem || st->sql_rc || st->fallback[0])
        return;
    for (size_t i = 0; i < st->n_recs; i++) {
        record *r = &st->recs[i];
        if (!read_keys(st, r)) {
            snprintf(st->fallback, sizeof st->fallback, "a snapshot record's keys");
            return;
        }
        /* Python's n_events is whatever the row says; a negative count or a tail past
         * the events is the reference's to judge. */
        if (r->n_events < 0 || r->n_events > UINT32_MAX || (r->tail && r->n_events < 1)) {
            snprintf(st->fallback, sizeof st->fallback, "a snapshot record's counts");
            return;
        }
    }
}

/* -- step 3 -------------------------------------------------------------------------- */

/* Each publisher's batches, made and applied in order (those after one the fast parser
 * left kept for Python). 0: no memory. */
static int apply_all(load_state *st) {
    for (size_t s = 0; s < st->n_srcs; s++)
        if (!source_batches(st, (int)s))
            return 0;
    return 1;
}

/* -- the Python entry ---------------------------------------------------------------- */

static PyObject *sql_error(const load_state *st) {
    PyObject *module = PyImport_ImportModule("sqlite3");
    if (module == NULL)
        return NULL;
    const char *name = "DatabaseError";
    switch (st->sql_rc & 0xff) {
    case SQLITE_NOMEM:
        Py_DECREF(module);
        return PyErr_NoMemory();
    case SQLITE_ERROR: case SQLITE_PERM: case SQLITE_ABORT: case SQLITE_BUSY:
    case SQLITE_LOCKED: case SQLITE_READONLY: case SQLITE_INTERRUPT: case SQLITE_IOERR:
    case SQLITE_FULL: case SQLITE_CANTOPEN: case SQLITE_PROTOCOL: case SQLITE_EMPTY:
    case SQLITE_SCHEMA:
        name = "OperationalError"; /* as Python's sqlite3 maps them */
        break;
    }
    PyObject *cls = PyObject_GetAttrString(module, name);
    Py_DECREF(module);
    if (cls == NULL)
        return NULL;
    PyErr_SetString(cls, st->sql_msg);
    Py_DECREF(cls);
    return NULL;
}

/* What `register` answered for `s` (a new reference, consumed): its bit, and with shards
 * (`core` a tuple) the index of its Core. 0 with an error set. */
static int source_core(source *s, PyObject *answer, PyObject *core) {
    PyObject *bit = answer, *shard = NULL;
    if (PyTuple_Check(core)) {
        if (!PyTuple_Check(answer) || PyTuple_GET_SIZE(answer) != 2) {
            PyErr_SetString(PyExc_TypeError, "register gives (bit, shard) with shards");
            Py_DECREF(answer);
            return 0;
        }
        bit = PyTuple_GET_ITEM(answer, 0);
        shard = PyTuple_GET_ITEM(answer, 1);
    }
    unsigned long value = PyLong_AsUnsignedLong(bit);
    Py_ssize_t at = shard != NULL ? PyLong_AsSsize_t(shard) : 0;
    Py_DECREF(answer);
    if (PyErr_Occurred())
        return 0;
    if (shard != NULL && (at < 0 || at >= PyTuple_GET_SIZE(core))) {
        PyErr_SetString(PyExc_ValueError, "register gave a shard out of range");
        return 0;
    }
    s->bit = (uint32_t)value;
    s->core = shard != NULL ? PyTuple_GET_ITEM(core, at) : core;
    return 1;
}

/* load(path, api, core, register) -> ("fallback", why) or
   ("ok", [(instance, rank, blocks, ts, (stored, removed, clears), batches applied)...],
    [(instance, rank, payload), ...] not applied: for Python's apply_payload, in order) */
static PyObject *load(PyObject *self, PyObject *args) {
    (void)self;
    const char *path;
    PyObject *api_obj, *core, *reg;
    if (!PyArg_ParseTuple(args, "sOOO", &path, &api_obj, &core, &reg))
        return NULL;
    const kv_ingest_api *api = PyCapsule_GetPointer(api_obj, KV_INGEST_API_NAME);
    if (api == NULL)
        return NULL;
    if (api->version != KV_INGEST_API_VERSION)
        return Py_BuildValue("(ss)", "fallback", "the core's ingest API is of another version");
    load_state st;
    memset(&st, 0, sizeof st);
    PyObject *result = NULL, *sources = NULL, *rest = NULL;
    int applied = 0;
    Py_BEGIN_ALLOW_THREADS
    prepare(&st, path);
    Py_END_ALLOW_THREADS
    if (st.nomem) {
        PyErr_NoMemory();
        goto out;
    }
    if (st.sql_rc) {
        sql_error(&st);
        goto out;
    }
    if (st.fallback[0]) {
        result = Py_BuildValue("(ss)", "fallback", st.fallback);
        goto out;
    }
    for (size_t i = 0; i < st.n_srcs; i++) {
        source *s = &st.srcs[i];
        PyObject *bit = PyObject_CallFunction(reg, "s#L", s->instance,
                                              (Py_ssize_t)s->instance_len, (long long)s->rank);
        if (bit == NULL || !source_core(s, bit, core))
            goto out;
    }
    st.api = api;
    st.core = core;
    Py_INCREF(core); /* the Core stays while its lock may be held without the GIL */
    Py_BEGIN_ALLOW_THREADS
    applied = apply_all(&st);
    Py_END_ALLOW_THREADS
    Py_DECREF(core);
    if (!applied) {
        PyErr_NoMemory();
        goto out;
    }
    sources = PyList_New((Py_ssize_t)st.n_srcs);
    rest = PyList_New(0);
    if (sources == NULL || rest == NULL)
        goto out;
    for (size_t i = 0; i < st.n_srcs; i++) {
        source *s = &st.srcs[i];
        PyObject *item = Py_BuildValue(
            "(s#LLd(LLL)i)", s->instance, (Py_ssize_t)s->instance_len, (long long)s->rank,
            s->blocks, s->ts, (long long)s->counts[0], (long long)s->counts[1],
            (long long)s->counts[2], s->applied);
        if (item == NULL)
            goto out;
        PyList_SET_ITEM(sources, (Py_ssize_t)i, item);
    }
    for (size_t i = 0; i < st.n_chunks; i++) {
        source *s = &st.srcs[st.chunks[i].src];
        PyObject *item =
            Py_BuildValue("(s#Ly#)", s->instance, (Py_ssize_t)s->instance_len,
                          (long long)s->rank, st.chunks[i].data, (Py_ssize_t)st.chunks[i].len);
        if (item == NULL || PyList_Append(rest, item) < 0) {
            Py_XDECREF(item);
            goto out;
        }
        Py_DECREF(item);
    }
    result = Py_BuildValue("(sOO)", "ok", sources, rest);
out:
    Py_XDECREF(sources);
    Py_XDECREF(rest);
    state_free(&st);
    return result;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS,
     "load(path, api, core, register): a SQLite store's snapshot into the core (see the "
     "module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvindex.store.sqlite._snapload",
    "A SQLite store's snapshot into the compiled core, without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__snapload(void) { return PyModule_Create(&module); }
