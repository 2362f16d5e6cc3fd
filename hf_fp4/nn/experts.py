"""FP4 expert GEMMs for Transformers' mixture-of-experts layers (issue 16): the reference path.

Transformers 5 keeps a MoE layer's experts as 3D parameters -- `gate_up_proj` [E, 2I, H] (or `up_proj`
[E, I, H] without a gate) and `down_proj` [E, H, I], transposed in some models -- in a class decorated with
`use_experts_implementation`, whose forward is looked up in `ExpertsInterface` by
`config._experts_implementation`.  `convert_experts(model, recipe)` gives every such module the recipe's
rules select an `ExpertsFP4` state and sets the implementation to "hf_fp4" (registered on import):

    per expert e, on the tokens routed to it:  h = act(Q(x_e) Q(W_up[e])^T),  y_e = Q(h) Q(W_down[e])^T

each projection through `FP4LinearFunction` -- the recipe's three GEMMs, with per-GEMM operand specs,
Hadamard and SR -- on a view of the expert's weight slice, so block and tensor scales are per expert and the
gradients land in the 3D parameters.  Every (expert, projection) has its own SR / Hadamard seeds, as a
separate nn.Linear would, and with LoRA-SVD its own factors (`<proj>_lora_svd_A` [E, r, K],
`<proj>_lora_svd_B` [E, N, r]; hf_fp4.nn.lora_svd splits them expert by expert).  The router is a module of its
own (an nn.Linear, or a router holding a weight Parameter) and is left to the linear swap's rules: Transformers'
routers are not nn.Linear, so they stay in high precision.  The loop over experts reads the routing counts on the
host; on CUDA each expert's GEMMs run on the fast path of FP4Linear (Triton operand kernels, exact FP8 / BF16
GEMMs), one expert at a time -- except where grouped GEMMs give the loop's operands bit for bit
(hf_fp4.nn.grouped: every recipe with BF16 activations, in the loop's GEMM forms): all experts at once, no host
synchronisation.
"""
from __future__ import annotations

import functools
import types

import torch

from . import linear as _linear
from . import lora_svd
from .autograd import FP4LinearFunction, output_dtype
from .experts_autocast import autocast_experts
from .grouped import grouped_projection, grouped_reason, segment_align
from .grouping import group_layout
from .linear import FP4Linear, _crc, _notify, _shared_tensor, hadamard_signs, seed_bases
from .step_counter import call_step, sr_calls_property
from ..numerics.formats import ELEMENT_BITS
from .operands import BACKENDS, LinearPlan, plan_switch, plans_by_backend
from .packing import packed_shapes, stored_scales
from ..numerics.qtensor import QuantizedTensor
from ..numerics.philox import STEP_MIX
from .recipe import GEMMS, HadamardKind, LinearRecipe, Recipe

IMPLEMENTATION = "hf_fp4"
PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")


