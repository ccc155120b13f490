/* The device model's native core (see chm_core.h). The decisions mirror, one
 * for one, the specifications in emulator/frame_table.py and
 * emulator/policies/{lru,fifo,clock,sieve,s3fifo}.py (libCacheSim's
 * algorithms, with the device's pinned frames); the property tests in
 * tests/emulator/test_native_core.py check them against the former Python
 * implementations, kept there as models. The timing resources and the
 * DRAM-hit read compute as emulator/timing.py and Controller.read do
 * (tests/emulator/test_native_hits.py runs workloads both ways); the
 * sequential path as Controller.read, write and flush do
 * (tests/emulator/test_native_sequential.py, likewise).
 */
#include "chm_core.h"

#include <stdlib.h>
#include <string.h>

#ifndef CHM_MUTATION
#define CHM_MUTATION CHM_MUTATION_NONE
#endif

int chm_core_mutation(void)
{
    return CHM_MUTATION;
}

/* ---- a hash map uint64 -> int32 (open addressing, linear probing, backward-shift deletion) ---- */

struct chm_map {
    uint64_t *keys;
    int32_t *values;  /* -1: an empty slot */
    uint32_t mask;
    uint32_t count;
    unsigned shift;   /* 64 - log2(slots): Fibonacci hashing takes the top bits */
};

#define MAP_MIN_SLOTS 8u

static uint32_t map_home(const struct chm_map *m, uint64_t key)
{
    return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> m->shift);
}

/* Slots for `entries` at a load of at most 1/2. */
static int map_init(struct chm_map *m, uint64_t entries)
{
    uint64_t slots = MAP_MIN_SLOTS;
    unsigned bits = 3;
    while (slots < 2 * entries) {
        slots <<= 1;
        bits++;
    }
    if (slots > (1ull << 31))
        return CHM_E_ARG;
    m->keys = malloc(slots * sizeof *m->keys);
    m->values = malloc(slots * sizeof *m->values);
    if (!m->keys || !m->values) {
        free(m->keys);
        free(m->values);
        m->keys = NULL;
        m->values = NULL;
        return CHM_E_NOMEM;
    }
    memset(m->values, 0xff, slots * sizeof *m->values);
    m->mask = (uint32_t)(slots - 1);
    m->count = 0;
    m->shift = 64 - bits;
    return CHM_OK;
}

static void map_destroy(struct chm_map *m)
{
    free(m->keys);
    free(m->values);
}

static int32_t map_get(const struct chm_map *m, uint64_t key)
{
    for (uint32_t i = map_home(m, key);; i = (i + 1) & m->mask) {
        int32_t v = m->values[i];
        if (v < 0 || m->keys[i] == key)
            return v;
    }
}

/* Put a key that is not there (the caller knows); the map has room for it. */
static void map_put_new(struct chm_map *m, uint64_t key, int32_t value)
{
    uint32_t i = map_home(m, key);
    while (m->values[i] >= 0)
        i = (i + 1) & m->mask;
    m->keys[i] = key;
    m->values[i] = value;
    m->count++;
}

/* Twice the slots when over half full (maps whose size is not known in advance). */
static int map_reserve_one(struct chm_map *m)
{
    if (2 * ((uint64_t)m->count + 1) <= (uint64_t)m->mask + 1)
        return CHM_OK;
    struct chm_map bigger;
    int rc = map_init(&bigger, (uint64_t)m->mask + 1);
    if (rc)
        return rc;
    for (uint32_t i = 0; i <= m->mask; i++)
        if (m->values[i] >= 0)
            map_put_new(&bigger, m->keys[i], m->values[i]);
    map_destroy(m);
    *m = bigger;
    return CHM_OK;
}

static void map_del(struct chm_map *m, uint64_t key)
{
    uint32_t i = map_home(m, key);
    while (m->values[i] >= 0 && m->keys[i] != key)
        i = (i + 1) & m->mask;
    if (m->values[i] < 0)
        return;
    /* Shift back every later entry of the run whose home is not in (i, j]: no tombstones. */
    for (uint32_t j = i;;) {
        j = (j + 1) & m->mask;
        if (m->values[j] < 0)
            break;
        uint32_t home = map_home(m, m->keys[j]);
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            m->keys[i] = m->keys[j];
            m->values[i] = m->values[j];
            i = j;
        }
    }
    m->values[i] = -1;
    m->count--;
}

/* ---- the frame table ---- */

#define QUEUES 2
#define NONE (-1)

struct chm_set {
    int32_t oldest[QUEUES];  /* per queue: its oldest and newest frame, NONE when empty */
    int32_t newest[QUEUES];
    uint32_t len[QUEUES];
    uint32_t free_ways;
    uint32_t pinned_ways;    /* frames with a pin count, resident or not */
    uint32_t free_hint;      /* no free way in the bitmap words before this one */
    int32_t hand;            /* sieve: the frame the hand looks at next; NONE: the oldest */
    uint8_t has_evicted;     /* s3fifo: before the first eviction a full small queue sends pages to main */
    uint8_t ghost_claimed;   /* s3fifo: evict() took claimed_page out of the ghost (libCacheSim looks the */
    uint64_t claimed_page;   /*   miss up before it evicts); the insert that follows uses it */
    int32_t ghost_oldest;    /* s3fifo: the ghost FIFO (page numbers), nodes of this set's pool */
    int32_t ghost_newest;
    int32_t ghost_free;
    uint32_t ghost_len;
};

struct chm_ft {
    uint32_t frames, ways, sets, resident;
    struct chm_policy_params policy;
    struct chm_policy_info info;
    uint64_t *page_of;
    uint8_t *dirty;
    uint32_t *pins;
    int32_t *older, *newer;  /* queue links, by frame */
    uint32_t *freq;          /* clock: counter; sieve: visited bit; s3fifo: hits */
    uint8_t *queue_of;       /* the queue a resident frame is in */
    uint64_t *free_bits;     /* per set, words_per_set words: bit w = way w is free */
    uint32_t words_per_set;
    struct chm_set *set;
    struct chm_map index;    /* page -> frame */
    uint64_t *ghost_page;    /* s3fifo: sets * ghost_capacity nodes */
    int32_t *ghost_older, *ghost_newer;
    struct chm_map ghost_index;  /* page -> ghost node */
    /* scratch for s3fifo's to_evict: the set's state, evicted on a copy and put back */
    int32_t *save_older, *save_newer;
    uint32_t *save_freq;
    uint8_t *save_queue_of;
};

#define SATURATING_INC(x) ((x) += (x) != UINT32_MAX)
#define S3FIFO_MAIN_MAX_FREQ 3  /* libCacheSim's main queue is a CLOCK with a 2-bit counter */

static uint32_t set_of_frame(const struct chm_ft *ft, uint32_t frame)
{
    return frame / ft->ways;
}

static int pinned(const struct chm_ft *ft, int32_t frame)
{
    return ft->pins[frame] != 0;
}

/* -- queues: doubly linked lists of frames, oldest to newest -- */

static void q_push_newest(struct chm_ft *ft, struct chm_set *s, int q, int32_t f)
{
    ft->older[f] = s->newest[q];
    ft->newer[f] = NONE;
    if (s->newest[q] == NONE)
        s->oldest[q] = f;
    else
        ft->newer[s->newest[q]] = f;
    s->newest[q] = f;
    s->len[q]++;
    ft->queue_of[f] = (uint8_t)q;
}

static void q_unlink(struct chm_ft *ft, struct chm_set *s, int q, int32_t f)
{
    int32_t o = ft->older[f], n = ft->newer[f];
    if (o == NONE)
        s->oldest[q] = n;
    else
        ft->newer[o] = n;
    if (n == NONE)
        s->newest[q] = o;
    else
        ft->older[n] = o;
    s->len[q]--;
}

static void q_move_newest(struct chm_ft *ft, struct chm_set *s, int q, int32_t f)
{
    if (s->newest[q] != f) {
        q_unlink(ft, s, q, f);
        q_push_newest(ft, s, q, f);
    }
}

/* -- s3fifo's ghost: a FIFO of page numbers with removal anywhere -- */

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

/* -- the eviction policies: a page arrived, was hit, left; choose a victim -- */

static void policy_inserted(struct chm_ft *ft, struct chm_set *s, int32_t f, uint64_t page)
{
    ft->freq[f] = 0;
    switch (ft->policy.kind) {
    case CHM_POLICY_EXTERNAL:
        return;
    case CHM_POLICY_S3FIFO: {
        int in_ghost;
        if (s->ghost_claimed && s->claimed_page == page) {
            s->ghost_claimed = 0;
            in_ghost = 1;
        } else {
            in_ghost = ghost_take(ft, s, page);
        }
        int to_main = in_ghost || (!s->has_evicted && s->len[CHM_QUEUE_SMALL] >= ft->info.small_capacity);
        q_push_newest(ft, s, to_main ? CHM_QUEUE_MAIN : CHM_QUEUE_SMALL, f);
        return;
    }
    default:
        q_push_newest(ft, s, CHM_QUEUE_MAIN, f);
    }
}

static void policy_hit(struct chm_ft *ft, struct chm_set *s, int32_t f)
{
    switch (ft->policy.kind) {
    case CHM_POLICY_LRU:
        q_move_newest(ft, s, CHM_QUEUE_MAIN, f);
        break;
    case CHM_POLICY_CLOCK:
        if (ft->freq[f] < ft->info.max_freq)
            ft->freq[f]++;
        break;
    case CHM_POLICY_SIEVE:
        ft->freq[f] = 1;
        break;
    case CHM_POLICY_S3FIFO:
        SATURATING_INC(ft->freq[f]);
        break;
    default:  /* fifo: a hit changes nothing; external: the plug-in is told by the caller */
        break;
    }
}

static void policy_removed(struct chm_ft *ft, struct chm_set *s, int32_t f)
{
    switch (ft->policy.kind) {
    case CHM_POLICY_EXTERNAL:
        return;
    case CHM_POLICY_SIEVE:
        if (s->hand == f)
            s->hand = ft->newer[f];
        break;
    default:
        break;
    }
    q_unlink(ft, s, ft->queue_of[f], f);
}

/* lru, fifo: the oldest unpinned frame (pinned ones keep their place). */
static int32_t oldest_unpinned(const struct chm_ft *ft, const struct chm_set *s)
{
#if CHM_MUTATION == CHM_MUTATION_LRU_RANK
    if (ft->policy.kind == CHM_POLICY_LRU) {
        for (int32_t f = s->newest[CHM_QUEUE_MAIN]; f != NONE; f = ft->older[f])
            if (!pinned(ft, f))
                return f;
        return NONE;
    }
#endif
    for (int32_t f = s->oldest[CHM_QUEUE_MAIN]; f != NONE; f = ft->newer[f])
        if (!pinned(ft, f))
            return f;
    return NONE;
}

/* clock: the hand at the oldest; a pinned page passes to the newest end unchanged, a counted one loses 1
 * and goes there, the first at 0 is the victim. Each turn lowers every unpinned counter, so at most
 * max_freq + 1 turns. */
