/* Parsing an event batch straight from its msgpack bytes into ops (no Python objects).
 *
 * The fast path takes what vLLM (0.9-0.33) and SGLang send every step; it must take a
 * payload only where kvindex.wire's typed msgspec decode would decode it to the same
 * events, and then mean the same as fleet.py's apply. Anything else -- an unknown event
 * type, a value of an unexpected type, multimodal or lookahead keys, a token past 32 bits,
 * a malformed payload -- makes `parse_batch` answer PARSE_SLOW before anything is applied:
 * the caller hands the payload to the Python decoder, which decides (and counts).
 *
 * What msgspec does that the fast path mirrors (checked by tests/test_core.py and the
 * fuzzer): a float field takes an int, never a bool; a later duplicate key wins; keys not
 * known are skipped; a batch array may have extra items after the rank; an array event
 * may have items past the fields; strings must be valid UTF-8.
 */
#include "core.h"

#include "msgpack.h"

/* The fields of BlockStored in array order (index 0 is the tag); BlockRemoved's array
 * order is hashes, medium, group_idx, locality, ownership. */
enum field {
    F_UNKNOWN = 0,
    F_HASHES,
    F_PARENT,
    F_TOKENS,
    F_SIZE,
    F_LORA_ID,
    F_MEDIUM,
    F_LORA_NAME,
    F_EXTRA,
    F_GROUP,
    F_KIND,
    F_WINDOW,
    F_LOCALITY,
    F_OWNERSHIP,
    F_SESSION,
    F_LOOKAHEAD,
    F_SALT,
};

static const enum field STORED_ORDER[] = {
    F_UNKNOWN, F_HASHES,  F_PARENT, F_TOKENS,   F_SIZE,      F_LORA_ID,  F_MEDIUM,    F_LORA_NAME, F_EXTRA,
    F_GROUP,   F_KIND,    F_WINDOW, F_LOCALITY, F_OWNERSHIP, F_SESSION, F_LOOKAHEAD, F_SALT,
};
static const enum field REMOVED_ORDER[] = {F_UNKNOWN, F_HASHES, F_MEDIUM, F_GROUP, F_LOCALITY,
                                           F_OWNERSHIP};

static enum field field_of(const uint8_t *k, uint32_t n, int stored) {
#define IS(text) (memcmp(k, text, sizeof(text) - 1) == 0)
    /* By length first: one memcmp for most keys (this runs for every field of every event). */
    switch (n) {
    case 12:
        return IS("block_hashes") ? F_HASHES : F_UNKNOWN;
    case 6:
        return IS("medium") ? F_MEDIUM : F_UNKNOWN;
    case 9:
        if (IS("group_idx"))
            return F_GROUP;
        if (IS("ownership"))
            return F_OWNERSHIP;
        if (stored && IS("token_ids"))
            return F_TOKENS;
        if (stored && IS("lora_name"))
            return F_LORA_NAME;
        return F_UNKNOWN;
    case 8:
        return IS("locality") ? F_LOCALITY : F_UNKNOWN;
    }
    if (!stored)
        return F_UNKNOWN;
    switch (n) {
    case 17:
        return IS("parent_block_hash") ? F_PARENT : F_UNKNOWN;
    case 10:
        if (IS("block_size"))
            return F_SIZE;
        if (IS("extra_keys"))
            return F_EXTRA;
        if (IS("session_id"))
            return F_SESSION;
        if (IS("cache_salt"))
            return F_SALT;
        return F_UNKNOWN;
    case 7:
        return IS("lora_id") ? F_LORA_ID : F_UNKNOWN;
    case 18:
        return IS("kv_cache_spec_kind") ? F_KIND : F_UNKNOWN;
    case 28:
        return IS("kv_cache_spec_sliding_window") ? F_WINDOW : F_UNKNOWN;
    case 19:
        return IS("lookahead_token_ids") ? F_LOOKAHEAD : F_UNKNOWN;
    }
    return F_UNKNOWN;
#undef IS
}

