/*
 * aio_engine.c - the engine core shared by both backends: batches, tickets, splitting requests
 * into pieces, the progress rule for read/write results, and waiting.
 *
 * Vocabulary: see aio.h (request, batch, ticket) and aio_backend.h (piece, progress, finish).
 *
 * One mutex per engine guards the list of unretired batches and every batch's counters; each
 * batch has its own condition variable so a completion wakes only that batch's waiters.
 * pthread_mutex_lock/unlock and pthread_cond_broadcast/destroy are not checked: on default
 * mutexes and condition variables that were initialized successfully they cannot fail.
 */
#define _GNU_SOURCE
#define _FILE_OFFSET_BITS 64  /* 64-bit off_t and st_size on every target */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "aio.h"
#include "aio_backend.h"

/* Consecutive -EAGAIN/-EINTR results a piece may get before its error stands: a bound, so that
 * a file that never becomes ready (a non-blocking descriptor) fails instead of spinning. */
#define ZO_MAX_RETRIES 100

struct zo_batch {
    struct zo_batch *prev, *next;  /* the engine's list of unretired batches */
    struct zo_engine *engine;
    uint64_t ticket;
    size_t pending;                /* pieces not finished yet */
    unsigned waiters;              /* threads inside zo_engine_wait on this batch */
    int done;
    int retired;                   /* unlinked from the engine's list; freed with no waiters */
    struct zo_status status;
    pthread_cond_t cond;
    struct zo_piece pieces[];
};

struct zo_engine {
    pthread_mutex_t lock;
    struct zo_batch *batches;
    uint64_t last_ticket;
    int closed;
    size_t block_size;
    struct zo_backend *backend;
    pid_t pid;  /* the process whose threads run the backend; a forked child has none of them */
};

static int config_valid(const struct zo_config *c)
{
    return (c->kind == ZO_URING || c->kind == ZO_POOL) && c->block_size >= 1 &&
           c->block_size <= ZO_MAX_BLOCK && c->queue_depth >= 1 &&
           c->queue_depth <= ZO_MAX_DEPTH && c->threads >= 1 && c->threads <= ZO_MAX_THREADS;
}

int zo_engine_create(const struct zo_config *config, zo_engine **out)
{
    if (!config_valid(config))
        return -EINVAL;
    struct zo_engine *e = calloc(1, sizeof(*e));
    if (!e)
        return -ENOMEM;
    int rc = pthread_mutex_init(&e->lock, NULL);
    if (rc) {
        free(e);
        return -rc;
    }
    e->block_size = config->block_size;
    e->pid = getpid();
    const struct zo_backend_ops *ops = config->kind == ZO_URING ? &zo_uring_ops : &zo_pool_ops;
    rc = ops->start(config, &e->backend);
    if (rc < 0) {
        pthread_mutex_destroy(&e->lock);
        free(e);
        return rc;
    }
    *out = e;
    return 0;
}

/* Number of pieces the requests split into, or -errno for an invalid request or overflow. */
static int count_pieces(const struct zo_request *reqs, size_t n, size_t block, size_t *count)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        const struct zo_request *r = &reqs[i];
        if ((r->op != ZO_READ && r->op != ZO_WRITE) || r->offset < 0 ||
            r->len > (uint64_t)INT64_MAX - (uint64_t)r->offset)
            return -EINVAL;
        size_t pieces = r->len / block + (r->len % block != 0);
        if (pieces > SIZE_MAX / sizeof(struct zo_piece) - total)
            return -ENOMEM;
        total += pieces;
    }
    *count = total;
    return 0;
}

static struct zo_batch *batch_alloc(size_t npieces, int *error)
{
    struct zo_batch *b = calloc(1, sizeof(*b) + npieces * sizeof(struct zo_piece));
    if (!b) {
        *error = -ENOMEM;
        return NULL;
    }
    pthread_condattr_t attr;
    int rc = pthread_condattr_init(&attr);
    if (!rc) {
        rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        if (!rc)
            rc = pthread_cond_init(&b->cond, &attr);
        pthread_condattr_destroy(&attr);
    }
    if (rc) {
        free(b);
        *error = -rc;
        return NULL;
    }
    return b;
}

