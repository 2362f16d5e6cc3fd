"""Element grids: hand-written tables (ties, +-0, saturation) and agreement with ml_dtypes / torch."""
import ml_dtypes
import numpy as np
import pytest
import torch

from hf_fp4 import decode, encode, round_to_grid
from hf_fp4.numerics.formats import grid_emax, grid_max

# (input, expected value, expected code) -- every tie point of the grid's low range, +-0, saturation.
E2M1_TABLE = [
    (0.0, 0.0, 0b0000), (-0.0, -0.0, 0b1000), (0.25, 0.0, 0b0000), (0.26, 0.5, 0b0001),
    (0.5, 0.5, 0b0001), (0.75, 1.0, 0b0010), (1.0, 1.0, 0b0010), (1.25, 1.0, 0b0010),
    (1.5, 1.5, 0b0011), (1.75, 2.0, 0b0100), (2.0, 2.0, 0b0100), (2.5, 2.0, 0b0100),
    (3.0, 3.0, 0b0101), (3.5, 4.0, 0b0110), (4.0, 4.0, 0b0110), (5.0, 4.0, 0b0110),
    (5.01, 6.0, 0b0111), (6.0, 6.0, 0b0111), (7.0, 6.0, 0b0111), (1e30, 6.0, 0b0111),
    (-0.25, -0.0, 0b1000), (-2.5, -2.0, 0b1100), (-5.0, -4.0, 0b1110), (-9.0, -6.0, 0b1111),
]
E1M2_TABLE = [
    (0.125, 0.0, 0b0000), (0.375, 0.5, 0b0010), (0.625, 0.5, 0b0010), (0.875, 1.0, 0b0100),
    (1.125, 1.0, 0b0100), (1.375, 1.5, 0b0110), (1.625, 1.5, 0b0110), (1.7, 1.75, 0b0111),
    (1.875, 1.75, 0b0111), (50.0, 1.75, 0b0111), (-0.375, -0.5, 0b1010), (-0.0, -0.0, 0b1000),
]
INT4_TABLE = [
    (0.5, 0.0, 0b0000), (1.5, 2.0, 0b0010), (2.5, 2.0, 0b0010), (3.5, 4.0, 0b0100),
    (6.5, 6.0, 0b0110), (6.6, 7.0, 0b0111), (7.5, 7.0, 0b0111), (-6.5, -6.0, 0b1110),
]
E4M3_TABLE = [
    (448.0, 448.0, 0x7E), (464.0, 448.0, 0x7E), (1e9, 448.0, 0x7E), (-1e9, -448.0, 0xFE),
    (2.0**-9, 2.0**-9, 0x01), (2.0**-10, 0.0, 0x00), (1.5 * 2**-9, 2.0**-8, 0x02),
    (1.0625, 1.0, 0x38), (1.1875, 1.25, 0x3A), (240.0, 240.0, 0x77), (232.0, 224.0, 0x76),
]


@pytest.mark.parametrize("grid,table", [("e2m1", E2M1_TABLE), ("e1m2", E1M2_TABLE),
                                        ("int4", INT4_TABLE), ("e4m3", E4M3_TABLE)])
def test_grid_tables(grid, table):
    x = torch.tensor([t[0] for t in table], dtype=torch.float32)
    codes = encode(x, grid)
    assert codes.tolist() == [t[2] for t in table]
    values = decode(codes, grid)
    expected = torch.tensor([t[1] for t in table])
    assert torch.equal(values, expected)
    assert torch.equal(torch.signbit(values), torch.signbit(expected))  # +-0 kept apart


def test_grid_constants():
    assert [grid_max(g) for g in ("e2m1", "e1m2", "int4", "e4m3")] == [6.0, 1.75, 7.0, 448.0]
    assert [grid_emax(g) for g in ("e2m1", "e1m2", "int4", "e4m3")] == [2, 0, 2, 8]
    assert decode(torch.arange(16, dtype=torch.uint8), "e2m1").tolist() == [
        0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def test_e2m1_matches_ml_dtypes_on_a_million_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10**6, generator=g) * torch.exp2(torch.randint(-4, 4, (10**6,), generator=g).float())
    ours = encode(x, "e2m1")
    theirs = torch.from_numpy(x.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8).copy())
    assert torch.equal(ours, theirs & 0xF)


def test_e4m3_matches_torch_float8_cast():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10**6, generator=g) * torch.exp2(torch.randint(-12, 10, (10**6,), generator=g).float())
    x = x.clamp(-448, 448)  # torch's cast does not saturate; ours does (checked in the table)
    assert torch.equal(encode(x, "e4m3"), x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(round_to_grid(x, "e4m3"), x.to(torch.float8_e4m3fn).float())


def test_e4m3_nan_code_decodes_to_nan():
    assert torch.isnan(decode(torch.tensor([0x7F, 0xFF], dtype=torch.uint8), "e4m3")).all()


@pytest.mark.parametrize("grid", ["e2m1", "e1m2", "int4"])
def test_stochastic_rounding_gives_neighbours(grid):
    g = torch.Generator().manual_seed(2)
    x = torch.rand(20000, generator=g) * 2 * grid_max(grid) - grid_max(grid)
    noise = torch.rand(x.shape, generator=g)
    sr = round_to_grid(x, grid, "stochastic", noise)
    table = decode(torch.arange(8, dtype=torch.uint8), grid)
    idx = torch.searchsorted(table, x.abs().contiguous())
    hi = table[idx.clamp(max=7)]
    lo = table[(idx - 1).clamp(min=0)]
    assert ((sr.abs() == hi) | (sr.abs() == lo)).all()
    assert (torch.sign(sr) * torch.sign(x) >= 0).all()


@pytest.mark.parametrize("grid", ["e2m1", "e1m2", "int4"])
def test_stochastic_rounding_goes_up_iff_the_noise_is_below_the_fraction(grid):
    """Upper neighbour iff noise < (m - lo) / (hi - lo), strictly: with noise uniform on multiples of 2^-24 in
    [0, 1), P(up) is then exactly the fraction (unbiased); noise equal to the fraction stays down."""
    table = decode(torch.arange(8, dtype=torch.uint8), grid)
    lo, hi = table[:-1], table[1:]
    for frac in (0.25, 0.5, 0.75):
        m = lo + frac * (hi - lo)  # exact: grid steps are powers of two
        at = torch.full_like(m, frac)
        below = torch.nextafter(at, torch.zeros_like(at))
        assert torch.equal(round_to_grid(m, grid, "stochastic", at), lo)
        assert torch.equal(round_to_grid(m, grid, "stochastic", below), hi)


def test_unknown_grid_lists_valid_names():
    with pytest.raises(ValueError, match="e2m1, e1m2, int4, e4m3"):
        encode(torch.zeros(2), "fp5")
