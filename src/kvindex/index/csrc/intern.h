/* Interned byte strings: an id per distinct content (0 is "none").
 *
 * Used for medium names, LoRA names, salts and spec kinds (a handful, kept for the life of
 * the index) and for bytes block hashes (32-byte digests: freed when no pool holds them,
 * counted in `refs`). Equal contents always get the same id, so an hkey of kind HK_BYTES
 * compares by id.
 */
#ifndef KVCORE_INTERN_H
#define KVCORE_INTERN_H

#include "core.h"

static inline uint64_t bytes_fingerprint(uint64_t seed, const uint8_t *data, size_t len) {
    /* FNV-1a from a per-index random seed, then mixed: only to find candidates (contents
     * are always compared); the seed keeps anyone from making many collide on purpose. */
    uint64_t h = 0xcbf29ce484222325ULL ^ seed;
    for (size_t i = 0; i < len; i++)
        h = (h ^ data[i]) * 0x100000001b3ULL;
    return mix64(h ^ len);
}

static inline void interner_init(interner *t, uint64_t seed) {
    map_init(&t->by_fp);
    t->seed = seed;
    t->items = NULL;
    t->count = 1; /* id 0: none */
    t->capacity = 0;
    t->free_head = 0;
}

static inline void interner_free(interner *t) {
    for (uint32_t i = 1; i < t->count; i++)
        if (t->items[i].data != NULL)
            free((void *)t->items[i].data);
    free(t->items);
    map_free(&t->by_fp);
}

/* The id of these bytes, or 0 if they were never interned. Probes b = len, len + 2^24,
 * ... past fingerprint collisions (different contents with the same fingerprint). */
static inline uint32_t intern_find(const interner *t, const uint8_t *data, uint32_t len) {
    uint64_t fp = bytes_fingerprint(t->seed, data, len);
    for (uint32_t probe = 0;; probe++) {
        map_entry *e = map_find(&t->by_fp, fp, (len & 0xffffff) | (probe << 24));
        if (e == NULL)
            return 0;
        const blob_t *b = &t->items[e->value];
        if (b->len == len && memcmp(b->data, data, len) == 0)
            return e->value;
        if (probe == 254)
            return 0;
    }
}

/* The id of these bytes, interned now if new. 0: out of memory. Any length: the table's
 * key holds the low 24 bits of it, contents are always compared (a medium of 16 MiB or
 * more was refused, and its batch raised MemoryError). */
static inline uint32_t intern(interner *t, const uint8_t *data, uint32_t len) {
    uint64_t fp = bytes_fingerprint(t->seed, data, len);
    for (uint32_t probe = 0; probe < 255; probe++) {
        int made;
        map_entry *e = map_put(&t->by_fp, fp, (len & 0xffffff) | (probe << 24), &made);
        if (e == NULL)
            return 0;
        if (!made) {
            const blob_t *b = &t->items[e->value];
            if (b->len == len && memcmp(b->data, data, len) == 0)
                return e->value;
            continue;
        }
        uint32_t id;
        if (t->free_head) {
            id = t->free_head;
            t->free_head = t->items[id].len;
        } else {
            if (t->count >= t->capacity) {
                uint32_t cap = t->capacity ? t->capacity * 2 : 16;
                blob_t *items = realloc(t->items, cap * sizeof(blob_t));
                if (items == NULL) {
                    map_delete(&t->by_fp, e);
                    return 0;
                }
                t->items = items;
                t->capacity = cap;
            }
            id = t->count++;
        }
        uint8_t *copy = malloc(len ? len : 1);
        if (copy == NULL) {
            map_delete(&t->by_fp, map_find(&t->by_fp, fp, (len & 0xffffff) | (probe << 24)));
            t->items[id].data = NULL;
            t->items[id].len = t->free_head;
            t->free_head = id;
            return 0;
        }
        memcpy(copy, data, len);
        /* `e` may have moved if the items realloc... it is in by_fp, which did not change */
        e = map_find(&t->by_fp, fp, (len & 0xffffff) | (probe << 24));
        e->value = id;
        t->items[id] = (blob_t){copy, len, 0, fp};
        return id;
    }
    return 0;
}

/* Drop an interned id that nothing refers to any more (bytes hashes). The entries that
 * probed past its slot move down one probe, so no search stops at a hole. */
static inline void intern_drop(interner *t, uint32_t id) {
    blob_t *b = &t->items[id];
    uint32_t group = b->len & 0xffffff;
    uint32_t probe = 0;
    for (; probe < 255; probe++) {
        map_entry *e = map_find(&t->by_fp, b->fp, group | (probe << 24));
        if (e == NULL)
            break;
        if (e->value == id) {
            map_delete(&t->by_fp, e);
            break;
        }
    }
    for (uint32_t next = probe + 1; next < 255; next++) {
        uint32_t moved;
        if (!map_remove(&t->by_fp, b->fp, group | (next << 24), &moved))
            break;
        int made;
        map_entry *e = map_put(&t->by_fp, b->fp, group | ((next - 1) << 24), &made);
        if (e != NULL) /* a put into a slot just freed can't need memory: the table shrank */
            e->value = moved;
    }
    free((void *)b->data);
    b->data = NULL;
    b->len = t->free_head;
    t->free_head = id;
}

#endif
