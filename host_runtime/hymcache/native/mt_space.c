/* The device's space, the drain heap, time, drop, expiry and eviction (mt_internal.h). */
#include "mt_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

int64_t mti_dev_allocate(mt_table *t, uint64_t length) {
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
        mti_map_del(&t->by_end, start + size);
        if (size == length) {
            mti_map_del(&t->by_start, start);
            ext_unlink_release(t, e);
        } else {
            t->ext[e].size = size - length;  /* keeps its place in the freed order */
            if (!mti_map_put(&t->by_end, start + size - length, e)) t->nomem = 1;
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
    uint32_t p = mti_map_get(&t->by_end, start);
    if (p != NIL) {
        mti_map_del(&t->by_end, start);
        start = t->ext[p].start;
        mti_map_del(&t->by_start, start);
        ext_unlink_release(t, p);
    }
    uint32_t n = mti_map_get(&t->by_start, end);
    if (n != NIL) {
        uint64_t end_next = end + t->ext[n].size;
        mti_map_del(&t->by_start, end);
        mti_map_del(&t->by_end, end_next);
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
    if (!mti_map_put(&t->by_start, start, e) || !mti_map_put(&t->by_end, end, e)) t->nomem = 1;
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

int mti_clock_ms(mt_table *t, double clock_s, int64_t *now) {
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
void mti_drop_row(mt_table *t, uint32_t r, int64_t now, int hold, uint32_t hold_until) {
    row_t *w = &t->rows[r];
    mti_index_erase(t, r);
    if (w->state == MT_PENDING) {
        mti_list_unlink(t->rows, &t->pend_head, &t->pend_tail, r);
        t->pend_count--;
    } else if (w->state == MT_COMPLETE) {
        mti_lru_unlink(t, r);
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
        mti_release_row(t, r);
    }
}

/* Master._evict_over_watermark */
void mti_evict_over_watermark(mt_table *t, int64_t now) {
    double cap = (double)t->capacity;
    if (!int_gt(t->used, t->high * cap)) return;
    double target = t->low * cap;
    int64_t min_leased = -1;  /* the soonest lease end of the complete blocks passed over */
    uint32_t r = mti_walk_start(t, now);
    int after_prefix = t->pre_last != NIL && MT_MUTATION != MT_MUTATION_EVICT_MRU;
    while (r != NIL) {
        uint32_t next = lru_after(t, r);
        int64_t until = t->rows[r].lease_until;
        if (until > now) {
            mti_walk_passed(t, r);
            if (min_leased < 0 || until < min_leased) min_leased = until;
        } else {
            if (!int_gt(t->used, target)) break;
            mti_drop_row(t, r, now, 0, 0);
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
void mti_expire(mt_table *t, int64_t now) {
    while (t->pend_head != NIL) {
        uint32_t r = t->pend_head;
        if ((int64_t)t->rows[r].put_deadline > now) break;
        /* its writer may still be writing: the extent waits one more put timeout */
        mti_drop_row(t, r, now, 1, (uint32_t)(now + t->put_timeout_ms));
        t->c.revoked_blocks++;
    }
    while (t->heap_len) {
        uint32_t r = t->heap[0].row;
        if ((int64_t)t->rows[r].lease_until > now) break;
        heap_pop(t);
        dev_free(t, t->rows[r].offset, t->rows[r].length);
        mti_release_row(t, r);
    }
    if (t->registered && int_gt(t->used, t->high * (double)t->capacity) && t->evict_retry_ms <= now)
        mti_evict_over_watermark(t, now);
}

