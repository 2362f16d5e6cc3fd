"""Philox4x32-10 uniforms in pure PyTorch, bit-identical to Triton's `tl.rand4x(seed, offset)`.

The Triton kernels draw stochastic-rounding noise four at a time: one Philox call per group of four
consecutive elements of a row of the padded [Mp, Kp] operand (Kp is a multiple of the block, so of
4); element (r, c) takes word c % 4 of the call at counter (r * Kp + c) // 4.  This twin draws
exactly the same numbers on any device, so kernel and reference agree bit for bit under stochastic
rounding.  Seeds may be Python ints or int64 tensors (so a training step's seed can live on the
device and be traced by torch.compile).  (Philox: Salmon et al., SC'11; constants and the
uint -> float map as in triton/language/random.py.)
"""
from __future__ import annotations

import torch

MASK = 0xFFFFFFFF
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
UNIFORM_SCALE = 4.6566127342e-10
#: Odd 63-bit constant that spreads a step counter over the seed space (seed = base + step * STEP_MIX).
STEP_MIX = 0x5851F42D4C957F2D


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product of the constant a and uint32 values b (int64).

    The product is below 2^64, so its int64 result (two's-complement wrap-around) holds exactly its 64 bits:
    the halves are a shift and a mask (the philox tests check this against Triton's tl.rand4x)."""
    p = b * a
    return (p >> 32) & MASK, p & MASK


def philox_words(seed: "int | torch.Tensor", offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four output words of Philox4x32-10 for counter (offset_lo, offset_hi, 0, 0), key = seed (int64)."""
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


def to_uniform(x: torch.Tensor) -> torch.Tensor:
    """uint32 words (held in int64) -> uniform [0, 1) FP32, as triton's uint_to_uniform_float."""
    x = torch.where(x >= 2**31, x - 2**32, x)  # bitcast to int32
    x = torch.where(x < 0, ~x, x)
    return x.to(torch.float32) * torch.tensor(UNIFORM_SCALE, dtype=torch.float32)


def philox_uniform(seed: "int | torch.Tensor", offsets: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) FP32 values, equal to Triton's tl.rand(seed, offsets) (the first word)."""
    return to_uniform(philox_words(seed, offsets)[0])


def philox_noise(seed: "int | torch.Tensor", shape: tuple[int, int], device=None) -> torch.Tensor:
    """Noise for a padded [Mp, Kp] operand (Kp % 4 == 0): element (r, c) is word c % 4 of the Philox
    call at counter (r * Kp + c) // 4 -- four uniforms per call, as the kernels draw them."""
    rows, cols = shape
    if cols % 4:
        raise ValueError(f"philox_noise needs a padded width divisible by 4, got {cols}")
    counters = torch.arange(rows * cols // 4, device=device, dtype=torch.int64)
    if isinstance(seed, torch.Tensor):
        seed = seed.to(device=device, dtype=torch.int64)
    words = philox_words(seed, counters)
    return torch.stack([to_uniform(w) for w in words], dim=-1).reshape(rows, cols)


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
