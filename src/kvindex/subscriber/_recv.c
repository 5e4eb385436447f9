/* kvindex.subscriber._recv: take many live messages off a SUB socket in one call.
 *
 * pyzmq costs a few microseconds per frame (three per live message: topic, seq, payload),
 * which at a million block events a second is a good part of a core. This reads the
 * frames with libzmq's own functions -- the very libzmq pyzmq loaded, found in the process
 * and never loaded twice (two copies of libzmq can't share sockets) -- and returns
 * (seq, payload) pairs. Where that libzmq can't be found (a pyzmq that links it
 * statically), `available()` is False and the Subscriber reads with pyzmq as before.
 *
 * The socket is the pyzmq socket's `underlying` address, used by the one thread that owns
 * it (the Subscriber's), with the GIL held (non-blocking reads).
 *
 * The in-order path in C (issue 23): `ingest_live` reads a SUB socket WITHOUT the GIL and,
 * for every message whose seq is the one due, checks it, digests it (CRC-32, as
 * state.payload_digest), and hands it to the compiled core through its capsule
 * (index/csrc/ingest_api.h), which parses and applies it; the payload is never copied into
 * a Python object. The first message that is not the one due -- a gap, a duplicate, a
 * restart, a malformed message, a batch the fast parser does not take -- stops the loop
 * and goes back to Python, undecided: the Python state machine (state.py), brought up to
 * date first (subscriber/inorder.py), decides it as it always did. A `Sequencer` holds
 * what the C path changed meanwhile (next seq, last live seq, recent digests, counters);
 * it is armed by Python only when the Python state is plain (no replay, no held batches,
 * no reconnect check pending), so C only ever takes the one decision Python would take
 * there: deliver.
 *
 * A persistent store must log every batch the index applied. With `keep_payloads` the
 * Sequencer also keeps the payloads of the batches C applied (copied, without the GIL, into
 * one growing buffer, written as msgpack: an array of bin), and `kept()` hands them to
 * Python in one call per read: the first seq, the count and that buffer itself, as a
 * read-only memoryview of a `Packed` that owns it from then on (the Sequencer starts a
 * new buffer), which the store's message carries as it is (the seqs C takes are
 * consecutive) and its link sends as a frame of its own, not copied. So the store still
 * sees every batch, and Python does nothing per batch at all, not even copy its bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h> /* Python.h defined _GNU_SOURCE: dl_iterate_phdr is there */
#include <errno.h>
#include <link.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <zlib.h>

#include "ingest_api.h"

/* libzmq's ABI (zmq.h): a message is 64 opaque bytes, ZMQ_DONTWAIT is 1, EAGAIN is the
 * system's. */
typedef union {
    unsigned char _[64];
    void *align; /* libzmq's zmq_msg_t is aligned like a pointer */
} zmq_msg;

static int (*zmq_msg_init_)(zmq_msg *);
static int (*zmq_msg_recv_)(zmq_msg *, void *, int);
static void *(*zmq_msg_data_)(zmq_msg *);
static size_t (*zmq_msg_size_)(const zmq_msg *);
static int (*zmq_msg_more_)(const zmq_msg *);
static int (*zmq_msg_close_)(zmq_msg *);
static int (*zmq_errno_)(void);
#define ZMQ_DONTWAIT_ 1

static int find_libzmq(struct dl_phdr_info *info, size_t size, void *out) {
    (void)size;
    const char *name = info->dlpi_name;
    if (name != NULL && strstr(name, "libzmq") != NULL) {
        *(const char **)out = name;
        return 1;
    }
    return 0;
}

