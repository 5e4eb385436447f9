/* The index model of kvindex/index/reference.py in C: nodes, holders, pools, placement.
 *
 * Each function here has a twin of the same name in fleet.py (`src_hold` is `_hold`,
 * `insert_chain` is `_insert_chain`, ...); the differential tests hold the two to the same
 * state and answers. Comments here say what is C-specific; the why of each rule is in
 * fleet.py.
 */
#include "core.h"

#include <stdio.h>

#include "intern.h"
#include "xxh3.h"

size_t kv_alloc_bytes, kv_alloc_blocks; /* alloc.h */
long kv_fail_countdown;                 /* alloc.h: tests' allocation failures */

/* -- the key digest ------------------------------------------------------------------ */

static inline uint64_t wymix(uint64_t a, uint64_t b) {
    __uint128_t r = (__uint128_t)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
}

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t read32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* A 64-bit digest of a tree key's bytes, keyed by the index's random seed (wyhash's
 * construction: 128-bit multiply-fold of each 16 bytes with the running state). Two
 * different keys under one parent get the same digest with probability about 2^-64 per
 * pair, whatever the tokens: the seed is drawn per process, so collisions can't be aimed
 * at (docs/performance.md states the bound). */
uint64_t key_digest(const core_t *c, const uint8_t *p, size_t len) {
    const uint64_t s0 = 0xa0761d6478bd642fULL, s1 = 0xe7037ed1a0b428dbULL;
    const uint64_t s2 = 0x8ebc6af09c88c6e3ULL, s3 = 0x589965cc75374cc3ULL;
    uint64_t seed = c->seed ^ wymix(c->seed ^ s0, s1);
    uint64_t a, b;
    size_t i = len;
    if (len <= 16) {
        if (len >= 4) {
            /* 4 bytes each (the low half of an 8-byte read, as it was: the same digest),
             * never past the key: a 1-token block ends the token buffer (ASan found it) */
            a = ((uint64_t)read32(p) << 32) | read32(p + ((len >> 3) << 2));
            uint32_t x, y;
            memcpy(&x, p + len - 4, 4);
            memcpy(&y, p + len - 4 - ((len >> 3) << 2), 4);
            b = ((uint64_t)x << 32) | y;
        } else if (len > 0) {
            a = ((uint64_t)p[0] << 16) | ((uint64_t)p[len >> 1] << 8) | p[len - 1];
            b = 0;
        } else {
            a = b = 0;
        }
    } else {
        if (i > 48) {
            uint64_t see1 = seed, see2 = seed;
            do {
                seed = wymix(read64(p) ^ s1, read64(p + 8) ^ seed);
                see1 = wymix(read64(p + 16) ^ s2, read64(p + 24) ^ see1);
                see2 = wymix(read64(p + 32) ^ s3, read64(p + 40) ^ see2);
                p += 48;
                i -= 48;
            } while (i > 48);
            seed ^= see1 ^ see2;
        }
        while (i > 16) {
            seed = wymix(read64(p) ^ s1, read64(p + 8) ^ seed);
            i -= 16;
            p += 16;
        }
        a = read64(p + i - 16);
        b = read64(p + i - 8);
    }
    a ^= s1;
    b ^= seed;
    __uint128_t r = (__uint128_t)a * b;
    a = (uint64_t)r;
    b = (uint64_t)(r >> 64);
    return wymix(a ^ s0 ^ len, b ^ s1);
}

/* -- tiers --------------------------------------------------------------------------- */

/* kvindex.wire.tiers.tier_of, for an interned medium name (case-insensitive). */
uint8_t tier_of_bytes(const uint8_t *s, uint32_t n) {
    char up[16];
    if (n == 0 || n >= sizeof up)
        return TIER_EXTERNAL;
    for (uint32_t i = 0; i < n; i++)
        up[i] = (char)((s[i] >= 'a' && s[i] <= 'z') ? s[i] - 32 : s[i]);
    up[n] = 0;
    static const struct {
        const char *name;
        uint8_t tier;
    } known[] = {
        {"GPU", TIER_GPU},       {"CPU", TIER_CPU},           {"CPU_PINNED", TIER_CPU},
        {"HOST", TIER_CPU},      {"DISK", TIER_DISK},         {"STORAGE", TIER_DISK},
        {"LOCAL_DISK", TIER_DISK}, {"EXTERNAL", TIER_EXTERNAL},
    };
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++)
        if (strcmp(up, known[k].name) == 0)
            return known[k].tier;
    return TIER_EXTERNAL; /* "external" itself, and any medium not known */
}

uint8_t core_tier_of(core_t *c, uint32_t medium) {
    if (medium == 0)
        return TIER_GPU;
    const blob_t *b = &c->strings.items[medium];
    return tier_of_bytes(b->data, b->len);
}

/* -- setup --------------------------------------------------------------------------- */

int core_init(core_t *c, uint64_t seed) {
    memset(c, 0, sizeof *c);
    c->seed = seed;
    pmap_init(&c->children);
    map_init(&c->root_ns);
    map_init(&c->partial);
    map_init(&c->ns_by_key);
    map_init(&c->local);
    interner_init(&c->strings, seed ^ 0x5bd1e995u);
    interner_init(&c->bytes, seed ^ 0x27d4eb2fu);
    interner_init(&c->names, seed ^ 0x165667b1u);
    c->nnodes = 1; /* index 0: NODE_NONE */
    c->set_words = 1;
    c->keep_tokens = 1;
    c->gpu_medium = intern(&c->strings, (const uint8_t *)"GPU", 3);
    if (c->gpu_medium == 0)
        return -1;
    c->strings.items[c->gpu_medium].refs = 1; /* the core's own: never dropped */
    return 0;
}

static void source_free(core_t *c, source_t *s);
static void tokens_release(core_t *c, uint32_t *copy);

void core_free(core_t *c) {
    for (uint32_t b = 0; b < c->nsources_cap; b++)
        if (c->sources[b] != NULL) {
            source_free(c, c->sources[b]);
            free(c->sources[b]);
        }
    free(c->sources);
    free(c->nodes);
    free(c->sets);
    free(c->ns);
    free(c->local_hash);
    free(c->local_root);
    map_free(&c->local);
    pmap_free(&c->children);
    map_free(&c->root_ns);
    map_free(&c->ns_by_key);
    for (uint32_t i = 0; i < c->set_tokens_cap; i++) /* a free set's is NULL */
        if (c->set_tokens[i] != NULL)
            tokens_release(c, c->set_tokens[i]); /* the malloc'd ones freed */
    free(c->set_tokens);
    for (uint32_t k = 0; k < c->ntoken_slabs; k++)
        for (void *chunk = c->token_slabs[k].chunks, *next; chunk != NULL; chunk = next) {
            memcpy(&next, chunk, sizeof(void *));
            free(chunk);
        }
    map_free(&c->partial);
    interner_free(&c->strings);
    interner_free(&c->bytes);
    interner_free(&c->names);
    memset(c, 0, sizeof *c);
}

/* -- nodes --------------------------------------------------------------------------- */

static inline uint64_t node_key(const node_t *n) {
    return ((uint64_t)n->key_hi << 32) | n->key_lo;
}

static uint32_t node_new(core_t *c, uint64_t key, uint32_t parent) {
    uint32_t i;
    if (c->free_nodes != NODE_NONE) {
        i = c->free_nodes;
        c->free_nodes = c->nodes[i].parent;
    } else {
        if (c->nnodes >= c->nodes_cap) {
            uint32_t cap = c->nodes_cap ? c->nodes_cap * 2 : 1024;
            if (cap >= NODE_LOOSE)
                cap = NODE_LOOSE - 1; /* node indices must fit a pool entry's 28 bits */
            if (cap <= c->nodes_cap)
                return NODE_NONE;
            node_t *nodes = realloc(c->nodes, (size_t)cap * sizeof(node_t));
            if (nodes == NULL)
                return NODE_NONE;
            c->nodes = nodes;
            if (c->local_on) { /* the local hashes' arrays follow the nodes' */
                uint64_t *lh = realloc(c->local_hash, (size_t)cap * sizeof(uint64_t));
                if (lh != NULL)
                    c->local_hash = lh;
                uint32_t *lr = lh ? realloc(c->local_root, (size_t)cap * sizeof(uint32_t)) : NULL;
                if (lr != NULL)
                    c->local_root = lr;
                if (lh == NULL || lr == NULL)
                    return NODE_NONE; /* the nodes keep their old capacity's count */
            }
            c->nodes_cap = cap;
        }
        i = c->nnodes++;
    }
    c->nodes[i] = (node_t){(uint32_t)key, (uint32_t)(key >> 32), parent, 0, 0};
    if (c->local_on)
        c->local_root[i] = NODE_NONE;
    c->live_nodes++;
    return i;
}

static void tokens_forget(core_t *c, uint32_t n);
static void set_free(core_t *c, uint32_t s);

static void local_forget(core_t *c, uint32_t i);

static void node_free(core_t *c, uint32_t i) {
    if (c->local_on)
        local_forget(c, i);
    node_t *n = &c->nodes[i];
    if (n->holders & HOLD_SET) { /* only a node two publishers hold keeps tokens */
        tokens_forget(c, i);
        set_free(c, n->holders & ~HOLD_SET);
    }
    if (c->partial.count) {
        map_entry *e = map_find(&c->partial, i, 0);
        if (e != NULL)
            map_delete(&c->partial, e);
    }
    n->holders = NODE_FREED;
    n->parent = c->free_nodes;
    c->free_nodes = i;
    c->live_nodes--;
}

static inline int node_freed(const core_t *c, uint32_t i) {
    return c->nodes[i].holders == NODE_FREED;
}

/* A child's prefix digest: its parent's and its own block's key digest, combined. For a
 * given parent this is a bijection of the block digest (mix64 is one), so two children of
 * one node share it only if their blocks' digests are equal; and it depends only on the
 * path from the root, so a lookup knows every node's before finding any (and prefetches). */
static inline uint64_t prefix_of(uint64_t parent_prefix, uint64_t block_digest) {
    return mix64(parent_prefix * 0x9E3779B97F4A7C15ULL + block_digest);
}

/* The entry of `parent`'s child with prefix digest `prefix`: probes 0, 1, ... past other
 * paths that reached the same 64-bit digest (never seen; kept exact all the same). */
static pmap_entry *child_entry(const core_t *c, uint32_t parent, uint64_t prefix) {
    for (uint32_t probe = 0; probe <= PMAP_MAX_B; probe++) {
        pmap_entry *e = pmap_find(&c->children, prefix, probe);
        if (e == NULL || c->nodes[pmap_value(e)].parent == parent)
            return e;
    }
    return NULL;
}

uint32_t child_get(const core_t *c, uint32_t parent, uint64_t key) {
    pmap_entry *e = child_entry(c, parent, prefix_of(node_key(&c->nodes[parent]), key));
    return e ? pmap_value(e) : NODE_NONE;
}

/* `_child`: the child of `parent` with this block key digest, made if there is none.
 * NODE_NONE: out of memory. A node's `key` is its prefix digest. */
static uint32_t child_make(core_t *c, uint32_t parent, uint64_t key) {
    uint64_t prefix = prefix_of(node_key(&c->nodes[parent]), key);
    uint32_t probe = 0;
    for (;; probe++) {
        pmap_entry *e = pmap_find(&c->children, prefix, probe);
        if (e == NULL)
            break;
        if (c->nodes[pmap_value(e)].parent == parent)
            return pmap_value(e);
    }
    if (probe > PMAP_MAX_B)
        return NODE_NONE; /* 15 paths on one 64-bit digest: held without a place */
    uint32_t child = node_new(c, prefix, parent);
    if (child == NODE_NONE)
        return NODE_NONE;
    int made;
    pmap_entry *e = pmap_put(&c->children, prefix, probe, &made);
    if (e == NULL) {
        node_free(c, child);
        return NODE_NONE;
    }
    pmap_set(e, child);
    c->nodes[parent].nchild++;
    return child;
}

