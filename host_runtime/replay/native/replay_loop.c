/* The replay's request loop (replay_loop.h says what and why; driver.py's Replay is the specification: each
 * step below names the Python it mirrors). */
#include "replay_loop.h"

#include <math.h>
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

static int keyset_grow(struct keyset *s)
{
    uint64_t cap = s->mask ? 2 * (s->mask + 1) : 1024;
    rp_key *keys = malloc(cap * sizeof(rp_key));
    if (!keys) return -1;
    memset(keys, 0xff, cap * sizeof(rp_key));
    for (uint64_t i = 0; s->mask && i <= s->mask; i++) {
        if (is_empty(s->keys[i])) continue;
        uint64_t h = key_hash(s->keys[i]) & (cap - 1);
        while (!is_empty(keys[h])) h = (h + 1) & (cap - 1);
        keys[h] = s->keys[i];
    }
    free(s->keys);
    s->keys = keys;
    s->mask = cap - 1;
    return 0;
}

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
    if (2 * (s->n + 1) > s->mask + 1 && keyset_grow(s)) return -1;
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

static int latmap_add(struct latmap *m, double v)
{
    if (2 * (m->n + 1) > m->mask + 1) {
        uint64_t cap = m->mask ? 2 * (m->mask + 1) : 64;
        double *values = malloc(cap * sizeof(double));
        uint64_t *counts = calloc(cap, sizeof(uint64_t));
        if (!values || !counts) { free(values); free(counts); return -1; }
        for (uint64_t i = 0; m->mask && i <= m->mask; i++) {
            if (!m->counts[i]) continue;
            uint64_t bits;
            memcpy(&bits, &m->values[i], 8);
            uint64_t h = mix64(bits) & (cap - 1);
            while (counts[h]) h = (h + 1) & (cap - 1);
            values[h] = m->values[i];
            counts[h] = m->counts[i];
        }
        free(m->values); free(m->counts);
        m->values = values; m->counts = counts; m->mask = cap - 1;
    }
    uint64_t bits;
    memcpy(&bits, &v, 8);
    uint64_t h = mix64(bits) & m->mask;
    while (m->counts[h]) {
        uint64_t other;
        memcpy(&other, &m->values[h], 8);
        if (other == bits) { m->counts[h]++; return 0; }
        h = (h + 1) & m->mask;
    }
    m->values[h] = v;
    m->counts[h] = 1;
    m->n++;
    return 0;
}

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

static int grow(void **p, uint64_t *cap, uint64_t need, size_t size)
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

static int fail(struct rp_engine *e, int rc, int op, int64_t status)
{
    e->err.op = op;
    e->err.status = status;
    return rc;
}

/* Python's float floor division (CPython's _float_div_mod), so a window index is the one int(now // w) gives. */
static double py_floordiv(double vx, double wx)
{
    double mod = fmod(vx, wx), div = (vx - mod) / wx, floordiv;
    if (mod) {
        if ((wx < 0) != (mod < 0)) div -= 1.0;
    }
    if (div) {
        floordiv = floor(div);
        if (div - floordiv > 0.5) floordiv += 1.0;
    } else {
        floordiv = copysign(0.0, vx / wx);
    }
    return floordiv;
}

static struct row *new_row(struct rp_engine *e, int64_t key, double start_ns)
{
    if (grow((void **)&e->rows, &e->rows_cap, e->n_rows + 1, sizeof(struct row))) return NULL;
    struct row *r = &e->rows[e->n_rows++];
    memset(r, 0, sizeof *r);
    r->b.key = key;
    r->b.start_ns = start_ns;
    r->b.first_read = r->b.first_write = INFINITY;
    return r;
}

