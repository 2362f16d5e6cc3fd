"""Triton kernels vs the reference, bit for bit (atol=0, rtol=0).

On CPU these run under TRITON_INTERPRET=1 at small sizes (set here before triton is imported); the
`gpu` tests repeat them at large sizes on CUDA (scripts/gpu_check.sh).
"""
import dataclasses
import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_fp4  # noqa: E402
from hf_fp4 import QuantSpec, apply_hadamard, quantize, seeded_signs  # noqa: E402
from hf_fp4.nn.recipe import PRESET_NAMES, linear_recipe, preset  # noqa: E402

triton_quant = pytest.importorskip("hf_fp4.kernels.quant")
from hf_fp4.kernels.numerics import philox4x32, rand16x  # noqa: E402  (globals of the Triton test kernels)
DEV = "cuda" if CUDA else "cpu"


def operand_specs():
    """Every operand spec of every preset recipe (RTN and SR as the recipes use them), plus the formats."""
    specs = {s for name in PRESET_NAMES for s in preset(name).linear.operand_specs()}
    specs |= set(linear_recipe("mxfp8").operand_specs())  # tib's q/k projections
    specs |= {QuantSpec.preset(n) for n in QuantSpec.presets()}
    specs |= {dataclasses.replace(s, rounding="stochastic") for s in list(specs)}
    return sorted(specs, key=str)


def wide(rows, cols, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 12, (rows, 1), generator=g).float())
    x[0, : min(cols, 40)] = 0.0
    x[-1, -1] = 3e4
    return x.to(dtype).to(DEV)


def assert_same(a, b):
    assert torch.equal(a.codes, b.codes)
    raw = lambda s: s if s.dtype == torch.float32 else s.view(torch.uint8)  # noqa: E731
    assert torch.equal(raw(a.scales), raw(b.scales))
    assert (a.tensor_scale is None) == (b.tensor_scale is None)
    if a.tensor_scale is not None:
        assert torch.equal(a.tensor_scale.cpu(), b.tensor_scale.cpu())
    torch.testing.assert_close(a.dequantize(), b.dequantize(), atol=0, rtol=0, equal_nan=True)


def test_philox_twin_matches_tl_randint4x_and_the_kernels_draws():
    """The reference's Philox words (hf_fp4.numerics.philox) against Triton's tl.randint4x and the kernels' own
    philox4x32 (one wide multiply per product pair), and the kernels' 16 uniforms a call (rand16x) against the
    reference's byte_uniforms: every value bit for bit, for seeds of both signs and above 2^32 and counters above
    2^32 (the interpreter here, the GPU's compiled code in the GPU suite)."""
    import triton
    import triton.language as tl

    from hf_fp4.numerics.philox import byte_uniforms, philox_words

    @triton.jit
    def draw(words_out, u_out, seed_ptr, N: tl.constexpr):
        offs = tl.arange(0, N).to(tl.int64) + (1 << 33) + tl.program_id(0) * N
        at = tl.arange(0, N) + tl.program_id(0) * N
        seed = tl.load(seed_ptr)  # a device-side int64 seed, as the operand kernels read it
        a0, a1, a2, a3 = tl.randint4x(seed, offs)
        b0, b1, b2, b3 = philox4x32(seed, offs)
        total = N * tl.num_programs(0)
        tl.store(words_out + at, a0.to(tl.int32, bitcast=True))
        tl.store(words_out + total + at, a1.to(tl.int32, bitcast=True))
        tl.store(words_out + 2 * total + at, a2.to(tl.int32, bitcast=True))
        tl.store(words_out + 3 * total + at, a3.to(tl.int32, bitcast=True))
        tl.store(words_out + 4 * total + at, b0.to(tl.int32, bitcast=True))
        tl.store(words_out + 5 * total + at, b1.to(tl.int32, bitcast=True))
        tl.store(words_out + 6 * total + at, b2.to(tl.int32, bitcast=True))
        tl.store(words_out + 7 * total + at, b3.to(tl.int32, bitcast=True))
        us = rand16x(seed, offs)
        for i in tl.static_range(16):
            tl.store(u_out + at * 16 + i, us[i])

    n, programs = 512, 2
    words_out = torch.empty(8 * n * programs, dtype=torch.int32, device=DEV)
    u_out = torch.empty(16 * n * programs, device=DEV)
    offsets = torch.arange(n * programs) + (1 << 33)
    for seed in (0, 977, 2**32 + 5, -(2**62) - 3, 2**63 - 1):
        draw[(programs,)](words_out, u_out, torch.tensor([seed], dtype=torch.int64, device=DEV), n)
        got = words_out.cpu().view(8, n * programs).to(torch.int64) & 0xFFFFFFFF
        ref = philox_words(seed, offsets)
        for i, w in enumerate(ref):
            assert torch.equal(got[i], w), i  # tl.randint4x
            assert torch.equal(got[4 + i], w), i  # the kernels' philox4x32
        assert torch.equal(u_out.cpu().view(n * programs, 16), byte_uniforms(ref))


