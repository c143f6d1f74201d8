/*
 * aio_pool.c - the "pool" backend: a fixed set of pthreads that each take one piece at a time
 * from a shared queue and move it with pread/pwrite, continuing short transfers and retrying
 * -EAGAIN/-EINTR by the same progress rule as the uring backend (zo_piece_progress). It needs
 * nothing from the kernel beyond pread/pwrite, so it stands in where io_uring is missing or
 * disabled.
 *
 * Vocabulary
 *   worker   one of `threads` pthreads; pieces in flight are bounded by the number of workers
 *            (queue_depth does not apply: a worker has exactly one piece in flight).
 *   queue    pieces handed over by zo_engine_submit and not yet taken by a worker.
 */
#define _GNU_SOURCE
#define _FILE_OFFSET_BITS 64  /* 64-bit off_t and st_size on every target */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "aio.h"
#include "aio_backend.h"

struct pool {
    struct zo_backend base;
    pthread_mutex_t lock;
    pthread_cond_t work;          /* signalled when the queue grows or the pool stops */
    struct zo_piece *queue_head, *queue_tail;
    int stopping;
    unsigned nthreads;            /* workers started */
    pthread_t threads[];
};

/* Move one piece to the end; 0 or its -errno. */
static int transfer(struct zo_piece *p)
{
    for (;;) {
        char *addr = p->addr + p->done;
        size_t len = p->len - p->done;
        off_t off = (off_t)(p->offset + (int64_t)p->done);
        ssize_t n = p->op == ZO_READ ? pread(p->fd, addr, len, off) : pwrite(p->fd, addr, len, off);
        int state = zo_piece_progress(p, n < 0 ? -errno : (long)n);
        if (state != ZO_PIECE_AGAIN)
            return state == ZO_PIECE_DONE ? 0 : state;
    }
}

static void *worker_main(void *arg)
{
    struct pool *pool = arg;
    for (;;) {
        pthread_mutex_lock(&pool->lock);
        while (!pool->queue_head && !pool->stopping)
            pthread_cond_wait(&pool->work, &pool->lock);
        struct zo_piece *p = pool->queue_head;
        if (p) {
            pool->queue_head = p->next;
            if (!pool->queue_head)
                pool->queue_tail = NULL;
        }
        pthread_mutex_unlock(&pool->lock);
        if (!p)
            return NULL;  /* stopping, and stop took the queue */
        zo_piece_finish(p, transfer(p));
    }
}

static int pool_enqueue(struct zo_backend *b, struct zo_piece *first, struct zo_piece *last)
{
    struct pool *pool = (struct pool *)b;
    pthread_mutex_lock(&pool->lock);
    if (pool->queue_tail)
        pool->queue_tail->next = first;
    else
        pool->queue_head = first;
    pool->queue_tail = last;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

/* Take the queue, finish it with -ECANCELED, wake and join the workers (joining our own
 * joinable threads cannot fail), free. */
static void pool_stop(struct zo_backend *b)
{
    struct pool *pool = (struct pool *)b;
    pthread_mutex_lock(&pool->lock);
    pool->stopping = 1;
    struct zo_piece *p = pool->queue_head;
    pool->queue_head = pool->queue_tail = NULL;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->lock);
    zo_chain_finish(p, -ECANCELED);
    for (unsigned i = 0; i < pool->nthreads; i++)
        pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->work);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

static int pool_start(const struct zo_config *config, struct zo_backend **out)
{
    struct pool *pool = calloc(1, sizeof(*pool) + config->threads * sizeof(pthread_t));
    if (!pool)
        return -ENOMEM;
    pool->base.ops = &zo_pool_ops;
    int rc = -pthread_mutex_init(&pool->lock, NULL);
    if (rc < 0) {
        free(pool);
        return rc;
    }
    rc = -pthread_cond_init(&pool->work, NULL);
    if (rc < 0) {
        pthread_mutex_destroy(&pool->lock);
        free(pool);
        return rc;
    }
    for (; pool->nthreads < config->threads; pool->nthreads++) {
        rc = zo_thread_start(&pool->threads[pool->nthreads], worker_main, pool);
        if (rc < 0) {
            pool_stop(&pool->base);  /* joins the workers started so far */
            return rc;
        }
    }
    *out = &pool->base;
    return 0;
}

const struct zo_backend_ops zo_pool_ops = {
    .start = pool_start,
    .enqueue = pool_enqueue,
    .stop = pool_stop,
};