/* driver: Replay._bucket_at */
static struct rp_bucket *bucket_at(struct rp_engine *e, double now)
{
    if (!e->p.by_time) return &e->rows[e->phase_row].b;
    int64_t k = (int64_t)py_floordiv(now, e->p.bucket_ns);
    if (e->have_last && k == e->last_win) return &e->rows[e->last_row].b;
    if (2 * (e->n_rows + 1) > e->win_mask + 1) {  /* grow the index */
        uint64_t cap = e->win_mask ? 2 * (e->win_mask + 1) : 64;
        int64_t *keys = malloc(cap * sizeof(int64_t));
        uint64_t *rows = calloc(cap, sizeof(uint64_t));
        if (!keys || !rows) { free(keys); free(rows); return NULL; }
        for (uint64_t i = 0; e->win_mask && i <= e->win_mask; i++) {
            if (!e->win_rows[i]) continue;
            uint64_t h = mix64((uint64_t)e->win_keys[i]) & (cap - 1);
            while (rows[h]) h = (h + 1) & (cap - 1);
            keys[h] = e->win_keys[i];
            rows[h] = e->win_rows[i];
        }
        free(e->win_keys); free(e->win_rows);
        e->win_keys = keys; e->win_rows = rows; e->win_mask = cap - 1;
    }
    uint64_t h = mix64((uint64_t)k) & e->win_mask;
    while (e->win_rows[h] && e->win_keys[h] != k) h = (h + 1) & e->win_mask;
    if (!e->win_rows[h]) {
        if (!new_row(e, k, (double)k * e->p.bucket_ns)) return NULL;
        e->win_keys[h] = k;
        e->win_rows[h] = e->n_rows;
    }
    e->last_win = k;
    e->last_row = e->win_rows[h] - 1;
    e->have_last = 1;
    return &e->rows[e->last_row].b;
}

static struct row *row_of(struct rp_bucket *b)
{
    return (struct row *)b;  /* its first member */
}

/* ---- the device's operations (Controller.read / write / flush / run_until on a native device) ---- */

static int run_until(struct rp_engine *e, double until)
{
    uint64_t ran = 0;
    double t = e->c.background_ns;
    int rc = chm_dev_run_until(e->dev, e->c.background_ns, until, &ran, &t);
    if (rc) {
        e->err.detail = t;  /* CHM_E_INTERNAL: when the rule said a flush was due */
        return fail(e, RP_E_DEVICE, RP_OP_RUN_UNTIL, rc);
    }
    e->c.background_ns = until > t ? until : t;
    e->c.events_run += ran;
    return RP_OK;
}

/* driver: Replay._read (count_hits), with the latency sample of _request's read loop */
static int do_read(struct rp_engine *e, uint64_t addr, double *now)
{
    double start = *now, finish;
    uint64_t len = e->p.block_bytes, hits, missed = 0, merged = 0;
    int rc = chm_dev_tick(e->dev, start, 0);
    if (rc < 0) return fail(e, RP_E_DEVICE, RP_OP_TICK, rc);
    int64_t hit = chm_dev_read_hit(e->dev, addr, len, start, NULL, 1, &finish);
    if (hit) {
        hits = (uint64_t)hit;
    } else {
        double res[4];
        int64_t n = chm_dev_read(e->dev, addr, len, start, 1, res);
        if (n <= 0) {
            e->err.addr = addr;
            e->err.detail = res[1];
            return fail(e, RP_E_DEVICE, RP_OP_READ, n);
        }
        finish = res[0];
        hits = (uint64_t)res[1];
        missed = (uint64_t)res[2];
        merged = (uint64_t)res[3];
    }
    struct rp_bucket *b = bucket_at(e, start);
    if (!b) return fail(e, RP_E_NOMEM, RP_OP_READ, 0);
    b->reads++;
    b->read_bytes += len;
    b->hit_pages += hits + merged;
    b->miss_pages += missed;
    if (start < b->first_read) b->first_read = start;
    if (finish > b->last_read) b->last_read = finish;
    if (latmap_add(&row_of(b)->lat, finish - start)) return fail(e, RP_E_NOMEM, RP_OP_READ, 0);
    *now = finish;
    return RP_OK;
}