static int32_t clock_evict(struct chm_ft *ft, struct chm_set *s)
{
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
static int32_t clock_to_evict(const struct chm_ft *ft, const struct chm_set *s)
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

/* sieve: the hand moves from the oldest towards the newest, wrapping round. */
static int32_t sieve_next(const struct chm_ft *ft, const struct chm_set *s, int32_t f)
{
    int32_t n = ft->newer[f];
    return n == NONE ? s->oldest[CHM_QUEUE_MAIN] : n;
}

static int32_t sieve_evict(struct chm_ft *ft, struct chm_set *s)
{
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

/* sieve without moving the hand: in one turn the first unpinned frame not visited; after a full turn every
 * unpinned bit would be clear and the hand back where it started, so the first unpinned frame it passed. */
static int32_t sieve_to_evict(const struct chm_ft *ft, const struct chm_set *s)
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

/* s3fifo, the small queue: pinned pages pass to its newest end; a page hit at least `threshold` times
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

/* s3fifo, the main queue: a CLOCK; a whole turn of pinned pages means every page here is pinned. */
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

static int32_t s3fifo_evict(struct chm_ft *ft, struct chm_set *s, int has_incoming, uint64_t incoming, int dry)
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

/* s3fifo without changing anything: evict on the set's state, then put it back (the ghost is left alone:
 * it does not decide the victim). */
static int32_t s3fifo_to_evict(struct chm_ft *ft, struct chm_set *s)
{
    uint32_t base = (uint32_t)(s - ft->set) * ft->ways, n = ft->ways;
    struct chm_set saved = *s;
    memcpy(ft->save_older, ft->older + base, n * sizeof *ft->older);
    memcpy(ft->save_newer, ft->newer + base, n * sizeof *ft->newer);
    memcpy(ft->save_freq, ft->freq + base, n * sizeof *ft->freq);
    memcpy(ft->save_queue_of, ft->queue_of + base, n * sizeof *ft->queue_of);
    int32_t victim = s3fifo_evict(ft, s, 0, 0, 1);
    *s = saved;
    memcpy(ft->older + base, ft->save_older, n * sizeof *ft->older);
    memcpy(ft->newer + base, ft->save_newer, n * sizeof *ft->newer);
    memcpy(ft->freq + base, ft->save_freq, n * sizeof *ft->freq);
    memcpy(ft->queue_of + base, ft->save_queue_of, n * sizeof *ft->queue_of);
    return victim;
}

/* Choose a victim among the set's unpinned resident frames and drop it from the policy's order. */
static int32_t policy_evict(struct chm_ft *ft, struct chm_set *s, int has_incoming, uint64_t incoming)
{
    int32_t f;
    switch (ft->policy.kind) {
    case CHM_POLICY_LRU:
    case CHM_POLICY_FIFO:
        f = oldest_unpinned(ft, s);
        if (f != NONE)
            q_unlink(ft, s, CHM_QUEUE_MAIN, f);
        return f;
    case CHM_POLICY_CLOCK:
        return clock_evict(ft, s);
    case CHM_POLICY_SIEVE:
        return sieve_evict(ft, s);
    case CHM_POLICY_S3FIFO:
        return s3fifo_evict(ft, s, has_incoming, incoming, 0);
    default:
        return NONE;
    }
}

static int32_t policy_to_evict(struct chm_ft *ft, struct chm_set *s)
{
    switch (ft->policy.kind) {
    case CHM_POLICY_LRU:
    case CHM_POLICY_FIFO:
        return oldest_unpinned(ft, s);
    case CHM_POLICY_CLOCK:
        return clock_to_evict(ft, s);
    case CHM_POLICY_SIEVE:
        return sieve_to_evict(ft, s);
    case CHM_POLICY_S3FIFO:
        return s3fifo_to_evict(ft, s);
    default:
        return NONE;
    }
}

/* -- free ways: a bitmap per set, lowest way first -- */

static int32_t take_free_way(struct chm_ft *ft, uint32_t set)
{
    struct chm_set *s = &ft->set[set];
    uint64_t *bits = ft->free_bits + (uint64_t)set * ft->words_per_set;
    for (uint32_t w = s->free_hint; w < ft->words_per_set; w++) {
        if (bits[w]) {
            unsigned b = (unsigned)__builtin_ctzll(bits[w]);
            bits[w] &= bits[w] - 1;
            s->free_hint = w;
            s->free_ways--;
            return (int32_t)(set * ft->ways + w * 64 + b);
        }
    }
    return NONE;
}

static void give_free_way(struct chm_ft *ft, uint32_t frame)
{
    uint32_t set = set_of_frame(ft, frame), way = frame - set * ft->ways;
    struct chm_set *s = &ft->set[set];
    ft->free_bits[(uint64_t)set * ft->words_per_set + way / 64] |= 1ull << (way % 64);
    if (way / 64 < s->free_hint)
        s->free_hint = way / 64;
    s->free_ways++;
}

/* -- construction -- */

int chm_policy_info(uint32_t ways, const struct chm_policy_params *policy, struct chm_policy_info *out)
{
    struct chm_policy_info info = {0};
    if (!ways || policy->kind > CHM_POLICY_S3FIFO)
        return CHM_E_ARG;
    if (policy->kind == CHM_POLICY_CLOCK) {
        if (policy->n_bit_counter < 1 || policy->n_bit_counter > 31)
            return CHM_E_ARG;
        info.max_freq = (1u << policy->n_bit_counter) - 1;
    }
    if (policy->kind == CHM_POLICY_S3FIFO) {
        /* integer parts as libCacheSim computes them (int64 times double, truncated) */
        double small = (double)ways * policy->small_size_ratio, ghost = (double)ways * policy->ghost_size_ratio;
        if (!(small >= 0 && small <= ways) || !(ghost >= 0 && ghost < INT32_MAX))
            return CHM_E_ARG;
        info.small_capacity = (uint32_t)small;
        info.main_capacity = ways - info.small_capacity;
        info.ghost_capacity = (uint32_t)ghost;
        info.threshold = policy->move_to_main_threshold;
    }
    *out = info;
    return CHM_OK;
}

int chm_ft_new(uint32_t frames, uint32_t ways, const struct chm_policy_params *policy, struct chm_ft **out)
{
    struct chm_policy_info info;
    if (!frames || !ways || frames % ways || frames > (uint32_t)INT32_MAX || chm_policy_info(ways, policy, &info))
        return CHM_E_ARG;
    if ((uint64_t)info.ghost_capacity * (frames / ways) > INT32_MAX)
        return CHM_E_ARG;
    struct chm_ft *ft = calloc(1, sizeof *ft);
    if (!ft)
        return CHM_E_NOMEM;
    ft->frames = frames;
    ft->ways = ways;
    ft->sets = frames / ways;
    ft->policy = *policy;
    ft->info = info;
    size_t n = frames;
    ft->words_per_set = (ways + 63) / 64;
    ft->page_of = malloc(n * sizeof *ft->page_of);
    ft->dirty = calloc(n, sizeof *ft->dirty);
    ft->pins = calloc(n, sizeof *ft->pins);
    ft->older = malloc(n * sizeof *ft->older);
    ft->newer = malloc(n * sizeof *ft->newer);
    ft->freq = calloc(n, sizeof *ft->freq);
    ft->queue_of = calloc(n, sizeof *ft->queue_of);
    ft->free_bits = calloc((size_t)ft->sets * ft->words_per_set, sizeof *ft->free_bits);
    ft->set = calloc(ft->sets, sizeof *ft->set);
    if (!ft->page_of || !ft->dirty || !ft->pins || !ft->older || !ft->newer || !ft->freq || !ft->queue_of
        || !ft->free_bits || !ft->set)
        goto no_mem;
    int rc = map_init(&ft->index, frames);
    if (rc) {
        chm_ft_free(ft);
        return rc;
    }
    if (policy->kind == CHM_POLICY_S3FIFO) {
        size_t nodes = (size_t)ft->sets * ft->info.ghost_capacity;
        ft->ghost_page = malloc((nodes ? nodes : 1) * sizeof *ft->ghost_page);
        ft->ghost_older = malloc((nodes ? nodes : 1) * sizeof *ft->ghost_older);
        ft->ghost_newer = malloc((nodes ? nodes : 1) * sizeof *ft->ghost_newer);
        ft->save_older = malloc(ways * sizeof *ft->save_older);
        ft->save_newer = malloc(ways * sizeof *ft->save_newer);
        ft->save_freq = malloc(ways * sizeof *ft->save_freq);
        ft->save_queue_of = malloc(ways * sizeof *ft->save_queue_of);
        if (!ft->ghost_page || !ft->ghost_older || !ft->ghost_newer || !ft->save_older || !ft->save_newer
            || !ft->save_freq || !ft->save_queue_of)
            goto no_mem;
        rc = map_init(&ft->ghost_index, nodes);
        if (rc) {
            chm_ft_free(ft);
            return rc;
        }
        for (size_t g = 0; g < nodes; g++)  /* each set's free list: its own nodes in order */
            ft->ghost_newer[g] = (g + 1) % ft->info.ghost_capacity ? (int32_t)(g + 1) : NONE;
    }
    for (size_t f = 0; f < n; f++)
        ft->page_of[f] = CHM_NO_PAGE;
    for (uint32_t set = 0; set < ft->sets; set++) {
        struct chm_set *s = &ft->set[set];
        for (int q = 0; q < QUEUES; q++)
            s->oldest[q] = s->newest[q] = NONE;
        s->hand = NONE;
        s->free_ways = ways;
        s->ghost_oldest = s->ghost_newest = NONE;
        s->ghost_free = ft->info.ghost_capacity ? (int32_t)(set * ft->info.ghost_capacity) : NONE;
        uint64_t *bits = ft->free_bits + (size_t)set * ft->words_per_set;
        for (uint32_t w = 0; w < ways / 64; w++)
            bits[w] = ~0ull;
        if (ways % 64)
            bits[ways / 64] = (1ull << (ways % 64)) - 1;
    }
    *out = ft;
    return CHM_OK;
no_mem:
    chm_ft_free(ft);
    return CHM_E_NOMEM;
}

void chm_ft_free(struct chm_ft *ft)
{
    if (!ft)
        return;
    free(ft->page_of);
    free(ft->dirty);
    free(ft->pins);
    free(ft->older);
    free(ft->newer);
    free(ft->freq);
    free(ft->queue_of);
    free(ft->free_bits);
    free(ft->set);
    map_destroy(&ft->index);
    free(ft->ghost_page);
    free(ft->ghost_older);
    free(ft->ghost_newer);
    map_destroy(&ft->ghost_index);
    free(ft->save_older);
    free(ft->save_newer);
    free(ft->save_freq);
    free(ft->save_queue_of);
    free(ft);
}

uint64_t *chm_ft_page_of(struct chm_ft *ft) { return ft->page_of; }
uint8_t *chm_ft_dirty(struct chm_ft *ft) { return ft->dirty; }
uint32_t *chm_ft_pins(struct chm_ft *ft) { return ft->pins; }
uint32_t chm_ft_resident(const struct chm_ft *ft) { return ft->resident; }

int64_t chm_ft_free_ways(const struct chm_ft *ft, uint32_t set)
{
    return set < ft->sets ? (int64_t)ft->set[set].free_ways : CHM_E_FRAME;
}

int64_t chm_ft_pinned_ways(const struct chm_ft *ft, uint32_t set)
{
    return set < ft->sets ? (int64_t)ft->set[set].pinned_ways : CHM_E_FRAME;
}

/* -- operations -- */

int64_t chm_ft_lookup(const struct chm_ft *ft, uint64_t page)
{
    return map_get(&ft->index, page);
}

static int check_resident(const struct chm_ft *ft, uint32_t frame)
{
    if (frame >= ft->frames)
        return CHM_E_FRAME;
    return ft->page_of[frame] == CHM_NO_PAGE ? CHM_E_EMPTY : CHM_OK;
}

int chm_ft_touch(struct chm_ft *ft, uint32_t frame)
{
    int rc = check_resident(ft, frame);
    if (!rc)
        policy_hit(ft, &ft->set[set_of_frame(ft, frame)], (int32_t)frame);
    return rc;
}

/* The frame's page leaves (evicted or invalidated): out of the index, the frame free. */
static void drop_page(struct chm_ft *ft, int32_t f)
{
    map_del(&ft->index, ft->page_of[f]);
    ft->page_of[f] = CHM_NO_PAGE;
    ft->dirty[f] = 0;
    ft->resident--;
}

static void place(struct chm_ft *ft, struct chm_set *s, int32_t f, uint64_t page, struct chm_access *out)
{
    ft->page_of[f] = page;
    ft->dirty[f] = 0;
    map_put_new(&ft->index, page, f);
    ft->resident++;
    policy_inserted(ft, s, f, page);
    out->frame = (uint32_t)f;
    out->hit = 0;
}

static void report_victim(const struct chm_ft *ft, int32_t f, struct chm_access *out)
{
    out->victim_page = ft->page_of[f];
    out->victim_dirty = ft->dirty[f];
}

/* Insert a page known not to be resident. */
static int insert_absent(struct chm_ft *ft, uint64_t page, struct chm_access *out)
{
    uint32_t set = (uint32_t)(page % ft->sets);
    struct chm_set *s = &ft->set[set];
    int32_t f;
    out->victim_page = CHM_NO_PAGE;
    out->victim_dirty = 0;
    if (s->free_ways) {
        f = take_free_way(ft, set);
    } else {
        if (s->pinned_ways == ft->ways)
            return CHM_ALL_PINNED;
        if (ft->policy.kind == CHM_POLICY_EXTERNAL)
            return CHM_NEEDS_VICTIM;
        f = policy_evict(ft, s, 1, page);
        if (f == NONE || pinned(ft, f))
            return CHM_E_INTERNAL;
        report_victim(ft, f, out);
        drop_page(ft, f);
    }
    if (f == NONE)
        return CHM_E_INTERNAL;
    place(ft, s, f, page, out);
    return CHM_OK;
}

int chm_ft_insert(struct chm_ft *ft, uint64_t page, struct chm_access *out)
{
    if (page == CHM_NO_PAGE)
        return CHM_E_ARG;
    if (map_get(&ft->index, page) >= 0)
        return CHM_E_RESIDENT;
    return insert_absent(ft, page, out);
}

int chm_ft_insert_replacing(struct chm_ft *ft, uint64_t page, uint32_t victim_frame, struct chm_access *out)
{
    if (page == CHM_NO_PAGE)
        return CHM_E_ARG;
    if (map_get(&ft->index, page) >= 0)
        return CHM_E_RESIDENT;
    int rc = check_resident(ft, victim_frame);
    if (rc)
        return rc;
    uint32_t set = (uint32_t)(page % ft->sets);
    if (set_of_frame(ft, victim_frame) != set)
        return CHM_E_OTHER_SET;
    if (pinned(ft, (int32_t)victim_frame))
        return CHM_E_PINNED;
    struct chm_set *s = &ft->set[set];
    if (ft->policy.kind != CHM_POLICY_EXTERNAL)
        policy_removed(ft, s, (int32_t)victim_frame);
    report_victim(ft, (int32_t)victim_frame, out);
    drop_page(ft, (int32_t)victim_frame);
    place(ft, s, (int32_t)victim_frame, page, out);
    return CHM_OK;
}

int chm_ft_lookup_or_insert(struct chm_ft *ft, uint64_t page, struct chm_access *out)
{
    if (page == CHM_NO_PAGE)
        return CHM_E_ARG;
    int32_t f = map_get(&ft->index, page);
    if (f >= 0) {
        policy_hit(ft, &ft->set[set_of_frame(ft, (uint32_t)f)], f);
        out->frame = (uint32_t)f;
        out->hit = 1;
        out->victim_page = CHM_NO_PAGE;
        out->victim_dirty = 0;
        return CHM_OK;
    }
    return insert_absent(ft, page, out);
}

int chm_ft_access_many(struct chm_ft *ft, const uint64_t *pages, const uint8_t *writes, uint64_t n,
                       uint8_t *hit_out, struct chm_access_counts *counts)
{
    struct chm_access a;
    memset(counts, 0, sizeof *counts);
    for (uint64_t i = 0; i < n; i++) {
        int rc = chm_ft_lookup_or_insert(ft, pages[i], &a);
        if (rc)
            return rc;
        counts->accesses++;
        if (a.hit) {
            counts->hits++;
        } else {
            counts->misses++;
            if (a.victim_page != CHM_NO_PAGE) {
                counts->evictions++;
                counts->dirty_evictions += a.victim_dirty;
            }
        }
        if (writes && writes[i])
            ft->dirty[a.frame] = 1;
        if (hit_out)
            hit_out[i] = a.hit;
    }
    return CHM_OK;
}

int64_t chm_ft_victim(struct chm_ft *ft, uint64_t page)
{
    struct chm_set *s = &ft->set[page % ft->sets];
    if (s->free_ways || s->pinned_ways == ft->ways)
        return NONE;
    return policy_to_evict(ft, s);
}

int64_t chm_ft_to_evict(struct chm_ft *ft, uint32_t set)
{
    if (set >= ft->sets)
        return CHM_E_FRAME;
    return policy_to_evict(ft, &ft->set[set]);
}

int chm_ft_evict(struct chm_ft *ft, uint32_t set, uint64_t incoming, struct chm_access *out)
{
    if (set >= ft->sets || ft->policy.kind == CHM_POLICY_EXTERNAL)
        return CHM_E_ARG;
    if (incoming != CHM_NO_PAGE && incoming % ft->sets != set)
        return CHM_E_OTHER_SET;
    if (incoming != CHM_NO_PAGE && map_get(&ft->index, incoming) >= 0)
        return CHM_E_RESIDENT;
    struct chm_set *s = &ft->set[set];
    int32_t f = policy_evict(ft, s, incoming != CHM_NO_PAGE, incoming);
    if (f == NONE)
        return CHM_ALL_PINNED;
    report_victim(ft, f, out);
    out->frame = (uint32_t)f;
    out->hit = 0;
    drop_page(ft, f);
    give_free_way(ft, (uint32_t)f);
    return CHM_OK;
}

int chm_ft_invalidate(struct chm_ft *ft, uint32_t frame)
{
    int rc = check_resident(ft, frame);
    if (rc)
        return rc;
    if (ft->pins[frame])
        return CHM_E_PINNED;
    policy_removed(ft, &ft->set[set_of_frame(ft, frame)], (int32_t)frame);
    drop_page(ft, (int32_t)frame);
    give_free_way(ft, frame);
    return CHM_OK;
}

int chm_ft_mark_dirty(struct chm_ft *ft, uint32_t frame)
{
    if (frame >= ft->frames)
        return CHM_E_FRAME;
    ft->dirty[frame] = 1;
    return CHM_OK;
}

int chm_ft_clear_dirty(struct chm_ft *ft, uint32_t frame)
{
    if (frame >= ft->frames)
        return CHM_E_FRAME;
    ft->dirty[frame] = 0;
    return CHM_OK;
}

int chm_ft_pin(struct chm_ft *ft, uint32_t frame)
{
    if (frame >= ft->frames)
        return CHM_E_FRAME;
    if (ft->pins[frame] == UINT32_MAX)
        return CHM_E_PIN_LIMIT;
    if (!ft->pins[frame]++)
        ft->set[set_of_frame(ft, frame)].pinned_ways++;
    return CHM_OK;
}

int chm_ft_unpin(struct chm_ft *ft, uint32_t frame)
{
    if (frame >= ft->frames)
        return CHM_E_FRAME;
    if (!ft->pins[frame])
        return CHM_E_NOT_PINNED;
    if (!--ft->pins[frame])
        ft->set[set_of_frame(ft, frame)].pinned_ways--;
    return CHM_OK;
}

int chm_ft_page_pinned(const struct chm_ft *ft, uint64_t page)
{
    int32_t f = map_get(&ft->index, page);
    return f >= 0 && ft->pins[f];
}

uint32_t chm_ft_queue(const struct chm_ft *ft, uint32_t set, uint32_t queue, uint64_t *out, uint32_t max)
{
    if (set >= ft->sets || queue >= QUEUES)
        return 0;
    uint32_t n = 0;
    for (int32_t f = ft->set[set].oldest[queue]; f != NONE; f = ft->newer[f], n++)
        if (n < max)
            out[n] = ft->page_of[f];
    return n;
}

#define INVARIANT(cond) do { if (!(cond)) return __LINE__; } while (0)

int chm_ft_check(const struct chm_ft *ft)
{
    uint32_t resident = 0;
    INVARIANT(ft->index.count == ft->resident);
    for (uint32_t set = 0; set < ft->sets; set++) {
        const struct chm_set *s = &ft->set[set];
        const uint64_t *bits = ft->free_bits + (size_t)set * ft->words_per_set;
        uint32_t free_ways = 0, pinned_ways = 0, in_queues = 0;
        for (uint32_t way = 0; way < ft->ways; way++) {
            uint32_t f = set * ft->ways + way;
            int is_free = (int)((bits[way / 64] >> (way % 64)) & 1);
            INVARIANT(is_free == (ft->page_of[f] == CHM_NO_PAGE));
            INVARIANT(!is_free || way / 64 >= s->free_hint);
            free_ways += (uint32_t)is_free;
            pinned_ways += ft->pins[f] != 0;
            if (!is_free) {
                resident++;
                INVARIANT(ft->page_of[f] % ft->sets == set);
                INVARIANT(map_get(&ft->index, ft->page_of[f]) == (int32_t)f);
                if (ft->policy.kind == CHM_POLICY_S3FIFO)
                    INVARIANT(map_get(&ft->ghost_index, ft->page_of[f]) < 0);
            }
        }
        INVARIANT(free_ways == s->free_ways && pinned_ways == s->pinned_ways);
        for (int q = 0; q < QUEUES; q++) {
            uint32_t len = 0;
            int32_t prev = NONE;
            for (int32_t f = s->oldest[q]; f != NONE; prev = f, f = ft->newer[f]) {
                INVARIANT(len < ft->ways && set_of_frame(ft, (uint32_t)f) == set);
                INVARIANT(ft->page_of[f] != CHM_NO_PAGE && ft->older[f] == prev && ft->queue_of[f] == q);
                INVARIANT(s->hand != f || ft->policy.kind == CHM_POLICY_SIEVE);
                len++;
            }
            INVARIANT(prev == s->newest[q] && len == s->len[q]);
            in_queues += len;
        }
        if (ft->policy.kind != CHM_POLICY_EXTERNAL)
            INVARIANT(in_queues == ft->ways - free_ways);
        INVARIANT(s->hand == NONE || (ft->page_of[s->hand] != CHM_NO_PAGE && set_of_frame(ft, (uint32_t)s->hand) == set));
        if (ft->policy.kind == CHM_POLICY_S3FIFO) {
            uint32_t len = 0, spare = 0;
            for (int32_t g = s->ghost_oldest; g != NONE; g = ft->ghost_newer[g]) {
                INVARIANT(len < ft->info.ghost_capacity && g >= ghost_node_base(ft, s));
                INVARIANT(map_get(&ft->ghost_index, ft->ghost_page[g]) == g);
                len++;
            }
            for (int32_t g = s->ghost_free; g != NONE; g = ft->ghost_newer[g])
                INVARIANT(++spare <= ft->info.ghost_capacity);
            INVARIANT(len == s->ghost_len && len + spare == ft->info.ghost_capacity);
        }
    }
    INVARIANT(resident == ft->resident);
    return 0;
}

/* ---- the prefetch engine ---- */

struct pf_slot {
    struct chm_pf_object obj;
    int32_t older, newer;  /* held objects in issue order; a free slot: newer is the next free one */
};

struct pf_fetch {          /* an issued object's page fetches not yet taken */
    int64_t handle;
    uint64_t next_page, end_page;
};

struct chm_pf {
    uint64_t window_pages, pages_held;
    uint32_t max_handles, objects;
    struct pf_slot *slots;  /* grown on demand up to max_handles */
    uint32_t slot_count;
    int32_t free_slot, oldest, newest;
    struct chm_map by_handle;  /* handle -> slot */
    struct pf_fetch *fetches;  /* a ring, grown on demand */
    uint64_t fetch_cap, fetch_head, fetch_len;
};

int chm_pf_new(uint64_t window_pages, uint32_t max_handles, struct chm_pf **out)
{
    if (max_handles > (uint32_t)INT32_MAX)
        return CHM_E_ARG;
    struct chm_pf *pf = calloc(1, sizeof *pf);
    if (!pf)
        return CHM_E_NOMEM;
    pf->window_pages = window_pages;
    pf->max_handles = max_handles;
    pf->free_slot = pf->oldest = pf->newest = NONE;
    int rc = map_init(&pf->by_handle, MAP_MIN_SLOTS / 2);
    if (rc) {
        free(pf);
        return rc;
    }
    *out = pf;
    return CHM_OK;
}

void chm_pf_free(struct chm_pf *pf)
{
    if (!pf)
        return;
    free(pf->slots);
    free(pf->fetches);
    map_destroy(&pf->by_handle);
    free(pf);
}

static int32_t pf_new_slot(struct chm_pf *pf)
{
    if (pf->free_slot == NONE) {
        uint32_t count = pf->slot_count ? 2 * pf->slot_count : 8;
        if (count > pf->max_handles)
            count = pf->max_handles;
        struct pf_slot *slots = realloc(pf->slots, (size_t)count * sizeof *slots);
        if (!slots)
            return NONE;
        pf->slots = slots;
        for (uint32_t i = count; i-- > pf->slot_count;) {
            slots[i].newer = pf->free_slot;
            pf->free_slot = (int32_t)i;
        }
        pf->slot_count = count;
    }
    int32_t i = pf->free_slot;
    pf->free_slot = pf->slots[i].newer;
    return i;
}

static int pf_queue_fetches(struct chm_pf *pf, int64_t handle, uint64_t first_page, uint64_t pages)
{
    if (pf->fetch_len == pf->fetch_cap) {
        uint64_t cap = pf->fetch_cap ? 2 * pf->fetch_cap : 16;
        struct pf_fetch *ring = malloc(cap * sizeof *ring);
        if (!ring)
            return CHM_E_NOMEM;
        for (uint64_t i = 0; i < pf->fetch_len; i++)
            ring[i] = pf->fetches[(pf->fetch_head + i) % pf->fetch_cap];
        free(pf->fetches);
        pf->fetches = ring;
        pf->fetch_cap = cap;
        pf->fetch_head = 0;
    }
    struct pf_fetch *f = &pf->fetches[(pf->fetch_head + pf->fetch_len) % pf->fetch_cap];
    f->handle = handle;
    f->next_page = first_page;
    f->end_page = first_page + pages;
    pf->fetch_len++;
    return CHM_OK;
}

int chm_pf_issue(struct chm_pf *pf, int64_t handle, uint64_t first_page, uint64_t pages)
{
    if (map_get(&pf->by_handle, (uint64_t)handle) >= 0)
        return CHM_PF_HANDLE_IN_USE;
    if (pages > pf->window_pages)
        return CHM_PF_NEVER_FITS;
    if (pf->objects >= pf->max_handles)
        return CHM_PF_NO_HANDLE;
#if CHM_MUTATION == CHM_MUTATION_PREFETCH_WINDOW
    if (pf->pages_held + pages >= pf->window_pages)
#else
    if (pf->pages_held + pages > pf->window_pages)
#endif
        return CHM_PF_WINDOW_FULL;
    if (first_page > UINT64_MAX - pages)
        return CHM_E_ARG;
    if (map_reserve_one(&pf->by_handle) || (pages && pf_queue_fetches(pf, handle, first_page, pages)))
        return CHM_E_NOMEM;
    int32_t i = pf_new_slot(pf);
    if (i == NONE) {
        if (pages)
            pf->fetch_len--;  /* take back the fetches just queued */
        return CHM_E_NOMEM;
    }
    struct pf_slot *slot = &pf->slots[i];
    slot->obj = (struct chm_pf_object){handle, first_page, pages, 0};
    slot->older = pf->newest;
    slot->newer = NONE;
    if (pf->newest == NONE)
        pf->oldest = i;
    else
        pf->slots[pf->newest].newer = i;
    pf->newest = i;
    map_put_new(&pf->by_handle, (uint64_t)handle, i);
    pf->objects++;
    pf->pages_held += pages;
    return CHM_OK;
}

int chm_pf_next_fetch(struct chm_pf *pf, int64_t *handle, uint64_t *page)
{
    if (!pf->fetch_len)
        return 0;
    struct pf_fetch *f = &pf->fetches[pf->fetch_head];
    *handle = f->handle;
    *page = f->next_page++;
    if (f->next_page == f->end_page) {
        pf->fetch_head = (pf->fetch_head + 1) % pf->fetch_cap;
        pf->fetch_len--;
    }
    return 1;
}

int chm_pf_arrived(struct chm_pf *pf, int64_t handle, uint64_t *arrived)
{
    int32_t i = map_get(&pf->by_handle, (uint64_t)handle);
    if (i < 0)
        return CHM_PF_UNKNOWN_HANDLE;
    struct chm_pf_object *obj = &pf->slots[i].obj;
    if (obj->arrived >= obj->pages)
        return CHM_PF_TOO_MANY_ARRIVALS;
    *arrived = ++obj->arrived;
    return obj->arrived == obj->pages;
}

int chm_pf_get(const struct chm_pf *pf, int64_t handle, struct chm_pf_object *out)
{
    int32_t i = map_get(&pf->by_handle, (uint64_t)handle);
    if (i < 0)
        return CHM_PF_UNKNOWN_HANDLE;
    *out = pf->slots[i].obj;
    return CHM_OK;
}

int chm_pf_release(struct chm_pf *pf, int64_t handle, struct chm_pf_object *out)
{
    int32_t i = map_get(&pf->by_handle, (uint64_t)handle);
    if (i < 0)
        return CHM_PF_UNKNOWN_HANDLE;
    struct pf_slot *slot = &pf->slots[i];
    *out = slot->obj;
    if (slot->older == NONE)
        pf->oldest = slot->newer;
    else
        pf->slots[slot->older].newer = slot->newer;
    if (slot->newer == NONE)
        pf->newest = slot->older;
    else
        pf->slots[slot->newer].older = slot->older;
    slot->newer = pf->free_slot;
    pf->free_slot = i;
    map_del(&pf->by_handle, (uint64_t)handle);
    pf->objects--;
    pf->pages_held -= out->pages;
    return CHM_OK;
}

uint64_t chm_pf_pages_held(const struct chm_pf *pf) { return pf->pages_held; }
uint32_t chm_pf_objects(const struct chm_pf *pf) { return pf->objects; }

uint32_t chm_pf_handles(const struct chm_pf *pf, int64_t *out, uint32_t max)
{
    uint32_t n = 0;
    for (int32_t i = pf->oldest; i != NONE && n < max; i = pf->slots[i].newer)
        out[n++] = pf->slots[i].obj.handle;
    return n;
}

/* ---- write admission ---- */

int chm_admission_admit(struct chm_admission *a, uint64_t pages)
{
    uint64_t free_pages = a->capacity_pages - a->used_pages;
#if CHM_MUTATION == CHM_MUTATION_EXACT_FIT
    if (pages >= free_pages)
#else
    if (pages > free_pages)
#endif
        return 0;
    a->used_pages += pages;
    return 1;
}

int chm_admission_release(struct chm_admission *a, uint64_t pages)
{
    if (pages > a->used_pages)
        return CHM_E_ARG;
    a->used_pages -= pages;
    return CHM_OK;
}

/* ---- timing resources (emulator/timing.py specifies them, operation for operation) ---- */

_Static_assert(CHM_HIST_SUB_BUCKETS == 1 << CHM_HIST_SUB_BITS, "sub-buckets per power of two");
_Static_assert(CHM_HIST_BUCKETS == (64 - CHM_HIST_SUB_BITS + 1) * CHM_HIST_SUB_BUCKETS, "buckets for every uint64");

/* One piece through a pipe; `latency` is latency_ns * slowdown, as the specification computes it once. */
static double pipe_piece(struct chm_pipe *p, double ready, uint64_t nbytes, double slowdown, double latency)
{
    double occupancy = (double)nbytes / p->bandwidth_gbps * slowdown;
    p->free_at = (ready > p->free_at ? ready : p->free_at) + occupancy;
    p->busy_ns += occupancy;
    p->bytes += nbytes;
    return p->free_at + latency;
}

double chm_pipe_transfer(struct chm_pipe *p, double ready, uint64_t nbytes, double slowdown)
{
    return pipe_piece(p, ready, nbytes, slowdown, p->latency_ns * slowdown);
}

/* When `cycles` started no earlier than ready would end, and their occupancy; changes nothing. */
static double clocked_plan(const struct chm_clocked *c, double ready, uint64_t cycles, double *occupancy)
{
    *occupancy = (double)cycles * 1000.0 / c->clock_mhz;
    return (c->free_at > ready ? c->free_at : ready) + *occupancy;   /* Python's max(ready, free_at) */
}

static void clocked_commit(struct chm_clocked *c, double end, double occupancy)
{
    c->free_at = end;
    c->busy_ns += occupancy;
}

double chm_clocked_run(struct chm_clocked *c, double ready, uint64_t cycles)
{
    double occupancy, end = clocked_plan(c, ready, cycles, &occupancy);
    clocked_commit(c, end, occupancy);
    return end;
}

void chm_histogram_init(struct chm_histogram *h)
{
    memset(h, 0, sizeof(*h));
    h->min_ns = 1.0 / 0.0;
    h->max_ns = -1.0 / 0.0;
}

uint32_t chm_histogram_bucket(uint64_t ns)
{
    if (ns < CHM_HIST_SUB_BUCKETS)
        return (uint32_t)ns;
    unsigned shift = (unsigned)(64 - __builtin_clzll(ns)) - CHM_HIST_SUB_BITS - 1;  /* bit_length - 6 */
    return (shift << CHM_HIST_SUB_BITS) + (uint32_t)(ns >> shift);
}

void chm_histogram_add(struct chm_histogram *h, double latency_ns)
{
    uint64_t ns = !(latency_ns > 0) ? 0 : latency_ns >= 18446744073709551616.0 ? UINT64_MAX : (uint64_t)latency_ns;
    h->counts[chm_histogram_bucket(ns)]++;
    h->count++;
    h->total_ns += latency_ns;
    if (latency_ns < h->min_ns)
        h->min_ns = latency_ns;
    if (latency_ns > h->max_ns)
        h->max_ns = latency_ns;
}

/* -- an SSD (timing.SsdModel) -- */

/* heapq's _siftdown and _siftup, so the heaps are laid out as Python's are under the same calls. */
static void heap_siftdown(double *heap, uint64_t startpos, uint64_t pos)
{
    double newitem = heap[pos];
    while (pos > startpos) {
        uint64_t parentpos = (pos - 1) >> 1;
        double parent = heap[parentpos];
        if (!(newitem < parent))
            break;
        heap[pos] = parent;
        pos = parentpos;
    }
    heap[pos] = newitem;
}

static void heap_siftup(double *heap, uint64_t endpos, uint64_t pos)
{
    uint64_t startpos = pos, childpos = 2 * pos + 1;
    double newitem = heap[pos];
    while (childpos < endpos) {
        uint64_t rightpos = childpos + 1;
        if (rightpos < endpos && !(heap[childpos] < heap[rightpos]))
            childpos = rightpos;
        heap[pos] = heap[childpos];
        pos = childpos;
        childpos = 2 * pos + 1;
    }
    heap[pos] = newitem;
    heap_siftdown(heap, startpos, pos);
}

static void heap_replace(double *heap, uint64_t n, double item)  /* heapq.heapreplace */
{
    heap[0] = item;
    heap_siftup(heap, n, 0);
}

int chm_ssd_new(uint32_t parallelism, double read_latency_ns, double write_latency_ns, double slowdown,
                double read_bandwidth_gbps, double write_bandwidth_gbps, struct chm_ssd **out)
{
    if (!parallelism)
        return CHM_E_ARG;
    struct chm_ssd *s = calloc(1, sizeof *s);
    if (!s)
        return CHM_E_NOMEM;
    s->slots = calloc(parallelism, sizeof *s->slots);
    if (!s->slots) {
        free(s);
        return CHM_E_NOMEM;
    }
    s->parallelism = parallelism;
    s->read_latency_ns = read_latency_ns;
    s->write_latency_ns = write_latency_ns;
    s->slowdown = slowdown;
    s->read_media.bandwidth_gbps = read_bandwidth_gbps;
    s->write_media.bandwidth_gbps = write_bandwidth_gbps;
    *out = s;
    return CHM_OK;
}

void chm_ssd_free(struct chm_ssd *s)
{
    if (!s)
        return;
    free(s->slots);
    free(s->read_finishes);
    free(s);
}

int chm_ssd_reserve(struct chm_ssd *s, uint64_t reads)
{
    if (reads <= s->read_finishes_cap - s->n_read_finishes)
        return CHM_OK;
    uint64_t cap = s->read_finishes_cap ? s->read_finishes_cap : 16;
    while (cap - s->n_read_finishes < reads) {
        if (cap > UINT64_MAX / 2 / sizeof(double))
            return CHM_E_NOMEM;
        cap *= 2;
    }
    double *grown = realloc(s->read_finishes, cap * sizeof *grown);
    if (!grown)
        return CHM_E_NOMEM;
    s->read_finishes = grown;
    s->read_finishes_cap = cap;
    return CHM_OK;
}

/* max(ready, slots[0]), as Python's max picks */
static double ssd_start(const struct chm_ssd *s, double ready)
{
    return s->slots[0] > ready ? s->slots[0] : ready;
}

double chm_ssd_read(struct chm_ssd *s, double ready, uint64_t nbytes)
{
    if (chm_ssd_reserve(s, 1))
        return 0.0 / 0.0;
    double start = ssd_start(s, ready);
    double slow = start < s->writes_until ? s->slowdown : 1.0;
    s->slowed_reads += slow > 1.0;
    double finish = chm_pipe_transfer(&s->read_media, start + s->read_latency_ns * slow, nbytes, slow);
    heap_replace(s->slots, s->parallelism, finish);
    s->read_finishes[s->n_read_finishes] = finish;  /* heapq.heappush */
    heap_siftdown(s->read_finishes, 0, s->n_read_finishes++);
    if (finish > s->reads_until)
        s->reads_until = finish;
    return finish;
}

double chm_ssd_write(struct chm_ssd *s, double ready, uint64_t nbytes)
{
    double start = ssd_start(s, ready);
    double finish = chm_pipe_transfer(&s->write_media, start + s->write_latency_ns, nbytes, 1.0);
    heap_replace(s->slots, s->parallelism, finish);
    if (finish > s->writes_until)  /* max(writes_until, finish) */
        s->writes_until = finish;
    return finish;
}

uint64_t chm_ssd_reads_in_flight(struct chm_ssd *s, double now)
{
    double *heap = s->read_finishes;
    while (s->n_read_finishes && heap[0] <= now) {  /* heapq.heappop */
        double last = heap[--s->n_read_finishes];
        if (s->n_read_finishes) {
            heap[0] = last;
            heap_siftup(heap, s->n_read_finishes, 0);
        }
    }
    return s->n_read_finishes;
}

/* ---- the DRAM-hit read ---- */

/* The page's frame (local to *area), or -1. */
static int64_t dev_lookup(const struct chm_dev *d, uint64_t page, const struct chm_dev_area **area)
{
    for (uint32_t i = 0; i < d->n_areas; i++) {
        int64_t f = chm_ft_lookup(d->areas[i].table, page);
        if (f >= 0) {
            *area = &d->areas[i];
            return f;
        }
    }
    return -1;
}

int64_t chm_dev_read_hit(struct chm_dev *d, uint64_t addr, uint64_t len, double now, uint8_t *out,
                         int count_command, double *finish)
{
    const uint64_t page_size = d->page_size;
    if (!d->n_areas || len == 0 || addr > d->capacity || len > d->capacity - addr)
        return 0;
    const uint64_t first = addr / page_size, last = (addr + len - 1) / page_size, pages = last - first + 1;
    double occupancy, t = clocked_plan(d->controller, now, d->cycles_per_command + pages * d->cycles_per_lookup,
                                       &occupancy);
    /* Every page a hit? (A frame not ready by t is a merged miss; an unsettled one needs its media read.) */
    for (uint64_t page = first; page <= last; page++) {
        const struct chm_dev_area *area;
        int64_t f = dev_lookup(d, page, &area);
        if (f < 0)
            return 0;
        uint64_t frame = area->base + (uint64_t)f;
        if (d->ready_at[frame] > t || d->io_token[frame] != CHM_NO_TOKEN)
            return 0;
    }
    /* Controller.read from here. Python touches every page, then copies and times each: the policy's
     * state and the pipes' are apart, so doing both per page ends in the same state. */
    d->counts.read_bytes += len;
    clocked_commit(d->controller, t, occupancy);
    struct chm_pipe *dram = d->dram_pipe, *link = d->link_to_host;
    const double dram_latency = dram->latency_ns * 1.0, link_latency = link->latency_ns * 1.0;
    const int copy = d->dram && out;
    const uint64_t end = addr + len;
    uint64_t run_src = 0, run_dst = 0, run_len = 0;  /* the pending memcpy: frames that follow each other in DRAM */
    int64_t run_last = -2;                           /* the frame that ends it, if a whole page */
    double arrival = t;
    for (uint64_t page = first; page <= last; page++) {
        const struct chm_dev_area *area = d->areas;   /* the page is resident: dev_lookup sets it */
        int64_t f = dev_lookup(d, page, &area);
        int64_t frame = (int64_t)area->base + f;
        d->counts.page_hits++;
        chm_ft_touch(area->table, (uint32_t)f);
        uint64_t base = page * page_size;
        uint64_t lo = page == first ? addr - base : 0;
        uint64_t hi = end < base + page_size ? end - base : page_size;
        d->counts.hit_bytes += hi - lo;
        if (copy) {
            if (frame == run_last + 1 && lo == 0) {
                run_len += hi;
            } else {
                if (run_len)
                    memcpy(out + run_dst, d->dram + run_src, run_len);
                run_src = (uint64_t)frame * page_size + lo;
                run_dst = base + lo - addr;
                run_len = hi - lo;
            }
            run_last = hi == page_size ? frame : -2;
        }
        /* every page is ready by t: each piece enters the DRAM pipe at t, then the link */
        arrival = pipe_piece(link, pipe_piece(dram, t, hi - lo, 1.0, dram_latency), hi - lo, 1.0, link_latency);
    }
    if (run_len)
        memcpy(out + run_dst, d->dram + run_src, run_len);
    *finish = arrival;
    if (count_command) {
        d->counts.reads++;
        chm_histogram_add(d->read_latency, *finish - now);
    }
    return (int64_t)pages;
}

/* ---- the data-off device: the flusher, writes, reads, and the sequential path ----
 * Each step below names the Python it mirrors (emulator/controller.py, flusher.py, media_io.py, ssd.py,
 * policies/base.py, policies/hymcache.py, write_buffer.py, timing.py); doubles are computed with the same
 * operations in the same order, and Python's max(a, b) is "b > a ? b : a". Frames are the device's (global). */

struct seq_entry {
    uint64_t page;
    uint32_t frame;
    double since;
};

struct seq {
    struct chm_dev *d;
    struct chm_flusher *fl;
    struct chm_seq_counts *c;
    int rc;                         /* why an operation stopped (its double is then NaN) */
    uint64_t failed_page;           /* CHM_NO_FRAME: the page */
};

#define SEQ_MAX_CHUNK 64            /* controller.MAX_CHUNK_PAGES */
#define NOT_A_TIME (0.0 / 0.0)

static double py_max(double a, double b)
{
    return b > a ? b : a;
}

/* -- the policy's per-frame calls, on the area holding the frame -- */

static struct chm_ft *frame_table(const struct chm_dev *d, uint32_t frame, uint32_t *local)
{
    for (uint32_t i = 0; i < d->n_areas; i++) {
        const struct chm_dev_area *a = &d->areas[i];
        if (frame >= a->base && frame - a->base < a->table->frames) {
            *local = frame - a->base;
            return a->table;
        }
    }
    *local = 0;
    return d->areas[0].table;  /* not reached: the areas cover the device */
}

/* The page's global frame in an area, or -1. */
static int64_t area_lookup(const struct chm_dev_area *a, uint64_t page)
{
    if (!a->table)
        return -1;
    int64_t f = chm_ft_lookup(a->table, page);
    return f < 0 ? -1 : (int64_t)a->base + f;
}

static void pol_touch(struct seq *q, uint32_t frame)
{
    uint32_t local;
    struct chm_ft *ft = frame_table(q->d, frame, &local);
    chm_ft_touch(ft, local);
}

static void pol_pin(struct seq *q, uint32_t frame)
{
    uint32_t local;
    struct chm_ft *ft = frame_table(q->d, frame, &local);
    chm_ft_pin(ft, local);
}

/* HymCachePolicy._free_write_frame */
static void free_write_frame(struct seq *q, uint32_t frame)
{
    chm_ft_invalidate(q->fl->write_area.table, frame - q->fl->write_area.base);
    chm_admission_release(q->fl->admission, 1);
}

static int in_write_area(const struct chm_flusher *fl, uint32_t frame)
{
    return frame >= fl->write_area.base && frame - fl->write_area.base < fl->write_area_frames;
}

/* Policy.unpin (HymCachePolicy.unpin: a flushed write-buffer frame a read held is freed now) */
static void pol_unpin(struct seq *q, uint32_t frame)
{
    uint32_t local;
    struct chm_ft *ft = frame_table(q->d, frame, &local);
    chm_ft_unpin(ft, local);
    uint8_t *fwu = q->fl->free_when_unpinned;
    if (fwu && fwu[frame] && ft->pins[local] == 0) {
        fwu[frame] = 0;
        free_write_frame(q, frame);
    }
}

/* Policy.flushed (HymCachePolicy.flushed: the write-buffer frame is freed, once unpinned) */
static void pol_flushed(struct seq *q, uint32_t frame)
{
    uint32_t local;
    struct chm_ft *ft = frame_table(q->d, frame, &local);
    chm_ft_clear_dirty(ft, local);
    struct chm_flusher *fl = q->fl;
    if (fl->free_when_unpinned && in_write_area(fl, frame)) {
        if (ft->pins[local])
            fl->free_when_unpinned[frame] = 1;
        else
            free_write_frame(q, frame);
    }
}

/* Policy.mark_dirty (HymCachePolicy.mark_dirty: rewritten before it was freed, it stays) */
static void pol_mark_dirty(struct seq *q, uint32_t frame)
{
    uint32_t local;
    struct chm_ft *ft = frame_table(q->d, frame, &local);
    chm_ft_mark_dirty(ft, local);
    if (q->fl->free_when_unpinned)
        q->fl->free_when_unpinned[frame] = 0;
}

/* -- the media (MediaIO, ssd.locate) -- */

/* ssd.locate(page * page_size): the SSD, and the byte offset in its file. */
static struct chm_ssd *seq_locate(const struct chm_dev *d, uint64_t page, uint64_t *offset)
{
    uint64_t addr = page * d->page_size, stripe = addr / d->stripe_bytes;
    *offset = (stripe / d->n_ssds) * d->stripe_bytes + addr % d->stripe_bytes;
    return d->ssds[stripe % d->n_ssds];
}

/* MediaIO.read: stage `page` at `now`; its modelled finish, or NaN (no memory). */
static double seq_media_read(struct seq *q, uint64_t page, double now)
{
    uint64_t offset;
    struct chm_ssd *ssd = seq_locate(q->d, page, &offset);
    double done = chm_ssd_read(ssd, now, q->d->page_size);
    if (done != done) {
        q->rc = CHM_E_NOMEM;
        return done;
    }
    q->c->ssd_read_bytes += q->d->page_size;
    return done;
}

/* MediaIO.write: `pages` frames on to the media from `page` on at `now`; its modelled finish. */
static double seq_media_write(struct seq *q, uint64_t page, uint64_t pages, double now)
{
    uint64_t offset, nbytes = pages * q->d->page_size;
    struct chm_ssd *ssd = seq_locate(q->d, page, &offset);
    q->c->ssd_write_bytes += nbytes;
    return chm_ssd_write(ssd, now, nbytes);
}

/* MediaIO.contiguous */
static int seq_contiguous(const struct chm_dev *d, uint64_t page, uint64_t next_page)
{
    uint64_t a_off, b_off;
    const struct chm_ssd *a = seq_locate(d, page, &a_off), *b = seq_locate(d, next_page, &b_off);
    return a == b && b_off == a_off + d->page_size;
}

/* TimingModel.reads_in_flight */
static uint64_t reads_in_flight(const struct chm_dev *d, double now)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < d->n_ssds; i++)
        n += chm_ssd_reads_in_flight(d->ssds[i], now);
    return n;
}

