/*
 * The C side of bench/bench_libchm.py. Prints one JSON object per run.
 *
 *   bench_libchm lat NODE ITERS [ROUNDS]  4 KiB DRAM-hit chm_read latency; with ROUNDS, beside the bare
 *                                         shared-memory ring round trip (two processes, spinning): ROUNDS
 *                                         rounds of ITERS samples each, the two taking turns, each reporting
 *                                         its median round
 *   bench_libchm tput NODE SIZE ITERS   SIZE-byte DRAM-hit reads: copy path, zero-copy path, memcpy
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chm.h>

#include "bench_clock.h"

/* One round's percentiles of n samples (sorted in place). */
struct round { uint64_t p50, p99, min; };

static struct round percentiles(uint64_t *v, int n)
{
    qsort(v, n, sizeof(*v), cmp_u64);
    return (struct round){ v[n / 2], v[(int)(n * 0.99)], v[0] };
}

/* The median round of each percentile, as one JSON line. */
static void print_rounds(struct round *r, int rounds, int iters, const char *name)
{
    uint64_t p50[rounds], p99[rounds], min = UINT64_MAX;
    for (int i = 0; i < rounds; i++) {
        p50[i] = r[i].p50;
        p99[i] = r[i].p99;
        min = r[i].min < min ? r[i].min : min;
    }
    qsort(p50, rounds, sizeof(uint64_t), cmp_u64);
    qsort(p99, rounds, sizeof(uint64_t), cmp_u64);
    printf("{\"what\": \"%s\", \"iters\": %d, \"rounds\": %d, \"p50_ns\": %llu, \"p99_ns\": %llu, "
           "\"min_ns\": %llu}\n", name, iters, rounds, (unsigned long long)p50[rounds / 2],
           (unsigned long long)p99[rounds / 2], (unsigned long long)min);
}

/* The floor: one 64-byte command through a shared ring and one 32-byte
 * completion back, both sides spinning; the same shape as a libchm queue pair
 * with none of the device's work. */
struct floor_ring {
    _Alignas(64) volatile uint32_t sq_tail;
    _Alignas(64) volatile uint32_t cq_tail;
    _Alignas(64) uint64_t sqe[8];
    _Alignas(64) uint64_t cqe[4];
};

