/*
 * adam_pass.h - one pass of the fused Adam update as every level runs it (cpu_adam.c's vocabulary):
 * its per-call constants and arrays (struct consts, struct pass), the element arithmetic
 * (ADAM_UPDATE), the state formats element by element (the scalar level, and every vector level's
 * head and tail), and the level functions the vector files define (adam_avx2.c, adam_avx512.c).
 * Included by those three files alone; everything here is static inline but the level functions.
 */
#ifndef ZO_ADAM_PASS_H
#define ZO_ADAM_PASS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_adam.h"

#if (defined(__x86_64__) || defined(__i386__)) && !defined(ZO_ADAM_SCALAR_ONLY)
#define ZO_ADAM_X86 1
#include <immintrin.h>
#else
#define ZO_ADAM_X86 0
#endif

/* GCC contracts a * b + c into one fused multiply-add wherever the target has FMA (its default
 * for GNU C is -ffp-contract=fast, and it applies to vector intrinsics too), so which products
 * are fused would depend on the level and on the optimizer's whims. Off: the fused multiply-adds
 * that torch's binary has are written out (ADAM_UPDATE), every other product is rounded. */
#pragma GCC optimize("fp-contract=off")
/* Floating-point exceptions are never read here, so GCC may compute both sides of a choice and keep
 * one (int8_moments.h's code and value are branch-free that way): with trapping math on, it keeps
 * such loops scalar. Results are IEEE's either way. */
#pragma GCC optimize("no-trapping-math")

#define ALWAYS_INLINE inline __attribute__((always_inline))
#if ZO_ADAM_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c,prefer-vector-width=512")))
#endif

enum decay_kind {
    DECAY_NONE,   /* weight_decay == 0: torch skips both forms (adding p * 0 is not a no-op for inf) */
    DECAY_ADAMW,  /* param *= 1 - lr * weight_decay, before the update */
    DECAY_L2,     /* grad += weight_decay * param */
};

struct consts {
    float grad_scale;
    int decay_kind;
    float decay;                 /* DECAY_ADAMW: 1 - lr * weight_decay */
    float weight_decay;          /* DECAY_L2 */
    int lerp_small;              /* torch's lerp of m toward g by w = 1 - beta1: m + w (g - m) when */
    float lerp_coeff;            /* |w| < 0.5, else g + (w - 1)(g - m); coeff is w or w - 1 */
    float beta2, one_minus_beta2;
    float bias_correction2_sqrt; /* sqrt(1 - beta2^step) */
    float eps;
    float neg_step_size;         /* -lr / (1 - beta1^step) */
    uint32_t noise_seed;         /* bf16 moments: this call's noise, from noise_key and step */
};

struct pass {
    float *param;
    void *exp_avg, *exp_avg_sq;
    float *exp_avg_scale, *exp_avg_sq_scale;  /* int8 moments: each block's scale (int8_moments.h) */
    const void *grad;
    void *out;
    int grad_dtype, out_dtype, moment_dtype;
    int split;                   /* the master is out + residual (cpu_adam.h: split) */
    int16_t *residual;
    uint8_t *residual_bits;
    size_t residual_bit0;
    uint32_t noise_base;
    int sumsq;                   /* also sum the squares of the gradient as read (before grad_scale) */
    int stream_out;              /* write out past the caches (STREAM_OUT_MIN) */
    struct consts k;
};

/* A pass this long writes its out copy with non-temporal stores where the address allows: out is
 * written and not read, so an ordinary store first reads each of its cache lines (2 of the 30 bytes
 * an element moves with a bf16 out), and a copy this large would not stay in the caches for the next
 * forward anyway. Measured at 100M elements, bf16 gradient and out (AVX2, 2 threads): the pass
 * 0.94x (0.87-1.18 over 8 interleaved rounds). Shorter passes keep their out in the caches. */
#define STREAM_OUT_MIN ((size_t)1 << 20)

/* A range function runs elements [begin, end) of its pass (struct pass, struct sumsq_pass) and
 * returns their sum of squares (0 when the pass does not ask for it). */
