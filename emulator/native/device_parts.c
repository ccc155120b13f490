/* The data-off device's calls into its parts: the policy's per-frame calls on the area holding the frame,
 * the media (MediaIO, ssd.locate), the timing model's read counts, and the flush rules chm_core.h exports
 * (the native flusher and the Python policies both call these). Each step names the Python it mirrors. */
#include "chm_core_internal.h"

struct chm_ft *frame_table(const struct chm_dev *d, uint32_t frame, uint32_t *local)
{
    for (uint32_t i = 0; i < d->n_areas; i++) {
        const struct chm_dev_area *a = &d->areas[i];
        if (frame >= a->base && frame - a->base < a->table->frames) {
            *local = frame - a->base;
            return a->table;
        }
    }
    *local = 0;
    return d->areas[0].table;  /* not reached: the areas cover the device */
}

int64_t area_lookup(const struct chm_dev_area *a, uint64_t page)
{
    if (!a->table)
        return -1;
    int64_t f = chm_ft_lookup(a->table, page);
    return f < 0 ? -1 : (int64_t)a->base + f;
}

void pol_touch(struct seq *q, uint32_t frame)
{
    uint32_t local;
    struct chm_ft *ft = frame_table(q->d, frame, &local);
    chm_ft_touch(ft, local);
}

void pol_pin(struct seq *q, uint32_t frame)
{
    uint32_t local;
    struct chm_ft *ft = frame_table(q->d, frame, &local);
    chm_ft_pin(ft, local);
}

/* HymCachePolicy._free_write_frame */
static void free_write_frame(struct seq *q, uint32_t frame)
{
    chm_ft_invalidate(q->fl->write_area.table, frame - q->fl->write_area.base);
    chm_admission_release(q->fl->admission, 1);
}

static int in_write_area(const struct chm_flusher *fl, uint32_t frame)
{
    return frame >= fl->write_area.base && frame - fl->write_area.base < fl->write_area_frames;
}

/* Policy.unpin (HymCachePolicy.unpin: a flushed write-buffer frame a read held is freed now) */
void pol_unpin(struct seq *q, uint32_t frame)
{
    uint32_t local;
    struct chm_ft *ft = frame_table(q->d, frame, &local);
    chm_ft_unpin(ft, local);
    uint8_t *fwu = q->fl->free_when_unpinned;
    if (fwu && fwu[frame] && ft->pins[local] == 0) {
        fwu[frame] = 0;
        free_write_frame(q, frame);
    }
}

/* Policy.flushed (HymCachePolicy.flushed: the write-buffer frame is freed, once unpinned) */
void pol_flushed(struct seq *q, uint32_t frame)
{
    uint32_t local;
    struct chm_ft *ft = frame_table(q->d, frame, &local);
    chm_ft_clear_dirty(ft, local);
    struct chm_flusher *fl = q->fl;
    if (fl->free_when_unpinned && in_write_area(fl, frame)) {
        if (ft->pins[local])
            fl->free_when_unpinned[frame] = 1;
        else
            free_write_frame(q, frame);
    }
}

/* Policy.mark_dirty (HymCachePolicy.mark_dirty: rewritten before it was freed, it stays) */
void pol_mark_dirty(struct seq *q, uint32_t frame)
{
    uint32_t local;
    struct chm_ft *ft = frame_table(q->d, frame, &local);
    chm_ft_mark_dirty(ft, local);
    if (q->fl->free_when_unpinned)
        q->fl->free_when_unpinned[frame] = 0;
}

/* -- the media (MediaIO, ssd.locate) -- */

/* ssd.locate(page * page_size): the SSD, and the byte offset in its file. */
static struct chm_ssd *seq_locate(const struct chm_dev *d, uint64_t page, uint64_t *offset)
{
    uint64_t addr = page * d->page_size, stripe = addr / d->stripe_bytes;
    *offset = (stripe / d->n_ssds) * d->stripe_bytes + addr % d->stripe_bytes;
    return d->ssds[stripe % d->n_ssds];
}

/* MediaIO.read: stage `page` at `now`; its modelled finish, or NaN (no memory). */
double seq_media_read(struct seq *q, uint64_t page, double now)
{
    uint64_t offset;
    struct chm_ssd *ssd = seq_locate(q->d, page, &offset);
    double done = chm_ssd_read(ssd, now, q->d->page_size);
    if (done != done) {
        q->rc = CHM_E_NOMEM;
        return done;
    }
    q->c->ssd_read_bytes += q->d->page_size;
    return done;
}

