/* Open-addressing hash maps: key (a: u64, b: u32) -> value u32, linear probing.
 *
 * Every table of the core is one of two instances of one template (maptmpl.h), so the
 * probing, growing and deletion are written once:
 * - `map`: 16-byte entries, any b and value (copies, counts, pool sets per node, ...);
 * - `pmap` (pmap.h): 12-byte entries with b in 4 bits and the value in 28, for the two
 *   tables that hold an entry per block (the pools, and the tree's children).
 * Deletion shifts the following entries back (no tombstones), so a table's cost follows
 * what it holds.
 */
#ifndef KVCORE_MAP_H
#define KVCORE_MAP_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h" /* every allocation of the core is counted */

#define MAP_EMPTY 0xFFFFFFFFu /* a free slot's b: no key may use it */

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

typedef struct {
    uint64_t a;
    uint32_t b;
    uint32_t value;
} map_entry;

#define MT_NAME map
#define MT_ENTRY map_entry
#define MT_GET_B(e) ((e)->b)
#define MT_GET_V(e) ((e)->value)
#define MT_SET_KEY(e, ka, kb) ((e)->a = (ka), (e)->b = (kb), (e)->value = 0)
#define MT_IS_EMPTY(e) ((e)->b == MAP_EMPTY)
#define MT_SET_EMPTY(e) ((e)->b = MAP_EMPTY)
#include "maptmpl.h"
#undef MT_NAME
#undef MT_ENTRY
#undef MT_GET_B
#undef MT_GET_V
#undef MT_SET_KEY
#undef MT_IS_EMPTY
#undef MT_SET_EMPTY

#define MAP_FOREACH(m, e)                                                                  \
    for (map_entry *e = (m)->slots,                                                        \
                   *e##_end = (m)->slots ? (m)->slots + (size_t)(m)->mask + 1 : NULL;      \
         e != e##_end; e++)                                                                \
        if (e->b != MAP_EMPTY)

/* -- pmap: 12 bytes an entry -------------------------------------------------------- */

#define PMAP_VALUE_BITS 28
#define PMAP_MAX_VALUE ((1u << PMAP_VALUE_BITS) - 2) /* values 0 .. PMAP_MAX_VALUE */
#define PMAP_MAX_B 14                                  /* b 0 .. 14; 15 marks a free slot */

typedef struct __attribute__((packed)) {
    uint64_t a;
    uint32_t bv; /* b << 28 | value */
} pmap_entry;

static inline uint32_t pmap_b(const pmap_entry *e) { return e->bv >> PMAP_VALUE_BITS; }
static inline uint32_t pmap_value(const pmap_entry *e) {
    return e->bv & ((1u << PMAP_VALUE_BITS) - 1);
}
static inline void pmap_set(pmap_entry *e, uint32_t value) {
    e->bv = (e->bv & ~((1u << PMAP_VALUE_BITS) - 1)) | value;
}

#define MT_NAME pmap
#define MT_ENTRY pmap_entry
#define MT_GET_B(e) pmap_b(e)
#define MT_GET_V(e) pmap_value(e)
#define MT_SET_KEY(e, ka, kb) ((e)->a = (ka), (e)->bv = (uint32_t)(kb) << PMAP_VALUE_BITS)
#define MT_IS_EMPTY(e) ((e)->bv == MAP_EMPTY)
#define MT_SET_EMPTY(e) ((e)->bv = MAP_EMPTY)
#include "maptmpl.h"
#undef MT_NAME
#undef MT_ENTRY
#undef MT_GET_B
#undef MT_GET_V
#undef MT_SET_KEY
#undef MT_IS_EMPTY
#undef MT_SET_EMPTY

#define PMAP_FOREACH(m, e)                                                                 \
    for (pmap_entry *e = (m)->slots,                                                       \
                    *e##_end = (m)->slots ? (m)->slots + (size_t)(m)->mask + 1 : NULL;     \
         e != e##_end; e++)                                                                \
        if (e->bv != MAP_EMPTY)

#endif
