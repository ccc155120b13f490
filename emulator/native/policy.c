/* The policies' registry (policy.h): by kind and by name, chm_policy_info, and what several policies share. */
#include <string.h>

#include "policy.h"

/* The registry: every policy's CHM_POLICY entry, gathered by the linker (GNU ld defines these two). */
extern const struct chm_policy_entry __start_chm_policies[], __stop_chm_policies[];

static uint32_t policy_kind_of(const struct chm_policy_entry *e)
{
    return e->kind != CHM_POLICY_UNNUMBERED ? e->kind
                                            : CHM_POLICY_FIRST_UNNUMBERED + (uint32_t)(e - __start_chm_policies);
}

const struct chm_policy_ops *chm_policy_ops_of(uint32_t kind)
{
    for (const struct chm_policy_entry *e = __start_chm_policies; e < __stop_chm_policies; e++)
        if (policy_kind_of(e) == kind)
            return e->ops;
    return NULL;
}

int64_t chm_policy_kind(const char *name)
{
    for (const struct chm_policy_entry *e = __start_chm_policies; e < __stop_chm_policies; e++)
        if (!strcmp(e->ops->name, name))
            return policy_kind_of(e);
    return -1;
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
