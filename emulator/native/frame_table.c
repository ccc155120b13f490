/* The frame table (emulator/frame_table.py's FrameTable): sets of ways, each frame's page, dirty bit and
 * pins, the page index, the free ways; its eviction policy decides through policy.h's table, chosen once
 * by chm_ft_new. */
#include "policy.h"

int chm_core_mutation(void)
{
    return CHM_MUTATION;
}

/* -- free ways: a bitmap per set, lowest way first -- */

static int32_t take_free_way(struct chm_ft *ft, uint32_t set)
{
    struct chm_set *s = &ft->set[set];
    uint64_t *bits = ft->free_bits + (uint64_t)set * ft->words_per_set;
    for (uint32_t w = s->free_hint; w < ft->words_per_set; w++) {
        if (bits[w]) {
            unsigned b = (unsigned)__builtin_ctzll(bits[w]);
            bits[w] &= bits[w] - 1;
            s->free_hint = w;
            s->free_ways--;
            return (int32_t)(set * ft->ways + w * 64 + b);
        }
    }
    return NONE;
}

static void give_free_way(struct chm_ft *ft, uint32_t frame)
{
    uint32_t set = set_of_frame(ft, frame), way = frame - set * ft->ways;
    struct chm_set *s = &ft->set[set];
    ft->free_bits[(uint64_t)set * ft->words_per_set + way / 64] |= 1ull << (way % 64);
    if (way / 64 < s->free_hint)
        s->free_hint = way / 64;
    s->free_ways++;
}

int chm_ft_new(uint32_t frames, uint32_t ways, const struct chm_policy_params *policy, struct chm_ft **out)
{
    struct chm_policy_info info;
    if (!frames || !ways || frames % ways || frames > (uint32_t)INT32_MAX || chm_policy_info(ways, policy, &info))
        return CHM_E_ARG;
    if ((uint64_t)info.ghost_capacity * (frames / ways) > INT32_MAX)
        return CHM_E_ARG;
    struct chm_ft *ft = calloc(1, sizeof *ft);
    if (!ft)
        return CHM_E_NOMEM;
    ft->frames = frames;
    ft->ways = ways;
    ft->sets = frames / ways;
    ft->policy = *policy;
    ft->ops = chm_policy_ops_of(policy->kind);  /* chm_policy_info found it */
    ft->info = info;
    size_t n = frames;
    ft->words_per_set = (ways + 63) / 64;
    ft->page_of = malloc(n * sizeof *ft->page_of);
    ft->dirty = calloc(n, sizeof *ft->dirty);
    ft->pins = calloc(n, sizeof *ft->pins);
    ft->older = malloc(n * sizeof *ft->older);
    ft->newer = malloc(n * sizeof *ft->newer);
    ft->freq = calloc(n, sizeof *ft->freq);
    ft->queue_of = calloc(n, sizeof *ft->queue_of);
    ft->free_bits = calloc((size_t)ft->sets * ft->words_per_set, sizeof *ft->free_bits);
    ft->set = calloc(ft->sets, sizeof *ft->set);
    if (!ft->page_of || !ft->dirty || !ft->pins || !ft->older || !ft->newer || !ft->freq || !ft->queue_of
        || !ft->free_bits || !ft->set)
        goto no_mem;
    int rc = map_init(&ft->index, frames);
    if (rc) {
        chm_ft_free(ft);
        return rc;
    }
    for (size_t f = 0; f < n; f++)
        ft->page_of[f] = CHM_NO_PAGE;
    for (uint32_t set = 0; set < ft->sets; set++) {
        struct chm_set *s = &ft->set[set];
        for (int q = 0; q < QUEUES; q++)
            s->oldest[q] = s->newest[q] = NONE;
        s->hand = NONE;
        s->free_ways = ways;
        uint64_t *bits = ft->free_bits + (size_t)set * ft->words_per_set;
        for (uint32_t w = 0; w < ways / 64; w++)
            bits[w] = ~0ull;
        if (ways % 64)
            bits[ways / 64] = (1ull << (ways % 64)) - 1;
    }
    if (ft->ops->init && (rc = ft->ops->init(ft))) {
        chm_ft_free(ft);
        return rc;
    }
    *out = ft;
    return CHM_OK;
no_mem:
    chm_ft_free(ft);
    return CHM_E_NOMEM;
}

