/* The apply ceiling of the compiled core, in C alone (bench/apply_ceiling.py builds and
 * runs it): the drain stream's batches parsed and applied by T threads, each taking the
 * publishers `inst % T`, either to ONE core under one write lock (what ingest does today)
 * or each thread to a core of its own (no memory shared: what partitioning the write side
 * could give at best). No Python, no sockets: what the machine's cores give the core.
 *
 *   apply_ceiling FILE THREADS CORES [SHARDS|-SHARDS]    -> one JSON line
 *
 * With SHARDS (> 0, CORES 1): a prototype of the write side sharded by chain root
 * (docs/performance.md): SHARDS sub-cores, each a tree with its own lock and its own part
 * of every publisher's pools; a stored event goes to its chain's shard (its parent's, or
 * for a chain's start the mix of its first block's key, modulo SHARDS), a removal to the
 * shard each hash was stored in (a per-publisher route table, what the root kept in the
 * pool entry would say). A batch takes the index's lock shared, then its shards' locks in
 * ascending order, held until all its parts are applied; with -SHARDS each part is
 * applied under its own shard's lock alone (a lookup of one shard sees all or none of a
 * batch's part there either way). Exact only for streams like the bench's (one pool per
 * publisher, plain chains): `digest` says what each publisher holds, for the driver to
 * compare with the unsharded run's. SHARD_HITS=1 in the environment prints the share of
 * batches touching each shard to stderr.
 *
 * CORES 0: one core, flat combining (a thread's parsed batch is applied by whichever
 * thread is applying, which applies the queue until it is empty; the thread waits for
 * its batch). CORES -1: the same, pipelined (a thread waits for a batch only when it needs
 * its scratch again, so it parses its next batch meanwhile; two in flight per thread).
 *
 * KEEP_TOKENS=0 in the environment: the cores keep no tokens of shared nodes (core_t's
 * keep_tokens, on in serve for the dashboard), to weigh that copy.
 *
 * FILE: u32 warm-up batches, u32 measured batches, u64 measured block events, then each
 * batch as u32 publisher, u32 length, payload. Per batch it samples the monotonic clock
 * around the lock: `wait_us` waiting for it, `held_us` applying under it. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"

typedef struct {
    uint32_t inst, len;
    const uint8_t *p;
} batch_t;

typedef struct {
    core_t c;
    pthread_rwlock_t lock;
} locked_core;

typedef struct {
    int t;
    double wait, held;
    uint64_t n;
} worker_t;

static batch_t *batches;
static uint32_t nwarm, nmeas;
static uint64_t events;
static locked_core *cores;
static int nthreads, ncores;
static pthread_barrier_t start_line;
static int nshards;
static int partwise; /* sharded: each part under its shard's lock alone (else all held) */
static int combining; /* CORES 0: one core, batches handed to whichever thread applies */

/* Flat combining: a thread that parsed a batch queues it; if no thread is applying, it
 * becomes the applier and applies the queue (others' batches too) until it is empty; a
 * thread whose batch another applies waits for it (its apply's answer is synchronous). */
typedef struct pending {
    const batch_t *b;
    scratch_t *sc;
    int done;
    struct pending *next;
} pending_t;
static pthread_mutex_t queue_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t queue_done = PTHREAD_COND_INITIALIZER;
static pending_t *queue_head, **queue_tail = &queue_head;
static int applying;
static uint64_t combined, own;
static pthread_rwlock_t index_lock; /* sharded: taken shared by every batch */
static map_t *routes;                 /* sharded: per publisher, hash -> shard | copies << 8 */
static uint64_t conflicts;            /* sharded: a hash stored again in another shard */
static uint64_t touched_sum, touched_batches; /* sharded: shards per batch (thread 0's) */
static uint64_t shard_hits[64];                /* sharded: batches touching each shard */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void apply_one(locked_core *k, scratch_t *sc, const batch_t *b, worker_t *w) {
    if (parse_batch(&k->c, b->p, b->len, sc) != PARSE_OK) {
        fprintf(stderr, "a batch the fast parser leaves to Python\n");
        exit(1);
    }
    double t0 = w ? now() : 0;
    pthread_rwlock_wrlock(&k->lock);
    double t1 = w ? now() : 0;
    source_t *s = source_get(&k->c, b->inst, 1);
    apply_cursor cur = {0};
    while (apply_slice(&k->c, s, sc, &cur, 4096) == 0) {
    }
    pthread_rwlock_unlock(&k->lock);
    if (w) {
        w->wait += t1 - t0;
        w->held += now() - t1;
        w->n++;
    }
}

