/*
 * cpu_adam.c - the fused Adam/AdamW pass of cpu_adam.h: per-call constants, one range function
 * per instruction-set level, and the split of a pass over threads.
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
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

#define ALWAYS_INLINE inline __attribute__((always_inline))
#if ZO_ADAM_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
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
static ALWAYS_INLINE uint32_t mix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
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

static double scalar_run(const void *pass, size_t begin, size_t end)
{
    return scalar_range(pass, begin, end);
}

#if ZO_ADAM_X86
/* ---------------------------------------------------------------------------------------------
 * AVX2 + FMA + F16C: 8 elements a vector */

AVX2 static ALWAYS_INLINE __m256 avx2_grad(const struct pass *s, size_t i)
{
    if (s->grad_dtype == ZO_DTYPE_FP32)
        return _mm256_loadu_ps((const float *)s->grad + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)s->grad + i));
    if (s->grad_dtype == ZO_DTYPE_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* 8 lanes of 0 .. 0xFFFF as 8 16-bit values. */
AVX2 static ALWAYS_INLINE __m128i avx2_pack16(__m256i x)
{
    return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

/* 8 16-bit values (bf16 weights or moments) as the high halves of 8 lanes. */
AVX2 static ALWAYS_INLINE __m256i avx2_high16(const uint16_t *from)
{
    return _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)from)), 16);
}

/* fp32_to_bf16 on 8 lanes, each in the low half of its lane. */
AVX2 static ALWAYS_INLINE __m256i avx2_bf16_lanes(__m256 p)
{
    __m256i u = _mm256_castps_si256(p);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), nan);
}

AVX2 static ALWAYS_INLINE __m128i avx2_bf16(__m256 p)
{
    return avx2_pack16(avx2_bf16_lanes(p));
}

/* 16 bytes of out: past the caches when the pass streams its out and the address allows. */
AVX2 static ALWAYS_INLINE void avx2_out_store(const struct pass *s, __m128i *to, __m128i x)
{
    if (s->stream_out && ((uintptr_t)to & 15) == 0)
        _mm_stream_si128(to, x);
    else
        _mm_storeu_si128(to, x);
}

AVX2 static ALWAYS_INLINE void avx2_out(const struct pass *s, size_t i, __m256 p)
{
    uint16_t *half = (uint16_t *)s->out + i;
    float *full = (float *)s->out + i;
    if (s->out_dtype == ZO_DTYPE_FP32 && s->stream_out && ((uintptr_t)full & 31) == 0)
        _mm256_stream_ps(full, p);
    else if (s->out_dtype == ZO_DTYPE_FP32)
        _mm256_storeu_ps(full, p);
    else if (s->out_dtype == ZO_DTYPE_BF16)
        avx2_out_store(s, (__m128i *)half, avx2_bf16(p));
    else if (s->out_dtype == ZO_DTYPE_FP16)
        avx2_out_store(s, (__m128i *)half, _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* split_join on 8 lanes, from element i (residual_bit0 + i a multiple of 8: split_head). */
AVX2 static ALWAYS_INLINE __m256 avx2_master(const struct pass *s, size_t i)
{
    if (!s->split)
        return _mm256_loadu_ps(s->param + i);
    __m256i x = _mm256_add_epi32(avx2_high16((const uint16_t *)s->out + i),
                                 _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(s->residual + i))));
    __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i byte = _mm256_set1_epi32(s->residual_bits[(s->residual_bit0 + i) >> 3]);
    __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bit), lane_bit);
    return _mm256_castsi256_ps(_mm256_add_epi32(x, _mm256_and_si256(set, _mm256_set1_epi32(0x10000))));
}

AVX2 static ALWAYS_INLINE void avx2_store_master(const struct pass *s, size_t i, __m256 p)
{
    if (!s->split) {
        _mm256_storeu_ps(s->param + i, p);
        avx2_out(s, i, p);
        return;
    }
    __m256i weight = avx2_bf16_lanes(p);
    __m256i rest = _mm256_sub_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(weight, 16));
    __m256i tie = _mm256_cmpeq_epi32(rest, _mm256_set1_epi32(0x8000));
    _mm_storeu_si128((__m128i *)((uint16_t *)s->out + i), avx2_pack16(weight));
    _mm_storeu_si128((__m128i *)(s->residual + i), avx2_pack16(_mm256_and_si256(rest, _mm256_set1_epi32(0xFFFF))));
    s->residual_bits[(s->residual_bit0 + i) >> 3] = (uint8_t)_mm256_movemask_ps(_mm256_castsi256_ps(tie));
}

