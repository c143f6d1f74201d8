/*
 * int8_moments.h - moments kept as blockwise 8-bit codes (cpu_adam.h: int8 moments), and the range
 * function that runs a level's pass over them a block at a time. Included by the level files alone
 * (cpu_adam.c's scalar level, adam_avx2.c, adam_avx512.c), so that the loops below are compiled, and
 * vectorized by GCC, for each level's instruction set: plain C with IEEE operations and integer
 * arithmetic, so every level gives the same bits. (The AVX2 level codes whole vectors of a block with
 * intrinsics of the same operations: adam_avx2.c's avx2_int8_codes.)
 *
 * A block's values x are stored as one fp32 scale, the largest finite |x| in the block, and a code per
 * element for q = |x| / scale in [0, 1] (the largest takes q = 1, the top code, always; a non-finite
 * value codes as the largest, so it spoils no other value of its block). The code is a tiny float of q:
 * 3 mantissa bits and an exponent field f, biased so that q = 1 is the top exponent; f = 0 is the
 * subnormal range, linear down to 0, so that the map is continuous and monotone:
 *   code c >= 8: q = 2^(c/8 - bias) x (1 + (c % 8) / 8)      code c < 8: q = c x 2^(-bias - 2)
 * exp_avg: a sign bit and 7 bits (bias 15: 4 exponent bits, |m| down to 2^-17 of the block's largest);
 * exp_avg_sq (never negative): 8 bits (bias 31: 5 exponent bits, v down to 2^-33 of the largest,
 * the square of m's range, as v ~ g^2). A linear map would make every v below 1/255 of the block's
 * largest 0, and the update m / (sqrt(v) + eps) of such an element would explode. Rounding is
 * stochastic with the bf16 moments' noise (cpu_adam.h), added below the code's last bit: unbiased, so
 * that v's 0.1%-per-step decay survives codes 12.5% apart.
 */
#ifndef ZO_INT8_MOMENTS_H
#define ZO_INT8_MOMENTS_H

#include "adam_pass.h"

#define INT8_M_BIAS 15
#define INT8_V_BIAS 31

/* q in [0, 1] (a NaN: 0) as its code's magnitude, rounded up with probability given by 16 bits of
 * noise. Written without branches, each form computed and one chosen, so that GCC vectorizes it. */
static ALWAYS_INLINE uint32_t int8_code(float q, int bias, uint32_t noise16)
{
    uint32_t bits = bits_of(q == q ? q : 0.0f), zero_exponent = (uint32_t)(127 - bias) << 23;
    int normal = bits >= zero_exponent + (1u << 23);
    uint32_t rebased = (bits + (noise16 << 4) - zero_exponent) >> 20;  /* q's bit pattern cut to 8 bits */
    float steps = float_of(normal ? 0 : bits) * float_of((uint32_t)(127 + bias + 2) << 23);  /* [0, 8), exact */
    uint32_t linear = (uint32_t)(int32_t)(steps + (float)noise16 * 0x1p-16f);
    return normal ? rebased : linear;
}

/* The value q in [0, 1] of a code's magnitude. */
static ALWAYS_INLINE float int8_value(uint32_t code, int bias)
{
    float rebased = float_of((code << 20) + ((uint32_t)(127 - bias) << 23));
    float linear = (float)(int32_t)code * float_of((uint32_t)(127 - bias - 2) << 23);
    return code >= 8 ? rebased : linear;
}

/* n codes of exp_avg (signed) or exp_avg_sq and their block's scale, as floats into x. */
static ALWAYS_INLINE void int8_decode(const uint8_t *codes, float scale, size_t n, int is_signed, float *x)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t code = codes[i];
        float q = is_signed ? int8_value(code & 0x7F, INT8_M_BIAS) : int8_value(code, INT8_V_BIAS);
        uint32_t sign = is_signed ? (code & 0x80) << 24 : 0;
        x[i] = float_of(bits_of(q * scale) | sign);
    }
}

