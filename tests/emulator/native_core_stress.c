/* Random calls of every function of the native core (emulator/native/chm_core.h), legal or not, with the
 * frame table's invariants (chm_ft_check) and the prefetch and admission counts checked after each call;
 * the SSD model, the sequential path and the data-off operations (the native flusher) with random
 * operations, their heaps, queues and settled state checked.
 * Built with -fsanitize=address,undefined by tests/emulator/test_native_core.py: an out-of-bounds access,
 * a leak or undefined behaviour fails it too. Prints "all invariants held" and exits 0, or names the failure.
 */
#include "chm_core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FAIL(...) do { printf(__VA_ARGS__); printf("\n"); exit(1); } while (0)

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static uint64_t rnd(uint64_t n)  /* uniform-ish in [0, n); xorshift64 */
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return n ? rng % n : 0;
}

static void check_table(const struct chm_ft *ft, const char *name, long step, int rc)
{
    if (rc == CHM_E_INTERNAL || rc == CHM_E_NOMEM)
        FAIL("%s, step %ld: status %d", name, step, rc);
    int line = chm_ft_check(ft);
    if (line)
        FAIL("%s, step %ld: the invariant at line %d (emulator/native/frame_table.c or the policy's policy_*.c) "
             "is broken", name, step, line);
}

/* The caller's victim for an external policy: an unpinned way of the page's set, from a random start. */
static int insert_external(struct chm_ft *ft, uint64_t page, uint32_t sets, uint32_t ways, struct chm_access *a)
{
    const uint32_t *pins = chm_ft_pins(ft);
    uint32_t set = (uint32_t)(page % sets), start = (uint32_t)rnd(ways);
    for (uint32_t k = 0; k < ways; k++) {
        uint32_t f = set * ways + (start + k) % ways;
        if (!pins[f])
            return chm_ft_insert_replacing(ft, page, f, a);
    }
    return CHM_ALL_PINNED;
}

static void stress_table(const char *name, uint32_t frames, uint32_t ways, struct chm_policy_params policy,
                         long steps, uint64_t page_space)
{
    struct chm_ft *ft;
    if (chm_ft_new(frames, ways, &policy, &ft))
        FAIL("chm_ft_new(%s, %u frames, %u ways) failed", name, frames, ways);
    uint32_t sets = frames / ways;
    uint64_t *queue = malloc(ways * sizeof *queue);
    uint64_t batch[16];
    uint8_t writes[16], hits[16];
    struct chm_access a;
    struct chm_access_counts counts;
    for (long i = 0; i < steps; i++) {
        uint64_t page = rnd(page_space);
        uint32_t frame = (uint32_t)rnd(frames + 2);  /* now and then out of range */
        uint32_t set = (uint32_t)rnd(sets + 1);
        int rc = CHM_OK;
        switch (rnd(15)) {
        case 0: case 1: case 2:
            rc = chm_ft_lookup_or_insert(ft, page, &a);
            if (rc == CHM_NEEDS_VICTIM)
                rc = insert_external(ft, page, sets, ways, &a);
            break;
        case 3:
            rc = chm_ft_insert(ft, page, &a);
            break;
        case 4:
            rc = chm_ft_touch(ft, frame);
            break;
        case 5:
            rc = chm_ft_invalidate(ft, frame);
            break;
        case 6: case 7:
            rc = chm_ft_pin(ft, frame);
            break;
        case 8: case 9:
            rc = chm_ft_unpin(ft, frame);
            break;
        case 10:
            rc = rnd(2) ? chm_ft_mark_dirty(ft, frame) : chm_ft_clear_dirty(ft, frame);
            break;
        case 11:
            chm_ft_victim(ft, page);
            chm_ft_to_evict(ft, set);
            break;
        case 12:
            rc = chm_ft_evict(ft, set, rnd(2) ? page : CHM_NO_PAGE, &a);
            break;
        case 13:
            for (int k = 0; k < 16; k++) {
                batch[k] = rnd(page_space);
                writes[k] = (uint8_t)rnd(2);
            }
            rc = chm_ft_access_many(ft, batch, rnd(2) ? writes : NULL, 1 + rnd(16), rnd(2) ? hits : NULL, &counts);
            if (counts.hits + counts.misses != counts.accesses)
                FAIL("%s, step %ld: access_many counted %lu accesses, %lu hits, %lu misses", name, i,
                     (unsigned long)counts.accesses, (unsigned long)counts.hits, (unsigned long)counts.misses);
            break;
        default:
            chm_ft_queue(ft, set, (uint32_t)rnd(3), queue, (uint32_t)rnd(ways + 1));
            chm_ft_page_pinned(ft, page);
            chm_ft_free_ways(ft, set);
            chm_ft_pinned_ways(ft, set);
        }
        check_table(ft, name, i, rc);
    }
    free(queue);
    chm_ft_free(ft);
}