/* Take a node out of the children table (it is being freed). */
static void child_forget(core_t *c, uint32_t n) {
    uint64_t prefix = node_key(&c->nodes[n]);
    uint32_t hole = 0;
    for (;; hole++) {
        pmap_entry *e = pmap_find(&c->children, prefix, hole);
        if (e == NULL)
            return;
        if (pmap_value(e) == n) {
            pmap_delete(&c->children, e);
            break;
        }
    }
    /* Later probes of this digest move down one, so no search stops at the hole (from
     * the hole on: starting at probe 1 left those after a hole at 1 or more unfound). */
    for (uint32_t probe = hole + 1; probe <= PMAP_MAX_B; probe++) {
        uint32_t moved;
        if (pmap_find(&c->children, prefix, probe - 1) != NULL ||
            !pmap_remove(&c->children, prefix, probe, &moved))
            return;
        int made;
        pmap_entry *e = pmap_put(&c->children, prefix, probe - 1, &made);
        if (e != NULL)
            pmap_set(e, moved);
    }
}

/* -- namespaces ---------------------------------------------------------------------- */

static void size_count(core_t *c, uint32_t size, int delta) {
    for (uint32_t i = 0; i < c->nsizes; i++)
        if (c->sizes[i] == size) {
            c->size_roots[i] += delta;
            if (c->size_roots[i] == 0) { /* keep the array dense */
                c->sizes[i] = c->sizes[c->nsizes - 1];
                c->size_roots[i] = c->size_roots[c->nsizes - 1];
                c->nsizes--;
            }
            return;
        }
    if (delta > 0 && c->nsizes < sizeof c->sizes / sizeof c->sizes[0]) {
        c->sizes[c->nsizes] = size;
        c->size_roots[c->nsizes++] = (uint32_t)delta;
    }
}

/* A namespace no longer uses name `id` (`held`: it was counted in refs): the name goes
 * when no namespace does. Also how a name interned for a root that was never made goes. */
static void name_release(core_t *c, uint32_t id, int held) {
    blob_t *b = &c->names.items[id];
    if (id == 0 || b->data == NULL) /* none, or already gone (adapter and salt alike) */
        return;
    b->refs -= (uint32_t)held;
    if (b->refs != 0)
        return;
    if (c->last_lora == id) /* intern_cached compares against the last id's bytes */
        c->last_lora = 0;
    if (c->last_salt == id)
        c->last_salt = 0;
    intern_drop(&c->names, id);
}

static uint32_t intern_cached(core_t *c, interner *t, span_t sp, uint32_t *last);

/* An event's medium's name: none, or an empty one, is the GPU's. */
static span_t medium_span(span_t sp) {
    return sp.p == NULL || sp.len == 0 ? (span_t){(const uint8_t *)"GPU", 3} : sp;
}

/* Media and spec kinds (c->strings) are counted as names are: one reference per pool of
 * that medium and per group spec of that kind; the string goes with its last one (they
 * were kept for the core's life: a publisher naming a fresh medium per event grew the
 * core for good, issue 27 point 3). */
static void str_release(core_t *c, uint32_t id) {
    if (id == 0)
        return;
    blob_t *b = &c->strings.items[id];
    if (b->data == NULL || --b->refs != 0)
        return;
    if (c->last_medium == id) /* intern_cached compares against the last id's bytes */
        c->last_medium = 0;
    if (c->last_kind == id)
        c->last_kind = 0;
    intern_drop(&c->strings, id);
}

/* A medium's or spec kind's id with a reference taken (interned if new), 0 if out of
 * memory. */
static uint32_t str_hold(core_t *c, span_t sp, uint32_t *last) {
    uint32_t id = intern_cached(c, &c->strings, sp, last);
    if (id != 0)
        c->strings.items[id].refs++;
    return id;
}

/* localhash.namespace_seed: 1337 + XXH3(lora name, 0) + XXH3(salt, 1), each only when
 * non-empty (an adapter known only by its lora_id, "\xff" + id, gets one no lookup asks). */
static uint64_t local_seed(const core_t *c, uint32_t lora, uint32_t salt) {
    uint64_t seed = 1337;
    if (lora && c->names.items[lora].len)
        seed += xxh3_64(c->names.items[lora].data, c->names.items[lora].len, 0);
    if (salt && c->names.items[salt].len)
        seed += xxh3_64(c->names.items[salt].data, c->names.items[salt].len, 1);
    return seed;
}

/* A root's prefix digest: of its namespace's names and block size under the seed, never of
 * where the namespace or its names sit in this core, so every index made with one seed keys
 * a prefix alike (ShardedIndex merges its shards' trees by key). Two namespaces' roots share
 * one only as two 64-bit digests do; their children would still never meet (child_entry
 * checks the parent). */
static uint64_t root_key(const core_t *c, uint32_t lora, uint32_t salt, uint32_t size) {
    uint64_t key = mix64(c->seed ^ size);
    if (lora) /* 0: none; an empty name is a name (seed 2 vs none) */
        key = mix64(key ^ xxh3_64(c->names.items[lora].data, c->names.items[lora].len, 2));
    if (salt)
        key = mix64(key * 0x94d049bb133111ebULL ^
                    xxh3_64(c->names.items[salt].data, c->names.items[salt].len, 3));
    return key;
}

/* The root of namespace (lora, salt, size); made if `make`. NODE_NONE if absent (or out of
 * memory, or past 16 distinct block sizes: the event is then held without a place). */
static uint32_t root_of(core_t *c, uint32_t lora, uint32_t salt, uint32_t size, int make) {
    uint64_t k = ((uint64_t)lora << 32) | salt;
    map_entry *e = map_find(&c->ns_by_key, k, size);
    if (e != NULL)
        return c->ns[e->value].root;
    if (!make)
        return NODE_NONE;
    int known_size = 0;
    for (uint32_t i = 0; i < c->nsizes; i++)
        known_size |= c->sizes[i] == size;
    if (!known_size && c->nsizes == sizeof c->sizes / sizeof c->sizes[0])
        return NODE_NONE;
    if (c->nns == c->ns_cap) {
        uint32_t cap = c->ns_cap ? c->ns_cap * 2 : 16;
        namespace_t *ns = realloc(c->ns, cap * sizeof(namespace_t));
        if (ns == NULL)
            return NODE_NONE;
        c->ns = ns;
        c->ns_cap = cap;
    }
    uint32_t root = node_new(c, root_key(c, lora, salt, size), NODE_NONE);
    if (root == NODE_NONE)
        return NODE_NONE;
    int made;
    e = map_put(&c->ns_by_key, k, size, &made);
    map_entry *r = e ? map_put(&c->root_ns, root, 0, &made) : NULL;
    if (r == NULL) {
        if (e)
            map_remove(&c->ns_by_key, k, size, NULL);
        node_free(c, root);
        return NODE_NONE;
    }
    uint32_t index = c->nns++;
    c->ns[index] = (namespace_t){lora, salt, size, root, local_seed(c, lora, salt)};
    if (c->local_on)
        c->local_root[root] = root;
    if (lora)
        c->names.items[lora].refs++;
    if (salt)
        c->names.items[salt].refs++;
    e = map_find(&c->ns_by_key, k, size);
    e->value = index;
    r->value = index;
    size_count(c, size, 1);
    return root;
}

/* A root nobody holds and nothing hangs from goes, with its namespace (a fleet of many
 * salted tenants would otherwise keep a root per salt forever). */
static void root_drop(core_t *c, uint32_t root) {
    uint32_t index;
    if (!map_remove(&c->root_ns, root, 0, &index))
        return;
    namespace_t ns = c->ns[index];
    map_remove(&c->ns_by_key, ((uint64_t)ns.lora << 32) | ns.salt, ns.size, NULL);
    name_release(c, ns.lora, 1);
    name_release(c, ns.salt, 1);
    size_count(c, ns.size, -1);
    uint32_t last = --c->nns;
    if (index != last) { /* keep the array dense: the last namespace takes its index */
        c->ns[index] = c->ns[last];
        map_find(&c->root_ns, c->ns[index].root, 0)->value = index;
        map_find(&c->ns_by_key, ((uint64_t)c->ns[index].lora << 32) | c->ns[index].salt,
                 c->ns[index].size)
            ->value = index;
    }
    node_free(c, root);
}

/* `_size_of`: the block size of the tree a node is in (walks up: rare paths only). */
uint32_t size_of(const core_t *c, uint32_t n) {
    while (c->nodes[n].parent != NODE_NONE)
        n = c->nodes[n].parent;
    map_entry *e = map_find(&c->root_ns, n, 0);
    return e ? c->ns[e->value].size : 0;
}

/* `_prune`: free a node nobody holds and nothing hangs from, then its parents likewise. */
static void prune(core_t *c, uint32_t n) {
    for (;;) {
        node_t *node = &c->nodes[n];
        uint32_t parent = node->parent;
        if (parent == NODE_NONE) {
            if (node->nchild == 0 && node->holders == 0)
                root_drop(c, n);
            return;
        }
        child_forget(c, n);
        node_free(c, n);
        node_t *p = &c->nodes[parent];
        p->nchild--;
        if (p->holders || p->nchild)
            return;
        n = parent;
    }
}

/* -- who holds a node ---------------------------------------------------------------- */

static uint32_t set_new(core_t *c) {
    uint32_t s;
    if (c->free_sets) {
        s = c->free_sets;
        c->free_sets = (uint32_t)c->sets[(size_t)s * c->set_words];
    } else {
        if (c->nsets == c->sets_cap) {
            uint32_t cap = c->sets_cap ? c->sets_cap * 2 : 64;
            uint64_t *sets = realloc(c->sets, (size_t)cap * c->set_words * sizeof(uint64_t));
            if (sets == NULL)
                return 0;
            c->sets = sets;
            c->sets_cap = cap;
        }
        if (c->nsets + 2 > c->set_tokens_cap) { /* each set's tokens pointer (tokens_keep) */
            uint32_t cap = c->sets_cap > c->nsets + 2 ? c->sets_cap : c->nsets + 2;
            uint32_t **tokens = realloc(c->set_tokens, (size_t)cap * sizeof(uint32_t *));
            if (tokens == NULL)
                return 0;
            memset(tokens + c->set_tokens_cap, 0, (cap - c->set_tokens_cap) * sizeof(uint32_t *));
            c->set_tokens = tokens;
            c->set_tokens_cap = cap;
        }
        s = c->nsets++;
        if (s == 0) { /* set 0 is "none": take the next */
            s = c->nsets++;
        }
    }
    memset(&c->sets[(size_t)s * c->set_words], 0, c->set_words * sizeof(uint64_t));
    return s;
}

static void set_free(core_t *c, uint32_t s) {
    c->sets[(size_t)s * c->set_words] = c->free_sets;
    c->free_sets = s;
}

/* Make room for bit `bit` in every set (a publisher past the sets' current width). */
static int sets_widen(core_t *c, uint32_t bit) {
    uint32_t words = bit / 64 + 1;
    if (words <= c->set_words)
        return 0;
    uint32_t cap = c->sets_cap ? c->sets_cap : 64;
    uint64_t *sets = calloc((size_t)cap * words, sizeof(uint64_t));
    if (sets == NULL)
        return -1;
    for (uint32_t s = 0; s < c->nsets; s++)
        memcpy(&sets[(size_t)s * words], &c->sets[(size_t)s * c->set_words],
               c->set_words * sizeof(uint64_t));
    free(c->sets);
    c->sets = sets;
    c->sets_cap = cap;
    c->set_words = words;
    return 0;
}

static inline uint64_t *set_words(const core_t *c, uint32_t holders) {
    return &c->sets[(size_t)(holders & ~HOLD_SET) * c->set_words];
}

int holds(const core_t *c, uint32_t n, uint32_t bit) {
    uint32_t h = c->nodes[n].holders;
    if (h == 0)
        return 0;
    if (!(h & HOLD_SET))
        return h - 1 == bit;
    return (set_words(c, h)[bit / 64] >> (bit % 64)) & 1;
}