static void batch_free(struct zo_batch *b)
{
    pthread_cond_destroy(&b->cond);
    free(b);
}

/* Fill the count pieces of b from the requests and link them into one chain. */
static void split(struct zo_batch *b, const struct zo_request *reqs, size_t n, size_t block,
                  size_t count)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        for (size_t at = 0; at < reqs[i].len; at += block) {
            struct zo_piece *p = &b->pieces[k++];
            p->batch = b;
            p->index = i;
            p->op = reqs[i].op;
            p->fd = reqs[i].fd;
            p->addr = (char *)reqs[i].addr + at;
            p->len = reqs[i].len - at < block ? reqs[i].len - at : block;
            p->offset = reqs[i].offset + (int64_t)at;
            p->next = k < count ? &b->pieces[k] : NULL;
        }
    }
}

int zo_engine_submit(zo_engine *e, const struct zo_request *reqs, size_t n, uint64_t *ticket)
{
    size_t count;
    int rc = count_pieces(reqs, n, e->block_size, &count);
    if (rc < 0)
        return rc;
    struct zo_batch *b = batch_alloc(count, &rc);
    if (!b)
        return rc;
    b->engine = e;
    b->pending = count;
    b->done = count == 0;
    split(b, reqs, n, e->block_size, count);

    /* Enqueue under the engine lock, so shutdown cannot stop the backend between the closed
     * check and the enqueue (the backend's lock nests inside this one). */
    pthread_mutex_lock(&e->lock);
    if (e->closed) {
        pthread_mutex_unlock(&e->lock);
        batch_free(b);
        return -ESHUTDOWN;
    }
    if (count)
        rc = e->backend->ops->enqueue(e->backend, &b->pieces[0], &b->pieces[count - 1]);
    if (rc == 0) {
        b->ticket = ++e->last_ticket;
        b->next = e->batches;
        if (e->batches)
            e->batches->prev = b;
        e->batches = b;
        *ticket = b->ticket;
    }
    pthread_mutex_unlock(&e->lock);
    if (rc < 0)
        batch_free(b);
    return rc;
}

static struct zo_batch *find(struct zo_engine *e, uint64_t ticket)
{
    for (struct zo_batch *b = e->batches; b; b = b->next)
        if (b->ticket == ticket)
            return b;
    return NULL;
}

static void retire(struct zo_engine *e, struct zo_batch *b)
{
    if (b->prev)
        b->prev->next = b->next;
    else
        e->batches = b->next;
    if (b->next)
        b->next->prev = b->prev;
    b->retired = 1;
}

static struct timespec deadline_after(int64_t timeout_ns)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);  /* cannot fail for CLOCK_MONOTONIC */
    int64_t ns = t.tv_nsec + timeout_ns % 1000000000;
    t.tv_sec += timeout_ns / 1000000000 + ns / 1000000000;
    t.tv_nsec = ns % 1000000000;
    return t;
}

int zo_engine_wait(zo_engine *e, uint64_t ticket, int64_t timeout_ns, struct zo_status *status)
{
    struct timespec deadline = deadline_after(timeout_ns < 0 ? 0 : timeout_ns);
    pthread_mutex_lock(&e->lock);
    struct zo_batch *b = find(e, ticket);
    if (!b) {
        pthread_mutex_unlock(&e->lock);
        return -ENOENT;
    }
    int rc = 0;
    b->waiters++;
    while (!b->done && rc == 0)
        rc = timeout_ns < 0 ? pthread_cond_wait(&b->cond, &e->lock)
                            : pthread_cond_timedwait(&b->cond, &e->lock, &deadline);
    b->waiters--;
    if (!b->done) {
        pthread_mutex_unlock(&e->lock);
        return -rc;
    }
    *status = b->status;
    if (!b->retired)
        retire(e, b);
    if (b->waiters == 0)
        batch_free(b);
    pthread_mutex_unlock(&e->lock);
    return 0;
}

