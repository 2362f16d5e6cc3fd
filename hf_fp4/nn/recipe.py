"""Recipes as data: per-GEMM operand specs, Hadamard, mean-bias removal, LoRA-SVD and layer rules.

A linear layer y = x W^T trains with three GEMMs (RESEARCH.md, "The three training GEMMs"):

    fprop: y  = Q(x)    Q(W)^T       [T,K] @ [K,N] -> [T,N]   contraction K (in-features)
    dgrad: dx = Q(dy)   Q(W^T)^T     [T,N] @ [N,K] -> [T,K]   contraction N (out-features)
    wgrad: dW = Q(dy^T) Q(x^T)^T     [N,T] @ [T,K] -> [N,K]   contraction T (tokens)

Each GEMM has a `GemmSpec`: a QuantSpec (or None = high precision) for its left operand (x, dy, dy^T)
and right operand (W, W^T, x^T), blocks along that GEMM's contraction dimension, plus a Hadamard
rotation applied to both operands along the same dimension.  A `LinearRecipe` holds the three GEMMs
and the layer-level options; a `Recipe` adds the rules that pick which modules get which recipe.

The presets are below (LINEAR_PRESETS, RECIPE_RULES); `preset_table()` renders them as the README's table.
"""
from __future__ import annotations

import dataclasses
import enum
import fnmatch
import inspect
import re
from dataclasses import dataclass
from typing import Any

from .attention import AttentionRecipe
from ..numerics.hadamard import HADAMARD_SIZES
from ..numerics.spec import QuantSpec, as_spec

GEMMS = ("fprop", "dgrad", "wgrad")
OPERANDS = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("dy", "x")}
#: How LoRA-SVD's factors evolve: trained by the optimizer, or frozen between re-splits (W_res takes every update)
LORA_SVD_FACTORS = ("trained", "frozen")


class HadamardKind(str, enum.Enum):
    NONE = "none"
    DETERMINISTIC = "deterministic"      # plain Sylvester H_n (AMD MXFP4 study)
    RANDOM_FIXED = "random_fixed"        # diag(s) H_n, one sign vector for the run (NVIDIA / TE)
    RANDOM_PER_STEP = "random_per_step"  # a new sign vector at every call


def _enum(cls, value, where):
    try:
        return cls(value)
    except ValueError:
        valid = ", ".join(m.value for m in cls)
        raise ValueError(f"{where}: unknown value {value!r}; valid: {valid}") from None


def _spec_or_none(value, where) -> QuantSpec | None:
    if value is None or value == "none":
        return None
    if isinstance(value, dict):
        return QuantSpec.from_dict(value)
    try:
        return as_spec(value)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


@dataclass(frozen=True)
class HadamardSpec:
    kind: HadamardKind = HadamardKind.NONE
    size: int = 16

    def __post_init__(self):
        object.__setattr__(self, "kind", _enum(HadamardKind, self.kind, "HadamardSpec.kind"))
        if self.size not in HADAMARD_SIZES:
            raise ValueError(f"HadamardSpec.size: {self.size} not in {HADAMARD_SIZES}")

    @property
    def enabled(self) -> bool:
        return self.kind is not HadamardKind.NONE

    def to_dict(self):
        return {"kind": self.kind.value, "size": self.size}


@dataclass(frozen=True)
class GemmSpec:
    """One GEMM: left operand (x, dy, dy^T), right operand (W, W^T, x^T), Hadamard on both."""

    lhs: QuantSpec | None = None
    rhs: QuantSpec | None = None
    hadamard: HadamardSpec = HadamardSpec()

    def __post_init__(self):
        object.__setattr__(self, "lhs", _spec_or_none(self.lhs, "GemmSpec.lhs"))
        object.__setattr__(self, "rhs", _spec_or_none(self.rhs, "GemmSpec.rhs"))
        if isinstance(self.hadamard, dict):
            object.__setattr__(self, "hadamard", HadamardSpec(**self.hadamard))
        elif isinstance(self.hadamard, str):
            object.__setattr__(self, "hadamard", HadamardSpec(self.hadamard))

    @property
    def quantized(self) -> bool:
        return self.lhs is not None or self.rhs is not None

    def to_dict(self):
        return {"lhs": self.lhs.to_dict() if self.lhs else None,
                "rhs": self.rhs.to_dict() if self.rhs else None, "hadamard": self.hadamard.to_dict()}


