/*
 * quantize.c - the block code of quantize.h at three levels: scalar C, AVX2 and AVX-512 (x86 intrinsics,
 * each function compiled for its level by a target attribute and chosen by __builtin_cpu_supports, as
 * in cpu_adam.c). The levels share the per-block arithmetic (block_params: scale = amax / qmax and the
 * multiplier qmax / amax, each one IEEE division) and differ only in how many elements one instruction
 * takes, so they give the same bits: the vector conversions round to nearest even as lrintf does.
 * The 4-bit code (gradients at bits 4) packs nibbles in scalar C at every level; its block maxima use
 * the level's vectors.
 */
#include "quantize.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && !defined(ZO_ADAM_SCALAR_ONLY)
#define ZO_Q_X86 1
#include <immintrin.h>
#else
#define ZO_Q_X86 0
#endif

/* Blocks whose largest magnitude is below this code as zeros: qmax / amax would overflow float. */
#define TINY 0x1p-120f

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);  /* a NaN stays a (quiet) NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  /* nearest even, as torch rounds */
}

static inline float load(const void *src, int dtype, size_t i)
{
    return dtype == ZO_Q_BF16 ? bf16_to_f32(((const uint16_t *)src)[i]) : ((const float *)src)[i];
}

/* The block's scale and multiplier from its largest magnitude (INFINITY: the block is not finite). */
static void block_params(float amax, int qmax, float *scale, float *inv)
{
    if (!(amax < INFINITY)) {
        *scale = NAN;
        *inv = 0.0f;
    } else if (amax < TINY) {
        *scale = 0.0f;
        *inv = 0.0f;
    } else {
        *scale = amax / (float)qmax;
        *inv = (float)qmax / amax;
    }
}

static inline int clamp_code(long q, int qmax)
{
    return q > qmax ? qmax : q < -qmax ? -qmax : (int)q;
}

/* ---------------------------------------------------------------------------------------------
 * Scalar level */

static float scalar_amax(const void *src, int dtype, size_t begin, size_t end)
{
    float m = 0.0f;
    int finite = 1;
    for (size_t i = begin; i < end; i++) {
        float a = fabsf(load(src, dtype, i));
        finite &= a < INFINITY;
        m = a > m ? a : m;
    }
    return finite ? m : INFINITY;
}

static void scalar_codes8(const void *src, int dtype, size_t begin, size_t end, float inv, uint8_t *codes)
{
    for (size_t i = begin; i < end; i++)
        codes[i] = (uint8_t)(int8_t)clamp_code(lrintf(load(src, dtype, i) * inv), 127);
}

static void scalar_decode8(const uint8_t *codes, size_t begin, size_t end, float scale, void *dst, int dtype,
                           int accumulate)
{
    for (size_t i = begin; i < end; i++) {
        float v = (float)(int8_t)codes[i] * scale;
        if (dtype == ZO_Q_BF16)
            ((uint16_t *)dst)[i] = f32_to_bf16(v);
        else
            ((float *)dst)[i] = accumulate ? ((float *)dst)[i] + v : v;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Vector levels: whole vectors of a block, the rest by the scalar functions above */

#if ZO_Q_X86
__attribute__((target("avx512f,avx512bw"))) static __m512 load16(const void *src, int dtype, size_t i)
{
    if (dtype == ZO_Q_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i))), 16));
    return _mm512_loadu_ps((const float *)src + i);
}

__attribute__((target("avx512f,avx512bw"))) static float avx512_amax(const void *src, int dtype, size_t begin,
                                                                     size_t end)
{
    const __m512 inf = _mm512_set1_ps(INFINITY);
    __m512 m = _mm512_setzero_ps();
    __mmask16 finite = 0xffff;
    size_t i = begin;
    for (; i + 16 <= end; i += 16) {
        __m512 a = _mm512_abs_ps(load16(src, dtype, i));
        finite &= _mm512_cmp_ps_mask(a, inf, _CMP_LT_OQ);
        m = _mm512_max_ps(m, a);
    }
    float rest = scalar_amax(src, dtype, i, end), head = _mm512_reduce_max_ps(m);
    return finite != 0xffff || !(rest < INFINITY) ? INFINITY : rest > head ? rest : head;
}

