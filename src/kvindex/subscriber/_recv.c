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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h> /* Python.h defined _GNU_SOURCE: dl_iterate_phdr is there */
#include <errno.h>
#include <link.h>
#include <stdint.h>
#include <string.h>

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

/* recv_live(socket_address, limit) -> [(seq, payload), ...]

   Up to `limit` whole messages, fewer if the socket has no more now. A message that is not
   [topic, 8-byte seq, payload] comes as (-1, number of frames): the caller counts it as
   malformed. An error other than "no message now" raises OSError after what was read. */
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
            if (zmq_msg_recv_(&msg, sock, ZMQ_DONTWAIT_) < 0) {
                int err = zmq_errno_();
                zmq_msg_close_(&msg);
                if (frames == 0 && (err == EAGAIN || err == EINTR))
                    return out; /* nothing more now */
                Py_XDECREF(payload);
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

static PyMethodDef methods[] = {
    {"available", available, METH_NOARGS, "Whether pyzmq's libzmq was found."},
    {"recv_live", recv_live, METH_VARARGS, "Many live messages off a SUB socket."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvindex.subscriber._recv",
    .m_doc = "Live messages off a SUB socket, many per call (see _recv.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__recv(void) { return PyModule_Create(&module); }
