"""Triton twins of the reference numerics (hf_fp4.numerics.formats, hf_fp4.numerics.scales, hf_fp4.numerics.hadamard, hf_fp4.numerics.philox).

Every helper here is a @triton.jit function used by the quantization kernels (`quant.py`: packed codes
and scales; `operand.py`: GEMM operands).  Each computes exactly what its reference twin computes;
the tests compare the kernels with the reference bit for bit.

Rounding is written with as few instructions per element as exactness allows, since the kernels are
otherwise memory-bound:

* uniform grids (E1M2 step 0.25, INT4 step 1): round-to-nearest-even is one FP32 add and subtract of
  1.5 * 2^23 * step (the addition rounds to a multiple of the step, ties to even), then the saturation;
* E2M1 has three binades of constant step (0.5 below 2, 1 below 4, 2 above); the same trick with the magic
  constant of m's binade, built from the exponent bits of max(m, 1).  A tie goes to the even multiple of the
  step, which is the even code (E2M1 codes count the grid in order), as the reference requires;
* stochastic rounding compares a uniform draw with the fraction m / step - floor(m / step), which is
  (m - lo) / (hi - lo) exactly (steps are powers of two);
* E4M3 (MXFP8 elements and UE4M3 block scales) keeps the general float-grid form.

Stochastic-rounding noise is drawn sixteen elements per Philox call, a byte each (`philox4x32`: tl.randint4x's words,
each round's two 32 x 32-bit products as one wide multiply; `byte_uniform`), in the layout of
hf_fp4.numerics.philox.philox_noise.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from hf_fp4.numerics.formats import FLOAT_PARAMS as GRID_PARAMS
from hf_fp4.numerics.formats import Grid

#: Grid ids the kernels branch on (constexpr).
GRID_IDS = {Grid.E2M1: 0, Grid.E1M2: 1, Grid.INT4: 2, Grid.E4M3: 3}
#: OCP emax of the element grid (floor(log2 max)).
GRID_EMAX = {Grid.E2M1: 2, Grid.E1M2: 0, Grid.INT4: 2, Grid.E4M3: 8}
FLT_MAX = 3.4028234663852886e38
FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # FP32's smallest normal number (hf_fp4.numerics.formats.FLT_MIN)
#: Whether kernels run in Triton's interpreter (the CPU tests: set before triton is imported), which runs no PTX.
INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def floor_log2(m):
    """floor(log2 m) of positive normal FP32 m from its exponent field (-127 for zero/subnormals)."""
    return ((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def pow2(e):
    """2^e in FP32 for integer e in [-149, 127] (subnormals built bitwise)."""
    normal = ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(e + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def round_float_grid(m, u, EMIN: tl.constexpr, MBITS: tl.constexpr, QMAX: tl.constexpr,
                     STOCHASTIC: tl.constexpr):
    """General float grid: step 2^(max(floor(log2 m), EMIN) - MBITS), RNE or SR, saturating at QMAX."""
    e = tl.maximum(floor_log2(m), EMIN)
    step = pow2(e - MBITS)
    v = m * pow2(MBITS - e)  # m / step, exact
    if STOCHASTIC:
        lo = floor_small(v)
        r = tl.where(u < v - lo, lo + 1.0, lo)
    else:
        r = (v + 12582912.0) - 12582912.0  # 1.5 * 2^23: FP32 addition rounds to an integer, ties to even
    return tl.minimum(r * step, QMAX)


@triton.jit
def _round_uniform(m, u, STEP: tl.constexpr, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """A uniform grid (step a power of two, max QMAX): RNE by adding and subtracting 1.5 * 2^23 * STEP
    (the FP32 sum rounds to a multiple of the step, ties to even), or SR against floor(m / STEP)."""
    if STOCHASTIC:
        v = m * (1.0 / STEP)
        lo = floor_small(v)
        q = tl.where(u < v - lo, lo + 1.0, lo) * STEP
    else:
        q = (m + 12582912.0 * STEP) - 12582912.0 * STEP
    return tl.minimum(q, QMAX)


@triton.jit
def round_grid(m, u, GRID: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Round non-negative FP32 m onto a grid (ids: GRID_IDS); u: uniforms for SR."""
    if GRID == 0:  # E2M1: steps 0.5 / 1 / 2 on [0, 2) / [2, 4) / [4, 6]
        # m's binade b = 2^floor(log2 max(m, 1)) from the exponent bits, the step b / 2 (a max and a mask: two
        # compares and two selects per step choice cost twice as many ALU-pipe instructions on sm_90; m >= 8 takes
        # step 4 here where the grid's last binade has 2: both round to 8 or more, saturated to 6 below)
        b_bits = tl.maximum(m, 1.0).to(tl.int32, bitcast=True) & 0x7F800000
        if STOCHASTIC:
            v = m * (0x7F800000 - b_bits).to(tl.float32, bitcast=True)  # m / step: times 2 / b, exact
            lo = floor_small(v)
            q = tl.where(u < v - lo, lo + 1.0, lo) * (b_bits.to(tl.float32, bitcast=True) * 0.5)
        else:  # one magic constant per element: 1.5 * 2^23 * step
            magic = b_bits.to(tl.float32, bitcast=True) * 6291456.0
            q = (m + magic) - magic
        q = tl.minimum(q, 6.0)
    elif GRID == 1:  # E1M2: step 0.25 up to 1.75
        q = _round_uniform(m, u, 0.25, 1.75, STOCHASTIC)
    elif GRID == 2:  # INT4: step 1 up to 7
        q = _round_uniform(m, u, 1.0, 7.0, STOCHASTIC)
    else:  # E4M3
        q = round_float_grid(m, u, -6, 3, 448.0, STOCHASTIC)
    return q


