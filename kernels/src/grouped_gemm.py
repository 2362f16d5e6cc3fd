"""Grouped BF16 GEMMs of expert segments with per-expert FP32 tensor scales (issue 16's two-level formats).

The BF16 operand form (NVFP4, UFP4: v * UE4M3 block scale, exact in BF16) leaves each operand's FP32 tensor decode
scale to the GEMM's output: FP4Linear computes BF16(acc * (s_a * s_b)) from the FP32 accumulator acc
(kernels/src/gemm.py: scale_output).  Grouped over experts each segment has its own pair of scales, and
`torch._grouped_mm` writes its output in the operands' dtype only (an FP32 output would need the rounding to
BF16 first, a second rounding the per-expert loop does not make).  Two kernels, FP32 accumulation on the BF16
tensor cores and that one rounding at the end:

    grouped_rows:        out[r] = BF16((a[r] @ B_e^T) * s_a[e] * s_b[e])   for the rows r of segment e
                         (fprop: B_e = the stacked weights' rows e*n..; dgrad: W^T's columns e*n..)
    grouped_contraction: out[e] = BF16((a[:, seg e] @ b[:, seg e]^T) * s_a[e] * s_b[e])   (wgrad)

Segments are given by their ends ([E] int32, non-decreasing; segment e is [ends[e-1], ends[e])) and read on the
device: no host synchronisation, so the GEMMs run under CUDA graphs and torch.compile.  grouped_rows is
persistent (a program per SM walks the (expert, row tile, column tile) list, as Triton's grouped-GEMM tutorial
does); rows past the last segment are not written.  Without CUDA and outside Triton's interpreter: the same
products in torch, one segment at a time (the host reads the ends).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import _kernel_device, default_programs, exact_copies
from .launch import launcher
from .numerics import bf16_bits

#: (BM, BN, BK, warps, stages) of the BF16 kernels and of the FP8 ones, from `scripts/profile_fast_path.py
#: --moe-tiles` (bench.py's MoE layer, captured, per tile; H100, 2026-12-06): nvfp4 18.69 ms with 128 x 256 x 64
#: against 19.89 ms with 128 x 128 x 64; mxfp4 on the FP8 kernels 25.35 ms with 128 x 128 x 128 against 26.43 ms.
#: Set these module attributes to change them.
TILE = (128, 256, 64, 8, 3)
FP8_TILE = (128, 128, 128, 8, 3)


@triton.jit
def _dot_tile(a, lda, rows, row_ok, b, ldb, cols, col_ok, k_lo, k_hi, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    """sum over k in [k_lo, k_hi) of a[rows, k] b[cols, k] as stored (BF16 or E4M3 operands), FP32 accumulation --
    for FP8 promoted to FP32 after every MMA step (K 32), not Hopper's default of never."""
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k_ok = k0 + ks < k_hi
        x = tl.load(a + rows[:, None].to(tl.int64) * lda + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        y = tl.load(b + cols[:, None].to(tl.int64) * ldb + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if INTERPRETED:  # the interpreter multiplies BF16 operands of tl.dot as their raw bits: FP32 there
            acc = tl.dot(x.to(tl.float32), tl.trans(y.to(tl.float32)), acc, input_precision="ieee")
        elif FP8:
            acc = tl.dot(x, tl.trans(y), acc, max_num_imprecise_acc=32)
        else:
            acc = tl.dot(x, tl.trans(y), acc)
    return acc


# ----------------------------------------------------------------------------------------------
# FP8 operands (the MX family: E8M0 block scales folded into E4M3 against a reference exponent per row -- per row
# and expert where the experts run along the contraction; kernels/src/operand.py).  The FP8 tensor cores with a
# promotion to FP32 after every MMA step, then the two row scales; a tile that touches a row flagged as holding
# a block below E4M3's range is recomputed exactly in the same program, as a BF16 product of the operands' exact
# BF16 copies (kernels/src/gemm.py's exact_copies, written by one launch before the GEMM when any row is flagged;
# a_x / b_x: the copies, with the data's strides and offsets).
@triton.jit
def _fp8_tile(a, a_scale, a_flags, a_x, lda, rows, row_ok, b, b_scale, b_flags, b_x, ldb, cols, col_ok, k_lo, k_hi,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INTERPRETED: tl.constexpr):
    """sum over k in [k_lo, k_hi) of a[rows, k] b[cols, k] in real units (row scales applied), exact where a flagged
    row is touched.  The pointers are the group's (offsets applied by the caller)."""
    acc = _dot_tile(a, lda, rows, row_ok, b, ldb, cols, col_ok, k_lo, k_hi, BM, BN, BK, True, INTERPRETED)
    sa = tl.load(a_scale + rows, mask=row_ok, other=0.0)
    sb = tl.load(b_scale + cols, mask=col_ok, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    flagged = (tl.max(tl.load(a_flags + rows, mask=row_ok, other=0).to(tl.int32), axis=0)
               + tl.max(tl.load(b_flags + cols, mask=col_ok, other=0).to(tl.int32), axis=0))
    if flagged > 0:  # the tile again from the exact copies, on the BF16 tensor cores (exact products)
        acc = _dot_tile(a_x, lda, rows, row_ok, b_x, ldb, cols, col_ok, k_lo, k_hi, BM, BN, BK, False, INTERPRETED)
    return acc


@triton.jit
def _tile(a, a_scale, a_flags, a_x, lda, rows, row_ok, b, b_scale, b_flags, b_x, ldb, cols, col_ok, k_lo, k_hi, e,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr, SCALED: tl.constexpr,
          INTERPRETED: tl.constexpr):
    """One output tile in real units: FP8 (row scales a_scale / b_scale, lost blocks from the exact copies) or BF16
    (SCALED: times the group's FP32 tensor scales a_scale[e] * b_scale[e])."""
    if FP8:
        acc = _fp8_tile(a, a_scale, a_flags, a_x, lda, rows, row_ok, b, b_scale, b_flags, b_x, ldb, cols, col_ok,
                        k_lo, k_hi, BM, BN, BK, INTERPRETED)
    else:
        acc = _dot_tile(a, lda, rows, row_ok, b, ldb, cols, col_ok, k_lo, k_hi, BM, BN, BK, False, INTERPRETED)
        if SCALED:
            acc = acc * (tl.load(a_scale + e) * tl.load(b_scale + e))
    return acc


@triton.jit
def _store(out_ptr, ld_out, rows, cols, mask, acc, OUT_BF16: tl.constexpr):
    """acc rounded once to the output dtype (BF16: to nearest even, by hand)."""
    optr = out_ptr + rows[:, None].to(tl.int64) * ld_out + cols[None, :]
    if OUT_BF16:
        tl.store(optr.to(tl.pointer_type(tl.int16)), bf16_bits(acc), mask=mask)
    else:
        tl.store(optr, acc, mask=mask)


@triton.jit
def _grouped_rows_kernel(a, a_scale, a_flags, a_x, lda, b, b_scale, b_flags, b_x, ldb, b_step, bs_step, bf_step,
                         out_ptr, ld_out, ends_ptr, M, E, N, K,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
                         SCALED: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    """Persistent: program p takes tiles p, p + P, ... of the list (expert, row tile, column tile), row tiles of an
    expert's segment first-major so that neighbouring programs share the segment's rows, then the zero tiles of
    the M - ends[E-1] rows past the last segment.  Expert e's B starts e * b_step elements further (FP8: its exact
    copy too; row scales e * bs_step, row flags e * bf_step)."""
    n_tiles = tl.cdiv(N, BN)
    tile = tl.program_id(0)
    seen = 0
    start = 0
    for e in range(E):
        end = tl.load(ends_ptr + e)
        count = tl.cdiv(end - start, BM) * n_tiles
        while tile < seen + count:
            local = tile - seen
            rows = start + (local // n_tiles) * BM + tl.arange(0, BM)
            cols = (local % n_tiles) * BN + tl.arange(0, BN)
            e64 = tl.zeros([], tl.int64) + e
            acc = _tile(a, a_scale, a_flags, a_x, lda, rows, rows < end, b + e64 * b_step, b_scale + e64 * bs_step,
                        b_flags + e64 * bf_step, b_x + e64 * b_step, ldb, cols, cols < N, 0, K, e, BM, BN, BK, FP8,
                        SCALED, INTERPRETED)
            _store(out_ptr, ld_out, rows, cols, (rows[:, None] < end) & (cols[None, :] < N), acc, OUT_BF16)
            tile += tl.num_programs(0)
        seen += count
        start = end
    # the rows past the last segment are zero: the output is defined everywhere (no select over it afterwards)
    count = tl.cdiv(M - start, BM) * n_tiles
    while tile < seen + count:
        local = tile - seen
        rows = start + (local // n_tiles) * BM + tl.arange(0, BM)
        cols = (local % n_tiles) * BN + tl.arange(0, BN)
        _store(out_ptr, ld_out, rows, cols, (rows[:, None] < M) & (cols[None, :] < N),
               tl.zeros([BM, BN], dtype=tl.float32), OUT_BF16)
        tile += tl.num_programs(0)


@triton.jit
def _grouped_contraction_kernel(a, a_scale, a_flags, a_x, lda, as_step, b, b_scale, b_flags, b_x, ldb, bs_step,
                                out_ptr, ends_ptr, M, N,
                                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
                                SCALED: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (tile, e): one [BM, BN] tile of out[e] = a[:, seg e] @ b[:, seg e]^T; zero for an empty segment.
    FP8: row scales per expert (e * as_step, e * bs_step)."""
    e = tl.program_id(1)
    n_tiles = tl.cdiv(N, BN)
    rows = (tl.program_id(0) // n_tiles) * BM + tl.arange(0, BM)
    cols = (tl.program_id(0) % n_tiles) * BN + tl.arange(0, BN)
    # segments start and end at multiples of 16 rows (the callers' layouts): the hint lets the loads be vectorised
    start = tl.multiple_of(tl.load(ends_ptr + e - 1, mask=e > 0, other=0), 16)
    end = tl.multiple_of(tl.load(ends_ptr + e), 16)
    e64 = tl.zeros([], tl.int64) + e
    acc = _tile(a, a_scale + e64 * as_step, a_flags, a_x, lda, rows, rows < M, b, b_scale + e64 * bs_step, b_flags,
                b_x, ldb, cols, cols < N, start, end, e, BM, BN, BK, FP8, SCALED, INTERPRETED)
    _store(out_ptr + e64 * M * N, N, rows, cols, (rows[:, None] < M) & (cols[None, :] < N), acc, OUT_BF16)


def _check(ends: torch.Tensor, a_scale, b_scale) -> None:
    if ends.dim() != 1 or ends.dtype != torch.int32:
        raise ValueError(f"ends must be int32 [E], got {ends.dtype} {tuple(ends.shape)}")
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        if s is not None and s.shape != ends.shape:
            raise ValueError(f"{name} must hold one FP32 scale per segment ({ends.shape[0]}), got {tuple(s.shape)}")


def grouped_rows(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, n: int, k: int, b_step: int,
                 a_scale: torch.Tensor | None = None, b_scale: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [R, n]: the rows of segment e of a [R, >=k] times B_e^T, B_e [n, k] = the [n, k] matrix at b's element
    offset e * b_step (rows of stride b.stride(0), contraction contiguous), FP32 accumulation, times
    a_scale[e] * b_scale[e] when given, rounded once to out_dtype.  Rows past ends[-1] are zero."""
    _check(ends, a_scale, b_scale)
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("grouped_rows reads a and b with a contiguous contraction dim")
    out = torch.empty((a.shape[0], n), dtype=out_dtype, device=a.device) if out is None else out
    scaled = a_scale is not None
    if not _kernel_device(a):
        return _rows_torch(a, b, ends, n, k, b_step, a_scale, b_scale, out)
    _launch_rows(out, *_bf16_args(a, b, a_scale, b_scale), [b_step, 0, 0], ends, n, k, False, scaled)
    return out


def _bf16_args(a: torch.Tensor, b: torch.Tensor, a_scale, b_scale) -> tuple[list, list]:
    """Two BF16 operands' kernel arguments in the FP8 operands' slots (_fp8_args): data, the per-group tensor
    scales (or a 1-element stand-in), stand-ins for what the FP8 form alone has, the row stride."""
    unused = torch.empty(1, dtype=torch.int8, device=a.device)
    sa, sb = (a_scale, b_scale) if a_scale is not None else (unused, unused)
    return [a, sa, unused, unused, a.stride(0)], [b, sb, unused, unused, b.stride(0)]


def _launch_rows(out, a_args, b_args, steps, ends, n, k, fp8, scaled):
    bm, bn, bk, warps, stages = FP8_TILE if fp8 else TILE
    dev = out.device
    launcher(_grouped_rows_kernel)[(default_programs(out),)](
        *a_args, *b_args, *steps, out, out.stride(0), ends, out.shape[0], ends.shape[0], n, k, BM=bm, BN=bn, BK=bk,
        FP8=fp8, SCALED=scaled, OUT_BF16=out.dtype == torch.bfloat16, INTERPRETED=dev.type != "cuda",
        num_warps=warps, num_stages=stages)


def _launch_contraction(out, a_args, b_args, scale_steps, ends, fp8, scaled):
    bm, bn, bk, warps, stages = FP8_TILE if fp8 else TILE
    num, m, n = out.shape
    launcher(_grouped_contraction_kernel)[(triton.cdiv(m, bm) * triton.cdiv(n, bn), num)](
        *a_args, scale_steps[0], *b_args, scale_steps[1], out, ends, m, n, BM=bm, BN=bn, BK=bk, FP8=fp8,
        SCALED=scaled, OUT_BF16=out.dtype == torch.bfloat16, INTERPRETED=out.device.type != "cuda",
        num_warps=warps, num_stages=stages)


def grouped_contraction(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, m: int, n: int,
                        a_scale: torch.Tensor | None = None, b_scale: torch.Tensor | None = None,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """out [E, m, n]: out[e] = a[:m, seg e] @ b[:n, seg e]^T (a, b: contraction along their rows' contiguous dim),
    FP32 accumulation, times a_scale[e] * b_scale[e] when given, rounded once to out_dtype; zero for an empty
    segment.  Segments start and end at multiples of 16 (the kernel's loads assume it; hf_fp4.nn.grouping's layouts
    align them to 16 or more)."""
    _check(ends, a_scale, b_scale)
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("grouped_contraction reads a and b with a contiguous contraction dim")
    num = ends.shape[0]
    out = torch.empty((num, m, n), dtype=out_dtype, device=a.device)
    scaled = a_scale is not None
    if not _kernel_device(a):
        return _contraction_torch(a, b, ends, m, n, a_scale, b_scale, out)
    _launch_contraction(out, *_bf16_args(a, b, a_scale, b_scale), (0, 0), ends, False, scaled)
    return out


def _segments(ends: torch.Tensor):
    start = 0
    for e, end in enumerate(ends.tolist()):
        yield e, start, end
        start = end


def _scaled(acc: torch.Tensor, a_scale, b_scale, e: int) -> torch.Tensor:
    return acc * (a_scale[e] * b_scale[e]) if a_scale is not None else acc


def _rows_torch(a, b, ends, n, k, b_step, a_scale, b_scale, out):
    for e, start, end in _segments(ends):
        b_e = torch.as_strided(b, (n, k), (b.stride(0), 1), b.storage_offset() + e * b_step)
        acc = a[start:end, :k].float() @ b_e.float().t()
        out[start:end] = _scaled(acc, a_scale, b_scale, e).to(out.dtype)
    out[int(ends[-1]) if ends.numel() else 0:] = 0
    return out


def _contraction_torch(a, b, ends, m, n, a_scale, b_scale, out):
    for e, start, end in _segments(ends):
        acc = a[:m, start:end].float() @ b[:n, start:end].float().t()
        out[e] = _scaled(acc, a_scale, b_scale, e).to(out.dtype)
    return out


def _fp8_args(op, copy: torch.Tensor) -> list:
    """An FP8 operand's kernel arguments: data, row scales, row flags, its exact BF16 copy, the row stride."""
    return [op.data, op.scale, op.flags, copy, op.data.stride(0)]


def _need_kernels(t: torch.Tensor) -> None:
    if not _kernel_device(t):
        raise RuntimeError("the grouped FP8 GEMMs run on CUDA (or in Triton's interpreter: TRITON_INTERPRET=1)")


def grouped_rows_fp8(a, b, ends: torch.Tensor, n: int, k: int, steps: tuple[int, int, int],
                     blocks: tuple[int, int, int, int], out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """grouped_rows on FP8 operands (hf_fp4.numerics.operand_plan.Operand: E4M3 data, row scales, lost blocks):
    out [R, n], the rows of segment e times expert e's B, whose data (and exact copy), row scales and row flags start
    `steps` = (b_step, bs_step, bf_step) elements further per expert; blocks = (a's block,
    a's SHIFT, b's block, b's SHIFT).  Exact as FP4Linear's FP8 GEMM is (kernels/src/gemm.py).  B's row scales are
    either one per row of its data (the stacked weights' rows) or [E, rows] (W^T, whose columns e * b_step.. are
    expert e's: its exact copy takes each column's expert's scale)."""
    _check(ends, None, None)
    _need_kernels(a.data)
    out = torch.empty((a.data.shape[0], n), dtype=out_dtype, device=a.data.device)
    b_cols = b.scale.numel() != b.data.shape[0]
    a_x, b_x = exact_copies(a, b, (blocks[0], blocks[1], 0, 0, 0),
                            (blocks[2], blocks[3], 1 if b_cols else 0, steps[0], steps[1]), ends=ends)
    _launch_rows(out, _fp8_args(a, a_x), _fp8_args(b, b_x), list(steps), ends, n, k, True, False)
    return out


def grouped_contraction_fp8(a, b, ends: torch.Tensor, m: int, n: int, scale_steps: tuple[int, int],
                            blocks: tuple[int, int, int, int], out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """grouped_contraction on FP8 operands whose row scales are per expert: expert e's start `scale_steps` =
    (a's, b's) elements further (the transposed orientations' [E, rows] scales; the exact copies take each
    column's segment's)."""
    _check(ends, None, None)
    _need_kernels(a.data)
    out = torch.empty((ends.shape[0], m, n), dtype=out_dtype, device=a.data.device)
    a_x, b_x = exact_copies(a, b, (blocks[0], blocks[1], 2, 0, scale_steps[0]),
                            (blocks[2], blocks[3], 2, 0, scale_steps[1]), ends=ends)
    _launch_contraction(out, _fp8_args(a, a_x), _fp8_args(b, b_x), scale_steps, ends, True, False)
    return out
