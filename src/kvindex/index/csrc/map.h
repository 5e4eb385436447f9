/* An open-addressing hash map with 16-byte entries: key (a: u64, b: u32) -> value u32.
 *
 * Every table of the core is one of these (a pool: hash -> node; the children of all
 * nodes: (digest, parent) -> child; copies, counts and pool sets per node), so the probing,
 * growing and deletion are written once. Linear probing; deletion shifts the following
 * entries back (no tombstones), so a table's cost follows what it holds. A slot whose `b`
 * is MAP_EMPTY is free: no key may use that value of `b`.
 */
#ifndef KVCORE_MAP_H
#define KVCORE_MAP_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAP_EMPTY 0xFFFFFFFFu

typedef struct {
    uint64_t a;
    uint32_t b;
    uint32_t value;
} map_entry;

typedef struct {
    map_entry *slots;
    uint32_t mask; /* capacity - 1 (any capacity: see map_slot_of), or 0 before the first put */
    uint32_t count;
} map_t;

/* A 64-bit mixer (the finaliser of MurmurHash3 / splitmix64): every input bit reaches
 * every output bit, so linear probing sees no clusters from regular keys. */
static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

/* The home slot: the hash scaled to the capacity (multiply-high, not a mask), so a table
 * can grow by half rather than double: the millions of entries of a big fleet's pools and
 * tree sit at 53-80 % load, not 37-75 %. */
static inline uint32_t map_slot_of(const map_t *m, uint64_t a, uint32_t b) {
    uint64_t h = mix64(a ^ ((uint64_t)b * 0x9E3779B97F4A7C15ULL));
    return (uint32_t)(((__uint128_t)h * ((uint64_t)m->mask + 1)) >> 64);
}

static inline uint32_t map_next(const map_t *m, uint32_t i) { return i == m->mask ? 0 : i + 1; }

static inline void map_init(map_t *m) {
    m->slots = NULL;
    m->mask = 0;
    m->count = 0;
}

static inline void map_free(map_t *m) {
    free(m->slots);
    map_init(m);
}

/* The entry of (a, b), or NULL. */
static inline map_entry *map_find(const map_t *m, uint64_t a, uint32_t b) {
    if (m->slots == NULL)
        return NULL;
    uint32_t i = map_slot_of(m, a, b);
    for (;;) {
        map_entry *e = &m->slots[i];
        if (e->b == MAP_EMPTY)
            return NULL;
        if (e->a == a && e->b == b)
            return e;
        i = map_next(m, i);
    }
}

static int map_grow(map_t *m, uint32_t capacity) {
    map_entry *old = m->slots;
    uint32_t old_capacity = old ? m->mask + 1 : 0;
    map_entry *slots = malloc((size_t)capacity * sizeof(map_entry));
    if (slots == NULL)
        return -1;
    for (uint32_t i = 0; i < capacity; i++)
        slots[i].b = MAP_EMPTY;
    m->slots = slots;
    m->mask = capacity - 1;
    for (uint32_t i = 0; i < old_capacity; i++) {
        if (old[i].b == MAP_EMPTY)
            continue;
        uint32_t j = map_slot_of(m, old[i].a, old[i].b);
        while (slots[j].b != MAP_EMPTY)
            j = map_next(m, j);
        slots[j] = old[i];
    }
    free(old);
    return 0;
}

/* The entry of (a, b), made (value 0) if absent; `*made` says which. NULL: out of
 * memory. Pointers into the table are valid until the next put or delete. */
static inline map_entry *map_put(map_t *m, uint64_t a, uint32_t b, int *made) {
    /* Kept at most 4/5 full (a miss then probes about 13 slots at worst, 3 at the 53 %
     * a table grows to), growing by half. */
    uint64_t capacity = (uint64_t)m->mask + 1;
    if (m->slots == NULL || ((uint64_t)m->count + 1) * 5 > capacity * 4) {
        uint64_t grown = m->slots == NULL ? 8 : capacity + capacity / 2;
        if (grown > 0xFFFFFFFFULL || map_grow(m, (uint32_t)grown) < 0)
            return NULL;
    }
    uint32_t i = map_slot_of(m, a, b);
    for (;;) {
        map_entry *e = &m->slots[i];
        if (e->b == MAP_EMPTY) {
            e->a = a;
            e->b = b;
            e->value = 0;
            m->count++;
            *made = 1;
            return e;
        }
        if (e->a == a && e->b == b) {
            *made = 0;
            return e;
        }
        i = map_next(m, i);
    }
}

/* Remove the entry at `e` (from map_find): the entries after it that probed past its slot
 * move back, so every remaining key is still found by linear probing. */
static inline void map_delete(map_t *m, map_entry *e) {
    uint32_t hole = (uint32_t)(e - m->slots);
    uint32_t i = hole;
    for (;;) {
        i = map_next(m, i);
        map_entry *next = &m->slots[i];
        if (next->b == MAP_EMPTY)
            break;
        uint32_t home = map_slot_of(m, next->a, next->b);
        /* `next` may fill the hole if its home is not in (hole, i] (cyclically). */
        int stays = hole <= i ? (hole < home && home <= i) : (hole < home || home <= i);
        if (!stays) {
            m->slots[hole] = *next;
            hole = i;
        }
    }
    m->slots[hole].b = MAP_EMPTY;
    m->count--;
    /* Shrink a table that emptied out (a pool after a clear of most of it). */
    if (m->mask >= 64 && (uint64_t)m->count * 8 < (uint64_t)m->mask + 1)
        map_grow(m, (m->mask + 1) / 2); /* on failure the table just stays large */
}

static inline int map_remove(map_t *m, uint64_t a, uint32_t b, uint32_t *value) {
    map_entry *e = map_find(m, a, b);
    if (e == NULL)
        return 0;
    if (value)
        *value = e->value;
    map_delete(m, e);
    return 1;
}

/* Bytes a table holds (for the memory figures). */
static inline size_t map_bytes(const map_t *m) {
    return m->slots ? ((size_t)m->mask + 1) * sizeof(map_entry) : 0;
}

#define MAP_FOREACH(m, e)                                                                  \
    for (map_entry *e = (m)->slots,                                                        \
                   *e##_end = (m)->slots ? (m)->slots + (size_t)(m)->mask + 1 : NULL;      \
         e != e##_end; e++)                                                                \
        if (e->b != MAP_EMPTY)

#endif
