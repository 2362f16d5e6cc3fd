"""FP4AdamW's step for all of a step's quantized parameters in two launches (hf_fp4.optim.FP4AdamW, backend "triton").

The PyTorch path decodes both moments, updates them and re-quantizes them in ~35 launches per parameter (host-bound
for a model of many small matrices), and two launches per parameter still were (bench-50m: ~25 ms a step over
AdamW's); here each program takes one tile of one parameter's padded [Mp, Kp] state, found through tables (tile ->
parameter and tile coordinates; parameter -> its tensors' addresses and sizes), and per tile:

  pass 0: decode m and v (grid value x block decode, then x tensor decode; v's zero codes floored to half the
          block's smallest step), the AdamW update of m, v and the parameter (written), and the tensor amax of
          the new m and of the stored form of the new v (sqrt(v) or v) by atomic max;
  pass 1: the same m, v again from the unchanged state, quantized against those amaxes into codes and block
          scales in place (each program reads and writes only its own tile), the new tensor decode scales
          written by the parameter's tile (0, 0) into fresh tensors.

Every operation rounds as `FP4AdamW._update` (the reference, PyTorch ops one IEEE rounding each): products and
sums apart (the launch disables FP contraction), sqrt and division correctly rounded, the bias corrections and
decay passed as the FP32 scalars PyTorch makes of them.  Quantization is `quant.encode_tile`, the codes of
`triton_quantize` (bit-exact with the reference).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hf_fp4.numerics.formats import ELEMENT_BITS, grid_step
from hf_fp4.numerics.scales import ScaleRule
from hf_fp4.numerics.spec import QuantSpec

from .launch import launcher
from .numerics import bf16_bits, expand_blocks, flush_subnormals, grid_constants, tensor_encode_scale
from .quant import SCALE_CODES, encode_tile

#: Tile (rows, columns, warps) of the padded state.
TILE = (16, 128, 4)


def supports(spec: QuantSpec) -> bool:
    """Whether the kernels take a state spec: 4-bit grids with E8M0 or UE4M3 + FP32 block scales, rounding to
    nearest (FP4AdamW's own check)."""
    return ELEMENT_BITS[spec.grid] == 4 and spec.scale is not ScaleRule.FP32


@triton.jit
def _state_tile(pid_m, pid_k, MP, KP, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Where the tile's part of a stored moment lies: (offsets [BM, BK // 2] and mask of its packed code bytes,
    offsets [BM // BR, BK // BC] and mask of its block-scale bytes) in the padded [MP, KP // 2] and
    [MP // BR, KP // BC] arrays."""
    HK: tl.constexpr = BK // 2
    NBM: tl.constexpr = BM // BR
    NBK: tl.constexpr = BK // BC
    rows = pid_m * BM + tl.arange(0, BM)
    pcols = pid_k * HK + tl.arange(0, HK)
    srows = pid_m * NBM + tl.arange(0, NBM)
    scols = pid_k * NBK + tl.arange(0, NBK)
    return (rows[:, None].to(tl.int64) * (KP // 2) + pcols[None, :],
            (rows[:, None] < MP) & (pcols[None, :] < KP // 2),
            srows[:, None].to(tl.int64) * (KP // BC) + scols[None, :],
            (srows[:, None] < MP // BR) & (scols[None, :] < KP // BC))


@triton.jit
def _moment(codes_ptr, scales_ptr, ts_ptr, values_ptr, factors_ptr, pid_m, pid_k, MP, KP,
            BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, FLOOR: tl.constexpr,
            STEP: tl.constexpr):
    """A [BM, BK] tile of a stored moment in FP32, as FP4AdamW._load: (grid value x block decode) x tensor decode
    (the reference's lookup tables at values_ptr [16], factors_ptr [256]); FLOOR: a zero becomes
    ((block decode x tensor decode) x STEP) / 2."""
    code_at, code_in, scale_at, scale_in = _state_tile(pid_m, pid_k, MP, KP, BM, BK, BR, BC)
    byte = tl.load(codes_ptr + code_at, mask=code_in, other=0).to(tl.int32)
    nibbles = tl.reshape(tl.join(byte & 15, byte >> 4), [BM, BK])  # low nibble = even element
    sbyte = tl.load(scales_ptr + scale_at, mask=scale_in, other=0).to(tl.int32)
    factor = expand_blocks(tl.load(factors_ptr + sbyte), BM, BK, BR, BC)
    ts = tl.load(ts_ptr)
    values = (tl.load(values_ptr + nibbles) * factor) * ts
    if FLOOR:
        values = tl.where(values == 0, ((factor * ts) * STEP) * 0.5, values)
    return values


#: Per parameter of a launch: its addresses (the int64 pointer table's columns) and sizes (the size table's).
POINTERS = ("p", "g", "m_codes", "m_scales", "m_ts", "v_codes", "v_scales", "v_ts", "m_ts_out", "v_ts_out")
SIZES = ("M", "K", "MP", "KP", "stride_p", "stride_g")
_NP, _NS = tl.constexpr(len(POINTERS)), tl.constexpr(len(SIZES))


@triton.jit
def _address(table, i, column: tl.constexpr, dtype: tl.constexpr):
    """Parameter i's pointer in `column` of the launch's pointer table (POINTERS), as a pointer to dtype."""
    return tl.load(table + i * _NP + column).to(tl.pointer_type(dtype))


@triton.jit
def _fp4_adamw_kernel(tiles_ptr, ptrs_ptr, sizes_ptr, values_ptr, factors_ptr, stat_ptr,
                      b1, one_minus_b1, b2, one_minus_b2, c1, c2, eps, decay, lr,
                      BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, GRID: tl.constexpr,
                      EMIN: tl.constexpr, MBITS: tl.constexpr, QMAX: tl.constexpr, QM: tl.constexpr,
                      QE: tl.constexpr, EMAX: tl.constexpr, SCALE: tl.constexpr, STEP: tl.constexpr,
                      SQRT_V: tl.constexpr, P_BF16: tl.constexpr, PASS: tl.constexpr):
    # program -> (parameter i, its tile pid_m, pid_k); the parameter's addresses and sizes from the tables
    i = tl.load(tiles_ptr + 3 * tl.program_id(0))
    pid_m = tl.load(tiles_ptr + 3 * tl.program_id(0) + 1)
    pid_k = tl.load(tiles_ptr + 3 * tl.program_id(0) + 2)
    M, K = tl.load(sizes_ptr + _NS * i), tl.load(sizes_ptr + _NS * i + 1)
    MP, KP = tl.load(sizes_ptr + _NS * i + 2), tl.load(sizes_ptr + _NS * i + 3)
    stride_p, stride_g = tl.load(sizes_ptr + _NS * i + 4), tl.load(sizes_ptr + _NS * i + 5)
    if P_BF16:
        p_ptr, g_ptr = _address(ptrs_ptr, i, 0, tl.bfloat16), _address(ptrs_ptr, i, 1, tl.bfloat16)
    else:
        p_ptr, g_ptr = _address(ptrs_ptr, i, 0, tl.float32), _address(ptrs_ptr, i, 1, tl.float32)
    m_codes, m_scales = _address(ptrs_ptr, i, 2, tl.uint8), _address(ptrs_ptr, i, 3, tl.uint8)
    v_codes, v_scales = _address(ptrs_ptr, i, 5, tl.uint8), _address(ptrs_ptr, i, 6, tl.uint8)
    m_ts, v_ts = _address(ptrs_ptr, i, 4, tl.float32), _address(ptrs_ptr, i, 7, tl.float32)
    stat = stat_ptr + 2 * i
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    inside = (rows[:, None] < M) & (cols[None, :] < K)
    g = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_g + cols[None, :], mask=inside, other=0.0)
    g = g.to(tl.float32)
    m = _moment(m_codes, m_scales, m_ts, values_ptr, factors_ptr, pid_m, pid_k, MP, KP, BM, BK, BR, BC, False, STEP)
    v = _moment(v_codes, v_scales, v_ts, values_ptr, factors_ptr, pid_m, pid_k, MP, KP, BM, BK, BR, BC, True, STEP)
    if SQRT_V:
        v = v * v
    # FP4AdamW._update, one rounding per operation
    m = m * b1 + g * one_minus_b1
    v = v * b2 + (g * g) * one_minus_b2
    m = tl.where(inside, m, 0.0)  # the state's padding quantizes zeros, as the reference's padded copy
    v = tl.where(inside, v, 0.0)
    stored_v = tl.sqrt_rn(v) if SQRT_V else v
    if PASS == 0:
        denom = tl.sqrt_rn(v * c2) + eps
        update = tl.math.div_rn(m * c1, denom)
        pp = p_ptr + rows[:, None].to(tl.int64) * stride_p + cols[None, :]
        p = tl.load(pp, mask=inside, other=0.0).to(tl.float32)
        p = p * decay - update * lr
        if P_BF16:  # rounded to nearest even by hand (the interpreter's cast truncates), as the GEMMs' stores
            tl.store(pp, bf16_bits(p).to(tl.bfloat16, bitcast=True), mask=inside)
        else:
            tl.store(pp, p, mask=inside)
        tl.atomic_max(stat, tl.max(tl.max(tl.abs(flush_subnormals(m)), axis=1), axis=0))
        tl.atomic_max(stat + 1, tl.max(tl.max(flush_subnormals(stored_v), axis=1), axis=0))
    else:
        m_ts_out, v_ts_out = _address(ptrs_ptr, i, 8, tl.float32), _address(ptrs_ptr, i, 9, tl.float32)
        _store_moment(flush_subnormals(m), m_codes, m_scales, stat, m_ts_out, pid_m, pid_k, MP, KP, BM, BK,
                      BR, BC, GRID, EMIN, MBITS, QMAX, QM, QE, EMAX, SCALE)
        _store_moment(flush_subnormals(stored_v), v_codes, v_scales, stat + 1, v_ts_out, pid_m, pid_k, MP, KP,
                      BM, BK, BR, BC, GRID, EMIN, MBITS, QMAX, QM, QE, EMAX, SCALE)


@triton.jit
def _store_moment(x, codes_ptr, scales_ptr, stat_ptr, ts_out, pid_m, pid_k, MP, KP, BM: tl.constexpr,
                  BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, GRID: tl.constexpr, EMIN: tl.constexpr,
                  MBITS: tl.constexpr, QMAX: tl.constexpr, QM: tl.constexpr, QE: tl.constexpr, EMAX: tl.constexpr,
                  SCALE: tl.constexpr):
    """x's codes and block scales over the tile (the reference's, against the tensor amax at stat_ptr), and for
    SCALE 2 the tensor decode scale 1 / s_enc at ts_out (program (0, 0))."""
    rows = pid_m * BM + tl.arange(0, BM)
    code, stored, _ = encode_tile(x, x != x, stat_ptr, 0, rows, pid_k * BK, KP, BM, BK, BR, BC, GRID, EMIN, MBITS,
                                  QMAX, QM, QE, EMAX, 4, SCALE, False)
    lo, hi = tl.split(tl.reshape(code, [BM, BK // 2, 2]))
    code_at, code_in, scale_at, scale_in = _state_tile(pid_m, pid_k, MP, KP, BM, BK, BR, BC)
    tl.store(codes_ptr + code_at, (lo | (hi << 4)).to(tl.uint8), mask=code_in)
    tl.store(scales_ptr + scale_at, stored.to(tl.uint8), mask=scale_in)
    if SCALE == 2:
        if (pid_m == 0) & (pid_k == 0):
            tl.store(ts_out, tl.math.div_rn(1.0, tensor_encode_scale(tl.load(stat_ptr), QMAX)))


def triton_fp4_adamw_steps(batch: list[tuple], spec: QuantSpec, tables: tuple, scalars: dict,
                           sqrt_v: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One FP4AdamW step of every parameter in `batch` -- (p, g, m, v) each: p a 2D view [M, K] (rows of unit column
    stride, all of one dtype), g its gradient, m and v its stored moments ({"codes", "scales", "tensor_scale"}) --
    in two launches for the whole batch: each p updated in place, the codes and scales of its m and v rewritten in
    place.  Returns each parameter's new tensor decode scales of m and v (fresh 0-d tensors, views of one buffer;
    the old ones unchanged).  tables: the reference's decodes on the device, a 4-bit code's grid value [16] and a
    scale byte's block decode factor [256]; scalars: FP4AdamW's _scalars (one step count and group for all)."""
    p0 = batch[0][0]
    dev, (br, bc) = p0.device, spec.block
    bm, bk, warps = TILE
    bm, bk = max(bm, br), max(bk, bc)
    n = len(batch)
    two_level = spec.scale is ScaleRule.UE4M3_FP32
    new_ts = torch.empty(n, 2, dtype=torch.float32, device=dev) if two_level else None
    views = new_ts.view(-1).unbind() if two_level else None  # 2n 0-d views in one call
    out = [(views[2 * i], views[2 * i + 1]) if two_level else (m["tensor_scale"], v["tensor_scale"])
           for i, (_, _, m, v) in enumerate(batch)]
    pointers, sizes, padded = [], [], []
    for (p, g, m, v), (m_ts, v_ts) in zip(batch, out):  # in POINTERS' and SIZES' orders
        pointers += [t.data_ptr() for t in (p, g, m["codes"], m["scales"], m["tensor_scale"], v["codes"],
                                            v["scales"], v["tensor_scale"], m_ts, v_ts)]
        padded.append((m["codes"].shape[0], m["codes"].shape[1] * 2))
        sizes += [*p.shape, *padded[-1], p.stride(0), g.stride(0)]
    # small copies from pageable host memory: the driver stages them before the call returns (the host lists may go)
    ptrs = torch.tensor(pointers, dtype=torch.int64).to(dev, non_blocking=True)
    sizes_t = torch.tensor(sizes, dtype=torch.int64).to(dev, non_blocking=True)
    tiles = _tile_table(tuple(padded), bm, bk, dev)
    stat = torch.zeros(n, 2, dtype=torch.float32, device=dev)
    consts = grid_constants(spec.grid)
    for pass_ in (0, 1):
        launcher(_fp4_adamw_kernel)[(tiles.shape[0],)](
            tiles, ptrs, sizes_t, *tables, stat, **scalars, BM=bm, BK=bk, BR=br, BC=bc,
            SCALE=SCALE_CODES[spec.scale], STEP=grid_step(spec.grid), SQRT_V=sqrt_v,
            P_BF16=p0.dtype == torch.bfloat16, PASS=pass_, num_warps=warps,
            enable_fp_fusion=False, **consts)
    return out


@functools.lru_cache(maxsize=None)
def _tile_table(padded: tuple[tuple[int, int], ...], bm: int, bk: int, device: torch.device) -> torch.Tensor:
    """[tiles, 3] int32 (parameter, tile row, tile column) of every tile of the padded states [MP, KP], parameter
    by parameter -- built once per list of shapes and device (a model steps the same parameters every step)."""
    rows = [(i, tm, tk) for i, (mp, kp) in enumerate(padded)
            for tm in range(triton.cdiv(mp, bm)) for tk in range(triton.cdiv(kp, bk))]
    return torch.tensor(rows, dtype=torch.int32).to(device)
