/* The lookup's HTTP edges in C: see answer.h. */
#include "answer.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* --- the request ------------------------------------------------------------------- */

#define MAX_NAME_CHARS 1024 /* lora_name, cache_salt: the service's limit */

typedef struct {
    const char *p, *end;
} cursor;

static inline int is_ws(char ch);

static void skip_ws(cursor *c) {
    while (c->p < c->end && is_ws(*c->p))
        c->p++;
}

static int eat(cursor *c, char ch) {
    skip_ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return 1;
    }
    return 0;
}

/* A string of plain ASCII (no escape, no control character, at most MAX_NAME_CHARS): its
 * contents between the quotes. Anything else is for the reference decoder. */
static int plain_string(cursor *c, const char **s, size_t *len) {
    if (!eat(c, '"'))
        return 0;
    const char *start = c->p;
    while (c->p < c->end) {
        unsigned char ch = (unsigned char)*c->p;
        if (ch == '"')
            break;
        if (ch < 0x20 || ch == '\\' || ch >= 0x80)
            return 0;
        c->p++;
    }
    if (c->p >= c->end || (size_t)(c->p - start) > MAX_NAME_CHARS)
        return 0;
    *s = start;
    *len = (size_t)(c->p - start);
    c->p++; /* the closing quote */
    return 1;
}

/* null, or a plain string. */
static int name_value(cursor *c, const char **s, size_t *len) {
    skip_ws(c);
    if (c->end - c->p >= 4 && memcmp(c->p, "null", 4) == 0) {
        c->p += 4;
        *s = NULL;
        *len = 0;
        return 1;
    }
    return plain_string(c, s, len);
}

static inline int is_ws(char ch) {
    return ch == ' ' || ch == '\n' || ch == '\r' || ch == '\t';
}

/* The run of ASCII digits that `p` starts with (8 bytes readable there), if shorter than
 * 8, and its value; 8 means "8 or more, or none could be told": read it one by one.
 * SWAR: the eight bytes as one little-endian word, each digit's value in its byte. */
static inline size_t swar_digits(const char *p, uint64_t *value) {
    uint64_t word;
    memcpy(&word, p, 8);
    uint64_t x = word ^ 0x3030303030303030ull; /* a digit byte becomes 0..9 */
    /* a byte is not a digit if its high nibble is set now, or adding 6 carries into it */
    uint64_t bad = (x | (x + 0x0606060606060606ull)) & 0xF0F0F0F0F0F0F0F0ull;
    if (bad == 0)
        return 8;
    size_t len = (size_t)__builtin_ctzll(bad) / 8; /* digits before the first non-digit */
    if (len == 0) {
        *value = 0;
        return 0;
    }
    /* Keep the digits, shifted to the top bytes (zeros in front read as leading zeros),
     * then fold pairs, quads and octets: the classic eight-digit conversion. */
    x <<= 8 * (8 - len);
    x = ((x & 0x0F0F0F0F0F0F0F0Full) * 2561) >> 8;
    x = ((x & 0x00FF00FF00FF00FFull) * 6553601) >> 16;
    *value = ((x & 0x0000FFFF0000FFFFull) * 42949672960001ull) >> 32;
    return len;
}

/* A JSON array of token ids into out->tokens: each as JSON writes an integer (0 or
 * [1-9][0-9]*), at most 2**32 - 1, not followed by a fraction or an exponent (`1.0` is
 * for the reference's lenient path); never more than max_items. One tight loop: a long
 * prompt is tens of kilobytes of digits. */
