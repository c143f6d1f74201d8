/*
 * aio_uring.c - the "uring" backend: io_uring through the raw kernel interface
 * (<linux/io_uring.h>, io_uring_setup/enter/register system calls, mmap of the rings; no
 * liburing), with the discipline of liburing's examples/io_uring-cp.c: at most queue_depth
 * pieces in flight, one io_uring_enter per batch of SQEs, every result checked as -errno,
 * short transfers and -EAGAIN resubmitted for the remainder.
 *
 * Vocabulary
 *   ring     the SQ/CQ pair of one io_uring instance and its mmap'd memory (struct ring).
 *   owner    the one thread per engine that fills the SQ, enters the kernel and reaps the CQ.
 *   queue    pieces handed over by zo_engine_submit, waiting for a free slot (mutex-guarded).
 *   retry    pieces the owner resubmits after a short transfer or -EAGAIN (owner only).
 *   slot     an in-flight piece's place in `slots`; its index + 1 is the SQE's user_data, so
 *            a failed ring can finish every piece it holds. user_data 0 is the wake read.
 *   wake     a read of an eventfd that the owner keeps in the ring: submitters write the
 *            eventfd after queueing, which completes that read and wakes the owner.
 *   failure  io_uring_enter returned an error it cannot retry. The ring then takes no more work,
 *            but pieces the kernel already holds finish only when their completions arrive:
 *            until then the kernel may still read or write their buffers, and finishing a piece
 *            is what lets its caller free or reuse that memory (see fail_all).
 *
 * Why one owner thread rather than a mutex around ring operations: completions of requests
 * are posted through task_work of the task that submitted them, so if any Python thread could
 * submit, one busy in Python code (or one that exits, whose requests the kernel then cancels
 * or waits for) would hold up other threads' completions. With a single owner, submission,
 * reaping and resubmission of short transfers need no lock on the rings at all; Python threads
 * touch only the queue and then sleep on their batch's condition variable (aio_engine.c).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "aio.h"
#include "aio_backend.h"

#define WAKE_TAG 0

struct ring {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_len, cq_len, sqes_len;
    unsigned sqe_tail;  /* next SQE to fill; published to *sq_tail by ring_enter */
};

struct uring {
    struct zo_backend base;
    struct ring ring;
    int wake_fd;
    unsigned depth;
    pthread_t thread;
    /* owner thread only */
    struct zo_piece **slots;
    unsigned *free_slots, nfree;
    struct zo_piece *retry_head, *retry_tail;
    int wake_armed;
    uint64_t wake_value;
    /* guarded by lock */
    pthread_mutex_t lock;
    struct zo_piece *queue_head, *queue_tail;
    int stopping;
    int broken;  /* -errno once the ring failed: later enqueues get it. Written by the owner only,
                  * which therefore reads it without the lock. */
};

/* ---------------------------------------------------------------- the ring itself */

static int ring_map(struct ring *r, const struct io_uring_params *p)
{
    r->sq_len = p->sq_off.array + p->sq_entries * sizeof(unsigned);
    r->cq_len = p->cq_off.cqes + p->cq_entries * sizeof(struct io_uring_cqe);
    int single = (p->features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single)
        r->sq_len = r->cq_len = r->sq_len > r->cq_len ? r->sq_len : r->cq_len;
    int prot = PROT_READ | PROT_WRITE, flags = MAP_SHARED | MAP_POPULATE;
    r->sq_map = mmap(NULL, r->sq_len, prot, flags, r->fd, IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED)
        return -errno;
    r->cq_map = single ? r->sq_map : mmap(NULL, r->cq_len, prot, flags, r->fd, IORING_OFF_CQ_RING);
    int rc = 0;
    if (r->cq_map == MAP_FAILED) {
        rc = -errno;
        munmap(r->sq_map, r->sq_len);
        return rc;
    }
    r->sqes_len = p->sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, prot, flags, r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) {
        rc = -errno;
        if (!single)
            munmap(r->cq_map, r->cq_len);
        munmap(r->sq_map, r->sq_len);
        return rc;
    }
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p->sq_off.head);
    r->sq_tail = (unsigned *)(sq + p->sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p->sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p->sq_off.array);
    r->cq_head = (unsigned *)(cq + p->cq_off.head);
    r->cq_tail = (unsigned *)(cq + p->cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p->cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p->cq_off.cqes);
    r->sqe_tail = *r->sq_tail;
    return 0;
}

