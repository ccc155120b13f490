/*
 * chm.h -- libchm, the host library of the CXL-HM device.
 *
 * A program opens a device node (served by `chm serve`), then reads, writes,
 * prefetches and flushes byte ranges of the device's memory space. Each open
 * device gets its own queue pair and its own staging buffer in shared memory;
 * the device copies between its DRAM and that buffer.
 *
 * Conventions (liburing's): functions return 0 (or a byte count / handle)
 * on success and a negative errno on failure; errno itself is not used.
 * Common errors:
 *   -ENODEV     no device serves that node (or it went away)
 *   -EINVAL     bad argument (zero length, unknown or released handle, ...)
 *   -ERANGE     address range outside the device
 *   -EAGAIN     write refused: the write buffer is full, retry later
 *   -ETIMEDOUT  a prefetch was not staged within the timeout
 *   -EBUSY      prefetch window full; or a synchronous call while
 *               asynchronous commands are in flight
 *   -EFAULT     a staging range outside the device's buffer
 *   -ENOSPC     the media are full: a flush could not write dirty pages, so
 *               writes are refused until space returns (also: a result
 *               larger than the caller's buffer, chm_stats_json)
 *   -EIO        a media read or write failed, or the device failed internally
 *   -EBADF      the handle was closed (chm_close) already; best effort, see chm_close
 *
 * Threads: a chm_dev is NOT thread-safe. Like an SPDK queue pair it belongs
 * to one thread at a time and takes no locks; open one chm_dev per thread
 * (each gets its own queue pair). The library starts no threads but one per
 * chm_mmap mapping (below).
 *
 * Time: every command's completion carries the modelled device latency;
 * chm_last_latency_ns() returns it for the last synchronous call.
 */
#ifndef CHM_H
#define CHM_H

#include <errno.h>   /* return values are -errno: callers compare with -EAGAIN etc. */
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "chm_stats.h"   /* the device's statistics fields, one list */