@dataclass(frozen=True)
class LinearRecipe:
    """How one FP4Linear trains: three GEMMs plus layer options."""

    fprop: GemmSpec = GemmSpec()
    dgrad: GemmSpec = GemmSpec()
    wgrad: GemmSpec = GemmSpec()
    mean_bias_removal: bool = False   # subtract the token mean of x (fprop and wgrad), add it back exactly
    lora_svd_rank: int = 0            # Full-Stack FP4: W = W_res + B A, W_res quantized, A and B not
    lora_svd_refresh_every: int = 0   # re-split every N optimizer steps (0 = never)
    lora_svd_factors: str = "trained"  # "frozen": A, B fixed between re-splits, W_res takes the whole update
    activation_scheme: str = "plain"  # "sharq": fprop's x as a 4:8 backbone + residual (inference; hf_fp4.nn.sharq)

    def __post_init__(self):
        for name in GEMMS:
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, GemmSpec(**value))
            elif not isinstance(value, GemmSpec):
                raise ValueError(f"LinearRecipe.{name} must be a GemmSpec or dict, got {type(value).__name__}")
        if self.lora_svd_rank < 0 or self.lora_svd_refresh_every < 0:
            raise ValueError("lora_svd_rank and lora_svd_refresh_every must be >= 0")
        if self.lora_svd_factors not in LORA_SVD_FACTORS:
            raise ValueError(f"lora_svd_factors={self.lora_svd_factors!r}: valid values are "
                             f"{', '.join(LORA_SVD_FACTORS)}")
        if self.lora_svd_factors == "frozen" and self.lora_svd_rank and not self.lora_svd_refresh_every:
            raise ValueError("lora_svd_factors='frozen' keeps B A fixed between re-splits: set "
                             "lora_svd_refresh_every > 0 (e.g. 100), or the low-rank part stays the initial "
                             "weights' top singular directions for the whole run")
        if self.activation_scheme not in ("plain", "sharq"):
            raise ValueError(f"activation_scheme={self.activation_scheme!r}: valid values are plain, sharq")
        if self.activation_scheme == "sharq":
            if self.fprop.lhs is None:
                raise ValueError("activation_scheme=sharq needs quantized activations in fprop (W4A4); this "
                                 "recipe keeps fprop's x in high precision")
            if self.fprop.hadamard.enabled:
                raise ValueError("activation_scheme=sharq is defined on the activations themselves: use it "
                                 "with hadamard=none in fprop")

    def gemm(self, name: str) -> GemmSpec:
        return getattr(self, name)

    @property
    def quantized(self) -> bool:
        return any(self.gemm(g).quantized for g in GEMMS)

    def operand_specs(self) -> list[QuantSpec]:
        return [s for g in GEMMS for s in (self.gemm(g).lhs, self.gemm(g).rhs) if s is not None]

    def to_dict(self):
        out = {g: self.gemm(g).to_dict() for g in GEMMS}
        out.update(mean_bias_removal=self.mean_bias_removal, lora_svd_rank=self.lora_svd_rank,
                   lora_svd_refresh_every=self.lora_svd_refresh_every)
        if self.activation_scheme != "plain":  # older checkpoints and configs stay as they were
            out["activation_scheme"] = self.activation_scheme
        if self.lora_svd_factors != "trained":
            out["lora_svd_factors"] = self.lora_svd_factors
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LinearRecipe":
        _check_keys(cls, data)
        return cls(**data)

    def with_options(self, *, gemms: tuple[str, ...] | None = None, hadamard: str | None = None,
                     hadamard_size: int | None = None, grid: str | None = None,
                     mean_bias_removal: bool | None = None, lora_svd_rank: int | None = None,
                     lora_svd_refresh_every: int | None = None, stochastic_rounding: bool | None = None,
                     weight_blocks: str | None = None, activation_scheme: str | None = None,
                     lora_svd_factors: str | None = None) -> "LinearRecipe":
        """The ablation switches: which GEMMs stay quantized, Hadamard kind/size, element grid, mean-bias
        removal, LoRA-SVD; stochastic_rounding=False rounds every operand to nearest; weight_blocks "1d" / "2d"
        gives the weight operands (fprop and dgrad rhs) 1 x B or B x B blocks; activation_scheme "sharq" (FP4
        inference with SharQ activations, hf_fp4.nn.sharq)."""
        for key, value, kind in (("hadamard_size", hadamard_size, int), ("mean_bias_removal", mean_bias_removal, bool),
                                 ("lora_svd_rank", lora_svd_rank, int),
                                 ("lora_svd_refresh_every", lora_svd_refresh_every, int),
                                 ("stochastic_rounding", stochastic_rounding, bool), ("weight_blocks", weight_blocks, str),
                                 ("lora_svd_factors", lora_svd_factors, str)):
            if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
                raise ValueError(f"recipe option {key} must be {kind.__name__}, got {type(value).__name__} {value!r}")
        if weight_blocks not in (None, "1d", "2d"):
            raise ValueError(f"recipe option weight_blocks={weight_blocks!r}: valid values are 1d, 2d")
        changes: dict[str, Any] = {}
        for name in GEMMS:
            g = self.gemm(name)
            if gemms is not None:
                unknown = set(gemms) - set(GEMMS)
                if unknown:
                    raise ValueError(f"unknown GEMM(s) {sorted(unknown)}; valid: {', '.join(GEMMS)}")
                if name not in gemms:
                    g = GemmSpec()
            if grid is not None:
                g = dataclasses.replace(g, lhs=g.lhs and dataclasses.replace(g.lhs, grid=grid),
                                        rhs=g.rhs and dataclasses.replace(g.rhs, grid=grid))
            if stochastic_rounding is False:
                g = dataclasses.replace(g, lhs=g.lhs and dataclasses.replace(g.lhs, rounding="nearest"),
                                        rhs=g.rhs and dataclasses.replace(g.rhs, rounding="nearest"))
            if weight_blocks is not None and name in ("fprop", "dgrad") and g.rhs is not None:
                b = g.rhs.block[1]
                g = dataclasses.replace(g, rhs=dataclasses.replace(g.rhs, block=(1, b) if weight_blocks == "1d" else (b, b)))
            if hadamard is not None or hadamard_size is not None:
                kind = hadamard if hadamard is not None else g.hadamard.kind
                size = hadamard_size if hadamard_size is not None else g.hadamard.size
                g = dataclasses.replace(g, hadamard=HadamardSpec(kind, size) if g.quantized else HadamardSpec())
            changes[name] = g
        for key, value in (("mean_bias_removal", mean_bias_removal), ("lora_svd_rank", lora_svd_rank),
                           ("lora_svd_refresh_every", lora_svd_refresh_every),
                           ("lora_svd_factors", lora_svd_factors), ("activation_scheme", activation_scheme)):
            if value is not None:
                changes[key] = value
        return dataclasses.replace(self, **changes)


