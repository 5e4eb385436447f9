/* Plain lookups answered by a C thread on serve's listening socket, with no GIL at all.
 *
 * kvindex/service/lookupd.py starts it; this file is the thread. It accepts every
 * connection of the socket and reads its requests. A request it is sure of -- `POST
 * /v1/lookup` over HTTP/1.1, the plain body shape (answer.h's parse_lookup_body), every
 * header one it understands and the guard's rules met (the Host on the allowed list or an
 * IPv4 literal, the bearer token when one is set, the body within its limit) -- it answers
 * itself (and `POST /v1/lookup/hashes` of its plain shape, answer.h's parse_hashes_body):
 * the core's walk and JSON answer under its read lock (lookup_api.h), the HTTP
 * response written as uvicorn's protocol writes it (kvindex/service/fastpath.py). The
 * first request it is not sure of hands the whole connection to Python -- its socket and
 * the bytes read so far -- and uvicorn's protocol (with every limit of the service) reads
 * it from there; once that request is answered and nothing more of the connection is
 * pending, Python gives it back (`adopt`). A request that has not arrived whole within `handoff_after`
 * seconds is handed over too (the service's body deadline then applies), and an idle
 * connection is closed after `keep_alive` seconds, as uvicorn's.
 *
 * So a lookup never waits for the GIL: under a busy ingest it costs what it costs idle.
 * What Python knows that the answer needs -- the followed instances with their DP ranks'
 * bits and their statuses -- is pushed here (`set_answer`) when it changes; an answer
 * whose bits no longer match the core's publishers (lookup_api.h's sources_gen) is handed
 * to Python instead, which answers it and pushes the new ones. Each answer's latency and
 * hit is kept in a ring that Python reads into the service's metrics (`samples`).
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../index/csrc/lookup_api.h"

#define RING 65536          /* latency samples kept until Python reads them */
#define READ_CHUNK 65536    /* bytes read per recv */
#define SCAN_MS 100         /* how often deadlines are looked at */

/* -- what the answer needs from Python --------------------------------------------- */

typedef struct {
    slot_t *slots;
    int32_t *ranks;
    char *text; /* the names' and statuses' JSON */
    uint32_t n;
    uint64_t gen;
    int refs; /* under the server's mutex: 1 while current, 1 per answer using it */
} ctx_t;

static void ctx_free(ctx_t *x) {
    if (x == NULL)
        return;
    free(x->slots);
    free(x->ranks);
    free(x->text);
    free(x);
}

/* -- connections --------------------------------------------------------------------- */

typedef struct conn {
    int fd;
    char *in;
    size_t in_len, in_cap;
    char *out;
    size_t out_len, out_off;
    double started; /* when the pending request's first byte came; 0: none pending */
    double active;  /* the last byte read or written */
    /* the last read that brought bytes: when the kernel received them (SO_TIMESTAMPNS,
     * CLOCK_REALTIME; 0: not known) and when the read returned (the same clock) */
    double rx_stamp, rx_read_real;
    double rx_read; /* the same read's time, CLOCK_MONOTONIC (now_s) */
    int handing;    /* hand it to Python once the output is out */
    int adopted;    /* given back by Python (`adopt`) and not answered here since */
    struct conn *prev, *next;
} conn_t;

typedef struct handoff {
    int fd;
    char *data;
    size_t len;
    int bounced; /* given back and handed over again before any answer here: Python keeps it */
    struct handoff *next;
} handoff_t;

/* One answer's time, by stage (seconds; a stage not measured is -1):
 * - queue: from the kernel's receipt of the request's last bytes to this thread's read
 *   of them (the wake-up: the thread waiting for a core, or busy with other sockets);
 * - parse: from that read to the walk (the HTTP head, the body's token ids);
 * - seconds: the walk and the JSON, the core's read lock taken and let go (what the
 *   service's lookup histogram measures);
 * - write: from the answer made to the send returned.
 * preempted / blocked: the thread was switched out involuntarily (a core taken from it)
 * / voluntarily (waiting for the read lock) during `seconds` (getrusage's counts). */
typedef struct {
    float seconds, queue, parse, write;
    uint8_t hit, hashes; /* hashes: a lookup by block hashes, else by tokens */
    uint8_t preempted, blocked;
} sample_t;


typedef struct {
    PyObject_HEAD
    const lookup_api_t *api;
    PyObject *core;
    int listen_fd, epfd, wake_fd, handoff_fd;
    pthread_t thread;
    int running;
    int stopping; /* atomic */
    int closed;   /* `close` freed what answers need: never started again */
    /* the rules */
    size_t max_body, head_limit;
    size_t nconns;    /* the connections served here (atomic: Python reads it) */
    size_t max_conns; /* --max-connections, over this thread's and Python's; 0: no cap */
    size_t others;    /* the connections Python serves, as it last said (atomic) */
    uint32_t max_items;
    char *token;
    size_t token_len;
    char **hosts;
    size_t *host_lens;
    Py_ssize_t nhosts;
    int check_hosts; /* 0: any host (no list, or `*` on it) */
    char *headers;   /* uvicorn's default headers but the date, as lines */
    size_t headers_len;
    int date;
    double keep_alive, handoff_after;
    /* shared with Python, under `mu` */
    pthread_mutex_t mu;
    ctx_t *ctx;
    handoff_t *handoffs, **handoff_tail;
    size_t nhandoffs; /* handed over and not taken yet */
    int *adopted; /* sockets Python gives back (`adopt`), for the thread to take */
    size_t nadopted, adopted_cap;
    sample_t *ring;
    size_t ring_start, ring_len;
    unsigned long long ring_added; /* samples ever added: the newest is ring_added - 1 */
    unsigned long long answered, handed, stale, dropped, returned;
    /* the thread's own */
    conn_t *conns;
    char date_line[64];
    time_t date_second;
} ServerObject;

static int LISTEN_TAG, WAKE_TAG;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double real_s(void) { /* the clock of the kernel's receive timestamps */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* This thread's context switches so far: voluntary (it waited: a lock) and not (a core
 * taken from it). */