/* Add `bit` to the node's holders; 1 if it became shared (a second holder), -1 OOM. */
static int holders_add(core_t *c, uint32_t n, uint32_t bit) {
    uint32_t h = c->nodes[n].holders;
    if (h == 0) {
        c->nodes[n].holders = bit + 1;
        return 0;
    }
    if (!(h & HOLD_SET)) {
        if (h - 1 == bit)
            return 0;
        uint32_t s = set_new(c);
        if (s == 0)
            return -1;
        uint64_t *w = &c->sets[(size_t)s * c->set_words];
        w[(h - 1) / 64] |= 1ULL << ((h - 1) % 64);
        w[bit / 64] |= 1ULL << (bit % 64);
        c->nodes[n].holders = HOLD_SET | s;
        return 1;
    }
    set_words(c, h)[bit / 64] |= 1ULL << (bit % 64);
    return 0;
}

static void holders_del(core_t *c, uint32_t n, uint32_t bit) {
    uint32_t h = c->nodes[n].holders;
    if (h == 0)
        return;
    if (!(h & HOLD_SET)) {
        if (h - 1 == bit)
            c->nodes[n].holders = 0;
        return;
    }
    uint64_t *w = set_words(c, h);
    w[bit / 64] &= ~(1ULL << (bit % 64));
    uint32_t count = 0, last = 0;
    for (uint32_t i = 0; i < c->set_words && count < 2; i++)
        if (w[i]) {
            count += (uint32_t)__builtin_popcountll(w[i]);
            last = i * 64 + (uint32_t)__builtin_ctzll(w[i]);
        }
    if (count >= 2)
        return;
    tokens_forget(c, n); /* no longer shared: the dashboard won't ask for its tokens */
    set_free(c, h & ~HOLD_SET);
    c->nodes[n].holders = count ? last + 1 : 0;
}

/* -- tokens of shared nodes (for the dashboard's shared prefixes) --------------------- */

/* A shared node's tokens live beside its holder set (`set_tokens`, by set index): a node
 * keeps tokens only while two publishers or more hold it, which is exactly while its
 * holders are a set. (They were in a table keyed by node: three hash-table operations
 * each time a node got or lost its second holder, under the write lock.) */
#define TOKEN_CHUNK_ITEMS 64

/* Room for a copy of `words` uint32 (count + tokens): from the slab of that size (made if
 * there is room for one more size), else malloc'd. They came and went with every node
 * getting or losing its second holder, ~6 a batch, each a malloc or free and two atomic
 * updates of the allocation counters under the write lock, and a free often on another
 * thread's arena than its malloc's. NULL: out of memory. */
static uint32_t *tokens_alloc(core_t *c, uint32_t words) {
    uint32_t k = 0;
    while (k < c->ntoken_slabs && c->token_slabs[k].words != words)
        k++;
    if (k == c->ntoken_slabs) {
        if (k == sizeof c->token_slabs / sizeof c->token_slabs[0])
            return malloc((size_t)words * sizeof(uint32_t));
        c->token_slabs[k].words = words;
        c->token_slabs[k].free = NULL;
        c->token_slabs[k].chunks = NULL;
        c->ntoken_slabs++;
    }
    if (c->token_slabs[k].free == NULL) {
        size_t item = (size_t)words * sizeof(uint32_t); /* >= 8: a block has a token */
        uint8_t *chunk = malloc(16 + TOKEN_CHUNK_ITEMS * item);
        if (chunk == NULL)
            return NULL;
        memcpy(chunk, &c->token_slabs[k].chunks, sizeof(void *));
        c->token_slabs[k].chunks = chunk;
        c->token_slab_bytes += 16 + TOKEN_CHUNK_ITEMS * item;
        for (uint32_t i = 0; i < TOKEN_CHUNK_ITEMS; i++) {
            uint8_t *at = chunk + 16 + i * item;
            memcpy(at, &c->token_slabs[k].free, sizeof(uint32_t *));
            c->token_slabs[k].free = (uint32_t *)at;
        }
    }
    uint32_t *out = c->token_slabs[k].free;
    memcpy(&c->token_slabs[k].free, out, sizeof(uint32_t *));
    return out;
}

/* A copy back to its slab (its size's: sizes are never dropped), or to free. */
static void tokens_release(core_t *c, uint32_t *copy) {
    uint32_t words = copy[0] + 1;
    for (uint32_t k = 0; k < c->ntoken_slabs; k++)
        if (c->token_slabs[k].words == words) {
            memcpy(copy, &c->token_slabs[k].free, sizeof(uint32_t *));
            c->token_slabs[k].free = copy;
            return;
        }
    free(copy);
}

static void tokens_keep(core_t *c, uint32_t n, const uint32_t *tokens, uint32_t count) {
    uint32_t h = c->nodes[n].holders;
    if (!c->keep_tokens || tokens == NULL || !(h & HOLD_SET) ||
        c->set_tokens[h & ~HOLD_SET] != NULL)
        return;
    uint32_t *copy = count < UINT32_MAX ? tokens_alloc(c, count + 1) : NULL;
    if (copy == NULL)
        return; /* only the dashboard's token display loses */
    copy[0] = count;
    memcpy(copy + 1, tokens, count * sizeof(uint32_t));
    c->set_tokens[h & ~HOLD_SET] = copy;
    c->tokens_kept++;
}

/* Called while the node's holders are still its set (before set_free). */
static void tokens_forget(core_t *c, uint32_t n) {
    uint32_t h = c->nodes[n].holders;
    if (!(h & HOLD_SET) || c->set_tokens[h & ~HOLD_SET] == NULL)
        return;
    tokens_release(c, c->set_tokens[h & ~HOLD_SET]);
    c->set_tokens[h & ~HOLD_SET] = NULL;
    c->tokens_kept--;
}

const uint32_t *node_tokens(const core_t *c, uint32_t n) {
    uint32_t h = c->nodes[n].holders;
    return (h & HOLD_SET) && h != NODE_FREED ? c->set_tokens[h & ~HOLD_SET] : NULL;
}

/* -- publishers ---------------------------------------------------------------------- */

static inline uint32_t hk_b(hkey h) { return h.kind; }

/* A pool entry's hash as a map key: (value, kind). */
#define POOL_FIND(pool, h) pmap_find(&(pool)->blocks, (h).v, (h).kind)

source_t *source_get(core_t *c, uint32_t bit, int make) {
    if (bit < c->nsources_cap && c->sources[bit] != NULL)
        return c->sources[bit];
    if (!make)
        return NULL;
    if (bit >= c->nsources_cap) {
        uint32_t cap = c->nsources_cap ? c->nsources_cap : 16;
        while (cap <= bit)
            cap *= 2;
        source_t **sources = realloc(c->sources, cap * sizeof(source_t *));
        if (sources == NULL)
            return NULL;
        memset(sources + c->nsources_cap, 0, (cap - c->nsources_cap) * sizeof(source_t *));
        c->sources = sources;
        c->nsources_cap = cap;
    }
    if (sets_widen(c, bit) < 0)
        return NULL;
    source_t *s = calloc(1, sizeof(source_t));
    if (s == NULL)
        return NULL;
    s->used = 1;
    s->bit = bit;
    s->serial = ++c->serials;
    map_init(&s->extra);
    map_init(&s->refs);
    map_init(&s->where);
    c->sources[bit] = s;
    c->sources_gen++;
    if (bit + 1 > c->max_bit)
        c->max_bit = bit + 1;
    return s;
}

/* A bytes hash's interned id is referenced once per pool entry holding it. */
static inline void hkey_ref(core_t *c, hkey h) {
    if (h.kind == HK_BYTES)
        c->bytes.items[h.v].refs++;
}

static inline void hkey_unref(core_t *c, hkey h) {
    if (h.kind == HK_BYTES && --c->bytes.items[h.v].refs == 0)
        intern_drop(&c->bytes, (uint32_t)h.v);
}

/* `_pool`: the pool of (group, medium), made if new. On the publisher's second pool,
 * `where` starts: every node of the first pool is held by pool 0. */
static pool_t *pool_get(core_t *c, source_t *s, int64_t group, uint8_t big, uint32_t medium,
                        span_t name) {
    for (uint32_t i = 0; medium != 0 && i < s->npools; i++)
        if (s->pools[i].group == group && s->pools[i].group_big == big &&
            s->pools[i].medium == medium)
            return &s->pools[i];
    if (s->npools == MAX_POOLS)
        return NULL;
    /* A new pool: its medium interned now (not for a pool refused), and held by it. */
    medium = medium != 0 ? (c->strings.items[medium].refs++, medium)
                         : str_hold(c, name, &c->last_medium);
    if (medium == 0)
        return NULL; /* out of memory */
    pool_t *p = &s->pools[s->npools];
    p->group = group;
    p->group_big = big;
    p->medium = medium;
    p->tier = core_tier_of(c, medium);
    p->index = (uint8_t)s->npools;
    p->size = 0;
    p->tree = 0;
    pmap_init(&p->blocks);
    s->npools++;
    if (s->npools == 2) {
        s->several = 1;
        PMAP_FOREACH(&s->pools[0].blocks, e) {
            if (pmap_value(e) == NODE_LOOSE)
                continue;
            int made;
            map_entry *w = map_put(&s->where, pmap_value(e), 0, &made);
            if (w == NULL)
                return NULL;
            w->value = 1;
        }
    }
    return p;
}

static inline void count_add(map_t *m, uint64_t a, uint32_t b) {
    int made;
    map_entry *e = map_put(m, a, b, &made);
    if (e != NULL)
        e->value++;
}

/* `_drop_copy`: one less; the entry goes at zero. 1 if there was one. */
static inline int count_drop(map_t *m, uint64_t a, uint32_t b) {
    if (m->count == 0)
        return 0;
    map_entry *e = map_find(m, a, b);
    if (e == NULL)
        return 0;
    if (--e->value == 0)
        map_delete(m, e);
    return 1;
}

/* `_hold`: one more (pool, hash) entry of the publisher points at node `n`. Returns 1 if
 * the node became shared by two publishers (its tokens are then kept). */
static int src_hold(core_t *c, source_t *s, uint32_t index, uint32_t n) {
    if (n == NODE_LOOSE)
        return 0;
    if (!s->several) {
        if (holds(c, n, s->bit)) {
            count_add(&s->refs, n, 0);
            return 0;
        }
        return holders_add(c, n, s->bit) == 1;
    }
    int made;
    map_entry *w = map_put(&s->where, n, 0, &made);
    if (w == NULL)
        return 0;
    uint32_t bit = 1u << index;
    if (w->value & bit) {
        count_add(&s->refs, n, index);
        return 0;
    }
    w->value |= bit;
    return holders_add(c, n, s->bit) == 1;
}

/* `_release`: one (pool, hash) entry of the publisher no longer points at node `n`. */
static void src_release(core_t *c, source_t *s, uint32_t index, uint32_t n) {
    if (n == NODE_LOOSE)
        return;
    if (count_drop(&s->refs, n, index))
        return;
    if (s->several) {
        map_entry *w = map_find(&s->where, n, 0);
        if (w != NULL) {
            w->value &= ~(1u << index);
            if (w->value)
                return;
            map_delete(&s->where, w);
        }
    }
    holders_del(c, n, s->bit);
    node_t *node = &c->nodes[n];
    if (node->holders == 0 && node->nchild == 0)
        prune(c, n);
}

/* `_placed_elsewhere`: the node the publisher holds `h` at in a pool (other than `skip`)
 * of `size`-token blocks. */
static uint32_t placed_elsewhere(core_t *c, source_t *s, hkey h, uint32_t size, pool_t *skip) {
    for (uint32_t i = 0; i < s->npools; i++) {
        pool_t *p = &s->pools[i];
        if (p == skip)
            continue;
        pmap_entry *e = POOL_FIND(p, h);
        if (e == NULL || pmap_value(e) == NODE_LOOSE)
            continue;
        if (p->size == size || size_of(c, pmap_value(e)) == size)
            return pmap_value(e);
    }
    return NODE_NONE;
}

