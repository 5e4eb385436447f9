/* The compiled index: the same model as kvindex/index/reference.py (read its docstring first),
 * in compact C memory.
 *
 * - A block hash is a `hkey`: a 64-bit value and a kind (a non-negative int, a negative
 *   int, or interned bytes), so equal Python values are equal keys and nothing else is.
 * - Tree nodes live in one array and refer to each other by index (4 bytes, not 8). A
 *   node's key is a 64-bit digest of the Python reference's key bytes (tokens as uint32
 *   little-endian, plus own keys): see `key_digest` for the collision bound. Children are
 *   found through one table for the whole tree, keyed by (digest, parent).
 * - Who holds a node: none, one publisher (its bit, inline), or a bit set in a side arena.
 * - Per publisher: its pools (hash -> node), the copies beyond the first, the second and
 *   later entries of one pool at one node (`refs`), and with two pools or more which pools
 *   hold each node (`where`): as in fleet.py.
 *
 * Nothing here touches Python objects: the module (module.c) converts at the boundary and
 * releases the GIL around parse + apply and lookups; a read-write lock keeps lookups from
 * ever seeing half a batch.
 */
#ifndef KVCORE_CORE_H
#define KVCORE_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "map.h"

#define NODE_NONE 0u         /* node index 0 is never used: "no node" */
#define NODE_LOOSE 0x0FFFFFFEu /* a pool entry of a block with no place in the tree (PMAP_MAX_VALUE) */
#define HOLD_SET 0x80000000u /* node.holders: the low bits index a bit set */
#define NODE_FREED 0xFFFFFFFFu
#define MAX_POOLS 32         /* per publisher: (group, medium) pairs */
#define MAX_GROUPS 64
/* A tree size's flag: the tree of an EAGLE bigram cache's pages (keys.py's BIGRAM). A
 * namespace's, a pool's and size_of's sizes are tree sizes; answers count in
 * BLOCK_SIZE(size). Block sizes are below 2^31, so the flag never meets one. */
#define BIGRAM_TREE 0x80000000u
#define BLOCK_SIZE(size) ((size) & ~BIGRAM_TREE)

enum hkind { HK_UINT = 0, HK_NEGATIVE = 1, HK_BYTES = 2 };

typedef struct {
    uint64_t v;    /* the int's bits, or the interned bytes' id */
    uint32_t kind; /* enum hkind */
} hkey;

enum tier { TIER_GPU = 0, TIER_CPU = 1, TIER_DISK = 2, TIER_EXTERNAL = 3, TIER_COUNT = 4 };

typedef struct {
    /* the prefix digest: of the path from the root to this block (see prefix_of); two
     * halves, so the struct stays 4-byte aligned (20 bytes a node) */
    uint32_t key_lo, key_hi;
    uint32_t parent;         /* NODE_NONE for a root; a free node: the next free one */
    uint32_t nchild;
    uint32_t holders; /* 0: nobody; bit + 1: one publisher; HOLD_SET | set: several */
} node_t;

typedef struct {
    /* group_idx as the wire says it: any int64 (was int32, which folded 2^32 onto 0 and
     * made a new pool per event; found by fuzz/), or with `group_big` a uint64 past
     * INT64_MAX (msgpack's range; was clamped, which merged such groups). */
    int64_t group;
    uint8_t group_big;
    uint32_t medium; /* interned string id */
    uint8_t tier;
    uint8_t index; /* its bit in `where` */
    uint32_t size; /* largest tree size of its events (BIGRAM_TREE: bigram pages) */
    uint32_t tree; /* the tree its blocks hang in, if another group's are larger (0: own) */
    pmap_t blocks; /* a = hash value, b = hash kind -> node index or NODE_LOOSE */
} pool_t;

typedef struct {
    uint32_t kind; /* interned string id of kv_cache_spec_kind; 0: not said */
    int64_t window;
    uint8_t present;
} group_spec;