/* -- scratch ------------------------------------------------------------------------- */

/* Room for `more` items after `count`. In 64 bits: a count from the wire near 2^32
 * would wrap a 32-bit sum (no room made, then writes past the end) or double the
 * capacity to 0 forever (a hang); past 2^32 items the batch goes to Python. */
#define GROW(arr, count, cap, more)                                                        \
    do {                                                                                   \
        int grown_ = KV_GROW(arr, cap, (uint64_t)(count) + (more));                        \
        if (grown_ != 0)                                                                   \
            return grown_ == -1 ? PARSE_NOMEM : PARSE_SLOW;                                \
    } while (0)

/* Whether an array header's count can be true: every item takes a byte at least. (Else
 * a 10-byte payload could make the scratch grow to gigabytes before failing.) */
static inline int items_fit(const mp_reader *r, uint32_t n) {
    return (size_t)n <= (size_t)(r->end - r->p);
}

void scratch_reset(scratch_t *sc) {
    sc->nops = sc->nhashes = sc->nkeys = sc->ntokens = 0;
    sc->has_rank = 0;
    sc->ts = 0;
}

void scratch_free(scratch_t *sc) {
    free(sc->ops);
    free(sc->hashes);
    free(sc->keys);
    free(sc->tokens);
    free(sc->hk);
    memset(sc, 0, sizeof *sc);
}

/* -- values -------------------------------------------------------------------------- */

/* A block hash: an int of any width, or bytes of 1 to 128 (MAX_HASH_BYTES). */
static int read_hash(mp_reader *r, phash *h) {
    uint8_t t;
    if (!mp_peek(r, &t))
        return 0;
    if (t >= 0xc4 && t <= 0xc6) {
        if (!mp_bin(r, &h->p, &h->len) || h->len < 1 || h->len > 128)
            return 0;
        h->kind = HK_BYTES;
        h->v = 0;
        return 1;
    }
    int kind;
    if (!mp_int(r, &kind, &h->v))
        return 0;
    h->kind = kind == MP_NEGATIVE ? HK_NEGATIVE : HK_UINT;
    h->p = NULL;
    h->len = 0;
    return 1;
}

static int read_hashes(mp_reader *r, scratch_t *sc, op_t *op) {
    uint32_t n;
    if (!mp_array(r, &n) || !items_fit(r, n))
        return PARSE_SLOW;
    GROW(sc->hashes, sc->nhashes, sc->hashes_cap, n);
    op->hashes_off = sc->nhashes;
    op->nhashes = n;
    for (uint32_t i = 0; i < n; i++)
        if (!read_hash(r, &sc->hashes[sc->nhashes + i]))
            return PARSE_SLOW;
    sc->nhashes += n;
    return PARSE_OK;
}

/* Token ids: the fast path keeps them as uint32 (every real vocabulary); one past that
 * (or negative) sends the batch to Python, whose keys take int64. */
static int read_tokens(mp_reader *r, scratch_t *sc, op_t *op) {
    uint32_t n;
    if (!mp_array(r, &n) || !items_fit(r, n))
        return PARSE_SLOW;
    GROW(sc->tokens, sc->ntokens, sc->tokens_cap, n);
    op->tokens_off = sc->ntokens;
    op->ntokens = n;
    uint32_t *out = sc->tokens + sc->ntokens;
    for (uint32_t i = 0; i < n; i++) {
        /* The common encodings inline (token ids: fixint, uint8, uint16, uint32). */
        size_t left = (size_t)(r->end - r->p);
        uint8_t t = left ? r->p[0] : 0xc1;
        if (t <= 0x7f) {
            out[i] = t;
            r->p++;
            continue;
        }
        if (t == 0xcd && left >= 3) {
            out[i] = mp_be16(r->p + 1);
            r->p += 3;
            continue;
        }
        if (t == 0xce && left >= 5) {
            out[i] = mp_be32(r->p + 1);
            r->p += 5;
            continue;
        }
        if (t == 0xcc && left >= 2) {
            out[i] = r->p[1];
            r->p += 2;
            continue;
        }
        int kind;
        uint64_t v;
        if (!mp_int(r, &kind, &v) || kind != MP_UINT || v > 0xFFFFFFFFULL)
            return PARSE_SLOW;
        out[i] = (uint32_t)v;
    }
    sc->ntokens += n;
    op->tokens_kept = 1;
    return PARSE_OK;
}

