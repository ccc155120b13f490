/* LRU (emulator/frame_table.py's LruOrder; the RTL's chm_frame_table): a hit moves the page to the newest
 * end; the victim is the oldest unpinned page (pinned ones keep their place). */
#include "policy.h"

static void lru_hit(struct chm_ft *ft, struct chm_set *s, int32_t f)
{
    q_move_newest(ft, s, CHM_QUEUE_MAIN, f);
}

static int32_t lru_to_evict(struct chm_ft *ft, struct chm_set *s)
{
#if CHM_MUTATION == CHM_MUTATION_LRU_RANK
    for (int32_t f = s->newest[CHM_QUEUE_MAIN]; f != NONE; f = ft->older[f])
        if (!pinned(ft, f))
            return f;
    return NONE;
#else
    return oldest_unpinned(ft, s);
#endif
}

static int32_t lru_evict(struct chm_ft *ft, struct chm_set *s, int has_incoming, uint64_t incoming)
{
    (void)has_incoming, (void)incoming;
    int32_t f = lru_to_evict(ft, s);
    if (f != NONE)
        q_unlink(ft, s, CHM_QUEUE_MAIN, f);
    return f;
}

static const struct chm_policy_ops chm_policy_lru = {
    .name = "lru",
    .inserted = policy_push_main,
    .hit = lru_hit,
    .removed = policy_unlink,
    .evict = lru_evict,
    .to_evict = lru_to_evict,
    .check = policy_check_no_hand,
};
CHM_POLICY_NUMBERED(chm_policy_lru, CHM_POLICY_LRU);