/* Set up a ring of at least `entries` SQEs. COOP_TASKRUN (5.19+) spares the owner an
 * interrupt per completion: it runs task_work anyway when it enters the kernel to wait. */
static int ring_setup(struct ring *r, unsigned entries)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    p.flags = IORING_SETUP_COOP_TASKRUN;
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0 && errno == EINVAL) {
        memset(&p, 0, sizeof(p));
        r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    }
    if (r->fd < 0)
        return -errno;
    int rc = ring_map(r, &p);
    if (rc < 0)
        close(r->fd);
    return rc;
}

/* Teardown: munmap and close of mappings and a descriptor we own cannot fail usefully here. */
static void ring_close(struct ring *r)
{
    munmap(r->sqes, r->sqes_len);
    if (r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_len);
    munmap(r->sq_map, r->sq_len);
    close(r->fd);
}

static void ring_prep(struct ring *r, int opcode, int fd, void *addr, size_t len, int64_t off,
                      uint64_t tag)
{
    unsigned index = r->sqe_tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[index];
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = (uint8_t)opcode;
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)addr;
    sqe->len = (uint32_t)len;  /* pieces are at most ZO_MAX_BLOCK (1 GiB) */
    sqe->off = (uint64_t)off;
    sqe->user_data = tag;
    r->sq_array[index] = index;
    r->sqe_tail++;
}

/* Submit every filled SQE and wait for at least one completion. -EINTR, -EAGAIN and -EBUSY
 * are retried, returning first when completions are ready to reap (reaping is what frees the
 * resources the kernel lacked); any other error is the ring's end. */
static int ring_enter(struct ring *r)
{
    __atomic_store_n(r->sq_tail, r->sqe_tail, __ATOMIC_RELEASE);
    for (;;) {
        unsigned to_submit = r->sqe_tail - __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
        long rc = syscall(__NR_io_uring_enter, r->fd, to_submit, 1, IORING_ENTER_GETEVENTS,
                          NULL, 0);
        if (rc >= 0)
            return 0;
        int err = errno;
        if (err != EINTR && err != EAGAIN && err != EBUSY)
            return -err;
        if (*r->cq_head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE))
            return 0;
    }
}

int zo_uring_probe(void)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    int fd = (int)syscall(__NR_io_uring_setup, 2, &p);
    if (fd < 0)
        return -errno;
    size_t nops = IORING_OP_WRITE + 1;
    struct io_uring_probe *probe = calloc(1, sizeof(*probe) + nops * sizeof(probe->ops[0]));
    int rc = -ENOMEM;
    if (probe) {
        rc = syscall(__NR_io_uring_register, fd, IORING_REGISTER_PROBE, probe, nops) < 0 ? -errno : 0;
        if (rc == 0 && (probe->last_op < IORING_OP_WRITE ||
                        !(probe->ops[IORING_OP_READ].flags & IO_URING_OP_SUPPORTED) ||
                        !(probe->ops[IORING_OP_WRITE].flags & IO_URING_OP_SUPPORTED)))
            rc = -EOPNOTSUPP;
        free(probe);
    }
    close(fd);
    return rc == -EINVAL ? -EOPNOTSUPP : rc;  /* kernels before 5.6 know no probe, nor the ops */
}

/* ---------------------------------------------------------------- the owner thread */

static void chain_push(struct zo_piece **head, struct zo_piece **tail, struct zo_piece *p)
{
    p->next = NULL;
    if (*tail)
        (*tail)->next = p;
    else
        *head = p;
    *tail = p;
}

static struct zo_piece *chain_pop(struct zo_piece **head, struct zo_piece **tail)
{
    struct zo_piece *p = *head;
    *head = p->next;
    if (!*head)
        *tail = NULL;
    return p;
}

