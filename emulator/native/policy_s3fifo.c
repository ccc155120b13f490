/* S3-FIFO (emulator/policies/s3fifo.py; libCacheSim's S3FIFO): a small FIFO queue, a main queue (a CLOCK)
 * and a ghost of the page numbers evicted from the small queue; a page the ghost remembers goes to main. */
#include "policy.h"

#define S3FIFO_MAIN_MAX_FREQ 3  /* libCacheSim's main queue is a CLOCK with a 2-bit counter */

static int s3fifo_info(uint32_t ways, const struct chm_policy_params *policy, struct chm_policy_info *info)
{
    /* integer parts as libCacheSim computes them (int64 times double, truncated) */
    double small = (double)ways * policy->small_size_ratio, ghost = (double)ways * policy->ghost_size_ratio;
    if (!(small >= 0 && small <= ways) || !(ghost >= 0 && ghost < INT32_MAX))
        return CHM_E_ARG;
    info->small_capacity = (uint32_t)small;
    info->main_capacity = ways - info->small_capacity;
    info->ghost_capacity = (uint32_t)ghost;
    info->threshold = policy->move_to_main_threshold;
    return CHM_OK;
}

/* The ghost's nodes, each set's free list its own nodes in order, and the scratch of s3fifo_to_evict. */
static int s3fifo_init(struct chm_ft *ft)
{
    size_t nodes = (size_t)ft->sets * ft->info.ghost_capacity, ways = ft->ways;
    ft->ghost_page = malloc((nodes ? nodes : 1) * sizeof *ft->ghost_page);
    ft->ghost_older = malloc((nodes ? nodes : 1) * sizeof *ft->ghost_older);
    ft->ghost_newer = malloc((nodes ? nodes : 1) * sizeof *ft->ghost_newer);
    ft->save_older = malloc(ways * sizeof *ft->save_older);
    ft->save_newer = malloc(ways * sizeof *ft->save_newer);
    ft->save_freq = malloc(ways * sizeof *ft->save_freq);
    ft->save_queue_of = malloc(ways * sizeof *ft->save_queue_of);
    if (!ft->ghost_page || !ft->ghost_older || !ft->ghost_newer || !ft->save_older || !ft->save_newer
        || !ft->save_freq || !ft->save_queue_of)
        return CHM_E_NOMEM;
    int rc = map_init(&ft->ghost_index, nodes);
    if (rc)
        return rc;
    for (size_t g = 0; g < nodes; g++)
        ft->ghost_newer[g] = (g + 1) % ft->info.ghost_capacity ? (int32_t)(g + 1) : NONE;
    for (uint32_t set = 0; set < ft->sets; set++) {
        struct chm_set *s = &ft->set[set];
        s->ghost_oldest = s->ghost_newest = NONE;
        s->ghost_free = ft->info.ghost_capacity ? (int32_t)(set * ft->info.ghost_capacity) : NONE;
    }
    return CHM_OK;
}

static void s3fifo_destroy(struct chm_ft *ft)
{
    free(ft->ghost_page);
    free(ft->ghost_older);
    free(ft->ghost_newer);
    map_destroy(&ft->ghost_index);
    free(ft->save_older);
    free(ft->save_newer);
    free(ft->save_freq);
    free(ft->save_queue_of);
}

/* -- the ghost: a FIFO of page numbers with removal anywhere -- */

static int32_t ghost_node_base(const struct chm_ft *ft, const struct chm_set *s)
{
    return (int32_t)((uint32_t)(s - ft->set) * ft->info.ghost_capacity);
}

static int ghost_take(struct chm_ft *ft, struct chm_set *s, uint64_t page)
{
    if (!ft->info.ghost_capacity)
        return 0;
    int32_t g = map_get(&ft->ghost_index, page);
    if (g < 0)
        return 0;
    int32_t o = ft->ghost_older[g], n = ft->ghost_newer[g];
    if (o == NONE)
        s->ghost_oldest = n;
    else
        ft->ghost_newer[o] = n;
    if (n == NONE)
        s->ghost_newest = o;
    else
        ft->ghost_older[n] = o;
    s->ghost_len--;
    map_del(&ft->ghost_index, page);
    ft->ghost_newer[g] = s->ghost_free;
    s->ghost_free = g;
    return 1;
}

