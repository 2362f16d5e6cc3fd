"""Block scale rules: how one block's amax becomes the factor that maps it onto the element grid.

Each rule returns, per block, the *stored* scale (in its real storage dtype), the FP32 factor the
elements are multiplied by before rounding ("encode"), and the FP32 factor that maps codes back
("decode").  All are exact transcriptions of the public definitions (RESEARCH.md, "Scale formats"):

* ``e8m0_floor`` -- OCP MX v1.0 (sec. 6.3): X = 2^(floor(log2 amax) - emax_elem), E8M0 storage
  (biased exponent, 127 = 2^0).  Values above qmax * X saturate.
* ``e8m0_ceil`` -- truncation-free: the smallest power of two X with amax <= qmax * X (torchao's
  RCEIL), so nothing saturates; stochastic rounding is unbiased only with such scales.
* ``ue4m3_fp32`` -- NVIDIA NVFP4 two-level scaling, generalised to any grid max qmax:
  s_enc = 448 * qmax / amax(tensor) (1 if amax is 0 or s_enc is 0, and if s_enc would exceed 2^117: see
  MAX_TENSOR_ENCODE -- there we depart from TE, which caps it at FLT_MAX);
  s_b = e4m3_rne(min(amax_b / qmax * s_enc, FLT_MAX)), saturating at 448;
  the encode factor is 1 / (fp32(s_b) * (1 / s_enc)), computed in FP32 as TransformerEngine does.
  A block whose s_b rounds to zero decodes to zero (TransformerEngine; torchao clamps instead).
* ``fp32`` -- research: scale = amax_b / qmax in FP32, encode = 1 / scale.

E8M0 exponents are clamped to [-127, 127]; an all-zero block gets the smallest scale 2^-127 (code 0),
so codes are zero and the scale stays finite.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .formats import Grid, encode, decode, grid_emax, grid_max

E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max


class ScaleRule(str, enum.Enum):
    E8M0_FLOOR = "e8m0_floor"
    E8M0_CEIL = "e8m0_ceil"
    UE4M3_FP32 = "ue4m3_fp32"
    FP32 = "fp32"


#: Storage bits of one block scale.
SCALE_BITS = {ScaleRule.E8M0_FLOOR: 8, ScaleRule.E8M0_CEIL: 8, ScaleRule.UE4M3_FP32: 8, ScaleRule.FP32: 32}


@dataclass
class BlockScales:
    """Per-block scales: `stored` in storage dtype, FP32 `encode` / `decode` factors (same shape)."""

    stored: torch.Tensor
    encode: torch.Tensor
    decode: torch.Tensor
    tensor_scale: torch.Tensor | None = None  # FP32 global decode factor (1 / s_enc), two-level only


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for positive finite FP32 a, exactly (from the binary exponent, subnormals too)."""
    return torch.frexp(a).exponent.to(torch.int32) - 1


def e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 storage (torch.float8_e8m0fnu) of 2^e, e clamped to [-127, 127]."""
    return (e.clamp(-127, 127) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_exponent(stored: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent (int32) of E8M0 scales; code 255 (NaN) gives 128."""
    return stored.view(torch.uint8).to(torch.int32) - 127


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e in FP32 exactly for integer e in [-149, 127]."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32))


def e8m0_floor_exponent(amax: torch.Tensor, grid: Grid) -> torch.Tensor:
    """OCP: floor(log2 amax) - emax_elem; amax = 0 gives the minimum exponent."""
    e = floor_log2(torch.where(amax > 0, amax, torch.ones_like(amax))) - grid_emax(grid)
    return torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)


