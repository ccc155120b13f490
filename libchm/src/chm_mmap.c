/* libchm: the device as memory (chm_mmap, docs/mmap.md).
 *
 * A mapping is an anonymous reservation registered with a userfaultfd. A fault on a page of it is read by
 * the mapping's handler thread, which asks the device over the mapping's own queue pair (MAP_FAULT: the
 * access a chm_read of that page makes) for the page's DRAM frame, maps that frame of the device's DRAM
 * memfd over the page (MAP_SHARED|MAP_FIXED: one VMA per frame, no copy), installs it (UFFDIO_CONTINUE,
 * write-protected unless the fault was a write) and acknowledges the lease (MAP_ACK). The VMA stays
 * registered MISSING|MINOR|WP, so when the device punches the frame (before it holds another page) every
 * later access faults again, and a first write after a read or after a flush faults as WP.
 *
 * CHM_MAP_INLINE serves the faults in the faulting thread instead: the userfaultfd has UFFD_FEATURE_SIGBUS,
 * so every fault on the mapping raises SIGBUS in the thread that took it, and libchm's SIGBUS handler does
 * what the handler thread does (handle_fault) before the access is retried: no hand-off between threads.
 * A SIGBUS the handler does not serve (another address, a page that has failed) goes to the handler the
 * program had before. The handler thread still watches the device's death. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include "chm_priv.h"

#ifndef UFFDIO_CONTINUE_MODE_WP
#define UFFDIO_CONTINUE_MODE_WP ((__u64)1 << 1)   /* Linux 6.2; this system's header may predate it */
#endif
#ifndef USERFAULTFD_IOC_NEW
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)
#endif

#define MAP_FEATURES (UFFD_FEATURE_MISSING_SHMEM | UFFD_FEATURE_MINOR_SHMEM | UFFD_FEATURE_WP_HUGETLBFS_SHMEM)
#define FAULT_QUEUE_ENTRIES 64u
#define FAULT_STAGING (2u << 20)          /* the fault queue pair moves no bytes: the smallest staging */
#define DEFAULT_FAULT_TIMEOUT_MS 10000u   /* no answer from the device this long: it is treated as gone */
#define DEFAULT_WRITE_TIMEOUT_MS 10000u   /* a write the device refuses (-EAGAIN) is retried this long */
#define MAP_COUNT_RESERVE 1024u           /* VMAs left to the rest of the process */
#define WAIT_SLICE_NS 5000000ull          /* while waiting for an answer, look at the device's pidfd this often */
#define OPEN_LEASE_NS 1000000ull         /* a read lease left open (close_open_lease) is acknowledged by then */
#define INLINE_MAPS_MAX 64u              /* CHM_MAP_INLINE mappings a process holds at once */
#define HOST_PAGE 4096u                  /* the kernel's page: a frame of 64 KiB has 16 */
#define NO_FRAME -1
#define DEAD_PAGE -2

struct chm_map {
    struct chm_map *next;             /* the owner handle's mappings */
    chm_dev *fq;                      /* the fault queue pair: a handle of its own, the handler's alone */
    char *base;
    size_t len;
    chm_addr dev_addr;
    uint64_t page;
    unsigned flags;
    size_t pages;
    int32_t *frame_of;                /* per page of the mapping: the frame its VMA maps, NO_FRAME or DEAD_PAGE */
    int32_t *page_error;              /* per page: the -errno that made it SIGBUS, or 0 */
    size_t *fifo;                     /* pages with a frame VMA, oldest first (vm.max_map_count budget) */
    size_t fifo_head, fifo_len, budget;
    ssize_t strict_last;              /* CHM_MAP_STRICT: the page installed last, or -1 */
    ssize_t last_fault_idx;           /* the page of the last fault that asked the device, or -1 */
    int uffd, dram_fd, stop_fd, pidfd, dead_fd;
    int error;                        /* the whole mapping's -errno once it is withdrawn (SIGBUS), else 0 */
    uint64_t fault_timeout_ns, write_timeout_ns;
    uint32_t acks_unreaped;
    pthread_t thread;
    int thread_started;
    int cont_wp;                      /* UFFDIO_CONTINUE_MODE_WP works */
    uint64_t leases;                  /* leases taken */
    uint64_t test_stall_at;           /* $CHM_MAP_TEST_STALL_AT (tests): SIGSTOP the process on taking that
                                         lease, before installing or acknowledging it (0: never) */
    uint32_t lock;                    /* held while the pages' state changes: by one faulting thread at a
                                         time (CHM_MAP_INLINE) and by the handler thread */
    int64_t open_lease;               /* a read lease not acknowledged yet (its frame stays pinned), or 0 */
    size_t open_idx;                  /* its page, of which one host page is installed */
    uint64_t open_since;              /* chm_now_ns() when it was taken */
};