typedef double range_fn(const void *pass, size_t begin, size_t end);

/* Vector levels sum squares in fp32 lanes over blocks this long, then add the block's sum into a
 * double: lanes never add more than a few hundred terms, so the sum stays accurate to ~1e-6 (the
 * result is a norm for statistics and clipping, not bitwise state). */
#define SUMSQ_BLOCK ((size_t)4096)

/* The update of p, m, v from g as torch's binary computes it, for a float or a vector of floats
 * (GCC's vector types take the same operators, a float operand standing for every lane). torch
 * writes one fused multiply-add (its lerp of m); GCC contracts two more of its products into the
 * sum that follows in the same basic block (the L2 decay and v: found by matching torch 2.13's
 * results bit for bit; AdamW's decay sits in a branch of its own and is not fused), so those are
 * fused here too, explicitly, and nothing else is. k: struct consts; BCAST(x): x in every lane;
 * FMA(a, b, c): a * b + c rounded once; SQRT: the IEEE square root. */
#define ADAM_UPDATE(k, p, g, m, v, BCAST, FMA, SQRT)                                              \
    do {                                                                                         \
        (g) = (g) * (k).grad_scale;                                                              \
        if ((k).decay_kind == DECAY_L2)                                                          \
            (g) = FMA((p), BCAST((k).weight_decay), (g));                                        \
        (m) = FMA(BCAST((k).lerp_coeff), (g) - (m), (k).lerp_small ? (m) : (g));                 \
        (v) = FMA((k).one_minus_beta2 * (g), (g), (v) * (k).beta2);                              \
        __typeof__(p) update_ = (k).neg_step_size * (m) / (SQRT(v) / (k).bias_correction2_sqrt + \
                                                           (k).eps);                             \
        if ((k).decay_kind == DECAY_ADAMW)                                                       \
            (p) = (p) * (k).decay;                                                               \
        (p) = (p) + update_;                                                                     \
    } while (0)

#define SAME(x) (x)

/* ---------------------------------------------------------------------------------------------
 * Scalar: the reference level, and every vector level's tail */

static ALWAYS_INLINE uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static ALWAYS_INLINE float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* As F16C's vcvtph2ps: exact, a NaN made quiet. */
static ALWAYS_INLINE float fp16_to_fp32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    if (exp == 0x1F)
        return float_of(sign | 0x7F800000 | mant << 13 | (mant ? 0x400000 : 0));
    if (exp == 0)  /* zero or subnormal: mant x 2^-24, exact in fp32 */
        return float_of(sign | bits_of((float)mant * 0x1p-24f));
    return float_of(sign | (exp + 112) << 23 | mant << 13);
}

/* |f| < 2^-14 (bits a) in units of 2^-24, the fp16 subnormal step, rounded to nearest even. */
static ALWAYS_INLINE uint16_t fp16_subnormal(uint32_t a)
{
    uint32_t exp = a >> 23;
    if (exp < 102)  /* below 2^-25, half a step */
        return 0;
    uint32_t mant = (a & 0x7FFFFF) | 0x800000, shift = 126 - exp;  /* 14 .. 24 */
    uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    return (uint16_t)(q + (rem > half || (rem == half && (q & 1))));
}

/* As F16C's vcvtps2ph with round to nearest even (what torch's .to(torch.float16) runs): a NaN
 * stays NaN, made quiet, sign and top payload bits kept; 65520 and above become inf. */
static ALWAYS_INLINE uint16_t fp32_to_fp16(float f)
{
    uint32_t u = bits_of(f), a = u & 0x7FFFFFFF;
    uint16_t sign = (uint16_t)(u >> 16 & 0x8000);
    if (a > 0x7F800000)
        return sign | 0x7E00 | (uint16_t)(a >> 13 & 0x1FF);
    if (a >= 0x477FF000)
        return sign | 0x7C00;
    if (a < 0x38800000)
        return sign | fp16_subnormal(a);
    uint32_t r = a - 0x38000000;  /* rebias the exponent from 127 to 15 */
    return sign | (uint16_t)((r + 0xFFF + (r >> 13 & 1)) >> 13);
}

