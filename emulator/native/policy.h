/* The frame table's eviction policies, as a table of functions (libCacheSim's cache_t does the same):
 * chm_ft_new looks its policy's up once by kind (chm_policy_ops_of) and every decision goes through it.
 * Each policy's .c registers itself (CHM_POLICY): the registry is what the linker gathers in the
 * chm_policies section, so no other file lists the policies.
 *
 * Adding a device policy "foo" (three files, nothing else to edit):
 *   1. emulator/native/policy_foo.c: its functions, `static const struct chm_policy_ops chm_policy_foo =
 *      {.name = "foo", ...}` and `CHM_POLICY(chm_policy_foo);` (policy_lru.c is the smallest; per-set state
 *      goes in struct chm_set / chm_ft of chm_core_internal.h, per-table state is allocated by .init and
 *      freed by .destroy); emulator/native_build.py compiles every *.c here, and the core numbers it
 *      (chm_policy_kind("foo"));
 *   2. emulator/policies/foo.py: a NativeOrder subclass with `native_name = "foo"`, registered
 *      (emulator/policies/sieve.py is the model);
 *   3. one test: its entry in CASES of tests/emulator/test_policy_eviction.py (libCacheSim's cache of the
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
    const char *name;  /* what chm_policy_kind and a Python policy's native_name call it */
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

/* One registered policy: its functions and its kind (chm_policy_params.kind). */
struct chm_policy_entry {
    const struct chm_policy_ops *ops;
    uint32_t kind;  /* a built-in's CHM_POLICY_* of chm_core.h, else CHM_POLICY_UNNUMBERED */
};

#define CHM_POLICY_UNNUMBERED UINT32_MAX
/* An unnumbered policy's kind: this plus its place in the registry (the link order of the sources). */
#define CHM_POLICY_FIRST_UNNUMBERED 64u

/* Registers policy `ops` (a struct chm_policy_ops of its .c, at file scope). CHM_POLICY_NUMBERED: with
 * the number chm_core.h gives a built-in (C callers write CHM_POLICY_LRU). */
#define CHM_POLICY_NUMBERED(ops, number)                                                                   \
    static const struct chm_policy_entry chm_policy_entry_##ops __attribute__((used, section("chm_policies"))) \
        = {&(ops), (number)}
#define CHM_POLICY(ops) CHM_POLICY_NUMBERED(ops, CHM_POLICY_UNNUMBERED)

const struct chm_policy_ops *chm_policy_ops_of(uint32_t kind);  /* NULL: no such policy */

/* What several policies share (policy.c). */
void policy_push_main(struct chm_ft *ft, struct chm_set *s, int32_t f, uint64_t page);  /* inserted: newest of main */
void policy_no_hit(struct chm_ft *ft, struct chm_set *s, int32_t f);
void policy_unlink(struct chm_ft *ft, struct chm_set *s, int32_t f);   /* removed: out of its queue */
int policy_check_no_hand(const struct chm_ft *ft, const struct chm_set *s);  /* only sieve moves a hand */

#pragma GCC visibility pop

#endif
