"""Fused Triton quantization: one read of the high-precision tensor -> packed codes + block scales.

`triton_quantize(x, spec, seed=..., hadamard=..., signs=..., mu=..., transpose=...)` is bit-exact
with the reference (`hf_fp4.quantize`, `hf_fp4.apply_hadamard`) for every QuantSpec: all grids, 1D
blocks and 2D tiles, every scale rule, round-to-nearest and stochastic rounding (Philox noise at the
element's offset in the padded operand: `hf_fp4.philox`), zero padding, and the NaN policy.

Per tile of [BLOCK_M, BLOCK_K] elements, in registers: optional mean subtraction, optional Hadamard
(signs, butterflies of stride 1 .. n/2, one scale: the reference's order of operations), block amax,
scale, rounding, code assembly, nibble packing.  The rounding is written arithmetically instead of
with the reference's table: for a float grid with minimum exponent EMIN and MBITS mantissa bits the
grid step at magnitude m is 2^(max(floor(log2 m), EMIN) - MBITS); round-to-nearest-even of m / step
uses the 1.5 * 2^23 trick (exact RNE in FP32), stochastic rounding compares a uniform draw with the
fraction m / step - floor(m / step).  E1M2 and INT4 are uniform grids in this form.  The tests check
both formulations agree bit for bit.

`transpose=True` quantizes x^T (blocks along x's first dimension) by reading x with swapped strides,
without materialising the transpose.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hf_fp4.formats import Grid, grid_max
from hf_fp4.quantize import NonFiniteError, QuantizedTensor
from hf_fp4.scales import ScaleRule, nvfp4_tensor_encode_scale
from hf_fp4.spec import NonFinite, QuantSpec, Rounding

# (EMIN, MBITS) of each grid as a float format; INT4 and E1M2 are uniform grids (one binade).
GRID_PARAMS = {Grid.E2M1: (0, 1), Grid.E1M2: (0, 2), Grid.INT4: (2, 2), Grid.E4M3: (-6, 3)}
SCALE_CODES = {ScaleRule.E8M0_FLOOR: 0, ScaleRule.E8M0_CEIL: 1, ScaleRule.UE4M3_FP32: 2, ScaleRule.FP32: 3}
# OCP emax of the element grid, and the grid max as (mantissa in [1, 2), exponent) for the ceil rule
GRID_EMAX = {Grid.E2M1: 2, Grid.E1M2: 0, Grid.INT4: 2, Grid.E4M3: 8}


@triton.jit
def _floor_log2(m):
    """floor(log2 m) of positive normal FP32 m from its exponent field (-127 for zero/subnormals)."""
    return ((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _pow2(e):
    """2^e in FP32 for integer e in [-149, 127] (subnormals built bitwise)."""
    normal = ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(e + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def _round_grid(m, u, EMIN: tl.constexpr, MBITS: tl.constexpr, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Round non-negative m onto the grid: nearest-even or stochastic with uniforms u; saturate."""
    e = tl.maximum(_floor_log2(m), EMIN)
    step = _pow2(e - MBITS)
    v = m * _pow2(MBITS - e)  # m / step, exact
    if STOCHASTIC:
        lo = tl.floor(v)
        r = tl.where(u < v - lo, lo + 1.0, lo)
    else:
        big = 12582912.0  # 1.5 * 2^23: FP32 addition rounds v to the nearest integer, ties to even
        r = (v + big) - big
    return tl.minimum(r * step, QMAX)


@triton.jit
def _grid_code(q, EMIN: tl.constexpr, MBITS: tl.constexpr):
    """Magnitude code of a grid value q >= 0: mantissa-with-implicit-bit + (E - EMIN) * 2^MBITS."""
    e = tl.maximum(_floor_log2(q), EMIN)
    m_int = (q * _pow2(MBITS - e)).to(tl.int32)
    return m_int + (e - EMIN) * (1 << MBITS)


