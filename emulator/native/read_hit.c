/* The DRAM-hit read (Controller.read when every page is a hit and ready), with or without the bytes. */
#include "chm_core_internal.h"

int64_t dev_lookup(const struct chm_dev *d, uint64_t page, const struct chm_dev_area **area)
{
    for (uint32_t i = 0; i < d->n_areas; i++) {
        int64_t f = map_get(&d->areas[i].table->index, page);
        if (f >= 0) {
            *area = &d->areas[i];
            return f;
        }
    }
    return -1;
}

int64_t chm_dev_read_hit(struct chm_dev *d, uint64_t addr, uint64_t len, double now, uint8_t *out,
                         int count_command, double *finish)
{
    const uint64_t page_size = d->page_size;
    if (!d->n_areas || len == 0 || addr > d->capacity || len > d->capacity - addr)
        return 0;
    const uint64_t first = addr / page_size, last = (addr + len - 1) / page_size, pages = last - first + 1;
    double occupancy, t = clocked_plan(d->controller, now, d->cycles_per_command + pages * d->cycles_per_lookup,
                                       &occupancy);
    /* Every page a hit? (A frame not ready by t is a merged miss; an unsettled one needs its media read.) */
    for (uint64_t page = first; page <= last; page++) {
        const struct chm_dev_area *area;
        int64_t f = dev_lookup(d, page, &area);
        if (f < 0)
            return 0;
        uint64_t frame = area->base + (uint64_t)f;
        if (d->ready_at[frame] > t || d->io_token[frame] != CHM_NO_TOKEN)
            return 0;
    }
    /* Controller.read from here. Python touches every page, then copies and times each: the policy's
     * state and the pipes' are apart, so doing both per page ends in the same state. */
    d->counts.read_bytes += len;
    clocked_commit(d->controller, t, occupancy);
    struct chm_pipe *dram = d->dram_pipe, *link = d->link_to_host;
    const double dram_latency = dram->latency_ns * 1.0, link_latency = link->latency_ns * 1.0;
    const int copy = d->dram && out;
    const uint64_t end = addr + len;
    uint64_t run_src = 0, run_dst = 0, run_len = 0;  /* the pending memcpy: frames that follow each other in DRAM */
    int64_t run_last = -2;                           /* the frame that ends it, if a whole page */
    double arrival = t;
    for (uint64_t page = first; page <= last; page++) {
        const struct chm_dev_area *area = d->areas;   /* the page is resident: dev_lookup sets it */
        int64_t f = dev_lookup(d, page, &area);
        int64_t frame = (int64_t)area->base + f;
        d->counts.page_hits++;
        chm_ft_touch(area->table, (uint32_t)f);
        uint64_t base = page * page_size;
        uint64_t lo = page == first ? addr - base : 0;
        uint64_t hi = end < base + page_size ? end - base : page_size;
        d->counts.hit_bytes += hi - lo;
        if (copy) {
            if (frame == run_last + 1 && lo == 0) {
                run_len += hi;
            } else {
                if (run_len)
                    memcpy(out + run_dst, d->dram + run_src, run_len);
                run_src = (uint64_t)frame * page_size + lo;
                run_dst = base + lo - addr;
                run_len = hi - lo;
            }
            run_last = hi == page_size ? frame : -2;
        }
        /* every page is ready by t: each piece enters the DRAM pipe at t, then the link */
        arrival = pipe_piece(link, pipe_piece(dram, t, hi - lo, 1.0, dram_latency), hi - lo, 1.0, link_latency);
    }
    if (run_len)
        memcpy(out + run_dst, d->dram + run_src, run_len);
    *finish = arrival;
    if (count_command) {
        d->counts.reads++;
        chm_histogram_add(d->read_latency, *finish - now);
    }
    return (int64_t)pages;
}

int64_t chm_dev_map_hit(struct chm_dev *d, uint64_t addr, double now, double *finish)
{
    const struct chm_dev_area *area;
    if (d->n_areas != 1 || addr % d->page_size)
        return -1;
    int64_t f = dev_lookup(d, addr / d->page_size, &area);
    if (f < 0 || !area->table->mapped || chm_dev_read_hit(d, addr, d->page_size, now, NULL, 1, finish) <= 0)
        return -1;
    if (chm_ft_pin(area->table, (uint32_t)f) != CHM_OK)
        return -1;
    area->table->mapped[f] = 1;
    return (int64_t)area->base + f;
}

int chm_dev_map_unpin(struct chm_dev *d, uint32_t frame)
{
    for (uint32_t i = 0; i < d->n_areas; i++) {
        const struct chm_dev_area *a = &d->areas[i];
        if (frame >= a->base && frame - a->base < a->table->frames)
            return chm_ft_unpin(a->table, frame - a->base);
    }
    return CHM_E_ARG;
}
