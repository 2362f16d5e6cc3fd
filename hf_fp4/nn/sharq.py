"""SharQ (training-free FP4 inference): a 4:8 "in pairs" sparse backbone plus its residual, both in FP4.

For an activation x [..., K] entering fprop (the spec, RESEARCH.md item 5):

    mask   in each group of 8 along K (zero-padded), the 2 of its 4 adjacent pairs (x[2i], x[2i+1]) with the
           largest magnitude |x[2i]| + |x[2i+1]| are kept (ties: the lower pair), the others zeroed -> x_sp
    q_sp   = Q(x_sp)                 fprop's activation format (NVFP4 in the paper), its own tensor scale
    q_res  = Q(x - q_sp)             the residual against the *quantized* backbone, quantized the same way
    y      = q_sp Q(W)^T + q_res Q(W)^T          two GEMMs over the one FP4 weight payload

Inference only: FP4Linear refuses it while gradients flow, and with an fprop Hadamard (the mask is defined
on the activations themselves).  This is the reference; `hf_fp4.kernels.sharq` computes both operands bit
for bit in fused Triton passes (backend="triton").
"""
from __future__ import annotations

import torch

from ..numerics.quantize import fake_quantize, quantize
from ..numerics.scales import ScaleRule
from ..numerics.spec import QuantSpec

SCHEMES = ("plain", "sharq")
GROUP, PAIRS, KEEP = 8, 4, 2


def pair_mask(x: torch.Tensor) -> torch.Tensor:
    """Boolean [..., K]: the kept elements of the 4:8 in-pairs backbone of x."""
    k = x.shape[-1]
    pad = -k % GROUP
    mag = torch.nn.functional.pad(x.detach().float().abs(), (0, pad))
    pairs = mag.reshape(*mag.shape[:-1], -1, PAIRS, 2).sum(-1)                 # [..., K/8, 4]
    order = torch.sort(pairs, dim=-1, descending=True, stable=True).indices    # ties: the lower pair first
    keep = torch.zeros_like(pairs, dtype=torch.bool).scatter_(-1, order[..., :KEEP], True)
    return keep.repeat_interleave(2, dim=-1).reshape(*mag.shape)[..., :k]


def sharq_operands(x: torch.Tensor, spec: QuantSpec, backend: str = "reference", parts: bool = False):
    """(Q(x_sp), Q(x - Q(x_sp))) in FP32, each [..., K]; backend "triton" runs the fused kernel.  parts: each
    as (BF16 grid value x block scale, FP32 tensor decode) -- QuantizedTensor.tensor_core_parts, whose product
    is the FP32 operand bit for bit -- for exact BF16 tensor-core GEMMs (not for FP32 block scales)."""
    if backend == "triton":
        from ..kernels.sharq import triton_sharq_operands
        return triton_sharq_operands(x, spec, parts=parts)
    if backend != "reference":
        raise ValueError(f"unknown backend {backend!r}; valid: reference, triton")
    flat = x.reshape(-1, x.shape[-1]).float()
    sparse = torch.where(pair_mask(flat), flat, torch.zeros_like(flat))
    q_sp = quantize(sparse, spec)
    res = flat - q_sp.dequantize()
    if parts:
        if spec.scale is ScaleRule.FP32:
            raise ValueError("SharQ operand parts need E8M0 or UE4M3 block scales (FP32 ones are not BF16-exact)")
        (sp, d_sp), (rs, d_rs) = q_sp.tensor_core_parts(), quantize(res, spec).tensor_core_parts()
        return (sp.reshape(x.shape), d_sp), (rs.reshape(x.shape), d_rs)
    return q_sp.dequantize().reshape(x.shape), fake_quantize(res, spec).reshape(x.shape)