static void switches(long *voluntary, long *involuntary) {
    struct rusage ru;
    if (getrusage(RUSAGE_THREAD, &ru) == 0) {
        *voluntary = ru.ru_nvcsw;
        *involuntary = ru.ru_nivcsw;
    } else {
        *voluntary = *involuntary = 0;
    }
}

/* -- the thread ---------------------------------------------------------------------- */

/* A connection out of the thread's list, and freed (its socket is no longer watched). */
static void conn_forget(ServerObject *s, conn_t *c) {
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    __atomic_sub_fetch(&s->nconns, 1, __ATOMIC_RELAXED);
    free(c->in);
    free(c->out);
    free(c);
}

static void conn_close(ServerObject *s, conn_t *c, int close_fd) {
    epoll_ctl(s->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    if (close_fd)
        close(c->fd);
    conn_forget(s, c);
}

/* The connection to Python: its socket and what was read of it and not answered. */
static void hand_off(ServerObject *s, conn_t *c) {
    handoff_t *h = calloc(1, sizeof *h);
    if (h == NULL) { /* nothing to hand it with: the client sees it closed */
        conn_close(s, c, 1);
        return;
    }
    h->fd = c->fd;
    h->data = c->in;
    h->len = c->in_len;
    h->bounced = c->adopted;
    c->in = NULL;
    /* Unwatched before Python can see it: once queued, Python may take the socket, answer
     * and close it at once, and its number be reused by a file of Python's before this
     * thread's EPOLL_CTL_DEL ran on that number (ThreadSanitizer saw the two race). */
    epoll_ctl(s->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    pthread_mutex_lock(&s->mu); /* queued before it leaves nconns: counted throughout */
    *s->handoff_tail = h;
    s->handoff_tail = &h->next;
    s->nhandoffs++;
    s->handed++;
    pthread_mutex_unlock(&s->mu);
    conn_forget(s, c);
    uint64_t one = 1;
    (void)!write(s->handoff_fd, &one, sizeof one);
}

static int ieq(const char *a, size_t n, const char *lit) {
    return strlen(lit) == n && strncasecmp(a, lit, n) == 0;
}

/* The host of a Host header as security/http.py's _host_name gives it, when it is one
 * this thread can judge (plain ASCII name characters; not an IPv6 literal): 1 and the
 * name lowercased in `out`, else 0. */
static int host_name(const char *v, size_t n, char *out, size_t *out_len) {
    if (n == 0 || n > 255)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = v[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '.' || ch == '-' || ch == '_' || ch == ':'))
            return 0;
        out[i] = (char)(ch >= 'A' && ch <= 'Z' ? ch + 32 : ch);
    }
    size_t len = n;
    const char *colon = memrchr(out, ':', n);
    if (colon != NULL) {
        size_t port = n - (size_t)(colon - out) - 1;
        int digits = port > 0;
        for (size_t i = 0; i < port; i++)
            digits &= colon[1 + i] >= '0' && colon[1 + i] <= '9';
        if (digits)
            len = (size_t)(colon - out);
    }
    while (len > 0 && out[len - 1] == '.')
        len--;
    if (memchr(out, ':', len) != NULL)
        return 0; /* colons left: IPv6 or odd; Python judges */
    *out_len = len;
    return 1;
}

static int host_admitted(ServerObject *s, const char *v, size_t n) {
    char name[256];
    size_t len;
    if (!host_name(v, n, name, &len))
        return 0;
    for (Py_ssize_t i = 0; i < s->nhosts; i++)
        if (s->host_lens[i] == len && memcmp(s->hosts[i], name, len) == 0)
            return 1;
    name[len] = 0;
    struct in_addr addr;
    return len > 0 && inet_pton(AF_INET, name, &addr) == 1;
}

static int token_admitted(ServerObject *s, const char *v, size_t n) {
    /* `Bearer TOKEN`, any case of the scheme, blanks around the token */
    if (n < 7 || strncasecmp(v, "bearer ", 7) != 0)
        return 0;
    const char *t = v + 7;
    size_t len = n - 7;
    while (len && (*t == ' ' || *t == '\t'))
        t++, len--;
    while (len && (t[len - 1] == ' ' || t[len - 1] == '\t'))
        len--;
    unsigned char diff = (unsigned char)(len != s->token_len);
    for (size_t i = 0; i < s->token_len; i++) /* constant time for the token's length */
        diff |= (unsigned char)(s->token[i] ^ (i < len ? t[i] : 0));
    return diff == 0;
}

enum { REQ_INCOMPLETE, REQ_HANDOFF, REQ_OK };

typedef struct {
    size_t head, body_len;
    int hashes; /* POST /v1/lookup/hashes, else POST /v1/lookup */
} request_t;

