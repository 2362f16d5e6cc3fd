"""hf_fp4: FP4 pretraining for the Hugging Face stack, with an exact pure-PyTorch reference."""
from .numerics.formats import Grid, decode, encode, grid_max, magnitudes, round_to_grid
from .numerics.hadamard import apply_hadamard, hadamard_matrix, random_signs, remove_mean_bias, seeded_signs
from .numerics.quantize import NonFiniteError, QuantizedTensor, quant_error_stats
from .nn.backends import fake_quantize, quantize
from .numerics.scales import ScaleRule
from .numerics.spec import NonFinite, QuantSpec, Rounding

__version__ = "0.1.0"

__all__ = [
    "Grid", "ScaleRule", "Rounding", "NonFinite", "NonFiniteError", "QuantSpec", "QuantizedTensor",
    "quantize", "fake_quantize", "quant_error_stats", "encode", "decode", "grid_max", "magnitudes",
    "round_to_grid", "apply_hadamard", "hadamard_matrix", "random_signs", "seeded_signs",
    "remove_mean_bias",
]

from .nn.lora_svd import maybe_refresh as maybe_refresh_lora_svd, split_model as lora_svd_split
from .nn.swap import (convert_model, enable_fp4_all_gather, fp4_modules, load_rng_state_dict, set_fp8_gemms,
                      rng_state_dict, swap_linear_layers)
from .nn.linear import FP4Linear, observe_operands
from .nn.recipe import PRESET_NAMES, GemmSpec, HadamardSpec, LayerRules, LinearRecipe, Recipe, preset
from .hf.quantizer import FP4HfQuantizer, FP4TrainConfig, register as _register

_register()

__all__ += [
    "FP4Linear", "FP4TrainConfig", "FP4HfQuantizer", "Recipe", "LinearRecipe", "GemmSpec", "HadamardSpec",
    "LayerRules", "PRESET_NAMES", "preset", "convert_model", "swap_linear_layers", "fp4_modules",
    "observe_operands", "set_fp8_gemms", "lora_svd_split", "maybe_refresh_lora_svd", "rng_state_dict",
    "load_rng_state_dict",
]

from .nn.compile import compile_model  # noqa: E402
from .nn.diagnostics import collect_diagnostics  # noqa: E402
from .nn.attention import AttentionRecipe, fp4_attention  # noqa: E402
from .nn.fp4_gather import precompute_fp4_amax  # noqa: E402

__all__ += ["collect_diagnostics", "compile_model", "AttentionRecipe", "fp4_attention", "enable_fp4_all_gather",
            "precompute_fp4_amax"]
