/* kvindex.index._core: the compiled index's Python face (kvindex/index/compiled.py wraps it).
 *
 * One way into the core: every entry point parses its arguments (with the GIL, touching
 * nothing of the core), fills a small context, and hands a body to `core_run`, the one
 * place that pairs the index's rwlock with the GIL; it builds the Python result from the
 * context afterwards when it can. tests/test_core_bodies.py checks that no entry point
 * takes the lock or gives the GIL away by itself. The modes:
 *  - RUN_READ: the read lock, GIL kept. Questions whose answer is Python objects made
 *    from the core (lookups, pools, walks): they are short, and giving the GIL away
 *    mid-request would let an ingest thread keep it for a whole switch interval.
 *  - RUN_READ_NOGIL: the read lock without the GIL (distinct: a long count in C only).
 *  - RUN_WRITE_NOGIL: the write lock, waited for and held without the GIL.
 *  - RUN_NOGIL: no lock, no GIL: `apply_payload` parses (reading nothing shared but the
 *    digest seed), then applies slice by slice, each under the write lock (core_locked),
 *    so HTTP lookups run on the other core meanwhile and no reader waits long behind a
 *    big batch. Readers never see half a slice of up to APPLY_SLICE hashes.
 * No code holds the GIL while it waits for or holds the write lock, so the two never
 * wait on each other in a circle. Bodies run without the GIL touch nothing `Py*`: they
 * return a status, and the entry point raises once the GIL is back. Everything that
 * reads the core (the name table included: a writer may be interning and rehashing it)
 * runs inside a body, so under the lock by construction.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <pthread.h>
#include <time.h>

#include "answer.h"
#define KVCORE_BUILD
#include "lookup_api.h"
#include "core.h"
#include "ingest_api.h"
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
    /* Tests only (pause_slices): a batch's applying thread waits between two slices, with
     * neither the lock nor the GIL, until resume_slices; so a test can remove or add
     * publishers exactly there (issue 27 point 1). */
    pthread_mutex_t pause_lock;
    pthread_cond_t pause_cond;
    int pause_on, paused;
    uint64_t resumes;
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
    pthread_mutex_init(&self->pause_lock, NULL);
    pthread_cond_init(&self->pause_cond, NULL);
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
        pthread_mutex_destroy(&self->pause_lock);
        pthread_cond_destroy(&self->pause_cond);
        pthread_rwlock_destroy(&self->lock);
        core_free(&self->core);
        self->ready = 0;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* -- one way in -------------------------------------------------------------------- */

typedef enum {
    RUN_READ,        /* read lock, GIL kept: bodies may build Python objects */
    RUN_READ_NOGIL,  /* read lock, GIL released: C-only bodies */
    RUN_WRITE_NOGIL, /* write lock, GIL released: C-only bodies */
    RUN_NOGIL,       /* no lock, GIL released: bodies that lock slice by slice (core_locked) */
} run_mode;

/* A body: C run by core_run under the mode's lock. Its int comes back from core_run. */
typedef int (*core_body)(CoreObject *self, void *ctx);

/* What core_run returns when the lock could not be taken (never a body's status). */
#define RUN_LOCK_FAILED INT_MIN

/* `body` under the read or write lock, the caller's GIL state unchanged. The lock's
 * return code is checked here, the one place that takes it: a read body that reached a
 * writer of the same core (a Python callback) gets EDEADLK rather than a hang where
 * glibc can tell. */
static int core_locked(CoreObject *self, int write, core_body body, void *ctx) {
    int err = write ? pthread_rwlock_wrlock(&self->lock) : pthread_rwlock_rdlock(&self->lock);
    if (err != 0)
        return RUN_LOCK_FAILED;
    int res = body(self, ctx);
    pthread_rwlock_unlock(&self->lock);
    return res;
}

/* Run `body` in `mode` (see the top of this file): the lock taken and released, the GIL
 * given away and taken back, here only. Called with the GIL. Returns the body's status,
 * or RUN_LOCK_FAILED with a RuntimeError set. */
static int core_run(CoreObject *self, run_mode mode, core_body body, void *ctx) {
    int res;
    if (mode == RUN_READ) {
        res = core_locked(self, 0, body, ctx);
    } else {
        Py_BEGIN_ALLOW_THREADS
        res = mode == RUN_NOGIL ? body(self, ctx)
                                : core_locked(self, mode == RUN_WRITE_NOGIL, body, ctx);
        Py_END_ALLOW_THREADS
    }
    if (res == RUN_LOCK_FAILED && !PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "the index's lock could not be taken (a callback "
                                            "reached the index it was called from?)");
    return res;
}

/* The entry guard of every method: an initialised Core and `lo`..`hi` positional
 * arguments (METH_FASTCALL). 1: go on; 0: an error is set. */
static int core_entry(CoreObject *self, const char *name, Py_ssize_t nargs, Py_ssize_t lo,
                      Py_ssize_t hi) {
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Core is not initialised");
        return 0;
    }
    if (nargs < lo || nargs > hi) {
        if (lo == hi)
            PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, lo, nargs);
        else
            PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments (%zd given)", name, lo,
                         hi, nargs);
        return 0;
    }
    return 1;
}

/* core_entry for METH_O and METH_NOARGS methods (their arity is CPython's to check). */
static int core_ready(CoreObject *self) { return core_entry(self, "", 0, 0, 0); }

/* Ints only, for every number an entry point reads: converting anything else would run
 * its `__index__`, Python that could change the lists being read (issue 27 point 4). */
static int int_arg(PyObject *obj, const char *what) {
    if (PyLong_Check(obj))
        return 1;
    PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, Py_TYPE(obj)->tp_name);
    return 0;
}

/* A flag: a bool or an int (PyObject_IsTrue of anything else would run its __bool__). */
static int flag_arg(PyObject *obj, uint8_t *flag) {
    if (!int_arg(obj, "a flag"))
        return 0;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow); /* an int: no Python runs */
    if (v == -1 && PyErr_Occurred())
        return 0;
    *flag = v != 0 || overflow != 0;
    return 1;
}

