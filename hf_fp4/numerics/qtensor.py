"""What a quantizer returns: `QuantizedTensor` (packed codes + block scales + tensor scale) and how it decodes,
and `NonFiniteError`.  Shared by the reference quantizer (hf_fp4.numerics.quantize) and the kernels (hf_fp4.kernels),
which both depend on this module and not on each other's internals."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .formats import ELEMENT_BITS, Grid, decode
from .scales import ScaleRule, e8m0_exponent, pow2
from .spec import QuantSpec


class NonFiniteError(ValueError):
    """A quantizer met NaN/Inf input under the default nonfinite="raise" policy."""


@dataclass
class QuantizedTensor:
    """A quantized tensor: packed codes, block scales in their storage dtype, optional tensor scale."""

    codes: torch.Tensor          # uint8 [Mp, Kp // 2] (4-bit grids) or [Mp, Kp] (E4M3)
    scales: torch.Tensor         # [Mp // br, Kp // bc]: float8_e8m0fnu, float8_e4m3fn or float32
    tensor_scale: torch.Tensor | None  # FP32 scalar global decode factor (two-level rules) or None
    shape: torch.Size            # the original shape
    spec: QuantSpec

    @property
    def padded_shape(self) -> tuple[int, int]:
        rows, cols = self.codes.shape
        return rows, cols * (2 if ELEMENT_BITS[self.spec.grid] == 4 else 1)

    @property
    def bits_per_value(self) -> float:
        return self.spec.bits_per_value

    def code_values(self) -> torch.Tensor:
        """Unpacked, decoded element values (FP32, padded shape, before scaling)."""
        return decode(unpack_codes(self.codes, self.spec.grid), self.spec.grid)

    def block_decode(self) -> torch.Tensor:
        """FP32 decode factor of every block (without the tensor scale)."""
        rule = self.spec.scale
        if rule in (ScaleRule.E8M0_FLOOR, ScaleRule.E8M0_CEIL):
            e = e8m0_exponent(self.scales)
            return torch.where(e == 128, torch.full(e.shape, math.nan, device=e.device), pow2(e.clamp(max=127)))
        if rule is ScaleRule.UE4M3_FP32:
            return decode(self.scales.view(torch.uint8), Grid.E4M3)
        return self.scales.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = self.code_values() * expand_blocks(self.block_decode(), self.spec.block)
        if self.tensor_scale is not None:
            values = values * self.tensor_scale
        return self._crop(values).to(dtype)

    def tensor_core_parts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(grid value x block scale in BF16, FP32 tensor decode) with values.float() * decode == dequantize()
        bit for bit: a grid value has at most 4 and a power-of-two or UE4M3 block scale at most 4 significant
        bits, so BF16 holds every product -- the operands of an exact BF16 tensor-core GEMM.  None for FP32
        block scales (not BF16-exact)."""
        if self.spec.scale is ScaleRule.FP32:
            return None
        values = self._crop(self.code_values() * expand_blocks(self.block_decode(), self.spec.block))
        decode = self.tensor_scale.reshape(()).float() if self.tensor_scale is not None else \
            torch.ones((), dtype=torch.float32, device=values.device)
        return values.to(torch.bfloat16), decode

    def _crop(self, values: torch.Tensor) -> torch.Tensor:
        rows = math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1
        cols = self.shape[-1] if len(self.shape) else 1
        return values[:rows, :cols].reshape(self.shape)


def pack_codes(codes: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Two nibbles per byte, low nibble = even element (4-bit grids); E4M3 codes are bytes already."""
    if ELEMENT_BITS[grid] == 8:
        return codes
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor, grid: Grid) -> torch.Tensor:
    if ELEMENT_BITS[grid] == 8:
        return packed
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def expand_blocks(per_block: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[Mb, Kb] per-block values -> [Mb * br, Kb * bc] per-element values."""
    return per_block.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
