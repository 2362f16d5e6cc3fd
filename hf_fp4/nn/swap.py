"""The one module swap: nn.Linear -> FP4Linear (and MoE experts -> hf_fp4.nn.experts), following a Recipe's
layer rules."""
from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import Callable

from torch import distributed, nn

from .attention import attention_rngs, place_attention_rngs
from .experts import convert_experts, experts_states, place_experts_state
from .fp4_gather import FP4MasterWeight, WeightGather, orientation_bytes, weight_gather
from .linear import FP4Linear
from .recipe import GEMMS, LinearRecipe, Recipe, block_index


def swap_linear_layers(model: nn.Module, make_fp4: Callable[[str, nn.Linear], nn.Module | None],
                       module_filter: Callable[[str, nn.Module], bool] = lambda name, m: True) -> int:
    """Replace every nn.Linear (not already FP4) for which module_filter holds by make_fp4(name, linear).

    make_fp4 may return None to leave a module alone. Returns the number of modules replaced.
    """
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not isinstance(m, FP4Linear) and module_filter(name, m)]
    swapped = 0
    for name, linear in targets:
        new = make_fp4(name, linear)
        if new is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        swapped += 1
    return swapped


def num_decoder_blocks(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n = getattr(text, "num_hidden_layers", None)
        if n:
            return int(n)
    indices = [block_index(name) for name, _ in model.named_modules()]
    indices = [i for i in indices if i is not None]
    return max(indices) + 1 if indices else None


def check_layer(name: str, linear: nn.Linear, recipe: LinearRecipe) -> None:
    """Reject combinations a layer cannot hold, at conversion time (not at step 1000)."""
    k, n = linear.in_features, linear.out_features
    contraction = {"fprop": k, "dgrad": n}
    for spec in recipe.operand_specs():
        if spec.is_2d and min(n, k) < spec.block[0]:
            raise ValueError(f"{name}: weight {n}x{k} is smaller than a {spec.block[0]}x{spec.block[1]} tile; "
                             "use 1D blocks for this layer (rules.overrides) or skip it (rules.skip)")
    for gemm_name, dim in contraction.items():
        h = recipe.gemm(gemm_name).hadamard
        if h.enabled and dim < h.size:
            raise ValueError(f"{name}: {gemm_name} contracts over {dim} < Hadamard size {h.size}; "
                             "choose a smaller hadamard_size or skip this layer")


def convert_model(model: nn.Module, recipe: Recipe) -> nn.Module:
    """Swap the model's nn.Linear layers for FP4Linear as the recipe's rules say (in place)."""
    blocks = num_decoder_blocks(model)

    def make(name: str, linear: nn.Linear):
        linear_recipe = recipe.recipe_for(name, blocks)
        if linear_recipe is None:
            return None
        check_layer(name, linear, linear_recipe)
        return FP4Linear.from_linear(linear, linear_recipe, name=name, seed=recipe.seed)

    swapped = swap_linear_layers(model, make) + convert_experts(model, recipe, blocks)
    if swapped == 0 and not any(isinstance(m, FP4Linear) for m in model.modules()):
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise ValueError(f"hf_fp4: nothing to convert in {type(model).__name__}: "
                         f"{len(linears)} nn.Linear module(s) {linears[:5]}, all excluded by the recipe's "
                         f"rules (skip={list(recipe.rules.skip)}). Check `rules.skip`.")
    return model


def fp4_modules(model: nn.Module) -> dict[str, FP4Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FP4Linear)}


def run_gemms_in_bf16(model: nn.Module, gemms: tuple[str, ...], base: dict[str, LinearRecipe]) -> None:
    """Every FP4 linear runs `gemms` unquantized and the others as its base recipe (`base`: module name ->
    recipe, taken before any switch); a precision schedule's step (TrainConfig.precision_schedule)."""
    for name, m in fp4_modules(model).items():
        m.recipe = base[name].with_options(gemms=tuple(g for g in GEMMS if g not in gemms))


def set_fp8_gemms(model: nn.Module, enabled: bool) -> int:
    """Run the MX family's GEMMs of every FP4 linear and experts module on the FP8 tensor cores (True, the
    default) or on the BF16 ones with FP32 accumulation (False); returns how many modules were set."""
    linears, experts = fp4_modules(model), experts_states(model)
    for m in linears.values():
        m.fp8_gemms = enabled
    for state in experts.values():
        state.fp8_gemms = enabled
    return len(linears) + len(experts)


def _rng_modules(model: nn.Module) -> dict:
    """Everything with an SR / random-Hadamard call counter: FP4 linears, FP4 experts and stochastically rounding
    FP4 attention."""
    return {**fp4_modules(model), **experts_states(model), **attention_rngs(model)}


def place_rng_states(model: nn.Module) -> None:
    """The step counters that are not module buffers (the FP4 experts' states, SR attention's AttentionRNGs) on
    their modules' devices, eagerly: after the model is moved, before a compiled first call would move them inside
    its graph.  (FP4Linear's counter follows Module.to() itself.)"""
    place_experts_state(model)
    place_attention_rngs(model)


def rng_state_dict(model: nn.Module) -> dict[str, int]:
    """The SR / random-Hadamard call counters, for exact resume."""
    return {name: m.sr_calls for name, m in _rng_modules(model).items()}


def load_rng_state_dict(model: nn.Module, state: dict[str, int]) -> None:
    modules = _rng_modules(model)
    missing = set(modules) - set(state)
    if missing:
        raise ValueError(f"hf_fp4 RNG state lacks layers {sorted(missing)[:5]}")
    for name, m in modules.items():
        m.sr_calls = int(state[name])


def enable_fp4_all_gather(model: nn.Module, world_size: int | None = None, skip=()) -> dict[str, str]:
    """Make every eligible FP4Linear's weight an FP4MasterWeight, before FSDP2's `fully_shard` (accelerate's
    prepare): FSDP2 then all-gathers it as FP4 codes and scales.  world_size: the FSDP shard count (default: the
    process group's).  skip: names of layers to leave alone.  Returns {layer name: why it stays in high
    precision} for the FP4 layers that were not converted (uneven shards, recipes that need W itself)."""
    if world_size is None:
        world_size = distributed.get_world_size() if distributed.is_initialized() else 1
    left = {}
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for name, m in model.named_modules():
        if not isinstance(m, FP4Linear) or isinstance(m.weight, FP4MasterWeight):
            continue
        reason = "skipped" if name in skip else weight_gather(m.recipe, m.frozen_weight)
        if uses[id(m.weight)] > 1:
            reason = "its weight is tied to another parameter"
        if isinstance(reason, WeightGather):
            n, k = m.weight.shape
            align = reason.row_align()
            if n % world_size or (n // world_size) % align or k % 2:
                reason = (f"[{n}, {k}] over {world_size} shards: each shard's rows must be a multiple of {align} "
                          "(and K even)")
        if isinstance(reason, str):
            left[name] = reason
            continue
        sizes = {orientation_bytes(o, n // world_size, k) for o in reason.orientations}
        m.fp4_gather = dataclasses.replace(reason, split=len(reason.orientations) == 2 and len(sizes) == 1)
        m.fp4_split = None  # decided at the first all-gather (FP4MasterWeight._gemms)
        m.fp4_root = weakref.ref(model)
        w = m.weight
        m.weight = nn.Parameter(FP4MasterWeight(w.data, weakref.ref(m)), requires_grad=w.requires_grad)
    return left