static int token_array(cursor *c, uint32_t max_items, lookup_body_t *out, int *oom) {
    if (!eat(c, '['))
        return 0;
    /* A token takes two bytes at least ("1,"): that bounds the array before reading it. */
    size_t room = (size_t)(c->end - c->p) / 2 + 1;
    if (room > (size_t)max_items)
        room = (size_t)max_items;
    out->tokens = malloc((room + 1) * sizeof(uint32_t));
    if (out->tokens == NULL) {
        *oom = 1;
        return 0;
    }
    out->ntokens = 0;
    if (eat(c, ']'))
        return 1;
    const char *p = c->p, *end = c->end;
    uint32_t n = 0;
    for (;;) {
        while (p < end && is_ws(*p))
            p++;
        const char *digits = p;
        uint64_t v;
        size_t len = end - p >= 8 ? swar_digits(p, &v) : 8;
        if (len < 8) { /* the common case: up to 7 digits, read 8 bytes at a time */
            p += len;
        } else { /* near the end, or 8 digits and more: one at a time */
            v = 0;
            while (p < end && (unsigned char)(*p - '0') < 10 && p - digits < 11)
                v = v * 10 + (uint64_t)(*p++ - '0');
            len = (size_t)(p - digits);
        }
        if (len == 0 || len > 10 || (len > 1 && *digits == '0') || v > 0xFFFFFFFFu)
            return 0;
        if (p < end && (*p == '.' || *p == 'e' || *p == 'E'))
            return 0;
        if (n >= room)
            return 0; /* over the limit: the reference words the refusal */
        out->tokens[n++] = (uint32_t)v;
        while (p < end && is_ws(*p))
            p++;
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p < end && *p == ']') {
            c->p = p + 1;
            out->ntokens = n;
            return 1;
        }
        return 0;
    }
}

static int hex_value(char ch) {
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    return -1;
}

/* One hash string (its characters, no escape) as parse_hash reads it; 0: not taken here. */
static int hash_text(const char *s, size_t len, phash *h, uint8_t **bytes) {
    int negative = len > 0 && s[0] == '-';
    size_t digits = len - (size_t)negative;
    int all_digits = digits > 0;
    for (size_t i = negative; i < len && all_digits; i++)
        all_digits = s[i] >= '0' && s[i] <= '9';
    if (all_digits && digits <= 20) { /* decimal wins, as in parse_hash */
        uint64_t v = 0;
        int overflow = 0;
        for (size_t i = negative; i < len; i++) {
            uint64_t d = (uint64_t)(s[i] - '0');
            overflow |= v > (UINT64_MAX - d) / 10;
            v = v * 10 + d;
        }
        if (negative && (overflow || v > (uint64_t)1 << 63))
            return 0; /* below -2^63: parse_hash refuses it */
        if (!overflow) {
            h->kind = negative && v ? HK_NEGATIVE : HK_UINT;
            h->v = negative ? (uint64_t)0 - v : v;
            h->p = NULL;
            h->len = 0;
            return 1;
        }
        /* 2^64 or more: parse_hash reads it as hex bytes, as below (20 digits: even) */
    }
    if (negative || len == 0 || len % 2 || len > 256)
        return 0;
    uint8_t *out = *bytes;
    for (size_t i = 0; i < len; i += 2) {
        int hi = hex_value(s[i]), lo = hex_value(s[i + 1]);
        if (hi < 0 || lo < 0)
            return 0;
        out[i / 2] = (uint8_t)(hi << 4 | lo);
    }
    h->kind = HK_BYTES;
    h->v = 0;
    h->p = out;
    h->len = (uint32_t)(len / 2);
    *bytes += len / 2;
    return 1;
}

void hashes_body_free(hashes_body_t *b) {
    free(b->hashes);
    free(b->bytes);
    b->hashes = NULL;
    b->bytes = NULL;
    b->n = 0;
}

