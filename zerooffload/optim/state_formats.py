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
"""
from __future__ import annotations

import torch

__all__ = ["join_master", "split_master", "write_bits", "read_bits", "rounding_noise", "round_bf16_stochastic",
           "noise_seed"]

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
    """The fp32 master of a bf16 weight, its int16 residual and bool residual bits."""
    weight, residual, bits = weight.reshape(-1), residual.reshape(-1), bits.reshape(-1)
    master = torch.empty(weight.numel(), dtype=torch.float32, device=weight.device)
    for start in _chunks(weight.numel()):
        stop = start + CHUNK
        value = ((_uint16(weight[start:stop]) << 16) + residual[start:stop].to(torch.int64)
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
