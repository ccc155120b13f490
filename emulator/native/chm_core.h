/* The device model's native core: the DRAM frame table with the built-in
 * eviction structures, the prefetch engine's window and handle accounting,
 * write admission, the timing model's pipes, SSD models and latency
 * histogram, the DRAM-hit read (chm serve's native hit path), the flusher
 * and the controller's operations with data emulation off (the replay's
 * path: Controller.write, read, prefetch, release, tick, run_until, flush)
 * and the sequential path (Controller.run_sequential), which share them.
 *
 * One implementation: the emulator (live serving, replay) and the RTL
 * lockstep benches reach it through cffi (emulator/native_build.py cuts the
 * text between the cdef markers out of this header, so every constant and
 * struct below is defined once, here). The decisions are specified in
 * emulator/frame_table.py, emulator/prefetch.py, emulator/write_buffer.py,
 * emulator/timing.py, emulator/controller.py (Controller.read, write,
 * prefetch, release), emulator/flusher.py (Flusher) and the policies' flush
 * rules and write paths (emulator/policies/base.py, hymcache.py).
 */
#ifndef CHM_CORE_H
#define CHM_CORE_H

#include <stdint.h>

/* ---- cdef begin ---- */

/* Status codes. >= 0: a decision; < 0: a call that breaks the contract (nothing changed). */
#define CHM_OK 0
#define CHM_ALL_PINNED 1        /* every way of the page's set is pinned: no frame for it */
#define CHM_NEEDS_VICTIM 2      /* CHM_POLICY_EXTERNAL and the set is full: the caller names the victim */
#define CHM_E_FRAME -1          /* frame (or set) out of range */
#define CHM_E_EMPTY -2          /* the frame holds no page */
#define CHM_E_PINNED -3         /* the frame is pinned */
#define CHM_E_NOT_PINNED -4     /* unpin of a frame that is not pinned */
#define CHM_E_RESIDENT -5       /* insert of a page that is already resident */
#define CHM_E_OTHER_SET -6      /* the named victim is not in the incoming page's set */
#define CHM_E_NOMEM -7
#define CHM_E_ARG -8            /* a bad size or parameter */
#define CHM_E_INTERNAL -9       /* an invariant broke (a bug here): see chm_ft_check */
#define CHM_E_PIN_LIMIT -10     /* the frame's pin counter is full */

#define CHM_NO_PAGE 0xffffffffffffffff  /* "no page": an empty frame, no victim */

/* Eviction policies (emulator/policies/<name>.py documents each one's decisions): a kind is
 * chm_policy_kind(name) (each emulator/native/policy_*.c registers its own); the built-ins' numbers are
 * these too, for C callers. */
#define CHM_POLICY_EXTERNAL 0   /* a Python plug-in chooses the victims; the table keeps the rest */
#define CHM_POLICY_LRU 1
#define CHM_POLICY_FIFO 2
#define CHM_POLICY_CLOCK 3
#define CHM_POLICY_SIEVE 4
#define CHM_POLICY_S3FIFO 5

/* Queues of a set, for chm_ft_queue: every policy keeps its pages in CHM_QUEUE_MAIN; S3-FIFO also
 * in CHM_QUEUE_SMALL. */
#define CHM_QUEUE_MAIN 0
#define CHM_QUEUE_SMALL 1

/* Test-only builds (tests/rtl_model/test_native_mutations.py): -DCHM_MUTATION=<one of these> plants
 * one wrong decision, which the RTL lockstep benches must catch. */
#define CHM_MUTATION_NONE 0
#define CHM_MUTATION_LRU_RANK 1         /* LRU's victim is the most recently used unpinned way */
#define CHM_MUTATION_PREFETCH_WINDOW 2  /* an object that fills the prefetch window exactly is refused */
#define CHM_MUTATION_EXACT_FIT 3        /* a write that fits the write buffer exactly is refused */

