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
    specs |= set(preset("mxfp8").linear.operand_specs())  # tib's q/k projections
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


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", operand_specs(), ids=str)
def test_kernel_matches_reference_at_large_sizes_on_gpu(spec):
    x = wide(4096, 4096 + 32, seed=12, dtype=torch.bfloat16)
    assert_same(triton_quant.triton_quantize(x, spec, seed=3), quantize(x, spec, seed=3))
    assert_same(triton_quant.triton_quantize(x, spec, seed=3, transpose=True),
                quantize(x.t().contiguous(), spec, seed=3))


def _gemm_case(m, n, k, seed, spread):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-spread, spread + 1, (m, k // 32), generator=g)
                                                   .float().repeat_interleave(32, 1))
    b = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-spread, spread + 1, (n, 1), generator=g).float())
    a[0, 7] = 5e3  # outlier
    return a.to(DEV), b.to(DEV)


@pytest.mark.parametrize("pair", [("mxfp4", "mxfp4"), ("mxfp4_2d_up", "mxfp4_2d_up"), ("nvfp4", "nvfp4_2d"),
                                  ("ufp4", "ufp4"), ("mxfp8", "mxfp8"), ("int4", "int4")])
@pytest.mark.parametrize("spread", [3, 12])
def test_fast_gemm_matches_float64_of_the_dequantized_operands(pair, spread):
    from hf_fp4.kernels.gemm import quantized_matmul

    a, b = _gemm_case(48, 40, 96, seed=1, spread=spread)
    qa, qb = quantize(a, pair[0]), quantize(b, pair[1])
    ref = qa.dequantize().double() @ qb.dequantize().double().t()
    out = quantized_matmul(qa, qb, 48, 40).double()
    err = (out - ref).norm() / ref.norm()
    assert err < 1e-6, err  # FP32 accumulation error, nothing lost


def test_fp8_path_refuses_rows_beyond_its_exponent_range():
    from hf_fp4.kernels.gemm import fp8_range_ok, quantized_matmul

    a, b = _gemm_case(32, 32, 64, seed=2, spread=1)
    a[5, :32] *= 2.0**-20  # one block 20 binades below the rest of its row: E4M3 would lose it
    qa, qb = quantize(a, "mxfp4"), quantize(b, "mxfp4")
    assert not fp8_range_ok(qa)[0] and fp8_range_ok(qb)[0]
    ref = qa.dequantize().double() @ qb.dequantize().double().t()
    out = quantized_matmul(qa, qb, 32, 32).double()
    assert ((out - ref).abs()[5] <= 1e-6 * ref.abs()[5].max()).all()  # the small row is exact too


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "tib", "ufp4"])
def test_fp4linear_triton_backend_quantizes_like_the_reference(name):
    from torch import nn

    from hf_fp4 import FP4Linear, observe_operands
    from hf_fp4.quantize import fake_quantize as fq

    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(64, 48, bias=False), preset(name, seed=1).linear, name="l").to(DEV)
    ref = FP4Linear.from_linear(nn.Linear(64, 48, bias=False), preset(name, seed=1).linear, name="l").to(DEV)
    ref.weight.data.copy_(layer.weight.data)
    layer.backend, ref.backend = "triton", "reference"
    x = torch.randn(32, 64, device=DEV)
    dy = torch.randn(32, 48, device=DEV)
    seen = []
    with observe_operands(lambda m, g, r, a, q, s: seen.append((g, r, a, q, s))):
        xa = x.clone().requires_grad_()
        layer(xa).backward(dy)
    assert {(g, r) for g, r, *_ in seen} == {(g, r) for g in ("fprop", "dgrad", "wgrad") for r in ("lhs", "rhs")}
    for gemm, role, operand, q, spec in seen:
        seed = layer.sr_seed(gemm, role, 0) if spec.rounding.value == "stochastic" else None
        assert torch.equal(q, fq(operand, spec, seed=seed)), (gemm, role)
    xr = x.clone().requires_grad_()
    y_ref = ref(xr)
    y_ref.backward(dy)
    y = layer(x)
    assert torch.allclose(y, y_ref, rtol=1e-5, atol=1e-5)  # RTN fprop: same operands, FP32 accumulation


@pytest.mark.parametrize("name", ["nvfp4", "ufp4", "mxfp4", "mxfp4_2d_up", "mxfp8"])
@pytest.mark.parametrize("sr", [False, True])
def test_fused_gemm_operand_is_the_reference_value_exactly(name, sr):
    from hf_fp4.kernels.quant import fp8_capable, fp8_shift, triton_gemm_operand
    from hf_fp4.scales import e8m0_exponent

    x = wide(40, 96, seed=13)
    spec = dataclasses.replace(QuantSpec.preset(name), rounding="stochastic" if sr else "nearest")
    q = quantize(x, spec, seed=21)
    block = q.code_values() * q.block_decode().repeat_interleave(spec.block[0], 0).repeat_interleave(spec.block[1], 1)
    block = block[:40, :96]
    op = triton_gemm_operand(x, spec, fp8=False, k_alloc=128, seed=21)
    assert torch.equal(op.data[:40, :96].float(), block) and (op.data[40:] == 0).all() and (op.data[:, 96:] == 0).all()
    assert torch.equal(op.scale.reshape(()), q.tensor_scale if q.tensor_scale is not None else torch.ones((), device=DEV))
    if fp8_capable(spec):
        op8 = triton_gemm_operand(x, spec, fp8=True, k_alloc=128, seed=21)
        e_ref = int(e8m0_exponent(q.scales).max())
        assert op8.scale.item() == 2.0 ** (e_ref - fp8_shift(spec.grid))
        lost = bool(op8.lost.any())
        nonzero = (q.code_values().abs() > 0).reshape(q.scales.shape[0], spec.block[0], q.scales.shape[1],
                                                       spec.block[1]).any(3).any(1)
        e_min = int(e8m0_exponent(q.scales)[nonzero].min())
        assert lost == (e_ref - e_min > 14)
        xs = torch.randn(40, 96, generator=torch.Generator().manual_seed(3)).to(DEV)  # a narrow range
        qs = quantize(xs, spec, seed=21)
        ref = qs.code_values() * qs.block_decode().repeat_interleave(spec.block[0], 0).repeat_interleave(
            spec.block[1], 1)
        op8 = triton_gemm_operand(xs, spec, fp8=True, k_alloc=128, seed=21)
        assert not bool(op8.lost.any())
        assert torch.equal(op8.data[:40, :96].float() * op8.scale, ref[:40, :96])
