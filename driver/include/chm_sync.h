/*
 * chm_sync.h -- memory ordering and sleeping on the shared rings, used by
 * both sides of the wire (libchm and the device's ring helpers, emulator/serve/chm_srv.c).
 * Private: not installed.
 */
#ifndef CHM_SYNC_H
#define CHM_SYNC_H

#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline uint32_t chm_load_acquire(const uint32_t *p)
{
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

static inline void chm_store_release(uint32_t *p, uint32_t v)
{
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

/* Store, then a full fence: the Dekker pattern of "publish, then look whether
 * the other side sleeps" needs store->load ordering, which release lacks. */
static inline void chm_store_fence(uint32_t *p, uint32_t v)
{
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static inline void chm_fence(void)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static inline void chm_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* One step of a spin-wait (*steps counts them). Every 16th step yields, so a
 * peer sharing our core runs when the machine has fewer free cores than
 * spinners; yielding on every step would add ~1 us to every pick-up. */
static inline void chm_spin_step(unsigned *steps)
{
    for (int k = 0; k < 8; k++)
        chm_cpu_relax();
    if (++*steps % 16 == 0)
        sched_yield();
}

static inline uint64_t chm_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Shared (not FUTEX_PRIVATE): the word lives in memory mapped by two processes. */
static inline int chm_futex_wait(uint32_t *addr, uint32_t expected, uint64_t timeout_ns)
{
    struct timespec ts = { (time_t)(timeout_ns / 1000000000ull), (long)(timeout_ns % 1000000000ull) };
    long ret = syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, NULL, 0);
    return ret < 0 ? -errno : 0;
}

static inline void chm_futex_wake(uint32_t *addr)
{
    syscall(SYS_futex, addr, FUTEX_WAKE, 1, NULL, NULL, 0);
}

#endif /* CHM_SYNC_H */
