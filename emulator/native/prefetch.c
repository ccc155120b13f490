/* The prefetch engine (emulator/prefetch.py wraps it): prefetch objects by handle, the window of pages they
 * hold, and the page fetches of issued objects not yet taken. */
#include "chm_core_internal.h"

struct pf_slot {
    struct chm_pf_object obj;
    int32_t older, newer;  /* held objects in issue order; a free slot: newer is the next free one */
};

struct pf_fetch {          /* an issued object's page fetches not yet taken */
    int64_t handle;
    uint64_t next_page, end_page;
};

struct chm_pf {
    uint64_t window_pages, pages_held;
    uint32_t max_handles, objects;
    struct pf_slot *slots;  /* grown on demand up to max_handles */
    uint32_t slot_count;
    int32_t free_slot, oldest, newest;
    struct chm_map by_handle;  /* handle -> slot */
    struct pf_fetch *fetches;  /* a ring, grown on demand */
    uint64_t fetch_cap, fetch_head, fetch_len;
};

int chm_pf_new(uint64_t window_pages, uint32_t max_handles, struct chm_pf **out)
{
    if (max_handles > (uint32_t)INT32_MAX)
        return CHM_E_ARG;
    struct chm_pf *pf = calloc(1, sizeof *pf);
    if (!pf)
        return CHM_E_NOMEM;
    pf->window_pages = window_pages;
    pf->max_handles = max_handles;
    pf->free_slot = pf->oldest = pf->newest = NONE;
    int rc = map_init(&pf->by_handle, MAP_MIN_SLOTS / 2);
    if (rc) {
        free(pf);
        return rc;
    }
    *out = pf;
    return CHM_OK;
}

void chm_pf_free(struct chm_pf *pf)
{
    if (!pf)
        return;
    free(pf->slots);
    free(pf->fetches);
    map_destroy(&pf->by_handle);
    free(pf);
}

static int32_t pf_new_slot(struct chm_pf *pf)
{
    if (pf->free_slot == NONE) {
        uint32_t count = pf->slot_count ? 2 * pf->slot_count : 8;
        if (count > pf->max_handles)
            count = pf->max_handles;
        struct pf_slot *slots = realloc(pf->slots, (size_t)count * sizeof *slots);
        if (!slots)
            return NONE;
        pf->slots = slots;
        for (uint32_t i = count; i-- > pf->slot_count;) {
            slots[i].newer = pf->free_slot;
            pf->free_slot = (int32_t)i;
        }
        pf->slot_count = count;
    }
    int32_t i = pf->free_slot;
    pf->free_slot = pf->slots[i].newer;
    return i;
}

static int pf_queue_fetches(struct chm_pf *pf, int64_t handle, uint64_t first_page, uint64_t pages)
{
    if (pf->fetch_len == pf->fetch_cap) {
        uint64_t cap = pf->fetch_cap ? 2 * pf->fetch_cap : 16;
        struct pf_fetch *ring = malloc(cap * sizeof *ring);
        if (!ring)
            return CHM_E_NOMEM;
        for (uint64_t i = 0; i < pf->fetch_len; i++)
            ring[i] = pf->fetches[(pf->fetch_head + i) % pf->fetch_cap];
        free(pf->fetches);
        pf->fetches = ring;
        pf->fetch_cap = cap;
        pf->fetch_head = 0;
    }
    struct pf_fetch *f = &pf->fetches[(pf->fetch_head + pf->fetch_len) % pf->fetch_cap];
    f->handle = handle;
    f->next_page = first_page;
    f->end_page = first_page + pages;
    pf->fetch_len++;
    return CHM_OK;
}