struct chm_policy_params {
    uint32_t kind;                  /* CHM_POLICY_* */
    uint32_t n_bit_counter;         /* clock: bits of each page's reference counter (1..8) */
    double small_size_ratio;        /* s3fifo: share of the ways in the small queue */
    double ghost_size_ratio;        /* s3fifo: ghost length as a share of the ways */
    uint32_t move_to_main_threshold;/* s3fifo: hits in the small queue that move a page to the main queue */
};

/* The sizes a set's policy derived from its parameters (libCacheSim's integer parts). */
struct chm_policy_info {
    uint32_t max_freq;              /* clock: 2**n_bit_counter - 1 */
    uint32_t small_capacity;        /* s3fifo */
    uint32_t main_capacity;
    uint32_t ghost_capacity;
    uint32_t threshold;
};

/* What one access or insert did. */
struct chm_access {
    uint64_t victim_page;           /* the page evicted to make room, or CHM_NO_PAGE */
    uint32_t frame;                 /* the page's frame */
    uint8_t hit;                    /* the page was resident (lookup_or_insert, access_many) */
    uint8_t victim_dirty;
};

/* What chm_ft_access_many did, over the accesses it made. */
struct chm_access_counts {
    uint64_t accesses;              /* made; fewer than asked when it stopped on a status */
    uint64_t hits;
    uint64_t misses;
    uint64_t evictions;
    uint64_t dirty_evictions;
};

struct chm_ft;                      /* a frame table: sets of ways, page index, pins, dirty bits, eviction state */

int chm_core_mutation(void);        /* the CHM_MUTATION_* this build plants (CHM_MUTATION_NONE) */
/* The sizes a policy derives for a set of `ways` ways; CHM_E_ARG for parameters it cannot work with. */
int chm_policy_info(uint32_t ways, const struct chm_policy_params *policy, struct chm_policy_info *out);
/* The kind (chm_policy_params.kind) of the policy registered as `name` ("lru"); -1: none is. */
int64_t chm_policy_kind(const char *name);

int  chm_ft_new(uint32_t frames, uint32_t ways, const struct chm_policy_params *policy, struct chm_ft **out);
void chm_ft_free(struct chm_ft *ft);
/* Per-frame state, frames long, owned by the table (read it; change it through the calls below). */
uint64_t *chm_ft_page_of(struct chm_ft *ft);   /* its page, or CHM_NO_PAGE */
uint8_t  *chm_ft_dirty(struct chm_ft *ft);
uint32_t *chm_ft_pins(struct chm_ft *ft);
uint32_t chm_ft_resident(const struct chm_ft *ft);
/* chm_mmap's tracking (chm_core_internal.h, struct chm_ft): mapped[] by frame, set by the server at a lease;
 * a page leaving a mapped frame clears it and appends the frame to dropped[] (chm_ft_dropped: the frames and
 * *n their count; chm_ft_clear_dropped empties it). 0, or CHM_E_NOMEM. */
int chm_ft_track_mapped(struct chm_ft *ft);
uint8_t *chm_ft_mapped(struct chm_ft *ft);
uint32_t *chm_ft_dropped(struct chm_ft *ft, uint32_t *n);
void chm_ft_clear_dropped(struct chm_ft *ft);
void chm_ft_clear_mapped(struct chm_ft *ft);   /* no frame is mapped any more (and none awaits a punch) */
int64_t  chm_ft_free_ways(const struct chm_ft *ft, uint32_t set);
int64_t  chm_ft_pinned_ways(const struct chm_ft *ft, uint32_t set);  /* frames with a pin count */

