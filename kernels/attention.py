"""FP4 attention's forward as a Triton flash-attention kernel (issue 12; the backward is still the reference).

`flash_forward(qh, kh, vh, keep, scale, decodes)` takes the quantized Q^, K^, V^ of `hf_fp4.attention`
([B, H, T, D], GQA expanded) -- as FP32 values, or as exact BF16 values (code x block scale,
`attention.tensor_core_operand`) with their tensor decode scales, which run on the tensor cores -- and computes O = softmax(Q^ K^T * scale, masked) V^ tile by tile with an online
softmax, never holding S or P: S in FP32 from the exact operand values, P = exp(S - m) rounded to BF16 before
the P V product ("P V in BF16"), the running max m and sum l in FP32, O = acc / l.

It is not bit-identical with the reference, which rounds the *normalised* softmax to BF16 in one piece: here
the rounded P is unnormalised and rescaled as the running max moves, and the exponentials are Triton's.  Both
round every P element once to BF16 (<= 2^-8 relative each), so they agree within the two roundings plus FP32
accumulation: |O - O_ref| <= 2^-7 P|V^| + K 2^-24 P|V^| elementwise (tests/test_attention.py checks this bound).
A row with no key to attend gives O = 0, as the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .numerics import round_to_bf16


@triton.jit
def _dot(a, b, TC: tl.constexpr, INTERPRETED: tl.constexpr):
    """a @ b in FP32: BF16 operands on the tensor cores (exact products), FP32 operands as IEEE FMAs."""
    if TC and not INTERPRETED:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")  # the interpreter: BF16 as FP32


@triton.jit
def _flash_forward_kernel(q_ptr, k_ptr, v_ptr, dec_ptr, keep_ptr, o_ptr, H, TQ, TK, scale,
                          sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                          sm_b, sm_h, sm_q, sm_k, so_b, so_h, so_t,
                          BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, HAS_KEEP: tl.constexpr,
                          TC: tl.constexpr, INTERPRETED: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    rows = pid_m * BM + tl.arange(0, BM)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_t + d[None, :], mask=rows[:, None] < TQ, other=0.0)
    s_scale = tl.load(dec_ptr) * tl.load(dec_ptr + 1) * scale  # Q^ = q dec_q, K^ = k dec_k, V^ = v dec_v
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in range(0, TK, BN):
        cols = start + tl.arange(0, BN)
        k = tl.load(k_ptr + b * sk_b + h * sk_h + cols[:, None] * sk_t + d[None, :], mask=cols[:, None] < TK,
                    other=0.0)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + cols[:, None] * sv_t + d[None, :], mask=cols[:, None] < TK,
                    other=0.0)
        s = _dot(q, tl.trans(k), TC, INTERPRETED) * s_scale
        valid = (rows[:, None] < TQ) & (cols[None, :] < TK)
        if HAS_KEEP:
            keep = tl.load(keep_ptr + b * sm_b + h * sm_h + rows[:, None] * sm_q + cols[None, :] * sm_k,
                           mask=valid, other=0)
            valid = valid & (keep != 0)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        live = m_new > float("-inf")  # rows that have seen a key to attend
        alpha = tl.where(live, tl.exp(m_i - tl.where(live, m_new, 0.0)), 1.0)
        p = tl.where(valid, tl.exp(s - tl.where(live, m_new, 0.0)[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p16 = round_to_bf16(p)  # P rounded to BF16 (V^ stays exact)
        acc = acc * alpha[:, None] + _dot(p16, v, TC, INTERPRETED)
        m_i = m_new
    acc = acc * tl.load(dec_ptr + 2)
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(o_ptr + b * so_b + h * so_h + rows[:, None] * so_t + d[None, :], out, mask=rows[:, None] < TQ)


def flash_forward(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, keep: torch.Tensor | None, scale: float,
                  decodes: torch.Tensor | None = None, tile: tuple[int, int] = (32, 32)) -> torch.Tensor:
    """O [B, H, TQ, D] in FP32 from Q^ [B, H, TQ, D], K^ and V^ [B, H, TK, D] and a boolean keep mask
    broadcastable to [B, H, TQ, TK] (or None).  FP32 operands are the values themselves (IEEE dots); BF16
    operands are exact values whose tensor decode scales are `decodes` [3] (Q^ = q decodes[0], ...): the
    tensor cores' path."""
    bsz, heads, tq, dim = qh.shape
    tk = kh.shape[2]
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"flash_forward: head_dim {dim} must be a power of two >= 16")
    tc = all(t.dtype == torch.bfloat16 for t in (qh, kh, vh))
    if not tc:
        qh, kh, vh = (t.float() for t in (qh, kh, vh))
    qh, kh, vh = (t.contiguous() for t in (qh, kh, vh))
    if decodes is None:
        decodes = torch.ones(3, dtype=torch.float32, device=qh.device)
    out = torch.empty(qh.shape, dtype=torch.float32, device=qh.device)
    has_keep = keep is not None
    if has_keep:
        keep = keep.to(torch.int8).expand(bsz, heads, tq, tk)  # broadcast dims keep stride 0: no copy
        mask_strides = keep.stride()
    else:
        keep, mask_strides = torch.empty(1, dtype=torch.int8, device=qh.device), (0, 0, 0, 0)
    bm, bn = tile
    grid = (triton.cdiv(tq, bm), bsz * heads)
    wrap_triton(_flash_forward_kernel)[grid](
        qh, kh, vh, decodes.float(), keep, out, heads, tq, tk, float(scale), *qh.stride()[:3], *kh.stride()[:3],
        *vh.stride()[:3], *mask_strides, *out.stride()[:3], BM=bm, BN=bn, D=dim, HAS_KEEP=has_keep, TC=tc,
        INTERPRETED=not qh.is_cuda, num_warps=4)
    return out