typedef struct {
    int64_t stored, removed, clears, batches, restarts;
    int64_t unplaced, unrecognised_keys, namespace_kept, namespace_moved;
} source_stats;

typedef struct {
    uint8_t used;
    uint8_t several; /* two pools or more: `where` is kept */
    uint32_t bit;
    uint32_t npools;
    pool_t pools[MAX_POOLS];
    map_t extra; /* copies beyond the first: a = hash value, b = kind | pool << 8 */
    map_t refs;  /* entries of one pool at one node beyond the first: a = node, b = pool */
    map_t where; /* a = node, b = 0 -> bits of the pools holding it */
    group_spec groups[MAX_GROUPS];
    source_stats stats;
    uint32_t epoch; /* cleared this many times (apply_slice: a chain's start gone) */
    uint32_t unit;  /* the hash block size its partial-block entries show (0: none) */
    uint64_t serial; /* never reused (core_t.serials): a batch's later slices check it */
} source_t;

typedef struct {
    const uint8_t *data;
    uint32_t len;
    uint32_t refs; /* bytes: pool entries using it; names: namespaces; strings: unused */
    uint64_t fp;
} blob_t;

/* Interned byte strings (bytes hashes, medium names, LoRA names, salts, spec kinds). */
typedef struct {
    uint64_t seed;
    map_t by_fp; /* a = fingerprint, b = length (+ probe) -> id */
    blob_t *items;
    uint32_t count, capacity;
    uint32_t free_head; /* freed ids (bytes hashes only), linked through `len` */
} interner;

typedef struct {
    uint32_t lora;  /* interned id; 0: no adapter */
    uint32_t salt;  /* interned id; 0: no salt */
    uint32_t size;
    uint32_t root;  /* node index */
    uint64_t seed;  /* Dynamo's local-hash seed of its blocks (see local_index) */
} namespace_t;

/* A block hash as parsed: an int (its bits, kind HK_UINT/HK_NEGATIVE) or bytes (a span of
 * the payload or of a Python bytes object, kind HK_BYTES). Interned when applied. */
typedef struct {
    uint64_t v;
    const uint8_t *p;
    uint32_t len;
    uint32_t kind;
} phash;

typedef struct {
    const uint8_t *p;
    uint32_t len; /* p == NULL: absent */
} span_t;

/* One parsed event, ready to apply; its arrays live in the scratch. */
enum op_type { OP_STORED = 1, OP_REMOVED = 2, OP_CLEARED = 3 };

typedef struct {
    uint8_t type;
    uint8_t has_parent, has_group, has_spec, has_window;
    uint8_t keyed;       /* a namespace or own keys: decides namespaces across tiers */
    uint8_t tokens_kept; /* the tokens are in scratch.tokens (all fit 32 bits) */
    uint8_t bigram;      /* EAGLE bigram pages: tokens are their pairs, flattened */
    phash parent;
    uint32_t nhashes, hashes_off; /* in scratch.hashes */
    uint32_t ntokens;             /* token ids the event carried */
    uint32_t nkeys, keys_off;     /* key digests of the blocks whose key could be made */
    uint32_t tokens_off;          /* in scratch.tokens */
    int64_t block_size;
    int64_t group;
    int64_t window;
    span_t medium; /* absent: the GPU */
    span_t lora;   /* the adapter's name (lora_name) */
    int64_t lora_id; /* without a name: the process-local id (vLLM < 0.14) */
    uint8_t has_lora_id;
    uint8_t own;       /* own keys (multimodal, lookahead, ...) on some block */
    uint8_t group_big; /* group is a uint64 past INT64_MAX (see pool_t) */
    span_t salt;
    span_t spec_kind;
    uint32_t unrecognised;
} op_t;

typedef struct {
    op_t *ops;
    uint32_t nops, ops_cap;
    phash *hashes;
    uint32_t nhashes, hashes_cap;
    uint64_t *keys;
    uint32_t nkeys, keys_cap;
    uint32_t *tokens;
    uint32_t ntokens, tokens_cap;
    hkey *hk; /* the hashes interned, filled while applying */
    uint32_t hk_cap;
    double ts;
    int64_t dp_rank;
    uint8_t has_rank;
} scratch_t;

