"""The compact formats of optimizer state, as torch ops: what the native pass reads and writes
(native/cpu_adam.h), for whatever runs outside it (first values, checkpoints, the torch fallback).

[Note: split masters]
A *split* master is the fp32 master held as its bf16 weight (the compute copy, which the forward
reads anyway) plus a 16-bit *residual* and one *residual bit*: the weight is the master rounded to
nearest even, exactly what the fp32 master's cast writes, so the master's bit pattern minus the
weight's (shifted to the high half) lies in [-0x8000, 0x8000]. Those are 2^16 + 1 values, one more than
16 bits hold: the residual keeps the low 16 bits (read as int16) and the bit marks +0x8000 (a tie
that rounded down to an even weight) apart from -0x8000. So ``join(split(x)) == x`` bit for bit for
every float but NaN (which stays a NaN): 2.125 bytes per parameter beside the weight, against 4 for
an fp32 master, and an update of a split master is bitwise the update of the fp32 one. The bits are
packed 8 to a byte, element ``j`` of a run at bit ``(bit0 + j) % 8`` of byte ``(bit0 + j) // 8``.

[Note: bf16 moments]
Moments kept in bf16 are computed in fp32 and stored *rounded stochastically*: the 16 bits below
bf16's are added to 16 bits of noise before truncation, so the stored value's expectation is the fp32
value. Round to nearest would drop every change below half a bf16 unit (2^-9 relative): v * 0.999
would round back to v, and v would never decay. The noise is a hash of (key, step, element number):
the same bits whatever runs it, and reproducible on resume.

[Note: int8 moments]
Moments kept in 8 bits are *blockwise*: each run of ``INT8_BLOCK`` elements (counted from the first
element of the piece the pass updates) keeps one fp32 scale, its largest finite magnitude, and each element a
code of ``q = |x| / scale`` in [0, 1]: a tiny float with 3 mantissa bits whose top exponent is q = 1
and whose lowest exponent field is linear down to 0 (native/int8_moments.h draws the map). exp_avg
has a sign bit and 4 exponent bits (bias 15: down to 2^-17 of the block's largest), exp_avg_sq 5
(bias 31: down to 2^-33, the square of that range, as v ~ g^2); a linear map would make every v
below 1/255 of its block's largest 0 and its update m / (sqrt(v) + eps) explode. Codes are rounded
stochastically with the bf16 moments' noise (16 bits below the last code bit), so v still decays
though codes lie 12.5% apart. 2 bytes and 1/32 for two moments, against 8 in fp32.
- *The largest takes the top code, always*: q is ``|x| * (1 / scale)``, which rounds to 0.99999994 for
  ~12% of floats; so the element whose magnitude is the scale's is given q = 1 by its bit pattern. Else,
  once in 65,536 (noise 0), the largest would code below the top, and a save and load (decoded, encoded
  anew) would give its block a new scale and all 256 elements new codes.
- *A non-finite moment is isolated*: the scale is the largest *finite* magnitude, and an inf or NaN
  codes as that largest (its sign kept). fp32 and bf16 moments keep the inf or NaN in its one element;
  int8 ones cannot hold it, and a scale of inf or NaN would turn all 256 values of the block NaN. (The
  update that met it used the non-finite value: its parameter is what the fp32 pass made it.)
"""
from __future__ import annotations

import torch

__all__ = ["join_master", "split_master", "write_bits", "read_bits", "rounding_noise", "round_bf16_stochastic",
           "noise_seed", "INT8_BLOCK", "int8_blocks", "encode_int8", "decode_int8"]

_LOW32 = 0xFFFFFFFF


def _bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x``'s bit patterns as int64 in [0, 2^32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & _LOW32


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns in [0, 2^32) as fp32."""
    return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32)


def _as_uint16(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 values in [0, 2^16) as a 16-bit tensor of ``dtype`` with those bit patterns."""
    return torch.where(values >= 2 ** 15, values - 2 ** 16, values).to(torch.int16).view(dtype)


