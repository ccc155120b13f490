"""cffi (API mode) build of the small C module around liburing.

Built by ``make`` (``python -m emulator.uring_build``) and, failing that, on
first import of :mod:`emulator.uring`. Needs Debian's ``liburing-dev``.
"""

import hashlib
from pathlib import Path

import cffi

from driver.native import compile_into

HERE = Path(__file__).resolve().parent
PREFIX = "_uring_"

CDEF = """
struct chm_io {
    uint8_t  opcode;      /* CHM_IO_READ or CHM_IO_WRITE */
    int32_t  fd;
    uint32_t len;
    uint64_t offset;
    uint64_t buf;         /* address of the buffer (DRAM frame) */
    uint64_t user_data;   /* token returned in the completion */
};
struct chm_done {
    uint64_t user_data;
    int32_t  res;         /* bytes transferred, or -errno */
};
#define CHM_IO_READ 0
#define CHM_IO_WRITE 1
struct chm_ring;
int  chm_ring_open(unsigned depth, struct chm_ring **out);
void chm_ring_close(struct chm_ring *r);
int  chm_ring_queue(struct chm_ring *r, const struct chm_io *ops, unsigned n);
int  chm_ring_submit(struct chm_ring *r);
int  chm_ring_reap(struct chm_ring *r, struct chm_done *out, unsigned max, unsigned wait_nr);
int  chm_ring_fd(struct chm_ring *r);
"""

SOURCE = r"""
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <liburing.h>

struct chm_io { uint8_t opcode; int32_t fd; uint32_t len; uint64_t offset; uint64_t buf; uint64_t user_data; };
struct chm_done { uint64_t user_data; int32_t res; };
#define CHM_IO_READ 0
#define CHM_IO_WRITE 1

struct chm_ring { struct io_uring ring; };

int chm_ring_open(unsigned depth, struct chm_ring **out)
{
    struct chm_ring *r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    int ret = io_uring_queue_init(depth, &r->ring, 0);
    if (ret < 0) {
        free(r);
        return ret;
    }
    *out = r;
    return 0;
}

/* The ring's file descriptor: poll() says POLLIN while completions wait to be reaped. */
int chm_ring_fd(struct chm_ring *r)
{
    return r->ring.ring_fd;
}

void chm_ring_close(struct chm_ring *r)
{
    if (!r)
        return;
    io_uring_queue_exit(&r->ring);
    free(r);
}

/* Queue up to n operations; returns how many fit in the submission queue. */
int chm_ring_queue(struct chm_ring *r, const struct chm_io *ops, unsigned n)
{
    unsigned i;
    for (i = 0; i < n; i++) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
        if (!sqe)
            break;
        void *buf = (void *)(uintptr_t)ops[i].buf;
        if (ops[i].opcode == CHM_IO_WRITE)
            io_uring_prep_write(sqe, ops[i].fd, buf, ops[i].len, ops[i].offset);
        else
            io_uring_prep_read(sqe, ops[i].fd, buf, ops[i].len, ops[i].offset);
        io_uring_sqe_set_data64(sqe, ops[i].user_data);
    }
    return (int)i;
}

int chm_ring_submit(struct chm_ring *r)
{
    return io_uring_submit(&r->ring);
}

/* Reap up to max completions, blocking until at least wait_nr are there. */
int chm_ring_reap(struct chm_ring *r, struct chm_done *out, unsigned max, unsigned wait_nr)
{
    unsigned n = 0;
    while (n < max) {
        struct io_uring_cqe *cqe;
        int ret = n < wait_nr ? io_uring_wait_cqe(&r->ring, &cqe) : io_uring_peek_cqe(&r->ring, &cqe);
        if (ret == -EAGAIN)
            break;
        if (ret == -EINTR)
            continue;
        if (ret < 0)
            return ret;
        out[n].user_data = io_uring_cqe_get_data64(cqe);
        out[n].res = cqe->res;
        io_uring_cqe_seen(&r->ring, cqe);
        n++;
    }
    return (int)n;
}
"""

CFLAGS = ["-O2", "-Wall"]
# Named by a digest of its source: a checkout whose source changed builds anew instead of loading a stale one.
MODULE = "emulator." + PREFIX + hashlib.sha256((CDEF + SOURCE + " ".join(CFLAGS)).encode()).hexdigest()[:12]


def build() -> Path:
    """Compile the module next to this file (``compile_into``); remove the modules built from earlier sources
    (and the unnamed ``_uring`` build of before). Returns its path."""
    ffibuilder = cffi.FFI()
    ffibuilder.cdef(CDEF)
    ffibuilder.set_source(MODULE, SOURCE, libraries=["uring"], extra_compile_args=CFLAGS)
    target = compile_into(ffibuilder, HERE)
    current = MODULE.rsplit(".", 1)[1]
    for old in list(HERE.glob(f"{PREFIX}*.so")) + list(HERE.glob("_uring.*")):
        if not old.name.startswith(current):
            old.unlink(missing_ok=True)
    return target


if __name__ == "__main__":
    build()
