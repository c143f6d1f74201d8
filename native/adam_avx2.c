/*
 * adam_avx2.c - the AVX2 (+FMA, F16C) level of the fused Adam pass: 8 elements a vector
 * (adam_pass.h). Compiled for plain x86-64; each function targets AVX2 itself (cpu_adam.c's note on
 * architectures), and nothing here runs unless the CPU has it.
 */
#include "int8_moments.h"

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
    typedef uint32_t lanes __attribute__((vector_size(32)));
    lanes v = (lanes)x;
    MIX32(v);
    return (__m256i)v;
}

/* The rounding noise of 8 elements from `index`: mix32((index + lane) ^ seed) in each lane. */
AVX2 static ALWAYS_INLINE __m256i avx2_noise(uint32_t index, uint32_t seed)
{
    __m256i lanes = _mm256_add_epi32(_mm256_set1_epi32((int)index), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return avx2_mix32(_mm256_xor_si256(lanes, _mm256_set1_epi32((int)seed)));
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
    __m256i noise = avx2_noise(s->noise_base + (uint32_t)i, s->k.noise_seed);
    _mm_storeu_si128((__m128i *)((uint16_t *)s->exp_avg + i),
                     avx2_bf16_stochastic(m, _mm256_and_si256(noise, _mm256_set1_epi32(0xFFFF))));
    _mm_storeu_si128((__m128i *)((uint16_t *)s->exp_avg_sq + i), avx2_bf16_stochastic(v, _mm256_srli_epi32(noise, 16)));
}

/* The update of 8 elements in place, their gradient's squares added to acc when the pass sums them. */
AVX2 static ALWAYS_INLINE __m256 avx2_update(const struct pass *s, const struct consts *k, __m256 *p, __m256 g,
                                             __m256 *m, __m256 *v, __m256 acc)
{
    if (s->sumsq)
        acc = _mm256_fmadd_ps(g, g, acc);
    ADAM_UPDATE(*k, *p, g, *m, *v, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_sqrt_ps);
    return acc;
}

/* Elements a staged range (below) carries through each of its three loops at a time: 256 bytes a
 * stream, 1 KiB in all, in the first-level cache. */
#define STAGE ((size_t)64)

/* bf16 moments, STAGE elements from i in three loops: the master, gradient and moments widened to fp32
 * in arrays; the update over those arrays; the results narrowed and stored. Why: in one loop doing all
 * three (as the other formats are run) an element group carries ~100 instructions with bf16 moments
 * (their stochastic rounding's hash among them), and the chain of a square root and two divisions in
 * each group then outlasts the core's reorder window, so the loop waits on it. Staged, the update's
 * loop is short and its groups overlap, while the widening and narrowing are integer work that overlaps
 * freely. Measured on an AVX2 AMD EPYC, 100M elements a core: split + bf16 moments 0.48 -> 0.58 G
 * elements/s (3 interleaved pairs). Since each precision has a loop of its own (avx2_range_as), a split
 * master with fp32 moments gains too (25M elements, 1 thread, 3 pairs: 0.93 -> 0.99), while an fp32
 * master with fp32 moments loses 11% (1.26 -> 1.12) and stays in one loop. The same instructions on
 * the same values: the same bits. */
AVX2 static ALWAYS_INLINE __m256 avx2_staged(const struct pass *s, const struct consts *k, size_t i, __m256 acc)
{
    float p[STAGE] __attribute__((aligned(32))), g[STAGE] __attribute__((aligned(32)));
    float m[STAGE] __attribute__((aligned(32))), v[STAGE] __attribute__((aligned(32)));
    for (size_t j = 0; j < STAGE; j += 8) {
        _mm256_store_ps(p + j, avx2_master(s, i + j));
        _mm256_store_ps(g + j, avx2_grad(s, i + j));
        _mm256_store_ps(m + j, avx2_moment(s, s->exp_avg, i + j));
        _mm256_store_ps(v + j, avx2_moment(s, s->exp_avg_sq, i + j));
    }
    for (size_t j = 0; j < STAGE; j += 8) {
        __m256 pj = _mm256_load_ps(p + j), mj = _mm256_load_ps(m + j), vj = _mm256_load_ps(v + j);
        acc = avx2_update(s, k, &pj, _mm256_load_ps(g + j), &mj, &vj, acc);
        _mm256_store_ps(p + j, pj);
        _mm256_store_ps(m + j, mj);
        _mm256_store_ps(v + j, vj);
    }
    for (size_t j = 0; j < STAGE; j += 8) {
        avx2_store_master(s, i + j, _mm256_load_ps(p + j));
        avx2_store_moments(s, i + j, _mm256_load_ps(m + j), _mm256_load_ps(v + j));
    }
    return acc;
}

/* A range of fp32 or bf16 moments: bf16 moments or a split master staged (avx2_staged) while whole stages
 * remain, every other element in one loop. */
AVX2 static ALWAYS_INLINE double avx2_range_of(const struct pass *s, size_t begin, size_t end)
{
    const struct consts k = s->k;
    int staged = s->moment_dtype == ZO_DTYPE_BF16 || s->split;
    size_t i = begin + split_head(s, begin, end, 8);
    double sumsq = scalar_range(s, begin, i);
    while (i + 8 <= end) {
        size_t block_end = end - i > SUMSQ_BLOCK ? i + SUMSQ_BLOCK : end;
        __m256 acc = _mm256_setzero_ps();
        for (; staged && i + STAGE <= block_end; i += STAGE)
            acc = avx2_staged(s, &k, i, acc);
        for (; i + 8 <= block_end; i += 8) {
            __m256 p = avx2_master(s, i), g = avx2_grad(s, i);
            __m256 m = avx2_moment(s, s->exp_avg, i), v = avx2_moment(s, s->exp_avg_sq, i);
            acc = avx2_update(s, &k, &p, g, &m, &v, acc);
            avx2_store_master(s, i, p);
            avx2_store_moments(s, i, m, v);
        }
        sumsq += avx2_sum(acc);
    }
    _mm_sfence();  /* the streamed stores are ordered before the tail's and the join's */
    return sumsq + scalar_range(s, i, end);
}

/* avx2_range_of on a copy of the pass whose dtypes and split are these constants. Why: through the
 * caller's pointer GCC must assume that the loop's stores may change the pass's fields, so the loop
 * reloads and tests every one of them for each vector; on a local copy with these fields constant it
 * drops those tests, and keeps only the loads and stores of these dtypes. Measured on an AVX2 AMD EPYC,
 * 25M elements, 1 thread, 3 interleaved pairs, bf16 gradient and weights: a split master 0.72 -> 0.89 G
 * elements/s, split + bf16 moments 0.57 -> 0.68, an fp32 master 0.88 -> 1.09; 2 threads, 100M: split
 * 1.18 -> 1.74, bf16 moments 1.12 -> 1.33. The same operations: the same bits. */
AVX2 static ALWAYS_INLINE double avx2_range_as(struct pass s, size_t begin, size_t end, int grad_dtype, int out_dtype,
                                              int split, int moment_dtype)
{
    s.grad_dtype = grad_dtype, s.out_dtype = out_dtype, s.split = split, s.moment_dtype = moment_dtype;
    return avx2_range_of(&s, begin, end);
}

/* avx2_range_as for fp32 or bf16 moments, as the pass has. */
AVX2 static ALWAYS_INLINE double avx2_range_by_moments(const struct pass *s, size_t begin, size_t end, int grad_dtype,
                                                      int out_dtype, int split)
{
    if (s->moment_dtype == ZO_DTYPE_BF16)
        return avx2_range_as(*s, begin, end, grad_dtype, out_dtype, split, ZO_DTYPE_BF16);
    return avx2_range_as(*s, begin, end, grad_dtype, out_dtype, split, ZO_DTYPE_FP32);
}

/* A range of fp32 or bf16 moments (int8 moments run as blocks of fp32 ones: int8_range), a loop of its
 * own for each of the engine's precisions (bf16: a gradient and weights in bf16, an fp32 or split master;
 * fp16; fp32, whose master is the weight) and one for any other pass. Only a bf16 out can be a split
 * master's weight (zo_adam_steps refuses any other), so the other precisions' masters are fp32. */
AVX2 static double avx2_range(const void *pass, size_t begin, size_t end)
{
    const struct pass *s = pass;
    int grad = s->grad_dtype, out = s->out_dtype;
    if (grad == ZO_DTYPE_BF16 && out == ZO_DTYPE_BF16)
        return s->split ? avx2_range_by_moments(s, begin, end, ZO_DTYPE_BF16, ZO_DTYPE_BF16, 1)
                        : avx2_range_by_moments(s, begin, end, ZO_DTYPE_BF16, ZO_DTYPE_BF16, 0);
    if (grad == ZO_DTYPE_FP16 && out == ZO_DTYPE_FP16)
        return avx2_range_by_moments(s, begin, end, ZO_DTYPE_FP16, ZO_DTYPE_FP16, 0);
    if (grad == ZO_DTYPE_FP32 && out == ZO_DTYPE_NONE)
        return avx2_range_by_moments(s, begin, end, ZO_DTYPE_FP32, ZO_DTYPE_NONE, 0);
    return avx2_range_as(*s, begin, end, grad, out, s->split, s->moment_dtype);
}

/* int8_code on 8 lanes of q in [0, 1] or NaN (int8_fraction's), each code in the low byte of its lane.
 * As there, each form computed and one chosen per lane, but the linear form only when a lane needs it:
 * a block's values lie within 2^-17 (m) or 2^-33 (v) of its largest but for zeros, so most vectors have
 * no such lane, and skipping its 7 operations makes the int8 pass 8% faster (AVX2 EPYC, 1 thread, 4
 * interleaved pairs: 0.327 -> 0.354 G elements/s). q's bit patterns are at most 1.0f's, so signed
 * comparisons order them. */
AVX2 static ALWAYS_INLINE __m256i avx2_int8_code(__m256 q, int bias, __m256i noise16)
{
    __m256i bits = _mm256_castps_si256(_mm256_and_ps(q, _mm256_cmp_ps(q, q, _CMP_ORD_Q)));
    __m256i zero_exponent = _mm256_set1_epi32((127 - bias) << 23);
    __m256i subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(((127 - bias) << 23) + (1 << 23)), bits);
    __m256i rebased = _mm256_srli_epi32(_mm256_sub_epi32(_mm256_add_epi32(bits, _mm256_slli_epi32(noise16, 4)),
                                                         zero_exponent), 20);
    if (_mm256_testz_si256(subnormal, subnormal))  /* the usual vector: no lane in the linear range */
        return rebased;
    __m256 steps = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(subnormal, bits)),
                                 _mm256_set1_ps(float_of((uint32_t)(127 + bias + 2) << 23)));
    __m256i linear = _mm256_cvttps_epi32(_mm256_add_ps(steps, _mm256_mul_ps(_mm256_cvtepi32_ps(noise16),
                                                                            _mm256_set1_ps(0x1p-16f))));
    return _mm256_blendv_epi8(rebased, linear, subnormal);
}

