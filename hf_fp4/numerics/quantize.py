"""The reference quantizer: `quantize`, `fake_quantize`, `quant_error_stats` (its result type, `QuantizedTensor`,
lives in hf_fp4.numerics.qtensor and is re-exported here).

This is the spec every kernel is tested against bit for bit.  For an input of shape [..., K]:

1. flatten to [M, K]; NaN/Inf raise (QuantSpec.nonfinite="raise") or make their block NaN ("propagate");
2. zero-pad K (and M for 2D tiles) up to a multiple of the block.  Padding is exact for GEMMs (zeros
   contribute nothing to a dot product and never raise a block amax); `dequantize` crops it again;
3. per block: amax -> scale (hf_fp4.numerics.scales), scaled = x * encode factor, round onto the grid
   (hf_fp4.numerics.formats) to nearest-even or stochastically with uniform noise from `generator`;
4. pack: two 4-bit codes per byte, low nibble = even element (E4M3 codes stay one per byte).

Dequantization multiplies each code value by its block decode factor; for two-level scales it is
(q * s_b) * (1 / s_enc): q * s_b is exact in FP32, so only the global factor rounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .formats import ELEMENT_BITS, encode, flush_subnormals, grid_max
from .philox import philox_noise
from .qtensor import NonFiniteError, QuantizedTensor, expand_blocks, pack_codes, unpack_codes  # noqa: F401
from .scales import BlockScales, block_scales
from .spec import NonFinite, QuantSpec, Rounding, as_spec


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [M, K] in FP32 (a scalar or vector becomes one row)."""
    x = x.float()
    return x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)