static void ghost_push(struct chm_ft *ft, struct chm_set *s, uint64_t page)
{
    while (s->ghost_len >= ft->info.ghost_capacity)
        ghost_take(ft, s, ft->ghost_page[s->ghost_oldest]);
    int32_t g = s->ghost_free;
    s->ghost_free = ft->ghost_newer[g];
    ft->ghost_page[g] = page;
    ft->ghost_older[g] = s->ghost_newest;
    ft->ghost_newer[g] = NONE;
    if (s->ghost_newest == NONE)
        s->ghost_oldest = g;
    else
        ft->ghost_newer[s->ghost_newest] = g;
    s->ghost_newest = g;
    s->ghost_len++;
    map_put_new(&ft->ghost_index, page, g);
}

/* -- the policy -- */

static void s3fifo_inserted(struct chm_ft *ft, struct chm_set *s, int32_t f, uint64_t page)
{
    int in_ghost;
    if (s->ghost_claimed && s->claimed_page == page) {
        s->ghost_claimed = 0;
        in_ghost = 1;
    } else {
        in_ghost = ghost_take(ft, s, page);
    }
    int to_main = in_ghost || (!s->has_evicted && s->len[CHM_QUEUE_SMALL] >= ft->info.small_capacity);
    q_push_newest(ft, s, to_main ? CHM_QUEUE_MAIN : CHM_QUEUE_SMALL, f);
}

static void s3fifo_hit(struct chm_ft *ft, struct chm_set *s, int32_t f)
{
    (void)s;
    SATURATING_INC(ft->freq[f]);
}

/* The small queue: pinned pages pass to its newest end; a page hit at least `threshold` times
 * moves to the main queue; the first other page is the victim, and its number goes to the ghost. */
static int32_t s3fifo_evict_small(struct chm_ft *ft, struct chm_set *s, int dry)
{
    uint32_t passed = 0;
    while (s->len[CHM_QUEUE_SMALL] && passed < s->len[CHM_QUEUE_SMALL]) {
        int32_t f = s->oldest[CHM_QUEUE_SMALL];
        if (pinned(ft, f)) {
            q_move_newest(ft, s, CHM_QUEUE_SMALL, f);
            passed++;
            continue;
        }
        q_unlink(ft, s, CHM_QUEUE_SMALL, f);
        if (ft->freq[f] >= ft->info.threshold) {
            q_push_newest(ft, s, CHM_QUEUE_MAIN, f);
            ft->freq[f] = 0;
            continue;
        }
        if (ft->info.ghost_capacity && !dry)
            ghost_push(ft, s, ft->page_of[f]);
        return f;
    }
    return NONE;
}

/* The main queue: a CLOCK; a whole turn of pinned pages means every page here is pinned. */
static int32_t s3fifo_evict_main(struct chm_ft *ft, struct chm_set *s)
{
    uint32_t pinned_run = 0;
    while (s->len[CHM_QUEUE_MAIN] && pinned_run < s->len[CHM_QUEUE_MAIN]) {
        int32_t f = s->oldest[CHM_QUEUE_MAIN];
        if (pinned(ft, f)) {
            q_move_newest(ft, s, CHM_QUEUE_MAIN, f);
            pinned_run++;
            continue;
        }
        pinned_run = 0;
        if (!ft->freq[f]) {
            q_unlink(ft, s, CHM_QUEUE_MAIN, f);
            return f;
        }
        uint32_t capped = ft->freq[f] < S3FIFO_MAIN_MAX_FREQ ? ft->freq[f] : S3FIFO_MAIN_MAX_FREQ;
        ft->freq[f] = capped - 1;
        q_move_newest(ft, s, CHM_QUEUE_MAIN, f);
    }
    return NONE;
}