AVX2 static ALWAYS_INLINE __m256 avx2_moment(const struct pass *s, const void *moment, size_t i)
{
    if (s->moment_dtype == ZO_DTYPE_BF16)
        return _mm256_castsi256_ps(avx2_high16((const uint16_t *)moment + i));
    return _mm256_loadu_ps((const float *)moment + i);
}

/* mix32 on 8 lanes. */
AVX2 static ALWAYS_INLINE __m256i avx2_mix32(__m256i x)
{
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846CA68Bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* bf16_stochastic on 8 lanes. */
AVX2 static ALWAYS_INLINE __m128i avx2_bf16_stochastic(__m256 f, __m256i noise16)
{
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(f), noise16), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return avx2_pack16(_mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), nan));
}

AVX2 static ALWAYS_INLINE void avx2_store_moments(const struct pass *s, size_t i, __m256 m, __m256 v)
{
    if (s->moment_dtype != ZO_DTYPE_BF16) {
        _mm256_storeu_ps((float *)s->exp_avg + i, m);
        _mm256_storeu_ps((float *)s->exp_avg_sq + i, v);
        return;
    }
    __m256i index = _mm256_add_epi32(_mm256_set1_epi32((int)(s->noise_base + (uint32_t)i)),
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i noise = avx2_mix32(_mm256_xor_si256(index, _mm256_set1_epi32((int)s->k.noise_seed)));
    _mm_storeu_si128((__m128i *)((uint16_t *)s->exp_avg + i),
                     avx2_bf16_stochastic(m, _mm256_and_si256(noise, _mm256_set1_epi32(0xFFFF))));
    _mm_storeu_si128((__m128i *)((uint16_t *)s->exp_avg_sq + i), avx2_bf16_stochastic(v, _mm256_srli_epi32(noise, 16)));
}

AVX2 static ALWAYS_INLINE double avx2_sum(__m256 x)
{
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    __m128d pair = _mm_add_pd(_mm_cvtps_pd(half), _mm_cvtps_pd(_mm_movehl_ps(half, half)));
    return _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
}

AVX2 static double avx2_run(const void *pass, size_t begin, size_t end)
{
    const struct pass *s = pass;
    const struct consts k = s->k;
    size_t i = begin + split_head(s, begin, end, 8);
    double sumsq = scalar_range(s, begin, i);
    while (i + 8 <= end) {
        size_t block_end = end - i > SUMSQ_BLOCK ? i + SUMSQ_BLOCK : end;
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= block_end; i += 8) {
            __m256 p = avx2_master(s, i), g = avx2_grad(s, i);
            __m256 m = avx2_moment(s, s->exp_avg, i), v = avx2_moment(s, s->exp_avg_sq, i);
            if (s->sumsq)
                acc = _mm256_fmadd_ps(g, g, acc);
            ADAM_UPDATE(k, p, g, m, v, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_sqrt_ps);
            avx2_store_master(s, i, p);
            avx2_store_moments(s, i, m, v);
        }
        sumsq += avx2_sum(acc);
    }
    _mm_sfence();  /* the streamed stores are ordered before the tail's and the join's */
    return sumsq + scalar_range(s, i, end);
}

/* ---------------------------------------------------------------------------------------------
 * AVX-512F: 16 elements a vector */

AVX512 static ALWAYS_INLINE __m512 avx512_grad(const struct pass *s, size_t i)
{
    if (s->grad_dtype == ZO_DTYPE_FP32)
        return _mm512_loadu_ps((const float *)s->grad + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)s->grad + i));
    if (s->grad_dtype == ZO_DTYPE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* 16 16-bit values (bf16 weights or moments) as the high halves of 16 lanes. */
AVX512 static ALWAYS_INLINE __m512i avx512_high16(const uint16_t *from)
{
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)from)), 16);
}

/* fp32_to_bf16 on 16 lanes, each in the low half of its lane. */
AVX512 static ALWAYS_INLINE __m512i avx512_bf16_lanes(__m512 p)
{
    __m512i u = _mm512_castps_si512(p);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
}

AVX512 static ALWAYS_INLINE __m256i avx512_bf16(__m512 p)
{
    return _mm512_cvtepi32_epi16(avx512_bf16_lanes(p));
}

