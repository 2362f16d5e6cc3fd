"""Fused Triton quantization into packed codes + block scales (a `QuantizedTensor`).

`triton_quantize(x, spec, seed=..., hadamard=..., signs=..., mu=..., transpose=...)` is bit-exact
with the reference (`hf_fp4.numerics.quantize`, `hf_fp4.apply_hadamard`) for every QuantSpec: all grids, 1D
blocks and 2D tiles, every scale rule, round-to-nearest and stochastic rounding (Philox noise in the
layout of `hf_fp4.numerics.philox.philox_noise`), zero padding, and the NaN policy.  It serves packing and
export; training uses `operand.py`, which writes GEMM operands instead of codes.

Per tile of [BLOCK_M, BLOCK_K] elements, in registers: optional mean subtraction, optional Hadamard,
block amax, scale, rounding (numerics.py), code assembly, nibble packing.  `transpose=True` quantizes
x^T (blocks along x's first dimension) by reading x with swapped strides, without a copy.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hf_fp4.numerics.formats import Grid
from hf_fp4.numerics.hadamard import padded_width
from hf_fp4.numerics.qtensor import NonFiniteError, QuantizedTensor
from hf_fp4.numerics.scales import ScaleRule
from hf_fp4.numerics.spec import NonFinite, QuantSpec, Rounding

from .launch import launcher
from .numerics import (block_any, block_max, encode_factor, e8m0_exponent, expand_blocks, flush_subnormals,
                       grid_code, grid_constants, hadamard, pow2, round_grid, sr_uniforms, tensor_encode_scale,
                       ue4m3_block_scale)

SCALE_CODES = {ScaleRule.E8M0_FLOOR: 0, ScaleRule.E8M0_CEIL: 1, ScaleRule.UE4M3_FP32: 2, ScaleRule.FP32: 3}


@triton.jit
def load_tile(x_ptr, rows, cols, M, K, stride_m, stride_k, mu_ptr, HAS_MU: tl.constexpr, EVEN: tl.constexpr = False):
    """A [rows, cols] tile of a strided matrix in FP32, zero outside [M, K]; minus mu[cols] if given.
    EVEN: the tile lies inside the matrix (no masks)."""
    ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :].to(tl.int64) * stride_k
    if EVEN:
        x = tl.load(ptrs).to(tl.float32)
        if HAS_MU:
            x = x - tl.load(mu_ptr + cols)[None, :]
    else:
        inside = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
        if HAS_MU:
            mu = tl.load(mu_ptr + cols, mask=cols < K, other=0.0)
            x = tl.where(inside, x - mu[None, :], 0.0)
    return flush_subnormals(x)


@triton.jit
def encode_tile(x, bad, stat_ptr, seed, rows, col0, KP, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                BC: tl.constexpr, GRID: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, QMAX: tl.constexpr,
                QM: tl.constexpr, QE: tl.constexpr, EMAX: tl.constexpr, BITS: tl.constexpr, SCALE: tl.constexpr,
                STOCHASTIC: tl.constexpr):
    """The reference's codes of a [BM, BK] FP32 tile (subnormals flushed, non-finite values zeroed and flagged in
    `bad`): (element codes [BM, BK] int32, sign in the top bit, 0 in a flagged block; the stored block scales
    [BM // BR, BK // BC] -- E8M0 / E4M3 bytes, or FP32 --; the flagged blocks).  SCALE 2's tensor amax is at
    stat_ptr; SR's noise is the padded [Mp, KP] matrix's at global `rows` and columns col0 + ..."""
    amax = block_max(tl.abs(x), BM, BK, BR, BC)  # [BM // BR, BK // BC]
    if SCALE == 0 or SCALE == 1:  # E8M0: floor (OCP) or ceil (truncation-free)
        e = e8m0_exponent(amax, SCALE == 1, QM, QE, EMAX)
        stored = (e + 127).to(tl.uint8)
        encode = pow2(-e)
    elif SCALE == 2:  # UE4M3 block scale + FP32 tensor scale
        s_enc = tensor_encode_scale(tl.load(stat_ptr), QMAX)
        s_b = ue4m3_block_scale(amax, s_enc, QMAX)
        stored = grid_code(s_b, -6, 3).to(tl.uint8)
        decode = s_b * tl.math.div_rn(1.0, s_enc)
        encode = tl.where(s_b > 0, encode_factor(decode), 0.0)
    else:  # FP32
        stored = tl.math.div_rn(amax, QMAX)
        encode = tl.where(stored > 0, tl.math.div_rn(tl.full(stored.shape, 1.0, tl.float32), stored), 0.0)
    bad_block = block_any(bad.to(tl.int32), BM, BK, BR, BC) > 0
    scaled = x * expand_blocks(encode, BM, BK, BR, BC)
    m = tl.abs(scaled)
    if STOCHASTIC:
        u = sr_uniforms(seed, rows, col0, KP, BM, BK)
    else:
        u = m
    q = round_grid(m, u, GRID, STOCHASTIC)
    sign = (scaled.to(tl.int32, bitcast=True) >> 31) & 1
    code = grid_code(q, EMIN, MBITS) | (sign << (BITS - 1))
    code = tl.where(expand_blocks(bad_block.to(tl.int32), BM, BK, BR, BC) > 0, 0, code)
    return code, stored, bad_block


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, stat_ptr, mu_ptr, signs_ptr, bad_ptr,
                     M, K, KP, stride_m, stride_k, seed,
                     BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                     GRID: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, QMAX: tl.constexpr,
                     QM: tl.constexpr, QE: tl.constexpr, EMAX: tl.constexpr, BITS: tl.constexpr,
                     SCALE: tl.constexpr, STOCHASTIC: tl.constexpr, H: tl.constexpr, HSCALE: tl.constexpr,
                     HAS_SIGNS: tl.constexpr, HAS_MU: tl.constexpr, STATS_ONLY: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    x = load_tile(x_ptr, rows, cols, M, K, stride_m, stride_k, mu_ptr, HAS_MU)
    if H > 0:
        x = hadamard(x, signs_ptr, BM, BK, H, HSCALE, HAS_SIGNS)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    x = tl.where(bad, 0.0, x)
    if STATS_ONLY:  # tensor amax (of the finite values) and a non-finite flag
        tl.atomic_max(stat_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        tl.atomic_max(bad_ptr, tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0))
        return
    code, stored, bad_block = encode_tile(x, bad, stat_ptr, seed, rows, pid_k * BK, KP, BM, BK, BR, BC, GRID, EMIN,
                                          MBITS, QMAX, QM, QE, EMAX, BITS, SCALE, STOCHASTIC)
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(code, [BM, BK // 2, 2]))
        packed = (lo | (hi << 4)).to(tl.uint8)
        pcols = pid_k * (BK // 2) + tl.arange(0, BK // 2)
        tl.store(codes_ptr + rows[:, None].to(tl.int64) * (tl.num_programs(1) * (BK // 2)) + pcols[None, :], packed)
    else:
        tl.store(codes_ptr + rows[:, None].to(tl.int64) * (tl.num_programs(1) * BK) + cols[None, :],
                 code.to(tl.uint8))
    NBM: tl.constexpr = BM // BR
    NBK: tl.constexpr = BK // BC
    srows = pid_m * NBM + tl.arange(0, NBM)
    scols = pid_k * NBK + tl.arange(0, NBK)
    sptr = scales_ptr + srows[:, None].to(tl.int64) * (tl.num_programs(1) * NBK) + scols[None, :]
    if SCALE == 3:
        tl.store(sptr, tl.where(bad_block, float("nan"), stored))
    else:
        nan_code: tl.constexpr = 255 if SCALE < 2 else 127
        tl.store(sptr, tl.where(bad_block, nan_code, stored).to(tl.uint8))


# Tile shape (rows, contraction, warps); rows >= 2D tile, contraction >= block and Hadamard size.
DEFAULT_TILE = (32, 64, 4)


def triton_quantize(x: torch.Tensor, spec: QuantSpec, seed: int | None = None, hadamard: int = 0,
                    signs: torch.Tensor | None = None, mu: torch.Tensor | None = None,
                    transpose: bool = False, tile: tuple[int, int, int] | None = None,
                    amax_hook=None) -> QuantizedTensor:
    """Quantize x ([..., K]; or x^T of a 2D x with transpose=True) with the fused kernel.  amax_hook (two-level
    rules): called with the statistics pass's tensor amax (FP32 [1]), returns the amax to scale by -- x is a shard
    of a tensor whose amax an all-reduce gives (FP4 all-gather)."""
    if spec.rounding is Rounding.STOCHASTIC and seed is None:
        raise ValueError("stochastic rounding with the Triton backend needs a seed")
    if transpose:
        if x.dim() != 2:
            raise ValueError("transpose=True needs a 2D tensor")
        x2, m, k, stride_m, stride_k = x, x.shape[1], x.shape[0], x.stride(1), x.stride(0)
        shape = torch.Size((m, k))
    else:
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        m, k, stride_m, stride_k, shape = x2.shape[0], x2.shape[1], x2.stride(0), x2.stride(1), x.shape
    br, bc = spec.block
    bm, bk, warps = tile or DEFAULT_TILE
    bm, bk = max(bm, br), max(bk, bc, hadamard or 1, 16)  # (SR: a Philox call serves 16 columns)
    kp = padded_width(k, hadamard, bc)  # the reference's padded K (SR offsets)
    dev = x.device
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    signs_t = signs.to(device=dev, dtype=torch.float32).contiguous() if signs is not None else dummy
    mu_t = mu.to(device=dev, dtype=torch.float32).contiguous() if mu is not None else dummy
    consts = dict(BM=bm, BK=bk, BR=br, BC=bc, **grid_constants(spec.grid), BITS=8 if spec.grid is Grid.E4M3 else 4,
                  SCALE=SCALE_CODES[spec.scale], STOCHASTIC=spec.rounding is Rounding.STOCHASTIC, H=hadamard,
                  HSCALE=(1.0 / math.sqrt(hadamard)) if hadamard else 1.0, HAS_SIGNS=signs is not None,
                  HAS_MU=mu is not None, num_warps=warps)
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    stat = torch.zeros(1, dtype=torch.float32, device=dev)
    if spec.scale is ScaleRule.UE4M3_FP32 or spec.nonfinite is NonFinite.RAISE:
        bad = torch.zeros(1, dtype=torch.int32, device=dev)
        launcher(_quantize_kernel)[grid](x2, dummy, dummy, stat, mu_t, signs_t, bad, m, k, kp, stride_m, stride_k,
                                         0, STATS_ONLY=True, **consts)
        if spec.nonfinite is NonFinite.RAISE and bool(bad.item()):
            raise NonFiniteError("quantize: input has NaN/Inf value(s); pass a QuantSpec with "
                                 "nonfinite='propagate' to turn their blocks into NaN instead")
        if amax_hook is not None and spec.scale is ScaleRule.UE4M3_FP32:
            stat = amax_hook(stat).reshape(1).to(torch.float32).contiguous()
    gm, gk = grid[0] * bm, grid[1] * bk
    bits = consts["BITS"]
    codes = torch.empty((gm, gk // (8 // bits)), dtype=torch.uint8, device=dev)
    scales = torch.empty((gm // br, gk // bc), dtype=torch.float32 if spec.scale is ScaleRule.FP32 else torch.uint8,
                         device=dev)
    launcher(_quantize_kernel)[grid](x2, codes, scales, stat, mu_t, signs_t, dummy, m, k, kp, stride_m, stride_k,
                                     seed or 0, STATS_ONLY=False, **consts)
    mp = triton.cdiv(m, br) * br
    codes = codes[:mp, : kp // (8 // bits)]
    scales = scales[: mp // br, : kp // bc]
    if spec.scale in (ScaleRule.E8M0_FLOOR, ScaleRule.E8M0_CEIL):
        scales = scales.view(torch.float8_e8m0fnu)
    elif spec.scale is ScaleRule.UE4M3_FP32:
        scales = scales.view(torch.float8_e4m3fn)
    tensor_scale = None
    if spec.scale is ScaleRule.UE4M3_FP32:
        from hf_fp4.numerics.scales import nvfp4_tensor_encode_scale
        tensor_scale = torch.reciprocal(nvfp4_tensor_encode_scale(stat[0], spec.grid))
    return QuantizedTensor(codes.contiguous(), scales.contiguous(), tensor_scale, shape, spec)