__attribute__((target("avx512f,avx512bw"))) static void avx512_codes8(const void *src, int dtype, size_t begin,
                                                                      size_t end, float inv, uint8_t *codes)
{
    const __m512 k = _mm512_set1_ps(inv);
    const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
    size_t i = begin;
    for (; i + 16 <= end; i += 16) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(src, dtype, i), k));
        q = _mm512_max_epi32(_mm512_min_epi32(q, hi), lo);
        _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(q));
    }
    scalar_codes8(src, dtype, i, end, inv, codes);
}

__attribute__((target("avx512f,avx512bw"))) static void avx512_decode8(const uint8_t *codes, size_t begin, size_t end,
                                                                       float scale, void *dst, int dtype,
                                                                       int accumulate)
{
    const __m512 s = _mm512_set1_ps(scale);
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    size_t i = begin;
    for (; i + 16 <= end; i += 16) {
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(codes + i)))), s);
        if (dtype == ZO_Q_BF16) {  /* finite here: a NaN block decodes in scalar C (see zo_dequantize) */
            __m512i u = _mm512_castps_si512(v);
            u = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
            _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
        } else {
            float *out = (float *)dst + i;
            _mm512_storeu_ps(out, accumulate ? _mm512_add_ps(_mm512_loadu_ps(out), v) : v);
        }
    }
    scalar_decode8(codes, i, end, scale, dst, dtype, accumulate);
}

__attribute__((target("avx2"))) static __m256 load8(const void *src, int dtype, size_t i)
{
    if (dtype == ZO_Q_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))), 16));
    return _mm256_loadu_ps((const float *)src + i);
}

__attribute__((target("avx2"))) static float avx2_amax(const void *src, int dtype, size_t begin, size_t end)
{
    const __m256 inf = _mm256_set1_ps(INFINITY), mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    size_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256 a = _mm256_and_ps(load8(src, dtype, i), mask);
        finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, inf, _CMP_LT_OQ));
        m = _mm256_max_ps(m, a);
    }
    float lanes[8], rest = scalar_amax(src, dtype, i, end), head = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int j = 0; j < 8; j++)
        head = lanes[j] > head ? lanes[j] : head;
    return _mm256_movemask_ps(finite) != 0xff || !(rest < INFINITY) ? INFINITY : rest > head ? rest : head;
}

__attribute__((target("avx2"))) static void avx2_codes8(const void *src, int dtype, size_t begin, size_t end,
                                                        float inv, uint8_t *codes)
{
    const __m256 k = _mm256_set1_ps(inv);
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    size_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src, dtype, i), k));
        q = _mm256_max_epi32(_mm256_min_epi32(q, hi), lo);
        __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(codes + i), _mm_packs_epi16(w, w));
    }
    scalar_codes8(src, dtype, i, end, inv, codes);
}

__attribute__((target("avx2"))) static void avx2_decode8(const uint8_t *codes, size_t begin, size_t end, float scale,
                                                         void *dst, int dtype, int accumulate)
{
    const __m256 s = _mm256_set1_ps(scale);
    const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    size_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)(codes + i)))), s);
        if (dtype == ZO_Q_BF16) {
            __m256i u = _mm256_castps_si256(v);
            u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(
                half, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + i),
                             _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
        } else {
            float *out = (float *)dst + i;
            _mm256_storeu_ps(out, accumulate ? _mm256_add_ps(_mm256_loadu_ps(out), v) : v);
        }
    }
    scalar_decode8(codes, i, end, scale, dst, dtype, accumulate);
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Levels and the block loop */

typedef float amax_fn(const void *, int, size_t, size_t);
typedef void codes_fn(const void *, int, size_t, size_t, float, uint8_t *);
typedef void decode_fn(const uint8_t *, size_t, size_t, float, void *, int, int);

static amax_fn *const amax_at[] = {
    [ZO_Q_SCALAR] = scalar_amax,
#if ZO_Q_X86
    [ZO_Q_AVX2] = avx2_amax, [ZO_Q_AVX512] = avx512_amax,
#endif
};
static codes_fn *const codes_at[] = {
    [ZO_Q_SCALAR] = scalar_codes8,
#if ZO_Q_X86
    [ZO_Q_AVX2] = avx2_codes8, [ZO_Q_AVX512] = avx512_codes8,
#endif
};
static decode_fn *const decode_at[] = {
    [ZO_Q_SCALAR] = scalar_decode8,
#if ZO_Q_X86
    [ZO_Q_AVX2] = avx2_decode8, [ZO_Q_AVX512] = avx512_decode8,
#endif
};