/* `_put`: the pool holds `h` at node `n` (or one more copy of it). */
static void put(core_t *c, source_t *s, pool_t *p, hkey h, uint32_t n, const uint32_t *tokens,
                uint32_t ntokens) {
    int made;
    pmap_entry *e = pmap_put(&p->blocks, h.v, h.kind, &made);
    if (e == NULL)
        return;
    if (made) {
        pmap_set(e, n);
        hkey_ref(c, h);
        if (src_hold(c, s, p->index, n))
            tokens_keep(c, n, tokens, ntokens);
        return;
    }
    count_add(&s->extra, h.v, h.kind | ((uint32_t)p->index << 8));
    uint32_t old = pmap_value(e);
    if (old != n && n != NODE_LOOSE) {
        pmap_set(e, n);
        if (src_hold(c, s, p->index, n))
            tokens_keep(c, n, tokens, ntokens);
        src_release(c, s, p->index, old);
    }
}

/* `_take_over`: a GPU or keyed copy of `h` was placed at node `n`: the publisher's other
 * pools of that block size holding `h` without a place, or on a lower tier elsewhere,
 * take this place. */
static void take_over(core_t *c, source_t *s, pool_t *placed_in, hkey h, uint32_t n) {
    uint32_t size = size_of(c, n);
    for (uint32_t i = 0; i < s->npools; i++) {
        pool_t *p = &s->pools[i];
        if (p == placed_in)
            continue;
        pmap_entry *e = POOL_FIND(p, h);
        if (e == NULL || pmap_value(e) == n)
            continue;
        if (p->size && p->size != size)
            continue;
        uint32_t old = pmap_value(e);
        if (old != NODE_LOOSE && p->tier == TIER_GPU)
            continue;
        if (!p->size)
            p->size = size; /* a pool of hash-only events learns its block size here */
        pmap_set(e, n);
        src_hold(c, s, p->index, n);
        src_release(c, s, p->index, old);
        s->stats.namespace_moved += old != NODE_LOOSE;
    }
}

/* `_store_elsewhere_placed`. */
static void store_elsewhere_placed(core_t *c, source_t *s, pool_t *p, const hkey *hashes,
                                   uint32_t n, uint32_t size) {
    for (uint32_t i = 0; i < n; i++) {
        uint32_t node = s->several ? placed_elsewhere(c, s, hashes[i], size, p) : NODE_NONE;
        if (node == NODE_NONE) {
            node = NODE_LOOSE;
            if (POOL_FIND(p, hashes[i]) == NULL)
                s->stats.unplaced++;
        }
        put(c, s, p, hashes[i], node, NULL, 0);
    }
}

/* An op with its strings and hashes interned (the form the model works on): its hashes
 * [from, from + n), the slice of it applied now (apply_slice). */
typedef struct {
    const op_t *op;
    const hkey *hashes; /* hashes[0] is the op's hash `from` */
    uint32_t from, n;
    hkey parent;
    uint8_t parent_known; /* a bytes parent never interned is held by nobody */
    uint32_t medium; /* 0: not interned (no pool of it yet) */
} rop_t;

static uint32_t intern_cached(core_t *c, interner *t, span_t sp, uint32_t *last);

/* The root of a chain-starting event's namespace, made if new. Its names -- the adapter
 * (its name, or "\xff" + the lora_id of vLLM < 0.14) and the salt -- are interned here
 * only, and held by the namespaces using them: a fleet whose requests bring new salts
 * keeps only the salts of namespaces it still has. NODE_NONE: no place (see root_of). */
static uint32_t root_for(core_t *c, const op_t *op, uint32_t size) {
    uint32_t lora = 0, salt = 0;
    int named = op->lora.p != NULL || op->has_lora_id;
    if (op->lora.p != NULL) {
        lora = intern_cached(c, &c->names, op->lora, &c->last_lora);
    } else if (op->has_lora_id) {
        char text[32];
        int n = snprintf(text, sizeof text, "\xff%lld", (long long)op->lora_id);
        lora = intern(&c->names, (const uint8_t *)text, (uint32_t)n);
    }
    if (op->salt.p != NULL)
        salt = intern_cached(c, &c->names, op->salt, &c->last_salt);
    uint32_t root = NODE_NONE;
    if ((!named || lora) && (op->salt.p == NULL || salt)) /* else out of memory */
        root = root_of(c, lora, salt, size, 1);
    name_release(c, lora, 0); /* names no namespace took (none made, or no memory) */
    name_release(c, salt, 0);
    return root;
}

/* `_anchor`: the node the event's first block hangs from (in a tree of `size`, a tree
 * size), or NODE_NONE. */
static uint32_t anchor(core_t *c, source_t *s, const rop_t *r, pool_t *p, uint32_t size) {
    const op_t *op = r->op;
    if (!op->has_parent)
        return root_for(c, op, size);
    if (!r->parent_known)
        return NODE_NONE;
    pmap_entry *e = POOL_FIND(p, r->parent);
    if (e != NULL && pmap_value(e) != NODE_LOOSE &&
        (p->size == size || size_of(c, pmap_value(e)) == size))
        return pmap_value(e);
    if (!s->several)
        return NODE_NONE;
    return placed_elsewhere(c, s, r->parent, size, p);
}

/* -- Dynamo's local block hashes ------------------------------------------------------ */

int keep_local_hashes(core_t *c, int on) {
    if (c->live_nodes != 0 && on != c->local_on)
        return -1; /* only before the first block: the tree's blocks would have none */
    if (on && !c->local_on) {
        c->local_hash = malloc((size_t)(c->nodes_cap ? c->nodes_cap : 1) * sizeof(uint64_t));
        c->local_root = malloc((size_t)(c->nodes_cap ? c->nodes_cap : 1) * sizeof(uint32_t));
        if (c->local_hash == NULL || c->local_root == NULL) {
            free(c->local_hash);
            free(c->local_root);
            c->local_hash = NULL;
            c->local_root = NULL;
            return -1;
        }
    }
    c->local_on = (uint8_t)(on != 0);
    return 0;
}

/* A new (or not yet indexed) child of `parent` with these `width` tokens: its local hash
 * under its namespace's seed, and the table entry (hash, parent) -> child. Only a block
 * keyed by its tokens alone (no own keys: its key digest is the tokens' own) in a tree
 * of plain blocks; a second sibling of the same hash (an XXH3 collision) stays out. */
static void local_index(core_t *c, uint32_t parent, uint32_t child, const uint32_t *block,
                        uint32_t width, uint64_t key) {
    uint32_t root = c->local_root[parent];
    if (root == NODE_NONE)
        return;
    map_entry *ns = map_find(&c->root_ns, root, 0);
    if (ns == NULL || (c->ns[ns->value].size & BIGRAM_TREE))
        return;
    const uint8_t *bytes = (const uint8_t *)block;
    size_t len = (size_t)width * 4;
    if (key_digest(c, bytes, len) != key)
        return; /* own keys (an image's block, ...): Dynamo's hash of tokens can't be it */
    uint64_t h = xxh3_64(bytes, len, c->ns[ns->value].seed);
    int made;
    map_entry *e = map_put(&c->local, h, parent, &made);
    if (e == NULL)
        return; /* out of memory: not found by its local hash */
    if (made)
        e->value = child;
    c->local_hash[child] = h;
    c->local_root[child] = root;
}

static void local_forget(core_t *c, uint32_t i) {
    uint32_t root = c->local_root[i];
    c->local_root[i] = NODE_NONE;
    uint32_t parent = c->nodes[i].parent;
    if (root == NODE_NONE || root == i || parent == NODE_NONE)
        return;
    map_entry *e = map_find(&c->local, c->local_hash[i], parent);
    if (e != NULL && e->value == i)
        map_remove(&c->local, c->local_hash[i], parent, NULL);
}

/* The nodes under `root` whose blocks continue these local hashes from the first. */
uint32_t local_path(const core_t *c, uint32_t root, const uint64_t *hashes, uint32_t n,
                    uint32_t *nodes) {
    uint32_t node = root, k = 0;
    for (; k < n; k++) {
        map_entry *e = map_find(&c->local, hashes[k], node);
        if (e == NULL)
            break;
        node = nodes[k] = e->value;
    }
    return k;
}

/* `_insert_chain` and `_insert_chain_in_several`, for the keyed blocks of the slice `r`
 * under `node`. Returns the node of the last one (a later slice goes on from it), or
 * NODE_NONE when it ran out of memory (the rest held without a place). */
static uint32_t insert_chain(core_t *c, source_t *s, pool_t *p, uint32_t node,
                             const scratch_t *sc, const rop_t *r, uint32_t size,
                             uint32_t width) {
    const op_t *op = r->op;
    const hkey *hashes = r->hashes; /* hashes[i - from]: block i of the op */
    const uint64_t *keys = sc->keys + op->keys_off;
    const uint32_t *tokens = op->tokens_kept ? sc->tokens + op->tokens_off : NULL;
    uint32_t tree_size = s->several ? size_of(c, node) : size;
    int keyed = op->keyed || p->tier == TIER_GPU;
    uint32_t n = op->nkeys < r->from + r->n ? op->nkeys : r->from + r->n;
    for (uint32_t i = r->from; i < n; i++) {
        const uint32_t *block = tokens ? tokens + (size_t)i * width : NULL;
        if (s->several && !keyed) {
            uint32_t kept = placed_elsewhere(c, s, hashes[i - r->from], tree_size, p);
            if (kept != NODE_NONE) {
                s->stats.namespace_kept++;
                put(c, s, p, hashes[i - r->from], kept, block, width);
                node = kept;
                continue;
            }
        }
        uint32_t child = child_make(c, node, keys[i]);
        if (child == NODE_NONE) { /* out of memory: held without a place */
            store_elsewhere_placed(c, s, p, hashes + (i - r->from), n - i, size);
            return NODE_NONE;
        }
        if (c->local_on && block != NULL && c->local_root[child] == NODE_NONE)
            local_index(c, node, child, block, width, keys[i]);
        node = child;
        put(c, s, p, hashes[i - r->from], node, block, width);
        if (s->several && keyed)
            take_over(c, s, p, hashes[i - r->from], node);
    }
    return node;
}

int is_partial(const core_t *c, uint32_t n) {
    return c->partial.count && map_find(&c->partial, n, 0) != NULL;
}

/* `_store_partial`: a partial-block entry (one hash unit of a larger block). */
static void store_partial(core_t *c, source_t *s, const scratch_t *sc, const rop_t *r,
                          pool_t *p, uint32_t unit) {
    const op_t *op = r->op;
    uint32_t size = p->size;
    hkey h = r->hashes[0];
    if (!s->unit || unit < s->unit)
        s->unit = unit;
    uint32_t parent = NODE_NONE;
    if (!op->has_parent) {
        parent = root_for(c, op, size);
    } else if (r->parent_known) {
        pmap_entry *e = POOL_FIND(p, r->parent);
        if (e != NULL && pmap_value(e) != NODE_LOOSE && size_of(c, pmap_value(e)) == size)
            parent = pmap_value(e);
        else
            parent = placed_elsewhere(c, s, r->parent, size, p);
    }
    uint32_t units = 1;
    if (parent != NODE_NONE) {
        map_entry *e = c->partial.count ? map_find(&c->partial, parent, 0) : NULL;
        units += e ? e->value : 0;
    }
    uint32_t node = NODE_NONE;
    if (parent != NODE_NONE && (uint64_t)units * unit < size && op->nkeys >= 1) {
        node = child_make(c, parent, sc->keys[op->keys_off] ^ PARTIAL_KEY);
        if (node != NODE_NONE) {
            int made;
            map_entry *e = map_put(&c->partial, node, 0, &made);
            if (e == NULL) { /* out of memory: a node nobody can tell partial goes */
                if (!c->nodes[node].holders && !c->nodes[node].nchild)
                    prune(c, node);
                node = NODE_NONE;
            } else {
                e->value = units;
            }
        }
    }
    if (node == NODE_NONE) {
        node = s->several ? placed_elsewhere(c, s, h, size, p) : NODE_NONE;
        if (node == NODE_NONE) {
            node = NODE_LOOSE;
            if (POOL_FIND(p, h) == NULL)
                s->stats.unplaced++;
        }
    }
    put(c, s, p, h, node, NULL, 0);
}

