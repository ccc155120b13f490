/* The replay's host-side index: master_table.h says what it is and what it matches. Each function
 * names the part of host_runtime/hymcache/master.py it follows. */
#include "master_table.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

int mt_mutation(void) { return MT_MUTATION; }

/* ---------------------------------------------------------------- hashing */

static inline uint64_t mix(uint64_t lo, uint64_t hi) {
    uint64_t x = lo ^ (hi * 0x9E3779B97F4A7C15ull);
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static int map_init(u64map *m, uint64_t slots) {
    m->slots = malloc(slots * sizeof(slot_t));
    if (!m->slots) return 0;
    for (uint64_t i = 0; i < slots; i++) m->slots[i].val = NIL;
    m->mask = slots - 1;
    m->count = 0;
    return 1;
}

static uint32_t map_get(const u64map *m, uint64_t key) {
    uint64_t i = mix(key, 0) & m->mask;
    for (;;) {
        const slot_t *s = &m->slots[i];
        if (s->val == NIL) return NIL;
        if (s->key == key) return s->val;
        i = (i + 1) & m->mask;
    }
}

static int map_put(u64map *m, uint64_t key, uint32_t val);

static int map_grow(u64map *m) {
    u64map g;
    if (!map_init(&g, 2 * (m->mask + 1))) return 0;
    for (uint64_t i = 0; i <= m->mask; i++)
        if (m->slots[i].val != NIL) map_put(&g, m->slots[i].key, m->slots[i].val);
    free(m->slots);
    *m = g;
    return 1;
}

static int map_put(u64map *m, uint64_t key, uint32_t val) {  /* key absent */
    if ((m->count + 1) * 2 > m->mask + 1 && !map_grow(m)) return 0;
    uint64_t i = mix(key, 0) & m->mask;
    while (m->slots[i].val != NIL) i = (i + 1) & m->mask;
    m->slots[i].key = key;
    m->slots[i].val = val;
    m->count++;
    return 1;
}

static void map_del(u64map *m, uint64_t key) {  /* key present */
    uint64_t mask = m->mask, i = mix(key, 0) & mask;
    while (m->slots[i].key != key || m->slots[i].val == NIL) i = (i + 1) & mask;
    for (uint64_t j = i;;) {
        j = (j + 1) & mask;
        if (m->slots[j].val == NIL) break;
        uint64_t k = mix(m->slots[j].key, 0) & mask;
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;  /* its home is between: it stays */
        m->slots[i] = m->slots[j];
        i = j;
    }
    m->slots[i].val = NIL;
    m->count--;
}

/* ---------------------------------------------------------------- the key index */

static inline uint64_t row_home(const mt_table *t, uint32_t r) {
    return mix(t->rows[r].lo, t->rows[r].hi) & t->index_mask;
}

static uint32_t index_find(const mt_table *t, uint64_t lo, uint64_t hi) {
    uint64_t mask = t->index_mask, i = mix(lo, hi) & mask;
    for (;;) {
        uint32_t r = t->index[i];
        if (r == NIL) return NIL;
        if (t->rows[r].lo == lo && t->rows[r].hi == hi) return r;
        i = (i + 1) & mask;
    }
}

static void index_place(mt_table *t, uint32_t r) {
    uint64_t i = row_home(t, r);
    while (t->index[i] != NIL) i = (i + 1) & t->index_mask;
    t->index[i] = r;
}

static int index_insert(mt_table *t, uint32_t r) {  /* the row's key is absent */
    if ((t->index_count + 1) * 2 > t->index_mask + 1) {
        uint64_t slots = 2 * (t->index_mask + 1);
        uint32_t *old = t->index, *grown = malloc(slots * sizeof(uint32_t));
        if (!grown) return 0;
        memset(grown, 0xff, slots * sizeof(uint32_t));
        uint64_t old_slots = t->index_mask + 1;
        t->index = grown;
        t->index_mask = slots - 1;
        for (uint64_t i = 0; i < old_slots; i++)
            if (old[i] != NIL) index_place(t, old[i]);
        free(old);
    }
    index_place(t, r);
    t->index_count++;
    return 1;
}

static void index_erase(mt_table *t, uint32_t r) {  /* row r is in the index */
    uint64_t mask = t->index_mask, i = row_home(t, r);
    while (t->index[i] != r) i = (i + 1) & mask;
    for (uint64_t j = i;;) {
        j = (j + 1) & mask;
        uint32_t s = t->index[j];
        if (s == NIL) break;
        uint64_t k = row_home(t, s);
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
        t->index[i] = s;
        i = j;
    }
    t->index[i] = NIL;
    t->index_count--;
}

/* ---------------------------------------------------------------- lists */

static void list_append(row_t *rows, uint32_t *head, uint32_t *tail, uint32_t r) {
    rows[r].prev = *tail;
    rows[r].next = NIL;
    if (*tail != NIL) rows[*tail].next = r; else *head = r;
    *tail = r;
}

static void list_unlink(row_t *rows, uint32_t *head, uint32_t *tail, uint32_t r) {
    uint32_t p = rows[r].prev, n = rows[r].next;
    if (p != NIL) rows[p].next = n; else *head = n;
    if (n != NIL) rows[n].prev = p; else *tail = p;
    rows[r].prev = rows[r].next = NIL;
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

/* Where a walk for the least recently used unleased block starts at ``now``: after the leased prefix while
 * each of its blocks is still leased, else (the prefix forgotten) at the head. */
static uint32_t walk_start(mt_table *t, int64_t now) {
    if (MT_MUTATION == MT_MUTATION_EVICT_MRU) return t->lru_tail;
    if (t->pre_last != NIL && now < (int64_t)t->pre_until) return t->rows[t->pre_last].next;
    prefix_reset(t);
    return t->lru_head;
}

/* A walk passes leased row r: the prefix takes it in if r follows it directly. */
static void walk_passed(mt_table *t, uint32_t r) {
    t->leased_passed++;
    if (MT_MUTATION == MT_MUTATION_EVICT_MRU) return;
    if (t->pre_last == NIL ? r != t->lru_head : t->rows[t->pre_last].next != r) return;
    uint32_t until = t->rows[r].lease_until;
    if (t->pre_last == NIL || until < t->pre_until) {
        t->pre_until = until;
        t->pre_exact = 1;
    }
    t->rows[r].pepoch = t->pre_epoch;
    t->pre_last = r;
}

/* Row r leaves the LRU list (touched, evicted, removed): it leaves the prefix too. */
static void lru_unlink(mt_table *t, uint32_t r) {
    row_t *w = &t->rows[r];
    if (w->pepoch == t->pre_epoch) {
        if (r == t->pre_last) prefix_reset(t);
        else if (w->lease_until == t->pre_until) t->pre_exact = 0;
        w->pepoch = 0;
    }
    list_unlink(t->rows, &t->lru_head, &t->lru_tail, r);
}

/* ---------------------------------------------------------------- rows (Master._new_row, _release_row) */

static uint32_t new_row(mt_table *t) {
    if (t->free_top != NIL) {
        uint32_t r = t->free_top;
        t->free_top = t->rows[r].next;
        t->rows[r].next = NIL;
        return r;
    }
    if (t->rows_used == t->rows_cap) {
        if (t->rows_cap >= NIL / 2) return NIL;
        row_t *grown = realloc(t->rows, 2 * (size_t)t->rows_cap * sizeof(row_t));
        if (!grown) return NIL;
        t->rows = grown;
        t->rows_cap *= 2;
    }
    uint32_t r = t->rows_used++;
    memset(&t->rows[r], 0, sizeof(row_t));
    t->rows[r].prev = t->rows[r].next = NIL;
    return r;
}

static void release_row(mt_table *t, uint32_t r) {
    memset(&t->rows[r], 0, sizeof(row_t));  /* state FREE */
    t->rows[r].prev = NIL;
    t->rows[r].next = t->free_top;
    t->free_top = r;
}

/* ---------------------------------------------------------------- the device (_Device) */

static uint32_t ext_new(mt_table *t, uint64_t start, uint64_t size) {
    uint32_t e;
    if (t->ext_free != NIL) {
        e = t->ext_free;
        t->ext_free = t->ext[e].next;
    } else {
        if (t->ext_used == t->ext_cap) {
            if (t->ext_cap >= NIL / 2) return NIL;
            ext_t *grown = realloc(t->ext, 2 * (size_t)t->ext_cap * sizeof(ext_t));
            if (!grown) return NIL;
            t->ext = grown;
            t->ext_cap *= 2;
        }
        e = t->ext_used++;
    }
    t->ext[e].start = start;
    t->ext[e].size = size;
    return e;
}

static void ext_unlink_release(mt_table *t, uint32_t e) {
    ext_t *x = &t->ext[e];
    if (x->prev != NIL) t->ext[x->prev].next = x->next; else t->fr_head = x->next;
    if (x->next != NIL) t->ext[x->next].prev = x->prev; else t->fr_tail = x->prev;
    t->fr_count--;
    x->next = t->ext_free;
    t->ext_free = e;
}

static int64_t dev_allocate(mt_table *t, uint64_t length) {
    uint64_t offset;
    if ((uint64_t)t->head + length <= (uint64_t)t->capacity) {
        offset = (uint64_t)t->head;
        t->head += (int64_t)length;
    } else {
        uint32_t e;
        if (MT_MUTATION == MT_MUTATION_FREED_NEWEST) {
            for (e = t->fr_tail; e != NIL && t->ext[e].size < length; e = t->ext[e].prev) {}
        } else {
            for (e = t->fr_head; e != NIL && t->ext[e].size < length; e = t->ext[e].next) {}
        }
        if (e == NIL) return -1;
        uint64_t start = t->ext[e].start, size = t->ext[e].size;
        map_del(&t->by_end, start + size);
        if (size == length) {
            map_del(&t->by_start, start);
            ext_unlink_release(t, e);
        } else {
            t->ext[e].size = size - length;  /* keeps its place in the freed order */
            if (!map_put(&t->by_end, start + size - length, e)) t->nomem = 1;
        }
        t->fr_bytes -= (int64_t)length;
        offset = start + size - length;
    }
    t->used += (int64_t)length;
    return (int64_t)offset;
}

static void dev_free(mt_table *t, uint64_t offset, uint64_t length) {
    t->used -= (int64_t)length;
    t->fr_bytes += (int64_t)length;
    uint64_t start = offset, end = offset + length;
    uint32_t p = map_get(&t->by_end, start);
    if (p != NIL) {
        map_del(&t->by_end, start);
        start = t->ext[p].start;
        map_del(&t->by_start, start);
        ext_unlink_release(t, p);
    }
    uint32_t n = map_get(&t->by_start, end);
    if (n != NIL) {
        uint64_t end_next = end + t->ext[n].size;
        map_del(&t->by_start, end);
        map_del(&t->by_end, end_next);
        ext_unlink_release(t, n);
        end = end_next;
    }
    uint32_t e = ext_new(t, start, end - start);
    if (e == NIL) {
        t->nomem = 1;
        return;
    }
    t->ext[e].prev = t->fr_tail;  /* the merged extent counts as freed now */
    t->ext[e].next = NIL;
    if (t->fr_tail != NIL) t->ext[t->fr_tail].next = e; else t->fr_head = e;
    t->fr_tail = e;
    t->fr_count++;
    if (!map_put(&t->by_start, start, e) || !map_put(&t->by_end, end, e)) t->nomem = 1;
}

/* ---------------------------------------------------------------- exact int-float comparison (Python's) */

static int int_gt(int64_t a, double b) {  /* a > b, exactly, as Python compares an int with a float */
    if (b != b) return 0;
    if (b >= 9223372036854775808.0) return 0;
    if (b < -9223372036854775808.0) return 1;
    return a > (int64_t)floor(b);
}

/* ---------------------------------------------------------------- the drain heap */

static inline int drain_less(drain_t a, drain_t b) {
    return a.until < b.until || (a.until == b.until && a.row < b.row);
}

static int heap_push(mt_table *t, uint32_t until, uint32_t row) {
    if (t->heap_len == t->heap_cap) {
        drain_t *grown = realloc(t->heap, 2 * t->heap_cap * sizeof(drain_t));
        if (!grown) return 0;
        t->heap = grown;
        t->heap_cap *= 2;
    }
    drain_t x = {until, row};
    uint64_t i = t->heap_len++;
    while (i > 0) {
        uint64_t p = (i - 1) / 2;
        if (!drain_less(x, t->heap[p])) break;
        t->heap[i] = t->heap[p];
        i = p;
    }
    t->heap[i] = x;
    return 1;
}

static void heap_pop(mt_table *t) {
    drain_t x = t->heap[--t->heap_len];
    uint64_t n = t->heap_len, i = 0;
    if (!n) return;
    for (;;) {
        uint64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && drain_less(t->heap[c + 1], t->heap[c])) c++;
        if (!drain_less(t->heap[c], x)) break;
        t->heap[i] = t->heap[c];
        i = c;
    }
    t->heap[i] = x;
}

/* ---------------------------------------------------------------- time (Master._now_ms, _rebase) */

static void rebase(mt_table *t, double now_ms) {
    t->time_base += now_ms / 1000.0;
    int all = now_ms > 4294967295.0;
    uint32_t shift = all ? 0 : (uint32_t)now_ms;
    for (uint32_t r = 0; r < t->rows_used; r++) {
        row_t *w = &t->rows[r];
        uint32_t *cols[3] = {&w->lease_until, &w->lease_cap, &w->put_deadline};
        for (int k = 0; k < 3; k++)
            *cols[k] = (!all && *cols[k] > shift) ? *cols[k] - shift : 0;
    }
    t->evict_retry_ms = 0;
    prefix_reset(t);
}

static int clock_ms(mt_table *t, double clock_s, int64_t *now) {
    if (t->nomem) return -MT_E_NOMEM;
    double elapsed = clock_s - t->time_base;
    if (!isfinite(elapsed)) return -MT_E_CLOCK;
    double ms = elapsed * 1000.0;
    if (!isfinite(ms)) return -MT_E_OVERFLOW;
    ms = trunc(ms);
    if (ms >= REBASE_MS) {
        rebase(t, ms);
        *now = 0;
        return 0;
    }
    *now = ms > 0 ? (int64_t)ms : 0;
    return 0;
}

/* ---------------------------------------------------------------- drop, expiry, eviction */

/* Master._drop: out of the index; freed now, or DRAINING until its lease (hold: until hold_until). */
static void drop_row(mt_table *t, uint32_t r, int64_t now, int hold, uint32_t hold_until) {
    row_t *w = &t->rows[r];
    index_erase(t, r);
    if (w->state == MT_PENDING) {
        list_unlink(t->rows, &t->pend_head, &t->pend_tail, r);
        t->pend_count--;
    } else if (w->state == MT_COMPLETE) {
        lru_unlink(t, r);
    }
    int leased;
    if (hold) {
        w->lease_until = hold_until;
        leased = 1;
    } else {
        leased = w->state == MT_COMPLETE && (int64_t)w->lease_until > now;
    }
    if (leased) {
        w->state = MT_DRAINING;
        if (!heap_push(t, w->lease_until, r)) t->nomem = 1;
    } else {
        dev_free(t, w->offset, w->length);
        release_row(t, r);
    }
}

/* Master._evict_over_watermark */
static void evict_over_watermark(mt_table *t, int64_t now) {
    double cap = (double)t->capacity;
    if (!int_gt(t->used, t->high * cap)) return;
    double target = t->low * cap;
    int64_t min_leased = -1;  /* the soonest lease end of the complete blocks passed over */
    uint32_t r = walk_start(t, now);
    int after_prefix = t->pre_last != NIL && MT_MUTATION != MT_MUTATION_EVICT_MRU;
    while (r != NIL) {
        uint32_t next = lru_after(t, r);
        int64_t until = t->rows[r].lease_until;
        if (until > now) {
            walk_passed(t, r);
            if (min_leased < 0 || until < min_leased) min_leased = until;
        } else {
            if (!int_gt(t->used, target)) break;
            drop_row(t, r, now, 0, 0);
            t->c.evictions++;
        }
        r = next;
    }
    /* still over: the walk went through every complete block after the prefix; with the prefix's soonest
     * lease end, min_leased is the soonest of all */
    if (int_gt(t->used, t->high * cap)) {
        if (after_prefix) {
            if (!t->pre_exact) {
                uint32_t soonest = t->rows[t->lru_head].lease_until;
                for (uint32_t p = t->lru_head;; p = t->rows[p].next) {
                    if (t->rows[p].lease_until < soonest) soonest = t->rows[p].lease_until;
                    if (p == t->pre_last) break;
                }
                t->pre_until = soonest;
                t->pre_exact = 1;
            }
            if (min_leased < 0 || (int64_t)t->pre_until < min_leased) min_leased = t->pre_until;
        }
        t->evict_retry_ms = min_leased >= 0 ? min_leased : NO_RETRY;
    }
}

/* Master._expire */
static void expire(mt_table *t, int64_t now) {
    while (t->pend_head != NIL) {
        uint32_t r = t->pend_head;
        if ((int64_t)t->rows[r].put_deadline > now) break;
        /* its writer may still be writing: the extent waits one more put timeout */
        drop_row(t, r, now, 1, (uint32_t)(now + t->put_timeout_ms));
        t->c.revoked_blocks++;
    }
    while (t->heap_len) {
        uint32_t r = t->heap[0].row;
        if ((int64_t)t->rows[r].lease_until > now) break;
        heap_pop(t);
        dev_free(t, t->rows[r].offset, t->rows[r].length);
        release_row(t, r);
    }
    if (t->registered && int_gt(t->used, t->high * (double)t->capacity) && t->evict_retry_ms <= now)
        evict_over_watermark(t, now);
}

/* ---------------------------------------------------------------- the table */

mt_table *mt_new(int64_t lease_ms, int64_t lease_max_ms, int64_t put_timeout_ms, double high_watermark,
                 double low_watermark, double time_base) {
    mt_table *t = calloc(1, sizeof(mt_table));
    if (!t) return NULL;
    t->lease_ms = lease_ms;
    t->lease_max_ms = lease_max_ms;
    t->put_timeout_ms = put_timeout_ms;
    t->high = high_watermark;
    t->low = low_watermark;
    t->time_base = time_base;
    t->rows_cap = 1024;
    t->rows = malloc(t->rows_cap * sizeof(row_t));
    t->index_mask = 2047;
    t->index = malloc((t->index_mask + 1) * sizeof(uint32_t));
    t->heap_cap = 64;
    t->heap = malloc(t->heap_cap * sizeof(drain_t));
    t->ext_cap = 64;
    t->ext = malloc(t->ext_cap * sizeof(ext_t));
    int maps = map_init(&t->by_start, 128);
    maps = map_init(&t->by_end, 128) && maps;
    if (!t->rows || !t->index || !t->heap || !t->ext || !maps) {
        mt_free(t);
        return NULL;
    }
    memset(t->index, 0xff, (t->index_mask + 1) * sizeof(uint32_t));
    t->free_top = t->pend_head = t->pend_tail = t->lru_head = t->lru_tail = t->pre_last = NIL;
    t->pre_epoch = 1;
    t->pre_exact = 1;
    t->ext_free = t->fr_head = t->fr_tail = NIL;
    t->lru_next = 1;
    t->version_next = 1;
    return t;
}

void mt_free(mt_table *t) {
    if (!t) return;
    free(t->rows);
    free(t->index);
    free(t->heap);
    free(t->ext);
    free(t->by_start.slots);
    free(t->by_end.slots);
    free(t->set);
    free(t->placed);
    free(t->todo);
    free(t);
}

int mt_register(mt_table *t, double clock_s, int64_t capacity_bytes) {
    int64_t now;
    int rc = clock_ms(t, clock_s, &now);
    if (rc) return rc;
    if (t->registered || capacity_bytes < 1) return -MT_E_ARG;
    t->registered = 1;
    t->capacity = capacity_bytes;
    return 0;
}

int mt_expire(mt_table *t, double clock_s) {
    int64_t now;
    int rc = clock_ms(t, clock_s, &now);
    if (rc) return rc;
    expire(t, now);
    return t->nomem ? -MT_E_NOMEM : 0;
}

/* Master.lookup */
int64_t mt_lookup(mt_table *t, double clock_s, const mt_key *keys, int64_t n, uint64_t *offsets,
                  uint32_t *lengths, uint64_t *checksums, uint32_t *versions) {
    int64_t now;
    int rc = clock_ms(t, clock_s, &now);
    if (rc) return rc;
    expire(t, now);
    t->c.lookup_requests++;
    t->c.lookup_keys += (uint64_t)n;
    int64_t found = 0;
    for (; found < n; found++) {
        uint32_t r = index_find(t, keys[found].lo, keys[found].hi);
        if (r == NIL || t->rows[r].state != MT_COMPLETE) break;
        row_t *w = &t->rows[r];
        lru_unlink(t, r);  /* before its lease changes (the prefix's soonest end) */
        /* a lease that has ended starts a new cap; renewals never pass the cap */
        uint32_t cap = (int64_t)w->lease_until > now ? w->lease_cap : (uint32_t)(now + t->lease_max_ms);
        w->lease_cap = cap;
        uint32_t until = (uint32_t)(now + t->lease_ms);
        if (MT_MUTATION != MT_MUTATION_LEASE_NO_CAP && until > cap) until = cap;
        if (until > w->lease_until) w->lease_until = until;
        w->lru = t->lru_next++;
        list_append(t->rows, &t->lru_head, &t->lru_tail, r);
        if (offsets) offsets[found] = w->offset;
        if (lengths) lengths[found] = w->length;
        if (checksums) checksums[found] = w->checksum;
        if (versions) versions[found] = w->version;
    }
    t->c.lookup_hits += (uint64_t)found;
    return t->nomem ? -MT_E_NOMEM : found;
}

static int scratch_reserve(mt_table *t, int64_t n) {
    uint64_t want = (uint64_t)n;
    if (want > t->scratch_n) {
        uint32_t *placed = realloc(t->placed, want * sizeof(uint32_t));
        if (placed) t->placed = placed;
        uint8_t *todo = realloc(t->todo, want);
        if (todo) t->todo = todo;
        if (!placed || !todo) return 0;
        t->scratch_n = want;
    }
    uint64_t slots = 16;
    while (slots < 2 * want) slots *= 2;
    if (slots > t->set_cap) {
        uint32_t *set = realloc(t->set, slots * sizeof(uint32_t));
        if (!set) return 0;
        t->set = set;
        t->set_cap = slots;
    }
    return 1;
}

/* Master.put_start */
int64_t mt_put_start(mt_table *t, double clock_s, const mt_key *keys, const uint32_t *sizes, int64_t n,
                     uint64_t *offsets, uint32_t *versions, int64_t *detail) {
    int64_t now;
    int rc = clock_ms(t, clock_s, &now);
    if (rc) return rc;
    expire(t, now);
    t->c.put_requests++;
    if (!scratch_reserve(t, n)) {
        t->nomem = 1;
        return -MT_E_NOMEM;
    }
    /* the keys to place: not stored, not in flight, not repeated (the first of each) */
    uint64_t slots = 16;
    while (slots < 2 * (uint64_t)n) slots *= 2;
    uint64_t mask = slots - 1;
    memset(t->set, 0xff, slots * sizeof(uint32_t));
    uint64_t need = 0;
    int64_t todo = 0;
    for (int64_t i = 0; i < n; i++) {
        versions[i] = 0;
        t->todo[i] = 0;
        uint64_t lo = keys[i].lo, hi = keys[i].hi;
        if (index_find(t, lo, hi) != NIL) continue;
        uint64_t s = mix(lo, hi) & mask;
        int seen = 0;
        for (; t->set[s] != NIL; s = (s + 1) & mask)
            if (keys[t->set[s]].lo == lo && keys[t->set[s]].hi == hi) {
                seen = 1;
                break;
            }
        if (seen) continue;
        t->set[s] = (uint32_t)i;
        t->todo[i] = 1;
        need += sizes[i];
        todo++;
    }
    if (!todo) return 0;
    if (!t->registered) return -MT_E_NODEV;
    if (need > (uint64_t)t->capacity) {
        if (detail) *detail = (int64_t)need;
        for (int64_t i = 0; i < n; i++) versions[i] = 0;
        return -MT_E_TOO_BIG;
    }
    uint32_t deadline = (uint32_t)(now + t->put_timeout_ms);
    uint32_t cursor = NIL;  /* the evictable blocks as they stood when the first was needed, in LRU order */
    int walking = 0;
    int64_t placed = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!t->todo[i]) continue;
        uint64_t size = sizes[i];
        int64_t offset = dev_allocate(t, size);
        while (offset < 0) {
            if (!walking) {
                cursor = walk_start(t, now);
                walking = 1;
            }
            while (cursor != NIL && (int64_t)t->rows[cursor].lease_until > now) {
                walk_passed(t, cursor);
                cursor = lru_after(t, cursor);
            }
            if (cursor == NIL) break;
            uint32_t victim = cursor;
            cursor = lru_after(t, victim);
            drop_row(t, victim, now, 0, 0);
            t->c.evictions++;
            offset = dev_allocate(t, size);
        }
        if (offset < 0) {  /* all or nothing: give back what this request took */
            for (int64_t k = 0; k < placed; k++) drop_row(t, t->placed[k], now, 0, 0);
            t->c.put_no_space++;
            if (detail) *detail = (int64_t)size;
            for (int64_t k = 0; k < n; k++) versions[k] = 0;
            return t->nomem ? -MT_E_NOMEM : -MT_E_NO_ROOM;
        }
        uint32_t version = t->version_next;
        t->version_next = version + 1 ? version + 1 : 1;
        uint32_t r = new_row(t);
        if (r == NIL) {
            t->nomem = 1;
            return -MT_E_NOMEM;
        }
        row_t *w = &t->rows[r];
        w->lo = keys[i].lo;
        w->hi = keys[i].hi;
        w->offset = (uint64_t)offset;
        w->length = (uint32_t)size;
        w->version = version;
        w->put_deadline = deadline;
        w->state = MT_PENDING;
        if (!index_insert(t, r)) {
            t->nomem = 1;
            return -MT_E_NOMEM;
        }
        list_append(t->rows, &t->pend_head, &t->pend_tail, r);
        t->pend_count++;
        t->placed[placed++] = r;
        offsets[i] = (uint64_t)offset;
        versions[i] = version;
    }
    evict_over_watermark(t, now);
    t->c.put_blocks += (uint64_t)placed;
    return t->nomem ? -MT_E_NOMEM : placed;
}

