/* CLOCK, second chance (emulator/policies/clock.py; libCacheSim's Clock with init_freq=0): a hit adds 1 to
 * the page's counter, up to max_freq = 2**n_bit_counter - 1. */
#include "policy.h"

static int clock_info(uint32_t ways, const struct chm_policy_params *policy, struct chm_policy_info *info)
{
    (void)ways;
    if (policy->n_bit_counter < 1 || policy->n_bit_counter > 31)
        return CHM_E_ARG;
    info->max_freq = (1u << policy->n_bit_counter) - 1;
    return CHM_OK;
}

static void clock_hit(struct chm_ft *ft, struct chm_set *s, int32_t f)
{
    (void)s;
    if (ft->freq[f] < ft->info.max_freq)
        ft->freq[f]++;
}

/* clock: the hand at the oldest; a pinned page passes to the newest end unchanged, a counted one loses 1
 * and goes there, the first at 0 is the victim. Each turn lowers every unpinned counter, so at most
 * max_freq + 1 turns. */
static int32_t clock_evict(struct chm_ft *ft, struct chm_set *s, int has_incoming, uint64_t incoming)
{
    (void)has_incoming, (void)incoming;
    uint64_t limit = ((uint64_t)ft->info.max_freq + 2) * s->len[CHM_QUEUE_MAIN];
    for (uint64_t step = 0; step < limit; step++) {
        int32_t f = s->oldest[CHM_QUEUE_MAIN];
        if (pinned(ft, f)) {
            q_move_newest(ft, s, CHM_QUEUE_MAIN, f);
        } else if (ft->freq[f]) {
            ft->freq[f]--;
            q_move_newest(ft, s, CHM_QUEUE_MAIN, f);
        } else {
            q_unlink(ft, s, CHM_QUEUE_MAIN, f);
            return f;
        }
    }
    return NONE;
}

/* clock without turning the hand: the first unpinned frame (from the oldest) with the smallest counter. */
static int32_t clock_to_evict(struct chm_ft *ft, struct chm_set *s)
{
    int32_t victim = NONE;
    for (int32_t f = s->oldest[CHM_QUEUE_MAIN]; f != NONE; f = ft->newer[f]) {
        if (!pinned(ft, f) && (victim == NONE || ft->freq[f] < ft->freq[victim])) {
            victim = f;
            if (!ft->freq[f])
                break;
        }
    }
    return victim;
}

static const struct chm_policy_ops chm_policy_clock = {
    .name = "clock",
    .info = clock_info,
    .inserted = policy_push_main,
    .hit = clock_hit,
    .removed = policy_unlink,
    .evict = clock_evict,
    .to_evict = clock_to_evict,
    .check = policy_check_no_hand,
};
CHM_POLICY_NUMBERED(chm_policy_clock, CHM_POLICY_CLOCK);