/* driver: Replay._write; *accepted 0 for a refused write */
static int do_write(struct rp_engine *e, uint64_t addr, double *now, int *accepted)
{
    double start = *now;
    struct rp_bucket *b = bucket_at(e, start);
    if (!b) return fail(e, RP_E_NOMEM, RP_OP_WRITE, 0);
    struct chm_write_result res;
    int rc = chm_dev_write(e->dev, addr, e->p.block_bytes, start, 1, &res);
    if (rc == CHM_WRITE_REFUSED) {
        b->refused_writes++;
        *now = start + e->p.refusal_ns;
        *accepted = 0;
        return RP_OK;
    }
    if (rc) {
        e->err.addr = addr;
        e->err.detail = (double)res.page;
        e->err.new_pages = res.new_pages;
        return fail(e, RP_E_DEVICE, RP_OP_WRITE, rc);
    }
    double finish = res.finish;
    b->writes++;
    b->write_bytes += e->p.block_bytes;
    b->write_miss_pages += res.new_pages;
    b->write_hit_pages += res.pages - res.new_pages;
    if (start < b->first_write) b->first_write = start;
    if (finish > b->last_write) b->last_write = finish;
    if (e->p.sequential) {  /* drain the write-back */
        finish = chm_dev_flush(e->dev, finish);
        if (finish != finish) return fail(e, RP_E_DEVICE, RP_OP_FLUSH, CHM_E_NOMEM);
    }
    *now = finish;
    *accepted = 1;
    return RP_OK;
}

/* ---- the Master (driver: Replay._lookup, _put_start, _put_finish) ---- */

static int lookup(struct rp_engine *e, struct stream *s, double now)
{
    double clock = now / 1e9;
    uint64_t n = s->n_keys, found = 0;
    if (grow((void **)&s->addrs, &s->addrs_cap, n, sizeof(uint64_t))) return fail(e, RP_E_NOMEM, RP_OP_LOOKUP, 0);
    for (uint64_t i = 0; i < n; i += e->p.max_batch) {
        uint64_t c = n - i < e->p.max_batch ? n - i : e->p.max_batch;
        int64_t r = mt_lookup(e->mt, clock, (const mt_key *)s->keys + i, (int64_t)c, s->addrs + i, NULL, NULL, NULL);
        if (r < 0) return fail(e, RP_E_MASTER, RP_OP_LOOKUP, -r);
        found += (uint64_t)r;
        if ((uint64_t)r < c) break;
    }
    s->n_addrs = found;
    return RP_OK;
}

static int put_start(struct rp_engine *e, struct stream *s, double now)
{
    double clock = now / 1e9;
    uint64_t rest = s->n_keys - s->n_addrs;
    const mt_key *keys = (const mt_key *)s->keys + s->n_addrs;
    if (grow((void **)&s->locs, &s->locs_cap, rest, sizeof(uint64_t))
        || grow((void **)&s->written, &s->written_cap, rest, sizeof(rp_key))
        || grow((void **)&s->refused, &s->refused_cap, rest, sizeof(rp_key)))
        return fail(e, RP_E_NOMEM, RP_OP_PUT_START, 0);
    s->n_locs = rest;
    uint64_t i = 0;
    for (; i < rest; i += e->p.max_batch) {
        uint64_t c = rest - i < e->p.max_batch ? rest - i : e->p.max_batch;
        int64_t detail = 0;
        int64_t r = mt_put_start(e->mt, clock, keys + i, e->sizes, (int64_t)c, e->offsets, e->versions, &detail);
        if (r == -MT_E_TOO_BIG || r == -MT_E_NO_ROOM) {  /* ENOSPC: the request's later chunks are not offered */
            e->c.no_space_puts++;
            break;
        }
        if (r < 0) return fail(e, RP_E_MASTER, RP_OP_PUT_START, -r);
        for (uint64_t k = 0; k < c; k++) s->locs[i + k] = e->versions[k] ? e->offsets[k] : NONE_LOC;
    }
    for (; i < rest; i++) s->locs[i] = NONE_LOC;
    return RP_OK;
}

