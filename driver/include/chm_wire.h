/*
 * chm_wire.h -- the one definition of the CXL-HM driver wire.
 *
 * Spoken by libchm (C, includes this file) and by the device process
 * (emulator/serve/server.py, which reaches these very structs through the cffi module
 * built by driver/wire_build.py from the text between the "cdef" markers).
 * Nothing else restates this layout.
 *
 * Pieces:
 *   device node   /dev/shm/<name> (0600): struct chm_node, written by the
 *                 server only; clients map it read-only for info and the
 *                 server's sleep flag.
 *   control path  Unix socket <node path>.sock: a client sends
 *                 struct chm_attach_req, the server answers
 *                 struct chm_attach_resp plus two fds (SCM_RIGHTS): the queue
 *                 pair memfd (sealed against resizing) and the client's
 *                 own doorbell eventfd. The connection stays open: its EOF is the
 *                 client's detach (or death), after which the server
 *                 reclaims the queue pair and the client's prefetch handles.
 *   queue pair    one memfd per client: struct chm_qp_hdr, then the
 *                 submission ring (struct chm_sqe), the completion ring
 *                 (struct chm_cqe), a stats slot (struct chm_wire_stats)
 *                 and the staging buffer. The device copies between its
 *                 DRAM and the staging buffer: one memcpy, no socket.
 *
 * Rings are single-producer single-consumer with free-running 32-bit
 * indices (entry = index & (entries - 1)). SQ: client produces (tail), server
 * consumes (head). CQ: server produces (tail), client consumes (head). The
 * server keeps its own copies of every index it owns and of every size; it
 * never trusts a value read back from the queue pair except the producer's
 * tail (bounded by the ring size) and the consumer's head (bounded likewise).
 *
 * Wake-ups: the server sets chm_node.server_sleeping before it sleeps in
 * poll(); a client that sees it after publishing a tail writes the eventfd.
 * A client about to sleep sets cq.waiting and futex-waits on cq.tail; the
 * server futex-wakes cq.tail after publishing when it sees the flag.
 *
 * Status: every completion's res is >= 0 (bytes, or a prefetch handle) or a
 * negative Linux errno (-EINVAL bad field, -ERANGE address outside the
 * device, -EFAULT staging range outside the client's buffer, -EAGAIN write
 * buffer full, -ETIMEDOUT, -EBUSY prefetch window full, -ENOSPC result does
 * not fit, -EPROTO ring indices corrupted, -EIO device-internal failure).
 */
#ifndef CHM_WIRE_H
#define CHM_WIRE_H

#include <stdint.h>

#include "chm_stats.h"

/* ---- cdef begin ---- */
#define CHM_WIRE_MAGIC 0x43484d31
#define CHM_WIRE_VERSION 5
#define CHM_QP_MAGIC 0x43485150
#define CHM_NAME_MAX 32
#define CHM_PROFILE_MAX 192

/* Command opcodes; 0 is never valid, so zeroed memory is rejected. */
#define CHM_OP_NOP 1
#define CHM_OP_READ 2
#define CHM_OP_WRITE 3
#define CHM_OP_FLUSH 4
#define CHM_OP_PREFETCH 5
#define CHM_OP_WAIT 6
#define CHM_OP_RELEASE 7
#define CHM_OP_STATS 8
#define CHM_OP_STATS_JSON 9
#define CHM_OP_MAP_FAULT 10             /* make page addr resident and lease its frame (chm_mmap, below) */
#define CHM_OP_MAP_ACK 11               /* lease handle installed (or given up): its frame may be reused */
#define CHM_OP_MAX 11

/* WAIT flags. LOOK: with the object's media reads still in flight, answer -EAGAIN at once instead of
 * waiting for them (the modelled-time bound still applies as timeout_ns says). */
#define CHM_WAIT_LOOK 1

/* MAP_FAULT flags. WRITE: the page is to be written (admitted as a one-page write, marked dirty). */
#define CHM_FAULT_WRITE 1
/* MAP_ACK flags. FAILED: the lease was not installed. */
#define CHM_ACK_FAILED 1
/* A MAP_FAULT's result, a lease: (sequence << CHM_LEASE_SEQ_SHIFT) | frame, sequence >= 1, so leases are
 * > 0 and never repeat for a client; the frame is pinned until its MAP_ACK (or the client's detach). */
#define CHM_LEASE_SEQ_SHIFT 32
#define CHM_LEASE_FRAME_MASK 0xffffffffu

/* Server limits a client's attach request is checked against. */
#define CHM_MIN_ENTRIES 2
#define CHM_MAX_ENTRIES 4096
#define CHM_MAX_STAGING_BYTES 1073741824
#define CHM_STAGING_ALIGN 2097152
#define CHM_PPM 1000000

/* The device node: written by the server, read by everyone. */
struct chm_node {
    uint32_t magic;                 /* CHM_WIRE_MAGIC, stored last when the node is ready */
    uint32_t version;               /* CHM_WIRE_VERSION */
    uint32_t server_pid;
    uint32_t clients;               /* queue pairs attached now */
    uint64_t capacity_bytes;
    uint64_t dram_bytes;
    uint64_t page_size;
    uint64_t write_buffer_bytes;
    uint64_t prefetch_window_bytes;
    uint32_t ssd_count;
    uint32_t prefetch_max_handles;
    uint32_t data;                  /* 1: bytes move; 0: state and time only */
    uint32_t pacing;                /* 1: completions wait for wall time to catch up */
    uint64_t clients_total;         /* queue pairs ever attached */
    char policy[32];
    char profile[192];
    uint64_t device_epoch;          /* random id, new whenever the media are formatted (chm.meta) */
    uint32_t pad0[18];
    uint32_t server_sleeping;       /* on its own cache line: clients poll it on every submit */
    uint32_t pad1[15];
};