static int bit_arg(PyObject *obj, uint32_t *bit) {
    if (!int_arg(obj, "a publisher bit"))
        return 0;
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

/* A batch on its way into the core: apply_payload's and apply_ops' context. */
typedef struct {
    uint32_t bit;
    scratch_t *sc;
    apply_cursor cur;
    const void *buf; /* apply_payload: the payload, parsed first */
    size_t len;
    int parsed; /* parse_batch's verdict */
    int64_t counts[3]; /* stored, removed, clears */
} apply_ctx;

/* One slice, under the write lock: 0 more to do, 1 done, -1 out of memory. */
static int apply_one_slice(CoreObject *self, void *ctx) {
    apply_ctx *a = ctx;
    /* Made at the first slice; gone at a later one: removed meanwhile (never by
     * ingest, which removes on the thread applying), the rest applied to nothing. */
    source_t *s = source_get(&self->core, a->bit, !a->cur.started);
    if (s == NULL)
        return a->cur.started ? 1 : -1;
    return apply_slice(&self->core, s, a->sc, &a->cur, self->slice);
}

/* Apply a parsed batch a slice at a time, the write lock let go between two: glibc's
 * rwlock (reader-preferring) hands it to the readers waiting. A RUN_NOGIL body. 1:
 * applied; 0: out of memory. */
/* Between two slices, when a test asked (pause_slices): wait, holding nothing. */
static void slice_pause(CoreObject *self) {
    if (!__atomic_load_n(&self->pause_on, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&self->pause_lock);
    uint64_t seen = self->resumes;
    self->paused++;
    while (self->pause_on && self->resumes == seen)
        pthread_cond_wait(&self->pause_cond, &self->pause_lock);
    self->paused--;
    pthread_mutex_unlock(&self->pause_lock);
}

static int apply_sliced(CoreObject *self, void *ctx) {
    apply_ctx *a = ctx;
    int res;
    while ((res = core_locked(self, 1, apply_one_slice, a)) == 0)
        slice_pause(self);
    a->counts[0] = a->cur.stored;
    a->counts[1] = a->cur.removed;
    a->counts[2] = a->cur.clears;
    return res == RUN_LOCK_FAILED ? res : res > 0;
}

/* Parse (no lock: reads only the digest seed), then apply. A RUN_NOGIL body. */
static int parse_and_apply(CoreObject *self, void *ctx) {
    apply_ctx *a = ctx;
    a->parsed = parse_batch(&self->core, a->buf, a->len, a->sc);
    return a->parsed == PARSE_OK ? apply_sliced(self, a) : 1;
}

/* apply_payload(bit, payload) -> (applied, ts, dp_rank, (stored, removed, clears))

   Parse and apply one batch of publisher `bit`. `applied` False: the fast path can't take
   it; nothing was applied (decode it with kvindex.wire and call apply_ops). */
static PyObject *Core_apply_payload(CoreObject *self, PyObject *const *args, Py_ssize_t nargs) {
    apply_ctx a = {0};
    if (!core_entry(self, "apply_payload", nargs, 2, 2) || !bit_arg(args[0], &a.bit))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    a.sc = scratch_take(self);
    if (a.sc == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    a.buf = view.buf;
    a.len = (size_t)view.len;
    int res = core_run(self, RUN_NOGIL, parse_and_apply, &a);
    PyBuffer_Release(&view);
    double ts = a.sc->ts;
    int has_rank = a.sc->has_rank;
    long long dp_rank = a.sc->dp_rank;
    scratch_give_back(self, a.sc);
    if (res == RUN_LOCK_FAILED)
        return NULL;
    if (a.parsed == PARSE_NOMEM || res == 0)
        return PyErr_NoMemory();
    if (a.parsed != PARSE_OK)
        return Py_BuildValue("(OOOO)", Py_False, Py_None, Py_None, Py_None);
    PyObject *rank = has_rank ? PyLong_FromLongLong(dp_rank) : Py_NewRef(Py_None);
    if (rank == NULL)
        return NULL;
    return Py_BuildValue("(OdN(LLL))", Py_True, ts, rank, a.counts[0], a.counts[1], a.counts[2]);
}

/* The C ingest loop's entry (ingest_api.h): apply_payload's RUN_NOGIL body (parse, then
 * apply_sliced), called by a thread that already runs without the GIL (core_run's
 * RUN_NOGIL, minus giving the GIL away: it has none) and never takes it. */
static double thread_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int ingest_apply(void *core, uint32_t bit, const uint8_t *data, size_t len, double *ts,
                        int64_t counts[3], double *locked) {
    CoreObject *self = (CoreObject *)core;
    if (!self->ready)
        return KV_APPLY_SLOW;
    apply_ctx a = {0};
    a.bit = bit;
    a.buf = data;
    a.len = len;
    a.sc = scratch_take(self);
    if (a.sc == NULL)
        return KV_APPLY_NOMEM;
    int res = 1, out = KV_APPLY_SLOW;
    a.parsed = parse_batch(&self->core, a.buf, a.len, a.sc);
    if (a.parsed == PARSE_OK) { /* parse_and_apply, the apply timed if asked */
        double start = locked != NULL ? thread_seconds() : 0;
        res = apply_sliced(self, &a);
        if (locked != NULL)
            *locked += thread_seconds() - start;
    }
    if (a.parsed == PARSE_NOMEM || res == 0 || res == RUN_LOCK_FAILED)
        out = KV_APPLY_NOMEM; /* a lock that can't be taken: Python's path says so */
    else if (a.parsed == PARSE_OK)
        out = KV_APPLY_DONE;
    *ts = a.sc->ts;
    for (int i = 0; i < 3; i++)
        counts[i] = a.counts[i];
    scratch_give_back(self, a.sc);
    return out;
}

static const kv_ingest_api INGEST_API = {KV_INGEST_API_VERSION, ingest_apply};

/* ingest_api() -> capsule: the table a C ingest loop applies batches through. */
static PyObject *Core_ingest_api(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    if (!core_ready(self))
        return NULL;
    return PyCapsule_New((void *)&INGEST_API, KV_INGEST_API_NAME, NULL);
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
    if (!int_arg(obj, "an op's number"))
        return 0;
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
static int op_from_tuple(CoreObject *self, scratch_t *sc, PyObject *t, PyObject *keep) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 1 || !PyUnicode_Check(PyTuple_GET_ITEM(t, 0))) {
        PyErr_SetString(PyExc_TypeError, "an op is a tuple starting with its kind");
        return 0;
    }
    const char *kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(t, 0));
    if (kind == NULL)
        return 0;
    if (KV_GROW(sc->ops, sc->ops_cap, (uint64_t)sc->nops + 1) != 0) {
        PyErr_NoMemory();
        return 0;
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
    /* A tuple of its own, kept in `keep` until the batch is applied: bytes hashes are
     * read by pointer without the GIL, and a list could change meanwhile. */
    PyObject *hashes = PySequence_Tuple(PyTuple_GET_ITEM(t, 1));
    if (hashes == NULL || PyList_Append(keep, hashes) < 0) {
        Py_XDECREF(hashes);
        return 0;
    }
    Py_DECREF(hashes); /* `keep` holds it */
    Py_ssize_t n = PyTuple_GET_SIZE(hashes);
    if (KV_GROW(sc->hashes, sc->hashes_cap, (uint64_t)sc->nhashes + (uint64_t)n) != 0) {
        PyErr_NoMemory();
        return 0;
    }
    op->hashes_off = sc->nhashes;
    op->nhashes = (uint32_t)n;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!hash_arg(PyTuple_GET_ITEM(hashes, i), &sc->hashes[sc->nhashes + i]))
            return 0;
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
    PyObject *keys = PySequence_Tuple(PyTuple_GET_ITEM(t, 3));
    if (keys == NULL)
        return 0;
    Py_ssize_t nk = PyTuple_GET_SIZE(keys);
    if (KV_GROW(sc->keys, sc->keys_cap, (uint64_t)sc->nkeys + (uint64_t)nk) != 0) {
        Py_DECREF(keys);
        PyErr_NoMemory();
        return 0;
    }
    op->keys_off = sc->nkeys;
    op->nkeys = (uint32_t)nk;
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *k = PyTuple_GET_ITEM(keys, i);
        if (!PyBytes_Check(k)) {
            Py_DECREF(keys);
            PyErr_SetString(PyExc_TypeError, "a key is bytes");
            return 0;
        }
        sc->keys[sc->nkeys + i] = key_digest(&self->core, (const uint8_t *)PyBytes_AS_STRING(k),
                                             (size_t)PyBytes_GET_SIZE(k));
    }
    Py_DECREF(keys); /* digested: nothing points into it */
    sc->nkeys += (uint32_t)nk;
    if (!int_arg(PyTuple_GET_ITEM(t, 4), "an op's token count"))
        return 0;
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
        if (KV_GROW(sc->tokens, sc->tokens_cap, (uint64_t)sc->ntokens + count) != 0) {
            PyErr_NoMemory();
            return 0;
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
        !opt_str(PyTuple_GET_ITEM(t, 9), &op->salt) || !flag_arg(PyTuple_GET_ITEM(t, 10), &op->keyed))
        return 0;
    op->lora_id = lora_id;
    if (!opt_str(PyTuple_GET_ITEM(t, 11), &op->medium) ||
        !opt_group(PyTuple_GET_ITEM(t, 12), &op->group, &op->has_group, &op->group_big) ||
        !opt_str(PyTuple_GET_ITEM(t, 13), &op->spec_kind) ||
        !opt_int(PyTuple_GET_ITEM(t, 14), &op->window, &op->has_window))
        return 0;
    op->has_spec = op->spec_kind.p != NULL;
    if (!int_arg(PyTuple_GET_ITEM(t, 15), "an op's unrecognised count"))
        return 0;
    op->unrecognised = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, 15));
    if (PyErr_Occurred() || !flag_arg(PyTuple_GET_ITEM(t, 16), &op->bigram) ||
        !flag_arg(PyTuple_GET_ITEM(t, 17), &op->own))
        return 0;
    sc->nops++;
    return 1;
}

