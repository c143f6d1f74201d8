/*
 * cpu_adam.c - the fused Adam/AdamW pass of cpu_adam.h: per-call constants, the level a pass runs
 * on, and the split of a pass over threads. The pass itself, element by element, is adam_pass.h;
 * its vector levels are adam_avx2.c and adam_avx512.c.
 *
 * Vocabulary
 *   consts   the floats the element arithmetic uses, derived once per call in double as torch
 *            derives them, then rounded to float.
 *   range    elements [begin, end) that one thread updates at a time. A level's range function runs whole
 *            vectors (16 or 8 elements) and leaves the last few (its tail) to the scalar code,
 *            which does the same arithmetic (ADAM_UPDATE) and the same rounding, so results do
 *            not depend on the level, the thread count or where a range starts.
 *   block    a range the threads of a pass take in turn (struct split): a multiple of 64
 *            elements (whole cache lines of every array) except the last.
 *
 * Threads are started per call and joined before it returns: no pool outlives a call, so there is
 * nothing to shut down, nothing to leak and nothing that a fork() could inherit half-alive. Passes
 * large enough to be split (>= 2 x ZO_ADAM_MIN_PER_THREAD elements) take milliseconds, against tens
 * of microseconds to start a thread.
 *
 * Architectures. The vector levels are x86 intrinsics (<immintrin.h>), each function compiled for
 * its level by a target attribute and chosen at run time by __builtin_cpu_supports, so a build
 * for plain x86-64 (no -mavx2 in CFLAGS) still runs AVX2/AVX-512 where the CPU has them. All of
 * that exists only under ZO_ADAM_X86: elsewhere (aarch64, ...) neither the header nor the CPU
 * query exists, and the file compiles to the scalar level alone, whatever ZO_ADAM_SIMD asks.
 * -DZO_ADAM_SCALAR_ONLY gives an x86 build the same shape, so that path is built and tested
 * on x86 too (tests/test_native_build.py).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include "int8_moments.h"

/* The scalar level's range of fp32 or bf16 moments, as a range_fn. */
static double scalar_level_range(const void *pass, size_t begin, size_t end)
{
    return scalar_range(pass, begin, end);
}

static double scalar_run(const void *pass, size_t begin, size_t end)
{
    return any_moments_range(pass, begin, end, scalar_level_range, int8_codes);
}

/* ---------------------------------------------------------------------------------------------
 * Sum of squares alone (zo_sum_squares): the gradient norm where no update reads the gradient */

static double scalar_sumsq(const void *pass, size_t begin, size_t end)
{
    return scalar_sumsq_range(pass, begin, end);
}

static range_fn *const sumsq_run[] = {
    [ZO_SIMD_SCALAR] = scalar_sumsq,
#if ZO_ADAM_X86
    [ZO_SIMD_AVX2] = zo_avx2_sumsq, [ZO_SIMD_AVX512] = zo_avx2_sumsq,  /* bound by memory: AVX2 is enough */
#endif
};

/* ---------------------------------------------------------------------------------------------
 * Level: the CPU's best, or lower when ZO_ADAM_SIMD asks */

/* Indexed by a level no higher than cpu_level(), so off x86 only the scalar entry is ever read. */
static range_fn *const level_run[] = {
    [ZO_SIMD_SCALAR] = scalar_run,
#if ZO_ADAM_X86
    [ZO_SIMD_AVX2] = zo_avx2_run, [ZO_SIMD_AVX512] = zo_avx512_run,
#endif
};

static pthread_once_t level_once = PTHREAD_ONCE_INIT;
static int level_chosen;  /* enum zo_simd, or -EINVAL; written once under level_once */

static int cpu_level(void)
{
#if ZO_ADAM_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        return ZO_SIMD_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ZO_SIMD_AVX2;
#endif
    return ZO_SIMD_SCALAR;
}