/* One ring's shared indices: producer and consumer on separate cache lines. */
struct chm_ring_ctl {
    uint32_t head;                  /* consumer: next entry it will take */
    uint32_t pad0[15];
    uint32_t tail;                  /* producer: next entry it will fill */
    uint32_t waiting;               /* consumer sleeps (futex on tail) */
    uint32_t pad1[14];
};

/* Start of a queue pair memfd. Offsets are from the start of the mapping. */
struct chm_qp_hdr {
    uint32_t magic;                 /* CHM_QP_MAGIC */
    uint32_t version;
    uint32_t client_id;
    uint32_t sq_entries;            /* power of two */
    uint32_t cq_entries;            /* power of two */
    uint32_t pad0;
    uint64_t sq_offset;
    uint64_t cq_offset;
    uint64_t stats_offset;
    uint64_t staging_offset;        /* CHM_STAGING_ALIGN-aligned */
    uint64_t staging_bytes;
    uint64_t total_bytes;
    uint32_t pad1[14];
    struct chm_ring_ctl sq;
    struct chm_ring_ctl cq;
};

/* A command. Every field is checked by the device; reserved ones must be 0. */
struct chm_sqe {
    uint8_t  opcode;                /* CHM_OP_* */
    uint8_t  flags;                 /* WAIT: 0 or CHM_WAIT_LOOK; others: must be 0 */
    uint16_t rsvd0;                 /* must be 0 */
    uint32_t rsvd1;                 /* must be 0 */
    uint64_t user_data;             /* echoed in the completion */
    uint64_t addr;                  /* READ/WRITE/PREFETCH: device byte address */
    uint64_t len;                   /* READ/WRITE/PREFETCH/STATS_JSON: bytes */
    uint64_t buf_offset;            /* READ/WRITE/STATS_JSON: offset in the staging buffer */
    int64_t  handle;                /* WAIT/RELEASE: a prefetch handle of this client */
    int64_t  timeout_ns;            /* WAIT: modelled-time bound; < 0 waits as long as it takes */
    uint64_t rsvd2;                 /* must be 0 */
};

/* A completion, in submission order. */
struct chm_cqe {
    uint64_t user_data;
    int64_t  res;                   /* >= 0: bytes or handle; < 0: -errno */
    uint64_t latency_ns;            /* modelled device time of this command */
    uint64_t clock_ns;              /* the client's virtual clock after it */
};

/* Counters and gauges for CHM_OP_STATS: the fields of chm_stats.h, in its order. */
struct chm_wire_stats {
    CHM_STATS_FIELDS(CHM_STATS_U64)
};

/* Control path messages (fixed size, little-endian host order). */
struct chm_attach_req {
    uint32_t magic;                 /* CHM_WIRE_MAGIC */
    uint32_t version;               /* CHM_WIRE_VERSION */
    uint32_t sq_entries;            /* power of two in [CHM_MIN_ENTRIES, CHM_MAX_ENTRIES] */
    uint32_t cq_entries;            /* likewise, >= sq_entries */
    uint64_t staging_bytes;         /* (0, CHM_MAX_STAGING_BYTES], rounded up to CHM_STAGING_ALIGN */
    uint32_t prefetch_share_ppm;    /* this client's share of the prefetch window, in millionths
                                       (1..CHM_PPM); 0 takes the device's policy.prefetch_client_share */
    uint32_t rsvd0;                 /* must be 0 */
};

struct chm_attach_resp {
    int32_t  status;                /* 0, or -errno (then no fds follow) */
    uint32_t client_id;
    uint64_t qp_bytes;              /* size of the queue pair memfd */
};
/* The map request (chm_mmap): sent on a queue pair's control connection after its attach, with the
 * client's userfaultfd (SCM_RIGHTS, exactly one fd). From then on that queue pair may send MAP_FAULT and
 * MAP_ACK for pages of [dev_addr, dev_addr + len). The device keeps the userfaultfd only to write-protect
 * the client's writable pages of a frame before it snapshots the frame (flush, write-back of a victim). */
#define CHM_CTL_MAP 1
struct chm_map_req {
    uint32_t magic;                 /* CHM_WIRE_MAGIC */
    uint32_t op;                    /* CHM_CTL_MAP */
    uint64_t dev_addr;              /* first device byte mapped: multiple of page_size, < capacity */
    uint64_t len;                   /* bytes: multiple of page_size, in (0, capacity - dev_addr] */
    uint64_t base;                  /* the client's address of dev_addr: multiple of page_size, != 0, and
                                       base + len <= CHM_MAP_USER_END */
    uint64_t rsvd0;                 /* must be 0 */
};
#define CHM_MAP_USER_END 0x800000000000ull   /* end of x86-64's user half: 2^47 */

struct chm_map_resp {
    int32_t  status;                /* 0, or -errno (then no fd follows) */
    uint32_t frames;                /* device DRAM frames */
    uint64_t page_size;
};                                  /* + SCM_RIGHTS: the device DRAM memfd (frame f at f * page_size) */
/* ---- cdef end ---- */

#endif /* CHM_WIRE_H */