static int by_value_desc(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* TimingModel.reads_idle_at; NaN: no memory. */
static double reads_idle_at(const struct chm_dev *d, double now, uint64_t max_in_flight)
{
    if (max_in_flight == 0) {
        double t = now;
        for (uint32_t i = 0; i < d->n_ssds; i++)
            t = py_max(t, d->ssds[i]->reads_until);
        return t;
    }
    uint64_t n = 0;
    for (uint32_t i = 0; i < d->n_ssds; i++)
        n += d->ssds[i]->n_read_finishes;
    if (n <= max_in_flight)
        return now;
    double *later = malloc((size_t)n * sizeof *later);
    if (!later)
        return NOT_A_TIME;
    uint64_t k = 0;
    for (uint32_t i = 0; i < d->n_ssds; i++)
        for (uint64_t j = 0; j < d->ssds[i]->n_read_finishes; j++)
            if (d->ssds[i]->read_finishes[j] > now)
                later[k++] = d->ssds[i]->read_finishes[j];
    double t = now;
    if (k > max_in_flight) {  /* heapq.nlargest(max_in_flight + 1, finishes)[-1] */
        qsort(later, k, sizeof *later, by_value_desc);
        t = later[max_in_flight];
    }
    free(later);
    return t;
}

/* timing.earliest_time for the two rules' tests */
static int due_after_delay(double t, double since, double delay) { return since <= t - delay; }
static int due_by_age(double t, double since, double delay) { return t - since >= delay; }

/* math.nextafter(x, +inf) (up) or (x, -inf): the next double (no libm: the ASan driver links none). */
static double next_double(double x, int up)
{
    if (x != x || x == (up ? 1.0 / 0.0 : -1.0 / 0.0))
        return x;
    uint64_t bits = 1;
    if (x == 0.0) {  /* either zero: the smallest subnormal of the direction's sign */
        memcpy(&x, &bits, sizeof x);
        return up ? x : -x;
    }
    memcpy(&bits, &x, sizeof bits);
    bits = (x > 0) == up ? bits + 1 : bits - 1;  /* away from zero or toward it */
    memcpy(&x, &bits, sizeof x);
    return x;
}

static double earliest_time(double guess, int (*due)(double, double, double), double since, double delay)
{
    while (!due(guess, since, delay))
        guess = next_double(guess, 1);
    double below;
    while (due(below = next_double(guess, 0), since, delay))
        guess = below;
    return guess;
}

/* The flush rules (chm_core.h); the native flusher and the Python policies both call these. */
double chm_delay_due_at(double oldest_written_ns, double delay_ns)
{
    return earliest_time(oldest_written_ns + delay_ns, due_after_delay, oldest_written_ns, delay_ns);
}

uint64_t chm_arbiter_grant(uint64_t batch_pages, uint64_t max_reads_in_flight, double max_delay_ns,
                           uint64_t dirty_pages, uint64_t reads_in_flight, double oldest_age_ns, int force)
{
    if (dirty_pages == 0)
        return 0;
    if (force)
        return dirty_pages < batch_pages ? dirty_pages : batch_pages;
    if (reads_in_flight > max_reads_in_flight)
        return 0;
    if (dirty_pages >= batch_pages)
        return batch_pages;
    if (oldest_age_ns >= max_delay_ns)
        return dirty_pages;
    return 0;
}

double chm_arbiter_ready_at(uint64_t batch_pages, double max_delay_ns, uint64_t dirty_pages, double oldest_written_ns,
                            double batch_full_ns)
{
    if (dirty_pages >= batch_pages)
        return batch_full_ns;
    return earliest_time(oldest_written_ns + max_delay_ns, due_by_age, oldest_written_ns, max_delay_ns);
}

/* -- the dirty queue -- */

static uint64_t ring_at(const struct chm_flusher *fl, uint64_t i)
{
    uint64_t k = fl->dirty_head + i;
    return k >= fl->frames ? k - fl->frames : k;
}

void chm_flusher_dirty_at(const struct chm_flusher *fl, uint64_t i, uint32_t *frame, double *since)
{
    uint64_t k = ring_at(fl, i);
    *frame = fl->dirty_frame[k];
    *since = fl->dirty_since[k];
}

/* Flusher.enqueue */
static void fl_enqueue(struct chm_flusher *fl, uint32_t frame, double now)
{
    if (fl->queued[frame])
        return;
    fl->queued[frame] = 1;
    uint64_t k = ring_at(fl, fl->n_dirty++);
    fl->dirty_frame[k] = frame;
    fl->dirty_since[k] = now;
}

/* Flusher._unqueue */
static void fl_unqueue(struct chm_flusher *fl, uint32_t frame)
{
    if (!fl->queued[frame])
        return;
    fl->queued[frame] = 0;
    uint64_t i = 0;
    while (i < fl->n_dirty && fl->dirty_frame[ring_at(fl, i)] != frame)
        i++;
    if (i == fl->n_dirty)
        return;
    for (; i + 1 < fl->n_dirty; i++) {
        uint64_t to = ring_at(fl, i), from = ring_at(fl, i + 1);
        fl->dirty_frame[to] = fl->dirty_frame[from];
        fl->dirty_since[to] = fl->dirty_since[from];
    }
    fl->n_dirty--;
}

/* -- flush writes in flight: a min-heap by (finish, order) -- */

static int flight_less(const struct chm_flight *a, const struct chm_flight *b)
{
    return a->finish < b->finish || (a->finish == b->finish && a->order < b->order);
}

static int flight_push(struct chm_flusher *fl, struct chm_flight f)
{
    if (fl->n_flights == fl->flights_cap) {
        uint64_t cap = fl->flights_cap ? 2 * fl->flights_cap : 64;
        struct chm_flight *grown = realloc(fl->flights, (size_t)cap * sizeof *grown);
        if (!grown)
            return CHM_E_NOMEM;
        fl->flights = grown;
        fl->flights_cap = cap;
    }
    uint64_t pos = fl->n_flights++;
    while (pos > 0) {
        uint64_t parent = (pos - 1) / 2;
        if (!flight_less(&f, &fl->flights[parent]))
            break;
        fl->flights[pos] = fl->flights[parent];
        pos = parent;
    }
    fl->flights[pos] = f;
    return CHM_OK;
}

static struct chm_flight flight_pop(struct chm_flusher *fl)
{
    struct chm_flight top = fl->flights[0], last = fl->flights[--fl->n_flights];
    uint64_t n = fl->n_flights, pos = 0;
    if (n) {
        for (;;) {
            uint64_t child = 2 * pos + 1;
            if (child >= n)
                break;
            if (child + 1 < n && flight_less(&fl->flights[child + 1], &fl->flights[child]))
                child++;
            if (!flight_less(&fl->flights[child], &last))
                break;
            fl->flights[pos] = fl->flights[child];
            pos = child;
        }
        fl->flights[pos] = last;
    }
    return top;
}

static int by_order(const void *a, const void *b)
{
    uint64_t x = ((const struct chm_flight *)a)->order, y = ((const struct chm_flight *)b)->order;
    return (x > y) - (x < y);
}

static int by_finish_order(const void *a, const void *b)
{
    const struct chm_flight *x = a, *y = b;
    return flight_less(x, y) ? -1 : flight_less(y, x) ? 1 : 0;
}

int chm_flusher_new(uint32_t frames, uint8_t *queued, struct chm_flusher **out)
{
    struct chm_flusher *fl = calloc(1, sizeof *fl);
    if (!fl)
        return CHM_E_NOMEM;
    fl->frames = frames;
    fl->pages_in_flight_limit = -1;
    fl->queued = queued;
    if (!queued) {
        fl->queued = calloc(frames ? frames : 1, 1);
        fl->owns_queued = 1;
    }
    fl->dirty_frame = malloc((size_t)(frames ? frames : 1) * sizeof *fl->dirty_frame);
    fl->dirty_since = malloc((size_t)(frames ? frames : 1) * sizeof *fl->dirty_since);
    fl->scratch = malloc((size_t)(frames ? frames : 1) * sizeof(struct seq_entry));
    if (!fl->queued || !fl->dirty_frame || !fl->dirty_since || !fl->scratch) {
        chm_flusher_free(fl);
        return CHM_E_NOMEM;
    }
    *out = fl;
    return CHM_OK;
}

void chm_flusher_free(struct chm_flusher *fl)
{
    if (!fl)
        return;
    for (uint64_t i = 0; i < fl->n_flights; i++)
        free(fl->flights[i].seqs);
    free(fl->flights);
    if (fl->owns_queued)
        free(fl->queued);
    free(fl->dirty_frame);
    free(fl->dirty_since);
    free(fl->scratch);
    free(fl->landed);
    free(fl);
}

/* -- the flusher (Flusher) -- */

static int at_flight_limit(const struct chm_flusher *fl)
{
    return fl->pages_in_flight_limit >= 0 && fl->flushing_pages >= (uint64_t)fl->pages_in_flight_limit;
}

/* Flusher._flight_room_at; NaN: no memory. Cached until a flush starts: flights land in (finish, order)
 * order, a prefix of the sorted flights, which lowers the pages that must land by as many as landed, so
 * while still at the limit the flight that brings them under it is the same one. */
static double flight_room_at(struct chm_flusher *fl)
{
    if (!fl->n_flights)
        return 0.0;  /* (at the limit with none in flight: a limit of 0) */
    if (!fl->room_valid || fl->room_order != fl->flight_order) {
        uint64_t must_land = fl->flushing_pages - (uint64_t)fl->pages_in_flight_limit + 1, landed = 0;
        double at = 0.0;
        if (fl->n_flights && fl->flights[0].pages >= must_land) {  /* the first to land is enough: the heap's top */
            fl->room_order = fl->flight_order;
            fl->room_pages = fl->flushing_pages;
            fl->room_at = fl->flights[0].finish;
            fl->room_valid = 1;
            return fl->room_at;
        }
        struct chm_flight *sorted = malloc((size_t)(fl->n_flights ? fl->n_flights : 1) * sizeof *sorted);
        if (!sorted)
            return NOT_A_TIME;
        memcpy(sorted, fl->flights, (size_t)fl->n_flights * sizeof *sorted);
        qsort(sorted, fl->n_flights, sizeof *sorted, by_finish_order);
        for (uint64_t i = 0; i < fl->n_flights; i++) {
            at = sorted[i].finish;
            landed += sorted[i].pages;
            if (landed >= must_land)
                break;
        }
        free(sorted);
        fl->room_order = fl->flight_order;
        fl->room_pages = fl->flushing_pages;
        fl->room_at = at;
        fl->room_valid = 1;
    }
    return fl->room_at;
}

/* Policy.next_flush_at (CachePolicy's or HymCachePolicy's): 1 and *at, or 0 (never); NaN *at: no memory. */
static int next_flush_at(const struct chm_dev *d, const struct chm_flusher *fl, double now, double *at)
{
    if (!fl->n_dirty)
        return 0;
    double oldest = fl->dirty_since[fl->dirty_head];
    if (fl->rule == CHM_FLUSH_AFTER_DELAY) {
        *at = py_max(now, chm_delay_due_at(oldest, fl->writeback_delay_ns));
        return 1;
    }
    double batch_full = fl->n_dirty >= fl->batch_pages ? fl->dirty_since[ring_at(fl, fl->batch_pages - 1)] : 0.0;
    double ready = chm_arbiter_ready_at(fl->batch_pages, fl->max_delay_ns, fl->n_dirty, oldest, batch_full);
    *at = py_max(py_max(now, ready), reads_idle_at(d, now, fl->max_reads_in_flight));
    return 1;
}

/* Policy.flush_grant */
static uint64_t flush_grant(const struct chm_flusher *fl, double now, uint64_t reads, int force)
{
    if (fl->rule == CHM_FLUSH_AFTER_DELAY) {
        if (force)
            return fl->n_dirty;
        double due_before = now - fl->writeback_delay_ns;
        uint64_t n = 0;
        while (n < fl->n_dirty && !(fl->dirty_since[ring_at(fl, n)] > due_before))
            n++;
        return n;
    }
    double oldest_age = fl->n_dirty ? now - fl->dirty_since[fl->dirty_head] : 0.0;
    return chm_arbiter_grant(fl->batch_pages, fl->max_reads_in_flight, fl->max_delay_ns, fl->n_dirty, reads,
                             oldest_age, force);
}

static int seq_by_page(const void *a, const void *b)
{
    uint64_t x = ((const struct seq_entry *)a)->page, y = ((const struct seq_entry *)b)->page;
    return (x > y) - (x < y);
}

static uint64_t page_of_frame(const struct chm_dev *d, uint32_t frame)
{
    uint32_t local;
    struct chm_ft *ft = frame_table(d, frame, &local);
    return ft->page_of[local];
}

/* Flusher._write_run of entries[0, n) */
static int write_run(struct seq *q, const struct seq_entry *run, uint32_t n, double now)
{
    struct chm_flusher *fl = q->fl;
    double finish = seq_media_write(q, run[0].page, n, now);
    int64_t *seqs = malloc((size_t)n * (sizeof *seqs + sizeof(double)));
    if (!seqs)
        return CHM_E_NOMEM;
    double *since = (double *)(seqs + n);
    for (uint32_t i = 0; i < n; i++) {
        seqs[i] = q->d->write_seq[run[i].frame];
        since[i] = run[i].since;
    }
    fl->flight_order++;
    fl->flushing_pages += n;
    struct chm_flight f = {.finish = finish, .order = fl->flight_order, .frame = run[0].frame, .pages = n,
                           .seqs = seqs, .since = since};
    if (flight_push(fl, f)) {
        free(seqs);
        return CHM_E_NOMEM;
    }
    q->c->flushed_pages += n;
    return CHM_OK;
}

/* Flusher.start_flush of the dirty queue's n oldest entries (popped) */
static int start_flush(struct seq *q, uint64_t n, double now)
{
    struct chm_flusher *fl = q->fl;
    struct seq_entry *e = fl->scratch;
    q->c->flush_batches++;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t k = ring_at(fl, 0);
        e[i].frame = fl->dirty_frame[k];
        e[i].since = fl->dirty_since[k];
        e[i].page = page_of_frame(q->d, e[i].frame);
        fl->dirty_head = k + 1 == fl->frames ? 0 : k + 1;
        fl->n_dirty--;
    }
    if (n > 1)
        qsort(e, n, sizeof *e, seq_by_page);  /* pages are distinct: sorted() is stable, qsort the same */
    for (uint64_t i = 0; i < n; i++) {
        fl->queued[e[i].frame] = 0;
        pol_pin(q, e[i].frame);
    }
    for (uint64_t start = 0, i = 1; i <= n; i++) {
        if (i < n && e[i].frame == e[i - 1].frame + 1 && seq_contiguous(q->d, e[i - 1].page, e[i].page))
            continue;
        int rc = write_run(q, e + start, (uint32_t)(i - start), now);
        if (rc)
            return rc;
        start = i;
    }
    return CHM_OK;
}

