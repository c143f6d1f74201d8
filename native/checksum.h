/*
 * checksum.h - the digest of swap chunks (and of any file read in pieces): CRC32C, as ext4, Btrfs and
 * iSCSI use it.
 *
 * Definition: the Castagnoli CRC, the standard one (RFC 3720, the iSCSI digest): polynomial 0x1EDC6F41
 * taken reflected (0x82F63B78), register preset to 0xFFFFFFFF, result complemented; zo_crc32c(0, "123456789", 9)
 * is 0xE3069283. zo_crc32c(crc, ...) continues a running value the way zlib's crc32 does:
 * zo_crc32c(zo_crc32c(0, a, na), b, nb) is the CRC of a followed by b.
 *
 * Why a CRC (it replaced a Fletcher-style pair of 32-bit lane sums, which a pair of sign flips 32
 * values apart left unchanged): a CRC is linear over GF(2), so what an error does to it depends on
 * the error alone, and for this polynomial that gives guarantees, not odds, within one swap chunk
 * (4 MiB = 2^25 bits, far below the 2^31 bits up to which they hold):
 *   - every error of 1 or 2 bits changes it (x has an order mod P above 2^25: no two bit
 *     positions share a syndrome, none is zero), so a pair of sign flips at any distance too;
 *   - every error confined to 32 consecutive bits (a burst) changes it (P's degree is 32 and x
 *     does not divide it);
 *   - any other error (a moved, zeroed or stale page) is missed with probability about 2^-32.
 * tests/test_checksum.py checks each on the implementation. Like any CRC it is no defence against
 * someone forging data: it catches accidents.
 *
 * Levels (every one gives the same value):
 *   "avx512" VPCLMULQDQ on four 512-bit accumulators, each 128-bit lane carried 256 bytes forward by a
 *            carry-less multiplication by x^2048 mod P (checksum.c says how), the last lane finished by the
 *            crc32 instruction: at the speed a Zen 4 core reads DRAM (27-32 GB/s), 47 GB/s from cache;
 *   "sse42"  the SSE4.2 crc32 instruction on three interleaved streams of 64 KiB blocks (its latency is
 *            three of its issue slots), the streams joined by multiplying by x^(8 * 65536) mod P through
 *            four 256-entry tables (the "zeros operator"); 256-byte blocks for what is left: 8 bytes a
 *            cycle (23 GB/s from DRAM there, 26 from cache);
 *   "table"  slicing-by-8 tables, for a CPU without SSE4.2 and for every other architecture (2 GB/s).
 * The best the CPU has runs unless the environment variable ZO_CRC32C_SIMD names a lower one.
 * None of these functions fails or blocks; each may run on any thread.
 */
#ifndef ZO_CHECKSUM_H
#define ZO_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

/* The CRC32C of n bytes at data, continuing crc (0 to start). */
uint32_t zo_crc32c(uint32_t crc, const void *data, size_t n);

/* The CRC32C of a followed by b, from crc1 = CRC of a, crc2 = CRC of b and len2 = b's length in bytes:
 * crc1 times x^(8 * len2) mod P, plus crc2 (log2(len2) multiplications, whatever the length). */
uint32_t zo_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);

/* The level zo_crc32c runs on: "avx512", "sse42" or "table"; NULL when ZO_CRC32C_SIMD names no level
 * (the CRC then runs on the best level, the value being the same at every one). */
const char *zo_crc32c_simd(void);

#endif
