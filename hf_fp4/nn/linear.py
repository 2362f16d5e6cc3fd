"""FP4Linear: an nn.Linear that trains with an FP4 recipe through one autograd function.

The master weight stays a high-precision Parameter (`weight`, the same name as nn.Linear, so PEFT,
checkpoints and HF tooling see an ordinary Linear).  `FP4LinearFunction` takes tensors and recipe
data (a `LinearPlan`, hf_fp4.nn.operands), never the module, and computes the three GEMMs of RESEARCH.md
from operands made by the operand layer -- each tensor read once for both of its orientations:

    fprop: y  = Q(x)    Q(W)^T       [T,K] @ [K,N] -> [T,N]
    dgrad: dx = Q(dy)   Q(W^T)^T     [T,N] @ [N,K] -> [T,K]
    wgrad: dW = Q(dy^T) Q(x^T)^T     [N,T] @ [T,K] -> [N,K]

Backends: "reference" (FP32 fake quantization, any device), "triton" (fused operand kernels, FP8 or
BF16 tensor-core GEMMs, exact), "auto" (triton on CUDA).  Stochastic rounding and per-step random
Hadamard signs draw from Philox with seed = base(layer, GEMM, operand) + step * STEP_MIX, where the
step counter is a device tensor: no host synchronisation, nothing for torch.compile to specialise on,
and a resumed run continues the same stream once `sr_calls` is restored (see `rng_state_dict`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import zlib
from typing import Callable

import torch
from torch import nn

from ..numerics.hadamard import apply_hadamard, seeded_signs
from . import fp4_gather, lora_svd
from .backends import quantize
from .autograd import ROLES, FP4LinearFunction, output_dtype, x_seeds
from .operands import BACKENDS, LinearPlan, operand_values, plan_switch, plans_by_backend
from ..numerics.philox import STEP_MIX, philox_signs, step_seed
from .recipe import GEMMS, HadamardKind, LinearRecipe
from ..numerics.scales import ScaleRule
from .sharq import sharq_operands
from .step_counter import recomputing, sr_calls_property, step_value

# Observers see every quantized operand: fn(module, gemm_name, role, operand, quantized, spec).
# Off the hot path (eager only): the list is empty unless a test or `hf_fp4.nn.diagnostics` registers one.
_OBSERVERS: list[Callable] = []


@contextlib.contextmanager
def observe_operands(fn: Callable):
    """Call fn(module, gemm_name, role, operand_fp32, quantized_fp32, spec) for every GEMM operand."""
    _OBSERVERS.append(fn)
    try:
        yield fn
    finally:
        _OBSERVERS.remove(fn)


_SHARED: dict = {}


def _shared_tensor(t: torch.Tensor, device) -> torch.Tensor:
    """One device tensor per distinct value (fixed Hadamard signs): layers with equal signs pass the same
    tensor, which torch.compile sees as one input (see FP4LinearFunction.forward)."""
    key = (t.dtype, tuple(t.shape), t.cpu().numpy().tobytes(), str(torch.device(device)))
    if key not in _SHARED:
        _SHARED[key] = t.to(device)
    return _SHARED[key]


def _crc(*parts) -> int:
    return zlib.crc32("/".join(str(p) for p in parts).encode())


class FP4Linear(nn.Linear):
    """nn.Linear trained with a `LinearRecipe` (quantization off = the bf16 baseline path)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: LinearRecipe | None = None, name: str = "", seed: int = 0,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(recipe or LinearRecipe(), name, seed)
        self._init_lora(device, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: LinearRecipe, name: str = "", seed: int = 0) -> "FP4Linear":
        """Wrap an existing nn.Linear, sharing its Parameters (no copy; ties and loaded weights kept)."""
        w = linear.weight
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = w
        new.bias = linear.bias
        new._setup(recipe, name, seed)
        new._init_lora(w.device, w.dtype)
        return new

    def _setup(self, recipe: LinearRecipe, name: str, seed: int) -> None:
        self._frozen_weight = False
        self._fp8_gemms = True  # the MX family on the FP8 tensor cores (see fp8_gemms)
        self.recipe = recipe
        self.layer_name = name
        self.seed = seed
        self.backend = "auto"
        # Set by hf_fp4.compile_model when the layer runs under CUDA graphs: its kernels are launched from opaque
        # custom ops there (see LinearPlan.triton_ops).  Numerics are the same either way.
        self.cuda_graphs = False
        # Plain tensor attributes, not buffers: they are not weights, and HF's meta-device loading
        # would leave non-persistent buffers uninitialised.  Created on the input's device at first use.
        # Seeds and fixed sign vectors are computed here, eagerly (crc32 and torch.Generator are not
        # traceable); device copies follow the module (see _apply).  Plain attributes, not buffers:
        # they are not weights, and HF's meta-device loading leaves non-persistent buffers uninitialised.
        self._bases = seed_bases(seed, name)
        self._rht_base = _crc(seed, name, "rht")
        self._signs_cpu = {g: self.hadamard_signs(g) for g in GEMMS
                           if self.recipe.gemm(g).hadamard.kind is not HadamardKind.RANDOM_PER_STEP}
        self._place_rng(torch.zeros((), dtype=torch.int64, device=self.weight.device))

    # The recipe's LinearPlans (one per backend) are built eagerly whenever the recipe or the frozen
    # flag changes, so torch.compile only ever reads them.
    @property
    def recipe(self) -> LinearRecipe:
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: LinearRecipe) -> None:
        if getattr(self, "fp4_gather", None) is not None:  # FP4 all-gather (hf_fp4.nn.fp4_gather): still possible?
            self.fp4_gather = fp4_gather.regather(self.fp4_gather, recipe, self.layer_name)
        self._recipe = recipe
        self._build_plans()

    frozen_weight = plan_switch("_frozen_weight", "True after loading a packed FP4 export: `weight` holds Q(W R) as "
                                "stored, for inference.")
    fp8_gemms = plan_switch("_fp8_gemms", "True (default): the MX family's GEMMs run on the FP8 tensor cores; False: "
                            "on the BF16 ones, with FP32 accumulation (slower; the FP8 MMA accumulates with fewer "
                            "bits).  Operands are the same either way.")

    def _build_plans(self) -> None:
        self._plans = plans_by_backend(self._recipe, self._frozen_weight, self._fp8_gemms)
        self._plans["graphs"] = dataclasses.replace(self._plans["triton"], triton_ops=False)
        if self._frozen_weight:  # inference on the stored operand (_frozen_product): x in the BF16 form
            self._plans["frozen"] = LinearPlan.build(self._recipe, "triton", fp8_gemms=False)

    # ------------------------------------------------------------------------------------------
    # LoRA-SVD residual compensation (Full-Stack FP4; hf_fp4.nn.lora_svd)
    def _init_lora(self, device, dtype):
        lora_svd.init_factors(self, self.recipe.lora_svd_rank, device, dtype)

    def lora_svd_split(self, fresh: bool = False) -> None:
        """Split W = W_res + B A by a truncated SVD (see hf_fp4.nn.lora_svd.split)."""
        lora_svd.split(self, fresh)

    # ------------------------------------------------------------------------------------------
    # Weight views (export, conversion, diagnostics)
    def quantized_fprop_weight(self):
        """QuantizedTensor of fprop's weight operand Q(W R) (R: fprop's Hadamard), or None if unquantized."""
        gemm_spec = self.recipe.fprop
        if gemm_spec.rhs is None:
            return None
        w = self.weight.detach().float()
        if gemm_spec.hadamard.enabled:
            if gemm_spec.hadamard.kind is HadamardKind.RANDOM_PER_STEP:
                raise ValueError(f"{self.layer_name}: per-step random Hadamard has no fixed weight operand")
            w = apply_hadamard(w, gemm_spec.hadamard.size, self.hadamard_signs("fprop"))
        return quantize(w, gemm_spec.rhs)

    def fprop_weight_operand(self) -> torch.Tensor:
        """The weight operand of fprop in FP32: Q(W R) (rotated when fprop has a Hadamard), as trained."""
        if self.frozen_weight:
            return self.weight.detach().float()
        q = self.quantized_fprop_weight()
        return q.dequantize() if q is not None else self.weight.detach().float()

    def dequantized_weight(self) -> torch.Tensor:
        """The weight a plain nn.Linear needs for the same product: Q(W R) R^T (+ B A), in FP32."""
        w = self.fprop_weight_operand()
        gemm_spec = self.recipe.fprop
        if gemm_spec.hadamard.enabled:  # R^T = H diag(s): apply H, then the signs, then drop the padding
            n = gemm_spec.hadamard.size
            w = apply_hadamard(w, n)
            signs = self.hadamard_signs("fprop")
            if signs is not None:
                w = (w.reshape(w.shape[0], -1, n) * signs.to(w.device)).reshape(w.shape)
            w = w[:, : self.in_features]
        if self.lora_svd_A is not None:
            w = w + lora_svd.factors_product(self).detach().float()
        return w

    def merged_weight(self) -> torch.Tensor:
        """W_res + B A (the high-precision weight the layer represents)."""
        if self.lora_svd_A is None:
            return self.weight
        return self.weight + lora_svd.factors_product(self)

    # ------------------------------------------------------------------------------------------
    # Seeds and signs
    sr_calls = sr_calls_property("_step")  # the step of the SR / per-step Hadamard streams

    def seed_base(self, gemm_name: str, role: str) -> int:
        return _crc(self.seed, self.layer_name, gemm_name, role)

    def sr_seed(self, gemm_name: str, role: str, call: int) -> int:
        """The Philox seed of one operand at one call (what the kernels and the reference draw with)."""
        return step_seed(self.seed_base(gemm_name, role), call)

    def hadamard_signs(self, gemm_name: str, step: "int | torch.Tensor" = 0) -> torch.Tensor | None:
        """The sign vector of a GEMM's Hadamard: fixed per layer (seeded by the recipe seed) or per step."""
        return hadamard_signs(self.recipe, gemm_name, self.seed, self._rht_base, step)

    def _place_rng(self, step: torch.Tensor) -> None:
        """The step counter, seed bases and fixed sign vectors on step's device."""
        dev = step.device
        self._step = step
        self._seed_bases = torch.tensor(self._bases, dtype=torch.int64, device=dev)
        self._fixed_signs = {g: _shared_tensor(s, dev) if s is not None else None for g, s in self._signs_cpu.items()}

    def _apply(self, fn, recurse=True):
        """Module.to()/cuda()/to_empty() move the RNG state too (a counter never held on meta starts at 0)."""
        super()._apply(fn, recurse)
        meta = self._step.is_meta
        step = fn(torch.zeros((), dtype=torch.int64) if meta else self._step)
        if meta and not step.is_meta:
            step = torch.zeros_like(step)  # to_empty() gives uninitialised memory
        self._place_rng(step)
        return self

    def resolved_backend(self, t: torch.Tensor) -> str:
        """'triton' (fused kernels + exact fast GEMMs) on CUDA, 'reference' elsewhere, unless forced."""
        if self.backend not in BACKENDS:
            raise ValueError(f"FP4Linear.backend={self.backend!r}; valid: {', '.join(BACKENDS)}")
        if self.backend == "auto":
            return "triton" if t.is_cuda else "reference"
        return self.backend

    # ------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device != self.weight.device:  # nn.Linear's own error, not a kernel's about a pointer it cannot read
            raise RuntimeError(f"FP4Linear {self.layer_name}: the input is on {x.device} and the weight on "
                               f"{self.weight.device}; expected all tensors on the same device (move the layer or "
                               "the input)")
        y = self._sharq_product(x) if self.recipe.activation_scheme == "sharq" else self._fp4_product(x)
        if self.lora_svd_A is not None:
            y = y + lora_svd.low_rank_product(self, x)
        return y

    def _fp4_product(self, x: torch.Tensor) -> torch.Tensor:
        """x Q(W)^T + bias through FP4LinearFunction (the three GEMMs of the recipe)."""
        if isinstance(self.weight, fp4_gather.GatheredFP4Weight):
            return self._gathered_product(x)
        return self._product(x)

    @torch.compiler.disable
    def _gathered_product(self, x: torch.Tensor) -> torch.Tensor:
        """_product on a weight FSDP2 gathered as FP4 (hf_fp4.nn.fp4_gather), always eagerly: torch.compile does not
        trace the gathered tensor subclass -- traced, its gradient was silently lost (aot_eager, 14 of 14 weights)
        -- so a compiled block runs this layer outside its graph."""
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        backend = self.resolved_backend(x)
        if backend == "triton" and self._frozen_fast(x):
            return self._frozen_product(x)
        plan = self._plans["graphs" if backend == "triton" and self.cuda_graphs else backend]
        training = torch.is_grad_enabled()
        again = training and recomputing()
        x_in, out_dtype, seeds, signs = self._step_inputs(x, rewind=again)
        if training and not again:
            self._step.add_(1)
        need = (training and x.requires_grad, training and self.weight.requires_grad)
        observer = functools.partial(_notify, self) if _OBSERVERS else None
        return FP4LinearFunction.apply(x_in, self.weight, self.bias, seeds, signs, plan, need, out_dtype, observer)

    def _step_inputs(self, x: torch.Tensor, gemms: tuple[str, ...] = GEMMS, rewind: bool = False):
        """(x as the GEMMs take it, the output dtype, this step's Philox seeds, the Hadamard signs of each of
        `gemms`); rewind: the previous step's (a recomputed forward, see recomputing)."""
        if self._step.device != x.device:  # moved without Module.to() (e.g. by a sharding wrapper)
            self._place_rng(self._step.to(x.device) if not self._step.is_meta else
                            torch.zeros((), dtype=torch.int64, device=x.device))
        step, fixed = step_value(self._step), self._fixed_signs
        if rewind:
            step = step - 1
        seeds = self._seed_bases + step * STEP_MIX
        signs = tuple(fixed[g] if g in fixed else self.hadamard_signs(g, step) for g in gemms)
        out_dtype = output_dtype(x)
        # Under autocast the activations enter the GEMMs in the autocast dtype, as nn.Linear's (and
        # TransformerEngine's) do: x is quantized from BF16, and read in half the bytes.
        x_in = x.to(out_dtype) if out_dtype != x.dtype and torch.is_autocast_enabled(x.device.type) else x
        return x_in, out_dtype, seeds, signs

    def _frozen_fast(self, x: torch.Tensor) -> bool:
        """Whether fprop on a frozen (packed) weight can run on the tensor cores: inference (no gradient
        through the layer), the weight's parts kept at load (hf_fp4.nn.packing.unpack_weight), x quantized by
        a spec with a BF16 form, no mean-bias term, no operand observer, not under torch.compile."""
        plan = self._plans.get("frozen")
        return (plan is not None and hasattr(self, "frozen_w_values") and plan.forms[0] == "bf16"
                and not plan.mean_bias and not _OBSERVERS and not torch.compiler.is_compiling()
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)))

    def _frozen_product(self, x: torch.Tensor) -> torch.Tensor:
        """Inference on a frozen weight: Q(x) by the operand kernels in the BF16 form (exact values, FP32 tensor
        decode) against the stored operand's BF16 parts, FP32 accumulation, both decodes on the output -- the
        fprop of the fast path, where FP4LinearFunction's frozen plan runs the reference quantizer and an FP32
        GEMM (the stored operand as FP32 values)."""
        from .operands import Operand, gemm, operands

        plan = self._plans["frozen"]
        x_in, out_dtype, seeds, (sign,) = self._step_inputs(x, ("fprop",))
        ox = operands(x_in, (plan.x[0], None), x_seeds(plan, seeds), (sign, None))[0]
        values = self.frozen_w_values
        if values.shape[1] != ox.data.shape[1]:  # the two paddings of K (blocks, Hadamard, alignment) differ
            values = nn.functional.pad(values[:, :ox.data.shape[1]], (0, max(0, ox.data.shape[1] - values.shape[1])))
        empty = values.new_empty(0)
        ow = Operand(values, self.frozen_w_decode.reshape(1).float(), empty, empty, empty)
        k = x.shape[-1]
        y = gemm(ox, ow, (plan.x[0], plan.x[0]), x_in.numel() // k, self.out_features, out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _sharq_product(self, x: torch.Tensor) -> torch.Tensor:
        """SharQ inference (hf_fp4.nn.sharq, reference): Q(x_sp) Q(W)^T + Q(x - Q(x_sp)) Q(W)^T + bias."""
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise RuntimeError(f"{self.layer_name or 'FP4Linear'}: activation_scheme=sharq is an inference scheme "
                               "(it has no backward): run under torch.no_grad() or torch.inference_mode()")
        spec, k = self.recipe.fprop.lhs, x.shape[-1]
        if self.frozen_weight:  # a packed export: the parts were kept when it was unpacked
            w_parts = (self.frozen_w_values, self.frozen_w_decode) if hasattr(self, "frozen_w_values") else None
        else:  # SharQ refuses an fprop Hadamard: the weight operand is Q(W), by the fused kernel on the fast path
            rhs = self.recipe.fprop.rhs
            q_w = quantize(self.weight.detach(), rhs, backend=self.resolved_backend(x)) if rhs is not None else None
            w_parts = q_w.tensor_core_parts() if q_w is not None else None
        if w_parts is not None and spec.scale is not ScaleRule.FP32:
            # exact BF16 operands (grid value x block scale) on the tensor cores, FP32 sums, tensor decodes after
            (sp, d_sp), (res, d_res) = sharq_operands(x, spec, self.resolved_backend(x), parts=True)
            w, d_w = w_parts
            a = torch.cat([sp.reshape(-1, k), res.reshape(-1, k)]).to(w.device)  # both products: one pass over W
            both = torch.mm(a, w.t(), out_dtype=torch.float32) if a.is_cuda else a.float() @ w.float().t()
            y_sp, y_res = both.chunk(2)
            y = y_sp * (d_sp * d_w) + y_res * (d_res * d_w)
        else:  # FP32 block scales or a frozen (packed) weight: the FP32 operands
            w = self.fprop_weight_operand()
            q_sp, q_res = sharq_operands(x, spec, self.resolved_backend(x))
            both = torch.cat([q_sp.reshape(-1, k), q_res.reshape(-1, k)]).to(w.device) @ w.t()
            y_sp, y_res = both.chunk(2)
            y = y_sp + y_res
        y = y.reshape(*x.shape[:-1], -1)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(output_dtype(x))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={recipe_label(self.recipe)}"


def seed_bases(seed: int, name: str) -> list[int]:
    """The Philox seed bases of a layer's six operands, in ROLES order (x, w, dy; two orientations each)."""
    return [_crc(seed, name, g, r) for t in ("x", "w", "dy") for g, r in ROLES[t]]


def hadamard_signs(recipe: LinearRecipe, gemm_name: str, seed: int, rht_base: int,
                   step: "int | torch.Tensor" = 0) -> torch.Tensor | None:
    """A GEMM's Hadamard sign vector: fixed (seeded by the recipe seed), per step (Philox from the layer's
    rht_base and the step counter), or None (no signs)."""
    h = recipe.gemm(gemm_name).hadamard
    if h.kind is HadamardKind.RANDOM_FIXED:
        return seeded_signs(h.size, seed)
    if h.kind is HadamardKind.RANDOM_PER_STEP:
        return philox_signs(step_seed(rht_base, step), h.size, step.device if isinstance(step, torch.Tensor) else None)
    return None


def recipe_label(recipe: LinearRecipe) -> str:
    if not recipe.quantized:
        return "bf16"
    return "/".join(f"{g}:{recipe.gemm(g).lhs is not None:d}{recipe.gemm(g).rhs is not None:d}"
                    for g in ("fprop", "dgrad", "wgrad"))


def _notify(module: FP4Linear, tensor: str, t: torch.Tensor, plans, ops, signs) -> None:
    """Hand each quantized orientation of a tensor to the observers (eager diagnostics and tests)."""
    for i, ((gemm_name, role), plan, op) in enumerate(zip(ROLES[tensor], plans, ops)):
        if plan is None or plan.form == "hp" or op is None:
            continue
        view = (t if i == 0 else t.t()).float()
        operand = apply_hadamard(view, plan.hadamard, signs[GEMMS.index(gemm_name)]) if plan.hadamard else view
        values = operand_values(op, plan, view.shape[0], view.shape[1])
        spec = getattr(module.recipe.gemm(gemm_name), role)
        for fn in list(_OBSERVERS):
            fn(module, gemm_name, role, operand, values, spec)
