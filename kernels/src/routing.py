"""The MoE routing passes of the grouped expert GEMMs (hf_fp4.nn.grouping): gather the routed tokens into expert
segments, and sum each token's slots back -- one read and one write each, deterministic (no atomics).

In torch these were index gathers into [R, H] followed by elementwise passes over it (a select for the padding,
a cast to FP32, the routing weights' product, a select, a reduction): on the H100 they took ~10 ms of a 32 ms
NVFP4 MoE layer step (`profile_fast_path.py --moe`, 2026-12-06), more than its grouped GEMMs.

    gather_rows(x [T, H], rows [R], k, w=None) -> [R, H]:
        out[r] = x[rows[r] // k] * w[rows[r]]  (FP32 product, rounded once to out's dtype; without w: x's row),
        0 where rows[r] < 0 (padding)
    token_sum(y [R, H], pos [T*k], k, w=None) -> [T, H] FP32:
        out[t] = sum over s = 0..k-1, in that order, of FP32(y[pos[t*k+s]]) * w[t*k+s]  (each product and each
        sum rounded: no FMA), a slot whose pos >= R (routed nowhere) adding 0 whatever w holds
    pair_dot(g [T, H] FP32, y [R, H], pos [T*k], k) -> [T*k] FP32:
        g[t] . y[pos[t*k+s]]  (FP32 accumulation, any order: compared with the float64 product within FP32
        accumulation error, as the GEMMs are), 0 for a slot routed nowhere
    zero_tail_(out [R, N], ends [E]):  out[ends[E-1]:] = 0 in place (the rows torch._grouped_mm leaves unwritten),
        without reading ends on the host; writes nothing else

The torch forms of the same definitions are hf_fp4.nn.grouping's reference (the CPU path, and the spec the
tests hold these kernels to bit for bit; pair_dot within FP32 accumulation error).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launcher
from .numerics import round_to_bf16

#: columns per program (a program handles one row, or one token, in chunks of BH columns)
BH = 1024


@triton.jit
def _gather_rows_kernel(x, rows, w, out, H, K: tl.constexpr, HAS_W: tl.constexpr, BH: tl.constexpr,
                        INTERPRETED: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    col_ok = cols < H
    pair = tl.load(rows + r)
    valid = tl.zeros([BH], dtype=tl.int64) + pair >= 0  # as a vector: the interpreter refuses a scalar in a mask
    token = tl.maximum(pair, 0) // K
    v = tl.load(x + token.to(tl.int64) * H + cols, mask=col_ok & valid, other=0.0)
    if HAS_W:
        v = v.to(tl.float32) * tl.load(w + tl.maximum(pair, 0)).to(tl.float32)
        v = tl.where(valid, v, 0.0)
        if INTERPRETED and out.dtype.element_ty == tl.bfloat16:  # the store rounds to nearest on the GPU only
            v = round_to_bf16(v)
    tl.store(out + r.to(tl.int64) * H + cols, v, mask=col_ok)


@triton.jit
def _token_sum_kernel(y, pos, w, out, R, H, K: tl.constexpr, HAS_W: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    col_ok = cols < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for s in tl.static_range(K):
        row = tl.load(pos + t * K + s)
        routed = tl.zeros([BH], dtype=tl.int64) + row < R
        v = tl.load(y + tl.minimum(row, R - 1).to(tl.int64) * H + cols, mask=col_ok & routed, other=0.0)
        v = v.to(tl.float32)
        if HAS_W:
            v = v * tl.load(w + t * K + s).to(tl.float32)
        acc = acc + tl.where(routed, v, 0.0)
    tl.store(out + t.to(tl.int64) * H + cols, acc, mask=col_ok)


@triton.jit
def _pair_dot_kernel(g, y, pos, out, R, H, K: tl.constexpr, BH: tl.constexpr):
    pair = tl.program_id(0)
    token = pair // K
    row = tl.load(pos + pair)
    cols = tl.arange(0, BH)
    routed = tl.zeros([BH], dtype=tl.int64) + row < R
    acc = tl.zeros([BH], dtype=tl.float32)
    for c0 in range(0, H, BH):
        ok = (c0 + cols < H) & routed
        gv = tl.load(g + token.to(tl.int64) * H + c0 + cols, mask=ok, other=0.0)
        yv = tl.load(y + tl.minimum(row, R - 1).to(tl.int64) * H + c0 + cols, mask=ok, other=0.0).to(tl.float32)
        acc += gv * yv
    tl.store(out + pair, tl.where(row < R, tl.sum(acc, axis=0), 0.0))


@triton.jit
def _zero_tail_kernel(out, ld, ends, E, R, N, BR: tl.constexpr, BH: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    end = tl.load(ends + E - 1)
    if tl.program_id(0) * BR + BR > end:  # the row tiles before the last segment's end return at once
        zero = tl.zeros([BR, BH], dtype=out.dtype.element_ty)
        for c0 in range(0, N, BH):
            cols = c0 + tl.arange(0, BH)
            mask = (rows[:, None] >= end) & (rows[:, None] < R) & (cols[None, :] < N)
            tl.store(out + rows[:, None].to(tl.int64) * ld + cols[None, :], zero, mask=mask)


def _check(name: str, t: torch.Tensor, dim: int):
    if t.dim() != dim or not t.is_contiguous():
        raise ValueError(f"{name}: needs a contiguous {dim}-D tensor, got shape {tuple(t.shape)}")


def gather_rows(x: torch.Tensor, rows: torch.Tensor, k: int, w: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[R, H]: row r holds x[rows[r] // k] (times w[rows[r]] when given, in FP32, rounded to out_dtype), zero for
    a padding row (rows[r] < 0)."""
    _check("gather_rows x", x, 2)
    out = x.new_empty(rows.shape[0], x.shape[1], dtype=out_dtype or x.dtype)
    if out_dtype is not None and out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"gather_rows: out_dtype {out_dtype} is not float32 or bfloat16")
    if out.numel():
        grid = (rows.shape[0], triton.cdiv(x.shape[1], BH))
        launcher(_gather_rows_kernel)[grid](x, rows, w if w is not None else x, out, x.shape[1], K=k,
                                            HAS_W=w is not None, BH=BH, INTERPRETED=not x.is_cuda)
    return out


