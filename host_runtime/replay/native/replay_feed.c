/* The replay loop's calls that make, feed and free an engine (replay_loop_internal.h: the files' map), and its
 * streams: rp_feed's batches of streams, rp_feed_objects' requests, each a stream of its own. */
#include "replay_loop_internal.h"

/* ---- streams ---- */

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

void replay_give_stream(struct rp_engine *e, struct stream *s)
{
    if (s == e->seq_stream) return;
    drop_batch(s->batch);
    s->batch = NULL;
    s->next_free = e->free_streams;
    e->free_streams = s;
}

static void free_stream_bufs(struct stream *s)
{
    free(s->own_keys); free(s->addrs); free(s->locs); free(s->written); free(s->refused);
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

int rp_phase_begin(struct rp_engine *e, double now, int64_t phase_key)
{
    if (e->c.heap) return fail(e, RP_E_ARG, 0, 0);  /* the last phase has not ended */
    e->t0 = e->c.now = now;
    e->next_idx = 0;
    e->popped = 0;
    if (!e->p.by_time) {
        if (!replay_new_row(e, phase_key, now)) return fail(e, RP_E_NOMEM, 0, 0);
        e->phase_row = e->n_rows - 1;
    }
    return RP_OK;
}

int rp_feed(struct rp_engine *e, uint64_t n, const double *start_ns, const uint32_t *stream_requests,
            const double *think_ns, const uint64_t *request_keys, const rp_key *keys, int final)
{
    if (!n) return e->p.sequential || final != RP_FEED_LAST ? RP_OK : replay_run_heap(e, 0.0, 0, RP_FEED_LAST);
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
        rc = replay_enter(e, s, start_ns[i]);
        if (e->p.sequential) { b->live--; s->batch = NULL; }
        else if (rc == RP_E_UNSORTED) replay_give_stream(e, s);
    }
    if (e->p.sequential) {
        free(b->key_start);
        return rc;
    }
    drop_batch(b);
    if (rc) return rc;
    return replay_run_heap(e, last_t, e->next_idx - 1, final);
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
        int rc = replay_enter(e, s, start);
        if (rc) {
            if (!e->p.sequential && rc == RP_E_UNSORTED) replay_give_stream(e, s);
            return rc;
        }
    }
    if (e->p.sequential || (!n && final != RP_FEED_LAST)) return RP_OK;
    return replay_run_heap(e, last_t, n ? e->next_idx - 1 : 0, final);
}

int rp_phase_end(struct rp_engine *e, double *now)
{
    int rc = e->p.sequential ? RP_OK : replay_run_heap(e, 0.0, 0, RP_FEED_LAST);
    if (rc) return rc;
    *now = e->c.now;
    return replay_run_until(e, e->c.now);
}