static void stress_prefetch(uint64_t window, uint32_t max_handles, long steps)
{
    enum { HANDLES = 12 };
    struct chm_pf *pf;
    if (chm_pf_new(window, max_handles, &pf))
        FAIL("chm_pf_new(%lu, %u) failed", (unsigned long)window, max_handles);
    uint64_t pages_of[HANDLES] = {0}, arrived_of[HANDLES] = {0}, held = 0, queued = 0;
    int is_held[HANDLES] = {0};
    uint32_t objects = 0;
    struct chm_pf_object obj;
    int64_t handles[HANDLES], h;
    uint64_t page, arrived;
    for (long i = 0; i < steps; i++) {
        int64_t handle = (int64_t)rnd(HANDLES);
        uint64_t pages = rnd(window + 2);
        int rc;
        switch (rnd(5)) {
        case 0: {
            int want = is_held[handle] ? CHM_PF_HANDLE_IN_USE : pages > window ? CHM_PF_NEVER_FITS
                       : objects >= max_handles ? CHM_PF_NO_HANDLE : held + pages > window ? CHM_PF_WINDOW_FULL : CHM_OK;
            rc = chm_pf_issue(pf, handle, rnd(1000), pages);
            if (rc != want)
                FAIL("prefetch step %ld: issue gave %d, expected %d", i, rc, want);
            if (!rc) {
                is_held[handle] = 1;
                pages_of[handle] = pages;
                arrived_of[handle] = 0;
                held += pages;
                queued += pages;
                objects++;
            }
            break;
        }
        case 1:
            if (chm_pf_next_fetch(pf, &h, &page) != (queued > 0))
                FAIL("prefetch step %ld: a fetch %s", i, queued ? "missing" : "too many");
            queued -= queued > 0;
            break;
        case 2:
            rc = chm_pf_arrived(pf, handle, &arrived);
            if (!is_held[handle] ? rc != CHM_PF_UNKNOWN_HANDLE
                : arrived_of[handle] == pages_of[handle] ? rc != CHM_PF_TOO_MANY_ARRIVALS
                : rc != (++arrived_of[handle] == pages_of[handle]) || arrived != arrived_of[handle])
                FAIL("prefetch step %ld: arrived gave %d", i, rc);
            break;
        case 3:
            rc = chm_pf_release(pf, handle, &obj);
            if (rc != (is_held[handle] ? CHM_OK : CHM_PF_UNKNOWN_HANDLE))
                FAIL("prefetch step %ld: release gave %d", i, rc);
            if (!rc) {
                is_held[handle] = 0;
                held -= obj.pages;
                objects--;
            }
            break;
        default:
            rc = chm_pf_get(pf, handle, &obj);
            if (rc != (is_held[handle] ? CHM_OK : CHM_PF_UNKNOWN_HANDLE)
                || (!rc && (obj.pages != pages_of[handle] || obj.arrived != arrived_of[handle])))
                FAIL("prefetch step %ld: get gave %d", i, rc);
        }
        if (chm_pf_pages_held(pf) != held || chm_pf_objects(pf) != objects
            || chm_pf_handles(pf, handles, HANDLES) != objects)
            FAIL("prefetch step %ld: %lu pages in %u objects held, expected %lu in %u", i,
                 (unsigned long)chm_pf_pages_held(pf), chm_pf_objects(pf), (unsigned long)held, objects);
    }
    chm_pf_free(pf);
}

