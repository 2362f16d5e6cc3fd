"""Exact fast GEMMs of quantized operands on Hopper.

Every E2M1/E1M2/INT4 value times a power of two is exact in FP8 E4M3 while the exponent stays in
range, and a 4-bit value times a UE4M3 scale has at most 8 significant bits, so:

* power-of-two scales (E8M0: the MX family, truncation-free tiles) run on FP8 tensor cores: each
  element becomes v * 2^(e_block - e_row + SHIFT) in E4M3 (SHIFT = floor(log2(448 / grid max))), the
  row scale 2^(e_row - SHIFT) goes to `torch._scaled_mm`'s row-wise scales, FP32 accumulation.  This
  is exact when every non-zero block of a row is within D_MAX = SHIFT + 9 + EMIN - MBITS binades of the
  row's largest (E4M3's subnormal step is 2^-9); a GEMM with any row beyond that runs the BF16 path
  instead, so no value is ever lost;
* UE4M3 two-level scales (NVFP4, UFP4, INT4) and the E4M3 grid (MXFP8) run on BF16 tensor cores with
  operands v * s_b (exact), FP32 accumulation, and the two FP32 tensor scales applied to the output;
* FP32 block scales (research only) fall back to an FP32 GEMM of the dequantized operands.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_fp4.formats import Grid
from hf_fp4.quantize import QuantizedTensor
from hf_fp4.scales import ScaleRule, e8m0_exponent

from .quant import GRID_PARAMS, SCALE_CODES, _pow2, fp8_dmax, fp8_shift


@triton.jit
def _decode_code(c, EMIN: tl.constexpr, MBITS: tl.constexpr):
    """Magnitude code -> grid value (float-grid form: subnormal when the exponent field is 0)."""
    e_field = c >> MBITS
    mant = c & ((1 << MBITS) - 1)
    sub = mant.to(tl.float32) * _pow2(tl.full(c.shape, EMIN - MBITS, tl.int32))
    normal = (mant + (1 << MBITS)).to(tl.float32) * _pow2(e_field - 1 + EMIN - MBITS)
    return tl.where(e_field == 0, sub, normal)


@triton.jit
def _operand_kernel(codes_ptr, scales_ptr, row_exp_ptr, out_ptr, M, KP,
                    BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                    EMIN: tl.constexpr, MBITS: tl.constexpr, BITS: tl.constexpr, SCALE: tl.constexpr,
                    SHIFT: tl.constexpr, FP8: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    inside = (rows[:, None] < M) & (cols[None, :] < KP)
    if BITS == 4:
        byte = tl.load(codes_ptr + rows[:, None].to(tl.int64) * (KP // 2) + cols[None, :] // 2, mask=inside, other=0)
        code = ((byte.to(tl.int32) >> ((cols[None, :] % 2) * 4)) & 0xF)
    else:
        code = tl.load(codes_ptr + rows[:, None].to(tl.int64) * KP + cols[None, :], mask=inside, other=0).to(tl.int32)
    SIGN: tl.constexpr = 1 << (BITS - 1)
    v = _decode_code(code & (SIGN - 1), EMIN, MBITS)
    v = tl.where((code & SIGN) != 0, -v, v)
    s = tl.load(scales_ptr + (rows[:, None] // BR).to(tl.int64) * (KP // BC) + cols[None, :] // BC,
                mask=inside, other=0).to(tl.int32)
    if SCALE == 2:  # UE4M3 block scale
        factor = _decode_code(s, -6, 3)
    else:  # E8M0
        e = s - 127
        if FP8:
            e_row = tl.load(row_exp_ptr + rows, mask=rows < M, other=0)
            e = e - e_row[:, None] + SHIFT
        factor = _pow2(e)
    out = v * factor
    optr = out_ptr + rows[:, None].to(tl.int64) * KP + cols[None, :]
    if FP8:
        tl.store(optr, out.to(tl.float8e4nv), mask=inside)
    else:
        tl.store(optr, out.to(tl.bfloat16), mask=inside)


def fp8_range_ok(q: QuantizedTensor) -> tuple[bool, torch.Tensor]:
    """Whether every row's non-zero blocks lie within D_MAX binades of its largest; the row exponents."""
    d_max = fp8_dmax(q.spec.grid)
    e = e8m0_exponent(q.scales).repeat_interleave(q.spec.block[0], 0)[: q.codes.shape[0]]
    e_row = e.amax(dim=1)
    e_min = torch.where(e > -127, e, torch.full_like(e, 1000)).amin(dim=1)
    spread = torch.where(e_min < 1000, e_row - e_min, torch.zeros_like(e_row))
    return bool((spread <= d_max).all()), e_row.to(torch.int32).contiguous()