@triton.jit
def _butterfly(x, BM: tl.constexpr, BK: tl.constexpr, S: tl.constexpr):
    """One stage of stride S: each pair (a at the lower index, b = a's partner) -> (a + b, a - b)."""
    x3 = tl.permute(tl.reshape(x, [BM * BK // (2 * S), 2, S]), (0, 2, 1))
    a, b = tl.split(x3)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [BM, BK])


@triton.jit
def _hadamard(x, signs_ptr, BM: tl.constexpr, BK: tl.constexpr, H: tl.constexpr, HSCALE: tl.constexpr,
              HAS_SIGNS: tl.constexpr):
    """Blockwise diag(s) H_n along the last dim: signs, butterflies of stride 1 .. H/2, one scale."""
    if HAS_SIGNS:
        s = tl.load(signs_ptr + tl.arange(0, H))
        x = tl.reshape(tl.reshape(x, [BM * BK // H, H]) * s[None, :], [BM, BK])
    x = _butterfly(x, BM, BK, 1)
    x = _butterfly(x, BM, BK, 2)
    x = _butterfly(x, BM, BK, 4)
    x = _butterfly(x, BM, BK, 8)
    if H > 16:
        x = _butterfly(x, BM, BK, 16)
    if H > 32:
        x = _butterfly(x, BM, BK, 32)
    if H > 64:
        x = _butterfly(x, BM, BK, 64)
    if H > 128:
        x = _butterfly(x, BM, BK, 128)
    return x * HSCALE


@triton.jit
def _block_scales(amax, senc_ptr, EMAX: tl.constexpr, QM: tl.constexpr, QE: tl.constexpr, QMAX: tl.constexpr,
                  SCALE: tl.constexpr):
    """(stored, encode, decode, e, s_b) of every block from its amax (hf_fp4.scales, bit for bit)."""
    e = tl.zeros(amax.shape, tl.int32)
    s_b = amax
    if SCALE == 0 or SCALE == 1:  # E8M0: floor (OCP) or ceil (truncation-free)
        f = _floor_log2(amax)
        if SCALE == 0:
            e = f - EMAX
        else:
            r = amax * _pow2(-f)  # mantissa of amax in [1, 2)
            e = tl.where(r <= QM, f - QE, f - QE + 1)
        e = tl.where(amax > 0, e, -127)
        e = tl.minimum(tl.maximum(e, -127), 127)
        stored = (e + 127).to(tl.uint8)
        decode = _pow2(e)
        encode = _pow2(-e)
    elif SCALE == 2:  # UE4M3 block scale + FP32 tensor scale
        s_enc = tl.load(senc_ptr)
        s_dec = tl.load(senc_ptr + 1)
        block = tl.minimum(tl.math.div_rn(amax, QMAX) * s_enc, 3.4028234663852886e38)
        s_b = _round_grid(block, block, -6, 3, 448.0, False)
        stored = _grid_code(s_b, -6, 3).to(tl.uint8)
        decode = s_b * s_dec
        encode = tl.where(s_b > 0, tl.math.div_rn(tl.full(decode.shape, 1.0, tl.float32), decode), 0.0)
    else:  # FP32
        decode = tl.math.div_rn(amax, QMAX)
        encode = tl.where(decode > 0, tl.math.div_rn(tl.full(decode.shape, 1.0, tl.float32), decode), 0.0)
        stored = decode
    return stored, encode, decode, e, s_b


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, amax_ptr, mu_ptr, signs_ptr, bad_ptr,
                     op_ptr, eref_ptr, lost_ptr, OP_COLS,
                     M, K, KP, stride_m, stride_k, senc_ptr, seed,
                     BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                     EMIN: tl.constexpr, MBITS: tl.constexpr, QMAX: tl.constexpr, QM: tl.constexpr,
                     QE: tl.constexpr, EMAX: tl.constexpr, BITS: tl.constexpr, SCALE: tl.constexpr,
                     STOCHASTIC: tl.constexpr, H: tl.constexpr, HSCALE: tl.constexpr, HAS_SIGNS: tl.constexpr,
                     HAS_MU: tl.constexpr, AMAX_ONLY: tl.constexpr, OUT: tl.constexpr = 0,
                     SHIFT: tl.constexpr = 0, DMAX: tl.constexpr = 0):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    inside = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :].to(tl.int64) * stride_k,
                mask=inside, other=0.0).to(tl.float32)
    if HAS_MU:
        mu = tl.load(mu_ptr + cols, mask=cols < K, other=0.0)
        x = tl.where(inside, x - mu[None, :], 0.0)
    if H > 0:
        x = _hadamard(x, signs_ptr, BM, BK, H, HSCALE, HAS_SIGNS)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    x = tl.where(bad, 0.0, x)
    NBM: tl.constexpr = BM // BR
    NBK: tl.constexpr = BK // BC
    a4 = tl.reshape(tl.abs(x), [NBM, BR, NBK, BC])
    amax = tl.max(tl.max(a4, axis=3), axis=1)  # [NBM, NBK]
    if AMAX_ONLY:
        tl.store(amax_ptr + pid_m * tl.num_programs(1) + pid_k, tl.max(tl.max(amax, axis=1), axis=0))
        tl.store(bad_ptr + pid_m * tl.num_programs(1) + pid_k, tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0))
        return
    stored, encode, decode, e, s_b = _block_scales(amax, senc_ptr, EMAX, QM, QE, QMAX, SCALE)
    bad_block = tl.max(tl.max(tl.reshape(bad.to(tl.int32), [NBM, BR, NBK, BC]), axis=3), axis=1) > 0
    enc = tl.reshape(tl.broadcast_to(tl.reshape(encode, [NBM, 1, NBK, 1]), [NBM, BR, NBK, BC]), [BM, BK])
    scaled = x * enc
    m = tl.abs(scaled)
    if STOCHASTIC:
        u = tl.rand(seed, rows[:, None].to(tl.int64) * KP + cols[None, :])  # the reference's padded layout
    else:
        u = m
    q = _round_grid(m, u, EMIN, MBITS, QMAX, STOCHASTIC)
    sign = (scaled.to(tl.int32, bitcast=True) >> 31) & 1
    code = _grid_code(q, EMIN, MBITS) | (sign << (BITS - 1))
    bad_full = tl.reshape(tl.broadcast_to(tl.reshape(bad_block, [NBM, 1, NBK, 1]), [NBM, BR, NBK, BC]), [BM, BK])
    code = tl.where(bad_full, 0, code)
    if OUT > 0:
        # GEMM operand instead of codes: v * s_b (BF16, exact) or v * 2^(e_b - e_ref + SHIFT) (FP8, exact
        # while e_ref - e_b <= DMAX for every non-zero block; a tile past that sets its `lost` flag)
        if OUT == 2:
            e_ref = tl.load(eref_ptr)
            rel = e - e_ref + SHIFT
            lost = tl.max(tl.max(((amax > 0) & (e_ref - e > DMAX)).to(tl.int32), axis=1), axis=0)
            tl.store(lost_ptr + pid_m * tl.num_programs(1) + pid_k, lost)
            factor = _pow2(tl.maximum(rel, -149))
        elif SCALE == 2:
            factor = s_b
        else:
            factor = decode
        fac = tl.reshape(tl.broadcast_to(tl.reshape(factor, [NBM, 1, NBK, 1]), [NBM, BR, NBK, BC]), [BM, BK])
        val = tl.where(sign != 0, -q, q) * fac
        val = tl.where(bad_full, float("nan"), val)
        optr = op_ptr + rows[:, None].to(tl.int64) * OP_COLS + cols[None, :]
        if OUT == 2:
            tl.store(optr, val.to(tl.float8e4nv))
        else:
            tl.store(optr, val.to(tl.bfloat16))
        return
    # ---- stores: codes (packed for 4-bit grids) and scales ----
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(code, [BM, BK // 2, 2]))
        packed = (lo | (hi << 4)).to(tl.uint8)
        pcols = pid_k * (BK // 2) + tl.arange(0, BK // 2)
        tl.store(codes_ptr + rows[:, None].to(tl.int64) * (tl.num_programs(1) * (BK // 2)) + pcols[None, :], packed)
    else:
        tl.store(codes_ptr + rows[:, None].to(tl.int64) * (tl.num_programs(1) * BK) + cols[None, :],
                 code.to(tl.uint8))
    srows = pid_m * NBM + tl.arange(0, NBM)
    scols = pid_k * NBK + tl.arange(0, NBK)
    sptr = scales_ptr + srows[:, None].to(tl.int64) * (tl.num_programs(1) * NBK) + scols[None, :]
    if SCALE == 3:
        tl.store(sptr, tl.where(bad_block, float("nan"), stored))
    else:
        nan_code: tl.constexpr = 255 if SCALE < 2 else 127
        tl.store(sptr, tl.where(bad_block, nan_code, stored).to(tl.uint8))


def _launch(grid, x, codes, scales, amax, mu, signs, bad, op, eref, lost, op_cols, m, k, kp, stride_m, stride_k,
            senc, seed, common, **flags):
    """One launch of the quantization kernel (amax pass, codes + scales, or GEMM operand: see flags)."""
    _quantize_kernel[grid](x, codes, scales, amax, mu, signs, bad, op, eref, lost, op_cols, m, k, kp, stride_m,
                           stride_k, senc, seed, **common, **flags)


# Tile shape (rows, contraction, warps); rows >= 2D tile, contraction >= block and Hadamard size.
DEFAULT_TILE = (32, 64, 4)


def _tile(spec: QuantSpec, hadamard: int, tile: tuple[int, int, int] | None) -> tuple[int, int, int]:
    bm, bk, warps = tile or DEFAULT_TILE
    return max(bm, spec.block[0]), max(bk, spec.block[1], hadamard or 1), warps


def _as_matrix_view(x: torch.Tensor, transpose: bool):
    """(2D view, rows, cols, row stride, col stride, logical shape) without copying."""
    if transpose:
        if x.dim() != 2:
            raise ValueError("transpose=True needs a 2D tensor")
        return x, x.shape[1], x.shape[0], x.stride(1), x.stride(0), torch.Size((x.shape[1], x.shape[0]))
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2, x2.shape[0], x2.shape[1], x2.stride(0), x2.stride(1), x.shape


def _constants(spec: QuantSpec, bm: int, bk: int, warps: int, hadamard: int, signs, mu) -> dict:
    emin, mbits = GRID_PARAMS[spec.grid]
    qm, qe = math.frexp(grid_max(spec.grid))
    return dict(BM=bm, BK=bk, BR=spec.block[0], BC=spec.block[1], EMIN=emin, MBITS=mbits, QMAX=grid_max(spec.grid),
                QM=qm * 2, QE=qe - 1, EMAX=GRID_EMAX[spec.grid], BITS=8 if spec.grid is Grid.E4M3 else 4,
                SCALE=SCALE_CODES[spec.scale], STOCHASTIC=spec.rounding is Rounding.STOCHASTIC, H=hadamard,
                HSCALE=(1.0 / math.sqrt(hadamard)) if hadamard else 1.0, HAS_SIGNS=signs is not None,
                HAS_MU=mu is not None, num_warps=warps)


def _amax_pass(args, grid, common, dev):
    """Per-tile amax and non-finite flags (same rotation as the quantization pass)."""
    x, m, k, kp, stride_m, stride_k, mu_t, signs_t, dummy = args
    tile_amax = torch.empty(grid, dtype=torch.float32, device=dev)
    tile_bad = torch.empty(grid, dtype=torch.int32, device=dev)
    _launch(grid, x, dummy, dummy, tile_amax, mu_t, signs_t, tile_bad, dummy, dummy, dummy, 0,
            m, k, kp, stride_m, stride_k, dummy, 0, common, AMAX_ONLY=True)
    return tile_amax.max(), tile_bad


def _tensor_scales(spec: QuantSpec, tensor_amax: torch.Tensor) -> torch.Tensor:
    """[s_enc, s_dec] (FP32, on the device) of two-level rules; [1, 1] otherwise."""
    if spec.scale is not ScaleRule.UE4M3_FP32:
        return torch.ones(2, dtype=torch.float32, device=tensor_amax.device)
    s_enc = nvfp4_tensor_encode_scale(tensor_amax.float(), spec.grid).reshape(1)
    return torch.cat([s_enc, torch.reciprocal(s_enc)])


def _prepare(x, spec, hadamard, signs, mu, transpose, tile):
    x2, m, k, stride_m, stride_k, shape = _as_matrix_view(x, transpose)
    bm, bk, warps = _tile(spec, hadamard, tile)
    dev = x.device
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    signs_t = signs.to(device=dev, dtype=torch.float32).contiguous() if signs is not None else dummy
    mu_t = mu.to(device=dev, dtype=torch.float32).contiguous() if mu is not None else dummy
    kp = triton.cdiv(k, spec.block[1]) * spec.block[1]  # the reference's padded K (SR offsets)
    common = _constants(spec, bm, bk, warps, hadamard, signs, mu)
    return (x2, m, k, kp, stride_m, stride_k, mu_t, signs_t, dummy), shape, (bm, bk), common


def triton_quantize(x: torch.Tensor, spec: QuantSpec, seed: int | None = None, hadamard: int = 0,
                    signs: torch.Tensor | None = None, mu: torch.Tensor | None = None,
                    transpose: bool = False, tensor_amax: torch.Tensor | None = None,
                    tile: tuple[int, int, int] | None = None) -> QuantizedTensor:
    """Quantize x ([..., K]; or x^T of a 2D x with transpose=True) with the fused kernel."""
    if spec.rounding is Rounding.STOCHASTIC and seed is None:
        raise ValueError("stochastic rounding with the Triton backend needs a seed")
    args, shape, (bm, bk), common = _prepare(x, spec, hadamard, signs, mu, transpose, tile)
    x2, m, k, kp, stride_m, stride_k, mu_t, signs_t, dummy = args
    br, bc = spec.block
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    mp = triton.cdiv(m, br) * br
    gm, gk = grid[0] * bm, grid[1] * bk
    bits = common["BITS"]
    dev = x.device
    codes = torch.empty((gm, gk // (8 // bits)), dtype=torch.uint8, device=dev)
    scales = torch.empty((gm // br, gk // bc), dtype=torch.float32 if spec.scale is ScaleRule.FP32 else torch.uint8,
                         device=dev)
    need_amax = spec.scale is ScaleRule.UE4M3_FP32 and tensor_amax is None
    check_bad = spec.nonfinite is NonFinite.RAISE
    if need_amax or check_bad:
        amax, tile_bad = _amax_pass(args, grid, common, dev)
        if check_bad and bool(tile_bad.any()):
            raise NonFiniteError("quantize: input has NaN/Inf value(s); pass a QuantSpec with "
                                 "nonfinite='propagate' to turn their blocks into NaN instead")
        tensor_amax = amax if need_amax else tensor_amax
    senc = _tensor_scales(spec, tensor_amax if tensor_amax is not None else dummy)
    _launch(grid, x2, codes, scales, dummy, mu_t, signs_t, dummy, dummy, dummy, dummy, 0,
            m, k, kp, stride_m, stride_k, senc, seed or 0, common, AMAX_ONLY=False)
    codes = codes[:mp, : kp // (8 // bits)]
    scales = scales[: mp // br, : kp // bc]
    if spec.scale in (ScaleRule.E8M0_FLOOR, ScaleRule.E8M0_CEIL):
        scales = scales.view(torch.float8_e8m0fnu)
    elif spec.scale is ScaleRule.UE4M3_FP32:
        scales = scales.view(torch.float8_e4m3fn)
    tensor_scale = senc[1].clone() if spec.scale is ScaleRule.UE4M3_FP32 else None
    return QuantizedTensor(codes.contiguous(), scales.contiguous(), tensor_scale, shape, spec)


@dataclass
class GemmOperand:
    """A GEMM-ready operand: [rows_alloc, k_alloc] BF16 (v * block scale) or FP8 (folded powers of two)."""

    data: torch.Tensor
    scale: torch.Tensor          # FP32 0-dim: the GEMM output is multiplied by scale_a * scale_b
    fp8: bool
    lost: torch.Tensor | None    # FP8: per-tile flags, set where E4M3 could not hold a block exactly
    rows: int


def fp8_shift(grid: Grid) -> int:
    """SHIFT = floor(log2(448 / grid max)): the largest element lands at <= 448."""
    return int(math.floor(math.log2(448.0 / grid_max(grid))))


def fp8_dmax(grid: Grid) -> int:
    """Binades below the reference exponent that E4M3 (subnormal step 2^-9) still holds exactly."""
    emin, mbits = GRID_PARAMS[grid]
    return fp8_shift(grid) + 9 + emin - mbits


def fp8_capable(spec: QuantSpec) -> bool:
    """Power-of-two block scales on a 4-bit grid: exact in E4M3 after folding."""
    return spec.scale in (ScaleRule.E8M0_FLOOR, ScaleRule.E8M0_CEIL) and spec.grid is not Grid.E4M3


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def triton_gemm_operand(x: torch.Tensor, spec: QuantSpec, *, fp8: bool, k_alloc: int, seed: int | None = None,
                        hadamard: int = 0, signs: torch.Tensor | None = None, mu: torch.Tensor | None = None,
                        tile: tuple[int, int, int] | None = None) -> GemmOperand:
    """Quantize straight into a GEMM operand (no codes round trip); NaN/Inf blocks become NaN."""
    if spec.scale is ScaleRule.FP32 or (fp8 and (spec.scale not in (ScaleRule.E8M0_FLOOR, ScaleRule.E8M0_CEIL)
                                               or spec.grid is Grid.E4M3)):
        raise ValueError(f"{spec} has no {'FP8' if fp8 else 'BF16'} GEMM operand form")
    args, _, (bm, bk), common = _prepare(x, spec, hadamard, signs, mu, False, tile)
    x2, m, k, kp, stride_m, stride_k, mu_t, signs_t, dummy = args
    if k_alloc % bk:
        raise ValueError(f"k_alloc={k_alloc} must be a multiple of the tile's {bk}")
    dev = x.device
    rows_alloc = round_up(m, 128)
    grid = (rows_alloc // bm, k_alloc // bk)
    amax, _ = _amax_pass(args, grid, common, dev)
    senc = _tensor_scales(spec, amax)
    data = torch.empty((rows_alloc, k_alloc), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev)
    lost = None
    if fp8:
        from hf_fp4.scales import e8m0_ceil_exponent, e8m0_floor_exponent, pow2
        rule = e8m0_floor_exponent if spec.scale is ScaleRule.E8M0_FLOOR else e8m0_ceil_exponent
        e_ref = rule(amax.reshape(1), spec.grid).to(torch.int32)
        scale = pow2(e_ref - fp8_shift(spec.grid)).reshape(())
        lost = torch.zeros(grid, dtype=torch.int32, device=dev)
        eref = e_ref
    else:
        scale = senc[1].reshape(()) if spec.scale is ScaleRule.UE4M3_FP32 else torch.ones((), device=dev)
        eref = dummy
    _launch(grid, x2, dummy, dummy, dummy, mu_t, signs_t, dummy, data, eref, lost if lost is not None else dummy,
            k_alloc, m, k, kp, stride_m, stride_k, senc, seed or 0, common, AMAX_ONLY=False,
            OUT=2 if fp8 else 1, SHIFT=fp8_shift(spec.grid), DMAX=fp8_dmax(spec.grid))
    return GemmOperand(data, scale, fp8, lost, m)
