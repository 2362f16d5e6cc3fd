"""The GEMM of two FP8 operands (kernels/src/operand.py), exact and without host synchronisation.

`fp8_gemm(a, b, m, n, out_dtype)` computes a [M, K] @ b [N, K]^T from the E4M3 data and row scales:

1. `torch._scaled_mm` on the FP8 tensor cores, FP32 accumulation; row-wise scales when the output is
   BF16 (cuBLASLt applies them in FP32), otherwise unit scales with FP32 output and the outer
   product of the row scales applied after (powers of two: exact).  The FP8 tensor cores accumulate
   with reduced precision: within FP32 accumulation error only while each step's products span a
   limited range (benchmarks/results-2026-12-02.md; 1x128 block scales were measured and dropped,
   hf_fp4/numerics/operand_plan.py);
2. a correction that recomputes exactly, from the E4M3 data, the `side` values and the block exponents, every
   output tile that touches a row flagged as holding a block below E4M3's range, and overwrites it.  Two
   launches of one persistent program per SM (or two), each of which first reads each operand's "any row
   flagged" element (flags[rows]) and returns when both are clear -- a few microseconds, and no host ever waits
   on a flag: (a) the exact values of both operands as BF16 copies (every exact operand value is a 4-bit grid
   value times a power of two, so BF16 holds it exactly), (b) a BF16 GEMM of the flagged output tiles over those
   copies on the tensor cores (exact products, FP32 sums).  History: an FP32 `ieee` dot on the CUDA cores made
   MX training 10x slower than NVFP4 once training spread the operands out and most rows were flagged
   (benchmarks/study-fp4-recipes-large/README.md); its BF16 tensor-core successor still derived the exact values
   inside the GEMM's loop for every tile and k-step, and on inputs whose 64-token runs spread over 2^-12..2^12
   (bench.py's linear_spread: every wgrad operand row then holds blocks > 14 binades below its largest) the
   MX layers ran 18x slower than bf16 on the H200 (benchmarks/results-2026-12-06-session20.md).  (A program per output tile, reading its rows' flags, cost
   25 us per GEMM: 7% of a 1.1B train step, profiled on the H200.)
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .launch import launcher, tracing
from .numerics import bf16_bits, pow2


@triton.jit
def exact_tile(data, side, eb, row_scale, rows, ks, row_ok, k_ok, ld, ld_eb, BLC: tl.constexpr, SHIFT: tl.constexpr):
    """Exact FP32 values of a [rows, ks] tile of an FP8 operand (rows of stride ld, block exponents of stride
    ld_eb): the E4M3 value times its row scale (row_scale: the scales, broadcastable to the tile -- [rows, 1], or
    [rows, ks] where the scale changes along the contraction), or a lost block's side value times 2^(e - SHIFT)."""
    inside = row_ok[:, None] & k_ok[None, :]
    offs = rows[:, None].to(tl.int64) * ld + ks[None, :]
    main = tl.load(data + offs, mask=inside, other=0.0).to(tl.float32)
    e = tl.load(eb + rows[:, None].to(tl.int64) * ld_eb + ks[None, :] // BLC, mask=inside, other=-128).to(tl.int32)
    lost = e != -128
    sv = tl.load(side + offs, mask=inside & lost, other=0.0).to(tl.float32)
    return tl.where(lost, sv * pow2(tl.where(lost, e, 0) - SHIFT), main * row_scale)


@triton.jit
def _segment_of(ends_ptr, E, ks, BK: tl.constexpr):
    """The segment (of E, ending at ends_ptr[0..E), non-decreasing) each column of ks lies in, at most E - 1."""
    g = tl.zeros([BK], dtype=tl.int32)
    for e in range(E - 1):
        g += (ks >= tl.load(ends_ptr + e)).to(tl.int32)
    return g


@triton.jit
def _copy_exact(data, side, eb, scale, R, C, ld_eb, gw, s_step, out, ends_ptr, E, tile,
                BR: tl.constexpr, BK: tl.constexpr, BLC: tl.constexpr, SHIFT: tl.constexpr, GROUPS: tl.constexpr):
    """Tile `tile` (row-major over [R, C] in BR x BK tiles) of a contiguous FP8 operand's exact values, stored as
    BF16 at out (the same shape and strides).  The row scale of element (r, c): scale[r] (GROUPS 0), or
    scale[g * s_step + r] with g the column's group -- c // gw (1: W^T's experts, gw columns each) or its segment
    of ends (2: the grouped wgrad's expert segments along the contraction)."""
    k_tiles = tl.cdiv(C, BK)
    rows = (tile // k_tiles) * BR + tl.arange(0, BR)
    ks = (tile % k_tiles) * BK + tl.arange(0, BK)
    row_ok, k_ok = rows < R, ks < C
    if GROUPS == 0:
        sc = tl.load(scale + rows, mask=row_ok, other=0.0)[:, None]
    else:
        if GROUPS == 1:
            g = tl.minimum(ks // gw, E - 1)
        else:
            g = _segment_of(ends_ptr, E, ks, BK)
        sc = tl.load(scale + g[None, :].to(tl.int64) * s_step + rows[:, None], mask=row_ok[:, None] & k_ok[None, :],
                     other=0.0)
    v = exact_tile(data, side, eb, sc, rows, ks, row_ok, k_ok, C, ld_eb, BLC, SHIFT)
    tl.store(out + rows[:, None].to(tl.int64) * C + ks[None, :], v.to(tl.bfloat16),
             mask=row_ok[:, None] & k_ok[None, :])


@triton.jit
def _exact_copy_kernel(a_ptr, a_side, a_eb, a_scale, a_flags, MA, CA, ld_aeb, a_gw, a_ss, a_out,
                       b_ptr, b_side, b_eb, b_scale, b_flags, NB, CB, ld_beb, b_gw, b_ss, b_out, ends_ptr, E,
                       BR: tl.constexpr, BK: tl.constexpr, A_BLC: tl.constexpr, A_SHIFT: tl.constexpr,
                       A_GROUPS: tl.constexpr, B_BLC: tl.constexpr, B_SHIFT: tl.constexpr, B_GROUPS: tl.constexpr):
    """Step 2a: a few persistent programs that read the two operands' "any row flagged" elements (a_flags[MA],
    b_flags[NB]) and return when both are clear; otherwise they write both operands' exact values as BF16 copies
    of their shapes, tile by tile (_copy_exact; every value is a 4-bit grid value times a power of two: BF16 holds
    it exactly, so any rounding is exact)."""
    if tl.load(a_flags + MA).to(tl.int32) + tl.load(b_flags + NB).to(tl.int32) > 0:
        a_tiles = tl.cdiv(MA, BR) * tl.cdiv(CA, BK)
        for tile in range(tl.program_id(0), a_tiles + tl.cdiv(NB, BR) * tl.cdiv(CB, BK), tl.num_programs(0)):
            if tile < a_tiles:
                _copy_exact(a_ptr, a_side, a_eb, a_scale, MA, CA, ld_aeb, a_gw, a_ss, a_out, ends_ptr,
                            E, tile, BR, BK, A_BLC, A_SHIFT, A_GROUPS)
            else:
                _copy_exact(b_ptr, b_side, b_eb, b_scale, NB, CB, ld_beb, b_gw, b_ss, b_out, ends_ptr,
                            E, tile - a_tiles, BR, BK, B_BLC, B_SHIFT, B_GROUPS)


@triton.jit
def _correction_kernel(out_ptr, M, N, ld_out, a_x, a_flags, MA, b_x, b_flags, NB, K,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, OUT_BF16: tl.constexpr,
                       INTERPRETED: tl.constexpr):
    """Step 2b: a few persistent programs: nothing but two flag reads unless an operand has a lost block
    (flags[MA], flags[NB]: "any row flagged"); then they walk the output tiles and recompute the flagged ones --
    a BF16 GEMM over the exact copies of step 2a (exact products, FP32 sums, on the tensor cores), stored over
    out."""
    if tl.load(a_flags + MA).to(tl.int32) + tl.load(b_flags + NB).to(tl.int32) > 0:
        n_col_tiles = tl.cdiv(N, BN)
        for tile in range(tl.program_id(0), tl.cdiv(M, BM) * n_col_tiles, tl.num_programs(0)):
            rows = (tile // n_col_tiles) * BM + tl.arange(0, BM)
            cols = (tile % n_col_tiles) * BN + tl.arange(0, BN)
            flagged = (tl.max(tl.load(a_flags + rows, mask=rows < MA, other=0).to(tl.int32), axis=0)
                       + tl.max(tl.load(b_flags + cols, mask=cols < NB, other=0).to(tl.int32), axis=0))
            if flagged > 0:
                acc = tl.zeros([BM, BN], dtype=tl.float32)
                a_rows = a_x + rows[:, None].to(tl.int64) * K
                b_cols = b_x + cols[None, :].to(tl.int64) * K
                for k0 in range(0, K, BK):
                    ks = k0 + tl.arange(0, BK)
                    a = tl.load(a_rows + ks[None, :], mask=(rows[:, None] < MA) & (ks[None, :] < K), other=0.0)
                    b = tl.load(b_cols + ks[:, None], mask=(ks[:, None] < K) & (cols[None, :] < NB), other=0.0)
                    if INTERPRETED:  # the interpreter multiplies BF16 operands of tl.dot as their raw bits
                        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(a, b, acc)
                mask = (rows[:, None] < M) & (cols[None, :] < N)
                optr = out_ptr + rows[:, None].to(tl.int64) * ld_out + cols[None, :]
                if OUT_BF16:  # round to nearest even by hand (Triton's interpreter truncates in .to(bfloat16))
                    tl.store(optr.to(tl.pointer_type(tl.int16)), bf16_bits(acc), mask=mask)
                else:
                    tl.store(optr, acc, mask=mask)


@functools.lru_cache(maxsize=None)
def _programs(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_programs(t: torch.Tensor) -> int:
    """Persistent programs for t's device: one per SM (4 in Triton's interpreter)."""
    return _programs(t.device.index or 0) if t.is_cuda else 4


#: The exact copies' tile (rows x K columns, warps) of step 2a: its sm_90 code (Triton 3.9, launched as the GPU's
#: JIT specialises an aligned call) holds a tile in 76-89 registers with 8 warps, 79-146 with 4 (no stack either way).
COPY_TILE = (64, 128, 8)


def exact_copies(a, b, a_layout: tuple, b_layout: tuple, programs: int | None = None,
                 ends: torch.Tensor | None = None):
    """Step 2a's launch: BF16 tensors of a's and b's data shapes (taken from the caching allocator on every call),
    written with the operands' exact values only when some row of either is flagged.  *_layout: (block, SHIFT,
    GROUPS, group width, scale step) -- see _copy_exact; programs: twice that many at most (default: one per SM);
    ends: the segments of GROUPS 2."""
    for op in (a, b):
        if not op.data.is_contiguous():
            raise ValueError("the exact copies take the operands' strides: contiguous FP8 data expected")
    programs = programs or default_programs(a.data)
    a_x = torch.empty(a.data.shape, dtype=torch.bfloat16, device=a.data.device)
    b_x = torch.empty(b.data.shape, dtype=torch.bfloat16, device=b.data.device)
    (ma, ca), (nb, cb) = a.data.shape, b.data.shape
    cr, ck = COPY_TILE[0], min(COPY_TILE[1], triton.next_power_of_2(max(ca, cb)))
    tiles = triton.cdiv(ma, cr) * triton.cdiv(ca, ck) + triton.cdiv(nb, cr) * triton.cdiv(cb, ck)
    ends = a.flags if ends is None else ends  # (a stand-in pointer where no operand is segmented)
    launcher(_exact_copy_kernel)[(max(1, min(tiles, 2 * programs)),)](
        a.data, a.side, a.eb, a.scale, a.flags, ma, ca, a.eb.stride(0), a_layout[3], a_layout[4], a_x,
        b.data, b.side, b.eb, b.scale, b.flags, nb, cb, b.eb.stride(0), b_layout[3], b_layout[4], b_x,
        ends, ends.shape[0], BR=cr, BK=ck, A_BLC=a_layout[0], A_SHIFT=a_layout[1], A_GROUPS=a_layout[2],
        B_BLC=b_layout[0], B_SHIFT=b_layout[1], B_GROUPS=b_layout[2], num_warps=COPY_TILE[2])
    return a_x, b_x


#: The flagged tiles' BF16 GEMM (step 2b): (BM, BN, BK, warps, stages).  On spread inputs (every wgrad tile
#: flagged) it ran at roughly a third of cuBLAS's BF16 speed on the H100 (benchmarks/results-2026-12-06-session21.md);
#: `scripts/profile_fast_path.py --correction-tiles` (H100, 2026-12-06: mxfp4's 4096^2 step on spread inputs 1.744 ms
#: with 128 x 256 x 64, 1.917 ms with 128 x 128 x 64; benchmarks/gpu/profile-correctiontiles-2026-12-06-session22-
#: before.txt).  Set this module attribute to change it.
CORRECTION_TILE = (128, 256, 64, 8, 3)


def correct_lost_tiles(out: torch.Tensor, a, b, a_blc: int, a_shift: int, b_blc: int, b_shift: int,
                       tile: tuple[int, ...] | None = None, programs: int | None = None) -> None:
    """Recompute exactly, in place, the tiles of out [M, N] whose rows of a or b are flagged (one program
    per SM, or `programs`; each walks its share of the tiles, only when some row is flagged): two launches,
    the exact BF16 copies of both operands and the GEMM of the flagged tiles over them.  The copies' memory
    (BF16, the operands' shapes) is taken for every call and written only when some row is flagged.
    tile: (BM, BN, BK[, warps, stages]), CORRECTION_TILE by default."""
    m, n = out.shape
    tile = tile or CORRECTION_TILE
    bm, bn, bk = tile[:3]
    warps = tile[3] if len(tile) > 3 else 8 if bm * bn >= 128 * 128 else 4
    stages = tile[4] if len(tile) > 4 else 3
    k = a.data.shape[1]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = programs or default_programs(out)
    a_x, b_x = exact_copies(a, b, (a_blc, a_shift, 0, 0, 0), (b_blc, b_shift, 0, 0, 0), programs)
    launcher(_correction_kernel)[(max(1, min(tiles, programs)),)](
        out, m, n, out.stride(0), a_x, a.flags, a.data.shape[0], b_x, b.flags, b.data.shape[0], k,
        BM=bm, BN=bn, BK=min(bk, triton.next_power_of_2(k)), OUT_BF16=out.dtype == torch.bfloat16,
        INTERPRETED=not out.is_cuda, num_warps=warps, num_stages=stages if out.is_cuda else 1)


def scaled_mm(a, b, m: int, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Step 1: the FP8 product with row scales (CUDA: `torch._scaled_mm`; CPU: the same in FP32)."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"operand widths differ: {a.data.shape[1]} vs {b.data.shape[1]}")
    if not a.data.is_cuda:  # the interpreter's path (tests): FP8 values are exact in FP32
        out = (a.data.float() * a.scale[:, None]) @ (b.data.float() * b.scale[:, None]).t()
        return out[:m, :n].to(out_dtype)
    if out_dtype == torch.bfloat16:
        out = torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale[:, None], scale_b=b.scale[None, :],
                               out_dtype=torch.bfloat16)
    else:
        one = torch.ones((), device=a.data.device)
        out = torch._scaled_mm(a.data, b.data.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        out = (out * a.scale[:, None] * b.scale[None, :]).to(out_dtype)
    return out[:m, :n]


def fp8_gemm(a, b, m: int, n: int, out_dtype: torch.dtype, a_blc: int, a_shift: int, b_blc: int,
             b_shift: int) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T of two FP8 operands, exact (see the module docstring), in out_dtype."""
    out = scaled_mm(a, b, m, n, out_dtype)
    if out.stride(1) != 1 or out.stride(0) != n:
        out = out.contiguous()
    correct_lost_tiles(out, a, b, a_blc, a_shift, b_blc, b_shift)
    return out


@triton.jit
def _scale_cast_kernel(src_ptr, dst_ptr, n, a_scale_ptr, b_scale_ptr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """dst = BF16(src * (a_scale * b_scale)): FP32 products rounded once each, as torch's two ops round them."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(a_scale_ptr) * tl.load(b_scale_ptr)
    if EVEN:
        v = tl.load(src_ptr + offs)
        tl.store(dst_ptr.to(tl.pointer_type(tl.int16)) + offs, bf16_bits(v * s))
    else:
        v = tl.load(src_ptr + offs, mask=offs < n, other=0.0)
        tl.store(dst_ptr.to(tl.pointer_type(tl.int16)) + offs, bf16_bits(v * s), mask=offs < n)


SCALE_CAST_BLOCK = 4096


def scale_output(out: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """The BF16-form GEMM's epilogue where the fused kernel (kernels/src/bf16_gemm.py) does not run -- FP32 outputs,
    operands off TMA's alignment, the CPU: the FP32 accumulator out times the two FP32 tensor scales, in out_dtype.

    `(out * (a_scale * b_scale)).to(out_dtype)` -- two passes over the FP32 output in eager mode (a mul that
    writes FP32, then the cast), 0.12 ms of a 4096-wide layer's 1.9 ms fwd+bwd on the H200
    (benchmarks/gpu/profile-linear-2026-12-02-session9.txt) -- is one read and one BF16 write here, with the same
    roundings.  Under torch.compile (which fuses the two ops itself), on the CPU and for other dtypes: the torch ops."""
    if (out_dtype != torch.bfloat16 or out.dtype != torch.float32 or not out.is_contiguous()
            or a_scale.numel() != 1 or b_scale.numel() != 1 or tracing(out) or not _kernel_device(out)):
        return (out * (a_scale * b_scale)).to(out_dtype)
    dst = torch.empty(out.shape, dtype=torch.bfloat16, device=out.device)
    n = out.numel()
    launcher(_scale_cast_kernel)[(triton.cdiv(n, SCALE_CAST_BLOCK),)](
        out, dst, n, a_scale, b_scale, BLOCK=SCALE_CAST_BLOCK, EVEN=n % SCALE_CAST_BLOCK == 0, num_warps=8)
    return dst


def _kernel_device(t: torch.Tensor) -> bool:
    """CUDA tensors; CPU tensors only in Triton's interpreter (the tests)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
