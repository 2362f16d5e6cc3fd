"""FP4Linear: an nn.Linear that trains with an FP4 recipe through one autograd function.

The master weight stays a high-precision Parameter (`weight`, the same name as nn.Linear, so PEFT,
checkpoints and HF tooling see an ordinary Linear).  `FP4LinearFunction` computes the three GEMMs
of RESEARCH.md, each operand quantized by `quantize_operand` with the spec its GEMM names:

    fprop: y  = Q(x)    Q(W)^T       [T,K] @ [K,N] -> [T,N]
    dgrad: dx = Q(dy)   Q(W^T)^T     [T,N] @ [N,K] -> [T,K]
    wgrad: dW = Q(dy^T) Q(x^T)^T     [N,T] @ [T,K] -> [N,K]

The reference backend multiplies the dequantized operands in FP32 (exact products, FP32
accumulation).  Stochastic rounding and random Hadamard signs come from counter-based seeds
(recipe seed, layer id, call number, GEMM, operand), so a run is reproducible and a resumed run
continues the same stream once `sr_calls` is restored (see `rng_state_dict`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import zlib
from typing import Callable

import torch
from torch import nn

from .hadamard import apply_hadamard, remove_mean_bias, seeded_signs
from .quantize import fake_quantize, quantize
from .recipe import GemmSpec, HadamardKind, LinearRecipe
from .spec import QuantSpec, Rounding

BACKENDS = ("auto", "reference", "triton")

# Observers see every quantized operand: fn(module, gemm, role, operand, quantized, spec).
# Off the hot path: the list is empty unless a test or `hf_fp4.diagnostics` registers one.
_OBSERVERS: list[Callable] = []


@contextlib.contextmanager
def observe_operands(fn: Callable):
    """Call fn(module, gemm, role, operand_fp32, quantized_fp32, spec) for every GEMM operand."""
    _OBSERVERS.append(fn)
    try:
        yield fn
    finally:
        _OBSERVERS.remove(fn)


def _seed(*parts) -> int:
    return zlib.crc32("/".join(str(p) for p in parts).encode())


class FP4Linear(nn.Linear):
    """nn.Linear trained with a `LinearRecipe` (quantization off = the bf16 baseline path)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: LinearRecipe | None = None, name: str = "", seed: int = 0,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe or LinearRecipe()
        self.layer_name = name
        self.seed = seed
        self.sr_calls = 0          # forward calls so far: the counter behind SR noise and per-step signs
        self.backend = "auto"
        self.frozen_weight = False  # True after loading a packed FP4 export: weight holds Q(W R) as is
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
        new.recipe, new.layer_name, new.seed, new.sr_calls, new.backend = recipe, name, seed, 0, "auto"
        new.frozen_weight = False
        new._init_lora(w.device, w.dtype)
        return new

    # ------------------------------------------------------------------------------------------
    # LoRA-SVD residual compensation (Full-Stack FP4)
    def _init_lora(self, device, dtype):
        r = self.recipe.lora_svd_rank
        if r == 0:
            self.lora_svd_A = self.lora_svd_B = None
            return
        if r > min(self.in_features, self.out_features):
            raise ValueError(f"{self.layer_name or 'FP4Linear'}: lora_svd_rank={r} exceeds "
                             f"min(in, out) = {min(self.in_features, self.out_features)}")
        self.lora_svd_A = nn.Parameter(torch.zeros(r, self.in_features, device=device, dtype=dtype))
        self.lora_svd_B = nn.Parameter(torch.zeros(self.out_features, r, device=device, dtype=dtype))

    @torch.no_grad()
    def lora_svd_split(self, fresh: bool = False) -> None:
        """Split W = W_res + B A by a rank-r truncated SVD: B = U_r S_r^1/2, A = S_r^1/2 V_r^T.

        With fresh=False the current B A is folded back first (a periodic re-split); fresh=True
        treats `weight` as the whole matrix (after loading a checkpoint without the factors).
        """
        if self.lora_svd_A is None:
            return
        full = self.weight.float()
        if not fresh:
            full = full + self.lora_svd_B.float() @ self.lora_svd_A.float()
        u, s, vh = torch.linalg.svd(full, full_matrices=False)
        r = self.recipe.lora_svd_rank
        root = s[:r].sqrt()
        b, a = u[:, :r] * root, root[:, None] * vh[:r]
        self.lora_svd_B.copy_(b)
        self.lora_svd_A.copy_(a)
        self.weight.copy_(full - self.lora_svd_B.float() @ self.lora_svd_A.float())

    def quantized_fprop_weight(self):
        """QuantizedTensor of fprop's weight operand Q(W R) (R: fprop's Hadamard), or None if unquantized."""
        gemm = self.recipe.fprop
        if gemm.rhs is None:
            return None
        w = self.weight.detach().float()
        if gemm.hadamard.enabled:
            if gemm.hadamard.kind is HadamardKind.RANDOM_PER_STEP:
                raise ValueError(f"{self.layer_name}: per-step random Hadamard has no fixed weight operand")
            w = apply_hadamard(w, gemm.hadamard.size, self.hadamard_signs(gemm, 0))
        return quantize(w, gemm.rhs)

    def fprop_weight_operand(self) -> torch.Tensor:
        """The weight operand of fprop in FP32: Q(W R) (rotated when fprop has a Hadamard), as trained."""
        if self.frozen_weight:
            return self.weight.detach().float()
        q = self.quantized_fprop_weight()
        return q.dequantize() if q is not None else self.weight.detach().float()

    def dequantized_weight(self) -> torch.Tensor:
        """The weight a plain nn.Linear needs for the same product: Q(W R) R^T (+ B A), in FP32."""
        w = self.fprop_weight_operand()
        gemm = self.recipe.fprop
        if gemm.hadamard.enabled:  # R^T = H diag(s): apply H, then the signs, then drop the padding
            n = gemm.hadamard.size
            w = apply_hadamard(w, n)
            signs = self.hadamard_signs(gemm, 0)
            if signs is not None:
                w = (w.reshape(w.shape[0], -1, n) * signs.to(w.device)).reshape(w.shape)
            w = w[:, : self.in_features]
        if self.lora_svd_A is not None:
            w = w + (self.lora_svd_B @ self.lora_svd_A).detach().float()
        return w

    def merged_weight(self) -> torch.Tensor:
        """W_res + B A (the high-precision weight the layer represents)."""
        if self.lora_svd_A is None:
            return self.weight
        return self.weight + self.lora_svd_B @ self.lora_svd_A

    # ------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call = self.sr_calls
        if torch.is_grad_enabled():
            self.sr_calls += 1
        y = FP4LinearFunction.apply(x, self.weight, self.bias, self, call)
        if self.lora_svd_A is not None:
            y = y + nn.functional.linear(nn.functional.linear(x, self.lora_svd_A), self.lora_svd_B)
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={recipe_label(self.recipe)}"

    # ------------------------------------------------------------------------------------------
    def hadamard_signs(self, gemm: GemmSpec, call: int) -> torch.Tensor | None:
        h = gemm.hadamard
        if h.kind is HadamardKind.RANDOM_FIXED:
            return seeded_signs(h.size, self.seed)
        if h.kind is HadamardKind.RANDOM_PER_STEP:
            return seeded_signs(h.size, _seed(self.seed, self.layer_name, call, "rht"))
        return None

    def quantize_operand(self, t: torch.Tensor, spec: QuantSpec | None, gemm_name: str, role: str,
                         call: int) -> torch.Tensor:
        """One GEMM operand ([rows, contraction], already rotated) -> FP32 (fake-quantized) values."""
        tf = t.float()
        if spec is None:
            q = tf
        else:
            gen = None
            if spec.rounding is Rounding.STOCHASTIC:
                gen = torch.Generator(device=t.device)
                gen.manual_seed(self.sr_seed(gemm_name, role, call))
            q = fake_quantize(tf, spec, gen)
        for fn in _OBSERVERS:
            fn(self, gemm_name, role, tf, q, spec)
        return q

    def gemm_operands(self, gemm_name: str, lhs: torch.Tensor, rhs: torch.Tensor, call: int):
        """Rotate (if the GEMM asks) and quantize both operands of one GEMM."""
        gemm = self.recipe.gemm(gemm_name)
        signs = self.hadamard_signs(gemm, call)
        frozen = self.frozen_weight and gemm_name == "fprop"
        if gemm.hadamard.enabled:
            lhs = apply_hadamard(lhs, gemm.hadamard.size, signs)
            if not frozen:
                rhs = apply_hadamard(rhs, gemm.hadamard.size, signs)
        lhs_q = self.quantize_operand(lhs, gemm.lhs, gemm_name, "lhs", call)
        if frozen:  # a packed export: the stored weight is the quantized (rotated) operand itself
            return lhs_q, rhs.float()
        return lhs_q, self.quantize_operand(rhs, gemm.rhs, gemm_name, "rhs", call)

    def resolved_backend(self, t: torch.Tensor) -> str:
        """'triton' (fused kernels + exact fast GEMMs) on CUDA, 'reference' elsewhere, unless forced."""
        if self.backend not in BACKENDS:
            raise ValueError(f"FP4Linear.backend={self.backend!r}; valid: {', '.join(BACKENDS)}")
        if self.backend == "auto":
            return "triton" if t.is_cuda else "reference"
        return self.backend

    def sr_seed(self, gemm_name: str, role: str, call: int) -> int:
        return _seed(self.seed, self.layer_name, call, gemm_name, role)

    def triton_operand(self, t: torch.Tensor, spec: QuantSpec, gemm_name: str, role: str, call: int,
                       size: int = 0, signs: torch.Tensor | None = None):
        """One operand through the fused kernel (a strided view is read in place: no transpose copied)."""
        from .kernels.quant import triton_quantize

        fast = dataclasses.replace(spec, nonfinite="propagate")  # NaN reaches the loss: the trainer skips
        q = triton_quantize(t, fast, seed=self.sr_seed(gemm_name, role, call), hadamard=size, signs=signs)
        if _OBSERVERS:
            operand = apply_hadamard(t, size, signs) if size else t.float()
            for fn in _OBSERVERS:
                fn(self, gemm_name, role, operand, q.dequantize(), spec)
        return q

    def triton_operands(self, gemm_name: str, lhs: torch.Tensor, rhs: torch.Tensor, call: int):
        gemm = self.recipe.gemm(gemm_name)
        signs = self.hadamard_signs(gemm, call)
        size = gemm.hadamard.size if gemm.hadamard.enabled else 0
        return (self.triton_operand(lhs, gemm.lhs, gemm_name, "lhs", call, size, signs),
                self.triton_operand(rhs, gemm.rhs, gemm_name, "rhs", call, size, signs))

    def uses_triton(self, gemm_name: str, t: torch.Tensor) -> bool:
        spec = self.recipe.gemm(gemm_name)
        return (self.resolved_backend(t) == "triton" and spec.lhs is not None and spec.rhs is not None
                and not self.frozen_weight)

    def fast_operands(self, gemm_name: str, lhs: torch.Tensor, rhs: torch.Tensor, call: int):
        """Both operands of one GEMM quantized straight into GEMM form (FP8 when exact, else BF16)."""
        from .kernels.quant import fp8_capable, round_up, triton_gemm_operand

        gemm = self.recipe.gemm(gemm_name)
        signs = self.hadamard_signs(gemm, call)
        size = gemm.hadamard.size if gemm.hadamard.enabled else 0
        k_alloc = round_up(lhs.shape[1], 256 if max(size, gemm.lhs.block[1], gemm.rhs.block[1]) > 128 else 128)

        def make(fp8: bool):
            return [triton_gemm_operand(t, dataclasses.replace(spec, nonfinite="propagate"), fp8=fp8,
                                        k_alloc=k_alloc, seed=self.sr_seed(gemm_name, role, call),
                                        hadamard=size, signs=signs)
                    for t, spec, role in ((lhs, gemm.lhs, "lhs"), (rhs, gemm.rhs, "rhs"))]

        fp8 = fp8_capable(gemm.lhs) and fp8_capable(gemm.rhs)
        ops = make(fp8)
        if fp8 and bool(torch.stack([ops[0].lost.any(), ops[1].lost.any()]).any()):
            ops = make(False)  # some block lies below E4M3's range: the exact BF16 form instead
        if _OBSERVERS:  # tests and diagnostics: the same operands through the codes path
            self.triton_operands(gemm_name, lhs, rhs, call)
        return ops

    def gemm(self, gemm_name: str, lhs: torch.Tensor, rhs: torch.Tensor, call: int,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """lhs @ rhs^T with both operands as the recipe says; an unquantized GEMM runs in their dtype."""
        spec = self.recipe.gemm(gemm_name)
        if not spec.quantized:
            return lhs @ rhs.t().to(lhs.dtype)  # dtypes differ when the forward ran under autocast
        if self.uses_triton(gemm_name, lhs):
            from .kernels.gemm import operand_matmul

            oa, ob = self.fast_operands(gemm_name, lhs, rhs, call)
            return operand_matmul(oa, ob, lhs.shape[0], rhs.shape[0], out_dtype)
        a, b = self.gemm_operands(gemm_name, lhs, rhs, call)
        return a @ b.t()

    def reuses_fprop_weight(self) -> bool:
        """2D weights quantized once: dgrad reuses Q(W)^T from fprop (transposition invariance)."""
        f, d = self.recipe.fprop, self.recipe.dgrad
        return (f.rhs is not None and f.rhs == d.rhs and f.rhs.is_2d and f.rhs.rounding is Rounding.NEAREST
                and not f.hadamard.enabled and not d.hadamard.enabled)


def recipe_label(recipe: LinearRecipe) -> str:
    if not recipe.quantized:
        return "bf16"
    return "/".join(f"{g}:{recipe.gemm(g).lhs is not None:d}{recipe.gemm(g).rhs is not None:d}"
                    for g in ("fprop", "dgrad", "wgrad"))


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class FP4LinearFunction(torch.autograd.Function):
    """The three GEMMs of one FP4Linear step (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, module: FP4Linear, call: int):
        recipe = module.recipe
        k, n = module.in_features, module.out_features
        x2 = x.reshape(-1, k)
        mu = None
        if recipe.mean_bias_removal:
            x2, mu = remove_mean_bias(x2)
        # fprop: y = Q(x) Q(W)^T    [T,K] @ [K,N] -> [T,N]
        wq = ctx.qw = None
        if not recipe.fprop.quantized and mu is None:
            y = nn.functional.linear(x2, weight, bias)  # quantization off: exactly nn.Linear
        else:
            if module.uses_triton("fprop", x2):
                from .kernels.gemm import operand_matmul

                ox, ow = module.fast_operands("fprop", x2, weight, call)
                y = operand_matmul(ox, ow, x2.shape[0], n, torch.float32)
                ctx.qw = ow if module.reuses_fprop_weight() else None
            elif recipe.fprop.quantized:
                xq, wq = module.gemm_operands("fprop", x2, weight, call)
                y = xq @ wq.t()
            else:
                y = x2.float() @ weight.float().t()
            if mu is not None:
                y = y + mu @ weight.float().t()  # rank-one mean term, high precision
            if bias is not None:
                y = y + bias.float()
        ctx.module, ctx.call = module, call
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = x.shape, x.dtype, bias is not None
        ctx.save_for_backward(x2, weight, mu, wq if wq is not None and module.reuses_fprop_weight() else None)
        return y.to(_out_dtype(x)).reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        module, call = ctx.module, ctx.call
        if module.frozen_weight:
            raise RuntimeError(f"{module.layer_name}: a packed FP4 export holds the quantized (rotated) fprop "
                               "weight only and is for inference; train from the training checkpoint "
                               "(pretrain.py's final/) or the bf16 export instead")
        x2, weight, mu, wq = ctx.saved_tensors
        dy2 = dy.reshape(-1, module.out_features)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            # dgrad: dx = Q(dy) Q(W^T)^T    [T,N] @ [N,K] -> [T,K]
            if ctx.qw is not None:  # 2D weight quantized once in fprop, reused (Q(W)^T == Q(W^T))
                from .kernels.gemm import operand_matmul
                from .kernels.quant import triton_gemm_operand

                ow = ctx.qw
                spec = dataclasses.replace(module.recipe.dgrad.lhs, nonfinite="propagate")
                o_dy = triton_gemm_operand(dy2, spec, fp8=ow.fp8, k_alloc=ow.data.shape[0],
                                           seed=module.sr_seed("dgrad", "lhs", call))
                if ow.fp8 and bool(o_dy.lost.any()):
                    o_dy = triton_gemm_operand(dy2, spec, fp8=False, k_alloc=ow.data.shape[0],
                                               seed=module.sr_seed("dgrad", "lhs", call))
                if _OBSERVERS:
                    from .kernels.quant import triton_quantize

                    module.triton_operand(dy2, module.recipe.dgrad.lhs, "dgrad", "lhs", call)
                    q_w = triton_quantize(weight, dataclasses.replace(module.recipe.fprop.rhs, nonfinite="propagate"))
                    for fn in _OBSERVERS:
                        fn(module, "dgrad", "rhs", weight.float().t(), q_w.dequantize().t(), module.recipe.dgrad.rhs)
                dx = operand_matmul(o_dy, ow, dy2.shape[0], module.in_features, torch.float32, ob_transposed=True)
            elif wq is not None:
                dyq = module.quantize_operand(dy2, module.recipe.dgrad.lhs, "dgrad", "lhs", call)
                wtq = wq.t()
                for fn in _OBSERVERS:
                    fn(module, "dgrad", "rhs", weight.float().t(), wtq, module.recipe.dgrad.rhs)
                dx = dyq @ wtq.t()
            else:
                dx = module.gemm("dgrad", dy2, weight.t(), call)
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            # wgrad: dW = Q(dy^T) Q(x^T)^T    [N,T] @ [T,K] -> [N,K]
            dw = module.gemm("wgrad", dy2.t(), x2.t(), call)
            if mu is not None:
                dw = dw.float() + dy2.float().sum(0)[:, None] * mu[None, :]
            dw = dw.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(weight.dtype)
        return dx, dw, db, None, None