/* Sharded: one shard's part of a batch, the ops in batch order (copied from `sc`). */
#define GROW(p, cap, n)                                                                    \
    do {                                                                                   \
        if ((n) > (cap)) {                                                                 \
            (cap) = (n) * 2;                                                               \
            (p) = realloc((p), (size_t)(cap) * sizeof *(p));                               \
        }                                                                                  \
    } while (0)

static void part_add(scratch_t *part, const scratch_t *sc, const op_t *op, uint32_t from,
                     uint32_t n) {
    GROW(part->ops, part->ops_cap, part->nops + 1);
    op_t *o = &part->ops[part->nops++];
    *o = *op;
    GROW(part->hashes, part->hashes_cap, part->nhashes + n);
    memcpy(part->hashes + part->nhashes, sc->hashes + op->hashes_off + from, n * sizeof(phash));
    o->hashes_off = part->nhashes;
    o->nhashes = n;
    part->nhashes += n;
    if (op->type == OP_STORED) {
        GROW(part->keys, part->keys_cap, part->nkeys + op->nkeys);
        memcpy(part->keys + part->nkeys, sc->keys + op->keys_off, op->nkeys * sizeof(uint64_t));
        o->keys_off = part->nkeys;
        part->nkeys += op->nkeys;
        if (op->tokens_kept) {
            GROW(part->tokens, part->tokens_cap, part->ntokens + op->ntokens);
            memcpy(part->tokens + part->ntokens, sc->tokens + op->tokens_off,
                   op->ntokens * sizeof(uint32_t));
            o->tokens_off = part->ntokens;
            part->ntokens += op->ntokens;
        }
    }
}

static uint32_t shard_of(uint64_t x) { return (uint32_t)(mix64(x) % (uint64_t)nshards); }