int64_t chm_ft_lookup(const struct chm_ft *ft, uint64_t page);  /* its frame, or -1; changes nothing */
int chm_ft_touch(struct chm_ft *ft, uint32_t frame);            /* a hit on the frame's page */
int chm_ft_insert(struct chm_ft *ft, uint64_t page, struct chm_access *out);
int chm_ft_insert_replacing(struct chm_ft *ft, uint64_t page, uint32_t victim_frame, struct chm_access *out);
int chm_ft_lookup_or_insert(struct chm_ft *ft, uint64_t page, struct chm_access *out);
/* Each page in turn: lookup_or_insert, then mark the frame dirty where writes[i] (writes may be NULL);
 * hit_out[i] (may be NULL) gets 1 for a hit. Stops at the first status other than CHM_OK. */
int chm_ft_access_many(struct chm_ft *ft, const uint64_t *pages, const uint8_t *writes, uint64_t n,
                       uint8_t *hit_out, struct chm_access_counts *counts);
int64_t chm_ft_victim(struct chm_ft *ft, uint64_t page);        /* the frame insert(page) would evict, or -1 */
int64_t chm_ft_to_evict(struct chm_ft *ft, uint32_t set);       /* the set's next victim (changes nothing), or -1 */
/* The op table's evict on its own: the set's victim leaves (its frame free), to make room for `incoming`
 * (a page of the set, not resident; CHM_NO_PAGE: none). CHM_ALL_PINNED: no unpinned page to take. */
int chm_ft_evict(struct chm_ft *ft, uint32_t set, uint64_t incoming, struct chm_access *out);
int chm_ft_invalidate(struct chm_ft *ft, uint32_t frame);
int chm_ft_mark_dirty(struct chm_ft *ft, uint32_t frame);
int chm_ft_clear_dirty(struct chm_ft *ft, uint32_t frame);
int chm_ft_pin(struct chm_ft *ft, uint32_t frame);
int chm_ft_unpin(struct chm_ft *ft, uint32_t frame);
int chm_ft_page_pinned(const struct chm_ft *ft, uint64_t page); /* 1: resident and pinned */
/* The pages of one queue of a set, oldest (next under the hand) first; returns how many there are. */
uint32_t chm_ft_queue(const struct chm_ft *ft, uint32_t set, uint32_t queue, uint64_t *out, uint32_t max);
int chm_ft_check(const struct chm_ft *ft);                      /* 0, or the line of the first broken invariant */

/* The prefetch engine: a window of staging pages and a number of handles. */
#define CHM_PF_HANDLE_IN_USE 1      /* EINVAL */
#define CHM_PF_NEVER_FITS 2         /* EINVAL: more pages than the whole window */
#define CHM_PF_NO_HANDLE 3          /* EBUSY: every handle is held */
#define CHM_PF_WINDOW_FULL 4        /* EBUSY */
#define CHM_PF_UNKNOWN_HANDLE 5     /* EINVAL: never issued, or released */
#define CHM_PF_TOO_MANY_ARRIVALS 6  /* more arrivals than pages */

struct chm_pf_object {
    int64_t handle;
    uint64_t first_page;
    uint64_t pages;
    uint64_t arrived;
};

struct chm_pf;

int  chm_pf_new(uint64_t window_pages, uint32_t max_handles, struct chm_pf **out);
void chm_pf_free(struct chm_pf *pf);
int  chm_pf_issue(struct chm_pf *pf, int64_t handle, uint64_t first_page, uint64_t pages);
int  chm_pf_next_fetch(struct chm_pf *pf, int64_t *handle, uint64_t *page);  /* 1: a fetch; 0: none queued */
int  chm_pf_arrived(struct chm_pf *pf, int64_t handle, uint64_t *arrived);   /* 1: now ready, 0: not yet */
int  chm_pf_get(const struct chm_pf *pf, int64_t handle, struct chm_pf_object *out);
int  chm_pf_release(struct chm_pf *pf, int64_t handle, struct chm_pf_object *out);
uint64_t chm_pf_pages_held(const struct chm_pf *pf);
uint32_t chm_pf_objects(const struct chm_pf *pf);
uint32_t chm_pf_handles(const struct chm_pf *pf, int64_t *out, uint32_t max);  /* held handles, issue order */

