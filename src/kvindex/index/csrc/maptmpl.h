/* The open-addressing table of map.h, written once for both entry layouts (a template:
 * included with MT_ defined, see map.h and pmap.h). */

#define MT_CAT2(a, b) a##_##b
#define MT_CAT(a, b) MT_CAT2(a, b)
#define MT_FN(name) MT_CAT(MT_NAME, name)
#define MT_T MT_CAT(MT_NAME, t)

typedef struct {
    MT_ENTRY *slots;
    uint32_t mask; /* capacity - 1 (any capacity: see slot_of), or 0 before the first put */
    uint32_t count;
} MT_T;

/* The home slot: the hash scaled to the capacity (multiply-high, not a mask), so a table
 * can grow by half rather than double: the millions of entries of a big fleet's pools and
 * tree sit at 53-80 % load, not 37-75 %. */
static inline uint32_t MT_FN(slot_of)(const MT_T *m, uint64_t a, uint32_t b) {
    uint64_t h = mix64(a ^ ((uint64_t)b * 0x9E3779B97F4A7C15ULL));
    return (uint32_t)(((__uint128_t)h * ((uint64_t)m->mask + 1)) >> 64);
}

static inline uint32_t MT_FN(next)(const MT_T *m, uint32_t i) { return i == m->mask ? 0 : i + 1; }

static inline void MT_FN(init)(MT_T *m) {
    m->slots = NULL;
    m->mask = 0;
    m->count = 0;
}

static inline void MT_FN(free)(MT_T *m) {
    free(m->slots);
    MT_FN(init)(m);
}

/* The entry of (a, b), or NULL. */
static inline MT_ENTRY *MT_FN(find)(const MT_T *m, uint64_t a, uint32_t b) {
    if (m->slots == NULL)
        return NULL;
    uint32_t i = MT_FN(slot_of)(m, a, b);
    for (;;) {
        MT_ENTRY *e = &m->slots[i];
        if (MT_IS_EMPTY(e))
            return NULL;
        if (e->a == a && MT_GET_B(e) == b)
            return e;
        i = MT_FN(next)(m, i);
    }
}

static int MT_FN(grow)(MT_T *m, uint32_t capacity) {
    MT_ENTRY *old = m->slots;
    uint32_t old_capacity = old ? m->mask + 1 : 0;
    MT_ENTRY *slots = malloc((size_t)capacity * sizeof(MT_ENTRY));
    if (slots == NULL)
        return -1;
    for (uint32_t i = 0; i < capacity; i++)
        MT_SET_EMPTY(&slots[i]);
    m->slots = slots;
    m->mask = capacity - 1;
    for (uint32_t i = 0; i < old_capacity; i++) {
        if (MT_IS_EMPTY(&old[i]))
            continue;
        uint32_t j = MT_FN(slot_of)(m, old[i].a, MT_GET_B(&old[i]));
        while (!MT_IS_EMPTY(&slots[j]))
            j = MT_FN(next)(m, j);
        slots[j] = old[i];
    }
    free(old);
    return 0;
}

/* The entry of (a, b), made (value 0) if absent; `*made` says which. NULL: out of
 * memory. Pointers into the table are valid until the next put or delete. */
static inline MT_ENTRY *MT_FN(put)(MT_T *m, uint64_t a, uint32_t b, int *made) {
    /* Kept at most 4/5 full (a miss then probes about 13 slots at worst, 3 at the 53 %
     * a table grows to), growing by half. */
    uint64_t capacity = (uint64_t)m->mask + 1;
    if (m->slots == NULL || ((uint64_t)m->count + 1) * 5 > capacity * 4) {
        uint64_t grown = m->slots == NULL ? 8 : capacity + capacity / 2;
        if (grown > 0xFFFFFFFFULL || MT_FN(grow)(m, (uint32_t)grown) < 0)
            return NULL;
    }
    uint32_t i = MT_FN(slot_of)(m, a, b);
    for (;;) {
        MT_ENTRY *e = &m->slots[i];
        if (MT_IS_EMPTY(e)) {
            MT_SET_KEY(e, a, b);
            m->count++;
            *made = 1;
            return e;
        }
        if (e->a == a && MT_GET_B(e) == b) {
            *made = 0;
            return e;
        }
        i = MT_FN(next)(m, i);
    }
}

/* Remove the entry at `e` (from find): the entries after it that probed past its slot
 * move back, so every remaining key is still found by linear probing. */
static inline void MT_FN(delete)(MT_T *m, MT_ENTRY *e) {
    uint32_t hole = (uint32_t)(e - m->slots);
    uint32_t i = hole;
    for (;;) {
        i = MT_FN(next)(m, i);
        MT_ENTRY *next = &m->slots[i];
        if (MT_IS_EMPTY(next))
            break;
        uint32_t home = MT_FN(slot_of)(m, next->a, MT_GET_B(next));
        /* `next` may fill the hole if its home is not in (hole, i] (cyclically). */
        int stays = hole <= i ? (hole < home && home <= i) : (hole < home || home <= i);
        if (!stays) {
            m->slots[hole] = *next;
            hole = i;
        }
    }
    MT_SET_EMPTY(&m->slots[hole]);
    m->count--;
    /* Shrink a table that emptied out (a pool after a clear of most of it). */
    if (m->mask >= 64 && (uint64_t)m->count * 8 < (uint64_t)m->mask + 1)
        MT_FN(grow)(m, (m->mask + 1) / 2); /* on failure the table just stays large */
}

static inline int MT_FN(remove)(MT_T *m, uint64_t a, uint32_t b, uint32_t *value) {
    MT_ENTRY *e = MT_FN(find)(m, a, b);
    if (e == NULL)
        return 0;
    if (value)
        *value = MT_GET_V(e);
    MT_FN(delete)(m, e);
    return 1;
}

/* Bytes a table holds (for the memory figures). */
static inline size_t MT_FN(bytes)(const MT_T *m) {
    return m->slots ? ((size_t)m->mask + 1) * sizeof(MT_ENTRY) : 0;
}

#undef MT_T
#undef MT_FN
#undef MT_CAT
#undef MT_CAT2
