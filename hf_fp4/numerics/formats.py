"""Element grids: the 4-bit grids (E2M1, E1M2, INT4) and FP8 E4M3, with encode/decode and rounding.

Every grid is described by its table of non-negative magnitudes in code order, so one readable
rounding rule serves all of them (RESEARCH.md, "Element grids"):

* 4-bit grids use sign-magnitude nibbles: bit 3 is the sign, bits 0-2 index the magnitude table.
  E2M1 (OCP MX v1.0, sec. 5.3.3): 0, 0.5, 1, 1.5, 2, 3, 4, 6.  E1M2: 0, 0.25, ..., 1.75 (uniform).
  INT4 (symmetric): 0, 1, ..., 7 (the two's-complement -8 is unused).
* E4M3 (OCP FP8 "E4M3FN"): bit 7 sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities,
  S.1111.111 is NaN, so the magnitudes are codes 0..126 and the max is 448.

Round-to-nearest picks the nearer of the two neighbouring table entries; a tie goes to the even code
(for the float grids that is the even mantissa, i.e. IEEE round-half-to-even), and values above the
max saturate to the max.  Stochastic rounding picks the upper neighbour with probability
(m - lo) / (hi - lo), so E[result] = m inside the grid range.  Consecutive non-zero entries differ by at
most a factor of two, so both distances are exact in FP32 (Sterbenz) and the comparison is exact.
"""
from __future__ import annotations

import enum
import functools

import torch


class Grid(str, enum.Enum):
    """The element grids hf_fp4 knows, by their plain names."""

    E2M1 = "e2m1"
    E1M2 = "e1m2"
    INT4 = "int4"
    E4M3 = "e4m3"


def _e4m3_magnitudes() -> list[float]:
    """The 127 finite non-negative E4M3FN values, in code order (code 127 is NaN)."""
    values = []
    for code in range(127):
        exponent, mantissa = code >> 3, code & 7
        if exponent == 0:  # subnormal: 0.mmm * 2^-6
            values.append(mantissa / 8 * 2.0**-6)
        else:
            values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return values


