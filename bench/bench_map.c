/*
 * The chm_mmap side of bench/bench_libchm.py (issue 26). Prints one JSON object per line.
 *
 *   bench_map touch NODE PAGES ROUNDS   4 KiB first-touch reads through a fresh mapping (faults served by the
 *                                       handler thread, and CHM_MAP_INLINE) against chm_read of the same
 *                                       4 KiB, sequential and random, on DRAM hits and on misses;
 *                                       in each round every contender takes its turn on the same pages;
 *                                       and the kernel's floors for a no-copy first touch (floor_pass,
 *                                       delivery_pass)
 *   bench_map resident NODE BYTES REPS  memcpy out of resident mapped pages against memcpy of private memory
 *   bench_map death NODE                map, touch, say "ready", then time from the device's death (its
 *                                       pidfd) to the mapping's withdrawal (chm_map_error)
 *   bench_map scan NODE PAGES ROUNDS    whole-page reads of PAGES resident pages: chm_read, a fresh default
 *                                       mapping, a fresh CHM_MAP_STRICT mapping (GB/s, medians of the rounds)
 *   bench_map stall NODE                map, say "ready", touch a page: with $CHM_MAP_TEST_STALL_AT=1 the
 *                                       process stops itself holding that lease (the bench times the cut-off)
 *
 * The device must have a one-area policy (lru) whose read area holds PAGES pages (hits) but not 2*PAGES (a
 * read of the churn region [PAGES, 3*PAGES) then evicts the pages measured, [0, PAGES): misses).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <chm.h>

#include "bench_clock.h"

#define BLOCK 4096

static void die(const char *what, long err)
{
    fprintf(stderr, "bench_map: %s: %s\n", what, chm_strerror((int)err));
    exit(1);
}

static uint64_t page_size;
static char block[BLOCK];

/* Open the device (exit on failure) and fill *info. */
static chm_dev *open_dev(const char *node, struct chm_info *info)
{
    chm_dev *dev;
    int ret = chm_open(node, &dev);
    if (ret < 0)
        die("chm_open", ret);
    chm_get_info(dev, info);
    return dev;
}

/* Every page of [first, first+n) read once by chm_read: resident (hits next), the ones before evicted. */
static void warm(chm_dev *dev, uint64_t first, uint64_t n)
{
    for (uint64_t p = first; p < first + n; p++) {
        ssize_t r = chm_read(dev, p * page_size, block, BLOCK);
        if (r < 0)
            die("chm_read (warm)", r);
    }
}

enum contender { BY_READ, BY_MAP, BY_MAP_INLINE, CONTENDERS };

/* One contender over the pages in `order`: chm_read of 4 KiB at the page's offset `off`, or a load of the
 * same 4 KiB through a fresh mapping of [0, n) pages (its first touch: one fault each), its faults served by
 * the handler thread or (CHM_MAP_INLINE) in the faulting thread. */
static void pass(chm_dev *dev, const uint64_t *order, uint64_t n, uint64_t off, enum contender who, int sequential,
                 uint64_t *out)
{
    void *base = NULL;
    int mapped = who != BY_READ;
    if (mapped) {
        int ret = chm_mmap_range(dev, 0, n * page_size, &base, who == BY_MAP_INLINE ? CHM_MAP_INLINE : 0);
        if (ret < 0)
            die("chm_mmap_range", ret);
    }
    uint64_t blocks = sequential ? page_size / BLOCK : 1;
    for (uint64_t i = 0; i < n; i++) {
        for (uint64_t b = 0; b < blocks; b++) {
            uint64_t addr = order[i] * page_size + (sequential ? b * BLOCK : off);
            uint64_t t0 = now_ns();
            if (mapped) {
                memcpy(block, (char *)base + addr, BLOCK);
                __asm__ __volatile__("" : : "r"(block) : "memory");
            } else {
                ssize_t r = chm_read(dev, addr, block, BLOCK);
                if (r != BLOCK)
                    die("chm_read", r);
            }
            out[i * blocks + b] = now_ns() - t0;
        }
    }
    if (mapped)
        chm_munmap(dev, base);
}

/* The kernel's floor for a no-copy first touch, no device and no handler: a frame of a memfd of its own mapped
 * over the page's place in a reservation (mmap MAP_SHARED|MAP_FIXED: a frame's offset is not the page's, so one
 * VMA operation per frame is the least any such mechanism pays), then the page's first touch (one fault). */
