"""Grouped expert GEMMs (issue 16's fast path, first part): all experts of a projection in one operand call per
tensor and one grouped GEMM per product, instead of a loop over experts with a host-read routing.

The routed (token, slot) pairs are gathered into expert segments aligned to the wgrad operands' blocks
(hf_fp4.nn.grouping); then, with W the projection's weights stacked as [E * N, K]:

    fprop: y  = Q(x)    Q(W_e)^T       per segment   torch._grouped_mm, offsets along the rows
    dgrad: dx = Q(dy)   Q(W_e^T)^T     per segment   torch._grouped_mm, offsets along the rows
    wgrad: dW_e = Q(dy_e^T) Q(x_e^T)^T per expert    torch._grouped_mm, offsets along the contraction

Bit-identical operands to the per-expert loop (the spec: ExpertsFP4.linear on each expert's rows) hold where
no operand depends on more than its own block: E8M0 block scales (no tensor amax, which would be per expert),
the BF16 operand form (no per-row FP8 reference exponent), round to nearest (the loop draws each expert's SR
noise from its own seeds and coordinates), and N and K multiples of every GEMM's alignment (the stacked
weights' blocks and Hadamard blocks then never straddle two experts).  `grouped_reason` names what breaks
that for a layer; such layers keep the loop.  So today: mxfp4 and mxfp4_dh (and mxfp8), in BF16 GEMMs with FP32
accumulation, outputs rounded once to BF16 -- equal to the loop's within FP32 accumulation error.  Two-level
formats (per-expert tensor scales), SR and FP8 GEMMs are still the loop's.
"""
from __future__ import annotations

import torch

from .autograd import ROLES, tensor_operands
from .grouping import GroupLayout
from .operands import LinearPlan
from .recipe import GEMMS


def grouped_reason(plan: LinearPlan, n: int, k: int, has_bias: bool, dtype: torch.dtype) -> str | None:
    """Why one projection (weights [E, n, k]) cannot take the grouped path bit-identically, or None."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no _grouped_mm"
    if dtype != torch.bfloat16:
        return f"activations in {dtype} (the grouped GEMMs write BF16)"
    if has_bias:
        return "expert biases"
    if plan.mean_bias or plan.frozen_weight:
        return "mean-bias removal / a frozen packed weight"
    for name in ("x", "w", "dy"):
        for p in getattr(plan, name):
            if p is None or p.form != "bf16":
                return f"a {p.form if p else 'missing'} operand ({name}): the grouped path runs BF16 operands"
            if p.stat:
                return f"{p.spec.scale.value} scales need a per-expert tensor amax ({name})"
            if p.stochastic:
                return f"stochastic rounding ({name}): the per-expert loop draws per expert"
    for g, dim in (("fprop", k), ("dgrad", n)):
        align = max(p.k_align for p in _gemm_plans(plan, g))
        if dim % align:
            return f"{g} contracts over {dim}, not a multiple of {align}"
    return None


def _gemm_plans(plan: LinearPlan, gemm: str):
    """The operand plans of one GEMM (its two operands)."""
    return [getattr(plan, t)[i] for t, roles in ROLES.items() for i, (g, _) in enumerate(roles) if g == gemm]


def segment_align(plan: LinearPlan) -> int:
    """Rows per expert segment: a multiple of the wgrad operands' blocks and Hadamard (blocks along the tokens)."""
    return max(16, *(p.k_align for p in _gemm_plans(plan, "wgrad")))


def _pair(t, plan: LinearPlan, tensor: str, signs, both: bool):
    """Both orientations of t (the second when `both`), as FP4LinearFunction makes them; round to nearest, so the
    seeds are not read."""
    zero = torch.zeros(2, dtype=torch.int64, device=t.device)
    return tensor_operands(t, plan, zero, signs, None, both, tensor, None)


class GroupedFP4Function(torch.autograd.Function):
    """One projection of every expert on the gathered rows xg [R, K] (segments ending at `ends`, [E] int32):
    weight [E, N, K]; returns [R, N] in BF16, zero on the rows no expert holds."""

    @staticmethod
    def forward(ctx, xg, weight, ends, valid, signs, plan: LinearPlan, need):
        e, n, k = weight.shape
        rows = xg.shape[0]
        ox, oxt = _pair(xg, plan, "x", signs, need[1])
        ow, owt = _pair(weight.reshape(e * n, k), plan, "w", signs, need[0])
        # fprop: y = Q(x) Q(W_e)^T per segment    [R,K] @ [K,N] -> [R,N]
        y = torch._grouped_mm(ox.data[:rows, :k], ow.data[:e * n, :k].view(e, n, k).transpose(1, 2), offs=ends)
        ctx.plan, ctx.shape, ctx.w_dtype = plan, (e, n, k, rows), weight.dtype
        ctx.save_for_backward(ends, valid, *signs, oxt.data if oxt is not None else None,
                              owt.data if owt is not None else None)
        return torch.where(valid[:, None], y, 0.0)

    @staticmethod
    def backward(ctx, dy):
        e, n, k, rows = ctx.shape
        ends, valid, *rest = ctx.saved_tensors
        signs, (xt, wt) = tuple(rest[:len(GEMMS)]), rest[len(GEMMS):]
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ody, odyt = _pair(dy.contiguous(), ctx.plan, "dy", signs, need_dw)
        dx = dw = None
        if need_dx:
            # dgrad: dx = Q(dy) Q(W_e^T)^T per segment    [R,N] @ [N,K] -> [R,K]
            dx = torch._grouped_mm(ody.data[:rows, :n], wt[:k, :e * n].view(k, e, n).permute(1, 2, 0), offs=ends)
            dx = torch.where(valid[:, None], dx, 0.0)
        if need_dw:
            # wgrad: dW_e = Q(dy_e^T) Q(x_e^T)^T per expert    [N,R_e] @ [R_e,K] -> [N,K]
            dw = torch._grouped_mm(odyt.data[:n, :rows], xt[:k, :rows].t(), offs=ends).to(ctx.w_dtype)
        return dx, dw, None, None, None, None, None


def grouped_projection(layout: GroupLayout, xg: torch.Tensor, weight: torch.Tensor, signs, plan: LinearPlan,
                       training: bool) -> torch.Tensor:
    """xg [R, K] (the layout's rows) through every expert's weight [E, N, K] -> [R, N] (BF16)."""
    ends = layout.offsets[1:].to(torch.int32)
    need = (training and xg.requires_grad, training and weight.requires_grad)
    return GroupedFP4Function.apply(xg, weight, ends, layout.valid, signs, plan, need)
