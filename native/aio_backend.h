/*
 * aio_backend.h - the contract between the engine core (aio_engine.c) and its backends
 * (aio_uring.c, aio_pool.c). Not part of the public interface in aio.h.
 *
 * Vocabulary (see aio.h for request, batch, ticket)
 *   piece     struct zo_piece: one block_size slice of a request, with how far it got (`done`).
 *   progress  the rule every backend applies to each read/write result (zo_piece_progress):
 *             retry -EAGAIN/-EINTR, continue short transfers, a read at end of file fails
 *             with -ZO_EEOF, any other negative result fails the piece.
 *   finish    handing a piece back to the core (zo_piece_finish), exactly once per piece.
 *
 * Lock order: the core's engine lock is taken before a backend's lock (enqueue runs under the
 * engine lock); a backend must therefore never call zo_piece_finish while holding its own lock.
 */
#ifndef ZO_AIO_BACKEND_H
#define ZO_AIO_BACKEND_H

#include <pthread.h>

#include "aio.h"

struct zo_batch;

struct zo_piece {
    struct zo_piece *next;   /* link in whichever queue holds the piece */
    struct zo_batch *batch;
    size_t index;            /* request index within the batch */
    int op;                  /* enum zo_op */
    int fd;
    char *addr;
    size_t len;
    int64_t offset;
    size_t done;             /* bytes moved so far */
    unsigned retries;        /* consecutive -EAGAIN/-EINTR results without progress */
};

struct zo_backend;

struct zo_backend_ops {
    /* Allocate the backend and start its threads. */
    int (*start)(const struct zo_config *config, struct zo_backend **out);
    /* Take a chain of pieces (first..last, linked by next), or refuse all of it with -errno
     * when the backend can no longer move pieces. Called under the engine lock. */
    int (*enqueue)(struct zo_backend *backend, struct zo_piece *first, struct zo_piece *last);
    /* Finish queued pieces with -ECANCELED, wait for pieces in flight, join threads, free. */
    void (*stop)(struct zo_backend *backend);
};

struct zo_backend {
    const struct zo_backend_ops *ops;
};

extern const struct zo_backend_ops zo_uring_ops;
extern const struct zo_backend_ops zo_pool_ops;

enum { ZO_PIECE_AGAIN = 0, ZO_PIECE_DONE = 1 };

/* Apply one read/write result (bytes or -errno) to p: ZO_PIECE_DONE, ZO_PIECE_AGAIN (submit
 * the rest of p again) or the piece's -errno. */
int zo_piece_progress(struct zo_piece *p, long result);

/* Hand p back to the core: error is 0 or -errno. p must not be touched afterwards. */
void zo_piece_finish(struct zo_piece *p, int error);
/* Finish every piece of a ->next chain with the same error (cancelled or failed queues). */
void zo_chain_finish(struct zo_piece *p, int error);

/* pthread_create with every signal blocked in the new thread, so that signals (SIGINT,
 * SIGXFSZ, ...) go to the Python threads that handle them. Returns 0 or -errno. */
int zo_thread_start(pthread_t *thread, void *(*run)(void *), void *arg);

#endif
