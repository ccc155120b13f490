/* The controller's data-off steps (emulator/controller.py): taking and staging frames, the read and the
 * write of one command after its tick. */
#include "chm_core_internal.h"

/* Controller._take_frame (with Flusher.write_back): the frame is free from the time returned. */
static double take_frame(struct seq *q, const struct chm_access *a, uint32_t frame, double now)
{
    double ready = now;
    if (a->victim_page != CHM_NO_PAGE) {
        q->c->evictions++;
        if (a->victim_dirty) {
            q->c->dirty_evictions++;
            fl_unqueue(q->fl, frame);
            ready = seq_media_write(q, a->victim_page, 1, now);
        }
    }
    return ready;
}

/* Controller._allocate: a frame of `area` for `page` (not resident), or -1 (q->rc says why); *now moves
 * past the flushes in flight when every frame was pinned. */
static int64_t allocate(struct seq *q, const struct chm_dev_area *area, uint64_t page, double *now,
                        struct chm_access *a)
{
    int rc = chm_ft_insert(area->table, page, a);
    if (rc == CHM_ALL_PINNED) {
        double latest = fl_complete_flights(q, 1.0 / 0.0);
        if (latest != latest)
            return -1;
        *now = py_max(*now, latest);
        rc = chm_ft_insert(area->table, page, a);
    }
    if (rc != CHM_OK) {
        q->rc = rc == CHM_ALL_PINNED ? CHM_NO_FRAME : rc;
        q->failed_page = page;
        return -1;
    }
    return (int64_t)area->base + a->frame;
}

/* The area clean pages are staged into (Policy.allocate_clean, staged_lookup): the read area. */
const struct chm_dev_area *seq_clean_area(const struct seq *q)
{
    return q->fl->copy_area.table ? &q->fl->copy_area : &q->fl->write_area;
}

/* Controller._stage at t into the read area; the frame, or -1. */
int64_t seq_stage(struct seq *q, uint64_t page, double t)
{
    struct chm_access a;
    int64_t frame = allocate(q, seq_clean_area(q), page, &t, &a);
    if (frame < 0)
        return -1;
    double ready = take_frame(q, &a, (uint32_t)frame, t);
    double done = seq_media_read(q, page, t);
    if (done != done)
        return -1;
    q->d->ready_at[frame] = py_max(done, ready);
    return frame;
}

/* Controller._copy_out of pages [first, last] (in frames[], or looked up when frames is NULL) at t: the
 * DRAM pipe, then the link, page by page (the two pipes are apart: the same as a stream through each). */
static double copy_out(struct seq *q, uint64_t addr, uint64_t len, uint64_t first, uint64_t last,
                       const uint32_t *frames, double t)
{
    struct chm_dev *d = q->d;
    const uint64_t page_size = d->page_size, first_page = addr / page_size, end = addr + len;
    double arrival = t;
    for (uint64_t page = first; page <= last; page++) {
        uint64_t frame = frames ? frames[page - first] : (uint64_t)area_lookup(&d->areas[0], page);
        uint64_t base = page * page_size;
        uint64_t lo = page == first_page ? addr - base : 0;
        uint64_t hi = end < base + page_size ? end - base : page_size;
        double ready = d->ready_at[frame];
        if (ready <= t)
            d->counts.hit_bytes += hi - lo;
        arrival = chm_pipe_transfer(d->link_to_host,
                                    chm_pipe_transfer(d->dram_pipe, ready > t ? ready : t, hi - lo, 1.0),
                                    hi - lo, 1.0);
    }
    return arrival;
}

/* Controller.read (no buffer) of a device of one area after its tick; its finish, or NaN. pages[0..2]: the
 * pages hit, missed and merged. */
double seq_read(struct seq *q, uint64_t addr, uint64_t len, double now, int count_command, uint64_t *pages_out)
{
    struct chm_dev *d = q->d;
    const struct chm_dev_area *area = &d->areas[0];
    double finish;
    int64_t hit = chm_dev_read_hit(d, addr, len, now, NULL, count_command, &finish);
    if (hit) {
        pages_out[0] = (uint64_t)hit;
        pages_out[1] = pages_out[2] = 0;
        return finish;
    }
    const uint64_t first = addr / d->page_size, last = (addr + len - 1) / d->page_size, pages = last - first + 1;
    uint64_t hits = 0, missed = 0, merged = 0;
    d->counts.read_bytes += len;
    double t = chm_clocked_run(d->controller, now, d->cycles_per_command + pages * d->cycles_per_lookup);
    int all_resident = 1;
    for (uint64_t page = first; page <= last && all_resident; page++)
        all_resident = area_lookup(area, page) >= 0;
    if (all_resident) {  /* nothing can be evicted: nothing pinned */
        for (uint64_t page = first; page <= last; page++) {
            int64_t frame = area_lookup(area, page);
            if (d->ready_at[frame] > t)
                merged++;
            else
                pol_touch(q, (uint32_t)frame);
        }
        hits = pages - merged;
        d->counts.page_hits += hits;
        q->c->merged_misses += merged;
        finish = copy_out(q, addr, len, first, last, NULL, t);
    } else {  /* staging may evict: pin what a chunk uses until it is copied (_lookup_or_stage) */
        uint32_t chunk[SEQ_MAX_CHUNK];
        finish = t;
        for (uint64_t start = first; start <= last; start += d->chunk_pages) {
            uint64_t end = last - start < d->chunk_pages ? last : start + d->chunk_pages - 1;
            for (uint64_t page = start; page <= end; page++) {
                int64_t frame = area_lookup(area, page);
                if (frame < 0) {
                    missed++;
                    q->c->page_misses++;
                    frame = seq_stage(q, page, t);
                    if (frame < 0) {
                        for (uint64_t p = start; p < page; p++)  /* the finally: unpin what it pinned */
                            pol_unpin(q, chunk[p - start]);
                        return NOT_A_TIME;
                    }
                } else if (d->ready_at[frame] > t) {
                    merged++;
                    q->c->merged_misses++;
                } else {
                    hits++;
                    d->counts.page_hits++;
                    pol_touch(q, (uint32_t)frame);
                }
                pol_pin(q, (uint32_t)frame);
                chunk[page - start] = (uint32_t)frame;
            }
            finish = py_max(finish, copy_out(q, addr, len, start, end, chunk, t));
            for (uint64_t page = start; page <= end; page++)
                pol_unpin(q, chunk[page - start]);
        }
    }
    if (count_command) {  /* Controller.count_command */
        d->counts.reads++;
        chm_histogram_add(d->read_latency, finish - now);
    }
    pages_out[0] = hits;
    pages_out[1] = missed;
    pages_out[2] = merged;
    return finish;
}

