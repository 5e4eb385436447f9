/* kvindex.index._core: the compiled index's Python face (kvindex/index/compiled.py wraps it).
 *
 * The GIL and the lock: `apply_payload` parses with the GIL released and no lock (parsing
 * reads nothing shared but the digest seed), then applies under the write lock, still
 * without the GIL, so HTTP lookups run on the other core meanwhile. Questions (lookups,
 * counts, walks) take the read lock and keep the GIL: they are short, and giving the GIL
 * away mid-request would let an ingest thread keep it for a whole switch interval. No code
 * holds the GIL while it waits for or holds the write lock (every writer: WRITE_LOCKED),
 * so the two never wait on each other in a circle. Readers never see half a batch of up
 * to APPLY_SLICE hashes: it is applied under one write lock; a bigger one is applied in
 * slices (apply_sliced), so no reader waits long behind it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>

#include "answer.h"
#include "core.h"
#include "xxh3.h"

/* Hashes applied under one write lock at most (issue 17 point 7). A lookup waits behind
 * one slice: ~0.2-0.8 us a hash, so a few ms, where a 1M-block BlockStored held the lock
 * (and with it a lookup, and the GIL that lookup keeps while it waits) for 0.7 s. */
#define APPLY_SLICE 4096

/* Answers' small dicts ({tier: blocks}, {group 0: blocks}, {rank: blocks}) are shared
 * between rows, made once per value: an answer of a big fleet would otherwise build three
 * dicts per instance (rows are read-only, as kvindex.index.base.LookupRow says). */
#define SHARED_BLOCKS 2048
#define SHARED_RANKS 8

typedef struct {
    PyObject_HEAD
    core_t core;
    PyObject **shared; /* tier dicts, group-0 dicts, rank dicts: see shared_dict */
    pthread_rwlock_t lock;
    /* Parse scratches not in use: one per ingest thread parsing at once, kept for the
     * next batch (they grow to the largest batch). A pool owned by the Core rather than
     * thread-local storage: a thread-local scratch of a thread that outlives the Core is
     * never freed (deleting the key runs no destructors). */
    pthread_mutex_t spares_lock;
    struct spare *spares;
    int ready;
    uint32_t slice; /* hashes applied under one write lock at most: APPLY_SLICE, or set_slice's */
} CoreObject;

typedef struct spare {
    scratch_t sc; /* first: a scratch_t * is its spare */
    struct spare *next;
} spare_t;

/* A scratch for one batch: a spare, or a new one. NULL: out of memory. */
static scratch_t *scratch_take(CoreObject *self) {
    pthread_mutex_lock(&self->spares_lock);
    spare_t *s = self->spares;
    if (s != NULL)
        self->spares = s->next;
    pthread_mutex_unlock(&self->spares_lock);
    return s != NULL ? &s->sc : calloc(1, sizeof(spare_t));
}

/* A scratch past this is emptied when given back: it grows to the largest batch, and one
 * odd batch of millions of events should not stay in memory for the Core's life. */
#define SCRATCH_KEEP ((size_t)4 << 20)

static void scratch_give_back(CoreObject *self, scratch_t *sc) {
    size_t bytes = (size_t)sc->ops_cap * sizeof(op_t) + (size_t)sc->hashes_cap * sizeof(phash) +
                   (size_t)sc->keys_cap * sizeof(uint64_t) +
                   (size_t)sc->tokens_cap * sizeof(uint32_t) + (size_t)sc->hk_cap * sizeof(hkey);
    if (bytes > SCRATCH_KEEP)
        scratch_free(sc);
    spare_t *s = (spare_t *)sc;
    pthread_mutex_lock(&self->spares_lock);
    s->next = self->spares;
    self->spares = s;
    pthread_mutex_unlock(&self->spares_lock);
}

static int Core_init(CoreObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"seed", NULL};
    unsigned long long seed = 0;
    PyObject *seed_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O", names, &seed_obj))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Core is already initialised");
        return -1;
    }
    if (seed_obj == Py_None) {
        /* A fresh seed per index: key digests can't be aimed at (see key_digest). */
        PyObject *os = PyImport_ImportModule("os");
        PyObject *raw = os ? PyObject_CallMethod(os, "urandom", "i", 8) : NULL;
        Py_XDECREF(os);
        if (raw == NULL)
            return -1;
        memcpy(&seed, PyBytes_AS_STRING(raw), 8);
        Py_DECREF(raw);
    } else {
        seed = PyLong_AsUnsignedLongLongMask(seed_obj);
        if (PyErr_Occurred())
            return -1;
    }
    if (core_init(&self->core, seed) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    if (pthread_rwlock_init(&self->lock, NULL) != 0) {
        core_free(&self->core);
        PyErr_SetString(PyExc_OSError, "could not make the index's lock");
        return -1;
    }
    pthread_mutex_init(&self->spares_lock, NULL); /* a default mutex: can't fail on Linux */
    self->spares = NULL;
    self->slice = APPLY_SLICE;
    self->ready = 1;
    return 0;
}

static void Core_dealloc(CoreObject *self) {
    if (self->shared != NULL) {
        for (size_t i = 0; i < (size_t)(TIER_COUNT + 1 + SHARED_RANKS) * SHARED_BLOCKS; i++)
            Py_XDECREF(self->shared[i]);
        free(self->shared);
        self->shared = NULL;
    }
    if (self->ready) {
        /* No batch is being applied: each holds a reference to the Core. */
        while (self->spares != NULL) {
            spare_t *s = self->spares;
            self->spares = s->next;
            scratch_free(&s->sc);
            free(s);
        }
        pthread_mutex_destroy(&self->spares_lock);
        pthread_rwlock_destroy(&self->lock);
        core_free(&self->core);
        self->ready = 0;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Run `body` (C only: no Python object) under the write lock, waited for and held without
 * the GIL, as apply_payload does. A lookup holds the read lock while it builds its rows,
 * with the GIL, and may give the GIL away meanwhile (its empty-rows callback is Python,
 * and any allocation may run a garbage collection's finalizers): a writer waiting for the
 * lock with the GIL held would wait for it forever, and the lookup for the GIL. Nor may
 * a writer take the GIL back while it holds the lock: readers wait for it with the GIL. */
#define WRITE_LOCKED(self, body)                                                           \
    do {                                                                                   \
        Py_BEGIN_ALLOW_THREADS                                                             \
        pthread_rwlock_wrlock(&(self)->lock);                                              \
        body;                                                                              \
        pthread_rwlock_unlock(&(self)->lock);                                              \
        Py_END_ALLOW_THREADS                                                               \
    } while (0)

#define READY(self)                                                                        \
    do {                                                                                   \
        if (!(self)->ready) {                                                              \
            PyErr_SetString(PyExc_RuntimeError, "Core is not initialised");               \
            return NULL;                                                                   \
        }                                                                                  \
    } while (0)

static int bit_arg(PyObject *obj, uint32_t *bit) {
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred())
        return 0;
    if (v < 0 || v > 1 << 20) {
        PyErr_SetString(PyExc_ValueError, "publisher bit out of range");
        return 0;
    }
    *bit = (uint32_t)v;
    return 1;
}

/* -- ingest -------------------------------------------------------------------------- */

/* Apply a parsed batch of publisher `bit`, a slice at a time, the write lock let go
 * between two: glibc's rwlock (reader-preferring) hands it to the readers waiting. Called
 * without the GIL. `counts`: stored, removed, clears. 1: applied; 0: out of memory. */
static int apply_sliced(CoreObject *self, uint32_t bit, scratch_t *sc, int64_t counts[3]) {
    apply_cursor cur = {0};
    int res;
    do {
        pthread_rwlock_wrlock(&self->lock);
        /* Made at the first slice; gone at a later one: removed meanwhile (never by
         * ingest, which removes on the thread applying), the rest applied to nothing. */
        source_t *s = source_get(&self->core, bit, !cur.started);
        res = s != NULL ? apply_slice(&self->core, s, sc, &cur, self->slice) : cur.started ? 1 : -1;
        pthread_rwlock_unlock(&self->lock);
    } while (res == 0);
    counts[0] = cur.stored;
    counts[1] = cur.removed;
    counts[2] = cur.clears;
    return res > 0;
}

/* apply_payload(bit, payload) -> (applied, ts, dp_rank, (stored, removed, clears))

   Parse and apply one batch of publisher `bit`. `applied` False: the fast path can't take
   it; nothing was applied (decode it with kvindex.wire and call apply_ops). */
static PyObject *Core_apply_payload(CoreObject *self, PyObject *args) {
    READY(self);
    PyObject *bit_obj, *payload;
    if (!PyArg_ParseTuple(args, "OO", &bit_obj, &payload))
        return NULL;
    uint32_t bit;
    if (!bit_arg(bit_obj, &bit))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    scratch_t *sc = scratch_take(self);
    if (sc == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    int res, failed = 0;
    int64_t counts[3] = {0, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    res = parse_batch(&self->core, view.buf, (size_t)view.len, sc);
    if (res == PARSE_OK)
        failed = !apply_sliced(self, bit, sc, counts);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    double ts = sc->ts;
    int has_rank = sc->has_rank;
    long long dp_rank = sc->dp_rank;
    scratch_give_back(self, sc);
    if (res == PARSE_NOMEM || failed)
        return PyErr_NoMemory();
    if (res != PARSE_OK)
        return Py_BuildValue("(OOOO)", Py_False, Py_None, Py_None, Py_None);
    PyObject *rank = has_rank ? PyLong_FromLongLong(dp_rank) : (Py_INCREF(Py_None), Py_None);
    if (rank == NULL)
        return NULL;
    return Py_BuildValue("(OdN(LLL))", Py_True, ts, rank, counts[0], counts[1], counts[2]);
}

/* A block hash from Python: an int in [-2^63, 2^64) or bytes (kept alive by the caller). */
static int hash_arg(PyObject *obj, phash *h) {
    if (PyBytes_Check(obj)) {
        h->kind = HK_BYTES;
        h->p = (const uint8_t *)PyBytes_AS_STRING(obj);
        h->len = (uint32_t)PyBytes_GET_SIZE(obj);
        h->v = 0;
        return 1;
    }
    if (!PyLong_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "a block hash is an int or bytes");
        return 0;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred())
            return 0;
        h->kind = v < 0 ? HK_NEGATIVE : HK_UINT;
        h->v = (uint64_t)v;
    } else if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(obj);
        if (PyErr_Occurred())
            return 0;
        h->kind = HK_UINT;
        h->v = u;
    } else {
        PyErr_SetString(PyExc_OverflowError, "a block hash below -2**63");
        return 0;
    }
    h->p = NULL;
    h->len = 0;
    return 1;
}

/* A hash asked about (lookup_hashes, count): an int outside [-2^63, 2^64) can't be one
 * any pool holds (no wire can say it): `*known` 0, as fleet.py answers, not an error. */
static int query_hash_arg(PyObject *obj, phash *h, uint8_t *known) {
    *known = 1;
    if (hash_arg(obj, h))
        return 1;
    if (!PyLong_Check(obj) || !PyErr_ExceptionMatches(PyExc_OverflowError))
        return 0;
    PyErr_Clear();
    *known = 0;
    return 1;
}

static int opt_str(PyObject *obj, span_t *out) {
    if (obj == Py_None) {
        out->p = NULL;
        out->len = 0;
        return 1;
    }
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(obj, &n);
    if (s == NULL)
        return 0;
    out->p = (const uint8_t *)s;
    out->len = (uint32_t)n;
    return 1;
}

static int opt_int(PyObject *obj, int64_t *v, uint8_t *present) {
    if (obj == Py_None) {
        *present = 0;
        return 1;
    }
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (x == -1 && PyErr_Occurred())
        return 0;
    /* An int past 64 bits can't name a group, rank or window: it never matches one. */
    *v = overflow ? (overflow > 0 ? INT64_MAX : INT64_MIN) : x;
    *present = 1;
    return 1;
}

/* A group_idx: any int64, or a uint64 past INT64_MAX (`big`), as msgpack can say; an int
 * past those (only from a decoded batch) can't come off the wire: clamped. */
static int opt_group(PyObject *obj, int64_t *v, uint8_t *present, uint8_t *big) {
    *big = 0;
    if (!opt_int(obj, v, present))
        return 0;
    if (*present && *v == INT64_MAX) {
        unsigned long long u = PyLong_AsUnsignedLongLong(obj);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            u = UINT64_MAX;
        }
        if (u > (unsigned long long)INT64_MAX) {
            *v = (int64_t)u;
            *big = 1;
        }
    }
    return 1;
}