/* Resolve libzmq's functions from the copy already in the process (pyzmq's). */
static int load_libzmq(void) {
    const char *path = NULL;
    dl_iterate_phdr(find_libzmq, &path);
    if (path == NULL)
        return 0;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        return 0;
    zmq_msg_init_ = (int (*)(zmq_msg *))dlsym(lib, "zmq_msg_init");
    zmq_msg_recv_ = (int (*)(zmq_msg *, void *, int))dlsym(lib, "zmq_msg_recv");
    zmq_msg_data_ = (void *(*)(zmq_msg *))dlsym(lib, "zmq_msg_data");
    zmq_msg_size_ = (size_t(*)(const zmq_msg *))dlsym(lib, "zmq_msg_size");
    zmq_msg_more_ = (int (*)(const zmq_msg *))dlsym(lib, "zmq_msg_more");
    zmq_msg_close_ = (int (*)(zmq_msg *))dlsym(lib, "zmq_msg_close");
    zmq_errno_ = (int (*)(void))dlsym(lib, "zmq_errno");
    return zmq_msg_init_ && zmq_msg_recv_ && zmq_msg_data_ && zmq_msg_size_ && zmq_msg_more_ &&
           zmq_msg_close_ && zmq_errno_;
}

static int ready = -1; /* -1: not looked yet */

static PyObject *available(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    if (ready < 0) {
        /* pyzmq's own module loads libzmq; import it first so it is in the process. */
        PyObject *zmq = PyImport_ImportModule("zmq");
        if (zmq == NULL)
            return NULL;
        Py_DECREF(zmq);
        ready = load_libzmq();
    }
    return PyBool_FromLong(ready);
}

/* Tests only (fail_after): the n-th receive from now fails with this errno, as if
 * libzmq had said so (a signal's EINTR can't be timed from a test). */
static long fail_countdown;
static int fail_errno;

/* zmq_msg_recv without waiting, EINTR retried (a signal arriving mid-call: the rest of a
 * multipart message is there, and pyzmq retries it too). 0, or -1 with *err set. */
static int recv_frame(zmq_msg *m, void *sock, int *err) {
    for (;;) {
        long n = __atomic_load_n(&fail_countdown, __ATOMIC_RELAXED);
        if (n > 0 && __atomic_sub_fetch(&fail_countdown, 1, __ATOMIC_RELAXED) == 0) {
            *err = fail_errno;
        } else if (zmq_msg_recv_(m, sock, ZMQ_DONTWAIT_) >= 0) {
            return 0;
        } else {
            *err = zmq_errno_();
        }
        if (*err != EINTR)
            return -1;
    }
}

/* An error met after messages were read in the same call: those are returned, and the
 * error raised on the socket's next call (issue 27 point 6). Read and written with the
 * GIL held; a few sockets per process at most. */
#define PENDING 64
static struct {
    uintptr_t sock;
    int err;
} pending[PENDING];

static int pending_take(uintptr_t sock) {
    for (int i = 0; i < PENDING; i++)
        if (pending[i].sock == sock) {
            pending[i].sock = 0;
            return pending[i].err;
        }
    return 0;
}

static int pending_put(uintptr_t sock, int err) {
    for (int i = 0; i < PENDING; i++)
        if (pending[i].sock == 0) {
            pending[i].sock = sock;
            pending[i].err = err;
            return 1;
        }
    return 0; /* full: raise now */
}