/* Master.put_end (_started_as, _commit) */
int64_t mt_put_end(mt_table *t, double clock_s, const mt_key *keys, const uint64_t *checksums,
                   const uint32_t *versions, int64_t n) {
    int64_t now;
    int rc = clock_ms(t, clock_s, &now);
    if (rc) return rc;
    expire(t, now);
    int64_t committed = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t r = index_find(t, keys[i].lo, keys[i].hi);
        if (r == NIL || t->rows[r].state != MT_PENDING) continue;
        if (versions && t->rows[r].version != versions[i]) continue;
        row_t *w = &t->rows[r];
        w->state = MT_COMPLETE;
        w->checksum = checksums[i];
        w->put_deadline = 0;
        w->lru = t->lru_next++;
        list_unlink(t->rows, &t->pend_head, &t->pend_tail, r);
        t->pend_count--;
        list_append(t->rows, &t->lru_head, &t->lru_tail, r);
        t->evict_retry_ms = 0;
        committed++;
    }
    t->c.registered_blocks += (uint64_t)committed;
    return t->nomem ? -MT_E_NOMEM : committed;
}

/* Master.put_revoke */
int64_t mt_put_revoke(mt_table *t, double clock_s, const mt_key *keys, const uint32_t *versions, int64_t n) {
    int64_t now;
    int rc = clock_ms(t, clock_s, &now);
    if (rc) return rc;
    expire(t, now);
    int64_t revoked = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t r = index_find(t, keys[i].lo, keys[i].hi);
        if (r == NIL || t->rows[r].state != MT_PENDING) continue;
        if (versions && t->rows[r].version != versions[i]) continue;
        drop_row(t, r, now, 0, 0);
        revoked++;
    }
    t->c.revoked_blocks += (uint64_t)revoked;
    return t->nomem ? -MT_E_NOMEM : revoked;
}