int zo_engine_poll(zo_engine *e, uint64_t ticket)
{
    pthread_mutex_lock(&e->lock);
    struct zo_batch *b = find(e, ticket);
    int rc = b ? b->done : -ENOENT;
    pthread_mutex_unlock(&e->lock);
    return rc;
}

/* In a forked child the backend's threads do not exist (and the engine lock may have been
 * copied held): the engine is left alone, closed only in name, its memory leaked with it. */
static int forked(const struct zo_engine *e)
{
    return getpid() != e->pid;
}

void zo_engine_shutdown(zo_engine *e)
{
    if (forked(e))
        return;
    pthread_mutex_lock(&e->lock);
    struct zo_backend *backend = e->closed ? NULL : e->backend;
    e->closed = 1;
    pthread_mutex_unlock(&e->lock);
    if (backend)
        backend->ops->stop(backend);
}

void zo_engine_destroy(zo_engine *e)
{
    if (forked(e))
        return;
    zo_engine_shutdown(e);
    while (e->batches) {
        struct zo_batch *b = e->batches;
        e->batches = b->next;
        batch_free(b);
    }
    pthread_mutex_destroy(&e->lock);
    free(e);
}

void zo_chain_finish(struct zo_piece *p, int error)
{
    while (p) {
        struct zo_piece *next = p->next;  /* read first: finishing may free the piece */
        zo_piece_finish(p, error);
        p = next;
    }
}

/* Whether a failure of request `index` at file offset `at` comes before the one s reports (see
 * aio.h): pieces finish in whatever order the disk completes them. */
static int comes_first(size_t index, int64_t at, const struct zo_status *s)
{
    return s->result >= 0 || index < s->failed_index ||
           (index == s->failed_index && at < s->failed_offset);
}

void zo_piece_finish(struct zo_piece *p, int error)
{
    struct zo_batch *b = p->batch;
    struct zo_engine *e = b->engine;
    int64_t at = p->offset + (int64_t)p->done;
    pthread_mutex_lock(&e->lock);
    if (error < 0 && comes_first(p->index, at, &b->status)) {
        b->status.result = error;
        b->status.failed_index = p->index;
        b->status.failed_offset = at;
    } else if (error == 0 && b->status.result >= 0) {
        b->status.result += (int64_t)p->len;
    }
    if (--b->pending == 0) {
        b->done = 1;
        pthread_cond_broadcast(&b->cond);
    }
    pthread_mutex_unlock(&e->lock);
}

/* After a short read: ZO_PIECE_AGAIN if the file goes on, -ZO_EEOF if the read stopped at its
 * end. Asked of the file rather than inferred, because with O_DIRECT the rest of a read that
 * stopped mid-block is unaligned and would fail with -EINVAL instead of reporting the end. */
static int continue_or_eof(int fd, int64_t position)
{
    struct stat st;
    if (fstat(fd, &st) < 0)
        return -errno;
    return S_ISREG(st.st_mode) && position >= st.st_size ? -ZO_EEOF : ZO_PIECE_AGAIN;
}

int zo_piece_progress(struct zo_piece *p, long result)
{
    if (result == -EAGAIN || result == -EINTR)
        return ++p->retries > ZO_MAX_RETRIES ? (int)result : ZO_PIECE_AGAIN;
    if (result < 0)
        return (int)result;
    if (result == 0)  /* nothing moved: end of file for a read; a write must not spin on it */
        return p->op == ZO_READ ? -ZO_EEOF : -EIO;
    p->retries = 0;
    p->done += (size_t)result;
    if (p->done >= p->len)
        return ZO_PIECE_DONE;
    return p->op == ZO_READ ? continue_or_eof(p->fd, p->offset + (int64_t)p->done) : ZO_PIECE_AGAIN;
}

int zo_thread_start(pthread_t *thread, void *(*run)(void *), void *arg)
{
    sigset_t all, old;
    sigfillset(&all);
    int rc = pthread_sigmask(SIG_SETMASK, &all, &old);
    if (rc)
        return -rc;
    rc = pthread_create(thread, NULL, run, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);  /* succeeded above with the same arguments */
    return -rc;
}
