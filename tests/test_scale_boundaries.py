"""Scale rules at their boundaries: block amax exactly at, one ulp below and one ulp above the values where
the chosen scale changes -- qmax * 2^k for truncation-free E8M0, 2^m for OCP's floor, an E4M3 rounding tie for
the two-level block scale.  Expected scales are written from the definitions (RESEARCH.md), the reference
must give them, and the Triton kernels (interpreted on the CPU) must give the reference's bits."""
import dataclasses
import math

import pytest
import torch

from hf_fp4 import QuantSpec, quantize
from hf_fp4.numerics.formats import Grid, grid_emax, grid_max

from fp32_values import blocks_with_amax, down, f32, up

GRIDS = [Grid.E2M1, Grid.E1M2, Grid.INT4, Grid.E4M3]
EXPONENTS = [-20, -3, 0, 5, 30]


def stored_exponents(x: torch.Tensor, spec: QuantSpec) -> list[int]:
    return (quantize(x, spec).scales.view(torch.uint8).to(torch.int32) - 127).flatten().tolist()


def kernel_matches_reference(x: torch.Tensor, spec: QuantSpec) -> None:
    pytest.importorskip("hf_fp4.kernels.quant")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernel in Triton's interpreter
    ref, got = quantize(x, spec), quantize(x.to(dev), spec, backend="triton")
    got = dataclasses.replace(got, codes=got.codes.cpu(), scales=got.scales.cpu(),
                              tensor_scale=None if got.tensor_scale is None else got.tensor_scale.cpu())
    assert torch.equal(got.codes, ref.codes)
    raw = lambda s: s if s.dtype == torch.float32 else s.view(torch.uint8)  # noqa: E731
    assert torch.equal(raw(got.scales), raw(ref.scales))
    assert (got.tensor_scale is None) == (ref.tensor_scale is None)
    assert ref.tensor_scale is None or torch.equal(got.tensor_scale, ref.tensor_scale)


def e8m0_edges(rule: str, grid: Grid) -> list[tuple[float, int]]:
    """(block amax, the scale exponent its definition gives) at, and one FP32 ulp around, the values where
    the exponent changes: qmax * 2^k for the truncation-free rule (smallest e with amax <= qmax * 2^e),
    2^m for OCP's floor (floor(log2 amax) - emax)."""
    cases = []
    for k in EXPONENTS:
        if rule == "e8m0_ceil":
            edge = f32(grid_max(grid) * 2.0**k)
            cases += [(edge, k), (up(edge), k + 1), (down(edge), k)]
        else:
            e = k - grid_emax(grid)
            cases += [(2.0**k, e), (down(2.0**k), e - 1), (up(2.0**k), e)]
    return cases


@pytest.mark.parametrize("rule", ["e8m0_ceil", "e8m0_floor"])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g.value)
def test_e8m0_scale_at_and_one_ulp_around_where_it_changes(rule, grid):
    spec = QuantSpec(grid=grid, block=(1, 32), scale=rule)
    amaxes, expected = zip(*e8m0_edges(rule, grid))
    assert [up(v) for v in amaxes[::3]] == list(amaxes[1 + (rule == "e8m0_floor")::3])  # one FP32 ulp away
    x = blocks_with_amax(list(amaxes))
    assert stored_exponents(x, spec) == list(expected)
    if rule == "e8m0_ceil":  # nothing saturates: the amax decodes back exactly
        q = quantize(x, spec)
        assert torch.equal(q.dequantize().abs().amax(1)[::3], x.abs().amax(1)[::3])
    kernel_matches_reference(x, spec)


