/*
 * cpu_adam.h - one fused pass of Adam/AdamW over master parameters on the CPU (fp32, or split).
 *
 * Vocabulary
 *   param       fp32 master parameters, updated in place (master ZO_MASTER_FP32).
 *   split       the master held as its bf16 weight (out, read and written) plus a residual
 *               (master ZO_MASTER_SPLIT, no param): master bits = (weight << 16) + residual,
 *               sign-extended, + (residual bit << 16). The weight is the master rounded to nearest
 *               even (what the fp32 master's out would be), so master - weight, on the bit pattern,
 *               lies in [-0x8000, 0x8000]: 2^16 + 1 values, one more than 16 bits hold. The residual
 *               keeps its low 16 bits and the residual bit says "+0x8000, not -0x8000" (a tie that
 *               rounded down to an even weight). Exact for every float, inf included; a NaN stays a
 *               NaN. Element j's bit is bit (residual_bit0 + j) % 8 of byte (residual_bit0 + j) / 8.
 *   grad        the gradient, fp32, bf16 or fp16; read only. It is multiplied by grad_scale
 *               first (the engine's unscale x clip coefficient), in fp32.
 *   exp_avg     first moment m, updated in place: fp32, bf16 or int8 (moment_dtype).
 *   exp_avg_sq  second moment v, likewise.
 *   bf16 moments are computed in fp32 and stored rounded stochastically: the bits below bf16's
 *               are added to 16 bits of noise before truncation, so a moment's expected stored value
 *               is its fp32 value. Round to nearest would lose every change below half a bf16 unit
 *               (2^-9 relative): v * beta2 with beta2 = 0.999 would never decay. The noise is a hash
 *               of (noise_key, step, noise_base + j) for element j: the same bits whatever the level,
 *               the thread count or where a range starts, and the same for one parameter element
 *               however the parameters are sharded, when the caller numbers them so.
 *   int8 moments are blockwise 8-bit codes: element j of a moment is code j (uint8) of the array, in
 *               block j / ZO_INT8_BLOCK of the pass, whose scale is exp_avg_scale[j / ZO_INT8_BLOCK]
 *               (exp_avg_sq_scale for v), one fp32 each. The codes are a tiny float of |x| / scale
 *               (int8_moments.h), rounded stochastically with the bf16 moments' noise. Blocks count
 *               from the pass's element 0: a pass's first element starts a block.
 *   out         optional low-precision copy of the new param (bf16, fp16 or fp32), written in the
 *               same pass and rounded to nearest even exactly as torch's `.to(dtype)` rounds.
 *   level       the instruction set the pass runs on: AVX-512 (F and BW), AVX2 (+FMA, F16C) or scalar C,
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

enum zo_dtype { ZO_DTYPE_NONE = 0, ZO_DTYPE_FP32 = 1, ZO_DTYPE_BF16 = 2, ZO_DTYPE_FP16 = 3, ZO_DTYPE_INT8 = 4 };

/* Elements of an int8 moment that share a scale. 256: the scale costs 1/64 of a byte per element
 * (1.6%), one large value dims the codes of 255 neighbours only, and a block's decoded moments (2 KiB)
 * stay in the first-level cache while the level's pass runs over them; every block of a split
 * (cpu_adam.c) is a multiple of it, so a thread's range always starts a block. */
#define ZO_INT8_BLOCK ((size_t)256)
enum zo_simd { ZO_SIMD_SCALAR = 0, ZO_SIMD_AVX2 = 1, ZO_SIMD_AVX512 = 2 };
enum zo_master { ZO_MASTER_FP32 = 0, ZO_MASTER_SPLIT = 1 };

/* Hyperparameters are double because torch derives its per-step constants in double (and so
 * must we, to round them to the same floats). */
struct zo_adam_args {
    float *param;          /* ZO_MASTER_FP32 only */
    const void *grad;
    int grad_dtype;        /* ZO_DTYPE_FP32 | BF16 | FP16 */
    void *exp_avg;
    void *exp_avg_sq;
    int moment_dtype;      /* ZO_DTYPE_FP32 | BF16 | INT8 */
    float *exp_avg_scale;  /* ZO_DTYPE_INT8: the blocks' scales, (n + ZO_INT8_BLOCK - 1) / ZO_INT8_BLOCK each */
    float *exp_avg_sq_scale;
    void *out;             /* NULL when out_dtype is ZO_DTYPE_NONE; the weight (bf16) of a split master */
    int out_dtype;         /* ZO_DTYPE_NONE | FP32 | BF16 | FP16; BF16 with ZO_MASTER_SPLIT */
    int master;            /* ZO_MASTER_FP32 | ZO_MASTER_SPLIT */
    int16_t *residual;     /* ZO_MASTER_SPLIT: the residuals and their bits (split, above) */
    uint8_t *residual_bits;
    size_t residual_bit0;
    uint32_t noise_key;    /* bf16 and int8 moments: the rounding noise's key and element 0's number */
    uint32_t noise_base;
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