static void floor_pass(int memfd, const uint64_t *order, uint64_t n, uint64_t off, uint64_t *out)
{
    char *base = mmap(NULL, n * page_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED)
        die("mmap (floor reservation)", -errno);
    for (uint64_t i = 0; i < n; i++) {
        char *at = base + order[i] * page_size;
        uint64_t t0 = now_ns();
        if (mmap(at, page_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, memfd,
                 (off_t)(((order[i] * 7919) % n) * page_size)) == MAP_FAILED)
            die("mmap (floor frame)", -errno);
        memcpy(block, at + off, BLOCK);
        __asm__ __volatile__("" : : "r"(block) : "memory");
        out[i] = now_ns() - t0;
    }
    munmap(base, n * page_size);
}

/* The kernel's floor for any user-space fault handling, even with frames at their pages' offsets (no VMA
 * operation at all): a MINOR fault on a registered shared mapping of the memfd, delivered as SIGBUS to the
 * faulting thread (UFFD_FEATURE_SIGBUS, the cheapest delivery) and resolved by one UFFDIO_CONTINUE. */
static int delivery_uffd = -1;
static char *delivery_base;
static size_t delivery_len;
static struct sigaction delivery_before;   /* libchm's handler (CHM_MAP_INLINE), for every other address */

static void delivery_sigbus(int sig, siginfo_t *si, void *uc)
{
    uintptr_t a = (uintptr_t)si->si_addr;
    if (a - (uintptr_t)delivery_base < delivery_len) {
        struct uffdio_continue c = { .range = { .start = a & ~(uintptr_t)4095, .len = 4096 } };
        if (ioctl(delivery_uffd, UFFDIO_CONTINUE, &c) == 0 || errno == EEXIST)
            return;
    }
    if ((delivery_before.sa_flags & SA_SIGINFO) && delivery_before.sa_sigaction)
        delivery_before.sa_sigaction(sig, si, uc);
    else   /* the access is retried under the disposition from before (the default: death) */
        sigaction(SIGBUS, &delivery_before, NULL);
}

/* 0, or -errno where the kernel lacks what it needs (the row is then left out). */
static int delivery_pass(int memfd, const uint64_t *order, uint64_t n, uint64_t off, uint64_t *out)
{
    int uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    struct uffdio_api api = { .api = UFFD_API, .features = UFFD_FEATURE_SIGBUS | UFFD_FEATURE_MINOR_SHMEM };
    if (uffd < 0 || ioctl(uffd, UFFDIO_API, &api) < 0) {
        int err = -errno;
        if (uffd >= 0)
            close(uffd);
        return err;
    }
    size_t len = n * page_size;
    char *base = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    struct uffdio_register r = { .range = { .start = (uintptr_t)base, .len = len }, .mode = UFFDIO_REGISTER_MODE_MINOR };
    if (base == MAP_FAILED || ioctl(uffd, UFFDIO_REGISTER, &r) < 0) {
        int err = -errno;
        if (base != MAP_FAILED)
            munmap(base, len);
        close(uffd);
        return err;
    }
    delivery_uffd = uffd;
    delivery_base = base;
    delivery_len = len;
    struct sigaction sa = { .sa_sigaction = delivery_sigbus, .sa_flags = SA_SIGINFO };
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &delivery_before);
    for (uint64_t i = 0; i < n; i++) {
        char *at = base + order[i] * page_size;
        uint64_t t0 = now_ns();
        memcpy(block, at + off, BLOCK);
        __asm__ __volatile__("" : : "r"(block) : "memory");
        out[i] = now_ns() - t0;
    }
    sigaction(SIGBUS, &delivery_before, NULL);
    delivery_len = 0;
    munmap(base, len);
    close(uffd);
    return 0;
}

static void print_p(const char *what, uint64_t *v, uint64_t n)
{
    qsort(v, n, sizeof *v, cmp_u64);
    printf("{\"what\": \"%s\", \"samples\": %llu, \"p50_ns\": %llu, \"p99_ns\": %llu}\n", what,
           (unsigned long long)n, (unsigned long long)v[n / 2], (unsigned long long)v[n * 99 / 100]);
}