/* The mapping's lock: a futex, so that threads faulting behind one that waits for the device sleep. Taken
 * in a signal handler too (CHM_MAP_INLINE): nothing that holds it touches the mapping. */
static void map_lock(struct chm_map *m)
{
    while (__atomic_exchange_n(&m->lock, 1, __ATOMIC_ACQUIRE))
        chm_futex_wait(&m->lock, 1, WAIT_SLICE_NS);
}

static void map_unlock(struct chm_map *m)
{
    __atomic_store_n(&m->lock, 0, __ATOMIC_RELEASE);
    chm_futex_wake(&m->lock);
}

static char unsupported_why[160];

/* A positive $name in ms, else fallback. */
static uint64_t env_ms(const char *name, uint64_t fallback)
{
    uint64_t v = env_u64(name, fallback);
    return v ? v : fallback;
}

/* ---- kernel support ---------------------------------------------------------------------------- */

static int uffd_open(void)
{
    int fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0)
        return fd;
    int dev = open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
    if (dev < 0)
        return -errno;
    fd = ioctl(dev, USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK);
    int err = errno;
    close(dev);
    return fd < 0 ? -err : fd;
}

/* A userfaultfd with the features chm_mmap needs, or -EOPNOTSUPP (unsupported_why says what is missing). */
static int uffd_for_mapping(uint64_t extra)
{
    int fd = uffd_open();
    if (fd < 0) {
        snprintf(unsupported_why, sizeof unsupported_why, "userfaultfd unavailable: %s (needs CAP_SYS_PTRACE, "
                 "vm.unprivileged_userfaultfd=1 or access to /dev/userfaultfd)", strerror(-fd));
        return fd == -ENOSYS || fd == -EPERM || fd == -EACCES || fd == -ENOENT ? -EOPNOTSUPP : fd;
    }
    struct uffdio_api api = { .api = UFFD_API, .features = MAP_FEATURES | extra };
    if (ioctl(fd, UFFDIO_API, &api) < 0 || (api.features & (MAP_FEATURES | extra)) != (MAP_FEATURES | extra)) {
        struct uffdio_api all = { .api = UFFD_API };
        int probe = uffd_open();
        if (probe >= 0 && ioctl(probe, UFFDIO_API, &all) == 0)
            snprintf(unsupported_why, sizeof unsupported_why, "the kernel's userfaultfd lacks%s%s%s%s",
                     all.features & UFFD_FEATURE_MISSING_SHMEM ? "" : " MISSING_SHMEM",
                     all.features & UFFD_FEATURE_MINOR_SHMEM ? "" : " MINOR_SHMEM",
                     all.features & UFFD_FEATURE_WP_HUGETLBFS_SHMEM ? "" : " WP_HUGETLBFS_SHMEM",
                     !(extra & UFFD_FEATURE_SIGBUS) || all.features & UFFD_FEATURE_SIGBUS ? "" : " SIGBUS");
        else
            snprintf(unsupported_why, sizeof unsupported_why, "UFFDIO_API failed: %s", strerror(errno));
        if (probe >= 0)
            close(probe);
        close(fd);
        return -EOPNOTSUPP;
    }
    return fd;
}

const char *chm_mmap_unsupported(void)
{
    int fd = uffd_for_mapping(0);
    if (fd >= 0) {
        close(fd);
        return NULL;
    }
    return unsupported_why[0] ? unsupported_why : "userfaultfd unavailable";
}

/* ---- the fault queue pair ---------------------------------------------------------------------- */

static int pidfd_readable(int pidfd)
{
    struct pollfd p = { .fd = pidfd, .events = POLLIN };
    return pidfd >= 0 && poll(&p, 1, 0) > 0;
}

/* Submit one command; its completion is waited for by wait_for. */
static int submit(struct chm_map *m, struct chm_sqe *e)
{
    chm_dev *d = m->fq;
    e->user_data = ++d->seq;
    int ret = sq_push(d, e);
    if (ret)
        return ret;
    doorbell(d);
    return 0;
}

/* The completion of user_data (ACKs' completions before it are reaped on the way): its res, or -ENODEV
 * (the device died), -ETIMEDOUT (no answer within the fault timeout). */
static int64_t wait_for(struct chm_map *m, uint64_t user_data)
{
    chm_dev *d = m->fq;
    uint64_t deadline = chm_now_ns() + m->fault_timeout_ns;
    unsigned steps = 0;
    uint64_t spin_until = chm_now_ns() + d->spin_ns;
    for (;;) {
        struct chm_cqe c;
        int got = cq_take(d, &c, 0);
        if (got > 0) {
            if (c.user_data == user_data)
                return c.res;
            if (m->acks_unreaped)
                m->acks_unreaped--;
            continue;
        }
        uint64_t now = chm_now_ns();
        if (pidfd_readable(m->pidfd) || chm_load_acquire(&d->node->magic) != CHM_WIRE_MAGIC)
            return -ENODEV;
        if (now >= deadline)
            return -ETIMEDOUT;
        if (now < spin_until) {
            chm_spin_step(&steps);
            continue;
        }
        uint32_t tail = chm_load_acquire(&d->hdr->cq.tail);
        chm_store_fence(&d->hdr->cq.waiting, 1);
        if (chm_load_acquire(&d->hdr->cq.tail) == tail)
            chm_futex_wait(&d->hdr->cq.tail, tail, WAIT_SLICE_NS);
        __atomic_store_n(&d->hdr->cq.waiting, 0, __ATOMIC_RELAXED);
    }
}

