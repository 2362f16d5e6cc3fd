"""FP32 values at the edges the scale tests probe: a float rounded to FP32, its neighbours, blocks with a given
amax, and an exact rational rounded to FP32 (the oracle of the kernels' fast divisions)."""
import math
from fractions import Fraction

import torch


def f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def up(v: float) -> float:
    """The next FP32 value above v (an FP32 value)."""
    return float(torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(math.inf)))


def down(v: float) -> float:
    return float(torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(-math.inf)))


def blocks_with_amax(amaxes: list[float], block: int = 32) -> torch.Tensor:
    """One row per amax: the amax itself (sign alternating) and smaller values below it."""
    rows = []
    for i, a in enumerate(amaxes):
        row = torch.linspace(-0.9, 0.9, block, dtype=torch.float64) * a
        row[i % block] = a if i % 2 == 0 else -a
        rows.append(row)
    return torch.stack(rows).float()


def fp32_rn(v: Fraction) -> Fraction:
    """An exact rational rounded to FP32 (ties to even, subnormals kept): the oracle of the fast divisions."""
    if v == 0:
        return Fraction(0)
    e = max(math.floor(math.log2(abs(v))), -126)
    while Fraction(2) ** e > abs(v) and e > -126:  # log2 of a rational may be off by one
        e -= 1
    while Fraction(2) ** (e + 1) <= abs(v):
        e += 1
    n = v / Fraction(2) ** (e - 23)
    lo = math.floor(n)
    round_up = n - lo > Fraction(1, 2) or (n - lo == Fraction(1, 2) and lo % 2 == 1)
    return (lo + round_up) * Fraction(2) ** (e - 23)