int zo_quantize_best_level(void)
{
#if ZO_Q_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        return ZO_Q_AVX512;
    if (__builtin_cpu_supports("avx2"))
        return ZO_Q_AVX2;
#endif
    return ZO_Q_SCALAR;
}

const char *zo_quantize_level_name(int level)
{
    return level == ZO_Q_AVX512 ? "avx512" : level == ZO_Q_AVX2 ? "avx2" : "scalar";
}

/* The level to run: the caller's (< 0: the best), never above what the CPU has; -EINVAL when the
 * arguments are not a code quantize.h describes. */
static int checked_level(int dtype, size_t block, int bits, int level)
{
    if ((dtype != ZO_Q_FP32 && dtype != ZO_Q_BF16) || (bits != 8 && bits != 4) || block == 0 || block % 2)
        return -EINVAL;
    int best = zo_quantize_best_level();
    return level < 0 || level > best ? best : level;
}

static void pack4(const void *src, int dtype, size_t begin, size_t end, float inv, uint8_t *codes)
{
    for (size_t i = begin; i < end; i += 2) {  /* block starts are even: a pair never spans two blocks */
        int lo = clamp_code(lrintf(load(src, dtype, i) * inv), 7);
        int hi = i + 1 < end ? clamp_code(lrintf(load(src, dtype, i + 1) * inv), 7) : 0;
        codes[i / 2] = (uint8_t)((lo + 8) | ((hi + 8) << 4));
    }
}

int zo_quantize(const void *src, int src_dtype, size_t n, size_t block, int bits, uint8_t *codes, float *scales,
                int level)
{
    level = checked_level(src_dtype, block, bits, level);
    if (level < 0 || (n && (!src || !codes || !scales)))
        return -EINVAL;
    for (size_t b = 0, begin = 0; begin < n; b++, begin += block) {
        size_t end = n - begin < block ? n : begin + block;
        float inv;
        block_params(amax_at[level](src, src_dtype, begin, end), bits == 8 ? 127 : 7, &scales[b], &inv);
        if (scales[b] != scales[b])  /* not finite: zero codes (0x88 is two zero nibbles), the NaN scale decodes */
            memset(codes + (bits == 8 ? begin : begin / 2), bits == 8 ? 0 : 0x88,
                   bits == 8 ? end - begin : (end - begin + 1) / 2);
        else if (bits == 8)
            codes_at[level](src, src_dtype, begin, end, inv, codes);
        else
            pack4(src, src_dtype, begin, end, inv, codes);
    }
    return 0;
}

static void unpack4(const uint8_t *codes, size_t begin, size_t end, float scale, void *dst, int dtype, int accumulate)
{
    for (size_t i = begin; i < end; i++) {
        float v = (float)((int)((codes[i / 2] >> (4 * (i % 2))) & 0xf) - 8) * scale;
        if (dtype == ZO_Q_BF16)
            ((uint16_t *)dst)[i] = f32_to_bf16(v);
        else
            ((float *)dst)[i] = accumulate ? ((float *)dst)[i] + v : v;
    }
}

int zo_dequantize(const uint8_t *codes, const float *scales, size_t n, size_t block, int bits, void *dst,
                  int dst_dtype, int accumulate, int level)
{
    level = checked_level(dst_dtype, block, bits, level);
    if (level < 0 || (accumulate && dst_dtype != ZO_Q_FP32) || (n && (!codes || !scales || !dst)))
        return -EINVAL;
    for (size_t b = 0, begin = 0; begin < n; b++, begin += block) {
        size_t end = n - begin < block ? n : begin + block;
        if (bits == 4)
            unpack4(codes, begin, end, scales[b], dst, dst_dtype, accumulate);
        else  /* a NaN block's bf16 needs the scalar conversion's NaN rule */
            decode_at[scales[b] == scales[b] ? level : ZO_Q_SCALAR](codes, begin, end, scales[b], dst, dst_dtype,
                                                                    accumulate);
    }
    return 0;
}