static int read_opt_int(mp_reader *r, int64_t *v, uint8_t *present) {
    if (mp_nil(r)) {
        *present = 0;
        return 1;
    }
    int kind;
    uint64_t u;
    if (!mp_int(r, &kind, &u))
        return 0;
    if (kind == MP_UINT && u > (uint64_t)INT64_MAX)
        return 0; /* a Python int fine for msgspec, but not for these fields' use here */
    *v = (int64_t)u;
    *present = 1;
    return 1;
}

static int read_opt_str(mp_reader *r, span_t *s) {
    if (mp_nil(r)) {
        s->p = NULL;
        s->len = 0;
        return 1;
    }
    if (!mp_str(r, &s->p, &s->len) || !mp_utf8(s->p, s->len))
        return 0;
    if (s->p == NULL) /* a zero-length str still needs a non-NULL "present" pointer */
        s->p = (const uint8_t *)"";
    return 1;
}

/* Python's truthiness of one msgpack value (`not any(extra_keys)` in fleet.py's `_plain`):
 * -1 if the value is one the fast path won't judge. */
static int falsy(mp_reader *r) {
    uint8_t t;
    if (!mp_peek(r, &t))
        return -1;
    const uint8_t *p;
    uint32_t n;
    if (t == 0xc0 || t == 0xc2) {
        r->p++;
        return 1;
    }
    if (t == 0xc3) {
        r->p++;
        return 0;
    }
    if (t <= 0x7f || t >= 0xe0 || (t >= 0xcc && t <= 0xd3)) {
        int kind;
        uint64_t v;
        return mp_int(r, &kind, &v) ? v == 0 : -1;
    }
    if ((t & 0xe0) == 0xa0 || (t >= 0xd9 && t <= 0xdb))
        return mp_str(r, &p, &n) && mp_utf8(p, n) ? n == 0 : -1;
    if (t >= 0xc4 && t <= 0xc6)
        return mp_bin(r, &p, &n) ? n == 0 : -1;
    if ((t & 0xf0) == 0x90 || t == 0xdc || t == 0xdd) {
        const uint8_t *at = r->p;
        if (!mp_array(r, &n))
            return -1;
        if (n == 0)
            return 1;
        r->p = at;
        return mp_skip(r) ? 0 : -1;
    }
    if ((t & 0xf0) == 0x80 || t == 0xde || t == 0xdf) {
        const uint8_t *at = r->p;
        if (!mp_map(r, &n))
            return -1;
        if (n == 0)
            return 1;
        r->p = at;
        return mp_skip(r) ? 0 : -1;
    }
    return -1; /* floats (0.0 vs NaN...) and ext types: Python decides */
}

typedef struct {
    const uint8_t *at; /* where extra_keys starts (NULL: absent or nil) */
} extra_span;

/* -- events -------------------------------------------------------------------------- */

