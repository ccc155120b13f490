/* The device side of the queue pairs: see chm_srv.h and chm_wire.h. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

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

    struct chm_sqe *batch = s->batch;   /* the caller's */
    memset(s, 0, sizeof(*s));
    s->hdr = h;
    s->sq = (struct chm_sqe *)((char *)base + sq_off);
    s->cq = (struct chm_cqe *)((char *)base + cq_off);
    s->sq_entries = sq_entries;
    s->cq_entries = cq_entries;
    s->staging = (uint8_t *)base + staging_off;
    s->staging_bytes = staging_bytes;
    s->batch = batch;
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
        s->bad_tails++;
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

static int has_command(const struct chm_srv_qp *s)
{
    return !s->parked && chm_load_acquire(&s->hdr->sq.tail) != s->sq_head && cq_room(s);
}

int chm_srv_pending(struct chm_srv_qp **qps, unsigned n, uint64_t spin_ns)
{
    uint64_t deadline = spin_ns ? chm_now_ns() + spin_ns : 0;
    unsigned steps = 0;
    for (;;) {
        for (unsigned i = 0; i < n; i++) {
            if (has_command(qps[i]))
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

int chm_srv_check(const struct chm_sqe *e, uint64_t capacity, uint64_t staging_bytes, uint32_t *field)
{
#define BAD(f, err) do { *field = (f); return -(err); } while (0)
    const uint8_t op = e->opcode;
    if (op == 0 || op > CHM_OP_MAX)
        BAD(CHM_SQE_OPCODE, EINVAL);
    if (e->flags) {                         /* the rare case: which flags does this opcode allow? */
        const uint8_t allowed = op == CHM_OP_WAIT ? CHM_WAIT_LOOK
                              : op == CHM_OP_MAP_FAULT ? CHM_FAULT_WRITE
                              : op == CHM_OP_MAP_ACK ? CHM_ACK_FAILED : 0;
        if (e->flags & ~allowed)
            BAD(CHM_SQE_FLAGS, EINVAL);
    }
    if (e->rsvd0)
        BAD(CHM_SQE_RSVD0, EINVAL);
    if (e->rsvd1)
        BAD(CHM_SQE_RSVD1, EINVAL);
    if (e->rsvd2)
        BAD(CHM_SQE_RSVD2, EINVAL);
    switch (op) {
    case CHM_OP_READ:
    case CHM_OP_WRITE:
    case CHM_OP_PREFETCH:
        if (e->len == 0)
            BAD(CHM_SQE_LEN, EINVAL);
        if (e->addr >= capacity)
            BAD(CHM_SQE_ADDR, ERANGE);
        if (e->len > capacity - e->addr)    /* addr + len, without the sum */
            BAD(CHM_SQE_LEN, ERANGE);
        if (op == CHM_OP_PREFETCH)          /* no staging range */
            break;
        /* fall through */
    case CHM_OP_STATS_JSON:
        if (e->len > staging_bytes)
            BAD(CHM_SQE_LEN, EFAULT);
        if (e->buf_offset > staging_bytes - e->len)
            BAD(CHM_SQE_BUF_OFFSET, EFAULT);
        break;
    case CHM_OP_WAIT:
    case CHM_OP_RELEASE:                    /* handles are >= 1; whose it is is the server's to say */
        if (e->handle < 1)
            BAD(CHM_SQE_HANDLE, EINVAL);
        break;
    case CHM_OP_MAP_FAULT:                  /* page alignment and the mapping's range are server.py's */
    case CHM_OP_MAP_ACK:
        if (e->addr >= capacity)
            BAD(CHM_SQE_ADDR, ERANGE);
        if (op == CHM_OP_MAP_FAULT && e->len == 0)
            BAD(CHM_SQE_LEN, EINVAL);
        if (op == CHM_OP_MAP_ACK && e->len)
            BAD(CHM_SQE_LEN, EINVAL);
        if (e->buf_offset)
            BAD(CHM_SQE_BUF_OFFSET, EINVAL);
        if (op == CHM_OP_MAP_FAULT ? e->handle != 0 : e->handle < 1)
            BAD(CHM_SQE_HANDLE, EINVAL);
        if (e->timeout_ns)
            BAD(CHM_SQE_TIMEOUT_NS, EINVAL);
        break;
    default:                                /* NOP, FLUSH, STATS: no other field is read */
        break;
    }
    return 0;
#undef BAD
}

/* server.py's _complete, without pacing (the C loop never paces) */
static void complete(struct chm_srv_loop *l, struct chm_srv_qp *q, uint64_t user_data, int64_t res, double start,
                     double finish)
{
    q->commands++;
    q->clock = finish;
    if (finish > l->floor)
        l->floor = finish;
    int64_t latency = (int64_t)(finish - start);
    chm_srv_post(q, user_data, res, latency > 0 ? (uint64_t)latency : 0, (uint64_t)finish);
}

/* Serve e here if it is a DRAM-hit read that needs nothing of Python; 1 if it was (completion posted). */
static int serve_hit(struct chm_srv_loop *l, struct chm_srv_qp *q, const struct chm_sqe *e)
{
    uint32_t field;
    if (e->opcode != CHM_OP_READ || e->len > l->chunk_bytes ||
        chm_srv_check(e, l->capacity, q->staging_bytes, &field))
        return 0;
    double start = l->floor > q->clock ? l->floor : q->clock;   /* server.py: max(c.clock, now) */
    double finish;
    if (!(start < l->quiet_until) ||
        l->read_hit(l->dev, e->addr, e->len, start, q->staging + e->buf_offset, 1, &finish) <= 0)
        return 0;
    complete(l, q, e->user_data, (int64_t)e->len, start, finish);
    l->hits++;
    return 1;
}

int64_t chm_srv_lease_add(struct chm_srv_qp *q, uint32_t frame, uint64_t page, uint64_t deadline_ns)
{
    if (q->lease_count >= q->lease_cap)
        return -EBUSY;
    int64_t id = (int64_t)((++q->lease_seq << CHM_LEASE_SEQ_SHIFT) | frame);
    q->leases[q->lease_count++] = (struct chm_srv_lease){ .id = id, .page = page, .frame = frame,
                                                           .deadline_ns = deadline_ns };
    return id;
}

/* The client's lease id for page, or NULL. */
static struct chm_srv_lease *lease_find(struct chm_srv_qp *q, int64_t id, uint64_t page)
{
    for (uint32_t i = 0; i < q->lease_count; i++) {
        if (q->leases[i].id == id && q->leases[i].page == page)
            return &q->leases[i];
    }
    return NULL;
}

static void lease_remove(struct chm_srv_qp *q, struct chm_srv_lease *ls)
{
    *ls = q->leases[--q->lease_count];
}

int chm_srv_lease_take(struct chm_srv_qp *q, int64_t id, uint64_t page, uint32_t *frame, uint32_t *expired)
{
    struct chm_srv_lease *ls = lease_find(q, id, page);
    if (!ls)
        return -ENOENT;
    *frame = ls->frame;
    *expired = ls->expired;
    lease_remove(q, ls);
    return 0;
}

/* Serve e here if it is a MAP_FAULT read of a page in DRAM, ready, or the MAP_ACK of a live lease; 1 if it
 * was. Everything else about a mapping (misses, writes, expired leases, bad entries) is mapping.py's. */
static int serve_map(struct chm_srv_loop *l, struct chm_srv_qp *q, const struct chm_sqe *e)
{
    uint32_t field;
    if (!l->map_hit || !q->map_len || q->map_cut_off || chm_srv_check(e, l->capacity, q->staging_bytes, &field))
        return 0;
    double start = l->floor > q->clock ? l->floor : q->clock;
    if (!(start < l->quiet_until))
        return 0;
    const uint64_t page_size = l->page_size;
    if (e->opcode == CHM_OP_MAP_FAULT) {
        if (e->flags || e->len != page_size || e->addr % page_size || e->addr < q->map_dev_addr ||
            e->addr - q->map_dev_addr >= q->map_len || q->lease_count >= q->lease_cap)
            return 0;
        double finish;
        int64_t frame = l->map_hit(l->dev, e->addr, start, &finish);
        if (frame < 0)
            return 0;
        int64_t lease = chm_srv_lease_add(q, (uint32_t)frame, e->addr / page_size, chm_now_ns() + l->lease_ns);
        l->map_faults++;
        complete(l, q, e->user_data, lease, start, finish);
        return 1;
    }
    if (e->opcode == CHM_OP_MAP_ACK && e->addr % page_size == 0) {
        struct chm_srv_lease *ls = lease_find(q, e->handle, e->addr / page_size);
        if (!ls || ls->expired || l->map_unpin(l->dev, ls->frame))  /* expired: -ETIMEDOUT; not pinned: a bug */
            return 0;                                                /* both mapping.py's to answer */
        lease_remove(q, ls);
        complete(l, q, e->user_data, 0, start, start);
        return 1;
    }
    return 0;
}

static void end_turn(struct chm_srv_loop *l)
{
    l->turn++;
    l->in_turn = 0;
}

/* A yield that took longer than this ran another task on our core: most likely the client we wait for. */
#define SHARED_CORE_NS 2000

/* Wait up to spin_ns for a client to have a command; 0 if none came. Unlike chm_srv_pending it looks
 * after every pause, not every few (a hit's whole service is a few hundred ns: the pick-up must not add
 * as much). It yields as often as chm_spin_step does, for a peer sharing the core; once a yield shows
 * that one does (it ran meanwhile), at every look, so the client sharing it gets it back at once. */
static int wait_for_command(struct chm_srv_loop *l, uint64_t spin_ns)
{
    uint64_t deadline = 0;
    for (unsigned looks = 0;; looks++) {
        for (uint32_t i = 0; i < l->n; i++) {
            if (has_command(l->qps[i]))
                return 1;
        }
        if (looks % 16 == 0) {
            uint64_t now = chm_now_ns();
            if (!deadline)
                deadline = now + spin_ns;
            if (now >= deadline)
                return 0;
        }
        if (l->core_shared || looks % 128 == 127) {
            uint64_t before = chm_now_ns();
            sched_yield();
            l->core_shared = chm_now_ns() - before > SHARED_CORE_NS;
        } else {
            chm_cpu_relax();
        }
    }
}

int chm_srv_serve(struct chm_srv_loop *l, uint64_t spin_ns, uint64_t max_ns)
{
    const uint64_t deadline = chm_now_ns() + max_ns;
    for (;;) {
        if (l->turn >= l->n) {      /* a pass is over */
            l->turn = 0;
            if (!l->ran && (!l->n || !wait_for_command(l, spin_ns)))
                return CHM_SRV_IDLE;
            l->ran = 0;
            if (chm_now_ns() >= deadline)
                return CHM_SRV_YIELD;
        }
        struct chm_srv_qp *q = l->qps[l->turn];
        if (q->parked) {            /* its wait ends when its media reads land (server.py): not a turn */
            end_turn(l);
            continue;
        }
        if (!l->in_turn) {
            l->in_turn = 1;
            l->budget = (int64_t)l->chunk_bytes;
            if (q->has_job) {       /* its next piece is its turn */
                l->ran = 1;
                return (int)l->turn;
            }
            if (q->batch_next == q->batch_len) {    /* fetch only when nothing fetched is left: CQ room was counted */
                int n = chm_srv_fetch(q, q->batch, CHM_SRV_BATCH);
                if (n < 0) {        /* corrupted tail: the helper resynced and posted -EPROTO */
                    q->errors++;
                    l->ran = 1;
                    end_turn(l);
                    continue;
                }
                q->batch_next = 0;
                q->batch_len = (uint32_t)n;
            }
        } else if (q->has_job) {    /* Python started one: it goes on in the next turns */
            end_turn(l);
            continue;
        }
        while (q->batch_next < q->batch_len && l->budget > 0) {
            const struct chm_sqe *e = &q->batch[q->batch_next];
            l->ran = 1;
            if (!serve_hit(l, q, e) && !serve_map(l, q, e))
                return (int)l->turn;
            q->batch_next++;
            l->budget -= (int64_t)e->len;
        }
        end_turn(l);
    }
}

int chm_srv_punch(int fd, uint64_t offset, uint64_t len)
{
    return fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)offset, (off_t)len) ? -errno : 0;
}

int chm_srv_writeprotect(int uffd, uint64_t start, uint64_t len)
{
    struct uffdio_writeprotect wp = { .range = { .start = start, .len = len }, .mode = UFFDIO_WRITEPROTECT_MODE_WP };
    return ioctl(uffd, UFFDIO_WRITEPROTECT, &wp) ? -errno : 0;
}

int chm_srv_is_userfaultfd(int fd)
{
    char path[64], link[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n < 0)
        return 0;
    link[n] = 0;
    return strcmp(link, "anon_inode:[userfaultfd]") == 0;
}