static void stress_admission(uint64_t capacity, long steps)
{
    struct chm_admission adm = {capacity, 0};
    for (long i = 0; i < steps; i++) {
        uint64_t pages = rnd(capacity + 3), before = adm.used_pages;
        if (rnd(2)) {
            int admitted = chm_admission_admit(&adm, pages);
            if (admitted != (pages <= capacity - before) || adm.used_pages != before + (admitted ? pages : 0))
                FAIL("admission step %ld: admit(%lu) with %lu of %lu used", i, (unsigned long)pages,
                     (unsigned long)before, (unsigned long)capacity);
        } else if (chm_admission_release(&adm, pages) != (pages <= before ? CHM_OK : CHM_E_ARG)) {
            FAIL("admission step %ld: release(%lu) with %lu used", i, (unsigned long)pages, (unsigned long)before);
        }
    }
}

/* The SSD model: random reads, writes and reads_in_flight; both heaps stay heaps, the count of reads in
 * flight is the reads reserved and not yet dropped that finish later. */
static void stress_ssd(uint32_t parallelism, long steps)
{
    struct chm_ssd *ssd;
    if (chm_ssd_new(0, 1, 1, 2, 1, 1, &ssd) != CHM_E_ARG)
        FAIL("an SSD of no command slots was accepted");
    if (chm_ssd_new(parallelism, 100.0, 500.0, 2.0, 4.0, 2.0, &ssd))
        FAIL("chm_ssd_new(%u) failed", parallelism);
    double now = 0.0, last_read = 0.0;
    for (long i = 0; i < steps; i++) {
        now += (double)rnd(3000);
        switch (rnd(3)) {
        case 0: {
            double f = chm_ssd_read(ssd, now, 4096 * (1 + rnd(64)));
            if (!(f >= now) || f > ssd->reads_until)
                FAIL("ssd step %ld: a read finishing at %g, reads until %g", i, f, ssd->reads_until);
            last_read = f;
            break;
        }
        case 1:
            if (!(chm_ssd_write(ssd, now, 4096 * (1 + rnd(64))) <= ssd->writes_until))
                FAIL("ssd step %ld: a write finishing after writes_until", i);
            break;
        default: {
            double at = now - (double)rnd(20000);
            uint64_t n = chm_ssd_reads_in_flight(ssd, at);
            for (uint64_t k = 0; k < n; k++)
                if (!(ssd->read_finishes[k] > at))
                    FAIL("ssd step %ld: a read counted in flight finished before", i);
        }
        }
        for (uint64_t k = 1; k < ssd->n_read_finishes; k++)
            if (ssd->read_finishes[k] < ssd->read_finishes[(k - 1) / 2])
                FAIL("ssd step %ld: the read finishes are no heap", i);
        for (uint32_t k = 1; k < ssd->parallelism; k++)
            if (ssd->slots[k] < ssd->slots[(k - 1) / 2])
                FAIL("ssd step %ld: the command slots are no heap", i);
    }
    if (chm_ssd_reads_in_flight(ssd, last_read) != 0)
        FAIL("reads in flight after the last read finished");
    chm_ssd_free(ssd);
}

/* The device model both data-off stresses run on: two SSDs, the pipes, the controller clock, the latency
 * histograms and the per-frame arrays, in ``d`` with the settings both use (areas, chunking, flusher: the
 * caller's). Not to be moved once set up: ``d`` points into it. */
enum { RIG_SSDS = 2 };
static const uint64_t RIG_PAGE = 4096, RIG_CAPACITY = 256 * 4096;

struct rig {
    struct chm_ssd *ssds[RIG_SSDS];
    struct chm_pipe link_up, link_down, dram;
    struct chm_clocked controller;
    double *ready_at;
    int64_t *io_token, *write_seq;
    struct chm_dev d;
};