static inline __attribute__((always_inline)) int read_field(mp_reader *r, scratch_t *sc, op_t *op,
                                                             enum field f, extra_span *extra) {
    span_t ignored;
    switch (f) {
    case F_HASHES:
        return read_hashes(r, sc, op);
    case F_PARENT:
        if (mp_nil(r)) {
            op->has_parent = 0;
            return PARSE_OK;
        }
        op->has_parent = 1;
        return read_hash(r, &op->parent) ? PARSE_OK : PARSE_SLOW;
    case F_TOKENS:
        return read_tokens(r, sc, op);
    case F_SIZE: {
        int kind;
        uint64_t v;
        if (!mp_int(r, &kind, &v))
            return PARSE_SLOW;
        if (kind == MP_UINT && v >= (1ULL << 31))
            return PARSE_SLOW; /* no block is that large: let Python say what it is */
        op->block_size = (int64_t)v; /* a negative size: held without a place */
        return PARSE_OK;
    }
    case F_LORA_ID:
        return read_opt_int(r, &op->lora_id, &op->has_lora_id) ? PARSE_OK : PARSE_SLOW;
    case F_MEDIUM:
        return read_opt_str(r, &op->medium) ? PARSE_OK : PARSE_SLOW;
    case F_LORA_NAME:
        return read_opt_str(r, &op->lora) ? PARSE_OK : PARSE_SLOW;
    case F_EXTRA:
        extra->at = mp_is_nil(r) ? NULL : r->p;
        return mp_skip(r) ? PARSE_OK : PARSE_SLOW;
    case F_GROUP:
        return read_opt_int(r, &op->group, &op->has_group) ? PARSE_OK : PARSE_SLOW;
    case F_KIND:
        if (!read_opt_str(r, &op->spec_kind))
            return PARSE_SLOW;
        op->has_spec = op->spec_kind.p != NULL;
        return PARSE_OK;
    case F_WINDOW:
        return read_opt_int(r, &op->window, &op->has_window) ? PARSE_OK : PARSE_SLOW;
    case F_LOCALITY:
    case F_OWNERSHIP:
    case F_SESSION:
        return read_opt_str(r, &ignored) ? PARSE_OK : PARSE_SLOW;
    case F_LOOKAHEAD:
        return mp_nil(r) ? PARSE_OK : PARSE_SLOW; /* own keys: the Python path makes them */
    case F_SALT:
        return read_opt_str(r, &op->salt) ? PARSE_OK : PARSE_SLOW;
    default:
        return mp_skip(r) ? PARSE_OK : PARSE_SLOW;
    }
}

/* The extra keys of a stored event, as namespaces.chain_keys reads them, for the shapes
 * the fast path takes: every entry falsy (a plain request: vLLM 0.33 sends [None, ...]),
 * entries that are the adapter's name alone, and block 0's salt (with or without the name
 * before it) from vLLM 0.20 on. Anything else: PARSE_SLOW. */
static int read_extra(const op_t *op_in, op_t *op, const uint8_t *at, const uint8_t *end) {
    mp_reader r = {at, end};
    uint32_t n;
    if (!mp_array(&r, &n))
        return PARSE_SLOW;
    const uint8_t *entries = r.p;
    int all_falsy = 1;
    for (uint32_t i = 0; i < n; i++) {
        int f = falsy(&r);
        if (f < 0)
            return PARSE_SLOW;
        all_falsy &= f;
    }
    if (all_falsy)
        return PARSE_OK; /* `_plain`: no keys at all */
    if (op->salt.p != NULL || n != op->nhashes)
        return PARSE_SLOW; /* cache_salt beside extra keys, or not one entry per block */
    int legacy = !op_in->has_group;
    int at_root = !op_in->has_parent;
    r.p = entries;
    for (uint32_t i = 0; i < n; i++) {
        if (mp_nil(&r))
            continue;
        uint32_t k;
        if (!mp_array(&r, &k))
            return PARSE_SLOW;
        const uint8_t *s;
        uint32_t len;
        uint32_t first = 0;
        if (k > 0 && op->lora.p != NULL) {
            const uint8_t *save = r.p;
            if (mp_str(&r, &s, &len) && mp_utf8(s, len) && len == op->lora.len &&
                memcmp(s, op->lora.p, len) == 0)
                first = 1; /* the adapter's name: the namespace */
            else
                r.p = save;
        }
        uint32_t rest = k - first;
        if (rest == 0)
            continue;
        if (rest == 1 && i == 0 && at_root && !legacy) {
            if (!mp_str(&r, &s, &len) || !mp_utf8(s, len))
                return PARSE_SLOW;
            op->salt.p = len ? s : (const uint8_t *)"";
            op->salt.len = len;
            continue;
        }
        return PARSE_SLOW; /* own keys (multimodal, embeds, ...): Python digests them */
    }
    return PARSE_OK;
}

