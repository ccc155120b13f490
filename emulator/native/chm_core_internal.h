/* What the native core's files share (chm_core.h is the public, cffi header). The decisions mirror, one
 * for one, the specifications in emulator/frame_table.py and emulator/policies/{lru,fifo,clock,sieve,s3fifo}.py
 * (libCacheSim's algorithms, with the device's pinned frames); the property tests in
 * tests/emulator/test_native_core.py check them against the former Python implementations, kept there as
 * models. The timing resources and
 * the DRAM-hit read compute as emulator/timing.py and Controller.read do (tests/emulator/test_native_hits.py
 * runs workloads both ways); the data-off device as Controller.read, write and flush do
 * (tests/emulator/test_native_sequential.py, test_native_ops.py, likewise).
 *
 * The files: hashmap.c, frame_table.c (with policy.h's table and one policy_*.c per eviction policy),
 * prefetch.c, admission.c, timing.c, read_hit.c, and the data-off device: device_parts.c (its calls into
 * the policy, the media and the timing model; the flush rules), flusher.c, device_ops.c (the controller's
 * steps), device.c (the operations chm_core.h exports, the sequential path).
 *
 * The small functions the hot paths call across files are static inline here; the others are hidden
 * from the module's exports (the visibility pragma below).
 */
#ifndef CHM_CORE_INTERNAL_H
#define CHM_CORE_INTERNAL_H

#include "chm_core.h"

#include <stdlib.h>
#include <string.h>

#ifndef CHM_MUTATION
#define CHM_MUTATION CHM_MUTATION_NONE
#endif

#pragma GCC visibility push(hidden)

/* ---- a hash map uint64 -> int32 (open addressing, linear probing, backward-shift deletion; hashmap.c) ---- */

struct chm_map {
    uint64_t *keys;
    int32_t *values;  /* -1: an empty slot */
    uint32_t mask;
    uint32_t count;
    unsigned shift;   /* 64 - log2(slots): Fibonacci hashing takes the top bits */
};

#define MAP_MIN_SLOTS 8u

static inline uint32_t map_home(const struct chm_map *m, uint64_t key)
{
    return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> m->shift);
}

static inline int32_t map_get(const struct chm_map *m, uint64_t key)
{
    for (uint32_t i = map_home(m, key);; i = (i + 1) & m->mask) {
        int32_t v = m->values[i];
        if (v < 0 || m->keys[i] == key)
            return v;
    }
}

int map_init(struct chm_map *m, uint64_t entries);      /* slots for `entries` at a load of at most 1/2 */
void map_destroy(struct chm_map *m);
void map_put_new(struct chm_map *m, uint64_t key, int32_t value);  /* a key not there; the map has room */
int map_reserve_one(struct chm_map *m);  /* twice the slots when over half full (sizes not known in advance) */
void map_del(struct chm_map *m, uint64_t key);

/* ---- the frame table (frame_table.c; its policies behind policy.h's table) ---- */

#define QUEUES 2
#define NONE (-1)

struct chm_set {
    int32_t oldest[QUEUES];  /* per queue: its oldest and newest frame, NONE when empty */
    int32_t newest[QUEUES];
    uint32_t len[QUEUES];
    uint32_t free_ways;
    uint32_t pinned_ways;    /* frames with a pin count, resident or not */
    uint32_t free_hint;      /* no free way in the bitmap words before this one */
    int32_t hand;            /* sieve: the frame the hand looks at next; NONE: the oldest */
    uint8_t has_evicted;     /* s3fifo: before the first eviction a full small queue sends pages to main */
    uint8_t ghost_claimed;   /* s3fifo: evict() took claimed_page out of the ghost (libCacheSim looks the */
    uint64_t claimed_page;   /*   miss up before it evicts); the insert that follows uses it */
    int32_t ghost_oldest;    /* s3fifo: the ghost FIFO (page numbers), nodes of this set's pool */
    int32_t ghost_newest;
    int32_t ghost_free;
    uint32_t ghost_len;
};

struct chm_policy_ops;

