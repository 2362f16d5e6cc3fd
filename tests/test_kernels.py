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
from hf_fp4.philox import philox_uniform  # noqa: E402
from hf_fp4.recipe import PRESET_NAMES, preset  # noqa: E402

triton_quant = pytest.importorskip("hf_fp4.kernels.quant")
DEV = "cuda" if CUDA else "cpu"


def operand_specs():
    """Every operand spec of every preset recipe (RTN and SR as the recipes use them), plus the formats."""
    specs = {s for name in PRESET_NAMES for s in preset(name).linear.operand_specs()}
    specs |= {preset("tib").rules.overrides[0][1] and s for s in preset("mxfp8").linear.operand_specs()}
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


def test_philox_twin_matches_tl_rand():
    import triton
    import triton.language as tl

    @triton.jit
    def draw(out, seed, N: tl.constexpr):
        offs = tl.arange(0, N).to(tl.int64) + (1 << 33)
        tl.store(out + tl.arange(0, N), tl.rand(seed, offs))

    out = torch.empty(512, device=DEV)
    for seed in (0, 977, 2**32 + 5):
        draw[(1,)](out, seed, 512)
        assert torch.equal(out.cpu(), philox_uniform(seed, torch.arange(512) + (1 << 33)))


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
    with pytest.raises(hf_fp4.quantize.__globals__["NonFiniteError"]):
        triton_quant.triton_quantize(x, QuantSpec.preset("nvfp4"))
    for name in ("nvfp4", "mxfp4", "mxfp8"):
        spec = dataclasses.replace(QuantSpec.preset(name), nonfinite="propagate")
        assert_same(triton_quant.triton_quantize(x, spec), quantize(x, spec))


def test_quantize_api_runs_the_kernel():
    x = wide(16, 64, seed=9)
    assert_same(quantize(x, "mxfp4", backend="triton"), quantize(x, "mxfp4"))
    with pytest.raises(ValueError, match="valid: reference, triton"):
        quantize(x, "mxfp4", backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", operand_specs(), ids=str)
def test_kernel_matches_reference_at_large_sizes_on_gpu(spec):
    x = wide(4096, 4096 + 32, seed=12, dtype=torch.bfloat16)
    assert_same(triton_quant.triton_quantize(x, spec, seed=3), quantize(x, spec, seed=3))
    assert_same(triton_quant.triton_quantize(x, spec, seed=3, transpose=True),
                quantize(x.t().contiguous(), spec, seed=3))