class ExpertsFP4:
    """The recipe state of one experts module: plans, per-(projection, expert) seed bases, one step counter."""

    def __init__(self, recipe: LinearRecipe, name: str, seed: int, num_experts: int, projections: tuple[str, ...]):
        self.recipe, self.name, self.seed = recipe, name, seed
        self.backend = "auto"  # as FP4Linear's: the Triton operand kernels and exact GEMMs on CUDA, per expert
        self.packed_rows: dict[str, int] = {}  # while a packed export loads: each projection's output rows
        # the fast path's grouped GEMMs (hf_fp4.nn.grouped) where they are bit-identical to the loop; False: the loop
        self.grouped = True
        # the MX family's expert GEMMs on the BF16 tensor cores by default (torch._grouped_mm; exact products as the
        # FP8 ones): hf_fp4's Triton FP8 grouped GEMMs ran no faster than BF16 ones and their wgrad operands flag
        # lost blocks at the segments' tails (profile_fast_path.py --moe, 2026-12-06); fp8_gemms = True takes them
        self._frozen, self._fp8_gemms = False, False
        self._build_plans()
        self.projections = projections
        self._bases = torch.tensor([[seed_bases(seed, f"{name}.{p}.{e}") for e in range(num_experts)]
                                    for p in projections], dtype=torch.int64, device="cpu")  # [P, E, 6]
        self._rht_base = _crc(seed, name, "rht")
        # fixed sign vectors computed here, eagerly, as FP4Linear's (torch.Generator does not trace)
        self._signs_cpu = {g: hadamard_signs(recipe, g, seed, self._rht_base) for g in GEMMS
                           if recipe.gemm(g).hadamard.kind is not HadamardKind.RANDOM_PER_STEP}
        self.place_signs("cpu")
        # on the CPU even under a meta-device context (from_pretrained); moved to the input's device at first use
        self.step = torch.zeros((), dtype=torch.int64, device="cpu")

    frozen = plan_switch("_frozen", "A packed export's 3D weights hold each expert's stored fprop operand.")
    fp8_gemms = plan_switch("_fp8_gemms", "As FP4Linear.fp8_gemms: the MX family's GEMMs on the FP8 (True) or BF16 "
                            "tensor cores (False, the experts' default).")

    def freeze(self, frozen: bool) -> None:
        """frozen: a packed export's 3D weights hold each expert's stored fprop operand (inference)."""
        self.frozen = frozen

    def _build_plans(self) -> None:
        self.plans = plans_by_backend(self.recipe, self._frozen, self._fp8_gemms)

    def grouped_reason(self, module: torch.nn.Module, x: torch.Tensor) -> str | None:
        """Why this step runs the per-expert loop instead of the grouped GEMMs (None: it does not)."""
        if self.plan(x) is not self.plans["triton"]:
            return "the reference backend"
        if _linear._OBSERVERS:
            return "operand observers (diagnostics per expert) are attached"
        return self.layer_reason(module, output_dtype(x))

    def layer_reason(self, module: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> str | None:
        """grouped_reason's part that depends on the layer alone (and the activations' dtype), not on a call."""
        if not self.grouped:
            return "ExpertsFP4.grouped is False"
        for proj in self.projections:  # the grouped path runs the loop's (fast) plan
            _, n, k = expert_dims(module, proj)
            if reason := grouped_reason(self.plans["triton"], n, k, module.has_bias, dtype):
                return f"{proj}: {reason}"
        return None

    def plan(self, t: torch.Tensor) -> LinearPlan:
        if self.backend not in BACKENDS:
            raise ValueError(f"ExpertsFP4.backend={self.backend!r}; valid: {', '.join(BACKENDS)}")
        backend = ("triton" if t.is_cuda else "reference") if self.backend == "auto" else self.backend
        return self.plans[backend]

    sr_calls = sr_calls_property("step")

    def place(self, device) -> None:
        """The step counter, seed bases and fixed sign vectors on `device` (the forward does it on a call whose
        input lies elsewhere; place_experts_state (swap.place_rng_states) does it eagerly, before a compiled first
        call would)."""
        if self.step.device != torch.device(device):
            self.step = self.step.to(device)
            self._bases = self._bases.to(device)
            self.place_signs(device)

    def place_signs(self, device) -> None:
        """The fixed sign vectors on `device` (eagerly, whenever the step counter moves)."""
        self._fixed_signs = {g: _shared_tensor(s, device) if s is not None else None
                             for g, s in self._signs_cpu.items()}

    def signs(self, step: torch.Tensor) -> tuple:
        """Each GEMM's Hadamard sign vector (or None) on the step counter's device."""
        out = []
        for g in GEMMS:
            if g in self._fixed_signs:
                out.append(self._fixed_signs[g])
            else:
                out.append(hadamard_signs(self.recipe, g, self.seed, self._rht_base, step).to(step.device))
        return tuple(out)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seeds: torch.Tensor,
               signs: tuple, training: bool, label: str) -> torch.Tensor:
        """x [T, K] @ weight [N, K]^T (+ bias) through the recipe's three GEMMs; `label` names the expert's
        projection for the operand observers (hf_fp4.nn.diagnostics: statistics per expert)."""
        need = (training and x.requires_grad, training and weight.requires_grad)
        out_dtype = output_dtype(x)
        x_in = x.to(out_dtype) if out_dtype != x.dtype and torch.is_autocast_enabled(x.device.type) else x
        observer = None
        if _linear._OBSERVERS:
            view = types.SimpleNamespace(layer_name=f"{self.name}.{label}", recipe=self.recipe, weight=weight)
            observer = functools.partial(_notify, view)
        return FP4LinearFunction.apply(x_in, weight, bias, seeds, signs, self.plan(x), need, out_dtype, observer)