/* Reap finished ACK completions so the rings never fill with them. */
static void reap_acks(struct chm_map *m)
{
    struct chm_cqe c;
    while (m->acks_unreaped && cq_take(m->fq, &c, 0) > 0)
        m->acks_unreaped--;
}

static int64_t map_fault(struct chm_map *m, chm_addr addr, int write)
{
    uint64_t start = chm_now_ns();
    for (;;) {
        reap_acks(m);
        struct chm_sqe e = { .opcode = CHM_OP_MAP_FAULT, .flags = write ? CHM_FAULT_WRITE : 0, .addr = addr,
                             .len = m->page };
        int ret = submit(m, &e);
        if (ret == -EBUSY) {   /* the ring is full of ACKs: take their completions */
            int64_t r = wait_for(m, 0);
            if (r == -ENODEV || r == -ETIMEDOUT)
                return r;
            continue;
        }
        if (ret)
            return ret;
        int64_t res = wait_for(m, e.user_data);
        uint64_t waited = chm_now_ns() - start;
        if (((res == -EAGAIN || res == -ENOSPC) && waited < m->write_timeout_ns) ||
            (res == -EBUSY && waited < m->fault_timeout_ns)) {
            usleep(waited < 1000000 ? 50 : 1000);   /* write refused (buffer or media full), frame busy: again */
            continue;
        }
        return res;
    }
}

static void map_ack(struct chm_map *m, chm_addr addr, int64_t lease, int failed)
{
    struct chm_sqe e = { .opcode = CHM_OP_MAP_ACK, .flags = failed ? CHM_ACK_FAILED : 0, .addr = addr,
                         .handle = lease };
    if (submit(m, &e) == 0)
        m->acks_unreaped++;
}

/* ---- installing and withdrawing pages ---------------------------------------------------------- */

/* A read fault in the middle of a page (not at its first host page, nor right after the page before it)
 * installs that host page alone and keeps the lease open: a random 4 KiB touch then pays one
 * UFFDIO_CONTINUE entry, not the frame's 16 (about a microsecond each). The frame stays pinned by the open
 * lease, so a second fault on that page installs the rest of it with no new question to the device; any other
 * fault, or OPEN_LEASE_NS without one (the handler thread), acknowledges it. */
static void close_open_lease(struct chm_map *m)
{
    if (m->open_lease) {
        map_ack(m, m->dev_addr + m->open_idx * m->page, m->open_lease, 0);
        m->open_lease = 0;
    }
}

static int uffd_register(struct chm_map *m, void *at, size_t len, uint64_t mode)
{
    struct uffdio_register r = { .range = { .start = (uintptr_t)at, .len = len }, .mode = mode };
    return ioctl(m->uffd, UFFDIO_REGISTER, &r) < 0 ? -errno : 0;
}

static void uffd_wake(struct chm_map *m, void *at, size_t len)
{
    struct uffdio_range r = { .start = (uintptr_t)at, .len = len };
    ioctl(m->uffd, UFFDIO_WAKE, &r);
}

/* Back to the reservation: the page's frame VMA goes (own mm only); its next access faults MISSING. */
static int withdraw(struct chm_map *m, size_t idx)
{
    if (m->open_lease && m->open_idx == idx)
        close_open_lease(m);
    char *at = m->base + idx * m->page;
    if (mmap(at, m->page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)
        == MAP_FAILED)
        return -errno;
    madvise(at, m->page, MADV_DONTFORK);
    m->frame_of[idx] = NO_FRAME;
    return uffd_register(m, at, m->page, UFFDIO_REGISTER_MODE_MISSING);
}

/* Make [at, at+len) answer every access with SIGBUS BUS_ADRERR: a zero-length memfd mapped over it. */
static void make_sigbus(struct chm_map *m, char *at, size_t len)
{
    void *p = mmap(at, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, m->dead_fd, 0);
    if (p != MAP_FAILED)
        madvise(at, len, MADV_DONTFORK);
    uffd_wake(m, at, len);
}

static void fail_page(struct chm_map *m, size_t idx, int err)
{
    __atomic_store_n(&m->page_error[idx], err, __ATOMIC_RELEASE);   /* before the access can fail */
    m->frame_of[idx] = DEAD_PAGE;
    make_sigbus(m, m->base + idx * m->page, m->page);
}