/* Flusher.complete_flights: the latest finish retired; NaN: no memory. */
static double complete_flights(struct seq *q, double now)
{
    struct chm_flusher *fl = q->fl;
    uint64_t n = 0;
    while (fl->n_flights && fl->flights[0].finish <= now) {
        if (n == fl->landed_cap) {
            uint64_t cap = fl->landed_cap ? 2 * fl->landed_cap : 64;
            void *grown = realloc(fl->landed, (size_t)cap * sizeof(struct chm_flight));
            if (!grown) {
                q->rc = CHM_E_NOMEM;
                return NOT_A_TIME;
            }
            fl->landed = grown;
            fl->landed_cap = cap;
        }
        ((struct chm_flight *)fl->landed)[n++] = flight_pop(fl);
    }
    struct chm_flight *landed = fl->landed;
    if (n > 1)
        qsort(landed, n, sizeof *landed, by_order);  /* retired in issue order */
    double latest = 0.0;
    for (uint64_t i = 0; i < n; i++) {
        struct chm_flight *f = &landed[i];
        fl->flushing_pages -= f->pages;
        for (uint32_t j = 0; j < f->pages; j++) {
            uint32_t frame = f->frame + j;
            pol_unpin(q, frame);
            if (q->d->write_seq[frame] == f->seqs[j] && !fl->queued[frame])
                pol_flushed(q, frame);
        }
        latest = py_max(latest, f->finish);
        free(f->seqs);
    }
    return latest;
}

