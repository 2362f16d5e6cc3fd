"""Unquantized MoE experts that compute in the autocast dtype, as nn.Linear does.

Transformers' `grouped_mm` experts implementation (the default where torch has grouped GEMMs) is not autocast-aware:
it casts the tokens to the weights' dtype.  Under BF16 autocast with FP32 master weights -- what Accelerate's
`mixed_precision="bf16"` and hf_fp4's trainer give a model -- a BF16 model's expert GEMMs therefore run in FP32,
while its attention and dense projections run in BF16: a "bf16" baseline that is neither (slower, and more precise in
its experts than the FP4 runs it is compared with, whose unquantized experts run F.linear under autocast).

`autocast_experts(model)` switches the model to `<implementation>+autocast`: the same implementation, given the
module's floating-point parameters in the autocast dtype (the cast is differentiable: gradients reach the FP32
parameters, as autocast's own casts do).  Outside autocast it is the implementation itself.
"""
from __future__ import annotations

import torch

SUFFIX = "+autocast"
#: implementations that need no view: Transformers' per-expert loop (F.linear casts under autocast) and hf_fp4's own
AWARE = ("eager", "hf_fp4")


class _AutocastView:
    """The experts module as an implementation reads it, with its floating-point parameters in `dtype`."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self._module = module
        self._dtype = dtype

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if isinstance(value, torch.nn.Parameter) and value.is_floating_point() and value.dtype != self._dtype:
            return value.to(self._dtype)
        return value


def _autocast_forward(base):
    def forward(module, hidden_states, *args, **kwargs):
        device = hidden_states.device.type
        if not torch.is_autocast_enabled(device):
            return base(module, hidden_states, *args, **kwargs)
        return base(_AutocastView(module, torch.get_autocast_dtype(device)), hidden_states, *args, **kwargs)

    return forward


def autocast_experts(model: torch.nn.Module) -> str | None:
    """Switch a MoE model (one with experts modules: hf_fp4.nn.experts.experts_modules) whose experts implementation
    ignores autocast to its `+autocast` form; returns the new implementation's name, or None (an implementation
    that follows autocast already)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    config = getattr(model, "config", None)
    impl = getattr(config, "_experts_implementation", None)
    if impl is None or impl in AWARE or impl.endswith(SUFFIX):
        return None
    if impl not in ALL_EXPERTS_FUNCTIONS:
        raise ValueError(f"experts implementation {impl!r} is not registered in Transformers' ExpertsInterface; "
                         f"registered: {', '.join(sorted(ALL_EXPERTS_FUNCTIONS))}")
    name = impl + SUFFIX
    if name not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(name, _autocast_forward(ALL_EXPERTS_FUNCTIONS[impl]))
    config._experts_implementation = name
    return name