void chm_ft_free(struct chm_ft *ft)
{
    if (!ft)
        return;
    free(ft->page_of);
    free(ft->dirty);
    free(ft->pins);
    free(ft->older);
    free(ft->newer);
    free(ft->freq);
    free(ft->queue_of);
    free(ft->free_bits);
    free(ft->set);
    free(ft->mapped);
    free(ft->dropped);
    map_destroy(&ft->index);
    if (ft->ops && ft->ops->destroy)
        ft->ops->destroy(ft);
    free(ft);
}

int chm_ft_track_mapped(struct chm_ft *ft)
{
    if (ft->mapped)
        return CHM_OK;
    ft->mapped = calloc(ft->frames, 1);
    ft->dropped = calloc(ft->frames, sizeof *ft->dropped);
    if (!ft->mapped || !ft->dropped) {
        free(ft->mapped);
        free(ft->dropped);
        ft->mapped = NULL;
        ft->dropped = NULL;
        return CHM_E_NOMEM;
    }
    return CHM_OK;
}

uint8_t *chm_ft_mapped(struct chm_ft *ft) { return ft->mapped; }
uint32_t *chm_ft_dropped(struct chm_ft *ft, uint32_t *n) { *n = ft->dropped_n; return ft->dropped; }
void chm_ft_clear_dropped(struct chm_ft *ft) { ft->dropped_n = 0; }

void chm_ft_clear_mapped(struct chm_ft *ft)
{
    if (ft->mapped)
        memset(ft->mapped, 0, ft->frames);
    ft->dropped_n = 0;
}

uint64_t *chm_ft_page_of(struct chm_ft *ft) { return ft->page_of; }
uint8_t *chm_ft_dirty(struct chm_ft *ft) { return ft->dirty; }
uint32_t *chm_ft_pins(struct chm_ft *ft) { return ft->pins; }
uint32_t chm_ft_resident(const struct chm_ft *ft) { return ft->resident; }

int64_t chm_ft_free_ways(const struct chm_ft *ft, uint32_t set)
{
    return set < ft->sets ? (int64_t)ft->set[set].free_ways : CHM_E_FRAME;
}

int64_t chm_ft_pinned_ways(const struct chm_ft *ft, uint32_t set)
{
    return set < ft->sets ? (int64_t)ft->set[set].pinned_ways : CHM_E_FRAME;
}

/* -- operations -- */

int64_t chm_ft_lookup(const struct chm_ft *ft, uint64_t page)
{
    return map_get(&ft->index, page);
}

static int check_resident(const struct chm_ft *ft, uint32_t frame)
{
    if (frame >= ft->frames)
        return CHM_E_FRAME;
    return ft->page_of[frame] == CHM_NO_PAGE ? CHM_E_EMPTY : CHM_OK;
}

int chm_ft_touch(struct chm_ft *ft, uint32_t frame)
{
    int rc = check_resident(ft, frame);
    if (!rc)
        ft->ops->hit(ft, &ft->set[set_of_frame(ft, frame)], (int32_t)frame);
    return rc;
}

/* The frame's page leaves (evicted or invalidated): out of the index, the frame free. */
static void drop_page(struct chm_ft *ft, int32_t f)
{
    if (ft->mapped && ft->mapped[f]) {  /* a client may map it: the server must punch it (chm_ft_dropped) */
        ft->mapped[f] = 0;
        ft->dropped[ft->dropped_n++] = (uint32_t)f;
    }
    map_del(&ft->index, ft->page_of[f]);
    ft->page_of[f] = CHM_NO_PAGE;
    ft->dirty[f] = 0;
    ft->resident--;
}

static void place(struct chm_ft *ft, struct chm_set *s, int32_t f, uint64_t page, struct chm_access *out)
{
    ft->page_of[f] = page;
    ft->dirty[f] = 0;
    map_put_new(&ft->index, page, f);
    ft->resident++;
    ft->freq[f] = 0;
    ft->ops->inserted(ft, s, f, page);
    out->frame = (uint32_t)f;
    out->hit = 0;
}

static void report_victim(const struct chm_ft *ft, int32_t f, struct chm_access *out)
{
    out->victim_page = ft->page_of[f];
    out->victim_dirty = ft->dirty[f];
}

/* Insert a page known not to be resident. */
static int insert_absent(struct chm_ft *ft, uint64_t page, struct chm_access *out)
{
    uint32_t set = (uint32_t)(page % ft->sets);
    struct chm_set *s = &ft->set[set];
    int32_t f;
    out->victim_page = CHM_NO_PAGE;
    out->victim_dirty = 0;
    if (s->free_ways) {
        f = take_free_way(ft, set);
    } else {
        if (s->pinned_ways == ft->ways)
            return CHM_ALL_PINNED;
        if (!ft->ops->evict)
            return CHM_NEEDS_VICTIM;
        f = ft->ops->evict(ft, s, 1, page);
        if (f == NONE || pinned(ft, f))
            return CHM_E_INTERNAL;
        report_victim(ft, f, out);
        drop_page(ft, f);
    }
    if (f == NONE)
        return CHM_E_INTERNAL;
    place(ft, s, f, page, out);
    return CHM_OK;
}