static void fail_all(struct chm_map *m, int err)
{
    if (m->error)
        return;
    __atomic_store_n(&m->error, err, __ATOMIC_RELEASE);
    m->open_lease = 0;   /* the device is gone, or ignores this client now */
    make_sigbus(m, m->base, m->len);
    for (size_t i = 0; i < m->pages; i++)
        m->frame_of[i] = DEAD_PAGE;
}

/* Keep the frame VMAs within the budget: the oldest goes back to the reservation. */
static void note_installed(struct chm_map *m, size_t idx)
{
    if (m->fifo_len == m->budget) {
        size_t old = m->fifo[m->fifo_head];
        m->fifo_head = (m->fifo_head + 1) % m->budget;
        m->fifo_len--;
        if (old != idx && m->frame_of[old] >= 0)
            withdraw(m, old);
    }
    m->fifo[(m->fifo_head + m->fifo_len) % m->budget] = idx;
    m->fifo_len++;
}

/* Install [at, at+len) of a leased frame's VMA: read-only (write-protected) unless the fault was a store. */
static int install_continue(struct chm_map *m, char *at, size_t len, int write)
{
    uint64_t mode = write ? 0 : UFFDIO_CONTINUE_MODE_WP;
    for (size_t off = 0; off < len;) {   /* all at once; page by page past a present one */
        struct uffdio_continue c = { .range = { .start = (uintptr_t)at + off, .len = len - off },
                                     .mode = m->cont_wp ? mode : 0 };
        if (ioctl(m->uffd, UFFDIO_CONTINUE, &c) == 0)
            break;
        int err = errno;
        if (err == EINVAL && m->cont_wp && mode) {   /* no CONTINUE_MODE_WP: continue, then write-protect */
            m->cont_wp = 0;
            continue;
        }
        if (err == EEXIST || (c.mapped < 0 && c.mapped == -EEXIST)) {
            size_t done = c.mapped > 0 ? (size_t)c.mapped : 0;
            off += done ? done : HOST_PAGE;
            continue;
        }
        if (err == EAGAIN) {
            if (c.mapped > 0)
                off += (size_t)c.mapped;
            continue;
        }
        return -err;
    }
    if (!write && !m->cont_wp) {
        struct uffdio_writeprotect wp = { .range = { .start = (uintptr_t)at, .len = len },
                                          .mode = UFFDIO_WRITEPROTECT_MODE_WP };
        ioctl(m->uffd, UFFDIO_WRITEPROTECT, &wp);
    }
    return 0;
}

static void handle_fault(struct chm_map *m, uintptr_t address, uint64_t fault_flags)
{
    size_t idx = (address - (uintptr_t)m->base) / m->page;
    if (idx >= m->pages || m->frame_of[idx] == DEAD_PAGE)
        return;
    char *at = m->base + idx * m->page;
    chm_addr addr = m->dev_addr + idx * m->page;
    int wp = (fault_flags & UFFD_PAGEFAULT_FLAG_WP) != 0;
    int write = wp || (fault_flags & UFFD_PAGEFAULT_FLAG_WRITE);
    if (m->open_lease && m->open_idx == idx && !write) {   /* its frame is still pinned: install the rest */
        int ret = install_continue(m, at, m->page, 0);
        close_open_lease(m);
        if (ret)
            fail_page(m, idx, ret);
        return;
    }
    close_open_lease(m);
    size_t host = (address - (uintptr_t)at) / HOST_PAGE;   /* the host page within the page */
    int sequential = host == 0 || (m->last_fault_idx >= 0 && (size_t)m->last_fault_idx + 1 == idx);
    m->last_fault_idx = (ssize_t)idx;
    if ((m->flags & CHM_MAP_STRICT) && m->strict_last >= 0 && (size_t)m->strict_last != idx &&
        m->frame_of[m->strict_last] >= 0)   /* one page mapped at a time: every page visit reaches the device */
        madvise(m->base + m->strict_last * m->page, m->page, MADV_DONTNEED);
    int64_t lease = map_fault(m, addr, write);
    if (lease < 0) {
        if (lease == -ENODEV || lease == -EPERM || lease == -ETIMEDOUT || lease == -EPROTO)
            fail_all(m, (int)lease);
        else
            fail_page(m, idx, (int)lease);
        return;
    }
    int32_t frame = (int32_t)(lease & CHM_LEASE_FRAME_MASK);
    if (++m->leases == m->test_stall_at)
        raise(SIGSTOP);   /* a client that stops answering (tests/libchm/test_mmap_faults.py) */
    int ret = 0;
    if (m->frame_of[idx] != frame) {
        if (mmap(at, m->page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, m->dram_fd,
                 (off_t)frame * (off_t)m->page) == MAP_FAILED) {
            ret = -errno;
        } else {
            madvise(at, m->page, MADV_DONTFORK);
            m->frame_of[idx] = frame;
            ret = uffd_register(m, at, m->page, UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_MINOR |
                                                UFFDIO_REGISTER_MODE_WP);
            if (!ret)
                note_installed(m, idx);
            wp = 0;   /* a fresh VMA has no entries: install them */
        }
    }
    int partial = 0;
    if (!ret && wp) {   /* a write to a page installed read-only: the device admitted it, lift the protection */
        struct uffdio_writeprotect u = { .range = { .start = (uintptr_t)at, .len = m->page }, .mode = 0 };
        if (ioctl(m->uffd, UFFDIO_WRITEPROTECT, &u) < 0)
            ret = install_continue(m, at, m->page, write);   /* its entries went meanwhile */
    } else if (!ret && !write && !sequential && !(m->flags & CHM_MAP_STRICT)) {
        ret = install_continue(m, at + host * HOST_PAGE, HOST_PAGE, 0);
        partial = !ret;
    } else if (!ret) {
        ret = install_continue(m, at, m->page, write);
    }
    if (partial) {
        m->open_lease = lease;
        m->open_idx = idx;
        m->open_since = chm_now_ns();
    } else {
        map_ack(m, addr, lease, ret != 0);
    }
    if (ret) {
        fail_page(m, idx, ret);
        return;
    }
    m->strict_last = (ssize_t)idx;   /* CONTINUE and the write-protect lift woke the faulting threads */
}

