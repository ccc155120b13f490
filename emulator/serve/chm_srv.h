/*
 * chm_srv.h -- the device side of the rings and the C serving loop that answers
 * DRAM-hit reads without Python (used by emulator/serve/server.py via cffi). The
 * server keeps its own indices and sizes here, never reading them back from
 * memory a client can write.
 */
#ifndef CHM_SRV_H
#define CHM_SRV_H

#include "chm_wire.h"

/* ---- cdef begin ---- */
#define CHM_SRV_BATCH 32            /* commands fetched from a ring at once */

struct chm_srv_qp {
    struct chm_qp_hdr *hdr;
    struct chm_sqe *sq;
    struct chm_cqe *cq;
    uint32_t sq_entries;
    uint32_t cq_entries;
    uint32_t sq_head;               /* next command to take (server-owned) */
    uint32_t cq_tail;               /* next completion slot (server-owned) */
    uint32_t held;                  /* completions reserved but not yet posted (pacing) */
    /* The rest of what the server keeps per client (server.py's Client), where the C loop reads it. */
    uint8_t *staging;               /* the client's staging buffer (in its queue pair mapping) */
    uint64_t staging_bytes;
    struct chm_sqe *batch;          /* CHM_SRV_BATCH commands: fetched, not yet run from batch_next on */
    uint32_t batch_next;
    uint32_t batch_len;
    uint32_t has_job;               /* a large command of it is served in pieces (server.py's Job) */
    uint32_t parked;                /* its prefetch wait waits for media reads: nothing of it runs meanwhile */
    double clock;                   /* its virtual clock: when its last command finished */
    uint64_t commands;
    uint64_t errors;
    uint64_t bad_tails;             /* times its sq tail was further ahead than the ring holds (chm_srv_fetch) */
    /* chm_mmap (emulator/serve/mapping.py): its mapping, after a map request (map_len 0: none), and its
     * leases, lease_count of lease_cap slots (server memory, set up by the server with the map request). */
    uint64_t map_dev_addr;
    uint64_t map_len;
    uint32_t map_cut_off;           /* too many leases expired: its faults are Python's (-EPERM) */
    uint32_t lease_count;
    uint32_t lease_cap;
    uint32_t pad0;
    uint64_t lease_seq;             /* the sequence number of its last lease (CHM_LEASE_SEQ_SHIFT) */
    struct chm_srv_lease *leases;
};

/* A lease (chm_wire.h, MAP_FAULT): frame pinned for the client until its MAP_ACK or its detach. */
struct chm_srv_lease {
    int64_t id;
    uint64_t page;
    uint32_t frame;
    uint32_t expired;               /* not acked by deadline_ns (CLOCK_MONOTONIC): counted, still pinned */
    uint64_t deadline_ns;
};

/* The device's DRAM-hit read, chm_core.h's chm_dev_read_hit: the server hands the C loop a pointer to it
 * from the core's module (this module does not link the core). */
typedef int64_t (*chm_read_hit_fn)(void *dev, uint64_t addr, uint64_t len, double now, uint8_t *out,
                                   int count_command, double *finish);
/* chm_core.h's chm_dev_map_hit and chm_dev_map_unpin, likewise. */
typedef int64_t (*chm_map_hit_fn)(void *dev, uint64_t addr, double now, double *finish);
typedef int (*chm_map_unpin_fn)(void *dev, uint32_t frame);

/* The C serving loop (chm_srv_serve): one turn per client per pass, as server.py's _run_ready gives. */
struct chm_srv_loop {
    struct chm_srv_qp **qps;        /* the clients, in turn order */
    uint32_t n;
    uint32_t turn;                  /* the client whose turn it is */
    uint32_t in_turn;               /* that turn has begun (its job stepped or its batch fetched) */
    uint32_t ran;                   /* something ran in this pass */
    int64_t budget;                 /* bulk bytes the turn may still move */
    uint64_t chunk_bytes;           /* longer commands go in pieces, through Python */
    double floor;                   /* device virtual time: the latest finish, plus idle time */
    double quiet_until;             /* a command starting before this has no background work to do first */
    uint64_t capacity;              /* the device's bytes: chm_srv_check's bound on addr and len */
    chm_read_hit_fn read_hit;
    void *dev;
    uint64_t hits;                  /* commands served in C */
    uint32_t core_shared;           /* the last yield while waiting ran another task on this core */
    /* chm_mmap's DRAM-hit faults and their acks, served here too (NULL map_hit: never) */
    chm_map_hit_fn map_hit;
    chm_map_unpin_fn map_unpin;
    uint64_t page_size;
    uint64_t lease_ns;              /* a lease's life before it expires */
    uint64_t map_faults;            /* MAP_FAULTs served here (mapping.py adds them to its counts) */
};

#define CHM_SRV_IDLE -1             /* no client has a command, after spinning */
#define CHM_SRV_YIELD -2            /* it served for its time: the control path's turn */

/* chm_srv_check's field index: struct chm_sqe's fields in declaration order (server.py names them from the
 * struct itself; tests/emulator/serve/test_ring_fields.py checks that the two agree). */