static int finish_stored(const core_t *c, scratch_t *sc, op_t *op, extra_span *extra,
                         const uint8_t *end) {
    if (extra->at != NULL) {
        int res = read_extra(op, op, extra->at, end);
        if (res != PARSE_OK)
            return res;
    }
    op->keyed = op->lora.p != NULL || op->has_lora_id || op->salt.p != NULL;
    /* The keys of the blocks, when the tokens cover exactly the hashes (else unused). */
    op->keys_off = sc->nkeys;
    op->nkeys = 0;
    int64_t size = op->block_size;
    if (size > 0 && op->tokens_kept && (uint64_t)op->ntokens == (uint64_t)size * op->nhashes) {
        GROW(sc->keys, sc->nkeys, sc->keys_cap, op->nhashes);
        const uint8_t *tokens = (const uint8_t *)(sc->tokens + op->tokens_off);
        for (uint32_t i = 0; i < op->nhashes; i++)
            sc->keys[sc->nkeys + i] = key_digest(c, tokens + (size_t)i * size * 4, (size_t)size * 4);
        op->nkeys = op->nhashes;
        sc->nkeys += op->nhashes;
    }
    return PARSE_OK;
}

static int tag_of(const uint8_t *s, uint32_t n) {
    if (n == 11 && memcmp(s, "BlockStored", 11) == 0)
        return OP_STORED;
    if (n == 12 && memcmp(s, "BlockRemoved", 12) == 0)
        return OP_REMOVED;
    if (n == 16 && memcmp(s, "AllBlocksCleared", 16) == 0)
        return OP_CLEARED;
    return 0;
}

static op_t *new_op(scratch_t *sc) {
    if (KV_GROW(sc->ops, sc->ops_cap, (uint64_t)sc->nops + 1) != 0)
        return NULL;
    op_t *op = &sc->ops[sc->nops++];
    memset(op, 0, sizeof *op);
    return op;
}

/* A map event ({"type": ..., fields}): vLLM >= 0.24 and SGLang. */
static int read_map_event(const core_t *c, mp_reader *r, scratch_t *sc) {
    uint32_t n;
    if (!mp_map(r, &n))
        return PARSE_SLOW;
    /* The tag first: the fields an event has depend on it. Every publisher writes it
     * first (msgspec's tag field); msgspec takes it anywhere, so look further if not. */
    const uint8_t *fields = r->p;
    int type = 0;
    const uint8_t *k, *v;
    uint32_t klen, vlen;
    uint32_t start = 0;
    if (n > 0 && mp_str(r, &k, &klen) && klen == 4 && memcmp(k, "type", 4) == 0) {
        if (!mp_str(r, &v, &vlen) || !(type = tag_of(v, vlen)))
            return PARSE_SLOW; /* an unknown event type: Python keeps it as unknown */
        fields = r->p;
        start = 1;
    } else {
        r->p = fields;
        for (uint32_t i = 0; i < n; i++) {
            if (!mp_str(r, &k, &klen))
                return PARSE_SLOW;
            if (klen == 4 && memcmp(k, "type", 4) == 0) {
                if (!mp_str(r, &v, &vlen) || !(type = tag_of(v, vlen)))
                    return PARSE_SLOW;
            } else if (!mp_skip(r)) {
                return PARSE_SLOW;
            }
        }
    }
    if (!type)
        return PARSE_SLOW;
    op_t *op = new_op(sc);
    if (op == NULL)
        return PARSE_NOMEM;
    op->type = (uint8_t)type;
    r->p = fields;
    extra_span extra = {NULL};
    int has_hashes = 0;
    for (uint32_t i = start; i < n; i++) {
        /* Keys are compared as bytes, never checked as UTF-8: msgspec skips a key it
         * doesn't know without decoding it, and every known key is ASCII. */
        if (!mp_str(r, &k, &klen))
            return PARSE_SLOW;
        enum field f = (klen == 4 && memcmp(k, "type", 4) == 0)
                           ? F_UNKNOWN
                           : (type == OP_CLEARED ? F_UNKNOWN : field_of(k, klen, type == OP_STORED));
        has_hashes |= f == F_HASHES;
        int res = read_field(r, sc, op, f, &extra);
        if (res != PARSE_OK)
            return res;
    }
    if (type != OP_CLEARED && !has_hashes)
        return PARSE_SLOW; /* block_hashes is required */
    return type == OP_STORED ? finish_stored(c, sc, op, &extra, r->end) : PARSE_OK;
}

