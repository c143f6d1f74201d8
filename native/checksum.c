/*
 * checksum.c - zo_crc32c (checksum.h) at three levels, its combine, and the tables they need.
 *
 * Vocabulary
 *   register  the CRC's running 32-bit state, reflected: bit 31 holds x^0, bit 0 x^31. Inside this
 *             file it is the raw state (no preset, no final complement); zo_crc32c adds those.
 *   P         the Castagnoli polynomial; POLY is its reflected form less the x^32 term.
 *   multiply  the product of two registers mod P (gf_multiply); x^(8n) mod P is what n zero bytes do
 *             to a register, so a register "shifted" past n bytes is a multiplication by it.
 *   operator  a fixed multiplication as four 256-entry tables, one per byte of the register (linear
 *             over GF(2), so the four lookups' XOR is the product): how the sse42 level joins streams.
 *   fold      the avx512 level's carry of 128 bits forward by a carry-less multiplication (below).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "checksum.h"

#if (defined(__x86_64__) || defined(__i386__)) && !defined(ZO_ADAM_SCALAR_ONLY)
#define ZO_CHECKSUM_X86 1
#include <immintrin.h>
#else
#define ZO_CHECKSUM_X86 0
#endif

#define POLY 0x82F63B78u
#define ONE 0x80000000u  /* the polynomial 1, reflected */

typedef uint32_t operator_t[4][256];

static uint32_t slices[8][256];  /* slices[k][b]: byte b followed by k zero bytes, from a zero register */
static uint32_t x_2k[67];        /* x^(2^k) mod P: a length in bytes up to 2^64 is 2^64 * 8 bits */

static uint32_t gf_multiply(uint32_t a, uint32_t b)
{
    uint32_t product = 0;
    for (uint32_t term = ONE; term; term >>= 1) {  /* a's terms from x^0 up, b times x each round */
        if (a & term)
            product ^= b;
        b = (b >> 1) ^ (b & 1 ? POLY : 0);
    }
    return product;
}

/* x^(n * 2^scale) mod P: scale 3 counts n in bytes, 0 in bits. */
static uint32_t x_power(uint64_t n, int scale)
{
    uint32_t power = ONE;
    for (int k = scale; n; n >>= 1, k++)
        if (n & 1)
            power = gf_multiply(power, x_2k[k]);
    return power;
}

static uint32_t x_to_bytes(uint64_t bytes)
{
    return x_power(bytes, 3);
}

static uint64_t load_le64(const unsigned char *p)
{
    uint64_t w = 0;
    for (int i = 7; i >= 0; i--)  /* the compiler makes this one load on a little-endian host */
        w = w << 8 | p[i];
    return w;
}

/* ---------------------------------------------------------------------------------------------
 * The table level */

static uint32_t update_table(uint32_t reg, const unsigned char *p, size_t n)
{
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w = load_le64(p) ^ reg;
        reg = slices[7][w & 0xff] ^ slices[6][(w >> 8) & 0xff] ^ slices[5][(w >> 16) & 0xff] ^
              slices[4][(w >> 24) & 0xff] ^ slices[3][(w >> 32) & 0xff] ^ slices[2][(w >> 40) & 0xff] ^
              slices[1][(w >> 48) & 0xff] ^ slices[0][w >> 56];
    }
    for (; n; p++, n--)
        reg = (reg >> 8) ^ slices[0][(reg ^ *p) & 0xff];
    return reg;
}

/* ---------------------------------------------------------------------------------------------
 * The sse42 level: three streams, each over its own block, joined by an operator per block size */

#if ZO_CHECKSUM_X86
#define LONG 65536  /* 4 MiB chunks from DRAM on a Zen 4 core: 21 GB/s; 13.8 with 8 KiB blocks */
#define SHORT 256

static operator_t long_op, short_op;

static void build_operator(operator_t op, uint64_t bytes)
{
    uint32_t power = x_to_bytes(bytes);
    for (int j = 0; j < 4; j++)
        for (uint32_t b = 0; b < 256; b++)
            op[j][b] = gf_multiply(power, b << (8 * j));
}