/* Give p a free slot and an SQE for the part of it not done yet. */
static void prep_piece(struct uring *u, struct zo_piece *p)
{
    unsigned slot = u->free_slots[--u->nfree];
    u->slots[slot] = p;
    ring_prep(&u->ring, p->op == ZO_READ ? IORING_OP_READ : IORING_OP_WRITE, p->fd,
              p->addr + p->done, p->len - p->done, p->offset + (int64_t)p->done, slot + 1u);
}

/* Fill free slots from the retry list, then from the queue; keep the wake read armed.
 * Returns whether the engine is stopping. */
static int fill(struct uring *u)
{
    while (u->retry_head && u->nfree)
        prep_piece(u, chain_pop(&u->retry_head, &u->retry_tail));
    pthread_mutex_lock(&u->lock);
    while (u->queue_head && u->nfree)
        prep_piece(u, chain_pop(&u->queue_head, &u->queue_tail));
    int stopping = u->stopping;
    pthread_mutex_unlock(&u->lock);
    if (!u->wake_armed && !stopping) {
        ring_prep(&u->ring, IORING_OP_READ, u->wake_fd, &u->wake_value, sizeof(u->wake_value), 0,
                  WAKE_TAG);
        u->wake_armed = 1;
    }
    return stopping;
}

static struct zo_piece *release_slot(struct uring *u, unsigned slot)
{
    struct zo_piece *p = u->slots[slot];
    u->slots[slot] = NULL;
    u->free_slots[u->nfree++] = slot;
    return p;
}

/* Apply a completion to its piece: finish it, or queue the rest of it to be submitted again, which
 * a failed ring no longer does (the rest fails with the ring's error). */
static void complete(struct uring *u, unsigned slot, int result)
{
    struct zo_piece *p = release_slot(u, slot);
    int state = zo_piece_progress(p, result);
    if (state == ZO_PIECE_AGAIN && !u->broken)
        chain_push(&u->retry_head, &u->retry_tail, p);
    else if (state == ZO_PIECE_AGAIN)
        zo_piece_finish(p, u->broken);
    else
        zo_piece_finish(p, state == ZO_PIECE_DONE ? 0 : state);
}

static void reap(struct uring *u)
{
    struct ring *r = &u->ring;
    unsigned head = *r->cq_head;
    unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    for (; head != tail; head++) {
        const struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
        if (cqe->user_data == WAKE_TAG)
            u->wake_armed = 0;  /* whatever it read (or failed with), the queue is looked at next */
        else
            complete(u, (unsigned)(cqe->user_data - 1), cqe->res);
    }
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
}

/* SQEs the failed io_uring_enter left unconsumed (at sq_head and after) never reach the kernel,
 * so no completion will come for them: their pieces finish with the error now; the SQ empties. */
static void fail_unconsumed(struct uring *u, int error)
{
    struct ring *r = &u->ring;
    unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
    for (unsigned at = head; at != r->sqe_tail; at++) {
        uint64_t tag = r->sqes[at & *r->sq_mask].user_data;
        if (tag == WAKE_TAG)
            u->wake_armed = 0;
        else
            zo_piece_finish(release_slot(u, (unsigned)(tag - 1)), error);
    }
    r->sqe_tail = head;
    __atomic_store_n(r->sq_tail, head, __ATOMIC_RELEASE);
}

/* Our eventfd is non-blocking, so writing it fails only with EAGAIN when its counter is
 * saturated: a wake is pending already, which is all a write asks for. */
static void wake(struct uring *u)
{
    while (eventfd_write(u->wake_fd, 1) < 0 && errno == EINTR)
        ;
}

/* Reap until the kernel holds nothing of ours: every slot's piece and the wake read, whose buffer
 * is freed with u (writing the eventfd completes it). The ring is not entered again: after the
 * failure it may not take io_uring_enter at all. Completions still land in the CQ (our mappings
 * keep the ring alive), and each return from the sleep runs the task_work that posts them. The
 * files are regular ones, whose transfers always complete. */
static void drain(struct uring *u)
{
    const struct timespec millisecond = {.tv_sec = 0, .tv_nsec = 1000000};
    if (u->wake_armed)
        wake(u);
    for (;;) {
        reap(u);
        if (u->nfree == u->depth && !u->wake_armed)
            return;
        nanosleep(&millisecond, NULL);  /* an interrupted sleep only looks again sooner */
    }
}