/* `_unit_tree`. */
static uint32_t unit_tree(const source_t *s, const pool_t *p, uint32_t size, const op_t *op) {
    if (p->tier != TIER_GPU || p->size != size || op->own || !size)
        return 0;
    uint32_t tree = 0;
    for (uint32_t i = 0; i < s->npools; i++) {
        uint32_t t = s->pools[i].size;
        if (s->pools[i].tier == TIER_GPU && t > size && t % size == 0 && !(t & BIGRAM_TREE) &&
            t > tree)
            tree = t;
    }
    return tree;
}

static inline uint32_t partial_units_of(const core_t *c, uint32_t n) {
    map_entry *e = c->partial.count ? map_find(&c->partial, n, 0) : NULL;
    return e ? e->value : 0;
}

/* `_unit_positions`: into `at` (UINT32_MAX: unknown). 0: out of memory. */
static int unit_positions(core_t *c, source_t *s, const hkey *hashes, uint32_t n,
                          uint32_t start, uint32_t anchor, uint32_t into, uint32_t k,
                          uint32_t units, uint32_t tree, uint32_t *at) {
    int64_t *low = malloc(((size_t)n + 1) * 2 * sizeof(int64_t));
    if (low == NULL)
        return 0;
    int64_t *high = low + n + 1;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t node = placed_elsewhere(c, s, hashes[i], tree, NULL);
        at[i] = UINT32_MAX;
        if (node == NODE_NONE)
            continue;
        uint64_t d = 0;
        uint32_t cur = node;
        int last_partial = 0;
        while (cur != NODE_NONE && cur != start && cur != anchor && d <= (uint64_t)units + into) {
            last_partial = partial_units_of(c, cur) != 0;
            d += last_partial ? 1 : k;
            cur = c->nodes[cur].parent;
        }
        int64_t pos = -1;
        if (cur == start && start != anchor)
            pos = (int64_t)d - 1;
        else if (cur == anchor && !(start != anchor && last_partial))
            pos = (int64_t)d - into - 1;
        if (pos >= 0 && pos < units)
            at[i] = (uint32_t)pos;
    }
    int64_t prev = -1;
    for (uint32_t i = 0; i < n; i++) {
        prev = at[i] != UINT32_MAX ? (int64_t)at[i] : prev + 1;
        low[i] = prev;
    }
    int64_t next = units;
    for (uint32_t i = n; i-- > 0;) {
        next = at[i] != UINT32_MAX ? (int64_t)at[i] : next - 1;
        high[i] = next;
    }
    int bad = 0;
    for (uint32_t i = 0; i < n; i++)
        if (low[i] > high[i] || (i + 1 < n && low[i] >= low[i + 1]))
            bad = 1;
    for (uint32_t i = 0; i < n; i++)
        at[i] = !bad && low[i] == high[i] ? (uint32_t)low[i] : UINT32_MAX;
    free(low);
    return 1;
}

/* A partial node: `child_make` and its units in `c->partial`. NODE_NONE: no memory. */
static uint32_t partial_child(core_t *c, uint32_t parent, uint64_t key, uint32_t units) {
    uint32_t node = child_make(c, parent, key ^ PARTIAL_KEY);
    if (node == NODE_NONE)
        return NODE_NONE;
    int made;
    map_entry *e = map_put(&c->partial, node, 0, &made);
    if (e == NULL) { /* out of memory: a node nobody can tell partial goes */
        if (!c->nodes[node].holders && !c->nodes[node].nchild)
            prune(c, node);
        return NODE_NONE;
    }
    e->value = units;
    return node;
}

/* `_store_units`. */
static void store_units(core_t *c, source_t *s, const scratch_t *sc, const rop_t *r, pool_t *p,
                        uint32_t tree) {
    const op_t *op = r->op;
    const hkey *hashes = r->hashes;
    uint32_t n = r->n, unit = p->size;
    p->tree = tree;
    if (!s->unit || unit < s->unit)
        s->unit = unit;
    uint32_t k = tree / unit, units = op->ntokens / unit;
    const uint32_t *data =
        op->tokens_kept && op->ntokens % unit == 0 ? sc->tokens + op->tokens_off : NULL;
    uint32_t start = NODE_NONE;
    if (data == NULL || r->from != 0 || r->n != op->nhashes) { /* never sliced: unsplit */
        start = NODE_NONE;
    } else if (!op->has_parent) {
        start = root_for(c, op, tree);
    } else if (r->parent_known) {
        pmap_entry *e = POOL_FIND(p, r->parent);
        if (e != NULL && pmap_value(e) != NODE_LOOSE && size_of(c, pmap_value(e)) == tree)
            start = pmap_value(e);
        else
            start = placed_elsewhere(c, s, r->parent, tree, NULL);
    }
    uint32_t *at = start != NODE_NONE ? malloc(((size_t)n + 1) * sizeof(uint32_t)) : NULL;
    if (at == NULL) {
        store_elsewhere_placed(c, s, p, hashes, n, tree);
        return;
    }
    uint32_t into = partial_units_of(c, start), anchor = start;
    for (uint32_t i = 0; i < into; i++)
        anchor = c->nodes[anchor].parent;
    if (units == n) {
        for (uint32_t i = 0; i < n; i++)
            at[i] = i;
    } else if (!unit_positions(c, s, hashes, n, start, anchor, into, k, units, tree, at)) {
        free(at);
        store_elsewhere_placed(c, s, p, hashes, n, tree);
        return;
    }
    uint32_t node = start;
    int64_t begun = -(int64_t)into;
    uint32_t done = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (at[i] == UINT32_MAX || node == NODE_NONE) {
            store_elsewhere_placed(c, s, p, hashes + i, 1, tree);
            continue;
        }
        while (done <= at[i] && node != NODE_NONE) {
            into++;
            if (into < k) {
                uint64_t key = key_digest(c, (const uint8_t *)(data + (size_t)done * unit),
                                          (size_t)unit * 4);
                node = partial_child(c, node, key, into);
            } else {
                uint32_t last = node;
                if (begun >= 0) {
                    uint64_t key =
                        key_digest(c, (const uint8_t *)(data + (size_t)begun * unit),
                                   ((size_t)done + 1 - (size_t)begun) * unit * 4);
                    node = child_make(c, anchor, key);
                } else {
                    uint32_t found =
                        done == at[i] ? placed_elsewhere(c, s, hashes[i], tree, NULL) : NODE_NONE;
                    node = found != NODE_NONE && c->nodes[found].parent == anchor ? found
                                                                                   : NODE_NONE;
                }
                /* skipped units inside the block, held by none */
                if (!c->nodes[last].holders && !c->nodes[last].nchild)
                    prune(c, last);
                if (node != NODE_NONE)
                    anchor = node;
                into = 0;
                begun = (int64_t)done + 1;
            }
            done++;
        }
        if (node == NODE_NONE) {
            store_elsewhere_placed(c, s, p, hashes + i, 1, tree);
            continue;
        }
        put(c, s, p, hashes[i], node, NULL, 0);
    }
    free(at);
}

/* `_store`, for the slice `r` of the op. `chain`: the node a later slice's first block
 * hangs from (the first slice sets it). */
static int store(core_t *c, source_t *s, const scratch_t *sc, const rop_t *r, uint32_t *chain) {
    const op_t *op = r->op;
    pool_t *p = pool_get(c, s, op->has_group ? op->group : 0, op->has_group && op->group_big,
                         r->medium, medium_span(op->medium));
    if (p == NULL) /* past MAX_POOLS (fleet.py's too): not held; else out of memory */
        return s->npools == MAX_POOLS ? 0 : -1;
    uint32_t size = op->block_size > 0 && op->block_size < (1LL << 31) ? (uint32_t)op->block_size : 0;
    /* `event_tokens`: a bigram page's key is its pairs flattened (twice the token ids),
     * in a tree of its own (its tree size has BIGRAM_TREE). */
    uint32_t width = op->bigram ? 2 * size : size;
    if (op->bigram && size)
        size |= BIGRAM_TREE;
    if (size > p->size)
        p->size = size;
    if (op->has_spec && !p->group_big && p->group >= 0 && p->group < MAX_GROUPS) {
        uint32_t kind = op->spec_kind.p == NULL ? 0 : str_hold(c, op->spec_kind, &c->last_kind);
        if (op->spec_kind.p != NULL && kind == 0)
            return -1;
        str_release(c, s->groups[p->group].kind);
        s->groups[p->group] = (group_spec){kind, op->has_window ? op->window : 0, 1};
    }
    if (r->from == 0)
        s->stats.unrecognised_keys += op->unrecognised;
    const hkey *hashes = r->hashes;
    uint32_t n = r->n, end = r->from + r->n;
    if (n == 0)
        return 0;
    uint32_t tree = s->several ? unit_tree(s, p, size, op) : 0;
    if (size == 0 || (uint64_t)op->ntokens != (uint64_t)width * op->nhashes) {
        if (tree) {
            store_units(c, s, sc, r, p, tree);
            return 0;
        }
        store_elsewhere_placed(c, s, p, hashes, n, size);
        return 0;
    }
    if (p->size > size && p->size % size == 0 && op->nhashes == 1 && width == size &&
        !(size & BIGRAM_TREE) && !(p->size & BIGRAM_TREE)) {
        store_partial(c, s, sc, r, p, size);
        return 0;
    }
    if (tree) {
        store_units(c, s, sc, r, p, tree);
        return 0;
    }
    uint32_t parent = r->from == 0 ? anchor(c, s, r, p, size) : *chain;
    *chain = parent == NODE_NONE ? NODE_NONE : insert_chain(c, s, p, parent, sc, r, size, width);
    uint32_t placed = parent == NODE_NONE || op->nkeys < r->from ? r->from
                      : op->nkeys < end                         ? op->nkeys
                                                                : end;
    if (placed < end) /* no place: the chain's start unknown, or a key that can't be made */
        store_elsewhere_placed(c, s, p, hashes + (placed - r->from), end - placed, size);
    return 0;
}

/* `_remove`. */
static void remove_hashes(core_t *c, source_t *s, int64_t group, uint8_t big, uint32_t medium,
                          const hkey *hashes, uint32_t n) {
    pool_t *p = NULL;
    for (uint32_t i = 0; i < s->npools; i++)
        if (s->pools[i].group == group && s->pools[i].group_big == big &&
            s->pools[i].medium == medium)
            p = &s->pools[i];
    if (p == NULL)
        return;
    uint32_t extra_b = (uint32_t)p->index << 8;
    for (uint32_t i = 0; i < n; i++) {
        hkey h = hashes[i];
        pmap_entry *e = POOL_FIND(p, h);
        if (e == NULL)
            continue; /* not known to be held (e.g. stored before a loss) */
        if (count_drop(&s->extra, h.v, h.kind | extra_b))
            continue; /* one of several copies went */
        uint32_t node = pmap_value(e);
        pmap_delete(&p->blocks, e);
        hkey_unref(c, h);
        src_release(c, s, p->index, node);
    }
}