def token_sum(y: torch.Tensor, pos: torch.Tensor, k: int, w: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] FP32 (T = pos.numel() // k): each token's rows summed over its slots in order (times w's weights
    when given); a slot routed nowhere (pos >= R) adds 0."""
    _check("token_sum y", y, 2)
    tokens = pos.shape[0] // k
    out = torch.empty(tokens, y.shape[1], dtype=torch.float32, device=y.device)
    if out.numel():
        grid = (tokens, triton.cdiv(y.shape[1], BH))
        launcher(_token_sum_kernel)[grid](y, pos, w if w is not None else y, out, y.shape[0], y.shape[1], K=k,
                                          HAS_W=w is not None, BH=BH, enable_fp_fusion=False)
    return out


def pair_dot(g: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """[T*k] FP32: g[t] . y[pos[t*k+s]] for each pair, 0 for a pair routed nowhere."""
    _check("pair_dot g", g, 2)
    _check("pair_dot y", y, 2)
    out = torch.empty(pos.shape[0], dtype=torch.float32, device=y.device)
    if out.numel():
        launcher(_pair_dot_kernel)[(pos.shape[0],)](g, y, pos, out, y.shape[0], y.shape[1], K=k, BH=BH)
    return out


def zero_tail_(out: torch.Tensor, ends: torch.Tensor) -> None:
    """out[ends[-1]:] = 0 in place (rows past the last segment); out's columns contiguous."""
    if out.dim() != 2 or out.stride(1) != 1:
        raise ValueError(f"zero_tail_: needs a 2-D tensor with contiguous rows, got shape {tuple(out.shape)}")
    if out.numel():
        br = 32
        launcher(_zero_tail_kernel)[(triton.cdiv(out.shape[0], br),)](out, out.stride(0), ends, ends.shape[0],
                                                                        out.shape[0], out.shape[1], BR=br, BH=128)