#define CHM_SQE_OPCODE 0
#define CHM_SQE_FLAGS 1
#define CHM_SQE_RSVD0 2
#define CHM_SQE_RSVD1 3
#define CHM_SQE_USER_DATA 4
#define CHM_SQE_ADDR 5
#define CHM_SQE_LEN 6
#define CHM_SQE_BUF_OFFSET 7
#define CHM_SQE_HANDLE 8
#define CHM_SQE_TIMEOUT_NS 9
#define CHM_SQE_RSVD2 10

/* Check every field of a command against chm_wire.h (struct chm_sqe), in the wire's own widths (no sum can
 * wrap): 0 if it may run, else -EINVAL (opcode, flags, a reserved field, len 0, handle < 1), -ERANGE (addr,
 * or addr + len, beyond capacity) or -EFAULT (len or buf_offset: the range is outside staging_bytes), with
 * *field set to the offending field's CHM_SQE_* index. MAP_FAULT and MAP_ACK: flags as chm_wire.h says,
 * addr < capacity, FAULT len >= 1 and handle 0, ACK len 0 and handle >= 1, buf_offset and timeout_ns 0. The one check of both serving paths (the C loop and
 * server.py). What needs the device's state (whose handle, window room) is server.py's. */
int chm_srv_check(const struct chm_sqe *e, uint64_t capacity, uint64_t staging_bytes, uint32_t *field);

/* Lay out a fresh queue pair in the mapping at base; returns its total size. */
uint64_t chm_srv_qp_layout(uint32_t sq_entries, uint32_t cq_entries, uint64_t staging_bytes,
                           uint64_t *sq_off, uint64_t *cq_off, uint64_t *stats_off, uint64_t *staging_off);
void chm_srv_qp_init(struct chm_srv_qp *s, void *base, uint32_t client_id, uint32_t sq_entries,
                     uint32_t cq_entries, uint64_t staging_bytes);

/* Copy up to max pending commands out of the ring (as many as the completion
 * ring has room for). Returns the count, or -EPROTO when the client's tail is
 * further ahead than the ring holds: the server then skips to it, counts it (bad_tails) and posts one
 * -EPROTO completion (user_data 0) if the completion ring has room. */
int chm_srv_fetch(struct chm_srv_qp *s, struct chm_sqe *out, unsigned max);

/* Post one completion and wake the client if it sleeps. */
void chm_srv_post(struct chm_srv_qp *s, uint64_t user_data, int64_t res, uint64_t latency_ns, uint64_t clock_ns);

/* Index of a queue pair with a command and completion room (and not parked), spinning up to
 * spin_ns for one to appear; -1 if none. */
int chm_srv_pending(struct chm_srv_qp **qps, unsigned n, uint64_t spin_ns);

/* Serve DRAM-hit reads in C, turn by turn, until a client's turn needs Python: returns that client's
 * index, with its job's next piece to serve (has_job; Python then ends the turn: in_turn = 0, turn + 1) or
 * its command batch[batch_next] to run (Python takes it, charging a bulk command's len to budget). Else
 * CHM_SRV_IDLE once a pass ran nothing and nothing came within spin_ns, or CHM_SRV_YIELD after max_ns.
 * A command is served here only if it is a read that passes chm_srv_check, at most chunk_bytes, starting
 * before quiet_until, that read_hit serves whole; everything else, bad entries included, is Python's. A parked client's turns are skipped. */
int chm_srv_serve(struct chm_srv_loop *l, uint64_t spin_ns, uint64_t max_ns);

/* chm_mmap's lease table of a client (struct chm_srv_qp): add one (its id, or -EBUSY when lease_cap are held);
 * take one back (0, with *frame and *expired; -ENOENT: no lease id of this client for page). */
int64_t chm_srv_lease_add(struct chm_srv_qp *q, uint32_t frame, uint64_t page, uint64_t deadline_ns);
int chm_srv_lease_take(struct chm_srv_qp *q, int64_t id, uint64_t page, uint32_t *frame, uint32_t *expired);

/* chm_mmap's two actions on other processes' mappings (emulator/serve/mapping.py), 0 or -errno:
 * punch: free [offset, offset+len) of the DRAM memfd, which unmaps those pages from every process at once
 * (fallocate PUNCH_HOLE); writeprotect: UFFDIO_WRITEPROTECT [start, start+len) through a client's
 * userfaultfd, so its next write to those pages faults again (the device snapshots them meanwhile). */
int chm_srv_punch(int fd, uint64_t offset, uint64_t len);
int chm_srv_writeprotect(int uffd, uint64_t start, uint64_t len);
/* 1 if fd is a userfaultfd (its /proc/self/fdinfo says so), else 0. */
int chm_srv_is_userfaultfd(int fd);

/* Set the node's sleep flag with a full fence (see chm_wire.h, wake-ups). */
void chm_srv_set_sleeping(struct chm_node *node, uint32_t sleeping);
/* ---- cdef end ---- */

#endif /* CHM_SRV_H */
