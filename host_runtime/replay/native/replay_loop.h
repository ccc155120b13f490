/* The replay's request loop in C: host_runtime/replay/driver.py's Replay (its ``_request``, ``_stream``,
 * ``_sequential`` and the heap of ``run``) for the variants that read on demand (lru, hymcache-noprefetch) on a
 * device whose data-off operations are native (a built-in frame-table policy: one area), with the runtime's
 * Master as the native table (host_runtime/hymcache/native/mt_*.c).
 *
 * One definition of the decisions: driver.py's Python loop is the specification and
 * tests/host_runtime/test_native_replay.py runs the two side by side on every workload and mode and demands the
 * same report, device state and Master state. The operations are the device's own (emulator/native/: chm_dev_tick,
 * chm_dev_read_hit, chm_dev_read, chm_dev_write, chm_dev_flush, chm_dev_run_until, the calls Controller.read,
 * write, flush and run_until make on a native device) and the Master's (mt_lookup, mt_put_start, mt_put_end,
 * mt_put_revoke), on the structs the Python Controller and NativeMaster own (passed in as pointers): the
 * controller's counters fold into its stats afterwards as after any native call.
 *
 * Requests come in batches (rp_feed: streams of requests of block keys; rp_feed_objects: libCacheSim requests,
 * each its own stream, keys made here), so no Python object exists per request. Per row (a window of virtual
 * time, or a phase) the Bucket's accumulators are kept here, the read latencies as distinct values with counts
 * (the percentiles come out exact), and the keys looked up so far as a hash set: memory grows with the blocks
 * and the rows, not with the requests. Without --sequential, streams wait in a heap by (time, stream number),
 * as driver.run's heap orders them; a batch's streams run up to the last one's start, so a trace in time order
 * holds only its active streams. A stream that starts before an event already run (a trace out of time order)
 * stops the feed with RP_E_UNSORTED: the caller feeds the whole phase before running it.
 *
 * Built by host_runtime/replay/native_build.py (REPLAY_LOOP: cffi API mode, replay_feed.c, replay_loop.c and
 * replay_results.c behind replay_loop_internal.h, with the core's and the Master table's sources); used through
 * host_runtime/replay/native_replay.py.
 */
#ifndef REPLAY_LOOP_H
#define REPLAY_LOOP_H

#include <stdint.h>

/* ---- cdef begin ---- */

/* Status codes */
#define RP_OK 0
#define RP_E_NOMEM 1
#define RP_E_DEVICE 2       /* a device call returned a status (rp_get_error: op, status, addr, detail) */
#define RP_E_MASTER 3       /* a Master call returned -status (rp_get_error: op, status) */
#define RP_E_UNSORTED 4     /* a stream starts before an event already run: feed the whole phase first */
#define RP_E_ARG 5          /* a call out of order (a phase begun before the last one ended) */

/* What failed (rp_error.op) */
#define RP_OP_TICK 1
#define RP_OP_READ 2
#define RP_OP_WRITE 3
#define RP_OP_FLUSH 4
#define RP_OP_RUN_UNTIL 5
#define RP_OP_LOOKUP 6
#define RP_OP_PUT_START 7
#define RP_OP_PUT_END 8
#define RP_OP_PUT_REVOKE 9

/* rp_feed's `final`: more streams of the phase to come (run what cannot change: up to the last stream fed);
 * the phase's last (run it to its end); or hold (run nothing yet: a trace out of time order, fed whole). */
#define RP_FEED_MORE 0
#define RP_FEED_LAST 1
#define RP_FEED_HOLD 2

typedef struct { uint64_t lo, hi; } rp_key;  /* a block key as the Master's 16-byte key (lo: its low 8 bytes) */

struct rp_params {
    uint64_t block_bytes;           /* every read and write */
    uint64_t slot_bytes;            /* a block's extent on the device (put_start's size) */
    double refusal_ns;              /* what a refused write costs the host */
    double bucket_ns;               /* by_time: a row's width of virtual time */
    int32_t by_time;                /* rows by time window (else one per phase) */
    int32_t sequential;
    uint32_t max_batch;             /* keys per Master call (MAX_BATCH) */
    uint32_t object_block_bits;     /* rp_feed_objects: block j of object o is key o << bits | j */
    double prefill_block_flops;     /* PrefillModel.flops(b, s) = b * prefill_block_flops + prefill_position_flops * s */
    uint64_t prefill_position_flops;
};

