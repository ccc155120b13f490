/*
 * chm_srv.h -- the device side of the rings (used by emulator/serve/server.py via
 * cffi). The server keeps its own indices and sizes here, never reading them
 * back from memory a client can write.
 */
#ifndef CHM_SRV_H
#define CHM_SRV_H

#include "chm_wire.h"

/* ---- cdef begin ---- */
struct chm_srv_qp {
    struct chm_qp_hdr *hdr;
    struct chm_sqe *sq;
    struct chm_cqe *cq;
    uint32_t sq_entries;
    uint32_t cq_entries;
    uint32_t sq_head;               /* next command to take (server-owned) */
    uint32_t cq_tail;               /* next completion slot (server-owned) */
    uint32_t held;                  /* completions reserved but not yet posted (pacing) */
};

/* Lay out a fresh queue pair in the mapping at base; returns its total size. */
uint64_t chm_srv_qp_layout(uint32_t sq_entries, uint32_t cq_entries, uint64_t staging_bytes,
                           uint64_t *sq_off, uint64_t *cq_off, uint64_t *stats_off, uint64_t *staging_off);
void chm_srv_qp_init(struct chm_srv_qp *s, void *base, uint32_t client_id, uint32_t sq_entries,
                     uint32_t cq_entries, uint64_t staging_bytes);

/* Copy up to max pending commands out of the ring (as many as the completion
 * ring has room for). Returns the count, or -EPROTO when the client's tail is
 * further ahead than the ring holds: the server then skips to it and posts one
 * -EPROTO completion (user_data 0) if the completion ring has room. */
int chm_srv_fetch(struct chm_srv_qp *s, struct chm_sqe *out, unsigned max);

/* Post one completion and wake the client if it sleeps. */
void chm_srv_post(struct chm_srv_qp *s, uint64_t user_data, int64_t res, uint64_t latency_ns, uint64_t clock_ns);

/* Index of a queue pair with a command and completion room, spinning up to
 * spin_ns for one to appear; -1 if none. */
int chm_srv_pending(struct chm_srv_qp **qps, unsigned n, uint64_t spin_ns);

/* Set the node's sleep flag with a full fence (see chm_wire.h, wake-ups). */
void chm_srv_set_sleeping(struct chm_node *node, uint32_t sleeping);
/* ---- cdef end ---- */

#endif /* CHM_SRV_H */