static void apply_sharded(const batch_t *b, scratch_t *sc, scratch_t *parts, worker_t *w) {
    if (parse_batch(&cores[0].c, b->p, b->len, sc) != PARSE_OK) {
        fprintf(stderr, "a batch the fast parser leaves to Python\n");
        exit(1);
    }
    map_t *route = &routes[b->inst];
    uint64_t touched = 0; /* bits of the shards (nshards <= 64) */
    for (int k = 0; k < nshards; k++)
        parts[k].nops = parts[k].nhashes = parts[k].nkeys = parts[k].ntokens = 0;
    for (uint32_t i = 0; i < sc->nops; i++) {
        const op_t *op = &sc->ops[i];
        const phash *h = sc->hashes + op->hashes_off;
        int made = 0;
        if (op->type == OP_STORED) {
            uint32_t k;
            if (op->has_parent) {
                map_entry *e = map_find(route, op->parent.v, op->parent.kind);
                k = e ? (e->value & 0xFF) : shard_of(op->parent.v);
            } else {
                k = shard_of(op->nkeys ? sc->keys[op->keys_off] : (op->nhashes ? h[0].v : 0));
            }
            for (uint32_t j = 0; j < op->nhashes; j++) {
                map_entry *e = map_put(route, h[j].v, h[j].kind, &made);
                if (!made && (e->value & 0xFF) != k)
                    conflicts++;
                e->value = made ? (1u << 8 | k) : (e->value + (1u << 8));
            }
            part_add(&parts[k], sc, op, 0, op->nhashes);
            touched |= 1ULL << k;
        } else if (op->type == OP_REMOVED) {
            /* each hash to its shard: runs of one shard kept together */
            uint32_t j = 0;
            while (j < op->nhashes) {
                map_entry *e = map_find(route, h[j].v, h[j].kind);
                uint32_t k = e ? (e->value & 0xFF) : 0;
                uint32_t end = j + 1;
                if (e && (e->value -= 1u << 8) < (1u << 8))
                    map_delete(route, e);
                for (; end < op->nhashes; end++) {
                    map_entry *f = map_find(route, h[end].v, h[end].kind);
                    if ((f ? (f->value & 0xFF) : 0) != k)
                        break;
                    if (f && (f->value -= 1u << 8) < (1u << 8))
                        map_delete(route, f);
                }
                part_add(&parts[k], sc, op, j, end - j);
                touched |= 1ULL << k;
                j = end;
            }
        } else {
            for (int k = 0; k < nshards; k++) {
                part_add(&parts[k], sc, op, 0, 0);
                touched |= 1ULL << k;
            }
        }
    }
    if (w && w->t == 0) {
        touched_sum += (uint64_t)__builtin_popcountll(touched);
        for (int k = 0; k < nshards; k++)
            shard_hits[k] += touched >> k & 1;
        touched_batches++;
    }
    double t0 = w ? now() : 0, waited = 0;
    pthread_rwlock_rdlock(&index_lock);
    if (!partwise)
        for (int k = 0; k < nshards; k++)
            if (touched >> k & 1)
                pthread_rwlock_wrlock(&cores[k].lock);
    double t1 = w ? now() : 0;
    for (int k = 0; k < nshards; k++) {
        if (!(touched >> k & 1))
            continue;
        if (partwise) { /* the part under its shard's lock alone */
            double a = w ? now() : 0;
            pthread_rwlock_wrlock(&cores[k].lock);
            waited += w ? now() - a : 0;
        }
        source_t *s = source_get(&cores[k].c, b->inst, 1);
        apply_cursor cur = {0};
        while (apply_slice(&cores[k].c, s, &parts[k], &cur, UINT32_MAX) == 0) {
        }
        if (partwise)
            pthread_rwlock_unlock(&cores[k].lock);
    }
    if (!partwise)
        for (int k = 0; k < nshards; k++)
            if (touched >> k & 1)
                pthread_rwlock_unlock(&cores[k].lock);
    pthread_rwlock_unlock(&index_lock);
    if (w) {
        w->wait += t1 - t0 + waited;
        w->held += now() - t1 - waited;
        w->n++;
    }
}

static int pipelined; /* CORES -1: combining, a thread waits for a batch only to reuse its scratch */

/* Queue `me` (parsed), then: `wait` 0: return at once unless no thread applies (then apply
 * the queue); 1: return once `me` is applied. */
static double combine(locked_core *k, pending_t *me, int queue, int wait, worker_t *w) {
    double held = 0;
    pthread_mutex_lock(&queue_lock);
    if (queue) {
        me->done = 0;
        me->next = NULL;
        *queue_tail = me;
        queue_tail = &me->next;
    }
    while (!__atomic_load_n(&me->done, __ATOMIC_ACQUIRE)) {
        if (applying && !wait)
            break;
        if (applying) {
            /* spin a while (an apply takes microseconds; a futex wake-up as long), then sleep */
            pthread_mutex_unlock(&queue_lock);
            for (int spin = 0; spin < 20000 && !__atomic_load_n(&me->done, __ATOMIC_ACQUIRE);
                 spin++)
                __builtin_ia32_pause();
            pthread_mutex_lock(&queue_lock);
            if (!me->done && applying)
                pthread_cond_wait(&queue_done, &queue_lock);
            continue;
        }
        applying = 1;
        while (queue_head != NULL) {
            pending_t *batch = queue_head;
            queue_head = NULL;
            queue_tail = &queue_head;
            pthread_mutex_unlock(&queue_lock);
            double h = now();
            pthread_rwlock_wrlock(&k->lock);
            for (pending_t *p = batch; p != NULL; p = p->next) {
                source_t *s = source_get(&k->c, p->b->inst, 1);
                apply_cursor cur = {0};
                while (apply_slice(&k->c, s, p->sc, &cur, 4096) == 0) {
                }
                if (w && p != me)
                    combined++;
                else if (w)
                    own++;
            }
            pthread_rwlock_unlock(&k->lock);
            held += now() - h;
            pthread_mutex_lock(&queue_lock);
            for (pending_t *p = batch, *next; p != NULL; p = next) {
                next = p->next;
                __atomic_store_n(&p->done, 1, __ATOMIC_RELEASE);
            }
            pthread_cond_broadcast(&queue_done);
        }
        applying = 0;
    }
    pthread_mutex_unlock(&queue_lock);
    return held;
}