/* The request at the start of c->in, if this thread takes it (see the top). */
static int parse_request(ServerObject *s, conn_t *c, request_t *r) {
    const char *p = c->in;
    size_t n = c->in_len;
    const char *end = memmem(p, n < s->head_limit ? n : s->head_limit, "\r\n\r\n", 4);
    if (end == NULL)
        return n >= s->head_limit ? REQ_HANDOFF : REQ_INCOMPLETE;
    static const char LINE[] = "POST /v1/lookup HTTP/1.1\r\n";
    static const char HASHES[] = "POST /v1/lookup/hashes HTTP/1.1\r\n";
    size_t head = (size_t)(end - p) + 2, line_len;
    if (head >= sizeof LINE - 1 && memcmp(p, LINE, sizeof LINE - 1) == 0)
        r->hashes = 0, line_len = sizeof LINE - 1;
    else if (head >= sizeof HASHES - 1 && memcmp(p, HASHES, sizeof HASHES - 1) == 0)
        r->hashes = 1, line_len = sizeof HASHES - 1;
    else
        return REQ_HANDOFF;
    const char *line = p + line_len, *stop = end + 2;
    int lengths = 0, hosts = 0, auths = 0, authorized = s->token == NULL;
    size_t length = 0;
    while (line < stop) {
        const char *eol = memmem(line, (size_t)(stop - line), "\r\n", 2);
        const char *colon = memchr(line, ':', (size_t)(eol - line));
        if (colon == NULL || colon == line)
            return REQ_HANDOFF;
        for (const char *q = line; q < colon; q++) { /* a token's characters only */
            char ch = *q;
            if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                  ch == '-' || ch == '_'))
                return REQ_HANDOFF;
        }
        const char *v = colon + 1, *ve = eol;
        while (v < ve && (*v == ' ' || *v == '\t'))
            v++;
        while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t'))
            ve--;
        for (const char *q = v; q < ve; q++)
            if ((unsigned char)*q < 0x20 && *q != '\t')
                return REQ_HANDOFF;
        size_t name_len = (size_t)(colon - line), vlen = (size_t)(ve - v);
        if (ieq(line, name_len, "content-length")) {
            if (lengths++ || vlen == 0 || vlen > 12)
                return REQ_HANDOFF;
            for (size_t i = 0; i < vlen; i++) {
                if (v[i] < '0' || v[i] > '9')
                    return REQ_HANDOFF;
                length = length * 10 + (size_t)(v[i] - '0');
            }
        } else if (ieq(line, name_len, "host")) {
            if (hosts++ || (s->check_hosts && !host_admitted(s, v, vlen)))
                return REQ_HANDOFF;
        } else if (ieq(line, name_len, "authorization")) {
            if (auths++)
                return REQ_HANDOFF;
            if (s->token != NULL) {
                if (!token_admitted(s, v, vlen))
                    return REQ_HANDOFF;
                authorized = 1;
            }
        } else if (ieq(line, name_len, "connection")) {
            if (!ieq(v, vlen, "keep-alive"))
                return REQ_HANDOFF;
        } else if (ieq(line, name_len, "transfer-encoding") || ieq(line, name_len, "expect") ||
                   ieq(line, name_len, "upgrade") || ieq(line, name_len, "te") ||
                   ieq(line, name_len, "trailer")) {
            return REQ_HANDOFF;
        }
        line = eol + 2;
    }
    if (lengths != 1 || !authorized || length > s->max_body)
        return REQ_HANDOFF;
    r->head = (size_t)(end - p) + 4;
    r->body_len = length;
    return n - r->head >= length ? REQ_OK : REQ_INCOMPLETE;
}

static const char *DAYS[] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
static const char *MONTHS[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                               "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};

/* uvicorn's `date` header line (email.utils.formatdate(usegmt=True)), kept per second. */
static const char *date_line(ServerObject *s) {
    time_t t = time(NULL);
    if (t != s->date_second) {
        struct tm tm;
        gmtime_r(&t, &tm);
        snprintf(s->date_line, sizeof s->date_line, "date: %s, %02d %s %04d %02d:%02d:%02d GMT\r\n",
                 DAYS[tm.tm_wday], tm.tm_mday, MONTHS[tm.tm_mon], tm.tm_year + 1900, tm.tm_hour,
                 tm.tm_min, tm.tm_sec);
        s->date_second = t;
    }
    return s->date_line;
}

/* Under s->mu; returns the sample's number (see set_write). */
static unsigned long long add_sample(ServerObject *s, const sample_t *sample) {
    size_t at = (s->ring_start + s->ring_len) % RING;
    if (s->ring_len == RING) { /* Python has not read for long: the oldest goes */
        s->ring_start = (s->ring_start + 1) % RING;
        s->dropped++;
    } else {
        s->ring_len++;
    }
    s->ring[at] = *sample;
    return s->ring_added++;
}

/* Under s->mu: sample number `k`'s write time, if Python has not read it yet. */
static void set_write(ServerObject *s, unsigned long long k, double seconds) {
    unsigned long long first = s->ring_added - s->ring_len; /* the oldest still kept */
    if (k >= first && k < s->ring_added)
        s->ring[(s->ring_start + (size_t)(k - first)) % RING].write = (float)seconds;
}

/* The answer to the request `r` at the start of c->in appended to c->out, its times but
 * the write's in `sample`: 1; 0 when Python must answer it (a body not of the plain
 * shape, the instances moved, no memory). */
static int answer(ServerObject *s, conn_t *c, const request_t *r, sample_t *sample) {
    lookup_body_t body;
    hashes_body_t hashes;
    int parsed = r->hashes
                     ? s->api->parse_hashes(c->in + r->head, r->body_len, s->max_items, &hashes)
                     : s->api->parse_tokens(c->in + r->head, r->body_len, s->max_items, &body);
    if (parsed != PARSE_OK)
        return 0;
    pthread_mutex_lock(&s->mu);
    ctx_t *x = s->ctx;
    if (x != NULL)
        x->refs++;
    pthread_mutex_unlock(&s->mu);
    int res = LOOKUP_STALE, hit = 0;
    jbuf_t json = {0};
    long vol0, invol0, vol1, invol1;
    switches(&vol0, &invol0);
    double start = now_s(), seconds = 0;
    if (x != NULL) {
        res = r->hashes
                  ? s->api->answer_hashes(s->core, &hashes, x->slots, x->n, x->gen, &json, &hit)
                  : s->api->answer_tokens(s->core, &body, x->slots, x->n, x->gen, &json, &hit);
        seconds = now_s() - start;
    }
    switches(&vol1, &invol1);
    sample->seconds = (float)seconds;
    sample->queue = c->rx_stamp > 0 ? (float)(c->rx_read_real - c->rx_stamp) : -1.0f;
    sample->parse = (float)(start - c->rx_read);
    sample->write = -1.0f;
    sample->hit = (uint8_t)hit;
    sample->hashes = (uint8_t)r->hashes;
    sample->preempted = invol1 != invol0;
    sample->blocked = vol1 != vol0;
    if (r->hashes)
        s->api->hashes_free(&hashes);
    else
        s->api->body_free(&body);
    pthread_mutex_lock(&s->mu);
    int unused = x != NULL && --x->refs == 0;
    if (res == LOOKUP_ANSWERED) {
        s->answered++;
    } else if (res == LOOKUP_STALE) {
        s->stale++;
    }
    pthread_mutex_unlock(&s->mu);
    if (unused)
        ctx_free(x);
    if (res != LOOKUP_ANSWERED) {
        s->api->jbuf_free(&json);
        return 0;
    }
    char length[64];
    int length_len = snprintf(length, sizeof length,
                              "content-type: application/json\r\ncontent-length: %zu\r\n\r\n",
                              json.len);
    static const char STATUS[] = "HTTP/1.1 200 OK\r\n";
    const char *date = s->date ? date_line(s) : "";
    size_t date_len = strlen(date);
    size_t need = sizeof STATUS - 1 + date_len + s->headers_len + (size_t)length_len + json.len;
    size_t pending = c->out_len - c->out_off;
    char *out = malloc(pending + need);
    if (out == NULL) {
        s->api->jbuf_free(&json);
        return 0;
    }
    if (pending) /* what is not written yet of the answers before, first */
        memcpy(out, c->out + c->out_off, pending);
    char *w = out + pending;
    memcpy(w, STATUS, sizeof STATUS - 1), w += sizeof STATUS - 1;
    memcpy(w, date, date_len), w += date_len;
    memcpy(w, s->headers, s->headers_len), w += s->headers_len;
    memcpy(w, length, (size_t)length_len), w += length_len;
    memcpy(w, json.p, json.len);
    s->api->jbuf_free(&json);
    free(c->out);
    c->out = out;
    c->out_len = pending + need;
    c->out_off = 0;
    return 1;
}

/* Write what is pending: 1 all out, 0 some left (EPOLLOUT asked), -1 the peer is gone. */
static int flush(ServerObject *s, conn_t *c) {
    while (c->out_off < c->out_len) {
        ssize_t k = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                struct epoll_event ev = {.events = EPOLLOUT, .data.ptr = c};
                epoll_ctl(s->epfd, EPOLL_CTL_MOD, c->fd, &ev);
                return 0;
            }
            return -1;
        }
        c->out_off += (size_t)k;
        c->active = now_s();
    }
    free(c->out);
    c->out = NULL;
    c->out_len = c->out_off = 0;
    return 1;
}

