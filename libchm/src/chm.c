/* libchm: the client side of the CXL-HM driver wire (driver/include/chm_wire.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "chm.h"
#include "chm_sync.h"
#include "chm_wire.h"

#define DEFAULT_NODE "chm0"
#define SHM_DIR "/dev/shm/"
#define DEFAULT_STAGING (16u << 20)
#define DEFAULT_ENTRIES 64u
#define DEFAULT_SPIN_US 50u
#define MAX_SPIN_US 1000000u
#ifndef PIPE_CHUNK
#define PIPE_CHUNK (2u << 20)            /* copy-path reads move in chunks of this, */
#endif
#ifndef PIPE_SLOTS
#define PIPE_SLOTS 2u                    /* this many in flight */
#endif
#define LIVENESS_CHECK_NS 100000000ull   /* while asleep, look whether the server is still there this often */
/* chm_dev.magic while the handle is open, and after chm_close poisoned it. */
#define DEV_OPEN_MAGIC 0x43484d2d4f50454eull   /* "CHM-OPEN" */
#define DEV_CLOSED_MAGIC 0x43484d2d53485554ull /* "CHM-SHUT": any value but the open one */

/* The queue pair mapping (rings, stats slot, staging buffer), counted: the
 * handle holds one reference, each chm_mapping_get another (FFI support). */
struct chm_mapping {
    void *base;
    size_t len;
    unsigned refs;
};

struct chm_dev {
    int sock;                      /* control connection: its EOF detaches us */
    int evfd;                      /* the server's doorbell */
    struct chm_node *node;         /* read-only */
    struct chm_mapping *qp;        /* the queue pair; NULL until mapped */
    struct chm_qp_hdr *hdr;
    struct chm_sqe *sq;
    struct chm_cqe *cq;
    struct chm_wire_stats *stats;
    char *staging;
    size_t staging_bytes;
    uint32_t sq_entries, cq_entries;
    uint32_t sq_tail, cq_head;     /* the indices we own */
    uint32_t inflight;             /* submitted, not reaped */
    uint32_t async_inflight;
    uint64_t spin_ns;
    uint64_t seq;
    uint64_t last_latency_ns;
    int dead;
    /* Last, far from the first 16 bytes, which free() overwrites with its list links:
     * so a closed handle still reads DEV_CLOSED_MAGIC until the memory is reused. */
    uint64_t magic;
};

/* An open handle, as far as can be told cheaply (best effort: a closed handle's
 * memory may be reused by another allocation, even another chm_dev). */
static int dev_is_open(const chm_dev *d)
{
    return d->magic == DEV_OPEN_MAGIC;
}

/* Every entry point but chm_close starts with this: NULL is -EINVAL, closed -EBADF. */
#define CHECK_DEV(d)                     \
    do {                                 \
        if (!(d))                        \
            return -EINVAL;              \
        if (!dev_is_open(d))             \
            return -EBADF;               \
    } while (0)

static void mapping_put(struct chm_mapping *m)
{
    if (m && __atomic_sub_fetch(&m->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        munmap(m->base, m->len);
        free(m);
    }
}

/* ---- opening -------------------------------------------------------------------- */

static int resolve_path(const char *path, char *out, size_t outlen)
{
    if (!path || !*path)
        path = getenv("CHM_DEVICE");
    if (!path || !*path)
        path = DEFAULT_NODE;
    int n = strchr(path, '/') ? snprintf(out, outlen, "%s", path) : snprintf(out, outlen, SHM_DIR "%s", path);
    if (n < 0 || (size_t)n >= outlen)
        return -EINVAL;
    return 0;
}

static uint64_t env_u64(const char *name, uint64_t fallback)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return fallback;
    char *end;
    unsigned long long v = strtoull(s, &end, 0);
    return *end ? fallback : (uint64_t)v;
}

static int map_node(const char *path, struct chm_node **out)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? -ENODEV : -errno;
    struct stat st;
    if (fstat(fd, &st) < 0 || (size_t)st.st_size < sizeof(struct chm_node)) {
        close(fd);
        return -ENODEV;
    }
    void *m = mmap(NULL, sizeof(struct chm_node), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return -errno;
    struct chm_node *node = m;
    if (chm_load_acquire(&node->magic) != CHM_WIRE_MAGIC) {
        munmap(m, sizeof(*node));
        return -ENODEV;
    }
    if (node->version != CHM_WIRE_VERSION) {
        munmap(m, sizeof(*node));
        return -EPROTO;
    }
    *out = node;
    return 0;
}

static int connect_server(const char *node_path)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    if (snprintf(sa.sun_path, sizeof(sa.sun_path), "%s.sock", node_path) >= (int)sizeof(sa.sun_path))
        return -EINVAL;
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return -errno;
    if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        int err = errno;
        close(s);
        return (err == ENOENT || err == ECONNREFUSED) ? -ENODEV : -err;
    }
    return s;
}