/* handle_fault under the mapping's lock, unless the mapping or the page has failed: then 0 (not served: the
 * access is retried onto the failed page's SIGBUS). */
static int serve_fault(struct chm_map *m, uintptr_t address, uint64_t fault_flags)
{
    map_lock(m);
    int served = !m->error && m->frame_of[(address - (uintptr_t)m->base) / m->page] != DEAD_PAGE;
    if (served)
        handle_fault(m, address, fault_flags);
    map_unlock(m);
    return served;
}

static void *handler(void *arg)
{
    struct chm_map *m = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);   /* the program's signals go to its own threads */
    struct pollfd p[3] = { { .fd = m->uffd, .events = POLLIN }, { .fd = m->stop_fd, .events = POLLIN },
                           { .fd = m->pidfd, .events = POLLIN } };
    for (;;) {
        int n = poll(p, m->pidfd >= 0 ? 3 : 2, __atomic_load_n(&m->open_lease, __ATOMIC_RELAXED) ? 1 : 100);
        if (n < 0 && errno != EINTR)
            break;
        if (p[1].revents)
            break;
        if ((m->pidfd >= 0 && p[2].revents) || chm_load_acquire(&m->fq->node->magic) != CHM_WIRE_MAGIC) {
            map_lock(m);
            fail_all(m, -ENODEV);   /* the device is gone: nothing it served may be seen again */
            map_unlock(m);
            p[2].fd = -1;
        }
        if (__atomic_load_n(&m->open_lease, __ATOMIC_RELAXED)) {   /* no second fault came for it */
            map_lock(m);
            if (m->open_lease && chm_now_ns() - m->open_since >= OPEN_LEASE_NS)
                close_open_lease(m);
            map_unlock(m);
        }
        struct uffd_msg msg[16];
        ssize_t got = read(m->uffd, msg, sizeof msg);
        for (ssize_t i = 0; got > 0 && i < got / (ssize_t)sizeof msg[0]; i++) {
            if (msg[i].event != UFFD_EVENT_PAGEFAULT)
                continue;
            uintptr_t address = (uintptr_t)msg[i].arg.pagefault.address;
            if (!serve_fault(m, address, msg[i].arg.pagefault.flags))
                uffd_wake(m, (void *)address, 1);
        }
    }
    return NULL;
}

/* ---- CHM_MAP_INLINE: faults served in the faulting thread's SIGBUS handler --------------------------- */

static struct chm_map *inline_maps[INLINE_MAPS_MAX];   /* the process's inline mappings, for the handler */
static uint32_t inline_in_handler;                     /* handlers running: a mapping is freed at 0 */
static struct sigaction sigbus_before;                 /* the program's SIGBUS handler, for every other one */
static pthread_once_t sigbus_once = PTHREAD_ONCE_INIT;
static int sigbus_installed;                           /* 0, or -errno of sigaction */

static void sigbus_chain(int sig, siginfo_t *si, void *uc)
{
    if ((sigbus_before.sa_flags & SA_SIGINFO) && sigbus_before.sa_sigaction) {
        sigbus_before.sa_sigaction(sig, si, uc);
        return;
    }
    if (!(sigbus_before.sa_flags & SA_SIGINFO) && sigbus_before.sa_handler != SIG_DFL &&
        sigbus_before.sa_handler != SIG_IGN) {
        sigbus_before.sa_handler(sig);
        return;
    }
    struct sigaction dfl = { .sa_handler = SIG_DFL };   /* the access is retried and the process dies of it */
    sigaction(SIGBUS, &dfl, NULL);
}

