/* libchm: opening and closing a handle (the attach handshake of driver/include/chm_wire.h,
 * the queue pair's mapping), and the mapping's references (FFI support). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "chm_priv.h"

#define DEFAULT_NODE "chm0"
#define SHM_DIR "/dev/shm/"
#define DEFAULT_STAGING (16u << 20)
#define DEFAULT_ENTRIES 64u
#define DEFAULT_SPIN_US 50u
#define MAX_SPIN_US 1000000u

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

uint64_t env_u64(const char *name, uint64_t fallback)
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
    snprintf(d->node_path, sizeof d->node_path, "%s", node_path);
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
    maps_close(d);
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