def fp4_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "hf_fp4" experts implementation (the signature of Transformers' experts forwards)."""
    state: ExpertsFP4 = self.hf_fp4
    state.place(hidden_states.device)  # a no-op once there
    training = torch.is_grad_enabled()
    step, advances = call_step(state.step)  # activation checkpointing's recompute: the first run's step, not advanced
    seeds = state._bases + step * STEP_MIX
    signs = state.signs(step)
    if advances:
        state.step.add_(1)
    up_name = "gate_up_proj" if self.has_gate else "up_proj"
    if state.grouped_reason(self, hidden_states) is None:
        return _grouped_experts_forward(self, state, hidden_states, top_k_index, top_k_weights, seeds, signs,
                                        training)
    p_up, p_down = state.projections.index(up_name), state.projections.index("down_proj")
    num_experts = seeds.shape[1]
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the host reads the routing (reference path)
    route_weights = top_k_weights.reshape(-1)
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    start = 0
    for e, count in enumerate(counts[:num_experts]):  # ids >= num_experts (expert-parallel sentinels) skipped
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // k
        w_up, w_down = getattr(self, up_name)[e], self.down_proj[e]
        if self.is_transposed:
            w_up, w_down = w_up.t(), w_down.t()
        bias_up = getattr(self, f"{up_name}_bias")[e] if self.has_bias else None
        bias_down = self.down_proj_bias[e] if self.has_bias else None
        x_e = hidden_states[tokens]
        h = state.linear(x_e, w_up, bias_up, seeds[p_up, e], signs, training, f"{up_name}.{e}")
        h = _plus_low_rank(h, x_e, expert_factors(self, up_name), e)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        y = state.linear(h, w_down, bias_down, seeds[p_down, e], signs, training, f"down_proj.{e}")
        y = _plus_low_rank(y, h, expert_factors(self, "down_proj"), e)
        if getattr(self, "has_post_expert_norm", False):
            y = self.post_expert_norm(y)
        out.index_add_(0, tokens, y.float() * route_weights[pairs, None].float())
    return out.to(hidden_states.dtype)


def _plus_low_rank(y: torch.Tensor, x: torch.Tensor, factors, e: int) -> torch.Tensor:
    """y + (x A_e^T) B_e^T, as FP4Linear adds its LoRA-SVD term (y itself without factors)."""
    if factors is None:
        return y
    return y + torch.nn.functional.linear(torch.nn.functional.linear(x, factors[0][e]), factors[1][e])


def _grouped_low_rank(y: torch.Tensor, layout, xg: torch.Tensor, factors) -> torch.Tensor:
    """_plus_low_rank for every expert's segment of the gathered rows at once (two grouped GEMMs in xg's dtype,
    FP32 accumulation); rows outside the segments add nothing."""
    if factors is None:
        return y
    a, b = (f.to(xg.dtype) for f in factors)
    low = torch._grouped_mm(torch._grouped_mm(xg, a.transpose(1, 2), offs=layout.ends), b.transpose(1, 2),
                            offs=layout.ends)
    return y + torch.where(layout.valid[:, None], low, 0.0)


def _grouped_experts_forward(self, state: ExpertsFP4, hidden_states, top_k_index, top_k_weights, seeds, signs,
                             training):
    """fp4_experts_forward on grouped GEMMs: every expert's rows in one gathered tensor (hf_fp4.nn.grouped);
    seeds [P, E, 6], each (projection, expert)'s as the loop's."""
    up_name = "gate_up_proj" if self.has_gate else "up_proj"
    w_up, w_down = getattr(self, up_name), self.down_proj
    if self.is_transposed:
        w_up, w_down = w_up.transpose(1, 2), w_down.transpose(1, 2)
    plan = state.plans["triton"]  # the loop's operand forms (FP8 or BF16)
    p_up, p_down = state.projections.index(up_name), state.projections.index("down_proj")
    layout = group_layout(top_k_index, w_down.shape[0], segment_align(plan))
    xg = layout.gather(hidden_states.to(output_dtype(hidden_states)))
    h = grouped_projection(layout, xg, w_up, seeds[p_up], signs, plan, training)
    h = _grouped_low_rank(h, layout, xg, expert_factors(self, up_name))
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    # the padding rows stay zero whatever act(0) is: the down projection's per-expert amax and wgrad blocks see
    # only the expert's tokens, as in the loop
    h = torch.where(layout.valid[:, None], h, 0.0)
    y = grouped_projection(layout, h, w_down, seeds[p_down], signs, plan, training)
    y = _grouped_low_rank(y, layout, h, expert_factors(self, "down_proj"))
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    return layout.combine(y, top_k_weights, hidden_states.shape[0]).to(hidden_states.dtype)


@functools.lru_cache(maxsize=None)
def register() -> None:
    """Make "hf_fp4" a valid experts implementation (Transformers >= 5 with ExpertsInterface)."""
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(IMPLEMENTATION, fp4_experts_forward)


def place_experts_state(model: torch.nn.Module) -> None:
    """Every FP4 experts layer's RNG state (step counter, seed bases, sign vectors) on its weights' device, eagerly:
    after the model is moved (the state is not a module's buffer, so .to() leaves it), before a compiled first step
    would move it inside its graph (a graph break and a recompilation)."""
    for m in experts_modules(model).values():
        state = getattr(m, "hf_fp4", None)
        if isinstance(state, ExpertsFP4) and m.down_proj.device.type != "meta":
            state.place(m.down_proj.device)


def experts_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules whose forward Transformers dispatches through ExpertsInterface (3D expert weights)."""
    def is_experts(m):
        if not (hasattr(m, "is_transposed") and hasattr(m, "has_gate")):
            return False
        w = getattr(m, "down_proj", None)
        return isinstance(m.__dict__.get("hf_fp4"), ExpertsFP4) or (isinstance(w, torch.nn.Parameter) and w.dim() == 3)

    return {name: m for name, m in model.named_modules() if is_experts(m)}


def expert_dims(module: torch.nn.Module, proj: str) -> tuple[int, int, int]:
    """(experts, out, in) of a projection's 3D weight, whichever of [E, out, in] / [E, in, out] it is stored as."""
    e, a, b = getattr(module, proj).shape
    return (e, b, a) if module.is_transposed else (e, a, b)


def check_experts(name: str, module: torch.nn.Module, recipe: LinearRecipe) -> None:
    """Reject what the expert GEMMs cannot do, at conversion time."""
    if recipe.activation_scheme != "plain":
        raise ValueError(f"{name}: activation_scheme={recipe.activation_scheme!r} is not implemented for experts")
    for proj in PROJECTIONS:
        w = getattr(module, proj, None)
        if not isinstance(w, torch.nn.Parameter):
            continue
        _, n, k = expert_dims(module, proj)
        if recipe.lora_svd_rank > min(n, k):
            raise ValueError(f"{name}.{proj}: lora_svd_rank={recipe.lora_svd_rank} exceeds min(out, in) = "
                             f"{min(n, k)} of each expert's {n}x{k} weight")
        for spec in recipe.operand_specs():
            if spec.is_2d and min(n, k) < spec.block[0]:
                raise ValueError(f"{name}.{proj}: expert weight {n}x{k} is smaller than a "
                                 f"{spec.block[0]}x{spec.block[1]} tile; use 1D blocks for the experts")
        for gemm_name, dim in (("fprop", k), ("dgrad", n)):
            h = recipe.gemm(gemm_name).hadamard
            if h.enabled and dim < h.size:
                raise ValueError(f"{name}.{proj}: {gemm_name} contracts over {dim} < Hadamard size {h.size}")


def convert_experts(model: torch.nn.Module, recipe: Recipe, num_blocks: int | None) -> int:
    """Give every experts module the recipe's rules select an ExpertsFP4 state and switch the model's
    experts implementation to "hf_fp4"; returns how many were converted.  A recipe that quantizes no experts
    leaves Transformers' implementation, in its autocast-aware form (hf_fp4.nn.experts_autocast: its grouped_mm
    would run FP32 GEMMs under BF16 autocast)."""
    modules = experts_modules(model)
    recipes = {name: recipe.recipe_for(name, num_blocks) for name in modules}
    if not any(r is not None and r.quantized for r in recipes.values()):
        if modules:
            autocast_experts(model)
        return 0
    for name, module in modules.items():
        if recipes[name] is not None:
            check_experts(name, module, recipes[name])
    register()
    for name, module in modules.items():
        # Transformers selects one experts implementation per model: experts the rules keep in high
        # precision run it too, with the unquantized recipe (exactly F.linear per expert)
        linear_recipe = recipes[name] if recipes[name] is not None else LinearRecipe()
        projections = tuple(p for p in PROJECTIONS if isinstance(getattr(module, p, None), torch.nn.Parameter))
        module.hf_fp4 = ExpertsFP4(linear_recipe, name, recipe.seed, module.down_proj.shape[0], projections)
        init_expert_factors(module, linear_recipe.lora_svd_rank)
    model.config._experts_implementation = IMPLEMENTATION
    return sum(r is not None and r.quantized for r in recipes.values())


def expert_linear(module: torch.nn.Module, proj: str, e: int) -> FP4Linear:
    """Expert e's projection `proj` as an FP4Linear of the same recipe, name and seed (copies of its weight slice,
    [out, in], and of its LoRA-SVD factors): the weight views of FP4Linear (dequantized_weight, ...) for one
    expert."""
    state: ExpertsFP4 = module.hf_fp4
    w = getattr(module, proj)[e].detach()
    w = w.t() if module.is_transposed else w
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    out = FP4Linear.from_linear(lin, state.recipe, name=f"{state.name}.{proj}.{e}", seed=state.seed)
    factors = expert_factors(module, proj)
    if factors is not None:
        with torch.no_grad():
            out.lora_svd_A.copy_(factors[0][e])
            out.lora_svd_B.copy_(factors[1][e])
    return out


def init_expert_factors(module: torch.nn.Module, rank: int) -> None:
    """Zero LoRA-SVD factors for every projection of an experts module (rank 0: none); the split fills them
    (hf_fp4.nn.lora_svd, as for FP4Linear)."""
    if rank == 0:
        return
    for proj in module.hf_fp4.projections:
        w = getattr(module, proj)
        e, n, k = expert_dims(module, proj)
        a_name, b_name = lora_svd.expert_factor_names(proj)
        train = lora_svd.trains_factors(module.hf_fp4.recipe)
        module.register_parameter(a_name, torch.nn.Parameter(torch.zeros(e, rank, k, device=w.device, dtype=w.dtype),
                                                              train))
        module.register_parameter(b_name, torch.nn.Parameter(torch.zeros(e, n, rank, device=w.device, dtype=w.dtype),
                                                              train))


def expert_factors(module: torch.nn.Module, proj: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A [E, r, K], B [E, N, r]) of a projection, or None without LoRA-SVD."""
    a_name, b_name = lora_svd.expert_factor_names(proj)
    a = getattr(module, a_name, None)
    return (a, getattr(module, b_name)) if a is not None else None


def dequantized_experts_weight(module: torch.nn.Module, proj: str) -> torch.Tensor:
    """The 3D weight (in the module's layout) that Transformers' plain experts need for the same products
    as the FP4 fprop: every expert's Q(W R) R^T, in FP32."""
    ws = [expert_linear(module, proj, e).dequantized_weight() for e in range(getattr(module, proj).shape[0])]
    out = torch.stack(ws)
    return out.transpose(1, 2) if module.is_transposed else out


# Packed FP4 export (hf_fp4.release.export "fp4"): per projection, every expert's fprop weight operand Q(W R) stacked
# along a leading expert dimension: `<proj>_packed` (codes), `<proj>_scale` (block scales as stored),
# `<proj>_tensor_scale` ([E], two-level formats).  Loading makes them a frozen 3D weight again.
def _expert_shapes(module: torch.nn.Module, proj: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    e, n, k = expert_dims(module, proj)
    shell = types.SimpleNamespace(recipe=module.hf_fp4.recipe, out_features=n, in_features=k)
    return {f"{proj}{key.removeprefix('weight')}": ((e, *shape), dtype)
            for key, (shape, dtype) in packed_shapes(shell).items()}


def packed_experts(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The packed tensors of one experts module (keys relative to the module)."""
    out = {}
    for proj in module.hf_fp4.projections:
        qs = [expert_linear(module, proj, e).quantized_fprop_weight() for e in range(getattr(module, proj).shape[0])]
        out[f"{proj}_packed"] = torch.stack([q.codes for q in qs]).cpu()
        out[f"{proj}_scale"] = torch.stack([q.scales.view(torch.uint8) if q.scales.dtype != torch.float32
                                            else q.scales for q in qs]).cpu()
        if qs[0].tensor_scale is not None:
            out[f"{proj}_tensor_scale"] = torch.stack([q.tensor_scale.reshape(1) for q in qs]).cpu()
    return out


def expect_packed_experts(module: torch.nn.Module) -> None:
    """Before loading a packed export: buffers of the stored shapes replace the 3D weights."""
    for proj in module.hf_fp4.projections:
        w = getattr(module, proj)
        device = w.device
        shapes = _expert_shapes(module, proj)
        module.hf_fp4.packed_rows[proj] = expert_dims(module, proj)[1]
        del module._parameters[proj]
        for key, (shape, dtype) in shapes.items():
            module.register_buffer(key, torch.empty(shape, dtype=dtype, device=device))
        # Transformers' _init_weights reads the 3D weight by name while loading: an empty, already-initialised
        # stand-in (a plain attribute, not in the state dict) until unpack_experts puts the weight back
        stand_in = torch.empty(0, device=device)
        stand_in._is_hf_initialized = True
        setattr(module, proj, stand_in)


def unpack_experts(module: torch.nn.Module) -> None:
    """After loading: each expert's stored operand, dequantized, becomes a frozen 3D weight (inference)."""
    state: ExpertsFP4 = module.hf_fp4
    spec = state.recipe.fprop.rhs
    for proj in state.projections:
        if f"{proj}_packed" not in module._buffers:
            continue
        codes, scales = module._buffers.pop(f"{proj}_packed"), module._buffers.pop(f"{proj}_scale")
        tensor_scales = module._buffers.pop(f"{proj}_tensor_scale", None)
        weights = []
        for e in range(codes.shape[0]):
            n = state.packed_rows[proj]
            k = codes.shape[2] * (2 if ELEMENT_BITS[spec.grid] == 4 else 1)
            tensor_scale = tensor_scales[e].reshape(()) if tensor_scales is not None else None
            q = QuantizedTensor(codes[e], stored_scales(scales[e], spec), tensor_scale, torch.Size((n, k)), spec)
            weights.append(q.dequantize())
        w = torch.stack(weights)
        module.__dict__.pop(proj, None)  # the loading stand-in
        module.register_parameter(proj, torch.nn.Parameter(w.transpose(1, 2) if module.is_transposed else w,
                                                           requires_grad=False))
    state.freeze(True)


def experts_states(model: torch.nn.Module) -> dict[str, ExpertsFP4]:
    return {name: m.hf_fp4 for name, m in experts_modules(model).items() if hasattr(m, "hf_fp4")}