/* Answer the whole requests read, in order; hand the connection over at the first one
 * this thread does not take. 0: the connection is gone (closed or handed over). */
static int process(ServerObject *s, conn_t *c) {
    /* The answers' samples go to the ring before they are written (a client that has its
     * answer finds it counted); their write time is added once the send returns. */
    unsigned long long first = 0;
    size_t nsamples = 0;
    double answered = 0; /* when the last answer of this call was made */
    while (c->in_len > 0 && !c->handing) {
        request_t r;
        sample_t sample;
        int kind = parse_request(s, c, &r);
        if (kind == REQ_INCOMPLETE)
            break;
        if (kind == REQ_HANDOFF || !answer(s, c, &r, &sample)) {
            c->handing = 1;
            break;
        }
        pthread_mutex_lock(&s->mu);
        unsigned long long k = add_sample(s, &sample);
        pthread_mutex_unlock(&s->mu);
        if (nsamples++ == 0)
            first = k;
        answered = now_s();
        c->adopted = 0;
        size_t used = r.head + r.body_len;
        memmove(c->in, c->in + used, c->in_len - used);
        c->in_len -= used;
        c->started = c->in_len ? now_s() : 0;
    }
    int flushed = flush(s, c);
    if (nsamples > 0 && flushed > 0) { /* all out at once: the write's time is known */
        double seconds = now_s() - answered;
        pthread_mutex_lock(&s->mu);
        for (size_t i = 0; i < nsamples; i++)
            set_write(s, first + i, seconds);
        pthread_mutex_unlock(&s->mu);
    }
    if (flushed < 0) {
        conn_close(s, c, 1);
        return 0;
    }
    if (flushed == 0)
        return 1; /* the rest once it can be written */
    if (c->handing) {
        hand_off(s, c);
        return 0;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    epoll_ctl(s->epfd, EPOLL_CTL_MOD, c->fd, &ev);
    return 1;
}

static void on_readable(ServerObject *s, conn_t *c) {
    for (;;) {
        size_t room = c->in_cap - c->in_len;
        if (room < READ_CHUNK / 2) {
            size_t cap = c->in_cap ? c->in_cap * 2 : READ_CHUNK;
            /* a request this thread takes is at most head_limit + max_body bytes; more
             * read than that and unanswered goes to Python anyway */
            if (c->in_cap >= s->head_limit + s->max_body + READ_CHUNK) {
                c->handing = 1;
                break;
            }
            char *in = realloc(c->in, cap);
            if (in == NULL) {
                c->handing = 1;
                break;
            }
            c->in = in;
            c->in_cap = cap;
            room = cap - c->in_len;
        }
        /* with the kernel's receive time of the bytes (SO_TIMESTAMPNS, set in conn_add) */
        struct iovec iov = {.iov_base = c->in + c->in_len, .iov_len = room};
        union {
            char buf[CMSG_SPACE(sizeof(struct timespec))];
            struct cmsghdr align;
        } control;
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                             .msg_controllen = sizeof control.buf};
        ssize_t k = recvmsg(c->fd, &msg, 0);
        if (k > 0) {
            c->rx_read_real = real_s();
            c->rx_stamp = 0;
            for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm != NULL; cm = CMSG_NXTHDR(&msg, cm))
                if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_TIMESTAMPNS) {
                    struct timespec ts;
                    memcpy(&ts, CMSG_DATA(cm), sizeof ts);
                    c->rx_stamp = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
                }
        }
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        if (k <= 0) { /* closed, or reset */
            conn_close(s, c, 1);
            return;
        }
        if (c->in_len == 0)
            c->started = now_s();
        c->in_len += (size_t)k;
        c->active = c->rx_read = now_s();
        if ((size_t)k < room)
            break; /* all there is for now */
    }
    process(s, c);
}

/* A connection served from now on (its socket non-blocking); closed if it can't be. */
static conn_t *conn_add(ServerObject *s, int fd) {
    conn_t *c = calloc(1, sizeof *c);
    if (c == NULL) {
        close(fd);
        return NULL;
    }
    c->fd = fd;
    c->active = now_s();
    int one = 1; /* each read says when the kernel received its bytes (the queue stage; a
                  * socket accepted here has it from the listener, see Server_init) */
    setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        close(fd);
        free(c);
        return NULL;
    }
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    __atomic_add_fetch(&s->nconns, 1, __ATOMIC_RELAXED);
    return c;
}

/* The connections held on both sides: served here, handed over or given back and not
 * taken yet, and Python's own (as it last said). */