int chm_ft_insert(struct chm_ft *ft, uint64_t page, struct chm_access *out)
{
    if (page == CHM_NO_PAGE)
        return CHM_E_ARG;
    if (map_get(&ft->index, page) >= 0)
        return CHM_E_RESIDENT;
    return insert_absent(ft, page, out);
}

int chm_ft_insert_replacing(struct chm_ft *ft, uint64_t page, uint32_t victim_frame, struct chm_access *out)
{
    if (page == CHM_NO_PAGE)
        return CHM_E_ARG;
    if (map_get(&ft->index, page) >= 0)
        return CHM_E_RESIDENT;
    int rc = check_resident(ft, victim_frame);
    if (rc)
        return rc;
    uint32_t set = (uint32_t)(page % ft->sets);
    if (set_of_frame(ft, victim_frame) != set)
        return CHM_E_OTHER_SET;
    if (pinned(ft, (int32_t)victim_frame))
        return CHM_E_PINNED;
    struct chm_set *s = &ft->set[set];
    ft->ops->removed(ft, s, (int32_t)victim_frame);
    report_victim(ft, (int32_t)victim_frame, out);
    drop_page(ft, (int32_t)victim_frame);
    place(ft, s, (int32_t)victim_frame, page, out);
    return CHM_OK;
}

int chm_ft_lookup_or_insert(struct chm_ft *ft, uint64_t page, struct chm_access *out)
{
    if (page == CHM_NO_PAGE)
        return CHM_E_ARG;
    int32_t f = map_get(&ft->index, page);
    if (f >= 0) {
        ft->ops->hit(ft, &ft->set[set_of_frame(ft, (uint32_t)f)], f);
        out->frame = (uint32_t)f;
        out->hit = 1;
        out->victim_page = CHM_NO_PAGE;
        out->victim_dirty = 0;
        return CHM_OK;
    }
    return insert_absent(ft, page, out);
}

int chm_ft_access_many(struct chm_ft *ft, const uint64_t *pages, const uint8_t *writes, uint64_t n,
                       uint8_t *hit_out, struct chm_access_counts *counts)
{
    struct chm_access a;
    memset(counts, 0, sizeof *counts);
    for (uint64_t i = 0; i < n; i++) {
        int rc = chm_ft_lookup_or_insert(ft, pages[i], &a);
        if (rc)
            return rc;
        counts->accesses++;
        if (a.hit) {
            counts->hits++;
        } else {
            counts->misses++;
            if (a.victim_page != CHM_NO_PAGE) {
                counts->evictions++;
                counts->dirty_evictions += a.victim_dirty;
            }
        }
        if (writes && writes[i])
            ft->dirty[a.frame] = 1;
        if (hit_out)
            hit_out[i] = a.hit;
    }
    return CHM_OK;
}

int64_t chm_ft_victim(struct chm_ft *ft, uint64_t page)
{
    struct chm_set *s = &ft->set[page % ft->sets];
    if (s->free_ways || s->pinned_ways == ft->ways)
        return NONE;
    return ft->ops->to_evict(ft, s);
}

int64_t chm_ft_to_evict(struct chm_ft *ft, uint32_t set)
{
    if (set >= ft->sets)
        return CHM_E_FRAME;
    return ft->ops->to_evict(ft, &ft->set[set]);
}

int chm_ft_evict(struct chm_ft *ft, uint32_t set, uint64_t incoming, struct chm_access *out)
{
    if (set >= ft->sets || !ft->ops->evict)
        return CHM_E_ARG;
    if (incoming != CHM_NO_PAGE && incoming % ft->sets != set)
        return CHM_E_OTHER_SET;
    if (incoming != CHM_NO_PAGE && map_get(&ft->index, incoming) >= 0)
        return CHM_E_RESIDENT;
    struct chm_set *s = &ft->set[set];
    int32_t f = ft->ops->evict(ft, s, incoming != CHM_NO_PAGE, incoming);
    if (f == NONE)
        return CHM_ALL_PINNED;
    report_victim(ft, f, out);
    out->frame = (uint32_t)f;
    out->hit = 0;
    drop_page(ft, f);
    give_free_way(ft, (uint32_t)f);
    return CHM_OK;
}