static void rig_init(struct rig *r, uint32_t frames, const char *name)
{
    static struct chm_histogram reads, writes;
    chm_histogram_init(&reads);
    chm_histogram_init(&writes);
    for (int i = 0; i < RIG_SSDS; i++)
        if (chm_ssd_new(4, 20000.0, 40000.0, 2.0, 3.0, 1.5, &r->ssds[i]))
            FAIL("%s: chm_ssd_new failed", name);
    r->link_up = r->link_down = (struct chm_pipe){600, 64, 0, 0, 0};
    r->dram = (struct chm_pipe){50, 100, 0, 0, 0};
    r->controller = (struct chm_clocked){1000, 0, 0};
    r->ready_at = calloc(frames, sizeof *r->ready_at);
    r->io_token = calloc(frames, sizeof *r->io_token);
    r->write_seq = calloc(frames, sizeof *r->write_seq);
    r->d = (struct chm_dev){.page_size = RIG_PAGE, .capacity = RIG_CAPACITY, .cycles_per_command = 10,
                            .cycles_per_lookup = 2, .ready_at = r->ready_at, .io_token = r->io_token,
                            .controller = &r->controller, .dram_pipe = &r->dram, .link_to_host = &r->link_down,
                            .read_latency = &reads, .cycles_per_admission = 3, .stripe_bytes = 2 * RIG_PAGE,
                            .n_ssds = RIG_SSDS, .ssds = r->ssds, .link_to_device = &r->link_up,
                            .write_latency = &writes, .write_seq = r->write_seq};
}

static void rig_free(struct rig *r)
{
    for (int i = 0; i < RIG_SSDS; i++)
        chm_ssd_free(r->ssds[i]);
    free(r->ready_at);
    free(r->io_token);
    free(r->write_seq);
}

/* The sequential path: random reads and writes (partial pages, runs longer than DRAM) over one table of
 * each policy; after each call the table's invariants hold and the device is settled again. */
static void stress_sequential(const char *name, struct chm_policy_params policy, uint32_t frames, long ops)
{
    enum { N = 64 };
    const uint64_t page = RIG_PAGE, capacity = RIG_CAPACITY;
    struct chm_ft *ft;
    if (chm_ft_new(frames, frames, &policy, &ft))
        FAIL("sequential %s: chm_ft_new(%u) failed", name, frames);
    struct rig rig;
    rig_init(&rig, frames, name);
    struct chm_dev *d = &rig.d;
    d->n_areas = 1;
    d->areas[0] = (struct chm_dev_area){ft, 0};
    d->chunk_pages = frames > 1 ? frames - 1 : 1;
    uint8_t kinds[N];
    uint64_t addrs[N], lengths[N];
    struct chm_seq_result out;
    double now = 0.0;
    for (long done = 0; done < ops; done += N) {
        for (int k = 0; k < N; k++) {
            kinds[k] = (uint8_t)rnd(2);
            addrs[k] = rnd(capacity);
            lengths[k] = 1 + rnd((frames + 3) * page);
            if (lengths[k] > capacity - addrs[k])
                lengths[k] = capacity - addrs[k];
        }
        if (rnd(8) == 0)
            lengths[rnd(N)] = capacity;  /* past the end (unless at 0): it stops there */
        int rc = chm_dev_run_sequential(d, kinds, addrs, lengths, N, now, &out);
        if (rc != CHM_OK && rc != CHM_E_ARG)
            FAIL("sequential %s: status %d at operation %lu", name, rc, (unsigned long)out.done);
        if (rc == CHM_OK ? out.done != N : out.done >= N || addrs[out.done] + lengths[out.done] <= capacity)
            FAIL("sequential %s: stopped after %lu operations with status %d", name, (unsigned long)out.done, rc);
        check_table(ft, name, done, CHM_OK);
        for (uint32_t f = 0; f < frames; f++)
            if (chm_ft_pins(ft)[f] || chm_ft_dirty(ft)[f])
                FAIL("sequential %s: frame %u left pinned or dirty", name, f);
        if (!(out.now >= now))
            FAIL("sequential %s: time went back", name);
        now = out.now;
    }
    rig_free(&rig);
    chm_ft_free(ft);
}

/* The flusher's state after a data-off call: the ring holds exactly the queued frames, the flights' pages
 * add up, the heap is a heap, the tables hold. */
