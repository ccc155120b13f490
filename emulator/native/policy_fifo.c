/* FIFO (emulator/policies/fifo.py): a hit changes nothing; the victim is the oldest unpinned page (pinned
 * ones keep their place, and go first once unpinned). */
#include "policy.h"

static int32_t fifo_to_evict(struct chm_ft *ft, struct chm_set *s)
{
    return oldest_unpinned(ft, s);
}

static int32_t fifo_evict(struct chm_ft *ft, struct chm_set *s, int has_incoming, uint64_t incoming)
{
    (void)has_incoming, (void)incoming;
    int32_t f = oldest_unpinned(ft, s);
    if (f != NONE)
        q_unlink(ft, s, CHM_QUEUE_MAIN, f);
    return f;
}

static const struct chm_policy_ops chm_policy_fifo = {
    .name = "fifo",
    .inserted = policy_push_main,
    .hit = policy_no_hit,
    .removed = policy_unlink,
    .evict = fifo_evict,
    .to_evict = fifo_to_evict,
    .check = policy_check_no_hand,
};
CHM_POLICY_NUMBERED(chm_policy_fifo, CHM_POLICY_FIFO);