/* Flusher.tick (data off: no failed staging read to drop, no backoff) */
static int tick(struct seq *q, double now, int force)
{
    struct chm_flusher *fl = q->fl;
    double latest = complete_flights(q, now);
    if (latest != latest)
        return q->rc;
    if (!force && at_flight_limit(fl))
        return CHM_OK;
    while (fl->n_dirty) {
        uint64_t n = flush_grant(fl, now, reads_in_flight(q->d, now), force);
        if (n == 0)
            return CHM_OK;
        int rc = start_flush(q, n, now);
        if (rc)
            return rc;
        if (!force)
            return CHM_OK;
    }
    return CHM_OK;
}

/* Flusher.next_event_ns (data off): 1 and *due, or 0; NaN *due: no memory. */
static int next_event(const struct chm_dev *d, struct chm_flusher *fl, double now, double *due)
{
    int has = 0;
    double at = 0.0;
    if (fl->n_dirty && at_flight_limit(fl)) {
        at = flight_room_at(fl);
        has = 1;
    }
    double grant;
    if (fl->n_dirty && !at_flight_limit(fl) && next_flush_at(d, fl, now, &grant) && (!has || grant < at)) {
        at = grant;
        has = 1;
    }
    if (has)
        *due = py_max(now, at);
    return has;
}

