"""hf_fp4: FP4 pretraining for the Hugging Face stack, with an exact pure-PyTorch reference."""
from .formats import Grid, decode, encode, grid_max, magnitudes, round_to_grid
from .hadamard import apply_hadamard, hadamard_matrix, random_signs, remove_mean_bias, seeded_signs
from .quantize import NonFiniteError, QuantizedTensor, fake_quantize, quant_error_stats, quantize
from .scales import ScaleRule
from .spec import NonFinite, QuantSpec, Rounding

__version__ = "0.1.0"

__all__ = [
    "Grid", "ScaleRule", "Rounding", "NonFinite", "NonFiniteError", "QuantSpec", "QuantizedTensor",
    "quantize", "fake_quantize", "quant_error_stats", "encode", "decode", "grid_max", "magnitudes",
    "round_to_grid", "apply_hadamard", "hadamard_matrix", "random_signs", "seeded_signs",
    "remove_mean_bias",
]

from .convert import (convert_model, fp4_modules, load_rng_state_dict, lora_svd_split, maybe_refresh_lora_svd,
                      rng_state_dict, swap_linear_layers)
from .linear import FP4Linear, observe_operands
from .recipe import PRESET_NAMES, GemmSpec, HadamardSpec, LayerRules, LinearRecipe, Recipe, preset
from .integration import FP4HfQuantizer, FP4TrainConfig, register as _register

_register()

__all__ += [
    "FP4Linear", "FP4TrainConfig", "FP4HfQuantizer", "Recipe", "LinearRecipe", "GemmSpec", "HadamardSpec",
    "LayerRules", "PRESET_NAMES", "preset", "convert_model", "swap_linear_layers", "fp4_modules",
    "observe_operands", "lora_svd_split", "maybe_refresh_lora_svd", "rng_state_dict", "load_rng_state_dict",
]

from .compile import compile_model  # noqa: E402
from .diagnostics import collect_diagnostics  # noqa: E402
from .attention import AttentionRecipe, fp4_attention  # noqa: E402

__all__ += ["collect_diagnostics", "compile_model", "AttentionRecipe", "fp4_attention"]
