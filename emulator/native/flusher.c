/* The native flusher (emulator/flusher.py's Flusher, data off): the dirty queue, the flush writes in flight,
 * the flush rule's grants; chm_dev_tick and the other operations of device.c run it. */
#include "chm_core_internal.h"

/* -- the dirty queue -- */

static uint64_t ring_at(const struct chm_flusher *fl, uint64_t i)
{
    uint64_t k = fl->dirty_head + i;
    return k >= fl->frames ? k - fl->frames : k;
}

void chm_flusher_dirty_at(const struct chm_flusher *fl, uint64_t i, uint32_t *frame, double *since)
{
    uint64_t k = ring_at(fl, i);
    *frame = fl->dirty_frame[k];
    *since = fl->dirty_since[k];
}

/* Flusher.enqueue */
void fl_enqueue(struct chm_flusher *fl, uint32_t frame, double now)
{
    if (fl->queued[frame])
        return;
    fl->queued[frame] = 1;
    uint64_t k = ring_at(fl, fl->n_dirty++);
    fl->dirty_frame[k] = frame;
    fl->dirty_since[k] = now;
}

/* Flusher._unqueue */
void fl_unqueue(struct chm_flusher *fl, uint32_t frame)
{
    if (!fl->queued[frame])
        return;
    fl->queued[frame] = 0;
    uint64_t i = 0;
    while (i < fl->n_dirty && fl->dirty_frame[ring_at(fl, i)] != frame)
        i++;
    if (i == fl->n_dirty)
        return;
    for (; i + 1 < fl->n_dirty; i++) {
        uint64_t to = ring_at(fl, i), from = ring_at(fl, i + 1);
        fl->dirty_frame[to] = fl->dirty_frame[from];
        fl->dirty_since[to] = fl->dirty_since[from];
    }
    fl->n_dirty--;
}

/* -- flush writes in flight: a min-heap by (finish, order) -- */

static int flight_less(const struct chm_flight *a, const struct chm_flight *b)
{
    return a->finish < b->finish || (a->finish == b->finish && a->order < b->order);
}

static int flight_push(struct chm_flusher *fl, struct chm_flight f)
{
    if (fl->n_flights == fl->flights_cap) {
        uint64_t cap = fl->flights_cap ? 2 * fl->flights_cap : 64;
        struct chm_flight *grown = realloc(fl->flights, (size_t)cap * sizeof *grown);
        if (!grown)
            return CHM_E_NOMEM;
        fl->flights = grown;
        fl->flights_cap = cap;
    }
    uint64_t pos = fl->n_flights++;
    while (pos > 0) {
        uint64_t parent = (pos - 1) / 2;
        if (!flight_less(&f, &fl->flights[parent]))
            break;
        fl->flights[pos] = fl->flights[parent];
        pos = parent;
    }
    fl->flights[pos] = f;
    return CHM_OK;
}

static struct chm_flight flight_pop(struct chm_flusher *fl)
{
    struct chm_flight top = fl->flights[0], last = fl->flights[--fl->n_flights];
    uint64_t n = fl->n_flights, pos = 0;
    if (n) {
        for (;;) {
            uint64_t child = 2 * pos + 1;
            if (child >= n)
                break;
            if (child + 1 < n && flight_less(&fl->flights[child + 1], &fl->flights[child]))
                child++;
            if (!flight_less(&fl->flights[child], &last))
                break;
            fl->flights[pos] = fl->flights[child];
            pos = child;
        }
        fl->flights[pos] = last;
    }
    return top;
}

static int by_order(const void *a, const void *b)
{
    uint64_t x = ((const struct chm_flight *)a)->order, y = ((const struct chm_flight *)b)->order;
    return (x > y) - (x < y);
}

static int by_finish_order(const void *a, const void *b)
{
    const struct chm_flight *x = a, *y = b;
    return flight_less(x, y) ? -1 : flight_less(y, x) ? 1 : 0;
}

int chm_flusher_new(uint32_t frames, uint8_t *queued, struct chm_flusher **out)
{
    struct chm_flusher *fl = calloc(1, sizeof *fl);
    if (!fl)
        return CHM_E_NOMEM;
    fl->frames = frames;
    fl->pages_in_flight_limit = -1;
    fl->queued = queued;
    if (!queued) {
        fl->queued = calloc(frames ? frames : 1, 1);
        fl->owns_queued = 1;
    }
    fl->dirty_frame = malloc((size_t)(frames ? frames : 1) * sizeof *fl->dirty_frame);
    fl->dirty_since = malloc((size_t)(frames ? frames : 1) * sizeof *fl->dirty_since);
    fl->scratch = malloc((size_t)(frames ? frames : 1) * sizeof(struct seq_entry));
    if (!fl->queued || !fl->dirty_frame || !fl->dirty_since || !fl->scratch) {
        chm_flusher_free(fl);
        return CHM_E_NOMEM;
    }
    *out = fl;
    return CHM_OK;
}

