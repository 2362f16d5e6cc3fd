"""hf_fp4: FP4 pretraining for the Hugging Face stack, with an exact pure-PyTorch reference."""
from .formats import Grid, decode, encode, grid_max, magnitudes, round_to_grid
from .hadamard import apply_hadamard, hadamard_matrix, random_signs, remove_mean_bias, seeded_signs
from .quantize import QuantizedTensor, fake_quantize, quant_error_stats, quantize
from .scales import ScaleRule
from .spec import NonFinite, QuantSpec, Rounding

__version__ = "0.1.0"

__all__ = [
    "Grid", "ScaleRule", "Rounding", "NonFinite", "QuantSpec", "QuantizedTensor",
    "quantize", "fake_quantize", "quant_error_stats", "encode", "decode", "grid_max", "magnitudes",
    "round_to_grid", "apply_hadamard", "hadamard_matrix", "random_signs", "seeded_signs",
    "remove_mean_bias",
]