static int put_finish(struct rp_engine *e, struct stream *s, double now)
{
    double clock = now / 1e9;
    for (uint64_t i = 0; i < s->n_refused; i += e->p.max_batch) {
        uint64_t c = s->n_refused - i < e->p.max_batch ? s->n_refused - i : e->p.max_batch;
        int64_t r = mt_put_revoke(e->mt, clock, (const mt_key *)s->refused + i, NULL, (int64_t)c);
        if (r < 0) return fail(e, RP_E_MASTER, RP_OP_PUT_REVOKE, -r);
        e->c.revoked += (uint64_t)r;
    }
    for (uint64_t i = 0; i < s->n_written; i += e->p.max_batch) {
        uint64_t c = s->n_written - i < e->p.max_batch ? s->n_written - i : e->p.max_batch;
        int64_t r = mt_put_end(e->mt, clock, (const mt_key *)s->written + i, e->checksums, NULL, (int64_t)c);
        if (r < 0) return fail(e, RP_E_MASTER, RP_OP_PUT_END, -r);
    }
    return RP_OK;
}

/* ---- one request's steps (driver: Replay._request and _stream, a generator there) ---- */

static int load_keys(struct rp_engine *e, struct stream *s)
{
    if (s->batch) {
        struct batch *b = s->batch;
        s->keys = b->keys + b->key_start[s->req];
        s->n_keys = b->request_keys[s->req];
        return RP_OK;
    }
    if (grow((void **)&s->own_keys, &s->own_cap, s->blocks, sizeof(rp_key))) return -1;
    uint32_t bits = e->p.object_block_bits;
    uint64_t lo = bits ? s->obj << bits : s->obj, hi = bits ? s->obj >> (64 - bits) : 0;
    for (uint64_t j = 0; j < s->blocks; j++) {
        s->own_keys[j].lo = lo | j;
        s->own_keys[j].hi = hi;
    }
    s->keys = s->own_keys;
    s->n_keys = s->blocks;
    return RP_OK;
}

/* The request's start: what it can reuse, its lookup, the cost of what it will not read. */
static int begin(struct rp_engine *e, struct stream *s)
{
    if (load_keys(e, s)) return fail(e, RP_E_NOMEM, RP_OP_LOOKUP, 0);
    uint64_t n = s->n_keys, reusable = 0;
    const rp_key *keys = s->keys;
    if (grow((void **)&e->positions, &e->positions_cap, n, sizeof(uint64_t))) return fail(e, RP_E_NOMEM, RP_OP_LOOKUP, 0);
    if (n == 1) {  /* one probe: looked up and added */
        int added = keyset_add(&e->known, keys[0]);
        if (added < 0) return fail(e, RP_E_NOMEM, RP_OP_LOOKUP, 0);
        if (!added) e->positions[reusable++] = 0;
        else if (!s->batch) e->c.objects++;
    } else {
        for (uint64_t i = 0; i < n; i++)  /* positions an earlier request had (all looked up before any is added) */
            if (keyset_has(&e->known, keys[i])) e->positions[reusable++] = i;
        for (uint64_t i = 0; i < n; i++) {
            int added = keyset_add(&e->known, keys[i]);
            if (added < 0) return fail(e, RP_E_NOMEM, RP_OP_LOOKUP, 0);
            if (added && !s->batch && i == 0) e->c.objects++;
        }
    }
    int rc = lookup(e, s, s->now);
    if (rc) return rc;
    if (reusable > s->n_addrs) {  /* what was not read is recomputed */
        uint64_t unread = 0, position_sum = 0;
        for (uint64_t k = 0; k < reusable; k++) {
            if (e->positions[k] >= s->n_addrs) {
                unread++;
                position_sum += e->positions[k];
            }
        }
        if (unread) {
            struct rp_bucket *b = bucket_at(e, s->now);
            if (!b) return fail(e, RP_E_NOMEM, RP_OP_LOOKUP, 0);
            b->recomputed_blocks += unread;
            /* PrefillModel.flops: the position term is an exact integer there, rounded once */
            double position_flops = (double)((unsigned __int128)e->p.prefill_position_flops * position_sum);
            b->recompute_flops += (double)unread * e->p.prefill_block_flops + position_flops;
        }
    }
    return RP_OK;
}