typedef struct {
    /* nodes */
    node_t *nodes;
    uint32_t nnodes, nodes_cap, free_nodes, live_nodes;
    pmap_t children; /* a = the child's prefix digest, b = probe -> child (see prefix_of) */
    map_t root_ns;  /* a = root node, b = 0 -> namespace index */
    map_t partial;  /* a = node, b = 0 -> the partial units it ends (fleet._partial_units) */
    /* holder sets */
    uint64_t *sets;
    uint32_t set_words, nsets, sets_cap, free_sets;
    /* per set: the tokens of the node it is the holders of (count, then the ids), or NULL
     * (see tokens_keep); set_tokens_cap >= nsets */
    uint32_t **set_tokens;
    uint32_t set_tokens_cap, tokens_kept;
    /* The copies themselves: items of one size carved from chunks kept for the core's life
     * (a few sizes: the fleet's block sizes), others malloc'd (see tokens_alloc). */
    struct {
        uint32_t words; /* an item's: the count, then the tokens */
        uint32_t *free; /* free items, linked through their first 8 bytes */
        void *chunks;   /* linked through their first 8 bytes */
    } token_slabs[4];
    uint32_t ntoken_slabs;
    size_t token_slab_bytes;
    /* namespaces */
    namespace_t *ns;
    uint32_t nns, ns_cap;
    map_t ns_by_key;  /* a = lora << 32 | salt, b = size -> namespace index */
    uint32_t sizes[16]; /* distinct block sizes with a namespace, and how many */
    uint32_t size_roots[16];
    uint32_t nsizes;
    /* publishers */
    source_t **sources; /* by bit */
    uint32_t nsources_cap;
    uint32_t max_bit;   /* bits in use are < max_bit */
    /* Moves whenever a publisher is made or removed (under the write lock): a lookup
     * answered outside Python (lookup_api.h) checks that the instances' bits it was given
     * are still the core's. */
    uint64_t sources_gen;
    uint64_t serials;   /* sources made so far: each one's serial */
    interner strings;   /* media and spec kinds: a few, kept for the index's life */
    interner names;     /* namespaces' adapters and salts (freed with their last one) */
    interner bytes;     /* bytes hashes (freed when no pool holds them) */
    uint64_t seed;      /* of the key digest */
    uint32_t gpu_medium; /* the interned "GPU": the medium of events that name none */
    uint32_t last_medium, last_lora, last_salt, last_kind; /* see intern_cached */
    /* Keep the tokens of nodes as they become shared (the dashboard's shared prefixes
     * show them). On by default; it costs ingest a copy and two table updates each time a
     * block gets or loses its second holder, so a library user can turn it off. */
    uint8_t keep_tokens;
    /* Dynamo's local block hashes (kvindex/index/localhash.py), kept when asked before the
     * first block (Core.keep_local_hashes): per node its hash and its tree's root, and a
     * table (hash, parent) -> child for lookups by them. ~30 bytes a node more. */
    uint8_t local_on;
    uint64_t *local_hash;
    uint32_t *local_root; /* NODE_NONE: not indexed (own keys, a bigram page, no tokens) */
    map_t local;          /* a = local hash, b = parent -> child */
} core_t;

/* What one publisher would reuse of a prompt (kvindex.index.reuse.Reuse). */
typedef struct {
    uint32_t blocks, size;
    uint8_t several; /* by_tier/groups computed (else: one pool, all from it) */
    uint32_t by_tier[TIER_COUNT];
    uint32_t ngroups;
    int64_t groups[MAX_POOLS];
    uint8_t groups_big[MAX_POOLS];
    uint32_t group_blocks[MAX_POOLS];
} reuse_t;

enum parse_result { PARSE_OK = 0, PARSE_SLOW = 1, PARSE_NOMEM = -1 };