/* `_clear`: everything the publisher holds goes (AllBlocksCleared, a restart). */
void source_clear(core_t *c, source_t *s) {
    s->epoch++;
    for (uint32_t i = 0; i < s->npools; i++) {
        PMAP_FOREACH(&s->pools[i].blocks, e) {
            uint32_t n = pmap_value(e);
            if (n != NODE_LOOSE && !node_freed(c, n))
                holders_del(c, n, s->bit);
        }
    }
    for (uint32_t i = 0; i < s->npools; i++) {
        PMAP_FOREACH(&s->pools[i].blocks, e) {
            uint32_t n = pmap_value(e);
            hkey_unref(c, (hkey){e->a, pmap_b(e)});
            if (n == NODE_LOOSE || node_freed(c, n))
                continue;
            if (c->nodes[n].holders == 0 && c->nodes[n].nchild == 0)
                prune(c, n);
        }
        pmap_free(&s->pools[i].blocks);
        str_release(c, s->pools[i].medium);
    }
    for (uint32_t g = 0; g < MAX_GROUPS; g++)
        str_release(c, s->groups[g].kind);
    s->npools = 0;
    s->several = 0;
    s->unit = 0;
    map_free(&s->extra);
    map_free(&s->refs);
    map_free(&s->where);
    memset(s->groups, 0, sizeof s->groups);
}

static void source_free(core_t *c, source_t *s) {
    source_clear(c, s);
}

void source_remove(core_t *c, uint32_t bit) {
    source_t *s = source_get(c, bit, 0);
    if (s == NULL)
        return;
    source_clear(c, s);
    free(s);
    c->sources[bit] = NULL;
    c->sources_gen++;
}

/* The interned id of a hash; bytes are interned only if `make` (a store), else a hash
 * never interned is reported unknown (returns 0). */
static int hash_of(core_t *c, const phash *ph, int make, hkey *out) {
    if (ph->kind != HK_BYTES) {
        *out = (hkey){ph->v, ph->kind};
        return 1;
    }
    uint32_t id = make ? intern(&c->bytes, ph->p, ph->len) : intern_find(&c->bytes, ph->p, ph->len);
    *out = (hkey){id, HK_BYTES};
    return id != 0;
}

/* A string's id, remembering the last one of its kind (a stream repeats its medium, spec
 * kind and adapter in every event: a compare instead of hashing each time). */
static uint32_t intern_cached(core_t *c, interner *t, span_t sp, uint32_t *last) {
    (void)c;
    if (*last) {
        const blob_t *b = &t->items[*last];
        if (b->len == sp.len && memcmp(sp.p, b->data, sp.len) == 0)
            return *last;
    }
    uint32_t id = sp.p == NULL ? 0 : intern(t, sp.p, sp.len);
    *last = id;
    return id;
}

/* An event's medium: none, or an empty name, is the GPU (fleet.py's `event.medium or
 * DEFAULT_MEDIUM`; "" made a pool of its own here, found by fuzz/). */
/* Its id if interned (a pool has it), else 0: interned only when a pool is made. */
static uint32_t medium_of(const core_t *c, span_t sp) {
    if (sp.p == NULL || sp.len == 0)
        return c->gpu_medium;
    if (c->last_medium) {
        const blob_t *b = &c->strings.items[c->last_medium];
        if (b->len == sp.len && memcmp(sp.p, b->data, sp.len) == 0)
            return c->last_medium;
    }
    /* "GPU" said in every event (vLLM's): interned at init, so never the last one made;
     * it was a table lookup per op, 5 % of apply's instructions */
    if (sp.len == 3 && memcmp(sp.p, "GPU", 3) == 0)
        return c->gpu_medium;
    return intern_find(&c->strings, sp.p, sp.len);
}

/* The op's hashes [from, from + n) interned, under the same write lock as their apply: a
 * bytes hash interned in an earlier slice could be gone since (another publisher's
 * removal freed it). */
static int resolve(core_t *c, scratch_t *sc, const op_t *op, uint32_t from, uint32_t n,
                   rop_t *r) {
    memset(r, 0, sizeof *r);
    r->op = op;
    r->from = from;
    r->n = n;
    r->medium = medium_of(c, op->medium); /* 0: no pool has it yet */
    if (KV_GROW(sc->hk, sc->hk_cap, n) != 0)
        return -1;
    r->hashes = sc->hk;
    const phash *hashes = &sc->hashes[op->hashes_off + from];
    if (op->type == OP_REMOVED) {
        uint32_t known = 0;
        for (uint32_t i = 0; i < n; i++)
            if (hash_of(c, &hashes[i], 0, &sc->hk[known]))
                known++;
        return (int)known; /* unknown bytes hashes are held by nobody: left out */
    }
    for (uint32_t i = 0; i < n; i++)
        if (!hash_of(c, &hashes[i], 1, &sc->hk[i]))
            return -1;
    if (op->has_parent)
        r->parent_known = (uint8_t)hash_of(c, &op->parent, 0, &r->parent);
    return (int)n;
}

/* Bytes hashes a store interned (resolve) that no pool entry took -- a pool past
 * MAX_POOLS, or out of memory -- go again: nothing else would ever free them. */
static void drop_unheld(core_t *c, const rop_t *r) {
    for (uint32_t i = 0; i < r->n; i++) {
        hkey h = r->hashes[i];
        if (h.kind == HK_BYTES && h.v != 0 && c->bytes.items[h.v].data != NULL &&
            c->bytes.items[h.v].refs == 0)
            intern_drop(&c->bytes, (uint32_t)h.v);
    }
}

/* Apply a parsed batch to one publisher: `apply` in fleet.py, a slice of at most
 * `budget` hashes at a time (issue 17 point 7: the caller lets the write lock go between
 * two, so a lookup waits behind one slice, not behind a batch of millions of blocks).
 * Slices give the state the whole batch gives at once: a stored op's later slice hangs
 * from the node its earlier one ended at (`cur->node`), as one chain would. Between two
 * slices the index is consistent (each block applied whole); readers may see a part of
 * a huge batch, as if the engine had sent it in several.
 * 1: the batch is applied; 0: call again with the same cursor; -1: out of memory. */
/* A store `store_units` may place: it places the whole chain at once (its hashes'
 * units are read from all of them), so a slice never ends inside it. */
static int unsplit(const source_t *s, const op_t *op) {
    if (!s->several || op->block_size <= 0 || op->block_size >= (1LL << 31))
        return 0;
    for (uint32_t i = 0; i < s->npools; i++) {
        uint32_t t = s->pools[i].size;
        if (s->pools[i].tier == TIER_GPU && t > op->block_size && t % op->block_size == 0)
            return 1;
    }
    return 0;
}

/* Whether a slice may chain from `node`: none, or a live node the source holds, or a
 * live root (a chain whose blocks found no place yet). */
static int cursor_live(const core_t *c, const source_t *s, uint32_t node) {
    if (node == NODE_NONE)
        return 1;
    if (node >= c->nnodes || node_freed(c, node))
        return 0;
    return holds(c, node, s->bit) || map_find((map_t *)&c->root_ns, node, 0) != NULL;
}

int apply_slice(core_t *c, source_t *s, scratch_t *sc, apply_cursor *cur, uint32_t budget) {
    if (cur->started && cur->serial != s->serial)
        return 1; /* removed meanwhile, its bit another's now: the rest was the removed one's */
    if (cur->started && cur->epoch != s->epoch)
        cur->node = NODE_NONE; /* cleared meanwhile (not by ingest): the chain's start gone */
    if (cur->started && !cursor_live(c, s, cur->node))
        cur->node = NODE_NONE; /* never expected: a freed node must not be chained from */
    cur->serial = s->serial;
    cur->started = 1;
    for (; cur->op < sc->nops; cur->op++, cur->done = 0) {
        const op_t *op = &sc->ops[cur->op];
        if (budget == 0)
            break;
        uint32_t n = op->nhashes - cur->done;
        if (n > budget && !(op->type == OP_STORED && cur->done == 0 && unsplit(s, op)))
            n = budget;
        uint32_t cost = n ? n : 1; /* an op of no hashes costs one */
        budget = cost >= budget ? 0 : budget - cost;
        rop_t r;
        if (op->type == OP_REMOVED) {
            if (cur->done == 0)
                cur->removed += op->nhashes;
            int known = resolve(c, sc, op, cur->done, n, &r);
            if (known < 0)
                return -1;
            remove_hashes(c, s, op->has_group ? op->group : 0, op->has_group && op->group_big,
                          r.medium, r.hashes,
                          (uint32_t)known);
        } else if (op->type == OP_STORED) {
            if (cur->done == 0)
                cur->stored += op->nhashes;
            if (resolve(c, sc, op, cur->done, n, &r) < 0)
                return -1;
            int res = store(c, s, sc, &r, &cur->node);
            drop_unheld(c, &r);
            if (res < 0)
                return -1;
        } else if (op->type == OP_CLEARED) {
            cur->clears++;
            source_clear(c, s);
        }
        cur->done += n;
        if (cur->done < op->nhashes) { /* the budget ended inside this op */
            cur->epoch = s->epoch;
            return 0;
        }
    }
    cur->epoch = s->epoch;
    if (cur->op < sc->nops)
        return 0;
    s->stats.stored += cur->stored;
    s->stats.removed += cur->removed;
    s->stats.clears += cur->clears;
    s->stats.batches++;
    return 1;
}

int apply_ops(core_t *c, source_t *s, scratch_t *sc) {
    apply_cursor cur = {0};
    return apply_slice(c, s, sc, &cur, UINT32_MAX) < 0 ? -1 : 0;
}

/* -- what an engine would reuse: kvindex/index/reuse.py ------------------------------- */

enum kind_class { KIND_PREFIX, KIND_WINDOW, KIND_MAMBA, KIND_UNCACHED };

static int blob_is(const core_t *c, uint32_t sid, const char *text) {
    const blob_t *b = &c->strings.items[sid];
    return b->len == strlen(text) && memcmp(b->data, text, b->len) == 0;
}

static int kind_class(const core_t *c, const group_spec *g) {
    if (!g->present || g->kind == 0)
        return KIND_PREFIX;
    if (blob_is(c, g->kind, "sliding_window") || blob_is(c, g->kind, "sliding_window_mla"))
        return g->window ? KIND_WINDOW : KIND_PREFIX;
    if (blob_is(c, g->kind, "mamba"))
        return KIND_MAMBA;
    if (blob_is(c, g->kind, "encoder_only_attention") || blob_is(c, g->kind, "cross_attention"))
        return KIND_UNCACHED;
    return KIND_PREFIX; /* full, mla, sink, chunked local, unknown, and kinds not known yet */
}

/* Whether pool `p` of publisher `s` holds path node `d`. */
static inline int held_at(const core_t *c, const source_t *s, const pool_t *p,
                          const walk_path *w, uint32_t d) {
    (void)c;
    if (d >= w->len)
        return 0;
    map_entry *e = map_find(&s->where, w->path[d], 0);
    return e != NULL && ((e->value >> p->index) & 1);
}

static uint32_t leading(const core_t *c, const source_t *s, const pool_t *p, const walk_path *w) {
    uint32_t d = 0;
    while (held_at(c, s, p, w, d))
        d++;
    return d;
}

/* A pool's block size (its tree size without the bigram flag): what answers count in. */
static inline uint32_t psize(const pool_t *p) { return BLOCK_SIZE(p->size); }

/* `_group_hit`: one group's hit in blocks, at most `limit` blocks. */
static uint32_t group_hit(const core_t *c, const source_t *s, const pool_t *p, const walk_path *w,
                          int klass, int64_t window, uint32_t limit) {
    if (limit > w->len)
        limit = w->len;
    if (klass == KIND_MAMBA) {
        for (uint32_t i = limit; i-- > 0;)
            if (held_at(c, s, p, w, i))
                return i + 1;
        return 0;
    }
    if (klass == KIND_WINDOW) {
        /* max(1, ceil((window - 1) / size)), for any int64 window from the wire: as
         * (window - 2) / size + 1 from 2 on (the plain sum overflowed near 2^63). */
        int64_t needed = window <= 1 ? 1 : (int64_t)(((uint64_t)window - 2) / psize(p) + 1);
        uint32_t run = 0;
        for (uint32_t i = limit; i-- > 0;) {
            if (held_at(c, s, p, w, i)) {
                if (++run >= needed)
                    return i + run;
            } else {
                run = 0;
            }
        }
        return run;
    }
    uint32_t d = leading(c, s, p, w);
    return d < limit ? d : limit;
}