def test_philox_noise_is_sixteen_byte_uniforms_per_call_in_row_order():
    """philox_noise's layout, built here element by element from the words with Python integers: element (r, c) is
    byte c % 4 of word (c % 16) // 4 of the call at r * ceil(Kp / 16) + c // 16, as (byte + 1/2) / 256 -- for a
    width that is a multiple of 16 and one that is not (a row's last call partly used)."""
    from hf_fp4.numerics.philox import philox_noise, philox_words

    for rows, cols in ((3, 48), (4, 40)):
        per_row = -(-cols // 16)
        words = philox_words(-12345, torch.arange(rows * per_row))
        want = torch.empty(rows, cols)
        for r in range(rows):
            for c in range(cols):
                word = int(words[(c % 16) // 4][r * per_row + c // 16])
                want[r, c] = ((word >> (8 * (c % 4))) & 0xFF) / 256 + 1 / 512
        assert torch.equal(philox_noise(-12345, (rows, cols)), want)
    u = philox_noise(7, (64, 1024))
    assert len(torch.unique(u)) == 256 and float(u.min()) == 1 / 512 and float(u.max()) == 1 - 1 / 512
    assert abs(float(u.double().mean()) - 0.5) < 0.002


@pytest.mark.parametrize("spec", operand_specs(), ids=str)
@pytest.mark.parametrize("shape", [(40, 72), (33, 100)])
def test_kernel_matches_reference_bit_for_bit(spec, shape):
    x = wide(*shape, seed=hash(str(spec)) % 1000)
    ref = quantize(x, spec, seed=11)
    assert_same(triton_quant.triton_quantize(x, spec, seed=11), ref)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp4_up", "ufp4"])
def test_kernel_transposed_orientation_reads_strides(name):
    x = wide(48, 80, seed=3, dtype=torch.bfloat16)
    spec = QuantSpec.preset(name)
    assert_same(triton_quant.triton_quantize(x, spec, transpose=True), quantize(x.t().contiguous(), spec))


@pytest.mark.parametrize("h,signed", [(16, True), (32, False)])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "ufp4"])
def test_kernel_fuses_hadamard_exactly(name, h, signed):
    x = wide(32, 96, seed=4)
    signs = seeded_signs(h, 9) if signed else None
    spec = dataclasses.replace(QuantSpec.preset(name), rounding="stochastic")
    ref = quantize(apply_hadamard(x, h, signs), spec, seed=5)
    assert_same(triton_quant.triton_quantize(x, spec, seed=5, hadamard=h, signs=signs), ref)


def test_kernel_fuses_mean_bias_removal():
    x = wide(40, 64, seed=6) + 3.0
    mu = x.float().mean(0)
    spec = QuantSpec.preset("mxfp4")
    assert_same(triton_quant.triton_quantize(x, spec, mu=mu), quantize(x.float() - mu, spec))


def test_kernel_sr_same_seed_same_bits_other_seed_other_bits():
    x = wide(32, 64, seed=7)
    spec = dataclasses.replace(QuantSpec.preset("nvfp4"), rounding="stochastic")
    a = triton_quant.triton_quantize(x, spec, seed=1)
    assert torch.equal(a.codes, triton_quant.triton_quantize(x, spec, seed=1).codes)
    assert not torch.equal(a.codes, triton_quant.triton_quantize(x, spec, seed=2).codes)


def test_kernel_nan_policy():
    x = wide(32, 64, seed=8)
    x[3, 5] = math.nan
    with pytest.raises(hf_fp4.NonFiniteError):
        triton_quant.triton_quantize(x, QuantSpec.preset("nvfp4"))
    for name in ("nvfp4", "mxfp4", "mxfp8"):
        spec = dataclasses.replace(QuantSpec.preset(name), nonfinite="propagate")
        assert_same(triton_quant.triton_quantize(x, spec), quantize(x, spec))


def test_quantize_api_runs_the_kernel():
    x = wide(16, 64, seed=9)
    assert_same(quantize(x, "mxfp4", backend="triton"), quantize(x, "mxfp4"))
    with pytest.raises(ValueError, match="valid: reference, triton"):
        quantize(x, "mxfp4", backend="cuda")
    with pytest.raises(ValueError, match="pass seed="):  # the kernels draw with Philox, not a torch.Generator
        quantize(x, "mxfp4", backend="triton", generator=torch.Generator())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", operand_specs(), ids=str)
def test_kernel_matches_reference_at_large_sizes_on_gpu(spec):
    x = wide(4096, 4096 + 32, seed=12, dtype=torch.bfloat16)
    assert_same(triton_quant.triton_quantize(x, spec, seed=3), quantize(x, spec, seed=3))
    assert_same(triton_quant.triton_quantize(x, spec, seed=3, transpose=True),
                quantize(x.t().contiguous(), spec, seed=3))




# ------------------------------------------------------------------------------------------------
# GEMM operands (kernels/src/operand.py): both orientations of a tensor from one pass, equal to the
# reference's dequantized values bit for bit, for every form a recipe can ask for.
from exactness import FP32_BITS, FP8_MMA_BITS, assert_within_accumulation_error  # noqa: E402
from hf_fp4.nn.operands import OperandPlan, fp8_capable, gemm, operand_values, reference_operand  # noqa: E402


def operand_cases():
    cases = []
    for spec in operand_specs():
        if spec.scale.value == "fp32":
            continue  # research-only scales run on the reference backend
        for form in ["bf16"] + (["fp8"] if fp8_capable(spec) else []):
            for h in ([0, 16, 32, 64] if spec.block[0] == 1 else [0]):  # 16 / 32 = a 1 x 16 / 32 block: _emit_across
                cases.append((spec, form, h))
    return cases


def plan_for(spec, form, h, signed):
    return OperandPlan.single(spec, form, h, signed)


def assert_operands_exact(t, plans, seeds, signs, mu=None, tile=None):
    from hf_fp4.kernels.operand import triton_operands

    ops = triton_operands(t, plans, seeds, signs, mu, tile=tile)
    centred = t.float() - mu if mu is not None else t.float()
    for i, (op, plan, view) in enumerate(zip(ops, plans, (centred, centred.t()))):
        if plan is None:
            assert op is None
            continue
        ref = reference_operand(view, plan, int(seeds[i]), signs[i]).data
        got = operand_values(op, plan, view.shape[0], view.shape[1])
        torch.testing.assert_close(got, ref, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"{plan}: {m}")
        assert same_signs(got, ref), plan  # assert_close takes -0 for +0
    return ops


def same_signs(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The sign bits agree wherever the reference is not NaN (-0.0 against +0.0 included)."""
    got, want = got.cpu(), want.cpu()
    real = ~torch.isnan(want)
    return torch.equal(torch.signbit(got)[real], torch.signbit(want)[real])


@pytest.mark.parametrize("spec,form,h", operand_cases(), ids=str)
def test_operand_kernel_both_orientations_match_reference(spec, form, h):
    t = wide(40, 72, seed=hash((str(spec), form, h)) % 1000)
    signs = (seeded_signs(h, 5), seeded_signs(h, 6)) if h == 16 else (None, None)
    plans = (plan_for(spec, form, h, signs[0] is not None), plan_for(spec, form, h, signs[1] is not None))
    assert_operands_exact(t, plans, torch.tensor([7, -2**40], device=DEV), signs)


@pytest.mark.parametrize("grid", ["e2m1", "e1m2"])
def test_sr_with_blocks_of_8_on_a_width_of_8_mod_16_matches_the_reference(grid):
    """A Philox call serves 16 columns: with 1 x 8 blocks a padded width of 8 mod 16 leaves each row's last call
    half used (counters per row, ceil(Kp / 16) a row), in the packed-code quantizer and in both operand
    orientations (rows: 40 columns; the transposed one: 24 rows)."""
    spec = QuantSpec(grid=grid, block=(1, 8), scale="ue4m3_fp32", rounding="stochastic")
    x = wide(24, 40, seed=3)
    assert_same(triton_quant.triton_quantize(x, spec, seed=-99), quantize(x, spec, seed=-99))
    plans = (plan_for(spec, "bf16", 0, False), plan_for(spec, "bf16", 0, False))
    assert_operands_exact(x, plans, torch.tensor([5, 2**35], device=DEV), (None, None))


@pytest.mark.parametrize("name,form", [("nvfp4", "bf16"), ("ufp4", "bf16"), ("mxfp4", "bf16"), ("mxfp4", "fp8")])
def test_a_negative_value_quantized_to_zero_is_minus_zero_as_in_the_reference(name, form):
    """The reference's code keeps the scaled value's sign bit (formats.encode), so a negative value whose scaled form
    underflows to -0 (a block holding ~3e38 beside -1e-30) or whose block scale is 0 (a block ~2^-40 below a two-level
    tensor's amax) dequantizes to -0.0.  The operand kernels give the same -0.0 (a compare and select gave +0.0)."""
    t = wide(40, 64, seed=5)
    t[5, 0], t[5, 1] = 3e38, -1e-30
    t[6, 32:64] = -(2.0 ** -40)
    plans = (plan_for(QuantSpec.preset(name), form, 0, False), plan_for(QuantSpec.preset(name), form, 0, False))
    ref = reference_operand(t.float(), plans[0], 7, None).data
    assert torch.signbit(ref[5, 1]) and ref[5, 1] == 0  # the case is there
    assert_operands_exact(t, plans, torch.tensor([7, 8], device=DEV), (None, None))
    if form == "bf16":  # and the in-register quantizer of the attention and SharQ kernels
        from hf_fp4.kernels.numerics import grid_constants
        from hf_fp4.kernels.quant import SCALE_CODES
        from hf_fp4.numerics.formats import flush_subnormals

        spec, x = QuantSpec.preset(name), t.float()
        out, stat = torch.empty_like(x), flush_subnormals(x).abs().max().reshape(1)
        _tile_fake_quantize_kernel[(triton.cdiv(40, 32), 64 // 32)](
            x, out, stat, 0, 40, 64, 64, BM=32, BK=32, BR=1, BC=spec.block[1], **grid_constants(spec.grid),
            SCALE=SCALE_CODES[spec.scale], SR=False)
        want = quantize(x, spec).dequantize(torch.float32)
        assert torch.equal(out, want) and same_signs(out, want), name


@pytest.mark.parametrize("spec,h", [(s, h) for s in operand_specs() if fp8_capable(s)
                                     for h in ([0, 32, 256] if s.block[0] == 1 else [0])], ids=str)
def test_fp8_operands_of_widely_spread_rows_and_columns_are_exact(spec, h):
    """FP8 operands whose rows and columns lie up to 2^36 apart (values over E4M3's whole range), both
    orientations, with and without a 32 / 256 Hadamard (32: B made across row tiles, lost blocks included): every
    value is the reference's, and the GEMM of the pair
    is within FP32 accumulation error under the interpreter (an FP32 matmul); on the GPU (cuBLAS's row-scaled
    FP8 GEMM plus the correction) within the FP8 MMA's 14-bit accumulation (tests/exactness.py: the FP32
    bound is exceeded up to 5.6x there; the BF16 form below meets it)."""
    g = torch.Generator().manual_seed(21)
    t = torch.randn(208, 328, generator=g)
    t = t * torch.exp2(torch.randint(-18, 18, (208, 1), generator=g).float())
    t = t * torch.exp2(torch.randint(-18, 18, (1, 328), generator=g).float())
    t = t.to(DEV)
    signs = (seeded_signs(h, 5), seeded_signs(h, 6)) if h else (None, None)
    plans = (plan_for(spec, "fp8", h, h > 0), plan_for(spec, "fp8", h, h > 0))
    oa, ob = assert_operands_exact(t, plans, torch.tensor([3, 4], device=DEV), signs)
    ra = reference_operand(t.float(), plans[0], 3, signs[0]).data
    rb = reference_operand(t.float().t(), plans[1], 4, signs[1]).data
    # x-like (208 x 328) against a second operand of the same width: the A operand with itself
    bits = FP8_MMA_BITS if CUDA else FP32_BITS
    assert_within_accumulation_error(gemm(oa, oa, plans, 208, 208, torch.float32), ra, ra, str(spec), bits)
    assert_within_accumulation_error(gemm(ob, ob, plans, 328, 328, torch.float32), rb, rb, str(spec), bits)


@pytest.mark.parametrize("h", [0, 32])
def test_fp8_wgrad_operand_blocks_far_below_their_row_are_recorded_exactly(h):
    """B (blocks along t's rows: a wgrad operand) of a t whose 32-row groups lie 2^20 apart: every other group's
    blocks fall more than 14 binades below their row's largest, so their exact values go to the side buffer
    (flags, block exponents) -- the lost-block path, which spread rows and columns alone do not reach. With a
    32 Hadamard B is made across row tiles (kernels/src/operand._emit_across). Every value is the reference's."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(192, 96, generator=g) * torch.exp2(-20.0 * (torch.arange(192) // 32 % 2)).unsqueeze(1)
    signs = (None, seeded_signs(h, 6) if h else None)
    spec = QuantSpec.preset("mxfp4")
    plans = (plan_for(spec, "fp8", 0, False), plan_for(spec, "fp8", h, h > 0))
    _, ob = assert_operands_exact(t.to(DEV), plans, torch.tensor([3, 4], device=DEV), signs)
    assert int(ob.flags[-1]) == 1 and int((ob.eb > -128).sum()) > 0  # the lost path ran


@pytest.mark.parametrize("spec", [s for s in operand_specs() if fp8_capable(s)], ids=str)
def test_mx_operands_in_the_bf16_form_are_exact_however_widely_spread(spec):
    """The same widely spread operands in the BF16 form (fp8_gemms=False): values v x 2^e are the reference's,
    and the GEMM (BF16 tensor cores, FP32 accumulation on the GPU) is within FP32 accumulation error -- where
    the FP8 form's cuBLAS GEMM is not (benchmarks/results-2026-12-02.md)."""
    g = torch.Generator().manual_seed(22)
    t = torch.randn(208, 328, generator=g)
    t = t * torch.exp2(torch.randint(-18, 18, (208, 1), generator=g).float())
    t = (t * torch.exp2(torch.randint(-18, 18, (1, 328), generator=g).float())).to(DEV)
    plans = (plan_for(spec, "bf16", 0, False), plan_for(spec, "bf16", 0, False))
    oa, ob = assert_operands_exact(t, plans, torch.tensor([3, 4], device=DEV), (None, None))
    ra = reference_operand(t.float(), plans[0], 3, None).data
    rb = reference_operand(t.float().t(), plans[1], 4, None).data
    assert_within_accumulation_error(gemm(oa, oa, plans, 208, 208, torch.float32), ra, ra, str(spec))
    assert_within_accumulation_error(gemm(ob, ob, plans, 328, 328, torch.float32), rb, rb, str(spec))


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "ufp4"])
def test_operand_kernel_mixed_orientations_transposed_input_and_mean(name):
    """Different specs per orientation (fprop RTN vs wgrad SR + RHT), a transposed (strided) input, mu."""
    spec = QuantSpec.preset(name)
    form = "fp8" if fp8_capable(spec) else "bf16"
    sr = dataclasses.replace(spec, rounding="stochastic")
    base = wide(96, 48, seed=3, dtype=torch.bfloat16)
    t = base.t()  # [48, 96] view with swapped strides
    mu = t.float().mean(0) + 0.5
    plans = (plan_for(spec, form, 0, False), plan_for(sr, "bf16", 32, True))
    assert_operands_exact(t, plans, torch.tensor([11, 12], device=DEV), (None, seeded_signs(32, 1)), mu)
    assert_operands_exact(t, (None, plans[1]), torch.tensor([11, 12], device=DEV), (None, seeded_signs(32, 1)))


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "ufp4"])
def test_operand_kernel_transposed_orientation_from_a_second_load(name):
    """RELOAD tiles (the 4th tile entry) read t^T's tile with swapped strides instead of transposing in
    registers: the same operands, with a mean, a strided input and a Hadamard on the transposed side."""
    spec = QuantSpec.preset(name)
    form = "fp8" if fp8_capable(spec) else "bf16"
    sr = dataclasses.replace(spec, rounding="stochastic")
    t = wide(96, 48, seed=4, dtype=torch.bfloat16).t()
    mu = t.float().mean(0) - 0.25
    seeds = torch.tensor([5, 6], device=DEV)
    for plans, signs in (((plan_for(spec, form, 0, False), plan_for(spec, form, 0, False)), (None, None)),
                         ((plan_for(spec, form, 0, False), plan_for(sr, "bf16", 16, True)), (None, seeded_signs(16, 2)))):
        for m in (None, mu):
            assert_operands_exact(t, plans, seeds, signs, m, tile=(32, 64, 2, True))