/* fail_after(n, errno): tests only; see fail_countdown. */
static PyObject *fail_after(PyObject *self, PyObject *args) {
    (void)self;
    long n;
    int err;
    if (!PyArg_ParseTuple(args, "li", &n, &err))
        return NULL;
    fail_errno = err;
    __atomic_store_n(&fail_countdown, n, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

/* recv_live(socket_address, limit) -> [(seq, payload), ...]

   Up to `limit` whole messages, fewer if the socket has no more now. A message that is not
   [topic, 8-byte seq, payload] comes as (-1, number of frames): the caller counts it as
   malformed. An error other than "no message now" ends the call with what was read, and
   raises OSError on the socket's next call (at once if nothing was read). */
static PyObject *recv_live(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long address;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "Kn", &address, &limit))
        return NULL;
    if (ready != 1) {
        PyErr_SetString(PyExc_RuntimeError, "libzmq was not found (call available() first)");
        return NULL;
    }
    void *sock = (void *)(uintptr_t)address;
    int pending_err = pending_take((uintptr_t)address);
    if (pending_err != 0) {
        errno = pending_err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    zmq_msg msg;
    for (Py_ssize_t n = 0; n < limit; n++) {
        int frames = 0, good = 1;
        uint64_t seq = 0;
        PyObject *payload = NULL;
        for (;;) {
            zmq_msg_init_(&msg);
            int err;
            if (recv_frame(&msg, sock, &err) < 0) {
                zmq_msg_close_(&msg);
                if (frames == 0 && err == EAGAIN)
                    return out; /* nothing more now */
                Py_XDECREF(payload);
                if (PyList_GET_SIZE(out) > 0 && pending_put((uintptr_t)address, err))
                    return out; /* what was read; the error on the next call */
                Py_DECREF(out);
                errno = err;
                return PyErr_SetFromErrno(PyExc_OSError);
            }
            size_t size = zmq_msg_size_(&msg);
            const unsigned char *data = zmq_msg_data_(&msg);
            if (frames == 1) {
                if (size == 8) {
                    for (int i = 0; i < 8; i++)
                        seq = (seq << 8) | data[i];
                } else {
                    good = 0;
                }
            } else if (frames == 2) {
                payload = PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)size);
                if (payload == NULL)
                    good = 0;
            }
            frames++;
            int more = zmq_msg_more_(&msg);
            zmq_msg_close_(&msg);
            if (!more)
                break;
        }
        if (PyErr_Occurred()) {
            Py_XDECREF(payload);
            Py_DECREF(out);
            return NULL;
        }
        PyObject *item;
        if (!good || frames != 3) {
            Py_XDECREF(payload);
            item = Py_BuildValue("(ii)", -1, frames);
        } else {
            item = Py_BuildValue("(KN)", (unsigned long long)seq, payload);
        }
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

/* -- the C sequencer ------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    int armed;
    uint64_t next_seq;
    int has_last_live;
    uint64_t last_live;
    uint32_t bit; /* the publisher's bit in the core */
    /* The digests of the batches delivered since armed, a ring of `kept` (seq, crc), its
     * arrays grown as it fills (`cap`): a quiet publisher keeps a few, not `kept`. */
    uint32_t kept, cap;
    uint64_t *ring_seq;
    uint32_t *ring_crc;
    uint64_t pushed;
    /* Since the last take(): what SourceState.stats and the index's bookkeeping get. */
    uint64_t received, delivered;
    int has_ts;
    double last_ts, last_traffic;
    int64_t counts[3]; /* stored, removed, clears */
    /* keep_payloads: the payloads of the batches C applied since the last kept(), as a
     * msgpack array of bin 32 in `kbuf` (klen used of kcap): 5 bytes for the array's
     * header (written by kept()), then per payload 0xc6, its size (u32, big-endian) and
     * its bytes. `kcount` of them, the first of seq `kfirst`, the rest following it. */
    int keep;
    unsigned char *kbuf;
    size_t klen, kcap;
    uint64_t kfirst;
    Py_ssize_t kcount;
} SequencerObject;

/* A read stops taking batches once this much is kept (it resumes at the next read, after
   Python took them): a bound on a read's memory however large the batches are. */
#define KEEP_LIMIT ((size_t)64 << 20)

/* -- Packed: a kept buffer handed over ------------------------------------------------- */

/* What kept() hands to Python: the Sequencer's buffer of packed payloads, owned by this
 * object from then on and freed with it; read through the buffer protocol, read-only
 * (kept() returns a memoryview of it). Made only by kept(): Python can't create one. */
typedef struct {
    PyObject_HEAD
    unsigned char *data; /* malloc'd (or NULL), freed in dealloc */
    Py_ssize_t size;
} PackedObject;

static int Packed_getbuffer(PackedObject *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->data, self->size, 1, flags);
}

static void Packed_dealloc(PackedObject *self) {
    free(self->data);
    PyObject_Free(self);
}

static PyBufferProcs Packed_as_buffer = {
    .bf_getbuffer = (getbufferproc)Packed_getbuffer,
};

static PyTypeObject PackedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvindex.subscriber._recv.Packed",
    .tp_basicsize = sizeof(PackedObject),
    .tp_dealloc = (destructor)Packed_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Payloads the C path kept, packed (Sequencer.kept() returns a memoryview of it).",
    .tp_as_buffer = &Packed_as_buffer,
};

