/* The data-off device's operations (chm_core.h: chm_dev_tick ... chm_dev_release_frames, each the
 * controller's or the flusher's method of that name) and the sequential path (chm_dev_run_sequential). */
#include "chm_core_internal.h"

/* -- the single operations -- */

int chm_dev_tick(struct chm_dev *d, double now, int force)
{
    struct seq q = dev_seq(d);
    uint64_t batches = q.c->flush_batches;
    int rc = fl_tick(&q, now, force);
    return rc ? rc : q.c->flush_batches != batches;
}

double chm_dev_complete_flights(struct chm_dev *d, double now)
{
    struct seq q = dev_seq(d);
    return fl_complete_flights(&q, now);
}

int chm_dev_next_event(struct chm_dev *d, double now, double *due)
{
    return fl_next_event(d, d->flusher, now, due);
}

int chm_dev_run_until(struct chm_dev *d, double from, double until, uint64_t *ran, double *t)
{
    struct seq q = dev_seq(d);
    double due;
    *ran = 0;
    *t = from;
    while (fl_next_event(d, q.fl, *t, &due) && due <= until) {
        if (due != due)
            return CHM_E_NOMEM;
        uint64_t batches = q.c->flush_batches, flights = q.fl->n_flights;
        int rc = fl_tick(&q, due, 0);
        if (rc)
            return rc;
        if (q.c->flush_batches == batches && q.fl->n_flights == flights) {
            *t = due;
            return CHM_E_INTERNAL;
        }
        *t = due;
        ++*ran;
    }
    return CHM_OK;
}

double chm_dev_quiet_until(struct chm_dev *d, double now)
{
    struct chm_flusher *fl = d->flusher;
    double until = fl->n_flights ? fl->flights[0].finish : 1.0 / 0.0, grant;
    if (fl->n_dirty && !fl_at_flight_limit(fl) && fl_next_flush_at(d, fl, now, &grant) && grant < until)
        until = grant;
    return until;
}

double chm_dev_flush(struct chm_dev *d, double now)
{
    struct seq q = dev_seq(d);
    return fl_flush(&q, now);
}

double chm_dev_write_back(struct chm_dev *d, uint32_t frame, uint64_t victim_page, double now)
{
    struct seq q = dev_seq(d);
    q.c->dirty_evictions++;
    fl_unqueue(q.fl, frame);
    return seq_media_write(&q, victim_page, 1, now);
}

int chm_dev_write(struct chm_dev *d, uint64_t addr, uint64_t len, double now, int count_command,
                  struct chm_write_result *out)
{
    if (!dev_range_ok(d, addr, len))
        return CHM_E_ARG;
    struct seq q = dev_seq(d);
    int rc = fl_tick(&q, now, 0);
    if (rc)
        return rc;
    return seq_write(&q, addr, len, now, count_command, out);
}

int64_t chm_dev_read(struct chm_dev *d, uint64_t addr, uint64_t len, double now, int count_command, double *out)
{
    if (!dev_range_ok(d, addr, len) || d->n_areas != 1 || d->chunk_pages > SEQ_MAX_CHUNK || !d->chunk_pages)
        return CHM_E_ARG;
    struct seq q = dev_seq(d);
    uint64_t pages[3];
    double finish = seq_read(&q, addr, len, now, count_command, pages);
    if (finish != finish) {
        out[1] = (double)q.failed_page;
        return q.rc ? q.rc : CHM_E_INTERNAL;
    }
    out[0] = finish;
    out[1] = (double)pages[0];
    out[2] = (double)pages[1];
    out[3] = (double)pages[2];
    return (int64_t)(pages[0] + pages[1] + pages[2]);
}