void chm_flusher_free(struct chm_flusher *fl)
{
    if (!fl)
        return;
    for (uint64_t i = 0; i < fl->n_flights; i++)
        free(fl->flights[i].seqs);
    free(fl->flights);
    if (fl->owns_queued)
        free(fl->queued);
    free(fl->dirty_frame);
    free(fl->dirty_since);
    free(fl->scratch);
    free(fl->landed);
    free(fl);
}

/* -- the flusher (Flusher) -- */

int fl_at_flight_limit(const struct chm_flusher *fl)
{
    return fl->pages_in_flight_limit >= 0 && fl->flushing_pages >= (uint64_t)fl->pages_in_flight_limit;
}

/* Flusher._flight_room_at; NaN: no memory. Cached until a flush starts: flights land in (finish, order)
 * order, a prefix of the sorted flights, which lowers the pages that must land by as many as landed, so
 * while still at the limit the flight that brings them under it is the same one. */
static double flight_room_at(struct chm_flusher *fl)
{
    if (!fl->n_flights)
        return 0.0;  /* (at the limit with none in flight: a limit of 0) */
    if (!fl->room_valid || fl->room_order != fl->flight_order) {
        uint64_t must_land = fl->flushing_pages - (uint64_t)fl->pages_in_flight_limit + 1, landed = 0;
        double at = 0.0;
        if (fl->n_flights && fl->flights[0].pages >= must_land) {  /* the first to land is enough: the heap's top */
            fl->room_order = fl->flight_order;
            fl->room_pages = fl->flushing_pages;
            fl->room_at = fl->flights[0].finish;
            fl->room_valid = 1;
            return fl->room_at;
        }
        struct chm_flight *sorted = malloc((size_t)(fl->n_flights ? fl->n_flights : 1) * sizeof *sorted);
        if (!sorted)
            return NOT_A_TIME;
        memcpy(sorted, fl->flights, (size_t)fl->n_flights * sizeof *sorted);
        qsort(sorted, fl->n_flights, sizeof *sorted, by_finish_order);
        for (uint64_t i = 0; i < fl->n_flights; i++) {
            at = sorted[i].finish;
            landed += sorted[i].pages;
            if (landed >= must_land)
                break;
        }
        free(sorted);
        fl->room_order = fl->flight_order;
        fl->room_pages = fl->flushing_pages;
        fl->room_at = at;
        fl->room_valid = 1;
    }
    return fl->room_at;
}

/* Policy.next_flush_at (CachePolicy's or HymCachePolicy's): 1 and *at, or 0 (never); NaN *at: no memory. */
int fl_next_flush_at(const struct chm_dev *d, const struct chm_flusher *fl, double now, double *at)
{
    if (!fl->n_dirty)
        return 0;
    double oldest = fl->dirty_since[fl->dirty_head];
    if (fl->rule == CHM_FLUSH_AFTER_DELAY) {
        *at = py_max(now, chm_delay_due_at(oldest, fl->writeback_delay_ns));
        return 1;
    }
    double batch_full = fl->n_dirty >= fl->batch_pages ? fl->dirty_since[ring_at(fl, fl->batch_pages - 1)] : 0.0;
    double ready = chm_arbiter_ready_at(fl->batch_pages, fl->max_delay_ns, fl->n_dirty, oldest, batch_full);
    *at = py_max(py_max(now, ready), reads_idle_at(d, now, fl->max_reads_in_flight));
    return 1;
}

/* Policy.flush_grant */
static uint64_t flush_grant(const struct chm_flusher *fl, double now, uint64_t reads, int force)
{
    if (fl->rule == CHM_FLUSH_AFTER_DELAY) {
        if (force)
            return fl->n_dirty;
        double due_before = now - fl->writeback_delay_ns;
        uint64_t n = 0;
        while (n < fl->n_dirty && !(fl->dirty_since[ring_at(fl, n)] > due_before))
            n++;
        return n;
    }
    double oldest_age = fl->n_dirty ? now - fl->dirty_since[fl->dirty_head] : 0.0;
    return chm_arbiter_grant(fl->batch_pages, fl->max_reads_in_flight, fl->max_delay_ns, fl->n_dirty, reads,
                             oldest_age, force);
}

static int seq_by_page(const void *a, const void *b)
{
    uint64_t x = ((const struct seq_entry *)a)->page, y = ((const struct seq_entry *)b)->page;
    return (x > y) - (x < y);
}

static uint64_t page_of_frame(const struct chm_dev *d, uint32_t frame)
{
    uint32_t local;
    struct chm_ft *ft = frame_table(d, frame, &local);
    return ft->page_of[local];
}

/* Flusher._write_run of entries[0, n) */
static int write_run(struct seq *q, const struct seq_entry *run, uint32_t n, double now)
{
    struct chm_flusher *fl = q->fl;
    double finish = seq_media_write(q, run[0].page, n, now);
    int64_t *seqs = malloc((size_t)n * (sizeof *seqs + sizeof(double)));
    if (!seqs)
        return CHM_E_NOMEM;
    double *since = (double *)(seqs + n);
    for (uint32_t i = 0; i < n; i++) {
        seqs[i] = q->d->write_seq[run[i].frame];
        since[i] = run[i].since;
    }
    fl->flight_order++;
    fl->flushing_pages += n;
    struct chm_flight f = {.finish = finish, .order = fl->flight_order, .frame = run[0].frame, .pages = n,
                           .seqs = seqs, .since = since};
    if (flight_push(fl, f)) {
        free(seqs);
        return CHM_E_NOMEM;
    }
    q->c->flushed_pages += n;
    return CHM_OK;
}

