"""SharQ's two activation operands from fused Triton passes, bit-exact with `hf_fp4.nn.sharq.sharq_operands`.

Per [BM, BK] tile of x, in registers: the 4:8 in-pairs mask (each group of 8 along K keeps the 2 of its 4
adjacent pairs with the largest |a| + |b|, ties to the lower pair), the backbone x_sp, its quantization
q_sp, the residual r = x - q_sp and its quantization q_res.  A two-level format (NVFP4: UE4M3 block scales
under an FP32 tensor scale) needs each tensor's amax before its blocks can be scaled, and r's amax needs
q_sp, so the kernel runs in three phases over x:

    phase 0: amax(x_sp) and a non-finite flag       (stats)
    phase 1: q_sp, r, amax(r)                        (stats)
    phase 2: q_sp and q_res, written as FP32 values  (one read of x for both operands)

Single-level formats (E8M0 scales: MXFP4) skip the two stats phases' tensor amax but keep phase 0's
non-finite check.  1D blocks along K and round-to-nearest only (SharQ quantizes fprop's activations).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_fp4.numerics.qtensor import NonFiniteError
from hf_fp4.numerics.scales import ScaleRule, nvfp4_tensor_encode_scale
from hf_fp4.numerics.spec import QuantSpec, Rounding

from .launch import launcher
from .numerics import flush_subnormals, grid_constants, quantize_tile
from .quant import SCALE_CODES


@triton.jit
def _pair_mask(a, BM: tl.constexpr, BK: tl.constexpr):
    """Kept elements of the 4:8 in-pairs backbone of |x| tile a [BM, BK] (BK a multiple of 8)."""
    G: tl.constexpr = BK // 8
    pairs = tl.sum(tl.reshape(a, [BM * G, 4, 2]), axis=2)  # [BM * G, 4]
    idx = tl.arange(0, 4)
    pi = tl.reshape(pairs, [BM * G, 4, 1])
    pj = tl.reshape(pairs, [BM * G, 1, 4])
    before = (pj > pi) | ((pj == pi) & (idx[None, None, :] < idx[None, :, None]))
    rank = tl.sum(before.to(tl.int32), axis=2)  # [BM * G, 4]: pairs ahead of this one
    keep = rank < 2
    keep = tl.broadcast_to(tl.reshape(keep, [BM * G, 4, 1]), [BM * G, 4, 2])
    return tl.reshape(keep, [BM, BK])


@triton.jit
def _sharq_kernel(x_ptr, sp_ptr, res_ptr, stat_ptr, bad_ptr, M, K, stride_m, stride_k,
                  BM: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, GRID: tl.constexpr, EMIN: tl.constexpr,
                  MBITS: tl.constexpr, QMAX: tl.constexpr, QM: tl.constexpr, QE: tl.constexpr,
                  EMAX: tl.constexpr, SCALE: tl.constexpr, PHASE: tl.constexpr, PARTS: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    inside = (rows[:, None] < M) & (cols[None, :] < K)
    ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :].to(tl.int64) * stride_k
    x = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)  # not flushed: the mask sees x as it is
    sparse = tl.where(_pair_mask(tl.abs(x), BM, BK), x, 0.0)
    if PHASE == 0:
        bad = (x != x) | (tl.abs(x) == float("inf"))
        tl.atomic_max(bad_ptr, tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0))
        tl.atomic_max(stat_ptr, tl.max(tl.max(tl.abs(flush_subnormals(sparse)), axis=1), axis=0))
        return
    sp_vals, sp_dec = quantize_tile(sparse, stat_ptr, 0, rows, 0, 0, BM, BK, 1, BC, GRID, QMAX, QM, QE, EMAX, SCALE,
                                    False)
    q_sp = sp_vals * sp_dec
    res = x - q_sp
    if PHASE == 1:
        tl.atomic_max(stat_ptr + 1, tl.max(tl.max(tl.abs(flush_subnormals(res)), axis=1), axis=0))
        return
    res_vals, res_dec = quantize_tile(res, stat_ptr + 1, 0, rows, 0, 0, BM, BK, 1, BC, GRID, QMAX, QM, QE, EMAX,
                                      SCALE, False)
    out = rows[:, None].to(tl.int64) * K + cols[None, :]
    if PARTS:  # grid value x block scale: exact in BF16 (the tensor decodes are applied after the GEMM)
        tl.store(sp_ptr + out, sp_vals.to(tl.bfloat16), mask=inside)
        tl.store(res_ptr + out, res_vals.to(tl.bfloat16), mask=inside)
    else:
        tl.store(sp_ptr + out, q_sp, mask=inside)
        tl.store(res_ptr + out, res_vals * res_dec, mask=inside)


def triton_sharq_operands(x: torch.Tensor, spec: QuantSpec, tile: tuple[int, int, int] = (32, 64, 4),
                          parts: bool = False):
    """(Q(x_sp), Q(x - Q(x_sp))) in FP32, each x's shape: `hf_fp4.nn.sharq.sharq_operands`, fused; parts: each as
    (BF16 grid value x block scale, FP32 tensor decode)."""
    if spec.block[0] != 1 or spec.rounding is not Rounding.NEAREST or spec.scale is ScaleRule.FP32:
        raise ValueError(f"the fused SharQ kernel takes 1D blocks, nearest rounding and E8M0 or UE4M3 scales; "
                         f"got {spec}")
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    bm, bk, warps = tile
    bk = max(bk, spec.block[1], 8)  # whole groups of 8
    dev = x.device
    stat = torch.zeros(2, dtype=torch.float32, device=dev)
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    q_sp, q_res = (torch.empty((m, k), dtype=torch.bfloat16 if parts else torch.float32, device=dev) for _ in "ab")
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    consts = dict(BM=bm, BK=bk, BC=spec.block[1], **grid_constants(spec.grid), SCALE=SCALE_CODES[spec.scale],
                  num_warps=warps)
    phases = (0, 1, 2) if spec.scale is ScaleRule.UE4M3_FP32 else (0, 2)
    for phase in phases:
        launcher(_sharq_kernel)[grid](x2, q_sp, q_res, stat, bad, m, k, x2.stride(0), x2.stride(1), PHASE=phase,
                                      PARTS=parts, **consts)
        if phase == 0 and bool(bad.item()):
            raise NonFiniteError("SharQ: the activation has NaN/Inf value(s)")
    if not parts:
        return q_sp.reshape(x.shape), q_res.reshape(x.shape)
    if spec.scale is ScaleRule.UE4M3_FP32:  # the kernels' decode, 1 / s_enc of each tensor amax
        decodes = torch.reciprocal(nvfp4_tensor_encode_scale(stat, spec.grid))
    else:
        decodes = torch.ones(2, dtype=torch.float32, device=dev)
    return (q_sp.reshape(x.shape), decodes[0]), (q_res.reshape(x.shape), decodes[1])