static size_t held(ServerObject *s) {
    pthread_mutex_lock(&s->mu);
    size_t queued = s->nhandoffs + s->nadopted;
    pthread_mutex_unlock(&s->mu);
    return __atomic_load_n(&s->nconns, __ATOMIC_RELAXED) + queued +
           __atomic_load_n(&s->others, __ATOMIC_RELAXED);
}

static void on_accept(ServerObject *s) {
    for (;;) {
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            return; /* EAGAIN, or out of descriptors: the rest wait in the backlog */
        }
        int one = 1;
        /* each answer goes out at once, whatever is unacknowledged (asyncio does it too) */
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        int over = s->max_conns && held(s) >= s->max_conns;
        conn_t *c = conn_add(s, fd);
        if (c != NULL && over) /* Python refuses it (503), in its words, and counts it */
            hand_off(s, c);
    }
}

/* The connections Python gave back (`adopt`): served here again from their next byte. */
static void on_wake(ServerObject *s) {
    uint64_t count;
    (void)!read(s->wake_fd, &count, sizeof count);
    pthread_mutex_lock(&s->mu);
    size_t n = s->nadopted;
    int fds[64];
    if (n > 64)
        n = 64; /* the rest at the next wake (one is due: the eventfd stays set) */
    if (n) { /* none: the wake was for stop */
        memcpy(fds, s->adopted, n * sizeof(int));
        memmove(s->adopted, s->adopted + n, (s->nadopted - n) * sizeof(int));
    }
    s->nadopted -= n;
    if (s->nadopted) {
        uint64_t one = 1;
        (void)!write(s->wake_fd, &one, sizeof one);
    }
    pthread_mutex_unlock(&s->mu);
    for (size_t i = 0; i < n; i++) {
        conn_t *c = conn_add(s, fds[i]);
        if (c != NULL)
            c->adopted = 1;
    }
}

/* Idle connections closed (keep_alive), requests slower than handoff_after handed over. */
static void scan(ServerObject *s, double now) {
    conn_t *c = s->conns;
    while (c != NULL) {
        conn_t *next = c->next;
        if (c->out_off < c->out_len) {
            if (now - c->active > s->keep_alive)
                conn_close(s, c, 1); /* the client reads nothing */
        } else if (c->in_len > 0 && c->started && now - c->started > s->handoff_after) {
            hand_off(s, c);
        } else if (c->in_len == 0 && now - c->active > s->keep_alive) {
            conn_close(s, c, 1);
        }
        c = next;
    }
}

/* linux/sched/types.h's struct sched_attr (its first version), for sched_setattr(2) */
struct sched_attr_ {
    uint32_t size, sched_policy;
    uint64_t sched_flags;
    int32_t sched_nice;
    uint32_t sched_priority;
    uint64_t sched_runtime, sched_deadline, sched_period;
};

/* The thread asks the scheduler for a short time slice. On a busy machine a lookup's
 * tail was the thread waiting for a core once its socket was readable (the `queue` stage:
 * p99 0.79 ms under a 200k/s stream on 2 cores): EEVDF (Linux 6.6+) gives a task whose
 * slice is short an early deadline, so at wake-up it takes a core from one with the
 * default slice (0.7 ms x (1 + log2 CPUs)), and since 6.12 a SCHED_OTHER task may set its
 * own (sched_runtime, 0.1-100 ms, no privilege needed). 300 us covers an answer (parse,
 * walk and JSON: ~0.1-0.2 ms) so it is not cut in the middle. Measured: queue p99 0.79 ->
 * 0.17 ms, the client's loaded p99 1.73 -> 0.99 ms (docs/performance.md). An older kernel
 * ignores it, or refuses it: nothing else changes then. */
#define SLICE_NS 300000ULL

static void short_slice(void) {
    struct sched_attr_ a;
    memset(&a, 0, sizeof a);
    if (syscall(SYS_sched_getattr, 0, &a, sizeof a, 0) != 0)
        return;
    if (a.sched_policy != SCHED_OTHER) /* batch, idle or real time: as it was set */
        return;
    a.size = sizeof a;
    a.sched_flags = 0;
    a.sched_runtime = SLICE_NS; /* the nice value and the rest kept as read */
    (void)syscall(SYS_sched_setattr, 0, &a, 0);
}

static void *serve(void *arg) {
    ServerObject *s = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals are the main thread's */
    short_slice();
    struct epoll_event evs[64];
    double last_scan = now_s();
    while (!__atomic_load_n(&s->stopping, __ATOMIC_ACQUIRE)) {
        int n = epoll_wait(s->epfd, evs, 64, SCAN_MS);
        for (int i = 0; i < n; i++) {
            void *tag = evs[i].data.ptr;
            if (tag == &LISTEN_TAG) {
                on_accept(s);
            } else if (tag == &WAKE_TAG) {
                on_wake(s);
            } else {
                conn_t *c = tag;
                if (evs[i].events & EPOLLOUT)
                    process(s, c);
                else if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR))
                    on_readable(s, c);
            }
        }
        double now = now_s();
        if (now - last_scan >= SCAN_MS / 1000.0) {
            scan(s, now);
            last_scan = now;
        }
    }
    /* As uvicorn stops: a request under way is Python's to finish (a graceful stop waits
     * for it there), an idle connection is closed. */
    while (s->conns != NULL) {
        conn_t *c = s->conns;
        if (c->in_len > 0 && c->out_off == c->out_len)
            hand_off(s, c);
        else
            conn_close(s, c, 1);
    }
    return NULL;
}

/* -- Python's side ------------------------------------------------------------------- */

static void server_release(ServerObject *s) {
    if (s->epfd >= 0)
        close(s->epfd);
    if (s->wake_fd >= 0)
        close(s->wake_fd);
    if (s->handoff_fd >= 0)
        close(s->handoff_fd);
    s->epfd = s->wake_fd = s->handoff_fd = -1;
}