static void choose_level(void)
{
    int best = cpu_level();
    const char *asked = getenv("ZO_ADAM_SIMD");
    if (!asked || !*asked) {
        level_chosen = best;
        return;
    }
    level_chosen = -EINVAL;
    for (int level = ZO_SIMD_SCALAR; level <= ZO_SIMD_AVX512; level++)
        if (strcmp(asked, zo_adam_simd_name(level)) == 0)
            level_chosen = level < best ? level : best;
}

int zo_adam_simd(void)
{
    int rc = pthread_once(&level_once, choose_level);
    return rc ? -rc : level_chosen;
}

const char *zo_adam_simd_name(int level)
{
    switch (level) {
    case ZO_SIMD_AVX512: return "avx512";
    case ZO_SIMD_AVX2: return "avx2";
    default: return "scalar";
    }
}

/* ---------------------------------------------------------------------------------------------
 * Constants and threads */

/* torch's derivation (adam_fused_step_impl): the step read as a float, everything in double,
 * each constant rounded to float where the kernel broadcasts it. */
static struct consts derive_consts(const struct zo_adam_args *a)
{
    double step = (float)a->step;
    double bias_correction1 = 1 - pow(a->beta1, step), bias_correction2 = 1 - pow(a->beta2, step);
    float w = (float)(1 - a->beta1);
    int small = fabsf(w) < 0.5f;
    return (struct consts){
        .grad_scale = a->grad_scale,
        .decay_kind = a->weight_decay == 0 ? DECAY_NONE : a->adamw ? DECAY_ADAMW : DECAY_L2,
        .decay = (float)(1 - a->lr * a->weight_decay),
        .weight_decay = (float)a->weight_decay,
        .lerp_small = small,
        .lerp_coeff = small ? w : w - 1.0f,
        .beta2 = (float)a->beta2,
        .one_minus_beta2 = (float)(1 - a->beta2),
        .bias_correction2_sqrt = (float)sqrt(bias_correction2),
        .eps = (float)a->eps,
        .neg_step_size = (float)-(a->lr / bias_correction1),
        .noise_seed = mix32(a->noise_key ^ mix32((uint32_t)a->step)),
    };
}

static unsigned usable_cpus(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0)
        return (unsigned)CPU_COUNT(&set);
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (unsigned)online : 1;
}

/* Threads for n elements: as asked (0: every usable CPU), at most one per
 * ZO_ADAM_MIN_PER_THREAD elements and at most ZO_ADAM_MAX_THREADS, at least one. */
static unsigned thread_count(unsigned asked, size_t n)
{
    size_t count = asked ? asked : usable_cpus();
    size_t useful = n / ZO_ADAM_MIN_PER_THREAD;
    if (count > useful)
        count = useful;
    if (count > ZO_ADAM_MAX_THREADS)
        count = ZO_ADAM_MAX_THREADS;
    return count ? (unsigned)count : 1;
}

/* A split: count passes (struct pass or struct sumsq_pass, pass_size bytes apart) of ns[i] elements
 * each, cut into blocks of `block` elements (a multiple of 64 and of SUMSQ_BLOCK, so a block's sum does
 * not depend on who runs it), which the threads take in turn from `next`, pass after pass. The caller
 * starts at once and a helper joins whenever it is scheduled: on a busy or virtual CPU a thread can
 * start hundreds of microseconds late, and an even split made every call wait for its late half. Many
 * passes in one split pay for one start and one join, and run on as one stream. Each block's sum of
 * squares lands in its own slot and a pass's slots are added in block order, so its sum is the same
 * whatever the threads and their timing. */
#define SPLIT_BLOCK_MIN ((size_t)1 << 16)
#define SPLIT_BLOCKS_TARGET 2048u
_Static_assert(SUMSQ_BLOCK % ZO_INT8_BLOCK == 0, "a split's blocks must start int8 moments' blocks");