static void on_sigbus(int sig, siginfo_t *si, void *ucontext)
{
    int saved_errno = errno;
    __atomic_add_fetch(&inline_in_handler, 1, __ATOMIC_SEQ_CST);
    uintptr_t address = (uintptr_t)si->si_addr;
    int served = 0;
    for (unsigned i = 0; si->si_code > 0 && i < INLINE_MAPS_MAX; i++) {   /* <= 0: sent, not a fault */
        struct chm_map *m = __atomic_load_n(&inline_maps[i], __ATOMIC_ACQUIRE);
        if (!m || address - (uintptr_t)m->base >= m->len)
            continue;
        uint64_t flags = 0;
#if defined(__x86_64__)
        greg_t err = ((ucontext_t *)ucontext)->uc_mcontext.gregs[REG_ERR];   /* the page fault's error code */
        if (err & 2)
            flags |= UFFD_PAGEFAULT_FLAG_WRITE;
        if ((err & 3) == 3)   /* a write to a present page: write-protected */
            flags |= UFFD_PAGEFAULT_FLAG_WP;
#endif
        /* installed, or failed while served: either way retried; a page failed before: the program's SIGBUS */
        served = serve_fault(m, address, flags);
        break;
    }
    __atomic_sub_fetch(&inline_in_handler, 1, __ATOMIC_SEQ_CST);
    if (!served)
        sigbus_chain(sig, si, ucontext);
    errno = saved_errno;
}

static void sigbus_install(void)
{
    struct sigaction sa = { .sa_sigaction = on_sigbus, .sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART };
    sigemptyset(&sa.sa_mask);
    sigbus_installed = sigaction(SIGBUS, &sa, &sigbus_before) ? -errno : 0;
}

static int inline_add(struct chm_map *m)
{
#if !defined(__x86_64__)
    (void)m;
    snprintf(unsupported_why, sizeof unsupported_why, "CHM_MAP_INLINE reads a fault's access from x86-64's "
             "signal context; this architecture's is not read");
    return -EOPNOTSUPP;
#else
    pthread_once(&sigbus_once, sigbus_install);
    if (sigbus_installed)
        return sigbus_installed;
    for (unsigned i = 0; i < INLINE_MAPS_MAX; i++) {
        struct chm_map *none = NULL;
        if (__atomic_compare_exchange_n(&inline_maps[i], &none, m, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED))
            return 0;
    }
    return -EMFILE;
#endif
}

/* Off the handler's list, once no handler can be using it. */
static void inline_remove(struct chm_map *m)
{
    for (unsigned i = 0; i < INLINE_MAPS_MAX; i++) {
        struct chm_map *mine = m;
        __atomic_compare_exchange_n(&inline_maps[i], &mine, NULL, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
    }
    while (__atomic_load_n(&inline_in_handler, __ATOMIC_SEQ_CST))
        sched_yield();
}

/* ---- the map request ----------------------------------------------------------------------------- */

static int map_request(struct chm_map *m)
{
    struct chm_map_req req = { .magic = CHM_WIRE_MAGIC, .op = CHM_CTL_MAP, .dev_addr = m->dev_addr,
                               .len = m->len, .base = (uintptr_t)m->base };
    char ctl[CMSG_SPACE(sizeof(int))] = { 0 };
    struct iovec iov = { .iov_base = &req, .iov_len = sizeof req };
    struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl };
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &m->uffd, sizeof(int));
    if (sendmsg(m->fq->sock, &msg, MSG_NOSIGNAL) != (ssize_t)sizeof req)
        return -ENODEV;
    struct chm_map_resp resp;
    char rctl[CMSG_SPACE(sizeof(int))] = { 0 };
    struct iovec riov = { .iov_base = &resp, .iov_len = sizeof resp };
    struct msghdr rmsg = { .msg_iov = &riov, .msg_iovlen = 1, .msg_control = rctl, .msg_controllen = sizeof rctl };
    struct pollfd p = { .fd = m->fq->sock, .events = POLLIN };
    if (poll(&p, 1, (int)(m->fault_timeout_ns / 1000000)) != 1)
        return -ETIMEDOUT;
    ssize_t n = recvmsg(m->fq->sock, &rmsg, MSG_CMSG_CLOEXEC);
    if (n != (ssize_t)sizeof resp)
        return -ENODEV;
    struct cmsghdr *rc = CMSG_FIRSTHDR(&rmsg);
    int fd = -1;
    if (rc && rc->cmsg_type == SCM_RIGHTS && rc->cmsg_len == CMSG_LEN(sizeof(int)))
        memcpy(&fd, CMSG_DATA(rc), sizeof(int));
    if (resp.status) {
        if (fd >= 0)
            close(fd);
        return resp.status;
    }
    if (fd < 0 || resp.page_size != m->page)
        return -EPROTO;
    m->dram_fd = fd;
    return 0;
}