def _uint16(x: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor's bit patterns as int64 in [0, 2^16)."""
    return x.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


CHUNK = 1 << 20
"""Elements a format conversion takes at a time: its int64 temporaries stay within ~50 MB, whatever
the unit (a 7B model's units hold 200M elements; whole, they would take gigabytes)."""


def _chunks(count: int) -> range:
    return range(0, count, CHUNK)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``master`` as (bf16 weight, int16 residual, bool residual bit) ([Note: split masters])."""
    flat = master.reshape(-1)
    weight = torch.empty(flat.numel(), dtype=torch.bfloat16, device=flat.device)
    residual = torch.empty(flat.numel(), dtype=torch.int16, device=flat.device)
    tie = torch.empty(flat.numel(), dtype=torch.bool, device=flat.device)
    for start in _chunks(flat.numel()):
        part = flat[start:start + CHUNK]
        stop = start + part.numel()
        weight[start:stop] = part  # torch's cast: round to nearest even, as the fp32 master's out
        rest = (_bits(part) - (_uint16(weight[start:stop]) << 16)) & _LOW32
        residual[start:stop] = _as_uint16(rest & 0xFFFF, torch.int16)
        tie[start:stop] = rest == 0x8000
    return weight, residual, tie


def join_master(weight: torch.Tensor, residual: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a bf16 weight, its int16 residual and bool residual bits, where the residual
    is (the optimizer's tier): weights on the GPU come over a chunk at a time."""
    weight, residual, bits = weight.reshape(-1), residual.reshape(-1), bits.reshape(-1)
    master = torch.empty(weight.numel(), dtype=torch.float32, device=residual.device)
    for start in _chunks(weight.numel()):
        stop = start + CHUNK
        value = ((_uint16(weight[start:stop].to(residual.device)) << 16) + residual[start:stop].to(torch.int64)
                 + (bits[start:stop].to(torch.int64) << 16))
        master[start:stop] = _from_bits(value & _LOW32)
    return master


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return ((packed.to(torch.int64)[:, None] >> torch.arange(8)) & 1).reshape(-1).bool()


def read_bits(packed: torch.Tensor, bit0: int, count: int) -> torch.Tensor:
    """Bits ``bit0 .. bit0 + count`` of uint8 ``packed`` (least significant first) as bools."""
    out = torch.empty(count, dtype=torch.bool)
    for start in _chunks(count):
        first, n = (bit0 + start) >> 3, min(CHUNK, count - start)
        out[start:start + n] = _unpack(packed[first:(bit0 + start + n + 7) >> 3])[bit0 + start - 8 * first:][:n]
    return out


def write_bits(packed: torch.Tensor, bit0: int, bits: torch.Tensor) -> None:
    """Set bits ``bit0 ..`` of uint8 ``packed`` to the bools ``bits``, leaving the others as they are."""
    bits = bits.reshape(-1)
    for start in _chunks(bits.numel()):
        part, at = bits[start:start + CHUNK], bit0 + start
        first, stop = at >> 3, (at + part.numel() + 7) >> 3
        every = _unpack(packed[first:stop])
        every[at - 8 * first:][:part.numel()] = part
        packed[first:stop] = (every.reshape(-1, 8).to(torch.int64) << torch.arange(8)).sum(1).to(torch.uint8)


def _mix32(x):
    """lowbias32 on values in [0, 2^32) (an int, or an int64 tensor), as the native pass's mix32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _LOW32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _LOW32
    return x ^ (x >> 16)


def noise_seed(key: int, step: int) -> int:
    """The native pass's per-call seed of the rounding noise."""
    return _mix32((key & _LOW32) ^ _mix32(step & _LOW32))


def rounding_noise(key: int, step: int, base: int, count: int) -> torch.Tensor:
    """32 bits of noise (int64) for elements ``base .. base + count`` at ``step``: the low 16 round
    the first moment, the high 16 the second ([Note: bf16 moments])."""
    index = (torch.arange(count, dtype=torch.int64) + base) & _LOW32
    return _mix32(index ^ noise_seed(key, step))


def round_bf16_stochastic(x: torch.Tensor, noise16: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 with 16 bits of noise per element (every NaN 0xFFFF)."""
    rounded = ((_bits(x) + noise16) >> 16) & 0xFFFF
    return _as_uint16(torch.where(torch.isnan(x.reshape(-1)), 0xFFFF, rounded), torch.bfloat16)


INT8_BLOCK = 256
"""Elements per scale of int8 moments (native/cpu_adam.h's ZO_INT8_BLOCK, which says why 256)."""

_INT8_BIAS = {True: 15, False: 31}
"""The codes' exponent bias: exp_avg's (signed), exp_avg_sq's."""

_INF = 0x7F800000
"""inf's bit pattern: |x| patterns at and above it are not finite."""
"""The codes' exponent bias: exp_avg's (signed), exp_avg_sq's."""


def int8_blocks(numel: int) -> int:
    """Scales of an int8 moment over ``numel`` elements."""
    return -(-numel // INT8_BLOCK)


def _pow2(exponent: int) -> float:
    return float(2.0 ** exponent)


def _per_element(scales: torch.Tensor, count: int) -> torch.Tensor:
    return scales.repeat_interleave(INT8_BLOCK)[:count]


def encode_int8(x: torch.Tensor, noise16: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` (one piece) as (uint8 codes, fp32 scales) ([Note: int8 moments]), rounded with
    ``noise16`` (int64, 16 bits per element): bit for bit what the native pass stores."""
    x = x.reshape(-1)
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    scales = torch.empty(int8_blocks(x.numel()), dtype=torch.float32)
    for start in _chunks(x.numel()):  # CHUNK is a multiple of INT8_BLOCK: chunks start blocks
        part, noise = x[start:start + CHUNK], noise16[start:start + CHUNK]
        magnitude = _bits(part) & 0x7FFFFFFF
        padded = torch.zeros(int8_blocks(part.numel()) * INT8_BLOCK, dtype=torch.int64)
        padded[:part.numel()] = torch.where(magnitude < _INF, magnitude, 0)  # the largest finite: the scale
        block_scales = _from_bits(padded.view(-1, INT8_BLOCK).amax(1))
        scales[start // INT8_BLOCK:start // INT8_BLOCK + block_scales.numel()] = block_scales
        reciprocals = torch.ones_like(block_scales).div(block_scales)  # IEEE's 1 / scale, as the native pass
        q = _from_bits(magnitude) * _per_element(reciprocals, part.numel())
        q = torch.where(q > 1.0, 1.0, q)
        top = _per_element(torch.where(_bits(block_scales) > 0, _bits(block_scales), _INF), part.numel())
        q = torch.where(magnitude >= top, 1.0, q)  # the largest (and a non-finite value) take the top code
        code = _int8_code(torch.nan_to_num(q, nan=0.0), _INT8_BIAS[signed], noise)
        if signed:
            code = code | ((_bits(part) >> 24) & 0x80)
        codes[start:start + part.numel()] = code.to(torch.uint8)
    return codes, scales


def _int8_code(q: torch.Tensor, bias: int, noise16: torch.Tensor) -> torch.Tensor:
    """q in [0, 1] as its code's magnitude (int64), as native/int8_moments.h's int8_code."""
    bits, zero_exponent = _bits(q), (127 - bias) << 23
    normal = bits >= zero_exponent + (1 << 23)
    rebased = ((bits + (noise16 << 4) - zero_exponent) & _LOW32) >> 20
    steps = torch.where(normal, 0.0, q) * _pow2(bias + 2)
    linear = (steps + noise16.to(torch.float32) * _pow2(-16)).to(torch.int32).to(torch.int64)
    return torch.where(normal, rebased, linear)


def decode_int8(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 ``codes`` of one piece and their blocks' ``scales`` as fp32 ([Note: int8 moments])."""
    bias = _INT8_BIAS[signed]
    out = torch.empty(codes.numel(), dtype=torch.float32)
    for start in _chunks(codes.numel()):
        code = codes[start:start + CHUNK].to(torch.int64)
        magnitude = code & 0x7F if signed else code
        rebased = _from_bits((magnitude << 20) + ((127 - bias) << 23))
        linear = magnitude.to(torch.float32) * _pow2(-bias - 2)
        q = torch.where(magnitude >= 8, rebased, linear)
        first = start // INT8_BLOCK
        value = q * _per_element(scales[first:first + int8_blocks(code.numel())], code.numel())
        if signed:
            value = _from_bits(_bits(value) | ((code & 0x80) << 24))
        out[start:start + code.numel()] = value
    return out
