/* libchm's private header: the handle and the ring helpers its three sources share.
 *
 *   chm_open.c - opening and closing a handle (attach handshake, queue pair mapping);
 *   chm_ring.c - the submission and completion rings, one synchronous command;
 *   chm.c      - the API of chm.h on top of them;
 *   chm_mmap.c - the device as memory (chm_mmap), each mapping served by a handler thread of its own.
 *
 * Nothing here is exported: libchm.map makes every symbol but chm_* local, so the shared
 * helpers are named without the chm_ prefix. */
#ifndef CHM_PRIV_H
#define CHM_PRIV_H

#include <stddef.h>
#include <stdint.h>

#include "chm.h"
#include "chm_sync.h"
#include "chm_wire.h"

/* chm_dev.magic while the handle is open, and after chm_close poisoned it. */
#define DEV_OPEN_MAGIC 0x43484d2d4f50454eull   /* "CHM-OPEN" */
#define DEV_CLOSED_MAGIC 0x43484d2d53485554ull /* "CHM-SHUT": any value but the open one */

/* The queue pair mapping (rings, stats slot, staging buffer), counted: the
 * handle holds one reference, each chm_mapping_get another (FFI support). */
struct chm_mapping {
    void *base;
    size_t len;
    unsigned refs;
};

struct chm_dev {
    int sock;                      /* control connection: its EOF detaches us */
    int evfd;                      /* the server's doorbell */
    struct chm_node *node;         /* read-only */
    struct chm_mapping *qp;        /* the queue pair; NULL until mapped */
    struct chm_qp_hdr *hdr;
    struct chm_sqe *sq;
    struct chm_cqe *cq;
    struct chm_wire_stats *stats;
    char *staging;
    size_t staging_bytes;
    uint32_t sq_entries, cq_entries;
    uint32_t sq_tail, cq_head;     /* the indices we own */
    uint32_t inflight;             /* submitted, not reaped */
    uint32_t async_inflight;
    uint64_t spin_ns;
    uint64_t seq;
    uint64_t last_latency_ns;
    int dead;
    struct chm_map *maps;          /* this handle's chm_mmap mappings (chm_mmap.c) */
    char node_path[4096];          /* the node it opened: a mapping opens its own queue pair there */
    /* Last, far from the first 16 bytes, which free() overwrites with its list links:
     * so a closed handle still reads DEV_CLOSED_MAGIC until the memory is reused. */
    uint64_t magic;
};

/* An open handle, as far as can be told cheaply (best effort: a closed handle's
 * memory may be reused by another allocation, even another chm_dev). */
static inline int dev_is_open(const chm_dev *d)
{
    return d->magic == DEV_OPEN_MAGIC;
}

/* Every entry point but chm_close starts with this: NULL is -EINVAL, closed -EBADF. */
#define CHECK_DEV(d)                     \
    do {                                 \
        if (!(d))                        \
            return -EINVAL;              \
        if (!dev_is_open(d))             \
            return -EBADF;               \
    } while (0)

/* chm_ring.c */
int sq_push(chm_dev *d, const struct chm_sqe *e);
void doorbell(chm_dev *d);
int cq_take(chm_dev *d, struct chm_cqe *out, int wait);
int64_t run_cmd(chm_dev *d, struct chm_sqe *e);
int in_staging(const chm_dev *d, const void *buf, size_t len, uint64_t *offset);
int check_range(const chm_dev *d, chm_addr addr, size_t len);

/* chm_open.c: $name as a number, or fallback when unset, empty or not a number */
uint64_t env_u64(const char *name, uint64_t fallback);

/* chm_mmap.c */
void maps_close(chm_dev *d);   /* chm_close: unmap every mapping of the handle */

#endif