/* The largest finite |x[i]| of n: the scale of their block. A non-finite value is left out, so that it
 * costs its block nothing but itself (it codes as the block's largest: int8_fraction). As integers, the
 * bit patterns of |x| order as the values do, and inf's and a NaN's lie at 0x7F800000 and above. */
static ALWAYS_INLINE float int8_scale(const float *x, size_t n)
{
    uint32_t largest = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t a = bits_of(x[i]) & 0x7FFFFFFF;
        a = a < 0x7F800000u ? a : 0;
        largest = a > largest ? a : largest;
    }
    return float_of(largest);
}

/* How one block codes: the reciprocals of its moments' scales (a division per block, not per element)
 * and the |x| bit patterns at and above which an element codes as q = 1, the top code. */
struct int8_block {
    float m_reciprocal, v_reciprocal;
    uint32_t m_top, v_top;
};

/* The top-code threshold of a block's scale: the scale's own bit pattern, so that the block's largest
 * takes q = 1 exactly, whatever |x| x (1 / scale) rounds to (0.99999994 for ~12% of floats: coded below
 * the top, a save and load would give the block a new scale and new codes); inf's for a block of zeros,
 * whose non-finite values then code as the top too. */
static ALWAYS_INLINE uint32_t int8_top(float scale)
{
    uint32_t bits = bits_of(scale);
    return bits ? bits : 0x7F800000u;
}

static ALWAYS_INLINE struct int8_block int8_block_of(float m_scale, float v_scale)
{
    return (struct int8_block){1.0f / m_scale, 1.0f / v_scale, int8_top(m_scale), int8_top(v_scale)};
}

/* q = |x| / scale in [0, 1], as |x| times the scale's reciprocal: 1 at and above `top` (the block's
 * largest, and a non-finite value: coded as the largest finite one, its sign kept), at most 1 below it.
 * A NaN only where |x| is 0 in a block of zeros (0 x inf), which int8_code takes as 0. */
static ALWAYS_INLINE float int8_fraction(float x, float reciprocal, uint32_t top)
{
    uint32_t a = bits_of(x) & 0x7FFFFFFF;
    float q = float_of(a) * reciprocal;
    q = q > 1.0f ? 1.0f : q;
    return a >= top ? 1.0f : q;
}

/* Codes of elements [from, n) of a block's new moments m and v, given how their block codes (b);
 * element i's noise is mix32((noise_base + i) ^ seed), its low 16 bits for m, its
 * high 16 for v (as bf16 moments round). A level may code the whole vectors of a block itself and
 * leave the rest to this (adam_avx2.c). */
static ALWAYS_INLINE void int8_code_range(const float *m, const float *v, size_t from, size_t n, uint32_t noise_base,
                                          uint32_t seed, struct int8_block b, uint8_t *m_codes, uint8_t *v_codes)
{
    for (size_t i = from; i < n; i++) {
        uint32_t noise = mix32((noise_base + (uint32_t)i) ^ seed);
        uint32_t sign = bits_of(m[i]) >> 24 & 0x80;
        float q = int8_fraction(m[i], b.m_reciprocal, b.m_top);
        m_codes[i] = (uint8_t)(int8_code(q, INT8_M_BIAS, noise & 0xFFFF) | sign);
        v_codes[i] = (uint8_t)int8_code(int8_fraction(v[i], b.v_reciprocal, b.v_top), INT8_V_BIAS, noise >> 16);
    }
}

/* A level's code loop over a whole block: int8_code_range's arguments from 0. */
typedef void int8_codes_fn(const float *m, const float *v, size_t n, uint32_t noise_base, uint32_t seed,
                           struct int8_block b, uint8_t *m_codes, uint8_t *v_codes);