_MAGNITUDES: dict[Grid, list[float]] = {
    Grid.E2M1: [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
    Grid.E1M2: [i * 0.25 for i in range(8)],
    Grid.INT4: [float(i) for i in range(8)],
    Grid.E4M3: _e4m3_magnitudes(),
}

#: Each grid as a float format (EMIN, MBITS): the step at magnitude m is 2^(max(floor(log2 m), EMIN) - MBITS).
#: INT4 and E1M2 are uniform grids (one binade).
FLOAT_PARAMS = {Grid.E2M1: (0, 1), Grid.E1M2: (0, 2), Grid.INT4: (2, 2), Grid.E4M3: (-6, 3)}

#: Bits of one element code.
ELEMENT_BITS = {Grid.E2M1: 4, Grid.E1M2: 4, Grid.INT4: 4, Grid.E4M3: 8}


def as_grid(name: "Grid | str") -> Grid:
    """Validate a grid name; unknown names raise ValueError listing the valid ones."""
    try:
        return Grid(name)
    except ValueError:
        valid = ", ".join(g.value for g in Grid)
        raise ValueError(f"unknown element grid {name!r}; valid grids: {valid}") from None


@functools.lru_cache(maxsize=None)
def _table(grid: Grid, device: torch.device) -> torch.Tensor:
    return torch.tensor(_MAGNITUDES[grid], dtype=torch.float32, device=device)


def magnitudes(grid: "Grid | str", device: torch.device | str = "cpu") -> torch.Tensor:
    """The grid's non-negative magnitudes in code order (FP32)."""
    return _table(as_grid(grid), torch.device(device))


def grid_max(grid: "Grid | str") -> float:
    """Largest magnitude of the grid (E2M1 6, E1M2 1.75, INT4 7, E4M3 448)."""
    return _MAGNITUDES[as_grid(grid)][-1]


def grid_step(grid: "Grid | str") -> float:
    """Smallest non-zero magnitude of the grid (E2M1 0.5, E1M2 0.25, INT4 1)."""
    return min(m for m in _MAGNITUDES[as_grid(grid)] if m > 0)


def grid_emax(grid: "Grid | str") -> int:
    """floor(log2(grid max)): the exponent of the largest normal value, used by the OCP E8M0 rule."""
    return int(torch.tensor(grid_max(grid)).frexp().exponent.item()) - 1


def sign_bit(grid: "Grid | str") -> int:
    return 1 << (ELEMENT_BITS[as_grid(grid)] - 1)


def round_magnitude_index(m: torch.Tensor, grid: "Grid | str", rounding: str = "nearest",
                          noise: torch.Tensor | None = None) -> torch.Tensor:
    """Index into the magnitude table for non-negative FP32 magnitudes `m` (int64, same shape).

    rounding="nearest": nearer neighbour, ties to the even index, saturating at the max.
    rounding="stochastic": upper neighbour iff noise < (m - lo) / (hi - lo); `noise` holds
    uniform [0, 1) draws of m's shape; values above the max saturate.
    """
    table = magnitudes(grid, m.device)
    last = table.numel() - 1
    hi = torch.searchsorted(table, m.contiguous(), right=False).clamp_(max=last)  # first entry >= m
    lo = (hi - 1).clamp_(min=0)
    t_lo, t_hi = table[lo], table[hi]
    exact_or_sat = (t_hi <= m)  # m equals an entry, or is above the max (hi == last)
    d_lo, d_hi = m - t_lo, t_hi - m
    if rounding == "nearest":
        take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    elif rounding == "stochastic":
        if noise is None:
            raise ValueError("stochastic rounding needs uniform noise of the input's shape")
        take_hi = noise < d_lo / (t_hi - t_lo)
    else:
        raise ValueError(f"unknown rounding {rounding!r}; valid: nearest, stochastic")
    return torch.where(exact_or_sat | take_hi, hi, lo)


def encode(x: torch.Tensor, grid: "Grid | str", rounding: str = "nearest",
           noise: torch.Tensor | None = None) -> torch.Tensor:
    """Encode already-scaled FP32 values to codes (uint8: a nibble for 4-bit grids, a byte for E4M3).

    The sign bit is x's sign bit, so -0.0 and small negatives that round to zero keep it (as
    ml_dtypes and hardware casts do). NaN input is not handled here: callers check finiteness.
    """
    grid = as_grid(grid)
    x = x.float()
    idx = round_magnitude_index(x.abs(), grid, rounding, noise)
    return (idx | torch.signbit(x).to(torch.int64) * sign_bit(grid)).to(torch.uint8)


def decode(codes: torch.Tensor, grid: "Grid | str") -> torch.Tensor:
    """Codes (uint8) to FP32 values; E4M3 code 0x7F/0xFF decodes to NaN."""
    grid = as_grid(grid)
    codes = codes.to(torch.int64)
    sbit = sign_bit(grid)
    mag_idx = codes & (sbit - 1)
    table = magnitudes(grid, codes.device)
    if grid is Grid.E4M3:
        table = torch.cat([table, table.new_tensor([float("nan")])])
    values = table[mag_idx]
    return torch.where(codes & sbit != 0, -values, values)


def round_to_grid(x: torch.Tensor, grid: "Grid | str", rounding: str = "nearest",
                  noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round FP32 values onto the grid (decode(encode(x)))."""
    return decode(encode(x, grid, rounding, noise), grid)


FLT_MIN = 2.0**-126  # FP32's smallest normal number


def flush_subnormals(x: torch.Tensor) -> torch.Tensor:
    """Values below FP32's smallest normal number in magnitude become +0 (what the quantizers see: GPU
    arithmetic may flush subnormals, and Triton's interpreter does when it widens BF16, so the spec does
    it for every implementation, at the input and after a Hadamard rotation).  NaN and inf stay."""
    return torch.where(x.abs() < FLT_MIN, torch.zeros_like(x), x)