def test_operand_kernel_reads_an_nd_tensor_as_its_flattened_matrix():
    """[B, S, C] in, through its strides (no reshape): the operands of the [B*S, C] matrix; a layout whose leading
    dims do not flatten (a permuted view) is reshaped first and gives the same."""
    from hf_fp4.kernels.operand import _rows_collapse, triton_operands

    spec = QuantSpec.preset("mxfp4")
    plans = (plan_for(spec, "fp8", 0, False), plan_for(spec, "fp8", 0, False))
    seeds = torch.tensor([1, 2], device=DEV)
    t3 = wide(48, 64, seed=5).reshape(3, 16, 64)
    permuted = t3.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, rows no longer collapsible
    assert _rows_collapse(t3) and not _rows_collapse(permuted)
    flat = assert_operands_exact(t3.reshape(48, 64), plans, seeds, (None, None))
    for t in (t3, permuted):
        for a, b in zip(triton_operands(t, plans, seeds), flat):
            for x, y in zip((a.data, a.scale, a.eb, a.flags), (b.data, b.scale, b.eb, b.flags)):  # side: unset
                assert torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x,
                                   y.view(torch.uint8) if y.dtype.itemsize == 1 else y)


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
@pytest.mark.parametrize("name,h,sr", [("nvfp4", 0, False), ("mxfp4", 0, False), ("nvfp4", 16, False),
                                       ("mxfp4", 32, False), ("nvfp4", 16, True)])
def test_operand_kernel_nan_blocks_become_nan(name, h, sr, bad):
    """A NaN or an Inf makes its block NaN in both orientations (h: B's Hadamard, the size of its block -- B made
    across row tiles -- so the NaN spreads over the rotated block, no further; with SR the NaN's row tile moves its
    block's Philox counters, kernels/src/operand._emit_across, and no other block's draws), and every other block
    keeps its reference value: the stats pass counts the non-finite value as 0 (its unchecked walk lets an Inf
    through and walks again)."""
    t = wide(32, 64, seed=8)
    t[16, 5] = bad  # row 16: the first row of B's second block, i = 0 of its row tiles
    spec = dataclasses.replace(QuantSpec.preset(name), nonfinite="propagate",
                               rounding="stochastic" if sr else "nearest")
    form = "fp8" if fp8_capable(spec) else "bf16"
    plans = (plan_for(spec, form, 0, False), plan_for(spec, form, h, h > 0))
    signs = (None, seeded_signs(h, 6) if h else None)
    ops = assert_operands_exact(t, plans, torch.tensor([1, 2], device=DEV), signs)
    assert torch.isnan(operand_values(ops[0], plans[0], 32, 64)[16]).sum() == spec.block[1]
    assert torch.isnan(operand_values(ops[1], plans[1], 64, 32)[5]).sum() == spec.block[1]
    assert torch.isnan(operand_values(ops[1], plans[1], 64, 32)).sum() == spec.block[1]