static int Server_init(ServerObject *s, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"api",  "core",    "fd",         "max_body",      "max_items",
                            "head_limit", "token", "hosts", "headers", "date",
                            "keep_alive", "handoff_after", "max_connections", NULL};
    PyObject *capsule, *core, *token_obj, *hosts_obj;
    int fd, date;
    Py_ssize_t max_body, head_limit;
    unsigned int max_items;
    const char *headers;
    Py_ssize_t headers_len;
    double keep_alive, handoff_after;
    Py_ssize_t max_conns = 0;
    if (s->api != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Server is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOinInOOy#pdd|n", names, &capsule, &core, &fd,
                                     &max_body, &max_items, &head_limit, &token_obj, &hosts_obj,
                                     &headers, &headers_len, &date, &keep_alive, &handoff_after,
                                     &max_conns))
        return -1;
    const lookup_api_t *api = PyCapsule_GetPointer(capsule, LOOKUP_API_CAPSULE);
    if (api == NULL)
        return -1;
    if (api->version != LOOKUP_API_VERSION) {
        PyErr_SetString(PyExc_RuntimeError, "the core's lookup_api is another version");
        return -1;
    }
    if (max_body < 0 || head_limit < 64 || keep_alive <= 0 || handoff_after <= 0 || max_conns < 0) {
        PyErr_SetString(PyExc_ValueError, "limits must be positive");
        return -1;
    }
    if (token_obj != Py_None && !PyBytes_Check(token_obj)) {
        PyErr_SetString(PyExc_TypeError, "token: bytes or None");
        return -1;
    }
    if (hosts_obj != Py_None && !PyList_Check(hosts_obj)) {
        PyErr_SetString(PyExc_TypeError, "hosts: a list of bytes, or None (any host)");
        return -1;
    }
    s->epfd = s->wake_fd = s->handoff_fd = -1;
    pthread_mutex_init(&s->mu, NULL);
    s->handoff_tail = &s->handoffs;
    s->listen_fd = fd;
    s->max_body = (size_t)max_body;
    s->max_conns = (size_t)max_conns;
    s->head_limit = (size_t)head_limit;
    s->max_items = max_items;
    s->date = date;
    s->keep_alive = keep_alive;
    s->handoff_after = handoff_after;
    s->ring = calloc(RING, sizeof(sample_t));
    s->headers = malloc((size_t)headers_len + 1);
    if (s->ring == NULL || s->headers == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(s->headers, headers, (size_t)headers_len);
    s->headers_len = (size_t)headers_len;
    if (token_obj != Py_None) {
        s->token_len = (size_t)PyBytes_GET_SIZE(token_obj);
        s->token = malloc(s->token_len + 1);
        if (s->token == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(s->token, PyBytes_AS_STRING(token_obj), s->token_len);
    }
    if (hosts_obj != Py_None) {
        s->check_hosts = 1;
        Py_ssize_t n = PyList_GET_SIZE(hosts_obj);
        s->hosts = calloc((size_t)n + 1, sizeof(char *));
        s->host_lens = calloc((size_t)n + 1, sizeof(size_t));
        if (s->hosts == NULL || s->host_lens == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *h = PyList_GET_ITEM(hosts_obj, i);
            if (!PyBytes_Check(h)) {
                PyErr_SetString(PyExc_TypeError, "a host is bytes");
                return -1;
            }
            s->host_lens[i] = (size_t)PyBytes_GET_SIZE(h);
            s->hosts[i] = malloc(s->host_lens[i] + 1);
            if (s->hosts[i] == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            memcpy(s->hosts[i], PyBytes_AS_STRING(h), s->host_lens[i]);
            s->nhosts = i + 1;
        }
    }
    /* Accepted sockets inherit it: bytes that came before the accept are stamped too (TCP
     * gives a read no timestamp for bytes received while none was asked). */
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one);
    s->epfd = epoll_create1(EPOLL_CLOEXEC);
    s->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    s->handoff_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event listen_ev = {.events = EPOLLIN, .data.ptr = &LISTEN_TAG};
    struct epoll_event wake_ev = {.events = EPOLLIN, .data.ptr = &WAKE_TAG};
    if (s->epfd < 0 || s->wake_fd < 0 || s->handoff_fd < 0 ||
        epoll_ctl(s->epfd, EPOLL_CTL_ADD, fd, &listen_ev) < 0 ||
        epoll_ctl(s->epfd, EPOLL_CTL_ADD, s->wake_fd, &wake_ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        server_release(s);
        return -1;
    }
    Py_INCREF(core);
    s->core = core;
    s->api = api;
    return 0;
}

/* start(): the thread runs. */
static PyObject *Server_start(ServerObject *s, PyObject *Py_UNUSED(unused)) {
    if (s->api == NULL || s->running || s->closed || s->epfd < 0) {
        PyErr_SetString(PyExc_RuntimeError, "the server can't start (started, stopped or not made)");
        return NULL;
    }
    int err = pthread_create(&s->thread, NULL, serve, s);
    if (err != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    s->running = 1;
    Py_RETURN_NONE;
}

/* stop(): the thread ends: it closes its idle connections and hands over those with a
   request under way (the listening socket is the caller's). What is handed over and not
   taken yet stays for `take`. Idempotent. */
static PyObject *Server_stop(ServerObject *s, PyObject *Py_UNUSED(unused)) {
    if (s->running) {
        __atomic_store_n(&s->stopping, 1, __ATOMIC_RELEASE);
        uint64_t one = 1;
        (void)!write(s->wake_fd, &one, sizeof one);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(s->thread, NULL);
        Py_END_ALLOW_THREADS
        s->running = 0;
        pthread_mutex_lock(&s->mu);
        for (size_t i = 0; i < s->nadopted; i++) /* given back as it stopped: idle ones */
            close(s->adopted[i]);
        s->nadopted = 0;
        pthread_mutex_unlock(&s->mu);
    }
    if (s->epfd >= 0) {
        close(s->epfd);
        close(s->wake_fd);
        s->epfd = s->wake_fd = -1;
    }
    Py_RETURN_NONE;
}

/* set_answer(slots, statuses, sources_gen): what answers are made with from now on (the
   shapes of CompiledIndex.lookup_json's slots and statuses; sources_gen: Core.sources_gen()
   read before the slots were made). */
static PyObject *Server_set_answer(ServerObject *s, PyObject *args) {
    PyObject *slots_obj, *statuses;
    unsigned long long gen;
    if (!PyArg_ParseTuple(args, "O!O!K", &PyList_Type, &slots_obj, &PyList_Type, &statuses, &gen))
        return NULL;
    if (s->closed) {
        PyErr_SetString(PyExc_RuntimeError, "the server is closed");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(slots_obj);
    if (PyList_GET_SIZE(statuses) != n) {
        PyErr_SetString(PyExc_TypeError, "slots and statuses: two lists, as long");
        return NULL;
    }
    size_t text = 0, nranks = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *slot = PyList_GET_ITEM(slots_obj, i), *status = PyList_GET_ITEM(statuses, i);
        if (!PyTuple_Check(slot) || PyTuple_GET_SIZE(slot) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(slot, 0)) ||
            !PyList_Check(PyTuple_GET_ITEM(slot, 1)) || PyList_GET_SIZE(PyTuple_GET_ITEM(slot, 1)) % 2 ||
            !PyBytes_Check(status)) {
            PyErr_SetString(PyExc_TypeError, "a slot is (name_json, [rank, bit, ...]), a status bytes");
            return NULL;
        }
        text += (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(slot, 0)) + (size_t)PyBytes_GET_SIZE(status);
        nranks += (size_t)PyList_GET_SIZE(PyTuple_GET_ITEM(slot, 1));
    }
    ctx_t *x = calloc(1, sizeof *x);
    if (x != NULL) {
        x->slots = calloc((size_t)n + 1, sizeof(slot_t));
        x->ranks = malloc((nranks + 1) * sizeof(int32_t));
        x->text = malloc(text + 1);
    }
    if (x == NULL || x->slots == NULL || x->ranks == NULL || x->text == NULL) {
        ctx_free(x);
        return PyErr_NoMemory();
    }
    char *t = x->text;
    int32_t *r = x->ranks;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *slot = PyList_GET_ITEM(slots_obj, i), *status = PyList_GET_ITEM(statuses, i);
        PyObject *name = PyTuple_GET_ITEM(slot, 0), *pairs = PyTuple_GET_ITEM(slot, 1);
        slot_t *out = &x->slots[i];
        out->name_len = (size_t)PyBytes_GET_SIZE(name);
        memcpy(t, PyBytes_AS_STRING(name), out->name_len);
        out->name_json = t;
        t += out->name_len;
        out->status_len = (size_t)PyBytes_GET_SIZE(status);
        memcpy(t, PyBytes_AS_STRING(status), out->status_len);
        out->status_json = t;
        t += out->status_len;
        out->down = out->status_len == 6 && memcmp(out->status_json, "\"down\"", 6) == 0;
        out->nranks = (uint32_t)(PyList_GET_SIZE(pairs) / 2);
        out->ranks = r;
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(pairs); k++) {
            long v = PyLong_AsLong(PyList_GET_ITEM(pairs, k));
            if (v == -1 && PyErr_Occurred()) {
                ctx_free(x);
                return NULL;
            }
            *r++ = (int32_t)v;
        }
    }
    x->n = (uint32_t)n;
    x->gen = gen;
    x->refs = 1;
    pthread_mutex_lock(&s->mu);
    ctx_t *old = s->ctx;
    s->ctx = x;
    int unused = old != NULL && --old->refs == 0;
    pthread_mutex_unlock(&s->mu);
    if (unused)
        ctx_free(old);
    Py_RETURN_NONE;
}

