/* The replay's host-side index in C: the HyMCache Master's decisions for one
 * node of one device, for the calls replay makes (host_runtime/replay/driver.py:
 * lookup, put_start, put_end, put_revoke, and expiry on a virtual clock), plus
 * remove.
 *
 * The specification is host_runtime/hymcache/master.py's class Master (its rows:
 * master_table.py; its _Device and eviction: allocator.py); the C is mt_*.c behind
 * mt_internal.h; tests/host_runtime/hymcache/test_native_master.py runs
 * both side by side on the same calls and demands the same answers, the same
 * rows (row numbers included) and the same allocator state. What is matched:
 *
 *   time       ms since a base (the clock at mt_new), truncated, >= 0; at 2^31 ms the
 *              base moves and the u4 deadlines shift (Master._now_ms, _rebase)
 *   rows       a row per PENDING, COMPLETE or DRAINING block; freed rows reused last
 *              freed first, else the next new row (Master._new_row, _release_row)
 *   allocator  write head, then the first freed extent large enough in the order
 *              freed, from its end; a freed extent merges with free neighbours and
 *              counts as freed now (_Device.allocate, free)
 *   lookup     the longest prefix of COMPLETE keys; each gets a read lease (renewed
 *              up to lease_max from its first grant) and is touched in prefix order
 *   put_start  keys not stored, not in flight and not repeated; all or nothing; to
 *              make room, least recently used COMPLETE unleased blocks are evicted
 *              one at a time, in the order they had when the first one was needed;
 *              then the high-to-low watermark round
 *   expiry     puts past their deadline revoked (their extent held one put timeout
 *              more), drained extents freed in (lease end, row) order, the watermark
 *              round unless nothing was evictable until evict_retry (Master._expire)
 *
 * Keys are the Master's 16-byte keys (keys.py; replay's master_key is the int key
 * little-endian), held as two uint64 halves: byte 0..7 little-endian is lo, 8..15
 * hi, so on a little-endian host an array of mt_key is a buffer of 16-byte keys.
 * A replay key k (Mooncake: < 2^64; libCacheSim: obj_id << 24 | block, up to
 * 2^88) is {k mod 2^64, k >> 64}.
 *
 * Memory: a row (80 bytes) per block, an index slot (4 bytes, load <= 1/2) per
 * block, an extent (24 bytes) and two map slots (16 bytes each, load <= 1/2) per
 * freed extent, a heap entry (8 bytes) per draining block; nothing grows with the
 * calls. Time per key O(1) (hash index, intrusive lists), but where the Master's
 * rule itself is a search: the first freed extent large enough (the first one
 * when all blocks are one size, as in replay), and the LRU walk for unleased
 * blocks, which starts after the leased prefix (the blocks at the LRU head known
 * to be leased still), so blocks that stay leased there are passed once, not by
 * every walk (mt_space.leased_passed counts what the walks pass).
 *
 * Not thread-safe: one caller at a time (replay is one thread).
 */
#ifndef MT_MASTER_TABLE_H
#define MT_MASTER_TABLE_H

#include <stdint.h>

/* ---- cdef begin ---- */

/* Errors (returned negated by the calls that return a count): nothing changed but what the text says. */
#define MT_E_CLOCK 1        /* the clock minus the time base is not a finite number (nothing changed) */
#define MT_E_OVERFLOW 2     /* ... it is, but in ms it is not (Python: OverflowError; nothing changed) */
#define MT_E_NODEV 3        /* put_start with no device registered (after expiry and the put count) */
#define MT_E_TOO_BIG 4      /* put_start: the request's new blocks exceed the device (*detail: their bytes) */
#define MT_E_NO_ROOM 5      /* put_start: no room even after evicting all it may (*detail: the block's size) */
#define MT_E_NOMEM 6        /* out of memory (state may be partly changed: drop the table) */
#define MT_E_ARG 7          /* a bad argument (a second mt_register, a capacity < 1) */

/* Row states (Master's FREE, PENDING, COMPLETE, DRAINING). */
#define MT_FREE 0
#define MT_PENDING 1
#define MT_COMPLETE 2
#define MT_DRAINING 3

/* Test-only builds: -DMT_MUTATION=<one of these> plants one wrong decision, which the side-by-side tests
 * must catch. */
