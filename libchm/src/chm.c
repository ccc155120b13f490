/* libchm: the client side of the CXL-HM driver wire (driver/include/chm_wire.h): the API of chm.h, on the
 * handle chm_open.c opens and the rings chm_ring.c drives. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "chm_priv.h"

#ifndef PIPE_CHUNK
#define PIPE_CHUNK (2u << 20)            /* copy-path reads move in chunks of this, */
#endif
#ifndef PIPE_SLOTS
#define PIPE_SLOTS 2u                    /* this many in flight */
#endif

/* ---- the API ---------------------------------------------------------------------- */

ssize_t chm_read(chm_dev *d, chm_addr addr, void *buf, size_t len)
{
    CHECK_DEV(d);
    if (!buf)
        return -EINVAL;
    int ret = check_range(d, addr, len);
    if (ret)
        return ret;
    if (d->async_inflight)
        return -EBUSY;
    uint64_t off;
    if (in_staging(d, buf, len, &off)) {   /* zero-copy: the device writes the caller's bytes itself */
        struct chm_sqe e = { .opcode = CHM_OP_READ, .addr = addr, .len = len, .buf_offset = off };
        int64_t r = run_cmd(d, &e);
        return r;
    }
    /* Copy path, pipelined: the device fills one slot while we copy out the other. */
    size_t slots = PIPE_SLOTS < d->sq_entries ? PIPE_SLOTS : d->sq_entries;
    size_t chunk = d->staging_bytes / slots < PIPE_CHUNK ? d->staging_bytes / slots : PIPE_CHUNK;
    if (len <= d->staging_bytes && len <= PIPE_CHUNK)
        chunk = len;
    size_t n = (len + chunk - 1) / chunk, submitted = 0, done = 0;
    uint64_t start_clock = 0, end_clock = 0;
    int64_t err = 0;
    while (done < n) {
        while (!err && submitted < n && submitted < done + slots) {
            size_t pos = submitted * chunk, sz = len - pos < chunk ? len - pos : chunk;
            struct chm_sqe e = { .opcode = CHM_OP_READ, .user_data = ++d->seq, .addr = addr + pos,
                                 .len = sz, .buf_offset = (submitted % slots) * chunk };
            if ((ret = sq_push(d, &e)) < 0) {
                err = ret;
                break;
            }
            submitted++;
        }
        doorbell(d);
        if (done == submitted)
            break;
        struct chm_cqe c;
        if ((ret = cq_take(d, &c, 1)) < 0)
            return ret;
        if (done == 0)
            start_clock = c.clock_ns - c.latency_ns;
        end_clock = c.clock_ns;
        if (c.res < 0 && !err)
            err = c.res;
        if (!err) {
            size_t pos = done * chunk, sz = len - pos < chunk ? len - pos : chunk;
            memcpy((char *)buf + pos, d->staging + (done % slots) * chunk, sz);
        }
        done++;
    }
    d->last_latency_ns = end_clock - start_clock;
    return err ? err : (ssize_t)len;
}

ssize_t chm_write(chm_dev *d, chm_addr addr, const void *buf, size_t len)
{
    CHECK_DEV(d);
    if (!buf)
        return -EINVAL;
    int ret = check_range(d, addr, len);
    if (ret)
        return ret;
    if (d->async_inflight)
        return -EBUSY;
    uint64_t off;
    if (in_staging(d, buf, len, &off)) {
        struct chm_sqe e = { .opcode = CHM_OP_WRITE, .addr = addr, .len = len, .buf_offset = off };
        return run_cmd(d, &e);
    }
    size_t written = 0;
    uint64_t latency = 0;
    while (written < len) {   /* one command per staging-buffer load: each is admitted whole or not at all */
        size_t sz = len - written < d->staging_bytes ? len - written : d->staging_bytes;
        memcpy(d->staging, (const char *)buf + written, sz);
        struct chm_sqe e = { .opcode = CHM_OP_WRITE, .addr = addr + written, .len = sz, .buf_offset = 0 };
        int64_t r = run_cmd(d, &e);
        if (r < 0)
            return written ? (ssize_t)written : r;
        latency += d->last_latency_ns;
        written += sz;
    }
    d->last_latency_ns = latency;
    return (ssize_t)written;
}

int chm_flush(chm_dev *d)
{
    CHECK_DEV(d);
    struct chm_sqe e = { .opcode = CHM_OP_FLUSH };
    return (int)run_cmd(d, &e);
}

chm_req chm_prefetch_object(chm_dev *d, chm_addr addr, size_t size)
{
    CHECK_DEV(d);
    int ret = check_range(d, addr, size);
    if (ret)
        return ret;
    struct chm_sqe e = { .opcode = CHM_OP_PREFETCH, .addr = addr, .len = size };
    return run_cmd(d, &e);
}

int chm_prefetch_wait(chm_dev *d, chm_req req, int timeout_ms)
{
    CHECK_DEV(d);
    if (req <= 0)
        return -EINVAL;
    struct chm_sqe e = { .opcode = CHM_OP_WAIT, .handle = req,
                         .timeout_ns = timeout_ms < 0 ? -1 : (int64_t)timeout_ms * 1000000 };
    return (int)run_cmd(d, &e);
}

int chm_prefetch_poll(chm_dev *d, chm_req req)
{
    CHECK_DEV(d);
    if (req <= 0)
        return -EINVAL;
    struct chm_sqe e = { .opcode = CHM_OP_WAIT, .flags = CHM_WAIT_LOOK, .handle = req, .timeout_ns = -1 };
    return (int)run_cmd(d, &e);
}