def _spread_case(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g)
    a[5, :32] *= 2.0**-20   # a block 20 binades below the rest of its row: beyond E4M3's reach ...
    b[:20, :32] *= 2.0**20  # ... meeting large values of b, so its products matter (and b's rows 0-19
    #                         now hold blocks 20 binades below their first: lost too)
    b[27] *= 2.0**-30       # a whole small row: its own reference exponent, nothing lost
    a[0, 7] = 5e3           # an outlier
    return a.to(DEV), b.to(DEV)


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4_up", "mxfp4_2d_up"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_is_exact_with_blocks_below_e4m3_range(name, out_dtype):
    """The FP8 GEMM equals the float64 product of the quantized operands (FP32 accumulation, then one
    rounding to the output dtype), including rows holding blocks E4M3 cannot fold: those tiles are
    recomputed on the device, and only those rows are flagged."""
    from hf_fp4.kernels.gemm import correct_lost_tiles, scaled_mm
    from hf_fp4.kernels.operand import triton_operands
    from hf_fp4.nn.operands import fp8_shift

    a, b = _spread_case(48, 40, 96, seed=1)
    spec = QuantSpec.preset(name)
    plan = plan_for(spec, "fp8", 0, False)
    seeds = torch.tensor([1, 2], device=DEV)
    oa, _ = triton_operands(a, (plan, None), seeds)
    ob, _ = triton_operands(b, (plan, None), seeds)
    if spec.block[0] == 1:
        assert oa.flags[:-1].nonzero().flatten().tolist() == [5]
        assert ob.flags[:-1].nonzero().flatten().tolist() == list(range(20))
    for op in (oa, ob):  # the last element says whether some row is flagged
        assert op.flags[-1] == int(op.flags[:-1].any())
    assert ob.flags[-1] == 1
    qa, qb = reference_operand(a, plan, 0, None).data, reference_operand(b, plan, 0, None).data
    out = gemm(oa, ob, (plan, plan), 48, 40, out_dtype)
    assert out.dtype == out_dtype and out.shape == (48, 40)
    assert_within_accumulation_error(out, qa, qb, name)
    with pytest.raises(AssertionError):  # the FP8 product alone misses the lost blocks: the check can fail
        assert_within_accumulation_error(scaled_mm(oa, ob, 48, 40, out_dtype), qa, qb)
    # every row flagged, small tiles, two programs: each program walks several tiles (the persistent loop)
    # and together they overwrite every tile of a garbage output
    out = torch.full((48, 40), float("nan"), dtype=out_dtype, device=DEV)
    correct_lost_tiles(out, oa._replace(flags=torch.ones_like(oa.flags)), ob, plan.spec.block[1],
                       fp8_shift(plan.spec.grid), plan.spec.block[1], fp8_shift(plan.spec.grid),
                       tile=(16, 16, 32), programs=2)
    assert_within_accumulation_error(out, qa, qb, name)
    # only one operand with lost blocks: its flag alone starts the correction
    clean = torch.randn(48, 96, generator=torch.Generator().manual_seed(3)).to(DEV)
    oc, _ = triton_operands(clean, (plan, None), seeds)
    assert not oc.flags.any()
    qc = reference_operand(clean, plan, 0, None).data
    assert_within_accumulation_error(gemm(oc, ob, (plan, plan), 48, 40, out_dtype), qc, qb, name)


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4_2d_up"])
def test_fp8_reference_exponent_is_the_rows_largest_block(name):
    """One reference exponent per operand row (cuBLAS's row-scaled FP8 GEMM): a row whose middle 128 columns
    lie 20 binades above the rest takes its scale from them (20 binades above the same row without them),
    and its other blocks, out of E4M3's reach, are lost and flagged; the GEMM stays exact."""
    from hf_fp4.kernels.operand import triton_operands

    g = torch.Generator().manual_seed(5)
    base, b = torch.randn(32, 384, generator=g), torch.randn(48, 384, generator=g)
    spec = QuantSpec.preset(name)
    a = base.clone()
    a[:, 128:256] *= 2.0**20
    a, b, base = a.to(DEV), b.to(DEV), base.to(DEV)
    plan = plan_for(spec, "fp8", 0, False)
    seeds = torch.tensor([1, 2], device=DEV)
    oa, _ = triton_operands(a, (plan, None), seeds)
    o_base, _ = triton_operands(base, (plan, None), seeds)
    ob, _ = triton_operands(b, (plan, None), seeds)
    assert oa.scale.shape == (32,)
    apart = torch.log2(oa.scale / o_base.scale).cpu()
    assert torch.all((apart >= 19) & (apart <= 21))
    assert oa.flags[:-1].all() and oa.flags[-1] == 1  # every row has blocks 20 binades below its reference
    assert not o_base.flags.any() and not ob.flags.any()
    qa, qb = reference_operand(a, plan, 0, None).data, reference_operand(b, plan, 0, None).data
    for op, q, n in ((oa, qa, 32), (ob, qb, 48)):
        assert torch.equal(operand_values(op, plan, n, 384).cpu(), q.cpu())
    for out_dtype in (torch.float32, torch.bfloat16):
        assert_within_accumulation_error(gemm(oa, ob, (plan, plan), 32, 48, out_dtype), qa, qb, name)


@pytest.mark.parametrize("pair", [("nvfp4", "nvfp4_2d"), ("ufp4", "ufp4"), ("mxfp8", "mxfp8"), ("int4", "int4"),
                                  ("mxfp4", "nvfp4")])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bf16_gemm_matches_float64_of_the_quantized_operands(pair, out_dtype):
    from hf_fp4.kernels.operand import triton_operands

    a, b = _spread_case(48, 40, 96, seed=2)
    pa, pb = (plan_for(QuantSpec.preset(n), "bf16", 0, False) for n in pair)
    seeds = torch.tensor([1, 2], device=DEV)
    oa, _ = triton_operands(a, (pa, None), seeds)
    ob, _ = triton_operands(b, (pb, None), seeds)
    out = gemm(oa, ob, (pa, pb), 48, 40, out_dtype)
    assert_within_accumulation_error(out, reference_operand(a, pa, 0, None).data,
                                     reference_operand(b, pb, 0, None).data, str(pair))


# (m, n, k, tile): tails in every dimension, several tiles per program (programs=2 below), one tile
FUSED_CASES = [(70, 56, 48, (32, 32, 16, 4, 1, 4, False)), (200, 304, 136, (64, 64, 32, 4, 1, 2, False)),
               (64, 64, 64, (64, 64, 64, 4, 1, 8, False))]


