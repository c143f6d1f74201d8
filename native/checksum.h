/*
 * checksum.h - the swap store's checksum: a 64-bit digest of a byte range, computed at memory speed.
 *
 * Definition (every level computes exactly this; tests/test_checksum.py holds a numpy copy of it)
 *   words   the bytes as little-endian uint32 w[0..N), N = ceil(n / 4), the last one zero-padded.
 *   lanes   16 of them: word i is in lane i % 16 of vector k = i / 16; K = ceil(N / 16) vectors,
 *           the last zero-padded.
 *   sums    per lane l, modulo 2^32: A[l] = sum over k of w[16k + l]                 (Fletcher's
 *           first sum) and B[l] = sum over k of (K - k) * w[16k + l] (its position-weighted second).
 *   digest  n and the 32 sums folded into 64 bits by a multiply-xorshift mix (splitmix64's).
 *
 * Why this and not CRC32C: the sums are two vector additions per 64 bytes, so a pass runs at the
 * memory's speed on one core (~12 GB/s from DRAM here, ~120 from L2; the SSE4.2 crc32 instruction
 * tops out near 11 GB/s even from cache), and what the swap store needs of it is to tell its
 * own bytes from anything else: a change of any single word changes A; a swapped pair of words
 * changes B; a zero-filled, truncated, overwritten or stale range changes the 1024 bits of sums
 * unless every lane's two sums cancel at once, and the mix keeps 64 of those bits' worth.
 * It is no defence against an adversary (nothing here is): it catches accidents.
 *
 * zo_checksum returns the digest; it never fails.
 */
#ifndef ZO_CHECKSUM_H
#define ZO_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

uint64_t zo_checksum(const void *data, size_t n);

/* The level zo_checksum runs on: "avx512", "avx2" or "scalar" (the best the CPU has, or a lower
 * one named by the environment variable ZO_CHECKSUM_SIMD; every level gives the same digest). */
const char *zo_checksum_simd(void);

#endif
