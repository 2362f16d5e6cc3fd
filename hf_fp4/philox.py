"""Philox4x32-10 uniforms in pure PyTorch, bit-identical to Triton's `tl.rand(seed, offset)`.

The Triton quantization kernels draw stochastic-rounding noise with `tl.rand` at the element's
offset in the padded [Mp, Kp] operand; this twin lets the reference quantizer draw exactly the same
numbers on any device, so kernel and reference agree bit for bit under stochastic rounding too.
(Philox: Salmon et al., SC'11; constants and the uint -> float map as in triton/language/random.py.)
"""
from __future__ import annotations

import torch

MASK = 0xFFFFFFFF
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
UNIFORM_SCALE = 4.6566127342e-10


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product of the constant a and uint32 values b (int64)."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_hi, p_lo = a * b_hi, a * b_lo  # each < 2^48: exact in int64
    high = (p_hi + (p_lo >> 16)) >> 16
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & MASK
    return high, low


def philox_uint32(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """First output word of Philox4x32-10 for counter (offset_lo, offset_hi, 0, 0), key = seed."""
    offsets = offsets.to(torch.int64)
    c0, c1 = offsets & MASK, (offsets >> 32) & MASK
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & MASK, (seed >> 32) & MASK
    for _ in range(10):
        hi_b, lo_b = _mul32(ROUND_B, c2)
        hi_a, lo_a = _mul32(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & MASK, (k1 + KEY_B) & MASK
    return c0


def philox_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) FP32 values, equal to Triton's tl.rand(seed, offsets)."""
    x = philox_uint32(seed, offsets)
    x = torch.where(x >= 2**31, x - 2**32, x)  # bitcast to int32
    x = torch.where(x < 0, ~x, x)
    return x.to(torch.float32) * torch.tensor(UNIFORM_SCALE, dtype=torch.float32)


def philox_noise(seed: int, shape: tuple[int, int], device=None) -> torch.Tensor:
    """Noise for a padded [Mp, Kp] operand: element (r, c) draws at offset r * Kp + c."""
    offsets = torch.arange(shape[0] * shape[1], device=device, dtype=torch.int64)
    return philox_uniform(seed, offsets).reshape(shape)