def pad_to_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad an [M, K] matrix to multiples of the block."""
    pad_rows, pad_cols = -x.shape[0] % block[0], -x.shape[1] % block[1]
    if pad_rows or pad_cols:
        x = torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows))
    return x


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """amax of every block of a padded [Mp, Kp] matrix -> [Mp // br, Kp // bc]."""
    rows, cols = x.shape
    tiles = x.abs().reshape(rows // block[0], block[0], cols // block[1], block[1])
    return tiles.amax(dim=(1, 3))


def check_finite(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor | None:
    """Raise on NaN/Inf unless the spec propagates them; return the non-finite mask (or None)."""
    bad = ~torch.isfinite(x)
    if not bad.any():
        return None
    if spec.nonfinite is NonFinite.RAISE:
        raise NonFiniteError(f"quantize: input has {int(bad.sum())} NaN/Inf value(s); pass a QuantSpec with "
                         "nonfinite='propagate' to turn their blocks into NaN instead")
    return bad


@dataclass
class _Scaled:
    """Intermediate state of the reference quantizer (also used by the error statistics)."""

    padded: torch.Tensor   # [Mp, Kp] FP32 input, non-finite values zeroed
    scaled: torch.Tensor   # padded * encode factor
    scales: BlockScales
    bad_blocks: torch.Tensor | None


def _scale(x: torch.Tensor, spec: QuantSpec, tensor_amax: torch.Tensor | None = None) -> _Scaled:
    x = flush_subnormals(as_matrix(x))
    bad = check_finite(x, spec)
    if bad is not None:
        x = torch.where(bad, torch.zeros_like(x), x)
        bad = block_amax(pad_to_blocks(bad.float(), spec.block), spec.block) > 0
    padded = pad_to_blocks(x, spec.block)
    amax = block_amax(padded, spec.block)
    scales = block_scales(amax, spec.scale, spec.grid, tensor_amax)
    scaled = padded * expand_blocks(scales.encode, spec.block)
    return _Scaled(padded, scaled, scales, bad)


def _nan_scales(stored: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Mark blocks as NaN in the scale's storage format (E8M0 0xFF, E4M3 0x7F, FP32 NaN)."""
    if stored.dtype == torch.float32:
        return torch.where(bad, torch.full_like(stored, math.nan), stored)
    nan_code = 0xFF if stored.dtype == torch.float8_e8m0fnu else 0x7F
    raw = stored.view(torch.uint8)
    return torch.where(bad, torch.full_like(raw, nan_code), raw).view(stored.dtype)


def quantize(x: torch.Tensor, spec: "QuantSpec | str", generator: torch.Generator | None = None,
             noise: torch.Tensor | None = None, seed: int | None = None,
             tensor_amax: torch.Tensor | None = None) -> QuantizedTensor:
    """Quantize `x` ([..., K], blocks along the last dim) with `spec` (a QuantSpec or preset name).

    Stochastic rounding draws uniform [0, 1) noise of the padded [Mp, Kp] shape: from `seed` with
    Philox (the Triton kernels' generator, hf_fp4.numerics.philox), else from `generator` (torch.rand), or
    takes it from `noise`; the same seed reproduces the same bits.  This is the reference; the fused kernel
    (hf_fp4.kernels.quant, reached through hf_fp4.quantize(..., backend="triton")) is bit-exact with it.
    `tensor_amax` (two-level rules): the amax of the whole tensor when `x` is a part of it (a shard whose
    scales must be those of the tensor: FP4 all-gather, hf_fp4.nn.fp4_gather); default: x's own.
    """
    return _quantize_ref(x, as_spec(spec), generator, noise, seed, tensor_amax)[0]


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """The amax the two-level rules scale by: of |x| after flushing subnormals, non-finite values as 0
    (what quantize's block amaxes reduce to), FP32 scalar."""
    a = flush_subnormals(as_matrix(x)).abs()
    return torch.where(a < math.inf, a, torch.zeros_like(a)).amax() if a.numel() else a.new_zeros(())


def _quantize_ref(x, spec: QuantSpec, generator, noise, seed, tensor_amax=None) -> tuple[QuantizedTensor, _Scaled]:
    """The reference quantizer; also returns its intermediate state (for the error statistics)."""
    state = _scale(x, spec, tensor_amax)
    if spec.rounding is Rounding.STOCHASTIC and noise is None:
        if seed is not None:
            noise = philox_noise(seed, state.scaled.shape, state.scaled.device)
        else:
            noise = torch.rand(state.scaled.shape, generator=generator, device=state.scaled.device)
    codes = encode(state.scaled, spec.grid, spec.rounding.value, noise)
    stored = state.scales.stored
    if state.bad_blocks is not None:
        codes = torch.where(expand_blocks(state.bad_blocks, spec.block), torch.zeros_like(codes), codes)
        stored = _nan_scales(stored, state.bad_blocks)
    return QuantizedTensor(pack_codes(codes, spec.grid), stored, state.scales.tensor_scale,
                           x.shape, spec), state


def fake_quantize(x: torch.Tensor, spec: "QuantSpec | str", generator: torch.Generator | None = None,
                  noise: torch.Tensor | None = None, seed: int | None = None) -> torch.Tensor:
    """quantize(...).dequantize() in x's dtype."""
    return quantize(x, spec, generator, noise, seed).dequantize(x.dtype)


def quant_error_stats(x: torch.Tensor, spec: "QuantSpec | str",
                      generator: torch.Generator | None = None) -> dict[str, float]:
    """SQNR (dB), relative MSE, gain <Q(x),x>/<x,x> (shrinkage), saturated fraction, zero-code fraction."""
    spec = as_spec(spec)
    q, state = _quantize_ref(x, spec, generator, None, None)
    xf = as_matrix(x).double().flatten()
    qf = q.dequantize(torch.float64).flatten()
    signal, err = (xf * xf).sum(), ((xf - qf) ** 2).sum()
    rows, cols = as_matrix(x).shape
    scaled = state.scaled[:rows, :cols]
    codes = unpack_codes(q.codes, spec.grid)[:rows, :cols]
    sign = 1 << (ELEMENT_BITS[spec.grid] - 1)
    return {
        "sqnr_db": float(10 * torch.log10(signal / err)) if err > 0 else math.inf,
        "rel_mse": float(err / signal) if signal > 0 else 0.0,
        "gain": float((qf * xf).sum() / signal) if signal > 0 else 1.0,
        "saturated": float((scaled.abs() > grid_max(spec.grid)).double().mean()),
        "zero_codes": float(((codes & (sign - 1)) == 0).double().mean()),
    }