int chm_pf_issue(struct chm_pf *pf, int64_t handle, uint64_t first_page, uint64_t pages)
{
    if (map_get(&pf->by_handle, (uint64_t)handle) >= 0)
        return CHM_PF_HANDLE_IN_USE;
    if (pages > pf->window_pages)
        return CHM_PF_NEVER_FITS;
    if (pf->objects >= pf->max_handles)
        return CHM_PF_NO_HANDLE;
#if CHM_MUTATION == CHM_MUTATION_PREFETCH_WINDOW
    if (pf->pages_held + pages >= pf->window_pages)
#else
    if (pf->pages_held + pages > pf->window_pages)
#endif
        return CHM_PF_WINDOW_FULL;
    if (first_page > UINT64_MAX - pages)
        return CHM_E_ARG;
    if (map_reserve_one(&pf->by_handle) || (pages && pf_queue_fetches(pf, handle, first_page, pages)))
        return CHM_E_NOMEM;
    int32_t i = pf_new_slot(pf);
    if (i == NONE) {
        if (pages)
            pf->fetch_len--;  /* take back the fetches just queued */
        return CHM_E_NOMEM;
    }
    struct pf_slot *slot = &pf->slots[i];
    slot->obj = (struct chm_pf_object){handle, first_page, pages, 0};
    slot->older = pf->newest;
    slot->newer = NONE;
    if (pf->newest == NONE)
        pf->oldest = i;
    else
        pf->slots[pf->newest].newer = i;
    pf->newest = i;
    map_put_new(&pf->by_handle, (uint64_t)handle, i);
    pf->objects++;
    pf->pages_held += pages;
    return CHM_OK;
}

int chm_pf_next_fetch(struct chm_pf *pf, int64_t *handle, uint64_t *page)
{
    if (!pf->fetch_len)
        return 0;
    struct pf_fetch *f = &pf->fetches[pf->fetch_head];
    *handle = f->handle;
    *page = f->next_page++;
    if (f->next_page == f->end_page) {
        pf->fetch_head = (pf->fetch_head + 1) % pf->fetch_cap;
        pf->fetch_len--;
    }
    return 1;
}

int chm_pf_arrived(struct chm_pf *pf, int64_t handle, uint64_t *arrived)
{
    int32_t i = map_get(&pf->by_handle, (uint64_t)handle);
    if (i < 0)
        return CHM_PF_UNKNOWN_HANDLE;
    struct chm_pf_object *obj = &pf->slots[i].obj;
    if (obj->arrived >= obj->pages)
        return CHM_PF_TOO_MANY_ARRIVALS;
    *arrived = ++obj->arrived;
    return obj->arrived == obj->pages;
}

int chm_pf_get(const struct chm_pf *pf, int64_t handle, struct chm_pf_object *out)
{
    int32_t i = map_get(&pf->by_handle, (uint64_t)handle);
    if (i < 0)
        return CHM_PF_UNKNOWN_HANDLE;
    *out = pf->slots[i].obj;
    return CHM_OK;
}

int chm_pf_release(struct chm_pf *pf, int64_t handle, struct chm_pf_object *out)
{
    int32_t i = map_get(&pf->by_handle, (uint64_t)handle);
    if (i < 0)
        return CHM_PF_UNKNOWN_HANDLE;
    struct pf_slot *slot = &pf->slots[i];
    *out = slot->obj;
    if (slot->older == NONE)
        pf->oldest = slot->newer;
    else
        pf->slots[slot->older].newer = slot->newer;
    if (slot->newer == NONE)
        pf->newest = slot->older;
    else
        pf->slots[slot->newer].older = slot->older;
    slot->newer = pf->free_slot;
    pf->free_slot = i;
    map_del(&pf->by_handle, (uint64_t)handle);
    pf->objects--;
    pf->pages_held -= out->pages;
    return CHM_OK;
}

uint64_t chm_pf_pages_held(const struct chm_pf *pf) { return pf->pages_held; }
uint32_t chm_pf_objects(const struct chm_pf *pf) { return pf->objects; }

uint32_t chm_pf_handles(const struct chm_pf *pf, int64_t *out, uint32_t max)
{
    uint32_t n = 0;
    for (int32_t i = pf->oldest; i != NONE && n < max; i = pf->slots[i].newer)
        out[n++] = pf->slots[i].obj.handle;
    return n;
}
