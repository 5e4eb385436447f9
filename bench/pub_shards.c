/* The write side sharded by publisher, in C alone (bench/pub_shards.py builds and runs it):
 * the lookup bench's fill (kvindex.bench.workloads.fill, as vLLM batches) applied to SHARDS
 * cores, each holding the publishers assigned to it (each with a bit of its own there),
 * then the bench's 512-block prompts looked up over every shard and the answers merged.
 * What per-publisher sharding costs the index's memory (the shared prefixes held once per
 * shard) and a lookup (a walk per shard), beside one core (SHARDS 1) in the same run.
 *
 *   pub_shards FILE SHARDS ASSIGN ROUNDS    -> one JSON line
 *
 * ASSIGN: each publisher's shard, comma-separated, in publisher order (the driver's
 * round-robin or FNV-1a assignment). A lookup, timed per prompt (the clock around it):
 * - `once`: the prompt's block keys digested once (prompt_keys against shard 0's core:
 *   every core has the same seed, so the same keys), then each shard walked under its read
 *   lock (walk() stops where its last engine stops matching) and the depths merged into
 *   one per publisher: what a sharded index could do in C;
 * - `per_shard`: the same, the keys digested again for each shard: what N `Core.lookup`
 *   calls cost beside it (the compiled API takes tokens, not keys);
 * - `hash`: the digest alone;
 * - `slowest_shard`: the digest plus the slowest shard's own walk (each shard's lock, walk
 *   and merge timed apart, the longest kept): the least a lookup whose shards are walked
 *   by parallel threads could take, their hand-off not counted.
 * Every lookup's merged depths are printed (per prompt, per publisher) for the driver to
 * hold to the one core's; `once` and `per_shard` must agree here too.
 *
 * FILE: u32 publishers, u32 batches, u32 prompts, u32 tokens a prompt, then each batch as
 * u32 publisher, u32 length, payload, then each prompt's tokens as u32. */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

#define BLOCK 16
#define MAX_PUBS 4096
#define MODES 4

typedef struct {
    core_t c;
    pthread_rwlock_t lock;
} shard_t;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static long rss_bytes(void) {
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f == NULL || fscanf(f, "%ld %ld", &pages, &resident) != 2)
        exit(1);
    fclose(f);
    return resident * sysconf(_SC_PAGESIZE);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The probe's percentile: the value at rank q * (n - 1), interpolated. */
static double percentile(double *v, uint32_t n, double q) {
    qsort(v, n, sizeof *v, cmp_double);
    double at = q * (double)(n - 1);
    uint32_t lo = (uint32_t)at;
    uint32_t hi = lo + 1 < n ? lo + 1 : lo;
    return v[lo] + (v[hi] - v[lo]) * (at - (double)lo);
}

static double median(double *v, uint32_t n) { return percentile(v, n, 0.5); }

static shard_t *shards;
static int nshards;
static uint32_t npubs, shard_of[MAX_PUBS], bit_of[MAX_PUBS];
static uint32_t members[64][MAX_PUBS], nmembers[64]; /* per shard, its publishers */

/* One lookup over every shard: `out` gets each publisher's matched blocks. `hash_each`:
 * digest the prompt's keys again for every shard. Returns the blocks walked (the deepest
 * match of each shard, summed: the tree steps a lookup takes). */
static uint32_t lookup(const uint32_t *tokens, uint32_t ntokens, uint64_t *keys, uint32_t *depth,
                       uint64_t *alive, uint32_t *out, int hash_each, double *slowest) {
    uint32_t nkeys = hash_each ? 0 : prompt_keys(&shards[0].c, tokens, NULL, ntokens, BLOCK, keys);
    uint32_t steps = 0;
    for (int k = 0; k < nshards; k++) {
        core_t *c = &shards[k].c;
        double t0 = slowest ? now() : 0;
        pthread_rwlock_rdlock(&shards[k].lock);
        if (hash_each)
            nkeys = prompt_keys(c, tokens, NULL, ntokens, BLOCK, keys);
        uint32_t root = root_find(c, 0, 0, BLOCK);
        memset(depth, 0, ((size_t)c->max_bit + 1) * sizeof(uint32_t));
        if (root != NODE_NONE && c->nodes[root].nchild)
            walk(c, root, keys, nkeys, depth, NULL, alive, NULL);
        uint32_t deepest = 0;
        for (uint32_t i = 0; i < nmembers[k]; i++) {
            uint32_t p = members[k][i];
            out[p] = depth[bit_of[p]];
            deepest = out[p] > deepest ? out[p] : deepest;
        }
        pthread_rwlock_unlock(&shards[k].lock);
        steps += deepest;
        if (slowest && now() - t0 > *slowest)
            *slowest = now() - t0;
    }
    return steps;
}