static int tier_rank(uint8_t tier) { return tier; } /* the enum is in TIERS order */

static const group_spec *spec_of(const source_t *s, const pool_t *p) {
    static const group_spec none = {0, 0, 0};
    return !p->group_big && p->group >= 0 && p->group < MAX_GROUPS ? &s->groups[p->group]
                                                                    : &none;
}

/* `reuse.fine_grained`. */
int fine_grained(const core_t *c, const source_t *s) {
    uint32_t unit = s->unit;
    if (!unit)
        return 0;
    int mamba = 0;
    for (uint32_t i = 0; i < s->npools; i++) {
        const pool_t *p = &s->pools[i];
        if (p->tier != TIER_GPU || !psize(p))
            continue;
        const group_spec *g = spec_of(s, p);
        int klass = kind_class(c, g);
        if (klass == KIND_MAMBA && psize(p) > unit)
            mamba = 1;
        int fine_kind = g->present && g->kind &&
                        (blob_is(c, g->kind, "full_attention") ||
                         blob_is(c, g->kind, "mla_attention") || blob_is(c, g->kind, "mamba"));
        if (!fine_kind && klass != KIND_UNCACHED && psize(p) != unit)
            return 0;
    }
    return mamba;
}

/* `reuse._unit_hit`: one group's hit in tokens, at most `max_len`, on `align`; `h[f]`:
 * whether it holds the prompt's hash f (`count` of them, `unit` tokens apart), its blocks
 * `size` tokens (block j is hash (j + 1) * size / unit - 1). */
static uint64_t unit_hit(const uint8_t *h, uint32_t count, uint32_t size, int klass,
                         int64_t window, uint32_t unit, uint64_t max_len, uint64_t align) {
    uint64_t k = size / unit;
    int fine = align < size && size % align == 0;
    uint64_t blocks = max_len / size < count / k ? max_len / size : count / k;
    if (klass == KIND_MAMBA) {
        if (fine) {
            uint64_t lim = max_len / unit < count ? max_len / unit : count;
            for (uint64_t f = lim; f-- > 0;)
                if (h[f])
                    return (f + 1) * unit;
            return 0;
        }
        for (uint64_t i = blocks; i-- > 0;)
            if (h[(i + 1) * k - 1] && ((i + 1) * size) % align == 0)
                return (i + 1) * size;
        return 0;
    }
    if (klass == KIND_WINDOW) {
        int64_t needed = window <= 1 ? 1 : (int64_t)(((uint64_t)window - 2) / size + 1);
        uint64_t run = 0;
        for (uint64_t i = blocks; i-- > 0;) {
            if (h[(i + 1) * k - 1]) {
                if (run == 0 && ((i + 1) * size) % align)
                    continue;
                if ((int64_t)++run >= needed)
                    return (i + run) * size;
            } else {
                run = 0;
            }
        }
        while (run * size % align)
            run--;
        return run * size;
    }
    uint64_t whole = 0; /* full attention: leading whole blocks, then (fine) a partial entry */
    while (whole < blocks && h[(whole + 1) * k - 1])
        whole++;
    uint64_t hit = whole * size;
    if (fine) {
        uint64_t first = whole * k, top = first + k - 1;
        if (max_len / unit < top)
            top = max_len / unit;
        if (count < top)
            top = count;
        for (uint64_t f = top; f-- > first;)
            if (h[f])
                return (f + 1) * unit;
    }
    return hit - hit % align;
}

/* `FleetIndex._unit_reuse`: per GPU pool, which of the prompt's hashes it holds (a whole
 * block's path node in the tree it hangs in, or a partial node inside the next block),
 * then `reuse.unit_reuse`'s GPU hit (returned, in tokens) and by_group (into `out`). -1:
 * out of memory. */
static int64_t unit_gpu(const core_t *c, const source_t *s, const uint32_t *sizes,
                        const walk_path *walks, uint32_t nsizes, const fine_prompt *fp,
                        reuse_t *out) {
    uint32_t unit = s->unit, count = fp->nunits;
    uint8_t *held = calloc((size_t)s->npools * count + 1, 1);
    uint32_t *at = calloc((size_t)count + 1, sizeof(uint32_t));
    if (held == NULL || at == NULL) {
        free(held);
        free(at);
        return -1;
    }
    int klass[MAX_POOLS], cached[MAX_POOLS];
    for (uint32_t i = 0; i < s->npools; i++) {
        const pool_t *p = &s->pools[i];
        klass[i] = kind_class(c, spec_of(s, p));
        cached[i] = p->tier == TIER_GPU && psize(p) && klass[i] != KIND_UNCACHED;
        uint32_t tree = p->tree ? p->tree : p->size;
        if (p->tier != TIER_GPU || !p->size || tree % unit)
            continue;
        uint32_t root = NODE_NONE;
        const walk_path *w = NULL;
        for (uint32_t k = 0; k < nsizes; k++)
            if (sizes[k] == tree) {
                root = fp->roots[k];
                w = &walks[k];
            }
        uint32_t len = w ? w->len : 0, k = tree / unit;
        memset(at, 0, ((size_t)count + 1) * sizeof(uint32_t));
        for (uint32_t j = 0; j < len; j++)
            if ((uint64_t)(j + 1) * k - 1 < count)
                at[(j + 1) * k - 1] = w->path[j];
        for (uint32_t j = 0; root != NODE_NONE && j <= len; j++) {
            uint32_t node = j == 0 ? root : w->path[j - 1];
            for (uint32_t m = 1; m < k; m++) {
                uint64_t u = (uint64_t)j * k + m - 1; /* the unit ending at j*size + m*unit */
                if (u >= count)
                    break;
                node = child_get(c, node, fp->unit_keys[u] ^ PARTIAL_KEY);
                if (node == NODE_NONE)
                    break;
                at[u] = node;
            }
        }
        for (uint32_t f = 0; f < count; f++) {
            if (at[f] == NODE_NONE)
                continue;
            map_entry *e = map_find(&s->where, at[f], 0);
            held[(size_t)i * count + f] = e != NULL && ((e->value >> p->index) & 1);
        }
    }
    free(at);
    /* `fine_reuse`: full attention first, to a fixed point */
    uint32_t order[MAX_POOLS], n = 0, nprefix = 0;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < s->npools; i++)
            if (cached[i] && (klass[i] == KIND_PREFIX) == (pass == 0)) {
                order[n++] = i;
                nprefix += pass == 0;
            }
    uint64_t align = unit;
    if (!fine_grained(c, s)) { /* the scheduler block size: the LCM of the groups' sizes */
        align = 1;
        for (uint32_t i = 0; i < s->npools; i++) {
            uint64_t size = psize(&s->pools[i]);
            if (s->pools[i].tier != TIER_GPU || !size)
                continue;
            uint64_t a = align, b = size;
            while (b) {
                uint64_t t = a % b;
                a = b;
                b = t;
            }
            align = align / a * size;
        }
    }
    uint64_t length = n ? (uint64_t)count * unit : 0, hit = length; /* no cached group: 0 */
    uint64_t known[MAX_POOLS];
    uint8_t have[MAX_POOLS] = {0};
    int simple = n == 2 && nprefix >= 1;
    for (;;) {
        uint64_t curr = hit;
        for (uint32_t o = 0; o < n; o++) {
            uint32_t i = order[o];
            if (have[i]) {
                if (known[i] < curr)
                    curr = known[i];
                continue;
            }
            curr = unit_hit(held + (size_t)i * count, count, psize(&s->pools[i]), klass[i],
                            spec_of(s, &s->pools[i])->window, unit, curr, align);
            if (klass[i] == KIND_PREFIX) {
                known[i] = curr;
                have[i] = 1;
            }
        }
        if (curr >= hit)
            break;
        hit = curr;
        if (simple)
            break;
    }
    for (uint32_t i = 0; i < s->npools; i++) {
        if (!cached[i] || out->ngroups == MAX_POOLS)
            continue;
        out->groups_big[out->ngroups] = s->pools[i].group_big;
        out->groups[out->ngroups] = s->pools[i].group;
        out->group_blocks[out->ngroups++] = (uint32_t)(
            unit_hit(held + (size_t)i * count, count, psize(&s->pools[i]), klass[i],
                     spec_of(s, &s->pools[i])->window, unit, length, align) /
            unit);
    }
    free(held);
    return (int64_t)hit;
}

/* `engine_reuse`. `walks[i]` is the path of block size `sizes[i]`. */
int engine_reuse(const core_t *c, const source_t *s, const uint32_t *sizes,
                 const walk_path *walks, uint32_t nsizes, const fine_prompt *fine,
                 reuse_t *out) {
    memset(out, 0, sizeof *out);
    out->several = 1;
    /* A pool of a size this lookup walked no tree of holds none of the prompt: its group
     * limits the hit as one holding nothing does (not passed over: whether a tree of its
     * size exists depends on other publishers' blocks, and a shard's on its instances). */
    static const walk_path no_walk = {NULL, 0};
    const walk_path *wp[MAX_POOLS] = {0};
    int klass[MAX_POOLS];
    int64_t window[MAX_POOLS];
    int gpu[MAX_POOLS], cached[MAX_POOLS], lower[MAX_POOLS];
    for (uint32_t i = 0; i < s->npools; i++) {
        const pool_t *p = &s->pools[i];
        for (uint32_t k = 0; k < nsizes; k++)
            if (sizes[k] == p->size && p->size) /* tree sizes */
                wp[i] = &walks[k];
        if (wp[i] == NULL && p->size)
            wp[i] = &no_walk;
        const group_spec *g =
            !p->group_big && p->group >= 0 && p->group < MAX_GROUPS ? &s->groups[p->group] : NULL;
        group_spec none = {0, 0, 0};
        klass[i] = kind_class(c, g ? g : &none);
        window[i] = g ? g->window : 0;
        gpu[i] = wp[i] != NULL && p->tier == TIER_GPU;
        cached[i] = gpu[i] && klass[i] != KIND_UNCACHED;
        lower[i] = wp[i] != NULL && p->tier != TIER_GPU;
    }
    uint64_t gpu_tokens = 0;
    uint32_t size = 0;
    if (fine != NULL) {
        int64_t hit = unit_gpu(c, s, sizes, walks, nsizes, fine, out);
        if (hit < 0)
            return -1; /* out of memory: the caller fails the lookup */
        gpu_tokens = (uint64_t)hit;
        size = s->unit;
        goto lower_run;
    }
    /* `_hybrid_hit` */
    int any = 0, prefix = 0;
    uint64_t bound = 0;
    for (uint32_t i = 0; i < s->npools; i++)
        if (cached[i]) {
            any = 1;
            uint64_t full = (uint64_t)wp[i]->len * psize(&s->pools[i]);
            if (full > bound)
                bound = full;
        }
    if (any) {
        int others_distinct = 0;
        int64_t first_kind = -1, first_window = 0;
        uint32_t first_size = 0;
        for (uint32_t i = 0; i < s->npools; i++) {
            if (!cached[i])
                continue;
            if (klass[i] == KIND_PREFIX) {
                prefix++;
                uint64_t hit = (uint64_t)leading(c, s, &s->pools[i], wp[i]) * psize(&s->pools[i]);
                if (hit < bound)
                    bound = hit;
            } else {
                uint32_t kind = spec_of(s, &s->pools[i])->kind;
                if (first_kind < 0) {
                    first_kind = kind, first_window = window[i], first_size = psize(&s->pools[i]);
                    others_distinct = 1;
                } else if (kind != first_kind || window[i] != first_window ||
                           psize(&s->pools[i]) != first_size) {
                    others_distinct = 2;
                }
            }
        }
        int simple = prefix >= 1 && others_distinct <= 1;
        for (;;) {
            uint64_t hit = bound;
            for (uint32_t i = 0; i < s->npools; i++) {
                if (!cached[i] || klass[i] == KIND_PREFIX)
                    continue;
                uint32_t size = psize(&s->pools[i]);
                hit = (uint64_t)group_hit(c, s, &s->pools[i], wp[i], klass[i], window[i],
                                          (uint32_t)(hit / size)) *
                      size;
            }
            if (hit >= bound)
                break;
            bound = hit;
            if (simple)
                break;
        }
        gpu_tokens = bound;
    }
    /* by_group: each group's own hit */
    for (uint32_t i = 0; i < s->npools; i++) {
        if (!cached[i] || out->ngroups == MAX_POOLS)
            continue;
        out->groups_big[out->ngroups] = s->pools[i].group_big;
        out->groups[out->ngroups] = s->pools[i].group;
        out->group_blocks[out->ngroups++] =
            group_hit(c, s, &s->pools[i], wp[i], klass[i], window[i], UINT32_MAX);
    }
    /* `_row_size` */
    for (uint32_t i = 0; i < s->npools; i++)
        if (cached[i] && s->pools[i].group == 0 && !s->pools[i].group_big) {
            size = psize(&s->pools[i]);
            break;
        }
    if (!size)
        for (uint32_t i = 0; i < s->npools; i++)
            if (cached[i] && (!size || psize(&s->pools[i]) < size))
                size = psize(&s->pools[i]);
lower_run:;
    /* `_lower_run`: the fastest tier holding the next block serves it */
    uint64_t tier_tokens[TIER_COUNT] = {0};
    tier_tokens[TIER_GPU] = gpu_tokens;
    uint32_t order[MAX_POOLS], norder = 0;
    for (uint32_t i = 0; i < s->npools; i++)
        if (lower[i])
            order[norder++] = i;
    for (uint32_t a = 1; a < norder; a++) /* by (tier, -size): insertion sort, few pools */
        for (uint32_t b = a; b > 0; b--) {
            const pool_t *x = &s->pools[order[b - 1]], *y = &s->pools[order[b]];
            if (tier_rank(x->tier) < tier_rank(y->tier) ||
                (x->tier == y->tier && psize(x) >= psize(y)))
                break;
            uint32_t t = order[b];
            order[b] = order[b - 1];
            order[b - 1] = t;
        }
    uint64_t at = gpu_tokens;
    for (;;) {
        int served = 0;
        for (uint32_t k = 0; k < norder; k++) {
            const pool_t *p = &s->pools[order[k]];
            if (at % psize(p) == 0 && held_at(c, s, p, wp[order[k]], (uint32_t)(at / psize(p)))) {
                tier_tokens[p->tier] += psize(p);
                at += psize(p);
                served = 1;
                break;
            }
        }
        if (!served)
            break;
    }
    if (!size)
        for (uint32_t k = 0; k < norder; k++)
            if (!size || psize(&s->pools[order[k]]) < size)
                size = psize(&s->pools[order[k]]);
    if (!size) {
        out->ngroups = 0;
        return 0;
    }
    uint64_t total = 0;
    for (int t = 0; t < TIER_COUNT; t++) {
        total += tier_tokens[t];
        out->by_tier[t] = (uint32_t)(tier_tokens[t] / size);
    }
    out->blocks = (uint32_t)(total / size);
    out->size = size;
    return 0;
}