int chm_dev_prefetch_fetch(struct chm_dev *d, struct chm_pf *pf, double t, uint32_t *frames,
                           struct chm_prefetch_result *out)
{
    struct seq q = dev_seq(d);
    const struct chm_dev_area *clean = seq_clean_area(&q);
    memset(out, 0, sizeof *out);
    out->ready_at = t;
    int64_t handle;
    uint64_t page;
    while (chm_pf_next_fetch(pf, &handle, &page)) {
        t = chm_clocked_run(d->controller, t, d->cycles_per_prefetch_page);
        out->t = t;
        int64_t frame = area_lookup(clean, page);  /* Policy.staged_lookup */
        const struct chm_dev_area *area;
        if (frame < 0 && dev_lookup(d, page, &area) >= 0) {  /* Policy.lookup: the newest data is written */
            out->resident++;
            continue;
        }
        if (frame < 0) {
            out->staged++;
            frame = seq_stage(&q, page, t);
            if (frame < 0) {
                out->page = page;
                return q.rc ? q.rc : CHM_E_INTERNAL;
            }
        } else {
            out->resident++;
            pol_touch(&q, (uint32_t)frame);
        }
        pol_pin(&q, (uint32_t)frame);
        frames[out->frames++] = (uint32_t)frame;
        out->ready_at = py_max(out->ready_at, d->ready_at[frame]);
    }
    out->t = t;
    return CHM_OK;
}

void chm_dev_release_frames(struct chm_dev *d, const uint32_t *frames, uint64_t n)
{
    struct seq q = dev_seq(d);
    const struct chm_dev_area *clean = seq_clean_area(&q);
    for (uint64_t i = 0; i < n; i++) {
        uint32_t frame = frames[i];
        pol_unpin(&q, frame);
        if (q.fl->drops_staged_on_release && frame >= clean->base && frame - clean->base < clean->table->frames
            && clean->table->pins[frame - clean->base] == 0)  /* HymCachePolicy.released */
            chm_ft_invalidate(clean->table, frame - clean->base);
    }
}

/* -- the sequential path -- */

int chm_dev_run_sequential(struct chm_dev *d, const uint8_t *kinds, const uint64_t *addrs, const uint64_t *lengths,
                           uint64_t n, double now, struct chm_seq_result *out)
{
    memset(out, 0, sizeof *out);
    out->now = now;
    if (d->n_areas != 1 || !d->n_ssds || !d->chunk_pages || d->chunk_pages > SEQ_MAX_CHUNK || !d->stripe_bytes
        || !d->page_size)
        return CHM_E_ARG;
    struct seq q = {.d = d, .fl = d->flusher, .c = &out->counts};
    struct chm_flusher *own = NULL;
    if (!q.fl) {  /* the flusher is Python's, settled: a private one, left settled too */
        uint32_t frames = d->areas[0].base + d->areas[0].table->frames;
        if (chm_flusher_new(frames, NULL, &own))
            return CHM_E_NOMEM;
        own->write_area = d->areas[0];
        own->write_area_frames = d->areas[0].table->frames;
        q.fl = own;
    }
    uint64_t order0 = q.fl->flight_order;
    int rc = CHM_OK;
    for (uint64_t i = 0; i < n && rc == CHM_OK; i++) {
        uint64_t addr = addrs[i], len = lengths[i];
        if (kinds[i] > CHM_SEQ_WRITE || !dev_range_ok(d, addr, len)) {
            rc = CHM_E_ARG;  /* Controller.check_range (or the kind) refuses it */
            break;
        }
        /* room for the finish of every read it may stage (the pages, or a partial write's two ends) */
        uint64_t pages = (addr + len - 1) / d->page_size - addr / d->page_size + 1;
        for (uint32_t s = 0; s < d->n_ssds && rc == CHM_OK; s++)
            rc = chm_ssd_reserve(d->ssds[s], kinds[i] == CHM_SEQ_READ ? pages : 2);
        if (rc)
            break;
        double finish;
        if (kinds[i] == CHM_SEQ_READ) {  /* its tick has nothing to do: nothing dirty, nothing in flight */
            uint64_t counted[3];
            finish = seq_read(&q, addr, len, now, 1, counted);
        } else {
            struct chm_write_result w;
            finish = seq_write(&q, addr, len, now, 1, &w) == CHM_OK ? w.finish : NOT_A_TIME;
            out->write_misses += w.new_pages;
            if (finish == finish)
                finish = fl_flush(&q, finish);
        }
        if (finish != finish) {
            rc = q.rc == CHM_E_NOMEM ? CHM_E_NOMEM : CHM_E_INTERNAL;
            break;
        }
        now = finish;
        out->done = i + 1;
        out->now = now;
    }
    out->flush_writes = q.fl->flight_order - order0;
    chm_flusher_free(own);
    return rc;
}