/* As torch's vectorized fp32 -> bf16 (ATen's cvtfp32_bf16): round to nearest even on the bit
 * pattern, and every NaN becomes 0xFFFF. */
static ALWAYS_INLINE uint16_t fp32_to_bf16(float f)
{
    uint32_t u = bits_of(f);
    if (f != f)
        return 0xFFFF;
    return (uint16_t)((u + 0x7FFF + (u >> 16 & 1)) >> 16);
}

/* A split master's element (cpu_adam.h: split): the weight, the residual, its bit. */
static ALWAYS_INLINE float split_join(uint16_t weight, int16_t residual, uint32_t bit)
{
    return float_of(((uint32_t)weight << 16) + (uint32_t)(int32_t)residual + (bit << 16));
}

/* Bit i of the pass's residual bits. Bytes at the ends of a range may be shared with another range
 * (another block of the pass, or another pass), so their bits are changed atomically. */
static ALWAYS_INLINE uint32_t residual_bit(const struct pass *s, size_t i)
{
    size_t b = s->residual_bit0 + i;
    return s->residual_bits[b >> 3] >> (b & 7) & 1u;
}

static ALWAYS_INLINE void set_residual_bit(const struct pass *s, size_t i, uint32_t bit)
{
    size_t b = s->residual_bit0 + i;
    uint8_t mask = (uint8_t)(1u << (b & 7));
    if (bit)
        __atomic_fetch_or(&s->residual_bits[b >> 3], mask, __ATOMIC_RELAXED);
    else
        __atomic_fetch_and(&s->residual_bits[b >> 3], (uint8_t)~mask, __ATOMIC_RELAXED);
}

/* lowbias32 (Chris Wellons' integer hash): a bijection of 32 bits whose output bits each depend on
 * every input bit; the bf16 moments' rounding noise. */
#define MIX32(x)                \
    do {                        \
        (x) ^= (x) >> 16;       \
        (x) *= 0x7FEB352Du;     \
        (x) ^= (x) >> 15;       \
        (x) *= 0x846CA68Bu;     \
        (x) ^= (x) >> 16;       \
    } while (0)

/* MIX32 on one uint32_t, or on every lane of a GCC vector of them (the vector levels' mix32). */
static ALWAYS_INLINE uint32_t mix32(uint32_t x)
{
    MIX32(x);
    return x;
}

/* f rounded to bf16 stochastically with 16 bits of noise (cpu_adam.h: bf16 moments); NaN as torch's. */
static ALWAYS_INLINE uint16_t bf16_stochastic(float f, uint32_t noise16)
{
    if (f != f)
        return 0xFFFF;
    return (uint16_t)((bits_of(f) + noise16) >> 16);
}

static ALWAYS_INLINE float scalar_moment(const struct pass *s, const void *moment, size_t i)
{
    if (s->moment_dtype == ZO_DTYPE_BF16)
        return float_of((uint32_t)((const uint16_t *)moment)[i] << 16);
    return ((const float *)moment)[i];
}

static ALWAYS_INLINE void scalar_store_moments(const struct pass *s, size_t i, float m, float v)
{
    if (s->moment_dtype == ZO_DTYPE_BF16) {
        uint32_t noise = mix32((s->noise_base + (uint32_t)i) ^ s->k.noise_seed);
        ((uint16_t *)s->exp_avg)[i] = bf16_stochastic(m, noise & 0xFFFF);
        ((uint16_t *)s->exp_avg_sq)[i] = bf16_stochastic(v, noise >> 16);
    } else {
        ((float *)s->exp_avg)[i] = m;
        ((float *)s->exp_avg_sq)[i] = v;
    }
}

static ALWAYS_INLINE float scalar_master(const struct pass *s, size_t i)
{
    if (s->split)
        return split_join(((const uint16_t *)s->out)[i], s->residual[i], residual_bit(s, i));
    return s->param[i];
}

