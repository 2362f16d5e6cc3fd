"""Transformers integration: FP4TrainConfig (a QuantizationConfigMixin) and FP4HfQuantizer.

`import hf_fp4` registers both under the quant method "hf_fp4", so

    AutoModelForCausalLM.from_config(cfg, quantization_config=FP4TrainConfig("ufp4"))
    AutoModelForCausalLM.from_pretrained(bf16_dir, quantization_config=FP4TrainConfig("nvfp4"))
    AutoModelForCausalLM.from_pretrained(saved_fp4_dir)      # recipe read back from config.json

all give a model whose decoder linears are FP4Linear.  transformers' `_from_config` ignores
`quantization_config`, so `route_from_config` wraps it narrowly: only an FP4TrainConfig (or a dict
with quant_method "hf_fp4") is intercepted; every other call goes through untouched.
"""
from __future__ import annotations

import functools
from typing import Any

from transformers import PreTrainedModel
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                          register_quantization_config, register_quantizer)
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..nn.attention import enable as enable_attention, register as register_attention
from ..nn import lora_svd
from ..nn.swap import convert_model, fp4_modules
from ..nn.experts import expect_packed_experts, experts_modules, unpack_experts
from ..nn.packing import expect_packed_weight, unpack_weight
from ..nn.recipe import Recipe, preset

QUANT_METHOD = "hf_fp4"


class FP4TrainConfig(QuantizationConfigMixin):
    """Quantization config of an hf_fp4 training model.

    FP4TrainConfig("ufp4")                          a preset (see hf_fp4.PRESET_NAMES)
    FP4TrainConfig("mxfp4", gemms=("fprop",), hadamard="deterministic", hadamard_size=32,
                   grid="e1m2", mean_bias_removal=True, lora_svd_rank=16, seed=0,
                   rules={"keep_last_blocks": 2, "overrides": {"*q_proj": "mxfp8"}})
    FP4TrainConfig(recipe_dict)                     a full recipe (as written to config.json)
    FP4TrainConfig("nvfp4", attention="nvfp4")      + FP4 attention (hf_fp4.nn.attention): a format for Q, K, V
                                                    and dS, or {"q": ..., "k": ..., "v": ..., "ds": ...}
    """

    def __init__(self, recipe: "str | dict | Recipe" = "ufp4", **options: Any):
        self.packed = bool(options.pop("packed", False))  # weights stored as packed FP4 (scripts/export.py)
        quant_method = options.pop("quant_method", QUANT_METHOD)
        if quant_method != QUANT_METHOD:
            raise ValueError(f"FP4TrainConfig is quant_method {QUANT_METHOD!r}, got {quant_method!r}")
        self.quant_method = QUANT_METHOD
        if isinstance(recipe, Recipe):
            built = recipe
        elif isinstance(recipe, dict):
            if options:
                raise ValueError(f"FP4TrainConfig: options {sorted(options)} cannot modify a recipe dict")
            built = Recipe.from_dict(recipe)
        elif isinstance(recipe, str):
            try:
                built = preset(recipe, **options)
            except TypeError as err:
                raise ValueError(f"FP4TrainConfig: {err}") from None
        else:
            raise TypeError(f"recipe must be a preset name, dict or Recipe, got {type(recipe).__name__}")
        self._built = built  # validated once, here; the quantizer converts the model with this object
        self.recipe = built.to_dict()  # what config.json holds

    def get_recipe(self) -> Recipe:
        return self._built

    @property
    def recipe_name(self) -> str:
        return self.recipe["name"]

    def to_dict(self) -> dict[str, Any]:
        out = {"quant_method": self.quant_method, "recipe": self.recipe}
        if self.packed:
            out["packed"] = True
        return out

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        config = cls(config_dict["recipe"], packed=config_dict.get("packed", False))
        return (config, kwargs) if return_unused_kwargs else config


class FP4HfQuantizer(HfQuantizer):
    """Swaps decoder linears for FP4Linear before weights load; splits LoRA-SVD layers after."""

    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        if isinstance(quantization_config, dict):
            quantization_config = FP4TrainConfig.from_dict(quantization_config)
        super().__init__(quantization_config, **kwargs)

    def _process_model_before_weight_loading(self, model, **kwargs):
        recipe = self.quantization_config.get_recipe()
        convert_model(model, recipe)
        if recipe.attention is not None:
            enable_attention(model, recipe.attention)
        if self.quantization_config.packed:
            for module in fp4_modules(model).values():
                expect_packed_weight(module)
            for module in experts_modules(model).values():
                if hasattr(module, "hf_fp4") and module.hf_fp4.recipe.fprop.rhs is not None:
                    expect_packed_experts(module)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.quantization_config.packed:
            for module in fp4_modules(model).values():
                unpack_weight(module)
            for module in experts_modules(model).values():
                if hasattr(module, "hf_fp4"):
                    unpack_experts(module)
        # A saved hf_fp4 checkpoint carries W_res, A and B; a plain checkpoint is split now.
        if not self.pre_quantized:
            lora_svd.split_model(model, fresh=True)
        return model

    def is_serializable(self, safe_serialization=None):
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return True


def is_fp4_config(qc) -> bool:
    return isinstance(qc, FP4TrainConfig) or (isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD)


def apply_fp4_config(model: PreTrainedModel, qc: "FP4TrainConfig | dict") -> PreTrainedModel:
    """Convert an already-built model in memory, exactly as from_pretrained's quantizer would."""
    if isinstance(qc, dict):
        qc = FP4TrainConfig.from_dict(qc)
    quantizer = FP4HfQuantizer(qc, pre_quantized=False)
    quantizer.preprocess_model(model)
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    return model


def route_from_config() -> None:
    """Make `from_config(cfg, quantization_config=FP4TrainConfig(...))` apply the recipe (idempotent)."""
    original = PreTrainedModel.__dict__["_from_config"].__func__
    if getattr(original, "_hf_fp4_routed", False):
        return

    @functools.wraps(original)
    def _from_config(cls, config, **kwargs):
        qc = kwargs.get("quantization_config")
        if not is_fp4_config(qc):
            return original(cls, config, **kwargs)
        kwargs.pop("quantization_config")
        return apply_fp4_config(original(cls, config, **kwargs), qc)

    _from_config._hf_fp4_routed = True
    PreTrainedModel._from_config = classmethod(_from_config)


def register() -> None:
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(FP4TrainConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(FP4HfQuantizer)
    register_attention()  # attn_implementation="hf_fp4"
    route_from_config()
