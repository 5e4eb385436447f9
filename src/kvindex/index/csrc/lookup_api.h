/* The core's lookups for C code outside this extension, with no Python object and no GIL:
 * what kvindex/service/_lookupd.c (the lookup thread on serve's listening socket) answers
 * plain lookups with. The table is the capsule `kvindex.index._core.lookup_api`.
 *
 * Every function here takes the core's read lock itself, resolves names under it, and
 * never touches a Python object: callable from any thread, the GIL held or not. The Core
 * must stay alive meanwhile (the caller keeps a reference to it). What they allocate is
 * given back through the table too: the core's allocations are counted (alloc.h), and
 * alloc.h's wrappers are undefined in the caller after this header (its own allocations
 * are its own).
 */
#ifndef KVINDEX_LOOKUP_API_H
#define KVINDEX_LOOKUP_API_H

#include <stddef.h>
#include <stdint.h>

#include "answer.h"

#define LOOKUP_API_VERSION 2
#define LOOKUP_API_CAPSULE "kvindex.index._core.lookup_api"

/* answer_tokens's results */
#define LOOKUP_ANSWERED 1
#define LOOKUP_STALE 0   /* the core's publishers moved since `sources_gen`: ask Python */
#define LOOKUP_NOMEM (-1)
#define LOOKUP_NOT_READY (-2)

typedef struct {
    int version; /* LOOKUP_API_VERSION */
    /* answer.h's parse_lookup_body: PARSE_OK, PARSE_SLOW or PARSE_NOMEM. */
    int (*parse_tokens)(const char *p, size_t n, uint32_t max_items, lookup_body_t *out);
    /* The JSON answer to a parsed plain lookup (what Fleet.lookup_json gives for it) into
     * `out`, `*hit` set, when the core's publishers are still those of `sources_gen`
     * (sources_gen's value when `slots` were made); else LOOKUP_STALE and nothing written. */
    int (*answer_tokens)(void *core, const lookup_body_t *body, const slot_t *slots,
                         uint32_t nslots, uint64_t sources_gen, jbuf_t *out, int *hit);
    /* What parse_tokens and answer_tokens allocated, given back (the core counts its
     * memory: alloc.h). */
    void (*body_free)(lookup_body_t *body);
    void (*jbuf_free)(jbuf_t *b);
    /* `POST /v1/lookup/hashes`: answer.h's parse_hashes_body, then the JSON answer
     * Fleet.lookup_hashes encodes for it (as answer_tokens; version 2). */
    int (*parse_hashes)(const char *p, size_t n, uint32_t max_items, hashes_body_t *out);
    int (*answer_hashes)(void *core, const hashes_body_t *body, const slot_t *slots,
                         uint32_t nslots, uint64_t sources_gen, jbuf_t *out, int *hit);
    void (*hashes_free)(hashes_body_t *b);
} lookup_api_t;

/* The caller's malloc and free are libc's (alloc.h counts the core's only). */
#ifndef KVCORE_BUILD
#undef malloc
#undef calloc
#undef realloc
#undef free
#endif

#endif
