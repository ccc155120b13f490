/* The frame table's eviction policies, as a table of functions (libCacheSim's cache_t does the same):
 * chm_ft_new looks its policy's up once by kind (chm_policy_ops_of) and every decision goes through it.
 *
 * Adding a device policy "foo":
 *   1. policy_foo.c: its functions and `const struct chm_policy_ops chm_policy_foo = {.kind = ..., ...}`
 *      (policy_lru.c is the smallest; per-set state goes in struct chm_set / chm_ft of
 *      chm_core_internal.h, per-table state is allocated by .init and freed by .destroy);
 *   2. its number: CHM_POLICY_FOO in chm_core.h, its line in chm_policies[] (policy.c) and its
 *      declaration below; emulator/native_build.py compiles every *.c here;
 *   3. emulator/policies/foo.py: a NativeOrder subclass with `kind = lib.CHM_POLICY_FOO`, registered
 *      (emulator/policies/sieve.py is the model);
 *   4. one test: its entry in CASES of tests/emulator/test_policy_eviction.py (libCacheSim's cache of the
 *      same algorithm), which runs every test there on it: hits and victims against libCacheSim,
 *      to_evict, pinned pages, invalidation.
 * Then chm_ft_check (tests/emulator/native_core_stress.c under ASan) and the DRAM-hit read take it as they
 * are; the native sequential path takes the built-in classes only (controller._policy_runs_sequentially).
 */
#ifndef CHM_POLICY_H
#define CHM_POLICY_H

#include "chm_core_internal.h"

#pragma GCC visibility push(hidden)

struct chm_policy_ops {
    uint32_t kind;  /* CHM_POLICY_* (stats and errors only: decisions go through the functions) */
    /* The sizes it derives for a set of `ways` ways (out is zeroed); CHM_E_ARG for parameters it cannot
     * work with. NULL: none. */
    int (*info)(uint32_t ways, const struct chm_policy_params *params, struct chm_policy_info *out);
    /* Its own state, once the table's is allocated and its sets initialised; CHM_E_*. NULL: none. */
    int (*init)(struct chm_ft *ft);
    void (*destroy)(struct chm_ft *ft);  /* frees what init allocated (also after a failed init); NULL: none */
    /* Page `page` was placed in frame f (its freq is 0). */
    void (*inserted)(struct chm_ft *ft, struct chm_set *s, int32_t f, uint64_t page);
    void (*hit)(struct chm_ft *ft, struct chm_set *s, int32_t f);
    /* f's page leaves without an eviction (invalidated, or replaced by a victim the caller named). */
    void (*removed)(struct chm_ft *ft, struct chm_set *s, int32_t f);
    /* A victim among the set's unpinned resident frames, dropped from the policy's order; NONE: every
     * one is pinned. has_incoming: `incoming` is the page that will take its place. NULL: the policy
     * chooses no victims (a Python plug-in does: chm_ft_insert answers CHM_NEEDS_VICTIM). */
    int32_t (*evict)(struct chm_ft *ft, struct chm_set *s, int has_incoming, uint64_t incoming);
    /* The victim evict would choose now, changing nothing; NONE: none. */
    int32_t (*to_evict)(struct chm_ft *ft, struct chm_set *s);
    /* Its invariants on set s (chm_ft_check): 0, or the line of the first broken (INVARIANT). */
    int (*check)(const struct chm_ft *ft, const struct chm_set *s);
};

extern const struct chm_policy_ops chm_policy_external, chm_policy_lru, chm_policy_fifo, chm_policy_clock,
    chm_policy_sieve, chm_policy_s3fifo;

const struct chm_policy_ops *chm_policy_ops_of(uint32_t kind);  /* NULL: no such policy */

/* What several policies share (policy.c). */
void policy_push_main(struct chm_ft *ft, struct chm_set *s, int32_t f, uint64_t page);  /* inserted: newest of main */
void policy_no_hit(struct chm_ft *ft, struct chm_set *s, int32_t f);
void policy_unlink(struct chm_ft *ft, struct chm_set *s, int32_t f);   /* removed: out of its queue */
int policy_check_no_hand(const struct chm_ft *ft, const struct chm_set *s);  /* only sieve moves a hand */

#pragma GCC visibility pop

#endif