/* MediaIO.write: `pages` frames on to the media from `page` on at `now`; its modelled finish. */
double seq_media_write(struct seq *q, uint64_t page, uint64_t pages, double now)
{
    uint64_t offset, nbytes = pages * q->d->page_size;
    struct chm_ssd *ssd = seq_locate(q->d, page, &offset);
    q->c->ssd_write_bytes += nbytes;
    return chm_ssd_write(ssd, now, nbytes);
}

/* MediaIO.contiguous */
int seq_contiguous(const struct chm_dev *d, uint64_t page, uint64_t next_page)
{
    uint64_t a_off, b_off;
    const struct chm_ssd *a = seq_locate(d, page, &a_off), *b = seq_locate(d, next_page, &b_off);
    return a == b && b_off == a_off + d->page_size;
}

/* TimingModel.reads_in_flight */
uint64_t reads_in_flight(const struct chm_dev *d, double now)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < d->n_ssds; i++)
        n += chm_ssd_reads_in_flight(d->ssds[i], now);
    return n;
}

static int by_value_desc(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* TimingModel.reads_idle_at; NaN: no memory. */
double reads_idle_at(const struct chm_dev *d, double now, uint64_t max_in_flight)
{
    if (max_in_flight == 0) {
        double t = now;
        for (uint32_t i = 0; i < d->n_ssds; i++)
            t = py_max(t, d->ssds[i]->reads_until);
        return t;
    }
    uint64_t n = 0;
    for (uint32_t i = 0; i < d->n_ssds; i++)
        n += d->ssds[i]->n_read_finishes;
    if (n <= max_in_flight)
        return now;
    double *later = malloc((size_t)n * sizeof *later);
    if (!later)
        return NOT_A_TIME;
    uint64_t k = 0;
    for (uint32_t i = 0; i < d->n_ssds; i++)
        for (uint64_t j = 0; j < d->ssds[i]->n_read_finishes; j++)
            if (d->ssds[i]->read_finishes[j] > now)
                later[k++] = d->ssds[i]->read_finishes[j];
    double t = now;
    if (k > max_in_flight) {  /* heapq.nlargest(max_in_flight + 1, finishes)[-1] */
        qsort(later, k, sizeof *later, by_value_desc);
        t = later[max_in_flight];
    }
    free(later);
    return t;
}

/* timing.earliest_time for the two rules' tests */
static int due_after_delay(double t, double since, double delay) { return since <= t - delay; }
static int due_by_age(double t, double since, double delay) { return t - since >= delay; }

/* math.nextafter(x, +inf) (up) or (x, -inf): the next double (no libm: the ASan driver links none). */
static double next_double(double x, int up)
{
    if (x != x || x == (up ? 1.0 / 0.0 : -1.0 / 0.0))
        return x;
    uint64_t bits = 1;
    if (x == 0.0) {  /* either zero: the smallest subnormal of the direction's sign */
        memcpy(&x, &bits, sizeof x);
        return up ? x : -x;
    }
    memcpy(&bits, &x, sizeof bits);
    bits = (x > 0) == up ? bits + 1 : bits - 1;  /* away from zero or toward it */
    memcpy(&x, &bits, sizeof x);
    return x;
}

static double earliest_time(double guess, int (*due)(double, double, double), double since, double delay)
{
    while (!due(guess, since, delay))
        guess = next_double(guess, 1);
    double below;
    while (due(below = next_double(guess, 0), since, delay))
        guess = below;
    return guess;
}

/* The flush rules (chm_core.h); the native flusher and the Python policies both call these. */
double chm_delay_due_at(double oldest_written_ns, double delay_ns)
{
    return earliest_time(oldest_written_ns + delay_ns, due_after_delay, oldest_written_ns, delay_ns);
}

uint64_t chm_arbiter_grant(uint64_t batch_pages, uint64_t max_reads_in_flight, double max_delay_ns,
                           uint64_t dirty_pages, uint64_t reads_in_flight, double oldest_age_ns, int force)
{
    if (dirty_pages == 0)
        return 0;
    if (force)
        return dirty_pages < batch_pages ? dirty_pages : batch_pages;
    if (reads_in_flight > max_reads_in_flight)
        return 0;
    if (dirty_pages >= batch_pages)
        return batch_pages;
    if (oldest_age_ns >= max_delay_ns)
        return dirty_pages;
    return 0;
}

double chm_arbiter_ready_at(uint64_t batch_pages, double max_delay_ns, uint64_t dirty_pages, double oldest_written_ns,
                            double batch_full_ns)
{
    if (dirty_pages >= batch_pages)
        return batch_full_ns;
    return earliest_time(oldest_written_ns + max_delay_ns, due_by_age, oldest_written_ns, max_delay_ns);
}