static struct round run_floor(int iters)
{
    struct floor_ring *r = mmap(NULL, sizeof(*r), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    memset(r, 0, sizeof(*r));
    pid_t pid = fork();
    if (pid == 0) {
        for (uint32_t seen = 0; seen < (uint32_t)iters + 100;) {
            while (__atomic_load_n(&r->sq_tail, __ATOMIC_ACQUIRE) == seen)
                __builtin_ia32_pause();
            seen++;
            r->cqe[0] = r->sqe[0];
            __atomic_store_n(&r->cq_tail, seen, __ATOMIC_RELEASE);
        }
        _exit(0);
    }
    uint64_t *lat = malloc(sizeof(uint64_t) * iters);
    for (int i = 0; i < iters + 100; i++) {
        uint64_t t0 = now_ns();
        r->sqe[0] = i;
        __atomic_store_n(&r->sq_tail, i + 1, __ATOMIC_RELEASE);
        while (__atomic_load_n(&r->cq_tail, __ATOMIC_ACQUIRE) != (uint32_t)i + 1)
            __builtin_ia32_pause();
        if (i >= 100)
            lat[i - 100] = now_ns() - t0;
    }
    waitpid(pid, NULL, 0);
    munmap(r, sizeof(*r));
    struct round out = percentiles(lat, iters);
    free(lat);
    return out;
}

static chm_dev *open_dev(const char *node)
{
    chm_dev *dev;
    struct chm_open_opts o = { .size = sizeof(o), .staging_bytes = 32u << 20 };
    int ret = chm_open_opts(node, &o, &dev);
    if (ret < 0) {
        fprintf(stderr, "chm_open(%s): %s\n", node, chm_strerror(ret));
        exit(1);
    }
    return dev;
}

static int run_lat(const char *node, int iters, int rounds, int with_floor)
{
    chm_dev *dev = open_dev(node);
    char buf[4096];
    memset(buf, 0x5a, sizeof(buf));
    if (chm_write(dev, 0, buf, sizeof(buf)) < 0 || chm_read(dev, 0, buf, sizeof(buf)) < 0)
        return 1;
    uint64_t *lat = malloc(sizeof(uint64_t) * iters);
    struct round floor_rounds[rounds], read_rounds[rounds];
    uint64_t modelled = 0;
    for (int round = 0; round < rounds; round++) {  /* the floor and the device take turns: same machine, same load */
        if (with_floor)
            floor_rounds[round] = run_floor(iters);
        for (int i = 0; i < iters + 100; i++) {
            uint64_t t0 = now_ns();
            ssize_t n = chm_read(dev, 0, buf, sizeof(buf));
            uint64_t t = now_ns() - t0;
            if (n != sizeof(buf)) {
                fprintf(stderr, "chm_read: %s\n", chm_strerror((int)n));
                return 1;
            }
            if (i >= 100)
                lat[i - 100] = t;
            modelled = chm_last_latency_ns(dev);
        }
        read_rounds[round] = percentiles(lat, iters);
    }
    struct chm_stats st;
    chm_get_stats(dev, &st);
    chm_close(dev);
    printf("{\"what\": \"modelled\", \"latency_ns\": %llu, \"page_misses\": %llu}\n", (unsigned long long)modelled,
           (unsigned long long)st.page_misses);
    if (with_floor)
        print_rounds(floor_rounds, rounds, iters, "ring_floor");
    print_rounds(read_rounds, rounds, iters, "libchm_read_4k");
    free(lat);
    return 0;
}

static double gbps(uint64_t bytes, uint64_t ns)
{
    return (double)bytes / (double)ns;
}

static int run_tput(const char *node, size_t size, int iters)
{
    chm_dev *dev = open_dev(node);
    size_t staging;
    char *zc = chm_buffer(dev, &staging);
    char *src = malloc(size), *dst = malloc(size);
    for (size_t i = 0; i < size; i++)
        src[i] = (char)(i * 13);
    memset(dst, 1, size);
    if (chm_write(dev, 0, src, size) != (ssize_t)size || chm_read(dev, 0, dst, size) != (ssize_t)size ||
        memcmp(src, dst, size) || size > staging) {
        fprintf(stderr, "warm-up failed\n");
        return 1;
    }
    /* The three contenders take turns within each repetition, so they see the same
     * machine (others share it); each reports its median repetition. */
    chm_read(dev, 0, zc, size);   /* fault the staging pages in, as the copy path did */
    uint64_t *t_copy = malloc(sizeof(uint64_t) * iters), *t_zc = malloc(sizeof(uint64_t) * iters),
             *t_mem = malloc(sizeof(uint64_t) * iters);
    for (int i = 0; i < iters; i++) {
        uint64_t t0 = now_ns();
        if (chm_read(dev, 0, dst, size) != (ssize_t)size)
            return 1;
        uint64_t t1 = now_ns();
        if (chm_read(dev, 0, zc, size) != (ssize_t)size)
            return 1;
        uint64_t t2 = now_ns();
        memcpy(dst, src, size);
        __asm__ __volatile__("" : : "r"(dst) : "memory");
        t_copy[i] = t1 - t0;
        t_zc[i] = t2 - t1;
        t_mem[i] = now_ns() - t2;
    }
    int ok = memcmp(zc, src, size) == 0 && memcmp(dst, src, size) == 0;
    qsort(t_copy, iters, sizeof(uint64_t), cmp_u64);
    qsort(t_zc, iters, sizeof(uint64_t), cmp_u64);
    qsort(t_mem, iters, sizeof(uint64_t), cmp_u64);
    uint64_t copy_ns = t_copy[iters / 2], zc_ns = t_zc[iters / 2], memcpy_ns = t_mem[iters / 2];
    chm_close(dev);
    printf("{\"what\": \"throughput\", \"bytes\": %zu, \"iters\": %d, \"copy_gbps\": %.3f, \"zero_copy_gbps\": %.3f, "
           "\"memcpy_gbps\": %.3f, \"data_ok\": %s}\n", size, iters, gbps(size, copy_ns),
           gbps(size, zc_ns), gbps(size, memcpy_ns), ok ? "true" : "false");
    return ok ? 0 : 1;
}

int main(int argc, char **argv)
{
    if ((argc == 4 || argc == 5) && !strcmp(argv[1], "lat") && atoi(argv[3]) >= 100 &&
        (argc == 4 || atoi(argv[4]) >= 1))
        return run_lat(argv[2], atoi(argv[3]), argc == 5 ? atoi(argv[4]) : 1, argc == 5);
    if (argc == 5 && !strcmp(argv[1], "tput"))
        return run_tput(argv[2], strtoull(argv[3], NULL, 0), atoi(argv[4]));
    fprintf(stderr, "usage: %s lat NODE ITERS [ROUNDS] | tput NODE SIZE ITERS\n", argv[0]);
    return 2;
}