/* Write admission: all-or-nothing check-and-reserve of write-buffer pages. */
struct chm_admission {
    uint64_t capacity_pages;
    uint64_t used_pages;
};

int chm_admission_admit(struct chm_admission *a, uint64_t pages);    /* 1: reserved; 0: refused */
int chm_admission_release(struct chm_admission *a, uint64_t pages);  /* CHM_OK, or CHM_E_ARG: more than reserved */

/* ---- The timing model's resources (specified by emulator/timing.py, which wraps these structs) ----
 * Each computes with the same double operations, in the same order, as its specification: replays stay
 * bit-identical whichever side runs a step. */

/* A serial server with a pipelined per-request latency and a bandwidth (timing.Pipe). */
struct chm_pipe {
    double latency_ns;              /* pipelined: it does not occupy the pipe */
    double bandwidth_gbps;          /* bytes per ns */
    double free_at;                 /* virtual time the last reservation ends */
    double busy_ns;
    uint64_t bytes;
};

/* The controller pipeline, counted in cycles of its clock (timing.Clocked). */
struct chm_clocked {
    double clock_mhz;
    double free_at;
    double busy_ns;
};

/* Reserve the pipe for nbytes no earlier than ready; the arrival time. */
double chm_pipe_transfer(struct chm_pipe *p, double ready, uint64_t nbytes, double slowdown);
/* Run `cycles` cycles no earlier than ready; when they end. */
double chm_clocked_run(struct chm_clocked *c, double ready, uint64_t cycles);

/* One SSD (timing.SsdModel): up to `parallelism` commands in service (a min-heap of when each command slot
 * frees), a media pipe per direction, reads slowed by `slowdown` while a write is in flight, and the
 * finishes of the reads reserved (a min-heap that reads_in_flight pops up to its `now`). Both heaps are
 * laid out as Python's heapq lays out a list under the same calls (the wrapper shows them as lists). */
struct chm_ssd {
    double read_latency_ns;
    double write_latency_ns;
    double slowdown;                /* read_slowdown_under_writes */
    double writes_until;            /* virtual time the last reserved write finishes */
    double reads_until;             /* virtual time the last reserved read finishes */
    uint64_t slowed_reads;
    struct chm_pipe read_media;
    struct chm_pipe write_media;
    uint32_t parallelism;
    double *slots;                  /* parallelism entries */
    double *read_finishes;          /* n_read_finishes entries of read_finishes_cap */
    uint64_t n_read_finishes;
    uint64_t read_finishes_cap;
};

int  chm_ssd_new(uint32_t parallelism, double read_latency_ns, double write_latency_ns, double slowdown,
                 double read_bandwidth_gbps, double write_bandwidth_gbps, struct chm_ssd **out);
void chm_ssd_free(struct chm_ssd *s);
/* Room for `reads` more reads without an allocation: CHM_OK or CHM_E_NOMEM (nothing changed). */
int chm_ssd_reserve(struct chm_ssd *s, uint64_t reads);
/* Reserve a read (write) of nbytes no earlier than ready; when it finishes. A read that finds no memory
 * for its finish returns NaN and changes nothing. */
double chm_ssd_read(struct chm_ssd *s, double ready, uint64_t nbytes);
double chm_ssd_write(struct chm_ssd *s, double ready, uint64_t nbytes);
/* The reads reserved that finish after `now` (those finished by then leave the heap). */
uint64_t chm_ssd_reads_in_flight(struct chm_ssd *s, double now);

/* Latencies of one operation kind in log-linear buckets (timing.LatencyHistogram): below
 * CHM_HIST_SUB_BUCKETS ns one bucket per ns, above it CHM_HIST_SUB_BUCKETS buckets per power of two. */