/* take() -> [(fd, bytes read, bounced), ...]: the connections handed to Python since the
   last call (each socket is the caller's now); `bounced`: one given back that came again
   before this thread answered anything on it (Python should keep it). */
static PyObject *Server_take(ServerObject *s, PyObject *Py_UNUSED(unused)) {
    uint64_t count;
    if (s->handoff_fd >= 0)
        (void)!read(s->handoff_fd, &count, sizeof count);
    pthread_mutex_lock(&s->mu);
    handoff_t *h = s->handoffs;
    s->handoffs = NULL;
    s->handoff_tail = &s->handoffs;
    s->nhandoffs = 0;
    pthread_mutex_unlock(&s->mu);
    PyObject *out = PyList_New(0);
    while (h != NULL) {
        handoff_t *next = h->next;
        PyObject *item = out ? Py_BuildValue("(iy#O)", h->fd, h->data ? h->data : "", (Py_ssize_t)h->len,
                                             h->bounced ? Py_True : Py_False)
                             : NULL;
        if (item == NULL || PyList_Append(out, item) < 0) {
            close(h->fd); /* nobody can serve it now */
            Py_CLEAR(out);
        }
        Py_XDECREF(item);
        free(h->data);
        free(h);
        h = next;
    }
    return out;
}

/* adopt(fd): a connection handed to Python comes back, idle between two requests (the
   caller gives up `fd`: the thread closes it). False when the thread is not running
   (the fd is still the caller's then). */
static PyObject *Server_adopt(ServerObject *s, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (!s->running || __atomic_load_n(&s->stopping, __ATOMIC_ACQUIRE))
        Py_RETURN_FALSE;
    pthread_mutex_lock(&s->mu);
    if (s->nadopted == s->adopted_cap) {
        size_t cap = s->adopted_cap ? s->adopted_cap * 2 : 16;
        int *more = realloc(s->adopted, cap * sizeof(int));
        if (more == NULL) {
            pthread_mutex_unlock(&s->mu);
            return PyErr_NoMemory();
        }
        s->adopted = more;
        s->adopted_cap = cap;
    }
    s->adopted[s->nadopted++] = (int)fd;
    s->returned++;
    pthread_mutex_unlock(&s->mu);
    uint64_t one = 1;
    (void)!write(s->wake_fd, &one, sizeof one);
    Py_RETURN_TRUE;
}

/* samples() -> [(seconds, hit, kind, queue, parse, write, preempted, blocked), ...]: each
   answer since the last call: its time (the walk and the JSON, as the service's lookup
   histogram measures), kind tokens or hashes, and its other stages (sample_t; -1: not
   measured). */
