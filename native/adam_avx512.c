/*
 * adam_avx512.c - the AVX-512F level of the fused Adam pass: 16 elements a vector (adam_pass.h).
 * Compiled for plain x86-64; each function targets AVX-512F itself (cpu_adam.c's note on
 * architectures), and nothing here runs unless the CPU has it.
 */
#include "int8_moments.h"

#if ZO_ADAM_X86
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
    typedef uint32_t lanes __attribute__((vector_size(64)));
    lanes v = (lanes)x;
    MIX32(v);
    return (__m512i)v;
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

/* A range of fp32 or bf16 moments. */
AVX512 static double avx512_range(const void *pass, size_t begin, size_t end)
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

AVX512 double zo_avx512_run(const void *pass, size_t begin, size_t end)
{
    return any_moments_range(pass, begin, end, avx512_range, int8_codes);
}
#endif
