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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern size_t kv_alloc_bytes, kv_alloc_blocks; /* core.c */

/* Fault injection (tests only: _core.fail_allocs(n)): the n-th allocation from now fails,
 * once. 0: none. One relaxed load per allocation otherwise. */
extern long kv_fail_countdown; /* core.c */

static inline int kv_fail_now(void) {
    long n = __atomic_load_n(&kv_fail_countdown, __ATOMIC_RELAXED);
    return n > 0 && __atomic_sub_fetch(&kv_fail_countdown, 1, __ATOMIC_RELAXED) == 0;
}

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
    if (kv_fail_now())
        return NULL;
    void *p = (malloc)(n);
    if (p != NULL)
        kv_count(p, 1);
    return p;
}

static inline void *kv_calloc(size_t count, size_t n) {
    if (kv_fail_now())
        return NULL;
    void *p = (calloc)(count, n);
    if (p != NULL)
        kv_count(p, 1);
    return p;
}

static inline void *kv_realloc(void *old, size_t n) {
    if (kv_fail_now())
        return NULL;
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

/* Room for `need` items of `item` bytes in `*(T **)arrp`, whose capacity is `*cap`: the one
 * growth helper for scratch arrays. Doubles from 64; counted in 64 bits, so a count near
 * 2^32 can neither wrap the sum (no room made, then writes past the end) nor double the
 * capacity to 0 forever. 0: room made (or there was); -1: out of memory (the array stays
 * as it was); -2: more than 2^32-1 items (too big to be a batch). */
static inline int kv_grow(void *arrp, uint32_t *cap, uint64_t need, size_t item) {
    if (need <= *cap)
        return 0;
    if (need > UINT32_MAX)
        return -2;
    uint64_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    if (c > UINT32_MAX)
        c = UINT32_MAX;
    if (c > SIZE_MAX / item)
        return -2;
    void *arr;
    memcpy(&arr, arrp, sizeof arr);
    void *p = kv_realloc(arr, (size_t)c * item);
    if (p == NULL)
        return -1;
    memcpy(arrp, &p, sizeof p);
    *cap = (uint32_t)c;
    return 0;
}

/* kv_grow for an array `arr` (any T *) of capacity `cap` (a uint32_t lvalue). */
#define KV_GROW(arr, cap, need) kv_grow(&(arr), &(cap), (uint64_t)(need), sizeof(*(arr)))

#define malloc(n) kv_malloc(n)
#define calloc(count, n) kv_calloc(count, n)
#define realloc(p, n) kv_realloc(p, n)
#define free(p) kv_free(p)

#endif