struct split {
    const char *passes;
    size_t pass_size;
    const size_t *ns;
    size_t count;
    range_fn *run;
    size_t block;
    size_t *first;               /* first[i]: pass i's first block; first[count]: every block */
    double *block_sumsq;         /* one slot per block, after first[] in the same allocation */
    size_t next;                 /* the next block to take (atomic) */
};

static void *split_worker(void *arg)
{
    struct split *s = arg;
    size_t pass = 0;  /* a thread takes blocks in increasing order: its pass only moves forward */
    for (;;) {
        size_t index = __atomic_fetch_add(&s->next, 1, __ATOMIC_RELAXED);
        if (index >= s->first[s->count])
            return NULL;
        while (s->first[pass + 1] <= index)
            pass++;
        size_t begin = (index - s->first[pass]) * s->block, n = s->ns[pass];
        size_t end = n - begin > s->block ? begin + s->block : n;
        s->block_sumsq[index] = s->run(s->passes + pass * s->pass_size, begin, end);
    }
}

/* The passes, run by the caller and threads - 1 helpers; a helper that cannot start leaves its
 * blocks to the others, so no pass is ever half applied. sums[i] receives pass i's sum of squares. */
static int run_split(const void *passes, size_t pass_size, const size_t *ns, size_t count, range_fn *run,
                     unsigned threads, double *sums)
{
    size_t total = 0;
    for (size_t i = 0; i < count; i++)
        total += ns[i];
    size_t block = (total + SPLIT_BLOCKS_TARGET - 1) / SPLIT_BLOCKS_TARGET;
    block = block < SPLIT_BLOCK_MIN ? SPLIT_BLOCK_MIN : (block + SUMSQ_BLOCK - 1) / SUMSQ_BLOCK * SUMSQ_BLOCK;
    size_t blocks = 0;
    for (size_t i = 0; i < count; i++)
        blocks += (ns[i] + block - 1) / block;
    struct split split = {.passes = passes, .pass_size = pass_size, .ns = ns, .count = count, .run = run,
                          .block = block, .first = malloc((count + 1) * sizeof(size_t) + blocks * sizeof(double))};
    if (!split.first)
        return -ENOMEM;
    split.block_sumsq = (double *)(split.first + count + 1);
    split.first[0] = 0;
    for (size_t i = 0; i < count; i++)
        split.first[i + 1] = split.first[i] + (ns[i] + block - 1) / block;
    pthread_t helpers[ZO_ADAM_MAX_THREADS];
    int started[ZO_ADAM_MAX_THREADS] = {0};
    for (unsigned i = 1; i < threads; i++)
        started[i] = pthread_create(&helpers[i], NULL, split_worker, &split) == 0;
    split_worker(&split);
    int rc = 0;
    for (unsigned i = 1; i < threads; i++) {
        int joined = started[i] ? pthread_join(helpers[i], NULL) : 0;
        if (joined && !rc)
            rc = -joined;
    }
    for (size_t i = 0; i < count; i++) {
        sums[i] = 0;
        for (size_t index = split.first[i]; index < split.first[i + 1]; index++)
            sums[i] += split.block_sumsq[index];
    }
    free(split.first);
    return rc;
}