struct chm_ft {
    uint32_t frames, ways, sets, resident;
    struct chm_policy_params policy;
    const struct chm_policy_ops *ops;  /* policy.kind's, chosen once by chm_ft_new */
    struct chm_policy_info info;
    uint64_t *page_of;
    uint8_t *dirty;
    uint32_t *pins;
    int32_t *older, *newer;  /* queue links, by frame */
    uint32_t *freq;          /* clock: counter; sieve: visited bit; s3fifo: hits */
    uint8_t *queue_of;       /* the queue a resident frame is in */
    uint64_t *free_bits;     /* per set, words_per_set words: bit w = way w is free */
    uint32_t words_per_set;
    struct chm_set *set;
    struct chm_map index;    /* page -> frame */
    uint64_t *ghost_page;    /* s3fifo: sets * ghost_capacity nodes */
    int32_t *ghost_older, *ghost_newer;
    struct chm_map ghost_index;  /* page -> ghost node */
    /* scratch for s3fifo's to_evict: the set's state, evicted on a copy and put back */
    int32_t *save_older, *save_newer;
    uint32_t *save_freq;
    uint8_t *save_queue_of;
    /* chm_mmap (chm_ft_track_mapped): mapped[f] = a client may hold a mapping of frame f; drop_page of such a
     * frame clears it and records f in dropped[] (at most once each, so frames long), which the server drains
     * to punch the frame out of every client's page tables before it holds another page. NULL: untracked. */
    uint8_t *mapped;
    uint32_t *dropped;
    uint32_t dropped_n;
};

#define SATURATING_INC(x) ((x) += (x) != UINT32_MAX)

static inline uint32_t set_of_frame(const struct chm_ft *ft, uint32_t frame)
{
    return frame / ft->ways;
}

static inline int pinned(const struct chm_ft *ft, int32_t frame)
{
    return ft->pins[frame] != 0;
}

/* -- queues: doubly linked lists of frames, oldest to newest -- */

static inline void q_push_newest(struct chm_ft *ft, struct chm_set *s, int q, int32_t f)
{
    ft->older[f] = s->newest[q];
    ft->newer[f] = NONE;
    if (s->newest[q] == NONE)
        s->oldest[q] = f;
    else
        ft->newer[s->newest[q]] = f;
    s->newest[q] = f;
    s->len[q]++;
    ft->queue_of[f] = (uint8_t)q;
}

static inline void q_unlink(struct chm_ft *ft, struct chm_set *s, int q, int32_t f)
{
    int32_t o = ft->older[f], n = ft->newer[f];
    if (o == NONE)
        s->oldest[q] = n;
    else
        ft->newer[o] = n;
    if (n == NONE)
        s->newest[q] = o;
    else
        ft->older[n] = o;
    s->len[q]--;
}

static inline void q_move_newest(struct chm_ft *ft, struct chm_set *s, int q, int32_t f)
{
    if (s->newest[q] != f) {
        q_unlink(ft, s, q, f);
        q_push_newest(ft, s, q, f);
    }
}

/* The oldest unpinned frame of the main queue (pinned ones keep their place), or NONE. */
static inline int32_t oldest_unpinned(const struct chm_ft *ft, const struct chm_set *s)
{
    for (int32_t f = s->oldest[CHM_QUEUE_MAIN]; f != NONE; f = ft->newer[f])
        if (!pinned(ft, f))
            return f;
    return NONE;
}

/* chm_ft_check and the policies' checks: the line of the first invariant broken (0: none). */
#define INVARIANT(cond) do { if (!(cond)) return __LINE__; } while (0)

/* ---- timing resources (timing.c): the steps the DRAM-hit read inlines ---- */

/* One piece through a pipe; `latency` is latency_ns * slowdown, as the specification computes it once. */
static inline double pipe_piece(struct chm_pipe *p, double ready, uint64_t nbytes, double slowdown, double latency)
{
    double occupancy = (double)nbytes / p->bandwidth_gbps * slowdown;
    p->free_at = (ready > p->free_at ? ready : p->free_at) + occupancy;
    p->busy_ns += occupancy;
    p->bytes += nbytes;
    return p->free_at + latency;
}

