/* The policies' table by kind (policy.h), chm_policy_info, and what several policies share. */
#include "policy.h"

static const struct chm_policy_ops *const chm_policies[] = {
    [CHM_POLICY_EXTERNAL] = &chm_policy_external,
    [CHM_POLICY_LRU] = &chm_policy_lru,
    [CHM_POLICY_FIFO] = &chm_policy_fifo,
    [CHM_POLICY_CLOCK] = &chm_policy_clock,
    [CHM_POLICY_SIEVE] = &chm_policy_sieve,
    [CHM_POLICY_S3FIFO] = &chm_policy_s3fifo,
};

const struct chm_policy_ops *chm_policy_ops_of(uint32_t kind)
{
    return kind < sizeof chm_policies / sizeof *chm_policies ? chm_policies[kind] : NULL;
}

int chm_policy_info(uint32_t ways, const struct chm_policy_params *policy, struct chm_policy_info *out)
{
    struct chm_policy_info info = {0};
    const struct chm_policy_ops *ops = chm_policy_ops_of(policy->kind);
    if (!ways || !ops)
        return CHM_E_ARG;
    if (ops->info) {
        int rc = ops->info(ways, policy, &info);
        if (rc)
            return rc;
    }
    *out = info;
    return CHM_OK;
}

void policy_push_main(struct chm_ft *ft, struct chm_set *s, int32_t f, uint64_t page)
{
    (void)page;
    q_push_newest(ft, s, CHM_QUEUE_MAIN, f);
}

void policy_no_hit(struct chm_ft *ft, struct chm_set *s, int32_t f)
{
    (void)ft, (void)s, (void)f;
}

void policy_unlink(struct chm_ft *ft, struct chm_set *s, int32_t f)
{
    q_unlink(ft, s, ft->queue_of[f], f);
}

int policy_check_no_hand(const struct chm_ft *ft, const struct chm_set *s)
{
    (void)ft;
    INVARIANT(s->hand == NONE);
    return 0;
}
