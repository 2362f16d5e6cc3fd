"""Philox4x32-10 noise in pure PyTorch, bit-identical to the Triton kernels' draws.

The kernels draw stochastic-rounding noise sixteen elements per Philox call: eight random bits an element, as
Blackwell's `cvt.rs` conversions to FP4 take them (one 32-bit word per four values, as TransformerEngine's NVFP4
cast passes them).  Element (r, c) of the padded [Mp, Kp] operand takes byte c % 4 of
word (c % 16) // 4 of the call at counter r * ceil(Kp / 16) + c // 16, as the uniform (byte + 1/2) / 256 -- exact in
FP32, mean 1/2, so a value's chance of rounding up is its fraction of a grid step within 1/512.  (Four uniforms a
call of 31 bits each, the layout before session 36, cost the SR operand kernels about 20 instructions per element
for the generator alone.)  This twin draws exactly the same numbers on any device, so kernel and reference agree
bit for bit under stochastic rounding.  Seeds may be Python ints or int64 tensors (so a training step's seed can
live on the device and be traced by torch.compile).  (Philox: Salmon et al., SC'11; the words as Triton's
`tl.randint4x`, constants in triton/language/random.py.)
"""
from __future__ import annotations

import torch

MASK = 0xFFFFFFFF
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
#: Odd 63-bit constant that spreads a step counter over the seed space (seed = base + step * STEP_MIX).
STEP_MIX = 0x5851F42D4C957F2D


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product of the constant a and uint32 values b (int64).

    The product is below 2^64, so its int64 result (two's-complement wrap-around) holds exactly its 64 bits:
    the halves are a shift and a mask (the philox tests check this against Triton's tl.randint4x)."""
    p = b * a
    return (p >> 32) & MASK, p & MASK


def philox_words(seed: "int | torch.Tensor", offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four output words of Philox4x32-10 for counter (offset_lo, offset_hi, 0, 0), key = seed (int64): Triton's
    tl.randint4x(seed, offset)."""
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
    return c0, c1, c2, c3


#: Elements one Philox call serves (four words of four bytes) and the byte-to-uniform map's constants.
PER_CALL = 16
BYTE_STEP, BYTE_HALF = 1.0 / 256, 0.5


def byte_uniforms(words: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The 16 uniforms of Philox calls' four words ([..., 16], FP32): element 4 w + k is byte k of word w as
    (byte + 1/2) / 256."""
    shifts = torch.arange(0, 32, 8, device=words[0].device)
    b = (torch.stack(words, dim=-1)[..., None] >> shifts) & 0xFF  # [..., word, byte]
    return ((b.to(torch.float32) + BYTE_HALF) * BYTE_STEP).flatten(-2)


def philox_noise(seed: "int | torch.Tensor", shape: tuple[int, int], device=None) -> torch.Tensor:
    """Noise for a padded [Mp, Kp] operand: element (r, c) takes byte c % 4 of word (c % 16) // 4 of the Philox
    call at counter r * ceil(Kp / 16) + c // 16 -- sixteen uniforms per call, as the kernels draw them."""
    rows, cols = shape
    per_row = -(-cols // PER_CALL)
    counters = torch.arange(rows * per_row, device=device, dtype=torch.int64)
    if isinstance(seed, torch.Tensor):
        seed = seed.to(device=device, dtype=torch.int64)
    return byte_uniforms(philox_words(seed, counters)).reshape(rows, per_row * PER_CALL)[:, :cols]


def step_seed(base: int, step: "int | torch.Tensor") -> "int | torch.Tensor":
    """The seed of one call: base + step * STEP_MIX with int64 wrap-around (tensor or int)."""
    if isinstance(step, torch.Tensor):
        return base + step * STEP_MIX
    value = (base + step * STEP_MIX) & 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= (1 << 63) else value


def philox_signs(seed: "int | torch.Tensor", n: int, device=None) -> torch.Tensor:
    """A +-1 vector of length n (FP32) from Philox bits: the per-step random Hadamard signs."""
    if isinstance(seed, torch.Tensor):
        seed = seed.to(device=device, dtype=torch.int64)
    bits = philox_words(seed, torch.arange(n, device=device))[0] & 1
    return (1 - 2 * bits).to(torch.float32)
