/* A hash map uint64 -> int32: open addressing, linear probing, backward-shift deletion (no tombstones).
 * The frame table's page index and s3fifo's ghost, the prefetch engine's handles. */
#include "chm_core_internal.h"

/* Slots for `entries` at a load of at most 1/2. */
int map_init(struct chm_map *m, uint64_t entries)
{
    uint64_t slots = MAP_MIN_SLOTS;
    unsigned bits = 3;
    while (slots < 2 * entries) {
        slots <<= 1;
        bits++;
    }
    if (slots > (1ull << 31))
        return CHM_E_ARG;
    m->keys = malloc(slots * sizeof *m->keys);
    m->values = malloc(slots * sizeof *m->values);
    if (!m->keys || !m->values) {
        free(m->keys);
        free(m->values);
        m->keys = NULL;
        m->values = NULL;
        return CHM_E_NOMEM;
    }
    memset(m->values, 0xff, slots * sizeof *m->values);
    m->mask = (uint32_t)(slots - 1);
    m->count = 0;
    m->shift = 64 - bits;
    return CHM_OK;
}

void map_destroy(struct chm_map *m)
{
    free(m->keys);
    free(m->values);
}

/* Put a key that is not there (the caller knows); the map has room for it. */
void map_put_new(struct chm_map *m, uint64_t key, int32_t value)
{
    uint32_t i = map_home(m, key);
    while (m->values[i] >= 0)
        i = (i + 1) & m->mask;
    m->keys[i] = key;
    m->values[i] = value;
    m->count++;
}

/* Twice the slots when over half full (maps whose size is not known in advance). */
int map_reserve_one(struct chm_map *m)
{
    if (2 * ((uint64_t)m->count + 1) <= (uint64_t)m->mask + 1)
        return CHM_OK;
    struct chm_map bigger;
    int rc = map_init(&bigger, (uint64_t)m->mask + 1);
    if (rc)
        return rc;
    for (uint32_t i = 0; i <= m->mask; i++)
        if (m->values[i] >= 0)
            map_put_new(&bigger, m->keys[i], m->values[i]);
    map_destroy(m);
    *m = bigger;
    return CHM_OK;
}

void map_del(struct chm_map *m, uint64_t key)
{
    uint32_t i = map_home(m, key);
    while (m->values[i] >= 0 && m->keys[i] != key)
        i = (i + 1) & m->mask;
    if (m->values[i] < 0)
        return;
    /* Shift back every later entry of the run whose home is not in (i, j]: no tombstones. */
    for (uint32_t j = i;;) {
        j = (j + 1) & m->mask;
        if (m->values[j] < 0)
            break;
        uint32_t home = map_home(m, m->keys[j]);
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            m->keys[i] = m->keys[j];
            m->values[i] = m->values[j];
            i = j;
        }
    }
    m->values[i] = -1;
    m->count--;
}