/* Flusher.start_flush of the dirty queue's n oldest entries (popped) */
static int start_flush(struct seq *q, uint64_t n, double now)
{
    struct chm_flusher *fl = q->fl;
    struct seq_entry *e = fl->scratch;
    q->c->flush_batches++;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t k = ring_at(fl, 0);
        e[i].frame = fl->dirty_frame[k];
        e[i].since = fl->dirty_since[k];
        e[i].page = page_of_frame(q->d, e[i].frame);
        fl->dirty_head = k + 1 == fl->frames ? 0 : k + 1;
        fl->n_dirty--;
    }
    if (n > 1)
        qsort(e, n, sizeof *e, seq_by_page);  /* pages are distinct: sorted() is stable, qsort the same */
    for (uint64_t i = 0; i < n; i++) {
        fl->queued[e[i].frame] = 0;
        pol_pin(q, e[i].frame);
    }
    for (uint64_t start = 0, i = 1; i <= n; i++) {
        if (i < n && e[i].frame == e[i - 1].frame + 1 && seq_contiguous(q->d, e[i - 1].page, e[i].page))
            continue;
        int rc = write_run(q, e + start, (uint32_t)(i - start), now);
        if (rc)
            return rc;
        start = i;
    }
    return CHM_OK;
}

/* Flusher.complete_flights: the latest finish retired; NaN: no memory. */
double fl_complete_flights(struct seq *q, double now)
{
    struct chm_flusher *fl = q->fl;
    uint64_t n = 0;
    while (fl->n_flights && fl->flights[0].finish <= now) {
        if (n == fl->landed_cap) {
            uint64_t cap = fl->landed_cap ? 2 * fl->landed_cap : 64;
            void *grown = realloc(fl->landed, (size_t)cap * sizeof(struct chm_flight));
            if (!grown) {
                q->rc = CHM_E_NOMEM;
                return NOT_A_TIME;
            }
            fl->landed = grown;
            fl->landed_cap = cap;
        }
        ((struct chm_flight *)fl->landed)[n++] = flight_pop(fl);
    }
    struct chm_flight *landed = fl->landed;
    if (n > 1)
        qsort(landed, n, sizeof *landed, by_order);  /* retired in issue order */
    double latest = 0.0;
    for (uint64_t i = 0; i < n; i++) {
        struct chm_flight *f = &landed[i];
        fl->flushing_pages -= f->pages;
        for (uint32_t j = 0; j < f->pages; j++) {
            uint32_t frame = f->frame + j;
            pol_unpin(q, frame);
            if (q->d->write_seq[frame] == f->seqs[j] && !fl->queued[frame])
                pol_flushed(q, frame);
        }
        latest = py_max(latest, f->finish);
        free(f->seqs);
    }
    return latest;
}

/* Flusher.tick (data off: no failed staging read to drop, no backoff) */
int fl_tick(struct seq *q, double now, int force)
{
    struct chm_flusher *fl = q->fl;
    double latest = fl_complete_flights(q, now);
    if (latest != latest)
        return q->rc;
    if (!force && fl_at_flight_limit(fl))
        return CHM_OK;
    while (fl->n_dirty) {
        uint64_t n = flush_grant(fl, now, reads_in_flight(q->d, now), force);
        if (n == 0)
            return CHM_OK;
        int rc = start_flush(q, n, now);
        if (rc)
            return rc;
        if (!force)
            return CHM_OK;
    }
    return CHM_OK;
}

/* Flusher.next_event_ns (data off): 1 and *due, or 0; NaN *due: no memory. */
int fl_next_event(const struct chm_dev *d, struct chm_flusher *fl, double now, double *due)
{
    int has = 0;
    double at = 0.0;
    if (fl->n_dirty && fl_at_flight_limit(fl)) {
        at = flight_room_at(fl);
        has = 1;
    }
    double grant;
    if (fl->n_dirty && !fl_at_flight_limit(fl) && fl_next_flush_at(d, fl, now, &grant) && (!has || grant < at)) {
        at = grant;
        has = 1;
    }
    if (has)
        *due = py_max(now, at);
    return has;
}

/* Flusher.flush: its finish; NaN: no memory. */
double fl_flush(struct seq *q, double now)
{
    struct chm_flusher *fl = q->fl;
    q->c->flush_calls++;
    int rc = fl_tick(q, now, 1);
    if (rc) {
        q->rc = rc;
        return NOT_A_TIME;
    }
    double done = now;
    for (uint64_t i = 0; i < fl->n_flights; i++)
        done = py_max(done, fl->flights[i].finish);
    double latest = fl_complete_flights(q, 1.0 / 0.0);
    if (latest != latest)
        return NOT_A_TIME;
    return done;
}

