/*
 * uffd_probe -- does this kernel allow what docs/mmap.md (chm_mmap) relies on?
 *
 * One line per check: "name: ok <detail>" or "name: missing (errno N: text) <detail>". Nothing here needs
 * a device: a memfd stands in for the device's DRAM region (frames of FRAME bytes), and the probe's own
 * handler thread plays libchm's fault handler. Exit status 0 even when checks are missing: the caller
 * (tests/libchm/test_mmap_probe.py) decides which checks it needs. Build: cc -O2 -pthread uffd_probe.c probe_common.c probe_costs.c (or make).
 * PROBE_BREAK=<check name> makes that check fail on purpose (to see the test fail).
 */
#define _GNU_SOURCE
#include "probe.h"

static const struct { uint64_t bit; const char *name; } FEATURES[] = {
    { 1ull << 0, "PAGEFAULT_FLAG_WP" }, { 1ull << 1, "EVENT_FORK" }, { 1ull << 2, "EVENT_REMAP" },
    { 1ull << 3, "EVENT_REMOVE" }, { 1ull << 4, "MISSING_HUGETLBFS" }, { 1ull << 5, "MISSING_SHMEM" },
    { 1ull << 6, "EVENT_UNMAP" }, { 1ull << 7, "SIGBUS" }, { 1ull << 8, "THREAD_ID" },
    { 1ull << 9, "MINOR_HUGETLBFS" }, { 1ull << 10, "MINOR_SHMEM" }, { 1ull << 11, "EXACT_ADDRESS" },
    { 1ull << 12, "WP_HUGETLBFS_SHMEM" }, { 1ull << 13, "WP_UNPOPULATED" }, { 1ull << 14, "POISON" },
    { 1ull << 15, "WP_ASYNC" }, { 1ull << 16, "MOVE" },
};

/* ---- the checks -------------------------------------------------------------------------------------- */

uint64_t features;
int have_uffd;

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
    if (have_uffd) {
        check_sigbus_feature();
        check_remote_wp();
    }
    check_pidfd();
    return 0;
}