struct rp_bucket {                  /* driver.Bucket's accumulators */
    int64_t key;                    /* window index (by_time) or phase number */
    double start_ns;
    uint64_t reads, writes, read_bytes, write_bytes, refused_writes, hit_pages, miss_pages, write_hit_pages,
        write_miss_pages, prefetch_busy, recomputed_blocks;
    double recompute_flops, first_read, last_read, first_write, last_write;
    uint64_t latencies;             /* distinct read latencies (rp_latencies) */
};

struct rp_counts {
    uint64_t revoked;               /* refused writes given back (put_revoke's count) */
    uint64_t no_space_puts;         /* put_starts refused whole (ENOSPC) */
    uint64_t streams, requests, block_refs;  /* run so far */
    uint64_t known_keys;            /* distinct keys looked up (or added) */
    uint64_t objects;               /* rp_feed_objects: distinct objects (keys of block 0) */
    uint64_t events_run;            /* the device's background events run (run_until) */
    double background_ns;           /* the device's background clock (Flusher.background_ns) */
    double now;                     /* sequential: where the phase stands; vt: the phase's end so far */
    uint64_t heap;                  /* streams waiting (vt) */
};

struct rp_error {
    int32_t op;                     /* RP_OP_* */
    int64_t status;
    uint64_t addr;
    double detail;                  /* read: the page that found no frame; write: chm_write_result's page;
                                     * run_until: when the flush rule said a flush was due */
    uint64_t new_pages;             /* write: chm_write_result's new_pages */
};

struct rp_engine;

/* An engine on a device (struct chm_dev *, with its native flusher) and a Master table (mt_table *, its one
 * device registered), the device's background clock at background_ns. RP_OK, RP_E_NOMEM, RP_E_ARG. */
int rp_new(void *dev, void *master, const struct rp_params *params, double background_ns, struct rp_engine **out);
void rp_free(struct rp_engine *e);
/* Keys already on the device (a populate): looked up, as far as reuse counts. */
int rp_known_add(struct rp_engine *e, const rp_key *keys, uint64_t n);
/* A phase starts at `now` (phase rows: a row of its own, key phase_key). */
int rp_phase_begin(struct rp_engine *e, double now, int64_t phase_key);
/* The phase's next n streams, in order: stream s starts start_ns[s] after the phase's start and has
 * stream_requests[s] requests (NULL: one each); request r waits think_ns[r] (NULL: none) after the stream's
 * previous one and names request_keys[r] keys, the next ones of `keys`. final: RP_FEED_*. Sequential: each stream
 * runs at once. */
int rp_feed(struct rp_engine *e, uint64_t n, const double *start_ns, const uint32_t *stream_requests,
            const double *think_ns, const uint64_t *request_keys, const rp_key *keys, int final);
/* libCacheSim requests, each its own stream of one request: starts (times[i] - first_time) * ns_per_unit after
 * the phase's start; its object's blocks max(1, ceil(sizes[i] / block_bytes)) (ignore_size: 1), block j of
 * object o the key o << object_block_bits | j. */
int rp_feed_objects(struct rp_engine *e, uint64_t n, const int64_t *times, const uint64_t *obj_ids,
                    const int64_t *sizes, int64_t first_time, double ns_per_unit, int ignore_size, int final);
/* The phase's end (sequential: its last request's finish; vt: its last stream's), after the device's background
 * work up to it (Controller.run_until). */
int rp_phase_end(struct rp_engine *e, double *now);

uint64_t rp_buckets(const struct rp_engine *e);                          /* rows, in the order made */
void rp_get_bucket(const struct rp_engine *e, uint64_t i, struct rp_bucket *out);
/* Row i's distinct read latencies (ns) and how often each came, in no order (out: rp_bucket.latencies each). */
void rp_get_latencies(const struct rp_engine *e, uint64_t i, double *values, uint64_t *counts);
void rp_get_counts(const struct rp_engine *e, struct rp_counts *out);
void rp_get_error(const struct rp_engine *e, struct rp_error *out);

/* ---- cdef end ---- */

#endif