#define CHM_HIST_SUB_BITS 5
#define CHM_HIST_SUB_BUCKETS 32         /* 1 << CHM_HIST_SUB_BITS */
#define CHM_HIST_BUCKETS 1920           /* (64 - CHM_HIST_SUB_BITS + 1) * CHM_HIST_SUB_BUCKETS: every uint64 */

struct chm_histogram {
    uint64_t count;
    double total_ns;
    double min_ns;                  /* +inf while empty */
    double max_ns;                  /* -inf while empty */
    uint64_t counts[CHM_HIST_BUCKETS];
};

void chm_histogram_init(struct chm_histogram *h);
uint32_t chm_histogram_bucket(uint64_t ns);     /* the bucket of a latency truncated to whole ns */
void chm_histogram_add(struct chm_histogram *h, double latency_ns);

/* ---- The DRAM-hit read (emulator/controller.py, Controller.read, when every page is a hit) ----
 * The state it needs is the controller's own (per-frame arrays, pipes, histogram), shared, not copied:
 * the controller's Python paths and this one see one truth. */
#define CHM_NO_TOKEN 0                  /* io_token of a frame whose staging read has settled */
#define CHM_DEV_MAX_AREAS 2

/* A frame table a read looks pages up in, and where its frames start among the device's. */
struct chm_dev_area {
    struct chm_ft *table;
    uint32_t base;
};

/* What hit reads served here counted (the controller adds them to its stats and zeroes them). */
struct chm_read_counts {
    uint64_t reads;
    uint64_t read_bytes;
    uint64_t page_hits;
    uint64_t hit_bytes;
};

/* The stats the data-off operations and the sequential path count besides chm_dev's `counts` (the names are
 * the stats' own). */
struct chm_seq_counts {
    uint64_t writes;
    uint64_t write_bytes;
    uint64_t flush_calls;
    uint64_t flush_batches;
    uint64_t flushed_pages;
    uint64_t page_misses;
    uint64_t merged_misses;
    uint64_t evictions;
    uint64_t dirty_evictions;
    uint64_t rmw_reads;
    uint64_t ssd_read_bytes;
    uint64_t ssd_write_bytes;
    uint64_t refused_writes;
    uint64_t refused_write_bytes;
};

/* ---- The flusher with data emulation off (emulator/flusher.py's Flusher, whose state it then holds) ----
 * The dirty queue (frames and write times, oldest first, a ring), the flush writes in flight (a min-heap by
 * (finish, issue order), each a run of frames with the write_seq each had), and the policy's flush rule and
 * write path (emulator/policies/base.py CachePolicy, emulator/policies/hymcache.py HymCachePolicy). With data
 * off no media error can happen: no backoff, no held pages, no requeue. */
#define CHM_FLUSH_AFTER_DELAY 0     /* CachePolicy: a page is flushed lru_writeback_delay_ns after its write */
#define CHM_FLUSH_ARBITER 1         /* hymcache: FlushArbiter's batches while reads are idle */

struct chm_flight {
    double finish;
    uint64_t order;                 /* Flusher._flight_order at its issue */
    uint32_t frame;                 /* its first frame; the run is frames [frame, frame + pages) */
    uint32_t pages;
    int64_t *seqs;                  /* each frame's write_seq at issue */
    double *since;                  /* each frame's write time */
};