def e8m0_ceil_exponent(amax: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Smallest e with amax <= qmax * 2^e (truncation-free); amax = 0 gives the minimum exponent."""
    qmax = grid_max(grid)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    e = torch.ceil(torch.log2(safe / qmax)).to(torch.int32)
    # log2 of a rounded quotient may be off by one near powers of two: correct with exact products.
    e = torch.where(safe > qmax * pow2(e), e + 1, e)
    e = torch.where(safe <= qmax * pow2(e - 1), e - 1, e)
    return torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)


#: s_enc above 2^117 would make a block's decode factor s_b / s_enc subnormal (E4M3's smallest s_b is 2^-9) and
#: its reciprocal, the encode factor, overflow: the block's values would then be scaled by a capped factor and
#: land up to ~2x off their grid step (found by tests/test_fuzz.py: a lone 2^-126 quantized to 4/7 of itself).
MAX_TENSOR_ENCODE = 2.0**117


def nvfp4_tensor_encode_scale(tensor_amax: torch.Tensor, grid: Grid) -> torch.Tensor:
    """s_enc = 448 * qmax / amax in FP32; 1 when amax or s_enc is zero (TE), and when s_enc would exceed
    MAX_TENSOR_ENCODE = 2^117 (amax below 448 * qmax * 2^-117, ~1e-32: every block decode factor then stays a
    normal FP32 number -- such a tensor's blocks round to a zero scale, i.e. it counts as zero, as a subnormal
    amax always did).  This deviates from TransformerEngine, which caps s_enc at FLT_MAX instead."""
    amax = tensor_amax.float()
    s_enc = torch.full_like(amax, E4M3_MAX * grid_max(grid)) / amax  # an amax of 0 gives inf: > 2^117, so 1
    return torch.where((s_enc > MAX_TENSOR_ENCODE) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def div_exact(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b, IEEE-rounded. (PyTorch's CUDA kernels multiply by the reciprocal of a scalar divisor,
    which rounds differently; a tensor divisor on a's device gives the true quotient everywhere.)"""
    return a / torch.full_like(a, b)


def ue4m3_two_level(amax: torch.Tensor, tensor_amax: torch.Tensor, grid: Grid) -> BlockScales:
    """NVIDIA's two-level scale (see module docstring) for block amaxes `amax` (FP32)."""
    s_enc = nvfp4_tensor_encode_scale(tensor_amax, grid).to(amax.device)
    s_dec = torch.reciprocal(s_enc)  # the FP32 global decode factor
    block = torch.clamp(div_exact(amax, grid_max(grid)) * s_enc, max=FLT_MAX)
    s_b_codes = encode(block, Grid.E4M3, "nearest")  # RNE, saturating at 448
    s_b = decode(s_b_codes, Grid.E4M3)
    decode_factor = s_b * s_dec
    # s_b >= 2^-9 where it is not zero and s_dec >= 2^-117 (MAX_TENSOR_ENCODE), so the decode factor is a normal
    # number and its reciprocal finite (<= 2^126)
    encode_factor = torch.where(s_b > 0, torch.reciprocal(decode_factor), torch.zeros_like(s_b))
    return BlockScales(s_b_codes.view(torch.float8_e4m3fn), encode_factor, decode_factor, s_dec)


def block_scales(amax: torch.Tensor, rule: ScaleRule, grid: Grid,
                 tensor_amax: torch.Tensor | None = None) -> BlockScales:
    """Scales of every block from the block amaxes (FP32); `tensor_amax` for two-level rules."""
    if rule in (ScaleRule.E8M0_FLOOR, ScaleRule.E8M0_CEIL):
        exp_fn = e8m0_floor_exponent if rule is ScaleRule.E8M0_FLOOR else e8m0_ceil_exponent
        e = exp_fn(amax, grid)
        return BlockScales(e8m0_from_exponent(e), pow2(-e), pow2(e))
    if rule is ScaleRule.UE4M3_FP32:
        if tensor_amax is None:
            tensor_amax = amax.max() if amax.numel() else amax.new_zeros(())
        return ue4m3_two_level(amax, tensor_amax, grid)
    if rule is ScaleRule.FP32:
        scale = div_exact(amax, grid_max(grid))
        inv = torch.where(scale > 0, torch.reciprocal(scale), torch.zeros_like(scale))
        return BlockScales(scale, inv, scale)
    raise ValueError(f"unknown scale rule {rule!r}")
