/* The lookup's HTTP edges in C: the request body read straight into token ids, and the
 * answer written straight as JSON (kvindex/service/fastpath.py uses both).
 *
 * Both are the compiled twins of Python code that stays the reference:
 * - parse_lookup_body accepts a strict subset of what kvindex.service's msgspec decoder
 *   accepts for /v1/lookup, and gives the same tokens and names; anything else (an error,
 *   `1.0`, an escape in a string, a token past 32 bits) is PARSE_SLOW and the Python path
 *   decides, so errors keep their one wording.
 * - answer_json writes exactly what msgspec.json.encode(Fleet.lookup(...)) writes
 *   (kvindex.runtime.views.LookupAnswer), from the same per-publisher answers the rows of
 *   Core.lookup come from. tests/test_fastpath.py holds the two to identical JSON.
 */
#ifndef KVINDEX_ANSWER_H
#define KVINDEX_ANSWER_H

#include <stddef.h>
#include <stdint.h>

#include "core.h"

/* --- the request ------------------------------------------------------------------- */

typedef struct {
    uint32_t *tokens; /* malloc'd; the caller frees it */
    uint32_t ntokens;
    const char *lora, *salt; /* into the body; NULL when absent or null */
    size_t lora_len, salt_len;
} lookup_body_t;

/* PARSE_OK, PARSE_SLOW (not the simple shape: let the reference decide) or PARSE_NOMEM. */
int parse_lookup_body(const char *p, size_t n, uint32_t max_items, lookup_body_t *out);

/* `POST /v1/lookup/hashes`'s body, {"block_hashes": [...]}, the strings as
 * kvindex.wire.parse_hash reads them: decimal (at most 20 digits, an int in [-2^63,
 * 2^64)) or, else, lowercase hex of whole bytes (at most 256 characters, the schema's).
 * PARSE_SLOW for anything else (an escape, another key, a hash that parse_hash refuses or
 * reads otherwise, past max_items): the reference decides. */
typedef struct {
    phash *hashes; /* malloc'd; a bytes hash points into `bytes` */
    uint8_t *bytes;
    uint32_t n;
} hashes_body_t;

int parse_hashes_body(const char *p, size_t n, uint32_t max_items, hashes_body_t *out);
void hashes_body_free(hashes_body_t *b);

/* --- the answer -------------------------------------------------------------------- */

/* A publisher's answer to a lookup (reuse_t for every publisher, several pools or one). */
typedef struct {
    uint32_t blocks, size;
    const reuse_t *detail; /* NULL: one pool, all of it from there */
    /* With detail NULL: that pool's tier and group, copied from the core under its lock
     * (answers_pin_pools), so the JSON is written from the answers alone: the answers of
     * several cores (an index in shards) merge by bit and are written after their locks. */
    uint8_t tier, group_big;
    int64_t group;
} answer_t;

/* Copy each answer's one pool (tier, group) from `c`: with the core's read lock held. */
void answers_pin_pools(const core_t *c, answer_t *answers, uint32_t nbits);

/* One followed instance, as the runtime sees it: its name and status already as JSON
 * strings, and its DP ranks by rank, each with its publisher's bit in the index (-1: the
 * index holds nothing of that rank yet). */
typedef struct {
    const char *name_json, *status_json;
    size_t name_len, status_len;
    int down; /* never the answer's `best` */
    uint32_t nranks;
    const int32_t *ranks; /* nranks pairs: rank, bit */
} slot_t;

typedef struct {
    char *p;
    size_t len, cap;
    int oom;
} jbuf_t;

void jbuf_free(jbuf_t *b);

/* The answer's JSON into `out` (rows best first, then by name: `slots` come by name).
 * With `by_tokens` 0 (a lookup by hashes) matched_tokens and block_size are null. With `c`,
 * the answers' pools are pinned from it first (call it with its read lock held); with
 * NULL, they were (answers_pin_pools, each under its core's lock). Returns whether any
 * instance holds the prompt's first block; out->oom on allocation failure. */
int answer_json(const core_t *c, answer_t *answers, uint32_t nbits, const slot_t *slots,
                uint32_t nslots, int by_tokens, jbuf_t *out);

#endif
