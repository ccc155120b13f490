/* probe.h -- what the parts of uffd_probe share (see uffd_probe.c). */
#ifndef PROBE_H
#define PROBE_H
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

enum action { MAP_FRAME, MAP_EOF, CONTINUE, UNPROTECT };

struct handler {
    int uffd;
    volatile enum action action;   /* the main thread changes it between faults */
    uint8_t *volatile base;         /* the client's mapping (reservation) */
    int eof_fd;                     /* a zero-length memfd: a mapping of it raises SIGBUS BUS_ADRERR */
    volatile int stop;
    volatile unsigned faults, minor, missing, wp, errors;
    volatile int last_err;
};


extern int dram_fd;
extern uint8_t *dram;               /* the "device's" own mapping of its DRAM memfd */
extern uint64_t features;           /* what the kernel's UFFDIO_API answered */
extern int have_uffd;
extern volatile int last_signo, last_code;
extern void *volatile last_addr;

int broken(const char *name);
void report(const char *name, int ok, int err, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
uint64_t now_ns(void);
uint64_t percentile(uint64_t *v, size_t n, double p);
int dram_open(void);
int uffd_new(uint64_t want, uint64_t *got);
int uffd_register(int fd, void *addr, size_t len, uint64_t mode);
int uffd_wake(int fd, uintptr_t addr, size_t len);
unsigned long frame_for(unsigned long i);
int handler_start(struct handler *h, pthread_t *t);
void handler_stop(struct handler *h, pthread_t t);
void *map_aligned(size_t len, int prot, int flags, int fd, off_t off);
uint8_t *reserve(size_t len);
void on_fault_signal(int sig, siginfo_t *si, void *ctx);
int guarded_load(const volatile uint8_t *p, uint8_t *out);
int guarded_store(volatile uint8_t *p, uint8_t v);

/* probe_costs.c */
void check_fault_cost(void);
void check_minor_cost(void);
void check_map_count(void);
void check_sigsegv(void);
void check_sigbus_feature(void);
void check_remote_wp(void);
void check_pidfd(void);

#endif