static uint32_t apply(const operator_t op, uint32_t reg)
{
    return op[0][reg & 0xff] ^ op[1][(reg >> 8) & 0xff] ^ op[2][(reg >> 16) & 0xff] ^ op[3][reg >> 24];
}

/* Three interleaved streams over `block`-byte blocks while 3 blocks remain: the crc32 instruction takes 3
 * cycles but issues every cycle, so three independent registers keep it busy. */
__attribute__((target("sse4.2"))) static uint64_t streams(uint64_t reg, const unsigned char **p, size_t *n,
                                                            size_t block, const operator_t op)
{
    for (; *n >= 3 * block; *p += 3 * block, *n -= 3 * block) {
        const unsigned char *q = *p, *end = *p + block;
        uint64_t one = 0, two = 0;
        for (; q < end; q += 8) {
            reg = _mm_crc32_u64(reg, load_le64(q));
            one = _mm_crc32_u64(one, load_le64(q + block));
            two = _mm_crc32_u64(two, load_le64(q + 2 * block));
        }
        reg = apply(op, (uint32_t)reg) ^ (uint32_t)one;
        reg = apply(op, (uint32_t)reg) ^ (uint32_t)two;
    }
    return reg;
}

__attribute__((target("sse4.2"))) static uint32_t update_sse42(uint32_t crc, const unsigned char *p, size_t n)
{
    uint64_t reg = crc;
    for (; n && ((uintptr_t)p & 7); p++, n--)  /* the streams' loads aligned */
        reg = _mm_crc32_u8((uint32_t)reg, *p);
    reg = streams(reg, &p, &n, LONG, long_op);
    reg = streams(reg, &p, &n, SHORT, short_op);
    for (; n >= 8; p += 8, n -= 8)
        reg = _mm_crc32_u64(reg, load_le64(p));
    for (; n; p++, n--)
        reg = _mm_crc32_u8((uint32_t)reg, *p);
    return (uint32_t)reg;
}

/* ---------------------------------------------------------------------------------------------
 * The avx512 level: four 512-bit accumulators (sixteen 128-bit lanes) folded forward 256 bytes at a time
 *
 * A 128-bit lane X standing D bits before a lane Y of the same message adds to the CRC what X x^D mod P
 * would add in Y's place. With X's first 8 bytes (its high-degree half) as A and the rest as B,
 * X x^D = A x^(D+64) + B x^D, and a carry-less product of a half by a 32-bit constant (x^(D+64) or x^D
 * mod P) is below 2^96: so two VPCLMULQDQ per lane, XORed into Y, carry X forward. Reflected bit order
 * makes each product come out times x, so the constants are one power lower: x^(D+63) and x^(D-1).
 * What is left, one lane, is a 16-byte message with the same CRC: two crc32 instructions finish it. */

struct fold {
    __m512i by[4];  /* by[i]: fold by 512 (i + 1) bits, in every lane: the accumulators to each other */
    __m512i lanes;  /* lane j of an accumulator to lane 3: by 128 (3 - j) bits; lane 3 zero */
};

static struct fold fold_k;

__attribute__((target("avx512f"))) static __m128i fold_constant(uint64_t bits)
{
    return _mm_set_epi64x((long long)((uint64_t)x_power(bits - 1, 0) << 32),
                          (long long)((uint64_t)x_power(bits + 63, 0) << 32));
}

__attribute__((target("avx512f"))) static void build_fold(void)
{
    for (int i = 0; i < 4; i++)
        fold_k.by[i] = _mm512_broadcast_i32x4(fold_constant(512 * (uint64_t)(i + 1)));
    fold_k.lanes = _mm512_inserti32x4(_mm512_castsi128_si512(fold_constant(384)), fold_constant(256), 1);
    fold_k.lanes = _mm512_inserti32x4(fold_k.lanes, fold_constant(128), 2);
    fold_k.lanes = _mm512_inserti32x4(fold_k.lanes, _mm_setzero_si128(), 3);
}

