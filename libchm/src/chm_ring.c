/* libchm: the client's side of the rings (driver/include/chm_wire.h): submit, ring the doorbell,
 * take a completion, one synchronous command, and the checks of a command's buffer and range. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "chm_priv.h"

#define LIVENESS_CHECK_NS 100000000ull   /* while asleep, look whether the server is still there this often */

/* ---- the rings ---------------------------------------------------------------------- */

static int server_gone(chm_dev *d)
{
    if (chm_load_acquire(&d->node->magic) != CHM_WIRE_MAGIC)
        return 1;
    struct pollfd p = { .fd = d->sock, .events = POLLIN | POLLRDHUP };
    if (poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLIN))) {
        char c;
        if (recv(d->sock, &c, 1, MSG_DONTWAIT | MSG_PEEK) <= 0)
            return 1;
    }
    return 0;
}

int sq_push(chm_dev *d, const struct chm_sqe *e)
{
    if (d->dead)
        return -ENODEV;
    if (d->inflight >= d->sq_entries || d->sq_tail - chm_load_acquire(&d->hdr->sq.head) >= d->sq_entries)
        return -EBUSY;
    d->sq[d->sq_tail & (d->sq_entries - 1)] = *e;
    d->sq_tail++;
    chm_store_release(&d->hdr->sq.tail, d->sq_tail);
    d->inflight++;
    return 0;
}

/* Ring the doorbell only if the server sleeps (see chm_wire.h, wake-ups). */
void doorbell(chm_dev *d)
{
    chm_fence();
    if (__atomic_load_n(&d->node->server_sleeping, __ATOMIC_RELAXED)) {
        uint64_t one = 1;
        ssize_t r = write(d->evfd, &one, sizeof(one));
        (void)r;
    }
}

/* Take the next completion: spin up to spin_ns, then sleep on the futex. */
int cq_take(chm_dev *d, struct chm_cqe *out, int wait)
{
    uint64_t spin_until = 0;
    unsigned steps = 0;
    for (;;) {
        uint32_t tail = chm_load_acquire(&d->hdr->cq.tail);
        if (tail != d->cq_head) {
            *out = d->cq[d->cq_head & (d->cq_entries - 1)];
            d->cq_head++;
            chm_store_release(&d->hdr->cq.head, d->cq_head);
            d->inflight--;
            return 1;
        }
        if (!wait)
            return 0;
        if (d->dead)
            return -ENODEV;
        uint64_t now = chm_now_ns();
        if (!spin_until)
            spin_until = now + d->spin_ns;
        if (now < spin_until) {
            chm_spin_step(&steps);
            continue;
        }
        chm_store_fence(&d->hdr->cq.waiting, 1);
        if (chm_load_acquire(&d->hdr->cq.tail) == tail) {
            int r = chm_futex_wait(&d->hdr->cq.tail, tail, LIVENESS_CHECK_NS);
            if (r == -ETIMEDOUT && server_gone(d)) {
                d->dead = 1;
                __atomic_store_n(&d->hdr->cq.waiting, 0, __ATOMIC_RELAXED);
                return -ENODEV;
            }
        }
        __atomic_store_n(&d->hdr->cq.waiting, 0, __ATOMIC_RELAXED);
    }
}

/* One synchronous command: returns its result, or -errno of the transport. */
int64_t run_cmd(chm_dev *d, struct chm_sqe *e)
{
    if (d->async_inflight)
        return -EBUSY;
    e->user_data = ++d->seq;
    int ret = sq_push(d, e);
    if (ret)
        return ret;
    doorbell(d);
    struct chm_cqe c;
    ret = cq_take(d, &c, 1);
    if (ret < 0)
        return ret;
    d->last_latency_ns = c.latency_ns;
    return c.res;
}

int in_staging(const chm_dev *d, const void *buf, size_t len, uint64_t *offset)
{
    uintptr_t b = (uintptr_t)buf, s = (uintptr_t)d->staging;
    if (b < s || b - s > d->staging_bytes || len > d->staging_bytes - (b - s))
        return 0;
    *offset = b - s;
    return 1;
}

int check_range(const chm_dev *d, chm_addr addr, size_t len)
{
    if (len == 0)
        return -EINVAL;
    if (addr >= d->node->capacity_bytes || len > d->node->capacity_bytes - addr)
        return -ERANGE;
    return 0;
}