/* 32 bytes of out: past the caches when the pass streams its out and the address allows. */
AVX512 static ALWAYS_INLINE void avx512_out_store(const struct pass *s, __m256i *to, __m256i x)
{
    if (s->stream_out && ((uintptr_t)to & 31) == 0)
        _mm256_stream_si256(to, x);
    else
        _mm256_storeu_si256(to, x);
}

AVX512 static ALWAYS_INLINE void avx512_out(const struct pass *s, size_t i, __m512 p)
{
    __m256i *half = (__m256i *)((uint16_t *)s->out + i);
    float *full = (float *)s->out + i;
    if (s->out_dtype == ZO_DTYPE_FP32 && s->stream_out && ((uintptr_t)full & 63) == 0)
        _mm512_stream_ps(full, p);
    else if (s->out_dtype == ZO_DTYPE_FP32)
        _mm512_storeu_ps(full, p);
    else if (s->out_dtype == ZO_DTYPE_BF16)
        avx512_out_store(s, half, avx512_bf16(p));
    else if (s->out_dtype == ZO_DTYPE_FP16)
        avx512_out_store(s, half, _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* split_join on 16 lanes, from element i (residual_bit0 + i a multiple of 16: split_head). */
AVX512 static ALWAYS_INLINE __m512 avx512_master(const struct pass *s, size_t i)
{
    if (!s->split)
        return _mm512_loadu_ps(s->param + i);
    __m512i x = _mm512_add_epi32(avx512_high16((const uint16_t *)s->out + i),
                                 _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(s->residual + i))));
    uint16_t bits;
    memcpy(&bits, s->residual_bits + ((s->residual_bit0 + i) >> 3), sizeof(bits));
    return _mm512_castsi512_ps(_mm512_mask_add_epi32(x, (__mmask16)bits, x, _mm512_set1_epi32(0x10000)));
}

AVX512 static ALWAYS_INLINE void avx512_store_master(const struct pass *s, size_t i, __m512 p)
{
    if (!s->split) {
        _mm512_storeu_ps(s->param + i, p);
        avx512_out(s, i, p);
        return;
    }
    __m512i weight = avx512_bf16_lanes(p);
    __m512i rest = _mm512_sub_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(weight, 16));
    uint16_t ties = (uint16_t)_mm512_cmpeq_epi32_mask(rest, _mm512_set1_epi32(0x8000));
    _mm256_storeu_si256((__m256i *)((uint16_t *)s->out + i), _mm512_cvtepi32_epi16(weight));
    _mm256_storeu_si256((__m256i *)(s->residual + i), _mm512_cvtepi32_epi16(rest));
    memcpy(s->residual_bits + ((s->residual_bit0 + i) >> 3), &ties, sizeof(ties));
}

AVX512 static ALWAYS_INLINE __m512 avx512_moment(const struct pass *s, const void *moment, size_t i)
{
    if (s->moment_dtype == ZO_DTYPE_BF16)
        return _mm512_castsi512_ps(avx512_high16((const uint16_t *)moment + i));
    return _mm512_loadu_ps((const float *)moment + i);
}

/* mix32 on 16 lanes. */
AVX512 static ALWAYS_INLINE __m512i avx512_mix32(__m512i x)
{
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846CA68Bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* bf16_stochastic on 16 lanes. */
AVX512 static ALWAYS_INLINE __m256i avx512_bf16_stochastic(__m512 f, __m512i noise16)
{
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(f), noise16), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
    return _mm512_cvtepi32_epi16(r);
}

AVX512 static ALWAYS_INLINE void avx512_store_moments(const struct pass *s, size_t i, __m512 m, __m512 v)
{
    if (s->moment_dtype != ZO_DTYPE_BF16) {
        _mm512_storeu_ps((float *)s->exp_avg + i, m);
        _mm512_storeu_ps((float *)s->exp_avg_sq + i, v);
        return;
    }
    __m512i index = _mm512_add_epi32(_mm512_set1_epi32((int)(s->noise_base + (uint32_t)i)),
                                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m512i noise = avx512_mix32(_mm512_xor_si512(index, _mm512_set1_epi32((int)s->k.noise_seed)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)s->exp_avg + i),
                        avx512_bf16_stochastic(m, _mm512_and_si512(noise, _mm512_set1_epi32(0xFFFF))));
    _mm256_storeu_si256((__m256i *)((uint16_t *)s->exp_avg_sq + i),
                        avx512_bf16_stochastic(v, _mm512_srli_epi32(noise, 16)));
}