static void check_flusher(const struct chm_flusher *fl, struct chm_ft *const *tables, int n_tables,
                          const char *name, long step)
{
    uint64_t queued = 0, pages = 0;
    for (uint32_t f = 0; f < fl->frames; f++)
        queued += fl->queued[f];
    if (queued != fl->n_dirty || fl->n_dirty > fl->frames)
        FAIL("ops %s step %ld: %lu queued, %lu in the dirty ring", name, step, (unsigned long)queued,
             (unsigned long)fl->n_dirty);
    for (uint64_t i = 0; i < fl->n_dirty; i++) {
        uint32_t frame;
        double since;
        chm_flusher_dirty_at(fl, i, &frame, &since);
        if (frame >= fl->frames || !fl->queued[frame])
            FAIL("ops %s step %ld: dirty entry %lu is frame %u, not queued", name, step, (unsigned long)i, frame);
    }
    for (uint64_t i = 0; i < fl->n_flights; i++) {
        const struct chm_flight *f = &fl->flights[i], *parent = &fl->flights[(i - 1) / 2];
        pages += f->pages;
        if (i && (parent->finish > f->finish || (parent->finish == f->finish && parent->order > f->order)))
            FAIL("ops %s step %ld: the flights are no heap", name, step);
    }
    if (pages != fl->flushing_pages)
        FAIL("ops %s step %ld: %lu pages in flights, %lu counted", name, step, (unsigned long)pages,
             (unsigned long)fl->flushing_pages);
    for (int t = 0; t < n_tables; t++)
        check_table(tables[t], name, step, CHM_OK);
}

/* The data-off operations (chm_dev_write, _read, _prefetch_fetch, _release_frames, _tick, _run_until, _flush,
 * ...) at random virtual times over a device of one table (CachePolicy's flush rule) and over one split
 * into a read area and a write buffer (hymcache's arbiter, admission, frames freed once unpinned). */
