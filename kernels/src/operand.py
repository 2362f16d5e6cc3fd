"""GEMM operands straight from a high-precision tensor: both orientations from one read.

A tensor t [R, C] feeds two GEMMs (x: fprop along K and wgrad along T; dy: dgrad along N and wgrad
along T; W: fprop along K and dgrad along N).  `triton_operands(t, plans, ...)` produces the operand
of each orientation in two passes over t:

1. the stats pass reads t once and, per orientation, reduces what its scale rule needs: the tensor
   amax (two-level UE4M3 + FP32 scales) or the amax of every row of the operand (E8M0 scales folded
   into FP8, below); rotated first when the orientation has a Hadamard transform;
2. the operand pass reads t once more and writes both operands: "A" = the rows of t (blocks along
   C) and "B" = the rows of t^T (blocks along R), through a register transpose of the same tile.

Operand forms (bit-exact with the reference values, `hf_fp4.numerics.quantize` then `dequantize`):

* `bf16`: v * s_b (UE4M3 block scale: 8 significant bits at most) or v * 2^e (E8M0), exact in BF16;
  the FP32 tensor decode scale goes to the GEMM;
* `fp8`: E8M0 scales on a 4-bit grid folded into E4M3 against a reference exponent per operand row,
  e_ref = the row's largest block exponent (2D blocks: of the block's rows): v * 2^(e_b - e_ref + SHIFT),
  GEMM row scale 2^(e_ref - SHIFT) (SHIFT = floor(log2(448 / grid max))).  Exact while e_ref - e_b <= DMAX
  (E4M3's subnormals run out below).  A block further down is "lost": its FP8 value is 0, its exact value v * 2^SHIFT goes
  to the `side` buffer with its exponent in `eb` (-128 elsewhere), and its row is flagged.  The GEMM
  front end (gemm.py) recomputes every output tile that touches a flagged row exactly -- decided on
  the device, with no host synchronisation.

Grouped operands (`groups=RowGroups(...)`, the grouped expert GEMMs): t's rows in groups -- experts' segments,
or experts' weight rows -- each quantized as a tensor of its own by the same two passes: the stats pass
(`_group_stats_kernel`) reduces per group (the tensor amax) or per row and group (the transposed orientation's
FP8 reference exponents, whose contraction runs across the groups), and the operand pass reads each block's
group for its tensor amax, reference exponent, SR seed and SR coordinates (`_group_of`, `_tensor_amax`,
`_uniforms`).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from hf_fp4.numerics.operand_plan import Operand, OperandPlan, RowGroups, empty_operand, fp8_dmax, fp8_shift
from hf_fp4.numerics.spec import Rounding

from .launch import launcher
from .numerics import (block_max, encode_factor, e8m0_exponent, expand_blocks, finite_abs, flush_subnormals,
                       grid_constants, hadamard, hadamard_across, hadamard_block_amax, pow2, rand16x, round_grid,
                       sr_uniforms, sr_uniforms_at, tensor_encode_scale, ue4m3_block_scale, with_sign_of)
from .quant import SCALE_CODES, load_tile


@triton.jit
def _max_into(ptr, value, mask=None):
    """atomic max of finite values >= 0 (the stats pass's amaxes) into FP32 memory that starts at +0: one integer
    max on the bits, which order as the values do -- Triton's FP32 atomic_max is two integer atomics (max and umin,
    for either sign) -- and relaxed: the operand pass reads the result after the launch ends (sm_90 code: no
    acq_rel fences in the walk's per-row atomics)."""
    tl.atomic_max(ptr.to(tl.pointer_type(tl.int32)), value.to(tl.int32, bitcast=True), mask=mask, sem="relaxed")


@triton.jit
def _stats_kernel(t_ptr, R, C, s_r, s_c, mu_ptr, a_stat, a_signs, b_stat, b_signs,
                  BR: tl.constexpr, BC: tl.constexpr, STEPS: tl.constexpr, HAS_MU: tl.constexpr, EVEN: tl.constexpr,
                  A_STAT: tl.constexpr, A_H: tl.constexpr, A_HSCALE: tl.constexpr, A_SIGNS: tl.constexpr,
                  B_STAT: tl.constexpr, B_H: tl.constexpr, B_HSCALE: tl.constexpr, B_SIGNS: tl.constexpr,
                  ACROSS: tl.constexpr):
    """Per-row (STAT 1) / tensor (STAT 2) amax of each orientation from one read of t.

    A program walks STEPS row tiles of one column strip.  What does not change along the walk -- the tensor
    amax, and B's per-row amax (B's rows are t's columns) -- is an elementwise running max of the tiles in
    registers, reduced across threads and sent to memory (one atomic) once at the end: on the H200 the
    per-tile reductions (through shared memory) held this pass to 30% of DRAM bandwidth (ncu, session 9).
    A's per-row amax (STAT 1) is reduced per tile, along the tile's rows.  An orientation without a Hadamard
    reads the tile where it lies (no transpose); ACROSS (stats_across()): B's Hadamard is computed across B_H row
    tiles (_stats_across), no transpose either."""
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    if ACROSS:
        _stats_across(t_ptr, R, C, s_r, s_c, mu_ptr, a_stat, a_signs, b_stat, b_signs, cols, BR, BC, STEPS, HAS_MU,
                      EVEN, A_STAT, A_H, A_HSCALE, A_SIGNS, B_STAT, B_H, B_HSCALE, B_SIGNS)
    else:
        _stats_tiles(t_ptr, R, C, s_r, s_c, mu_ptr, a_stat, a_signs, b_stat, b_signs, cols, BR, BC, STEPS, HAS_MU,
                     EVEN, A_STAT, A_H, A_HSCALE, A_SIGNS, B_STAT, B_H, B_HSCALE, B_SIGNS)


#: The largest Hadamard of B (blocks along t's rows) that either pass computes across row tiles: a program
#: holds that many row tiles at once.
ACROSS_MAX = 32


@triton.jit
def _stats_across(t_ptr, R, C, s_r, s_c, mu_ptr, a_stat, a_signs, b_stat, b_signs, cols,
                  BR: tl.constexpr, BC: tl.constexpr, STEPS: tl.constexpr, HAS_MU: tl.constexpr, EVEN: tl.constexpr,
                  A_STAT: tl.constexpr, A_H: tl.constexpr, A_HSCALE: tl.constexpr, A_SIGNS: tl.constexpr,
                  B_STAT: tl.constexpr, B_H: tl.constexpr, B_HSCALE: tl.constexpr, B_SIGNS: tl.constexpr):
    """The stats pass when B has a Hadamard and A needs its tensor amax, rotated or not, or its per-row amax without
    a Hadamard (stats_across(): NVFP4's x and dy, RHT-16 on the wgrad orientation only; UFP4's x, dy and W, RHT-16
    both ways; mxfp4_dh's x, H-32 on the wgrad orientation): each row tile is read as B_H tiles of BR / B_H
    rows, xs[i] = rows r0 + g * B_H + i, so that B's rotation (along t's rows) is elementwise between them
    (hadamard_across).  A's rotation (along t's columns) runs inside each of those tiles and is reduced where its
    last butterfly stage leaves it (hadamard_block_amax): UFP4's x went from _stats_tiles' 9 conversions, 42
    barriers, 202 shared-memory accesses and 124 registers to 8 barriers, 14 accesses and 79 registers (sm_90,
    Triton 3.6), and its x pair's operands (both passes, 8192^2) from 0.489 to 0.337 ms on the H200.  A's per-row
    amax (mxfp4_dh's x: E8M0 scales folded into FP8, H-32 on the wgrad orientation) is reduced from a second load
    of the whole row tile (an L1 / L2 hit): 8 conversions, 17 barriers and ~100 shared-memory accesses -> 2, 5 and
    9 (untimed).  For NVFP4's x / dy (A plain) the transpose and butterfly stages of _stats_tiles were six layout
    conversions through 16 KiB of shared memory at 128 registers; this is none, 2 KiB, 75 registers.  (A's
    per-row amax with a Hadamard would need a reduction per row tile of the B_H: those pairs stay on _stats_tiles.)"""
    G: tl.constexpr = BR // B_H
    g = tl.arange(0, G)
    plain = tl.zeros([G, BC], dtype=tl.float32)  # |t| for A's tensor amax, elementwise
    b_acc = tl.zeros([G, BC], dtype=tl.float32)  # |B's rotated values|, elementwise (t's columns are B's rows)
    a_rot = tl.zeros([], dtype=tl.float32)  # A's rotated tensor amax
    for step in range(STEPS):
        row0 = (tl.program_id(0) * STEPS + step) * BR
        xs = ()
        for i in tl.static_range(B_H):
            xs = xs + (load_tile(t_ptr, row0 + g * B_H + i, cols, R, C, s_r, s_c, mu_ptr, HAS_MU, EVEN),)
        ys = hadamard_across(xs, b_signs, B_H, B_HSCALE, B_SIGNS)
        for i in tl.static_range(B_H):
            b_acc = tl.maximum(b_acc, finite_abs(ys[i]))
            if A_STAT == 2 and A_H == 0:
                plain = tl.maximum(plain, finite_abs(xs[i]))
        if A_STAT == 1:  # A's per-row amax (A_H == 0): the whole tile once more (an L1 / L2 hit), reduced per row
            rows = row0 + tl.arange(0, BR)
            x = load_tile(t_ptr, rows, cols, R, C, s_r, s_c, mu_ptr, HAS_MU, EVEN)
            _max_into(a_stat + rows, tl.max(finite_abs(x), axis=1), mask=rows < R)
        if A_STAT == 2 and A_H > 0:  # A's rotation inside each row tile: block amaxes, in their own layout
            a_step = hadamard_block_amax(xs[0], a_signs, G, BC, A_H, A_HSCALE, A_SIGNS)
            for i in tl.static_range(1, B_H):
                a_step = tl.maximum(a_step, hadamard_block_amax(xs[i], a_signs, G, BC, A_H, A_HSCALE, A_SIGNS))
            a_rot = tl.maximum(a_rot, tl.max(tl.max(a_step, axis=1), axis=0))
    if A_STAT == 2:
        _max_into(a_stat, flush_subnormals(a_rot * A_HSCALE) if A_H > 0 else tl.max(tl.max(plain, axis=1), axis=0))
    _send_b(b_stat, tl.max(b_acc, axis=0), cols, C, B_STAT)


@triton.jit
def _send_b(b_stat, b, cols, C, B_STAT: tl.constexpr):
    """B's statistic from b, the amax of each of its rows (t's columns) in this program: per row (STAT 1) or of
    the tensor (STAT 2)."""
    if B_STAT == 2:
        _max_into(b_stat, tl.max(b, axis=0))
    else:
        _max_into(b_stat + cols, b, mask=cols < C)


@triton.jit
def _stats_tiles(t_ptr, R, C, s_r, s_c, mu_ptr, a_stat, a_signs, b_stat, b_signs, cols,
                 BR: tl.constexpr, BC: tl.constexpr, STEPS: tl.constexpr, HAS_MU: tl.constexpr, EVEN: tl.constexpr,
                 A_STAT: tl.constexpr, A_H: tl.constexpr, A_HSCALE: tl.constexpr, A_SIGNS: tl.constexpr,
                 B_STAT: tl.constexpr, B_H: tl.constexpr, B_HSCALE: tl.constexpr, B_SIGNS: tl.constexpr):
    """The stats pass on whole row tiles (B without a Hadamard, or with one above ACROSS_MAX)."""
    plain = tl.zeros([BR, BC], dtype=tl.float32)  # |t|, elementwise: A's tensor amax, B's amaxes (no Hadamard)
    a_rot = tl.zeros([BR], dtype=tl.float32)      # A's rotated rows (tensor amax): reduced per tile
    b_rot = tl.zeros([BC], dtype=tl.float32)      # B's rotated rows: reduced per tile
    PLAIN: tl.constexpr = (A_STAT == 2 and A_H == 0) or (B_STAT > 0 and B_H == 0)
    for step in range(STEPS):
        rows = (tl.program_id(0) * STEPS + step) * BR + tl.arange(0, BR)
        x = load_tile(t_ptr, rows, cols, R, C, s_r, s_c, mu_ptr, HAS_MU, EVEN)
        if PLAIN:
            plain = tl.maximum(plain, finite_abs(x))
        if A_STAT > 0 and A_H > 0:
            a = tl.max(finite_abs(hadamard(x, a_signs, BR, BC, A_H, A_HSCALE, A_SIGNS)), axis=1)
            if A_STAT == 1:
                _max_into(a_stat + rows, a, mask=rows < R)
            else:
                a_rot = tl.maximum(a_rot, a)
        elif A_STAT == 1:
            _max_into(a_stat + rows, tl.max(finite_abs(x), axis=1), mask=rows < R)
        if B_STAT > 0 and B_H > 0:
            b_rot = tl.maximum(b_rot, tl.max(finite_abs(hadamard(tl.trans(x), b_signs, BC, BR, B_H, B_HSCALE,
                                                                  B_SIGNS)), axis=1))
    if A_STAT == 2:
        _max_into(a_stat, tl.max(a_rot, axis=0) if A_H > 0 else tl.max(tl.max(plain, axis=1), axis=0))
    if B_STAT > 0:
        _send_b(b_stat, b_rot if B_H > 0 else tl.max(plain, axis=0), cols, C, B_STAT)


#: Rows of t a grouped operand's groups are made of (their boundaries are multiples of it): the grouped stats pass
#: sends one amax per GROUP_ROWS rows.
GROUP_ROWS = 16


def group_stats_across(a: OperandPlan | None, b: OperandPlan | None) -> bool:
    """Whether the grouped stats pass rotates B across row tiles (_group_stats_across): B's Hadamard is a whole
    number of group chunks, up to ACROSS_MAX (NVFP4's and UFP4's RHT-16 on the wgrad orientation, UFP4's dgrad
    weight, mxfp4_dh's H-32 -- groups start at multiples of the wgrad blocks and Hadamard, so a Hadamard block never
    spans two groups), and A needs at most its tensor amax, rotated or not, or its per-row amax unrotated (as
    stats_across())."""
    return (b is not None and b.stat > 0 and b.hadamard % GROUP_ROWS == 0 and 0 < b.hadamard <= ACROSS_MAX
            and (a is None or a.stat != 1 or a.hadamard == 0))


@triton.jit
def _group_stats_across(t_ptr, R, C, s_r, s_c, ids_ptr, a_stat, a_signs, b_stat, b_signs, b_rows, cols,
                        BR: tl.constexpr, BC: tl.constexpr, EVEN: tl.constexpr,
                        A_STAT: tl.constexpr, A_H: tl.constexpr, A_HSCALE: tl.constexpr, A_SIGNS: tl.constexpr,
                        B_STAT: tl.constexpr, B_H: tl.constexpr, B_HSCALE: tl.constexpr, B_SIGNS: tl.constexpr):
    """_group_stats_kernel's tile read as B_H tiles xs[i] of rows r0 + g * B_H + i, g one Hadamard block (one or
    two group chunks of one group) each: B's rotation along t's rows is elementwise between them (hadamard_across,
    bit-identical), and its amax per block and column is an elementwise max over i -- no transpose (_stats_across's
    layout for the grouped pass).  A's amax per block (STAT 2; rotated inside each xs[i] by hadamard_block_amax,
    scaled once after) or per row (STAT 1, unrotated)."""
    G: tl.constexpr = BR // B_H
    g = tl.arange(0, G)
    chunk_rows = tl.program_id(0) * BR + g * B_H  # each block's first row (its group: the block's)
    chunk_ok = chunk_rows < R
    ids = tl.load(ids_ptr + chunk_rows, mask=chunk_ok, other=0)
    xs = ()
    for i in tl.static_range(B_H):
        xs = xs + (load_tile(t_ptr, chunk_rows + i, cols, R, C, s_r, s_c, t_ptr, False, EVEN),)
    ys = hadamard_across(xs, b_signs, B_H, B_HSCALE, B_SIGNS)
    b = finite_abs(ys[0])
    for i in tl.static_range(1, B_H):
        b = tl.maximum(b, finite_abs(ys[i]))  # [G, BC]: per chunk and t column
    if B_STAT == 1:  # -> b_stat[group, column]
        _max_into(b_stat + ids[:, None] * b_rows + cols[None, :], b, mask=chunk_ok[:, None] & (cols[None, :] < b_rows))
    else:
        _max_into(b_stat + ids, tl.max(b, axis=1), mask=chunk_ok)
    if A_STAT == 1:  # per row of t, unrotated: the whole tile once more (an L1 / L2 hit), as _stats_across
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        x = load_tile(t_ptr, rows, cols, R, C, s_r, s_c, t_ptr, False, EVEN)
        _max_into(a_stat + rows, tl.max(finite_abs(x), axis=1), mask=rows < R)
    if A_STAT == 2:
        if A_H > 0:  # rotated along t's columns inside each xs[i]: block amaxes [G * BC / A_H, A_H / 2], an
            # elementwise max over the xs[i] in that layout, then one reshape to [G, BC / 2] per chunk
            a_step = hadamard_block_amax(xs[0], a_signs, G, BC, A_H, A_HSCALE, A_SIGNS)
            for i in tl.static_range(1, B_H):
                a_step = tl.maximum(a_step, hadamard_block_amax(xs[i], a_signs, G, BC, A_H, A_HSCALE, A_SIGNS))
            a = flush_subnormals(tl.max(tl.reshape(a_step, [G, BC // 2]), axis=1) * A_HSCALE)
        else:
            a = tl.max(finite_abs(xs[0]), axis=1)
            for i in tl.static_range(1, B_H):
                a = tl.maximum(a, tl.max(finite_abs(xs[i]), axis=1))
        _max_into(a_stat + ids, a, mask=chunk_ok)


@triton.jit
def _group_stats_kernel(t_ptr, R, C, s_r, s_c, ids_ptr, a_stat, a_signs, b_stat, b_signs,
                        b_rows, BR: tl.constexpr, BC: tl.constexpr, EVEN: tl.constexpr, CH: tl.constexpr,
                        A_STAT: tl.constexpr, A_H: tl.constexpr, A_HSCALE: tl.constexpr, A_SIGNS: tl.constexpr,
                        B_STAT: tl.constexpr, B_H: tl.constexpr, B_HSCALE: tl.constexpr, B_SIGNS: tl.constexpr,
                        ACROSS: tl.constexpr):
    """The tensor amax (STAT 2) of each orientation per group of t's rows (ids_ptr: the group of each row): a
    program reduces its [BR, BC] tile per row of t -- A's rotated along t's columns, B's along t's rows -- and
    sends one atomic max per CH (GROUP_ROWS) rows into the group's element of the statistic.  Per-row statistics
    (STAT 1, the FP8 form's reference exponents): A's per row of t (rows are not shared by groups), B's per row of
    B and group (b_stat [E, b_rows]).  ACROSS (group_stats_across()): B's Hadamard is one chunk, rotated across row
    tiles (_group_stats_across): sm_90 code (Triton 3.9, scripts/ptx_report.py --only grouped-stats) of NVFP4's
    x / dy from 8 layout conversions, 32 KiB of shared memory and 39 SASS instructions per element to 2, 32 B and
    30; UFP4's x from 43 barriers, 32 KiB and 60.8 to 7, 32 B and 33.5 (its A rotation's 50 conversions are the
    ungrouped pass's 49); mxfp4_dh's x (H-32, A's per-row amax from a second read of the tile) from 8 conversions,
    32 KiB, 13 barriers and 40 to 1, 256 B, 1 and 29.5.  Otherwise a plain pass over whole tiles (a transpose for
    B's Hadamard).  Not yet timed."""
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    if ACROSS:
        _group_stats_across(t_ptr, R, C, s_r, s_c, ids_ptr, a_stat, a_signs, b_stat, b_signs, b_rows, cols, BR, BC,
                            EVEN, A_STAT, A_H, A_HSCALE, A_SIGNS, B_STAT, B_H, B_HSCALE, B_SIGNS)
    else:
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        x = load_tile(t_ptr, rows, cols, R, C, s_r, s_c, t_ptr, False, EVEN)
        NCH: tl.constexpr = BR // CH
        chunks = tl.program_id(0) * BR + tl.arange(0, NCH) * CH
        ids = tl.load(ids_ptr + chunks, mask=chunks < R, other=0)
        if A_STAT > 0:
            if A_H > 0:
                a = tl.max(finite_abs(hadamard(x, a_signs, BR, BC, A_H, A_HSCALE, A_SIGNS)), axis=1)
            else:
                a = tl.max(finite_abs(x), axis=1)
            if A_STAT == 1:
                _max_into(a_stat + rows, a, mask=rows < R)
            else:
                _max_into(a_stat + ids, tl.max(tl.reshape(a, [NCH, CH]), axis=1), mask=chunks < R)
        if B_STAT > 0:
            if B_H > 0:  # [BC, NCH]: per t column and chunk of t's rows
                rotated = hadamard(tl.trans(x), b_signs, BC, BR, B_H, B_HSCALE, B_SIGNS)
                b = tl.trans(tl.max(tl.reshape(finite_abs(rotated), [BC, NCH, CH]), axis=2))
            else:
                b = tl.max(tl.reshape(finite_abs(x), [NCH, CH, BC]), axis=1)
            if B_STAT == 1:  # [NCH, BC] -> b_stat[group, column]
                _max_into(b_stat + ids[:, None] * b_rows + cols[None, :], b,
                          mask=(chunks[:, None] < R) & (cols[None, :] < b_rows))
            else:
                _max_into(b_stat + ids, tl.max(b, axis=1), mask=chunks < R)


@triton.jit
def _block_scales(amax, e_ref, t_amax, SCALE: tl.constexpr, QMAX: tl.constexpr, QM: tl.constexpr,
                  QE: tl.constexpr, EMAX: tl.constexpr, FP8: tl.constexpr, SHIFT: tl.constexpr, DMAX: tl.constexpr):
    """Per block of an operand, from its amax (any shape; e_ref: the FP8 form's reference exponent of each
    block's rows, broadcast to amax's shape; t_amax: the two-level formats' tensor amax, a scalar or one per
    block of a grouped operand): (encode factor, block factor -- the value a grid point is multiplied
    by, NaN for a block holding a NaN / Inf --, lost -- FP8: more than DMAX binades below e_ref --, the E8M0
    exponent, the FP32 tensor decode scale: 1 for E8M0)."""
    bad = ~(amax <= 3.4028234663852886e38)
    lost = amax < 0  # nothing, unless FP8 below
    if SCALE == 0 or SCALE == 1:  # E8M0 (floor or ceil)
        e = e8m0_exponent(amax, SCALE == 1, QM, QE, EMAX)
        encode = pow2(-e)
        s_dec = 1.0
        if FP8:  # folded into E4M3 against the reference exponent of the block's rows
            lost = (amax > 0) & (e_ref - e > DMAX) & ~bad
            factor = tl.where(lost, 0.0, pow2(tl.maximum(e - e_ref + SHIFT, -149)))
        else:
            factor = pow2(e)
    else:  # UE4M3 block scale + FP32 tensor scale
        e = tl.zeros(amax.shape, dtype=tl.int32)
        s_enc = tensor_encode_scale(t_amax, QMAX)
        s_dec = tl.math.div_rn(1.0, s_enc)
        factor = ue4m3_block_scale(amax, s_enc, QMAX)
        encode = tl.where(factor > 0, encode_factor(factor * s_dec), 0.0)
    return encode, tl.where(bad, float("nan"), factor), lost, e, s_dec


@triton.jit
def _group_of(grp, t_rows, BL: tl.constexpr, N: tl.constexpr):
    """The group of each of N // BL blocks of BL consecutive rows of t (t_rows [N]; grp = (ids, starts, kp, R):
    a group per row of t, each group's first row and padded length; a block lies in one group)."""
    ids = tl.load(grp[0] + t_rows, mask=t_rows < grp[3], other=0)
    if BL > 1:
        ids = tl.max(tl.reshape(ids, [N // BL, BL]), axis=1)
    return ids


@triton.jit
def _tensor_amax(stat_ptr, grp, rows, cols, SCALE: tl.constexpr, GROUPS: tl.constexpr, BM: tl.constexpr,
                 BK: tl.constexpr, BLR: tl.constexpr, BLC: tl.constexpr):
    """The tensor amax of a two-level operand's [BM // BLR, BK // BLC] blocks: the tensor's (GROUPS 0), or of the
    group each block lies in -- the groups running along the operand's rows (1) or its contraction (2)."""
    t_amax = 0.0
    if SCALE >= 2:
        if GROUPS == 0:
            t_amax = tl.load(stat_ptr)
        elif GROUPS == 1:
            t_amax = tl.load(stat_ptr + _group_of(grp, rows, BLR, BM))[:, None]
        else:
            t_amax = tl.load(stat_ptr + _group_of(grp, cols, BLC, BK))[None, :]
    return t_amax


@triton.jit
def _uniforms(seed_ptr, grp, rows, col0, KP, GROUPS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """SR's uniforms of a [BM, BK] tile (sr_uniforms).  Grouped, each group is its own operand, as in a loop over
    groups: its own seed (seed_ptr[2 * g]) and coordinates from its first row -- along the operand's rows (1),
    or along the contraction (2), whose padded length is then the group's (kp[g])."""
    if GROUPS == 0:
        u = sr_uniforms(tl.load(seed_ptr), rows, col0, KP, BM, BK)
    elif GROUPS == 1:
        g = _group_of(grp, rows, 1, BM)
        u = sr_uniforms(tl.load(seed_ptr + 2 * g)[:, None], rows - tl.load(grp[1] + g), col0, KP, BM, BK)
    else:  # (groups start at multiples of GROUP_ROWS = 16: a Philox call's 16 columns lie in one group)
        c16 = col0 + 16 * tl.arange(0, BK // 16)
        g = _group_of(grp, c16, 1, BK // 16)
        kp16 = (tl.load(grp[2] + g) + 15) // 16
        counters = rows[:, None].to(tl.int64) * kp16[None, :] + ((c16 - tl.load(grp[1] + g)) // 16)[None, :]
        u = sr_uniforms_at(tl.load(seed_ptr + 2 * g)[None, :], counters, BM, BK)
    return u


@triton.jit
def _store_group_scales(stat_ptr, scale_ptr, n_groups, QMAX: tl.constexpr):
    """A grouped two-level operand's FP32 decode scale of every group, from the groups' amaxes."""
    for g0 in range(0, n_groups, 128):
        g = g0 + tl.arange(0, 128)
        s_enc = tensor_encode_scale(tl.load(stat_ptr + g, mask=g < n_groups, other=0.0), QMAX)
        tl.store(scale_ptr + g, tl.math.div_rn(tl.full([128], 1.0, tl.float32), s_enc), mask=g < n_groups)


@triton.jit
def _round_values(x, encode, factor, u, GRID: tl.constexpr, SR: tl.constexpr):
    """Per element: (signed grid value, operand value = grid value x block factor); encode / factor per element
    (expanded from the blocks), u: SR's uniforms (ignored for round to nearest)."""
    scaled = x * encode
    m = tl.abs(scaled)
    q = with_sign_of(round_grid(m, u if SR else m, GRID, SR), scaled)
    return q, q * factor


@triton.jit
def _store_fp8(out_ptr, offs, val, inside, INTERPRETED: tl.constexpr):
    """E4M3 values as bits (the interpreter's conversion drops NaN: its code written explicitly)."""
    bits = val.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    if INTERPRETED:
        bits = tl.where(val != val, 0x7F, bits)  # E4M3 NaN
    tl.store(out_ptr + offs, bits, mask=inside)


@triton.jit
def _emit(x, rows, cols, col0, first_tile, out_ptr, n_rows, n_cols, stat_ptr, scale_ptr, seed_ptr,
          signs_ptr, side_ptr, eb_ptr, flag_ptr, KP, grp, GROUPS: tl.constexpr,
          BM: tl.constexpr, BK: tl.constexpr, BLR: tl.constexpr, BLC: tl.constexpr, GRID: tl.constexpr,
          QMAX: tl.constexpr, QM: tl.constexpr, QE: tl.constexpr, EMAX: tl.constexpr, SCALE: tl.constexpr,
          SR: tl.constexpr, H: tl.constexpr, HSCALE: tl.constexpr, HAS_SIGNS: tl.constexpr, FP8: tl.constexpr,
          SHIFT: tl.constexpr, DMAX: tl.constexpr, EVEN: tl.constexpr, INTERPRETED: tl.constexpr):
    """Quantize a [BM, BK] tile (rows = operand rows, columns = contraction) into its GEMM operand.

    Per element only: scale, round, sign, multiply by the block factor, convert.  Non-finite input
    needs no per-element test: the block amax propagates NaN/Inf, and a NaN block factor makes the
    whole block NaN (the E4M3 conversion keeps NaN on the GPU; under INTERPRETED -- Triton's interpreter,
    whose conversion does not -- the NaN code is written explicitly).  GROUPS: see _tensor_amax (a grouped
    operand's decode scales are written by _store_group_scales)."""
    if H > 0:
        x = hadamard(x, signs_ptr, BM, BK, H, HSCALE, HAS_SIGNS)
    a = tl.abs(x)
    if INTERPRETED:  # the interpreter's max drops NaN, as PTX's does: map NaN to Inf first
        a = tl.where(a == a, a, float("inf"))
    amax = block_max(a, BM, BK, BLR, BLC, not INTERPRETED)  # [BM // BLR, BK // BLC]; NaN/Inf: non-finite
    NBM: tl.constexpr = BM // BLR
    NBK: tl.constexpr = BK // BLC
    e_ref = amax  # (unused but by the FP8 form)
    if FP8 and GROUPS == 2:  # per (row, group of the block's columns): statistics and row scales [E, n_rows]
        g = _group_of(grp, cols, BLC, BK)
        at = g[None, :] * n_rows + rows[:, None]  # [BM, NBK]
        row_amax = tl.load(stat_ptr + at, mask=rows[:, None] < n_rows, other=0.0)
        e_ref = e8m0_exponent(tl.max(tl.reshape(row_amax, [NBM, BLR, NBK]), axis=1), SCALE == 1, QM, QE, EMAX)
        e_each = tl.reshape(tl.broadcast_to(tl.reshape(e_ref, [NBM, 1, NBK]), [NBM, BLR, NBK]), [BM, NBK])
        tl.store(scale_ptr + at, pow2(e_each - SHIFT), mask=rows[:, None] < n_rows)  # (every tile: the same)
    elif FP8:  # reference exponent: the largest block of the block's rows, from the stats pass
        row_amax = tl.load(stat_ptr + rows, mask=rows < n_rows, other=0.0)
        e_rows = e8m0_exponent(tl.max(tl.reshape(row_amax, [NBM, BLR]), axis=1), SCALE == 1, QM, QE, EMAX)
        e_ref = tl.broadcast_to(e_rows[:, None], [NBM, NBK])
        if col0 == 0:  # the row scale, written by the row's first tile
            e_each = tl.reshape(tl.broadcast_to(e_rows[:, None], [NBM, BLR]), [BM])
            tl.store(scale_ptr + rows, pow2(e_each - SHIFT), mask=rows < n_rows)
    t_amax = _tensor_amax(stat_ptr, grp, rows, cols, SCALE, GROUPS, BM, BK, BLR, BLC)
    encode, factor, lost, e, s_dec = _block_scales(amax, e_ref, t_amax, SCALE, QMAX, QM, QE, EMAX, FP8, SHIFT,
                                                   DMAX)
    if SCALE >= 2 and first_tile and GROUPS == 0:  # two-level: the tensor decode scale
        tl.store(scale_ptr, s_dec)
    if SR:
        u = _uniforms(seed_ptr, grp, rows, col0, KP, GROUPS, BM, BK)
    else:
        u = x
    q, val = _round_values(x, expand_blocks(encode, BM, BK, BLR, BLC), expand_blocks(factor, BM, BK, BLR, BLC), u,
                           GRID, SR)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    if EVEN:
        inside = None
    else:
        inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    if FP8:
        _store_fp8(out_ptr, offs, val, inside, INTERPRETED)
        if tl.max(tl.max(lost.to(tl.int32), axis=1), axis=0) > 0:  # rare: record the lost blocks exactly
            lost_el = expand_blocks(lost.to(tl.int32), BM, BK, BLR, BLC) > 0
            tl.store(side_ptr + offs, (q * (1 << SHIFT)).to(tl.float8e4nv).to(tl.uint8, bitcast=True),
                     mask=lost_el if EVEN else inside & lost_el)
            eb = tl.where(lost, e, -128)
            if BLR > 1:
                eb = tl.reshape(tl.broadcast_to(tl.reshape(eb, [NBM, 1, NBK]), [NBM, BLR, NBK]), [BM, NBK])
            bcols = col0 // BLC + tl.arange(0, NBK)
            tl.store(eb_ptr + rows[:, None].to(tl.int64) * (n_cols // BLC) + bcols[None, :], eb.to(tl.int8),
                     mask=(rows[:, None] < n_rows) & (bcols[None, :] < n_cols // BLC))
            row_lost = tl.max(tl.max(tl.reshape(lost_el.to(tl.int32), [BM, NBK, BLC]), axis=2), axis=1)
            tl.store(flag_ptr + rows, row_lost.to(tl.int8), mask=(rows < n_rows) & (row_lost > 0))
            tl.store(flag_ptr + n_rows, tl.full([], 1, tl.int8))  # "some row is flagged" (the GEMM's early exit)
    else:
        tl.store(out_ptr + offs, val.to(tl.bfloat16), mask=inside)


@triton.jit
def _join_halves(vs, N: tl.constexpr):
    """(join(vs[j], vs[j + N / 2]) for j < N / 2): one level of _interleave."""
    out = ()
    for j in tl.static_range(N // 2):
        out = out + (tl.join(vs[j], vs[j + N // 2]),)
    return out


@triton.jit
def _interleave(vs, H: tl.constexpr, G: tl.constexpr, BC: tl.constexpr):
    """H tiles [G, BC], vs[i][g, c] = element (g * H + i, c) of a [G * H, BC] tile -> that tile transposed,
    [BC, G * H].  The joins stack in registers: element i's bits, most significant first, become the new
    trailing dims, so the flat order of the last H is i (no data exchanged but by the final transpose)."""
    vs = _join_halves(vs, H)
    vs = _join_halves(vs, H // 2)
    vs = _join_halves(vs, H // 4)
    vs = _join_halves(vs, H // 8)
    if H > 16:
        vs = _join_halves(vs, H // 16)
    t = tl.reshape(vs[0], [G, BC, H])
    return tl.reshape(tl.permute(t, (1, 0, 2)), [BC, G * H])


@triton.jit
def _emit_across(xs, row0, cols, first_tile, out_ptr, n_rows, n_cols, stat_ptr, scale_ptr, seed_ptr, signs_ptr,
                 side_ptr, eb_ptr, flag_ptr, KP, grp, GROUPED: tl.constexpr, G: tl.constexpr, BC: tl.constexpr,
                 N: tl.constexpr,
                 GRID: tl.constexpr, QMAX: tl.constexpr, QM: tl.constexpr, QE: tl.constexpr, EMAX: tl.constexpr,
                 SCALE: tl.constexpr, SR: tl.constexpr, ROTATE: tl.constexpr, HSCALE: tl.constexpr,
                 HAS_SIGNS: tl.constexpr, FP8: tl.constexpr, SHIFT: tl.constexpr, DMAX: tl.constexpr,
                 EVEN: tl.constexpr, INTERPRETED: tl.constexpr):
    """_emit for the orientation whose blocks run along t's rows (B: rows = t's columns, 1 x N blocks along t's
    rows; ROTATE: an N Hadamard, else none), from the N row tiles xs[i] = t[row0 + g * N + i, cols] ([G, BC]):
    the rotation, the block amax (elementwise over the tuple: a block is one (g, c)), scaling and rounding need
    no transpose; the values are transposed once, for the store (_interleave).  Bit-identical to _emit on the
    transposed tile (GROUPED: its GROUPS 2, the groups along t's rows, a block of N rows in one group)."""
    if ROTATE:
        ys = hadamard_across(xs, signs_ptr, N, HSCALE, HAS_SIGNS)
    else:
        ys = xs
    amax = tl.zeros([G, BC], dtype=tl.float32)
    for i in tl.static_range(N):
        a = tl.abs(ys[i])
        if INTERPRETED:  # the interpreter's max drops NaN: map NaN to Inf first
            a = tl.where(a == a, a, float("inf"))
        amax = tl.maximum(amax, a, propagate_nan=tl.PropagateNan.ALL)
    e_ref = amax  # (unused but by the FP8 form)
    first_rows = row0 + tl.arange(0, G) * N  # each block's first row of t
    if GROUPED:
        g = _group_of(grp, first_rows, 1, G)  # each block's group
    if FP8 and GROUPED:  # per (B's row, group of the block): statistics and row scales [E, n_rows]
        at = g[:, None] * n_rows + cols[None, :]  # [G, BC]
        e_ref = e8m0_exponent(tl.load(stat_ptr + at, mask=cols[None, :] < n_rows, other=0.0), SCALE == 1, QM, QE,
                              EMAX)
        tl.store(scale_ptr + at, pow2(e_ref - SHIFT), mask=cols[None, :] < n_rows)  # (every tile: the same)
    elif FP8:  # reference exponent of each of B's rows (t's columns), from the stats pass
        e_cols = e8m0_exponent(tl.load(stat_ptr + cols, mask=cols < n_rows, other=0.0), SCALE == 1, QM, QE, EMAX)
        e_ref = tl.broadcast_to(e_cols[None, :], [G, BC])
        if row0 == 0:  # the row scale, written by the row's first tile
            tl.store(scale_ptr + cols, pow2(e_cols - SHIFT), mask=cols < n_rows)
    t_amax = 0.0
    if SCALE >= 2:
        if GROUPED:
            t_amax = tl.load(stat_ptr + g)[:, None]
        else:
            t_amax = tl.load(stat_ptr)
    encode, factor, lost, e, s_dec = _block_scales(amax, e_ref, t_amax, SCALE, QMAX, QM, QE, EMAX, FP8, SHIFT,
                                                   DMAX)
    if SCALE >= 2 and first_tile and not GROUPED:  # two-level: the tensor decode scale
        tl.store(scale_ptr, s_dec)
    if SR:  # element (c, r) takes byte r % 16 of Philox call c * KP / 16 + r // 16 (N, KP: multiples of 16)
        if GROUPED:  # each group its own operand: its seed, its rows from its first, its padded length
            seed = tl.load(seed_ptr + 2 * g)[:, None]
            kp = (tl.load(grp[2] + g) // 16)[:, None]
            rows16 = (first_rows - tl.load(grp[1] + g)) // 16
        else:
            seed = tl.load(seed_ptr)
            kp = KP // 16
            rows16 = row0 // 16 + tl.arange(0, G) * (N // 16)
        # + 1 where xs[0] is NaN (its block is NaN whatever the draws): keeps the counters in the values' layout --
        # from the aranges alone sm_90 code drew in a layout of its own and converted every draw
        base = cols[None, :].to(tl.int64) * kp + rows16[:, None] + (xs[0] != xs[0]).to(tl.int64)
    qs, vals = (), ()
    for j in tl.static_range(N // 16):
        if SR:
            us = rand16x(seed, base + j)
        for i in tl.static_range(16):
            q, v = _round_values(ys[16 * j + i], encode, factor, us[i] if SR else ys[16 * j + i], GRID, SR)
            qs, vals = qs + (q,), vals + (v,)
    rows = row0 + tl.arange(0, G * N)
    offs = cols[:, None].to(tl.int64) * n_cols + rows[None, :]
    if EVEN:
        inside = None
    else:
        inside = (cols[:, None] < n_rows) & (rows[None, :] < n_cols)
    val = _interleave(vals, N, G, BC)
    if FP8:
        _store_fp8(out_ptr, offs, val, inside, INTERPRETED)
        if tl.max(tl.max(lost.to(tl.int32), axis=1), axis=0) > 0:  # rare: record the lost blocks exactly
            lost_el = ()
            for i in tl.static_range(N):
                lost_el = lost_el + (lost.to(tl.int32),)
            lost_t = _interleave(lost_el, N, G, BC) > 0
            side = (_interleave(qs, N, G, BC) * (1 << SHIFT)).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            tl.store(side_ptr + offs, side, mask=lost_t if EVEN else inside & lost_t)
            blocks = (row0 // N + tl.arange(0, G))[:, None]
            tl.store(eb_ptr + cols[None, :].to(tl.int64) * (n_cols // N) + blocks, tl.where(lost, e, -128).to(tl.int8),
                     mask=(cols[None, :] < n_rows) & (blocks < n_cols // N))
            col_lost = tl.max(lost.to(tl.int32), axis=0)
            tl.store(flag_ptr + cols, col_lost.to(tl.int8), mask=(cols < n_rows) & (col_lost > 0))
            tl.store(flag_ptr + n_rows, tl.full([], 1, tl.int8))  # "some row is flagged" (the GEMM's early exit)
    else:
        tl.store(out_ptr + offs, val.to(tl.bfloat16), mask=inside)


@triton.jit
def _operand_kernel(t_ptr, R, C, s_r, s_c, mu_ptr,
                    a_out, a_rows, a_cols, a_stat, a_scale, a_seed, a_signs, a_side, a_eb, a_flags, a_kp,
                    b_out, b_rows, b_cols, b_stat, b_scale, b_seed, b_signs, b_side, b_eb, b_flags, b_kp,
                    grp_ids, grp_starts, grp_kp, n_groups,
                    BR: tl.constexpr, BC: tl.constexpr, HAS_MU: tl.constexpr, EVEN: tl.constexpr,
                    INTERPRETED: tl.constexpr, RELOAD: tl.constexpr, ACROSS: tl.constexpr, GROUPED: tl.constexpr,
                    A_ON: tl.constexpr, A_BLR: tl.constexpr, A_BLC: tl.constexpr, A_GRID: tl.constexpr,
                    A_QMAX: tl.constexpr, A_QM: tl.constexpr, A_QE: tl.constexpr, A_EMAX: tl.constexpr,
                    A_SCALE: tl.constexpr, A_SR: tl.constexpr, A_H: tl.constexpr, A_HSCALE: tl.constexpr,
                    A_SIGNS: tl.constexpr, A_FP8: tl.constexpr, A_SHIFT: tl.constexpr, A_DMAX: tl.constexpr,
                    B_ON: tl.constexpr, B_BLR: tl.constexpr, B_BLC: tl.constexpr, B_GRID: tl.constexpr,
                    B_QMAX: tl.constexpr, B_QM: tl.constexpr, B_QE: tl.constexpr, B_EMAX: tl.constexpr,
                    B_SCALE: tl.constexpr, B_SR: tl.constexpr, B_H: tl.constexpr, B_HSCALE: tl.constexpr,
                    B_SIGNS: tl.constexpr, B_FP8: tl.constexpr, B_SHIFT: tl.constexpr, B_DMAX: tl.constexpr):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    first = (pid_r == 0) & (pid_c == 0)
    grp = (grp_ids, grp_starts, grp_kp, R)  # GROUPED: t's rows in groups, each quantized as its own tensor
    if GROUPED:
        if first:
            if A_ON and A_SCALE >= 2:
                _store_group_scales(a_stat, a_scale, n_groups, A_QMAX)
            if B_ON and B_SCALE >= 2:
                _store_group_scales(b_stat, b_scale, n_groups, B_QMAX)
    if A_ON or not ACROSS:
        x = load_tile(t_ptr, rows, cols, R, C, s_r, s_c, mu_ptr, HAS_MU, EVEN)
    if A_ON:
        _emit(x, rows, cols, pid_c * BC, first, a_out, a_rows, a_cols, a_stat, a_scale, a_seed, a_signs,
              a_side, a_eb, a_flags, a_kp, grp, 1 if GROUPED else 0, BR, BC, A_BLR, A_BLC, A_GRID, A_QMAX, A_QM, A_QE, A_EMAX, A_SCALE, A_SR,
              A_H, A_HSCALE, A_SIGNS, A_FP8, A_SHIFT, A_DMAX, EVEN, INTERPRETED)
    if B_ON and ACROSS:  # B's 1 x B_BLC blocks across row tiles (a second read of the tile: L1 / L2)
        G: tl.constexpr = BR // B_BLC
        xs = ()
        for i in tl.static_range(B_BLC):
            xs = xs + (load_tile(t_ptr, pid_r * BR + tl.arange(0, G) * B_BLC + i, cols, R, C, s_r, s_c, mu_ptr,
                                 HAS_MU, EVEN),)
        _emit_across(xs, pid_r * BR, cols, first, b_out, b_rows, b_cols, b_stat, b_scale, b_seed, b_signs, b_side,
                     b_eb, b_flags, b_kp, grp, GROUPED, G, BC, B_BLC, B_GRID, B_QMAX, B_QM, B_QE, B_EMAX, B_SCALE, B_SR, B_H > 0,
                     B_HSCALE, B_SIGNS, B_FP8, B_SHIFT, B_DMAX, EVEN, INTERPRETED)
    elif B_ON:
        if RELOAD:  # the transposed tile from a second load (an L1/L2 hit) instead of a register transpose
            xt = load_tile(t_ptr, cols, rows, C, R, s_c, s_r, mu_ptr, False, EVEN)
            if HAS_MU:
                mu = tl.load(mu_ptr + cols, mask=cols < C, other=0.0)
                xt = tl.where((cols[:, None] < C) & (rows[None, :] < R), xt - mu[:, None], 0.0)
        else:
            xt = tl.trans(x)
        _emit(xt, cols, rows, pid_r * BR, first, b_out, b_rows, b_cols, b_stat, b_scale,
              b_seed, b_signs, b_side, b_eb, b_flags, b_kp, grp, 2 if GROUPED else 0, BC, BR, B_BLR, B_BLC, B_GRID, B_QMAX, B_QM, B_QE,
              B_EMAX, B_SCALE, B_SR, B_H, B_HSCALE, B_SIGNS, B_FP8, B_SHIFT, B_DMAX, EVEN, INTERPRETED)


#: Tiles (rows of t, columns of t, warps) by which orientations are made, grown to fit blocks and Hadamard
#: sizes.  Measured on the H200 (scripts/profile_fast_path.py --sweep, CUDA-graph replay, 8192^2 bf16;
#: benchmarks/results-2026-12-01.md): rows only 64x128x4; the transposed orientation (through a register
#: transpose) and both at once 32x64x2 -- wider tiles or more warps spread a block over warps.
#: A 4th entry True (RELOAD): the transposed orientation comes from a second, swapped-stride load of the tile
#: instead of a register transpose -- 14% faster for FP8 operand pairs (0.295 vs 0.343 ms), 4% slower for BF16.
#: B across row tiles (across(), _emit_across): two blocks of rows a program, so each row tile has two rows (2 x
#: 128 over 4 warps for H 16, 8 warps for H 32: 2 elements a thread and tile) -- chosen from the sm_90 code
#: (scripts/ptx_report.py), not yet timed.
#: Pairs of 2D blocks (the presets' weights) take RELOAD too: with Triton 3.9 the register transpose of their tile
#: compiles to a 3.5 KiB stack and 278 SASS instructions per element (32 registers), with RELOAD to none and 47;
#: with Triton 3.6 (the GPU image) 46 without RELOAD, 49 with (sm_90 code, scripts/ptx_report.py; session 32).
TILES = {"rows": (64, 128, 4), "cols": (32, 64, 2), "both": (32, 64, 2), "both_fp8": (32, 64, 2, True),
         "both_2d": (32, 64, 2, True), "across_16": (32, 128, 4), "across_32": (64, 128, 8)}
#: Largest operand tile one program makes (elements): a pair whose Hadamards need more (256 both ways: a
#: 256 x 256 tile) is made by two launches, one per orientation -- on the H200 one 256 x 256 program of 2
#: warps had not finished compiling after 5 minutes (session 10's GPU suite), and neither had it here.
MAX_TILE = 64 * 256
#: Elements a thread holds at most: wider tiles get more warps (a 256 x 64 tile of the transposed
#: orientation: 4 warps, not 2).
MAX_PER_THREAD = 128
#: The statistics pass reduces without transposing (unless a Hadamard rotates B), so it takes wide tiles;
#: a program walks up to 8 row tiles while at least STATS_PROGRAMS programs remain (_stats_steps).  8 warps:
#: the running-max tile costs 64 registers a thread (NVFP4 both ways; 95 with 4 warps), MX 79, UFP4 with
#: Hadamards both ways 128 (sm_90 cubins, tests/hopper_compile.py; not yet timed on the GPU).
STATS_TILE = (64, 128, 8)
STATS_PROGRAMS = 512


def _stats_steps(R: int, C: int, br: int, bc: int) -> int:
    """Row tiles per program of the stats pass: doubled up to 8 while the grid keeps STATS_PROGRAMS programs."""
    steps, col_tiles = 1, triton.cdiv(C, bc)
    while steps < 8 and triton.cdiv(R, br * steps * 2) * col_tiles >= STATS_PROGRAMS:
        steps *= 2
    return steps


@functools.lru_cache(maxsize=None)
def _launch_config(plans, tile):
    """(operand tile, stats tile, operand-kernel constexprs, stats-kernel constexprs) of a pair of plans
    (cached); a tile is (BR, BC, warps), grown to fit blocks and Hadamard sizes."""
    a, b = plans
    kind = "both" if a is not None and b is not None else "rows" if a is not None else "cols"
    if kind == "both" and b.form == "fp8":
        kind = "both_fp8"
    elif kind == "both" and b.spec.block[0] > 1:
        kind = "both_2d"
    if across(b):
        kind = f"across_{b.spec.block[1]}"
    tile = _fit(tile or TILES[kind], a, b)
    stats_tile = _fit(STATS_TILE, a, b)
    consts = {**_constexprs("A_", a), **_constexprs("B_", b), "ACROSS": across(b)}
    stat_flags = {"ACROSS": stats_across(a, b)}
    for prefix, plan in (("A_", a), ("B_", b)):
        stat_flags.update({f"{prefix}STAT": plan.stat if plan is not None else 0,
                           f"{prefix}H": plan.hadamard if plan is not None else 0,
                           f"{prefix}HSCALE": consts[f"{prefix}HSCALE"],
                           f"{prefix}SIGNS": plan.signed if plan is not None else False})
    return tile, stats_tile, consts, stat_flags


def across(b: OperandPlan | None) -> bool:
    """Whether the operand kernel makes B (blocks along t's rows) across row tiles (_emit_across): 1 x 16 or 1 x 32
    blocks, with no Hadamard or one that is the block (the presets' wgrad operands, and the MX family's dgrad
    weight), so a block is one element of each row tile.  sm_90 code (Triton 3.6, scripts/ptx_report.py): NVFP4's
    x pair (RHT-16 wgrad) 5 layout conversions and 11 barriers -> 1 and 1, its dy pair (SR) 5 / 11 -> 1 / 1, ufp4's
    x 7 / 27 -> 3 / 17, mxfp4_dh's (H-32) 21 / 41 -> 11 / 25 and no stack; without a Hadamard, mxfp4's FP8 x / dy
    / W pairs 19 / 43 and 124 registers -> 11 / 25 and 76 (the byte-wise shared-memory transpose of its FP8 values
    gone), NVFP4's lone wgrad operand 1 / 4 -> 1 / 1 (the last two untimed)."""
    return b is not None and b.spec.block[0] == 1 and b.spec.block[1] in (16, 32) and b.hadamard in (0, b.spec.block[1])


def stats_across(a: OperandPlan | None, b: OperandPlan | None) -> bool:
    """Whether the stats pass computes B's rotated amax across row tiles (_stats_across): B has a statistic and a
    Hadamard of up to ACROSS_MAX, and A needs at most its tensor amax, rotated or not (A's per-row amax -- the MX
    FP8 fold -- would need a reduction per row tile of the B_H: 99 conversions against 10)."""
    return (b is not None and b.stat > 0 and 0 < b.hadamard <= ACROSS_MAX
            and (a is None or a.stat != 1 or a.hadamard == 0))


def _fit(tile, a: OperandPlan | None, b: OperandPlan | None) -> tuple:
    br, bc, warps = tile[:3]
    if a is not None:
        br, bc = max(br, a.spec.block[0]), max(bc, a.spec.block[1], a.hadamard)
    if b is not None:
        br, bc = max(br, b.spec.block[1], b.hadamard), max(bc, b.spec.block[0])
    warps = max(warps, min(8, br * bc // (32 * MAX_PER_THREAD)))
    return (br, bc, warps, *tile[3:])


def _constexprs(prefix: str, plan: OperandPlan | None) -> dict:
    if plan is None:
        names = ("BLR", "BLC", "GRID", "QMAX", "QM", "QE", "EMAX", "SCALE", "SR", "H", "HSCALE", "SIGNS", "FP8",
                 "SHIFT", "DMAX")
        return {f"{prefix}ON": False, **{f"{prefix}{n}": 1 for n in names}}
    g = grid_constants(plan.spec.grid)
    fp8 = plan.form == "fp8"
    return {f"{prefix}{k}": v for k, v in dict(
        ON=True, BLR=plan.spec.block[0], BLC=plan.spec.block[1], GRID=g["GRID"], QMAX=g["QMAX"], QM=g["QM"],
        QE=g["QE"], EMAX=g["EMAX"], SCALE=SCALE_CODES[plan.spec.scale],
        SR=plan.spec.rounding is Rounding.STOCHASTIC, H=plan.hadamard,
        HSCALE=1.0 / math.sqrt(plan.hadamard) if plan.hadamard else 1.0, SIGNS=plan.signed, FP8=fp8,
        SHIFT=fp8_shift(plan.spec.grid) if fp8 else 0, DMAX=fp8_dmax(plan.spec.grid) if fp8 else 0).items()}


def _rows_collapse(t: torch.Tensor) -> bool:
    """Whether t's leading dims flatten into one row index with the stride of dim -2."""
    return all(t.shape[i] == 1 or t.stride(i) == t.shape[i + 1] * t.stride(i + 1) for i in range(t.dim() - 2))


def triton_operands(t: torch.Tensor, plans: tuple[OperandPlan | None, OperandPlan | None], seeds: torch.Tensor,
                    signs: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                    mu: torch.Tensor | None = None, tile: tuple[int, int, int] | None = None,
                    groups: RowGroups | None = None) -> list[Operand | None]:
    """Operands of the tensor t read as a matrix [rows, C] (its leading dims flattened; any strides):
    plans[0] for the rows, plans[1] for the rows of the transpose.

    seeds: int64 [2] on t's device (Philox seeds of the two orientations, used under SR); signs: the
    Hadamard sign vectors (FP32 on t's device, or None); mu: per-column mean subtracted first.
    An N-D t is read through its strides, not reshaped: under torch.compile a reshaped view of a fused
    result can reach the kernel as a copy.
    groups: t's rows in groups, each quantized as a tensor of its own (RowGroups; BF16 forms only): seeds is then
    [E, 2] (each group's), and a two-level operand's scale holds each group's decode scale ([E]).
    """
    if t.dim() < 2:
        raise ValueError(f"triton_operands needs a tensor of 2 or more dims, got shape {tuple(t.shape)}")
    for plan, s in zip(plans, signs):
        if plan is not None and plan.signed != (s is not None):
            raise ValueError("OperandPlan.signed must match whether a sign vector is given")
    if not _rows_collapse(t):
        t = t.reshape(-1, t.shape[-1])
    R, C = t.numel() // t.shape[-1], t.shape[-1]
    if groups is not None:
        _check_groups(plans, seeds, mu, groups, R)
    s_r, s_c = t.stride(-2), t.stride(-1)
    dev = t.device
    (br, bc, warps, *reload), (sbr, sbc, swarps), consts, stat_flags = _launch_config(tuple(plans), tile)
    if None not in plans and br * bc > MAX_TILE:  # one orientation per launch (t read twice)
        return [triton_operands(t, (plans[0], None), seeds, (signs[0], None), mu, tile, groups)[0],
                triton_operands(t, (None, plans[1]), seeds, (None, signs[1]), mu, tile, groups)[1]]
    dims = ((R, C), (C, R))
    ops = [empty_operand(p, *d, dev, groups=groups.count if groups is not None else 0, contraction_grouped=i == 1)
           if p is not None else None for i, (p, d) in enumerate(zip(plans, dims))]
    # Pointers a launch does not use get a 1-element tensor, never t: under torch.compile a tensor passed in
    # several argument slots of a user Triton kernel may be copied once per slot.
    unused = torch.empty(1, dtype=torch.float32, device=dev)
    stats = []
    for i, (plan, (rows, k)) in enumerate(zip(plans, dims)):  # per-row statistics cover the allocated rows
        n = 0 if plan is None or plan.stat == 0 else (
            plan.shape(rows, k)[0] if plan.stat == 1 else groups.count if groups is not None else 1)
        if groups is not None and plan is not None and plan.stat == 1 and i == 1:
            n *= groups.count  # B's per-row statistics per group: [E, rows]
        stats.append(torch.zeros(n, dtype=torch.float32, device=dev) if n else unused)
    mu_t = mu.to(torch.float32) if mu is not None else unused
    signs_t = [s.to(device=dev, dtype=torch.float32) if s is not None else unused for s in signs]
    if groups is not None and any(p is not None and p.stat for p in plans):
        flags = {k: v for k, v in stat_flags.items() if k != "ACROSS"}
        launcher(_group_stats_kernel)[(triton.cdiv(R, sbr), triton.cdiv(C, sbc))](
            t, R, C, s_r, s_c, groups.ids, stats[0], signs_t[0], stats[1], signs_t[1],
            ops[1].data.shape[0] if ops[1] is not None else 0, BR=sbr, BC=sbc,
            EVEN=R % sbr == 0 and C % sbc == 0, CH=GROUP_ROWS, num_warps=swarps,
            ACROSS=group_stats_across(*plans), **flags)
    elif any(p is not None and p.stat for p in plans):
        steps = _stats_steps(R, C, sbr, sbc)
        launcher(_stats_kernel)[(triton.cdiv(R, sbr * steps), triton.cdiv(C, sbc))](
            t, R, C, s_r, s_c, mu_t, stats[0], signs_t[0], stats[1], signs_t[1],
            BR=sbr, BC=sbc, STEPS=steps, HAS_MU=mu is not None, EVEN=R % (sbr * steps) == 0 and C % sbc == 0,
            num_warps=swarps, **stat_flags)
    args, cover = [], [0, 0]
    seeds = seeds.reshape(-1)  # grouped: [E, 2] -> group g's seed of orientation i at 2 g + i
    for i, (plan, op, stat, s, (rows, k)) in enumerate(zip(plans, ops, stats, signs_t, dims)):
        if plan is None:
            args += [unused, 0, 0, unused, unused, seeds, unused, unused, unused, unused, 0]
            continue
        r_alloc, k_alloc = op.data.shape
        cover[i], cover[1 - i] = max(cover[i], r_alloc), max(cover[1 - i], k_alloc)
        fp8 = plan.form == "fp8"
        data = op.data.view(torch.uint8) if fp8 else op.data  # FP8 written as bits (NaN = 0x7F)
        side, eb, flags = (op.side.view(torch.uint8), op.eb, op.flags) if fp8 else (unused, unused, unused)
        args += [data, r_alloc, k_alloc, stat, op.scale, seeds[i:], s, side, eb, flags, plan.k_padded(k)]
    # every tile inside t and inside both allocations (not padded past t): no masks
    even = R % br == 0 and C % bc == 0 and tuple(cover) == (R, C)
    args += [*groups, groups.count] if groups is not None else [unused, unused, unused, 0]
    launcher(_operand_kernel)[(triton.cdiv(cover[0], br), triton.cdiv(cover[1], bc))](
        t, R, C, s_r, s_c, mu_t, *args, BR=br, BC=bc, HAS_MU=mu is not None, EVEN=even,
        INTERPRETED=dev.type == "cpu", RELOAD=bool(reload and reload[0]), GROUPED=groups is not None,
        num_warps=warps, **consts)
    return ops


def _check_groups(plans, seeds: torch.Tensor, mu, groups: RowGroups, rows: int) -> None:
    """What a grouped operand call needs (the layouts of hf_fp4.nn.grouping and grouped.py give it)."""
    if mu is not None:
        raise ValueError("grouped operands take no mean-bias removal")
    e = groups.count
    if seeds.shape != (e, 2) or seeds.dtype != torch.int64:
        raise ValueError(f"grouped operands take int64 seeds [{e}, 2] (one pair per group), got {seeds.dtype} "
                         f"{tuple(seeds.shape)}")
    for name, v, n in (("ids", groups.ids, rows), ("starts", groups.starts, e), ("kp", groups.kp, e)):
        if v.dtype != torch.int32 or v.shape != (n,):
            raise ValueError(f"RowGroups.{name} must be int32 [{n}], got {v.dtype} {tuple(v.shape)}")
    if rows % GROUP_ROWS:
        raise ValueError(f"grouped operands need rows in multiples of {GROUP_ROWS}, got {rows}")
