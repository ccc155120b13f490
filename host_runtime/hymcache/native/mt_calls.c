/* The replay's host-side index: master_table.h says what it is and what it matches; mt_internal.h how it
 * is laid out. Each function names the part of host_runtime/hymcache/master.py it follows. */
#include "mt_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int mt_mutation(void) { return MT_MUTATION; }

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
    int maps = mti_map_init(&t->by_start, 128);
    maps = mti_map_init(&t->by_end, 128) && maps;
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
    int rc = mti_clock_ms(t, clock_s, &now);
    if (rc) return rc;
    if (t->registered || capacity_bytes < 1) return -MT_E_ARG;
    t->registered = 1;
    t->capacity = capacity_bytes;
    return 0;
}

int mt_expire(mt_table *t, double clock_s) {
    int64_t now;
    int rc = mti_clock_ms(t, clock_s, &now);
    if (rc) return rc;
    mti_expire(t, now);
    return t->nomem ? -MT_E_NOMEM : 0;
}

/* Master.lookup */
int64_t mt_lookup(mt_table *t, double clock_s, const mt_key *keys, int64_t n, uint64_t *offsets,
                  uint32_t *lengths, uint64_t *checksums, uint32_t *versions) {
    int64_t now;
    int rc = mti_clock_ms(t, clock_s, &now);
    if (rc) return rc;
    mti_expire(t, now);
    t->c.lookup_requests++;
    t->c.lookup_keys += (uint64_t)n;
    int64_t found = 0;
    for (; found < n; found++) {
        uint32_t r = mti_index_find(t, keys[found].lo, keys[found].hi);
        if (r == NIL || t->rows[r].state != MT_COMPLETE) break;
        row_t *w = &t->rows[r];
        mti_lru_unlink(t, r);  /* before its lease changes (the prefix's soonest end) */
        /* a lease that has ended starts a new cap; renewals never pass the cap */
        uint32_t cap = (int64_t)w->lease_until > now ? w->lease_cap : (uint32_t)(now + t->lease_max_ms);
        w->lease_cap = cap;
        uint32_t until = (uint32_t)(now + t->lease_ms);
        if (MT_MUTATION != MT_MUTATION_LEASE_NO_CAP && until > cap) until = cap;
        if (until > w->lease_until) w->lease_until = until;
        w->lru = t->lru_next++;
        mti_list_append(t->rows, &t->lru_head, &t->lru_tail, r);
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
    int rc = mti_clock_ms(t, clock_s, &now);
    if (rc) return rc;
    mti_expire(t, now);
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
        if (mti_index_find(t, lo, hi) != NIL) continue;
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
        int64_t offset = mti_dev_allocate(t, size);
        while (offset < 0) {
            if (!walking) {
                cursor = mti_walk_start(t, now);
                walking = 1;
            }
            while (cursor != NIL && (int64_t)t->rows[cursor].lease_until > now) {
                mti_walk_passed(t, cursor);
                cursor = lru_after(t, cursor);
            }
            if (cursor == NIL) break;
            uint32_t victim = cursor;
            cursor = lru_after(t, victim);
            mti_drop_row(t, victim, now, 0, 0);
            t->c.evictions++;
            offset = mti_dev_allocate(t, size);
        }
        if (offset < 0) {  /* all or nothing: give back what this request took */
            for (int64_t k = 0; k < placed; k++) mti_drop_row(t, t->placed[k], now, 0, 0);
            t->c.put_no_space++;
            if (detail) *detail = (int64_t)size;
            for (int64_t k = 0; k < n; k++) versions[k] = 0;
            return t->nomem ? -MT_E_NOMEM : -MT_E_NO_ROOM;
        }
        uint32_t version = t->version_next;
        t->version_next = version + 1 ? version + 1 : 1;
        uint32_t r = mti_new_row(t);
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
        if (!mti_index_insert(t, r)) {
            t->nomem = 1;
            return -MT_E_NOMEM;
        }
        mti_list_append(t->rows, &t->pend_head, &t->pend_tail, r);
        t->pend_count++;
        t->placed[placed++] = r;
        offsets[i] = (uint64_t)offset;
        versions[i] = version;
    }
    mti_evict_over_watermark(t, now);
    t->c.put_blocks += (uint64_t)placed;
    return t->nomem ? -MT_E_NOMEM : placed;
}

/* Master.put_end (_started_as, _commit) */
int64_t mt_put_end(mt_table *t, double clock_s, const mt_key *keys, const uint64_t *checksums,
                   const uint32_t *versions, int64_t n) {
    int64_t now;
    int rc = mti_clock_ms(t, clock_s, &now);
    if (rc) return rc;
    mti_expire(t, now);
    int64_t committed = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t r = mti_index_find(t, keys[i].lo, keys[i].hi);
        if (r == NIL || t->rows[r].state != MT_PENDING) continue;
        if (versions && t->rows[r].version != versions[i]) continue;
        row_t *w = &t->rows[r];
        w->state = MT_COMPLETE;
        w->checksum = checksums[i];
        w->put_deadline = 0;
        w->lru = t->lru_next++;
        mti_list_unlink(t->rows, &t->pend_head, &t->pend_tail, r);
        t->pend_count--;
        mti_list_append(t->rows, &t->lru_head, &t->lru_tail, r);
        t->evict_retry_ms = 0;
        committed++;
    }
    t->c.registered_blocks += (uint64_t)committed;
    return t->nomem ? -MT_E_NOMEM : committed;
}

/* Master.put_revoke */
int64_t mt_put_revoke(mt_table *t, double clock_s, const mt_key *keys, const uint32_t *versions, int64_t n) {
    int64_t now;
    int rc = mti_clock_ms(t, clock_s, &now);
    if (rc) return rc;
    mti_expire(t, now);
    int64_t revoked = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t r = mti_index_find(t, keys[i].lo, keys[i].hi);
        if (r == NIL || t->rows[r].state != MT_PENDING) continue;
        if (versions && t->rows[r].version != versions[i]) continue;
        mti_drop_row(t, r, now, 0, 0);
        revoked++;
    }
    t->c.revoked_blocks += (uint64_t)revoked;
    return t->nomem ? -MT_E_NOMEM : revoked;
}

/* Master.remove */
int64_t mt_remove(mt_table *t, double clock_s, const mt_key *keys, int64_t n) {
    int64_t now;
    int rc = mti_clock_ms(t, clock_s, &now);
    if (rc) return rc;
    mti_expire(t, now);
    int64_t removed = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t r = mti_index_find(t, keys[i].lo, keys[i].hi);
        if (r == NIL) continue;
        mti_drop_row(t, r, now, 0, 0);
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