static int Sequencer_init(SequencerObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"digests_kept", "keep_payloads", NULL};
    unsigned int kept = 4096;
    int keep = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|Ip", names, &kept, &keep))
        return -1;
    if (kept == 0 || kept > (1u << 24)) {
        PyErr_SetString(PyExc_ValueError, "digests_kept must be 1 to 2**24");
        return -1;
    }
    free(self->ring_seq);
    free(self->ring_crc);
    self->ring_seq = NULL;
    self->ring_crc = NULL;
    self->cap = 0;
    self->kept = kept;
    self->armed = 0;
    self->pushed = 0;
    free(self->kbuf);
    self->kbuf = NULL;
    self->klen = self->kcap = 0;
    self->kcount = 0;
    self->keep = keep;
    return 0;
}

static void Sequencer_dealloc(SequencerObject *self) {
    free(self->ring_seq);
    free(self->ring_crc);
    free(self->kbuf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Whether `seq` is the batch due, the one decision C takes (state.py's on_live, in the
 * plain state: not at or below the last live seq, and the next one). */
static inline int in_order(const SequencerObject *s, uint64_t seq) {
    return s->armed && seq == s->next_seq && !(s->has_last_live && seq <= s->last_live);
}

/* Room in the ring for the next digest: the arrays grown (doubling, up to `kept`) while it
   has not wrapped yet. 0: out of memory (the batch is then left to Python). No GIL needed. */
static int ring_room(SequencerObject *s) {
    if (s->pushed >= s->kept || s->pushed < s->cap)
        return 1;
    uint32_t cap = s->cap ? s->cap * 2 : 16;
    if (cap > s->kept)
        cap = s->kept;
    uint64_t *seqs = realloc(s->ring_seq, sizeof(uint64_t) * cap);
    if (seqs == NULL)
        return 0;
    s->ring_seq = seqs;
    uint32_t *crcs = realloc(s->ring_crc, sizeof(uint32_t) * cap);
    if (crcs == NULL)
        return 0;
    s->ring_crc = crcs;
    s->cap = cap;
    return 1;
}

#define KEEP_HEADER 5 /* msgpack array 32: 0xdd and the count (u32, big-endian) */

/* A msgpack marker byte and a u32, big-endian. */
static void put_u32(unsigned char *at, unsigned char marker, uint32_t n) {
    at[0] = marker;
    at[1] = (unsigned char)(n >> 24);
    at[2] = (unsigned char)(n >> 16);
    at[3] = (unsigned char)(n >> 8);
    at[4] = (unsigned char)n;
}

/* Room to keep one more payload of `size` bytes (keep_payloads). 0: too large or out of
   memory (the batch is then left to Python, which records it itself). No GIL needed. */
static int keep_room(SequencerObject *s, size_t size) {
    if (size > UINT32_MAX || s->kcount >= (Py_ssize_t)UINT32_MAX)
        return 0;
    size_t need = (s->kcount ? s->klen : KEEP_HEADER) + 5 + size;
    if (need <= s->kcap)
        return 1;
    size_t cap = s->kcap ? s->kcap : 64 * 1024;
    while (cap < need)
        cap *= 2;
    unsigned char *buf = realloc(s->kbuf, cap);
    if (buf == NULL)
        return 0;
    s->kbuf = buf;
    s->kcap = cap;
    return 1;
}

/* Keep the payload of the batch `seq` just applied; the caller made room (keep_room). */
static void keep_payload(SequencerObject *s, uint64_t seq, const void *data, size_t size) {
    if (s->kcount == 0) {
        s->kfirst = seq;
        s->klen = KEEP_HEADER;
    }
    unsigned char *at = s->kbuf + s->klen;
    put_u32(at, 0xc6, (uint32_t)size); /* msgpack bin 32 */
    memcpy(at + 5, data, size);
    s->klen += 5 + size;
    s->kcount++;
}

/* Record the delivery of the batch due (state.py's on_live + _deliver, plain state); the
   caller made room (ring_room). */
static inline void take_in_order(SequencerObject *s, uint64_t seq, uint32_t crc, double now) {
    uint64_t at = s->pushed++ % s->kept;
    s->ring_seq[at] = seq;
    s->ring_crc[at] = crc;
    s->next_seq = seq + 1;
    s->has_last_live = 1;
    s->last_live = seq;
    s->received++;
    s->delivered++;
    s->last_traffic = now;
}

static double clock_now(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* time.monotonic()'s clock */
static double monotonic_now(void) { return clock_now(CLOCK_MONOTONIC); }

static uint32_t digest_of(const void *data, size_t size) {
    /* zlib.crc32(payload), as state.payload_digest (zlib takes uInt lengths) */
    uLong crc = crc32(0L, Z_NULL, 0);
    const Bytef *p = data;
    while (size > 0) {
        uInt n = size > (1u << 30) ? (1u << 30) : (uInt)size;
        crc = crc32(crc, p, n);
        p += n;
        size -= n;
    }
    return (uint32_t)crc;
}

/* arm(next_seq, last_live, bit): C takes the batches due from now on. */
static PyObject *Sequencer_arm(SequencerObject *self, PyObject *args) {
    unsigned long long next_seq, bit;
    PyObject *last_live;
    if (!PyArg_ParseTuple(args, "KOK", &next_seq, &last_live, &bit))
        return NULL;
    if (last_live != Py_None) {
        unsigned long long v = PyLong_AsUnsignedLongLong(last_live);
        if (v == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
        self->has_last_live = 1;
        self->last_live = v;
    } else {
        self->has_last_live = 0;
    }
    self->next_seq = next_seq;
    self->bit = (uint32_t)bit;
    self->pushed = 0;
    self->armed = 1;
    Py_RETURN_NONE;
}

static PyObject *Sequencer_disarm(SequencerObject *self, PyObject *Py_UNUSED(unused)) {
    self->armed = 0;
    self->pushed = 0;
    Py_RETURN_NONE;
}

/* offer(seq, payload, now) -> bool: the sequencing decision alone (no apply): True, and
   recorded as delivered, if C takes it; False: it is Python's to decide. */
static PyObject *Sequencer_offer(SequencerObject *self, PyObject *args) {
    unsigned long long seq;
    Py_buffer payload;
    double now;
    if (!PyArg_ParseTuple(args, "Ky*d", &seq, &payload, &now))
        return NULL;
    int take = in_order(self, seq);
    if (take && !ring_room(self)) {
        PyBuffer_Release(&payload);
        return PyErr_NoMemory();
    }
    if (take)
        take_in_order(self, seq, digest_of(payload.buf, (size_t)payload.len), now);
    PyBuffer_Release(&payload);
    return PyBool_FromLong(take);
}

/* take() -> (received, delivered, next_seq, last_live, last_ts, last_traffic, (stored,
   removed, clears)): what changed since the last take (counts), and where it stands. */
static PyObject *Sequencer_take(SequencerObject *self, PyObject *Py_UNUSED(unused)) {
    PyObject *last_live = self->has_last_live ? PyLong_FromUnsignedLongLong(self->last_live)
                                              : (Py_INCREF(Py_None), Py_None);
    PyObject *ts = self->has_ts ? PyFloat_FromDouble(self->last_ts) : (Py_INCREF(Py_None), Py_None);
    PyObject *traffic = self->delivered ? PyFloat_FromDouble(self->last_traffic)
                                        : (Py_INCREF(Py_None), Py_None);
    PyObject *out = NULL;
    if (last_live != NULL && ts != NULL && traffic != NULL)
        out = Py_BuildValue("(KKKOOO(LLL))", (unsigned long long)self->received,
                            (unsigned long long)self->delivered,
                            (unsigned long long)self->next_seq, last_live, ts, traffic,
                            (long long)self->counts[0], (long long)self->counts[1],
                            (long long)self->counts[2]);
    Py_XDECREF(last_live);
    Py_XDECREF(ts);
    Py_XDECREF(traffic);
    if (out != NULL) {
        self->received = self->delivered = 0;
        self->has_ts = 0;
        self->counts[0] = self->counts[1] = self->counts[2] = 0;
    }
    return out;
}

/* kept() -> (first_seq, count, packed) | None: the payloads of the batches applied in C
   since the last call (keep_payloads), in seq order from first_seq, as one msgpack array
   of bin (what a list of bytes encodes to); None if there are none. What a persistent
   store records of them: one call per read, no object per batch, and no copy: `packed` is
   a read-only memoryview of the buffer they were kept in, handed over whole (a `Packed`
   owns it now); the next read keeps its payloads in a new one. */
static PyObject *Sequencer_kept(SequencerObject *self, PyObject *Py_UNUSED(unused)) {
    if (self->kcount == 0)
        Py_RETURN_NONE;
    /* Fitted to what it holds before it goes (it grew by doubling): the store link's
       bound counts these bytes, so they are what is held. Shrinking frees the tail in
       place; should it fail, the buffer goes as it is. */
    unsigned char *fit = realloc(self->kbuf, self->klen);
    if (fit != NULL) {
        self->kbuf = fit;
        self->kcap = self->klen;
    }
    /* Everything that can fail first: on a failure the payloads stay kept as they are,
       and a later call may succeed. */
    PyObject *out = PyTuple_New(3);
    PyObject *first = PyLong_FromUnsignedLongLong((unsigned long long)self->kfirst);
    PyObject *count = PyLong_FromSsize_t(self->kcount);
    /* The owner only once the rest is made: a view dropped on a failure below would free
       the buffer with its owner while the Sequencer still holds it. */
    PackedObject *owner = out && first && count ? PyObject_New(PackedObject, &PackedType) : NULL;
    PyObject *view = NULL;
    if (owner != NULL) {
        owner->data = self->kbuf;
        owner->size = (Py_ssize_t)self->klen;
        view = PyMemoryView_FromObject((PyObject *)owner); /* holds the owner */
        if (view == NULL)
            owner->data = NULL; /* still the Sequencer's */
        Py_DECREF(owner);
    }
    if (out == NULL || first == NULL || count == NULL || view == NULL) {
        Py_XDECREF(out);
        Py_XDECREF(first);
        Py_XDECREF(count);
        Py_XDECREF(view);
        return NULL;
    }
    put_u32(self->kbuf, 0xdd, (uint32_t)self->kcount); /* msgpack array 32 */
    PyTuple_SET_ITEM(out, 0, first);
    PyTuple_SET_ITEM(out, 1, count);
    PyTuple_SET_ITEM(out, 2, view);
    self->kbuf = NULL; /* the owner's now */
    self->kcap = self->klen = 0;
    self->kcount = 0;
    return out;
}

/* digests() -> [(seq, digest), ...]: those of the batches delivered since armed, oldest
   first, at most digests_kept. */
static PyObject *Sequencer_digests(SequencerObject *self, PyObject *Py_UNUSED(unused)) {
    uint64_t n = self->pushed < self->kept ? self->pushed : self->kept;
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (out == NULL)
        return NULL;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t at = (self->pushed - n + i) % self->kept;
        PyObject *item = Py_BuildValue("(KI)", (unsigned long long)self->ring_seq[at],
                                       (unsigned int)self->ring_crc[at]);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    return out;
}

/* digest(seq) -> int | None: the digest of a batch delivered since armed, if kept. */
static PyObject *Sequencer_digest(SequencerObject *self, PyObject *seq_obj) {
    unsigned long long seq = PyLong_AsUnsignedLongLongMask(seq_obj);
    if (PyErr_Occurred())
        return NULL;
    uint64_t n = self->pushed < self->kept ? self->pushed : self->kept;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t at = (self->pushed - 1 - i) % self->kept;
        if (self->ring_seq[at] == seq)
            return PyLong_FromUnsignedLong(self->ring_crc[at]);
    }
    Py_RETURN_NONE;
}

static PyObject *Sequencer_get_armed(SequencerObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->armed);
}

static PyMethodDef Sequencer_methods[] = {
    {"arm", (PyCFunction)Sequencer_arm, METH_VARARGS, NULL},
    {"disarm", (PyCFunction)Sequencer_disarm, METH_NOARGS, NULL},
    {"offer", (PyCFunction)Sequencer_offer, METH_VARARGS, NULL},
    {"take", (PyCFunction)Sequencer_take, METH_NOARGS, NULL},
    {"kept", (PyCFunction)Sequencer_kept, METH_NOARGS, NULL},
    {"digests", (PyCFunction)Sequencer_digests, METH_NOARGS, NULL},
    {"digest", (PyCFunction)Sequencer_digest, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Sequencer_getset[] = {
    {"armed", (getter)Sequencer_get_armed, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SequencerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvindex.subscriber._recv.Sequencer",
    .tp_basicsize = sizeof(SequencerObject),
    .tp_dealloc = (destructor)Sequencer_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One publisher's in-order path in C (see _recv.c, subscriber/inorder.py).",
    .tp_methods = Sequencer_methods,
    .tp_getset = Sequencer_getset,
    .tp_init = (initproc)Sequencer_init,
    .tp_new = PyType_GenericNew,
};

/* One live message off the socket, its payload frame left open in `pay` (closed by the
   caller) when it is [topic, 8-byte seq, payload]. 1: a message (*frames its frame
   count, *seq set when well formed); 0: none now; -1: an error (*err). */
static int read_message(void *sock, zmq_msg *pay, int *frames, uint64_t *seq, int *good,
                        int *err) {
    zmq_msg msg;
    *frames = 0;
    *good = 1;
    *seq = 0;
    for (;;) {
        zmq_msg *m = *frames == 2 ? pay : &msg;
        zmq_msg_init_(m);
        if (recv_frame(m, sock, err) < 0) {
            zmq_msg_close_(m);
            if (*frames == 0 && *err == EAGAIN)
                return 0;
            if (*frames > 2)
                zmq_msg_close_(pay);
            return -1;
        }
        int more = zmq_msg_more_(m);
        if (*frames == 1) {
            if (zmq_msg_size_(m) == 8) {
                const unsigned char *data = zmq_msg_data_(m);
                for (int i = 0; i < 8; i++)
                    *seq = (*seq << 8) | data[i];
            } else {
                *good = 0;
            }
        }
        if (m != pay)
            zmq_msg_close_(m);
        (*frames)++;
        if (!more)
            break;
    }
    if (*frames < 3)
        *good = 0;
    else if (*frames > 3) {
        *good = 0;
        zmq_msg_close_(pay);
    }
    return 1;
}

/* ingest_live(socket_address, sequencer, api, core, limit)
       -> (taken, stop, c_seconds, apply_seconds)

   Up to `limit` live messages: each that is the batch due is applied to `core` through
   `api` (Core.ingest_api()) and recorded in `sequencer` (its payload kept there too, with
   keep_payloads, up to KEEP_LIMIT bytes a read), all without the GIL. `stop`: None
   (the socket had no more now, or the limit was reached), or the first message C did not
   take, for Python to decide: (seq, payload), or (-1, frame count) for a message that is
   not [topic, 8-byte seq, payload]. `c_seconds`: this thread's CPU time in the loop, the
   GIL released (what the ingest path's GIL accounting leaves out); `apply_seconds`: the
   part of it spent applying, under the core's write lock (sampled: 1 batch in 16, scaled).
   An error other than "no message now" raises OSError (after what was taken is recorded). */
static PyObject *ingest_live(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long address;
    PyObject *seqr_obj, *api_obj, *core;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "KO!OOn", &address, &SequencerType, &seqr_obj, &api_obj, &core,
                          &limit))
        return NULL;
    if (ready != 1) {
        PyErr_SetString(PyExc_RuntimeError, "libzmq was not found (call available() first)");
        return NULL;
    }
    const kv_ingest_api *api = PyCapsule_GetPointer(api_obj, KV_INGEST_API_NAME);
    if (api == NULL)
        return NULL;
    if (api->version != KV_INGEST_API_VERSION) {
        PyErr_SetString(PyExc_RuntimeError, "the core's ingest API is of another version");
        return NULL;
    }
    SequencerObject *s = (SequencerObject *)seqr_obj;
    void *sock = (void *)(uintptr_t)address;
    Py_ssize_t taken = 0;
    int stopped = 0, failed = 0, err = 0, frames = 0, good = 0;
    uint64_t seq = 0;
    zmq_msg pay;
    double now, cpu_start, cpu_end, locked = 0;
    Py_ssize_t sampled = 0;
    Py_INCREF(core); /* the Core stays while its lock may be held without the GIL */
    Py_BEGIN_ALLOW_THREADS
    cpu_start = clock_now(CLOCK_THREAD_CPUTIME_ID);
    now = monotonic_now();
    while (taken < limit && !(s->keep && s->klen >= KEEP_LIMIT)) {
        int r = read_message(sock, &pay, &frames, &seq, &good, &err);
        if (r == 0)
            break;
        if (r < 0) {
            failed = 1;
            break;
        }
        if (!good) {
            if (frames == 3)
                zmq_msg_close_(&pay);
            stopped = 1;
            break;
        }
        if (!in_order(s, seq) || !ring_room(s)) {
            stopped = 1; /* not the batch due (or no memory for its digest): Python's */
            break;
        }
        const uint8_t *data = zmq_msg_data_(&pay);
        size_t size = zmq_msg_size_(&pay);
        if (s->keep && !keep_room(s, size)) {
            stopped = 1; /* no memory to keep it for the store: Python's */
            break;
        }
        double ts = 0;
        int64_t counts[3] = {0, 0, 0};
        uint32_t crc = digest_of(data, size);
        /* The apply's CPU time, sampled (its clock is a system call): 1 batch in 16. */
        int sample = (taken & 15) == 0;
        int res = api->apply(core, s->bit, data, size, &ts, counts, sample ? &locked : NULL);
        sampled += sample && res == KV_APPLY_DONE;
        if (res != KV_APPLY_DONE) {
            stopped = 1; /* Python's again: it decodes it (or finds memory short itself) */
            break;
        }
        if (s->keep)
            keep_payload(s, seq, data, size);
        zmq_msg_close_(&pay);
        take_in_order(s, seq, crc, now);
        s->has_ts = 1;
        s->last_ts = ts;
        for (int i = 0; i < 3; i++)
            s->counts[i] += counts[i];
        taken++;
        if ((taken & 63) == 0)
            now = monotonic_now();
    }
    now = monotonic_now();
    if (taken)
        s->last_traffic = now;
    cpu_end = clock_now(CLOCK_THREAD_CPUTIME_ID);
    Py_END_ALLOW_THREADS
    Py_DECREF(core);
    double nogil = cpu_end - cpu_start;
    if (sampled > 0)
        locked *= (double)taken / (double)sampled;
    if (failed) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *stop;
    if (!stopped) {
        stop = Py_None;
        Py_INCREF(stop);
    } else if (!good) {
        stop = Py_BuildValue("(ii)", -1, frames);
    } else {
        PyObject *payload = PyBytes_FromStringAndSize(zmq_msg_data_(&pay),
                                                      (Py_ssize_t)zmq_msg_size_(&pay));
        zmq_msg_close_(&pay);
        stop = payload == NULL ? NULL
                               : Py_BuildValue("(KN)", (unsigned long long)seq, payload);
    }
    if (stop == NULL)
        return NULL;
    return Py_BuildValue("(nNdd)", taken, stop, nogil, locked);
}

static PyMethodDef methods[] = {
    {"available", available, METH_NOARGS, "Whether pyzmq's libzmq was found."},
    {"recv_live", recv_live, METH_VARARGS, "Many live messages off a SUB socket."},
    {"fail_after", fail_after, METH_VARARGS, "Tests only: the n-th receive fails."},
    {"ingest_live", ingest_live, METH_VARARGS, "The in-order path in C (see _recv.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvindex.subscriber._recv",
    .m_doc = "Live messages off a SUB socket, many per call (see _recv.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__recv(void) {
    if (PyType_Ready(&SequencerType) < 0 || PyType_Ready(&PackedType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&SequencerType);
    if (PyModule_AddObject(m, "Sequencer", (PyObject *)&SequencerType) < 0) {
        Py_DECREF(&SequencerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
