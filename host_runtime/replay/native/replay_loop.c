/* The replay's request loop: the heap of streams and a request's steps (replay_loop.h says what and why,
 * replay_loop_internal.h the files' map; driver.py's Replay is the specification: each step below names the
 * Python it mirrors). */
#include "replay_loop_internal.h"

/* ---- the device's operations (Controller.read / write / flush / run_until on a native device) ---- */

int replay_run_until(struct rp_engine *e, double until)
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
    struct rp_bucket *b = replay_bucket_at(e, start);
    if (!b) return fail(e, RP_E_NOMEM, RP_OP_READ, 0);
    b->reads++;
    b->read_bytes += len;
    b->hit_pages += hits + merged;
    b->miss_pages += missed;
    if (start < b->first_read) b->first_read = start;
    if (finish > b->last_read) b->last_read = finish;
    if (replay_latmap_add(&row_of(b)->lat, finish - start)) return fail(e, RP_E_NOMEM, RP_OP_READ, 0);
    *now = finish;
    return RP_OK;
}

/* driver: Replay._write; *accepted 0 for a refused write */
static int do_write(struct rp_engine *e, uint64_t addr, double *now, int *accepted)
{
    double start = *now;
    struct rp_bucket *b = replay_bucket_at(e, start);
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
            struct rp_bucket *b = replay_bucket_at(e, s->now);
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

/* ---- the heap ---- */

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
int replay_run_heap(struct rp_engine *e, double bound_t, uint64_t bound_idx, int feed)
{
    if (feed == RP_FEED_HOLD) return RP_OK;
    while (e->c.heap) {
        struct heap_entry *top = &e->heap[0];
        if (feed == RP_FEED_MORE && !(top->t < bound_t || (top->t == bound_t && top->idx <= bound_idx))) break;
        int rc = replay_run_until(e, top->t);
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
            replay_give_stream(e, s);
            e->heap[0] = e->heap[--e->c.heap];
        }
        if (e->c.heap) sift_down(e->heap, e->c.heap, 0);
    }
    return RP_OK;
}

/* A stream enters: sequential, it runs now; else it waits in the heap for its start. */
int replay_enter(struct rp_engine *e, struct stream *s, double start_ns)
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