/* Master.remove */
int64_t mt_remove(mt_table *t, double clock_s, const mt_key *keys, int64_t n) {
    int64_t now;
    int rc = clock_ms(t, clock_s, &now);
    if (rc) return rc;
    expire(t, now);
    int64_t removed = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t r = index_find(t, keys[i].lo, keys[i].hi);
        if (r == NIL) continue;
        drop_row(t, r, now, 0, 0);
        removed++;
    }
    t->c.removed_blocks += (uint64_t)removed;
    return t->nomem ? -MT_E_NOMEM : removed;
}

/* ---------------------------------------------------------------- state */

void mt_get_counters(const mt_table *t, mt_counters *out) { *out = t->c; }

void mt_get_space(const mt_table *t, mt_space *out) {
    memset(out, 0, sizeof(*out));
    out->registered = t->registered;
    out->capacity_bytes = t->capacity;
    out->used_bytes = t->used;
    out->write_head = t->head;
    int64_t tail = t->capacity - t->head, largest = tail;
    for (uint32_t e = t->fr_head; e != NIL; e = t->ext[e].next)
        if ((int64_t)t->ext[e].size > largest) largest = (int64_t)t->ext[e].size;
    out->free_bytes = tail + t->fr_bytes;
    out->freed_extents = (int64_t)t->fr_count;
    out->largest_free_extent = largest;
    out->entries = (int64_t)t->index_count;
    out->pending_blocks = (int64_t)t->pend_count;
    out->draining_blocks = (int64_t)t->heap_len;
    out->rows_used = t->rows_used;
    out->evict_retry_ms = t->evict_retry_ms;
    out->leased_passed = (int64_t)t->leased_passed;
    out->metadata_bytes = (int64_t)(sizeof(mt_table) + (uint64_t)t->rows_cap * sizeof(row_t)
                                    + (t->index_mask + 1) * sizeof(uint32_t) + t->heap_cap * sizeof(drain_t)
                                    + (uint64_t)t->ext_cap * sizeof(ext_t)
                                    + (t->by_start.mask + t->by_end.mask + 2) * sizeof(slot_t)
                                    + t->scratch_n * (sizeof(uint32_t) + 1) + t->set_cap * sizeof(uint32_t));
}