static void apply_combined(locked_core *k, scratch_t *sc, const batch_t *b, worker_t *w) {
    if (parse_batch(&k->c, b->p, b->len, sc) != PARSE_OK)
        exit(1);
    double t0 = w ? now() : 0;
    pending_t me = {b, sc, 0, NULL};
    double held = combine(k, &me, 1, 1, w);
    if (w) {
        w->wait += now() - t0 - held;
        w->held += held;
        w->n++;
    }
}

/* Two batches in flight per thread: parse the next while the last waits to be applied. */
static void apply_pipelined(locked_core *k, scratch_t sc[2], pending_t slot[2], uint32_t *turn,
                            const batch_t *b, worker_t *w) {
    pending_t *me = &slot[*turn & 1];
    if (me->b != NULL && !me->done)
        combine(k, me, 0, 1, w); /* its scratch is needed again */
    if (parse_batch(&k->c, b->p, b->len, &sc[*turn & 1]) != PARSE_OK)
        exit(1);
    me->b = b;
    me->sc = &sc[*turn & 1];
    double held = combine(k, me, 1, 0, w);
    (*turn)++;
    if (w) {
        w->held += held;
        w->n++;
    }
}

static void *work(void *arg) {
    worker_t *w = arg;
    scratch_t sc = {0}, parts[64] = {{0}}, two[2] = {{0}};
    pending_t slot[2] = {{0}};
    uint32_t turn = 0;
    locked_core *k = &cores[w->t % ncores];
    pthread_barrier_wait(&start_line);
    for (uint32_t i = nwarm; i < nwarm + nmeas; i++)
        if ((int)(batches[i].inst % (uint32_t)nthreads) == w->t) {
            if (nshards)
                apply_sharded(&batches[i], &sc, parts, w);
            else if (pipelined)
                apply_pipelined(k, two, slot, &turn, &batches[i], w);
            else if (combining)
                apply_combined(k, &sc, &batches[i], w);
            else
                apply_one(k, &sc, &batches[i], w);
        }
    for (int j = 0; j < 2; j++) /* the last ones applied */
        if (slot[j].b != NULL && !slot[j].done)
            combine(k, &slot[j], 0, 1, w);
    scratch_free(&sc);
    scratch_free(&two[0]);
    scratch_free(&two[1]);
    for (int p = 0; p < nshards; p++)
        scratch_free(&parts[p]);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5)
        return 2;
    nthreads = atoi(argv[2]);
    ncores = atoi(argv[3]);
    nshards = argc == 5 ? atoi(argv[4]) : 0;
    if (ncores <= 0) {
        combining = 1;
        pipelined = ncores < 0;
        ncores = 1;
    }
    if (nshards < 0) { /* negative: each part under its own shard's lock alone */
        nshards = -nshards;
        partwise = 1;
    }
    if (nthreads < 1 || nthreads > 64 || (ncores != 1 && ncores != nthreads) || nshards < 0 ||
        nshards > 64 || (nshards && ncores != 1))
        return 2;
    if (nshards)
        ncores = nshards; /* the shards' sub-cores */
    FILE *f = fopen(argv[1], "rb");
    if (f == NULL)
        return 1;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)size);
    if (fread(buf, 1, (size_t)size, f) != (size_t)size)
        return 1;
    fclose(f);
    memcpy(&nwarm, buf, 4);
    memcpy(&nmeas, buf + 4, 4);
    memcpy(&events, buf + 8, 8);
    batches = malloc(sizeof(batch_t) * (nwarm + nmeas));
    const uint8_t *q = buf + 16;
    for (uint32_t i = 0; i < nwarm + nmeas; i++) {
        memcpy(&batches[i].inst, q, 4);
        memcpy(&batches[i].len, q + 4, 4);
        batches[i].p = q + 8;
        q += 8 + batches[i].len;
    }
    cores = calloc((size_t)ncores, sizeof(locked_core));
    for (int k = 0; k < ncores; k++) {
        core_init(&cores[k].c, 1);
        if (getenv("KEEP_TOKENS") && atoi(getenv("KEEP_TOKENS")) == 0)
            cores[k].c.keep_tokens = 0; /* what the shared nodes' token copies cost */
        pthread_rwlock_init(&cores[k].lock, NULL);
    }
    uint32_t npubs = 0;
    for (uint32_t i = 0; i < nwarm + nmeas; i++)
        npubs = batches[i].inst + 1 > npubs ? batches[i].inst + 1 : npubs;
    routes = calloc(npubs, sizeof(map_t));
    pthread_rwlock_init(&index_lock, NULL);
    scratch_t sc = {0}, parts[64] = {{0}};
    for (uint32_t i = 0; i < nwarm; i++) { /* the steady state, untimed */
        if (nshards)
            apply_sharded(&batches[i], &sc, parts, NULL);
        else
            apply_one(&cores[(batches[i].inst % (uint32_t)nthreads) % (uint32_t)ncores], &sc,
                      &batches[i], NULL);
    }
    scratch_free(&sc);
    for (int p = 0; p < nshards; p++)
        scratch_free(&parts[p]);
    pthread_barrier_init(&start_line, NULL, (unsigned)nthreads + 1);
    pthread_t threads[64];
    worker_t workers[64] = {{0}};
    for (int t = 0; t < nthreads; t++) {
        workers[t].t = t;
        pthread_create(&threads[t], NULL, work, &workers[t]);
    }
    pthread_barrier_wait(&start_line);
    double start = now();
    for (int t = 0; t < nthreads; t++)
        pthread_join(threads[t], NULL);
    double seconds = now() - start;
    double wait = 0, held = 0;
    uint64_t n = 0;
    for (int t = 0; t < nthreads; t++) {
        wait += workers[t].wait;
        held += workers[t].held;
        n += workers[t].n;
    }
    if (getenv("SHARD_HITS"))
        for (int k = 0; k < nshards; k++)
            fprintf(stderr, "%d:%.2f ", k, (double)shard_hits[k] / (double)touched_batches);
    /* What each publisher holds, over every core (a shard's part of it in each). */
    uint64_t digest = 0, entries = 0;
    for (int k = 0; k < ncores; k++)
        for (uint32_t bit = 0; bit < cores[k].c.nsources_cap; bit++) {
            source_t *s = cores[k].c.sources[bit];
            for (uint32_t p = 0; s != NULL && p < s->npools; p++)
                PMAP_FOREACH(&s->pools[p].blocks, e) {
                    digest += mix64(e->a ^ ((uint64_t)bit << 56));
                    entries++;
                }
        }
    printf("{\"threads\": %d, \"combining\": %d, \"pipelined\": %d, \"partwise\": %d, \"cores\": %d, \"shards\": %d, \"per_s\": %.0f, "
           "\"wait_us\": %.3f, \"held_us\": %.3f, \"entries\": %llu, \"digest\": \"%016llx\", "
           "\"conflicts\": %llu, \"shards_per_batch\": %.2f}\n",
           nthreads, combining, pipelined, partwise, nshards ? 1 : ncores, nshards, (double)events / seconds,
           wait / (double)n * 1e6, held / (double)n * 1e6, (unsigned long long)entries,
           (unsigned long long)digest, (unsigned long long)conflicts,
           touched_batches ? (double)touched_sum / (double)touched_batches : 0.0);
    for (int k = 0; k < ncores; k++)
        core_free(&cores[k].c);
    free(cores);
    free(batches);
    free(buf);
    return 0;
}