/* The ring failed for good with error. Later enqueues get it; pieces the kernel never saw (queued,
 * waiting to be retried, or in unconsumed SQEs) finish with it at once, and those it holds as
 * their completions arrive (drain), never before. */
static void fail_all(struct uring *u, int error)
{
    pthread_mutex_lock(&u->lock);
    struct zo_piece *queued = u->queue_head;
    u->queue_head = u->queue_tail = NULL;
    u->broken = error;
    pthread_mutex_unlock(&u->lock);
    zo_chain_finish(queued, error);
    zo_chain_finish(u->retry_head, error);
    u->retry_head = u->retry_tail = NULL;
    fail_unconsumed(u, error);
    drain(u);
}

/* Runs until stopping with nothing left in the kernel: no piece in a slot and no wake read armed
 * (stop writes the eventfd after setting stopping, so an armed one completes), or until the ring
 * fails and fail_all has drained it. */
static void *owner_main(void *arg)
{
    struct uring *u = arg;
    for (;;) {
        int stopping = fill(u);
        if (stopping && u->nfree == u->depth && !u->retry_head && !u->wake_armed)
            return NULL;
        int rc = ring_enter(&u->ring);
        if (rc < 0) {
            fail_all(u, rc);
            return NULL;
        }
        reap(u);
    }
}

/* ---------------------------------------------------------------- the backend contract */

static int uring_enqueue(struct zo_backend *b, struct zo_piece *first, struct zo_piece *last)
{
    struct uring *u = (struct uring *)b;
    pthread_mutex_lock(&u->lock);
    int rc = u->broken;
    if (!rc) {
        if (u->queue_tail)
            u->queue_tail->next = first;
        else
            u->queue_head = first;
        u->queue_tail = last;
    }
    pthread_mutex_unlock(&u->lock);
    if (!rc)
        wake(u);
    return rc;
}

static void uring_free(struct uring *u)
{
    free(u->slots);
    free(u->free_slots);
    free(u);
}

static int uring_start(const struct zo_config *config, struct zo_backend **out)
{
    int rc = zo_uring_probe();
    if (rc < 0)
        return rc;
    struct uring *u = calloc(1, sizeof(*u));
    if (!u)
        return -ENOMEM;
    u->base.ops = &zo_uring_ops;
    u->depth = u->nfree = config->queue_depth;
    u->slots = calloc(u->depth, sizeof(*u->slots));
    u->free_slots = calloc(u->depth, sizeof(*u->free_slots));
    if (!u->slots || !u->free_slots) {
        uring_free(u);
        return -ENOMEM;
    }
    for (unsigned i = 0; i < u->depth; i++)
        u->free_slots[i] = i;
    rc = -pthread_mutex_init(&u->lock, NULL);
    if (rc < 0)
        goto free_u;
    u->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (u->wake_fd < 0) {
        rc = -errno;
        goto destroy_lock;
    }
    rc = ring_setup(&u->ring, u->depth + 1);  /* + 1: the wake read */
    if (rc < 0)
        goto close_wake;
    rc = zo_thread_start(&u->thread, owner_main, u);
    if (rc < 0)
        goto close_ring;
    *out = &u->base;
    return 0;
close_ring:
    ring_close(&u->ring);
close_wake:
    close(u->wake_fd);
destroy_lock:
    pthread_mutex_destroy(&u->lock);
free_u:
    uring_free(u);
    return rc;
}

/* pthread_join of our own joinable owner thread cannot fail. */
static void uring_stop(struct zo_backend *b)
{
    struct uring *u = (struct uring *)b;
    pthread_mutex_lock(&u->lock);
    u->stopping = 1;
    struct zo_piece *queued = u->queue_head;
    u->queue_head = u->queue_tail = NULL;
    pthread_mutex_unlock(&u->lock);
    zo_chain_finish(queued, -ECANCELED);
    wake(u);
    pthread_join(u->thread, NULL);
    ring_close(&u->ring);
    close(u->wake_fd);
    pthread_mutex_destroy(&u->lock);
    uring_free(u);
}

const struct zo_backend_ops zo_uring_ops = {
    .start = uring_start,
    .enqueue = uring_enqueue,
    .stop = uring_stop,
};