/* Run the stream from where it stands to its next yield (*more 1: s->now the time of its next step) or its
 * end (*more 0: driver's StopIteration). RP_OK or an RP_E_* status. */
static int advance(struct rp_engine *e, struct stream *s, int *more)
{
    int rc;
    *more = 1;
    for (;;) {
        switch (s->stage) {
        case ST_THINK:
            if (s->req > s->first_req && s->batch && s->batch->think_ns && s->batch->think_ns[s->req] != 0.0) {
                s->now += s->batch->think_ns[s->req];
                s->stage = ST_BEGIN;
                return RP_OK;
            }
            /* fall through */
        case ST_BEGIN:
            if ((rc = begin(e, s))) return rc;
            s->j = 0;
            s->stage = ST_READ;
            /* fall through */
        case ST_READ:
            if (s->j < s->n_addrs) {
                if ((rc = do_read(e, s->addrs[s->j], &s->now))) return rc;
                s->j++;
                return RP_OK;
            }
            s->n_locs = 0;
            if (s->n_addrs < s->n_keys && (rc = put_start(e, s, s->now))) return rc;  /* the rest of the chain */
            s->j = 0;
            s->n_written = s->n_refused = 0;
            s->stage = ST_WRITE;
            /* fall through */
        case ST_WRITE:
            while (s->j < s->n_locs && s->locs[s->j] == NONE_LOC) s->j++;
            if (s->j < s->n_locs) {
                int accepted;
                if ((rc = do_write(e, s->locs[s->j], &s->now, &accepted))) return rc;
                rp_key key = s->keys[s->n_addrs + s->j];  /* room for every placed one: put_start */
                if (accepted) s->written[s->n_written++] = key;
                else s->refused[s->n_refused++] = key;
                s->j++;
                return RP_OK;
            }
            if ((s->n_written || s->n_refused) && (rc = put_finish(e, s, s->now))) return rc;
            e->c.requests++;
            e->c.block_refs += s->n_keys;
            s->req++;
            if (s->req < s->req_end) {
                s->stage = ST_THINK;
                continue;
            }
            /* fall through */
        case ST_END:
            e->c.streams++;
            if (s->now > e->c.now && !e->p.sequential) e->c.now = s->now;  /* the phase's end */
            *more = 0;
            return RP_OK;
        }
    }
}

/* ---- streams, the heap ---- */

static struct stream *take_stream(struct rp_engine *e)
{
    struct stream *s = e->free_streams;
    if (s) {
        e->free_streams = s->next_free;
    } else {
        s = calloc(1, sizeof *s);
        if (!s) return NULL;
    }
    return s;
}

static void drop_batch(struct batch *b)
{
    if (b && !--b->live && b->owned) {
        free(b->think_ns); free(b->key_start); free(b->request_keys); free(b->keys);
        free(b);
    }
}

static void give_stream(struct rp_engine *e, struct stream *s)
{
    if (s == e->seq_stream) return;
    drop_batch(s->batch);
    s->batch = NULL;
    s->next_free = e->free_streams;
    e->free_streams = s;
}

static inline int before(const struct heap_entry *a, const struct heap_entry *b)
{
    return a->t < b->t || (a->t == b->t && a->idx < b->idx);
}

