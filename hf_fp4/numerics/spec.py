"""QuantSpec: how one GEMM operand is quantized -- element grid, block shape, scale rule, rounding.

A frozen dataclass whose fields accept plain names and are validated on construction, so
``dataclasses.replace(spec, rounding="stochastic")`` works and a typo fails at once with the list of
valid values.  Blocks run along the last (contraction) dimension: ``(1, B)`` is a 1xB block, ``(B, B)``
a 2D tile.  Presets (RESEARCH.md, "Scale formats and block layouts"):

| preset   | grid | block | scale rule                     | bits/value |
|----------|------|-------|--------------------------------|------------|
| nvfp4    | E2M1 | 1x16  | UE4M3 block + FP32 tensor      | 4.5        |
| nvfp4_2d | E2M1 | 16x16 | UE4M3 block + FP32 tensor      | 4.03       |
| mxfp4    | E2M1 | 1x32  | E8M0, OCP floor                | 4.25       |
| mxfp4_up | E2M1 | 1x32  | E8M0, truncation-free (ceil)   | 4.25       |
| mxfp8    | E4M3 | 1x32  | E8M0, OCP floor                | 8.25       |
| ufp4     | E1M2 | 1x16  | UE4M3 block + FP32 tensor      | 4.5        |
| int4     | INT4 | 1x16  | UE4M3 block + FP32 tensor      | 4.5        |

bits/value counts element and block-scale bits; the single FP32 tensor scale is left out.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from .formats import ELEMENT_BITS, Grid, as_grid
from .scales import SCALE_BITS, ScaleRule


class Rounding(str, enum.Enum):
    NEAREST = "nearest"
    STOCHASTIC = "stochastic"


class NonFinite(str, enum.Enum):
    """What quantize does with NaN/Inf input: raise (default) or make the whole block NaN."""

    RAISE = "raise"
    PROPAGATE = "propagate"


BLOCK_SIZES = (8, 16, 32, 64, 128)


def _as_enum(enum_cls: type[enum.Enum], value: Any, field: str) -> enum.Enum:
    try:
        return enum_cls(value)
    except ValueError:
        valid = ", ".join(m.value for m in enum_cls)
        raise ValueError(f"QuantSpec.{field}: unknown value {value!r}; valid: {valid}") from None


@dataclass(frozen=True)
class QuantSpec:
    """One operand's quantization. See the module docstring for the presets."""

    grid: Grid = Grid.E2M1
    block: tuple[int, int] = (1, 16)
    scale: ScaleRule = ScaleRule.UE4M3_FP32
    rounding: Rounding = Rounding.NEAREST
    nonfinite: NonFinite = NonFinite.RAISE

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", as_grid(self.grid))
        object.__setattr__(self, "scale", _as_enum(ScaleRule, self.scale, "scale"))
        object.__setattr__(self, "rounding", _as_enum(Rounding, self.rounding, "rounding"))
        object.__setattr__(self, "nonfinite", _as_enum(NonFinite, self.nonfinite, "nonfinite"))
        block = self.block
        if isinstance(block, int):
            block = (1, block)
        try:
            block = tuple(int(b) for b in block)
        except TypeError:
            raise ValueError(f"QuantSpec.block must be (1, B) or (B, B), got {self.block!r}") from None
        if (len(block) != 2 or block[1] not in BLOCK_SIZES or block[0] not in (1, block[1])):
            raise ValueError(f"QuantSpec.block must be (1, B) or (B, B) with B in {BLOCK_SIZES}, "
                             f"got {self.block!r}")
        object.__setattr__(self, "block", block)

    @property
    def is_2d(self) -> bool:
        return self.block[0] > 1

    @property
    def block_numel(self) -> int:
        return self.block[0] * self.block[1]

    @property
    def bits_per_value(self) -> float:
        """Element bits plus block-scale bits per element (the FP32 tensor scale is not counted)."""
        return ELEMENT_BITS[self.grid] + SCALE_BITS[self.scale] / self.block_numel

    def to_dict(self) -> dict[str, Any]:
        return {"grid": self.grid.value, "block": list(self.block), "scale": self.scale.value,
                "rounding": self.rounding.value, "nonfinite": self.nonfinite.value}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "QuantSpec":
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            valid = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ValueError(f"QuantSpec: unknown field(s) {sorted(unknown)}; valid: {valid}")
        return cls(**{k: tuple(v) if k == "block" else v for k, v in data.items()})

    @classmethod
    def preset(cls, name: str) -> "QuantSpec":
        if name not in PRESETS:
            raise ValueError(f"unknown QuantSpec preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def presets(cls) -> list[str]:
        return list(PRESETS)


PRESETS: dict[str, QuantSpec] = {
    "nvfp4": QuantSpec("e2m1", (1, 16), "ue4m3_fp32"),
    "nvfp4_2d": QuantSpec("e2m1", (16, 16), "ue4m3_fp32"),
    "mxfp4": QuantSpec("e2m1", (1, 32), "e8m0_floor"),
    "mxfp4_up": QuantSpec("e2m1", (1, 32), "e8m0_ceil"),
    "mxfp8": QuantSpec("e4m3", (1, 32), "e8m0_floor"),
    "ufp4": QuantSpec("e1m2", (1, 16), "ue4m3_fp32"),
    "ufp4_2d": QuantSpec("e1m2", (16, 16), "ue4m3_fp32"),
    "int4": QuantSpec("int4", (1, 16), "ue4m3_fp32"),
    "mxfp4_2d_up": QuantSpec("e2m1", (16, 16), "e8m0_ceil"),
}


def as_spec(spec: "QuantSpec | str") -> QuantSpec:
    """A QuantSpec, or a preset name."""
    if isinstance(spec, QuantSpec):
        return spec
    if isinstance(spec, str):
        return QuantSpec.preset(spec)
    raise TypeError(f"expected a QuantSpec or a preset name, got {type(spec).__name__}")