def _check_keys(cls, data):
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - valid
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown key(s) {sorted(unknown)}; valid: {', '.join(sorted(valid))}")


@dataclass(frozen=True)
class LayerRules:
    """Which nn.Linear modules are converted, and with which recipe.

    skip: name patterns (fnmatch on the full name, or a plain suffix) never converted; embeddings are
    not nn.Linear and are never touched.  keep_first_blocks / keep_last_blocks: decoder blocks
    (`...layers.<i>.`) kept in high precision.  overrides: pattern -> recipe (preset name or dict)
    for matching modules, e.g. {"*q_proj": "mxfp8"}.
    """

    skip: tuple[str, ...] = ("lm_head",)
    keep_first_blocks: int = 0
    keep_last_blocks: int = 0
    overrides: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "skip", tuple(self.skip))
        overrides = self.overrides.items() if isinstance(self.overrides, dict) else self.overrides
        object.__setattr__(self, "overrides", tuple((str(p), r) for p, r in overrides))
        if self.keep_first_blocks < 0 or self.keep_last_blocks < 0:
            raise ValueError("keep_first_blocks / keep_last_blocks must be >= 0")
        for pattern, recipe in self.overrides:
            linear_recipe(recipe)  # validate now, not at step 1000

    def to_dict(self):
        return {"skip": list(self.skip), "keep_first_blocks": self.keep_first_blocks,
                "keep_last_blocks": self.keep_last_blocks,
                # a list of [pattern, recipe] pairs: the first match wins, so order is kept
                "overrides": [[p, r if isinstance(r, (str, dict)) else r.to_dict()] for p, r in self.overrides]}