/* The attach handshake: request out, response and two fds (queue pair, doorbell) in. */
static int attach(chm_dev *d, uint32_t entries, uint64_t staging, uint32_t share_ppm, int *qp_fd, uint64_t *qp_bytes)
{
    struct chm_attach_req req = {
        .magic = CHM_WIRE_MAGIC, .version = CHM_WIRE_VERSION,
        .sq_entries = entries, .cq_entries = entries, .staging_bytes = staging,
        .prefetch_share_ppm = share_ppm, .rsvd0 = 0,
    };
    if (send(d->sock, &req, sizeof(req), MSG_NOSIGNAL) != (ssize_t)sizeof(req))
        return -ENODEV;
    struct chm_attach_resp resp;
    char ctrl[CMSG_SPACE(2 * sizeof(int))];
    struct iovec iov = { &resp, sizeof(resp) };
    struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctrl, .msg_controllen = sizeof(ctrl) };
    ssize_t n;
    do
        n = recvmsg(d->sock, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof(resp))
        return -ENODEV;
    /* Take every fd that arrived (the kernel may install fewer than were sent), so none leaks. */
    int fds[2] = { -1, -1 }, extra = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS || cm->cmsg_len < CMSG_LEN(0))
            continue;
        size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(fd));
            if (i < 2 && fds[i] < 0)
                fds[i] = fd;
            else {
                close(fd);
                extra = 1;
            }
        }
    }
    if (resp.status < 0 || extra || (msg.msg_flags & MSG_CTRUNC) || fds[0] < 0 || fds[1] < 0) {
        for (int i = 0; i < 2; i++)
            if (fds[i] >= 0)
                close(fds[i]);
        if (resp.status < 0)
            return resp.status;
        /* Truncated: the kernel could not install the fds here. Our buffer holds both, so that is
         * this process's fd limit (EMFILE) or the system's (ENFILE): ask for two fds to learn which. */
        if ((msg.msg_flags & MSG_CTRUNC) && !extra) {
            int a = fcntl(d->sock, F_DUPFD_CLOEXEC, 0), err = a < 0 ? errno : 0;
            int b = a < 0 ? -1 : fcntl(d->sock, F_DUPFD_CLOEXEC, 0);
            if (a >= 0 && b < 0)
                err = errno;
            if (a >= 0)
                close(a);
            if (b >= 0)
                close(b);
            if (err == EMFILE || err == ENFILE)
                return -err;
        }
        return -EPROTO;
    }
    *qp_fd = fds[0];
    d->evfd = fds[1];
    *qp_bytes = resp.qp_bytes;
    return 0;
}

static int map_qp(chm_dev *d, int fd, uint64_t qp_bytes)
{
    struct stat st;
    if (fstat(fd, &st) < 0 || (uint64_t)st.st_size != qp_bytes || qp_bytes < sizeof(struct chm_qp_hdr))
        return -EPROTO;
    struct chm_mapping *map = calloc(1, sizeof(*map));
    if (!map)
        return -ENOMEM;
    void *m = mmap(NULL, qp_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        free(map);
        return -errno;
    }
    *map = (struct chm_mapping){ .base = m, .len = qp_bytes, .refs = 1 };
    d->qp = map;
    struct chm_qp_hdr *h = d->hdr = m;
    if (chm_load_acquire(&h->magic) != CHM_QP_MAGIC || h->version != CHM_WIRE_VERSION ||
        h->total_bytes != qp_bytes || h->staging_offset + h->staging_bytes > qp_bytes ||
        h->sq_offset + (uint64_t)h->sq_entries * sizeof(struct chm_sqe) > qp_bytes ||
        h->cq_offset + (uint64_t)h->cq_entries * sizeof(struct chm_cqe) > qp_bytes)
        return -EPROTO;
    d->sq = (struct chm_sqe *)((char *)m + h->sq_offset);
    d->cq = (struct chm_cqe *)((char *)m + h->cq_offset);
    d->stats = (struct chm_wire_stats *)((char *)m + h->stats_offset);
    d->staging = (char *)m + h->staging_offset;
    d->staging_bytes = h->staging_bytes;
    d->sq_entries = h->sq_entries;
    d->cq_entries = h->cq_entries;
    return 0;
}

