"""FP4 attention as Triton flash-attention kernels (issue 12): `flash_forward` and `flash_backward`.

`flash_forward(qh, kh, vh, keep, scale, decodes)` takes the quantized Q^ [B, H, T, D], K^ and V^ [B, H / G, T, D]
of `hf_fp4.nn.attention` (grouped-query attention: G query heads read one key head, nothing expanded) -- as FP32
values, or as exact BF16 values (code x block scale, `attention.tensor_core_operand`) with their tensor decode
scales, which run on the tensor cores -- and computes O = softmax(Q^ K^T * scale, masked) V^ tile by tile with an online
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

from .launch import launcher
from .numerics import quantize_tile, round_to_bf16, tensor_encode_scale

#: (query rows, keys, warps) of a program on the tensor cores' path, forward and backward (a tile argument
#: overrides them), timed on the H200 (B1 H32 T4096 D128 causal, NVFP4 operands; `scripts/profile_fast_path.py
#: --attention-tiles`, benchmarks/results-2026-12-02-session9.md): forward 64 x 32 x 4 0.60 ms (128 x 64 x 8:
#: 0.69, 32 x 32 x 4: 1.10); backward 64 x 32 x 4 3.46 ms (32 x 64 x 4: 4.84, 64 x 64 x 8: 6.20) -- the
#: backward's dK/dV kernel spills at 64 x 32 (ptxas -v) and is still the fastest.  Those times are of the kernels
#: before session 21, which masked every tile; now the tiles every row attends run without masks (_online_step's
#: MASKED, _full_keys, _full_queries) and P V accumulates in the MMA's accumulator; retimed on an H100 in session 27
#: (benchmarks/gpu/attention-tiles-2026-12-06-session27.txt) the defaults stay the fastest: forward 64 x 32 x 4 0.419 ms
#: (64 x 64 x 4: 0.455, 128 x 32 x 8: 0.475, 128 x 128 x 8: 0.486; 2 or 4 stages slower), backward 64 x 32 x 4 3.43 ms
#: (32 x 64 x 4: 5.31, 64 x 32 x 8: 6.13) against SDPA's default dispatch, 0.255 / 0.810 ms (a tile argument may give the
#: pipeline stages: (rows, keys, warps, stages)).  Session 28 computes phase 3's tile transposed (S^T = K^ Q^T, the key
#: tile loaded once): compiled here for sm_90 (Triton 3.9, `scripts/ptx_report.py --only bwd3`) its stack (spilled
#: registers) fell from 216 to 16 B at 64 x 32 x 4 and from 136 B to none at 64 x 32 x 8 (180 registers, from 255).
#: Session 29 (H100, benchmarks/gpu/attention-tiles-2026-12-07-session29.txt, with that and fewer instructions per dS
#: element): backward 64 x 32 x 4 2.76 ms, phase 3 on 32 x 64 x 4 2.27 ms (BACKWARD_TILES) against SDPA flash's 1.46.
#: Every launch compiles with enable_fp_fusion=False: each product and sum is rounded on its own, as the
#: reference (and the interpreter) round them.  With FMA contraction on, the code around the mask decides which
#: multiply-adds fuse.  causal=True and the equivalent tril keep-mask still differ in low bits on the H200
#: (session 10's GPU suite): a loaded mask gives P a second register layout, and Triton sums P's rows in that
#: layout's order (sm_90 TTGIR: the row sum over #blocked with a mask, over #mma without).  Each is checked
#: against the spec on its own (tests/test_attention.py, the causal cases).
FORWARD_TILE = (64, 32, 4)
BACKWARD_TILE = (64, 32, 4)
#: phase 3 (dK / dV, computed transposed: S^T is [keys, queries]) on 64 keys x 32 queries -- the tensor cores' wgmma
#: needs 64 rows, and 64 x 32 (32 keys) fell back to mma.sync; H100, session 29 (profile_fast_path.py
#: --attention-tiles bwd): the backward 2.27 ms against 2.76 with phase 3 on 64 x 32 x 4 (SDPA flash 1.46)
BACKWARD_TILES = {0: BACKWARD_TILE, 1: BACKWARD_TILE, 2: BACKWARD_TILE, 3: (32, 64, 4)}
IEEE_TILE = (32, 32, 4)  # FP32 operands (IEEE dots): twice the bytes and registers per element


@triton.jit
def _dot(a, b, TC: tl.constexpr, INTERPRETED: tl.constexpr):
    """a @ b in FP32: BF16 operands on the tensor cores (exact products), FP32 operands as IEEE FMAs."""
    if TC and not INTERPRETED:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")  # the interpreter: BF16 as FP32


@triton.jit
def _bf16_values(p, TC: tl.constexpr, INTERPRETED: tl.constexpr):
    """P rounded to BF16 for the P V / P^T dO products: on the tensor cores, _dot's own conversion (the GPU's
    cvt.rn.bf16: to nearest even, NaN kept); otherwise round_to_bf16 by hand, in FP32 (Triton's interpreter
    truncates in .to(tl.bfloat16))."""
    if TC and not INTERPRETED:
        return p
    return round_to_bf16(p)


@triton.jit
def _row_lse(m_i, l_i):
    """A row's log-sum-exp from its online max and sum (the forward's and phase 0's): +inf for a row that sees
    no key; a NaN stays NaN."""
    return tl.where(l_i == 0, float("inf"), m_i + tl.log(tl.where(l_i == 0, 1.0, l_i)))


@triton.jit
def _valid(r, c, TQ, TK, CAUSAL: tl.constexpr):
    """In range, and (causal) a key at or before the query (aligned at the start, as Transformers' SDPA); r and c:
    the query and key positions broadcast to the tile's orientation (rows[:, None], cols[None, :] for S;
    rows[None, :], cols[:, None] for S^T)."""
    valid = (r < TQ) & (c < TK)
    if CAUSAL:
        valid = valid & (c <= r)
    return valid


@triton.jit
def _key_end(pid_m, BM: tl.constexpr, TK, CAUSAL: tl.constexpr):
    """Where a block of query rows stops reading keys: TK, or (causal) after its last row's position --
    the skipped tiles are masked entirely (their P and dS are 0, so skipping them changes nothing)."""
    if CAUSAL:
        return tl.minimum(TK, (pid_m + 1) * BM)
    return TK


@triton.jit
def _query_start(pid_n, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr):
    """Where a block of keys starts reading query rows: 0, or (causal) the query block of its first key (the
    blocks before see none of it)."""
    if CAUSAL:
        return (pid_n * BN // BM) * BM
    return 0


@triton.jit
def _full_keys(pid_m, BM: tl.constexpr, BN: tl.constexpr, TK, HAS_KEEP: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys [0, end) in whole BN tiles that every row of query block pid_m attends: none with a keep mask, the
    tiles before the causal diagonal, every full tile otherwise (the forward's and dQ's unmasked loop)."""
    full = 0
    if not HAS_KEEP:
        full = TK // BN * BN
        if CAUSAL:  # a key before the block's first row is seen by all its rows
            full = tl.minimum(full, pid_m * BM // BN * BN)
    return full


@triton.jit
def _full_queries(pid_n, BM: tl.constexpr, BN: tl.constexpr, TQ, TK, HAS_KEEP: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """(lo, hi): the query blocks from lo up to hi (multiples of BM from _query_start) attend every key of key
    block pid_n -- none with a keep mask or a key block past TK; (lo, hi) = (start, start) then, every block
    masked (dK / dV's loops: masked [start, lo), unmasked [lo, hi), masked [hi, TQ))."""
    lo = _query_start(pid_n, BM, BN, CAUSAL)
    hi = lo
    if not HAS_KEEP and (pid_n + 1) * BN <= TK:
        if CAUSAL:  # every row at or after the block's last key
            lo = tl.minimum(tl.cdiv((pid_n + 1) * BN, BM) * BM, TQ)
        hi = tl.maximum(lo, TQ // BM * BM)
    return lo, hi


@triton.jit
def _dot_into(a, b, acc, TC: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + a @ b, accumulated by the dot itself (on the tensor cores: the MMA's accumulator, no separate add)."""
    if TC and not INTERPRETED:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _online_step(acc, m_i, l_i, q, k_ptrs, v_ptrs, keep_ptrs, rows, cols, TQ, TK, s_scale, HAS_KEEP: tl.constexpr,
                 CAUSAL: tl.constexpr, MASKED: tl.constexpr, TC: tl.constexpr, INTERPRETED: tl.constexpr):
    """One key tile of the online softmax: (acc, m, l) after keys `cols`.  MASKED=False: a tile every row of the
    block attends in full (in range, below the causal diagonal, no keep mask) -- no mask is computed or loaded,
    and no score is set to -inf; the row statistics and P are the same expressions as the masked tile's."""
    if MASKED:
        k = tl.load(k_ptrs, mask=cols[:, None] < TK, other=0.0)
        v = tl.load(v_ptrs, mask=cols[:, None] < TK, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = _dot(q, tl.trans(k), TC, INTERPRETED) * s_scale
    if MASKED:
        valid = _valid(rows[:, None], cols[None, :], TQ, TK, CAUSAL)
        if HAS_KEEP:
            valid = valid & (tl.load(keep_ptrs, mask=valid, other=0) != 0)
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    live = m_new > float("-inf")  # rows that have seen a key to attend
    alpha = tl.where(live, tl.exp(m_i - tl.where(live, m_new, 0.0)), 1.0)
    p = tl.exp(s - tl.where(live, m_new, 0.0)[:, None])
    if MASKED:
        p = tl.where(valid, p, 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = _dot_into(_bf16_values(p, TC, INTERPRETED), v, acc * alpha[:, None], TC, INTERPRETED)  # P in BF16
    return acc, m_new, l_i


@triton.jit
def _flash_forward_kernel(q_ptr, k_ptr, v_ptr, dec_ptr, keep_ptr, o_ptr, lse_ptr, H, G, TQ, TK, scale,
                          sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                          sm_b, sm_h, sm_q, sm_k, so_b, so_h, so_t,
                          BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, HAS_KEEP: tl.constexpr,
                          CAUSAL: tl.constexpr, TC: tl.constexpr, LSE: tl.constexpr, INTERPRETED: tl.constexpr):
    """O for a block of query rows; LSE: also each row's log-sum-exp (+inf for a row that sees nothing), the
    backward's phase 0 (_lse_kernel) from the same online sums.  The key tiles run in two loops: first those
    the whole block attends (no mask: every tile before the causal diagonal, or every full tile without causal;
    none with a keep mask), then the rest with their masks -- the order of the sums is the key order either way."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    rows = pid_m * BM + tl.arange(0, BM)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_t + d[None, :], mask=rows[:, None] < TQ, other=0.0)
    s_scale = tl.load(dec_ptr) * tl.load(dec_ptr + 1) * scale  # Q^ = q dec_q, K^ = k dec_k, V^ = v dec_v
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    k_base = k_ptr + b * sk_b + (h // G) * sk_h + d[None, :]
    v_base = v_ptr + b * sv_b + (h // G) * sv_h + d[None, :]
    keep_base = keep_ptr + b * sm_b + h * sm_h + rows[:, None] * sm_q
    end, full = _key_end(pid_m, BM, TK, CAUSAL), _full_keys(pid_m, BM, BN, TK, HAS_KEEP, CAUSAL)
    for start in range(0, full, BN):
        cols = start + tl.arange(0, BN)
        acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k_base + cols[:, None] * sk_t, v_base + cols[:, None] * sv_t,
                                     keep_base + cols[None, :] * sm_k, rows, cols, TQ, TK, s_scale, HAS_KEEP,
                                     CAUSAL, False, TC, INTERPRETED)
    for start in range(full, end, BN):
        cols = start + tl.arange(0, BN)
        acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k_base + cols[:, None] * sk_t, v_base + cols[:, None] * sv_t,
                                     keep_base + cols[None, :] * sm_k, rows, cols, TQ, TK, s_scale, HAS_KEEP,
                                     CAUSAL, True, TC, INTERPRETED)
    if LSE:
        tl.store(lse_ptr + pid_bh * TQ + rows, _row_lse(m_i, l_i), mask=rows < TQ)
    acc = acc * tl.load(dec_ptr + 2)
    # a row that attends to no key is 0; a NaN sum (a NaN score or value) stays NaN -- never a silent 0
    out = tl.where(l_i[:, None] == 0, 0.0, acc / tl.where(l_i == 0, 1.0, l_i)[:, None])
    if INTERPRETED and o_ptr.dtype.element_ty == tl.bfloat16:  # the store rounds to nearest on the GPU only
        out = round_to_bf16(out)
    tl.store(o_ptr + b * so_b + h * so_h + rows[:, None] * so_t + d[None, :], out, mask=rows[:, None] < TQ)


def _groups(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, name: str) -> int:
    """Query heads per key head (grouped-query attention: K^, V^ [B, H / G, TK, D], not expanded)."""
    heads, kv_heads = qh.shape[1], kh.shape[1]
    if vh.shape[1] != kv_heads or heads % kv_heads or qh.shape[0] != kh.shape[0]:
        raise ValueError(f"{name}: Q {tuple(qh.shape)}, K {tuple(kh.shape)}, V {tuple(vh.shape)}: K and V need the "
                         f"same heads, a divisor of Q's, and Q's batch")
    return heads // kv_heads


def _tile(tile: tuple[int, ...] | None, default: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(rows, keys, warps, pipeline stages) from a tile argument (rows, keys[, warps[, stages]]) or the default;
    4 warps and 3 stages (Triton's default on sm_90) where not given."""
    rows, keys, *rest = default if tile is None else tile
    return rows, keys, rest[0] if rest else 4, rest[1] if len(rest) > 1 else 3


def flash_forward(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, keep: torch.Tensor | None, scale: float,
                  decodes: torch.Tensor | None = None, tile: tuple[int, ...] | None = None,
                  causal: bool = False, return_lse: bool = False, out_dtype: torch.dtype = torch.float32):
    """O [B, H, TQ, D] in out_dtype (FP32 by default; a BF16 O is the FP32 one rounded to nearest by the kernel's
    store, as .to(torch.bfloat16) rounds it, without the FP32 tensor) from Q^ [B, H, TQ, D], K^ and V^
    [B, H / G, TK, D] (G query heads share a key head) and a boolean keep mask
    broadcastable to [B, H, TQ, TK] (or None); causal: also key <= query (computed, no mask read; the key
    tiles after a query block are skipped).  FP32 operands are the values themselves (IEEE dots); BF16
    operands are exact values whose tensor decode scales are `decodes` [3] (Q^ = q decodes[0], ...): the
    tensor cores' path.  return_lse: (O, the log-sum-exp [B, H, TQ] of each query row's scores, FP32), which
    flash_backward takes instead of recomputing it."""
    bsz, heads, tq, dim = qh.shape
    tk = kh.shape[2]
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"flash_forward: head_dim {dim} must be a power of two >= 16")
    groups = _groups(qh, kh, vh, "flash_forward")
    tc = all(t.dtype == torch.bfloat16 for t in (qh, kh, vh))
    if not tc:
        qh, kh, vh = (t.float() for t in (qh, kh, vh))
    qh, kh, vh = (t.contiguous() for t in (qh, kh, vh))
    if decodes is None:
        decodes = torch.ones(3, dtype=torch.float32, device=qh.device)
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"flash_forward: out_dtype {out_dtype} is not float32 or bfloat16")
    out = torch.empty(qh.shape, dtype=out_dtype, device=qh.device)
    lse = torch.empty((bsz, heads, tq) if return_lse else (1,), dtype=torch.float32, device=qh.device)
    has_keep = keep is not None
    if has_keep:
        keep = keep.to(torch.int8).expand(bsz, heads, tq, tk)  # broadcast dims keep stride 0: no copy
        mask_strides = keep.stride()
    else:
        keep, mask_strides = torch.empty(1, dtype=torch.int8, device=qh.device), (0, 0, 0, 0)
    bm, bn, warps, stages = _tile(tile, FORWARD_TILE if tc else IEEE_TILE)
    grid = (triton.cdiv(tq, bm), bsz * heads)
    launcher(_flash_forward_kernel)[grid](
        qh, kh, vh, decodes.float(), keep, out, lse, heads, groups, tq, tk, float(scale), *qh.stride()[:3],
        *kh.stride()[:3], *vh.stride()[:3], *mask_strides, *out.stride()[:3], BM=bm, BN=bn, D=dim,
        HAS_KEEP=has_keep, CAUSAL=causal, TC=tc, LSE=return_lse, INTERPRETED=not qh.is_cuda, num_warps=warps,
        num_stages=stages, enable_fp_fusion=False)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# Backward: the reference's dV = bf16(P)^T dO, dP = dO V^T, dS = P (dP - D), dQ = Q_keys(dS) K^ scale,
# dK = Q_queries(dS)^T Q^ scale, tile by tile without materialising S, P or dS.  Four phases over the same
# tiles (each recomputes S and P from the saved Q^, K^ and the row's log-sum-exp):
#   0  the log-sum-exp of every query row             (grid: query blocks; skipped when the forward's is given)
#   1  the tensor amax of dS (two-level dS specs only) (grid: query blocks)
#   2  dQ                                             (grid: query blocks; loops over key blocks)
#   3  dK and dV                                      (grid: key blocks; loops over query blocks)
# dS is quantized in registers by numerics.quantize_tile exactly as hf_fp4.nn.attention.quantize_rows does
# on the whole tensor: blocks along keys for dQ (rows = (b, h, query) of the flattened [B H Tq, Tk] matrix),
# along queries for dK (rows = (b, h, key) of dS^T, seed + 1), or one 2D-tile quantization for both.
# Phases 2 and 3 compute each dS element with the same instructions, so both GEMMs see the same dS.

@triton.jit
def _kv_offset(b, h, H, G, TK, D: tl.constexpr):
    """Where query head h's K^ and V^ start in the contiguous [B, H / G, TK, D] tensors (G query heads per key
    head: grouped-query attention, K and V not expanded)."""
    return (b * (H // G) + h // G) * TK * D


@triton.jit
def _scores(q, k_ptr, kb, cols, d, sk_t, TK, keep_ptr, mb, rows, sm_q, sm_k, TQ, s_scale,
            HAS_KEEP: tl.constexpr, CAUSAL: tl.constexpr, TC: tl.constexpr, INTERPRETED: tl.constexpr,
            MASKED: tl.constexpr = True):
    """S tile [BM, BN] (masked entries -inf) and the key tile it used.  MASKED=False: a tile every row attends
    in full (_online_step's), no mask computed or loaded."""
    if not MASKED:
        k = tl.load(k_ptr + kb + cols[:, None] * sk_t + d[None, :])
        return _dot(q, tl.trans(k), TC, INTERPRETED) * s_scale, k
    k = tl.load(k_ptr + kb + cols[:, None] * sk_t + d[None, :], mask=cols[:, None] < TK, other=0.0)
    s = _dot(q, tl.trans(k), TC, INTERPRETED) * s_scale
    return _masked(s, rows[:, None], cols[None, :], TQ, TK, keep_ptr, mb, sm_q, sm_k, HAS_KEEP, CAUSAL), k


@triton.jit
def _masked(s, r, c, TQ, TK, keep_ptr, mb, sm_q, sm_k, HAS_KEEP: tl.constexpr, CAUSAL: tl.constexpr):
    """An S (or S^T) tile with -inf where a query does not attend a key (out of range, causal, keep mask); r, c: the
    query and key positions broadcast to the tile's orientation, as _valid takes them."""
    valid = _valid(r, c, TQ, TK, CAUSAL)
    if HAS_KEEP:
        keep = tl.load(keep_ptr + mb + r * sm_q + c * sm_k, mask=valid, other=0)
        valid = valid & (keep != 0)
    return tl.where(valid, s, float("-inf"))


#: log2(e): the backward phases 1-3 take S and the log-sum-exp in base 2 (S scaled by scale * log2(e) with the
#: decodes, one multiply per element), so that P = 2^(S2 - lse2) is one subtraction and one MUFU instruction
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp2(x, INTERPRETED: tl.constexpr):
    """2^x: PTX's ex2.approx.ftz on the GPU (one MUFU instruction; tl.exp's non-ftz form adds a multiply and a
    subnormal fix-up of compares and selects per element), numpy's in the interpreter.  2^-inf = +0, NaN stays NaN."""
    if INTERPRETED:
        return tl.exp2(x)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _probs_and_ds(s2, lse2, do, v, delta, dec_v, TC: tl.constexpr, INTERPRETED: tl.constexpr):
    """P = 2^(S2 - lse2) and dS = P (dO V^T dec_v - D) (one FMA), S2 and lse2 in base 2 (LOG2E).  No test per
    element: a masked score (-inf) gives P = 0, and so does a row that sees nothing (lse +inf, its every score
    masked: -inf - inf = -inf); a NaN score or log-sum-exp stays NaN."""
    p = _exp2(s2 - lse2[:, None], INTERPRETED)
    return p, p * tl.fma(_dot(do, tl.trans(v), TC, INTERPRETED), dec_v, -delta[:, None])


@triton.jit
def _decodes(dec_ptr, stat_ptr, scale, QUANT: tl.constexpr, SCALE: tl.constexpr, QMAX: tl.constexpr):
    """(dec_k, dec_v, S's scale, dS's tensor decode): Q^ = q dec_q, K^ = k dec_k, V^ = v dec_v."""
    dec_q, dec_k, dec_v = tl.load(dec_ptr), tl.load(dec_ptr + 1), tl.load(dec_ptr + 2)
    ds_dec = 1.0
    if QUANT and SCALE == 2:
        ds_dec = tl.math.div_rn(1.0, tensor_encode_scale(tl.load(stat_ptr), QMAX))
    return dec_q, dec_k, dec_v, dec_q * dec_k * scale, ds_dec


@triton.jit
def _lse_kernel(q_ptr, k_ptr, v_ptr, dec_ptr, do_ptr, delta_ptr, lse_ptr, stat_ptr, keep_ptr,
                dq_ptr, dk_ptr, dv_ptr, dbg_ptr, seed_ptr, H, G, TQ, TK, TQ_ROWS, TK_ROWS, KP_Q, KP_K, scale,
                sm_b, sm_h, sm_q, sm_k,
                BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, HAS_KEEP: tl.constexpr, CAUSAL: tl.constexpr,
                PHASE: tl.constexpr, QUANT: tl.constexpr, SQUARE: tl.constexpr, BR: tl.constexpr,
                BC: tl.constexpr, GRID: tl.constexpr, QMAX: tl.constexpr, QM: tl.constexpr,
                QE: tl.constexpr, EMAX: tl.constexpr, SCALE: tl.constexpr, SR: tl.constexpr,
                DEBUG: tl.constexpr, TC: tl.constexpr, INTERPRETED: tl.constexpr):
    """Phase 0: the log-sum-exp of each query row of a block (+inf for a row that sees nothing)."""
    pid, pid_bh = tl.program_id(0), tl.program_id(1)
    dec_q, dec_k, dec_v, s_scale, ds_dec = _decodes(dec_ptr, stat_ptr, scale, False, SCALE, QMAX)
    b, h = pid_bh // H, pid_bh % H
    d = tl.arange(0, D)
    qb, kb, mb = pid_bh * TQ * D, _kv_offset(b, h, H, G, TK, D), b * sm_b + h * sm_h
    rows = pid * BM + tl.arange(0, BM)
    q = tl.load(q_ptr + qb + rows[:, None] * D + d[None, :], mask=rows[:, None] < TQ, other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    for start in range(0, _key_end(pid, BM, TK, CAUSAL), BN):
        cols = start + tl.arange(0, BN)
        s, k = _scores(q, k_ptr, kb, cols, d, D, TK, keep_ptr, mb, rows, sm_q, sm_k, TQ, s_scale, HAS_KEEP,
                       CAUSAL, TC, INTERPRETED)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        live = m_new > float("-inf")
        l_i = l_i * tl.where(live, tl.exp(m_i - tl.where(live, m_new, 0.0)), 1.0) + tl.sum(
            tl.where(s == float("-inf"), 0.0, tl.exp(s - tl.where(live, m_new, 0.0)[:, None])), axis=1)
        m_i = m_new
    tl.store(lse_ptr + pid_bh * TQ + rows, _row_lse(m_i, l_i), mask=rows < TQ)


@triton.jit
def _dq_step(dq, amax, start, q, do, lse, delta, k_ptr, v_ptr, kb, keep_ptr, mb, stat_ptr, dbg_ptr, seed, pid_bh,
             rows, d, TQ, TK, TQ_ROWS, KP_Q, sm_q, sm_k, s_scale, dec_v, BM: tl.constexpr, BN: tl.constexpr,
             D: tl.constexpr, HAS_KEEP: tl.constexpr, CAUSAL: tl.constexpr, PHASE: tl.constexpr,
             QUANT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, GRID: tl.constexpr, QMAX: tl.constexpr,
             QM: tl.constexpr, QE: tl.constexpr, EMAX: tl.constexpr, SCALE: tl.constexpr, SR: tl.constexpr,
             DEBUG: tl.constexpr, TC: tl.constexpr, INTERPRETED: tl.constexpr, MASKED: tl.constexpr):
    """One key tile of phase 1 (dS's row maxima into amax) or 2 (dQ += Q_keys(dS) K^)."""
    cols = start + tl.arange(0, BN)
    s, k = _scores(q, k_ptr, kb, cols, d, D, TK, keep_ptr, mb, rows, sm_q, sm_k, TQ, s_scale, HAS_KEEP,
                   CAUSAL, TC, INTERPRETED, MASKED)
    if MASKED:
        v = tl.load(v_ptr + kb + cols[:, None] * D + d[None, :], mask=cols[:, None] < TK, other=0.0)
    else:
        v = tl.load(v_ptr + kb + cols[:, None] * D + d[None, :])
    p, ds = _probs_and_ds(s, lse, do, v, delta, dec_v, TC, INTERPRETED)
    if PHASE == 1:
        amax = tl.maximum(amax, tl.max(tl.abs(ds), axis=1))
    else:
        if DEBUG:
            tl.store(dbg_ptr + pid_bh * TQ * TK + rows[:, None] * TK + cols[None, :], ds,
                     mask=(rows[:, None] < TQ) & (cols[None, :] < TK))
        if QUANT:  # along keys: rows of the flattened [B H TQ_ROWS, KP_Q] matrix
            vals, vals_dec = quantize_tile(ds, stat_ptr, seed, pid_bh * TQ_ROWS + rows, start, KP_Q, BM, BN,
                                           BR, BC, GRID, QMAX, QM, QE, EMAX, SCALE, SR)
            dq += _dot(vals, k, TC, INTERPRETED)
        else:
            dq += _dot(ds, k, False, INTERPRETED)
    return dq, amax


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, dec_ptr, do_ptr, delta_ptr, lse_ptr, stat_ptr, keep_ptr,
               dq_ptr, dk_ptr, dv_ptr, dbg_ptr, seed_ptr, H, G, TQ, TK, TQ_ROWS, TK_ROWS, KP_Q, KP_K, scale,
               sm_b, sm_h, sm_q, sm_k,
               BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, HAS_KEEP: tl.constexpr, CAUSAL: tl.constexpr,
               PHASE: tl.constexpr, QUANT: tl.constexpr, SQUARE: tl.constexpr, BR: tl.constexpr,
               BC: tl.constexpr, GRID: tl.constexpr, QMAX: tl.constexpr, QM: tl.constexpr,
               QE: tl.constexpr, EMAX: tl.constexpr, SCALE: tl.constexpr, SR: tl.constexpr,
               DEBUG: tl.constexpr, TC: tl.constexpr, INTERPRETED: tl.constexpr):
    """Phase 1 (dS's tensor amax, atomic) or 2 (dQ = Q_keys(dS) K^ scale) for a block of query rows."""
    pid, pid_bh = tl.program_id(0), tl.program_id(1)
    seed = tl.load(seed_ptr)  # dS's Philox seed (int64), read on the device: no host read per call
    dec_q, dec_k, dec_v, s_scale, ds_dec = _decodes(dec_ptr, stat_ptr, scale, QUANT and PHASE == 2, SCALE, QMAX)
    b, h = pid_bh // H, pid_bh % H
    d = tl.arange(0, D)
    # Q^, dO, dQ [B H TQ D]; K^, V^ [B H/G TK D]
    qb, kb, mb = pid_bh * TQ * D, _kv_offset(b, h, H, G, TK, D), b * sm_b + h * sm_h
    rows = pid * BM + tl.arange(0, BM)
    q = tl.load(q_ptr + qb + rows[:, None] * D + d[None, :], mask=rows[:, None] < TQ, other=0.0)
    do = tl.load(do_ptr + qb + rows[:, None] * D + d[None, :], mask=rows[:, None] < TQ, other=0.0)
    lse = tl.load(lse_ptr + pid_bh * TQ + rows, mask=rows < TQ, other=float("inf")) * LOG2E  # base 2
    delta = tl.load(delta_ptr + pid_bh * TQ + rows, mask=rows < TQ, other=0.0)
    s_scale = s_scale * LOG2E  # S in base 2 (_probs_and_ds)
    dq = tl.zeros([BM, D], tl.float32)
    amax = tl.zeros([BM], tl.float32)
    full = _full_keys(pid, BM, BN, TK, HAS_KEEP, CAUSAL)
    for start in range(0, full, BN):  # the tiles every row attends: no mask (as the forward's)
        dq, amax = _dq_step(dq, amax, start, q, do, lse, delta, k_ptr, v_ptr, kb, keep_ptr, mb, stat_ptr, dbg_ptr,
                            seed, pid_bh, rows, d, TQ, TK, TQ_ROWS, KP_Q, sm_q, sm_k, s_scale, dec_v, BM, BN, D,
                            HAS_KEEP, CAUSAL, PHASE, QUANT, BR, BC, GRID, QMAX, QM, QE, EMAX, SCALE, SR, DEBUG, TC,
                            INTERPRETED, False)
    for start in range(full, _key_end(pid, BM, TK, CAUSAL), BN):
        dq, amax = _dq_step(dq, amax, start, q, do, lse, delta, k_ptr, v_ptr, kb, keep_ptr, mb, stat_ptr, dbg_ptr,
                            seed, pid_bh, rows, d, TQ, TK, TQ_ROWS, KP_Q, sm_q, sm_k, s_scale, dec_v, BM, BN, D,
                            HAS_KEEP, CAUSAL, PHASE, QUANT, BR, BC, GRID, QMAX, QM, QE, EMAX, SCALE, SR, DEBUG, TC,
                            INTERPRETED, True)
    if PHASE == 1:
        tl.atomic_max(stat_ptr, tl.max(amax, axis=0))
    else:
        tl.store(dq_ptr + qb + rows[:, None] * D + d[None, :], dq * (ds_dec * dec_k * scale), mask=rows[:, None] < TQ)


@triton.jit
def _dkdv_step(dk, dv, start, pid, pid_bh, cols, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qb, keep_ptr, mb,
               stat_ptr, seed, d, TQ, TK, TQ_ROWS, TK_ROWS, KP_Q, KP_K, sm_q, sm_k, s_scale, dec_v,
               BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, HAS_KEEP: tl.constexpr, CAUSAL: tl.constexpr,
               QUANT: tl.constexpr, SQUARE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, GRID: tl.constexpr,
               QMAX: tl.constexpr, QM: tl.constexpr, QE: tl.constexpr, EMAX: tl.constexpr, SCALE: tl.constexpr,
               SR: tl.constexpr, TC: tl.constexpr, INTERPRETED: tl.constexpr, MASKED: tl.constexpr):
    """One query tile of phase 3: dV += bf16(P)^T dO, dK += Q_queries(dS)^T Q^ (or the 2D tile's).  With 1D dS
    blocks (or none) the tile is computed transposed, keys as rows (S^T = K^ Q^T [BN, BM], as FlashAttention-2's
    dK / dV loop): P^T and dS^T enter the dV and dK products and dS^T's blocks along queries are its rows' -- no
    register transposes (sm_90, 64 x 32 x 4: a 16 B stack against 216 in phase 2's orientation; scripts/
    ptx_report.py).  Each element is the same dot product over D as phase 2's S = Q^ K^T (the operands' roles
    swapped), so both phases quantize the same dS (the GPU suite's backward test checks it on the tensor cores).  A
    2D-tile dS keeps phase 2's orientation (its quantization and SR coordinates are that tile's; transposing dS^T
    back in registers made ptxas spill 42 KB)."""
    rows = start + tl.arange(0, BM)
    if MASKED:
        q = tl.load(q_ptr + qb + rows[:, None] * D + d[None, :], mask=rows[:, None] < TQ, other=0.0)
        do = tl.load(do_ptr + qb + rows[:, None] * D + d[None, :], mask=rows[:, None] < TQ, other=0.0)
        lse = tl.load(lse_ptr + pid_bh * TQ + rows, mask=rows < TQ, other=float("inf"))
        delta = tl.load(delta_ptr + pid_bh * TQ + rows, mask=rows < TQ, other=0.0)
    else:
        q = tl.load(q_ptr + qb + rows[:, None] * D + d[None, :])
        do = tl.load(do_ptr + qb + rows[:, None] * D + d[None, :])
        lse = tl.load(lse_ptr + pid_bh * TQ + rows)
        delta = tl.load(delta_ptr + pid_bh * TQ + rows)
    lse = lse * LOG2E  # base 2, as phase 2's
    if SQUARE:  # one 2D-tile quantization serves both GEMMs: the tile in phase 2's orientation, as it quantizes it
        s = _dot(q, tl.trans(k), TC, INTERPRETED) * s_scale
        if MASKED:
            s = _masked(s, rows[:, None], cols[None, :], TQ, TK, keep_ptr, mb, sm_q, sm_k, HAS_KEEP, CAUSAL)
        p, ds = _probs_and_ds(s, lse, do, v, delta, dec_v, TC, INTERPRETED)
        dv += _dot(tl.trans(_bf16_values(p, TC, INTERPRETED)), do, TC, INTERPRETED)
        vals, vals_dec = quantize_tile(ds, stat_ptr, seed, pid_bh * TQ_ROWS + rows, pid * BN, KP_Q, BM, BN,
                                       BR, BC, GRID, QMAX, QM, QE, EMAX, SCALE, SR)
        dk += _dot(tl.trans(vals), q, TC, INTERPRETED)
        return dk, dv
    st = _dot(k, tl.trans(q), TC, INTERPRETED) * s_scale  # S^T [BN, BM]
    if MASKED:
        st = _masked(st, rows[None, :], cols[:, None], TQ, TK, keep_ptr, mb, sm_q, sm_k, HAS_KEEP, CAUSAL)
    pt = _exp2(st - lse[None, :], INTERPRETED)  # as _probs_and_ds, transposed
    dst = pt * tl.fma(_dot(v, tl.trans(do), TC, INTERPRETED), dec_v, -delta[None, :])
    dv += _dot(_bf16_values(pt, TC, INTERPRETED), do, TC, INTERPRETED)
    if QUANT:  # along queries: rows of the flattened [B H TK_ROWS, KP_K] matrix of dS^T, seed + 1
        vals, vals_dec = quantize_tile(dst, stat_ptr, seed + 1, pid_bh * TK_ROWS + cols, start, KP_K, BN, BM,
                                       BR, BC, GRID, QMAX, QM, QE, EMAX, SCALE, SR)
        dk += _dot(vals, q, TC, INTERPRETED)
    else:
        dk += _dot(dst, q, False, INTERPRETED)
    return dk, dv


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, dec_ptr, do_ptr, delta_ptr, lse_ptr, stat_ptr, keep_ptr,
                 dq_ptr, dk_ptr, dv_ptr, dbg_ptr, seed_ptr, H, G, TQ, TK, TQ_ROWS, TK_ROWS, KP_Q, KP_K, scale,
                 sm_b, sm_h, sm_q, sm_k,
                 BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, HAS_KEEP: tl.constexpr, CAUSAL: tl.constexpr,
                 PHASE: tl.constexpr, QUANT: tl.constexpr, SQUARE: tl.constexpr, BR: tl.constexpr,
                 BC: tl.constexpr, GRID: tl.constexpr, QMAX: tl.constexpr, QM: tl.constexpr,
                 QE: tl.constexpr, EMAX: tl.constexpr, SCALE: tl.constexpr, SR: tl.constexpr,
                 DEBUG: tl.constexpr, TC: tl.constexpr, INTERPRETED: tl.constexpr):
    """Phase 3: dK = Q_queries(dS)^T Q^ scale and dV = bf16(P)^T dO for a block of keys."""
    pid, pid_bh = tl.program_id(0), tl.program_id(1)
    seed = tl.load(seed_ptr)  # (as _dq_kernel's)
    dec_q, dec_k, dec_v, s_scale, ds_dec = _decodes(dec_ptr, stat_ptr, scale, QUANT, SCALE, QMAX)
    b, h = pid_bh // H, pid_bh % H
    d = tl.arange(0, D)
    qb, kb, mb = pid_bh * TQ * D, _kv_offset(b, h, H, G, TK, D), b * sm_b + h * sm_h
    ob = pid_bh * TK * D  # dK, dV per query head [B H TK D]: summed over each group after
    s_scale = s_scale * LOG2E  # S in base 2 (_probs_and_ds), as phase 2's
    cols = pid * BN + tl.arange(0, BN)
    k = tl.load(k_ptr + kb + cols[:, None] * D + d[None, :], mask=cols[:, None] < TK, other=0.0)
    v = tl.load(v_ptr + kb + cols[:, None] * D + d[None, :], mask=cols[:, None] < TK, other=0.0)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    # query blocks in order: masked [start, lo) (the causal diagonal), unmasked [lo, hi), masked [hi, TQ)
    lo, hi = _full_queries(pid, BM, BN, TQ, TK, HAS_KEEP, CAUSAL)
    for start in range(_query_start(pid, BM, BN, CAUSAL), lo, BM):
        dk, dv = _dkdv_step(dk, dv, start, pid, pid_bh, cols, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qb,
                            keep_ptr, mb, stat_ptr, seed, d, TQ, TK, TQ_ROWS, TK_ROWS, KP_Q, KP_K, sm_q, sm_k,
                            s_scale, dec_v, BM, BN, D, HAS_KEEP, CAUSAL, QUANT, SQUARE, BR, BC, GRID, QMAX, QM, QE,
                            EMAX, SCALE, SR, TC, INTERPRETED, True)
    for start in range(lo, hi, BM):
        dk, dv = _dkdv_step(dk, dv, start, pid, pid_bh, cols, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qb,
                            keep_ptr, mb, stat_ptr, seed, d, TQ, TK, TQ_ROWS, TK_ROWS, KP_Q, KP_K, sm_q, sm_k,
                            s_scale, dec_v, BM, BN, D, HAS_KEEP, CAUSAL, QUANT, SQUARE, BR, BC, GRID, QMAX, QM, QE,
                            EMAX, SCALE, SR, TC, INTERPRETED, False)
    for start in range(hi, TQ, BM):
        dk, dv = _dkdv_step(dk, dv, start, pid, pid_bh, cols, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qb,
                            keep_ptr, mb, stat_ptr, seed, d, TQ, TK, TQ_ROWS, TK_ROWS, KP_Q, KP_K, sm_q, sm_k,
                            s_scale, dec_v, BM, BN, D, HAS_KEEP, CAUSAL, QUANT, SQUARE, BR, BC, GRID, QMAX, QM, QE,
                            EMAX, SCALE, SR, TC, INTERPRETED, True)
    tl.store(dk_ptr + ob + cols[:, None] * D + d[None, :], dk * (ds_dec * dec_q * scale), mask=cols[:, None] < TK)
    tl.store(dv_ptr + ob + cols[:, None] * D + d[None, :], dv, mask=cols[:, None] < TK)


def flash_backward(qh, kh, vh, out, d_out, keep, scale: float, ds_spec, seed: "int | torch.Tensor",
                   decodes: torch.Tensor | None = None,
                   tile: tuple[int, ...] | dict[int, tuple[int, ...]] | None = None, debug: bool = False,
                   causal: bool = False, lse: torch.Tensor | None = None):
    """dQ, dK, dV in FP32, all [B, H, T, D] (dK, dV per query head: a key head's gradient is the sum over its G
    query heads) of hf_fp4.nn.attention's backward, from the saved Q^, K^, V^
    (FP32 values, or exact BF16 values with their tensor `decodes` [3] as flash_forward takes them), the forward
    output and dO; ds_spec: dS's QuantSpec (None: high precision); seed: dS's Philox seed (along keys; seed + 1
    along queries), an int or a one-element int64 tensor on the device (read by the kernels: no host read).  The
    tensor cores run every GEMM when the operands are BF16 and so is dO (products exact, FP32 sums; tensor scales
    applied after); otherwise IEEE FP32 dots.  causal: as flash_forward's.  debug: also the unquantized dS
    [B, H, TQ, TK] the kernels computed (tests).
    lse: the forward's log-sum-exp (flash_forward(..., return_lse=True)); None: recomputed (phase 0).
    tile: one tile for every phase, or {phase: tile} (phases 0-3, see above; a phase not named takes the default):
    the phases' tiles are independent -- dS is quantized in 16-wide blocks and its SR noise drawn by coordinates, and
    each element is the same dot product over D whatever tile computes it (on the tensor cores the GPU suite's
    tests check that the phases agree)."""
    from hf_fp4.numerics.formats import Grid
    from hf_fp4.numerics.scales import ScaleRule
    from hf_fp4.numerics.spec import Rounding

    from .numerics import grid_constants
    from .quant import SCALE_CODES

    bsz, heads, tq, dim = qh.shape
    tk = kh.shape[2]
    dev = qh.device
    groups = _groups(qh, kh, vh, "flash_backward")
    tc = decodes is not None and all(t.dtype == torch.bfloat16 for t in (qh, kh, vh, d_out))
    if decodes is None:
        decodes = torch.ones(3, dtype=torch.float32, device=dev)
    elif not tc:  # the values themselves, in FP32
        qh, kh, vh = (t.float() * dec for t, dec in zip((qh, kh, vh), decodes))
        decodes = torch.ones(3, dtype=torch.float32, device=dev)
    if not tc:
        qh, kh, vh, d_out = (t.float() for t in (qh, kh, vh, d_out))
    qh, kh, vh, do = (t.contiguous() for t in (qh, kh, vh, d_out))
    delta = (d_out.float() * out.float()).sum(-1).contiguous()  # D = rowsum(dO * O), as the reference
    phases = [2, 3]
    if lse is None:
        lse, phases = torch.empty(bsz, heads, tq, dtype=torch.float32, device=dev), [0, 2, 3]
    elif lse.shape != (bsz, heads, tq) or lse.dtype != torch.float32:
        raise ValueError(f"flash_backward: lse must be FP32 of shape {(bsz, heads, tq)}, got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    lse = lse.contiguous()
    stat = torch.zeros(1, dtype=torch.float32, device=dev)
    dq, dk, dv = (torch.empty(qh.shape[:2] + t.shape[2:], dtype=torch.float32, device=dev) for t in (qh, kh, vh))
    dbg = torch.zeros(bsz, heads, tq, tk, dtype=torch.float32, device=dev) if debug else stat
    if keep is not None:
        keep_t = keep.to(torch.int8).expand(bsz, heads, tq, tk)
        mask_strides = keep_t.stride()
    else:
        keep_t, mask_strides = torch.empty(1, dtype=torch.int8, device=dev), (0, 0, 0, 0)
    defaults = BACKWARD_TILES if tc else dict.fromkeys(range(4), IEEE_TILE)
    if isinstance(tile, dict):
        if unknown := sorted(set(tile) - {0, 1, 2, 3}):
            raise ValueError(f"flash_backward: tiles for phases {unknown}; the phases are 0, 1, 2, 3")
        tiles = {phase: _tile(tile.get(phase), defaults[phase]) for phase in range(4)}
    elif tile is not None:
        tiles = dict.fromkeys(range(4), _tile(tile, defaults[0]))
    else:
        tiles = {phase: _tile(None, defaults[phase]) for phase in range(4)}
    quant = dict(QUANT=False, SQUARE=False, BR=1, BC=16, **grid_constants(Grid.E2M1), SCALE=0, SR=False)
    rows_q, rows_k, kp_q, kp_k = tq, tk, tk, tq
    if ds_spec is not None:
        br, bc = ds_spec.block
        for bm, bn, *_ in tiles.values():
            if bm % max(br, bc) or bn % max(br, bc) or ds_spec.scale is ScaleRule.FP32:
                raise ValueError(f"flash_backward: dS spec {ds_spec} does not fit {bm}x{bn} tiles")
        quant = dict(QUANT=True, SQUARE=br == bc, BR=br, BC=bc, **grid_constants(ds_spec.grid),
                     SCALE=SCALE_CODES[ds_spec.scale], SR=ds_spec.rounding is Rounding.STOCHASTIC)
        rows_q, rows_k = tq + (-tq % br), tk + (-tk % br)  # quantize_rows pads each matrix's rows to the block
        kp_q, kp_k = tk + (-tk % bc), tq + (-tq % bc)
    quant.pop("EMIN", None)
    quant.pop("MBITS", None)
    seed_t = (seed.reshape(1).to(device=dev, dtype=torch.int64) if isinstance(seed, torch.Tensor)
              else torch.full((1,), int(seed), dtype=torch.int64, device=dev))  # a fill kernel, no copy
    args = (qh, kh, vh, decodes.float().contiguous(), do, delta, lse, stat, keep_t, dq, dk, dv, dbg, seed_t, heads,
            groups, tq, tk, rows_q, rows_k, kp_q, kp_k,
            float(scale), *mask_strides)
    consts = dict(D=dim, HAS_KEEP=keep is not None, CAUSAL=causal, DEBUG=debug, TC=tc, INTERPRETED=not qh.is_cuda,
                  **quant)
    if quant["QUANT"] and quant["SCALE"] == 2:  # dS's tensor amax first
        phases.insert(phases.index(2), 1)
    kernels = {0: _lse_kernel, 1: _dq_kernel, 2: _dq_kernel, 3: _dkdv_kernel}
    for phase in phases:
        bm, bn, warps, stages = tiles[phase]
        grid = (triton.cdiv(tk, bn) if phase == 3 else triton.cdiv(tq, bm), bsz * heads)
        launcher(kernels[phase])[grid](*args, PHASE=phase, BM=bm, BN=bn, num_warps=warps, num_stages=stages,
                                       enable_fp_fusion=False, **consts)
    return (dq, dk, dv, dbg) if debug else (dq, dk, dv)