def name_matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or name == pattern or name.endswith("." + pattern)


_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def block_index(name: str) -> int | None:
    m = _BLOCK_INDEX.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Recipe:
    """A named training recipe: the default LinearRecipe, layer rules, the seed for SR / RHT, the attention's
    formats (hf_fp4.nn.attention; None: the model's own attention) and the optimizer the recipe trains with
    (None: AdamW; the trainer's `optimizer: auto` follows it)."""

    name: str = "custom"
    linear: LinearRecipe = LinearRecipe()
    rules: LayerRules = LayerRules()
    seed: int = 0
    attention: Any = None
    optimizer: str | None = None

    def __post_init__(self):
        if self.attention is not None and not isinstance(self.attention, AttentionRecipe):
            object.__setattr__(self, "attention", AttentionRecipe.build(self.attention))
        if self.attention is not None and not self.attention.quantized:
            object.__setattr__(self, "attention", None)
        if isinstance(self.linear, dict):
            object.__setattr__(self, "linear", LinearRecipe.from_dict(self.linear))
        if isinstance(self.rules, dict):
            _check_keys(LayerRules, self.rules)
            object.__setattr__(self, "rules", LayerRules(**self.rules))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "linear": self.linear.to_dict(), "rules": self.rules.to_dict(),
                "seed": self.seed, "attention": self.attention.to_dict() if self.attention else None,
                "optimizer": self.optimizer}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Recipe":
        _check_keys(cls, data)
        return cls(**data)

    def recipe_for(self, name: str, num_blocks: int | None) -> LinearRecipe | None:
        """The LinearRecipe of module `name`, or None to leave it unconverted."""
        rules = self.rules
        if any(name_matches(name, p) for p in rules.skip):
            return None
        idx = block_index(name)
        if idx is not None and (idx < rules.keep_first_blocks or
                                (num_blocks is not None and idx >= num_blocks - rules.keep_last_blocks)):
            return LinearRecipe()  # converted, quantization off (same code path as bf16)
        for pattern, recipe in rules.overrides:
            if name_matches(name, pattern):
                return linear_recipe(recipe)
        return self.linear


# ----------------------------------------------------------------------------------------------
# Presets
def _gemm(lhs, rhs, hadamard=HadamardSpec(), *, sr_lhs=False):
    lhs = as_spec(lhs)
    if sr_lhs:
        lhs = dataclasses.replace(lhs, rounding="stochastic")
    return GemmSpec(lhs, as_spec(rhs), hadamard)


def _uniform(spec: str, hadamard=HadamardSpec(), sr_grads=False, wgrad_hadamard=None) -> LinearRecipe:
    return LinearRecipe(
        fprop=_gemm(spec, spec, hadamard),
        dgrad=_gemm(spec, spec, hadamard, sr_lhs=sr_grads),
        wgrad=_gemm(spec, spec, wgrad_hadamard or hadamard, sr_lhs=sr_grads))


def _nvfp4() -> LinearRecipe:
    rht16 = HadamardSpec("random_fixed", 16)
    return LinearRecipe(fprop=_gemm("nvfp4", "nvfp4_2d"),
                        dgrad=_gemm("nvfp4", "nvfp4_2d", sr_lhs=True),
                        wgrad=_gemm("nvfp4", "nvfp4", rht16, sr_lhs=True))