struct chm_flusher {
    /* the policy's flush rule */
    uint32_t rule;                  /* CHM_FLUSH_* */
    double writeback_delay_ns;      /* CHM_FLUSH_AFTER_DELAY */
    uint64_t batch_pages;           /* CHM_FLUSH_ARBITER */
    uint64_t max_reads_in_flight;
    double max_delay_ns;
    int64_t pages_in_flight_limit;  /* Policy.flush_pages_in_flight; -1: none */
    /* the policy's write path: write_lookup and allocate_write in write_area, read_copy in copy_area
     * (table NULL: none), admit_writes by `admission` (NULL: every write), and hymcache's frames to free
     * once unpinned (NULL: a policy that frees no frame when flushed) */
    struct chm_dev_area write_area;
    uint32_t write_area_frames;
    struct chm_dev_area copy_area;
    struct chm_admission *admission;
    uint8_t *free_when_unpinned;    /* by device frame */
    uint64_t write_buffer_frames;   /* Config.write_buffer_frames */
    uint32_t drops_staged_on_release;  /* Policy.drops_staged_on_release: a released staged page leaves */
    /* the state */
    uint8_t *queued;                /* Flusher.queued, by device frame (the Python bytearray) */
    uint32_t frames;                /* device frames: the dirty ring's capacity */
    uint32_t *dirty_frame;          /* the dirty queue, a ring from dirty_head */
    double *dirty_since;
    uint64_t dirty_head;
    uint64_t n_dirty;
    struct chm_flight *flights;     /* a min-heap by (finish, order) */
    uint64_t n_flights;
    uint64_t flights_cap;
    uint64_t flight_order;          /* Flusher._flight_order */
    uint64_t flushing_pages;        /* Flusher._flushing_pages */
    uint64_t room_order, room_pages;/* _flight_room_at's cache key and value */
    double room_at;
    int32_t room_valid;
    int32_t owns_queued;
    void *scratch;                  /* start_flush's sort, frames long */
    void *landed;                   /* complete_flights' landed flights */
    uint64_t landed_cap;
};

int  chm_flusher_new(uint32_t frames, uint8_t *queued, struct chm_flusher **out);
void chm_flusher_free(struct chm_flusher *fl);
/* The dirty queue's i-th entry (oldest first). */
void chm_flusher_dirty_at(const struct chm_flusher *fl, uint64_t i, uint32_t *frame, double *since);

/* The flush rules, one definition for the native flusher and the Python policies (policies/base.py
 * CachePolicy, write_buffer.py FlushArbiter). chm_delay_due_at: the first time t (a float) with
 * oldest_written_ns <= t - delay_ns (lru's write-back delay). chm_arbiter_grant: how many dirty pages the
 * arbiter flushes now (force: drain a batch regardless of reads; else only while reads_in_flight <=
 * max_reads_in_flight, once a batch is full or the oldest page is max_delay_ns old). chm_arbiter_ready_at:
 * when it would grant, reads aside: batch_full_ns (the batch's last page's write) if the batch is full, else
 * the first t with t - oldest_written_ns >= max_delay_ns. */
double   chm_delay_due_at(double oldest_written_ns, double delay_ns);
uint64_t chm_arbiter_grant(uint64_t batch_pages, uint64_t max_reads_in_flight, double max_delay_ns,
                           uint64_t dirty_pages, uint64_t reads_in_flight, double oldest_age_ns, int force);
double   chm_arbiter_ready_at(uint64_t batch_pages, double max_delay_ns, uint64_t dirty_pages,
                              double oldest_written_ns, double batch_full_ns);

struct chm_dev {
    uint64_t page_size;
    uint64_t capacity;
    uint64_t cycles_per_command;
    uint64_t cycles_per_lookup;
    uint32_t n_areas;               /* 0: the policy looks pages up in Python; no read is served here */
    struct chm_dev_area areas[CHM_DEV_MAX_AREAS];  /* a page's frame is its first area's that holds it */
    double *ready_at;               /* per frame: when its data is in DRAM */
    const int64_t *io_token;        /* per frame: the media read filling it, or CHM_NO_TOKEN */
    const uint8_t *dram;            /* the DRAM region; NULL: data emulation is off */
    struct chm_clocked *controller;
    struct chm_pipe *dram_pipe;
    struct chm_pipe *link_to_host;
    struct chm_histogram *read_latency;
    struct chm_read_counts counts;
    /* what chm_dev_run_sequential needs besides */
    uint64_t cycles_per_admission;
    uint64_t stripe_bytes;          /* ssd.stripe_bytes: the address space is striped over the SSDs */
    uint32_t n_ssds;
    uint32_t chunk_pages;           /* Controller.chunk_pages: the most pages a read pins at once */
    struct chm_ssd **ssds;
    struct chm_pipe *link_to_device;
    struct chm_histogram *write_latency;
    int64_t *write_seq;             /* per frame: bumped by every write (dram.Frames.write_seq) */
    /* what the data-off operations (chm_dev_write, chm_dev_read, chm_dev_tick, ...) need besides */
    struct chm_flusher *flusher;    /* NULL: the flusher is Python's (chm_dev_run_sequential makes its own) */
    struct chm_seq_counts *ops;     /* what they count (folded into stats by the controller, then zeroed) */
    uint64_t cycles_per_prefetch_page;
};

