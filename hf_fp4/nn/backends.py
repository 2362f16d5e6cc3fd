"""The quantizer with a choice of backend: the reference (hf_fp4.numerics.quantize, the spec) or the fused
Triton kernel (hf_fp4.kernels.quant, bit-exact with it).  This is hf_fp4.quantize / hf_fp4.fake_quantize: it
sits above both, so the reference never imports a kernel and the kernels import only the reference's types."""
from __future__ import annotations

import torch

from ..numerics import quantize as _reference
from ..numerics.qtensor import QuantizedTensor
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