int core_init(core_t *c, uint64_t seed);
void core_free(core_t *c);
uint64_t key_digest(const core_t *c, const uint8_t *data, size_t len);

/* parse.c */
int parse_batch(const core_t *c, const uint8_t *data, size_t len, scratch_t *sc);
void scratch_reset(scratch_t *sc);
void scratch_free(scratch_t *sc);

/* core.c */
source_t *source_get(core_t *c, uint32_t bit, int make);
void source_clear(core_t *c, source_t *s);
void source_remove(core_t *c, uint32_t bit);
int apply_ops(core_t *c, source_t *s, scratch_t *sc);

/* Where a batch applied a slice at a time stands (apply_slice); zeroed to start. */
typedef struct {
    uint32_t op, done; /* the next op, and how many of its hashes are applied */
    uint32_t node;     /* a stored op's next slice hangs from here (NODE_NONE: no place) */
    uint32_t epoch;    /* the source's after the last slice */
    uint64_t serial;   /* the source's the first slice was applied to */
    uint8_t started;
    int64_t stored, removed, clears; /* what the batch brought, added when it is done */
} apply_cursor;
int apply_slice(core_t *c, source_t *s, scratch_t *sc, apply_cursor *cur, uint32_t budget);
uint32_t find_str(const core_t *c, const uint8_t *p, uint32_t len);
uint32_t find_name(const core_t *c, const uint8_t *p, uint32_t len);
uint32_t find_bytes(const core_t *c, const uint8_t *p, uint32_t len);
const uint64_t *set_words_of(const core_t *c, uint32_t holders);
uint32_t root_find(const core_t *c, uint32_t lora, uint32_t salt, uint32_t size);
uint32_t prompt_keys(const core_t *c, const uint32_t *small, const int64_t *tokens,
                     uint32_t ntokens, uint32_t size, uint64_t *keys);
uint32_t prompt_bigram_keys(const core_t *c, const uint32_t *small, const int64_t *tokens,
                            uint32_t ntokens, uint32_t size, uint64_t *keys);
typedef struct {
    const uint32_t *path;
    uint32_t len;
} walk_path;
uint32_t walk(const core_t *c, uint32_t root, const uint64_t *keys, uint32_t nkeys,
              uint32_t *depth, uint32_t *path, uint64_t *alive, const uint64_t *several);
uint32_t walk_nodes(const core_t *c, const uint32_t *nodes, uint32_t n, uint32_t *depth,
                    uint32_t *path, uint64_t *alive, const uint64_t *several);
int keep_local_hashes(core_t *c, int on);
uint32_t local_path(const core_t *c, uint32_t root, const uint64_t *hashes, uint32_t n,
                    uint32_t *nodes);
/* A prompt's hash units, for publishers whose lookups hit inside blocks (fine_reuse). */
typedef struct {
    const uint32_t *roots; /* by size, as `sizes` */
    const uint64_t *unit_keys; /* the key digest of each of the prompt's hash units */
    uint32_t nunits;
} fine_prompt;
int engine_reuse(const core_t *c, const source_t *s, const uint32_t *sizes,
                 const walk_path *walks, uint32_t nsizes, const fine_prompt *fine,
                 reuse_t *out);
int fine_grained(const core_t *c, const source_t *s);
int is_partial(const core_t *c, uint32_t n);
/* A partial-block entry's key: its unit's key digest with this mixed in (fleet.py puts
 * PARTIAL_MARK before the key bytes), so no whole block's key meets it. */
#define PARTIAL_KEY 0x5bd1e9955bd1e995ULL
uint32_t size_of(const core_t *c, uint32_t n);
int holds(const core_t *c, uint32_t n, uint32_t bit);
const uint32_t *node_tokens(const core_t *c, uint32_t n);
uint32_t child_get(const core_t *c, uint32_t parent, uint64_t key);
uint8_t core_tier_of(core_t *c, uint32_t medium);
uint8_t tier_of_bytes(const uint8_t *s, uint32_t n); /* a medium's tier, by its name */

#endif