int parse_hashes_body(const char *p, size_t n, uint32_t max_items, hashes_body_t *out) {
    memset(out, 0, sizeof *out);
    cursor c = {p, p + n};
    const char *key;
    size_t key_len;
    /* A hash takes three bytes at least ("",): that bounds the arrays before reading. */
    size_t room = n / 3 + 1;
    if (room > (size_t)max_items)
        room = (size_t)max_items;
    out->hashes = malloc((room + 1) * sizeof(phash));
    out->bytes = malloc(n / 2 + 1);
    if (out->hashes == NULL || out->bytes == NULL) {
        hashes_body_free(out);
        return PARSE_NOMEM;
    }
    uint8_t *bytes = out->bytes;
    int ok = eat(&c, '{') && plain_string(&c, &key, &key_len) && key_len == 12 &&
             memcmp(key, "block_hashes", 12) == 0 && eat(&c, ':') && eat(&c, '[');
    if (ok && !eat(&c, ']')) {
        for (;;) {
            const char *s;
            size_t len;
            if (out->n >= room || !plain_string(&c, &s, &len) ||
                !hash_text(s, len, &out->hashes[out->n], &bytes)) {
                ok = 0;
                break;
            }
            out->n++;
            if (eat(&c, ','))
                continue;
            ok = eat(&c, ']');
            break;
        }
    }
    ok = ok && eat(&c, '}');
    skip_ws(&c);
    if (ok && c.p == c.end)
        return PARSE_OK;
    hashes_body_free(out);
    return PARSE_SLOW;
}

int parse_lookup_body(const char *p, size_t n, uint32_t max_items, lookup_body_t *out) {
    memset(out, 0, sizeof *out);
    cursor c = {p, p + n};
    int oom = 0, seen_tokens = 0, seen_lora = 0, seen_salt = 0, ok = eat(&c, '{');
    if (ok && eat(&c, '}'))
        ok = 0; /* no token_ids: an error, worded by the reference */
    else
        while (ok) {
            const char *key;
            size_t len;
            ok = plain_string(&c, &key, &len) && eat(&c, ':');
            if (!ok)
                break;
            /* A key seen twice is for the reference too (which of the two wins is its
             * decoder's business). */
            if (len == 9 && memcmp(key, "token_ids", 9) == 0 && !seen_tokens++)
                ok = token_array(&c, max_items, out, &oom);
            else if (len == 9 && memcmp(key, "lora_name", 9) == 0 && !seen_lora++)
                ok = name_value(&c, &out->lora, &out->lora_len);
            else if (len == 10 && memcmp(key, "cache_salt", 10) == 0 && !seen_salt++)
                ok = name_value(&c, &out->salt, &out->salt_len);
            else
                ok = 0; /* an unknown field (refused by the reference), or a repeat */
            if (ok && eat(&c, ','))
                continue;
            ok = ok && eat(&c, '}');
            break;
        }
    skip_ws(&c);
    if (ok && seen_tokens && c.p == c.end)
        return PARSE_OK;
    free(out->tokens);
    out->tokens = NULL;
    return oom ? PARSE_NOMEM : PARSE_SLOW;
}

/* --- the answer -------------------------------------------------------------------- */

static int jb_room(jbuf_t *b, size_t more) {
    if (b->oom)
        return 0;
    if (b->len + more <= b->cap)
        return 1;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (p == NULL) {
        b->oom = 1;
        return 0;
    }
    b->p = p;
    b->cap = cap;
    return 1;
}

static void jb_put(jbuf_t *b, const char *s, size_t n) {
    if (jb_room(b, n)) {
        memcpy(b->p + b->len, s, n);
        b->len += n;
    }
}

/* A string literal (only: sizeof of anything else is not its length). */
#define JB_LIT(b, s) jb_put((b), "" s "", sizeof(s) - 1)

static void jb_u64(jbuf_t *b, uint64_t v) {
    char digits[20];
    int n = 0;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    if (jb_room(b, (size_t)n))
        while (n)
            b->p[b->len++] = digits[--n];
}

static void jb_i64(jbuf_t *b, int64_t v) {
    if (v < 0) {
        JB_LIT(b, "-");
        jb_u64(b, (uint64_t)0 - (uint64_t)v);
    } else {
        jb_u64(b, (uint64_t)v);
    }
}