static int valid_args(const struct zo_adam_args *a)
{
    int grad_ok = a->grad_dtype == ZO_DTYPE_FP32 || a->grad_dtype == ZO_DTYPE_BF16 ||
                  a->grad_dtype == ZO_DTYPE_FP16;
    int out_ok = a->out_dtype == ZO_DTYPE_NONE || a->out_dtype == ZO_DTYPE_FP32 ||
                 a->out_dtype == ZO_DTYPE_BF16 || a->out_dtype == ZO_DTYPE_FP16;
    int int8 = a->moment_dtype == ZO_DTYPE_INT8;
    int moments_ok = a->moment_dtype == ZO_DTYPE_FP32 || a->moment_dtype == ZO_DTYPE_BF16 || int8;
    int split = a->master == ZO_MASTER_SPLIT;
    if (!grad_ok || !out_ok || !moments_ok || a->step < 1 || (a->master != ZO_MASTER_FP32 && !split) ||
        (split && a->out_dtype != ZO_DTYPE_BF16))
        return 0;
    /* torch hands out a null data pointer for an empty tensor, so pointers matter only when n > 0 */
    int master_ok = split ? a->out && a->residual && a->residual_bits : a->param != NULL;
    int scales_ok = !int8 || (a->exp_avg_scale && a->exp_avg_sq_scale);
    return a->n == 0 || (master_ok && scales_ok && a->grad && a->exp_avg && a->exp_avg_sq &&
                         (a->out_dtype == ZO_DTYPE_NONE || a->out));
}

int zo_adam_steps(const struct zo_adam_args *args, size_t count, unsigned threads)
{
    int level = zo_adam_simd();
    if (level < 0)
        return level;
    size_t total = 0;
    for (size_t i = 0; i < count; i++) {
        if (!valid_args(&args[i]))
            return -EINVAL;
        total += args[i].n;
    }
    if (total == 0) {
        for (size_t i = 0; i < count; i++)
            if (args[i].grad_sumsq)
                *args[i].grad_sumsq = 0;
        return 0;
    }
    struct pass *pass = malloc(count * (sizeof(*pass) + sizeof(size_t) + sizeof(double)));
    if (!pass)
        return -ENOMEM;
    size_t *ns = (size_t *)(pass + count);
    double *sums = (double *)(ns + count);
    for (size_t i = 0; i < count; i++) {
        const struct zo_adam_args *a = &args[i];
        int split = a->master == ZO_MASTER_SPLIT;
        pass[i] = (struct pass){
            .param = a->param, .exp_avg = a->exp_avg, .exp_avg_sq = a->exp_avg_sq, .grad = a->grad, .out = a->out,
            .exp_avg_scale = a->exp_avg_scale, .exp_avg_sq_scale = a->exp_avg_sq_scale,
            .grad_dtype = a->grad_dtype, .out_dtype = a->out_dtype, .moment_dtype = a->moment_dtype, .split = split,
            .residual = a->residual, .residual_bits = a->residual_bits, .residual_bit0 = a->residual_bit0,
            .noise_base = a->noise_base, .sumsq = a->grad_sumsq != NULL,
            .stream_out = !split && a->n >= STREAM_OUT_MIN,  /* a split master's out is read too */
            .k = derive_consts(a),
        };
        ns[i] = a->n;
    }
    int rc = run_split(pass, sizeof(*pass), ns, count, level_run[level], thread_count(threads, total), sums);
    for (size_t i = 0; rc == 0 && i < count; i++)
        if (args[i].grad_sumsq)
            *args[i].grad_sumsq = sums[i];
    free(pass);
    return rc;
}

int zo_sum_squares(const void *x, int dtype, size_t n, unsigned threads, double *sumsq)
{
    int level = zo_adam_simd();
    if (level < 0)
        return level;
    if (!sumsq || (dtype != ZO_DTYPE_FP32 && dtype != ZO_DTYPE_BF16 && dtype != ZO_DTYPE_FP16) || (n && !x))
        return -EINVAL;
    *sumsq = 0;
    if (n == 0)
        return 0;
    const struct sumsq_pass pass = {.x = x, .dtype = dtype};
    /* a read-only pass moves a sixth of an update's bytes per element: as many per thread */
    unsigned count = thread_count(threads, n / 6);
    int rc = run_split(&pass, sizeof(pass), &n, 1, sumsq_run[level], count, sumsq);
    if (rc == 0 && !isfinite(*sumsq))  /* an inf or NaN, or squares past fp32's range: again in double */
        rc = run_split(&pass, sizeof(pass), &n, 1, scalar_sumsq, count, sumsq);
    return rc;
}