/* apply_ops(bit, ops): apply a batch the Python decoder made (as apply_payload does). */
static PyObject *Core_apply_ops(CoreObject *self, PyObject *const *args, Py_ssize_t nargs) {
    apply_ctx a = {0};
    if (!core_entry(self, "apply_ops", nargs, 2, 2) || !bit_arg(args[0], &a.bit))
        return NULL;
    /* The ops as a tuple of our own, and every op's hashes (kept in `keep`): the spans
     * point into their objects, read without the GIL until the batch is applied. */
    PyObject *ops = PySequence_Tuple(args[1]);
    PyObject *keep = ops ? PyList_New(0) : NULL;
    if (keep == NULL) {
        Py_XDECREF(ops);
        return NULL;
    }
    scratch_t sc = {0};
    a.sc = &sc;
    int ok = 1;
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(ops); i++)
        ok = op_from_tuple(self, &sc, PyTuple_GET_ITEM(ops, i), keep);
    int res = ok ? core_run(self, RUN_NOGIL, apply_sliced, &a) : 0;
    scratch_free(&sc);
    Py_DECREF(keep);
    Py_DECREF(ops);
    if (!ok || res == RUN_LOCK_FAILED)
        return NULL;
    if (res == 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* A publisher's bit and a flag: clear's, remove's and keep_*'s context. */
typedef struct {
    uint32_t bit;
    uint8_t flag;
    int res;
} bit_ctx;

static int clear_body(CoreObject *self, void *ctx) {
    bit_ctx *x = ctx;
    source_t *s = source_get(&self->core, x->bit, 0);
    if (s != NULL) {
        source_clear(&self->core, s);
        s->stats.restarts += x->flag;
    }
    return 0;
}

/* clear(bit, restart): drop what the publisher holds (a restart also counts one). */
static PyObject *Core_clear(CoreObject *self, PyObject *const *args, Py_ssize_t nargs) {
    bit_ctx x = {0};
    if (!core_entry(self, "clear", nargs, 2, 2) || !bit_arg(args[0], &x.bit))
        return NULL;
    int restart = PyObject_IsTrue(args[1]);
    if (restart < 0)
        return NULL;
    x.flag = (uint8_t)restart;
    if (core_run(self, RUN_WRITE_NOGIL, clear_body, &x) == RUN_LOCK_FAILED)
        return NULL;
    Py_RETURN_NONE;
}

static int remove_body(CoreObject *self, void *ctx) {
    source_remove(&self->core, ((bit_ctx *)ctx)->bit);
    return 0;
}

static PyObject *Core_remove(CoreObject *self, PyObject *bit_obj) {
    bit_ctx x = {0};
    if (!core_ready(self) || !bit_arg(bit_obj, &x.bit))
        return NULL;
    if (core_run(self, RUN_WRITE_NOGIL, remove_body, &x) == RUN_LOCK_FAILED)
        return NULL;
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
    /* PyDict_New may have run a collection that let another lookup fill the slot
     * meanwhile: that one stays, this one is only returned (it was leaked before). */
    if (d != NULL && slot != NULL && *slot == NULL) {
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

/* Whether `layout` has the shape make_rows reads without checks: a list of (name, [(rank,
 * bit), ...]) with one pair at least, ranks and bits ints. 0 with a TypeError set. */
static int layout_ok(PyObject *layout) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(layout); i++) {
        PyObject *entry = PyList_GET_ITEM(layout, i);
        int ok = PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 2 &&
                 PyList_Check(PyTuple_GET_ITEM(entry, 1)) &&
                 PyList_GET_SIZE(PyTuple_GET_ITEM(entry, 1)) > 0;
        for (Py_ssize_t k = 0; ok && k < PyList_GET_SIZE(PyTuple_GET_ITEM(entry, 1)); k++) {
            PyObject *pair = PyList_GET_ITEM(PyTuple_GET_ITEM(entry, 1), k);
            ok = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 &&
                 PyLong_Check(PyTuple_GET_ITEM(pair, 0)) && PyLong_Check(PyTuple_GET_ITEM(pair, 1));
        }
        if (!ok) {
            PyErr_SetString(PyExc_TypeError, "a layout is [(name, [(rank, bit), ...]), ...]");
            return 0;
        }
    }
    return 1;
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
    uint32_t default_key;  /* that tree size as the core keys it (BIGRAM_TREE kept); 0: none */
    reuse_t *reuses;
    int oom;
} walked_t;

static void walk_free(walked_t *w) {
    free(w->answers);
    free(w->reuses);
}

/* A prompt's block keys per tree size, made by one shard's walk and taken by the next:
 * the shards of an index share one digest seed, so the keys are the same in each, and a
 * lookup over N shards digests the prompt once, not N times (the digest of a long prompt
 * is most of what walking a shard that does not hold it costs). Keys are reused only for
 * the seed they were made with. */
typedef struct {
    uint64_t seed;
    uint32_t n;
    uint32_t size[16]; /* tree sizes as the core keys them (BIGRAM_TREE kept) */
    uint32_t nkeys[16];
    uint64_t *keys[16];
} key_cache;

static void key_cache_free(key_cache *kc) {
    for (uint32_t i = 0; i < kc->n; i++)
        free(kc->keys[i]);
    kc->n = 0;
}

/* The prompt's keys for tree size `size` into `keys` (room for ntokens + 1): from `kc` if
 * a walk with this seed made them, else digested (and kept in `kc`, if it has room and
 * memory: else only not kept). Returns how many. */
static uint32_t size_keys(const core_t *c, const prompt_t *prompt, uint32_t size, uint64_t *keys,
                          key_cache *kc) {
    uint32_t ntokens = prompt->n;
    if (kc != NULL && kc->n && kc->seed == c->seed)
        for (uint32_t i = 0; i < kc->n; i++)
            if (kc->size[i] == size) {
                memcpy(keys, kc->keys[i], (size_t)kc->nkeys[i] * sizeof(uint64_t));
                return kc->nkeys[i];
            }
    uint32_t n = size & BIGRAM_TREE
                     ? prompt_bigram_keys(c, prompt->small, prompt->wide, ntokens,
                                          BLOCK_SIZE(size), keys)
                     : prompt_keys(c, prompt->small, prompt->wide, ntokens, size, keys);
    if (kc == NULL || kc->n >= 16 || (kc->n && kc->seed != c->seed))
        return n;
    uint64_t *copy = malloc(((size_t)n + 1) * sizeof(uint64_t));
    if (copy != NULL) {
        memcpy(copy, keys, (size_t)n * sizeof(uint64_t));
        kc->seed = c->seed;
        kc->size[kc->n] = size;
        kc->nkeys[kc->n] = n;
        kc->keys[kc->n++] = copy;
    }
    return n;
}

/* A lookup's context: its arguments as C, what the walk found, and the result. */
typedef struct {
    span_t lora, salt; /* names: resolved in the body, under the lock (issue 23) */
    prompt_t prompt;
    own_keys own;
    walked_t w;
    /* lookup, lookup_local: the answer's shape, its empty rows' maker, the row type */
    PyObject *layout, *empty_rows, *row_type, *rows;
    /* lookup_local */
    uint64_t *hashes;
    uint32_t nhashes, want_size;
    /* lookup_json */
    slot_t *slots;
    int32_t *ranks;
    uint32_t nslots;
    jbuf_t out;
    int hit;
    key_cache *keys_made; /* over shards: the keys a walk made, for the next (else NULL) */
} lookup_ctx;

static void lookup_ctx_free(lookup_ctx *x) {
    prompt_free(&x->prompt);
    free(x->own.keys);
    walk_free(&x->w);
    free(x->hashes);
    free(x->slots);
    free(x->ranks);
    jbuf_free(&x->out);
}

/* The lookup's LoRA name and salt as the core's name ids; `unknown`: one was given that
 * no namespace has (nothing matches). Reads the name table: under the lock only. */
static void lookup_names(const core_t *c, const lookup_ctx *x, uint32_t *lora_id,
                         uint32_t *salt_id, int *unknown) {
    *lora_id = x->lora.p ? find_name(c, x->lora.p, x->lora.len) : 0;
    *salt_id = x->salt.p ? find_name(c, x->salt.p, x->salt.len) : 0;
    *unknown = (x->lora.p && !*lora_id) || (x->salt.p && !*salt_id);
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
                        uint32_t salt_id, int unknown, const own_keys *own, walked_t *out,
                        key_cache *kc) {
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
    out->default_key = nsizes ? sizes[0] : 0;
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
        uint32_t nkeys = size_keys(c, prompt, sizes[k], keys, kc);
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
    out->default_key = nsizes ? sizes[0] : 0;
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

/* The answer's rows from the walk (a RUN_READ body's last step): the empty rows of the
 * walk's default size, then make_rows. The rows need the pools (by_tier): built before
 * the lock goes, with the GIL kept (ingest never needs the GIL while it holds the write
 * lock). 0, or -1 with an error set. */
static int lookup_rows(CoreObject *self, lookup_ctx *x) {
    if (x->w.oom) {
        PyErr_NoMemory();
        return -1;
    }
    if (!layout_ok(x->layout))
        return -1;
    /* The empty rows of the layout passed: the index's own may be replaced meanwhile by a
     * publisher joining or leaving (issue 27 point 5). */
    PyObject *empty = PyObject_CallFunction(x->empty_rows, "IOI", x->w.default_size, x->layout,
                                            x->w.default_key);
    if (empty != NULL &&
        (!PyList_Check(empty) || PyList_GET_SIZE(empty) != PyList_GET_SIZE(x->layout))) {
        PyErr_SetString(PyExc_ValueError, "empty rows do not match the layout");
        Py_CLEAR(empty);
    }
    if (empty != NULL)
        x->rows = make_rows(self, x->layout, empty, x->row_type, x->w.answers, x->w.nbits);
    Py_XDECREF(empty);
    return x->rows != NULL ? 0 : -1;
}

static int lookup_local_body(CoreObject *self, void *ctx) {
    lookup_ctx *x = ctx;
    const core_t *c = &self->core;
    if (!c->local_on) {
        PyErr_SetString(PyExc_RuntimeError, "the core keeps no local hashes");
        return -1;
    }
    uint32_t lora_id = x->lora.p ? find_name(c, x->lora.p, x->lora.len) : 0;
    if (x->lora.p && !lora_id) /* an adapter no namespace has: nothing matches */
        walk_local(c, x->hashes, 0, 0, 1, 0xFFFFFFFFu, &x->w);
    else
        walk_local(c, x->hashes, x->nhashes, lora_id, x->lora.p != NULL, x->want_size, &x->w);
    return lookup_rows(self, x);
}

/* lookup_local(hashes, lora_name, block_size, layout, empty_rows, row_type) -> [row, ...]

   FleetIndex.lookup_local_hashes: `hashes` u64 or i64 ints (Dynamo's local block hashes),
   `lora_name` None or a name (only its namespaces), `block_size` None or a size. */
static PyObject *Core_lookup_local(CoreObject *self, PyObject *const *args, Py_ssize_t nargs) {
    lookup_ctx x = {0};
    if (!core_entry(self, "lookup_local", nargs, 6, 6) || !opt_str(args[1], &x.lora))
        return NULL;
    if (!PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "layout must be a list");
        return NULL;
    }
    x.layout = args[3], x.empty_rows = args[4], x.row_type = args[5];
    if (args[2] != Py_None) {
        if (!int_arg(args[2], "block_size"))
            return NULL;
        unsigned long v = PyLong_AsUnsignedLong(args[2]);
        if (PyErr_Occurred())
            return NULL;
        if (v == 0 || v >= (1UL << 31)) /* no tree has it: nothing matches */
            v = 0xFFFFFFFFUL;
        x.want_size = (uint32_t)v;
    }
    PyObject *fast = PySequence_Fast(args[0], "hashes must be a sequence of ints");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    x.hashes = malloc(((size_t)n + 1) * sizeof(uint64_t));
    if (x.hashes == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    x.nhashes = (uint32_t)n;
    for (Py_ssize_t i = 0; i < n && !PyErr_Occurred(); i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(fast, i);
        /* modulo 2^64, as localhash.as_unsigned: an i64 from the wire is its u64 */
        if (int_arg(o, "a local hash"))
            x.hashes[i] = PyLong_AsUnsignedLongLongMask(o);
    }
    Py_DECREF(fast);
    int res = PyErr_Occurred() ? -1 : core_run(self, RUN_READ, lookup_local_body, &x);
    lookup_ctx_free(&x);
    return res == 0 ? x.rows : NULL;
}

static int keep_local_body(CoreObject *self, void *ctx) {
    return keep_local_hashes(&self->core, ((bit_ctx *)ctx)->flag);
}

/* keep_local_hashes(on): keep Dynamo's local block hashes (only before the first block). */
static PyObject *Core_keep_local_hashes(CoreObject *self, PyObject *on) {
    bit_ctx x = {0};
    if (!core_ready(self) || !flag_arg(on, &x.flag))
        return NULL;
    int res = core_run(self, RUN_WRITE_NOGIL, keep_local_body, &x);
    if (res == RUN_LOCK_FAILED)
        return NULL;
    if (res < 0) {
        PyErr_SetString(PyExc_ValueError, "local hashes are kept from the first block only");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The prompt-lookups' common arguments: token_ids, lora_name, cache_salt and the
 * optional own keys (args[own_at] if given). 1, or 0 with an error set. */
static int lookup_args(CoreObject *self, PyObject *const *args, Py_ssize_t nargs,
                       Py_ssize_t own_at, lookup_ctx *x) {
    return opt_str(args[1], &x->lora) && opt_str(args[2], &x->salt) &&
           own_arg(self, nargs > own_at ? args[own_at] : NULL, &x->own) &&
           tokens_arg(args[0], &x->prompt);
}

static void walk_body(const core_t *c, lookup_ctx *x) {
    uint32_t lora_id, salt_id;
    int unknown;
    lookup_names(c, x, &lora_id, &salt_id, &unknown);
    walk_prompt(c, &x->prompt, lora_id, salt_id, unknown, &x->own, &x->w, x->keys_made);
}

static int lookup_body(CoreObject *self, void *ctx) {
    lookup_ctx *x = ctx;
    walk_body(&self->core, x);
    return lookup_rows(self, x);
}

/* lookup(token_ids, lora_name, cache_salt, layout, empty_rows, row_type[, own]) -> [row, ...]

   What every instance would reuse of the prompt: FleetIndex.lookup. `layout` is the
   answer's shape (IndexBase._lay_out), `empty_rows(size, layout, key)` the shared rows of
   instances matching nothing (`key`: that size as the core keys it, 0 when none is walked), `row_type` LookupRow. `token_ids`: ints, or bytes of uint32 in native
   order (parse_lookup's). `own`: the blocks keyed by the lookup's own keys (own_arg). */
static PyObject *Core_lookup(CoreObject *self, PyObject *const *args, Py_ssize_t nargs) {
    lookup_ctx x = {0};
    if (!core_entry(self, "lookup", nargs, 6, 7))
        return NULL;
    if (!PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "layout must be a list");
        return NULL;
    }
    x.layout = args[3], x.empty_rows = args[4], x.row_type = args[5];
    int res = lookup_args(self, args, nargs, 6, &x) ? core_run(self, RUN_READ, lookup_body, &x) : -1;
    lookup_ctx_free(&x);
    return res == 0 ? x.rows : NULL;
}

/* The runtime's instances (a list of (name_json, [rank, bit, rank, bit, ...]) by name, see
 * CompiledIndex.lookup_json) and their statuses (a list of JSON strings as bytes) as
 * slot_t; the rank arrays go in `ranks`. 0 with an error set on a bad shape. Ints only
 * (int_arg): nothing of Python runs between the two passes, so the lists stay as sized. */
static int slots_arg(PyObject *slots_obj, PyObject *statuses, lookup_ctx *x) {
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
    slot_t *slots = x->slots = calloc((size_t)n + 1, sizeof(slot_t));
    int32_t *ranks = x->ranks = malloc(((size_t)total + 1) * sizeof(int32_t));
    if (slots == NULL || ranks == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    x->nslots = (uint32_t)n;
    Py_ssize_t left = total;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *slot = PyList_GET_ITEM(slots_obj, i), *pairs = PyTuple_GET_ITEM(slot, 1);
        PyObject *status = PyList_GET_ITEM(statuses, i);
        if (!PyBytes_Check(status)) {
            PyErr_SetString(PyExc_TypeError, "a status is its JSON string, as bytes");
            return 0;
        }
        Py_ssize_t count = PyList_GET_SIZE(pairs);
        if (count > left) { /* the lists changed since they were counted */
            PyErr_SetString(PyExc_RuntimeError, "slots changed while read");
            return 0;
        }
        left -= count;
        slots[i].name_json = PyBytes_AS_STRING(PyTuple_GET_ITEM(slot, 0));
        slots[i].name_len = (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(slot, 0));
        slots[i].status_json = PyBytes_AS_STRING(status);
        slots[i].status_len = (size_t)PyBytes_GET_SIZE(status);
        slots[i].down = slots[i].status_len == 6 && memcmp(slots[i].status_json, "\"down\"", 6) == 0;
        slots[i].nranks = (uint32_t)(count / 2);
        slots[i].ranks = ranks;
        for (Py_ssize_t k = 0; k < count; k++) {
            PyObject *v = PyList_GET_ITEM(pairs, k);
            if (!int_arg(v, "a rank or bit"))
                return 0;
            long r = PyLong_AsLong(v);
            if (r == -1 && PyErr_Occurred())
                return 0;
            *ranks++ = (int32_t)r;
        }
    }
    return 1;
}

/* C only (answer_json): the GIL is kept all the same, as for every question (see the top
 * of this file): given away for these ~30 us, it could take a busy ingest thread's whole
 * switch interval to get back. */
static int lookup_json_body(CoreObject *self, void *ctx) {
    lookup_ctx *x = ctx;
    walk_body(&self->core, x);
    if (!x->w.oom)
        x->hit = answer_json(&self->core, x->w.answers, x->w.nbits, x->slots, x->nslots, 1, &x->out);
    return 0;
}

/* lookup_json(token_ids, lora_name, cache_salt, slots, statuses[, own]) -> (json bytes, hit)

   Core.lookup and the runtime's answer (Fleet.lookup encoded) in one go: see answer.h. */
static PyObject *Core_lookup_json(CoreObject *self, PyObject *const *args, Py_ssize_t nargs) {
    lookup_ctx x = {0};
    PyObject *result = NULL;
    if (!core_entry(self, "lookup_json", nargs, 5, 6))
        return NULL;
    if (slots_arg(args[3], args[4], &x) && lookup_args(self, args, nargs, 5, &x) &&
        core_run(self, RUN_READ, lookup_json_body, &x) == 0) {
        if (x.w.oom || x.out.oom)
            PyErr_NoMemory();
        else
            result = Py_BuildValue("(y#O)", x.out.p, (Py_ssize_t)x.out.len, x.hit ? Py_True : Py_False);
    }
    lookup_ctx_free(&x);
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

/* lookup_hashes' context: the hashes asked about, then the rows. */
typedef struct {
    phash *ph;
    hkey *hk;
    uint8_t *known;
    Py_ssize_t n;
    PyObject *rows;
} hashes_ctx;

/* Per publisher: the run of the hashes its GPU pools hold from the first, then the run
 * its lower tiers hold. A RUN_READ body (it builds the rows). */
/* The asked hashes as the core's keys (under the lock: bytes are looked up among the
 * interned); a bytes hash no pool ever held is unknown. */
static void hashes_keys(const core_t *c, const phash *ph, hkey *hk, uint8_t *known, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!known[i])
            continue;
        if (ph[i].kind == HK_BYTES) {
            uint32_t id = find_bytes(c, ph[i].p, ph[i].len);
            hk[i] = (hkey){id, HK_BYTES};
            known[i] = id != 0;
        } else {
            hk[i] = (hkey){ph[i].v, ph[i].kind};
        }
    }
}

/* A publisher's run of the hashes (hashes_keys'): those its GPU pools hold from the first,
 * then the fastest lower tier holding each next one; `by_tier` filled. */
static Py_ssize_t hashes_run(const source_t *s, const hkey *hk, const uint8_t *known,
                             Py_ssize_t n, uint32_t by_tier[TIER_COUNT]) {
    memset(by_tier, 0, TIER_COUNT * sizeof(uint32_t));
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
    return d;
}

static int lookup_hashes_body(CoreObject *self, void *ctx) {
    hashes_ctx *x = ctx;
    const core_t *c = &self->core;
    Py_ssize_t n = x->n;
    hashes_keys(c, x->ph, x->hk, x->known, n);
    for (uint32_t b = 0; x->rows && b < c->max_bit; b++) {
        const source_t *s = c->sources[b];
        if (s == NULL)
            continue;
        uint32_t by_tier[TIER_COUNT];
        Py_ssize_t d = hashes_run(s, x->hk, x->known, n, by_tier);
        if (d == 0)
            continue;
        PyObject *tiers = tier_dict(by_tier);
        PyObject *row = tiers ? Py_BuildValue("(InN)", b, d, tiers) : NULL;
        if (row == NULL || PyList_Append(x->rows, row) < 0)
            Py_CLEAR(x->rows);
        Py_XDECREF(row);
    }
    return x->rows != NULL ? 0 : -1;
}

/* lookup_hashes(hashes) -> [(bit, blocks, by_tier), ...]: see lookup_hashes_body. */
static PyObject *Core_lookup_hashes(CoreObject *self, PyObject *hashes_obj) {
    if (!core_ready(self))
        return NULL;
    /* A tuple of our own: bytes hashes are read by pointer (the GIL is kept, but a
     * row's allocation may run a collection, and a finalizer could change a list). */
    PyObject *hashes = PySequence_Tuple(hashes_obj);
    if (hashes == NULL)
        return NULL;
    hashes_ctx x = {0};
    x.n = PyTuple_GET_SIZE(hashes);
    x.ph = malloc(((size_t)x.n + 1) * sizeof(phash));
    x.hk = malloc(((size_t)x.n + 1) * sizeof(hkey));
    x.known = malloc((size_t)x.n + 1);
    x.rows = x.ph && x.hk && x.known ? PyList_New(0) : NULL;
    int ok = x.rows != NULL;
    if (!ok && !PyErr_Occurred())
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; ok && i < x.n; i++)
        ok = query_hash_arg(PyTuple_GET_ITEM(hashes, i), &x.ph[i], &x.known[i]);
    if (ok && core_run(self, RUN_READ, lookup_hashes_body, &x) != 0)
        ok = 0;
    free(x.ph), free(x.hk), free(x.known);
    Py_DECREF(hashes);
    if (!ok)
        Py_CLEAR(x.rows);
    return x.rows;
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

/* A question about one publisher (pools, pool_keys, pool_hashes, hashes, count, stats):
 * its bit and arguments, and the answer. */
typedef struct {
    uint32_t bit;
    uint32_t index; /* pool_hashes: the pool */
    span_t medium;  /* hashes, count */
    int64_t group;  /* count */
    uint8_t big, known;
    phash ph;
    unsigned long copies;
    source_stats stats;
    PyObject *out;
} pub_ctx;

/* (group, medium) of a pool, as Python: new reference, or NULL with an error set. */
static PyObject *pool_key(const core_t *c, const pool_t *p) {
    PyObject *medium = str_object(c, p->medium);
    PyObject *group = medium ? group_object(p->group, p->group_big) : NULL;
    PyObject *key = group ? PyTuple_Pack(2, group, medium) : NULL;
    Py_XDECREF(medium);
    Py_XDECREF(group);
    return key;
}

/* A pool's {hash: copies}: new reference, or NULL with an error set. */
static PyObject *pool_copies(const core_t *c, const source_t *s, const pool_t *p) {
    PyObject *d = PyDict_New();
    PMAP_FOREACH(&p->blocks, e) {
        if (d == NULL)
            break;
        uint32_t kind = pmap_b(e);
        const map_entry *x =
            s->extra.count ? map_find(&s->extra, e->a, kind | ((uint32_t)p->index << 8)) : NULL;
        PyObject *k = hash_object(c, e->a, kind);
        PyObject *v = PyLong_FromUnsignedLong(1 + (x ? x->value : 0));
        if (!k || !v || PyDict_SetItem(d, k, v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    return d;
}

/* Append `item` (a new reference, or NULL with an error set) to `*out`; the list is
 * cleared on any failure. The item's reference is given up either way. */
static void append_or_clear(PyObject **out, PyObject *item) {
    if (*out != NULL && (item == NULL || PyList_Append(*out, item) < 0))
        Py_CLEAR(*out);
    Py_XDECREF(item);
}

static int pools_body(CoreObject *self, void *ctx) {
    pub_ctx *x = ctx;
    const core_t *c = &self->core;
    const source_t *s = source_get(&self->core, x->bit, 0);
    for (uint32_t i = 0; x->out && s && i < s->npools; i++) {
        const pool_t *p = &s->pools[i];
        PyObject *key = pool_key(c, p), *d = key ? pool_copies(c, s, p) : NULL;
        PyObject *row = d ? PyTuple_Pack(3, PyTuple_GET_ITEM(key, 0), PyTuple_GET_ITEM(key, 1), d)
                          : NULL;
        Py_XDECREF(key);
        Py_XDECREF(d);
        append_or_clear(&x->out, row);
    }
    return x->out != NULL ? 0 : -1;
}

static int pool_keys_body(CoreObject *self, void *ctx) {
    pub_ctx *x = ctx;
    const source_t *s = source_get(&self->core, x->bit, 0);
    for (uint32_t i = 0; x->out && s && i < s->npools; i++)
        append_or_clear(&x->out, pool_key(&self->core, &s->pools[i]));
    return x->out != NULL ? 0 : -1;
}

static int pool_hashes_body(CoreObject *self, void *ctx) {
    pub_ctx *x = ctx;
    const source_t *s = source_get(&self->core, x->bit, 0);
    if (s == NULL || x->index >= s->npools)
        return 0;
    PMAP_FOREACH(&s->pools[x->index].blocks, e) {
        append_or_clear(&x->out, hash_object(&self->core, e->a, pmap_b(e)));
        if (x->out == NULL)
            return -1;
    }
    return 0;
}

/* A question about publisher `bit` whose answer is a list: `body` under the read lock. */
static PyObject *pub_list(CoreObject *self, pub_ctx *x, core_body body) {
    x->out = PyList_New(0);
    if (x->out == NULL)
        return NULL;
    if (core_run(self, RUN_READ, body, x) != 0)
        Py_CLEAR(x->out);
    return x->out;
}

/* pools(bit) -> [(group, medium, {hash: copies}), ...] */
static PyObject *Core_pools(CoreObject *self, PyObject *bit_obj) {
    pub_ctx x = {0};
    if (!core_ready(self) || !bit_arg(bit_obj, &x.bit))
        return NULL;
    return pub_list(self, &x, pools_body);
}

/* pool_keys(bit) -> [(group, medium), ...] in the order the pools came. */
static PyObject *Core_pool_keys(CoreObject *self, PyObject *bit_obj) {
    pub_ctx x = {0};
    if (!core_ready(self) || !bit_arg(bit_obj, &x.bit))
        return NULL;
    return pub_list(self, &x, pool_keys_body);
}

/* pool_hashes(bit, index) -> [hash, ...] of one pool. */
static PyObject *Core_pool_hashes(CoreObject *self, PyObject *const *args, Py_ssize_t nargs) {
    pub_ctx x = {0};
    if (!core_entry(self, "pool_hashes", nargs, 2, 2) || !bit_arg(args[0], &x.bit) ||
        !int_arg(args[1], "a pool index"))
        return NULL;
    unsigned long index = PyLong_AsUnsignedLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    x.index = index > UINT32_MAX ? UINT32_MAX : (uint32_t)index;
    return pub_list(self, &x, pool_hashes_body);
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

typedef struct {
    const uint32_t *bits;
    Py_ssize_t nbits;
    medium_count *media;
    uint32_t nmedia;
    map_t all;
    uint64_t most;
    int ok;
} distinct_ctx;

/* A RUN_READ_NOGIL body: C only. */
static int distinct_body(CoreObject *self, void *ctx) {
    distinct_ctx *x = ctx;
    const core_t *c = &self->core;
    uint32_t filled = 0; /* pools holding something: one (most instances) needs no union */
    x->most = distinct_pass(c, x->bits, x->nbits, x->media, &x->nmedia, NULL, &x->ok, &filled);
    if (x->ok && filled > 1) {
        /* Sized first: a pool's entries come in the order of their hash, and put into a
         * table smaller than the pool's they would pile up in one run (quadratic). */
        x->ok = x->most * 5 / 4 + 8 <= UINT32_MAX &&
                map_grow(&x->all, (uint32_t)(x->most * 5 / 4 + 8)) == 0;
        for (uint32_t m = 0; x->ok && m < x->nmedia; m++)
            x->ok = map_grow(&x->media[m].seen, (uint32_t)(x->media[m].most * 5 / 4 + 8)) == 0;
        if (x->ok)
            distinct_pass(c, x->bits, x->nbits, x->media, &x->nmedia, &x->all, &x->ok, &filled);
        for (uint32_t m = 0; m < x->nmedia; m++)
            x->media[m].most = x->media[m].seen.count;
        x->most = x->all.count;
    }
    return 0;
}

static PyObject *Core_distinct(CoreObject *self, PyObject *bits_obj) {
    if (!core_ready(self))
        return NULL;
    PyObject *fast = PySequence_Tuple(bits_obj);
    if (fast == NULL)
        return NULL;
    distinct_ctx x = {0};
    x.nbits = PyTuple_GET_SIZE(fast);
    uint32_t *bits = malloc(((size_t)x.nbits + 1) * sizeof(uint32_t));
    x.media = calloc((size_t)x.nbits * MAX_POOLS + 1, sizeof(medium_count));
    x.bits = bits;
    x.ok = bits != NULL && x.media != NULL;
    for (Py_ssize_t i = 0; x.ok && i < x.nbits; i++)
        x.ok = bit_arg(PyTuple_GET_ITEM(fast, i), &bits[i]);
    Py_DECREF(fast);
    map_init(&x.all);
    if (x.ok && core_run(self, RUN_READ_NOGIL, distinct_body, &x) == RUN_LOCK_FAILED)
        x.ok = -1;
    PyObject *by_medium = x.ok == 1 ? PyDict_New() : NULL;
    for (uint32_t m = 0; m < x.nmedia; m++) {
        if (by_medium != NULL) {
            PyObject *name = PyUnicode_DecodeUTF8(x.media[m].name, x.media[m].len, "replace");
            PyObject *count = PyLong_FromUnsignedLongLong(x.media[m].most);
            if (name == NULL || count == NULL || PyDict_SetItem(by_medium, name, count) < 0)
                Py_CLEAR(by_medium);
            Py_XDECREF(name);
            Py_XDECREF(count);
        }
        map_free(&x.media[m].seen);
        free(x.media[m].name);
    }
    map_free(&x.all);
    free(x.media);
    free(bits);
    if (by_medium == NULL)
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    return Py_BuildValue("(KN)", (unsigned long long)x.most, by_medium);
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

static int hashes_body(CoreObject *self, void *ctx) {
    pub_ctx *x = ctx;
    const core_t *c = &self->core;
    const source_t *s = source_get(&self->core, x->bit, 0);
    for (uint32_t i = 0; x->out && s && i < s->npools; i++) {
        const pool_t *p = &s->pools[i];
        if (x->medium.p != NULL && !medium_matches(c, p->medium, x->medium))
            continue;
        PMAP_FOREACH(&p->blocks, e) {
            append_or_clear(&x->out, hash_object(c, e->a, pmap_b(e)));
            if (x->out == NULL)
                break;
        }
    }
    return x->out != NULL ? 0 : -1;
}

/* hashes(bit, medium|None) -> [hash, ...]: every pool entry (a hash held in two pools comes
   twice: the caller makes the set), of pools of that medium or tier, or all. */
static PyObject *Core_hashes(CoreObject *self, PyObject *const *args, Py_ssize_t nargs) {
    pub_ctx x = {0};
    if (!core_entry(self, "hashes", nargs, 2, 2) || !bit_arg(args[0], &x.bit) ||
        !opt_str(args[1], &x.medium))
        return NULL;
    return pub_list(self, &x, hashes_body);
}

static int count_body(CoreObject *self, void *ctx) {
    pub_ctx *x = ctx;
    const core_t *c = &self->core;
    const source_t *s = source_get(&self->core, x->bit, 0);
    uint32_t mid = x->medium.p ? find_str(c, x->medium.p, x->medium.len) : 0;
    hkey h = {x->ph.v, x->ph.kind};
    if (x->ph.kind == HK_BYTES)
        h.v = find_bytes(c, x->ph.p, x->ph.len);
    for (uint32_t i = 0; s && mid && (x->ph.kind != HK_BYTES || h.v) && i < s->npools; i++) {
        const pool_t *p = &s->pools[i];
        if (p->group != x->group || p->group_big != x->big || p->medium != mid)
            continue;
        if (pmap_find(&p->blocks, h.v, h.kind) != NULL) {
            const map_entry *e = map_find(&s->extra, h.v, h.kind | ((uint32_t)p->index << 8));
            x->copies = 1 + (e ? e->value : 0);
        }
    }
    return 0;
}

/* count(bit, group, medium, hash) -> copies held in that pool (0 if none). */
static PyObject *Core_count(CoreObject *self, PyObject *const *args, Py_ssize_t nargs) {
    pub_ctx x = {0};
    uint8_t has_group;
    if (!core_entry(self, "count", nargs, 4, 4))
        return NULL;
    if (!PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "group: an int");
        return NULL;
    }
    if (!opt_group(args[1], &x.group, &has_group, &x.big) || !bit_arg(args[0], &x.bit) ||
        !opt_str(args[2], &x.medium) || !query_hash_arg(args[3], &x.ph, &x.known))
        return NULL;
    if (!x.known)
        return PyLong_FromLong(0);
    if (core_run(self, RUN_READ, count_body, &x) != 0)
        return NULL;
    return PyLong_FromUnsignedLong(x.copies);
}

static int stats_body(CoreObject *self, void *ctx) {
    pub_ctx *x = ctx;
    const source_t *s = source_get(&self->core, x->bit, 0);
    if (s != NULL)
        x->stats = s->stats;
    return 0;
}

/* stats(bit) -> (stored, removed, clears, batches, restarts, unplaced, unrecognised_keys,
   namespace_kept, namespace_moved) */
static PyObject *Core_stats(CoreObject *self, PyObject *bit_obj) {
    pub_ctx x = {0};
    if (!core_ready(self) || !bit_arg(bit_obj, &x.bit) ||
        core_run(self, RUN_READ, stats_body, &x) != 0)
        return NULL;
    const source_stats *st = &x.stats;
    return Py_BuildValue("(LLLLLLLLL)", st->stored, st->removed, st->clears, st->batches,
                         st->restarts, st->unplaced, st->unrecognised_keys, st->namespace_kept,
                         st->namespace_moved);
}

/* The whole core's figures: entries, tree_nodes, memory, tree_sizes. */
typedef struct {
    unsigned long long entries, nodes;
    unsigned long long pools, side, node_bytes, children, sets, tokens, local;
    uint32_t sizes[16], nsizes;
} core_figures;

static int entries_body(CoreObject *self, void *ctx) {
    core_figures *f = ctx;
    for (uint32_t b = 0; b < self->core.max_bit; b++) {
        const source_t *s = self->core.sources[b];
        for (uint32_t i = 0; s && i < s->npools; i++)
            f->entries += s->pools[i].blocks.count;
    }
    f->nodes = self->core.live_nodes - self->core.nns; /* roots aside */
    f->nsizes = self->core.nsizes;
    memcpy(f->sizes, self->core.sizes, f->nsizes * sizeof(uint32_t));
    return 0;
}

static PyObject *Core_entries(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    core_figures f = {0};
    if (!core_ready(self) || core_run(self, RUN_READ, entries_body, &f) != 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(f.entries);
}

static PyObject *Core_tree_nodes(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    core_figures f = {0};
    if (!core_ready(self) || core_run(self, RUN_READ, entries_body, &f) != 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(f.nodes);
}

static int memory_body(CoreObject *self, void *ctx) {
    core_figures *f = ctx;
    const core_t *c = &self->core;
    for (uint32_t b = 0; b < c->max_bit; b++) {
        const source_t *s = c->sources[b];
        if (s == NULL)
            continue;
        f->side += sizeof(source_t) + map_bytes(&s->extra) + map_bytes(&s->refs) + map_bytes(&s->where);
        for (uint32_t i = 0; i < s->npools; i++)
            f->pools += pmap_bytes(&s->pools[i].blocks);
    }
    f->node_bytes = (unsigned long long)c->nodes_cap * sizeof(node_t);
    f->children = pmap_bytes(&c->children);
    f->sets = (unsigned long long)c->sets_cap * c->set_words * 8;
    f->tokens = (unsigned long long)c->set_tokens_cap * sizeof(uint32_t *) + c->token_slab_bytes;
    f->local = c->local_on ? map_bytes(&c->local) + (unsigned long long)c->nodes_cap * 12 : 0;
    return 0;
}

/* memory() -> {part: bytes} of the structures (not malloc's own overhead). */
static PyObject *Core_memory(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    core_figures f = {0};
    if (!core_ready(self) || core_run(self, RUN_READ, memory_body, &f) != 0)
        return NULL;
    return Py_BuildValue("{sKsKsKsKsKsKsK}", "nodes", f.node_bytes, "children", f.children,
                         "pools", f.pools, "holder_sets", f.sets, "shared_tokens", f.tokens,
                         "publishers", f.side, "local_hashes", f.local);
}

static PyObject *one_bit(uint32_t bit) {
    PyObject *one = PyLong_FromLong(1), *shift = PyLong_FromUnsignedLong(bit);
    PyObject *out = one && shift ? PyNumber_Lshift(one, shift) : NULL;
    Py_XDECREF(one);
    Py_XDECREF(shift);
    return out;
}

/* A namespace's LoRA (None, its name, or its int lora_id) and salt (None or a name):
 * new references in *lora and *salt, 0 with an error set (both NULL then). */
static int ns_names(const core_t *c, namespace_t ns, PyObject **lora, PyObject **salt) {
    if (ns.lora == 0) {
        *lora = Py_NewRef(Py_None);
    } else if (c->names.items[ns.lora].len && c->names.items[ns.lora].data[0] == 0xff) {
        /* "\xff" + the lora_id's digits (see resolve): the int again */
        char digits[32] = {0};
        const blob_t *b = &c->names.items[ns.lora];
        memcpy(digits, b->data + 1, b->len - 1 < sizeof digits - 1 ? b->len - 1 : sizeof digits - 1);
        *lora = PyLong_FromString(digits, NULL, 10);
    } else {
        *lora = blob_object(&c->names, ns.lora);
    }
    *salt = ns.salt ? blob_object(&c->names, ns.salt) : Py_NewRef(Py_None);
    if (*lora != NULL && *salt != NULL)
        return 1;
    Py_CLEAR(*lora);
    Py_CLEAR(*salt);
    return 0;
}

/* One node's row of walk_tree: new reference, or NULL with an error set. */
static PyObject *node_row(const core_t *c, uint32_t n, PyObject *lora, PyObject *salt,
                          uint32_t size, uint32_t depth) {
    const node_t *node = &c->nodes[n];
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
                            : Py_NewRef(Py_None);
    PyObject *row = NULL;
    if (holders && tokens)
        row = Py_BuildValue("(OOIIKOO)", lora, salt, size, depth,
                            (unsigned long long)(((uint64_t)node->key_hi << 32) | node->key_lo),
                            tokens, holders);
    Py_XDECREF(holders);
    Py_XDECREF(tokens);
    return row;
}

typedef struct {
    uint32_t *first, *next, *stack; /* children lists: first child, next sibling; the walk */
    PyObject *out;
} walk_ctx;

/* A RUN_READ body: every namespace's nodes, depth first, into x->out. */
static int walk_tree_body(CoreObject *self, void *ctx) {
    walk_ctx *x = ctx;
    const core_t *c = &self->core;
    x->first = calloc(c->nnodes + 1, sizeof(uint32_t));
    x->next = calloc(c->nnodes + 1, sizeof(uint32_t));
    x->stack = malloc((c->nnodes + 1) * sizeof(uint32_t) * 2);
    if (!x->first || !x->next || !x->stack) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t *first = x->first, *next = x->next, *stack = x->stack;
    PMAP_FOREACH(&c->children, e) {
        uint32_t child = pmap_value(e), parent = c->nodes[child].parent;
        next[child] = first[parent];
        first[parent] = child;
    }
    for (uint32_t k = 0; k < c->nns; k++) {
        namespace_t ns = c->ns[k];
        PyObject *lora, *salt;
        if (!ns_names(c, ns, &lora, &salt))
            return -1;
        uint32_t top = 0;
        for (uint32_t ch = first[ns.root]; ch; ch = next[ch]) {
            stack[top++] = ch;
            stack[top++] = 1;
        }
        while (top && x->out) {
            uint32_t depth = stack[--top];
            uint32_t n = stack[--top];
            if (is_partial(c, n))
                continue; /* a partial-block entry: not a block of this tree's size */
            append_or_clear(&x->out, node_row(c, n, lora, salt, ns.size, depth));
            for (uint32_t ch = first[n]; ch; ch = next[ch]) {
                stack[top++] = ch;
                stack[top++] = depth + 1;
            }
        }
        Py_DECREF(lora);
        Py_DECREF(salt);
        if (x->out == NULL)
            return -1;
    }
    return 0;
}

/* walk_tree() -> [(lora, salt, size, depth, digest, tokens|None, holders), ...]: every node,
   depth first, parents before children (fleet.py's walk_tree; siblings in no set order).
   Tokens are there for nodes two publishers hold, unless keep_tokens(False) (core.h).
   `lora` is the name, or the int lora_id; `holders` the publishers' bits as an int. */
static PyObject *Core_walk_tree(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    walk_ctx x = {0};
    if (!core_ready(self) || (x.out = PyList_New(0)) == NULL)
        return NULL;
    if (core_run(self, RUN_READ, walk_tree_body, &x) != 0)
        Py_CLEAR(x.out);
    free(x.first), free(x.next), free(x.stack);
    return x.out;
}

/* keep_tokens(on), set_slice(n): a setting, under the write lock. */
typedef struct {
    uint8_t keep;
    uint32_t slice;
} setting_ctx;

static int keep_tokens_body(CoreObject *self, void *ctx) {
    self->core.keep_tokens = ((setting_ctx *)ctx)->keep;
    return 0;
}

static PyObject *Core_keep_tokens(CoreObject *self, PyObject *on) {
    setting_ctx x = {0};
    int keep;
    if (!core_ready(self) || (keep = PyObject_IsTrue(on)) < 0)
        return NULL;
    x.keep = (uint8_t)keep;
    if (core_run(self, RUN_WRITE_NOGIL, keep_tokens_body, &x) == RUN_LOCK_FAILED)
        return NULL;
    Py_RETURN_NONE;
}

static int set_slice_body(CoreObject *self, void *ctx) {
    self->slice = ((setting_ctx *)ctx)->slice;
    return 0;
}

/* set_slice(n): apply batches n hashes at a time (tests: small streams cross slices). */
static PyObject *Core_set_slice(CoreObject *self, PyObject *n_obj) {
    setting_ctx x = {0};
    if (!core_ready(self) || !int_arg(n_obj, "a slice"))
        return NULL;
    unsigned long n = PyLong_AsUnsignedLong(n_obj);
    if (PyErr_Occurred())
        return NULL;
    if (n == 0 || n > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a slice is 1 to 2**32-1 hashes");
        return NULL;
    }
    x.slice = (uint32_t)n;
    if (core_run(self, RUN_WRITE_NOGIL, set_slice_body, &x) == RUN_LOCK_FAILED)
        return NULL;
    Py_RETURN_NONE;
}

/* tree_sizes() -> [size, ...]: the tree sizes with a namespace now (what a lookup walks). */
static PyObject *Core_tree_sizes(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    core_figures f = {0};
    if (!core_ready(self) || core_run(self, RUN_READ, entries_body, &f) != 0)
        return NULL;
    PyObject *out = PyList_New(f.nsizes);
    for (uint32_t i = 0; out && i < f.nsizes; i++) {
        PyObject *v = PyLong_FromUnsignedLong(f.sizes[i]);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* key_digest(data) -> the core's digest of a tree key (reads only the seed: no lock). */
static PyObject *Core_key_digest(CoreObject *self, PyObject *data) {
    if (!core_ready(self))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t d = key_digest(&self->core, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(d);
}

/* tier_of(medium) -> its tier's name. From the name alone: nothing of the core is read
 * (it interned the medium for the core's life before: issue 27 point 3). */
static PyObject *Core_tier_of(CoreObject *self, PyObject *medium) {
    span_t name;
    if (!core_ready(self))
        return NULL;
    if (!PyUnicode_Check(medium)) {
        PyErr_SetString(PyExc_TypeError, "a medium is a str");
        return NULL;
    }
    if (!opt_str(medium, &name))
        return NULL;
    return PyUnicode_FromString(TIER_NAMES[tier_of_bytes(name.p, name.len)]);
}

/* pause_slices(on): tests only. On: a batch applied in slices waits after each slice
   until resume_slices() (or pause_slices(False)); slices_paused() says how many wait. */
static PyObject *Core_pause_slices(CoreObject *self, PyObject *on) {
    uint8_t flag;
    if (!core_ready(self) || !flag_arg(on, &flag))
        return NULL;
    pthread_mutex_lock(&self->pause_lock);
    __atomic_store_n(&self->pause_on, flag, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&self->pause_cond);
    pthread_mutex_unlock(&self->pause_lock);
    Py_RETURN_NONE;
}

static PyObject *Core_slices_paused(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    if (!core_ready(self))
        return NULL;
    pthread_mutex_lock(&self->pause_lock);
    int paused = self->paused;
    pthread_mutex_unlock(&self->pause_lock);
    return PyLong_FromLong(paused);
}

static PyObject *Core_resume_slices(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    if (!core_ready(self))
        return NULL;
    pthread_mutex_lock(&self->pause_lock);
    self->resumes++;
    pthread_cond_broadcast(&self->pause_cond);
    pthread_mutex_unlock(&self->pause_lock);
    Py_RETURN_NONE;
}

/* -- lookups outside Python (lookup_api.h) ----------------------------------------- */

/* lookup_api_t.answer_tokens's work under the read lock: the names resolved, the walk,
 * the answer (Core_lookup_json's, from C strings and with no Python object). */
typedef struct {
    const lookup_body_t *body;
    const slot_t *slots;
    uint32_t nslots;
    uint64_t sources_gen;
    jbuf_t *out;
    walked_t w;
    int hit, stale;
} api_lookup;

/* The walk of a parsed lookup body (names resolved under the lock). */
static void api_walk(const core_t *c, const lookup_body_t *b, walked_t *w, key_cache *kc) {
    prompt_t prompt = {.small = b->tokens, .wide = NULL, .n = b->ntokens};
    own_keys own = {NULL, 0};
    uint32_t lora_id = b->lora ? find_name(c, (const uint8_t *)b->lora, (uint32_t)b->lora_len) : 0;
    uint32_t salt_id = b->salt ? find_name(c, (const uint8_t *)b->salt, (uint32_t)b->salt_len) : 0;
    int unknown = (b->lora && !lora_id) || (b->salt && !salt_id);
    walk_prompt(c, &prompt, lora_id, salt_id, unknown, &own, w, kc);
}

static int api_tokens_body(CoreObject *self, void *ctx) {
    api_lookup *a = ctx;
    const core_t *c = &self->core;
    if (c->sources_gen != a->sources_gen) {
        a->stale = 1;
        return 0;
    }
    api_walk(c, a->body, &a->w, NULL);
    if (!a->w.oom)
        a->hit = answer_json(c, a->w.answers, a->w.nbits, a->slots, a->nslots, 1, a->out);
    return 0;
}

/* One shard's part of a lookup over an index in shards (the lookup thread's): its
 * generation and its answers, made under its lock (their pools pinned); the JSON is
 * written after, from all of them. `request`: the lookup_body_t or hashes_body_t. */
typedef struct {
    const void *request;
    uint64_t gen;
    walked_t w;
    key_cache *keys_made; /* one for all the parts of a lookup by tokens */
} shard_part;

static int shard_walk_body(CoreObject *self, void *ctx) {
    shard_part *part = ctx;
    part->gen = self->core.sources_gen;
    api_walk(&self->core, part->request, &part->w, part->keys_made);
    if (!part->w.oom)
        answers_pin_pools(&self->core, part->w.answers, part->w.nbits);
    return 0;
}

/* The shards' answers as one index's (each bit is one shard's publisher). NULL: no
 * memory. */
static answer_t *merge_by_bit(const walked_t *const *walks, Py_ssize_t n, uint32_t *nbits) {
    uint32_t bits = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        bits = walks[i]->nbits > bits ? walks[i]->nbits : bits;
    answer_t *merged = calloc((size_t)bits + 1, sizeof(answer_t));
    if (merged == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        for (uint32_t b = 0; b < walks[i]->nbits; b++) {
            const answer_t *a = &walks[i]->answers[b];
            if (a->blocks || a->detail)
                merged[b] = *a;
        }
    *nbits = bits;
    return merged;
}

/* The JSON answer of the shards' walks, merged by bit (written from the answers alone:
 * their pools were pinned). 0, `*hit` set; -1: no memory. */
static int answer_merged(const walked_t *const *walks, Py_ssize_t n, const slot_t *slots,
                         uint32_t nslots, int by_tokens, jbuf_t *out, int *hit) {
    uint32_t nbits = 0;
    answer_t *merged = merge_by_bit(walks, n, &nbits);
    if (merged == NULL)
        return -1;
    *hit = answer_json(NULL, merged, nbits, slots, nslots, by_tokens, out);
    free(merged);
    return out->oom ? -1 : 0;
}

/* A lookup over a tuple of Cores (an index in shards): `part_body` makes each shard's
 * part under its lock; `sources_gen` is the sum of their generations when the slots were
 * made (each only grows: the sum is the same only if each is), checked against the sum
 * they had while read. Reads the tuple without the GIL: it is immutable and kept alive by
 * the caller, as a Core is. */
static int answer_over_shards(PyObject *cores, core_body part_body, const void *request,
                              int by_tokens, const slot_t *slots, uint32_t nslots,
                              uint64_t sources_gen, jbuf_t *out, int *hit) {
    Py_ssize_t n = PyTuple_GET_SIZE(cores);
    shard_part *parts = calloc((size_t)n + 1, sizeof(shard_part));
    const walked_t **walks = calloc((size_t)n + 1, sizeof(walked_t *));
    key_cache keys_made = {0};
    int res = LOOKUP_NOMEM;
    uint64_t gen = 0;
    *hit = 0;
    if (parts == NULL || walks == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        CoreObject *core = (CoreObject *)PyTuple_GET_ITEM(cores, i);
        parts[i].request = request;
        parts[i].keys_made = &keys_made;
        walks[i] = &parts[i].w;
        if (!core->ready) {
            res = LOOKUP_NOT_READY;
            goto done;
        }
        if (core_locked(core, 0, part_body, &parts[i]) == RUN_LOCK_FAILED) {
            res = LOOKUP_STALE;
            goto done;
        }
        if (parts[i].w.oom)
            goto done;
        gen += parts[i].gen;
    }
    if (gen != sources_gen) {
        res = LOOKUP_STALE;
        goto done;
    }
    if (answer_merged(walks, n, slots, nslots, by_tokens, out, hit) == 0)
        res = LOOKUP_ANSWERED;
done:
    key_cache_free(&keys_made);
    for (Py_ssize_t i = 0; parts != NULL && i < n; i++)
        walk_free(&parts[i].w);
    free(parts);
    free(walks);
    return res;
}

static int api_answer_tokens(void *core, const lookup_body_t *body, const slot_t *slots,
                             uint32_t nslots, uint64_t sources_gen, jbuf_t *out, int *hit) {
    if (PyTuple_Check((PyObject *)core))
        return answer_over_shards(core, shard_walk_body, body, 1, slots, nslots, sources_gen,
                                  out, hit);
    CoreObject *self = core;
    if (!self->ready)
        return LOOKUP_NOT_READY;
    api_lookup a = {body, slots, nslots, sources_gen, out, {0}, 0, 0};
    *hit = 0;
    if (core_locked(self, 0, api_tokens_body, &a) == RUN_LOCK_FAILED)
        return LOOKUP_STALE; /* Python answers it (and says what went wrong) */
    int oom = a.w.oom || out->oom;
    walk_free(&a.w);
    if (a.stale)
        return LOOKUP_STALE;
    *hit = a.hit;
    return oom ? LOOKUP_NOMEM : LOOKUP_ANSWERED;
}

/* lookup_api_t.answer_hashes's work under the read lock: Core_lookup_hashes's walk, the
 * answer as Fleet.lookup_hashes encodes it (by_group empty, no tokens). */
typedef struct {
    const hashes_body_t *body;
    const slot_t *slots;
    uint32_t nslots;
    uint64_t sources_gen;
    jbuf_t *out;
    int hit, stale, oom;
} api_hashes;

/* Core_lookup_hashes's walk into `w` (answers and reuses by bit), under the read lock. */
static void hashes_answers(const core_t *c, const hashes_body_t *body, walked_t *w) {
    Py_ssize_t n = body->n;
    uint32_t bits = c->max_bit;
    hkey *hk = malloc(((size_t)n + 1) * sizeof(hkey));
    uint8_t *known = malloc((size_t)n + 1);
    answer_t *answers = w->answers = calloc((size_t)bits + 1, sizeof(answer_t));
    reuse_t *reuses = w->reuses = calloc((size_t)bits + 1, sizeof(reuse_t));
    w->nbits = bits;
    if (hk == NULL || known == NULL || answers == NULL || reuses == NULL) {
        w->oom = 1;
    } else {
        memset(known, 1, (size_t)n + 1);
        hashes_keys(c, body->hashes, hk, known, n);
        for (uint32_t b = 0; b < bits; b++) {
            const source_t *s = c->sources[b];
            if (s == NULL)
                continue;
            Py_ssize_t d = hashes_run(s, hk, known, n, reuses[b].by_tier);
            if (d == 0)
                continue;
            reuses[b].blocks = (uint32_t)d;
            reuses[b].several = 1;
            answers[b] = (answer_t){(uint32_t)d, 0, &reuses[b]};
        }
    }
    free(hk);
    free(known);
}

static int api_hashes_body(CoreObject *self, void *ctx) {
    api_hashes *a = ctx;
    const core_t *c = &self->core;
    if (c->sources_gen != a->sources_gen) {
        a->stale = 1;
        return 0;
    }
    walked_t w = {0};
    hashes_answers(c, a->body, &w);
    if (w.oom)
        a->oom = 1;
    else
        a->hit = answer_json(c, w.answers, w.nbits, a->slots, a->nslots, 0, a->out);
    walk_free(&w);
    return 0;
}

static int shard_hashes_body(CoreObject *self, void *ctx) {
    shard_part *part = ctx;
    part->gen = self->core.sources_gen;
    hashes_answers(&self->core, part->request, &part->w);
    return 0; /* answers by hashes always have their detail: nothing to pin */
}

static int api_answer_hashes(void *core, const hashes_body_t *body, const slot_t *slots,
                             uint32_t nslots, uint64_t sources_gen, jbuf_t *out, int *hit) {
    if (PyTuple_Check((PyObject *)core))
        return answer_over_shards(core, shard_hashes_body, body, 0, slots, nslots, sources_gen,
                                  out, hit);
    CoreObject *self = core;
    if (!self->ready)
        return LOOKUP_NOT_READY;
    api_hashes a = {body, slots, nslots, sources_gen, out, 0, 0, 0};
    *hit = 0;
    if (core_locked(self, 0, api_hashes_body, &a) == RUN_LOCK_FAILED || a.stale)
        return LOOKUP_STALE;
    if (a.oom || out->oom)
        return LOOKUP_NOMEM;
    *hit = a.hit;
    return LOOKUP_ANSWERED;
}

static void api_body_free(lookup_body_t *body) {
    free(body->tokens);
    body->tokens = NULL;
}

static lookup_api_t LOOKUP_API = {
    .version = LOOKUP_API_VERSION,
    .parse_tokens = parse_lookup_body,
    .answer_tokens = api_answer_tokens,
    .body_free = api_body_free,
    .parse_hashes = parse_hashes_body,
    .answer_hashes = api_answer_hashes,
    .hashes_free = hashes_body_free,
    .jbuf_free = jbuf_free,
};

/* sources_gen() -> int: moves whenever the core makes or removes a publisher (see
   lookup_api.h: what the slots of an answer made outside Python are checked against). */
static int sources_gen_body(CoreObject *self, void *ctx) {
    *(uint64_t *)ctx = self->core.sources_gen;
    return 0;
}

static PyObject *Core_sources_gen(CoreObject *self, PyObject *Py_UNUSED(unused)) {
    uint64_t gen = 0;
    if (!core_ready(self) || core_run(self, RUN_READ, sources_gen_body, &gen) != 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(gen);
}

static PyMethodDef Core_methods[] = {
    {"pause_slices", (PyCFunction)Core_pause_slices, METH_O, NULL},
    {"slices_paused", (PyCFunction)Core_slices_paused, METH_NOARGS, NULL},
    {"resume_slices", (PyCFunction)Core_resume_slices, METH_NOARGS, NULL},
    {"apply_payload", (PyCFunction)(void (*)(void))Core_apply_payload, METH_FASTCALL, NULL},
    {"apply_ops", (PyCFunction)(void (*)(void))Core_apply_ops, METH_FASTCALL, NULL},
    {"clear", (PyCFunction)(void (*)(void))Core_clear, METH_FASTCALL, NULL},
    {"ingest_api", (PyCFunction)Core_ingest_api, METH_NOARGS, NULL},
    {"remove", (PyCFunction)Core_remove, METH_O, NULL},
    {"lookup", (PyCFunction)(void (*)(void))Core_lookup, METH_FASTCALL, NULL},
    {"lookup_json", (PyCFunction)(void (*)(void))Core_lookup_json, METH_FASTCALL, NULL},
    {"sources_gen", (PyCFunction)Core_sources_gen, METH_NOARGS, NULL},
    {"lookup_hashes", (PyCFunction)Core_lookup_hashes, METH_O, NULL},
    {"pools", (PyCFunction)Core_pools, METH_O, NULL},
    {"pool_keys", (PyCFunction)Core_pool_keys, METH_O, NULL},
    {"pool_hashes", (PyCFunction)(void (*)(void))Core_pool_hashes, METH_FASTCALL, NULL},
    {"hashes", (PyCFunction)(void (*)(void))Core_hashes, METH_FASTCALL, NULL},
    {"count", (PyCFunction)(void (*)(void))Core_count, METH_FASTCALL, NULL},
    {"stats", (PyCFunction)Core_stats, METH_O, NULL},
    {"entries", (PyCFunction)Core_entries, METH_NOARGS, NULL},
    {"tree_nodes", (PyCFunction)Core_tree_nodes, METH_NOARGS, NULL},
    {"memory", (PyCFunction)Core_memory, METH_NOARGS, NULL},
    {"walk_tree", (PyCFunction)Core_walk_tree, METH_NOARGS, NULL},
    {"key_digest", (PyCFunction)Core_key_digest, METH_O, NULL},
    {"tree_sizes", (PyCFunction)Core_tree_sizes, METH_NOARGS, NULL},
    {"lookup_local", (PyCFunction)(void (*)(void))Core_lookup_local, METH_FASTCALL, NULL},
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

/* fail_allocs(n): tests only. The n-th allocation of the core's C from now fails, once
   (alloc.h); 0 turns it off. Returns how many were still to go. */
static PyObject *core_fail_allocs(PyObject *module, PyObject *n_obj) {
    (void)module;
    long n = PyLong_AsLong(n_obj);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(__atomic_exchange_n(&kv_fail_countdown, n < 0 ? 0 : n, __ATOMIC_RELAXED));
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

/* -- an index in shards (kvindex.index.sharded) ----------------------------------------- */

/* The walk of one shard, its answers' pools pinned while its read lock is held. */
static int walk_pinned_body(CoreObject *self, void *ctx) {
    lookup_ctx *x = ctx;
    walk_body(&self->core, x);
    if (!x->w.oom)
        answers_pin_pools(&self->core, x->w.answers, x->w.nbits);
    return 0;
}

/* lookup_json_shards(cores, token_ids, lora_name, cache_salt, slots, statuses)
       -> (json bytes, hit)

   Core.lookup_json over an index in shards (a tuple of Cores): each shard walked under
   its own read lock (a batch is applied within one shard: no answer sees half of one),
   the answers merged by bit, then the JSON written from them alone (answers_pin_pools).
   The prompt is read once; every shard walks it with its own names. */
static PyObject *lookup_json_shards(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) < 1) {
        PyErr_SetString(PyExc_TypeError,
                        "lookup_json_shards(cores, token_ids, lora_name, cache_salt, slots, "
                        "statuses): cores a tuple of one Core or more");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(args[0], i), &CoreType) ||
            !core_ready((CoreObject *)PyTuple_GET_ITEM(args[0], i))) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "cores: Core objects");
            return NULL;
        }
    lookup_ctx *walks = calloc((size_t)n, sizeof(lookup_ctx));
    const walked_t **parts = calloc((size_t)n + 1, sizeof(walked_t *));
    lookup_ctx answer = {0}; /* the slots, the prompt and names, the JSON */
    PyObject *result = NULL;
    key_cache keys_made = {0}; /* the prompt digested once, for every shard */
    if (walks == NULL || parts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (!slots_arg(args[4], args[5], &answer) || !opt_str(args[2], &answer.lora) ||
        !opt_str(args[3], &answer.salt) || !tokens_arg(args[1], &answer.prompt))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        CoreObject *core = (CoreObject *)PyTuple_GET_ITEM(args[0], i);
        walks[i].keys_made = &keys_made;
        walks[i].prompt = answer.prompt; /* borrowed: freed once, with `answer` */
        walks[i].lora = answer.lora;
        walks[i].salt = answer.salt;
        if (core_run(core, RUN_READ, walk_pinned_body, &walks[i]) != 0)
            goto done;
        if (walks[i].w.oom) {
            PyErr_NoMemory();
            goto done;
        }
        parts[i] = &walks[i].w;
    }
    if (answer_merged(parts, n, answer.slots, answer.nslots, 1, &answer.out, &answer.hit))
        PyErr_NoMemory();
    else
        result = Py_BuildValue("(y#O)", answer.out.p, (Py_ssize_t)answer.out.len,
                               answer.hit ? Py_True : Py_False);
done:
    free(parts);
    key_cache_free(&keys_made);
    for (Py_ssize_t i = 0; walks != NULL && i < n; i++) {
        walks[i].prompt = (prompt_t){0};
        lookup_ctx_free(&walks[i]);
    }
    free(walks);
    lookup_ctx_free(&answer);
    return result;
}

static PyMethodDef core_functions[] = {
    {"allocated", core_allocated, METH_NOARGS, NULL},
    {"fail_allocs", core_fail_allocs, METH_O, NULL},
    {"xxh3_64", (PyCFunction)core_xxh3_64, METH_VARARGS, NULL},
    {"parse_lookup", (PyCFunction)parse_lookup, METH_VARARGS, NULL},
    {"lookup_json_shards", (PyCFunction)(void (*)(void))lookup_json_shards, METH_FASTCALL, NULL},
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
    PyObject *api = PyCapsule_New(&LOOKUP_API, LOOKUP_API_CAPSULE, NULL);
    if (api == NULL || PyModule_AddObject(m, "lookup_api", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