static void sift_down(struct heap_entry *h, uint64_t n, uint64_t i)
{
    struct heap_entry x = h[i];
    for (;;) {
        uint64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && before(&h[c + 1], &h[c])) c++;
        if (!before(&h[c], &x)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
}

static int heap_push(struct rp_engine *e, double t, uint64_t idx, struct stream *s)
{
    if (grow((void **)&e->heap, &e->heap_cap, e->c.heap + 1, sizeof(struct heap_entry))) return -1;
    uint64_t i = e->c.heap++;
    struct heap_entry x = {t, idx, s};
    while (i) {
        uint64_t parent = (i - 1) / 2;
        if (!before(&x, &e->heap[parent])) break;
        e->heap[i] = e->heap[parent];
        i = parent;
    }
    e->heap[i] = x;
    return 0;
}

/* driver.run's loop: the stream with the earliest (time, number) runs its next step, after the device's
 * background work due by then. RP_FEED_MORE: only up to the last stream fed (the ones to come start no earlier,
 * in a trace in time order); RP_FEED_LAST: to the end. */
static int run_heap(struct rp_engine *e, double bound_t, uint64_t bound_idx, int feed)
{
    if (feed == RP_FEED_HOLD) return RP_OK;
    while (e->c.heap) {
        struct heap_entry *top = &e->heap[0];
        if (feed == RP_FEED_MORE && !(top->t < bound_t || (top->t == bound_t && top->idx <= bound_idx))) break;
        int rc = run_until(e, top->t);
        if (rc) return rc;
        e->last_popped = top->t;
        e->popped = 1;
        struct stream *s = top->s;
        s->now = top->t;
        int more;
        if ((rc = advance(e, s, &more))) return rc;
        if (more) {
            top->t = s->now;
        } else {
            give_stream(e, s);
            e->heap[0] = e->heap[--e->c.heap];
        }
        if (e->c.heap) sift_down(e->heap, e->c.heap, 0);
    }
    return RP_OK;
}

/* A stream enters: sequential, it runs now; else it waits in the heap for its start. */
static int enter(struct rp_engine *e, struct stream *s, double start_ns)
{
    s->idx = e->next_idx++;
    s->stage = s->req < s->req_end ? ST_BEGIN : ST_END;
    if (e->p.sequential) {  /* driver: Replay._sequential */
        double t = e->t0 + start_ns;
        if (t > e->c.now) e->c.now = t;
        s->now = e->c.now;
        int rc, more = 1;
        while (more)
            if ((rc = advance(e, s, &more))) return rc;
        e->c.now = s->now;
        return RP_OK;
    }
    double t = e->t0 + start_ns;
    if (e->popped && t < e->last_popped) return fail(e, RP_E_UNSORTED, 0, 0);
    s->now = t;
    if (heap_push(e, t, s->idx, s)) return fail(e, RP_E_NOMEM, 0, 0);
    return RP_OK;
}

/* ---- the calls ---- */

int rp_new(void *dev, void *master, const struct rp_params *params, double background_ns, struct rp_engine **out)
{
    *out = NULL;
    if (!dev || !master || !params->max_batch || params->object_block_bits > 63 || !params->block_bytes)
        return RP_E_ARG;
    struct rp_engine *e = calloc(1, sizeof *e);
    if (!e) return RP_E_NOMEM;
    e->dev = dev;
    e->mt = master;
    e->p = *params;
    e->c.background_ns = background_ns;
    uint32_t m = params->max_batch;
    e->sizes = malloc(m * sizeof(uint32_t));
    e->checksums = calloc(m, sizeof(uint64_t));
    e->offsets = malloc(m * sizeof(uint64_t));
    e->versions = malloc(m * sizeof(uint32_t));
    e->seq_stream = calloc(1, sizeof(struct stream));
    if (!e->sizes || !e->checksums || !e->offsets || !e->versions || !e->seq_stream) {
        rp_free(e);
        return RP_E_NOMEM;
    }
    for (uint32_t i = 0; i < m; i++) e->sizes[i] = (uint32_t)params->slot_bytes;
    *out = e;
    return RP_OK;
}

static void free_stream_bufs(struct stream *s)
{
    free(s->own_keys); free(s->addrs); free(s->locs); free(s->written); free(s->refused);
}

void rp_free(struct rp_engine *e)
{
    if (!e) return;
    for (uint64_t i = 0; i < e->c.heap; i++) {
        drop_batch(e->heap[i].s->batch);
        free_stream_bufs(e->heap[i].s);
        free(e->heap[i].s);
    }
    while (e->free_streams) {
        struct stream *s = e->free_streams;
        e->free_streams = s->next_free;
        free_stream_bufs(s);
        free(s);
    }
    if (e->seq_stream) free_stream_bufs(e->seq_stream);
    free(e->seq_stream);
    for (uint64_t i = 0; i < e->n_rows; i++) { free(e->rows[i].lat.values); free(e->rows[i].lat.counts); }
    free(e->rows); free(e->win_keys); free(e->win_rows); free(e->heap); free(e->positions);
    free(e->known.keys);
    free(e->sizes); free(e->checksums); free(e->offsets); free(e->versions);
    free(e);
}

int rp_known_add(struct rp_engine *e, const rp_key *keys, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (keyset_add(&e->known, keys[i]) < 0) return fail(e, RP_E_NOMEM, 0, 0);
    return RP_OK;
}

int rp_phase_begin(struct rp_engine *e, double now, int64_t phase_key)
{
    if (e->c.heap) return fail(e, RP_E_ARG, 0, 0);  /* the last phase has not ended */
    e->t0 = e->c.now = now;
    e->next_idx = 0;
    e->popped = 0;
    if (!e->p.by_time) {
        if (!new_row(e, phase_key, now)) return fail(e, RP_E_NOMEM, 0, 0);
        e->phase_row = e->n_rows - 1;
    }
    return RP_OK;
}

int rp_feed(struct rp_engine *e, uint64_t n, const double *start_ns, const uint32_t *stream_requests,
            const double *think_ns, const uint64_t *request_keys, const rp_key *keys, int final)
{
    if (!n) return e->p.sequential || final != RP_FEED_LAST ? RP_OK : run_heap(e, 0.0, 0, RP_FEED_LAST);
    uint64_t n_req = 0, n_keys = 0;
    for (uint64_t i = 0; i < n; i++) n_req += stream_requests ? stream_requests[i] : 1;
    for (uint64_t r = 0; r < n_req; r++) n_keys += request_keys[r];
    struct batch local = {0}, *b = &local;
    if (!e->p.sequential) {  /* the streams outlive the call: the batch is copied */
        b = calloc(1, sizeof *b);
        if (!b) return fail(e, RP_E_NOMEM, 0, 0);
        b->owned = 1;
        b->key_start = malloc((n_req + 1) * sizeof(uint64_t));
        b->request_keys = malloc((n_req + 1) * sizeof(uint64_t));
        b->keys = malloc((n_keys + 1) * sizeof(rp_key));
        if (think_ns) b->think_ns = malloc(n_req * sizeof(double));
        if (!b->key_start || !b->request_keys || !b->keys || (think_ns && !b->think_ns)) {
            b->live = 1;
            drop_batch(b);
            return fail(e, RP_E_NOMEM, 0, 0);
        }
        memcpy(b->request_keys, request_keys, n_req * sizeof(uint64_t));
        memcpy(b->keys, keys, n_keys * sizeof(rp_key));
        if (think_ns) memcpy(b->think_ns, think_ns, n_req * sizeof(double));
    } else {
        b->key_start = malloc((n_req + 1) * sizeof(uint64_t));
        if (!b->key_start) return fail(e, RP_E_NOMEM, 0, 0);
        b->request_keys = (uint64_t *)request_keys;
        b->keys = (rp_key *)keys;
        b->think_ns = (double *)think_ns;
    }
    for (uint64_t r = 0, k = 0; r < n_req; k += request_keys[r], r++) b->key_start[r] = k;
    b->live = 1;  /* held while streams enter */
    int rc = RP_OK;
    double last_t = 0.0;
    uint64_t req = 0;
    for (uint64_t i = 0; i < n && rc == RP_OK; i++) {
        uint64_t requests = stream_requests ? stream_requests[i] : 1;
        struct stream *s = e->p.sequential ? e->seq_stream : take_stream(e);
        if (!s) { rc = fail(e, RP_E_NOMEM, 0, 0); break; }
        s->batch = b;
        s->first_req = s->req = req;
        s->req_end = req + requests;
        req += requests;
        b->live++;
        last_t = e->t0 + start_ns[i];
        rc = enter(e, s, start_ns[i]);
        if (e->p.sequential) { b->live--; s->batch = NULL; }
        else if (rc == RP_E_UNSORTED) give_stream(e, s);
    }
    if (e->p.sequential) {
        free(b->key_start);
        return rc;
    }
    drop_batch(b);
    if (rc) return rc;
    return run_heap(e, last_t, e->next_idx - 1, final);
}

int rp_feed_objects(struct rp_engine *e, uint64_t n, const int64_t *times, const uint64_t *obj_ids,
                    const int64_t *sizes, int64_t first_time, double ns_per_unit, int ignore_size, int final)
{
    double last_t = 0.0;
    uint64_t block = e->p.block_bytes;
    for (uint64_t i = 0; i < n; i++) {
        struct stream *s = e->p.sequential ? e->seq_stream : take_stream(e);
        if (!s) return fail(e, RP_E_NOMEM, 0, 0);
        s->batch = NULL;
        s->first_req = s->req = 0;
        s->req_end = 1;
        s->obj = obj_ids[i];
        /* lcs_trace: LibCacheSimTrace._blocks (ignore_obj_size: every size 1) */
        uint64_t size = ignore_size ? 1 : (uint64_t)sizes[i];
        s->blocks = size ? (size - 1) / block + 1 : 1;
        double start = (double)(times[i] - first_time) * ns_per_unit;
        last_t = e->t0 + start;
        int rc = enter(e, s, start);
        if (rc) {
            if (!e->p.sequential && rc == RP_E_UNSORTED) give_stream(e, s);
            return rc;
        }
    }
    if (e->p.sequential || (!n && final != RP_FEED_LAST)) return RP_OK;
    return run_heap(e, last_t, n ? e->next_idx - 1 : 0, final);
}

int rp_phase_end(struct rp_engine *e, double *now)
{
    int rc = e->p.sequential ? RP_OK : run_heap(e, 0.0, 0, RP_FEED_LAST);
    if (rc) return rc;
    *now = e->c.now;
    return run_until(e, e->c.now);
}

uint64_t rp_buckets(const struct rp_engine *e) { return e->n_rows; }

void rp_get_bucket(const struct rp_engine *e, uint64_t i, struct rp_bucket *out)
{
    *out = e->rows[i].b;
    out->latencies = e->rows[i].lat.n;
}

void rp_get_latencies(const struct rp_engine *e, uint64_t i, double *values, uint64_t *counts)
{
    const struct latmap *m = &e->rows[i].lat;
    uint64_t k = 0;
    for (uint64_t h = 0; m->mask && h <= m->mask; h++) {
        if (!m->counts[h]) continue;
        values[k] = m->values[h];
        counts[k++] = m->counts[h];
    }
}

void rp_get_counts(const struct rp_engine *e, struct rp_counts *out) { *out = e->c; }

void rp_get_error(const struct rp_engine *e, struct rp_error *out) { *out = e->err; }