#ifdef __cplusplus
extern "C" {
#endif

#define CHM_API_VERSION 1

/* ---- cdef begin ---- (the Python binding reads its declarations from here) */

typedef struct chm_dev chm_dev;   /* one opened device */
typedef uint64_t chm_addr;        /* byte address in the device's memory space */
typedef int64_t  chm_req;         /* prefetch handle; negative = -errno */

struct chm_info {
    uint64_t capacity_bytes;      /* the device's byte address space */
    uint64_t dram_bytes;          /* device DRAM */
    uint64_t page_size;           /* DRAM frame: unit of staging and flushing */
    uint32_t ssd_count;           /* backend SSDs */
    uint32_t prefetch_max_handles;
    uint64_t write_buffer_bytes;  /* hymcache write buffer (0 under lru) */
    uint64_t prefetch_window_bytes;
    uint64_t staging_bytes;       /* this handle's registered buffer (chm_buffer) */
    uint32_t clients;             /* queue pairs attached to the device now */
    uint32_t server_pid;
    char     policy[32];          /* "lru", "hymcache", ... */
    char     profile[192];        /* where the device's configuration came from */
    uint64_t device_epoch;        /* random id, new whenever the media are formatted: a KV index
                                     that recorded another epoch holds stale blocks */
};

struct chm_stats {                /* the fields of chm_stats.h, each a uint64_t */
    CHM_STATS_FIELDS(CHM_STATS_U64)
};

/* Options for chm_open_opts; set .size = sizeof(struct chm_open_opts) so the
 * struct can grow. Zero fields take the defaults. */
struct chm_open_opts {
    size_t   size;
    size_t   staging_bytes;       /* default 16 MiB, or $CHM_STAGING_BYTES; at most 1 GiB */
    uint32_t queue_entries;       /* power of two, default 64, at most 4096 */
    uint32_t spin_us;             /* spin this long for a completion before sleeping; default 50, or $CHM_SPIN_US */
    double   prefetch_share;      /* this handle's share of the device's prefetch window, in (0, 1];
                                     0 takes the device default (policy.prefetch_client_share) */
};

/* A completion of an asynchronous command (chm_submit_*, chm_reap). */
struct chm_completion {
    uint64_t user_data;
    int64_t  res;                 /* bytes moved, or -errno */
    uint64_t latency_ns;          /* modelled device latency */
};

/* Open the device node at path ("chm0" means /dev/shm/chm0; a path with a
 * '/' is used as is; NULL: $CHM_DEVICE, else "chm0"). Returns 0, -ENODEV if
 * no live device is there, -EPROTO on a wire version mismatch, -EINVAL for a
 * bad name or option (one outside the range its field names, e.g. a
 * prefetch_share not 0 nor in (0, 1]), -ENOMEM, -EMFILE (this process is at
 * its fd limit: attaching needs 3 free fds, an open device keeps 2) or
 * -ENFILE (the system's), or another -errno of the attach. An older caller's
 * smaller opts (its .size) takes the defaults for the fields it lacks. */
int     chm_open(const char *path, chm_dev **dev);
int     chm_open_opts(const char *path, const struct chm_open_opts *opts, chm_dev **dev);
/* Detach: the device releases this handle's prefetch handles, and the
 * queue pair and staging buffer (chm_buffer) are unmapped (unless an FFI
 * reference holds them, see chm_mapping_get). NULL is fine.
 * Closing a closed handle is undefined, like free(): the library detects it
 * where cheap (a double chm_close does nothing, any other call on a closed
 * handle returns -EBADF, chm_buffer NULL, chm_last_latency_ns 0), but only
 * best effort -- once the freed memory is reused the handle may look open. */
void    chm_close(chm_dev *dev);
/* Fill *info (no device round trip; clients is read live). 0, -EINVAL, -EBADF. */
int     chm_get_info(chm_dev *dev, struct chm_info *info);

/* Read len bytes at addr into buf. Returns len, or -ERANGE (outside the
 * device), -EINVAL (len 0, NULL), -ENODEV (device gone), -EIO (a media read
 * failed), -EBUSY (asynchronous commands in flight), -EBADF. If buf lies inside
 * chm_buffer() the device copies straight into it (zero-copy); otherwise the
 * bytes pass through the staging buffer (larger reads are pipelined). */
ssize_t chm_read(chm_dev *dev, chm_addr addr, void *buf, size_t len);
/* Write len bytes from buf at addr. Returns len; -EAGAIN if the write buffer
 * refused it (nothing written); -ENOSPC while the media are full after a
 * flush failed (nothing written; refused until space returns); -EIO on a
 * media failure; -ERANGE, -EINVAL, -ENODEV, -EBUSY, -EBADF. A write larger
 * than the staging buffer is split into one command per buffer load: if a
 * later part is refused the parts before it stay written and the return is
 * their byte count (a short write, as write(2)); write the rest again to
 * learn why. Zero-copy from chm_buffer() as for chm_read. */
ssize_t chm_write(chm_dev *dev, chm_addr addr, const void *buf, size_t len);
/* Drain the write buffer to the media. 0; -ENOSPC or -EIO when pages could
 * not be written (they stay dirty and are retried); -ENODEV, -EBUSY, -EBADF. */
int     chm_flush(chm_dev *dev);

/* Stage [addr, addr+size) in device DRAM. Returns a handle (> 0), -EBUSY
 * (the device's prefetch window or its handles are all held, or this handle's
 * prefetch_share of them is; "last_error" in chm_stats_json says which),
 * -ERANGE, -EINVAL (size 0, or larger than the window or this handle's
 * share of it), -ENODEV, -EBADF. */
chm_req chm_prefetch_object(chm_dev *dev, chm_addr addr, size_t size);
/* Until the object is staged. timeout_ms < 0 waits as long as it takes (in
 * modelled time). 0, -ETIMEDOUT, -EIO (a media read of the object failed),
 * -EINVAL (unknown, released or another handle's request), -ENODEV, -EBADF. */
int     chm_prefetch_wait(chm_dev *dev, chm_req req, int timeout_ms);
/* Is the object staged, media reads landed? Never waits for them: 0 (yes; as chm_prefetch_wait
 * without a bound would answer), -EAGAIN (not yet: ask again), or chm_prefetch_wait's errors. */
int     chm_prefetch_poll(chm_dev *dev, chm_req req);
/* Let the device reuse the object's frames. 0, -EINVAL (unknown or
 * released), -ENODEV, -EBADF. */
int     chm_prefetch_release(chm_dev *dev, chm_req req);
/* Device counters and this handle's clock. 0, -EINVAL, -ENODEV, -EBADF. */
int     chm_get_stats(chm_dev *dev, struct chm_stats *stats);
/* Text of a (negative or positive) errno value returned by libchm (never NULL). */
const char *chm_strerror(int err);

/* ---- beyond the core -------------------------------------------------------- */

/* The registered staging buffer shared with the device; *len gets its size.
 * Reads and writes from/to inside it move no extra copy. NULL if dev is NULL
 * or closed. It is unmapped by chm_close (see FFI support below). */
void   *chm_buffer(chm_dev *dev, size_t *len);
/* Modelled device latency of the last synchronous command, in ns (0 if dev
 * is NULL or closed). */
uint64_t chm_last_latency_ns(chm_dev *dev);
/* Stats as JSON text (every counter the device keeps) into buf; returns its
 * length, -ENOSPC if len is too small, -EINVAL, -ENODEV, -EBUSY, -EBADF. */
ssize_t chm_stats_json(chm_dev *dev, char *buf, size_t len);

/* Asynchronous commands: buf must lie inside chm_buffer(). Up to the queue
 * depth may be in flight; completions come back in submission order via
 * chm_reap. Returns 0, -EFAULT (buf outside the buffer), -EBUSY (queue
 * full), -EINVAL, -ERANGE, -ENODEV, -EBADF. While any is in flight the
 * synchronous calls return -EBUSY. A completion's res may be -EAGAIN,
 * -ENOSPC or -EIO as for chm_write, or -EIO as for chm_read. */
int     chm_submit_read(chm_dev *dev, chm_addr addr, void *buf, size_t len, uint64_t user_data);
int     chm_submit_write(chm_dev *dev, chm_addr addr, const void *buf, size_t len, uint64_t user_data);
/* Take up to max completions, waiting until at least min_wait are there.
 * Returns the count, -EINVAL (min_wait > max or more than in flight), -ENODEV, -EBADF. */
int     chm_reap(chm_dev *dev, struct chm_completion *out, unsigned max, unsigned min_wait);

/* ---- the device as memory (docs/mmap.md) ------------------------------------
 * chm_mmap maps the device's capacity (chm_mmap_range: [addr, addr+len), both
 * multiples of page_size) into this process: *ptr gets its first byte, and
 * plain loads and stores then reach the device. Nothing is backed at first. A
 * page's first touch faults; a handler thread that libchm starts for the
 * mapping (its only thread) asks the device for the page, exactly as a
 * chm_read of it would (DRAM hit, or staged from the SSDs under the device's
 * policy, timing and statistics), and maps the device's DRAM frame itself over
 * it: no copy. A first write is admitted by the device as a one-page chm_write
 * (dirty, flushed by its flusher) before the store completes; a write the
 * device refuses (its write buffer, or media, full: chm_write's -EAGAIN or
 * -ENOSPC) holds the storing thread while it is asked again, for at most
 * $CHM_MAP_WRITE_TIMEOUT_MS (default 10000).
 * When the device reuses a frame, its mapping in every process is withdrawn
 * first, and the next access faults again: never a stale or another page.
 * Statistics count each page's first touch per residency (and first writes);
 * CHM_MAP_STRICT keeps one page mapped at a time, so every visit to another
 * page reaches the device and a scan counts as a chm_read scan of the pages.
 * An access that cannot be served gets SIGBUS (si_code BUS_ADRERR, si_addr the
 * address): the device died or stopped answering for $CHM_MAP_FAULT_TIMEOUT_MS
 * (default 10000; the whole mapping, within ~5 ms of a kill -9), this process
 * was cut off for leaving leases unacknowledged (-EPERM, the whole mapping),
 * a media error (-EIO) or a write refused past the timeout (-EAGAIN,
 * -ENOSPC), that page only; chm_map_error says which. Syscalls reading the mapping work
 * (the handler thread serves kernel faults too). The mapping is not inherited
 * by fork(); a child touching it gets SIGSEGV.
 * CHM_MAP_INLINE serves each fault in the thread that took it (libchm's SIGBUS
 * handler, installed at the first such mapping, chaining to the program's for
 * every other SIGBUS), which saves the hand-off to and from the handler thread
 * (about half a random first touch's cost). Then a syscall given a page that
 * is not mapped yet fails with -EFAULT instead of being served (touch or
 * chm_map_populate it first), a thread touching the mapping must not block
 * SIGBUS, and a handler the program installs later must chain to libchm's.
 * Returns 0, -EOPNOTSUPP (the kernel lacks a userfaultfd feature this needs:
 * chm_mmap_unsupported says which; or the device moves no bytes), -EINVAL (flags, alignment, len 0), -ERANGE,
 * -ENOMEM, -EMFILE (64 CHM_MAP_INLINE mappings held already), -ENODEV, -EBADF. chm_close unmaps the handle's
 * mappings. */
#define CHM_MAP_STRICT 1
#define CHM_MAP_INLINE 2
int     chm_mmap(chm_dev *dev, void **ptr, unsigned flags);
int     chm_mmap_range(chm_dev *dev, chm_addr addr, size_t len, void **ptr, unsigned flags);
/* Unmap a mapping (ptr as chm_mmap gave it). 0, -EINVAL (not a mapping of dev), -EBADF. */
int     chm_munmap(chm_dev *dev, void *ptr);
/* Withdraw a mapping without unmapping its addresses: every later access gets
 * SIGBUS BUS_ADRERR (for bindings whose views may outlive it); they stay
 * reserved for the life of the process. 0, -EINVAL, -EBADF. */
int     chm_map_revoke(chm_dev *dev, void *ptr);
/* Why an access at ptr gets SIGBUS (a -errno), or 0; -EFAULT if ptr is in no mapping of dev. */
int     chm_map_error(chm_dev *dev, const void *ptr);
/* Fault [ptr, ptr+size) in now (read, by the kernel: a page that cannot be served is its return value, not
 * SIGBUS). 0, chm_map_error's -errno, -EFAULT, -ERANGE, -EINVAL. */
int     chm_map_populate(chm_dev *dev, const void *ptr, size_t size);
/* chm_prefetch_object of the device bytes that [ptr, ptr+size) of a mapping
 * shows; wait and release on the handle as for it. -EFAULT: ptr is in no
 * mapping of dev; -ERANGE: the range leaves it; else chm_prefetch_object's. */
chm_req chm_prefetch_ptr(chm_dev *dev, const void *ptr, size_t size);
/* NULL if chm_mmap can work on this kernel, else what it lacks (for messages and test skips). */
const char *chm_mmap_unsupported(void);

/* ---- FFI support ------------------------------------------------------------
 * For language bindings (cffi, ctypes) whose views of chm_buffer() can outlive
 * the handle, e.g. a Python memoryview kept after close(). C programs need
 * none of this. */

typedef struct chm_mapping chm_mapping;   /* the mapping that holds chm_buffer() */
/* A counted reference to dev's staging buffer mapping: it stays mapped until
 * chm_close has run and every reference is put, so a view of it never faults.
 * After chm_close the device no longer reads or writes it: bytes stored there
 * reach nothing. NULL if dev is NULL or closed. */
chm_mapping *chm_mapping_get(chm_dev *dev);
/* Drop a reference from chm_mapping_get; the last one unmaps. NULL is fine.
 * Unlike the rest of the API it may be called from any thread (a binding's
 * garbage collector): the count is atomic. */
void    chm_mapping_put(chm_mapping *map);
/* ---- cdef end ---- */

#ifdef __cplusplus
}
#endif

#endif /* CHM_H */