AVX512 static double avx512_run(const void *pass, size_t begin, size_t end)
{
    const struct pass *s = pass;
    const struct consts k = s->k;
    size_t i = begin + split_head(s, begin, end, 16);
    double sumsq = scalar_range(s, begin, i);
    while (i + 16 <= end) {
        size_t block_end = end - i > SUMSQ_BLOCK ? i + SUMSQ_BLOCK : end;
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= block_end; i += 16) {
            __m512 p = avx512_master(s, i), g = avx512_grad(s, i);
            __m512 m = avx512_moment(s, s->exp_avg, i), v = avx512_moment(s, s->exp_avg_sq, i);
            if (s->sumsq)
                acc = _mm512_fmadd_ps(g, g, acc);
            ADAM_UPDATE(k, p, g, m, v, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_sqrt_ps);
            avx512_store_master(s, i, p);
            avx512_store_moments(s, i, m, v);
        }
        sumsq += avx2_sum(_mm256_add_ps(_mm512_castps512_ps256(acc),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1))));
    }
    _mm_sfence();
    return sumsq + scalar_range(s, i, end);
}
#endif /* ZO_ADAM_X86 */

/* ---------------------------------------------------------------------------------------------
 * Sum of squares alone (zo_sum_squares): the gradient norm where no update reads the gradient */

struct sumsq_pass {
    const void *x;
    int dtype;
};

static double scalar_sumsq(const void *pass, size_t begin, size_t end)
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
AVX2 static double avx2_sumsq(const void *pass, size_t begin, size_t end)
{
    const struct sumsq_pass *s = pass;
    const struct pass as_grad = {.grad = s->x, .grad_dtype = s->dtype};
    double sumsq = 0;
    size_t i = begin;
    while (i + 16 <= end) {  /* two accumulators: one fused multiply-add chain would bound the pass */
        size_t block_end = end - i > SUMSQ_BLOCK ? i + SUMSQ_BLOCK : end;
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        for (; i + 16 <= block_end; i += 16) {
            __m256 x = avx2_grad(&as_grad, i), y = avx2_grad(&as_grad, i + 8);
            a = _mm256_fmadd_ps(x, x, a);
            b = _mm256_fmadd_ps(y, y, b);
        }
        sumsq += avx2_sum(_mm256_add_ps(a, b));
    }
    return sumsq + scalar_sumsq(pass, i, end);
}
#endif

static range_fn *const sumsq_run[] = {
    [ZO_SIMD_SCALAR] = scalar_sumsq,
#if ZO_ADAM_X86
    [ZO_SIMD_AVX2] = avx2_sumsq, [ZO_SIMD_AVX512] = avx2_sumsq,  /* bound by memory: AVX2 is enough */
#endif
};

/* ---------------------------------------------------------------------------------------------
 * Level: the CPU's best, or lower when ZO_ADAM_SIMD asks */

/* Indexed by a level no higher than cpu_level(), so off x86 only the scalar entry is ever read. */
static range_fn *const level_run[] = {
    [ZO_SIMD_SCALAR] = scalar_run,
#if ZO_ADAM_X86
    [ZO_SIMD_AVX2] = avx2_run, [ZO_SIMD_AVX512] = avx512_run,
#endif
};

static pthread_once_t level_once = PTHREAD_ONCE_INIT;
static int level_chosen;  /* enum zo_simd, or -EINVAL; written once under level_once */

static int cpu_level(void)
{
#if ZO_ADAM_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
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
    int moments_ok = a->moment_dtype == ZO_DTYPE_FP32 || a->moment_dtype == ZO_DTYPE_BF16;
    int split = a->master == ZO_MASTER_SPLIT;
    if (!grad_ok || !out_ok || !moments_ok || a->step < 1 || (a->master != ZO_MASTER_FP32 && !split) ||
        (split && a->out_dtype != ZO_DTYPE_BF16))
        return 0;
    /* torch hands out a null data pointer for an empty tensor, so pointers matter only when n > 0 */
    int master_ok = split ? a->out && a->residual && a->residual_bits : a->param != NULL;
    return a->n == 0 || (master_ok && a->grad && a->exp_avg && a->exp_avg_sq &&
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