#define MT_MUTATION_NONE 0
#define MT_MUTATION_EVICT_MRU 1        /* eviction takes the most recently used block first */
#define MT_MUTATION_LEASE_NO_CAP 2     /* lease renewals ignore lease_max */
#define MT_MUTATION_FREED_NEWEST 3     /* allocation tries the most recently freed extent first */

typedef struct { uint64_t lo, hi; } mt_key;
typedef struct mt_table mt_table;

typedef struct {  /* Master.counters */
    uint64_t lookup_requests, lookup_keys, lookup_hits, put_requests, put_blocks, registered_blocks,
        revoked_blocks, removed_blocks, evictions, stale_blocks, put_no_space;
} mt_counters;

typedef struct {  /* the device (_Device.space) and the index's sizes */
    int64_t capacity_bytes, used_bytes, free_bytes, write_head, freed_extents, largest_free_extent;
    int64_t entries, pending_blocks, draining_blocks, rows_used, evict_retry_ms, metadata_bytes;
    int64_t leased_passed;  /* leased blocks the LRU walks have passed over, in all (the walks' cost) */
    int registered;
} mt_space;

typedef struct {  /* one row, as Master's ENTRY_DTYPE has it (tests) */
    mt_key key;
    uint64_t offset, checksum, lru;
    uint32_t length, version, lease_until, lease_cap, put_deadline;
    int state;
} mt_row_view;

/* lease_ms, lease_max_ms, put_timeout_ms: Master's ceil(seconds * 1000); time_base: the clock at start
 * (seconds). NULL if out of memory. */
mt_table *mt_new(int64_t lease_ms, int64_t lease_max_ms, int64_t put_timeout_ms, double high_watermark,
                 double low_watermark, double time_base);
void mt_free(mt_table *t);

/* The one device (register_node); 0 or -MT_E_*. clock_s: the clock now (seconds), as in every call. */
int mt_register(mt_table *t, double clock_s, int64_t capacity_bytes);

/* Master.expire / tick; 0 or -MT_E_CLOCK / -MT_E_OVERFLOW. */
int mt_expire(mt_table *t, double clock_s);

/* The number of keys found (the longest complete prefix), each leased and touched; their fields go to
 * the arrays given (any may be NULL), or -MT_E_*. */
int64_t mt_lookup(mt_table *t, double clock_s, const mt_key *keys, int64_t n, uint64_t *offsets,
                  uint32_t *lengths, uint64_t *checksums, uint32_t *versions);

/* Where to write each block: versions[i] 0 for a key not placed (stored, in flight, repeated), else the
 * WriteLoc's version and offsets[i] its offset. The number placed, or -MT_E_* (ENOSPC: -MT_E_TOO_BIG,
 * -MT_E_NO_ROOM, with *detail; nothing placed, but what was evicted stays evicted). */
int64_t mt_put_start(mt_table *t, double clock_s, const mt_key *keys, const uint32_t *sizes, int64_t n,
                     uint64_t *offsets, uint32_t *versions, int64_t *detail);

/* put_end / put_revoke / remove: how many keys it applied to. versions NULL: any put_start's. */
int64_t mt_put_end(mt_table *t, double clock_s, const mt_key *keys, const uint64_t *checksums,
                   const uint32_t *versions, int64_t n);
int64_t mt_put_revoke(mt_table *t, double clock_s, const mt_key *keys, const uint32_t *versions, int64_t n);
int64_t mt_remove(mt_table *t, double clock_s, const mt_key *keys, int64_t n);

/* State, without expiry (Master.stats expires first: call mt_expire). */
void mt_get_counters(const mt_table *t, mt_counters *out);
void mt_get_space(const mt_table *t, mt_space *out);
/* Row ``row`` (< rows_used) as it stands; 0, or -MT_E_ARG. */
int mt_get_row(const mt_table *t, int64_t row, mt_row_view *out);
/* The freed extents in the order freed (start, length pairs: out holds 2 * max); how many there are. */
int64_t mt_get_freed(const mt_table *t, uint64_t *out, int64_t max);
/* The PENDING rows in put_start order (out holds max); how many there are. */
int64_t mt_get_pending(const mt_table *t, uint32_t *out, int64_t max);
/* The Master's time base (seconds) and its lru / version counters. */
double mt_time_base(const mt_table *t);
uint64_t mt_lru_next(const mt_table *t);
uint32_t mt_version_next(const mt_table *t);

int mt_mutation(void);  /* the MT_MUTATION_* this build plants (MT_MUTATION_NONE) */

/* ---- cdef end ---- */

#endif