@triton.jit
def floor_small(v):
    """floor(v) for 0 <= v < 2^23 (and NaN, Inf).  On the GPU two FP32 adds (v + 2^23 rounded toward -inf, then - 2^23:
    exact) on the FMA pipe, where floor is an FRND on sm_90's narrower conversion pipe."""
    if INTERPRETER:
        return tl.floor(v)
    else:
        return tl.inline_asm_elementwise("{ .reg .f32 t; add.rm.f32 t, $1, 0f4B000000; sub.rn.f32 $0, t, 0f4B000000; }",
                                         "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def grid_code(q, EMIN: tl.constexpr, MBITS: tl.constexpr):
    """Magnitude code of a grid value q >= 0: mantissa-with-implicit-bit + (E - EMIN) * 2^MBITS."""
    e = tl.maximum(floor_log2(q), EMIN)
    m_int = (q * pow2(MBITS - e)).to(tl.int32)
    return m_int + (e - EMIN) * (1 << MBITS)


@triton.jit
def e8m0_exponent(amax, CEIL: tl.constexpr, QM: tl.constexpr, QE: tl.constexpr, EMAX: tl.constexpr):
    """Block exponent of E8M0 scales: OCP floor(log2 amax) - emax, or truncation-free ceil; -127 for 0."""
    f = floor_log2(amax)
    if CEIL:
        r = amax * pow2(-f)  # mantissa of amax in [1, 2); qmax = QM * 2^QE
        e = tl.where(r <= QM, f - QE, f - QE + 1)
    else:
        e = f - EMAX
    e = tl.where(amax > 0, e, -127)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def tensor_encode_scale(tensor_amax, QMAX: tl.constexpr):
    """s_enc = 448 * qmax / amax (IEEE division); 1 when amax or s_enc is 0 (TE) and when s_enc would exceed 2^117
    (hf_fp4.numerics.scales.MAX_TENSOR_ENCODE: a tiny tensor counts as zero; an amax of 0 gives inf here)."""
    s_enc = tl.math.div_rn(448.0 * QMAX, tensor_amax)
    return tl.where((s_enc > 1.661534994731145e35) | (s_enc == 0), 1.0, s_enc)


@triton.jit
def encode_factor(decode):
    """1 / decode (IEEE division), the two-level encode factor (hf_fp4.numerics.scales.ue4m3_two_level); finite,
    since a block decode factor is a normal number (MAX_TENSOR_ENCODE)."""
    return tl.math.div_rn(tl.full(decode.shape, 1.0, tl.float32), decode)


@triton.jit
def ue4m3_block_scale(amax, s_enc, QMAX: tl.constexpr, FAST: tl.constexpr = False):
    """s_b = e4m3_rne(min(amax_b / qmax * s_enc, FLT_MAX)), saturating at 448.  FAST: amax_b / qmax by div_qmax
    (QMAX 6, 7 or 448; the same s_b for every amax, see there)."""
    if FAST:
        quotient = div_qmax(amax, QMAX)
    else:
        quotient = tl.math.div_rn(amax, QMAX)
    block = tl.minimum(quotient * s_enc, 3.4028234663852886e38)
    return round_float_grid(block, block, -6, 3, 448.0, False)


@triton.jit
def div_qmax(amax, QMAX: tl.constexpr):
    """amax / QMAX for the two-level block scale, QMAX 6, 7 or 448 (E2M1, INT4, E4M3): q = RN(amax c), r = amax - q QMAX (exact, one
    FMA), RN(q + r c), with c = RN(1 / QMAX) -- three instructions for div_rn's ~14 (its reciprocal refined at run
    time, a range check and a branch, per block).  Checked for every positive FP32 amax (scripts/
    check_fast_division.c, 2026-12-07): correctly rounded at every normal quotient; an ulp off at some subnormal
    ones, the largest 0x1.55555p-128 (QMAX 6) and 0x1.24924p-129 (448; none for 7), where s_enc <= 2^117
    (MAX_TENSOR_ENCODE) keeps amax / QMAX * s_enc under 2^-10, which E4M3 rounds to 0 -- so the block scale
    s_b is the IEEE division's for every amax.  (E1M2's 1.75 fails at normal quotients: IEEE division.)"""
    q = amax * (1.0 / QMAX)
    return tl.fma(tl.fma(-q, QMAX, amax), 1.0 / QMAX, q)


@triton.jit
def rcp_rn(d):
    """RN(1 / d) for d in [2^-125, 2^125]: div_rn(1, d)'s own fast path (MUFU's approximation, Newton's step, the
    FMA residual correction) without its range check and branch -- the range where that check passes it.  The
    interpreter has no rcp.approx and starts from the IEEE quotient (the tile tests compare its results with the
    reference's bit for bit; the GPU suite checks MUFU's start)."""
    if INTERPRETER:
        r = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
    else:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32, is_pure=True,
                                      pack=1)
    r = tl.fma(r, tl.fma(-d, r, 1.0), r)
    return tl.fma(r, tl.fma(-d, r, 1.0), r)