static PyObject *Server_samples(ServerObject *s, PyObject *Py_UNUSED(unused)) {
    pthread_mutex_lock(&s->mu);
    size_t n = s->ring_len, start = s->ring_start;
    sample_t *copy = malloc((n + 1) * sizeof(sample_t));
    if (copy != NULL) {
        for (size_t i = 0; i < n; i++)
            copy[i] = s->ring[(start + i) % RING];
        s->ring_start = (start + n) % RING;
        s->ring_len = 0;
    }
    pthread_mutex_unlock(&s->mu);
    if (copy == NULL)
        return PyErr_NoMemory();
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        sample_t *m = &copy[i];
        PyObject *item = Py_BuildValue("(dOsdddOO)", (double)m->seconds, m->hit ? Py_True : Py_False,
                                       m->hashes ? "hashes" : "tokens", (double)m->queue,
                                       (double)m->parse, (double)m->write,
                                       m->preempted ? Py_True : Py_False,
                                       m->blocked ? Py_True : Py_False);
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    free(copy);
    return out;
}

/* counts() -> (answered, handed over, stale, samples dropped, given back) since the start. */
static PyObject *Server_counts(ServerObject *s, PyObject *Py_UNUSED(unused)) {
    pthread_mutex_lock(&s->mu);
    unsigned long long a = s->answered, h = s->handed, st = s->stale, d = s->dropped;
    unsigned long long r = s->returned;
    pthread_mutex_unlock(&s->mu);
    return Py_BuildValue("(KKKKK)", a, h, st, d, r);
}

/* connections() -> the connections this side holds: served by the thread, handed over
   and not taken yet, given back and not served yet (for Python's --max-connections). */
static PyObject *Server_connections(ServerObject *s, PyObject *Py_UNUSED(unused)) {
    pthread_mutex_lock(&s->mu);
    size_t queued = s->nhandoffs + s->nadopted;
    pthread_mutex_unlock(&s->mu);
    return PyLong_FromSize_t(__atomic_load_n(&s->nconns, __ATOMIC_RELAXED) + queued);
}

/* set_others(n): Python serves `n` connections now (the thread counts them against
   max_connections before it takes one more). */
static PyObject *Server_set_others(ServerObject *s, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    __atomic_store_n(&s->others, (size_t)(n < 0 ? 0 : n), __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

/* fileno() -> the descriptor that is readable when connections wait to be taken. */
static PyObject *Server_fileno(ServerObject *s, PyObject *Py_UNUSED(unused)) {
    return PyLong_FromLong(s->handoff_fd);
}

/* What a stopped server still holds, freed: the connections handed over and not taken,
   those given back, the answers' context, the samples, the limits (the object stays: a
   later `take`, `samples` or `counts` finds nothing, `set_answer` and `start` refuse). */
static void server_free(ServerObject *s) {
    while (s->handoffs != NULL) {
        handoff_t *h = s->handoffs;
        s->handoffs = h->next;
        close(h->fd);
        free(h->data);
        free(h);
    }
    s->handoff_tail = &s->handoffs;
    s->nhandoffs = 0;
    for (size_t i = 0; i < s->nadopted; i++)
        close(s->adopted[i]);
    free(s->adopted);
    s->adopted = NULL;
    s->nadopted = s->adopted_cap = 0;
    server_release(s);
    ctx_free(s->ctx);
    s->ctx = NULL;
    free(s->ring);
    s->ring = NULL;
    s->ring_len = s->ring_start = 0;
    free(s->headers);
    s->headers = NULL;
    free(s->token);
    s->token = NULL;
    for (Py_ssize_t i = 0; i < s->nhosts; i++)
        free(s->hosts[i]);
    free(s->hosts);
    free(s->host_lens);
    s->hosts = NULL;
    s->host_lens = NULL;
    s->nhosts = 0;
    Py_CLEAR(s->core);
}

/* close(): stop, then free what the server holds, at once rather than when the object
   goes (serve keeps it alive to the end: gc.freeze). Idempotent. */
static PyObject *Server_close(ServerObject *s, PyObject *Py_UNUSED(unused)) {
    PyObject *r = Server_stop(s, NULL);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    /* The thread is joined and the GIL held from here on: nobody else reads these (the
       core's reference is released with no lock of ours held). */
    server_free(s);
    s->closed = 1;
    Py_RETURN_NONE;
}

static void Server_dealloc(ServerObject *s) {
    if (s->running) { /* not stopped: stop it here, the GIL given away while it ends */
        PyObject *r = Server_stop(s, NULL);
        Py_XDECREF(r);
    }
    server_free(s);
    if (s->api != NULL)
        pthread_mutex_destroy(&s->mu);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *Server_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    ServerObject *s = (ServerObject *)PyType_GenericNew(type, args, kwargs);
    if (s != NULL) {
        s->listen_fd = s->epfd = s->wake_fd = s->handoff_fd = -1;
    }
    return (PyObject *)s;
}

static PyMethodDef Server_methods[] = {
    {"start", (PyCFunction)Server_start, METH_NOARGS, NULL},
    {"stop", (PyCFunction)Server_stop, METH_NOARGS, NULL},
    {"close", (PyCFunction)Server_close, METH_NOARGS, NULL},
    {"set_answer", (PyCFunction)Server_set_answer, METH_VARARGS, NULL},
    {"take", (PyCFunction)Server_take, METH_NOARGS, NULL},
    {"adopt", (PyCFunction)Server_adopt, METH_O, NULL},
    {"samples", (PyCFunction)Server_samples, METH_NOARGS, NULL},
    {"counts", (PyCFunction)Server_counts, METH_NOARGS, NULL},
    {"fileno", (PyCFunction)Server_fileno, METH_NOARGS, NULL},
    {"connections", (PyCFunction)Server_connections, METH_NOARGS, NULL},
    {"set_others", (PyCFunction)Server_set_others, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ServerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvindex.service._lookupd.Server",
    .tp_basicsize = sizeof(ServerObject),
    .tp_dealloc = (destructor)Server_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Plain lookups answered by a C thread on a listening socket (see lookupd.py).",
    .tp_methods = Server_methods,
    .tp_init = (initproc)Server_init,
    .tp_new = Server_new,
};

static struct PyModuleDef lookupd_module = {PyModuleDef_HEAD_INIT, "_lookupd", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__lookupd(void) {
    if (PyType_Ready(&ServerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&lookupd_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ServerType);
    if (PyModule_AddObject(m, "Server", (PyObject *)&ServerType) < 0) {
        Py_DECREF(&ServerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