uint32_t find_str(const core_t *c, const uint8_t *p, uint32_t len) {
    return intern_find(&c->strings, p, len);
}

uint32_t find_name(const core_t *c, const uint8_t *p, uint32_t len) {
    return intern_find(&c->names, p, len);
}

uint32_t find_bytes(const core_t *c, const uint8_t *p, uint32_t len) {
    return intern_find(&c->bytes, p, len);
}

const uint64_t *set_words_of(const core_t *c, uint32_t holders) {
    return set_words(c, holders);
}

uint32_t root_find(const core_t *c, uint32_t lora, uint32_t salt, uint32_t size) {
    map_entry *e = map_find(&c->ns_by_key, ((uint64_t)lora << 32) | salt, size);
    return e ? c->ns[e->value].root : NODE_NONE;
}

/* -- lookups ------------------------------------------------------------------------- */

/* One prompt's keys in one block size: a digest per whole block (fewer if a token can't
 * be keyed: past 64 bits). `small` holds the tokens as uint32 when every one fits (every
 * real vocabulary): the blocks are digested in place. Otherwise `tokens` (int64) is used,
 * and a block with a token past 32 bits is keyed as b"\\x00" + int64s, as fleet.py's
 * block_keys does. */
uint32_t prompt_keys(const core_t *c, const uint32_t *small, const int64_t *tokens,
                     uint32_t ntokens, uint32_t size, uint64_t *keys) {
    uint32_t blocks = size ? ntokens / size : 0;
    if (small != NULL) {
        for (uint32_t i = 0; i < blocks; i++)
            keys[i] = key_digest(c, (const uint8_t *)(small + (size_t)i * size), (size_t)size * 4);
        return blocks;
    }
    uint8_t stack[4 * 256], *buf = stack;
    size_t need = (size_t)size * 8 + 1;
    if (need > sizeof stack) {
        buf = malloc(need);
        if (buf == NULL)
            return 0;
    }
    uint32_t done = 0;
    for (; done < blocks; done++) {
        const int64_t *t = tokens + (size_t)done * size;
        int fits = 1;
        for (uint32_t k = 0; k < size; k++)
            if (t[k] < 0 || t[k] > 0xFFFFFFFFLL) {
                fits = 0;
                break;
            }
        size_t len;
        if (fits) {
            for (uint32_t k = 0; k < size; k++) {
                uint32_t v = (uint32_t)t[k];
                memcpy(buf + 4 * k, &v, 4); /* native order: x86 and arm64 are little-endian */
            }
            len = (size_t)size * 4;
        } else {
            buf[0] = 0;
            memcpy(buf + 1, t, (size_t)size * 8);
            len = (size_t)size * 8 + 1;
        }
        keys[done] = key_digest(c, buf, len);
    }
    if (buf != stack)
        free(buf);
    return done;
}

/* A prompt's keys in a bigram tree of `size`-pair pages (keys.py's prompt_keys): the
 * units (t[i], t[i+1]) flattened, then keyed as blocks of 2 * size token ids. Returns 0
 * (no keys) when out of memory; a lookup then matches nothing there. */
uint32_t prompt_bigram_keys(const core_t *c, const uint32_t *small, const int64_t *tokens,
                            uint32_t ntokens, uint32_t size, uint64_t *keys) {
    if (ntokens < 2 || size == 0)
        return 0;
    size_t n = (size_t)ntokens - 1, width = small ? 4 : 8;
    void *flat = malloc(2 * n * width);
    if (flat == NULL)
        return 0;
    for (size_t i = 0; i < n; i++) {
        if (small) {
            ((uint32_t *)flat)[2 * i] = small[i];
            ((uint32_t *)flat)[2 * i + 1] = small[i + 1];
        } else {
            ((int64_t *)flat)[2 * i] = tokens[i];
            ((int64_t *)flat)[2 * i + 1] = tokens[i + 1];
        }
    }
    uint32_t nkeys = prompt_keys(c, small ? flat : NULL, small ? NULL : flat, (uint32_t)(2 * n),
                                 2 * size, keys);
    free(flat);
    return nkeys;
}

/* `_walk`: per publisher bit, how many of these blocks it holds in a row from the root
 * (`depth`, left untouched for publishers matching nothing); `path` gets the nodes while a
 * publisher with several pools is on it. `alive` is scratch of c->set_words words. */
static uint32_t walk_any(const core_t *c, uint32_t root, const uint64_t *keys,
                         const uint32_t *given, uint32_t nkeys, uint32_t *depth,
                         uint32_t *path, uint64_t *alive, const uint64_t *several);

uint32_t walk(const core_t *c, uint32_t root, const uint64_t *keys, uint32_t nkeys,
              uint32_t *depth, uint32_t *path, uint64_t *alive, const uint64_t *several) {
    return walk_any(c, root, keys, NULL, nkeys, depth, path, alive, several);
}

/* `walk` along nodes already found (a lookup by local hashes: local_path's). */
uint32_t walk_nodes(const core_t *c, const uint32_t *nodes, uint32_t n, uint32_t *depth,
                    uint32_t *path, uint64_t *alive, const uint64_t *several) {
    return walk_any(c, NODE_NONE, NULL, nodes, n, depth, path, alive, several);
}

static uint32_t walk_any(const core_t *c, uint32_t root, const uint64_t *keys,
                         const uint32_t *given, uint32_t nkeys, uint32_t *depth,
                         uint32_t *path, uint64_t *alive, const uint64_t *several) {
    uint32_t words = c->set_words;
    for (uint32_t w = 0; w < words; w++)
        alive[w] = 0;
    for (uint32_t b = 0; b < c->max_bit; b++)
        if (c->sources[b] != NULL)
            alive[b / 64] |= 1ULL << (b % 64);
    uint32_t node = root, d = 0, npath = 0;
    int any_alive = 1, follow = 0;
    for (uint32_t w = 0; path != NULL && w < words; w++)
        follow |= (alive[w] & several[w]) != 0;
    /* Every node's prefix digest is known from the keys alone (prefix_of): the table
     * slots of the blocks ahead are prefetched, so a long prompt's lookups overlap their
     * memory latency instead of paying it one after another. */
    enum { AHEAD = 12 };
    uint64_t prefix[AHEAD];
    uint64_t next = given ? 0 : node_key(&c->nodes[root]);
    uint32_t ahead = given ? 0 : nkeys < AHEAD ? nkeys : AHEAD;
    if (c->children.slots == NULL)
        return 0;
    for (uint32_t i = 0; i < ahead; i++) {
        next = prefix_of(next, keys[i]);
        prefix[i] = next;
        __builtin_prefetch(&c->children.slots[pmap_slot_of(&c->children, next, 0)]);
    }
    for (; d < nkeys; d++) {
        uint32_t child;
        if (given) {
            child = given[d];
        } else {
            if (c->nodes[node].nchild == 0)
                break;
            uint64_t here = prefix[d % AHEAD];
            if (d + AHEAD < nkeys) {
                next = prefix_of(next, keys[d + AHEAD]);
                prefix[d % AHEAD] = next;
                __builtin_prefetch(&c->children.slots[pmap_slot_of(&c->children, next, 0)]);
            }
            pmap_entry *e = child_entry(c, node, here);
            if (e == NULL)
                break;
            child = pmap_value(e);
        }
        if (any_alive) {
            uint32_t h = c->nodes[child].holders;
            /* alive &= holders; publishers dropping out past depth 0 get depth d */
            any_alive = 0;
            for (uint32_t w = 0; w < words; w++) {
                uint64_t mask;
                if (h & HOLD_SET)
                    mask = c->sets[(size_t)(h & ~HOLD_SET) * words + w];
                else
                    mask = (h && (h - 1) / 64 == w) ? 1ULL << ((h - 1) % 64) : 0;
                uint64_t dropped = alive[w] & ~mask;
                if (dropped && d) {
                    while (dropped) {
                        depth[w * 64 + (uint32_t)__builtin_ctzll(dropped)] = d;
                        dropped &= dropped - 1;
                    }
                }
                alive[w] &= mask;
                any_alive |= alive[w] != 0;
            }
        }
        /* With a publisher of several pools (`follow`), the whole path is walked: one of
         * its groups may hold blocks past one nobody holds (a window's, near its end). */
        if (!any_alive && !follow)
            break;
        if (follow)
            path[npath++] = child;
        node = child;
    }
    if (any_alive && d)
        for (uint32_t w = 0; w < words; w++) {
            uint64_t left = alive[w];
            while (left) {
                depth[w * 64 + (uint32_t)__builtin_ctzll(left)] = d;
                left &= left - 1;
            }
        }
    return npath;
}
