/*
 * uffd_probe -- does this kernel allow what docs/mmap-design.md (chm_mmap) relies on?
 *
 * One line per check: "name: ok <detail>" or "name: missing (errno N: text) <detail>". Nothing here needs
 * a device: a memfd stands in for the device's DRAM region (frames of FRAME bytes), and the probe's own
 * handler thread plays libchm's fault handler. Exit status 0 even when checks are missing: the caller
 * (tests/libchm/test_mmap_probe.py) decides which checks it needs. Build: cc -O2 -pthread uffd_probe.c.
 * PROBE_BREAK=<check name> makes that check fail on purpose (to see the test fail).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define FRAME 65536ul              /* the small profile's device page: one frame, one VMA */
#define NFRAMES 64ul               /* frames of the stand-in DRAM memfd */
#define FAULTS 10000               /* fault round trips timed per mechanism */
#define VMA_TEST 4000              /* distinct per-frame VMAs created in the max_map_count check */
#define POLL_MS 2000               /* the handler gives up on a silent uffd after this (no hang) */

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif
#ifndef USERFAULTFD_IOC_NEW
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)
#endif
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

static const struct { uint64_t bit; const char *name; } FEATURES[] = {
    { 1ull << 0, "PAGEFAULT_FLAG_WP" }, { 1ull << 1, "EVENT_FORK" }, { 1ull << 2, "EVENT_REMAP" },
    { 1ull << 3, "EVENT_REMOVE" }, { 1ull << 4, "MISSING_HUGETLBFS" }, { 1ull << 5, "MISSING_SHMEM" },
    { 1ull << 6, "EVENT_UNMAP" }, { 1ull << 7, "SIGBUS" }, { 1ull << 8, "THREAD_ID" },
    { 1ull << 9, "MINOR_HUGETLBFS" }, { 1ull << 10, "MINOR_SHMEM" }, { 1ull << 11, "EXACT_ADDRESS" },
    { 1ull << 12, "WP_HUGETLBFS_SHMEM" }, { 1ull << 13, "WP_UNPOPULATED" }, { 1ull << 14, "POISON" },
    { 1ull << 15, "WP_ASYNC" }, { 1ull << 16, "MOVE" },
};

static int broken(const char *name)
{
    const char *b = getenv("PROBE_BREAK");
    return b && strcmp(b, name) == 0;
}

