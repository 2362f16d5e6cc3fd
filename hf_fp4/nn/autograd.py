"""FP4LinearFunction: the one autograd function of an FP4 linear layer, its three GEMMs over recipe data.

It takes tensors and a `LinearPlan` (hf_fp4.nn.operands: the form of each GEMM's operands), never the module.
Each tensor is read once for both of its orientations (the operand layer), and each GEMM is one labelled line:

    fprop: y  = Q(x)    Q(W)^T       [T,K] @ [K,N] -> [T,N]
    dgrad: dx = Q(dy)   Q(W^T)^T     [T,N] @ [N,K] -> [T,K]
    wgrad: dW = Q(dy^T) Q(x^T)^T     [N,T] @ [T,K] -> [N,K]

Mean-bias removal quantizes x - mu in fprop and wgrad and adds the rank-one terms back in high precision.
"""
from __future__ import annotations

import torch
from torch import nn

from .fp4_gather import GatheredFP4Weight
from .operands import LinearPlan, Operand, gemm, operands
from .recipe import GEMMS

# The orientations of each tensor, as (GEMM, role) pairs: x, W, dy.
ROLES = {"x": (("fprop", "lhs"), ("wgrad", "rhs")), "w": (("fprop", "rhs"), ("dgrad", "rhs")),
         "dy": (("dgrad", "lhs"), ("wgrad", "lhs"))}


def output_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def x_seeds(plan: LinearPlan, seeds: torch.Tensor) -> torch.Tensor:
    """The Philox seeds of x's operands: the layer's own under stochastic rounding or a random Hadamard, else
    one constant (see FP4LinearFunction.forward)."""
    return seeds[0:2] if plan.seeded("x") else torch.zeros(2, dtype=seeds.dtype, device=seeds.device)


def tensor_operands(t, plan: LinearPlan, seeds, signs, mu, need, tensor, observer, groups=None):
    """Both orientations of one tensor (the second only when its GEMM will run); t as the layer got it (the
    operand layer reads [..., C] as [rows, C] without a reshape).  groups: its rows in groups quantized as separate
    tensors (RowGroups; seeds [E, 2])."""
    pair = getattr(plan, tensor)
    plans = (pair[0], pair[1] if need else None)
    s = tuple(signs[GEMMS.index(g)] for g, _ in ROLES[tensor])
    ops = operands(t, plans, seeds, s, mu, plan.key(tensor, need), plan.triton_ops, groups)
    if observer is not None:
        t = t.reshape(-1, t.shape[-1])
        observer(tensor, t if mu is None else t.float() - mu, plans, ops, signs)
    return ops


class FP4LinearFunction(torch.autograd.Function):
    """The three GEMMs of one FP4Linear step (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, seeds, signs, plan: LinearPlan, need, out_dtype, observer):
        n, k = weight.shape
        x2 = x.reshape(-1, k)
        mu = x2.float().mean(0) if plan.mean_bias else None
        # Layers that share an input (q/k/v, gate/up) and round it deterministically make identical operands of
        # it: with seeds that are the same constant for all of them (and shared sign vectors), torch.compile's
        # common-subexpression elimination quantizes x once for all of them.
        ox, oxt = tensor_operands(x, plan, x_seeds(plan, seeds), signs, mu, need[1], "x", observer)
        ctx.gathered = None
        if isinstance(weight, GatheredFP4Weight):  # FP4 all-gather: W arrived as its operands' codes and scales
            ow, owt = weight.operands(plan.w, need[0])
            if need[0] and owt is None:  # dgrad's comes with the backward's all-gather
                ctx.gathered = weight
        else:
            ow, owt = tensor_operands(weight, plan, seeds[2:4], signs, None, need[0], "w", observer)
        # fprop: y = Q(x) Q(W)^T    [T,K] @ [K,N] -> [T,N]
        if plan.forms[0] == "hp" and mu is None:
            y = nn.functional.linear(x2, weight, bias)  # quantization off: exactly nn.Linear
        else:
            y = gemm(ox, ow, (plan.x[0], plan.w[0]), x2.shape[0], n, torch.float32 if mu is not None else out_dtype,
                     plan.triton_ops)
            if mu is not None:
                y = y.float() + mu @ weight.float().t()  # rank-one mean term, high precision
            if bias is not None:
                y = y + bias
        ctx.plan, ctx.observer = plan, observer
        ctx.shapes = (x.shape, x.dtype, bias is not None, x2.shape[0], n, k, weight.dtype, out_dtype)
        saved = list(oxt or ()) + list(owt or ())
        ctx.n_x, ctx.n_w = len(oxt or ()), len(owt or ())
        ctx.save_for_backward(seeds, mu, *signs, *saved)
        return y.to(out_dtype).reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        if plan.frozen_weight:
            raise RuntimeError("a packed FP4 export holds the quantized (rotated) fprop weight only and is for "
                               "inference; train from the training checkpoint (pretrain.py's final/) or the bf16 "
                               "export instead")
        x_shape, x_dtype, has_bias, t, n, k, w_dtype, act_dtype = ctx.shapes
        seeds, mu, *rest = ctx.saved_tensors
        signs, saved = tuple(rest[:len(GEMMS)]), rest[len(GEMMS):]
        oxt = _operand(saved[:ctx.n_x])
        owt = _operand(saved[ctx.n_x:ctx.n_x + ctx.n_w])
        dy2 = dy.reshape(-1, n)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ody, odyt = tensor_operands(dy, plan, seeds[4:6], signs, None, need_dw, "dy", ctx.observer)
        dx = dw = db = None
        if need_dx:
            if ctx.gathered is not None:  # FP4 all-gather: from the backward's gather
                owt = ctx.gathered.dgrad_operand(plan.w[1])
            # dgrad: dx = Q(dy) Q(W^T)^T    [T,N] @ [N,K] -> [T,K]
            # (outputs in the activation dtype, as nn.Linear's under autocast, then in the input's dtype)
            dx = gemm(ody, owt, (plan.dy[0], plan.w[1]), t, k, act_dtype, plan.triton_ops).to(x_dtype).reshape(x_shape)
        if need_dw:
            # wgrad: dW = Q(dy^T) Q(x^T)^T    [N,T] @ [T,K] -> [N,K]
            dw = gemm(odyt, oxt, (plan.dy[1], plan.x[1]), n, k, torch.float32 if mu is not None else act_dtype,
                      plan.triton_ops)
            if mu is not None:
                dw = dw + dy2.float().sum(0)[:, None] * mu[None, :]
            dw = dw.to(w_dtype)
        if has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(w_dtype)
        return dx, dw, db, None, None, None, None, None, None


def _operand(parts) -> Operand | None:
    return Operand(*parts) if parts else None
