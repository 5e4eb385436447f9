/* The compiled core's entry for a C ingest loop (kvindex.subscriber._recv's ingest_live):
 * parse and apply one batch as the publisher sent it, called WITHOUT the GIL, from the one
 * thread that owns the publisher's socket. The core hands it out as a capsule
 * (Core.ingest_api()); the loop never links against the core, nor the core against libzmq.
 *
 * Versioned: a loop built against another layout refuses the capsule (and ingest stays in
 * Python) rather than calling through a wrong table. */
#ifndef KVINDEX_INGEST_API_H
#define KVINDEX_INGEST_API_H

#include <stddef.h>
#include <stdint.h>

#define KV_INGEST_API_NAME "kvindex.index._core.INGEST_API"
#define KV_INGEST_API_VERSION 2

/* apply's answer */
enum { KV_APPLY_NOMEM = -1, KV_APPLY_SLOW = 0, KV_APPLY_DONE = 1 };

typedef struct {
    int version; /* KV_INGEST_API_VERSION */
    /* Parse and apply one batch of publisher `bit` of the Core `core` (a
     * kvindex.index._core.Core the caller keeps a reference to). KV_APPLY_DONE: applied,
     * `ts` and `counts` (stored, removed, clears) set. KV_APPLY_SLOW: the fast parser does
     * not take it; nothing was applied (the Python path decides what it means).
     * KV_APPLY_NOMEM: out of memory, nothing applied. Takes the Core's write lock itself
     * (in slices, as apply_payload does); must be called without the GIL. `locked`, if not
     * NULL: this thread's CPU seconds applying, under the write lock, are added to it (what
     * no two ingest threads can do at once: Amdahl's serial part besides the GIL). The
     * clock costs a system call: callers sample. */
    int (*apply)(void *core, uint32_t bit, const uint8_t *data, size_t len, double *ts,
                 int64_t counts[3], double *locked);
} kv_ingest_api;

#endif
