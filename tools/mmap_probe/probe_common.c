/* uffd_probe's helpers: reporting, timing, the stand-in DRAM, userfaultfd and its handler thread. */
#define _GNU_SOURCE
#include "probe.h"

int broken(const char *name)
{
    const char *b = getenv("PROBE_BREAK");
    return b && strcmp(b, name) == 0;
}

void report(const char *name, int ok, int err, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
void report(const char *name, int ok, int err, const char *fmt, ...)
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

uint64_t now_ns(void)
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

uint64_t percentile(uint64_t *v, size_t n, double p)
{
    qsort(v, n, sizeof(*v), cmp_u64);
    return v[(size_t)(p * (double)(n - 1))];
}

/* ---- the stand-in device DRAM ------------------------------------------------------------------ */

int dram_fd = -1;
uint8_t *dram;               /* the "device's" own mapping of its DRAM memfd */

int dram_open(void)
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

int uffd_new(uint64_t want, uint64_t *got)
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

int uffd_register(int fd, void *addr, size_t len, uint64_t mode)
{
    struct uffdio_register r = { .range = { (uintptr_t)addr, len }, .mode = mode };
    return ioctl(fd, UFFDIO_REGISTER, &r) < 0 ? -errno : 0;
}

int uffd_wake(int fd, uintptr_t addr, size_t len)
{
    struct uffdio_range r = { addr, len };
    return ioctl(fd, UFFDIO_WAKE, &r) < 0 ? -errno : 0;
}

/* Which frame the "device" answers for client frame index i: never the same offset (the trick's point). */
unsigned long frame_for(unsigned long i)
{
    return (i * 7 + 3) % NFRAMES;
}

void resolve(struct handler *h, const struct uffd_msg *m)
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

void *handler_main(void *arg)
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

int handler_start(struct handler *h, pthread_t *t)
{
    h->stop = 0;
    return -pthread_create(t, NULL, handler_main, h);
}

void handler_stop(struct handler *h, pthread_t t)
{
    h->stop = 1;
    pthread_join(t, NULL);
}

/* A mapping at a FRAME-aligned address (the handler finds a fault's frame by rounding down), or MAP_FAILED. */
void *map_aligned(size_t len, int prot, int flags, int fd, off_t off)
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

uint8_t *reserve(size_t len)
{
    void *m = map_aligned(len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return m == MAP_FAILED ? NULL : m;
}

/* ---- SIGBUS / SIGSEGV catching --------------------------------------------------------------------- */

static __thread sigjmp_buf jump;
static __thread volatile int jump_armed;
volatile int last_signo, last_code;
void *volatile last_addr;

void on_fault_signal(int sig, siginfo_t *si, void *ctx)
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
int guarded_load(const volatile uint8_t *p, uint8_t *out)
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

int guarded_store(volatile uint8_t *p, uint8_t v)
{
    last_signo = 0;
    jump_armed = 1;
    if (sigsetjmp(jump, 1)) {
        jump_armed = 0;
        return last_signo;
    }
    *p = v;
    jump_armed = 0;
    return 0;
}