int main(int argc, char **argv) {
    if (argc != 5)
        return 2;
    nshards = atoi(argv[2]);
    int rounds = atoi(argv[4]);
    if (nshards < 1 || nshards > 64 || rounds < 1)
        return 2;
    FILE *f = fopen(argv[1], "rb");
    if (f == NULL)
        return 1;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)size);
    if (buf == NULL || fread(buf, 1, (size_t)size, f) != (size_t)size)
        return 1;
    fclose(f);
    uint32_t head[4];
    memcpy(head, buf, sizeof head);
    npubs = head[0];
    uint32_t nbatches = head[1], nprompts = head[2], ptokens = head[3];
    if (npubs > MAX_PUBS)
        return 2;
    /* the assignment: a shard per publisher; its bit there is its rank among the shard's */
    const char *a = argv[3];
    for (uint32_t p = 0; p < npubs; p++) {
        char *end;
        long k = strtol(a, &end, 10);
        if (end == a || k < 0 || k >= nshards)
            return 2;
        shard_of[p] = (uint32_t)k;
        bit_of[p] = nmembers[k];
        members[k][nmembers[k]++] = p;
        a = *end == ',' ? end + 1 : end;
    }
    malloc_trim(0);
    long rss0 = rss_bytes();
    size_t alloc0 = kv_alloc_bytes;
    shards = calloc((size_t)nshards, sizeof(shard_t));
    for (int k = 0; k < nshards; k++) {
        core_init(&shards[k].c, 1); /* one seed: the prompt's keys are every shard's */
        pthread_rwlock_init(&shards[k].lock, NULL);
    }
    const uint8_t *q = buf + sizeof head;
    scratch_t sc = {0};
    double t0 = now();
    for (uint32_t i = 0; i < nbatches; i++) {
        uint32_t inst, len;
        memcpy(&inst, q, 4);
        memcpy(&len, q + 4, 4);
        core_t *c = &shards[shard_of[inst]].c;
        if (inst >= npubs || parse_batch(c, q + 8, len, &sc) != PARSE_OK) {
            fprintf(stderr, "batch %u: not a fast-parser batch\n", i);
            return 1;
        }
        source_t *s = source_get(c, bit_of[inst], 1);
        if (s == NULL || apply_ops(c, s, &sc) != 0) {
            fprintf(stderr, "batch %u: apply failed\n", i);
            return 1;
        }
        q += 8 + len;
    }
    double build_s = now() - t0;
    scratch_free(&sc);
    size_t alloc_bytes = kv_alloc_bytes - alloc0;
    long rss_delta = rss_bytes() - rss0;
    uint64_t entries = 0, nodes = 0, node_bytes = 0, children = 0, sets = 0, pools = 0;
    for (int k = 0; k < nshards; k++) {
        core_t *c = &shards[k].c;
        for (uint32_t b = 0; b < c->max_bit; b++)
            for (uint32_t i = 0; c->sources[b] && i < c->sources[b]->npools; i++) {
                entries += c->sources[b]->pools[i].blocks.count;
                pools += pmap_bytes(&c->sources[b]->pools[i].blocks);
            }
        nodes += c->live_nodes - c->nns;
        node_bytes += (uint64_t)c->nodes_cap * sizeof(node_t);
        children += pmap_bytes(&c->children);
        sets += (uint64_t)c->sets_cap * c->set_words * 8;
    }

    const uint32_t *prompts = (const uint32_t *)q;
    uint64_t *keys = malloc(((size_t)ptokens / BLOCK + 1) * sizeof(uint64_t));
    uint32_t *depth = calloc(MAX_PUBS + 1, sizeof(uint32_t));
    uint64_t alive[MAX_PUBS / 64 + 1];
    uint32_t *answers = calloc((size_t)nprompts * npubs, sizeof(uint32_t));
    uint32_t *check = calloc(npubs, sizeof(uint32_t));
    double *times = malloc((size_t)nprompts * sizeof(double));
    double *p50[MODES], *p99[MODES];
    for (int m = 0; m < MODES; m++) {
        p50[m] = malloc((size_t)rounds * sizeof(double));
        p99[m] = malloc((size_t)rounds * sizeof(double));
    }
    uint64_t steps = 0;
    for (uint32_t i = 0; i < nprompts; i++) { /* untimed: the answers, both ways */
        const uint32_t *t = prompts + (size_t)i * ptokens;
        steps += lookup(t, ptokens, keys, depth, alive, answers + (size_t)i * npubs, 0, NULL);
        lookup(t, ptokens, keys, depth, alive, check, 1, NULL);
        if (memcmp(check, answers + (size_t)i * npubs, npubs * sizeof(uint32_t)) != 0) {
            fprintf(stderr, "prompt %u: keys digested once and per shard disagree\n", i);
            return 1;
        }
    }
    for (int r = 0; r < rounds; r++)
        for (int m = 0; m < MODES; m++) { /* once, per_shard, hash, slowest_shard */
            for (uint32_t i = 0; i < nprompts; i++) {
                const uint32_t *t = prompts + (size_t)i * ptokens;
                double s = now(), slowest = 0;
                if (m < 2) {
                    lookup(t, ptokens, keys, depth, alive, check, m, NULL);
                    times[i] = now() - s;
                } else if (m == 2) {
                    prompt_keys(&shards[0].c, t, NULL, ptokens, BLOCK, keys);
                    times[i] = now() - s;
                } else { /* the digest, then the slowest shard's walk alone */
                    prompt_keys(&shards[0].c, t, NULL, ptokens, BLOCK, keys);
                    double hashed = now() - s;
                    lookup(t, ptokens, keys, depth, alive, check, 0, &slowest);
                    times[i] = hashed + slowest;
                }
            }
            p50[m][r] = percentile(times, nprompts, 0.50) * 1e6;
            p99[m][r] = percentile(times, nprompts, 0.99) * 1e6;
        }
    printf("{\"shards\": %d, \"entries\": %llu, \"tree_nodes\": %llu, \"build_s\": %.3f, "
           "\"alloc_bytes\": %zu, \"rss_delta_bytes\": %ld, \"node_bytes\": %llu, "
           "\"children_bytes\": %llu, \"holder_set_bytes\": %llu, \"pool_bytes\": %llu, "
           "\"mean_steps\": %.1f",
           nshards, (unsigned long long)entries, (unsigned long long)nodes, build_s, alloc_bytes,
           rss_delta, (unsigned long long)node_bytes, (unsigned long long)children,
           (unsigned long long)sets, (unsigned long long)pools, (double)steps / nprompts);
    const char *names[MODES] = {"once", "per_shard", "hash", "slowest_shard"};
    for (int m = 0; m < MODES; m++) {
        printf(", \"%s\": {\"round_p50_us\": [", names[m]);
        for (int r = 0; r < rounds; r++)
            printf("%s%.3f", r ? ", " : "", p50[m][r]);
        printf("], \"round_p99_us\": [");
        for (int r = 0; r < rounds; r++)
            printf("%s%.3f", r ? ", " : "", p99[m][r]);
        double a50 = median(p50[m], (uint32_t)rounds), a99 = median(p99[m], (uint32_t)rounds);
        printf("], \"p50_us\": %.3f, \"p99_us\": %.3f}", a50, a99);
    }
    printf(", \"depths\": [");
    for (uint32_t i = 0; i < nprompts; i++) {
        printf("%s[", i ? ", " : "");
        for (uint32_t p = 0; p < npubs; p++)
            printf("%s%u", p ? "," : "", answers[(size_t)i * npubs + p]);
        printf("]");
    }
    printf("]}\n");
    for (int k = 0; k < nshards; k++)
        core_free(&shards[k].c);
    return 0;
}