static ALWAYS_INLINE float scalar_grad(const struct pass *s, size_t i)
{
    switch (s->grad_dtype) {
    case ZO_DTYPE_FP32: return ((const float *)s->grad)[i];
    case ZO_DTYPE_BF16: return float_of((uint32_t)((const uint16_t *)s->grad)[i] << 16);
    default: return fp16_to_fp32(((const uint16_t *)s->grad)[i]);
    }
}

static ALWAYS_INLINE void scalar_out(const struct pass *s, size_t i, float p)
{
    switch (s->out_dtype) {
    case ZO_DTYPE_FP32: ((float *)s->out)[i] = p; break;
    case ZO_DTYPE_BF16: ((uint16_t *)s->out)[i] = fp32_to_bf16(p); break;
    case ZO_DTYPE_FP16: ((uint16_t *)s->out)[i] = fp32_to_fp16(p); break;
    default: break;
    }
}

/* The new master p: a split one as its weight (out), residual and bit; an fp32 one and its out. */
static ALWAYS_INLINE void scalar_store_master(const struct pass *s, size_t i, float p)
{
    if (s->split) {
        uint16_t weight = fp32_to_bf16(p);
        uint32_t rest = bits_of(p) - ((uint32_t)weight << 16);
        ((uint16_t *)s->out)[i] = weight;
        s->residual[i] = (int16_t)(uint16_t)rest;
        set_residual_bit(s, i, rest == 0x8000);
        return;
    }
    s->param[i] = p;
    scalar_out(s, i, p);
}

/* Inlined into each vector level, so its fmaf is that level's fused multiply-add instruction. */
static ALWAYS_INLINE double scalar_range(const struct pass *s, size_t begin, size_t end)
{
    const struct consts k = s->k;  /* a local copy: the stores below cannot alias it */
    double sumsq = 0;
    for (size_t i = begin; i < end; i++) {
        float p = scalar_master(s, i), g = scalar_grad(s, i);
        float m = scalar_moment(s, s->exp_avg, i), v = scalar_moment(s, s->exp_avg_sq, i);
        if (s->sumsq)
            sumsq += (double)g * g;
        ADAM_UPDATE(k, p, g, m, v, SAME, fmaf, sqrtf);
        scalar_store_master(s, i, p);
        scalar_store_moments(s, i, m, v);
    }
    return sumsq;
}

/* Elements from begin that a vector level leaves to the scalar code so that its vectors of a split
 * master start on a whole byte (lanes 8) or 16-bit word (lanes 16) of residual bits. */
static ALWAYS_INLINE size_t split_head(const struct pass *s, size_t begin, size_t end, size_t lanes)
{
    if (!s->split)
        return 0;
    size_t head = (lanes - (s->residual_bit0 + begin) % lanes) % lanes;
    return head < end - begin ? head : end - begin;
}


struct sumsq_pass {
    const void *x;
    int dtype;
};

/* The sum of squares of a gradient alone, elements [begin, end) (zo_sum_squares). */
static ALWAYS_INLINE double scalar_sumsq_range(const void *pass, size_t begin, size_t end)
{
    const struct sumsq_pass *s = pass;
    const struct pass as_grad = {.grad = s->x, .grad_dtype = s->dtype};
    double sumsq = 0;
    for (size_t i = begin; i < end; i++) {
        double g = scalar_grad(&as_grad, i);
        sumsq += g * g;
    }
    return sumsq;
}


#if ZO_ADAM_X86
AVX2 static ALWAYS_INLINE double avx2_sum(__m256 x)
{
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    __m128d pair = _mm_add_pd(_mm_cvtps_pd(half), _mm_cvtps_pd(_mm_movehl_ps(half, half)));
    return _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
}


/* The vector levels (a range function each: range_fn). */
double zo_avx2_run(const void *pass, size_t begin, size_t end);
double zo_avx2_sumsq(const void *pass, size_t begin, size_t end);
double zo_avx512_run(const void *pass, size_t begin, size_t end);
#endif

#endif
