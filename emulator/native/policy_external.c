/* CHM_POLICY_EXTERNAL: a Python plug-in chooses the victims (emulator/frame_table.py's EvictionPolicy);
 * the table keeps no order of its own and names no victim (chm_ft_insert answers CHM_NEEDS_VICTIM). */
#include "policy.h"

static void external_inserted(struct chm_ft *ft, struct chm_set *s, int32_t f, uint64_t page)
{
    (void)ft, (void)s, (void)f, (void)page;
}

static int32_t external_to_evict(struct chm_ft *ft, struct chm_set *s)
{
    (void)ft, (void)s;
    return NONE;
}

static const struct chm_policy_ops chm_policy_external = {
    .name = "external",
    .inserted = external_inserted,
    .hit = policy_no_hit,     /* the caller tells the plug-in */
    .removed = policy_no_hit,
    .evict = NULL,
    .to_evict = external_to_evict,
    .check = policy_check_no_hand,
};
CHM_POLICY_NUMBERED(chm_policy_external, CHM_POLICY_EXTERNAL);