int chm_ft_invalidate(struct chm_ft *ft, uint32_t frame)
{
    int rc = check_resident(ft, frame);
    if (rc)
        return rc;
    if (ft->pins[frame])
        return CHM_E_PINNED;
    ft->ops->removed(ft, &ft->set[set_of_frame(ft, frame)], (int32_t)frame);
    drop_page(ft, (int32_t)frame);
    give_free_way(ft, frame);
    return CHM_OK;
}

int chm_ft_mark_dirty(struct chm_ft *ft, uint32_t frame)
{
    if (frame >= ft->frames)
        return CHM_E_FRAME;
    ft->dirty[frame] = 1;
    return CHM_OK;
}

int chm_ft_clear_dirty(struct chm_ft *ft, uint32_t frame)
{
    if (frame >= ft->frames)
        return CHM_E_FRAME;
    ft->dirty[frame] = 0;
    return CHM_OK;
}

int chm_ft_pin(struct chm_ft *ft, uint32_t frame)
{
    if (frame >= ft->frames)
        return CHM_E_FRAME;
    if (ft->pins[frame] == UINT32_MAX)
        return CHM_E_PIN_LIMIT;
    if (!ft->pins[frame]++)
        ft->set[set_of_frame(ft, frame)].pinned_ways++;
    return CHM_OK;
}

int chm_ft_unpin(struct chm_ft *ft, uint32_t frame)
{
    if (frame >= ft->frames)
        return CHM_E_FRAME;
    if (!ft->pins[frame])
        return CHM_E_NOT_PINNED;
    if (!--ft->pins[frame])
        ft->set[set_of_frame(ft, frame)].pinned_ways--;
    return CHM_OK;
}

int chm_ft_page_pinned(const struct chm_ft *ft, uint64_t page)
{
    int32_t f = map_get(&ft->index, page);
    return f >= 0 && ft->pins[f];
}

uint32_t chm_ft_queue(const struct chm_ft *ft, uint32_t set, uint32_t queue, uint64_t *out, uint32_t max)
{
    if (set >= ft->sets || queue >= QUEUES)
        return 0;
    uint32_t n = 0;
    for (int32_t f = ft->set[set].oldest[queue]; f != NONE; f = ft->newer[f], n++)
        if (n < max)
            out[n] = ft->page_of[f];
    return n;
}

int chm_ft_check(const struct chm_ft *ft)
{
    uint32_t resident = 0;
    INVARIANT(ft->index.count == ft->resident);
    for (uint32_t set = 0; set < ft->sets; set++) {
        const struct chm_set *s = &ft->set[set];
        const uint64_t *bits = ft->free_bits + (size_t)set * ft->words_per_set;
        uint32_t free_ways = 0, pinned_ways = 0, in_queues = 0;
        for (uint32_t way = 0; way < ft->ways; way++) {
            uint32_t f = set * ft->ways + way;
            int is_free = (int)((bits[way / 64] >> (way % 64)) & 1);
            INVARIANT(is_free == (ft->page_of[f] == CHM_NO_PAGE));
            INVARIANT(!is_free || way / 64 >= s->free_hint);
            free_ways += (uint32_t)is_free;
            pinned_ways += ft->pins[f] != 0;
            if (!is_free) {
                resident++;
                INVARIANT(ft->page_of[f] % ft->sets == set);
                INVARIANT(map_get(&ft->index, ft->page_of[f]) == (int32_t)f);
            }
        }
        INVARIANT(free_ways == s->free_ways && pinned_ways == s->pinned_ways);
        for (int q = 0; q < QUEUES; q++) {
            uint32_t len = 0;
            int32_t prev = NONE;
            for (int32_t f = s->oldest[q]; f != NONE; prev = f, f = ft->newer[f]) {
                INVARIANT(len < ft->ways && set_of_frame(ft, (uint32_t)f) == set);
                INVARIANT(ft->page_of[f] != CHM_NO_PAGE && ft->older[f] == prev && ft->queue_of[f] == q);
                len++;
            }
            INVARIANT(prev == s->newest[q] && len == s->len[q]);
            in_queues += len;
        }
        if (ft->ops->evict)  /* a plug-in's table keeps no queues */
            INVARIANT(in_queues == ft->ways - free_ways);
        INVARIANT(s->hand == NONE || (ft->page_of[s->hand] != CHM_NO_PAGE && set_of_frame(ft, (uint32_t)s->hand) == set));
        int rc = ft->ops->check(ft, s);
        if (rc)
            return rc;
    }
    INVARIANT(resident == ft->resident);
    return 0;
}