int chm_open_opts(const char *path, const struct chm_open_opts *opts, chm_dev **dev)
{
    if (!dev)
        return -EINVAL;
    *dev = NULL;
    /* Fields an older caller's opts->size does not wholly cover stay 0: the defaults. */
    struct chm_open_opts o = { 0 };
    if (opts) {
        if (opts->size < offsetof(struct chm_open_opts, spin_us) || opts->size > 4096)
            return -EINVAL;
        memcpy(&o, opts, opts->size < sizeof(o) ? opts->size : sizeof(o));
#define OPT_GIVEN(field) (opts->size >= offsetof(struct chm_open_opts, field) + sizeof(o.field))
        if (!OPT_GIVEN(spin_us))
            o.spin_us = 0;
        if (!OPT_GIVEN(prefetch_share))
            o.prefetch_share = 0;
#undef OPT_GIVEN
    }
    uint64_t staging = o.staging_bytes ? o.staging_bytes : env_u64("CHM_STAGING_BYTES", DEFAULT_STAGING);
    uint32_t entries = o.queue_entries ? o.queue_entries : DEFAULT_ENTRIES;
    uint64_t spin_us = o.spin_us ? o.spin_us : env_u64("CHM_SPIN_US", DEFAULT_SPIN_US);
    if (staging == 0 || staging > CHM_MAX_STAGING_BYTES || entries < CHM_MIN_ENTRIES ||
        entries > CHM_MAX_ENTRIES || (entries & (entries - 1)) || spin_us > MAX_SPIN_US)
        return -EINVAL;
    if (o.prefetch_share != 0 && !(o.prefetch_share > 0 && o.prefetch_share <= 1))   /* NaN fails too */
        return -EINVAL;
    /* Rounded to the nearest ppm, at least 1: 0 would mean "the device default". */
    uint32_t share_ppm = 0;
    if (o.prefetch_share != 0) {
        share_ppm = (uint32_t)(o.prefetch_share * CHM_PPM + 0.5);
        if (share_ppm == 0)
            share_ppm = 1;
    }

    char node_path[PATH_MAX];
    int ret = resolve_path(path, node_path, sizeof(node_path));
    if (ret)
        return ret;
    chm_dev *d = calloc(1, sizeof(*d));
    if (!d)
        return -ENOMEM;
    d->magic = DEV_OPEN_MAGIC;
    d->sock = d->evfd = -1;
    d->spin_ns = spin_us * 1000;
    int qp_fd = -1;
    uint64_t qp_bytes = 0;
    if ((ret = map_node(node_path, &d->node)) < 0)
        goto fail;
    if ((ret = connect_server(node_path)) < 0)
        goto fail;
    d->sock = ret;
    if ((ret = attach(d, entries, staging, share_ppm, &qp_fd, &qp_bytes)) < 0)
        goto fail;
    ret = map_qp(d, qp_fd, qp_bytes);
    close(qp_fd);
    if (ret < 0)
        goto fail;
    *dev = d;
    return 0;
fail:
    chm_close(d);
    return ret;
}

int chm_open(const char *path, chm_dev **dev)
{
    return chm_open_opts(path, NULL, dev);
}

void chm_close(chm_dev *d)
{
    if (!d || !dev_is_open(d))
        return;          /* NULL, or closed already (best effort: see chm.h) */
    d->magic = DEV_CLOSED_MAGIC;
    mapping_put(d->qp);  /* unmapped now unless an FFI user holds a reference */
    if (d->node)
        munmap(d->node, sizeof(*d->node));
    if (d->sock >= 0)
        close(d->sock);      /* the server sees EOF and reclaims the queue pair */
    if (d->evfd >= 0)
        close(d->evfd);
    free(d);
}

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

static int sq_push(chm_dev *d, const struct chm_sqe *e)
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
static void doorbell(chm_dev *d)
{
    chm_fence();
    if (__atomic_load_n(&d->node->server_sleeping, __ATOMIC_RELAXED)) {
        uint64_t one = 1;
        ssize_t r = write(d->evfd, &one, sizeof(one));
        (void)r;
    }
}

/* Take the next completion: spin up to spin_ns, then sleep on the futex. */
static int cq_take(chm_dev *d, struct chm_cqe *out, int wait)
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
static int64_t run_cmd(chm_dev *d, struct chm_sqe *e)
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

static int in_staging(const chm_dev *d, const void *buf, size_t len, uint64_t *offset)
{
    uintptr_t b = (uintptr_t)buf, s = (uintptr_t)d->staging;
    if (b < s || b - s > d->staging_bytes || len > d->staging_bytes - (b - s))
        return 0;
    *offset = b - s;
    return 1;
}

static int check_range(const chm_dev *d, chm_addr addr, size_t len)
{
    if (len == 0)
        return -EINVAL;
    if (addr >= d->node->capacity_bytes || len > d->node->capacity_bytes - addr)
        return -ERANGE;
    return 0;
}

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

/* ---- FFI support ---------------------------------------------------------------- */

chm_mapping *chm_mapping_get(chm_dev *d)
{
    if (!d || !dev_is_open(d) || !d->qp)
        return NULL;
    __atomic_add_fetch(&d->qp->refs, 1, __ATOMIC_RELAXED);
    return d->qp;
}

void chm_mapping_put(chm_mapping *m)
{
    mapping_put(m);
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
