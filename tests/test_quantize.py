"""The reference quantizer: scale rules against independent re-derivations, SR, 2D tiles, bad input."""
import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import hf_fp4
from hf_fp4 import QuantSpec, fake_quantize, quant_error_stats, quantize
from hf_fp4.numerics.quantize import unpack_codes
from thresholds import (E1M2_GAIN_TOL, E2M1_GAIN_MAX, QUANT_SQNR_MIN_DB, SR_DRAWS, SR_GAIN_TOL, SR_MEAN_REL_TOL)


def wide_range(rows, cols, seed=0):
    """Gaussian values with per-row magnitudes over 2^-20 .. 2^20, a few outliers and a zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=g).float())
    x[0, :32] = 0.0
    x[1, 3] = 1e4
    return x


def test_mxfp4_follows_the_ocp_formula():
    """OCP MX v1.0: X = 2^(floor(log2 amax) - 2); element = rne_e2m1(x / X); re-derived with numpy."""
    x = wide_range(64, 128)
    q = quantize(x, "mxfp4")
    blocks = x.numpy().reshape(64, 4, 32).astype(np.float32)
    amax = np.abs(blocks).max(-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    assert np.array_equal(q.scales.view(torch.uint8).numpy(), (exp + 127).astype(np.uint8))
    scaled = blocks / np.exp2(exp)[..., None].astype(np.float32)
    elements = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF  # saturating RNE
    assert np.array_equal(unpack_codes(q.codes, q.spec.grid).numpy(), elements.reshape(64, 128))


def test_mxfp8_follows_the_ocp_formula():
    x = wide_range(32, 64, seed=3)
    q = quantize(x, "mxfp8")
    blocks = x.numpy().reshape(32, 2, 32)
    amax = np.abs(blocks).max(-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 8, -127)
    assert np.array_equal(q.scales.view(torch.uint8).numpy(), (exp + 127).astype(np.uint8))
    scaled = np.clip(blocks / np.exp2(exp)[..., None], -448, 448).astype(np.float32)
    expected = torch.from_numpy(scaled).to(torch.float8_e4m3fn).view(torch.uint8).reshape(32, 64)
    assert torch.equal(q.codes, expected)


@pytest.mark.parametrize("preset,qmax,elem", [("nvfp4", 6.0, ml_dtypes.float4_e2m1fn), ("ufp4", 1.75, None)])
def test_nvfp4_two_level_follows_nvidias_procedure(preset, qmax, elem):
    """s_enc = 448*qmax/amax; s_b = e4m3(amax_b/qmax*s_enc); encode = 1/(s_b*(1/s_enc)); re-derived in numpy."""
    x = wide_range(16, 64, seed=4).numpy().astype(np.float32) * np.float32(1e-3)
    q = quantize(torch.from_numpy(x), preset)
    s_enc = np.float32(448.0 * qmax) / np.abs(x).max()
    amax_b = np.abs(x.reshape(16, 4, 16)).max(-1)
    s_b = np.minimum(amax_b / np.float32(qmax) * s_enc, np.float32(448)).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(q.scales.view(torch.uint8).numpy(), s_b.view(np.uint8))
    s_dec = np.float32(1) / s_enc
    assert q.tensor_scale.item() == s_dec
    decode_b = s_b.astype(np.float32) * s_dec
    with np.errstate(divide="ignore"):
        enc = np.where(decode_b > 0, np.float32(1) / decode_b, 0).astype(np.float32)
    scaled = x.reshape(16, 4, 16) * enc[..., None]
    if elem is not None:
        codes = scaled.astype(elem).view(np.uint8) & 0xF
        assert np.array_equal(unpack_codes(q.codes, q.spec.grid).numpy(), codes.reshape(16, 64))
    else:  # E1M2 = INT4 grid / 4: round half to even on 4*|x|, saturate at 7
        mag = np.minimum(np.round(np.abs(scaled) * 4), 7).astype(np.uint8)
        codes = mag | (np.signbit(scaled).astype(np.uint8) << 3)
        assert np.array_equal(unpack_codes(q.codes, q.spec.grid).numpy(), codes.reshape(16, 64))


def test_truncation_free_scales_never_saturate_and_are_minimal():
    x = wide_range(64, 256, seed=5)
    q = quantize(x, "mxfp4_up")
    decode_b = q.block_decode()
    amax = x.abs().reshape(64, 8, 32).amax(-1)
    assert (amax <= 6 * decode_b).all()
    nonzero = amax > 0
    assert (amax[nonzero] > 6 * decode_b[nonzero] / 2).all()  # one step smaller would saturate
    assert quant_error_stats(x, "mxfp4_up")["saturated"] == 0.0


@pytest.mark.parametrize("preset", ["nvfp4_2d", "ufp4_2d", "mxfp4_2d_up"])
def test_2d_tiles_are_transposition_invariant(preset):
    w = wide_range(40, 72, seed=6)  # not multiples of 16: padding included
    qw, qwt = quantize(w, preset), quantize(w.t().contiguous(), preset)
    assert torch.equal(qw.dequantize().t(), qwt.dequantize())
    assert torch.equal(qw.scales.view(torch.uint8).t(), qwt.scales.view(torch.uint8))


def test_1d_blocks_are_not_transposition_invariant():
    w = wide_range(64, 64, seed=7)
    assert not torch.equal(fake_quantize(w, "nvfp4").t(), fake_quantize(w.t().contiguous(), "nvfp4"))


def sr_spec(preset):
    return dataclasses.replace(QuantSpec.preset(preset), rounding="stochastic")


def test_stochastic_rounding_reproduces_and_varies_with_seed():
    x = torch.randn(64, 64)
    spec = sr_spec("nvfp4")
    a = fake_quantize(x, spec, torch.Generator().manual_seed(1))
    b = fake_quantize(x, spec, torch.Generator().manual_seed(1))
    c = fake_quantize(x, spec, torch.Generator().manual_seed(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("preset", ["mxfp4_up", "mxfp4_2d_up"])
def test_stochastic_rounding_is_unbiased_with_truncation_free_scales(preset):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    spec = sr_spec(preset)
    g = torch.Generator().manual_seed(4)
    draws = torch.stack([fake_quantize(x, spec, g) for _ in range(SR_DRAWS)])
    # the local grid gap of every element, from its block's decode factor and the E2M1 table
    d = quantize(x, spec).block_decode().repeat_interleave(spec.block[0], 0).repeat_interleave(
        spec.block[1], 1)[: x.shape[0], : x.shape[1]]
    table = hf_fp4.magnitudes("e2m1")
    hi = torch.searchsorted(table, (x.abs() / d).contiguous()).clamp(1, 7)
    gap = (table[hi] - table[hi - 1]) * d
    err = (draws.mean(0) - x) / gap
    assert abs(err.mean()) < SR_MEAN_REL_TOL / 4   # no systematic bias
    assert err.abs().mean() < 2 * SR_MEAN_REL_TOL   # each mean within ~1/sqrt(draws) of x
    mean = draws.mean(0)
    assert abs((mean * x).sum() / (x * x).sum() - 1) < SR_GAIN_TOL  # no shrinkage
    rtn = fake_quantize(x, preset)
    assert (draws[:50].mean(0) - x).pow(2).mean().sqrt() < (rtn - x).pow(2).mean().sqrt()


def recipe_sr_specs():
    """The stochastic-rounding operand specs the preset recipes use (nvfp4, ufp4, tib)."""
    from hf_fp4.nn.recipe import PRESET_NAMES, preset

    found = {}
    for name in PRESET_NAMES:
        for spec in preset(name).linear.operand_specs():
            if spec.rounding.value == "stochastic" and spec not in found.values():  # fullstack: nvfp4's specs
                found[f"{name}:{spec.grid.value}{spec.block[0]}x{spec.block[1]}"] = spec
    return found


SR_SPECS = recipe_sr_specs()


@pytest.mark.parametrize("path", ["generator", "philox"])
@pytest.mark.parametrize("key", sorted(SR_SPECS))
def test_recipe_sr_operands_are_unbiased_below_saturation(key, path):
    """E[Q(x)] = x for every element its block scale does not saturate, with the recipes' SR specs, on the
    torch.Generator path and the Philox path (the kernels' stream; the call index moves the seed)."""
    assert {k.split(":")[0] for k in SR_SPECS} == {"nvfp4", "ufp4", "tib"}
    spec = SR_SPECS[key]
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    draws = torch.stack([fake_quantize(x, spec, g) if path == "generator" else fake_quantize(x, spec, seed=1000 + i)
                         for i in range(SR_DRAWS)])
    q = quantize(x, spec)
    d = q.block_decode() * (q.tensor_scale if q.tensor_scale is not None else 1.0)
    d = d.repeat_interleave(spec.block[0], 0).repeat_interleave(spec.block[1], 1)[: x.shape[0], : x.shape[1]]
    table = hf_fp4.magnitudes(spec.grid.value)
    scaled = x.abs() / d
    free = scaled <= table[-1]  # elements the block scale does not clip
    assert free.float().mean() > 0.9
    hi = torch.searchsorted(table, scaled.contiguous()).clamp(1, len(table) - 1)
    gap = (table[hi] - table[hi - 1]) * d
    err = ((draws.mean(0) - x) * x.sign() / gap)[free]  # signed away from zero: shrinkage is negative
    assert abs(err.mean()) < SR_MEAN_REL_TOL / 4   # no systematic bias
    assert err.abs().mean() < 2 * SR_MEAN_REL_TOL   # each mean within ~1/sqrt(draws) of x
    assert not torch.equal(draws[0], draws[1])


def test_stochastic_rounding_with_saturating_scales_shrinks():
    """The contrast: OCP floor scales clip, so the mean of SR draws shrinks (RESEARCH.md)."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    mean = torch.stack([fake_quantize(x, sr_spec("mxfp4"), g) for _ in range(SR_DRAWS)]).mean(0)
    assert (mean * x).sum() / (x * x).sum() < 1 - 4 * SR_GAIN_TOL


def test_shrinkage_is_visible():
    x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(5))
    assert quant_error_stats(x, "nvfp4")["gain"] < E2M1_GAIN_MAX
    assert abs(quant_error_stats(x, "ufp4")["gain"] - 1) < E1M2_GAIN_TOL


@pytest.mark.parametrize("preset", QuantSpec.presets())
def test_dequantize_equals_fake_quantize_and_sqnr(preset):
    x = torch.randn(48, 96, generator=torch.Generator().manual_seed(6))
    assert torch.equal(quantize(x, preset).dequantize(), fake_quantize(x, preset))
    assert quant_error_stats(x, preset)["sqnr_db"] > QUANT_SQNR_MIN_DB[preset]


def test_bits_per_value():
    assert QuantSpec.preset("mxfp4").bits_per_value == 4.25
    assert QuantSpec.preset("nvfp4").bits_per_value == 4.5
    assert QuantSpec.preset("mxfp8").bits_per_value == 8.25
    assert QuantSpec.preset("nvfp4_2d").bits_per_value == 4 + 8 / 256
    q = quantize(torch.randn(32, 64), "nvfp4")
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (32, 32)
    assert q.scales.dtype == torch.float8_e4m3fn and q.scales.shape == (32, 4)
    assert quantize(torch.randn(32, 64), "mxfp4").scales.dtype == torch.float8_e8m0fnu


def test_packing_puts_the_even_element_in_the_low_nibble():
    x = torch.tensor([[0.5, -6.0] + [0.0] * 30])  # mxfp4: amax 6 -> X = 2^(2-2) = 1
    q = quantize(x, "mxfp4")
    assert q.codes[0, 0].item() == (0b0001 | (0b1111 << 4))


def test_padding_is_zero_and_cropped():
    x = torch.randn(3, 5, 33)
    q = quantize(x, "nvfp4")
    assert q.padded_shape == (15, 48)
    assert q.dequantize().shape == x.shape
    assert (unpack_codes(q.codes, q.spec.grid)[:, 33:] == 0).all()


def test_all_zero_blocks_give_zero_codes_and_finite_scales():
    for preset in QuantSpec.presets():
        q = quantize(torch.zeros(16, 32), preset)
        assert (q.codes == 0).all()
        assert torch.isfinite(q.block_decode()).all()
        assert (q.dequantize() == 0).all()


def test_nonfinite_input_raises_by_default_and_propagates_on_request():
    x = torch.randn(4, 64)
    x[1, 40] = math.nan
    x[2, 3] = math.inf
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize(x, "nvfp4")
    for preset in ("nvfp4", "mxfp4", "mxfp8"):
        spec = dataclasses.replace(QuantSpec.preset(preset), nonfinite="propagate")
        y = fake_quantize(x, spec)
        bs = spec.block[1]
        assert torch.isnan(y[1, 40 // bs * bs: 40 // bs * bs + bs]).all()
        assert torch.isnan(y[2, :bs]).all()
        assert torch.isfinite(y[0]).all() and torch.isfinite(y[3]).all()


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="nvfp4.*mxfp4"):
        QuantSpec.preset("fp3")
    with pytest.raises(ValueError, match="nearest, stochastic"):
        QuantSpec(rounding="up")
    with pytest.raises(ValueError, match="e8m0_floor"):
        QuantSpec(scale="e9m0")
    with pytest.raises(ValueError, match="block"):
        QuantSpec(block=(2, 16))
    with pytest.raises(ValueError, match="nvfp4"):
        quantize(torch.zeros(4), "nope")


def test_spec_round_trips_and_replace_validates():
    for name in QuantSpec.presets():
        spec = QuantSpec.preset(name)
        assert QuantSpec.from_dict(spec.to_dict()) == spec
    spec = dataclasses.replace(QuantSpec.preset("nvfp4"), rounding="stochastic")
    assert spec.rounding is hf_fp4.Rounding.STOCHASTIC
    with pytest.raises(ValueError):
        dataclasses.replace(spec, rounding="sideways")


@pytest.mark.parametrize("name", QuantSpec.presets())
def test_fast_dequantize_is_the_reference_dequantize_bit_for_bit(name):
    """hf_fp4.nn.backends.fast_dequantize (byte lookup tables + broadcast block scales, FP4AdamW's state
    decode) equals QuantizedTensor.dequantize exactly: values over many octaves, a zero block, ragged
    (padded) rows and columns, and a 3-D tensor."""
    from hf_fp4.nn.backends import fast_dequantize
    from hf_fp4.numerics.quantize import quantize as reference_quantize

    spec = QuantSpec.preset(name)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 19, 70, generator=g) * torch.logspace(-6, 6, 70)
    x[0, :16, :32] = 0
    q = reference_quantize(x.reshape(-1, 70), spec)
    assert torch.equal(fast_dequantize(q), q.dequantize())
    q3 = reference_quantize(x, spec)
    assert torch.equal(fast_dequantize(q3), q3.dequantize()) and fast_dequantize(q3).shape == x.shape