/* x carried forward by k's distance, into y. */
__attribute__((target("avx512f,vpclmulqdq"))) static inline __m512i fold_into(__m512i x, __m512i k, __m512i y)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     y, 0x96);  /* a ^ b ^ c */
}

__attribute__((target("avx512f,vpclmulqdq,sse4.2"))) static uint32_t update_avx512(uint32_t reg,
                                                                                  const unsigned char *p, size_t n)
{
    if (n < 512)
        return update_sse42(reg, p, n);
    __m512i x[4];
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_loadu_si512(p + 64 * i);
    x[0] = _mm512_xor_si512(x[0], _mm512_castsi128_si512(_mm_cvtsi32_si128((int)reg)));  /* the register's
                                                   value is what XORing it into the first 4 bytes adds */
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256)
        for (int i = 0; i < 4; i++)
            x[i] = fold_into(x[i], fold_k.by[3], _mm512_loadu_si512(p + 64 * i));
    __m512i last = fold_into(x[0], fold_k.by[2], fold_into(x[1], fold_k.by[1], fold_into(x[2], fold_k.by[0], x[3])));
    last = fold_into(last, fold_k.lanes, _mm512_maskz_mov_epi64(0xC0, last));  /* lane 3 kept as it is */
    __m128i one = _mm_xor_si128(_mm_xor_si128(_mm512_castsi512_si128(last), _mm512_extracti32x4_epi32(last, 1)),
                                _mm_xor_si128(_mm512_extracti32x4_epi32(last, 2), _mm512_extracti32x4_epi32(last, 3)));
    uint64_t folded = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(one));
    folded = _mm_crc32_u64(folded, (uint64_t)_mm_extract_epi64(one, 1));
    return update_sse42((uint32_t)folded, p, n);
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Tables and level, made once per process */

typedef uint32_t update_fn(uint32_t reg, const unsigned char *p, size_t n);

static pthread_once_t once = PTHREAD_ONCE_INIT;
static update_fn *level_fn;
static const char *level_name;  /* NULL when ZO_CRC32C_SIMD names no level */

static void build_tables(void)
{
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t reg = b;
        for (int bit = 0; bit < 8; bit++)
            reg = (reg >> 1) ^ (reg & 1 ? POLY : 0);
        slices[0][b] = reg;
    }
    for (int k = 1; k < 8; k++)
        for (int b = 0; b < 256; b++)
            slices[k][b] = (slices[k - 1][b] >> 8) ^ slices[0][slices[k - 1][b] & 0xff];
    x_2k[0] = ONE >> 1;  /* x */
    for (int k = 1; k < 67; k++)
        x_2k[k] = gf_multiply(x_2k[k - 1], x_2k[k - 1]);
}

static void choose_level(void)
{
    build_tables();
    const char *asked = getenv("ZO_CRC32C_SIMD");
    int limit = !asked || !*asked ? 2 : strcmp(asked, "avx512") == 0 ? 2 : strcmp(asked, "sse42") == 0 ? 1
              : strcmp(asked, "table") == 0 ? 0 : -1;  /* the highest level allowed; -1: no level's name */
    level_fn = update_table;
    level_name = "table";
#if ZO_CHECKSUM_X86
    __builtin_cpu_init();
    if (limit != 0 && __builtin_cpu_supports("sse4.2")) {
        build_operator(long_op, LONG);
        build_operator(short_op, SHORT);
        level_fn = update_sse42;
        level_name = "sse42";
        if (limit != 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq")) {
            build_fold();
            level_fn = update_avx512;
            level_name = "avx512";
        }
    }
#endif
    if (limit < 0)
        level_name = NULL;
}

static void ready(void)
{
    pthread_once(&once, choose_level);  /* fails only for an invalid once, which this is not */
}

const char *zo_crc32c_simd(void)
{
    ready();
    return level_name;
}

uint32_t zo_crc32c(uint32_t crc, const void *data, size_t n)
{
    ready();
    return ~level_fn(~crc, data, n);
}

uint32_t zo_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    ready();
    return gf_multiply(x_to_bytes(len2), crc1) ^ crc2;
}
