"""Property-based fuzzing (hypothesis) of quantize / dequantize / fake_quantize and of the Triton kernels
(interpreted on the CPU): random shapes (block multiples or not), FP32 / BF16 / FP16 input, zeros,
subnormals, huge values, +-inf and NaN.  Never a crash other than the documented NonFiniteError; shapes
round-trip; every finite element lands within its block's largest grid step; non-finite input raises or,
with nonfinite="propagate", turns exactly its blocks into NaN; the kernels give the reference's bits."""
import dataclasses

import pytest
import torch
from conftest import need

hypothesis = need("hypothesis", "test")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import hf_fp4  # noqa: E402
from hf_fp4 import QuantSpec, fake_quantize, quantize  # noqa: E402
from hf_fp4.numerics.formats import grid_emax  # noqa: E402
from hf_fp4.numerics.quantize import NonFiniteError  # noqa: E402

PRESETS = QuantSpec.presets()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Huge values stop at 1e38: above ~2.4e38 a truncation-free E8M0 scale (2^126) times an element rounded up
# to the grid's next point can exceed FP32's range -- a valid MX value that dequantizes to inf (see below).
SPECIALS = [0.0, -0.0, 1e-40, -1e-45, 2.0**-126, 65504.0, -1.0e38, float("inf"), float("-inf"), float("nan")]


@st.composite
def tensors(draw, allow_nonfinite=True):
    rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 100))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-40, 40, (rows, 1), generator=g).double())  # row magnitudes far apart
    nonfinite = allow_nonfinite and draw(st.booleans())  # half the examples stay finite
    for _ in range(draw(st.integers(0, 6))):  # a few special values at random places
        value = draw(st.sampled_from(SPECIALS if nonfinite else SPECIALS[:7]))
        x[draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))] = value
    limit = torch.finfo(dtype).max
    x = torch.where(x.isfinite(), x.clamp(-limit, limit), x).to(dtype)  # finite stays finite in the dtype
    return x


def block_ids(shape, block):
    r, c = torch.meshgrid(torch.arange(shape[0]), torch.arange(shape[1]), indexing="ij")
    return (r // block[0]) * ((shape[1] + block[1] - 1) // block[1]) + c // block[1]


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(x=tensors(), name=st.sampled_from(PRESETS), propagate=st.booleans())
def test_quantize_never_crashes_and_stays_within_a_grid_step(x, name, propagate):
    spec = dataclasses.replace(QuantSpec.preset(name), nonfinite="propagate" if propagate else "raise")
    bad = ~x.isfinite()
    if bad.any() and not propagate:
        with pytest.raises(NonFiniteError, match="nonfinite='propagate'"):
            quantize(x, spec)
        return
    q = quantize(x, spec)
    y = q.dequantize()
    assert y.shape == x.shape and y.dtype == torch.float32
    assert fake_quantize(x, spec).dtype == x.dtype
    ids = block_ids(x.shape, spec.block)
    bad_blocks = ids[bad].unique()
    in_bad = torch.isin(ids, bad_blocks)
    assert y[in_bad].isnan().all()  # a non-finite value makes its whole block NaN ...
    assert y[~in_bad].isfinite().all()  # ... and no other
    table = hf_fp4.magnitudes(spec.grid.value)
    step = (table[1:] - table[:-1]).max()
    d = q.block_decode() * (q.tensor_scale if q.tensor_scale is not None else 1.0)
    d = d.repeat_interleave(spec.block[0], 0).repeat_interleave(spec.block[1], 1)[: x.shape[0], : x.shape[1]]
    # a two-level block whose E4M3 scale rounds to zero decodes to zero (TransformerEngine's rule): its
    # values were at most qmax * 2^-10 (half E4M3's smallest subnormal) times the tensor decode scale
    bound = torch.where(d > 0, d * step, table[-1] * 2.0**-10 * (q.tensor_scale or 0.0))
    # or the element saturated: the grid's largest value, with x's sign, and x beyond it (a block scale rounded
    # down to a subnormal E4M3 value saturates the block's largest values).  y and top multiply the same three
    # factors in a different order, so they may differ in the last bit.
    top = table[-1] * d
    saturated = torch.isclose(y.abs(), top, rtol=5e-7, atol=0) & (x.float().abs() > top) & (y.sign() == x.float().sign())
    err = torch.where(saturated, 0.0, (y - x.float()).abs())[~in_bad]
    assert (err <= bound[~in_bad]).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=tensors(), name=st.sampled_from(PRESETS), propagate=st.booleans(), seed=st.integers(0, 2**40))
def test_kernels_give_the_references_bits_on_fuzzed_input(x, name, propagate, seed):
    pytest.importorskip("hf_fp4.kernels.quant")
    spec = dataclasses.replace(QuantSpec.preset(name), nonfinite="propagate" if propagate else "raise")
    if not x.isfinite().all() and not propagate:
        with pytest.raises(NonFiniteError):
            quantize(x, spec, seed=seed, backend="triton")
        return
    ref, got = quantize(x, spec, seed=seed), quantize(x, spec, seed=seed, backend="triton")
    assert torch.equal(got.codes, ref.codes)
    raw = lambda s: s if s.dtype == torch.float32 else s.view(torch.uint8)  # noqa: E731
    assert torch.equal(raw(got.scales), raw(ref.scales))
    assert torch.equal(got.dequantize(), ref.dequantize()) or torch.equal(got.dequantize().isnan(),
                                                                          ref.dequantize().isnan())


def test_an_mx_value_beyond_fp32_dequantizes_to_inf():
    """The documented edge of the FP32 reference: -3e38 takes scale 2^126 and element -4 (3.53 rounds up), a
    valid MXFP4 value of magnitude 2^128, one binade above FP32's largest finite value."""
    q = quantize(torch.tensor([[-3.0e38]]), "mxfp4_up")
    assert q.block_decode().item() == 2.0**126
    assert q.dequantize().item() == float("-inf")