/* Serve a read of [addr, addr + len) at virtual time `now` if every page is resident, ready by the time
 * its lookups end, and settled, exactly as Controller.read does after its tick: count it, touch the
 * pages, run the controller, the DRAM and the link, copy the bytes into `out` (when the DRAM region is
 * there). count_command: also count the command (reads, read latency), as Controller.count_command.
 * Returns the pages read, with *finish the time the last byte reaches the host; 0 when a page is not a
 * hit, the range is not one the device holds or no area is native: then nothing changed. */
/* chm_mmap's DRAM-hit fault (chm serve's C loop): if the page at addr (page-aligned) is resident in the one
 * area and ready, the read of that page a chm_read makes (counted, no copy), the frame pinned and marked mapped
 * (chm_ft_track_mapped); its device frame, or -1 (nothing done: the server's Python path serves it). */
int64_t chm_dev_map_hit(struct chm_dev *d, uint64_t addr, double now, double *finish);
/* The pin of a lease's frame released (its ack; the frame in any area): 0, or a CHM_E_* code. */
int chm_dev_map_unpin(struct chm_dev *d, uint32_t frame);
int64_t chm_dev_read_hit(struct chm_dev *d, uint64_t addr, uint64_t len, double now, uint8_t *out,
                         int count_command, double *finish);

/* ---- Sequential operations (Controller.run_sequential), data emulation off ----
 * Each operation runs as Controller.read / Controller.write followed by Controller.flush do, one after the
 * other, each starting when the one before finished: a read of [addr, addr + len) at `now` (now = its
 * finish), or a write of it (no bytes) at `now`, then a flush at the write's finish (now = the flush's
 * finish). The caller guarantees, at the call: one area (a fully associative table of a built-in policy,
 * no write buffer), no page dirty, no flush in flight, no frame pinned, no staging read failed, no media
 * error, no prefetch handle held; each operation then leaves the same again. */
#define CHM_SEQ_READ 0
#define CHM_SEQ_WRITE 1

struct chm_seq_result {
    uint64_t done;                  /* operations run (all, unless a status stopped it before one) */
    double now;                     /* the finish of the last one run (the start if none) */
    uint64_t write_misses;          /* pages the writes found no frame for (WriteOutcome.new_pages, summed) */
    uint64_t flush_writes;          /* media writes the flushes issued (Flusher._flight_order advances by these) */
    struct chm_seq_counts counts;
};

/* CHM_OK: all n run. Else it stopped before operation out->done, with everything before it done and
 * counted: CHM_E_ARG, that operation is not one the device takes (a kind not CHM_SEQ_*, a range outside
 * the device; Controller.read/write say why); CHM_E_NOMEM; CHM_E_INTERNAL, a frame could not be had
 * (cannot happen under the guarantees above). A device it cannot run on (not one area): CHM_E_ARG with
 * out->done 0. */
int chm_dev_run_sequential(struct chm_dev *d, const uint8_t *kinds, const uint64_t *addrs, const uint64_t *lengths,
                           uint64_t n, double now, struct chm_seq_result *out);