/* When `cycles` started no earlier than ready would end, and their occupancy; changes nothing. */
static inline double clocked_plan(const struct chm_clocked *c, double ready, uint64_t cycles, double *occupancy)
{
    *occupancy = (double)cycles * 1000.0 / c->clock_mhz;
    return (c->free_at > ready ? c->free_at : ready) + *occupancy;   /* Python's max(ready, free_at) */
}

static inline void clocked_commit(struct chm_clocked *c, double end, double occupancy)
{
    c->free_at = end;
    c->busy_ns += occupancy;
}

/* ---- the DRAM-hit read (read_hit.c) ---- */

/* The page's frame (local to *area), or -1. */
int64_t dev_lookup(const struct chm_dev *d, uint64_t page, const struct chm_dev_area **area);

/* ---- the data-off device: the flusher, writes, reads, and the sequential path ----
 * Each step below names the Python it mirrors (emulator/controller.py, flusher.py, media_io.py, ssd.py,
 * policies/base.py, policies/hymcache.py, write_buffer.py, timing.py); doubles are computed with the same
 * operations in the same order, and Python's max(a, b) is "b > a ? b : a". Frames are the device's (global). */

struct seq_entry {
    uint64_t page;
    uint32_t frame;
    double since;
};

struct seq {
    struct chm_dev *d;
    struct chm_flusher *fl;
    struct chm_seq_counts *c;
    int rc;                         /* why an operation stopped (its double is then NaN) */
    uint64_t failed_page;           /* CHM_NO_FRAME: the page */
};

#define SEQ_MAX_CHUNK 64            /* controller.MAX_CHUNK_PAGES */
#define NOT_A_TIME (0.0 / 0.0)

static inline double py_max(double a, double b)
{
    return b > a ? b : a;
}

/* device_parts.c: the policy's per-frame calls on the area holding the frame, the media, the timing model */
struct chm_ft *frame_table(const struct chm_dev *d, uint32_t frame, uint32_t *local);
int64_t area_lookup(const struct chm_dev_area *a, uint64_t page);  /* the page's global frame in an area, or -1 */
void pol_touch(struct seq *q, uint32_t frame);
void pol_pin(struct seq *q, uint32_t frame);
void pol_unpin(struct seq *q, uint32_t frame);
void pol_flushed(struct seq *q, uint32_t frame);
void pol_mark_dirty(struct seq *q, uint32_t frame);
double seq_media_read(struct seq *q, uint64_t page, double now);
double seq_media_write(struct seq *q, uint64_t page, uint64_t pages, double now);
int seq_contiguous(const struct chm_dev *d, uint64_t page, uint64_t next_page);
uint64_t reads_in_flight(const struct chm_dev *d, double now);
double reads_idle_at(const struct chm_dev *d, double now, uint64_t max_in_flight);

/* flusher.c (Flusher) */
void fl_enqueue(struct chm_flusher *fl, uint32_t frame, double now);
void fl_unqueue(struct chm_flusher *fl, uint32_t frame);
int fl_at_flight_limit(const struct chm_flusher *fl);
int fl_next_flush_at(const struct chm_dev *d, const struct chm_flusher *fl, double now, double *at);
double fl_complete_flights(struct seq *q, double now);
int fl_tick(struct seq *q, double now, int force);
int fl_next_event(const struct chm_dev *d, struct chm_flusher *fl, double now, double *due);
double fl_flush(struct seq *q, double now);

/* device_ops.c (the controller's data-off steps) */
const struct chm_dev_area *seq_clean_area(const struct seq *q);
int64_t seq_stage(struct seq *q, uint64_t page, double t);
double seq_read(struct seq *q, uint64_t addr, uint64_t len, double now, int count_command, uint64_t *pages_out);
int seq_write(struct seq *q, uint64_t addr, uint64_t len, double now, int count_command,
              struct chm_write_result *out);
int dev_range_ok(const struct chm_dev *d, uint64_t addr, uint64_t len);
struct seq dev_seq(struct chm_dev *d);

#pragma GCC visibility pop

#endif