static int run_touch(const char *node, uint64_t n, int rounds)
{
    struct chm_info info;
    chm_dev *dev = open_dev(node, &info);
    page_size = info.page_size;
    uint64_t per_page = page_size / BLOCK;
    uint64_t *order = malloc(n * sizeof *order), *seq = malloc(n * sizeof *seq);
    enum { CASES = 4, FLOOR = CASES * CONTENDERS, DELIVERY, SERIES };   /* + the two floors */
    uint64_t *v[SERIES];
    for (int k = 0; k < SERIES; k++)
        v[k] = malloc((size_t)rounds * n * per_page * sizeof(uint64_t));
    uint64_t count[SERIES] = { 0 };
    int memfd = memfd_create("bench-map-floor", MFD_CLOEXEC);   /* resident frames, as the device's hits are */
    if (memfd < 0 || ftruncate(memfd, (off_t)(n * page_size)) < 0)
        die("memfd (floor)", -errno);
    char *fill = mmap(NULL, n * page_size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (fill == MAP_FAILED)
        die("mmap (floor fill)", -errno);
    memset(fill, 7, n * page_size);
    srand(26);
    for (uint64_t i = 0; i < n; i++)
        seq[i] = order[i] = i;
    static const char *cases[CASES] = { "hit_seq", "hit_rand", "miss_seq", "miss_rand" };
    static const char *by[CONTENDERS] = { "read", "map", "inline" };
    for (int round = 0; round < rounds; round++) {
        for (uint64_t i = n - 1; i > 0; i--) {   /* a new random order each round */
            uint64_t j = (uint64_t)rand() % (i + 1), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        uint64_t off = ((uint64_t)rand() % per_page) * BLOCK;
        for (int c = 0; c < CASES; c++) {
            int miss = c >= 2, sequential = c % 2 == 0;
            for (int who = 0; who < CONTENDERS; who++) {   /* each contender on the same pages, taking turns */
                int k = c * CONTENDERS + who;
                warm(dev, miss ? n : 0, miss ? 2 * n : n);   /* hits: the pages resident; misses: evicted */
                pass(dev, sequential ? seq : order, n, off, (enum contender)who, sequential, v[k] + count[k]);
                count[k] += sequential ? n * per_page : n;
            }
        }
        floor_pass(memfd, order, n, off, v[FLOOR] + count[FLOOR]);
        count[FLOOR] += n;
        if (delivery_pass(memfd, order, n, off, v[DELIVERY] + count[DELIVERY]) == 0)
            count[DELIVERY] += n;
    }
    struct chm_stats st;
    chm_get_stats(dev, &st);
    char name[32];
    for (int k = 0; k < FLOOR; k++) {
        snprintf(name, sizeof name, "%s_%s", cases[k / CONTENDERS], by[k % CONTENDERS]);
        print_p(name, v[k], count[k]);
    }
    print_p("rand_floor", v[FLOOR], count[FLOOR]);
    if (count[DELIVERY])
        print_p("rand_fault_delivery", v[DELIVERY], count[DELIVERY]);
    printf("{\"what\": \"stats\", \"map_faults\": %llu, \"page_hits\": %llu, \"page_misses\": %llu}\n",
           (unsigned long long)st.map_faults, (unsigned long long)st.page_hits, (unsigned long long)st.page_misses);
    chm_close(dev);
    return 0;
}

static int run_resident(const char *node, size_t bytes, int reps)
{
    struct chm_info info;
    chm_dev *dev = open_dev(node, &info);
    int ret;
    void *base;
    if ((ret = chm_mmap_range(dev, 0, bytes, &base, 0)) < 0)
        die("chm_mmap_range", ret);
    char *priv = malloc(bytes), *dst = malloc(bytes);
    memset(priv, 3, bytes);
    memset(dst, 1, bytes);
    if ((ret = chm_map_populate(dev, base, bytes)) < 0)
        die("chm_map_populate", ret);
    uint64_t *t_map = malloc(reps * sizeof(uint64_t)), *t_mem = malloc(reps * sizeof(uint64_t));
    for (int i = 0; i < reps; i++) {   /* the two take turns */
        uint64_t t0 = now_ns();
        memcpy(dst, base, bytes);
        __asm__ __volatile__("" : : "r"(dst) : "memory");
        uint64_t t1 = now_ns();
        memcpy(dst, priv, bytes);
        __asm__ __volatile__("" : : "r"(dst) : "memory");
        t_map[i] = t1 - t0;
        t_mem[i] = now_ns() - t1;
    }
    qsort(t_map, reps, sizeof(uint64_t), cmp_u64);
    qsort(t_mem, reps, sizeof(uint64_t), cmp_u64);
    printf("{\"what\": \"resident\", \"bytes\": %zu, \"reps\": %d, \"mapped_gbps\": %.3f, \"memcpy_gbps\": %.3f}\n",
           bytes, reps, (double)bytes / (double)t_map[reps / 2], (double)bytes / (double)t_mem[reps / 2]);
    chm_close(dev);
    return 0;
}

static int run_death(const char *node)
{
    struct chm_info info;
    chm_dev *dev = open_dev(node, &info);
    int ret;
    void *base;
    if ((ret = chm_mmap_range(dev, 0, info.page_size * 4, &base, 0)) < 0)
        die("chm_mmap_range", ret);
    volatile char *p = base;
    (void)p[0];
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)info.server_pid, 0);
    printf("ready\n");
    fflush(stdout);
    struct pollfd pfd = { .fd = pidfd, .events = POLLIN };
    poll(&pfd, 1, -1);
    uint64_t died = now_ns();
    while (chm_map_error(dev, base) == 0 && now_ns() - died < 10000000000ull)
        ;
    printf("{\"what\": \"death\", \"withdrawn_after_ns\": %llu, \"error\": %d}\n",
           (unsigned long long)(now_ns() - died), chm_map_error(dev, base));
    return 0;
}