/* Flusher.flush: its finish; NaN: no memory. */
static double dev_flush(struct seq *q, double now)
{
    struct chm_flusher *fl = q->fl;
    q->c->flush_calls++;
    int rc = tick(q, now, 1);
    if (rc) {
        q->rc = rc;
        return NOT_A_TIME;
    }
    double done = now;
    for (uint64_t i = 0; i < fl->n_flights; i++)
        done = py_max(done, fl->flights[i].finish);
    double latest = complete_flights(q, 1.0 / 0.0);
    if (latest != latest)
        return NOT_A_TIME;
    return done;
}

/* -- the controller's data-off steps -- */

/* Controller._take_frame (with Flusher.write_back): the frame is free from the time returned. */
static double take_frame(struct seq *q, const struct chm_access *a, uint32_t frame, double now)
{
    double ready = now;
    if (a->victim_page != CHM_NO_PAGE) {
        q->c->evictions++;
        if (a->victim_dirty) {
            q->c->dirty_evictions++;
            fl_unqueue(q->fl, frame);
            ready = seq_media_write(q, a->victim_page, 1, now);
        }
    }
    return ready;
}

/* Controller._allocate: a frame of `area` for `page` (not resident), or -1 (q->rc says why); *now moves
 * past the flushes in flight when every frame was pinned. */