/* int8_fraction on 8 lanes (a NaN stays NaN: the comparison is false for it, as in C). |x|'s bit
 * patterns lie below 2^31, so a signed comparison orders them as the unsigned one there. */
AVX2 static ALWAYS_INLINE __m256 avx2_int8_fraction(__m256 x, __m256 reciprocal, __m256i top)
{
    __m256i magnitude = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF));
    __m256 q = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), reciprocal), one = _mm256_set1_ps(1.0f);
    q = _mm256_blendv_ps(q, one, _mm256_cmp_ps(q, one, _CMP_GT_OQ));
    __m256i below_top = _mm256_cmpgt_epi32(top, magnitude);
    return _mm256_blendv_ps(one, q, _mm256_castsi256_ps(below_top));
}

/* 8 lanes of codes (each below 256) as 8 bytes at `to`. */
AVX2 static ALWAYS_INLINE void avx2_store_bytes(uint8_t *to, __m256i codes)
{
    __m128i words = avx2_pack16(codes);
    _mm_storel_epi64((__m128i *)to, _mm_packus_epi16(words, words));
}

/* int8_codes with 8 lanes a vector: GCC's vectorized loop of the same arithmetic works 32 elements at
 * a time to fill a vector of bytes, and spills its lanes to the stack; 8 at a time, each packed down
 * to 8 bytes, stays in registers. The same operations on the same values as int8_code_range, which
 * codes the block's last n % 8. */