def gemm_operand(q: QuantizedTensor, fp8: bool, row_exp: torch.Tensor | None = None) -> torch.Tensor:
    """The padded [Mp, Kp] operand: FP8 (folded powers of two) or BF16 (v * block scale)."""
    mp, kp = q.padded_shape
    emin, mbits = GRID_PARAMS[q.spec.grid]
    out = torch.empty((mp, kp), device=q.codes.device, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    bm, bk = 32, 128
    grid = (triton.cdiv(mp, bm), triton.cdiv(kp, bk))
    _operand_kernel[grid](q.codes, q.scales.view(torch.uint8), row_exp if row_exp is not None else q.codes,
                          out, mp, kp, BM=bm, BK=bk, BR=q.spec.block[0], BC=q.spec.block[1], EMIN=emin,
                          MBITS=mbits, BITS=8 if q.spec.grid is Grid.E4M3 else 4,
                          SCALE=SCALE_CODES[q.spec.scale], SHIFT=fp8_shift(q.spec.grid), FP8=fp8)
    return out


def _pad_cols(t: torch.Tensor, k: int) -> torch.Tensor:
    return t if t.shape[1] == k else torch.nn.functional.pad(t, (0, k - t.shape[1]))


def _pad_rows(t: torch.Tensor, m: int) -> torch.Tensor:
    if t.shape[0] == m:
        return t
    if t.dtype == torch.float8_e4m3fn:  # pad does not support FP8: pad the bytes
        return _pad_rows(t.view(torch.uint8), m).view(torch.float8_e4m3fn)
    return torch.nn.functional.pad(t, (0, 0, 0, m - t.shape[0]))


def quantized_matmul(a: QuantizedTensor, b: QuantizedTensor, m: int, n: int) -> torch.Tensor:
    """a [M, K] times b [N, K]^T -> [M, N] FP32, both quantized along K (the GEMM's contraction)."""
    pow2 = {ScaleRule.E8M0_FLOOR, ScaleRule.E8M0_CEIL}
    if ScaleRule.FP32 in (a.spec.scale, b.spec.scale):
        return a.dequantize().reshape(m, -1) @ b.dequantize().reshape(n, -1).t()
    k = max(a.padded_shape[1], b.padded_shape[1], 16)
    k += -k % 16
    use_fp8 = (a.spec.scale in pow2 and b.spec.scale in pow2 and Grid.E4M3 not in (a.spec.grid, b.spec.grid))
    if use_fp8:
        ok_a, row_a = fp8_range_ok(a)
        ok_b, row_b = fp8_range_ok(b)
        use_fp8 = ok_a and ok_b
    if use_fp8:
        mp, np_ = m + (-m % 16), n + (-n % 16)  # _scaled_mm wants multiples of 16
        oa = _pad_rows(_pad_cols(gemm_operand(a, True, row_a), k)[:m], mp)
        ob = _pad_rows(_pad_cols(gemm_operand(b, True, row_b), k)[:n], np_)
        sa = _pad_rows(torch.ldexp(torch.ones(m, 1, device=oa.device), (row_a[:m] - fp8_shift(a.spec.grid))[:, None]), mp)
        sb = _pad_rows(torch.ldexp(torch.ones(n, 1, device=oa.device), (row_b[:n] - fp8_shift(b.spec.grid))[:, None]), np_)
        out = torch._scaled_mm(oa, ob.t(), scale_a=sa.contiguous(), scale_b=sb.t().contiguous(),
                               out_dtype=torch.float32)
        return out[:m, :n]
    oa = _pad_cols(gemm_operand(a, False), k)[:m]
    ob = _pad_cols(gemm_operand(b, False), k)[:n]
    return _apply_tensor_scales(mm_fp32(oa, ob.t()), a, b)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """BF16 x BF16 -> FP32 output with FP32 accumulation (cuBLAS); FP32 math where that is unavailable."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _apply_tensor_scales(out: torch.Tensor, *qs: QuantizedTensor) -> torch.Tensor:
    for q in qs:
        if q.tensor_scale is not None:
            out = out * q.tensor_scale
    return out


def operand_matmul(oa, ob, m: int, n: int, out_dtype: torch.dtype, ob_transposed: bool = False) -> torch.Tensor:
    """[M, K] x [N, K]^T of two GemmOperands (or ob given as [K, N] with ob_transposed) -> [M, N].

    FP8 x FP8: `torch._scaled_mm` with the two tensor scales; otherwise BF16 (an FP8 operand converts
    to BF16 exactly) with FP32 output, scaled once.
    """
    a = oa.data[: m + (-m % 16)]
    b = ob.data if ob_transposed else ob.data[: n + (-n % 16)].t()  # [K, N]
    if ob_transposed:
        b = b[:, : n + (-n % 16)]
    if oa.fp8 and ob.fp8:
        b = b if b.stride(0) == 1 else b.t().contiguous().t()  # column-major for cuBLASLt
        out = torch._scaled_mm(a, b, scale_a=oa.scale.float(), scale_b=ob.scale.float(), out_dtype=out_dtype)
    else:
        a = a.to(torch.bfloat16)
        b = b.to(torch.bfloat16)
        out = (mm_fp32(a, b) * (oa.scale * ob.scale)).to(out_dtype)
    return out[:m, :n]