/* int8_code_range over a whole block: the levels whose compiler-vectorized loop serves. */
static ALWAYS_INLINE void int8_codes(const float *m, const float *v, size_t n, uint32_t noise_base, uint32_t seed,
                                     struct int8_block b, uint8_t *m_codes, uint8_t *v_codes)
{
    int8_code_range(m, v, 0, n, noise_base, seed, b, m_codes, v_codes);
}

/* One block's n new moments m and v as codes (by the level's `codes`) and scales. A block of zeros
 * has scale 0 and codes 0; a non-finite value is isolated: it codes as its block's largest finite
 * magnitude (with its sign), and the block's other values keep theirs. */
static ALWAYS_INLINE void int8_encode(const float *m, const float *v, size_t n, uint32_t noise_base, uint32_t seed,
                                      uint8_t *m_codes, uint8_t *v_codes, float *m_scale, float *v_scale,
                                      int8_codes_fn *codes)
{
    *m_scale = int8_scale(m, n);
    *v_scale = int8_scale(v, n);
    codes(m, v, n, noise_base, seed, int8_block_of(*m_scale, *v_scale), m_codes, v_codes);
}

/* Elements [begin, end) of a pass with int8 moments (begin a multiple of ZO_INT8_BLOCK, as every range
 * of a split is), a block at a time: its moments decoded into fp32 arrays on the stack, the level's
 * fp32-moment pass `run` over the block, the new moments encoded. No block is ever widened in memory
 * beyond these 2 KiB, which stay in the first-level cache. */
static ALWAYS_INLINE double int8_range(const struct pass *s, size_t begin, size_t end, range_fn *run,
                                       int8_codes_fn *codes)
{
    static const size_t dtype_size[] = {[ZO_DTYPE_NONE] = 0, [ZO_DTYPE_FP32] = 4, [ZO_DTYPE_BF16] = 2,
                                        [ZO_DTYPE_FP16] = 2};
    float m[ZO_INT8_BLOCK] __attribute__((aligned(64))), v[ZO_INT8_BLOCK] __attribute__((aligned(64)));
    double sumsq = 0;
    for (size_t at = begin; at < end; at += ZO_INT8_BLOCK) {
        size_t n = end - at < ZO_INT8_BLOCK ? end - at : ZO_INT8_BLOCK, block = at / ZO_INT8_BLOCK;
        uint8_t *m_codes = (uint8_t *)s->exp_avg + at, *v_codes = (uint8_t *)s->exp_avg_sq + at;
        int8_decode(m_codes, s->exp_avg_scale[block], n, 1, m);
        int8_decode(v_codes, s->exp_avg_sq_scale[block], n, 0, v);
        struct pass sub = *s;  /* the block as a pass of its own, its moments fp32 */
        sub.exp_avg = m, sub.exp_avg_sq = v, sub.moment_dtype = ZO_DTYPE_FP32;
        sub.param = s->param ? s->param + at : NULL;
        sub.grad = (const char *)s->grad + at * dtype_size[s->grad_dtype];
        sub.out = s->out ? (char *)s->out + at * dtype_size[s->out_dtype] : NULL;
        sub.residual = s->residual ? s->residual + at : NULL;
        sub.residual_bit0 = s->residual_bit0 + at;
        sumsq += run(&sub, 0, n);
        int8_encode(m, v, n, s->noise_base + (uint32_t)at, s->k.noise_seed, m_codes, v_codes,
                    &s->exp_avg_scale[block], &s->exp_avg_sq_scale[block], codes);
    }
    return sumsq;
}

/* A level's range function over any moment format: int8 moments a block at a time (int8_range, the
 * level's `codes` coding them), the others by the level's own `range`. */
static ALWAYS_INLINE double any_moments_range(const void *pass, size_t begin, size_t end, range_fn *range,
                                              int8_codes_fn *codes)
{
    const struct pass *s = pass;
    return s->moment_dtype == ZO_DTYPE_INT8 ? int8_range(s, begin, end, range, codes) : range(s, begin, end);
}

#endif