AVX2 static void avx2_int8_codes(const float *m, const float *v, size_t n, uint32_t noise_base, uint32_t seed,
                                 struct int8_block b, uint8_t *m_codes, uint8_t *v_codes)
{
    __m256 m_scaled = _mm256_set1_ps(b.m_reciprocal), v_scaled = _mm256_set1_ps(b.v_reciprocal);
    __m256i m_top = _mm256_set1_epi32((int)b.m_top), v_top = _mm256_set1_epi32((int)b.v_top);
    __m256i low16 = _mm256_set1_epi32(0xFFFF), sign_bit = _mm256_set1_epi32(0x80);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i noise = avx2_noise(noise_base + (uint32_t)i, seed);
        __m256 mi = _mm256_loadu_ps(m + i), vi = _mm256_loadu_ps(v + i);
        __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(mi), 24), sign_bit);
        __m256i m_code = avx2_int8_code(avx2_int8_fraction(mi, m_scaled, m_top), INT8_M_BIAS,
                                        _mm256_and_si256(noise, low16));
        __m256i v_code = avx2_int8_code(avx2_int8_fraction(vi, v_scaled, v_top), INT8_V_BIAS,
                                        _mm256_srli_epi32(noise, 16));
        avx2_store_bytes(m_codes + i, _mm256_or_si256(m_code, sign));
        avx2_store_bytes(v_codes + i, v_code);
    }
    int8_code_range(m, v, i, n, noise_base, seed, b, m_codes, v_codes);
}

AVX2 double zo_avx2_run(const void *pass, size_t begin, size_t end)
{
    return any_moments_range(pass, begin, end, avx2_range, avx2_int8_codes);
}


AVX2 double zo_avx2_sumsq(const void *pass, size_t begin, size_t end)
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
    return sumsq + scalar_sumsq_range(pass, i, end);
}
#endif