static void stress_ops(const char *name, int split, uint32_t frames, long steps)
{
    enum { HELD = 6 };
    const uint64_t page = RIG_PAGE, capacity = RIG_CAPACITY;
    uint32_t wbuf = split ? frames / 4 : 0, reads = frames - wbuf;
    struct chm_policy_params lru = {CHM_POLICY_LRU, 0, 0, 0, 0};
    struct chm_ft *read_ft, *write_ft = NULL;
    if (chm_ft_new(reads, reads, &lru, &read_ft) || (split && chm_ft_new(wbuf, wbuf, &lru, &write_ft)))
        FAIL("ops %s: chm_ft_new failed", name);
    struct chm_seq_counts counts = {0};
    uint8_t *queued = calloc(frames, 1), *fwu = calloc(frames, 1);
    struct chm_flusher *fl;
    if (chm_flusher_new(frames, queued, &fl))
        FAIL("ops %s: chm_flusher_new failed", name);
    struct chm_admission admission = {wbuf, 0};
    struct chm_pf *pf;
    uint64_t window = reads > 2 ? reads / 2 : 1;
    if (chm_pf_new(window, HELD, &pf))
        FAIL("ops %s: chm_pf_new failed", name);
    struct rig rig;
    rig_init(&rig, frames, name);
    struct chm_dev *d = &rig.d;
    d->chunk_pages = reads - window;
    d->flusher = fl;
    d->ops = &counts;
    d->cycles_per_prefetch_page = 1;
    struct chm_ft *tables[2] = {read_ft, write_ft};
    if (split) {
        d->n_areas = 2;
        d->areas[0] = (struct chm_dev_area){write_ft, reads};
        d->areas[1] = (struct chm_dev_area){read_ft, 0};
        fl->rule = CHM_FLUSH_ARBITER;
        fl->batch_pages = 3;
        fl->max_reads_in_flight = rnd(2);
        fl->max_delay_ns = 50000.0;
        fl->pages_in_flight_limit = 3;
        fl->write_area = d->areas[0];
        fl->write_area_frames = wbuf;
        fl->copy_area = d->areas[1];
        fl->admission = &admission;
        fl->free_when_unpinned = fwu;
        fl->write_buffer_frames = wbuf;
        fl->drops_staged_on_release = 1;
    } else {
        d->n_areas = 1;
        d->areas[0] = (struct chm_dev_area){read_ft, 0};
        fl->rule = CHM_FLUSH_AFTER_DELAY;
        fl->writeback_delay_ns = 30000.0;
        fl->write_area = d->areas[0];
        fl->write_area_frames = reads;
    }
    uint32_t *held_frames[HELD] = {0};
    uint64_t held_n[HELD] = {0};
    int64_t next_handle = 1, handle_of[HELD] = {0};
    double now = 0.0, t, out4[4];
    uint64_t ran;
    for (long i = 0; i < steps; i++) {
        now += (double)rnd(4) * (double)rnd(40000);
        uint64_t addr = rnd(capacity), len = 1 + rnd((split ? wbuf : frames) * page);
        if (len > capacity - addr)
            len = capacity - addr;
        struct chm_write_result w;
        struct chm_prefetch_result pr;
        int rc = CHM_OK;
        switch (rnd(9)) {
        case 0: case 1:
            rc = chm_dev_write(d, addr, len, now, 1, &w);
            if (rc == CHM_WRITE_REFUSED || rc == CHM_WRITE_TOO_BIG || rc == CHM_NO_FRAME)
                rc = CHM_OK;
            break;
        case 2:  /* Controller.read: the tick, then (one area) the read */
            rc = chm_dev_tick(d, now, 0) < 0 ? CHM_E_NOMEM : CHM_OK;
            if (!split && rc == CHM_OK) {
                int64_t n = chm_dev_read(d, addr, len, now, 1, out4);
                if (n < 0 && n != CHM_NO_FRAME)
                    rc = (int)n;
                if (n > 0 && !(out4[0] >= now))
                    FAIL("ops %s step %ld: a read finished before it began", name, i);
            }
            break;
        case 3: {
            int k = (int)rnd(HELD);
            if (handle_of[k]) {  /* release it */
                struct chm_pf_object obj;
                chm_pf_release(pf, handle_of[k], &obj);
                chm_dev_release_frames(d, held_frames[k], held_n[k]);
                free(held_frames[k]);
                held_frames[k] = NULL;
                handle_of[k] = 0;
                break;
            }
            uint64_t pages = 1 + rnd(window);
            uint64_t first = rnd(capacity / page - pages);
            if (chm_pf_issue(pf, next_handle, first, pages) != CHM_OK)
                break;
            held_frames[k] = malloc(pages * sizeof **held_frames);
            rc = chm_dev_prefetch_fetch(d, pf, now, held_frames[k], &pr);
            held_n[k] = pr.frames;
            handle_of[k] = next_handle++;
            if (rc == CHM_NO_FRAME)
                rc = CHM_OK;
            break;
        }
        case 4: case 5:
            rc = chm_dev_run_until(d, now - 50000.0, now, &ran, &t);
            break;
        case 6:
            if (chm_dev_next_event(d, now, &t) && !(t >= now))
                FAIL("ops %s step %ld: an event before now", name, i);
            if (!(chm_dev_quiet_until(d, now) >= now) && fl->n_flights == 0)
                FAIL("ops %s step %ld: quiet before now", name, i);
            break;
        case 7:
            if (!(chm_dev_complete_flights(d, now) <= now) || (fl->n_flights && !(fl->flights[0].finish > now)))
                FAIL("ops %s step %ld: a flight retired before it landed, or one left that landed", name, i);
            break;
        default:
            if (rnd(4) == 0 && !(chm_dev_flush(d, now) >= now))
                FAIL("ops %s step %ld: a flush before now", name, i);
        }
        if (rc < 0)
            FAIL("ops %s step %ld: status %d", name, i, rc);
        check_flusher(fl, tables, split ? 2 : 1, name, i);
    }
    for (int k = 0; k < HELD; k++) {
        if (handle_of[k]) {
            struct chm_pf_object obj;
            chm_pf_release(pf, handle_of[k], &obj);
            chm_dev_release_frames(d, held_frames[k], held_n[k]);
        }
        free(held_frames[k]);
    }
    chm_dev_flush(d, now);
    check_flusher(fl, tables, split ? 2 : 1, name, steps);
    if (fl->n_dirty || fl->n_flights || admission.used_pages)
        FAIL("ops %s: %lu dirty, %lu flights, %lu write-buffer pages left after the last flush", name,
             (unsigned long)fl->n_dirty, (unsigned long)fl->n_flights, (unsigned long)admission.used_pages);
    if (chm_ft_pinned_ways(read_ft, 0) || (split && chm_ft_pinned_ways(write_ft, 0)))
        FAIL("ops %s: frames left pinned", name);
    chm_flusher_free(fl);
    chm_pf_free(pf);
    rig_free(&rig);
    free(queued);
    free(fwu);
    chm_ft_free(read_ft);
    chm_ft_free(write_ft);
}

