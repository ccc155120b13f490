/* uffd_probe: the fault costs of each mechanism, per-frame VMAs, the device writing-protecting a client, pidfd. */
#define _GNU_SOURCE
#include "probe.h"

void check_fault_cost(void)
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

/* The best case of MINOR faults: the VMA already maps the right offset (a frame whose page came back to it). */
void check_minor_cost(void)
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

void check_map_count(void)
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

void check_sigsegv(void)
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

void check_sigbus_feature(void)
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
    /* A kernel-mode access (a syscall reading the mapping) to a page not mapped yet: with the SIGBUS feature
     * (and UFFD_USER_MODE_ONLY) no signal can resolve it, so the syscall fails. */
    int pipefd[2] = { -1, -1 };
    ssize_t wr = -1;
    int wr_err = 0;
    if (pipe(pipefd) == 0) {
        wr = write(pipefd[1], segv_base + (FAULTS - 1) * FRAME + 4096, 16);   /* not touched: unmapped */
        wr_err = errno;
        munmap(segv_base + (FAULTS - 1) * FRAME, FRAME);
        void *fresh = mmap(segv_base + (FAULTS - 1) * FRAME, FRAME, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        if (fresh != MAP_FAILED)
            uffd_register(sigbus_uffd, fresh, FRAME, UFFDIO_REGISTER_MODE_MISSING);
        wr = write(pipefd[1], (uint8_t *)fresh + 64, 16);
        wr_err = errno;
        close(pipefd[0]);
        close(pipefd[1]);
    }
    report("sigbus_mode_syscall_efault", wr < 0 && wr_err == EFAULT, wr < 0 ? wr_err : EIO,
           "write(2) from a registered, unmapped page in SIGBUS mode: %s (a syscall needs the page mapped first)",
           wr < 0 ? strerror(wr_err) : "succeeded");
    sigaction(SIGBUS, &old, NULL);
    report("fault_cost_uffd_sigbus", ok, EIO, "faults=%u errors=%u punch_seen=%#x p50_ns=%llu p99_ns=%llu (UFFD_FEATURE_SIGBUS -> the faulting "
           "thread's own handler: mmap(frame) + UFFDIO_REGISTER MINOR + UFFDIO_CONTINUE; a punch traps too)",
           sigbus_faults, sigbus_errors, v, (unsigned long long)percentile(lat, FAULTS, 0.5),
           (unsigned long long)percentile(lat, FAULTS, 0.99));
    munmap(segv_base, FAULTS * FRAME);
    free(lat);
    close(sigbus_uffd);
}

/* Dirty tracking without the client's help: the client hands its uffd to the device (SCM_RIGHTS), and the
 * device write-protects the client's mapping of a frame itself before it flushes the frame. */
void check_remote_wp(void)
{
    uint64_t want = UFFD_FEATURE_WP_HUGETLBFS_SHMEM | UFFD_FEATURE_SIGBUS;
    int sv[2];
    if ((features & want) != want || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
        report("remote_writeprotect", 0, ENOTSUP, "needs UFFD_FEATURE_WP_HUGETLBFS_SHMEM and SIGBUS");
        return;
    }
    pid_t child = fork();
    if (child == 0) {           /* the client */
        int u = uffd_new(want, NULL);
        uint8_t *a = map_aligned(FRAME, PROT_READ | PROT_WRITE, MAP_SHARED, dram_fd, (off_t)(17 * FRAME));
        if (u < 0 || a == MAP_FAILED || uffd_register(u, a, FRAME, UFFDIO_REGISTER_MODE_WP) < 0)
            _exit(2);
        a[0] = 1;               /* mapped and writable */
        uintptr_t addr = (uintptr_t)a;
        char ctrl[CMSG_SPACE(sizeof(int))] = { 0 };
        struct iovec iov = { &addr, sizeof(addr) };
        struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctrl, .msg_controllen = sizeof(ctrl) };
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &u, sizeof(int));
        if (sendmsg(sv[1], &msg, 0) != (ssize_t)sizeof(addr))
            _exit(3);
        char go;
        if (read(sv[1], &go, 1) != 1)   /* the device has write-protected us */
            _exit(4);
        _exit(guarded_store(a + 8, 2) == SIGBUS && last_code == BUS_ADRERR ? 0 : 5);
    }
    uintptr_t addr = 0;
    char ctrl[CMSG_SPACE(sizeof(int))];
    struct iovec iov = { &addr, sizeof(addr) };
    struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctrl, .msg_controllen = sizeof(ctrl) };
    int err = recvmsg(sv[0], &msg, 0) == (ssize_t)sizeof(addr) ? 0 : EPROTO;
    int cu = -1;
    if (!err && CMSG_FIRSTHDR(&msg))
        memcpy(&cu, CMSG_DATA(CMSG_FIRSTHDR(&msg)), sizeof(int));
    struct uffdio_writeprotect w = { .range = { addr, FRAME }, .mode = UFFDIO_WRITEPROTECT_MODE_WP };
    if (!err && (cu < 0 || ioctl(cu, UFFDIO_WRITEPROTECT, &w) < 0))
        err = cu < 0 ? EPROTO : errno;
    if (write(sv[0], "g", 1) != 1 && !err)
        err = errno;
    int status = 0;
    waitpid(child, &status, 0);
    int child_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    report("remote_writeprotect", !err && child_ok, err ? err : EIO,
           "UFFDIO_WRITEPROTECT by another process on the client's uffd: the client's next write was reported "
           "(child exit %d)", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    if (cu >= 0)
        close(cu);
    close(sv[0]);
    close(sv[1]);
}

/* The kill -9 rule: a pidfd on the device process becomes readable when it dies. */
void check_pidfd(void)
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

