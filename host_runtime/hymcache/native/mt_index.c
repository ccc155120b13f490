/* The key index, the row lists and the rows (mt_internal.h). */
#include "mt_internal.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- hashing */

int mti_map_init(u64map *m, uint64_t slots) {
    m->slots = malloc(slots * sizeof(slot_t));
    if (!m->slots) return 0;
    for (uint64_t i = 0; i < slots; i++) m->slots[i].val = NIL;
    m->mask = slots - 1;
    m->count = 0;
    return 1;
}

uint32_t mti_map_get(const u64map *m, uint64_t key) {
    uint64_t i = mix(key, 0) & m->mask;
    for (;;) {
        const slot_t *s = &m->slots[i];
        if (s->val == NIL) return NIL;
        if (s->key == key) return s->val;
        i = (i + 1) & m->mask;
    }
}

static int map_grow(u64map *m) {
    u64map g;
    if (!mti_map_init(&g, 2 * (m->mask + 1))) return 0;
    for (uint64_t i = 0; i <= m->mask; i++)
        if (m->slots[i].val != NIL) mti_map_put(&g, m->slots[i].key, m->slots[i].val);
    free(m->slots);
    *m = g;
    return 1;
}

int mti_map_put(u64map *m, uint64_t key, uint32_t val) {  /* key absent */
    if ((m->count + 1) * 2 > m->mask + 1 && !map_grow(m)) return 0;
    uint64_t i = mix(key, 0) & m->mask;
    while (m->slots[i].val != NIL) i = (i + 1) & m->mask;
    m->slots[i].key = key;
    m->slots[i].val = val;
    m->count++;
    return 1;
}

void mti_map_del(u64map *m, uint64_t key) {  /* key present */
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

uint32_t mti_index_find(const mt_table *t, uint64_t lo, uint64_t hi) {
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

int mti_index_insert(mt_table *t, uint32_t r) {  /* the row's key is absent */
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

void mti_index_erase(mt_table *t, uint32_t r) {  /* row r is in the index */
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

void mti_list_append(row_t *rows, uint32_t *head, uint32_t *tail, uint32_t r) {
    rows[r].prev = *tail;
    rows[r].next = NIL;
    if (*tail != NIL) rows[*tail].next = r; else *head = r;
    *tail = r;
}

void mti_list_unlink(row_t *rows, uint32_t *head, uint32_t *tail, uint32_t r) {
    uint32_t p = rows[r].prev, n = rows[r].next;
    if (p != NIL) rows[p].next = n; else *head = n;
    if (n != NIL) rows[n].prev = p; else *tail = p;
    rows[r].prev = rows[r].next = NIL;
}

/* Where a walk for the least recently used unleased block starts at ``now``: after the leased prefix while
 * each of its blocks is still leased, else (the prefix forgotten) at the head. */
uint32_t mti_walk_start(mt_table *t, int64_t now) {
    if (MT_MUTATION == MT_MUTATION_EVICT_MRU) return t->lru_tail;
    if (t->pre_last != NIL && now < (int64_t)t->pre_until) return t->rows[t->pre_last].next;
    prefix_reset(t);
    return t->lru_head;
}

/* A walk passes leased row r: the prefix takes it in if r follows it directly. */
void mti_walk_passed(mt_table *t, uint32_t r) {
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
void mti_lru_unlink(mt_table *t, uint32_t r) {
    row_t *w = &t->rows[r];
    if (w->pepoch == t->pre_epoch) {
        if (r == t->pre_last) prefix_reset(t);
        else if (w->lease_until == t->pre_until) t->pre_exact = 0;
        w->pepoch = 0;
    }
    mti_list_unlink(t->rows, &t->lru_head, &t->lru_tail, r);
}

/* ---------------------------------------------------------------- rows (Master._new_row, _release_row) */

uint32_t mti_new_row(mt_table *t) {
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

void mti_release_row(mt_table *t, uint32_t r) {
    memset(&t->rows[r], 0, sizeof(row_t));  /* state FREE */
    t->rows[r].prev = NIL;
    t->rows[r].next = t->free_top;
    t->free_top = r;
}