LINEAR_PRESETS = {
    "bf16": LinearRecipe,
    "nvfp4": _nvfp4,
    "mxfp4": lambda: _uniform("mxfp4"),
    "mxfp4_dh": lambda: _uniform("mxfp4", wgrad_hadamard=HadamardSpec("deterministic", 32)),
    "ufp4": lambda: _uniform("ufp4", HadamardSpec("random_fixed", 16), sr_grads=True),
    "tib": lambda: _uniform("mxfp4_2d_up", sr_grads=True),
    "mxfp8": lambda: _uniform("mxfp8"),
    # Full-Stack FP4: NVFP4 linears with LoRA-SVD (rank 16: the paper does not state it; RESEARCH.md infers
    # 8-64), plus FP4 attention and FP4 AdamW state (RECIPE_ATTENTION, RECIPE_OPTIMIZER).  The factors are frozen
    # between re-splits every 100 steps: trained factors (the paper's) diverged in every probe at bench-50m's lr
    # (benchmarks/study-lora-probe/: gradient norm to ~30-1100, val loss 5.1-5.9 against NVFP4's 3.5-3.9), frozen
    # ones trained as NVFP4 does; lora_svd_factors="trained", lora_svd_refresh_every=0 give the paper's variant
    "fullstack": lambda: _nvfp4().with_options(lora_svd_rank=16, lora_svd_factors="frozen",
                                               lora_svd_refresh_every=100),
}

def linear_recipe(value: "str | dict | LinearRecipe") -> LinearRecipe:
    if isinstance(value, LinearRecipe):
        return value
    if isinstance(value, dict):
        return LinearRecipe.from_dict(value)
    if value not in LINEAR_PRESETS:  # a layer override may also name mxfp8
        raise ValueError(f"unknown linear recipe {value!r}; valid presets: {', '.join(LINEAR_PRESETS)}")
    return LINEAR_PRESETS[value]()


RECIPE_RULES = {"tib": LayerRules(overrides=(("*q_proj", "mxfp8"), ("*k_proj", "mxfp8")))}
#: Attention formats of a preset (Q, K, V, dS; dS rounds to nearest: stochastic rounding there would need a
#: per-step seed the compiled step cannot take from the host) and its optimizer.
RECIPE_ATTENTION = {"fullstack": "nvfp4"}
RECIPE_OPTIMIZER = {"fullstack": "fp4_adamw"}