@pytest.mark.parametrize("preset", ["nvfp4", "ufp4"])
def test_two_level_block_scale_at_an_e4m3_tie_and_just_above(preset):
    """s_b = e4m3_rne(fp32(amax_b / qmax) * s_enc).  With s_enc a power of two (tensor amax 448 * qmax * 2^-j),
    amax_b = t * qmax * 2^-j puts the block scale exactly on t: a tie between two E4M3 values goes to the
    even one; the next FP32 amax_b whose quotient leaves the tie goes to the upper one; the tensor's amax
    block gets 448."""
    spec = QuantSpec.preset(preset)
    qmax, j = grid_max(spec.grid), 6
    tensor_amax = 448.0 * qmax * 2.0**-j
    # E4M3 neighbours (1.0, 1.125), (1.125, 1.25) and (12, 13): ties at 1.0625 -> 1.0, 1.1875 -> 1.25, 12.5 -> 12
    ties = [(1.0625, 1.0, 1.125), (1.1875, 1.25, 1.25), (12.5, 12.0, 13.0)]
    amaxes, expected = [tensor_amax], [448.0]
    for t, even, above in ties:
        a = t * qmax * 2.0**-j
        assert f32(f32(a) / qmax) * 2.0**j == t  # exactly on the tie
        b = up(a)
        while f32(b / qmax) * 2.0**j == t:  # the first amax whose FP32 quotient is above the tie
            b = up(b)
        amaxes += [a, b]
        expected += [even, above]
    x = blocks_with_amax(amaxes, block=spec.block[1])
    q = quantize(x, spec)
    assert q.tensor_scale.item() == 2.0**-j
    assert q.scales.float().flatten().tolist() == expected
    kernel_matches_reference(x, spec)


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g.value)
def test_ties_between_grid_points_go_to_the_even_code_in_both_backends(grid):
    """Every midpoint between neighbouring grid magnitudes, at unit scale, rounds to the even code."""
    spec = QuantSpec(grid=grid, block=(1, 32), scale="e8m0_ceil")
    qmax = grid_max(grid)
    from hf_fp4.numerics.formats import decode, encode

    table = decode(torch.arange(0, 127 if grid is Grid.E4M3 else 8, dtype=torch.uint8), grid).unique()
    table = table[torch.isfinite(table)]
    mids = ((table[1:] + table[:-1]) / 2)[:31]
    x = torch.zeros(1, 32)
    x[0, 0] = qmax  # the block amax: scale exponent 0, so the midpoints stay midpoints
    x[0, 1:1 + mids.numel()] = mids
    q = quantize(x, spec)
    assert stored_exponents(x, spec) == [0]
    codes = encode(mids, grid, "nearest")
    assert ((codes.to(torch.int32) & 1) == 0).all()  # the definition: ties to the even code
    assert torch.equal(q.dequantize()[0, 1:1 + mids.numel()], decode(codes, grid))
    kernel_matches_reference(x, spec)


@pytest.mark.parametrize("name", ["nvfp4", "ufp4", "int4"])
def test_a_tensor_too_small_for_a_normal_decode_factor_counts_as_zero(name):
    """Two-level scaling at the bottom of FP32 (found by tests/test_fuzz.py): s_enc = 448 qmax / amax above 2^117
    would give a subnormal block decode factor whose reciprocal overflows -- a lone 2^-126 came back as 4/7 of
    itself.  Such a tensor counts as zero (s_enc = 1, its block scales round to zero); just above the limit
    every block's decode factor is normal and the values land within a grid step."""
    spec = QuantSpec.preset(name)
    qmax = grid_max(spec.grid)
    limit = f32(448 * qmax * 2.0**-117)  # amax at which s_enc = 2^117
    for amax in (2.0**-126, down(limit)):
        x = blocks_with_amax([amax], 16)
        q = quantize(x, spec)
        assert float(1 / q.tensor_scale) == 1.0 and torch.equal(q.dequantize(), torch.zeros_like(x)), amax
        kernel_matches_reference(x, spec)
    x = blocks_with_amax([up(limit) * 1.5], 16)
    q = quantize(x, spec)
    decode = float(q.block_decode().max() * q.tensor_scale)
    assert decode >= 2.0**-126  # normal
    step = float((hf_magnitudes(spec.grid)[1:] - hf_magnitudes(spec.grid)[:-1]).max())
    assert ((q.dequantize() - x).abs() <= decode * step).all()
    kernel_matches_reference(x, spec)


def hf_magnitudes(grid):
    from hf_fp4 import magnitudes

    return magnitudes(grid.value)