static size_t vma_budget(void)
{
    size_t max = 65530, used = 0;
    FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
    if (f) {
        if (fscanf(f, "%zu", &max) != 1)
            max = 65530;
        fclose(f);
    }
    f = fopen("/proc/self/maps", "r");
    if (f) {
        int ch;
        while ((ch = fgetc(f)) != EOF)
            used += ch == '\n';
        fclose(f);
    }
    size_t budget = max > used + MAP_COUNT_RESERVE ? (max - used - MAP_COUNT_RESERVE) / 2 : 16;
    uint64_t cap = env_ms("CHM_MAP_MAX_FRAMES", 0);
    return cap && cap < budget ? cap : (budget < 16 ? 16 : budget);
}

static void map_free(struct chm_map *m, int unmap)
{
    if (m->flags & CHM_MAP_INLINE)
        inline_remove(m);
    if (m->thread_started) {
        uint64_t one = 1;
        ssize_t w = write(m->stop_fd, &one, sizeof one);
        (void)w;
        pthread_join(m->thread, NULL);
    }
    if (unmap && m->base)
        munmap(m->base, m->len);
    else if (m->base)
        make_sigbus(m, m->base, m->len);
    size_t meta = m->pages * sizeof(int32_t);
    if (m->frame_of)
        munmap(m->frame_of, meta);
    if (m->page_error)
        munmap(m->page_error, meta);
    free(m->fifo);
    int fds[] = { m->uffd, m->dram_fd, m->stop_fd, m->pidfd, m->dead_fd };
    for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    chm_close(m->fq);   /* the device sees EOF: this mapping's leases end */
    free(m);
}

