"""How one orientation of a tensor becomes a GEMM operand (`OperandPlan`), the operand itself (`Operand`), and
the FP8-folding constants.  Data only: the reference path (hf_fp4.nn.operands) and the kernels (hf_fp4.kernels)
both build on this module, and neither imports the other's internals."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .formats import FLOAT_PARAMS, Grid, grid_max
from .hadamard import padded_width
from .scales import ScaleRule
from .spec import QuantSpec, Rounding

FORMS = ("hp", "fp32", "fp8", "bf16")
#: The FP8 form's reference exponents (and GEMM scales) are per operand row: cuBLAS's row-scaled FP8 GEMM.
#: Finer 1x128 block scales (fewer lost blocks along T) were measured and dropped
#: (benchmarks/results-2026-12-02.md): cuBLAS's block-scaled GEMM is 1.3-1.65x slower than row-scaled and no
#: more exact -- on operands spanning E4M3's range within a row both exceed the FP32 accumulation bound (the
#: FP8 tensor cores' reduced-precision accumulation); a Triton GEMM that promotes every step is exact but
#: slower than BF16.
#: The forms the Triton kernels make (the others: "hp" is the tensor itself, "fp32" the reference values).
KERNEL_FORMS = ("fp8", "bf16")


def fp8_capable(spec: QuantSpec | None) -> bool:
    """Power-of-two block scales on a 4-bit grid: exact in E4M3 after folding."""
    return (spec is not None and spec.scale in (ScaleRule.E8M0_FLOOR, ScaleRule.E8M0_CEIL)
            and spec.grid is not Grid.E4M3)


def fp8_shift(grid: Grid) -> int:
    """SHIFT = floor(log2(448 / grid max)): the largest element lands at <= 448."""
    return int(math.floor(math.log2(448.0 / grid_max(grid))))


def fp8_dmax(grid: Grid) -> int:
    """Binades below the reference exponent that E4M3 (subnormal step 2^-9) still holds exactly:
    SHIFT + 9 + EMIN - MBITS (the smallest non-zero grid value is 2^(EMIN - MBITS))."""
    emin, mbits = FLOAT_PARAMS[grid]
    return fp8_shift(grid) + 9 + emin - mbits


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class OperandPlan:
    """One orientation of one tensor: QuantSpec (None: unquantized), Hadamard size (0: none), whether
    a sign vector is applied, the GEMM form, and the alignment of the contraction dim (both operands
    of a GEMM share it)."""

    spec: QuantSpec | None
    hadamard: int = 0
    signed: bool = False
    form: str = "bf16"
    k_align: int = 16

    @classmethod
    def single(cls, spec: QuantSpec, form: str, hadamard: int = 0, signed: bool = False) -> "OperandPlan":
        """The plan of an operand whose GEMM partner shares its spec and Hadamard: the contraction aligned to
        16, the block and the Hadamard size (as LinearPlan aligns a GEMM's two operands)."""
        return cls(spec, hadamard, signed, form, max(16, hadamard, spec.block[1]))

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"OperandPlan.form: unknown {self.form!r}; valid: {', '.join(FORMS)}")
        if self.form == "fp8" and not fp8_capable(self.spec):
            raise ValueError(f"{self.spec} has no FP8 operand form (needs E8M0 scales on a 4-bit grid)")
        if self.form == "bf16" and (self.spec is None or self.spec.scale is ScaleRule.FP32):
            raise ValueError("the BF16 operand form needs a QuantSpec with E8M0 or UE4M3 scales")

    @property
    def stat(self) -> int:
        """What the kernels' statistics pass reduces: 0 nothing, 1 per operand row, 2 the tensor."""
        if self.spec is not None and self.spec.scale is ScaleRule.UE4M3_FP32:
            return 2
        return 1 if self.form == "fp8" else 0

    def shape(self, rows: int, k: int) -> tuple[int, int]:
        """Allocated [rows, k] of a fast operand: rows to 16, k to the GEMM's alignment."""
        return round_up(rows, 16), round_up(k, self.k_align)

    @property
    def stochastic(self) -> bool:
        """Whether the operand draws stochastic-rounding noise (its seed matters)."""
        return self.spec is not None and self.spec.rounding is Rounding.STOCHASTIC

    def k_padded(self, k: int) -> int:
        """The reference's padded contraction length (SR noise offsets)."""
        return padded_width(k, self.hadamard, self.spec.block[1])

    def to_dict(self):
        return {"spec": self.spec.to_dict() if self.spec else None, "hadamard": self.hadamard,
                "signed": self.signed, "form": self.form, "k_align": self.k_align}

    @classmethod
    def from_dict(cls, d):
        return cls(QuantSpec.from_dict(d["spec"]) if d["spec"] else None, d["hadamard"], d["signed"], d["form"],
                   d["k_align"])


class Operand(NamedTuple):
    """fp32/hp: data only (scale = 1); bf16: data + FP32 tensor scale; fp8: E4M3 data, FP32 row scales, and the
    lost-block parts (side values, block exponents, row flags + a last "any row" flag; kernels/src/operand.py).  Unused: empty."""

    data: torch.Tensor
    scale: torch.Tensor
    side: torch.Tensor
    eb: torch.Tensor
    flags: torch.Tensor


class RowGroups(NamedTuple):
    """Groups of a tensor's rows quantized as separate tensors by one operand call (grouped expert GEMMs, issue 16):
    each group has its own tensor amax (two-level formats) and SR stream, as if its rows were a tensor of their own.

    ids [R] int32: the group of each row; starts [E] int32: each group's first row; kp [E] int32: each group's padded
    length along the rows -- the contraction of the transposed orientation, whose SR coordinates run along it
    (OperandPlan.k_padded of the group's row count).  Group boundaries are multiples of 16 rows."""

    ids: torch.Tensor
    starts: torch.Tensor
    kp: torch.Tensor

    @property
    def count(self) -> int:
        return self.starts.shape[0]


def empty_operand(plan: OperandPlan, rows: int, k: int, device, dtype=torch.float32, groups: int = 0,
                  contraction_grouped: bool = False) -> Operand:
    """Allocate an operand of `plan` (shapes and dtypes; also the custom op's fake implementation); `groups` > 0:
    a grouped operand (RowGroups), whose two-level decode scales are one per group, and whose FP8 row scales are
    per row and group ([E * rows]) where the groups run along its contraction (`contraction_grouped`: the
    transposed orientation)."""
    def none():
        return torch.empty(0, device=device)

    one = torch.ones(1, dtype=torch.float32, device=device)
    if plan.form in ("fp32", "hp"):
        width = k + (-k % plan.hadamard if plan.hadamard else 0)
        return Operand(torch.empty(rows, width, dtype=dtype if plan.form == "hp" else torch.float32,
                                   device=device), one, none(), none(), none())
    r, c = plan.shape(rows, k)
    if plan.form == "fp8":
        return Operand(torch.empty(r, c, dtype=torch.float8_e4m3fn, device=device),
                       torch.empty(r * (groups if groups and contraction_grouped else 1), dtype=torch.float32,
                                   device=device),
                       torch.empty(r, c, dtype=torch.float8_e4m3fn, device=device),
                       torch.full((r, c // plan.spec.block[1]), -128, dtype=torch.int8, device=device),
                       torch.zeros(r + 1, dtype=torch.int8, device=device))  # [r]: any row flagged
    scale = torch.empty(groups, dtype=torch.float32, device=device) if groups and plan.stat == 2 else one
    return Operand(torch.empty(r, c, dtype=torch.bfloat16, device=device), scale, none(), none(), none())