static int32_t s3fifo_evict_maybe_dry(struct chm_ft *ft, struct chm_set *s, int has_incoming, uint64_t incoming, int dry)
{
    if (has_incoming && !dry) {
        s->ghost_claimed = (uint8_t)ghost_take(ft, s, incoming);
        s->claimed_page = incoming;
    }
    s->has_evicted = 1;
    for (int round = 0; round < 2; round++) {  /* a second round after the small queue moved pages to main */
        int32_t victim;
        if (s->len[CHM_QUEUE_MAIN] > ft->info.main_capacity || !s->len[CHM_QUEUE_SMALL]) {
            victim = s3fifo_evict_main(ft, s);
            if (victim == NONE)
                victim = s3fifo_evict_small(ft, s, dry);
        } else {
            victim = s3fifo_evict_small(ft, s, dry);
            if (victim == NONE)
                victim = s3fifo_evict_main(ft, s);
        }
        if (victim != NONE)
            return victim;
    }
    return NONE;
}

/* Without changing anything: evict on the set's state, then put it back (the ghost is left alone:
 * it does not decide the victim). */
static int32_t s3fifo_to_evict(struct chm_ft *ft, struct chm_set *s)
{
    uint32_t base = (uint32_t)(s - ft->set) * ft->ways, n = ft->ways;
    struct chm_set saved = *s;
    memcpy(ft->save_older, ft->older + base, n * sizeof *ft->older);
    memcpy(ft->save_newer, ft->newer + base, n * sizeof *ft->newer);
    memcpy(ft->save_freq, ft->freq + base, n * sizeof *ft->freq);
    memcpy(ft->save_queue_of, ft->queue_of + base, n * sizeof *ft->queue_of);
    int32_t victim = s3fifo_evict_maybe_dry(ft, s, 0, 0, 1);
    *s = saved;
    memcpy(ft->older + base, ft->save_older, n * sizeof *ft->older);
    memcpy(ft->newer + base, ft->save_newer, n * sizeof *ft->newer);
    memcpy(ft->freq + base, ft->save_freq, n * sizeof *ft->freq);
    memcpy(ft->queue_of + base, ft->save_queue_of, n * sizeof *ft->queue_of);
    return victim;
}


static int32_t s3fifo_evict(struct chm_ft *ft, struct chm_set *s, int has_incoming, uint64_t incoming)
{
    return s3fifo_evict_maybe_dry(ft, s, has_incoming, incoming, 0);
}

/* No resident page is in the ghost; the ghost's list and its free list hold the set's nodes. */
static int s3fifo_check(const struct chm_ft *ft, const struct chm_set *s)
{
    uint32_t set = (uint32_t)(s - ft->set);
    for (uint32_t f = set * ft->ways; f < (set + 1) * ft->ways; f++)
        if (ft->page_of[f] != CHM_NO_PAGE)
            INVARIANT(map_get(&ft->ghost_index, ft->page_of[f]) < 0);
    int rc = policy_check_no_hand(ft, s);
    if (rc)
        return rc;
    uint32_t len = 0, spare = 0;
    for (int32_t g = s->ghost_oldest; g != NONE; g = ft->ghost_newer[g]) {
        INVARIANT(len < ft->info.ghost_capacity && g >= ghost_node_base(ft, s));
        INVARIANT(map_get(&ft->ghost_index, ft->ghost_page[g]) == g);
        len++;
    }
    for (int32_t g = s->ghost_free; g != NONE; g = ft->ghost_newer[g])
        INVARIANT(++spare <= ft->info.ghost_capacity);
    INVARIANT(len == s->ghost_len && len + spare == ft->info.ghost_capacity);
    return 0;
}

static const struct chm_policy_ops chm_policy_s3fifo = {
    .name = "s3fifo",
    .info = s3fifo_info,
    .init = s3fifo_init,
    .destroy = s3fifo_destroy,
    .inserted = s3fifo_inserted,
    .hit = s3fifo_hit,
    .removed = policy_unlink,
    .evict = s3fifo_evict,
    .to_evict = s3fifo_to_evict,
    .check = s3fifo_check,
};
CHM_POLICY_NUMBERED(chm_policy_s3fifo, CHM_POLICY_S3FIFO);