/* ---- Single operations with data emulation off (Controller's, through d->flusher) ----
 * Each is its Python counterpart from its tick on (the caller has checked the range: CHM_E_ARG if not). */
#define CHM_WRITE_TOO_BIG 1         /* more new pages than the whole write buffer (EINVAL) */
#define CHM_WRITE_REFUSED 2         /* the policy refuses it now (WriteBufferFull) */
#define CHM_NO_FRAME 3              /* every frame pinned, even after the flushes in flight landed (EBUSY) */

struct chm_write_result {
    double finish;
    uint64_t new_pages;
    uint64_t pages;
    uint64_t page;                  /* CHM_NO_FRAME: the page that found none */
};

/* What chm_dev_prefetch_fetch did. */
struct chm_prefetch_result {
    double t;                       /* when the last fetch was issued */
    double ready_at;                /* when every page staged is in DRAM (Staged.ready_at) */
    uint64_t staged;                /* prefetch_staged_pages */
    uint64_t resident;              /* prefetch_resident_pages */
    uint64_t frames;                /* frames pinned, in frames[] */
    uint64_t page;                  /* CHM_NO_FRAME: the page that found none */
};

/* Controller.prefetch's fetch loop, after the engine took the object (engine.issue) and the command's cycles
 * ended at t: each fetch the engine hands out, its page staged (or found), pinned and put in frames[] (room
 * for the object's pages). CHM_OK, or CHM_NO_FRAME / CHM_E_NOMEM with what it did before counted in out. */
int chm_dev_prefetch_fetch(struct chm_dev *d, struct chm_pf *pf, double t, uint32_t *frames,
                           struct chm_prefetch_result *out);
/* Controller.release's frames: each unpinned, then Policy.released. */
void chm_dev_release_frames(struct chm_dev *d, const uint32_t *frames, uint64_t n);

/* Flusher.tick(now, force): 1 if it started a flush (and counted it), else 0; CHM_E_NOMEM. */
int chm_dev_tick(struct chm_dev *d, double now, int force);
/* Flusher.complete_flights(now): the latest finish retired (0.0: none). */
double chm_dev_complete_flights(struct chm_dev *d, double now);
/* Flusher.next_event_ns(now): 1 and *due, or 0: nothing pending. */
int chm_dev_next_event(struct chm_dev *d, double now, double *due);
/* Flusher.run_until's events from background time `from` up to `until`: *ran of them, *t the last one's time
 * (`from` if none). CHM_OK; CHM_E_INTERNAL: the rule said a flush is due at *t but granted none; CHM_E_NOMEM. */
int chm_dev_run_until(struct chm_dev *d, double from, double until, uint64_t *ran, double *t);
/* Flusher.quiet_until(now) (data off: no staging-read error, no media error). */
double chm_dev_quiet_until(struct chm_dev *d, double now);
/* Flusher.flush(now): when everything written is on the media; NaN: no memory. */
double chm_dev_flush(struct chm_dev *d, double now);
/* Flusher.write_back of `frame`'s dirty victim page at now: when it is written. */
double chm_dev_write_back(struct chm_dev *d, uint32_t frame, uint64_t victim_page, double now);
/* Controller.write(addr, None, len, now, whole=count_command) from its tick on. */
int chm_dev_write(struct chm_dev *d, uint64_t addr, uint64_t len, double now, int count_command,
                  struct chm_write_result *out);
/* Controller.read(addr, len, now, None, whole=count_command) after its tick, for a device of one area.
 * Returns the pages read, with out[0] its finish, hit, missed and merged pages in out[1..3]; < 0: a status
 * (CHM_NO_FRAME: out[1] the page that found no frame; CHM_E_ARG: not a device of one area). */
int64_t chm_dev_read(struct chm_dev *d, uint64_t addr, uint64_t len, double now, int count_command, double *out);

/* ---- cdef end ---- */

#endif
