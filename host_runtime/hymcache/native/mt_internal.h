/* The replay index's private header: the table's layout and what its three files share.
 *
 *   mt_index.c       the key index (hashing), the row lists (put_start order, LRU with its leased prefix), rows
 *   mt_space.c       the device's space (write head, freed extents), the drain heap, time, drop, expiry, eviction
 *   mt_calls.c       the calls of master_table.h (the Master's methods) and the state the tests compare
 *
 * Each function names the part of host_runtime/hymcache/master.py (master_table.py, allocator.py) it follows.
 * Shared functions are mti_*: the replay links this beside the emulator's core, whose names are plain. */
#ifndef MT_INTERNAL_H
#define MT_INTERNAL_H

#include "master_table.h"

#ifndef MT_MUTATION
#define MT_MUTATION MT_MUTATION_NONE
#endif

#define NIL UINT32_MAX
#define REBASE_MS 2147483648.0        /* _REBASE_MS: 2^31 */
#define NO_RETRY ((int64_t)1 << 62)   /* evict_retry_ms when nothing leased can end */

typedef struct {
    uint64_t lo, hi;                  /* key */
    uint64_t offset, checksum, lru;
    uint32_t length, version, lease_until, lease_cap, put_deadline;
    uint32_t prev, next;              /* PENDING: the put_start order; COMPLETE: the LRU order; FREE: the free stack */
    uint32_t pepoch;                  /* == pre_epoch: in the leased prefix */
    uint8_t state;
} row_t;

typedef struct {
    uint64_t start, size;
    uint32_t prev, next;              /* the order freed, oldest first */
} ext_t;

typedef struct {
    uint64_t key;
    uint32_t val;                     /* NIL: empty */
} slot_t;

typedef struct {                      /* open addressing, linear probing, backward-shift deletion */
    slot_t *slots;
    uint64_t mask, count;
} u64map;

typedef struct {
    uint32_t until, row;              /* the drain heap's (lease end when draining began, row) */
} drain_t;

struct mt_table {
    int64_t lease_ms, lease_max_ms, put_timeout_ms;
    double high, low, time_base;
    int nomem;

    row_t *rows;
    uint32_t rows_cap, rows_used, free_top;

    uint32_t *index;                  /* row numbers of PENDING and COMPLETE blocks, by key */
    uint64_t index_mask, index_count;

    uint32_t pend_head, pend_tail;
    uint64_t pend_count;
    uint32_t lru_head, lru_tail;      /* COMPLETE rows, least recently used first (= ascending lru stamp) */
    /* The leased prefix: the LRU list's first rows up to pre_last, each leased until pre_until or later
     * (pre_exact: the soonest of them ends at pre_until). While now < pre_until the LRU walks start after
     * it, so blocks that stay leased at the head are passed over once, not by every walk. */
    uint32_t pre_last, pre_epoch, pre_until;
    int pre_exact;

    drain_t *heap;
    uint64_t heap_len, heap_cap;

    /* the device (_Device) */
    int registered;
    int64_t capacity, head, used, evict_retry_ms;
    ext_t *ext;
    uint32_t ext_cap, ext_used, ext_free;
    uint32_t fr_head, fr_tail;
    uint64_t fr_count;
    int64_t fr_bytes;
    u64map by_start, by_end;

    uint64_t lru_next;
    uint32_t version_next;
    mt_counters c;
    uint64_t leased_passed;

    /* put_start's scratch */
    uint32_t *set, *placed;
    uint8_t *todo;
    uint64_t scratch_n, set_cap;
};

static inline uint64_t mix(uint64_t lo, uint64_t hi) {
    uint64_t x = lo ^ (hi * 0x9E3779B97F4A7C15ull);
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* The LRU walk: least recently used first (the mutation: most recently used first). */
static inline uint32_t lru_after(const mt_table *t, uint32_t r) {
    return MT_MUTATION == MT_MUTATION_EVICT_MRU ? t->rows[r].prev : t->rows[r].next;
}

static inline void prefix_reset(mt_table *t) {
    t->pre_epoch++;
    t->pre_last = NIL;
    t->pre_exact = 1;
}

/* mt_index.c */
int mti_map_init(u64map *m, uint64_t slots);
uint32_t mti_map_get(const u64map *m, uint64_t key);
int mti_map_put(u64map *m, uint64_t key, uint32_t val);
void mti_map_del(u64map *m, uint64_t key);
uint32_t mti_index_find(const mt_table *t, uint64_t lo, uint64_t hi);
int mti_index_insert(mt_table *t, uint32_t r);
void mti_index_erase(mt_table *t, uint32_t r);
void mti_list_append(row_t *rows, uint32_t *head, uint32_t *tail, uint32_t r);
void mti_list_unlink(row_t *rows, uint32_t *head, uint32_t *tail, uint32_t r);
uint32_t mti_walk_start(mt_table *t, int64_t now);
void mti_walk_passed(mt_table *t, uint32_t r);
void mti_lru_unlink(mt_table *t, uint32_t r);
uint32_t mti_new_row(mt_table *t);
void mti_release_row(mt_table *t, uint32_t r);

/* mt_space.c */
int64_t mti_dev_allocate(mt_table *t, uint64_t length);
int mti_clock_ms(mt_table *t, double clock_s, int64_t *now);
void mti_drop_row(mt_table *t, uint32_t r, int64_t now, int hold, uint32_t hold_until);
void mti_evict_over_watermark(mt_table *t, int64_t now);
void mti_expire(mt_table *t, int64_t now);

#endif