static PyObject *group_object(int64_t group, uint8_t big) {
    return big ? PyLong_FromUnsignedLongLong((unsigned long long)group)
               : PyLong_FromLongLong(group);
}

/* One op of the Python path, a tuple built by kvindex.index.compiled:
     ("S", hashes, parent|None, keys: list[bytes], ntokens, tokens: bytes|None, block_size,
      lora_name|None, lora_id|None, salt|None, keyed, medium|None, group|None,
      spec_kind|None, window|None, unrecognised, bigram, own)
     ("R", hashes, medium|None, group|None)
     ("C",)
   `keys` are the fleet.py tree keys of the blocks (digested here), `tokens` the uint32
   token bytes when they all fit (kept for shared nodes). `bigram`: an EAGLE bigram
   cache's pages (their pairs flattened in keys and tokens; see keys.py). `own`: some
   block has own keys (fleet._unit_tree leaves such chains to the other rules). */
static int op_from_tuple(CoreObject *self, scratch_t *sc, PyObject *t) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 1 || !PyUnicode_Check(PyTuple_GET_ITEM(t, 0))) {
        PyErr_SetString(PyExc_TypeError, "an op is a tuple starting with its kind");
        return 0;
    }
    const char *kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(t, 0));
    if (kind == NULL)
        return 0;
    if (sc->nops == sc->ops_cap) {
        uint32_t cap = sc->ops_cap ? sc->ops_cap * 2 : 64;
        op_t *ops = realloc(sc->ops, cap * sizeof(op_t));
        if (ops == NULL) {
            PyErr_NoMemory();
            return 0;
        }
        sc->ops = ops;
        sc->ops_cap = cap;
    }
    op_t *op = &sc->ops[sc->nops];
    memset(op, 0, sizeof *op);
    Py_ssize_t size = PyTuple_GET_SIZE(t);
    if (kind[0] == 'C') {
        op->type = OP_CLEARED;
        sc->nops++;
        return 1;
    }
    if ((kind[0] == 'S' && size != 18) || (kind[0] == 'R' && size != 4) ||
        (kind[0] != 'S' && kind[0] != 'R')) {
        PyErr_SetString(PyExc_ValueError, "malformed op");
        return 0;
    }
    PyObject *hashes = PySequence_Fast(PyTuple_GET_ITEM(t, 1), "hashes must be a sequence");
    if (hashes == NULL)
        return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    if (sc->nhashes + n > sc->hashes_cap) {
        uint32_t cap = sc->hashes_cap ? sc->hashes_cap : 64;
        while (cap < sc->nhashes + n)
            cap *= 2;
        phash *hs = realloc(sc->hashes, cap * sizeof(phash));
        if (hs == NULL) {
            Py_DECREF(hashes);
            PyErr_NoMemory();
            return 0;
        }
        sc->hashes = hs;
        sc->hashes_cap = cap;
    }
    op->hashes_off = sc->nhashes;
    op->nhashes = (uint32_t)n;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!hash_arg(PySequence_Fast_GET_ITEM(hashes, i), &sc->hashes[sc->nhashes + i])) {
            Py_DECREF(hashes);
            return 0;
        }
    Py_DECREF(hashes); /* the items stay alive: the caller's tuple holds them */
    sc->nhashes += (uint32_t)n;
    if (kind[0] == 'R') {
        op->type = OP_REMOVED;
        if (!opt_str(PyTuple_GET_ITEM(t, 2), &op->medium) ||
            !opt_group(PyTuple_GET_ITEM(t, 3), &op->group, &op->has_group, &op->group_big))
            return 0;
        sc->nops++;
        return 1;
    }
    op->type = OP_STORED;
    PyObject *parent = PyTuple_GET_ITEM(t, 2);
    if (parent != Py_None) {
        op->has_parent = 1;
        if (!hash_arg(parent, &op->parent))
            return 0;
    }
    PyObject *keys = PySequence_Fast(PyTuple_GET_ITEM(t, 3), "keys must be a sequence");
    if (keys == NULL)
        return 0;
    Py_ssize_t nk = PySequence_Fast_GET_SIZE(keys);
    if (sc->nkeys + nk > sc->keys_cap) {
        uint32_t cap = sc->keys_cap ? sc->keys_cap : 64;
        while (cap < sc->nkeys + nk)
            cap *= 2;
        uint64_t *ks = realloc(sc->keys, cap * sizeof(uint64_t));
        if (ks == NULL) {
            Py_DECREF(keys);
            PyErr_NoMemory();
            return 0;
        }
        sc->keys = ks;
        sc->keys_cap = cap;
    }
    op->keys_off = sc->nkeys;
    op->nkeys = (uint32_t)nk;
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(keys, i);
        if (!PyBytes_Check(k)) {
            Py_DECREF(keys);
            PyErr_SetString(PyExc_TypeError, "a key is bytes");
            return 0;
        }
        sc->keys[sc->nkeys + i] = key_digest(&self->core, (const uint8_t *)PyBytes_AS_STRING(k),
                                             (size_t)PyBytes_GET_SIZE(k));
    }
    Py_DECREF(keys);
    sc->nkeys += (uint32_t)nk;
    op->ntokens = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, 4));
    if (PyErr_Occurred())
        return 0;
    PyObject *tokens = PyTuple_GET_ITEM(t, 5);
    if (tokens != Py_None) {
        if (!PyBytes_Check(tokens)) {
            PyErr_SetString(PyExc_TypeError, "tokens are uint32 bytes");
            return 0;
        }
        uint32_t count = (uint32_t)(PyBytes_GET_SIZE(tokens) / 4);
        if (sc->ntokens + count > sc->tokens_cap) {
            uint32_t cap = sc->tokens_cap ? sc->tokens_cap : 64;
            while (cap < sc->ntokens + count)
                cap *= 2;
            uint32_t *ts = realloc(sc->tokens, cap * sizeof(uint32_t));
            if (ts == NULL) {
                PyErr_NoMemory();
                return 0;
            }
            sc->tokens = ts;
            sc->tokens_cap = cap;
        }
        memcpy(sc->tokens + sc->ntokens, PyBytes_AS_STRING(tokens), (size_t)count * 4);
        op->tokens_off = sc->ntokens;
        op->tokens_kept = 1;
        sc->ntokens += count;
    }
    uint8_t present;
    int64_t lora_id;
    if (!opt_int(PyTuple_GET_ITEM(t, 6), &op->block_size, &present))
        return 0;
    if (!opt_str(PyTuple_GET_ITEM(t, 7), &op->lora) ||
        !opt_int(PyTuple_GET_ITEM(t, 8), &lora_id, &op->has_lora_id) ||
        !opt_str(PyTuple_GET_ITEM(t, 9), &op->salt))
        return 0;
    op->lora_id = lora_id;
    op->keyed = (uint8_t)PyObject_IsTrue(PyTuple_GET_ITEM(t, 10));
    if (!opt_str(PyTuple_GET_ITEM(t, 11), &op->medium) ||
        !opt_group(PyTuple_GET_ITEM(t, 12), &op->group, &op->has_group, &op->group_big) ||
        !opt_str(PyTuple_GET_ITEM(t, 13), &op->spec_kind) ||
        !opt_int(PyTuple_GET_ITEM(t, 14), &op->window, &op->has_window))
        return 0;
    op->has_spec = op->spec_kind.p != NULL;
    op->unrecognised = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, 15));
    if (PyErr_Occurred())
        return 0;
    int bigram = PyObject_IsTrue(PyTuple_GET_ITEM(t, 16));
    if (bigram < 0)
        return 0;
    op->bigram = (uint8_t)bigram;
    int own = PyObject_IsTrue(PyTuple_GET_ITEM(t, 17));
    if (own < 0)
        return 0;
    op->own = (uint8_t)own;
    sc->nops++;
    return 1;
}

/* apply_ops(bit, ops): apply a batch the Python decoder made (as apply_payload does). */
static PyObject *Core_apply_ops(CoreObject *self, PyObject *args) {
    READY(self);
    PyObject *bit_obj, *ops;
    if (!PyArg_ParseTuple(args, "OO", &bit_obj, &ops))
        return NULL;
    uint32_t bit;
    if (!bit_arg(bit_obj, &bit))
        return NULL;
    PyObject *fast = PySequence_Fast(ops, "ops must be a sequence");
    if (fast == NULL)
        return NULL;
    scratch_t sc = {0};
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!op_from_tuple(self, &sc, PySequence_Fast_GET_ITEM(fast, i))) {
            scratch_free(&sc);
            Py_DECREF(fast);
            return NULL;
        }
    /* The spans point into the tuples' objects: `fast` keeps them alive until here (the
     * list is batch_ops' own: nothing else changes it while the GIL is away). */
    int failed;
    int64_t counts[3];
    Py_BEGIN_ALLOW_THREADS /* see WRITE_LOCKED */
    failed = !apply_sliced(self, bit, &sc, counts);
    Py_END_ALLOW_THREADS
    scratch_free(&sc);
    Py_DECREF(fast);
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* clear(bit, restart): drop what the publisher holds (a restart also counts one). */
static PyObject *Core_clear(CoreObject *self, PyObject *args) {
    READY(self);
    PyObject *bit_obj;
    int restart;
    if (!PyArg_ParseTuple(args, "Op", &bit_obj, &restart))
        return NULL;
    uint32_t bit;
    if (!bit_arg(bit_obj, &bit))
        return NULL;
    WRITE_LOCKED(self, {
        source_t *s = source_get(&self->core, bit, 0);
        if (s != NULL) {
            source_clear(&self->core, s);
            s->stats.restarts += restart;
        }
    });
    Py_RETURN_NONE;
}

static PyObject *Core_remove(CoreObject *self, PyObject *bit_obj) {
    READY(self);
    uint32_t bit;
    if (!bit_arg(bit_obj, &bit))
        return NULL;
    WRITE_LOCKED(self, source_remove(&self->core, bit));
    Py_RETURN_NONE;
}

/* -- questions ----------------------------------------------------------------------- */