int mt_get_row(const mt_table *t, int64_t row, mt_row_view *out) {
    if (row < 0 || row >= (int64_t)t->rows_used) return -MT_E_ARG;
    const row_t *w = &t->rows[row];
    out->key.lo = w->lo;
    out->key.hi = w->hi;
    out->offset = w->offset;
    out->checksum = w->checksum;
    out->lru = w->lru;
    out->length = w->length;
    out->version = w->version;
    out->lease_until = w->lease_until;
    out->lease_cap = w->lease_cap;
    out->put_deadline = w->put_deadline;
    out->state = w->state;
    return 0;
}

int64_t mt_get_freed(const mt_table *t, uint64_t *out, int64_t max) {
    int64_t k = 0;
    for (uint32_t e = t->fr_head; e != NIL; e = t->ext[e].next, k++)
        if (k < max) {
            out[2 * k] = t->ext[e].start;
            out[2 * k + 1] = t->ext[e].size;
        }
    return k;
}

int64_t mt_get_pending(const mt_table *t, uint32_t *out, int64_t max) {
    int64_t k = 0;
    for (uint32_t r = t->pend_head; r != NIL; r = t->rows[r].next, k++)
        if (k < max) out[k] = r;
    return k;
}

double mt_time_base(const mt_table *t) { return t->time_base; }
uint64_t mt_lru_next(const mt_table *t) { return t->lru_next; }
uint32_t mt_version_next(const mt_table *t) { return t->version_next; }
