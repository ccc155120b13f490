/* The replay loop's results (replay_loop_internal.h: the files' map): its rows (driver.Bucket's accumulators, by
 * time window or phase), each row's read latencies, the set of keys looked up, and the calls that read them out. */
#include "replay_loop_internal.h"

#include <math.h>

int replay_keyset_grow(struct keyset *s)
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

int replay_latmap_add(struct latmap *m, double v)
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

struct row *replay_new_row(struct rp_engine *e, int64_t key, double start_ns)
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
struct rp_bucket *replay_bucket_at(struct rp_engine *e, double now)
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
        if (!replay_new_row(e, k, (double)k * e->p.bucket_ns)) return NULL;
        e->win_keys[h] = k;
        e->win_rows[h] = e->n_rows;
    }
    e->last_win = k;
    e->last_row = e->win_rows[h] - 1;
    e->have_last = 1;
    return &e->rows[e->last_row].b;
}

int rp_known_add(struct rp_engine *e, const rp_key *keys, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (keyset_add(&e->known, keys[i]) < 0) return fail(e, RP_E_NOMEM, 0, 0);
    return RP_OK;
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
