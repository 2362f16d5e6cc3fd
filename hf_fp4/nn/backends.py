"""The quantizer with a choice of backend: the reference (hf_fp4.numerics.quantize, the spec) or the fused
Triton kernel (hf_fp4.kernels.quant, bit-exact with it).  This is hf_fp4.quantize / hf_fp4.fake_quantize: it
sits above both, so the reference never imports a kernel and the kernels import only the reference's types."""
from __future__ import annotations

import functools

import torch

from ..numerics import quantize as _reference
from ..numerics.formats import decode
from ..numerics.qtensor import QuantizedTensor, unpack_codes
from ..numerics.scales import ScaleRule
from ..numerics.spec import QuantSpec, as_spec

QUANTIZE_BACKENDS = ("reference", "triton")


def quantize(x: torch.Tensor, spec: "QuantSpec | str", generator: torch.Generator | None = None,
             noise: torch.Tensor | None = None, seed: int | None = None,
             backend: str = "reference") -> QuantizedTensor:
    """Quantize `x` ([..., K], blocks along the last dim) with `spec`; see hf_fp4.numerics.quantize.quantize.

    backend="triton" runs the fused kernel (on CPU under TRITON_INTERPRET=1); it draws stochastic-rounding noise
    with Philox from `seed`, as the reference does from the same seed."""
    if backend == "triton":
        if generator is not None or noise is not None:
            raise ValueError("the triton backend draws stochastic-rounding noise with Philox: pass seed=<int> "
                             "(the reference backend draws the same numbers from the same seed)")
        from ..kernels.quant import triton_quantize  # Triton is imported only when asked for

        return triton_quantize(x, as_spec(spec), seed=seed)
    if backend != "reference":
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(QUANTIZE_BACKENDS)}")
    return _reference.quantize(x, spec, generator, noise, seed)


def fake_quantize(x: torch.Tensor, spec: "QuantSpec | str", generator: torch.Generator | None = None,
                  noise: torch.Tensor | None = None, seed: int | None = None,
                  backend: str = "reference") -> torch.Tensor:
    """quantize(...).dequantize() in x's dtype."""
    return quantize(x, spec, generator, noise, seed, backend).dequantize(x.dtype)


@functools.lru_cache(maxsize=None)
def _decode_tables(spec: QuantSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference's own decodes of every byte: [256, n] element values of a code byte (two 4-bit codes,
    low nibble first, or one E4M3 code) and [256] block decode factors of a scale byte (None: FP32 scales)."""
    byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = decode(unpack_codes(byte[:, None], spec.grid), spec.grid)
    factors = None
    if spec.scale is not ScaleRule.FP32:
        # block_decode reads a scale byte as its bits: the byte itself stands for every storage dtype
        factors = QuantizedTensor(byte[:, None], byte[:, None], None, torch.Size((1, 1)), spec).block_decode()[:, 0]
    return values.to(device), None if factors is None else factors.to(device)


def fast_block_decode(q: QuantizedTensor) -> torch.Tensor:
    """q.block_decode() bit for bit, by byte lookup (see fast_dequantize)."""
    factor_of = _decode_tables(q.spec, q.codes.device)[1]
    return q.scales.float() if factor_of is None else factor_of[q.scales.view(torch.uint8).to(torch.int32)]


def fast_dequantize(q: QuantizedTensor, crop: bool = True) -> torch.Tensor:
    """q.dequantize() in FP32, bit for bit, in a handful of launches: the codes and block scales decoded by
    byte lookup in tables the reference made (`_decode_tables`), the products in the reference's order (grid
    value x block decode, then x tensor decode).  For hot loops over many small tensors (FP4AdamW's state).
    crop=False: the padded [Mp, Kp] values."""
    values = _decode_tables(q.spec, q.codes.device)[0][q.codes.to(torch.int32)].flatten(-2)
    (mp, kp), (br, bc) = values.shape, q.spec.block
    values = (values.view(mp // br, br, kp // bc, bc) * fast_block_decode(q).view(mp // br, 1, kp // bc, 1))
    values = values.view(mp, kp)
    if q.tensor_scale is not None:
        values = values * q.tensor_scale
    return q._crop(values) if crop else values
