/* The device side of the queue pairs: see chm_srv.h and chm_wire.h. */
#include <stddef.h>
#include <string.h>

#include "chm_srv.h"
#include "chm_sync.h"

_Static_assert(sizeof(struct chm_sqe) == 64, "a command is one cache line");
_Static_assert(sizeof(struct chm_cqe) == 32, "two completions per cache line");
_Static_assert(offsetof(struct chm_ring_ctl, tail) == 64, "producer and consumer on separate lines");
_Static_assert(offsetof(struct chm_node, server_sleeping) % 64 == 0, "sleep flag on its own line");
_Static_assert(sizeof(struct chm_qp_hdr) % 64 == 0, "rings start on a cache line");

static uint64_t align_up(uint64_t x, uint64_t a)
{
    return (x + a - 1) / a * a;
}

uint64_t chm_srv_qp_layout(uint32_t sq_entries, uint32_t cq_entries, uint64_t staging_bytes,
                           uint64_t *sq_off, uint64_t *cq_off, uint64_t *stats_off, uint64_t *staging_off)
{
    uint64_t off = sizeof(struct chm_qp_hdr);
    *sq_off = off;
    off += (uint64_t)sq_entries * sizeof(struct chm_sqe);
    *cq_off = off = align_up(off, 64);
    off += (uint64_t)cq_entries * sizeof(struct chm_cqe);
    *stats_off = off = align_up(off, 64);
    off += sizeof(struct chm_wire_stats);
    *staging_off = off = align_up(off, CHM_STAGING_ALIGN);
    return off + staging_bytes;
}

void chm_srv_qp_init(struct chm_srv_qp *s, void *base, uint32_t client_id, uint32_t sq_entries,
                     uint32_t cq_entries, uint64_t staging_bytes)
{
    struct chm_qp_hdr *h = base;
    uint64_t sq_off, cq_off, stats_off, staging_off;
    uint64_t total = chm_srv_qp_layout(sq_entries, cq_entries, staging_bytes, &sq_off, &cq_off, &stats_off, &staging_off);

    memset(h, 0, sizeof(*h));
    h->version = CHM_WIRE_VERSION;
    h->client_id = client_id;
    h->sq_entries = sq_entries;
    h->cq_entries = cq_entries;
    h->sq_offset = sq_off;
    h->cq_offset = cq_off;
    h->stats_offset = stats_off;
    h->staging_offset = staging_off;
    h->staging_bytes = staging_bytes;
    h->total_bytes = total;
    chm_store_release(&h->magic, CHM_QP_MAGIC);

    memset(s, 0, sizeof(*s));
    s->hdr = h;
    s->sq = (struct chm_sqe *)((char *)base + sq_off);
    s->cq = (struct chm_cqe *)((char *)base + cq_off);
    s->sq_entries = sq_entries;
    s->cq_entries = cq_entries;
}

static uint32_t cq_room(const struct chm_srv_qp *s)
{
    uint32_t used = s->cq_tail - chm_load_acquire(&s->hdr->cq.head);
    if (used > s->cq_entries)       /* head corrupted by the client: its queue stalls, nobody else's */
        return 0;
    uint32_t room = s->cq_entries - used;
    return room > s->held ? room - s->held : 0;
}

int chm_srv_fetch(struct chm_srv_qp *s, struct chm_sqe *out, unsigned max)
{
    uint32_t tail = chm_load_acquire(&s->hdr->sq.tail);
    uint32_t avail = tail - s->sq_head;
    if (avail > s->sq_entries) {
        s->sq_head = tail;
        chm_store_release(&s->hdr->sq.head, s->sq_head);
        if (cq_room(s))     /* tell the client, if its completion ring has room */
            chm_srv_post(s, 0, -EPROTO, 0, 0);
        return -EPROTO;
    }
    uint32_t room = cq_room(s);
    unsigned n = avail < room ? avail : room;
    if (n > max)
        n = max;
    for (unsigned i = 0; i < n; i++)    /* a private copy: the client may rewrite the slot meanwhile */
        memcpy(&out[i], &s->sq[(s->sq_head + i) & (s->sq_entries - 1)], sizeof(*out));
    s->sq_head += n;
    if (n)
        chm_store_release(&s->hdr->sq.head, s->sq_head);
    return (int)n;
}

void chm_srv_post(struct chm_srv_qp *s, uint64_t user_data, int64_t res, uint64_t latency_ns, uint64_t clock_ns)
{
    struct chm_cqe *c = &s->cq[s->cq_tail & (s->cq_entries - 1)];
    c->user_data = user_data;
    c->res = res;
    c->latency_ns = latency_ns;
    c->clock_ns = clock_ns;
    s->cq_tail++;
    chm_store_release(&s->hdr->cq.tail, s->cq_tail);
    chm_fence();
    if (__atomic_load_n(&s->hdr->cq.waiting, __ATOMIC_RELAXED))
        chm_futex_wake(&s->hdr->cq.tail);
}

int chm_srv_pending(struct chm_srv_qp **qps, unsigned n, uint64_t spin_ns)
{
    uint64_t deadline = spin_ns ? chm_now_ns() + spin_ns : 0;
    unsigned steps = 0;
    for (;;) {
        for (unsigned i = 0; i < n; i++) {
            struct chm_srv_qp *s = qps[i];
            if (chm_load_acquire(&s->hdr->sq.tail) != s->sq_head && cq_room(s))
                return (int)i;
        }
        if (!spin_ns || chm_now_ns() >= deadline)
            return -1;
        chm_spin_step(&steps);
    }
}

void chm_srv_set_sleeping(struct chm_node *node, uint32_t sleeping)
{
    chm_store_fence(&node->server_sleeping, sleeping);
}
