/*
 * aio.h - the narrow async-I/O interface of zerooffload (the TensorNVMe shape: this header,
 * one source file per backend, a runtime probe, bindings in their own file).
 *
 * Vocabulary
 *   request  one transfer a caller asks for: read or write `len` bytes at `addr` from/to file
 *            `fd` at byte `offset`.
 *   batch    the requests of one zo_engine_submit call; they complete together.
 *   ticket   the caller's name for a batch; zo_engine_wait returns its total bytes or its error.
 *   piece    a slice of one request of at most `block_size` bytes: the unit a backend moves.
 *   backend  how pieces move: ZO_URING (io_uring, aio_uring.c) or ZO_POOL (pthreads running
 *            pread/pwrite, aio_pool.c). Both share the batch bookkeeping in aio_engine.c.
 *
 * Every function returns 0 or a negative errno. A failed batch reports the error of its failed
 * piece that comes first (lowest request index, then lowest file offset), with the index of its
 * request and the file offset where it failed, so the caller can name file, offset and errno; the
 * order pieces happened to finish in does not change the report. A read that meets end of file
 * before its length is an error of its own, -ZO_EEOF. No function here aborts or exits the
 * process.
 */
#ifndef ZO_AIO_H
#define ZO_AIO_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

/* A read met end of file before its length: not an errno any read(2) returns for a regular file. */
#define ZO_EEOF ENODATA

enum zo_op { ZO_READ = 0, ZO_WRITE = 1 };
enum zo_kind { ZO_URING = 0, ZO_POOL = 1 };

/* offset is int64_t, not off_t: Python.h turns on _FILE_OFFSET_BITS=64 in aio_module.c only, and
 * the layout of this struct must not depend on which translation unit includes it. */
struct zo_request {
    int op;          /* enum zo_op */
    int fd;
    void *addr;
    size_t len;
    int64_t offset;  /* >= 0 */
};

struct zo_config {
    int kind;               /* enum zo_kind */
    size_t block_size;      /* bytes per piece, 1 .. ZO_MAX_BLOCK */
    unsigned queue_depth;   /* uring: pieces in flight per engine, 1 .. ZO_MAX_DEPTH */
    unsigned threads;       /* pool: worker threads, 1 .. ZO_MAX_THREADS */
};

#define ZO_MAX_BLOCK ((size_t)1 << 30)
#define ZO_MAX_DEPTH 4096u
#define ZO_MAX_THREADS 1024u

struct zo_status {
    int64_t result;         /* total bytes of the batch, or -errno of its first failed piece */
    size_t failed_index;    /* on failure: index of the failed request within the batch */
    int64_t failed_offset;  /* on failure: file offset the failed piece had reached */
};

typedef struct zo_engine zo_engine;

/* Create an engine and start its threads. */
int zo_engine_create(const struct zo_config *config, zo_engine **out);

/* Queue a batch of n requests; *ticket names it. Requests of length 0 move nothing. */
int zo_engine_submit(zo_engine *engine, const struct zo_request *requests, size_t n,
                     uint64_t *ticket);

/* Wait up to timeout_ns (< 0: forever) for a batch. 0: done, *status filled and the ticket
 * retired (threads already waiting on it still get the status); -ETIMEDOUT: still running;
 * -ENOENT: no such ticket (never issued, or already retired). */
int zo_engine_wait(zo_engine *engine, uint64_t ticket, int64_t timeout_ns,
                   struct zo_status *status);

/* 1 when the batch is done, 0 while it runs, -ENOENT for an unknown ticket. */
int zo_engine_poll(zo_engine *engine, uint64_t ticket);

/* Stop taking work: queued pieces complete with -ECANCELED, pieces in flight are waited for,
 * threads are joined. Safe while other threads wait on tickets; later submits get -ESHUTDOWN. */
void zo_engine_shutdown(zo_engine *engine);

/* Shut down and free. The caller guarantees no other thread is inside a zo_engine_* call.
 * In a child forked from the creating process, where the engine's threads do not exist,
 * shutdown and destroy do nothing (the child's copy of the engine is leaked, not joined). */
void zo_engine_destroy(zo_engine *engine);

/* 0 when io_uring can be set up here and supports IORING_OP_READ/WRITE, else -errno
 * (-ENOSYS: no io_uring; -EPERM: disabled by sysctl or seccomp; -EOPNOTSUPP: ops missing). */
int zo_uring_probe(void);

#endif
