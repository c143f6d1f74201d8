/*
 * cpu_adam.h - one fused pass of Adam/AdamW over fp32 master parameters on the CPU.
 *
 * Vocabulary
 *   param       fp32 master parameters, updated in place.
 *   grad        the gradient, fp32, bf16 or fp16; read only. It is multiplied by grad_scale
 *               first (the engine's unscale x clip coefficient), in fp32.
 *   exp_avg     fp32 first moment m, updated in place.
 *   exp_avg_sq  fp32 second moment v, updated in place.
 *   out         optional low-precision copy of the new param (bf16, fp16 or fp32), written in the
 *               same pass and rounded to nearest even exactly as torch's `.to(dtype)` rounds.
 *   level       the instruction set the pass runs on: AVX-512, AVX2 (+FMA, F16C) or scalar C,
 *               the best the CPU has unless the environment variable ZO_ADAM_SIMD
 *               (avx512 | avx2 | scalar) asks for a lower one. Every level gives the same bits.
 *               The vector levels are x86 only: on other architectures the level is scalar.
 *
 * The arithmetic is what torch's fused CPU kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp)
 * computes in its vectorized body, as built, operation for operation: constants derived in double
 * and rounded to float once, IEEE sqrt and division, and a fused multiply-add exactly where torch's
 * binary has one. Results equal torch.optim.Adam/AdamW(fused=True) bit for bit except in the last
 * n % 16 elements of a tensor, where torch leaves its vector body for scalar code that rounds v
 * differently from itself (by an ulp); we keep one formula for every element, so results do not
 * depend on the level, the thread count or where a range starts.
 *
 * Functions return 0 or a negative errno, and never abort the process.
 */
#ifndef ZO_CPU_ADAM_H
#define ZO_CPU_ADAM_H

#include <stddef.h>
#include <stdint.h>

enum zo_dtype { ZO_DTYPE_NONE = 0, ZO_DTYPE_FP32 = 1, ZO_DTYPE_BF16 = 2, ZO_DTYPE_FP16 = 3 };
enum zo_simd { ZO_SIMD_SCALAR = 0, ZO_SIMD_AVX2 = 1, ZO_SIMD_AVX512 = 2 };

/* Hyperparameters are double because torch derives its per-step constants in double (and so
 * must we, to round them to the same floats). */
struct zo_adam_args {
    float *param;
    const void *grad;
    int grad_dtype;        /* ZO_DTYPE_FP32 | BF16 | FP16 */
    float *exp_avg;
    float *exp_avg_sq;
    void *out;             /* NULL when out_dtype is ZO_DTYPE_NONE */
    int out_dtype;         /* ZO_DTYPE_NONE | FP32 | BF16 | FP16 */
    size_t n;              /* elements of each array */
    double lr, beta1, beta2, eps, weight_decay;
    float grad_scale;
    int64_t step;          /* 1 for the first update */
    int adamw;             /* 1: decoupled weight decay (AdamW); 0: L2 added to the gradient (Adam) */
    double *grad_sumsq;    /* not NULL: receives the sum of the squares of grad as read (before
                              grad_scale), summed in the same pass (see SUMSQ_BLOCK for accuracy) */
};

/* Below this many elements per thread a pass is not worth another thread (starting one costs
 * ~30 us, about what one core needs for 128Ki elements); smaller passes run on the caller. */
#define ZO_ADAM_MIN_PER_THREAD ((size_t)1 << 17)
/* More threads than this cannot help a pass bound by memory bandwidth; larger requests are capped. */
#define ZO_ADAM_MAX_THREADS 256u

/* count updates, each of its n elements, as one split over threads (0: every CPU this process may
 * run on): one start and one join for them all, their elements streamed one after the other. Every
 * update is checked before any runs: -EINVAL (a NULL array, an unknown dtype, step < 1, or an unknown
 * ZO_ADAM_SIMD) leaves them all unapplied. A thread that cannot be started leaves its share to the
 * others, so no update is ever half applied. */
int zo_adam_steps(const struct zo_adam_args *args, size_t count, unsigned threads);

/* The sum of the squares of n elements of x (ZO_DTYPE_FP32 | BF16 | FP16), each squared in fp32 and
 * summed in blocks into a double; a sum that is not finite is taken again in double, so the result
 * is finite exactly when every element is. The norm of a
 * gradient nothing else reads (the update then sums it itself: grad_sumsq). -EINVAL: NULL sumsq, an
 * unknown dtype or NULL x with n > 0. */
int zo_sum_squares(const void *x, int dtype, size_t n, unsigned threads, double *sumsq);

/* The level passes run on (enum zo_simd), decided once per process; -EINVAL when ZO_ADAM_SIMD
 * names no level. */
int zo_adam_simd(void);

/* "avx512", "avx2" or "scalar". */
const char *zo_adam_simd_name(int level);

#endif