void jbuf_free(jbuf_t *b) {
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

static const char *const TIER_JSON[TIER_COUNT] = {"\"gpu\":", "\"cpu\":", "\"disk\":",
                                                  "\"external\":"};

/* One instance's row, as the runtime's Fleet._match makes it (see answer.h). */
typedef struct {
    uint32_t slot;
    uint32_t blocks; /* matched_blocks: 0 for an instance that reuses nothing */
    int matched;     /* the row has content: blocks, or a KV cache group's own hit */
    int64_t best_rank;
    int32_t best_bit; /* -1: the index holds nothing of the instance */
} row_t;

static uint32_t blocks_of(const answer_t *answers, uint32_t nbits, int32_t bit) {
    return bit >= 0 && (uint32_t)bit < nbits ? answers[bit].blocks : 0;
}

/* The rank a row reports: the most blocks, ties to the lowest rank, among the ranks the
 * index knows (IndexBase._rows); 0 for an instance it knows nothing of. */
static row_t row_of(const answer_t *answers, uint32_t nbits, const slot_t *s, uint32_t i) {
    row_t r = {i, 0, 0, 0, -1};
    for (uint32_t k = 0; k < s->nranks; k++) {
        int32_t rank = s->ranks[2 * k], bit = s->ranks[2 * k + 1];
        if (bit < 0)
            continue;
        uint32_t blocks = blocks_of(answers, nbits, bit);
        if (r.best_bit < 0 || blocks > r.blocks)
            r.best_rank = rank, r.best_bit = bit, r.blocks = blocks;
    }
    const reuse_t *d =
        r.best_bit >= 0 && (uint32_t)r.best_bit < nbits ? answers[r.best_bit].detail : NULL;
    r.matched = r.blocks > 0;
    for (uint32_t g = 0; !r.matched && d && g < d->ngroups; g++)
        r.matched = d->group_blocks[g] != 0;
    if (!r.matched)
        r.blocks = 0;
    return r;
}

static int best_first(const void *a, const void *b) {
    const row_t *x = a, *y = b;
    if (x->blocks != y->blocks)
        return x->blocks > y->blocks ? -1 : 1;
    return x->slot < y->slot ? -1 : x->slot > y->slot; /* slots come by name */
}

void answers_pin_pools(const core_t *c, answer_t *answers, uint32_t nbits) {
    for (uint32_t bit = 0; bit < nbits; bit++) {
        answer_t *a = &answers[bit];
        if (a->detail != NULL || a->blocks == 0)
            continue; /* written from its detail, or not written at all */
        const source_t *s = bit < c->nsources_cap ? c->sources[bit] : NULL;
        a->tier = s && s->npools ? s->pools[0].tier : TIER_GPU;
        a->group = s && s->npools ? s->pools[0].group : 0; /* was int32: folded 2^32 on 0 */
        a->group_big = s && s->npools ? s->pools[0].group_big : 0;
    }
}

static void write_tiers_groups(const answer_t *a, jbuf_t *b) {
    JB_LIT(b, ",\"by_tier\":{");
    if (a->detail != NULL) {
        int first = 1;
        for (int t = 0; t < TIER_COUNT; t++) {
            if (!a->detail->by_tier[t])
                continue;
            if (!first)
                JB_LIT(b, ",");
            first = 0;
            jb_put(b, TIER_JSON[t], strlen(TIER_JSON[t]));
            jb_u64(b, a->detail->by_tier[t]);
        }
        JB_LIT(b, "},\"by_group\":{");
        for (uint32_t g = 0; g < a->detail->ngroups; g++) {
            if (g)
                JB_LIT(b, ",");
            JB_LIT(b, "\"");
            if (a->detail->groups_big[g])
                jb_u64(b, (uint64_t)a->detail->groups[g]);
            else
                jb_i64(b, a->detail->groups[g]);
            JB_LIT(b, "\":");
            jb_u64(b, a->detail->group_blocks[g]);
        }
        JB_LIT(b, "}");
        return;
    }
    /* One pool: everything it reuses is that pool's tier and group (pinned). */
    uint8_t tier = a->tier, big = a->group_big;
    int64_t group = a->group;
    jb_put(b, TIER_JSON[tier], strlen(TIER_JSON[tier]));
    jb_u64(b, a->blocks);
    JB_LIT(b, "},\"by_group\":{\"");
    if (big)
        jb_u64(b, (uint64_t)group);
    else
        jb_i64(b, group);
    JB_LIT(b, "\":");
    jb_u64(b, a->blocks);
    JB_LIT(b, "}");
}

static void write_row(const answer_t *answers, uint32_t nbits,
                      const slot_t *s, const row_t *r, int by_tokens, jbuf_t *b) {
    const answer_t *a = r->matched ? &answers[r->best_bit] : NULL;
    JB_LIT(b, "{\"name\":");
    jb_put(b, s->name_json, s->name_len);
    JB_LIT(b, ",\"status\":");
    jb_put(b, s->status_json, s->status_len);
    JB_LIT(b, ",\"matched_blocks\":");
    jb_u64(b, r->blocks);
    JB_LIT(b, ",\"matched_tokens\":");
    if (!by_tokens)
        JB_LIT(b, "null,\"block_size\":null");
    else if (r->blocks == 0)
        JB_LIT(b, "0,\"block_size\":null");
    else {
        jb_u64(b, (uint64_t)r->blocks * a->size);
        JB_LIT(b, ",\"block_size\":");
        jb_u64(b, a->size);
    }
    JB_LIT(b, ",\"best_rank\":");
    jb_i64(b, r->best_rank);
    JB_LIT(b, ",\"ranks\":[");
    for (uint32_t k = 0; k < s->nranks; k++) {
        if (k)
            JB_LIT(b, ",");
        JB_LIT(b, "{\"rank\":");
        jb_i64(b, s->ranks[2 * k]);
        JB_LIT(b, ",\"matched_blocks\":");
        /* A row with no content reports 0 for every rank (its shared empty row). */
        jb_u64(b, r->matched ? blocks_of(answers, nbits, s->ranks[2 * k + 1]) : 0);
        JB_LIT(b, "}");
    }
    JB_LIT(b, "]");
    if (a != NULL)
        write_tiers_groups(a, b);
    else
        JB_LIT(b, ",\"by_tier\":{},\"by_group\":{}");
    JB_LIT(b, "}");
}

int answer_json(const core_t *c, answer_t *answers, uint32_t nbits, const slot_t *slots,
                uint32_t nslots, int by_tokens, jbuf_t *out) {
    if (c != NULL)
        answers_pin_pools(c, answers, nbits);
    row_t *rows = malloc(((size_t)nslots + 1) * sizeof(row_t));
    if (rows == NULL) {
        out->oom = 1;
        return 0;
    }
    for (uint32_t i = 0; i < nslots; i++)
        rows[i] = row_of(answers, nbits, &slots[i], i);
    qsort(rows, nslots, sizeof(row_t), best_first);
    int hit = 0;
    const slot_t *best = NULL;
    for (uint32_t i = 0; i < nslots; i++) {
        hit |= rows[i].blocks > 0;
        if (best == NULL && rows[i].blocks > 0 && !slots[rows[i].slot].down)
            best = &slots[rows[i].slot];
    }
    JB_LIT(out, "{\"best\":");
    if (best != NULL)
        jb_put(out, best->name_json, best->name_len);
    else
        JB_LIT(out, "null");
    JB_LIT(out, ",\"instances\":[");
    for (uint32_t i = 0; i < nslots; i++) {
        if (i)
            JB_LIT(out, ",");
        write_row(answers, nbits, &slots[rows[i].slot], &rows[i], by_tokens, out);
    }
    JB_LIT(out, "]}");
    free(rows);
    return hit;
}