static int64_t allocate(struct seq *q, const struct chm_dev_area *area, uint64_t page, double *now,
                        struct chm_access *a)
{
    int rc = chm_ft_insert(area->table, page, a);
    if (rc == CHM_ALL_PINNED) {
        double latest = complete_flights(q, 1.0 / 0.0);
        if (latest != latest)
            return -1;
        *now = py_max(*now, latest);
        rc = chm_ft_insert(area->table, page, a);
    }
    if (rc != CHM_OK) {
        q->rc = rc == CHM_ALL_PINNED ? CHM_NO_FRAME : rc;
        q->failed_page = page;
        return -1;
    }
    return (int64_t)area->base + a->frame;
}

/* The area clean pages are staged into (Policy.allocate_clean, staged_lookup): the read area. */
static const struct chm_dev_area *clean_area(const struct seq *q)
{
    return q->fl->copy_area.table ? &q->fl->copy_area : &q->fl->write_area;
}

/* Controller._stage at t into the read area; the frame, or -1. */
static int64_t stage(struct seq *q, uint64_t page, double t)
{
    struct chm_access a;
    int64_t frame = allocate(q, clean_area(q), page, &t, &a);
    if (frame < 0)
        return -1;
    double ready = take_frame(q, &a, (uint32_t)frame, t);
    double done = seq_media_read(q, page, t);
    if (done != done)
        return -1;
    q->d->ready_at[frame] = py_max(done, ready);
    return frame;
}

/* Controller._copy_out of pages [first, last] (in frames[], or looked up when frames is NULL) at t: the
 * DRAM pipe, then the link, page by page (the two pipes are apart: the same as a stream through each). */
static double copy_out(struct seq *q, uint64_t addr, uint64_t len, uint64_t first, uint64_t last,
                       const uint32_t *frames, double t)
{
    struct chm_dev *d = q->d;
    const uint64_t page_size = d->page_size, first_page = addr / page_size, end = addr + len;
    double arrival = t;
    for (uint64_t page = first; page <= last; page++) {
        uint64_t frame = frames ? frames[page - first] : (uint64_t)area_lookup(&d->areas[0], page);
        uint64_t base = page * page_size;
        uint64_t lo = page == first_page ? addr - base : 0;
        uint64_t hi = end < base + page_size ? end - base : page_size;
        double ready = d->ready_at[frame];
        if (ready <= t)
            d->counts.hit_bytes += hi - lo;
        arrival = chm_pipe_transfer(d->link_to_host,
                                    chm_pipe_transfer(d->dram_pipe, ready > t ? ready : t, hi - lo, 1.0),
                                    hi - lo, 1.0);
    }
    return arrival;
}

/* Controller.read (no buffer) of a device of one area after its tick; its finish, or NaN. pages[0..2]: the
 * pages hit, missed and merged. */
static double seq_read(struct seq *q, uint64_t addr, uint64_t len, double now, int count_command, uint64_t *pages_out)
{
    struct chm_dev *d = q->d;
    const struct chm_dev_area *area = &d->areas[0];
    double finish;
    int64_t hit = chm_dev_read_hit(d, addr, len, now, NULL, count_command, &finish);
    if (hit) {
        pages_out[0] = (uint64_t)hit;
        pages_out[1] = pages_out[2] = 0;
        return finish;
    }
    const uint64_t first = addr / d->page_size, last = (addr + len - 1) / d->page_size, pages = last - first + 1;
    uint64_t hits = 0, missed = 0, merged = 0;
    d->counts.read_bytes += len;
    double t = chm_clocked_run(d->controller, now, d->cycles_per_command + pages * d->cycles_per_lookup);
    int all_resident = 1;
    for (uint64_t page = first; page <= last && all_resident; page++)
        all_resident = area_lookup(area, page) >= 0;
    if (all_resident) {  /* nothing can be evicted: nothing pinned */
        for (uint64_t page = first; page <= last; page++) {
            int64_t frame = area_lookup(area, page);
            if (d->ready_at[frame] > t)
                merged++;
            else
                pol_touch(q, (uint32_t)frame);
        }
        hits = pages - merged;
        d->counts.page_hits += hits;
        q->c->merged_misses += merged;
        finish = copy_out(q, addr, len, first, last, NULL, t);
    } else {  /* staging may evict: pin what a chunk uses until it is copied (_lookup_or_stage) */
        uint32_t chunk[SEQ_MAX_CHUNK];
        finish = t;
        for (uint64_t start = first; start <= last; start += d->chunk_pages) {
            uint64_t end = last - start < d->chunk_pages ? last : start + d->chunk_pages - 1;
            for (uint64_t page = start; page <= end; page++) {
                int64_t frame = area_lookup(area, page);
                if (frame < 0) {
                    missed++;
                    q->c->page_misses++;
                    frame = stage(q, page, t);
                    if (frame < 0) {
                        for (uint64_t p = start; p < page; p++)  /* the finally: unpin what it pinned */
                            pol_unpin(q, chunk[p - start]);
                        return NOT_A_TIME;
                    }
                } else if (d->ready_at[frame] > t) {
                    merged++;
                    q->c->merged_misses++;
                } else {
                    hits++;
                    d->counts.page_hits++;
                    pol_touch(q, (uint32_t)frame);
                }
                pol_pin(q, (uint32_t)frame);
                chunk[page - start] = (uint32_t)frame;
            }
            finish = py_max(finish, copy_out(q, addr, len, start, end, chunk, t));
            for (uint64_t page = start; page <= end; page++)
                pol_unpin(q, chunk[page - start]);
        }
    }
    if (count_command) {  /* Controller.count_command */
        d->counts.reads++;
        chm_histogram_add(d->read_latency, finish - now);
    }
    pages_out[0] = hits;
    pages_out[1] = missed;
    pages_out[2] = merged;
    return finish;
}