/* Controller._fill_partial (no bytes) */
static double fill_partial(struct seq *q, uint32_t frame, uint64_t page, double now)
{
    int64_t copy = area_lookup(&q->fl->copy_area, page);
    if (copy >= 0 && (uint32_t)copy != frame)
        return py_max(now, q->d->ready_at[copy]);
    q->c->rmw_reads++;
    return seq_media_read(q, page, now);
}

/* Controller._write_page (no bytes) at now; its finish, or NaN. */
static double write_page(struct seq *q, uint64_t page, uint64_t lo, uint64_t hi, double now)
{
    struct chm_dev *d = q->d;
    struct chm_flusher *fl = q->fl;
    int64_t frame = area_lookup(&fl->write_area, page);
    double ready = now;
    if (frame < 0) {
        struct chm_access a;
        frame = allocate(q, &fl->write_area, page, &now, &a);
        if (frame < 0)
            return NOT_A_TIME;
        ready = take_frame(q, &a, (uint32_t)frame, now);
        d->ready_at[frame] = now;
        if (hi - lo < d->page_size) {  /* partial page: the rest from DRAM's staged copy or the media */
            double filled = fill_partial(q, (uint32_t)frame, page, now);
            if (filled != filled)
                return filled;
            ready = py_max(ready, filled);
        }
    } else {
        pol_touch(q, (uint32_t)frame);
    }
    d->write_seq[frame]++;
    pol_mark_dirty(q, (uint32_t)frame);
    fl_enqueue(fl, (uint32_t)frame, now);
    return chm_pipe_transfer(d->dram_pipe, py_max(ready, d->ready_at[frame]), hi - lo, 1.0);
}

/* Controller.write (no bytes) after its tick; CHM_OK (out: its finish and pages) or a status. */
int seq_write(struct seq *q, uint64_t addr, uint64_t len, double now, int count_command,
                     struct chm_write_result *out)
{
    struct chm_dev *d = q->d;
    struct chm_flusher *fl = q->fl;
    const uint64_t page_size = d->page_size, first = addr / page_size, last = (addr + len - 1) / page_size;
    const uint64_t pages = last - first + 1, end = addr + len;
    uint64_t new_pages = 0;
    for (uint64_t page = first; page <= last; page++)
        new_pages += area_lookup(&fl->write_area, page) < 0;
    out->new_pages = new_pages;
    out->pages = pages;
    if (new_pages > fl->write_buffer_frames && fl->write_buffer_frames > 0)
        return CHM_WRITE_TOO_BIG;
    if (fl->admission && !chm_admission_admit(fl->admission, new_pages)) {
        q->c->refused_writes++;
        q->c->refused_write_bytes += len;
        return CHM_WRITE_REFUSED;
    }
    q->c->write_bytes += len;
    double arrived = chm_pipe_transfer(d->link_to_device, now, len, 1.0);
    double t = chm_clocked_run(d->controller, arrived, d->cycles_per_command + pages * d->cycles_per_admission);
    double finish = t;
    for (uint64_t page = first; page <= last; page++) {
        uint64_t base = page * page_size;
        uint64_t lo = addr > base ? addr - base : 0;
        uint64_t hi = end < base + page_size ? end - base : page_size;
        double done = write_page(q, page, lo, hi, t);
        if (done != done) {
            out->page = q->failed_page;
            return q->rc ? q->rc : CHM_E_INTERNAL;
        }
        finish = py_max(finish, done);
    }
    if (count_command) {
        q->c->writes++;
        chm_histogram_add(d->write_latency, finish - now);
    }
    out->finish = finish;
    return CHM_OK;
}

int dev_range_ok(const struct chm_dev *d, uint64_t addr, uint64_t len)
{
    return len != 0 && addr <= d->capacity && len <= d->capacity - addr;
}

struct seq dev_seq(struct chm_dev *d)
{
    struct seq q = {.d = d, .fl = d->flusher, .c = d->ops};
    return q;
}