int main(void)
{
    static const struct { const char *name; struct chm_policy_params policy; } policies[] = {
        {"external", {CHM_POLICY_EXTERNAL, 0, 0, 0, 0}},
        {"lru", {CHM_POLICY_LRU, 0, 0, 0, 0}},
        {"fifo", {CHM_POLICY_FIFO, 0, 0, 0, 0}},
        {"clock", {CHM_POLICY_CLOCK, 2, 0, 0, 0}},
        {"sieve", {CHM_POLICY_SIEVE, 0, 0, 0, 0}},
        {"s3fifo", {CHM_POLICY_S3FIFO, 0, 0.1, 0.9, 2}},
        {"s3fifo-big-ghost", {CHM_POLICY_S3FIFO, 0, 0.3, 4.0, 1}},
        {"s3fifo-no-ghost", {CHM_POLICY_S3FIFO, 0, 0.5, 0.0, 3}},
    };
    static const struct { uint32_t frames, ways; } geometries[] = {{1, 1}, {8, 8}, {16, 4}, {96, 8}, {130, 65}, {200, 200}};
    for (size_t p = 0; p < sizeof policies / sizeof *policies; p++) {
        for (size_t g = 0; g < sizeof geometries / sizeof *geometries; g++) {
            uint32_t frames = geometries[g].frames;
            stress_table(policies[p].name, frames, geometries[g].ways, policies[p].policy, 6000, 3 * frames);
        }
        /* sparse page numbers, across the whole range: the page index's probing and deletion */
        stress_table(policies[p].name, 512, 512, policies[p].policy, 20000, UINT64_MAX - 1);
    }
    struct chm_ft *ft;
    struct chm_policy_params bad = {CHM_POLICY_CLOCK, 0, 0, 0, 0};
    if (chm_ft_new(8, 3, &policies[1].policy, &ft) != CHM_E_ARG || chm_ft_new(8, 8, &bad, &ft) != CHM_E_ARG)
        FAIL("a bad geometry or policy was accepted");
    stress_prefetch(4, 2, 20000);
    stress_prefetch(40, 8, 20000);
    stress_prefetch(0, 1, 2000);
    stress_admission(13, 20000);
    stress_admission(0, 1000);
    stress_ssd(1, 20000);
    stress_ssd(7, 20000);
    for (size_t p = 1; p < sizeof policies / sizeof *policies; p++) {
        stress_sequential(policies[p].name, policies[p].policy, 24, 3000);
        if (policies[p].policy.kind != CHM_POLICY_S3FIFO)
            stress_sequential(policies[p].name, policies[p].policy, 3, 1000);
    }
    stress_ops("cache", 0, 24, 20000);
    stress_ops("cache-small", 0, 4, 5000);
    stress_ops("split", 1, 24, 20000);
    stress_ops("split-small", 1, 8, 5000);
    struct chm_dev no_area = {.n_areas = 0};
    struct chm_seq_result out;
    if (chm_dev_run_sequential(&no_area, NULL, NULL, NULL, 0, 0.0, &out) != CHM_E_ARG || out.done)
        FAIL("the sequential path ran on a device without one area");
    printf("all invariants held\n");
    return 0;
}