@triton.jit
def rcp_rn_exact(s_enc):
    """Whether rcp_rn gives every block's encode factor: s_enc in [2^-116, 2^116] puts each decode factor
    s_b / s_enc (s_b an E4M3 value in [2^-9, 448]) in [2^-125, 2^125].  One test per tensor: only a tensor whose
    amax is below ~1e-31 or above ~3e38 takes the IEEE division."""
    return (s_enc <= 8.307674973655724e34) & (s_enc >= 1.2037062152420224e-35)


@triton.jit
def butterfly(x, BM: tl.constexpr, BK: tl.constexpr, S: tl.constexpr):
    """One stage of stride S: each pair (a at the lower index, b = a's partner) -> (a + b, a - b)."""
    x3 = tl.permute(tl.reshape(x, [BM * BK // (2 * S), 2, S]), (0, 2, 1))
    a, b = tl.split(x3)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [BM, BK])


@triton.jit
def _signed_stages(x, signs_ptr, BM: tl.constexpr, BK: tl.constexpr, H: tl.constexpr, HAS_SIGNS: tl.constexpr,
                   STOP: tl.constexpr):
    """The signs of diag(s) H_n, then the butterfly stages of stride 1, 2, 4, ... below STOP."""
    if HAS_SIGNS:
        s = tl.load(signs_ptr + tl.arange(0, H))
        x = tl.reshape(tl.reshape(x, [BM * BK // H, H]) * s[None, :], [BM, BK])
    for i in tl.static_range(8):  # strides 1 .. 128 (H <= 256)
        if (1 << i) < STOP:
            x = butterfly(x, BM, BK, 1 << i)
    return x


@triton.jit
def hadamard(x, signs_ptr, BM: tl.constexpr, BK: tl.constexpr, H: tl.constexpr, HSCALE: tl.constexpr,
             HAS_SIGNS: tl.constexpr):
    """Blockwise diag(s) H_n along the last dim: signs, butterflies of stride 1 .. H/2, one scale."""
    return flush_subnormals(_signed_stages(x, signs_ptr, BM, BK, H, HAS_SIGNS, H) * HSCALE)


@triton.jit
def hadamard_block_amax(x, signs_ptr, BM: tl.constexpr, BK: tl.constexpr, H: tl.constexpr, HSCALE: tl.constexpr,
                        HAS_SIGNS: tl.constexpr):
    """For amaxes of hadamard(x, ...) without its values: the same FP32 operations up to the last butterfly stage
    (stride H / 2), whose pairs (a + b, a - b) are reduced where they lie -- max(|a + b|, |a - b|) of the finite
    ones, [BM * BK // H, H // 2] -- instead of being put back into x's layout (on sm_90 that reshape is a round
    trip through shared memory per tile).  Not yet scaled: the caller reduces further, then applies
    flush_subnormals(m * HSCALE) once -- both monotone in |v|, so they commute with the max (and a finite v
    stays finite, HSCALE < 1)."""
    x = _signed_stages(x, signs_ptr, BM, BK, H, HAS_SIGNS, H // 2)
    a, b = tl.split(tl.permute(tl.reshape(x, [BM * BK // H, 2, H // 2]), (0, 2, 1)))  # the last stage, S = H / 2
    return tl.maximum(finite_abs(a + b), finite_abs(a - b))


@triton.jit
def finite_abs(x):
    """|x|, 0 for a non-finite x (the reference zeroes non-finite values before an amax; NaN < inf is false)."""
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)


@triton.jit
def _butterfly_across(xs, S: tl.constexpr, H: tl.constexpr):
    """butterfly()'s stage of stride S across a tuple: element i of every block is the tile xs[i]; each pair
    (xs[i], xs[i + S]) with bit S of i clear -> (sum, difference), at the same indices."""
    out = ()
    for i in tl.static_range(H):
        if (i // S) % 2 == 0:
            out = out + (xs[i] + xs[i + S],)
        else:
            out = out + (xs[i - S] - xs[i],)
    return out


@triton.jit
def hadamard_across(xs, signs_ptr, H: tl.constexpr, HSCALE: tl.constexpr, HAS_SIGNS: tl.constexpr):
    """hadamard() along a dimension that is spread over a tuple of H equal tiles instead of lying inside one
    tile: xs[i] holds element i of every block (e.g. rows r0 + g * H + i of t, for the orientation whose blocks
    run along t's rows).  The same FP32 operations in the same order as hadamard() (signs, butterflies of
    stride 1 .. H/2, one scale), so the results are bit-identical -- but elementwise between tiles of one
    register layout: no transpose, and no data exchanged between threads (on sm_90 each butterfly stage of
    hadamard() on a transposed tile is a layout conversion through shared memory)."""
    if HAS_SIGNS:
        signed = ()
        for i in tl.static_range(H):
            signed = signed + (xs[i] * tl.load(signs_ptr + i),)
        xs = signed
    xs = _butterfly_across(xs, 1, H)
    xs = _butterfly_across(xs, 2, H)
    xs = _butterfly_across(xs, 4, H)
    xs = _butterfly_across(xs, 8, H)
    if H > 16:
        xs = _butterfly_across(xs, 16, H)
    if H > 32:
        xs = _butterfly_across(xs, 32, H)
    if H > 64:
        xs = _butterfly_across(xs, 64, H)
    if H > 128:
        xs = _butterfly_across(xs, 128, H)
    out = ()
    for i in tl.static_range(H):
        out = out + (flush_subnormals(xs[i] * HSCALE),)
    return out


@triton.jit
def flush_subnormals(x):
    """hf_fp4.numerics.formats.flush_subnormals: |x| < 2^-126 -> +0 (NaN, inf kept).

    On the GPU one FP32 add of +0 with subnormals flushed (add.rn.ftz: a subnormal x becomes a zero of its sign, and
    -0 + +0 = +0 under round to nearest, so every zero comes out +0 -- the where() below, bit for bit): one
    FMA-pipe instruction where the compare and select are two on the half-rate ALU pipe, which bounds the operand
    kernels (sm_90 code: their ALU-pipe instructions outnumber the FMA pipe's; every loaded element is flushed)."""
    if INTERPRETER:
        return tl.where(tl.abs(x) < FLT_MIN, 0.0, x)
    else:
        return tl.inline_asm_elementwise("add.rn.ftz.f32 $0, $1, 0f00000000;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _mul_wide(a, B: tl.constexpr):
    """(high, low) 32-bit halves of the 64-bit product of uint32 a and the constant B."""
    p = a.to(tl.uint64) * B
    return (p >> 32).to(tl.uint32), p.to(tl.uint32)


@triton.jit
def philox4x32(seed, offset):
    """tl.randint4x(seed, offset) bit for bit -- the four uint32 words of Philox4x32-10 at counter (offset's low and
    high words, 0, 0), key = the int64 seed's two words (hf_fp4.numerics.philox.philox_words) -- with each round's
    hi and lo products of a counter word as one 32 x 32 -> 64-bit multiply: on sm_90 one IMAD.WIDE.U32 where
    Triton's umulhi + mul compile to two multiplies (timed on an H100 in session 34, when a call served four
    elements: bench-50m's SR dy pairs 1.4-3.9% faster than with tl.rand4x)."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = offset.to(tl.uint32)
    c1 = (offset >> 32).to(tl.uint32)
    c2 = c0 * 0
    c3 = c2
    for _ in tl.static_range(10):
        hi_b, lo_b = _mul_wide(c2, 0xCD9E8D57)
        hi_a, lo_a = _mul_wide(c0, 0xD2511F53)
        c0, c2 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1
        c1, c3 = lo_b, lo_a
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def byte_uniform(word, K: tl.constexpr):
    """Byte K of a Philox word as the uniform (byte + 1/2) / 256 (hf_fp4.numerics.philox.byte_uniforms): the byte
    placed in the fraction of 1.0 (1 + byte / 256, exact) minus 1 - 1/512 (exact: a multiple of 2^-9 below 1) -- a
    shift, one LOP3 and an FADD, where an integer-to-float conversion runs on sm_90's narrower pipe."""
    if K == 0:
        b = word << 15
    elif K == 1:
        b = word << 7
    elif K == 2:
        b = word >> 1
    else:
        b = word >> 9
    return _uniform_at_bit15(b)


@triton.jit
def _uniform_at_bit15(b):
    """(byte + 1/2) / 256 of the byte held in bits 15-22 of the uint32 b (other bits ignored)."""
    return ((b & 0x7F8000) | 0x3F800000).to(tl.float32, bitcast=True) - 0.998046875


@triton.jit
def rand16x(seed, offset):
    """The 16 uniforms of the Philox call at `offset` (each a tensor of offset's shape): element 4 w + k is byte k
    of word w."""
    c0, c1, c2, c3 = philox4x32(seed, offset)
    return (byte_uniform(c0, 0), byte_uniform(c0, 1), byte_uniform(c0, 2), byte_uniform(c0, 3),
            byte_uniform(c1, 0), byte_uniform(c1, 1), byte_uniform(c1, 2), byte_uniform(c1, 3),
            byte_uniform(c2, 0), byte_uniform(c2, 1), byte_uniform(c2, 2), byte_uniform(c2, 3),
            byte_uniform(c3, 0), byte_uniform(c3, 1), byte_uniform(c3, 2), byte_uniform(c3, 3))


@triton.jit
def sr_uniforms(seed, rows, col0, KP, BM: tl.constexpr, BK: tl.constexpr):
    """Uniforms of a [BM, BK] tile starting at column col0 (a multiple of 16) of the padded [Mp, KP]
    operand: element (r, c) is byte c % 16 of the Philox call at counter r * ceil(KP / 16) + c // 16."""
    groups = col0 // 16 + tl.arange(0, BK // 16)
    return sr_uniforms_at(seed, rows[:, None].to(tl.int64) * ((KP + 15) // 16) + groups[None, :], BM, BK)


@triton.jit
def sr_uniforms_at(seed, counters, BM: tl.constexpr, BK: tl.constexpr):
    """sr_uniforms from the Philox counters of the tile's groups of 16 columns ([BM, BK // 16]; seed: a scalar or
    any shape that broadcasts to theirs -- one seed per row or column group in grouped operands).  The words are
    spread to one per 4 columns first, then their bytes (two joins of 4, the layout of the draws of 4 uniforms a
    call before): one join of 16 uniforms cost the grouped UFP4 pair 6 more layout conversions and 12 more
    barriers in sm_90 code (scripts/ptx_report.py), the ungrouped NVFP4 pair the same either way."""
    c0, c1, c2, c3 = philox4x32(seed, counters)
    words = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [BM, BK // 4])  # word w of a call at 4 g + w
    return tl.reshape(tl.join(tl.join(byte_uniform(words, 0), byte_uniform(words, 2)),
                              tl.join(byte_uniform(words, 1), byte_uniform(words, 3))), [BM, BK])


@triton.jit
def sr_uniforms_each(seed, rows, col0, KP, BM: tl.constexpr, BK: tl.constexpr):
    """sr_uniforms' numbers without its join / reshape: every element draws its own Philox call (the one at
    counter r * ceil(KP / 16) + c // 16) and keeps byte c % 16 -- sixteen times the Philox work.  For tiles the
    kernels hold in an MMA register layout (the attention kernels' dS): on the H200 the flash dQ kernel's
    stochastically rounded dS at 32 x 16 tiles came out unlike the spec with sr_uniforms (its dQ outside the FP32
    bound; round to nearest, the dK kernel and a loaded tile of the same shape were exact: session 11,
    benchmarks/results-2026-12-03-session11.md), the join + reshape into the MMA layout being the one
    layout-dependent step."""
    c = col0 + tl.arange(0, BK)
    counters = rows[:, None].to(tl.int64) * ((KP + 15) // 16) + (c // 16)[None, :]
    c0, c1, c2, c3 = philox4x32(seed, counters)
    w = ((c % 16) // 4)[None, :]
    word = tl.where(w == 0, c0, tl.where(w == 1, c1, tl.where(w == 2, c2, c3)))
    return _uniform_at_bit15((word >> (8 * (c % 4))[None, :].to(tl.uint32)) << 15)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def block_max(a, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
              NAN: tl.constexpr = False):
    """Per-block max of a [BM, BK] tile with BR x BC blocks -> [BM // BR, BK // BC].  NAN: a block holding
    a NaN gives NaN (tl.max, like PTX's max, drops NaN)."""
    if NAN:
        if BR == 1:
            return tl.reduce(tl.reshape(a, [BM, BK // BC, BC]), 2, _max_nan)
        return tl.reduce(tl.reduce(tl.reshape(a, [BM // BR, BR, BK // BC, BC]), 3, _max_nan), 1, _max_nan)
    if BR == 1:
        return tl.max(tl.reshape(a, [BM, BK // BC, BC]), axis=2)
    return tl.max(tl.max(tl.reshape(a, [BM // BR, BR, BK // BC, BC]), axis=3), axis=1)


@triton.jit
def block_any(b, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Per-block maximum of an integer tile (e.g. "any element flagged")."""
    if BR == 1:
        return tl.max(tl.reshape(b, [BM, BK // BC, BC]), axis=2)
    return tl.max(tl.max(tl.reshape(b, [BM // BR, BR, BK // BC, BC]), axis=3), axis=1)


@triton.jit
def expand_blocks(v, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """[BM // BR, BK // BC] per-block values -> [BM, BK] per element."""
    if BR == 1:
        return tl.reshape(tl.broadcast_to(v[:, :, None], [BM, BK // BC, BC]), [BM, BK])
    v4 = tl.broadcast_to(tl.reshape(v, [BM // BR, 1, BK // BC, 1]), [BM // BR, BR, BK // BC, BC])
    return tl.reshape(v4, [BM, BK])


@triton.jit
def fake_quantize_tile(x, stat_ptr, seed, rows, col0, KP, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                       BC: tl.constexpr, GRID: tl.constexpr, QMAX: tl.constexpr, QM: tl.constexpr, QE: tl.constexpr,
                       EMAX: tl.constexpr, SCALE: tl.constexpr, SR: tl.constexpr):
    """quantize(x, spec).dequantize() of a finite [BM, BK] tile in FP32, as the reference: BR x BC blocks
    (whole blocks in the tile), E8M0 (SCALE 0 floor / 1 ceil) or UE4M3 + FP32 tensor scale (SCALE 2, the tensor
    amax at stat_ptr), nearest or stochastic rounding (SR: Philox noise of the padded [Mp, KP] matrix at global
    `rows` and columns col0 + ...)."""
    values, s_dec = quantize_tile(x, stat_ptr, seed, rows, col0, KP, BM, BK, BR, BC, GRID, QMAX, QM, QE, EMAX, SCALE,
                                  SR)
    return values * s_dec


@triton.jit
def quantize_tile(x, stat_ptr, seed, rows, col0, KP, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                  BC: tl.constexpr, GRID: tl.constexpr, QMAX: tl.constexpr, QM: tl.constexpr, QE: tl.constexpr,
                  EMAX: tl.constexpr, SCALE: tl.constexpr, SR: tl.constexpr):
    """fake_quantize_tile in two parts: (grid value x block scale -- at most 8 significant bits, exact in BF16
    for the tensor cores --, the FP32 tensor decode scale or 1).  A block holding a NaN or Inf comes out NaN
    (the operand kernels' rule; the reference raises on such input) -- never finite values that hide it."""
    x = flush_subnormals(x)
    # one reduction finds both the block amax and a non-finite block: the max propagates NaN (a separate "any
    # NaN / Inf" reduction cost ~4 ALU instructions per element, twice per dS tile in the attention backward)
    a = tl.abs(x)
    if INTERPRETER:  # the interpreter's max drops NaN, as PTX's plain max does: map NaN to Inf first
        a = tl.where(a == a, a, float("inf"))
    amax = block_max(a, BM, BK, BR, BC, not INTERPRETER)
    bad = ~(amax <= 3.4028234663852886e38)
    if SCALE == 2:
        s_enc = tensor_encode_scale(tl.load(stat_ptr), QMAX)
        s_dec = tl.math.div_rn(1.0, s_enc)
        if QMAX == 6.0 or QMAX == 7.0 or QMAX == 448.0:  # div_qmax's grid maxima
            # the two divisions per block in a few instructions (the reciprocal's IEEE division for a tensor at
            # either end of FP32: a uniform branch)
            s_b = ue4m3_block_scale(amax, s_enc, QMAX, True)
            if rcp_rn_exact(s_enc):
                encode = tl.where(s_b > 0, rcp_rn(s_b * s_dec), 0.0)
            else:
                encode = tl.where(s_b > 0, encode_factor(s_b * s_dec), 0.0)
        else:
            s_b = ue4m3_block_scale(amax, s_enc, QMAX)
            encode = tl.where(s_b > 0, encode_factor(s_b * s_dec), 0.0)
        block = s_b
    else:
        e = e8m0_exponent(amax, SCALE == 1, QM, QE, EMAX)
        encode = pow2(-e)
        block = pow2(e)
        s_dec = 1.0
    scaled = x * expand_blocks(encode, BM, BK, BR, BC)
    m = tl.abs(scaled)
    if SR:  # the attention kernels quantize dS in the MMA layout: sr_uniforms_each
        u = sr_uniforms_each(seed, rows, col0, KP, BM, BK)
    else:
        u = m
    q = with_sign_of(round_grid(m, u, GRID, SR), scaled)
    return q * expand_blocks(tl.where(bad, float("nan"), block), BM, BK, BR, BC), s_dec


@triton.jit
def with_sign_of(q, scaled):
    """q (>= 0) with scaled's sign bit: the reference's sign (hf_fp4.numerics.formats.encode takes the scaled value's
    sign bit, so a negative value that rounds or underflows to zero is -0) in one LOP3, where a compare and a select
    gave +0 for a scaled value that underflowed to -0."""
    sign = scaled.to(tl.uint32, bitcast=True) & 0x80000000
    return (q.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits(x):
    """The bits (int16) of FP32 x rounded to BF16, ties to even, NaN kept NaN: by hand, because Triton's
    interpreter truncates in .to(tl.bfloat16) (and a carry out of an all-ones NaN payload would reach the sign)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def round_to_bf16(x):
    """FP32 x rounded to the nearest BF16 value (ties to even), kept in FP32: bf16_bits' rounding (NaN stays
    NaN), by hand because Triton's interpreter truncates in .to(tl.bfloat16)."""
    return (bf16_bits(x).to(tl.int32) << 16).to(tl.float32, bitcast=True)


def grid_constants(grid: Grid) -> dict:
    """The constexpr arguments of a grid: id, float-format parameters, max as (mantissa, exponent), emax."""
    import math

    from hf_fp4.numerics.formats import grid_max

    emin, mbits = GRID_PARAMS[grid]
    qm, qe = math.frexp(grid_max(grid))
    return dict(GRID=GRID_IDS[grid], EMIN=emin, MBITS=mbits, QMAX=grid_max(grid), QM=qm * 2, QE=qe - 1,
                EMAX=GRID_EMAX[grid])