static int run_scan(const char *node, uint64_t n, int rounds)
{
    struct chm_info info;
    chm_dev *dev = open_dev(node, &info);
    int ret;
    page_size = info.page_size;
    char *buf = malloc(page_size);
    uint64_t *t[3];
    for (int k = 0; k < 3; k++)
        t[k] = malloc(rounds * sizeof(uint64_t));
    for (int round = 0; round < rounds; round++) {
        for (int k = 0; k < 3; k++) {   /* chm_read, default mapping, strict mapping: in turn */
            warm(dev, 0, n);
            void *base = NULL;
            if (k && (ret = chm_mmap_range(dev, 0, n * page_size, &base, k == 2 ? CHM_MAP_STRICT : 0)) < 0)
                die("chm_mmap_range", ret);
            uint64_t t0 = now_ns();
            for (uint64_t p = 0; p < n; p++) {
                if (!k) {
                    ssize_t r = chm_read(dev, p * page_size, buf, page_size);
                    if (r < 0)
                        die("chm_read", r);
                } else {
                    memcpy(buf, (char *)base + p * page_size, page_size);
                    __asm__ __volatile__("" : : "r"(buf) : "memory");
                }
            }
            t[k][round] = now_ns() - t0;
            if (k)
                chm_munmap(dev, base);
        }
    }
    static const char *names[3] = { "read", "map", "strict" };
    printf("{\"what\": \"scan\", \"pages\": %llu, \"page_size\": %llu", (unsigned long long)n,
           (unsigned long long)page_size);
    for (int k = 0; k < 3; k++) {
        qsort(t[k], rounds, sizeof(uint64_t), cmp_u64);
        printf(", \"%s_gbps\": %.3f", names[k], (double)(n * page_size) / (double)t[k][rounds / 2]);
    }
    printf("}\n");
    chm_close(dev);
    return 0;
}

static int run_stall(const char *node)
{
    struct chm_info info;
    chm_dev *dev = open_dev(node, &info);
    int ret;
    void *base;
    if ((ret = chm_mmap_range(dev, 0, info.page_size, &base, 0)) < 0)
        die("chm_mmap_range", ret);
    printf("ready\n");
    fflush(stdout);
    (void)*(volatile char *)base;   /* its lease: the handler stops the process before acknowledging it */
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 5 && !strcmp(argv[1], "scan"))
        return run_scan(argv[2], strtoull(argv[3], NULL, 0), atoi(argv[4]));
    if (argc == 3 && !strcmp(argv[1], "stall"))
        return run_stall(argv[2]);
    if (argc == 5 && !strcmp(argv[1], "touch"))
        return run_touch(argv[2], strtoull(argv[3], NULL, 0), atoi(argv[4]));
    if (argc == 5 && !strcmp(argv[1], "resident"))
        return run_resident(argv[2], strtoull(argv[3], NULL, 0), atoi(argv[4]));
    if (argc == 3 && !strcmp(argv[1], "death"))
        return run_death(argv[2]);
    fprintf(stderr, "usage: %s touch NODE PAGES ROUNDS | resident NODE BYTES REPS | death NODE | scan NODE PAGES ROUNDS"
            " | stall NODE\n", argv[0]);
    return 2;
}
