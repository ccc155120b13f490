/* SIEVE (emulator/policies/sieve.py; libCacheSim's Sieve): a hit sets the page's visited bit; a hand moves
 * from the oldest towards the newest, wrapping round, clearing bits, and evicts the first page not
 * visited; the next eviction starts where it stopped. Pinned pages are passed over and keep their bit. */
#include "policy.h"

static void sieve_hit(struct chm_ft *ft, struct chm_set *s, int32_t f)
{
    (void)s;
    ft->freq[f] = 1;
}

static void sieve_removed(struct chm_ft *ft, struct chm_set *s, int32_t f)
{
    if (s->hand == f)
        s->hand = ft->newer[f];
    q_unlink(ft, s, ft->queue_of[f], f);
}

/* The hand moves from the oldest towards the newest, wrapping round. */
static int32_t sieve_next(const struct chm_ft *ft, const struct chm_set *s, int32_t f)
{
    int32_t n = ft->newer[f];
    return n == NONE ? s->oldest[CHM_QUEUE_MAIN] : n;
}

static int32_t sieve_evict(struct chm_ft *ft, struct chm_set *s, int has_incoming, uint64_t incoming)
{
    (void)has_incoming, (void)incoming;
    if (!s->len[CHM_QUEUE_MAIN])
        return NONE;
    int32_t f = s->hand == NONE ? s->oldest[CHM_QUEUE_MAIN] : s->hand;
    /* within two turns: the first clears every unpinned bit */
    for (uint64_t step = 0, limit = 2 * (uint64_t)s->len[CHM_QUEUE_MAIN] + 1; step < limit; step++) {
        if (!pinned(ft, f)) {
            if (!ft->freq[f]) {
                s->hand = ft->newer[f];
                q_unlink(ft, s, CHM_QUEUE_MAIN, f);
                return f;
            }
            ft->freq[f] = 0;
        }
        f = sieve_next(ft, s, f);
    }
    return NONE;
}

/* Without moving the hand: in one turn the first unpinned frame not visited; after a full turn every
 * unpinned bit would be clear and the hand back where it started, so the first unpinned frame it passed. */
static int32_t sieve_to_evict(struct chm_ft *ft, struct chm_set *s)
{
    int32_t f = s->hand == NONE ? s->oldest[CHM_QUEUE_MAIN] : s->hand;
    int32_t first_unpinned = NONE;
    for (uint32_t i = 0; i < s->len[CHM_QUEUE_MAIN]; i++) {
        if (!pinned(ft, f)) {
            if (!ft->freq[f])
                return f;
            if (first_unpinned == NONE)
                first_unpinned = f;
        }
        f = sieve_next(ft, s, f);
    }
    return first_unpinned;
}

/* The hand, when set, is a frame of this set's queue. */
static int sieve_check(const struct chm_ft *ft, const struct chm_set *s)
{
    INVARIANT(s->hand == NONE || ft->queue_of[s->hand] == CHM_QUEUE_MAIN);
    return 0;
}

static const struct chm_policy_ops chm_policy_sieve = {
    .name = "sieve",
    .inserted = policy_push_main,
    .hit = sieve_hit,
    .removed = sieve_removed,
    .evict = sieve_evict,
    .to_evict = sieve_to_evict,
    .check = sieve_check,
};
CHM_POLICY_NUMBERED(chm_policy_sieve, CHM_POLICY_SIEVE);