def _exact_sum_gemm_case(m: int, n: int, k: int, seed: int):
    """BF16 operands a [m, k], b [n, k] whose FP32 sums are exact in any order (|a| <= 1 and |b| <= 2^8 in steps of
    2^-3 and 2^5: every product and partial sum an integer times 2^2, below 2^24 for k <= 2^12), two FP32 tensor
    scales, and the fused GEMM's spec on them: BF16(exact product * (s_a * s_b)), one rounding."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randint(-8, 9, (m, k), generator=g).float() * 2.0**-3).bfloat16().to(DEV)
    b = (torch.randint(-8, 9, (n, k), generator=g).float() * 2.0**5).bfloat16().to(DEV)
    sa, sb = torch.tensor([0.3712], device=DEV), torch.tensor([1.77e-3], device=DEV)
    exact = (a.double() @ b.double().t()).float()
    return a, b, sa, sb, (exact * (sa * sb)).to(torch.bfloat16)


@pytest.mark.parametrize("m,n,k,tile", FUSED_CASES, ids=str)
def test_fused_bf16_gemm_rounds_the_scaled_accumulator_once(m, n, k, tile):
    """kernels/src/bf16_gemm.py: BF16(acc * FP32(s_a * s_b)) with one rounding.  Small-integer operands times
    powers of two make every FP32 sum exact whatever the order, so the output must equal torch's
    (exact product * (s_a * s_b)).to(bf16) bit for bit, in every element of every (tail) tile."""
    from hf_fp4.kernels.bf16_gemm import bf16_gemm

    a, b, sa, sb, expected = _exact_sum_gemm_case(m, n, k, seed=m + n + k)
    got = bf16_gemm(a, b, sa, sb, tile=tile if DEV == "cpu" else None, programs=2)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,n,k", [(4100, 3080, 2056), (8192, 4096, 4096), (37, 384, 512), (16384, 640, 1728),
                                   (16384, 320, 640)], ids=str)
def test_fused_bf16_gemm_rounds_once_at_full_size_on_gpu(m, n, k):
    """The GPU's kernel (warp-specialised, TMA, the default tile) at sizes with partial tiles and at the bench's: exact
    sums (|products| <= 2^8, k <= 2^12 of them: below FP32's 2^24) make it equal to torch's rounding bit for bit."""
    from hf_fp4.kernels.bf16_gemm import bf16_gemm

    a, b, sa, sb, expected = _exact_sum_gemm_case(m, n, k, seed=m + n)
    assert torch.equal(bf16_gemm(a, b, sa, sb).view(torch.int16), expected.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (scripts/multi_gpu_check.sh"
                    " STAGE=tests)")
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "ufp4"])
def test_a_layer_on_the_second_gpu_runs_its_kernels_there_whatever_device_is_current(name):
    """Triton launches on the *current* CUDA device: a layer on cuda:1 while cuda:0 is current must still run every
    kernel on cuda:1 (kernels/src/launch.launcher's device guard) -- forward and backward bit-identical to the same
    layer run with cuda:1 current (without the guard: an illegal address, or another GPU's memory read)."""
    import copy

    from hf_fp4.nn.linear import FP4Linear

    torch.manual_seed(5)
    base = torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16)
    x, dy = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(64, 128, dtype=torch.bfloat16)
    got = []
    for current in (1, 0):
        with torch.cuda.device(current):
            layer = FP4Linear.from_linear(copy.deepcopy(base), preset(name).linear, name="p").to("cuda:1")
            layer.backend = "triton"
            xs = x.to("cuda:1").requires_grad_(True)
            y = layer(xs)
            y.backward(dy.to("cuda:1"))
            torch.cuda.synchronize("cuda:1")
            got.append((y, xs.grad, layer.weight.grad))
    for a, b in zip(*got):
        assert a.device == b.device == torch.device("cuda", 1) and torch.equal(a, b)


def test_fused_bf16_gemm_keeps_nan_in_its_row_and_refuses_what_it_cannot_take():
    from hf_fp4.kernels.bf16_gemm import aligned, bf16_gemm, fits

    g = torch.Generator().manual_seed(4)
    a = torch.randn(40, 64, generator=g).bfloat16().to(DEV)
    b = torch.randn(48, 64, generator=g).bfloat16().to(DEV)
    a[3, 17] = float("nan")
    one = torch.ones(1, device=DEV)
    out = bf16_gemm(a, b, one, one, tile=(16, 16, 16, 4, 1, 2, False) if DEV == "cpu" else None)
    assert out[3].isnan().all() and out[torch.arange(40) != 3].isfinite().all()
    assert not fits(a, b[:44])            # an output row of 88 bytes: not whole 16 bytes
    assert not fits(a, b.t().contiguous().t())  # b's columns not of unit stride
    assert not fits(a.float(), b)
    assert not aligned(a[:, 1:], b[:, 1:])  # rows that start 2 bytes in
    for bad in ((a, b[:44]), (a[:, 1:], b[:, 1:])):
        with pytest.raises(ValueError, match="16-byte"):
            bf16_gemm(*bad, one, one)
    with pytest.raises(ValueError, match="widths differ"):
        bf16_gemm(a, b[:, :32], one, one)


def test_the_bf16_gemm_op_takes_a_misaligned_view_through_torch_mm_with_the_same_roundings():
    """A view whose rows fit TMA but whose start does not (16 bytes) -- which a compiler's trace cannot see -- goes
    through torch.mm's FP32 output and the epilogue pass: with exact sums both give the same bits."""
    from hf_fp4.kernels.bf16_gemm import aligned, fits
    from hf_fp4.nn.operands import _bf16_gemm_kernels

    a, b, sa, sb, expected = _exact_sum_gemm_case(48, 40, 64, seed=9)
    store = torch.zeros(48 * 64 + 1, dtype=torch.bfloat16, device=DEV)
    shifted = store[1:].view(48, 64)  # 2 bytes past an aligned start
    shifted.copy_(a)
    assert fits(shifted, b) and not aligned(shifted, b) and aligned(a, b)
    for operand in (a, shifted):
        assert torch.equal(_bf16_gemm_kernels(operand, b, sa, sb).view(torch.int16), expected.view(torch.int16))


def test_an_output_that_the_default_tile_pads_by_over_a_tenth_takes_the_narrow_tile():
    """bf16_gemm.default_tile: BN 256 pads 640 columns to 768 and 320 to 512 (bench-50m's), 1728 to 1792 (3.7%,
    kept), 4096 / 512 / 2048 not at all; the narrow tile was faster on all six padded bench-50m GEMMs (session 31)."""
    from hf_fp4.kernels.bf16_gemm import NARROW_TILE, TILE, default_tile

    assert [default_tile(n) for n in (640, 320, 384)] == [NARROW_TILE] * 3
    assert [default_tile(n) for n in (1728, 4096, 512, 2048, 5632, 14336)] == [TILE] * 6


def test_a_long_contraction_onto_few_output_tiles_goes_to_torch_mm_with_the_same_roundings(monkeypatch):
    """A small weight's wgrad -- an output of fewer tiles than half the GPU's SMs, summed over K >= LONG_K -- runs on
    torch.mm's FP32 output and the epilogue pass (cuBLAS splits K; one persistent program per tile walks all of K),
    a shorter contraction or a wider output on the fused kernel: both give the exact sums' bits."""
    from hf_fp4.kernels import bf16_gemm as fused
    from hf_fp4.nn.operands import _bf16_gemm_kernels

    launched = []
    kernel = fused.bf16_gemm
    monkeypatch.setattr(fused, "bf16_gemm", lambda *args: launched.append(args[0].shape) or kernel(*args))
    monkeypatch.setattr(fused, "TILE", (16, 16, 16, 4, 1, 2, False))  # the interpreter's 4 programs: 2 tiles are half
    monkeypatch.setattr(fused, "NARROW_TILE", fused.TILE)
    monkeypatch.setattr(fused, "LONG_K", 64)
    for (m, n, k), on_kernel in (((16, 16, 64), False), ((16, 16, 48), True), ((24, 16, 64), True),
                                 ((40, 24, 64), True)):
        a, b, sa, sb, expected = _exact_sum_gemm_case(m, n, k, seed=m + k)
        launched.clear()
        assert torch.equal(_bf16_gemm_kernels(a, b, sa, sb).view(torch.int16), expected.view(torch.int16))
        assert launched == ([(m, k)] if on_kernel else []), (m, n, k)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,n,k", [(640, 640, 16384), (1728, 640, 16384), (320, 640, 4096)], ids=str)
def test_bench_50m_wgrads_go_to_torch_mm_with_the_same_roundings_on_gpu(m, n, k):
    """bench-50m's wgrads (outputs of 9-42 tiles over 16,384 tokens) take the torch.mm route on the GPU, and its
    split-K sums round as the fused kernel does: exact sums (|products| <= 2^8, k <= 2^14) give torch's bits."""
    from hf_fp4.kernels.bf16_gemm import long_and_narrow
    from hf_fp4.nn.operands import _bf16_gemm_kernels

    a, b, sa, sb, expected = _exact_sum_gemm_case(m, n, k, seed=m + k)
    assert long_and_narrow(a, b)
    assert torch.equal(_bf16_gemm_kernels(a, b, sa, sb).view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("name", ["nvfp4", "ufp4"])
def test_fp4linear_on_the_fused_bf16_gemm_compiles_fullgraph_and_equals_eager(name):
    """The BF16-form layers' fused GEMM under torch.compile(fullgraph=True): no graph break (a break there left
    reduce-overhead training without its CUDA graphs: 0.13x of bf16 on the H100, session 26) and forward +
    backward bit-identical to eager, where both run the kernel (Triton's interpreter here)."""
    import torch._dynamo

    from hf_fp4.nn.linear import FP4Linear

    torch._dynamo.reset()
    torch.manual_seed(3)
    base = torch.nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
    layers = [FP4Linear.from_linear(base, preset(name).linear, name="p").to(DEV) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    for layer in layers:
        layer.backend = "triton"
    compiled = torch.compile(layers[1], fullgraph=True, backend="aot_eager")
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    dy = torch.randn(32, 48, dtype=torch.bfloat16)
    got = []
    for layer in (layers[0], compiled):
        xs = x.clone().to(DEV).requires_grad_(True)
        y = layer(xs)
        y.backward(dy.to(DEV))
        got.append((y, xs.grad))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert torch.equal(layers[0].weight.grad, layers[1].weight.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,n,k", [(37, 384, 512), (2048, 768, 384), (4096, 1536, 512)], ids=str)
def test_the_bf16_gemm_writes_every_output_element_on_gpu(m, n, k):
    """compute-sanitizer's initcheck (session 25) reported reads of unwritten memory where the BF16-form GEMM's
    epilogue (kernels/gemm.py: scale_output) reads torch.mm's FP32 output, in the per-expert loop at the MoE study's
    sizes.  Here the caching allocator holds NaN-filled blocks of the output's sizes when the GEMM runs: an element
    that torch.mm or the epilogue left unwritten would come out NaN (or whatever was there) instead of the product."""
    from hf_fp4.kernels.operand import triton_operands

    a, b = _spread_case(m, n, k, seed=3)
    plan = plan_for(QuantSpec.preset("nvfp4"), "bf16", 0, False)
    seeds = torch.tensor([1, 2], device=DEV)
    (oa, _), (ob, _) = triton_operands(a, (plan, None), seeds), triton_operands(b, (plan, None), seeds)
    qa, qb = reference_operand(a, plan, 0, None).data, reference_operand(b, plan, 0, None).data
    for _ in range(3):
        poison = [torch.full((m, n), float("nan"), device=DEV, dtype=dtype) for dtype in (torch.float32,
                                                                                      torch.bfloat16) * 8]
        del poison
        out = gemm(oa, ob, (plan, plan), m, n, torch.bfloat16)
        assert out.isfinite().all()
        assert_within_accumulation_error(out, qa, qb, f"{m}x{n}x{k}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec,form,h", [c for c in operand_cases() if c[2] in (0, 16)], ids=str)
def test_operand_kernel_matches_reference_at_large_sizes_on_gpu(spec, form, h):
    t = wide(4096 + 16, 2048 + 32, seed=12, dtype=torch.bfloat16)
    signs = (seeded_signs(h, 5), seeded_signs(h, 6)) if h else (None, None)
    plans = (plan_for(spec, form, h, h > 0), plan_for(spec, form, h, h > 0))
    assert_operands_exact(t, plans, torch.tensor([3, 4], device=DEV), signs)


@pytest.mark.parametrize("grid,qmax,step_pts", [
    ("e2m1", 6.0, [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]),        # every E2M1 midpoint
    ("e1m2", 1.75, [0.125 + 0.25 * i for i in range(7)]),          # every E1M2 midpoint
    ("int4", 7.0, [0.5 + i for i in range(7)])])                    # every INT4 midpoint
@pytest.mark.parametrize("form", ["fp8", "bf16"])
def test_operand_kernel_breaks_exact_ties_to_the_even_code(grid, qmax, step_pts, form):
    """With power-of-two scales the grid's midpoints are hit exactly: each must round to the even code, as
    the reference (checked against ml_dtypes) does, in both orientations."""
    spec = QuantSpec(grid, (1, 32), "e8m0_floor")  # amax = qmax gives the scale 1: values are grid units
    row = torch.tensor(step_pts + [-p for p in step_pts] + [qmax] + [0.0] * (32 - 2 * len(step_pts) - 1))
    t = torch.stack([row.roll(i) * 2.0 ** (i % 5 - 2) for i in range(32)]).to(DEV)  # several binades
    plan = plan_for(spec, form, 0, False)
    assert_operands_exact(t, (plan, plan), torch.tensor([1, 2], device=DEV), (None, None))
    ref = reference_operand(t, plan, 0, None).data
    units = ref[0, :2 * len(step_pts)] / 0.25  # row 0 is scaled by 2^-2, so is its block scale
    even = {"e2m1": [0, 1, 1, 2, 2, 4, 4], "e1m2": [0, 0.5, 0.5, 1.0, 1.0, 1.5, 1.5],
            "int4": [0, 2, 2, 4, 4, 6, 6]}[grid]
    expected = torch.tensor(even + [-v for v in even], dtype=torch.float32, device=units.device)
    assert torch.equal(units, expected), (grid, units)  # the reference itself breaks ties to even


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hf_fp4.kernels.numerics import fake_quantize_tile, round_to_bf16  # noqa: E402


@triton.jit
def _tile_fake_quantize_kernel(x_ptr, out_ptr, stat_ptr, seed, M, K, KP, BM: tl.constexpr, BK: tl.constexpr,
                               BR: tl.constexpr, BC: tl.constexpr, GRID: tl.constexpr, EMIN: tl.constexpr,
                               MBITS: tl.constexpr, QMAX: tl.constexpr, QM: tl.constexpr, QE: tl.constexpr,
                               EMAX: tl.constexpr, SCALE: tl.constexpr, SR: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    inside = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=inside, other=0.0)
    y = fake_quantize_tile(x, stat_ptr, seed, rows, tl.program_id(1) * BK, KP, BM, BK, BR, BC, GRID, QMAX, QM, QE,
                           EMAX, SCALE, SR)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], y, mask=inside)


#: tiles of the in-register quantizer: the SharQ kernel's, and the attention kernels' (dQ: BM x BN; dK: BN x BM)
#: at their default and their causal-test sizes
TILE_SHAPES = [(32, 64), (32, 16), (16, 32), (64, 32), (32, 32)]


@pytest.mark.parametrize("tile", TILE_SHAPES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("spec", [s for s in operand_specs() if s.scale.value != "fp32"
                                  and s.grid.value != "e4m3"], ids=str)
def test_the_tile_fake_quantizer_is_the_reference(spec, tile):
    """kernels.numerics.fake_quantize_tile (the in-register quantizer of the SharQ and attention kernels) equals
    hf_fp4.quantize(...).dequantize() bit for bit: 1D and 2D blocks, E8M0 and two-level scales, nearest and
    stochastic rounding (Philox at the element's place in the padded matrix), ragged edges, every tile shape
    the kernels quantize in."""
    from hf_fp4.numerics.formats import flush_subnormals
    from hf_fp4.kernels.numerics import grid_constants
    from hf_fp4.kernels.quant import SCALE_CODES

    x = wide(45, 70, seed=9)
    br, bc = spec.block
    bm, bk = max(tile[0], br), max(tile[1], bc)
    kp = x.shape[1] + (-x.shape[1] % bc)
    stat = flush_subnormals(x.float()).abs().max().reshape(1)
    out = torch.empty_like(x)
    sr = spec.rounding.value == "stochastic"
    grid = (triton.cdiv(45, bm), triton.cdiv(70, bk))
    _tile_fake_quantize_kernel[grid](x, out, stat, 1234, 45, 70, kp, BM=bm, BK=bk, BR=br, BC=bc,
                                     **grid_constants(spec.grid), SCALE=SCALE_CODES[spec.scale], SR=sr)
    want = quantize(x, spec, seed=1234 if sr else None).dequantize(torch.float32)
    assert torch.equal(out, want) and same_signs(out, want), str(spec)


@pytest.mark.parametrize("name", ["nvfp4", "int4"])  # grid maxima 6 and 7, two of kernels.numerics.div_qmax's
@pytest.mark.parametrize("s_enc_log2", [0, 116, 117], ids=["ordinary", "fast-largest", "ieee-reciprocal"])
def test_the_tile_quantizers_fast_scale_divisions_give_the_references_block_scales(name, s_enc_log2):
    """quantize_tile's block scale divides by the grid max with div_qmax (three instructions, an ulp off at some
    subnormal quotients) and takes the encode factor with rcp_rn where s_enc <= 2^116 (else the IEEE division):
    bit for bit the reference's on blocks whose amax / qmax is misrounded by div_qmax (checked here with exact
    rationals), with s_enc at the largest value the fast reciprocal takes, at the cap 2^117 (the IEEE branch), and
    ordinary; blocks at E4M3 ties of the block scale and just above; the tensor's own block."""
    from fractions import Fraction

    from fp32_values import blocks_with_amax, f32, fp32_rn, up
    from hf_fp4.kernels.numerics import grid_constants
    from hf_fp4.kernels.quant import SCALE_CODES

    spec = QuantSpec.preset(name)
    qmax = hf_fp4.numerics.formats.grid_max(spec.grid)
    tensor_amax = f32(448 * qmax * 2.0 ** -s_enc_log2)  # s_enc = 448 qmax / amax = 2^s_enc_log2
    amaxes = [tensor_amax]
    a = 2.0**-126  # the bottom binade, where div_qmax's misrounded quotients lie (every 12th amax for qmax 6)
    for _ in range(48):
        amaxes.append(a)
        a = up(a)
    for t in (1.0625, 1.1875, 12.5):  # E4M3 ties of s_b = amax / qmax * s_enc, and the next FP32 amax
        tie = f32(t * qmax * 2.0 ** -s_enc_log2)
        amaxes += [tie, up(tie)]
    c = fp32_rn(Fraction(1) / Fraction(qmax))
    misrounded = 0
    for am in map(Fraction, amaxes):
        q = fp32_rn(am * c)
        misrounded += fp32_rn(fp32_rn(am - q * qmax) * c + q) != fp32_rn(am / Fraction(qmax))
    assert misrounded > 0 or qmax == 7  # 7: div_qmax is exact everywhere (scripts/check_fast_division.c)
    x = blocks_with_amax(amaxes, 16).to(DEV)
    m, k = x.shape
    stat = x.abs().max().reshape(1)
    assert float(stat) == tensor_amax
    out = torch.empty_like(x)
    _tile_fake_quantize_kernel[(triton.cdiv(m, 32), 1)](x, out, stat, 0, m, k, k, BM=32, BK=16, BR=1, BC=16,
                                                        **grid_constants(spec.grid), SCALE=SCALE_CODES[spec.scale],
                                                        SR=False)
    want = quantize(x, spec).dequantize(torch.float32)
    assert (want != 0).any(dim=1).sum() > 4  # blocks that keep values: scales to compare
    assert torch.equal(out, want), name


def test_kernels_are_wrapped_for_the_compiler_only_while_one_traces():
    """hf_fp4.kernels.launch: eager launches skip wrap_triton (torch 2.11 sends each through a higher-order op);
    under dynamo and under the fake / proxy modes AOTAutograd and make_fx trace with, the launch is wrapped."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from hf_fp4.kernels.launch import tracing

    assert not tracing(torch.zeros(1))
    with FakeTensorMode() as mode:
        assert tracing()
        fake = torch.zeros(1)
    assert tracing(fake) and tracing(mode.from_tensor(torch.zeros(1)))  # a traced op's fake arguments
    traced = make_fx(lambda x: x + tracing())(torch.zeros(2))  # the graph recorded True
    assert torch.equal(traced(torch.zeros(2)), torch.ones(2))
    torch._dynamo.reset()
    assert torch.equal(torch.compile(lambda x: x + tracing(), backend="eager", fullgraph=True)(torch.zeros(2)),
                       torch.ones(2))
    assert not tracing()


def _specials(n, seed):
    """FP32 values that stress a BF16 rounding: ties (odd and even), near-ties, NaN with any payload, Inf,
    the largest finite values (which round up to Inf), subnormals, signed zeros, random values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7FFFFFFF, 0x7F800001, 0xFFC00000,
                         0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80008000, 0x00000000,
                         0x80000000], dtype=torch.int64).to(torch.int32)
    x[:bits.numel()] = bits.view(torch.float32)
    return x


@pytest.mark.parametrize("n", [4096 * 2, 1000])  # EVEN, and a masked tail
def test_scale_output_is_torchs_mul_and_cast_bit_for_bit(n):
    """The BF16-form GEMM's fused epilogue (kernels/src/gemm.scale_output) rounds exactly as
    (out * (sa * sb)).to(bf16) does: FP32 product of the scales, FP32 product, BF16 ties to even; NaN stays NaN."""
    from hf_fp4.kernels import gemm as gemm_kernels

    out = _specials(n, seed=n).reshape(-1, 8).to(DEV)
    for sa, sb in ((0.37, 3.1e-5), (1.0, 1.0), (2.0**-7, 1.7)):
        a_scale, b_scale = torch.tensor([sa], device=DEV), torch.tensor([sb], device=DEV)
        got = gemm_kernels.scale_output(out, a_scale, b_scale, torch.bfloat16)
        want = (out * (a_scale * b_scale)).to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.shape == out.shape
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        same = ~torch.isnan(want)
        assert torch.equal(got[same].view(torch.int16), want[same].view(torch.int16)), (sa, sb)
    # the kernel ran (not the torch fallback): a planted bug in the kernel's rounding would show
    assert gemm_kernels._kernel_device(out)


@triton.jit
def _round_to_bf16_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, round_to_bf16(tl.load(x_ptr + offs)))


def test_round_to_bf16_is_torchs_cast_and_keeps_nan():
    """round_to_bf16 (P before the P V and dV products of FP4 attention): torch's FP32 -> BF16 rounding on
    finite values and Inf, and NaN for every NaN payload (CUDA's all-ones one once came out -0.0)."""
    x = _specials(64, seed=3).to(DEV)
    out = torch.empty_like(x)
    _round_to_bf16_kernel[(1,)](x, out, N=64)
    want = x.to(torch.bfloat16).float()
    assert torch.equal(torch.isnan(out), torch.isnan(x))
    assert torch.equal(out[~torch.isnan(x)], want[~torch.isnan(x)])


def test_bf16_bits_keeps_nan_whatever_its_payload():
    """A NaN whose payload is all ones (CUDA's canonical 0x7FFFFFFF) must not carry into the sign bit and
    become -0.0 when rounded by hand (the exact-correction GEMM tiles and the epilogue use this rounding)."""
    from hf_fp4.kernels import gemm as gemm_kernels

    nan = torch.tensor([0x7FFFFFFF, 0x7F800001, -1], dtype=torch.int32).view(torch.float32).repeat(8).to(DEV)
    one = torch.ones(1, device=DEV)
    assert torch.isnan(gemm_kernels.scale_output(nan.reshape(4, 6), one, one, torch.bfloat16)).all()


@pytest.mark.parametrize("name,form,h,h_a", [("nvfp4", "bf16", 0, 0), ("ufp4", "bf16", 16, 16), ("mxfp4", "fp8", 0, 0),
                                              ("mxfp4", "fp8", 16, 16), ("nvfp4_2d", "bf16", 0, 0),
                                              ("nvfp4", "bf16", 16, 0), ("nvfp4", "bf16", 32, 0),
                                              ("mxfp4", "fp8", 32, 0)])
@pytest.mark.parametrize("rows", [256, 200])  # whole walks, and a last walk past the tensor's rows
def test_stats_pass_walking_several_row_tiles_matches_reference(monkeypatch, name, form, h, h_a, rows):
    """The stats pass's programs walk up to 8 row tiles each, keeping the tensor amax and the per-column amax
    in registers (kernels/src/operand._stats_steps): forced here at a small size, the operands stay the reference's.
    h: B's Hadamard, h_a: A's (B rotated -- NVFP4's x and dy with A plain, mxfp4_dh's x with A's per-row amax,
    UFP4's with A rotated: the stats pass's row-tile tuples, _stats_across)."""
    from hf_fp4.kernels import operand as operand_kernels

    monkeypatch.setattr(operand_kernels, "STATS_PROGRAMS", 1)
    assert operand_kernels._stats_steps(rows, 96, 64, 128) > 1
    t = wide(rows, 96, seed=rows + h)
    t[rows // 2 + 3, 9] = 2e5  # the tensor amax sits in a later row tile of its program's walk
    spec = QuantSpec.preset(name)
    signs = (seeded_signs(h_a, 5) if h_a else None, seeded_signs(h, 6) if h else None)
    plans = (plan_for(spec, form, h_a, h_a > 0), plan_for(spec, form, h, h > 0))
    assert_operands_exact(t, plans, torch.tensor([3, 4], device=DEV), signs)


@pytest.mark.parametrize("name,form", [("ufp4", "bf16"), ("nvfp4", "bf16"), ("mxfp4", "fp8")])
def test_stats_pass_rotated_amax_sits_in_any_output_of_a_block(monkeypatch, name, form):
    """Each orientation's rotated tensor amax comes from one output of one block -- output 15 of 16, which the
    last butterfly stage writes as a difference (kernels/src/numerics.hadamard_block_amax reduces that stage where
    it lies): a block equal to signs * row 15 of H_16 rotates to 4 * its scale at output 15 and 0 elsewhere."""
    from hf_fp4.kernels import operand as operand_kernels
    from hf_fp4.numerics.hadamard import _sylvester

    monkeypatch.setattr(operand_kernels, "STATS_PROGRAMS", 1)
    g = torch.Generator().manual_seed(11)
    t = torch.randn(128, 96, generator=g)
    signs = (seeded_signs(16, 5), seeded_signs(16, 6))
    last = _sylvester(16)[15].float()
    t[37, 32:48] = 900.0 * last * signs[0]  # A: rotates to 3600 at output 15 of its block
    t[64:80, 70] = -700.0 * last * signs[1]  # B (t's columns): -2800 at output 15
    spec = QuantSpec.preset(name)
    plans = (plan_for(spec, form, 16, True), plan_for(spec, form, 16, True))
    assert_operands_exact(t.to(DEV), plans, torch.tensor([3, 4], device=DEV), tuple(s.to(DEV) for s in signs))


# ------------------------------------------------------------------------------------------------
# Grouped operands and GEMMs (issue 16): a tensor's rows in groups, each quantized as a tensor of its own.
def _grouped_rows_case(counts, cols, align, seed):
    """Rows of experts' segments (each padded with zero rows to `align`, then 32 rows past them): t, RowGroups
    pieces (ids, starts) and the segments' starts."""
    g = torch.Generator().manual_seed(seed)
    seg = [-(-c // align) * align for c in counts]
    starts = [sum(seg[:i]) for i in range(len(counts))]
    t = torch.zeros(sum(seg) + 32, cols)
    ids = torch.zeros(t.shape[0], dtype=torch.int32)
    for e, (s, c, n) in enumerate(zip(starts, counts, seg)):
        scale = 2.0 ** float(torch.randint(-6, 7, (), generator=g))  # each expert its own magnitude
        t[s:s + c] = torch.randn(c, cols, generator=g) * scale
        ids[s:s + n] = e
    return t.to(torch.bfloat16), ids, starts


# (QuantSpec preset, A's Hadamard, B's Hadamard, SR): two-level 1D / 2D, B across row tiles (H 0, 16, 32) or on
# whole tiles (H 64), SR on E8M0 and two-level scales
GROUPED_OPERAND_CASES = [("nvfp4", 0, 16, True), ("nvfp4_2d", 0, 0, False), ("ufp4", 16, 16, True),
                         ("mxfp4", 0, 32, True), ("nvfp4", 16, 64, True)]


@pytest.mark.parametrize("name,h_a,h_b,sr", GROUPED_OPERAND_CASES, ids=str)
def test_grouped_operands_are_each_groups_reference_operands(name, h_a, h_b, sr):
    """One grouped call makes, for every group, the reference operands of that group's rows as a tensor of its
    own -- its tensor amax, its seed, SR coordinates from its first row and its own padded length -- in both
    orientations, bit for bit (an empty group included)."""
    from hf_fp4.kernels.operand import triton_operands
    from hf_fp4.numerics.operand_plan import RowGroups

    spec = QuantSpec.preset(name)
    spec = dataclasses.replace(spec, rounding="stochastic") if sr else spec
    pa, pb = OperandPlan.single(spec, "bf16", h_a, h_a == 16), OperandPlan.single(spec, "bf16", h_b, h_b == 16)
    counts = [37, 0, 16, 70]
    t, ids, starts = _grouped_rows_case(counts, 64, pb.k_align, seed=h_a + h_b)
    signs = (seeded_signs(16, 1) if h_a == 16 else None, seeded_signs(16, 2) if h_b == 16 else None)
    seeds = torch.randint(-2**40, 2**40, (len(counts), 2), generator=torch.Generator().manual_seed(3))
    groups = RowGroups(ids.to(DEV), torch.tensor(starts, dtype=torch.int32, device=DEV),
                       torch.tensor([pb.k_padded(c) for c in counts], dtype=torch.int32, device=DEV))
    oa, ob = triton_operands(t.to(DEV), (pa, pb), seeds.to(DEV), tuple(s.to(DEV) if s is not None else None
                                                                       for s in signs), groups=groups)
    two_level = spec.scale.value == "ue4m3_fp32"
    assert oa.scale.shape == ((len(counts),) if two_level else (1,))
    for e, (s, c) in enumerate(zip(starts, counts)):
        if c == 0:
            continue
        rows = t[s:s + c].float()
        for op, plan, view, sign, i in ((oa, pa, rows, signs[0], 0), (ob, pb, rows.t(), signs[1], 1)):
            ref = reference_operand(view, plan, int(seeds[e, i]), sign).data
            data = op.data[s:s + c] if i == 0 else op.data[:, s:]
            got = data[:ref.shape[0], :ref.shape[1]].float().cpu() * (op.scale[e] if two_level else op.scale).cpu()
            torch.testing.assert_close(got, ref, atol=0, rtol=0, msg=lambda m: f"group {e}, orientation {i}: {m}")


def _exact_case(shape, g):
    """BF16 values whose products and sums are exact in FP32 (small integers times 1/4): any summation order gives
    the same FP32 accumulator."""
    return (torch.randint(-6, 7, shape, generator=g).float() / 4).to(torch.bfloat16)


@pytest.mark.parametrize("scaled", [True, False])
def test_grouped_gemms_are_each_segments_product_scaled_and_rounded_once(scaled):
    """grouped_rows (fprop: stacked weights' rows; dgrad: W^T's columns) and grouped_contraction (wgrad) against
    each segment's product in float64, times the segment's two FP32 scales in FP32, rounded once to BF16: bit for
    bit (exact sums), empty segments included; rows past the last segment zero (the output is written everywhere,
    whatever it held)."""
    from hf_fp4.kernels.grouped_gemm import grouped_contraction, grouped_rows

    g = torch.Generator().manual_seed(0)
    e, n, k = 3, 40, 48
    bounds = [0, 16, 16, 96]
    ends = torch.tensor(bounds[1:], dtype=torch.int32, device=DEV)
    sa, sb = (torch.exp2(torch.randn(e, generator=g) * 8).to(DEV) for _ in range(2)) if scaled else (None, None)

    def expect(acc, i):
        acc = acc.float()
        return (acc * (sa[i] * sb[i]).cpu() if scaled else acc).to(torch.bfloat16)

    x, w, dy = _exact_case((112, k), g), _exact_case((e * n, k), g), _exact_case((112, n), g)
    y = grouped_rows(x.to(DEV), w.to(DEV), ends, n, k, n * k, sa, sb,
                     out=torch.full((112, n), 7.0, dtype=torch.bfloat16, device=DEV)).cpu()
    wt = w.t().contiguous()
    dx = grouped_rows(dy.to(DEV), wt.to(DEV), ends, k, n, n, sa, sb).cpu()
    dw = grouped_contraction(dy.t().contiguous().to(DEV), x.t().contiguous().to(DEV), ends, n, k, sa, sb).cpu()
    assert torch.equal(y[96:], torch.zeros(16, n, dtype=torch.bfloat16)) and not dx[96:].any()
    for i in range(e):
        s, t = bounds[i], bounds[i + 1]
        w_e = w[i * n:(i + 1) * n].double()
        assert torch.equal(y[s:t], expect(x[s:t].double() @ w_e.t(), i)), f"fprop segment {i}"
        assert torch.equal(dx[s:t], expect(dy[s:t].double() @ w_e, i)), f"dgrad segment {i}"
        assert torch.equal(dw[i], expect(dy[s:t].double().t() @ x[s:t].double(), i)), f"wgrad expert {i}"


def _fp8_group_values(op, plan, e, grouped_scale):
    """The real values of an FP8 operand with the row scales of group e (grouped_scale: [E, rows] scales)."""
    from hf_fp4.numerics.operand_plan import fp8_shift

    r_alloc, blc = op.data.shape[0], plan.spec.block[1]
    scale = (op.scale[e * r_alloc:(e + 1) * r_alloc] if grouped_scale else op.scale).float().cpu()
    lost = (op.eb != -128).repeat_interleave(blc, 1).cpu()
    side = (op.side.float() * torch.exp2(op.eb.float() - fp8_shift(plan.spec.grid)).repeat_interleave(blc, 1)).cpu()
    return torch.where(lost, side, op.data.float().cpu() * scale[:, None])


@pytest.mark.parametrize("name,h", [("mxfp4", 0), ("mxfp4", 32), ("mxfp4_2d_up", 0)])
def test_grouped_fp8_operands_and_gemms_hold_each_experts_reference(name, h):
    """The MX family's grouped path: x and dy in expert segments, the stacked weights grouped by expert, each
    group's FP8 operands the reference's bit for bit -- the transposed orientations' reference exponents and row
    scales per (row, expert) -- with blocks far below their row's (lost blocks, recorded exactly and flagged); the
    three grouped FP8 GEMMs within FP32 accumulation error of each segment's float64 product (the interpreter
    accumulates exactly; on the GPU the FP8 MMA's bound)."""
    from hf_fp4.kernels.grouped_gemm import grouped_contraction_fp8, grouped_rows_fp8
    from hf_fp4.kernels.operand import triton_operands
    from hf_fp4.numerics.operand_plan import RowGroups, fp8_shift

    spec = QuantSpec.preset(name)
    px = (OperandPlan.single(spec, "fp8"), OperandPlan.single(spec, "fp8", h))
    counts, e_n, k, n = [37, 0, 16, 70], 4, 96, 64  # n, k: multiples of the blocks (no block across experts)
    g = torch.Generator().manual_seed(5)
    t_x, ids, starts = _grouped_rows_case(counts, k, px[1].k_align, seed=7)
    t_dy, _, _ = _grouped_rows_case(counts, n, px[1].k_align, seed=8)
    # every other 32-row / 32-column chunk 2^-30 below the rest, and the partner operand of each GEMM the other way
    # round: every operand has blocks far below their row (lost to E4M3, recorded and flagged), and those carry
    # half of every product -- a GEMM that dropped them would be off by far more than the bound
    def far(n_):
        return -30.0 * (torch.arange(n_) // 32 % 2)

    rows_far, n_far, k_far = far(t_x.shape[0]), far(n), far(k)
    t_x = (t_x.float() * torch.exp2(rows_far[:, None] + k_far[None, :])).to(torch.bfloat16)
    t_dy = (t_dy.float() * torch.exp2(-30 - rows_far[:, None] - 30 - n_far[None, :])).to(torch.bfloat16)
    w = (torch.randn(e_n * n, k, generator=g) * torch.exp2(n_far.repeat(e_n)[:, None] - 30 - k_far[None, :])).to(
        torch.bfloat16)
    seg_groups = RowGroups(ids.to(DEV), torch.tensor(starts, dtype=torch.int32, device=DEV),
                           torch.tensor([px[1].k_padded(c) for c in counts], dtype=torch.int32, device=DEV))
    w_groups = RowGroups((torch.arange(e_n * n, dtype=torch.int32) // n).to(DEV),
                         torch.arange(0, e_n * n, n, dtype=torch.int32, device=DEV),
                         torch.full((e_n,), px[1].k_padded(n), dtype=torch.int32, device=DEV))
    zero = torch.zeros(e_n, 2, dtype=torch.int64, device=DEV)
    ox, oxt = triton_operands(t_x.to(DEV), px, zero, groups=seg_groups)
    ody, odyt = triton_operands(t_dy.to(DEV), px, zero, groups=seg_groups)
    ow, owt = triton_operands(w.to(DEV), (px[0], OperandPlan.single(spec, "fp8")), zero, groups=w_groups)
    assert all(int(o.flags[-1]) == 1 for o in (ox, oxt, ody, odyt, ow, owt))  # lost blocks in every operand
    ends = torch.tensor([s + -(-c // px[1].k_align) * px[1].k_align for s, c in zip(starts, counts)],
                        dtype=torch.int32, device=DEV)
    blocks = (spec.block[1], fp8_shift(spec.grid)) * 2
    y = grouped_rows_fp8(ox, ow, ends, n, k, (n * ow.data.stride(0), n, n), blocks).cpu()
    dx = grouped_rows_fp8(ody, owt, ends, k, n, (n, owt.data.shape[0], 0), blocks).cpu()
    dw = grouped_contraction_fp8(odyt, oxt, ends, n, k, (odyt.data.shape[0], oxt.data.shape[0]), blocks).cpu()
    tail = int(ends[-1])  # the 32 rows past the last segment: zero
    assert y.shape[0] == tail + 32 and not y[tail:].any() and not dx[tail:].any()
    bits = FP8_MMA_BITS if CUDA else FP32_BITS
    vx, vdy = _fp8_group_values(ox, px[0], 0, False), _fp8_group_values(ody, px[0], 0, False)
    vw = _fp8_group_values(ow, px[0], 0, False)
    for e, (s, c) in enumerate(zip(starts, counts)):
        if c == 0:
            assert not dw[e].any()
            continue
        rows = slice(s, s + c)
        xe, dye = t_x[rows].float(), t_dy[rows].float()
        # the grouped operands are each expert's reference operands
        ref_xt = reference_operand(xe.t(), px[1], 0, None).data
        ref_dyt = reference_operand(dye.t(), px[1], 0, None).data
        ref_wt = reference_operand(w[e * n:(e + 1) * n].float().t(), px[0], 0, None).data
        vxt = _fp8_group_values(oxt, px[1], e, True)[:k, s:s + ref_xt.shape[1]]
        vdyt = _fp8_group_values(odyt, px[1], e, True)[:n, s:s + ref_dyt.shape[1]]
        vwt = _fp8_group_values(owt, px[0], e, True)[:k, e * n:(e + 1) * n]
        for what, got, want in (("x^T", vxt, ref_xt), ("dy^T", vdyt, ref_dyt), ("W^T", vwt, ref_wt)):
            torch.testing.assert_close(got, want, atol=0, rtol=0, msg=lambda m: f"{what} of expert {e}: {m}")
        torch.testing.assert_close(vx[rows, :k], reference_operand(xe, px[0], 0, None).data, atol=0, rtol=0)
        assert_within_accumulation_error(y[rows], vx[rows, :k], vw[e * n:(e + 1) * n, :k], f"fprop {e}", bits)
        assert_within_accumulation_error(dx[rows], vdy[rows, :n], vwt, f"dgrad {e}", bits)
        assert_within_accumulation_error(dw[e], vdyt, vxt, f"wgrad {e}", bits)
