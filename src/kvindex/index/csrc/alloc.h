/* Allocation accounting: every malloc, calloc, realloc and free of the core's C goes
 * through the counting wrappers below, so the bytes and blocks it holds are known at any
 * time (kvindex.index._core.allocated(); tests/test_core_leaks.py checks that churn
 * returns them to a constant and a deleted Core to zero).
 *
 * The wrappers are function-like macros over the libc names, defined after <stdlib.h>
 * and <malloc.h> are in (their declarations stay as they are): the core's code keeps
 * calling malloc/free, and nothing new can escape the count. The counts are the blocks'
 * usable sizes (malloc_usable_size: no header added, so the memory figures stay the
 * same), updated atomically: parsing allocates its scratch outside the index's lock, on
 * several ingest threads at once.
 */
#ifndef KVCORE_ALLOC_H
#define KVCORE_ALLOC_H

#include <malloc.h>
#include <stddef.h>
#include <stdlib.h>

extern size_t kv_alloc_bytes, kv_alloc_blocks; /* core.c */

static inline void kv_count(void *p, int sign) {
    size_t n = malloc_usable_size(p);
    if (sign > 0) {
        __atomic_add_fetch(&kv_alloc_bytes, n, __ATOMIC_RELAXED);
        __atomic_add_fetch(&kv_alloc_blocks, 1, __ATOMIC_RELAXED);
    } else {
        __atomic_sub_fetch(&kv_alloc_bytes, n, __ATOMIC_RELAXED);
        __atomic_sub_fetch(&kv_alloc_blocks, 1, __ATOMIC_RELAXED);
    }
}

static inline void *kv_malloc(size_t n) {
    void *p = (malloc)(n);
    if (p != NULL)
        kv_count(p, 1);
    return p;
}

static inline void *kv_calloc(size_t count, size_t n) {
    void *p = (calloc)(count, n);
    if (p != NULL)
        kv_count(p, 1);
    return p;
}

static inline void *kv_realloc(void *old, size_t n) {
    size_t before = old != NULL ? malloc_usable_size(old) : 0;
    void *p = (realloc)(old, n);
    if (p == NULL)
        return NULL; /* the old block stays, and stays counted (n == 0 aside: never asked) */
    size_t after = malloc_usable_size(p);
    __atomic_add_fetch(&kv_alloc_bytes, after - before, __ATOMIC_RELAXED); /* wraps right */
    if (old == NULL)
        __atomic_add_fetch(&kv_alloc_blocks, 1, __ATOMIC_RELAXED);
    return p;
}

static inline void kv_free(void *p) {
    if (p != NULL) {
        kv_count(p, -1);
        (free)(p);
    }
}

#define malloc(n) kv_malloc(n)
#define calloc(count, n) kv_calloc(count, n)
#define realloc(p, n) kv_realloc(p, n)
#define free(p) kv_free(p)

#endif
