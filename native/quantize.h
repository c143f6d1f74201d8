/*
 * quantize.h - ZeRO++'s block code for data on the wire (zerooffload/comm/quantize.py says why).
 *
 * Vocabulary
 *   block    `block` consecutive elements (the last one may be shorter) sharing one fp32 scale.
 *   code     linear symmetric: bits 8 -> integers in [-127, 127], one byte each (int8);
 *            bits 4 -> integers in [-7, 7], stored as code + 8 in a nibble, element 2i in the low nibble
 *            of byte i and element 2i + 1 in the high one (an odd count pads a zero code).
 *   scale    amax / qmax for a block whose largest magnitude is amax (qmax = 127 or 7); the codes are
 *            round-to-nearest-even of x * (qmax / amax), so |x - code * scale| <= scale / 2 (plus a few
 *            ulp of x), and the block's largest element codes to +-qmax exactly (amax * (qmax / amax)
 *            is within an ulp of qmax, and rounds to it). A block of zeros has scale 0 and codes 0; a
 *            block holding inf or NaN has scale NaN and codes 0, so every element it decodes to is NaN
 *            (a non-finite gradient stays visible to the overflow check after the wire).
 *   dtype    the source or destination: ZO_Q_FP32 or ZO_Q_BF16 (decoded as fp32 code * scale, rounded to
 *            nearest even for bf16, NaN kept a NaN); `accumulate` adds into an fp32 destination.
 *   level    the instruction set: AVX-512 (F, BW), AVX2 or scalar C, the best the CPU has unless the
 *            caller asks for a lower one. Every level gives the same bits (one rounding per operation,
 *            no fused multiply-add: built with -ffp-contract=off).
 * Functions return 0 or -errno (-EINVAL for bad arguments, nothing written).
 */
#ifndef ZO_QUANTIZE_H
#define ZO_QUANTIZE_H

#include <stddef.h>
#include <stdint.h>

enum zo_q_dtype { ZO_Q_FP32 = 1, ZO_Q_BF16 = 2 };
enum zo_q_level { ZO_Q_SCALAR = 0, ZO_Q_AVX2 = 1, ZO_Q_AVX512 = 2 };

int zo_quantize(const void *src, int src_dtype, size_t n, size_t block, int bits, uint8_t *codes, float *scales,
                int level);
int zo_dequantize(const uint8_t *codes, const float *scales, size_t n, size_t block, int bits, void *dst,
                  int dst_dtype, int accumulate, int level);
/* The best level this CPU runs (enum zo_q_level); a caller's level above it is lowered to it. */
int zo_quantize_best_level(void);
const char *zo_quantize_level_name(int level);

#endif
