/*
 * checksum.c - zo_checksum (checksum.h): the lane sums at one of three levels, then the fold.
 *
 * Vocabulary
 *   lanes  struct lanes: the 16 A and 16 B sums of checksum.h's definition.
 *   body   the whole 64-byte vectors of the range; the tail (its last n % 64 bytes) is copied
 *          into a zeroed vector and summed as one more, so every level pads the same way.
 * The vector levels keep A and B in registers (two 512-bit, or four 256-bit, lanes of uint32)
 * and add each vector into A, then A into B: after K vectors B[l] = sum (K - k) w[16k + l].
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "checksum.h"

#if (defined(__x86_64__) || defined(__i386__)) && !defined(ZO_ADAM_SCALAR_ONLY)
#define ZO_CHECKSUM_X86 1
#include <immintrin.h>
#else
#define ZO_CHECKSUM_X86 0
#endif

#define LANES 16
#define VECTOR 64

struct lanes {
    uint32_t a[LANES], b[LANES];
};

static void sum_vector(struct lanes *s, const unsigned char *p)
{
    for (int l = 0; l < LANES; l++) {
        const unsigned char *q = p + 4 * l;  /* little-endian on every host */
        uint32_t w = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
        s->a[l] += w;
        s->b[l] += s->a[l];
    }
}

static void sums_scalar(struct lanes *s, const unsigned char *p, size_t vectors)
{
    for (size_t k = 0; k < vectors; k++)
        sum_vector(s, p + k * VECTOR);
}

#if ZO_CHECKSUM_X86
__attribute__((target("avx512f"))) static void sums_avx512(struct lanes *s, const unsigned char *p,
                                                             size_t vectors)
{
    __m512i a = _mm512_loadu_si512(s->a), b = _mm512_loadu_si512(s->b);
    for (size_t k = 0; k < vectors; k++) {
        a = _mm512_add_epi32(a, _mm512_loadu_si512(p + k * VECTOR));
        b = _mm512_add_epi32(b, a);
    }
    _mm512_storeu_si512(s->a, a);
    _mm512_storeu_si512(s->b, b);
}

__attribute__((target("avx2"))) static void sums_avx2(struct lanes *s, const unsigned char *p, size_t vectors)
{
    __m256i a0 = _mm256_loadu_si256((const __m256i *)s->a), a1 = _mm256_loadu_si256((const __m256i *)(s->a + 8));
    __m256i b0 = _mm256_loadu_si256((const __m256i *)s->b), b1 = _mm256_loadu_si256((const __m256i *)(s->b + 8));
    for (size_t k = 0; k < vectors; k++) {
        a0 = _mm256_add_epi32(a0, _mm256_loadu_si256((const __m256i *)(p + k * VECTOR)));
        a1 = _mm256_add_epi32(a1, _mm256_loadu_si256((const __m256i *)(p + k * VECTOR + 32)));
        b0 = _mm256_add_epi32(b0, a0);
        b1 = _mm256_add_epi32(b1, a1);
    }
    _mm256_storeu_si256((__m256i *)s->a, a0);
    _mm256_storeu_si256((__m256i *)(s->a + 8), a1);
    _mm256_storeu_si256((__m256i *)s->b, b0);
    _mm256_storeu_si256((__m256i *)(s->b + 8), b1);
}
#endif

typedef void sums_fn(struct lanes *s, const unsigned char *p, size_t vectors);

static const char *level_name = NULL;
static sums_fn *level_fn = NULL;

/* The best level the CPU has, lowered by ZO_CHECKSUM_SIMD; decided once (a race only repeats it). */
static sums_fn *level(void)
{
    if (level_fn)
        return level_fn;
    const char *asked = getenv("ZO_CHECKSUM_SIMD");
    sums_fn *fn = sums_scalar;
    const char *name = "scalar";
#if ZO_CHECKSUM_X86
    int scalar = asked && strcmp(asked, "scalar") == 0;
    int avx2_only = asked && strcmp(asked, "avx2") == 0;
    if (!scalar && !avx2_only && __builtin_cpu_supports("avx512f")) {
        fn = sums_avx512;
        name = "avx512";
    } else if (!scalar && __builtin_cpu_supports("avx2")) {
        fn = sums_avx2;
        name = "avx2";
    }
#else
    (void)asked;
#endif
    level_name = name;
    level_fn = fn;
    return fn;
}

const char *zo_checksum_simd(void)
{
    level();
    return level_name;
}

/* splitmix64's finalizer: every input bit reaches every output bit. */
static uint64_t mix(uint64_t h)
{
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebULL;
    return h ^ (h >> 31);
}

uint64_t zo_checksum(const void *data, size_t n)
{
    const unsigned char *p = data;
    struct lanes s;
    memset(&s, 0, sizeof(s));
    size_t body = n / VECTOR;
    level()(&s, p, body);
    if (n % VECTOR) {
        unsigned char tail[VECTOR] = {0};
        memcpy(tail, p + body * VECTOR, n % VECTOR);
        sum_vector(&s, tail);
    }
    uint64_t h = mix((uint64_t)n ^ 0x9e3779b97f4a7c15ULL);
    for (int l = 0; l < LANES; l++)
        h = mix(h ^ (((uint64_t)s.b[l] << 32) | s.a[l]));
    return h;
}
