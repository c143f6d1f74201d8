"""ZeRO++'s wire code against an independent numpy reference (every native level and the torch fallback),
and the quantized collectives at world 4 as 2 nodes x 2 ranks against the fp32 collectives."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from zerooffload.comm import quantize as q

LEVELS = [-1, 0, 1, 2] if q.native_level() else [-1]
QMAX = {8: 127, 4: 7}


def _reference(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes (int) and scales (float32) of the note's code, in numpy, block by block."""
    qmax, codes, scales = np.float32(QMAX[bits]), np.zeros(x.size, dtype=np.int64), []
    for start in range(0, x.size, q.BLOCK):
        block = x[start:start + q.BLOCK].astype(np.float32)
        amax = np.abs(block).max()
        if not np.isfinite(amax):
            scales.append(np.float32(np.nan))
            continue
        scales.append(amax / qmax if amax >= q.TINY else np.float32(0))
        if amax >= q.TINY:
            codes[start:start + block.size] = np.clip(np.rint(block * (qmax / amax)), -qmax, qmax)
    return codes, np.array(scales, dtype=np.float32)


def _sample(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g).pow(4) * 3  # blocks of unlike ranges
    x[q.BLOCK // 2 + 5: q.BLOCK // 2 + 9] = torch.tensor([1e-3, -1e-3, 0.5, -0.5]) * 1e3  # an outlier block
    return x.to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_code_matches_numpy_and_its_bound(bits, dtype):
    numel = 3 * q.BLOCK + 1001  # a short last block, odd for the nibbles
    x = _sample(numel, dtype, seed=bits)
    codes, scales = _reference(x.float().numpy(), bits)
    wires = [q.encode(x, torch.empty(q.wire_bytes(numel, bits), dtype=torch.uint8), bits, level=level)
             for level in LEVELS]
    assert all(torch.equal(wire, wires[0]) for wire in wires)  # every level, the same bytes
    torch_wire = torch.zeros_like(wires[0])
    got_codes, got_scales = q._parts(torch_wire, numel, bits)
    q._encode_torch(x, got_codes, got_scales, bits)
    assert torch.equal(torch_wire, wires[0])  # the fallback too
    got_codes, got_scales = q._parts(wires[0], numel, bits)
    np.testing.assert_array_equal(got_scales.numpy(), scales)
    if bits == 4:  # unpack the nibbles by hand: element 2i low, 2i + 1 high, code + 8
        nibbles = np.stack([got_codes.numpy() & 0xF, got_codes.numpy() >> 4], axis=1).reshape(-1)
        assert nibbles[numel:].tolist() in ([], [8])
        np.testing.assert_array_equal(nibbles[:numel].astype(np.int64) - 8, codes)
    else:
        np.testing.assert_array_equal(got_codes.numpy().view(np.int8), codes)
    qmax = QMAX[bits]
    for b, start in enumerate(range(0, numel, q.BLOCK)):  # each block's largest element codes to +-qmax
        block = x.float()[start:start + q.BLOCK].abs()
        assert abs(codes[start + int(block.argmax())]) == qmax
    for out_dtype in (torch.float32, torch.bfloat16):
        for level in LEVELS:
            out = q.decode(wires[0], torch.empty(numel, dtype=out_dtype), bits, level=level)
            exact = torch.from_numpy(codes.astype(np.float32) * np.repeat(scales, q.BLOCK)[:numel])
            assert torch.equal(out, exact.to(out_dtype))
    bound = torch.from_numpy(np.repeat(scales, q.BLOCK)[:numel]) / 2 * (1 + 1e-6) + x.float().abs() * 2e-7
    error = (q.decode(wires[0], torch.empty(numel), bits) - x.float()).abs()
    assert (error <= bound).all() and error.max() > bound.max() / 10  # within the bound, and it is lossy


def test_accumulate_non_finite_and_zero_blocks():
    numel = 2 * q.BLOCK + 10
    x = torch.randn(numel)
    x[q.BLOCK:2 * q.BLOCK] = 0  # a zero block
    x[2 * q.BLOCK + 3] = float("inf")  # the last block is not finite
    for level in LEVELS:
        wire = q.encode(x, torch.empty(q.wire_bytes(numel), dtype=torch.uint8), level=level)
        base = torch.full((numel,), 0.25)
        summed = q.decode(wire, base.clone(), accumulate=True, level=level)
        alone = q.decode(wire, torch.empty(numel), level=level)
        assert torch.equal(summed[:2 * q.BLOCK], base[:2 * q.BLOCK] + alone[:2 * q.BLOCK])
        assert torch.equal(alone[q.BLOCK:2 * q.BLOCK], torch.zeros(q.BLOCK))
        assert alone[2 * q.BLOCK:].isnan().all() and summed[2 * q.BLOCK:].isnan().all()
        assert q.decode(wire, torch.empty(numel, dtype=torch.bfloat16), level=level)[2 * q.BLOCK:].isnan().all()
    with pytest.raises(ValueError, match="adds only to fp32"):
        q.decode(wire, torch.empty(numel, dtype=torch.bfloat16), accumulate=True)
    assert q.wire_bytes(2049, 8) == 2052 + 8 and q.wire_bytes(2049, 4) == 1028 + 8
