"""ZeRO++'s block code for data on the wire: linear symmetric int8 (or int4) with one fp32 scale a block.

[Note: the wire code]
A tensor of n elements (fp32 or bf16) is cut into blocks of ``BLOCK`` elements (the last may be
shorter); a block whose largest magnitude is amax has the scale amax / qmax (qmax = 127 for 8 bits, 7
for 4) and codes round-to-nearest-even(x · (qmax / amax)), clamped to ±qmax. Decoding gives code · scale
in fp32 (then rounded to nearest even for bf16), so each element is off by at most scale / 2 =
amax / qmax / 2 (plus a few fp32 ulp of x), and the block's largest element codes to ±qmax exactly
(amax · (qmax / amax) lies within an ulp of qmax and rounds to it; the clamp holds whatever the
rounding). A block of zeros, or below 2^-120 where qmax / amax would overflow, codes as zeros; a block
with an inf or NaN gets a NaN scale, so all of it decodes to NaN and a non-finite gradient still reaches
the overflow check. The *wire* form of n elements is one uint8 buffer: the codes (n bytes at 8 bits;
at 4 bits two a byte, element 2i in the low nibble of byte i, stored as code + 8), padded to 4 bytes,
then the fp32 scales.

``BLOCK`` = 2048 elements, DeepSpeed's group size for ZeRO++: its scale adds 4 bytes to 2048 (0.2% at
8 bits, 0.4% at 4), while a smaller block would tighten the bound only where one outlier dominates a
block; 2048 also divides every unit shard of a bf16 compute dtype (4 KiB-aligned), so blocks do not
straddle shards there.

The code runs in the native extension ``zerooffload._quantize`` (native/quantize.h: AVX-512, AVX2 or
scalar C, the same bits at every level) for CPU tensors, and in torch otherwise (a CUDA tensor, or
without the extension), with the same arithmetic operation for operation: the same bits.
"""
from __future__ import annotations

import torch

try:
    from .. import _quantize
except ImportError:  # optional at install: torch computes the same code
    _quantize = None

__all__ = ["BLOCK", "wire_bytes", "encode", "decode", "native_level"]

BLOCK = 2048
"""Elements a scale (see the note: DeepSpeed's group size; 0.2% of scale bytes at 8 bits)."""
TINY = 2.0 ** -120
"""Blocks whose largest magnitude is below this code as zeros (qmax / amax would overflow fp32)."""
_QMAX = {8: 127, 4: 7}


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def wire_bytes(numel: int, bits: int = 8) -> int:
    """Bytes of the wire form of ``numel`` elements: codes padded to 4 bytes, then a scale a block."""
    _check_bits(bits)
    return -(-_code_bytes(numel, bits) // 4) * 4 + 4 * _blocks(numel)


def _check_bits(bits: int) -> None:
    if bits not in _QMAX:
        raise ValueError(f"bits={bits}: the wire code has 8 or 4 bits")


def _parts(wire: torch.Tensor, numel: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and the scales of ``wire`` (a contiguous uint8 tensor of ``wire_bytes``)."""
    offset = wire_bytes(numel, bits) - 4 * _blocks(numel)
    return wire[:_code_bytes(numel, bits)], wire[offset:offset + 4 * _blocks(numel)].view(torch.float32)


def native_level() -> str | None:
    """The instruction set the native code runs on here, or None without the extension."""
    return None if _quantize is None else _quantize.level_name(_quantize.best_level())


def _native(*tensors: torch.Tensor) -> bool:
    return _quantize is not None and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


_DTYPES = {torch.float32: "DTYPE_FP32", torch.bfloat16: "DTYPE_BF16"}


def encode(src: torch.Tensor, wire: torch.Tensor, bits: int = 8, *, level: int = -1) -> torch.Tensor:
    """Write the wire form of ``src`` (fp32 or bf16, contiguous) into ``wire`` (uint8, ``wire_bytes``
    long); ``level`` picks a native level for tests (-1: the CPU's best)."""
    _check_bits(bits)
    if src.dtype not in _DTYPES or wire.numel() != wire_bytes(src.numel(), bits):
        raise ValueError(f"encode takes fp32 or bf16 into {wire_bytes(src.numel(), bits)} bytes, not {src.dtype} "
                         f"into {wire.numel()}")
    codes, scales = _parts(wire, src.numel(), bits)
    wire[codes.numel():wire.numel() - 4 * scales.numel()].zero_()  # the padding: the same bytes every time
    if _native(src, wire):
        _quantize.quantize(src.data_ptr(), getattr(_quantize, _DTYPES[src.dtype]), src.numel(), BLOCK, bits,
                           codes.data_ptr(), scales.data_ptr(), level)
    else:
        _encode_torch(src, codes, scales, bits)
    return wire


def decode(wire: torch.Tensor, out: torch.Tensor, bits: int = 8, *, accumulate: bool = False,
           level: int = -1) -> torch.Tensor:
    """Decode ``wire`` into ``out`` (fp32 or bf16, contiguous), or add it to ``out`` (fp32) with
    ``accumulate``."""
    _check_bits(bits)
    if out.dtype not in _DTYPES or (accumulate and out.dtype != torch.float32):
        raise ValueError(f"decode writes fp32 or bf16 and adds only to fp32, not {out.dtype}")
    codes, scales = _parts(wire, out.numel(), bits)
    if _native(out, wire):
        _quantize.dequantize(codes.data_ptr(), scales.data_ptr(), out.numel(), BLOCK, bits, out.data_ptr(),
                             getattr(_quantize, _DTYPES[out.dtype]), accumulate, level)
    else:
        values = _decode_torch(codes, scales, out.numel(), bits)
        if accumulate:
            out.add_(values)
        else:
            out.copy_(values)
    return out


def _encode_torch(src: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int) -> None:
    """The note's code in torch, operation for operation as native/quantize.c computes it."""
    qmax, numel = _QMAX[bits], src.numel()
    x = torch.zeros(_blocks(numel) * BLOCK, dtype=torch.float32, device=src.device)
    x[:numel] = src.reshape(-1)
    x = x.view(-1, BLOCK)
    amax = x.abs().amax(dim=1)
    finite, usable = torch.isfinite(amax), amax >= TINY
    qmaxes = torch.full_like(amax, qmax)  # tensor by tensor: torch computes qmax / amax as 1 / amax * qmax
    scales.copy_(torch.where(finite, torch.where(usable, amax / qmaxes, 0.0), float("nan")))
    inv = torch.where(finite & usable, qmaxes / amax, 0.0)
    q = torch.where(finite[:, None], torch.round(x * inv[:, None]), 0.0).clamp_(-qmax, qmax)
    q = q.view(-1)[:numel].to(torch.int8)
    if bits == 8:
        codes.copy_(q.view(torch.uint8))
        return
    nibbles = torch.full((2 * codes.numel(),), 8, dtype=torch.uint8, device=src.device)
    nibbles[:numel] = (q + 8).to(torch.uint8)
    pairs = nibbles.view(-1, 2)
    codes.copy_(pairs[:, 0] | (pairs[:, 1] << 4))


def _decode_torch(codes: torch.Tensor, scales: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    if bits == 8:
        q = codes.view(torch.int8).to(torch.float32)
    else:
        q = torch.stack([codes & 0xF, codes >> 4], dim=1).view(-1)[:numel].to(torch.float32) - 8
    padded = torch.zeros(_blocks(numel) * BLOCK, dtype=torch.float32, device=codes.device)
    padded[:numel] = q
    return (padded.view(-1, BLOCK) * scales[:, None]).view(-1)[:numel]
