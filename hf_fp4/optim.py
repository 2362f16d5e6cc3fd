"""FP4 optimizer state (Full-Stack FP4): AdamW whose two moments are stored in a 4-bit QuantSpec format.

`FP4AdamW` keeps, per parameter of at least `min_numel` elements, the first moment m and the second moment v as
quantized tensors (packed 4-bit codes + block scales + a tensor scale; NVFP4 by default: 0.5625 bytes per
value instead of FP32's 4).  Each step decodes them to FP32, runs the AdamW update there, and re-quantizes.

The second moment is non-negative and heavy-tailed: within a block of 16 its values span many octaves, and
E2M1's 8 magnitudes (0.5 ... 6 times the block scale) flush the small ones to zero -- a zero v divides a
non-zero m by eps alone.  Two choices make it survive 4 bits:
* ``v_transform="sqrt"`` (default) stores sqrt(v): the spread of a block halves in octaves, so fewer values
  fall below the grid ("none" stores v itself: the ablation);
* a zero code of the stored v decodes to a quarter of the block's smallest step (the middle of the values
  that round to zero) instead of 0, so the denominator is never smaller than what the block can tell apart.

Smaller parameters (norms, biases) keep FP32 moments.  The state dict holds only tensors (codes and scales
as uint8, the tensor scale in FP32), so save/load through torch.save or accelerate is exact.
"""
from __future__ import annotations

import itertools
import math

import torch

from .qtensor import QuantizedTensor, expand_blocks
from .quantize import quantize
from .spec import QuantSpec, as_spec

V_TRANSFORMS = ("sqrt", "none")
_STORED = ("_codes", "_scales", "_tensor_scale")


class FP4AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with moments stored in `state_spec` (see module doc)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, state_spec: "QuantSpec | str" = "nvfp4", v_transform: str = "sqrt",
                 min_numel: int = 4096):
        if v_transform not in V_TRANSFORMS:
            raise ValueError(f"v_transform={v_transform!r}: valid values are {', '.join(V_TRANSFORMS)}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if lr < 0 or eps <= 0 or weight_decay < 0:
            raise ValueError(f"need lr >= 0, eps > 0, weight_decay >= 0; got {lr}, {eps}, {weight_decay}")
        spec = as_spec(state_spec)
        if spec.rounding.value != "nearest":
            raise ValueError("state_spec must round to nearest (the state is re-quantized every step)")
        self.spec, self.v_transform, self.min_numel = spec, v_transform, int(min_numel)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating state tensor to its parameter's dtype; the stored moments (codes,
        scales, FP32 tensor scale) are put back as saved instead."""
        saved = {i: {k: v for k, v in s.items() if k.endswith(_STORED)} for i, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        index = dict(zip(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                         itertools.chain.from_iterable(g["params"] for g in self.param_groups)))
        for i, tensors in saved.items():
            p = index[i]
            self.state[p].update({k: v.to(p.device) for k, v in tensors.items()})

    # ------------------------------------------------------------------------------------------
    def quantized(self, p: torch.Tensor) -> bool:
        return p.numel() >= self.min_numel and p.dim() >= 1

    def _store(self, state: dict, name: str, x: torch.Tensor) -> None:
        q = quantize(x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x, self.spec)
        state[f"{name}_codes"] = q.codes
        state[f"{name}_scales"] = q.scales.view(torch.uint8)  # not a float: load_state_dict would cast it
        state[f"{name}_tensor_scale"] = q.tensor_scale if q.tensor_scale is not None else torch.ones((), device=x.device)

    def _load(self, state: dict, name: str, p: torch.Tensor, floor_zeros: bool) -> torch.Tensor:
        shape = p.shape if p.dim() == 2 else torch.Size((math.prod(p.shape[:-1]), p.shape[-1]))
        scales = state[f"{name}_scales"].view(_scale_dtype(self.spec))
        q = QuantizedTensor(state[f"{name}_codes"], scales, state[f"{name}_tensor_scale"], shape, self.spec)
        values = q.dequantize()
        if floor_zeros:  # a zero code stands for "below the grid": the middle of that range, not 0
            step = expand_blocks(q.block_decode(), self.spec.block) * q.tensor_scale * _smallest_step(self.spec)
            values = torch.where(values == 0, step[:shape[0], :shape[1]] / 2, values)
        return values.reshape(p.shape)

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP32 values of p's first and second moments, as the next step will read them."""
        state = self.state[p]
        if not self.quantized(p):
            return state["m"], state["v"]
        stored_v = self._load(state, "v", p, floor_zeros=True)
        return self._load(state, "m", p, False), stored_v.square() if self.v_transform == "sqrt" else stored_v

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        for group, p in _with_grads(self):
            b1, b2 = group["betas"]
            g = p.grad.float()
            if not torch.isfinite(g).all():
                raise FloatingPointError("FP4AdamW: non-finite gradient (the state would be lost on "
                                         "re-quantization); skip the step instead")
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                zeros = torch.zeros_like(p, dtype=torch.float32)
                if self.quantized(p):
                    self._store(state, "m", zeros)
                    self._store(state, "v", zeros)
                else:
                    state["m"], state["v"] = zeros, zeros.clone()
            m, v = self.moments(p)
            m = m.mul(b1).add_(g, alpha=1 - b1)
            v = v.mul(b2).addcmul_(g, g, value=1 - b2)
            state["step"] += 1
            t = float(state["step"])
            denom = (v / (1 - b2 ** t)).sqrt_().add_(group["eps"])
            update = (m / (1 - b1 ** t)) / denom
            master = p.float()
            master.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
            p.copy_(master)
            if self.quantized(p):
                self._store(state, "m", m)
                self._store(state, "v", v.sqrt() if self.v_transform == "sqrt" else v)
            else:
                state["m"], state["v"] = m, v
        return loss