def preset(name: str, **options) -> Recipe:
    """A preset Recipe; `options` are LinearRecipe.with_options switches plus `seed`, `rules` and `attention`
    (a format for Q, K, V and dS, a mapping of them, or "none")."""
    if name not in PRESET_NAMES:  # the one check of a preset name (FP4TrainConfig and TrainConfig call this)
        raise ValueError(f"unknown recipe {name!r}; valid presets: {', '.join(PRESET_NAMES)}")
    seed = options.pop("seed", 0)
    rules = options.pop("rules", None)
    attention = options.pop("attention", RECIPE_ATTENTION.get(name))
    unknown = sorted(set(options) - set(RECIPE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown recipe option(s) {unknown}; valid: seed, rules, attention, "
                         f"{', '.join(RECIPE_OPTIONS)}")
    linear = linear_recipe(name)
    if options:
        linear = linear.with_options(**options)
    if rules is None:
        rules = RECIPE_RULES.get(name, LayerRules())
    elif isinstance(rules, dict):
        _check_keys(LayerRules, rules)
        rules = LayerRules(**{**RECIPE_RULES.get(name, LayerRules()).to_dict(), **rules})
    return Recipe(name=name, linear=linear, rules=rules, seed=seed,
                  attention=AttentionRecipe.build(attention) if attention is not None else None,
                  optimizer=RECIPE_OPTIMIZER.get(name))


PRESET_NAMES = tuple(n for n in LINEAR_PRESETS if n != "mxfp8")
#: The ablation switches preset() accepts (besides seed and rules): LinearRecipe.with_options' keywords.
RECIPE_OPTIONS = tuple(p for p in inspect.signature(LinearRecipe.with_options).parameters if p != "self")


#: Every option of preset() / FP4TrainConfig(name, **options): (values, meaning).  The README's option table is
#: generated from it (option_table()); a test fails when an option lacks a row or the README drifts.
OPTION_DOCS = {
    "gemms": ("subset of " + ", ".join(GEMMS), "the GEMMs that stay quantized; the others run in high precision"),
    "hadamard": (", ".join(k.value for k in HadamardKind), "the rotation of every quantized GEMM's operands"),
    "hadamard_size": (", ".join(str(n) for n in HADAMARD_SIZES), "the rotation's block"),
    "grid": ("e2m1, e1m2, int4", "the element grid of every operand"),
    "mean_bias_removal": ("bool", "fprop and wgrad quantize x - mean over tokens; the rank-one terms are added "
                          "back in high precision"),
    "lora_svd_rank": ("int >= 0", "LoRA-SVD: W = W_res + B A, the rank-r B A trained unquantized (hf_fp4.nn.lora_svd)"),
    "lora_svd_refresh_every": ("int >= 0", "fold B A back and re-split every N optimizer steps (0: never)"),
    "lora_svd_factors": ("trained, frozen", "frozen: A and B fixed between re-splits (no gradient), W_res takes "
                         "the whole update; needs lora_svd_refresh_every"),
    "stochastic_rounding": ("bool", "False rounds every operand to nearest"),
    "weight_blocks": ("1d, 2d", "the fprop / dgrad weight operands' blocks: 1 x B or B x B"),
    "activation_scheme": ("plain, sharq", "sharq: fprop's x as SharQ's 4:8 backbone + residual (inference only)"),
    "seed": ("int", "the seed of the SR streams and random Hadamard signs"),
    "rules": ("mapping: skip, keep_first_blocks, keep_last_blocks, overrides", "which linears are converted, "
              "and with which recipe (e.g. overrides {'*q_proj': 'mxfp8'})"),
    "attention": ("a format, none, or {q, k, v, ds}", "FP4 attention (attn_implementation hf_fp4)"),
}


def option_table() -> str:
    """The README's table of recipe options, generated from OPTION_DOCS."""
    rows = ["| option | values | what it does |", "|---|---|---|"]
    rows += [f"| `{name}` | {values} | {meaning} |" for name, (values, meaning) in OPTION_DOCS.items()]
    return "\n".join(rows) + "\n"


def _spec_label(spec: QuantSpec) -> str:
    """A QuantSpec by its preset name (plus "SR" for stochastic rounding), or its fields."""
    base = dataclasses.replace(spec, rounding="nearest", nonfinite="raise")
    name = next((n for n in QuantSpec.presets() if QuantSpec.preset(n) == base), None)
    label = name or f"{spec.grid.value} {spec.block[0]}x{spec.block[1]} {spec.scale.value}"
    return label + (" SR" if spec.rounding.value == "stochastic" else "")


def preset_table() -> str:
    """The README's table of training recipes, generated from the presets (a test keeps the README equal)."""
    rows = ["| recipe | fprop x / W | dgrad dy / Wᵀ | wgrad dyᵀ / xᵀ | Hadamard | layer rules | beyond the linears |",
            "|---|---|---|---|---|---|---|"]
    for name in PRESET_NAMES:
        recipe = preset(name)
        cells = []
        for g in GEMMS:
            gs = recipe.linear.gemm(g)
            cells.append(" / ".join(_spec_label(s) if s else "—" for s in (gs.lhs, gs.rhs)) if gs.quantized else "—")
        groups: dict[tuple, list[str]] = {}
        for g in GEMMS:
            h = recipe.linear.gemm(g).hadamard
            if h.enabled:
                groups.setdefault((h.kind.value, h.size), []).append(g)
        hadamard = "; ".join(f"{kind} H-{size}: {', '.join(gs)}" for (kind, size), gs in groups.items()) or "—"
        rules = ", ".join(f"`{pattern.lstrip('*')}`: {r}" for pattern, r in recipe.rules.overrides) or "—"
        if not recipe.linear.quantized:
            rules = "quantization off (the same code path)"
        extra = []
        if recipe.linear.lora_svd_rank:
            lin = recipe.linear
            extra.append(f"LoRA-SVD rank {lin.lora_svd_rank}" + (f", factors frozen, re-split every "
                                                                 f"{lin.lora_svd_refresh_every} steps"
                                                                 if lin.lora_svd_factors == "frozen" else ""))
        if recipe.attention is not None:
            extra.append("attention " + ", ".join(f"{t} {_spec_label(s) if s else 'BF16'}"
                                                  for t, s in recipe.attention.specs().items()))
        if recipe.optimizer:
            extra.append(f"optimizer `{recipe.optimizer}`")
        rows.append(f"| `{name}` | {' | '.join(cells)} | {hadamard} | {rules} | {'; '.join(extra) or '—'} |")
    return "\n".join(rows) + "\n"
