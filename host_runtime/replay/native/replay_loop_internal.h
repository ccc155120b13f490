/* What the replay loop's files share (not in the cdef: replay_loop.h is the public header): the engine and its
 * streams, the tables, and the calls between the files, named replay_*:
 *
 * replay_feed.c     the calls that make, feed and free an engine (rp_new, rp_feed, rp_feed_objects, rp_phase_*),
 *                   its streams and their batches;
 * replay_loop.c     the heap of streams and a request's steps, on the device and the Master;
 * replay_results.c  the rows (buckets) and their latencies, the set of known keys, and the calls that read
 *                   them out (rp_buckets, rp_get_*).
 */
#ifndef REPLAY_LOOP_INTERNAL_H
#define REPLAY_LOOP_INTERNAL_H

#include "replay_loop.h"

#include <stdlib.h>
#include <string.h>

#include "chm_core.h"
#include "master_table.h"

_Static_assert(sizeof(rp_key) == sizeof(mt_key), "rp_key is mt_key");

#define NONE_LOC UINT64_MAX  /* put_start placed no block (stored, in flight, or no room) */

/* ---------------------------------------------------------------------------------------- hash tables */

static inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27; x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* A set of keys (driver: Replay.known), open addressing, linear probing, one cache line per probe: an empty
 * slot holds EMPTY_KEY, and the key that equals it is a flag of its own. */
#define EMPTY_HALF UINT64_MAX

struct keyset {
    rp_key *keys;
    uint64_t mask, n;
    int has_empty_key;
};

static inline int is_empty(rp_key k) { return k.lo == EMPTY_HALF && k.hi == EMPTY_HALF; }
static inline uint64_t key_hash(rp_key k) { return mix64(k.lo ^ mix64(k.hi)); }

int replay_keyset_grow(struct keyset *s);

static inline int keyset_has(const struct keyset *s, rp_key k)
{
    if (is_empty(k)) return s->has_empty_key;
    if (!s->mask) return 0;
    for (uint64_t h = key_hash(k) & s->mask; !is_empty(s->keys[h]); h = (h + 1) & s->mask)
        if (s->keys[h].lo == k.lo && s->keys[h].hi == k.hi) return 1;
    return 0;
}

/* 1: added, 0: there already, -1: no memory */
static inline int keyset_add(struct keyset *s, rp_key k)
{
    if (is_empty(k)) {
        int added = !s->has_empty_key;
        s->has_empty_key = 1;
        s->n += (uint64_t)added;
        return added;
    }
    if (2 * (s->n + 1) > s->mask + 1 && replay_keyset_grow(s)) return -1;
    uint64_t h = key_hash(k) & s->mask;
    for (; !is_empty(s->keys[h]); h = (h + 1) & s->mask)
        if (s->keys[h].lo == k.lo && s->keys[h].hi == k.hi) return 0;
    s->keys[h] = k;
    s->n++;
    return 1;
}

/* Read latencies of a row: distinct values (their bits) with counts (count 0: an empty slot). */
struct latmap {
    double *values;
    uint64_t *counts;
    uint64_t mask, n;
};

/* Adds one sample of v. 0, or -1: no memory. */
int replay_latmap_add(struct latmap *m, double v);

/* ---------------------------------------------------------------------------------------- the engine */

struct row {
    struct rp_bucket b;
    struct latmap lat;
};

/* A batch of streams fed by rp_feed (vt: copied, alive while a stream of it is) */
struct batch {
    double *think_ns;               /* per request, NULL: none */
    uint64_t *key_start;            /* per request: its first key */
    uint64_t *request_keys;         /* per request */
    rp_key *keys;
    uint64_t live;                  /* streams of it not finished */
    int owned;                      /* the arrays are the batch's (vt), else the caller's (sequential) */
};

enum { ST_THINK, ST_BEGIN, ST_READ, ST_WRITE, ST_END };

struct stream {
    uint64_t idx;                   /* its number in the phase (the heap's tie-break: driver.run's i) */
    double now;
    int stage;
    struct batch *batch;            /* NULL: an object request (rp_feed_objects) */
    uint64_t req, req_end, first_req;
    uint64_t obj;                   /* object mode: the object id, and its blocks */
    uint64_t blocks;
    const rp_key *keys;             /* the current request's keys */
    uint64_t n_keys;
    rp_key *own_keys; uint64_t own_cap;
    uint64_t *addrs; uint64_t addrs_cap; uint64_t n_addrs;
    uint64_t *locs; uint64_t locs_cap; uint64_t n_locs;
    rp_key *written; uint64_t written_cap; uint64_t n_written;
    rp_key *refused; uint64_t refused_cap; uint64_t n_refused;
    uint64_t j;
    struct stream *next_free;
};

struct heap_entry {
    double t;
    uint64_t idx;
    struct stream *s;
};

struct rp_engine {
    struct chm_dev *dev;
    mt_table *mt;
    struct rp_params p;
    struct rp_counts c;
    struct rp_error err;
    struct keyset known;
    struct row *rows; uint64_t n_rows, rows_cap;
    /* by_time: window index -> row (open addressing; slot value row + 1, 0 empty) */
    int64_t *win_keys; uint64_t *win_rows; uint64_t win_mask;
    int64_t last_win; uint64_t last_row; int have_last;
    uint64_t phase_row;             /* phase rows: the current phase's */
    double t0;                      /* the phase's start */
    uint64_t next_idx;              /* the phase's next stream number */
    struct heap_entry *heap; uint64_t heap_cap;
    double last_popped; int popped;
    struct stream *free_streams;
    struct stream *seq_stream;
    uint64_t *positions; uint64_t positions_cap;  /* a request's reusable positions */
    uint32_t *sizes;                /* max_batch slot sizes (put_start) */
    uint64_t *checksums;            /* max_batch zeros (put_end) */
    uint64_t *offsets; uint32_t *versions;  /* max_batch (put_start's answers) */
};

static inline int grow(void **p, uint64_t *cap, uint64_t need, size_t size)
{
    if (need <= *cap) return 0;
    uint64_t cap2 = *cap ? *cap : 4;
    while (cap2 < need) cap2 *= 2;
    void *q = realloc(*p, cap2 * size);
    if (!q) return -1;
    *p = q;
    *cap = cap2;
    return 0;
}

static inline int fail(struct rp_engine *e, int rc, int op, int64_t status)
{
    e->err.op = op;
    e->err.status = status;
    return rc;
}

static inline struct row *row_of(struct rp_bucket *b)
{
    return (struct row *)b;  /* its first member */
}

/* ---- between the files ---- */

/* replay_results.c: a new row (NULL: no memory); the row of the request at `now` (driver: Replay._bucket_at). */
struct row *replay_new_row(struct rp_engine *e, int64_t key, double start_ns);
struct rp_bucket *replay_bucket_at(struct rp_engine *e, double now);

/* replay_loop.c: the device's background work up to `until`; the heap run up to a bound (RP_FEED_*); a stream's
 * entry (sequential: run at once). */
int replay_run_until(struct rp_engine *e, double until);
int replay_run_heap(struct rp_engine *e, double bound_t, uint64_t bound_idx, int feed);
int replay_enter(struct rp_engine *e, struct stream *s, double start_ns);

/* replay_feed.c: a finished stream back to the free list (its batch dropped). */
void replay_give_stream(struct rp_engine *e, struct stream *s);

#endif