def _run_closure(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _with_grads(optimizer: torch.optim.Optimizer):
    """(group, parameter) for every parameter that has a gradient."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                yield group, p


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (step counters included)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def _scale_dtype(spec: QuantSpec) -> torch.dtype:
    return {"ue4m3_fp32": torch.float8_e4m3fn, "e8m0_floor": torch.float8_e8m0fnu,
            "e8m0_ceil": torch.float8_e8m0fnu}.get(spec.scale.value, torch.float32)


def _smallest_step(spec: QuantSpec) -> float:
    from .formats import magnitudes

    return float(min(m for m in magnitudes(spec.grid) if m > 0))


# ----------------------------------------------------------------------------------------------
# Muon: momentum orthogonalised by Newton-Schulz iterations, optionally with NVFP4 operands
#: x <- a x + (b S + c S^2) x with S = x x^T.  "quintic": Muon's (Jordan et al., 2024), fast but stable only
#: while every singular value stays below ~1.3 -- with NVFP4 operands (~12% error in S) it diverges (measured:
#: tests/test_optim.py, benchmarks/optim-2026-12-01.md).  "cubic": the classic Newton-Schulz step, contractive
#: for singular values in (0, sqrt 3), slower to converge, and as accurate with NVFP4 operands as in BF16.
NS_ITERATIONS = {"quintic": (3.4445, -4.7750, 2.0315), "cubic": (1.5, -0.5, 0.0)}


def _matmul(a: torch.Tensor, b: torch.Tensor, spec: QuantSpec | None) -> torch.Tensor:
    """a [m, k] @ b [k, n]: in BF16, or with both operands quantized along k (blocks of the contraction
    dimension, as hf_fp4's GEMMs take them) by the reference quantizer and multiplied in FP32."""
    if spec is None:
        return a.bfloat16() @ b.bfloat16()
    from .quantize import fake_quantize

    return fake_quantize(a.float(), spec) @ fake_quantize(b.float().t(), spec).t()


def newton_schulz(g: torch.Tensor, steps: int = 5, spec: "QuantSpec | str | None" = None,
                  iteration: str = "quintic") -> torch.Tensor:
    """Approximately U V^T of g = U S V^T, every matmul in BF16 or, with `spec` (e.g. "nvfp4"), with quantized
    operands.  Returns FP32 of g's shape.  See NS_ITERATIONS for the two iterations."""
    spec = as_spec(spec) if spec is not None else None
    a, b, c = NS_ITERATIONS[iteration]
    x = g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.t()
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = _matmul(x, x.t(), spec).float()
        poly = b * s + c * _matmul(s, s, spec).float() if c else b * s
        x = a * x + _matmul(poly, x, spec).float()
    return x.t() if tall else x


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked ``muon=True`` (the hidden weight matrices), AdamW for the others
    (embeddings, norms, LM head) -- one optimizer, so accelerate, schedulers and checkpoints see one.  Each
    group's ``lr`` is its own (Muon's is typically ~10x AdamW's), so an LR schedule scales both.

    Muon: buf = mu buf + g; u = g + mu buf (Nesterov); p -= lr (NS(u) sqrt(max(1, rows / cols)) + wd p).
    ``ns_spec="nvfp4"`` runs the Newton-Schulz matmuls with NVFP4 operands (`newton_schulz`); it needs
    ``ns_iteration="cubic"`` (the quintic diverges with 4-bit operands) and more steps (e.g. 12)."""

    def __init__(self, param_groups, lr: float = 0.02, momentum: float = 0.95, ns_steps: int = 5,
                 ns_spec: "str | None" = None, ns_iteration: str = "quintic", weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        if ns_iteration not in NS_ITERATIONS:
            raise ValueError(f"ns_iteration={ns_iteration!r}: valid values are {', '.join(NS_ITERATIONS)}")
        if ns_spec is not None:
            as_spec(ns_spec)  # an unknown spec name fails here
            if ns_iteration == "quintic":
                raise ValueError(f"ns_spec={ns_spec!r} with ns_iteration='quintic': the quintic iteration diverges "
                                 "with 4-bit operands (its error pushes singular values past its stable range); "
                                 "use ns_iteration='cubic' (e.g. with ns_steps=12)")
        self.ns_iteration = ns_iteration
        if not 0.0 <= momentum < 1.0 or ns_steps < 1:
            raise ValueError(f"need 0 <= momentum < 1 and ns_steps >= 1; got {momentum}, {ns_steps}")
        self.ns_spec = ns_spec
        defaults = dict(lr=lr, momentum=momentum, ns_steps=ns_steps, weight_decay=weight_decay, betas=tuple(betas),
                        eps=eps, muon=False)
        super().__init__(param_groups, defaults)
        for group in self.param_groups:
            if group["muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon groups take 2-D weight matrices only; put other parameters in a muon=False "
                                 "group (AdamW)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        for group, p in _with_grads(self):
            g, state = p.grad.float(), self.state[p]
            if group["muon"]:
                buf = state.setdefault("momentum_buffer", torch.zeros_like(g))
                buf.mul_(group["momentum"]).add_(g)
                u = newton_schulz(g.add(buf, alpha=group["momentum"]), group["ns_steps"], self.ns_spec,
                                  self.ns_iteration)
                scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
                master = p.float().mul_(1 - group["lr"] * group["weight_decay"])
                p.copy_(master.add_(u, alpha=-group["lr"] * scale))
                continue
            b1, b2 = group["betas"]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["m"], state["v"] = torch.zeros_like(g), torch.zeros_like(g)
            state["step"] += 1
            t = float(state["step"])
            state["m"].mul_(b1).add_(g, alpha=1 - b1)
            state["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (state["v"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
            master = p.float().mul_(1 - group["lr"] * group["weight_decay"])
            p.copy_(master.addcdiv_(state["m"], denom, value=-group["lr"] / (1 - b1 ** t)))
        return loss


def orthogonality_error(o: torch.Tensor, g: torch.Tensor) -> float:
    """|| o - U V^T ||_F / || U V^T ||_F: the distance of an orthogonalisation o of g from g's exact polar factor."""
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    polar = u @ vh
    return float((o.double() - polar).norm() / polar.norm())


def build_optimizer(name: str, groups: list[dict], lr: float, betas: tuple[float, float],
                    options: dict) -> torch.optim.Optimizer:
    """The trainer's optimizer `name` ("adamw" | "fp4_adamw" | "muon") over param groups; for muon, groups marked
    ``muon=True`` take ``options["muon_lr"]`` (default 0.02) as their lr, the others `lr`."""
    if name == "muon":
        opts = dict(options)
        muon_lr = opts.pop("muon_lr", 0.02)
        groups = [{**g, "lr": muon_lr} if g.get("muon") else g for g in groups if g["params"]]
        return Muon(groups, lr=lr, betas=betas, **opts)
    if name == "fp4_adamw":
        return FP4AdamW(groups, lr=lr, betas=betas, **options)
    fused = {"fused": True} if torch.cuda.is_available() else {}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **fused)