static const char *TIER_NAMES[TIER_COUNT] = {"gpu", "cpu", "disk", "external"};
static PyObject *TIER_STR[TIER_COUNT]; /* interned at import */

static PyObject *tier_dict(const uint32_t *by_tier) {
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    for (int t = 0; t < TIER_COUNT; t++) {
        if (!by_tier[t])
            continue;
        PyObject *v = PyLong_FromUnsignedLong(by_tier[t]);
        if (v == NULL || PyDict_SetItem(d, TIER_STR[t], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

/* One token id: ints only (a float or str is a TypeError, as in fleet.py). 0 with
 * *stop set: past 64 bits (no block from there on can be keyed). */
static inline int token_of(PyObject *o, int64_t *v, int *stop) {
#if PY_VERSION_HEX < 0x030C0000
    /* CPython 3.11's int layout: a small non-negative int is one 30-bit digit. Reading it
     * directly costs a few instructions instead of a call (a prompt has thousands). */
    if (PyLong_CheckExact(o)) {
        Py_ssize_t size = Py_SIZE(o);
        if (size == 1) {
            *v = ((PyLongObject *)o)->ob_digit[0];
            return 1;
        }
        if (size == 0) {
            *v = 0;
            return 1;
        }
    }
#endif
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "a token id must be an int, not %.100s", Py_TYPE(o)->tp_name);
        return 0;
    }
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (x == -1 && PyErr_Occurred())
        return 0;
    if (overflow) {
        *stop = 1;
        return 0;
    }
    *v = x;
    return 1;
}

/* A prompt's token ids: as uint32 (`small`) when every one fits, the common case, else
 * as int64 (`wide`; `small` NULL). `n`: how many could be read (a token past 64 bits
 * ends the prompt there, as fleet.py's keys do). */
typedef struct {
    uint32_t *small;
    int64_t *wide;
    uint32_t n;
} prompt_t;

static void prompt_free(prompt_t *p) {
    free(p->small);
    free(p->wide);
}

static int tokens_arg(PyObject *obj, prompt_t *out) {
    memset(out, 0, sizeof *out);
    if (PyBytes_Check(obj)) { /* uint32 token ids, native order (parse_lookup's) */
        Py_ssize_t n = PyBytes_GET_SIZE(obj) / (Py_ssize_t)sizeof(uint32_t);
        out->small = malloc(((size_t)n + 1) * sizeof(uint32_t));
        if (out->small == NULL) {
            PyErr_NoMemory();
            return 0;
        }
        memcpy(out->small, PyBytes_AS_STRING(obj), (size_t)n * sizeof(uint32_t));
        out->n = (uint32_t)n;
        return 1;
    }
    PyObject *fast = PySequence_Fast(obj, "token_ids must be a sequence of ints");
    if (fast == NULL)
        return 0;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint32_t *small = malloc(((size_t)len + 1) * sizeof(uint32_t));
    if (small == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return 0;
    }
    Py_ssize_t i = 0;
    int stop = 0;
    for (; i < len; i++) {
        int64_t v;
#if PY_VERSION_HEX < 0x030C0000
        /* CPython 3.11's int layout: a non-negative int below 2**30 is one digit. Reading
         * it directly costs a few instructions instead of a call (a prompt has thousands). */
        PyObject *o = items[i];
        if (PyLong_CheckExact(o) && (size_t)Py_SIZE(o) <= 1) {
            small[i] = Py_SIZE(o) ? ((PyLongObject *)o)->ob_digit[0] : 0;
            continue;
        }
#endif
        if (!token_of(items[i], &v, &stop))
            break;
        if (v < 0 || v > 0xFFFFFFFFLL)
            break; /* the wide path below takes it from here */
        small[i] = (uint32_t)v;
    }
    if (i < len && !PyErr_Occurred() && !stop) {
        /* A token past 32 bits (or negative): every token as int64 then. */
        int64_t *wide = malloc(((size_t)len + 1) * sizeof(int64_t));
        if (wide == NULL) {
            free(small);
            Py_DECREF(fast);
            PyErr_NoMemory();
            return 0;
        }
        for (Py_ssize_t k = 0; k < i; k++)
            wide[k] = small[k];
        for (; i < len; i++)
            if (!token_of(items[i], &wide[i], &stop))
                break;
        free(small);
        small = NULL;
        out->wide = wide;
    }
    Py_DECREF(fast);
    out->small = small;
    out->n = (uint32_t)i;
    if (PyErr_Occurred()) {
        prompt_free(out);
        return 0;
    }
    return 1;
}

static int lookup_names(CoreObject *self, PyObject *lora, PyObject *salt, uint32_t *lora_id,
                        uint32_t *salt_id, int *unknown) {
    span_t l, s;
    if (!opt_str(lora, &l) || !opt_str(salt, &s))
        return 0;
    *lora_id = l.p ? find_name(&self->core, l.p, l.len) : 0;
    *salt_id = s.p ? find_name(&self->core, s.p, s.len) : 0;
    *unknown = (l.p && !*lora_id) || (s.p && !*salt_id);
    return 1;
}


static PyObject *int_dict(const int64_t *keys, const uint8_t *big, const uint32_t *values,
                          uint32_t n) {
    PyObject *d = PyDict_New();
    for (uint32_t i = 0; d && i < n; i++) {
        PyObject *k = group_object(keys[i], big[i]), *v = PyLong_FromUnsignedLong(values[i]);
        if (!k || !v || PyDict_SetItem(d, k, v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    return d;
}

/* A shared one-entry dict: {tier name: blocks} (kind 0..3), {0: blocks} (kind 4, group 0)
 * or {rank: blocks} (kind 5 + rank). New reference; NULL with an error set. */
static PyObject *shared_dict(CoreObject *self, int kind, uint32_t blocks) {
    PyObject **slot = NULL;
    if (blocks < SHARED_BLOCKS && kind < TIER_COUNT + 1 + SHARED_RANKS) {
        if (self->shared == NULL) {
            self->shared = calloc((size_t)(TIER_COUNT + 1 + SHARED_RANKS) * SHARED_BLOCKS,
                                  sizeof(PyObject *));
            if (self->shared == NULL)
                return PyErr_NoMemory();
        }
        slot = &self->shared[(size_t)kind * SHARED_BLOCKS + blocks];
        if (*slot != NULL) {
            Py_INCREF(*slot);
            return *slot;
        }
    }
    PyObject *key = kind < TIER_COUNT ? (Py_INCREF(TIER_STR[kind]), TIER_STR[kind])
                                      : PyLong_FromLong(kind == TIER_COUNT ? 0 : kind - TIER_COUNT - 1);
    PyObject *value = PyLong_FromUnsignedLong(blocks);
    PyObject *d = key && value ? PyDict_New() : NULL;
    if (d != NULL && PyDict_SetItem(d, key, value) < 0)
        Py_CLEAR(d);
    Py_XDECREF(key);
    Py_XDECREF(value);
    if (d != NULL && slot != NULL) {
        Py_INCREF(d);
        *slot = d;
    }
    return d;
}

/* One LookupRow (kvindex.index.base): `row_type(name, blocks, tokens, size, rank, ranks,
 * by_tier, by_group)`. Called with the read lock held: pools are read for by_tier. */
static PyObject *make_row(CoreObject *self, PyObject *row_type, PyObject *name, uint32_t bit,
                          const answer_t *a, long rank, PyObject *ranks) {
    const core_t *c = &self->core;
    PyObject *tiers, *groups;
    if (a->detail != NULL) {
        tiers = tier_dict(a->detail->by_tier);
        groups = int_dict(a->detail->groups, a->detail->groups_big, a->detail->group_blocks,
                          a->detail->ngroups);
    } else { /* one pool: everything it reuses is that pool's tier and group */
        const source_t *s = c->sources[bit];
        int64_t group = s && s->npools ? s->pools[0].group : 0;
        uint8_t big = s && s->npools ? s->pools[0].group_big : 0;
        uint8_t tier = s && s->npools ? s->pools[0].tier : TIER_GPU;
        tiers = shared_dict(self, tier, a->blocks);
        groups = group == 0 && !big ? shared_dict(self, TIER_COUNT, a->blocks)
                                    : int_dict(&group, &big, &a->blocks, 1);
    }
    PyObject *row = NULL;
    if (tiers && groups) {
        PyObject *args[8] = {
            name,
            PyLong_FromUnsignedLong(a->blocks),
            PyLong_FromUnsignedLongLong((unsigned long long)a->blocks * a->size),
            PyLong_FromUnsignedLong(a->size),
            PyLong_FromLong(rank),
            ranks,
            tiers,
            groups,
        };
        if (args[1] && args[2] && args[3] && args[4])
            row = PyObject_Vectorcall(row_type, args, 8, NULL);
        for (int i = 1; i < 5; i++)
            Py_XDECREF(args[i]);
    }
    Py_XDECREF(tiers);
    Py_XDECREF(groups);
    return row;
}

/* The answer's rows (base.IndexBase._rows): one per instance of `layout` ([(name,
 * [(rank, bit), ...]), ...] by name), the shared empty row of `empty` where nothing
 * matched, else a new row for the instance's best rank. */
static PyObject *make_rows(CoreObject *self, PyObject *layout, PyObject *empty,
                           PyObject *row_type, const answer_t *answers, uint32_t nbits) {
    Py_ssize_t n = PyList_GET_SIZE(layout);
    PyObject *rows = PyList_New(n);
    for (Py_ssize_t i = 0; rows && i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(layout, i);
        PyObject *name = PyTuple_GET_ITEM(entry, 0), *ranks = PyTuple_GET_ITEM(entry, 1);
        Py_ssize_t nranks = PyList_GET_SIZE(ranks);
        long best_rank = -1;
        uint32_t best_bit = 0, best_blocks = 0;
        for (Py_ssize_t k = 0; k < nranks; k++) { /* the most blocks; ties: the lowest rank */
            PyObject *pair = PyList_GET_ITEM(ranks, k);
            long rank = PyLong_AsLong(PyTuple_GET_ITEM(pair, 0));
            uint32_t bit = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(pair, 1));
            uint32_t blocks = bit < nbits ? answers[bit].blocks : 0;
            if (best_rank < 0 || blocks > best_blocks || (blocks == best_blocks && rank < best_rank))
                best_rank = rank, best_bit = bit, best_blocks = blocks;
        }
        const reuse_t *detail = best_bit < nbits ? answers[best_bit].detail : NULL;
        int groups_only = 0; /* nothing reused, but a group's own hit to report */
        for (uint32_t g = 0; best_blocks == 0 && detail && g < detail->ngroups; g++)
            groups_only |= detail->group_blocks[g] != 0;
        if (best_blocks == 0 && !groups_only) {
            PyObject *nothing = PyList_GET_ITEM(empty, i);
            Py_INCREF(nothing);
            PyList_SET_ITEM(rows, i, nothing);
            continue;
        }
        PyObject *per_rank = nranks == 1 && best_rank >= 0 && best_rank < SHARED_RANKS
                                 ? shared_dict(self, TIER_COUNT + 1 + (int)best_rank, best_blocks)
                                 : PyDict_New();
        for (Py_ssize_t k = 0; nranks > 1 && per_rank && k < nranks; k++) {
            PyObject *pair = PyList_GET_ITEM(ranks, k);
            uint32_t bit = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(pair, 1));
            PyObject *v = PyLong_FromUnsignedLong(bit < nbits ? answers[bit].blocks : 0);
            if (v == NULL || PyDict_SetItem(per_rank, PyTuple_GET_ITEM(pair, 0), v) < 0)
                Py_CLEAR(per_rank);
            Py_XDECREF(v);
        }
        PyObject *row = per_rank ? make_row(self, row_type, name, best_bit, &answers[best_bit],
                                            best_rank, per_rank)
                                 : NULL;
        Py_XDECREF(per_rank);
        if (row == NULL)
            Py_CLEAR(rows);
        else
            PyList_SET_ITEM(rows, i, row);
    }
    return rows;
}

/* A lookup's own-keyed blocks (kvindex.index.multimodal.PromptKeys): per tree size, the
 * blocks whose key the lookup gives whole (tokens + own-keys digest), as key digests. */
typedef struct {
    uint32_t size;  /* a tree size */
    uint32_t block; /* the block's index in the prompt */
    uint64_t key;   /* key_digest of its tree key */
} own_key;

typedef struct {
    own_key *keys;
    uint32_t n;
} own_keys;

/* `own`: None, or {tree size: {block index: tree key bytes}}. 0 with an error set on a bad
 * shape; the digests need no lock (key_digest reads only the seed). */
static int own_arg(CoreObject *self, PyObject *obj, own_keys *out) {
    out->keys = NULL;
    out->n = 0;
    if (obj == NULL || obj == Py_None)
        return 1;
    static const char *shape = "own keys: {tree size: {block index: key bytes}}";
    if (!PyDict_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, shape);
        return 0;
    }
    Py_ssize_t total = 0, pos = 0;
    PyObject *size_obj, *blocks;
    while (PyDict_Next(obj, &pos, &size_obj, &blocks)) {
        if (!PyDict_Check(blocks)) {
            PyErr_SetString(PyExc_TypeError, shape);
            return 0;
        }
        total += PyDict_GET_SIZE(blocks);
    }
    if (total == 0)
        return 1;
    out->keys = malloc((size_t)total * sizeof(own_key));
    if (out->keys == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    pos = 0;
    while (PyDict_Next(obj, &pos, &size_obj, &blocks)) {
        unsigned long long size = PyLong_AsUnsignedLongLong(size_obj);
        if (PyErr_Occurred() || size > UINT32_MAX)
            goto bad;
        Py_ssize_t inner = 0;
        PyObject *block_obj, *key;
        while (PyDict_Next(blocks, &inner, &block_obj, &key)) {
            unsigned long long block = PyLong_AsUnsignedLongLong(block_obj);
            if (PyErr_Occurred() || block > UINT32_MAX || !PyBytes_Check(key))
                goto bad;
            if ((Py_ssize_t)out->n >= total) /* the dicts changed under us */
                goto bad;
            out->keys[out->n++] = (own_key){
                (uint32_t)size, (uint32_t)block,
                key_digest(&self->core, (const uint8_t *)PyBytes_AS_STRING(key),
                           (size_t)PyBytes_GET_SIZE(key))};
        }
    }
    return 1;
bad:
    PyErr_Clear(); /* a size or index that is not a u32 int: one wording for every shape */
    PyErr_SetString(PyExc_TypeError, shape);
    free(out->keys);
    out->keys = NULL;
    out->n = 0;
    return 0;
}

/* What every publisher would reuse of one prompt: computed with the read lock held (the
 * answers point into `reuses`), freed by walk_free. */
typedef struct {
    answer_t *answers;
    uint32_t nbits;
    uint32_t default_size; /* what publishers matching nothing report: the smallest size */
    reuse_t *reuses;
    int oom;
} walked_t;

static void walk_free(walked_t *w) {
    free(w->answers);
    free(w->reuses);
}

/* Marks in `several` (`words` words, cleared here) the publishers with several pools,
   whose answers need each size's walk path; 1 if there is any. Both lookups' set-up. */
static int mark_several(const core_t *c, uint64_t *several, uint32_t words, uint32_t bits) {
    int any = 0;
    memset(several, 0, words * sizeof(uint64_t));
    for (uint32_t b = 0; b < bits; b++)
        if (c->sources[b] && c->sources[b]->several) {
            several[b / 64] |= 1ULL << (b % 64);
            any = 1;
        }
    return any;
}

static void walk_prompt(const core_t *c, const prompt_t *prompt, uint32_t lora_id,
                        uint32_t salt_id, int unknown, const own_keys *own, walked_t *out) {
    memset(out, 0, sizeof *out);
    uint32_t ntokens = prompt->n;
    uint32_t bits = c->max_bit;
    uint32_t words = c->set_words;
    uint32_t sizes[16], nsizes = 0, roots[16];
    if (!unknown)
        for (uint32_t i = 0; i < c->nsizes; i++) {
            uint32_t root = root_find(c, lora_id, salt_id, c->sizes[i]);
            if (root == NODE_NONE || !c->nodes[root].nchild)
                continue;
            /* by block size, ascending: ties between sizes go to the smaller */
            uint32_t k = nsizes++;
            while (k > 0 && sizes[k - 1] > c->sizes[i]) {
                sizes[k] = sizes[k - 1];
                roots[k] = roots[k - 1];
                k--;
            }
            sizes[k] = c->sizes[i];
            roots[k] = root;
        }
    out->default_size = nsizes ? BLOCK_SIZE(sizes[0]) : 0;
    out->nbits = bits;
    uint64_t small_words[8];
    uint64_t *several = words <= 4 ? small_words : calloc(words * 2, sizeof(uint64_t));
    uint64_t *alive = several ? several + words : NULL;
    answer_t *answers = out->answers = calloc(bits + 1, sizeof(answer_t));
    uint32_t *depth = calloc(bits + 1, sizeof(uint32_t));
    uint64_t *keys = malloc(((size_t)ntokens + 1) * sizeof(uint64_t));
    uint32_t *paths = NULL;
    walk_path walks[16];
    int oom = !several || !answers || !depth || !keys;
    int any_several = 0;
    if (!oom) {
        any_several = mark_several(c, several, words, bits);
        if (any_several && nsizes) {
            paths = malloc(((size_t)ntokens + 1) * nsizes * sizeof(uint32_t));
            oom = paths == NULL;
        }
    }
    for (uint32_t k = 0; !oom && k < nsizes; k++) {
        uint32_t size = BLOCK_SIZE(sizes[k]); /* sizes[k] is a tree size */
        uint32_t nkeys =
            sizes[k] & BIGRAM_TREE
                ? prompt_bigram_keys(c, prompt->small, prompt->wide, ntokens, size, keys)
                : prompt_keys(c, prompt->small, prompt->wide, ntokens, size, keys);
        for (uint32_t i = 0; i < own->n; i++) /* the blocks keyed by the lookup's own keys */
            if (own->keys[i].size == sizes[k] && own->keys[i].block < nkeys)
                keys[own->keys[i].block] = own->keys[i].key;
        memset(depth, 0, (bits + 1) * sizeof(uint32_t));
        uint32_t *path = paths ? paths + (size_t)k * (ntokens + 1) : NULL;
        walks[k].path = path;
        walks[k].len = walk(c, roots[k], keys, nkeys, depth, path, alive, several);
        for (uint32_t b = 0; b < bits; b++) /* the most tokens over the sizes */
            if (depth[b] && (uint64_t)depth[b] * size > (uint64_t)answers[b].blocks * answers[b].size) {
                answers[b].blocks = depth[b];
                answers[b].size = size;
            }
    }
    if (!oom && any_several && nsizes) {
        reuse_t *reuses = out->reuses = calloc(bits + 1, sizeof(reuse_t));
        oom = reuses == NULL;
        uint64_t *unit_keys = NULL;
        for (uint32_t b = 0; !oom && b < bits; b++)
            if (c->sources[b] && c->sources[b]->several) {
                const source_t *s = c->sources[b];
                fine_prompt fp = {roots, NULL, 0};
                int fine = s->unit != 0;
                if (fine) { /* hits inside blocks: the prompt's hash units' keys */
                    if (unit_keys == NULL)
                        unit_keys = malloc(((size_t)ntokens + 1) * sizeof(uint64_t));
                    if (unit_keys == NULL) {
                        oom = 1;
                        break;
                    }
                    fp.unit_keys = unit_keys;
                    fp.nunits = prompt_keys(c, prompt->small, prompt->wide, ntokens, s->unit,
                                            unit_keys);
                }
                if (engine_reuse(c, s, sizes, walks, nsizes, fine ? &fp : NULL, &reuses[b])) {
                    oom = 1;
                    break;
                }
                answers[b] = (answer_t){reuses[b].blocks, reuses[b].size, &reuses[b]};
            }
        free(unit_keys);
    }
    out->oom = oom;
    if (several != small_words)
        free(several);
    free(depth);
    free(keys);
    free(paths);
}

/* The byte order of namespaces for a lookup by local hashes (fleet.py's
 * _namespace_order within one size): by LoRA name, then salt ("" for none). */
static int name_cmp(const core_t *c, uint32_t a, uint32_t b) {
    const blob_t *x = a ? &c->names.items[a] : NULL, *y = b ? &c->names.items[b] : NULL;
    uint32_t lx = x ? x->len : 0, ly = y ? y->len : 0;
    int r = memcmp(x ? (const void *)x->data : "", y ? (const void *)y->data : "",
                   lx < ly ? lx : ly);
    return r ? r : (lx > ly) - (lx < ly);
}

static int ns_before(const core_t *c, const namespace_t *a, const namespace_t *b) {
    int r = name_cmp(c, a->lora, b->lora);
    return r ? r < 0 : name_cmp(c, a->salt, b->salt) < 0;
}

/* FleetIndex.lookup_local_hashes: per tree size (plain trees; `size` 0: every size), the
 * namespace (of LoRA `lora`, if `lora_given`) whose blocks continue the hashes furthest
 * (ties: the first by name), walked along the nodes found. */
static void walk_local(const core_t *c, const uint64_t *hashes, uint32_t n, uint32_t lora,
                       int lora_given, uint32_t want_size, walked_t *out) {
    memset(out, 0, sizeof *out);
    uint32_t bits = c->max_bit, words = c->set_words;
    uint32_t sizes[16], nsizes = 0, best_len[16];
    const namespace_t *best[16];
    uint32_t *scratch = malloc(((size_t)n + 1) * sizeof(uint32_t));
    uint32_t *found = malloc(((size_t)n + 1) * 16 * sizeof(uint32_t));
    int oom = scratch == NULL || found == NULL;
    for (uint32_t i = 0; !oom && i < c->nns; i++) {
        const namespace_t *ns = &c->ns[i];
        if (ns->size & BIGRAM_TREE || (want_size && ns->size != want_size))
            continue;
        if (ns->lora && c->names.items[ns->lora].len && c->names.items[ns->lora].data[0] == 0xff)
            continue; /* an adapter known by its lora_id only: no seed a lookup can give */
        if (lora_given && ns->lora != lora)
            continue;
        uint32_t k = 0;
        while (k < nsizes && sizes[k] != ns->size)
            k++;
        if (k == nsizes) { /* a new size, in ascending order */
            while (k > 0 && sizes[k - 1] > ns->size) {
                sizes[k] = sizes[k - 1];
                best[k] = best[k - 1];
                best_len[k] = best_len[k - 1];
                memcpy(found + (size_t)k * (n + 1), found + (size_t)(k - 1) * (n + 1),
                       (size_t)best_len[k] * sizeof(uint32_t));
                k--;
            }
            sizes[k] = ns->size;
            best[k] = NULL;
            best_len[k] = 0;
            nsizes++;
        }
        uint32_t len = local_path(c, ns->root, hashes, n, scratch);
        if (len && (len > best_len[k] || (len == best_len[k] && ns_before(c, ns, best[k])))) {
            best[k] = ns;
            best_len[k] = len;
            memcpy(found + (size_t)k * (n + 1), scratch, (size_t)len * sizeof(uint32_t));
        }
    }
    out->default_size = nsizes ? BLOCK_SIZE(sizes[0]) : 0;
    out->nbits = bits;
    uint64_t small_words[8];
    uint64_t *several = words <= 4 ? small_words : calloc(words * 2, sizeof(uint64_t));
    uint64_t *alive = several ? several + words : NULL;
    answer_t *answers = out->answers = calloc(bits + 1, sizeof(answer_t));
    uint32_t *depth = calloc(bits + 1, sizeof(uint32_t));
    uint32_t *paths = NULL;
    walk_path walks[16];
    oom |= !several || !answers || !depth;
    int any_several = 0;
    if (!oom) {
        any_several = mark_several(c, several, words, bits);
        if (any_several && nsizes) {
            paths = malloc(((size_t)n + 1) * nsizes * sizeof(uint32_t));
            oom = paths == NULL;
        }
    }
    for (uint32_t k = 0; !oom && k < nsizes; k++) {
        uint32_t size = BLOCK_SIZE(sizes[k]);
        memset(depth, 0, (bits + 1) * sizeof(uint32_t));
        uint32_t *path = paths ? paths + (size_t)k * (n + 1) : NULL;
        walks[k].path = path;
        walks[k].len = best_len[k] ? walk_nodes(c, found + (size_t)k * (n + 1), best_len[k],
                                                depth, path, alive, several)
                                   : 0;
        for (uint32_t b = 0; b < bits; b++)
            if (depth[b] && (uint64_t)depth[b] * size > (uint64_t)answers[b].blocks * answers[b].size) {
                answers[b].blocks = depth[b];
                answers[b].size = size;
            }
    }
    if (!oom && any_several && nsizes) {
        reuse_t *reuses = out->reuses = calloc(bits + 1, sizeof(reuse_t));
        oom = reuses == NULL;
        for (uint32_t b = 0; !oom && b < bits; b++)
            if (c->sources[b] && c->sources[b]->several) {
                /* Local hashes name whole blocks only: no hits inside a block (no fine). */
                if (engine_reuse(c, c->sources[b], sizes, walks, nsizes, NULL, &reuses[b])) {
                    oom = 1;
                    break;
                }
                answers[b] = (answer_t){reuses[b].blocks, reuses[b].size, &reuses[b]};
            }
    }
    out->oom = oom;
    if (several != small_words)
        free(several);
    free(depth);
    free(paths);
    free(scratch);
    free(found);
}

/* lookup_local(hashes, lora_name, block_size, layout, empty_rows, row_type) -> [row, ...]

   FleetIndex.lookup_local_hashes: `hashes` u64 or i64 ints (Dynamo's local block hashes),
   `lora_name` None or a name (only its namespaces), `block_size` None or a size. */
static PyObject *Core_lookup_local(CoreObject *self, PyObject *args) {
    READY(self);
    PyObject *hashes_obj, *lora, *size_obj, *layout, *empty_rows, *row_type;
    if (!PyArg_ParseTuple(args, "OOOO!OO", &hashes_obj, &lora, &size_obj, &PyList_Type, &layout,
                          &empty_rows, &row_type))
        return NULL;
    span_t l;
    if (!opt_str(lora, &l))
        return NULL;
    uint32_t want_size = 0;
    if (size_obj != Py_None) {
        unsigned long v = PyLong_AsUnsignedLong(size_obj);
        if (PyErr_Occurred())
            return NULL;
        if (v == 0 || v >= (1UL << 31)) /* no tree has it: nothing matches */
            v = 0xFFFFFFFFUL;
        want_size = (uint32_t)v;
    }
    PyObject *fast = PySequence_Fast(hashes_obj, "hashes must be a sequence of ints");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    uint64_t *hashes = malloc(((size_t)n + 1) * sizeof(uint64_t));
    if (hashes == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyLong_Check(o)) {
            PyErr_SetString(PyExc_TypeError, "a local hash must be an int");
            break;
        }
        /* modulo 2^64, as localhash.as_unsigned: an i64 from the wire is its u64 */
        hashes[i] = PyLong_AsUnsignedLongLongMask(o);
        if (PyErr_Occurred())
            break;
    }
    Py_DECREF(fast);
    if (PyErr_Occurred()) {
        free(hashes);
        return NULL;
    }
    walked_t w;
    PyObject *rows = NULL;
    pthread_rwlock_rdlock(&self->lock);
    uint32_t lora_id = l.p ? find_name(&self->core, l.p, l.len) : 0;
    if (!self->core.local_on) {
        PyErr_SetString(PyExc_RuntimeError, "the core keeps no local hashes");
        memset(&w, 0, sizeof w);
    } else if (l.p && !lora_id) { /* an adapter no namespace has: nothing matches */
        walk_local(&self->core, hashes, 0, 0, 1, 0xFFFFFFFFu, &w);
    } else {
        walk_local(&self->core, hashes, (uint32_t)n, lora_id, l.p != NULL, want_size, &w);
    }
    if (PyErr_Occurred()) {
        /* refused above */
    } else if (w.oom) {
        PyErr_NoMemory();
    } else {
        PyObject *empty = PyObject_CallFunction(empty_rows, "I", w.default_size);
        if (empty != NULL && (!PyList_Check(empty) || PyList_GET_SIZE(empty) != PyList_GET_SIZE(layout))) {
            PyErr_SetString(PyExc_ValueError, "empty rows do not match the layout");
            Py_CLEAR(empty);
        }
        if (empty != NULL)
            rows = make_rows(self, layout, empty, row_type, w.answers, w.nbits);
        Py_XDECREF(empty);
    }
    pthread_rwlock_unlock(&self->lock);
    walk_free(&w);
    free(hashes);
    return rows;
}

/* keep_local_hashes(on): keep Dynamo's local block hashes (only before the first block). */
static PyObject *Core_keep_local_hashes(CoreObject *self, PyObject *on) {
    READY(self);
    int flag = PyObject_IsTrue(on);
    if (flag < 0)
        return NULL;
    int r;
    WRITE_LOCKED(self, r = keep_local_hashes(&self->core, flag));
    if (r < 0) {
        PyErr_SetString(PyExc_ValueError, "local hashes are kept from the first block only");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* lookup(token_ids, lora_name, cache_salt, layout, empty_rows, row_type[, own]) -> [row, ...]

   What every instance would reuse of the prompt: FleetIndex.lookup. `layout` is the
   answer's shape (IndexBase._lay_out), `empty_rows(size)` the shared rows of instances
   matching nothing, `row_type` LookupRow. `token_ids`: ints, or bytes of uint32 in native
   order (parse_lookup's). `own`: the blocks keyed by the lookup's own keys (own_arg). */
static PyObject *Core_lookup(CoreObject *self, PyObject *args) {
    READY(self);
    PyObject *tokens_obj, *lora, *salt, *layout, *empty_rows, *row_type, *own_obj = NULL;
    if (!PyArg_ParseTuple(args, "OOOO!OO|O", &tokens_obj, &lora, &salt, &PyList_Type, &layout,
                          &empty_rows, &row_type, &own_obj))
        return NULL;
    prompt_t prompt;
    uint32_t lora_id, salt_id;
    int unknown;
    own_keys own;
    if (!lookup_names(self, lora, salt, &lora_id, &salt_id, &unknown))
        return NULL;
    if (!own_arg(self, own_obj, &own))
        return NULL;
    if (!tokens_arg(tokens_obj, &prompt)) {
        free(own.keys);
        return NULL;
    }
    walked_t w;
    PyObject *rows = NULL;
    pthread_rwlock_rdlock(&self->lock);
    walk_prompt(&self->core, &prompt, lora_id, salt_id, unknown, &own, &w);
    if (w.oom) {
        PyErr_NoMemory();
    } else {
        /* The rows need the pools (by_tier): built before the lock goes, with the GIL
         * kept (ingest never needs the GIL while it holds the write lock). */
        PyObject *empty = PyObject_CallFunction(empty_rows, "I", w.default_size);
        if (empty != NULL && (!PyList_Check(empty) || PyList_GET_SIZE(empty) != PyList_GET_SIZE(layout))) {
            PyErr_SetString(PyExc_ValueError, "empty rows do not match the layout");
            Py_CLEAR(empty);
        }
        if (empty != NULL)
            rows = make_rows(self, layout, empty, row_type, w.answers, w.nbits);
        Py_XDECREF(empty);
    }
    pthread_rwlock_unlock(&self->lock);
    prompt_free(&prompt);
    walk_free(&w);
    free(own.keys);
    return rows;
}

/* The runtime's instances (a list of (name_json, [rank, bit, rank, bit, ...]) by name, see
 * CompiledIndex.lookup_json) and their statuses (a list of JSON strings as bytes) as
 * slot_t; the rank arrays go in `ranks`. 0 with an error set on a bad shape. */
static int slots_arg(PyObject *slots_obj, PyObject *statuses, slot_t **slots_out,
                     int32_t **ranks_out) {
    *slots_out = NULL;
    *ranks_out = NULL;
    if (!PyList_Check(slots_obj) || !PyList_Check(statuses) ||
        PyList_GET_SIZE(slots_obj) != PyList_GET_SIZE(statuses)) {
        PyErr_SetString(PyExc_TypeError, "slots and statuses: two lists, as long");
        return 0;
    }
    Py_ssize_t n = PyList_GET_SIZE(slots_obj), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *slot = PyList_GET_ITEM(slots_obj, i);
        if (!PyTuple_Check(slot) || PyTuple_GET_SIZE(slot) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(slot, 0)) || !PyList_Check(PyTuple_GET_ITEM(slot, 1)) ||
            PyList_GET_SIZE(PyTuple_GET_ITEM(slot, 1)) % 2) {
            PyErr_SetString(PyExc_TypeError, "a slot is (name_json, [rank, bit, ...])");
            return 0;
        }
        total += PyList_GET_SIZE(PyTuple_GET_ITEM(slot, 1));
    }
    slot_t *slots = *slots_out = calloc((size_t)n + 1, sizeof(slot_t));
    int32_t *ranks = *ranks_out = malloc(((size_t)total + 1) * sizeof(int32_t));
    if (slots == NULL || ranks == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *slot = PyList_GET_ITEM(slots_obj, i), *pairs = PyTuple_GET_ITEM(slot, 1);
        PyObject *status = PyList_GET_ITEM(statuses, i);
        if (!PyBytes_Check(status)) {
            PyErr_SetString(PyExc_TypeError, "a status is its JSON string, as bytes");
            return 0;
        }
        slots[i].name_json = PyBytes_AS_STRING(PyTuple_GET_ITEM(slot, 0));
        slots[i].name_len = (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(slot, 0));
        slots[i].status_json = PyBytes_AS_STRING(status);
        slots[i].status_len = (size_t)PyBytes_GET_SIZE(status);
        slots[i].down = slots[i].status_len == 6 && memcmp(slots[i].status_json, "\"down\"", 6) == 0;
        slots[i].nranks = (uint32_t)(PyList_GET_SIZE(pairs) / 2);
        slots[i].ranks = ranks;
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(pairs); k++) {
            long v = PyLong_AsLong(PyList_GET_ITEM(pairs, k));
            if (v == -1 && PyErr_Occurred())
                return 0;
            *ranks++ = (int32_t)v;
        }
    }
    return 1;
}

/* lookup_json(token_ids, lora_name, cache_salt, slots, statuses[, own]) -> (json bytes, hit)

   Core.lookup and the runtime's answer (Fleet.lookup encoded) in one go: see answer.h. */
static PyObject *Core_lookup_json(CoreObject *self, PyObject *args) {
    READY(self);
    PyObject *tokens_obj, *lora, *salt, *slots_obj, *statuses, *own_obj = NULL;
    if (!PyArg_ParseTuple(args, "OOOOO|O", &tokens_obj, &lora, &salt, &slots_obj, &statuses,
                          &own_obj))
        return NULL;
    prompt_t prompt;
    uint32_t lora_id, salt_id;
    int unknown;
    slot_t *slots;
    int32_t *ranks;
    own_keys own;
    if (!lookup_names(self, lora, salt, &lora_id, &salt_id, &unknown))
        return NULL;
    if (!slots_arg(slots_obj, statuses, &slots, &ranks)) {
        free(slots);
        free(ranks);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(slots_obj);
    if (!own_arg(self, own_obj, &own)) {
        free(slots);
        free(ranks);
        return NULL;
    }
    if (!tokens_arg(tokens_obj, &prompt)) {
        free(slots);
        free(ranks);
        free(own.keys);
        return NULL;
    }
    walked_t w;
    jbuf_t out = {0};
    int hit = 0;
    /* The GIL is kept, as for every question (see the top of this file): given away for
     * these ~30 us, it could take a busy ingest thread's whole switch interval to get back. */
    pthread_rwlock_rdlock(&self->lock);
    walk_prompt(&self->core, &prompt, lora_id, salt_id, unknown, &own, &w);
    if (!w.oom)
        hit = answer_json(&self->core, w.answers, w.nbits, slots, (uint32_t)n, 1, &out);
    pthread_rwlock_unlock(&self->lock);
    PyObject *result = NULL;
    if (w.oom || out.oom)
        PyErr_NoMemory();
    else
        result = Py_BuildValue("(y#O)", out.p, (Py_ssize_t)out.len, hit ? Py_True : Py_False);
    jbuf_free(&out);
    walk_free(&w);
    prompt_free(&prompt);
    free(slots);
    free(ranks);
    free(own.keys);
    return result;
}

/* parse_lookup(body, max_items) -> (token_ids as uint32 bytes, lora_name, cache_salt), or
   None when the body is not the simple shape (see answer.h): the caller decodes it then. */
static PyObject *parse_lookup(PyObject *module, PyObject *args) {
    Py_buffer body;
    unsigned int max_items;
    if (!PyArg_ParseTuple(args, "y*I", &body, &max_items))
        return NULL;
    lookup_body_t parsed;
    int r = parse_lookup_body(body.buf, (size_t)body.len, max_items, &parsed);
    PyObject *result = NULL;
    if (r == PARSE_NOMEM) {
        PyErr_NoMemory();
    } else if (r == PARSE_SLOW) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else {
        PyObject *tokens = PyBytes_FromStringAndSize((const char *)parsed.tokens,
                                                     (Py_ssize_t)parsed.ntokens * 4);
        PyObject *lora = parsed.lora ? PyUnicode_FromStringAndSize(parsed.lora, (Py_ssize_t)parsed.lora_len)
                                     : (Py_INCREF(Py_None), Py_None);
        PyObject *salt = parsed.salt ? PyUnicode_FromStringAndSize(parsed.salt, (Py_ssize_t)parsed.salt_len)
                                     : (Py_INCREF(Py_None), Py_None);
        if (tokens && lora && salt)
            result = PyTuple_Pack(3, tokens, lora, salt);
        Py_XDECREF(tokens);
        Py_XDECREF(lora);
        Py_XDECREF(salt);
    }
    free(parsed.tokens);
    PyBuffer_Release(&body);
    return result;
}

/* lookup_hashes(hashes) -> [(bit, blocks, by_tier), ...]: per publisher, the run of these
   hashes its GPU pools hold from the first, then the run its lower tiers hold. */
static PyObject *Core_lookup_hashes(CoreObject *self, PyObject *hashes_obj) {
    READY(self);
    PyObject *fast = PySequence_Fast(hashes_obj, "hashes must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    phash *ph = malloc(((size_t)n + 1) * sizeof(phash));
    hkey *hk = malloc(((size_t)n + 1) * sizeof(hkey));
    uint8_t *known = malloc((size_t)n + 1);
    if (!ph || !hk || !known) {
        free(ph), free(hk), free(known);
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!query_hash_arg(PySequence_Fast_GET_ITEM(fast, i), &ph[i], &known[i])) {
            free(ph), free(hk), free(known);
            Py_DECREF(fast);
            return NULL;
        }
    core_t *c = &self->core;
    PyObject *rows = PyList_New(0);
    pthread_rwlock_rdlock(&self->lock);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!known[i])
            continue;
        if (ph[i].kind == HK_BYTES) {
            uint32_t id = find_bytes(c, ph[i].p, ph[i].len);
            hk[i] = (hkey){id, HK_BYTES};
            known[i] = id != 0;
        } else {
            hk[i] = (hkey){ph[i].v, ph[i].kind};
            known[i] = 1;
        }
    }
    uint32_t bits = c->max_bit;
    for (uint32_t b = 0; rows && b < bits; b++) {
        source_t *s = c->sources[b];
        if (s == NULL)
            continue;
        uint32_t by_tier[TIER_COUNT] = {0};
        Py_ssize_t d = 0;
        for (; d < n; d++) { /* the GPU run */
            int held = 0;
            for (uint32_t p = 0; known[d] && !held && p < s->npools; p++)
                held = s->pools[p].tier == TIER_GPU &&
                       pmap_find(&s->pools[p].blocks, hk[d].v, hk[d].kind) != NULL;
            if (!held)
                break;
        }
        by_tier[TIER_GPU] = (uint32_t)d;
        for (; d < n; d++) { /* then the fastest lower tier holding each next block */
            int tier = -1;
            for (int t = TIER_CPU; t < TIER_COUNT && tier < 0 && known[d]; t++)
                for (uint32_t p = 0; tier < 0 && p < s->npools; p++)
                    if (s->pools[p].tier == t &&
                        pmap_find(&s->pools[p].blocks, hk[d].v, hk[d].kind) != NULL)
                        tier = t;
            if (tier < 0)
                break;
            by_tier[tier]++;
        }
        if (d == 0)
            continue;
        PyObject *tiers = tier_dict(by_tier);
        PyObject *row = tiers ? Py_BuildValue("(InN)", b, d, tiers) : NULL;
        if (row == NULL || PyList_Append(rows, row) < 0)
            Py_CLEAR(rows);
        Py_XDECREF(row);
    }
    pthread_rwlock_unlock(&self->lock);
    free(ph), free(hk), free(known);
    Py_DECREF(fast);
    return rows;
}

static PyObject *hash_object(const core_t *c, uint64_t v, uint32_t kind) {
    if (kind == HK_BYTES) {
        const blob_t *b = &c->bytes.items[v];
        return PyBytes_FromStringAndSize((const char *)b->data, b->len);
    }
    if (kind == HK_NEGATIVE)
        return PyLong_FromLongLong((long long)v);
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *blob_object(const interner *t, uint32_t sid) {
    const blob_t *b = &t->items[sid];
    return PyUnicode_DecodeUTF8((const char *)b->data, b->len, "replace");
}

static PyObject *str_object(const core_t *c, uint32_t sid) { return blob_object(&c->strings, sid); }

/* pools(bit) -> [(group, medium, {hash: copies}), ...] */
static PyObject *Core_pools(CoreObject *self, PyObject *bit_obj) {
    READY(self);
    uint32_t bit;
    if (!bit_arg(bit_obj, &bit))
        return NULL;
    core_t *c = &self->core;
    PyObject *out = PyList_New(0);
    pthread_rwlock_rdlock(&self->lock);
    source_t *s = source_get(c, bit, 0);
    for (uint32_t i = 0; out && s && i < s->npools; i++) {
        pool_t *p = &s->pools[i];
        PyObject *d = PyDict_New();
        PMAP_FOREACH(&p->blocks, e) {
            if (d == NULL)
                break;
            uint32_t kind = pmap_b(e);
            map_entry *x = s->extra.count ? map_find(&s->extra, e->a, kind | ((uint32_t)p->index << 8)) : NULL;
            PyObject *k = hash_object(c, e->a, kind);
            PyObject *v = PyLong_FromUnsignedLong(1 + (x ? x->value : 0));
            if (!k || !v || PyDict_SetItem(d, k, v) < 0)
                Py_CLEAR(d);
            Py_XDECREF(k);
            Py_XDECREF(v);
        }
        PyObject *medium = d ? str_object(c, p->medium) : NULL;
        PyObject *group = medium ? group_object(p->group, p->group_big) : NULL;
        PyObject *row = group ? Py_BuildValue("(NNN)", group, medium, d) : NULL;
        if (row == NULL) {
            Py_XDECREF(d);
            Py_CLEAR(out);
            break;
        }
        if (PyList_Append(out, row) < 0)
            Py_CLEAR(out);
        Py_DECREF(row);
    }
    pthread_rwlock_unlock(&self->lock);
    return out;
}

/* pool_keys(bit) -> [(group, medium), ...] in the order the pools came. */
static PyObject *Core_pool_keys(CoreObject *self, PyObject *bit_obj) {
    READY(self);
    uint32_t bit;
    if (!bit_arg(bit_obj, &bit))
        return NULL;
    core_t *c = &self->core;
    PyObject *out = PyList_New(0);
    pthread_rwlock_rdlock(&self->lock);
    source_t *s = source_get(c, bit, 0);
    for (uint32_t i = 0; out && s && i < s->npools; i++) {
        PyObject *medium = str_object(c, s->pools[i].medium);
        PyObject *group =
            medium ? group_object(s->pools[i].group, s->pools[i].group_big) : NULL;
        PyObject *row = group ? Py_BuildValue("(NN)", group, medium) : NULL;
        if (row == NULL || PyList_Append(out, row) < 0)
            Py_CLEAR(out);
        Py_XDECREF(row);
    }
    pthread_rwlock_unlock(&self->lock);
    return out;
}

/* pool_hashes(bit, index) -> [hash, ...] of one pool. */
static PyObject *Core_pool_hashes(CoreObject *self, PyObject *args) {
    READY(self);
    PyObject *bit_obj;
    unsigned int index;
    if (!PyArg_ParseTuple(args, "OI", &bit_obj, &index))
        return NULL;
    uint32_t bit;
    if (!bit_arg(bit_obj, &bit))
        return NULL;
    core_t *c = &self->core;
    PyObject *out = PyList_New(0);
    pthread_rwlock_rdlock(&self->lock);
    source_t *s = source_get(c, bit, 0);
    if (out && s && index < s->npools) {
        PMAP_FOREACH(&s->pools[index].blocks, e) {
            PyObject *k = hash_object(c, e->a, pmap_b(e));
            if (k == NULL || PyList_Append(out, k) < 0) {
                Py_XDECREF(k);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(k);
        }
    }
    pthread_rwlock_unlock(&self->lock);
    return out;
}

/* distinct(bits) -> (blocks, {medium: blocks}): distinct hashes the publishers `bits`
 * (one instance's ranks) hold over all their pools, and per medium. Counted in C under
 * the read lock without the GIL: IndexBase's union of Python sets held the GIL ~0.5 s an
 * instance of 1M blocks, each time an instance view was asked after a batch, so the
 * HTTP loop (lookups included) stopped that long (issue 17 point 7). */
typedef struct {
    uint32_t medium; /* interned id */
    uint64_t most;   /* entries of its pools; then its distinct hashes */
    map_t seen;      /* a = hash value, b = kind */
    char *name;      /* copied under the lock: a writer may move the interner's items */
    uint32_t len;
} medium_count;

/* One pass over the pools of `bits`: without `all`, the media met and their entries
 * (returns the total); with it, every entry put in `all` and in its medium's table. */
static uint64_t distinct_pass(const core_t *c, const uint32_t *bits, Py_ssize_t nbits,
                              medium_count *media, uint32_t *nmedia, map_t *all, int *ok,
                              uint32_t *filled) {
    uint64_t most = 0;
    int made;
    for (Py_ssize_t i = 0; *ok && i < nbits; i++) {
        source_t *src = source_get((core_t *)c, bits[i], 0); /* make = 0: only reads */
        for (uint32_t p = 0; *ok && src != NULL && p < src->npools; p++) {
            const pool_t *pool = &src->pools[p];
            uint32_t m = 0;
            while (m < *nmedia && media[m].medium != pool->medium)
                m++;
            if (m == *nmedia) {
                const blob_t *b = &c->strings.items[pool->medium];
                media[m].medium = pool->medium;
                map_init(&media[m].seen);
                media[m].len = b->len;
                media[m].name = malloc(b->len + 1);
                *ok = media[m].name != NULL;
                if (*ok)
                    memcpy(media[m].name, b->data, b->len);
                (*nmedia)++;
            }
            if (all == NULL) {
                *filled += pool->blocks.count != 0;
                media[m].most += pool->blocks.count;
                most += pool->blocks.count;
                continue;
            }
            PMAP_FOREACH(&pool->blocks, e) {
                *ok = map_put(all, e->a, pmap_b(e), &made) != NULL &&
                      map_put(&media[m].seen, e->a, pmap_b(e), &made) != NULL;
                if (!*ok)
                    break;
            }
        }
    }
    return most;
}

static PyObject *Core_distinct(CoreObject *self, PyObject *bits_obj) {
    READY(self);
    PyObject *fast = PySequence_Fast(bits_obj, "bits must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t nbits = PySequence_Fast_GET_SIZE(fast);
    uint32_t *bits = malloc(((size_t)nbits + 1) * sizeof(uint32_t));
    medium_count *media = calloc((size_t)nbits * MAX_POOLS + 1, sizeof(medium_count));
    int ok = bits != NULL && media != NULL;
    for (Py_ssize_t i = 0; ok && i < nbits; i++)
        ok = bit_arg(PySequence_Fast_GET_ITEM(fast, i), &bits[i]);
    Py_DECREF(fast);
    if (!ok) {
        free(bits);
        free(media);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    core_t *c = &self->core;
    map_t all;
    map_init(&all);
    uint32_t nmedia = 0;
    uint32_t filled; /* pools holding something: one (most instances) needs no union */
    uint64_t most;
    Py_BEGIN_ALLOW_THREADS /* a reader without the GIL: it waits for no writer holding it */
    pthread_rwlock_rdlock(&self->lock);
    filled = 0;
    most = distinct_pass(c, bits, nbits, media, &nmedia, NULL, &ok, &filled);
    if (ok && filled > 1) {
        /* Sized first: a pool's entries come in the order of their hash, and put into a
         * table smaller than the pool's they would pile up in one run (quadratic). */
        ok = most * 5 / 4 + 8 <= UINT32_MAX && map_grow(&all, (uint32_t)(most * 5 / 4 + 8)) == 0;
        for (uint32_t m = 0; ok && m < nmedia; m++)
            ok = map_grow(&media[m].seen, (uint32_t)(media[m].most * 5 / 4 + 8)) == 0;
        if (ok)
            distinct_pass(c, bits, nbits, media, &nmedia, &all, &ok, &filled);
        for (uint32_t m = 0; m < nmedia; m++)
            media[m].most = media[m].seen.count;
        most = all.count;
    }
    pthread_rwlock_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    PyObject *by_medium = ok ? PyDict_New() : NULL;
    for (uint32_t m = 0; m < nmedia; m++) {
        if (by_medium != NULL) {
            PyObject *name = PyUnicode_DecodeUTF8(media[m].name, media[m].len, "replace");
            PyObject *count = PyLong_FromUnsignedLongLong(media[m].most);
            if (name == NULL || count == NULL || PyDict_SetItem(by_medium, name, count) < 0)
                Py_CLEAR(by_medium);
            Py_XDECREF(name);
            Py_XDECREF(count);
        }
        map_free(&media[m].seen);
        free(media[m].name);
    }
    map_free(&all);
    free(media);
    free(bits);
    if (by_medium == NULL)
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    return Py_BuildValue("(KN)", (unsigned long long)most, by_medium);
}

static int medium_matches(const core_t *c, uint32_t medium, span_t wanted) {
    const blob_t *b = &c->strings.items[medium];
    if (b->len == wanted.len && memcmp(b->data, wanted.p, b->len) == 0)
        return 1;
    const char *tier = TIER_NAMES[core_tier_of((core_t *)c, medium)];
    if (strlen(tier) != wanted.len)
        return 0;
    for (uint32_t i = 0; i < wanted.len; i++) {
        uint8_t ch = wanted.p[i];
        if ((ch >= 'A' && ch <= 'Z' ? ch + 32 : ch) != (uint8_t)tier[i])
            return 0;
    }
    return 1;
}

/* hashes(bit, medium|None) -> [hash, ...]: every pool entry (a hash held in two pools comes
   twice: the caller makes the set), of pools of that medium or tier, or all. */
static PyObject *Core_hashes(CoreObject *self, PyObject *args) {
    READY(self);
    PyObject *bit_obj, *medium_obj;
    if (!PyArg_ParseTuple(args, "OO", &bit_obj, &medium_obj))
        return NULL;
    uint32_t bit;
    span_t medium;
    if (!bit_arg(bit_obj, &bit) || !opt_str(medium_obj, &medium))
        return NULL;
    core_t *c = &self->core;
    PyObject *out = PyList_New(0);
    pthread_rwlock_rdlock(&self->lock);
    source_t *s = source_get(c, bit, 0);
    for (uint32_t i = 0; out && s && i < s->npools; i++) {
        pool_t *p = &s->pools[i];
        if (medium.p != NULL && !medium_matches(c, p->medium, medium))
            continue;
        PMAP_FOREACH(&p->blocks, e) {
            PyObject *k = hash_object(c, e->a, pmap_b(e));
            if (k == NULL || PyList_Append(out, k) < 0) {
                Py_XDECREF(k);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(k);
        }
    }
    pthread_rwlock_unlock(&self->lock);
    return out;
}

/* count(bit, group, medium, hash) -> copies held in that pool (0 if none). */
static PyObject *Core_count(CoreObject *self, PyObject *args) {
    READY(self);
    PyObject *bit_obj, *group_obj, *medium_obj, *hash_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &bit_obj, &group_obj, &medium_obj, &hash_obj))
        return NULL;
    int64_t group;
    uint8_t has_group, big;
    if (!PyLong_Check(group_obj)) {
        PyErr_SetString(PyExc_TypeError, "group: an int");
        return NULL;
    }
    if (!opt_group(group_obj, &group, &has_group, &big))
        return NULL;
    uint32_t bit;
    span_t medium;
    phash ph;
    uint8_t known;
    if (!bit_arg(bit_obj, &bit) || !opt_str(medium_obj, &medium) ||
        !query_hash_arg(hash_obj, &ph, &known))
        return NULL;
    if (!known)
        return PyLong_FromLong(0);
    core_t *c = &self->core;
    unsigned long copies = 0;
    pthread_rwlock_rdlock(&self->lock);
    source_t *s = source_get(c, bit, 0);
    uint32_t mid = medium.p ? find_str(c, medium.p, medium.len) : 0;
    hkey h = {ph.v, ph.kind};
    if (ph.kind == HK_BYTES)
        h.v = find_bytes(c, ph.p, ph.len);
    for (uint32_t i = 0; s && mid && (ph.kind != HK_BYTES || h.v) && i < s->npools; i++) {
        pool_t *p = &s->pools[i];
        if (p->group != group || p->group_big != big || p->medium != mid)
            continue;
        if (pmap_find(&p->blocks, h.v, h.kind) != NULL) {
            map_entry *x = map_find(&s->extra, h.v, h.kind | ((uint32_t)p->index << 8));
            copies = 1 + (x ? x->value : 0);
        }
    }
    pthread_rwlock_unlock(&self->lock);
    return PyLong_FromUnsignedLong(copies);
}

/* stats(bit) -> (stored, removed, clears, batches, restarts, unplaced, unrecognised_keys,
   namespace_kept, namespace_moved) */
static PyObject *Core_stats(CoreObject *self, PyObject *bit_obj) {
    READY(self);
    uint32_t bit;
    if (!bit_arg(bit_obj, &bit))
        return NULL;
    source_stats st = {0};
    pthread_rwlock_rdlock(&self->lock);
    source_t *s = source_get(&self->core, bit, 0);
    if (s != NULL)
        st = s->stats;
    pthread_rwlock_unlock(&self->lock);
    return Py_BuildValue("(LLLLLLLLL)", st.stored, st.removed, st.clears, st.batches, st.restarts,
                         st.unplaced, st.unrecognised_keys, st.namespace_kept, st.namespace_moved);
}

static PyObject *Core_entries(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    READY(self);
    unsigned long long total = 0;
    pthread_rwlock_rdlock(&self->lock);
    for (uint32_t b = 0; b < self->core.max_bit; b++) {
        source_t *s = self->core.sources[b];
        for (uint32_t i = 0; s && i < s->npools; i++)
            total += s->pools[i].blocks.count;
    }
    pthread_rwlock_unlock(&self->lock);
    return PyLong_FromUnsignedLongLong(total);
}

static PyObject *Core_tree_nodes(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    READY(self);
    pthread_rwlock_rdlock(&self->lock);
    unsigned long n = self->core.live_nodes - self->core.nns; /* roots aside */
    pthread_rwlock_unlock(&self->lock);
    return PyLong_FromUnsignedLong(n);
}

/* memory() -> {part: bytes} of the structures (not malloc's own overhead). */
static PyObject *Core_memory(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    READY(self);
    core_t *c = &self->core;
    unsigned long long pools = 0, side = 0;
    pthread_rwlock_rdlock(&self->lock);
    for (uint32_t b = 0; b < c->max_bit; b++) {
        source_t *s = c->sources[b];
        if (s == NULL)
            continue;
        side += sizeof(source_t) + map_bytes(&s->extra) + map_bytes(&s->refs) + map_bytes(&s->where);
        for (uint32_t i = 0; i < s->npools; i++)
            pools += pmap_bytes(&s->pools[i].blocks);
    }
    unsigned long long nodes = (unsigned long long)c->nodes_cap * sizeof(node_t);
    unsigned long long children = pmap_bytes(&c->children);
    unsigned long long sets = (unsigned long long)c->sets_cap * c->set_words * 8;
    unsigned long long tokens = map_bytes(&c->tokens) + (unsigned long long)c->tokens.count * 68;
    unsigned long long local = c->local_on ? map_bytes(&c->local) + (unsigned long long)c->nodes_cap * 12 : 0;
    pthread_rwlock_unlock(&self->lock);
    return Py_BuildValue("{sKsKsKsKsKsKsK}", "nodes", nodes, "children", children, "pools", pools,
                         "holder_sets", sets, "shared_tokens", tokens, "publishers", side,
                         "local_hashes", local);
}

static PyObject *one_bit(uint32_t bit) {
    PyObject *one = PyLong_FromLong(1), *shift = PyLong_FromUnsignedLong(bit);
    PyObject *out = one && shift ? PyNumber_Lshift(one, shift) : NULL;
    Py_XDECREF(one);
    Py_XDECREF(shift);
    return out;
}

/* walk_tree() -> [(lora, salt, size, depth, digest, tokens|None, holders), ...]: every node,
   depth first, parents before children (fleet.py's walk_tree; siblings in no set order).
   Tokens are there for nodes two publishers hold, unless keep_tokens(False) (core.h).
   `lora` is the name, or the int lora_id; `holders` the publishers' bits as an int. */
static PyObject *Core_walk_tree(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    READY(self);
    core_t *c = &self->core;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    pthread_rwlock_rdlock(&self->lock);
    /* Children lists from the one children table: first child and next sibling. */
    uint32_t *first = calloc(c->nnodes + 1, sizeof(uint32_t));
    uint32_t *next = calloc(c->nnodes + 1, sizeof(uint32_t));
    uint32_t *stack = malloc((c->nnodes + 1) * sizeof(uint32_t) * 2);
    if (!first || !next || !stack) {
        pthread_rwlock_unlock(&self->lock);
        free(first), free(next), free(stack);
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    PMAP_FOREACH(&c->children, e) {
        uint32_t child = pmap_value(e), parent = c->nodes[child].parent;
        next[child] = first[parent];
        first[parent] = child;
    }
    for (uint32_t k = 0; out && k < c->nns; k++) {
        namespace_t ns = c->ns[k];
        PyObject *lora, *salt;
        if (ns.lora == 0) {
            lora = Py_None, Py_INCREF(lora);
        } else if (c->names.items[ns.lora].len && c->names.items[ns.lora].data[0] == 0xff) {
            /* "\xff" + the lora_id's digits (see resolve): the int again */
            char digits[32] = {0};
            const blob_t *b = &c->names.items[ns.lora];
            memcpy(digits, b->data + 1, b->len - 1 < sizeof digits - 1 ? b->len - 1 : sizeof digits - 1);
            lora = PyLong_FromString(digits, NULL, 10);
        } else {
            lora = blob_object(&c->names, ns.lora);
        }
        salt = ns.salt ? blob_object(&c->names, ns.salt) : (Py_INCREF(Py_None), Py_None);
        uint32_t top = 0;
        for (uint32_t ch = first[ns.root]; ch; ch = next[ch]) {
            stack[top++] = ch;
            stack[top++] = 1;
        }
        while (top && out && lora && salt) {
            uint32_t depth = stack[--top];
            uint32_t n = stack[--top];
            node_t *node = &c->nodes[n];
            if (is_partial(c, n))
                continue; /* a partial-block entry: not a block of this tree's size */
            PyObject *holders;
            if (node->holders & HOLD_SET)
                holders = _PyLong_FromByteArray((const unsigned char *)set_words_of(c, node->holders),
                                                c->set_words * 8, 1, 0);
            else if (node->holders)
                holders = one_bit(node->holders - 1);
            else
                holders = PyLong_FromLong(0);
            const uint32_t *toks = node_tokens(c, n);
            PyObject *tokens = toks ? PyBytes_FromStringAndSize((const char *)(toks + 1), toks[0] * 4)
                                    : (Py_INCREF(Py_None), Py_None);
            PyObject *row = (holders && tokens)
                                ? Py_BuildValue("(OOIIKNN)", lora, salt, ns.size, depth,
                                                (unsigned long long)(((uint64_t)node->key_hi << 32) | node->key_lo),
                                                tokens, holders)
                                : NULL;
            if (row == NULL || PyList_Append(out, row) < 0)
                Py_CLEAR(out);
            Py_XDECREF(row);
            for (uint32_t ch = first[n]; ch; ch = next[ch]) {
                stack[top++] = ch;
                stack[top++] = depth + 1;
            }
        }
        Py_XDECREF(lora);
        Py_XDECREF(salt);
    }
    pthread_rwlock_unlock(&self->lock);
    free(first), free(next), free(stack);
    return out;
}

static PyObject *Core_keep_tokens(CoreObject *self, PyObject *on) {
    READY(self);
    int keep = PyObject_IsTrue(on);
    if (keep < 0)
        return NULL;
    WRITE_LOCKED(self, self->core.keep_tokens = (uint8_t)keep);
    Py_RETURN_NONE;
}

/* set_slice(n): apply batches n hashes at a time (tests: small streams cross slices). */
static PyObject *Core_set_slice(CoreObject *self, PyObject *n_obj) {
    READY(self);
    unsigned long n = PyLong_AsUnsignedLong(n_obj);
    if (PyErr_Occurred())
        return NULL;
    if (n == 0 || n > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a slice is 1 to 2**32-1 hashes");
        return NULL;
    }
    WRITE_LOCKED(self, self->slice = (uint32_t)n);
    Py_RETURN_NONE;
}

/* tree_sizes() -> [size, ...]: the tree sizes with a namespace now (what a lookup walks). */
static PyObject *Core_tree_sizes(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    READY(self);
    uint32_t sizes[16], n;
    pthread_rwlock_rdlock(&self->lock);
    n = self->core.nsizes;
    memcpy(sizes, self->core.sizes, n * sizeof(uint32_t));
    pthread_rwlock_unlock(&self->lock);
    PyObject *out = PyList_New(n);
    for (uint32_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(sizes[i]);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *Core_key_digest(CoreObject *self, PyObject *data) {
    READY(self);
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t d = key_digest(&self->core, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(d);
}

static PyObject *Core_tier_of(CoreObject *self, PyObject *medium) {
    READY(self);
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(medium, &n);
    if (s == NULL)
        return NULL;
    uint8_t tier;
    WRITE_LOCKED(self, {
        uint32_t id = intern_str(&self->core, (const uint8_t *)s, (uint32_t)n);
        tier = id ? core_tier_of(&self->core, id) : TIER_EXTERNAL;
    });
    return PyUnicode_FromString(TIER_NAMES[tier]);
}

static PyMethodDef Core_methods[] = {
    {"apply_payload", (PyCFunction)Core_apply_payload, METH_VARARGS, NULL},
    {"apply_ops", (PyCFunction)Core_apply_ops, METH_VARARGS, NULL},
    {"clear", (PyCFunction)Core_clear, METH_VARARGS, NULL},
    {"remove", (PyCFunction)Core_remove, METH_O, NULL},
    {"lookup", (PyCFunction)Core_lookup, METH_VARARGS, NULL},
    {"lookup_json", (PyCFunction)Core_lookup_json, METH_VARARGS, NULL},
    {"lookup_hashes", (PyCFunction)Core_lookup_hashes, METH_O, NULL},
    {"pools", (PyCFunction)Core_pools, METH_O, NULL},
    {"pool_keys", (PyCFunction)Core_pool_keys, METH_O, NULL},
    {"pool_hashes", (PyCFunction)Core_pool_hashes, METH_VARARGS, NULL},
    {"hashes", (PyCFunction)Core_hashes, METH_VARARGS, NULL},
    {"count", (PyCFunction)Core_count, METH_VARARGS, NULL},
    {"stats", (PyCFunction)Core_stats, METH_O, NULL},
    {"entries", (PyCFunction)Core_entries, METH_NOARGS, NULL},
    {"tree_nodes", (PyCFunction)Core_tree_nodes, METH_NOARGS, NULL},
    {"memory", (PyCFunction)Core_memory, METH_NOARGS, NULL},
    {"walk_tree", (PyCFunction)Core_walk_tree, METH_NOARGS, NULL},
    {"key_digest", (PyCFunction)Core_key_digest, METH_O, NULL},
    {"tree_sizes", (PyCFunction)Core_tree_sizes, METH_NOARGS, NULL},
    {"lookup_local", (PyCFunction)Core_lookup_local, METH_VARARGS, NULL},
    {"keep_local_hashes", (PyCFunction)Core_keep_local_hashes, METH_O, NULL},
    {"keep_tokens", (PyCFunction)Core_keep_tokens, METH_O, NULL},
    {"set_slice", (PyCFunction)Core_set_slice, METH_O, NULL},
    {"distinct", (PyCFunction)Core_distinct, METH_O, NULL},
    {"tier_of", (PyCFunction)Core_tier_of, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvindex.index._core.Core",
    .tp_basicsize = sizeof(CoreObject),
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The compiled index (see kvindex/index/compiled.py).",
    .tp_methods = Core_methods,
    .tp_init = (initproc)Core_init,
    .tp_new = PyType_GenericNew,
};

/* allocated() -> (bytes, blocks) the core's C holds now, over every Core of the process
   (alloc.h): what tests and the fuzzer check leaks with. */
static PyObject *core_allocated(PyObject *module, PyObject *Py_UNUSED(unused)) {
    (void)module;
    return Py_BuildValue("(nn)", (Py_ssize_t)__atomic_load_n(&kv_alloc_bytes, __ATOMIC_RELAXED),
                         (Py_ssize_t)__atomic_load_n(&kv_alloc_blocks, __ATOMIC_RELAXED));
}

/* xxh3_64(data, seed) -> int: the core's XXH3-64 (xxh3.h), for tests against xxhash. */
static PyObject *core_xxh3_64(PyObject *module, PyObject *args) {
    Py_buffer data;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*K", &data, &seed))
        return NULL;
    uint64_t h = xxh3_64(data.buf, (size_t)data.len, seed);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef core_functions[] = {
    {"allocated", core_allocated, METH_NOARGS, NULL},
    {"xxh3_64", (PyCFunction)core_xxh3_64, METH_VARARGS, NULL},
    {"parse_lookup", (PyCFunction)parse_lookup, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvindex.index._core",
    .m_doc = "The compiled index core.",
    .m_size = -1,
    .m_methods = core_functions,
};

PyMODINIT_FUNC PyInit__core(void) {
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    for (int t = 0; t < TIER_COUNT; t++)
        if ((TIER_STR[t] = PyUnicode_InternFromString(TIER_NAMES[t])) == NULL)
            return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