/* Controller._fill_partial (no bytes) */
static double fill_partial(struct seq *q, uint32_t frame, uint64_t page, double now)
{
    int64_t copy = area_lookup(&q->fl->copy_area, page);
    if (copy >= 0 && (uint32_t)copy != frame)
        return py_max(now, q->d->ready_at[copy]);
    q->c->rmw_reads++;
    return seq_media_read(q, page, now);
}

/* Controller._write_page (no bytes) at now; its finish, or NaN. */
static double write_page(struct seq *q, uint64_t page, uint64_t lo, uint64_t hi, double now)
{
    struct chm_dev *d = q->d;
    struct chm_flusher *fl = q->fl;
    int64_t frame = area_lookup(&fl->write_area, page);
    double ready = now;
    if (frame < 0) {
        struct chm_access a;
        frame = allocate(q, &fl->write_area, page, &now, &a);
        if (frame < 0)
            return NOT_A_TIME;
        ready = take_frame(q, &a, (uint32_t)frame, now);
        d->ready_at[frame] = now;
        if (hi - lo < d->page_size) {  /* partial page: the rest from DRAM's staged copy or the media */
            double filled = fill_partial(q, (uint32_t)frame, page, now);
            if (filled != filled)
                return filled;
            ready = py_max(ready, filled);
        }
    } else {
        pol_touch(q, (uint32_t)frame);
    }
    d->write_seq[frame]++;
    pol_mark_dirty(q, (uint32_t)frame);
    fl_enqueue(fl, (uint32_t)frame, now);
    return chm_pipe_transfer(d->dram_pipe, py_max(ready, d->ready_at[frame]), hi - lo, 1.0);
}

/* Controller.write (no bytes) after its tick; CHM_OK (out: its finish and pages) or a status. */
static int seq_write(struct seq *q, uint64_t addr, uint64_t len, double now, int count_command,
                     struct chm_write_result *out)
{
    struct chm_dev *d = q->d;
    struct chm_flusher *fl = q->fl;
    const uint64_t page_size = d->page_size, first = addr / page_size, last = (addr + len - 1) / page_size;
    const uint64_t pages = last - first + 1, end = addr + len;
    uint64_t new_pages = 0;
    for (uint64_t page = first; page <= last; page++)
        new_pages += area_lookup(&fl->write_area, page) < 0;
    out->new_pages = new_pages;
    out->pages = pages;
    if (new_pages > fl->write_buffer_frames && fl->write_buffer_frames > 0)
        return CHM_WRITE_TOO_BIG;
    if (fl->admission && !chm_admission_admit(fl->admission, new_pages)) {
        q->c->refused_writes++;
        q->c->refused_write_bytes += len;
        return CHM_WRITE_REFUSED;
    }
    q->c->write_bytes += len;
    double arrived = chm_pipe_transfer(d->link_to_device, now, len, 1.0);
    double t = chm_clocked_run(d->controller, arrived, d->cycles_per_command + pages * d->cycles_per_admission);
    double finish = t;
    for (uint64_t page = first; page <= last; page++) {
        uint64_t base = page * page_size;
        uint64_t lo = addr > base ? addr - base : 0;
        uint64_t hi = end < base + page_size ? end - base : page_size;
        double done = write_page(q, page, lo, hi, t);
        if (done != done) {
            out->page = q->failed_page;
            return q->rc ? q->rc : CHM_E_INTERNAL;
        }
        finish = py_max(finish, done);
    }
    if (count_command) {
        q->c->writes++;
        chm_histogram_add(d->write_latency, finish - now);
    }
    out->finish = finish;
    return CHM_OK;
}

static int range_ok(const struct chm_dev *d, uint64_t addr, uint64_t len)
{
    return len != 0 && addr <= d->capacity && len <= d->capacity - addr;
}

static struct seq dev_seq(struct chm_dev *d)
{
    struct seq q = {.d = d, .fl = d->flusher, .c = d->ops};
    return q;
}

/* -- the single operations -- */

int chm_dev_tick(struct chm_dev *d, double now, int force)
{
    struct seq q = dev_seq(d);
    uint64_t batches = q.c->flush_batches;
    int rc = tick(&q, now, force);
    return rc ? rc : q.c->flush_batches != batches;
}

double chm_dev_complete_flights(struct chm_dev *d, double now)
{
    struct seq q = dev_seq(d);
    return complete_flights(&q, now);
}

int chm_dev_next_event(struct chm_dev *d, double now, double *due)
{
    return next_event(d, d->flusher, now, due);
}

int chm_dev_run_until(struct chm_dev *d, double from, double until, uint64_t *ran, double *t)
{
    struct seq q = dev_seq(d);
    double due;
    *ran = 0;
    *t = from;
    while (next_event(d, q.fl, *t, &due) && due <= until) {
        if (due != due)
            return CHM_E_NOMEM;
        uint64_t batches = q.c->flush_batches, flights = q.fl->n_flights;
        int rc = tick(&q, due, 0);
        if (rc)
            return rc;
        if (q.c->flush_batches == batches && q.fl->n_flights == flights) {
            *t = due;
            return CHM_E_INTERNAL;
        }
        *t = due;
        ++*ran;
    }
    return CHM_OK;
}

double chm_dev_quiet_until(struct chm_dev *d, double now)
{
    struct chm_flusher *fl = d->flusher;
    double until = fl->n_flights ? fl->flights[0].finish : 1.0 / 0.0, grant;
    if (fl->n_dirty && !at_flight_limit(fl) && next_flush_at(d, fl, now, &grant) && grant < until)
        until = grant;
    return until;
}

double chm_dev_flush(struct chm_dev *d, double now)
{
    struct seq q = dev_seq(d);
    return dev_flush(&q, now);
}

double chm_dev_write_back(struct chm_dev *d, uint32_t frame, uint64_t victim_page, double now)
{
    struct seq q = dev_seq(d);
    q.c->dirty_evictions++;
    fl_unqueue(q.fl, frame);
    return seq_media_write(&q, victim_page, 1, now);
}

int chm_dev_write(struct chm_dev *d, uint64_t addr, uint64_t len, double now, int count_command,
                  struct chm_write_result *out)
{
    if (!range_ok(d, addr, len))
        return CHM_E_ARG;
    struct seq q = dev_seq(d);
    int rc = tick(&q, now, 0);
    if (rc)
        return rc;
    return seq_write(&q, addr, len, now, count_command, out);
}

int64_t chm_dev_read(struct chm_dev *d, uint64_t addr, uint64_t len, double now, int count_command, double *out)
{
    if (!range_ok(d, addr, len) || d->n_areas != 1 || d->chunk_pages > SEQ_MAX_CHUNK || !d->chunk_pages)
        return CHM_E_ARG;
    struct seq q = dev_seq(d);
    uint64_t pages[3];
    double finish = seq_read(&q, addr, len, now, count_command, pages);
    if (finish != finish) {
        out[1] = (double)q.failed_page;
        return q.rc ? q.rc : CHM_E_INTERNAL;
    }
    out[0] = finish;
    out[1] = (double)pages[0];
    out[2] = (double)pages[1];
    out[3] = (double)pages[2];
    return (int64_t)(pages[0] + pages[1] + pages[2]);
}

int chm_dev_prefetch_fetch(struct chm_dev *d, struct chm_pf *pf, double t, uint32_t *frames,
                           struct chm_prefetch_result *out)
{
    struct seq q = dev_seq(d);
    const struct chm_dev_area *clean = clean_area(&q);
    memset(out, 0, sizeof *out);
    out->ready_at = t;
    int64_t handle;
    uint64_t page;
    while (chm_pf_next_fetch(pf, &handle, &page)) {
        t = chm_clocked_run(d->controller, t, d->cycles_per_prefetch_page);
        out->t = t;
        int64_t frame = area_lookup(clean, page);  /* Policy.staged_lookup */
        const struct chm_dev_area *area;
        if (frame < 0 && dev_lookup(d, page, &area) >= 0) {  /* Policy.lookup: the newest data is written */
            out->resident++;
            continue;
        }
        if (frame < 0) {
            out->staged++;
            frame = stage(&q, page, t);
            if (frame < 0) {
                out->page = page;
                return q.rc ? q.rc : CHM_E_INTERNAL;
            }
        } else {
            out->resident++;
            pol_touch(&q, (uint32_t)frame);
        }
        pol_pin(&q, (uint32_t)frame);
        frames[out->frames++] = (uint32_t)frame;
        out->ready_at = py_max(out->ready_at, d->ready_at[frame]);
    }
    out->t = t;
    return CHM_OK;
}

void chm_dev_release_frames(struct chm_dev *d, const uint32_t *frames, uint64_t n)
{
    struct seq q = dev_seq(d);
    const struct chm_dev_area *clean = clean_area(&q);
    for (uint64_t i = 0; i < n; i++) {
        uint32_t frame = frames[i];
        pol_unpin(&q, frame);
        if (q.fl->drops_staged_on_release && frame >= clean->base && frame - clean->base < clean->table->frames
            && clean->table->pins[frame - clean->base] == 0)  /* HymCachePolicy.released */
            chm_ft_invalidate(clean->table, frame - clean->base);
    }
}

/* -- the sequential path -- */

int chm_dev_run_sequential(struct chm_dev *d, const uint8_t *kinds, const uint64_t *addrs, const uint64_t *lengths,
                           uint64_t n, double now, struct chm_seq_result *out)
{
    memset(out, 0, sizeof *out);
    out->now = now;
    if (d->n_areas != 1 || !d->n_ssds || !d->chunk_pages || d->chunk_pages > SEQ_MAX_CHUNK || !d->stripe_bytes
        || !d->page_size)
        return CHM_E_ARG;
    struct seq q = {.d = d, .fl = d->flusher, .c = &out->counts};
    struct chm_flusher *own = NULL;
    if (!q.fl) {  /* the flusher is Python's, settled: a private one, left settled too */
        uint32_t frames = d->areas[0].base + d->areas[0].table->frames;
        if (chm_flusher_new(frames, NULL, &own))
            return CHM_E_NOMEM;
        own->write_area = d->areas[0];
        own->write_area_frames = d->areas[0].table->frames;
        q.fl = own;
    }
    uint64_t order0 = q.fl->flight_order;
    int rc = CHM_OK;
    for (uint64_t i = 0; i < n && rc == CHM_OK; i++) {
        uint64_t addr = addrs[i], len = lengths[i];
        if (kinds[i] > CHM_SEQ_WRITE || !range_ok(d, addr, len)) {
            rc = CHM_E_ARG;  /* Controller.check_range (or the kind) refuses it */
            break;
        }
        /* room for the finish of every read it may stage (the pages, or a partial write's two ends) */
        uint64_t pages = (addr + len - 1) / d->page_size - addr / d->page_size + 1;
        for (uint32_t s = 0; s < d->n_ssds && rc == CHM_OK; s++)
            rc = chm_ssd_reserve(d->ssds[s], kinds[i] == CHM_SEQ_READ ? pages : 2);
        if (rc)
            break;
        double finish;
        if (kinds[i] == CHM_SEQ_READ) {  /* its tick has nothing to do: nothing dirty, nothing in flight */
            uint64_t counted[3];
            finish = seq_read(&q, addr, len, now, 1, counted);
        } else {
            struct chm_write_result w;
            finish = seq_write(&q, addr, len, now, 1, &w) == CHM_OK ? w.finish : NOT_A_TIME;
            out->write_misses += w.new_pages;
            if (finish == finish)
                finish = dev_flush(&q, finish);
        }
        if (finish != finish) {
            rc = q.rc == CHM_E_NOMEM ? CHM_E_NOMEM : CHM_E_INTERNAL;
            break;
        }
        now = finish;
        out->done = i + 1;
        out->now = now;
    }
    out->flush_writes = q.fl->flight_order - order0;
    chm_flusher_free(own);
    return rc;
}