/* An array event ([tag, fields...]): vLLM 0.9 - 0.23. */
static int read_array_event(const core_t *c, mp_reader *r, scratch_t *sc) {
    uint32_t n;
    if (!mp_array(r, &n) || n < 1)
        return PARSE_SLOW;
    const uint8_t *s;
    uint32_t len;
    int type;
    if (!mp_str(r, &s, &len) || !(type = tag_of(s, len)))
        return PARSE_SLOW;
    if (type != OP_CLEARED && n < 2)
        return PARSE_SLOW;
    op_t *op = new_op(sc);
    if (op == NULL)
        return PARSE_NOMEM;
    op->type = (uint8_t)type;
    extra_span extra = {NULL};
    const enum field *order = type == OP_STORED ? STORED_ORDER : REMOVED_ORDER;
    uint32_t known = type == OP_STORED ? sizeof STORED_ORDER / sizeof STORED_ORDER[0]
                     : type == OP_REMOVED ? sizeof REMOVED_ORDER / sizeof REMOVED_ORDER[0]
                                          : 1;
    for (uint32_t i = 1; i < n; i++) {
        int res = read_field(r, sc, op, i < known ? order[i] : F_UNKNOWN, &extra);
        if (res != PARSE_OK)
            return res;
    }
    return type == OP_STORED ? finish_stored(c, sc, op, &extra, r->end) : PARSE_OK;
}

/* Parse a whole batch into `sc` (reset first). PARSE_OK: every event parsed on the fast
 * path; PARSE_SLOW: the Python decoder must take it (nothing was applied); PARSE_NOMEM. */
int parse_batch(const core_t *c, const uint8_t *data, size_t len, scratch_t *sc) {
    scratch_reset(sc);
    mp_reader r = {data, data + len};
    uint32_t n, events;
    if (!mp_array(&r, &n) || n < 2)
        return PARSE_SLOW;
    int t0 = r.p < r.end ? r.p[0] : 0;
    if (t0 == 0xc2 || t0 == 0xc3 || !mp_float(&r, &sc->ts))
        return PARSE_SLOW; /* msgspec's float takes ints, never bools */
    if (!mp_array(&r, &events))
        return PARSE_SLOW;
    int maps = -1; /* a batch's events are all maps or all arrays */
    for (uint32_t i = 0; i < events; i++) {
        uint8_t t;
        if (!mp_peek(&r, &t))
            return PARSE_SLOW;
        int is_map = (t & 0xf0) == 0x80 || t == 0xde || t == 0xdf;
        if (maps < 0)
            maps = is_map;
        else if (maps != is_map)
            return PARSE_SLOW;
        int res = is_map ? read_map_event(c, &r, sc) : read_array_event(c, &r, sc);
        if (res != PARSE_OK)
            return res;
    }
    if (n >= 3) {
        int64_t rank;
        uint8_t present;
        int tr = r.p < r.end ? r.p[0] : 0;
        if (tr == 0xc2 || tr == 0xc3 || !read_opt_int(&r, &rank, &present))
            return PARSE_SLOW;
        sc->has_rank = present;
        sc->dp_rank = rank;
        for (uint32_t i = 3; i < n; i++) /* msgspec skips items past the struct's fields */
            if (!mp_skip(&r))
                return PARSE_SLOW;
    }
    if (r.p != r.end)
        return PARSE_SLOW; /* trailing bytes: msgspec refuses them */
    return PARSE_OK;
}