int chm_mmap_range(chm_dev *dev, chm_addr addr, size_t len, void **ptr, unsigned flags)
{
    CHECK_DEV(dev);
    if (!ptr || (flags & ~(unsigned)(CHM_MAP_STRICT | CHM_MAP_INLINE)))
        return -EINVAL;
    *ptr = NULL;
    uint64_t page = dev->node->page_size;
    int ret = check_range(dev, addr, len);
    if (ret)
        return ret;
    if (addr % page || len % page)
        return -EINVAL;
    struct chm_map *m = calloc(1, sizeof *m);
    if (!m)
        return -ENOMEM;
    m->uffd = m->dram_fd = m->stop_fd = m->pidfd = m->dead_fd = -1;
    m->dev_addr = addr;
    m->len = len;
    m->page = page;
    m->flags = flags;
    m->pages = len / page;
    m->strict_last = m->last_fault_idx = -1;
    m->cont_wp = 1;
    m->fault_timeout_ns = env_ms("CHM_MAP_FAULT_TIMEOUT_MS", DEFAULT_FAULT_TIMEOUT_MS) * 1000000ull;
    m->write_timeout_ns = env_ms("CHM_MAP_WRITE_TIMEOUT_MS", DEFAULT_WRITE_TIMEOUT_MS) * 1000000ull;
    m->budget = vma_budget();
    m->test_stall_at = env_ms("CHM_MAP_TEST_STALL_AT", 0);
    if ((ret = m->uffd = uffd_for_mapping(flags & CHM_MAP_INLINE ? UFFD_FEATURE_SIGBUS : 0)) < 0) {
        m->uffd = -1;
        goto fail;
    }
    struct chm_open_opts o = { .size = sizeof o, .staging_bytes = FAULT_STAGING, .queue_entries = FAULT_QUEUE_ENTRIES };
    if ((ret = chm_open_opts(dev->node_path, &o, &m->fq)) < 0)
        goto fail;
    m->stop_fd = eventfd(0, EFD_CLOEXEC);
    m->dead_fd = memfd_create("chm-map-dead", MFD_CLOEXEC);
    m->pidfd = (int)syscall(SYS_pidfd_open, (pid_t)dev->node->server_pid, 0);
    size_t meta = m->pages * sizeof(int32_t);
    m->frame_of = mmap(NULL, meta, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    m->page_error = mmap(NULL, meta, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    m->fifo = malloc(m->budget * sizeof *m->fifo);
    if (m->stop_fd < 0 || m->dead_fd < 0 || m->frame_of == MAP_FAILED || m->page_error == MAP_FAILED || !m->fifo) {
        if (m->frame_of == MAP_FAILED)
            m->frame_of = NULL;
        if (m->page_error == MAP_FAILED)
            m->page_error = NULL;
        ret = -ENOMEM;
        goto fail;
    }
    memset(m->frame_of, 0xff, meta);   /* NO_FRAME: the pages touched are backed, the rest stays untouched */
    /* The reservation, aligned to the page so each frame VMA starts on one. */
    size_t span = len + page;
    char *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) {
        ret = -ENOMEM;
        goto fail;
    }
    char *base = (char *)(((uintptr_t)raw + page - 1) / page * page);
    if (base > raw)
        munmap(raw, (size_t)(base - raw));
    if (raw + span > base + len)
        munmap(base + len, (size_t)(raw + span - (base + len)));
    m->base = base;
    madvise(base, len, MADV_DONTFORK);
    if ((ret = uffd_register(m, base, len, UFFDIO_REGISTER_MODE_MISSING)) < 0)
        goto fail;
    if ((ret = map_request(m)) < 0)
        goto fail;
    if ((ret = -pthread_create(&m->thread, NULL, handler, m)) < 0)
        goto fail;
    m->thread_started = 1;
    if ((flags & CHM_MAP_INLINE) && (ret = inline_add(m)) < 0)
        goto fail;
    m->next = dev->maps;
    dev->maps = m;
    *ptr = base;
    return 0;
fail:
    map_free(m, 1);
    return ret;
}

int chm_mmap(chm_dev *dev, void **ptr, unsigned flags)
{
    CHECK_DEV(dev);
    return chm_mmap_range(dev, 0, dev->node->capacity_bytes, ptr, flags);
}

static struct chm_map **find(chm_dev *dev, const void *ptr, int inside)
{
    for (struct chm_map **p = &dev->maps; *p; p = &(*p)->next) {
        const char *b = (*p)->base, *c = ptr;
        if (inside ? (c >= b && (size_t)(c - b) < (*p)->len) : c == b)
            return p;
    }
    return NULL;
}

/* Take the mapping at ptr off dev's list and free it (unmapping its addresses, or leaving them SIGBUS). */
static int map_end(chm_dev *dev, void *ptr, int unmap)
{
    CHECK_DEV(dev);
    struct chm_map **p = find(dev, ptr, 0);
    if (!p)
        return -EINVAL;
    struct chm_map *m = *p;
    *p = m->next;
    map_free(m, unmap);
    return 0;
}

int chm_munmap(chm_dev *dev, void *ptr)
{
    return map_end(dev, ptr, 1);
}

int chm_map_revoke(chm_dev *dev, void *ptr)
{
    return map_end(dev, ptr, 0);
}

int chm_map_error(chm_dev *dev, const void *ptr)
{
    CHECK_DEV(dev);
    struct chm_map **p = find(dev, ptr, 1);
    if (!p)
        return -EFAULT;
    struct chm_map *m = *p;
    int whole = __atomic_load_n(&m->error, __ATOMIC_ACQUIRE);
    return whole ? whole : __atomic_load_n(&m->page_error[((const char *)ptr - m->base) / m->page], __ATOMIC_ACQUIRE);
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22   /* Linux 5.14 */
#endif

/* Fault one page in as a read by the kernel (MADV_POPULATE_READ), so that a page that cannot be served is
 * -1 (EFAULT) rather than this thread's SIGBUS. The handler thread serves the kernel's fault; an inline
 * mapping's fault is SIGBUS to the kernel too, so the page is served here first. A kernel without
 * MADV_POPULATE_READ: the page is touched. */
static int populate_page(struct chm_map *m, char *at)
{
    if (madvise(at, m->page, MADV_POPULATE_READ) == 0)
        return 0;
    if (errno == EINVAL) {
        (void)*(volatile const char *)at;
        return 0;
    }
    if (errno != EFAULT || !(m->flags & CHM_MAP_INLINE))
        return -1;
    serve_fault(m, (uintptr_t)at, 0);
    return madvise(at, m->page, MADV_POPULATE_READ);
}

int chm_map_populate(chm_dev *dev, const void *ptr, size_t size)
{
    CHECK_DEV(dev);
    struct chm_map **p = find(dev, ptr, 1);
    if (!p || size == 0)
        return p ? -EINVAL : -EFAULT;
    struct chm_map *m = *p;
    size_t off = (size_t)((const char *)ptr - m->base);
    if (size > m->len - off)
        return -ERANGE;
    for (size_t at = off / m->page * m->page; at < off + size; at += m->page) {
        int err = chm_map_error(dev, m->base + at);
        if (err)
            return err;   /* a failed page: its error, where a touch would be SIGBUS */
        if (populate_page(m, m->base + at) < 0)
            return chm_map_error(dev, m->base + at) ?: -EFAULT;
    }
    return 0;
}

chm_req chm_prefetch_ptr(chm_dev *dev, const void *ptr, size_t size)
{
    CHECK_DEV(dev);
    struct chm_map **p = find(dev, ptr, 1);
    if (!p)
        return -EFAULT;
    struct chm_map *m = *p;
    size_t off = (size_t)((const char *)ptr - m->base);
    if (size == 0)
        return -EINVAL;
    if (size > m->len - off)
        return -ERANGE;
    return chm_prefetch_object(dev, m->dev_addr + off, size);
}

void maps_close(chm_dev *dev)
{
    while (dev->maps) {
        struct chm_map *m = dev->maps;
        dev->maps = m->next;
        map_free(m, 1);
    }
}