static void report(const char *name, int ok, int err, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void report(const char *name, int ok, int err, const char *fmt, ...)
{
    char detail[256] = "";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof(detail), fmt, ap);
    va_end(ap);
    if (ok && broken(name)) {
        ok = 0;
        err = EPERM;
        snprintf(detail, sizeof(detail), "broken on purpose by PROBE_BREAK");
    }
    if (ok)
        printf("%s: ok %s\n", name, detail);
    else
        printf("%s: missing (errno %d: %s) %s\n", name, err, strerror(err), detail);
    fflush(stdout);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t percentile(uint64_t *v, size_t n, double p)
{
    qsort(v, n, sizeof(*v), cmp_u64);
    return v[(size_t)(p * (double)(n - 1))];
}

/* ---- the stand-in device DRAM ------------------------------------------------------------------ */

static int dram_fd = -1;
static uint8_t *dram;               /* the "device's" own mapping of its DRAM memfd */

static int dram_open(void)
{
    dram_fd = memfd_create("probe-dram", MFD_CLOEXEC);
    if (dram_fd < 0 || ftruncate(dram_fd, NFRAMES * FRAME) < 0)
        return -errno;
    dram = mmap(NULL, NFRAMES * FRAME, PROT_READ | PROT_WRITE, MAP_SHARED, dram_fd, 0);
    if (dram == MAP_FAILED)
        return -errno;
    for (unsigned long f = 0; f < NFRAMES; f++)
        memset(dram + f * FRAME, (int)(0x40 + f), FRAME);
    return 0;
}

/* ---- userfaultfd and the handler thread -------------------------------------------------------- */

static int uffd_new(uint64_t want, uint64_t *got)
{
    int fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
    if (fd < 0) {    /* no syscall, or vm.unprivileged_userfaultfd=0 for a non-root: /dev/userfaultfd */
        int dev = open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
        if (dev < 0)
            return -errno;
        fd = ioctl(dev, USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
        close(dev);
        if (fd < 0)
            return -errno;
    }
    struct uffdio_api api = { .api = UFFD_API, .features = want };
    if (ioctl(fd, UFFDIO_API, &api) < 0) {
        int err = errno;
        close(fd);
        return -err;
    }
    if (got)
        *got = api.features;
    return fd;
}

static int uffd_register(int fd, void *addr, size_t len, uint64_t mode)
{
    struct uffdio_register r = { .range = { (uintptr_t)addr, len }, .mode = mode };
    return ioctl(fd, UFFDIO_REGISTER, &r) < 0 ? -errno : 0;
}

static int uffd_wake(int fd, uintptr_t addr, size_t len)
{
    struct uffdio_range r = { addr, len };
    return ioctl(fd, UFFDIO_WAKE, &r) < 0 ? -errno : 0;
}

enum action { MAP_FRAME, MAP_EOF, CONTINUE, UNPROTECT };

struct handler {
    int uffd;
    enum action action;
    uint8_t *base;                  /* the client's mapping (reservation) */
    int eof_fd;                     /* a zero-length memfd: a mapping of it raises SIGBUS BUS_ADRERR */
    volatile int stop;
    volatile unsigned faults, minor, missing, wp, errors;
    volatile int last_err;
};

/* Which frame the "device" answers for client frame index i: never the same offset (the trick's point). */
static unsigned long frame_for(unsigned long i)
{
    return (i * 7 + 3) % NFRAMES;
}

static void resolve(struct handler *h, const struct uffd_msg *m)
{
    uintptr_t a = (uintptr_t)m->arg.pagefault.address & ~(FRAME - 1);
    unsigned long i = (a - (uintptr_t)h->base) / FRAME;
    uint64_t fl = m->arg.pagefault.flags;
    h->faults++;
    if (fl & UFFD_PAGEFAULT_FLAG_MINOR)
        h->minor++;
    else if (fl & UFFD_PAGEFAULT_FLAG_WP)
        h->wp++;
    else
        h->missing++;
    int err = 0;
    switch (h->action) {
    case MAP_FRAME:     /* the frame itself, at its own (different) offset, over the reservation */
        if (mmap((void *)a, FRAME, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, dram_fd,
                 (off_t)(frame_for(i) * FRAME)) == MAP_FAILED)
            err = errno;
        break;
    case MAP_EOF:       /* withdrawn for good: every access now raises SIGBUS BUS_ADRERR in the kernel */
        if (mmap((void *)a, FRAME, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, h->eof_fd, 0) == MAP_FAILED)
            err = errno;
        break;
    case CONTINUE: {    /* the page cache at this VMA's own offset: map it (all the frame's pages, one call) */
        struct uffdio_continue c = { .range = { a, FRAME }, .mode = 0 };
        if (ioctl(h->uffd, UFFDIO_CONTINUE, &c) < 0 && errno != EEXIST) {
            if (errno == EAGAIN)    /* the mm changed meanwhile: wake, the thread faults again */
                uffd_wake(h->uffd, a, FRAME);
            else
                err = errno;
        }
        break;
    }
    case UNPROTECT: {   /* the first write is seen (dirty tracking): allow it */
        struct uffdio_writeprotect w = { .range = { a, FRAME }, .mode = 0 };
        if (ioctl(h->uffd, UFFDIO_WRITEPROTECT, &w) < 0)
            err = errno;
        break;
    }
    }
    if (err) {
        h->errors++;
        h->last_err = err;
    }
    if (h->action != CONTINUE && h->action != UNPROTECT)   /* those two wake by themselves */
        uffd_wake(h->uffd, a, FRAME);
}

static void *handler_main(void *arg)
{
    struct handler *h = arg;
    while (!h->stop) {
        struct pollfd p = { .fd = h->uffd, .events = POLLIN };
        int n = poll(&p, 1, 50);
        if (n <= 0)
            continue;
        struct uffd_msg m;
        while (read(h->uffd, &m, sizeof(m)) == (ssize_t)sizeof(m)) {
            if (m.event == UFFD_EVENT_PAGEFAULT)
                resolve(h, &m);
        }
    }
    return NULL;
}

static int handler_start(struct handler *h, pthread_t *t)
{
    h->stop = 0;
    return -pthread_create(t, NULL, handler_main, h);
}

static void handler_stop(struct handler *h, pthread_t t)
{
    h->stop = 1;
    pthread_join(t, NULL);
}

/* A mapping at a FRAME-aligned address (the handler finds a fault's frame by rounding down), or MAP_FAILED. */
static void *map_aligned(size_t len, int prot, int flags, int fd, off_t off)
{
    uint8_t *r = mmap(NULL, len + FRAME, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED)
        return MAP_FAILED;
    uint8_t *a = (uint8_t *)(((uintptr_t)r + FRAME - 1) & ~(FRAME - 1));
    if (a > r)
        munmap(r, (size_t)(a - r));
    munmap(a + len, (size_t)(r + FRAME - a));
    return mmap(a, len, prot, flags | MAP_FIXED, fd, off);
}

static uint8_t *reserve(size_t len)
{
    void *m = map_aligned(len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return m == MAP_FAILED ? NULL : m;
}

/* ---- SIGBUS / SIGSEGV catching --------------------------------------------------------------------- */

static __thread sigjmp_buf jump;
static __thread volatile int jump_armed;
static volatile int last_signo, last_code;
static void *volatile last_addr;

static void on_fault_signal(int sig, siginfo_t *si, void *ctx)
{
    (void)ctx;
    last_signo = sig;
    last_code = si->si_code;
    last_addr = si->si_addr;
    if (jump_armed)
        siglongjmp(jump, 1);
    _exit(70);
}

/* Read one byte at p; 0 if it read (*out), else the signal that stopped it. */
static int guarded_load(const volatile uint8_t *p, uint8_t *out)
{
    last_signo = 0;
    jump_armed = 1;
    if (sigsetjmp(jump, 1)) {
        jump_armed = 0;
        return last_signo;
    }
    *out = *p;
    jump_armed = 0;
    return 0;
}

/* ---- the checks -------------------------------------------------------------------------------------- */

static uint64_t features;
static int have_uffd;

static void check_uffd(void)
{
    int fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY);
    report("uffd_syscall", fd >= 0, errno, "userfaultfd(2) (vm.unprivileged_userfaultfd or CAP_SYS_PTRACE)");
    if (fd >= 0)
        close(fd);
    int dev = open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
    int nfd = dev < 0 ? -1 : ioctl(dev, USERFAULTFD_IOC_NEW, O_CLOEXEC);
    report("uffd_dev", nfd >= 0, errno, "/dev/userfaultfd USERFAULTFD_IOC_NEW");
    if (nfd >= 0)
        close(nfd);
    if (dev >= 0)
        close(dev);
    /* Ask for nothing: the kernel answers with every feature it has. */
    int u = uffd_new(0, &features);
    have_uffd = u >= 0;
    report("uffd_api", have_uffd, -u, "features=%#llx", (unsigned long long)features);
    if (u >= 0)
        close(u);
    for (size_t i = 0; i < sizeof(FEATURES) / sizeof(FEATURES[0]); i++) {
        char name[64];
        snprintf(name, sizeof(name), "feature_%s", FEATURES[i].name);
        report(name, have_uffd && (features & FEATURES[i].bit), ENOTSUP, "UFFD_FEATURE_%s", FEATURES[i].name);
    }
}

static void check_register(void)
{
    uint64_t got;
    int u = uffd_new(0, &got);
    if (u < 0) {
        report("register_missing_anon", 0, -u, "no userfaultfd");
        report("register_prot_none", 0, -u, "no userfaultfd");
        return;
    }
    uint8_t *r = reserve(16 * FRAME);
    int err = r ? uffd_register(u, r, 16 * FRAME, UFFDIO_REGISTER_MODE_MISSING) : -errno;
    report("register_missing_anon", !err, -err, "MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE reservation, MODE_MISSING");
    void *pn = mmap(NULL, 16 * FRAME, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    int err2 = pn == MAP_FAILED ? -errno : uffd_register(u, pn, 16 * FRAME, UFFDIO_REGISTER_MODE_MISSING);
    /* Informational: an access to PROT_NONE is SIGSEGV before any uffd fault, so the design does not use it. */
    report("register_prot_none", !err2, -err2, "PROT_NONE reservation registers (its accesses SIGSEGV, not uffd)");
    if (r)
        munmap(r, 16 * FRAME);
    if (pn != MAP_FAILED)
        munmap(pn, 16 * FRAME);
    close(u);
}

/* The key trick, withdrawal, and the fault cost of the trick. */
static void check_map_frame(void)
{
    const unsigned long n = 8;
    int u = uffd_new(0, NULL);
    uint8_t *base = reserve(n * FRAME);
    if (u < 0 || !base || uffd_register(u, base, n * FRAME, UFFDIO_REGISTER_MODE_MISSING) < 0) {
        report("map_frame_on_fault", 0, u < 0 ? -u : errno, "setup");
        report("withdraw_refaults", 0, u < 0 ? -u : errno, "setup");
        return;
    }
    struct handler h = { .uffd = u, .action = MAP_FRAME, .base = base };
    pthread_t t;
    handler_start(&h, &t);
    unsigned long i = 5, f = frame_for(i);
    volatile uint8_t *a = base + i * FRAME + 4096 * 3;
    uint8_t seen = *a;                               /* faults; the handler maps frame f over it */
    int ok = seen == (uint8_t)(0x40 + f) && h.missing == 1 && !h.errors;
    dram[f * FRAME + 4096 * 3] = 0xA5;               /* the device writes its frame: the client sees it */
    ok = ok && *a == 0xA5;
    *a = 0x5A;                                       /* the client writes: the device's frame has it */
    ok = ok && dram[f * FRAME + 4096 * 3] == 0x5A;
    report("map_frame_on_fault", ok, h.last_err ? h.last_err : EIO,
           "fault at frame %lu resolved by mmap(MAP_FIXED|MAP_SHARED) of frame %lu (offset %#lx): shared, no copy "
           "(seen %#x, faults %u)", i, f, f * FRAME, seen, h.faults);
    /* Withdraw: a fresh reservation over it, registered again: the next access faults again. */
    unsigned before = h.faults;
    void *w = mmap(base + i * FRAME, FRAME, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    int err = w == MAP_FAILED ? errno : -uffd_register(u, w, FRAME, UFFDIO_REGISTER_MODE_MISSING);
    h.action = MAP_FRAME;
    uint8_t again = err ? 0 : *a;
    report("withdraw_refaults", !err && h.faults == before + 1 && again == 0x5A, err ? err : EIO,
           "MAP_FIXED reservation + UFFDIO_REGISTER over a mapped frame: next access faulted again");
    handler_stop(&h, t);
    munmap(base, n * FRAME);
    close(u);
}

static void check_fault_cost(void)
{
    int u = uffd_new(0, NULL);
    uint8_t *base = reserve(FAULTS * FRAME);
    uint64_t *lat = calloc(FAULTS, sizeof(*lat));
    if (u < 0 || !base || !lat || uffd_register(u, base, FAULTS * FRAME, UFFDIO_REGISTER_MODE_MISSING) < 0) {
        report("fault_cost_uffd_mmap", 0, u < 0 ? -u : errno, "setup");
        return;
    }
    struct handler h = { .uffd = u, .action = MAP_FRAME, .base = base };
    pthread_t t;
    handler_start(&h, &t);
    unsigned long sum = 0;
    for (unsigned long i = 0; i < FAULTS; i++) {
        uint64_t t0 = now_ns();
        sum += base[i * FRAME];
        lat[i] = now_ns() - t0;
    }
    handler_stop(&h, t);
    int ok = h.faults == FAULTS && !h.errors;
    uint64_t p99 = percentile(lat, FAULTS, 0.99), p50 = percentile(lat, FAULTS, 0.5);
    report("fault_cost_uffd_mmap", ok, h.last_err ? h.last_err : EIO,
           "p50_ns=%llu p99_ns=%llu faults=%u (missing fault -> handler thread mmap(frame) -> UFFDIO_WAKE)%s",
           (unsigned long long)p50, (unsigned long long)p99, h.faults, sum ? "" : " ");
    munmap(base, FAULTS * FRAME);
    free(lat);
    close(u);
}

/* The device zaps every client's mapping of a frame by itself: punch the frame's range out of the DRAM memfd.
 * A client VMA registered MODE_MINOR|MODE_MISSING then traps the next access (never silently maps the
 * frame's new bytes): MINOR once the frame holds a page again, MISSING while it is a hole. */
static void check_punch_minor(void)
{
    int need = (features & UFFD_FEATURE_MINOR_SHMEM) && (features & UFFD_FEATURE_MISSING_SHMEM);
    int u = uffd_new(0, NULL);
    const unsigned long f = 9;
    uint8_t *a = map_aligned(FRAME, PROT_READ | PROT_WRITE, MAP_SHARED, dram_fd, (off_t)(f * FRAME));
    if (!need || u < 0 || a == MAP_FAILED) {
        report("punch_traps_minor", 0, need ? errno : ENOTSUP, "needs UFFD_FEATURE_MINOR_SHMEM and MISSING_SHMEM");
        report("punch_traps_missing", 0, need ? errno : ENOTSUP, "needs UFFD_FEATURE_MINOR_SHMEM and MISSING_SHMEM");
        report("punch_cost", 0, need ? errno : ENOTSUP, "needs UFFD_FEATURE_MINOR_SHMEM");
        return;
    }
    int err = uffd_register(u, a, FRAME, UFFDIO_REGISTER_MODE_MINOR | UFFDIO_REGISTER_MODE_MISSING);
    struct handler h = { .uffd = u, .action = CONTINUE, .base = a };
    pthread_t t;
    handler_start(&h, &t);
    volatile uint8_t *p = a + 4096;
    uint8_t first = err ? 0 : *p;                   /* page in the page cache, no PTE: a minor fault */
    int ok = !err && first == (uint8_t)(0x40 + f) && h.minor == 1 && !h.errors;
    /* The device reuses frame f: punch (zaps the PTEs of every process), then stages the new page. */
    int perr = fallocate(dram_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(f * FRAME), FRAME);
    memset(dram + f * FRAME, 0xC3, FRAME);
    uint8_t after = *p;
    ok = ok && !perr && after == 0xC3 && h.minor == 2 && !h.errors;
    report("punch_traps_minor", ok, perr ? errno : (h.last_err ? h.last_err : EIO),
           "after fallocate(PUNCH_HOLE) of the frame and restaging it, the client's access was a MINOR fault "
           "(minor=%u), resolved by UFFDIO_CONTINUE", h.minor);
    /* Punched and not restaged yet: a hole. The access is a MISSING fault; the handler maps another frame. */
    perr = fallocate(dram_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(f * FRAME), FRAME);
    unsigned missing0 = h.missing;
    h.action = MAP_FRAME;                           /* h.base = a: its frame index 0 -> frame_for(0) */
    uint8_t hole = *p;
    report("punch_traps_missing", !perr && h.missing == missing0 + 1 && hole == (uint8_t)(0x40 + frame_for(0)),
           perr ? errno : EIO, "an access to a punched, empty frame was a MISSING fault (remapped to frame %lu)",
           frame_for(0));
    handler_stop(&h, t);
    munmap(a, FRAME);
    close(u);
    /* What a forced withdrawal costs the device: punch a mapped frame (the refill's page allocation apart). */
    uint64_t lat[1000];
    const unsigned long g = 11;
    uint8_t *m = map_aligned(FRAME, PROT_READ | PROT_WRITE, MAP_SHARED, dram_fd, (off_t)(g * FRAME));
    for (int i = 0; i < 1000; i++) {
        memset(dram + g * FRAME, i, FRAME);
        for (unsigned long o = 0; o < FRAME; o += 4096)
            (void)*(volatile uint8_t *)(m + o);     /* mapped by a "client" too */
        uint64_t t0 = now_ns();
        fallocate(dram_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(g * FRAME), FRAME);
        lat[i] = now_ns() - t0;
    }
    munmap(m, FRAME);
    report("punch_cost", 1, 0, "p50_ns=%llu (fallocate PUNCH_HOLE of one %lu-byte frame, mapped by the device and "
           "by a client)", (unsigned long long)percentile(lat, 1000, 0.5), FRAME);
}

/* The best case of MINOR faults: the VMA already maps the right offset (a frame whose page came back to it). */
static void check_minor_cost(void)
{
    if (!(features & UFFD_FEATURE_MINOR_SHMEM)) {
        report("fault_cost_minor_continue", 0, ENOTSUP, "needs UFFD_FEATURE_MINOR_SHMEM");
        return;
    }
    int u = uffd_new(0, NULL);
    uint8_t *a = map_aligned(NFRAMES * FRAME, PROT_READ | PROT_WRITE, MAP_SHARED, dram_fd, 0);
    uint64_t *lat = calloc(FAULTS, sizeof(*lat));
    if (u < 0 || a == MAP_FAILED || !lat ||
        uffd_register(u, a, NFRAMES * FRAME, UFFDIO_REGISTER_MODE_MINOR) < 0) {
        report("fault_cost_minor_continue", 0, errno, "setup");
        return;
    }
    struct handler h = { .uffd = u, .action = CONTINUE, .base = a };
    pthread_t t;
    handler_start(&h, &t);
    for (int i = 0; i < FAULTS; i++) {
        unsigned long f = (unsigned long)i % NFRAMES;
        if (f == 0)     /* our own PTEs only: the page cache stays */
            madvise(a, NFRAMES * FRAME, MADV_DONTNEED);
        uint64_t t0 = now_ns();
        (void)*(volatile uint8_t *)(a + f * FRAME);
        lat[i] = now_ns() - t0;
    }
    handler_stop(&h, t);
    report("fault_cost_minor_continue", h.minor >= FAULTS && !h.errors, h.last_err ? h.last_err : EIO,
           "p50_ns=%llu p99_ns=%llu faults=%u (minor fault -> UFFDIO_CONTINUE of the whole frame)",
           (unsigned long long)percentile(lat, FAULTS, 0.5), (unsigned long long)percentile(lat, FAULTS, 0.99),
           h.minor);
    munmap(a, NFRAMES * FRAME);
    free(lat);
    close(u);
}

/* Dirty tracking: a mapped frame write-protected through uffd; the first write is reported, then allowed. */
static void check_wp(void)
{
    if (!(features & UFFD_FEATURE_WP_HUGETLBFS_SHMEM)) {
        report("wp_shmem_first_write", 0, ENOTSUP, "needs UFFD_FEATURE_WP_HUGETLBFS_SHMEM");
        return;
    }
    int u = uffd_new(UFFD_FEATURE_WP_HUGETLBFS_SHMEM, NULL);
    const unsigned long f = 13;
    uint8_t *a = map_aligned(FRAME, PROT_READ | PROT_WRITE, MAP_SHARED, dram_fd, (off_t)(f * FRAME));
    int err = u < 0 ? -u : a == MAP_FAILED ? errno : 0;
    if (!err)
        err = -uffd_register(u, a, FRAME, UFFDIO_REGISTER_MODE_WP);
    struct uffdio_writeprotect w = { .range = { (uintptr_t)a, FRAME }, .mode = UFFDIO_WRITEPROTECT_MODE_WP };
    for (unsigned long o = 0; !err && o < FRAME; o += 4096)
        (void)*(volatile uint8_t *)(a + o);           /* populated: write-protect applies to present PTEs */
    if (!err && ioctl(u, UFFDIO_WRITEPROTECT, &w) < 0)
        err = errno;
    if (err) {
        report("wp_shmem_first_write", 0, err, "setup");
        return;
    }
    struct handler h = { .uffd = u, .action = UNPROTECT, .base = a };
    pthread_t t;
    handler_start(&h, &t);
    uint8_t r = *(volatile uint8_t *)(a + 100);     /* a read is not reported */
    unsigned after_read = h.faults;
    *(volatile uint8_t *)(a + 100) = 0x77;          /* the first write is */
    unsigned after_write = h.wp;
    *(volatile uint8_t *)(a + 200) = 0x78;          /* and then allowed: no second report */
    handler_stop(&h, t);
    report("wp_shmem_first_write", r == (uint8_t)(0x40 + f) && after_read == 0 && after_write == 1 && h.wp == 1 &&
           dram[f * FRAME + 100] == 0x77 && !h.errors, h.last_err ? h.last_err : EIO,
           "read not reported, first write reported once (wp=%u), then allowed", h.wp);
    munmap(a, FRAME);
    close(u);
}

/* What a faulting thread sees when its access cannot be served: a mapping beyond the end of a zero-length
 * memfd raises SIGBUS BUS_ADRERR in the kernel, also for a thread that was blocked in a uffd fault. */
static void check_sigbus(void)
{
    int eof = memfd_create("probe-eof", MFD_CLOEXEC);
    uint8_t *a = map_aligned(FRAME, PROT_READ | PROT_WRITE, MAP_SHARED, eof, 0);
    uint8_t v;
    int sig = a == MAP_FAILED ? -1 : guarded_load(a + 4096, &v);
    report("sigbus_beyond_eof", sig == SIGBUS && last_code == BUS_ADRERR && last_addr == a + 4096, EIO,
           "signal=%d si_code=%d (BUS_ADRERR=%d) si_addr matches=%d", sig, last_code, BUS_ADRERR,
           last_addr == a + 4096);
    if (a != MAP_FAILED)
        munmap(a, FRAME);
    int u = uffd_new(0, NULL);
    uint8_t *base = reserve(4 * FRAME);
    if (u < 0 || !base || uffd_register(u, base, 4 * FRAME, UFFDIO_REGISTER_MODE_MISSING) < 0) {
        report("sigbus_blocked_faulter", 0, errno, "setup");
        return;
    }
    struct handler h = { .uffd = u, .action = MAP_EOF, .base = base, .eof_fd = eof };
    pthread_t t;
    handler_start(&h, &t);
    sig = guarded_load(base + 2 * FRAME + 8, &v);
    handler_stop(&h, t);
    report("sigbus_blocked_faulter", sig == SIGBUS && last_code == BUS_ADRERR && h.faults == 1, EIO,
           "a thread blocked in a uffd fault, its frame replaced by a beyond-EOF mapping and woken: signal=%d "
           "si_code=%d", sig, last_code);
    munmap(base, 4 * FRAME);
    close(u);
    close(eof);
}

static long count_maps(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f)
        return -1;
    long n = 0;
    int c;
    while ((c = fgetc(f)) != EOF)
        n += c == '\n';
    fclose(f);
    return n;
}

static void check_map_count(void)
{
    long max = -1;
    FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
    if (f) {
        if (fscanf(f, "%ld", &max) != 1)
            max = -1;
        fclose(f);
    }
    long before = count_maps();
    uint8_t *base = reserve(VMA_TEST * FRAME);
    int err = base ? 0 : errno;
    /* Frames at offsets that do not follow each other: neighbouring VMAs never merge. */
    for (unsigned long i = 0; !err && i < VMA_TEST; i++) {
        if (mmap(base + i * FRAME, FRAME, PROT_READ, MAP_SHARED | MAP_FIXED, dram_fd,
                 (off_t)(((i * 2) % NFRAMES) * FRAME)) == MAP_FAILED)
            err = errno;
    }
    long during = count_maps();
    if (base)
        munmap(base, VMA_TEST * FRAME);
    report("max_map_count", max > 0, ENOENT, "vm.max_map_count=%ld maps_at_start=%ld", max, before);
    report("per_frame_vmas", !err && during - before >= VMA_TEST, err ? err : EIO,
           "%d per-frame mappings held: %ld VMAs (+%ld); room left for about %ld frames of %lu bytes",
           VMA_TEST, during, during - before, max - before, FRAME);
}

/* The alternative: PROT_NONE reservation, SIGSEGV handler that maps the frame from inside the handler. */
static uint8_t *segv_base;

static void on_segv_map(int sig, siginfo_t *si, void *ctx)
{
    (void)sig;
    (void)ctx;
    uintptr_t a = (uintptr_t)si->si_addr & ~(FRAME - 1);
    unsigned long i = (a - (uintptr_t)segv_base) / FRAME;
    if (mmap((void *)a, FRAME, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, dram_fd,
             (off_t)(frame_for(i) * FRAME)) == MAP_FAILED)
        _exit(71);
}

static void check_sigsegv(void)
{
    struct sigaction sa = { .sa_sigaction = on_segv_map, .sa_flags = SA_SIGINFO }, old;
    sigemptyset(&sa.sa_mask);
    segv_base = map_aligned(FAULTS * FRAME, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    uint64_t *lat = calloc(FAULTS, sizeof(*lat));
    if (segv_base == MAP_FAILED || !lat || sigaction(SIGSEGV, &sa, &old) < 0) {
        report("fault_cost_sigsegv_mmap", 0, errno, "setup");
        return;
    }
    int ok = 1;
    for (unsigned long i = 0; i < FAULTS; i++) {
        uint64_t t0 = now_ns();
        uint8_t v = *(volatile uint8_t *)(segv_base + i * FRAME);
        lat[i] = now_ns() - t0;
        ok = ok && v == (uint8_t)dram[frame_for(i) * FRAME];
    }
    sigaction(SIGSEGV, &old, NULL);
    report("fault_cost_sigsegv_mmap", ok, EIO, "p50_ns=%llu p99_ns=%llu (SIGSEGV -> mmap(frame) in the handler)",
           (unsigned long long)percentile(lat, FAULTS, 0.5), (unsigned long long)percentile(lat, FAULTS, 0.99));
    munmap(segv_base, FAULTS * FRAME);
    free(lat);
}

/* The chosen mechanism: uffd registration (so a punched frame traps) with UFFD_FEATURE_SIGBUS, so the faulting
 * thread itself resolves its fault in a SIGBUS handler: no handler thread, no context switch. */
static int sigbus_uffd = -1;
static volatile unsigned sigbus_faults, sigbus_errors;

static void on_sigbus_map(int sig, siginfo_t *si, void *ctx)
{
    (void)sig;
    (void)ctx;
    uintptr_t a = (uintptr_t)si->si_addr & ~(FRAME - 1);
    unsigned long i = (a - (uintptr_t)segv_base) / FRAME;
    sigbus_faults++;
    if (si->si_code != BUS_ADRERR ||
        mmap((void *)a, FRAME, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, dram_fd,
             (off_t)(frame_for(i) * FRAME)) == MAP_FAILED ||
        uffd_register(sigbus_uffd, (void *)a, FRAME, UFFDIO_REGISTER_MODE_MINOR | UFFDIO_REGISTER_MODE_MISSING) < 0)
        _exit(72);
    struct uffdio_continue c = { .range = { a, FRAME }, .mode = UFFDIO_CONTINUE_MODE_DONTWAKE };
    if (ioctl(sigbus_uffd, UFFDIO_CONTINUE, &c) < 0 && errno != EEXIST)
        sigbus_errors++;
}

static void check_sigbus_feature(void)
{
    uint64_t want = UFFD_FEATURE_SIGBUS | UFFD_FEATURE_MINOR_SHMEM | UFFD_FEATURE_MISSING_SHMEM;
    if ((features & want) != want) {
        report("fault_cost_uffd_sigbus", 0, ENOTSUP, "needs UFFD_FEATURE_SIGBUS, MINOR_SHMEM, MISSING_SHMEM");
        return;
    }
    for (unsigned long f = 0; f < NFRAMES; f++)     /* the earlier checks punched some frames: stage them again */
        memset(dram + f * FRAME, (int)(0x40 + f), FRAME);
    sigbus_uffd = uffd_new(UFFD_FEATURE_SIGBUS, NULL);
    segv_base = reserve(FAULTS * FRAME);
    uint64_t *lat = calloc(FAULTS, sizeof(*lat));
    struct sigaction sa = { .sa_sigaction = on_sigbus_map, .sa_flags = SA_SIGINFO }, old;
    sigemptyset(&sa.sa_mask);
    if (sigbus_uffd < 0 || !segv_base || !lat ||
        uffd_register(sigbus_uffd, segv_base, FAULTS * FRAME, UFFDIO_REGISTER_MODE_MISSING) < 0 ||
        sigaction(SIGBUS, &sa, &old) < 0) {
        report("fault_cost_uffd_sigbus", 0, errno, "setup");
        return;
    }
    int ok = 1;
    for (unsigned long i = 0; i < FAULTS; i++) {
        uint64_t t0 = now_ns();
        uint8_t v = *(volatile uint8_t *)(segv_base + i * FRAME);
        lat[i] = now_ns() - t0;
        ok = ok && v == (uint8_t)dram[frame_for(i) * FRAME];
    }
    /* And the device's punch is trapped in the same thread: the frame's new page is mapped again. */
    unsigned before = sigbus_faults;
    unsigned long f = frame_for(1);
    fallocate(dram_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(f * FRAME), FRAME);
    memset(dram + f * FRAME, 0xE1, FRAME);
    uint8_t v = *(volatile uint8_t *)(segv_base + 1 * FRAME);
    ok = ok && v == 0xE1 && sigbus_faults == before + 1 && !sigbus_errors;
    sigaction(SIGBUS, &old, NULL);
    report("fault_cost_uffd_sigbus", ok, EIO, "faults=%u errors=%u punch_seen=%#x p50_ns=%llu p99_ns=%llu (UFFD_FEATURE_SIGBUS -> the faulting "
           "thread's own handler: mmap(frame) + UFFDIO_REGISTER MINOR + UFFDIO_CONTINUE; a punch traps too)",
           sigbus_faults, sigbus_errors, v, (unsigned long long)percentile(lat, FAULTS, 0.5),
           (unsigned long long)percentile(lat, FAULTS, 0.99));
    munmap(segv_base, FAULTS * FRAME);
    free(lat);
    close(sigbus_uffd);
}

/* The kill -9 rule: a pidfd on the device process becomes readable when it dies. */
static void check_pidfd(void)
{
    pid_t child = fork();
    if (child == 0) {
        for (;;)
            pause();
    }
    int pfd = (int)syscall(SYS_pidfd_open, child, 0);
    int err = pfd < 0 ? errno : 0;
    uint64_t t0 = now_ns(), waited = 0;
    kill(child, SIGKILL);
    if (!err) {
        struct pollfd p = { .fd = pfd, .events = POLLIN };
        int n = poll(&p, 1, 1000);
        waited = now_ns() - t0;
        if (n != 1 || !(p.revents & POLLIN))
            err = n < 0 ? errno : ETIMEDOUT;
        close(pfd);
    }
    waitpid(child, NULL, 0);
    report("pidfd_poll_death", !err, err, "pidfd readable %llu us after SIGKILL", (unsigned long long)(waited / 1000));
    /* SO_PEERPIDFD: the device's pidfd straight from the control socket (no pid reuse race). */
    int sv[2];
    int pidfd = -1;
    socklen_t len = sizeof(pidfd);
    err = socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0 ? errno : 0;
    if (!err && getsockopt(sv[0], SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) < 0)
        err = errno;
    report("so_peerpidfd", !err && pidfd >= 0, err, "getsockopt(SO_PEERPIDFD) on a Unix socket (Linux 6.5+)");
    if (pidfd >= 0)
        close(pidfd);
    if (!err) {
        close(sv[0]);
        close(sv[1]);
    }
}

int main(void)
{
    struct sigaction sa = { .sa_sigaction = on_fault_signal, .sa_flags = SA_SIGINFO | SA_NODEFER };
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, NULL);
    int err = dram_open();
    if (err) {
        report("dram_memfd", 0, -err, "memfd_create + ftruncate + mmap");
        return 1;
    }
    FILE *osr = fopen("/proc/sys/kernel/osrelease", "r");
    char rel[65] = "?";
    if (osr) {
        if (!fgets(rel, sizeof(rel), osr))
            strcpy(rel, "?");
        rel[strcspn(rel, "\n")] = 0;
        fclose(osr);
    }
    printf("kernel: %s frame_bytes=%lu faults_timed=%d\n", rel, FRAME, FAULTS);
    check_uffd();
    if (have_uffd) {
        check_register();
        check_map_frame();
        check_punch_minor();
        check_wp();
        check_sigbus();
        check_fault_cost();
        check_minor_cost();
    }
    check_map_count();
    check_sigsegv();
    if (have_uffd)
        check_sigbus_feature();
    check_pidfd();
    return 0;
}