int chm_prefetch_release(chm_dev *d, chm_req req)
{
    CHECK_DEV(d);
    if (req <= 0)
        return -EINVAL;
    struct chm_sqe e = { .opcode = CHM_OP_RELEASE, .handle = req };
    return (int)run_cmd(d, &e);
}

int chm_get_stats(chm_dev *d, struct chm_stats *s)
{
    CHECK_DEV(d);
    if (!s)
        return -EINVAL;
    struct chm_sqe e = { .opcode = CHM_OP_STATS };
    int64_t r = run_cmd(d, &e);
    if (r < 0)
        return (int)r;
    const struct chm_wire_stats *w = d->stats;
#define COPY(f) s->f = w->f;
    CHM_STATS_FIELDS(COPY)
#undef COPY
    return 0;
}

ssize_t chm_stats_json(chm_dev *d, char *buf, size_t len)
{
    CHECK_DEV(d);
    if (!buf || !len)
        return -EINVAL;
    size_t room = len - 1 < d->staging_bytes ? len - 1 : d->staging_bytes;
    struct chm_sqe e = { .opcode = CHM_OP_STATS_JSON, .len = room, .buf_offset = 0 };
    int64_t r = run_cmd(d, &e);
    if (r < 0)
        return r;
    memcpy(buf, d->staging, (size_t)r);
    buf[r] = '\0';
    return r;
}

int chm_get_info(chm_dev *d, struct chm_info *info)
{
    CHECK_DEV(d);
    if (!info)
        return -EINVAL;
    const struct chm_node *n = d->node;
    memset(info, 0, sizeof(*info));
    info->capacity_bytes = n->capacity_bytes;
    info->dram_bytes = n->dram_bytes;
    info->page_size = n->page_size;
    info->ssd_count = n->ssd_count;
    info->prefetch_max_handles = n->prefetch_max_handles;
    info->write_buffer_bytes = n->write_buffer_bytes;
    info->prefetch_window_bytes = n->prefetch_window_bytes;
    info->staging_bytes = d->staging_bytes;
    info->clients = __atomic_load_n(&n->clients, __ATOMIC_RELAXED);
    info->server_pid = n->server_pid;
    snprintf(info->policy, sizeof(info->policy), "%.*s", (int)sizeof(n->policy), n->policy);
    snprintf(info->profile, sizeof(info->profile), "%.*s", (int)sizeof(n->profile), n->profile);
    info->device_epoch = n->device_epoch;
    return 0;
}

void *chm_buffer(chm_dev *d, size_t *len)
{
    if (!d || !dev_is_open(d))
        return NULL;
    if (len)
        *len = d->staging_bytes;
    return d->staging;
}

uint64_t chm_last_latency_ns(chm_dev *d)
{
    return d && dev_is_open(d) ? d->last_latency_ns : 0;
}

/* ---- asynchronous ------------------------------------------------------------------ */

static int submit_rw(chm_dev *d, uint8_t op, chm_addr addr, const void *buf, size_t len, uint64_t user_data)
{
    CHECK_DEV(d);
    if (!buf)
        return -EINVAL;
    int ret = check_range(d, addr, len);
    if (ret)
        return ret;
    uint64_t off;
    if (!in_staging(d, buf, len, &off))
        return -EFAULT;
    struct chm_sqe e = { .opcode = op, .user_data = user_data, .addr = addr, .len = len, .buf_offset = off };
    if ((ret = sq_push(d, &e)) < 0)
        return ret;
    d->async_inflight++;
    doorbell(d);
    return 0;
}

int chm_submit_read(chm_dev *d, chm_addr addr, void *buf, size_t len, uint64_t user_data)
{
    return submit_rw(d, CHM_OP_READ, addr, buf, len, user_data);
}

int chm_submit_write(chm_dev *d, chm_addr addr, const void *buf, size_t len, uint64_t user_data)
{
    return submit_rw(d, CHM_OP_WRITE, addr, buf, len, user_data);
}

int chm_reap(chm_dev *d, struct chm_completion *out, unsigned max, unsigned min_wait)
{
    CHECK_DEV(d);
    if ((!out && max) || min_wait > max || min_wait > d->async_inflight)
        return -EINVAL;
    unsigned n = 0;
    while (n < max && d->async_inflight) {
        struct chm_cqe c;
        int ret = cq_take(d, &c, n < min_wait);
        if (ret < 0)
            return n ? (int)n : ret;
        if (ret == 0)
            break;
        d->async_inflight--;
        out[n].user_data = c.user_data;
        out[n].res = c.res;
        out[n].latency_ns = c.latency_ns;
        n++;
    }
    return (int)n;
}

const char *chm_strerror(int err)
{
    switch (err < 0 ? -err : err) {
    case 0: return "success";
    case ENODEV: return "no device at that node (or it went away)";
    case EINVAL: return "invalid argument";
    case ERANGE: return "address range outside the device";
    case EFAULT: return "buffer range outside the staging buffer";
    case EAGAIN: return "write buffer full: nothing written, retry later";
    case ETIMEDOUT: return "prefetch not staged within the timeout";
    case EBUSY: return "busy: prefetch window full, queue full, or asynchronous commands in flight";
    case ENOSPC: return "no space on the media (or a result larger than the buffer)";
    case EPROTO: return "driver protocol mismatch";
    case ENOMEM: return "out of memory";
    case EACCES: return "permission denied";
    case EIO: return "media I/O error or device internal error";
    case EBADF: return "handle closed already (chm_close)";
    case EMFILE: return "this process is at its open-file limit (RLIMIT_NOFILE): an open device needs 3 free fds while attaching, 2 after";
    case ENFILE: return "the system's open-file table is full (fs.file-max)";
    default: return strerror(err < 0 ? -err : err);
    }
}
