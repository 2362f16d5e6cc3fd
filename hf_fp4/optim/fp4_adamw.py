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

The update (`_update`) rounds once per operation -- products and sums apart, the bias corrections multiplied as
FP32 reciprocals -- so that it means the same on every device (PyTorch's fused forms, add(alpha=) or a division
by a scalar, round differently on CPU and CUDA).  backend "triton" (the default on CUDA) runs the whole
step of a group's quantized parameters in two kernel launches (hf_fp4.kernels.optim, bit-exact with this module's
PyTorch path, "reference"); the PyTorch path launches ~35 kernels per parameter.  The FP32-moment parameters of a group
take one update over their concatenation (`_flat_step`: the same operations elementwise, the same bits).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import torch

from ..nn.backends import _decode_tables, fast_block_decode, fast_dequantize, quantize
from ..numerics.formats import grid_step
from ..numerics.qtensor import QuantizedTensor
from ..numerics.spec import QuantSpec, as_spec

from ._common import _run_closure, _with_grads

V_TRANSFORMS = ("sqrt", "none")
BACKENDS = ("auto", "triton", "reference")
#: Gradients at or above this magnitude are refused: below it g^2 < 2^126, so v = b2 v + (1 - b2) g^2 stays finite.
GRAD_LIMIT = 2.0**63
_STORED = ("_codes", "_scales", "_tensor_scale")


class FP4AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with moments stored in `state_spec` (see module doc)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, state_spec: "QuantSpec | str" = "nvfp4", v_transform: str = "sqrt",
                 min_numel: int = 4096, backend: str = "auto"):
        if v_transform not in V_TRANSFORMS:
            raise ValueError(f"v_transform={v_transform!r}: valid values are {', '.join(V_TRANSFORMS)}")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: valid values are {', '.join(BACKENDS)}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if lr < 0 or eps <= 0 or weight_decay < 0:
            raise ValueError(f"need lr >= 0, eps > 0, weight_decay >= 0; got {lr}, {eps}, {weight_decay}")
        spec = as_spec(state_spec)
        if spec.rounding.value != "nearest":
            raise ValueError("state_spec must round to nearest (the state is re-quantized every step)")
        self.spec, self.v_transform, self.min_numel, self.backend = spec, v_transform, int(min_numel), backend
        self._store_spec = dataclasses.replace(spec, nonfinite="propagate")
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
        # on CUDA the fused kernel (bit-exact with the reference quantizer, one launch instead of dozens); the
        # values are finite by step()'s gradient check, so the quantizer skips its own (a host read per store)
        q = quantize(x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x, self._store_spec,
                     backend="triton" if x.is_cuda else "reference")
        state[f"{name}_codes"] = q.codes
        state[f"{name}_scales"] = q.scales.view(torch.uint8)  # not a float: load_state_dict would cast it
        state[f"{name}_tensor_scale"] = q.tensor_scale if q.tensor_scale is not None else torch.ones((), device=x.device)

    def _load(self, state: dict, name: str, p: torch.Tensor, floor_zeros: bool) -> torch.Tensor:
        """The stored moment's FP32 values: QuantizedTensor.dequantize's, by byte lookup (fast_dequantize: a few
        launches per tensor instead of dozens), with zero codes floored (see the module doc)."""
        shape = p.shape if p.dim() == 2 else torch.Size((math.prod(p.shape[:-1]), p.shape[-1]))
        scales = state[f"{name}_scales"].view(_scale_dtype(self.spec))
        q = QuantizedTensor(state[f"{name}_codes"], scales, state[f"{name}_tensor_scale"], shape, self.spec)
        values = fast_dequantize(q, crop=False)
        if floor_zeros:  # a zero code stands for "below the grid": the middle of that range, not 0
            (mp, kp), (br, bc) = values.shape, self.spec.block
            half = (fast_block_decode(q) * q.tensor_scale * grid_step(self.spec.grid)) / 2
            blocks = values.view(mp // br, br, kp // bc, bc)
            values = torch.where(blocks == 0, half.view(mp // br, 1, kp // bc, 1), blocks).view(mp, kp)
        return q._crop(values).reshape(p.shape)

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
        walk = list(_with_grads(self))
        # One host synchronisation per step, before any state changes: every gradient finite and below
        # GRAD_LIMIT, so that every moment stays finite (|m| <= max|g| so far, v < 2^127) and the stores need no
        # check of their own (the quantizer's non-finite check read a flag back per store: 2 syncs a parameter).
        grads = [p.grad for _, p in walk if p.grad.numel()]
        # max |g| of every gradient in one foreach launch per dtype (a NaN gives NaN: below no limit)
        if grads and not bool((torch.stack([n.float().to(grads[0].device) for n in
                                            torch._foreach_norm(grads, float("inf"))]) < GRAD_LIMIT).all()):
            raise FloatingPointError(f"FP4AdamW: non-finite gradient, or one of magnitude >= 2^63 (its square "
                                     f"overflows FP32); the state would be lost on re-quantization: skip the step")
        small = {}  # FP32-moment parameters, batched by (group, step): one update over their concatenation
        fused = {}  # the kernels' parameters, batched by (group, step, dtype): two launches a batch
        for group, p in walk:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                zeros = torch.zeros_like(p, dtype=torch.float32)
                if self.quantized(p):
                    self._store(state, "m", zeros)
                    self._store(state, "v", zeros)
                else:
                    state["m"], state["v"] = zeros, zeros.clone()
        if walk:  # every step counter (CPU tensors) in one call
            torch._foreach_add_([self.state[p]["step"] for _, p in walk], 1)
        for group, p in walk:
            state = self.state[p]
            t = float(state["step"])
            scalars = _scalars(group, t)
            if self.quantized(p) and self._fused_ready(p):
                fused.setdefault((id(group), t, p.dtype, p.device), (scalars, []))[1].append(p)
                continue
            if not self.quantized(p) and _flat_ready(p, walk[0][1].device):
                small.setdefault((id(group), t), (scalars, []))[1].append(p)
                continue
            m, v = self.moments(p)
            m, v, master = _update(m, v, p.grad.float(), p.float(), scalars)
            p.copy_(master)
            if self.quantized(p):
                self._store(state, "m", m)
                self._store(state, "v", _sqrt_rn(v) if self.v_transform == "sqrt" else v)
            else:
                state["m"], state["v"] = m, v
        for scalars, params in fused.values():
            self._fused_steps(params, scalars)
        for scalars, params in small.values():
            self._flat_step(params, scalars)
        return loss

    def _flat_step(self, params: list[torch.Tensor], scalars: dict) -> None:
        """The FP32-moment parameters of one group and step count in one `_update` over their concatenation (the
        same elementwise operations, so the same bits as parameter by parameter, in ~27 launches instead of ~20
        per parameter: bench-50m's 21 norm weights took ~420)."""
        states = [self.state[p] for p in params]
        flat = [torch.cat([t.reshape(-1).float() for t in ts]) for ts in (
            [st["m"] for st in states], [st["v"] for st in states], [p.grad for p in params], params)]
        m, v, master = _update(*flat, scalars)
        sizes = [p.numel() for p in params]
        for targets, new in (([st["m"] for st in states], m), ([st["v"] for st in states], v), (params, master)):
            torch._foreach_copy_(targets, [c.view(t.shape) for c, t in zip(new.split(sizes), targets)])

    def _fused_ready(self, p: torch.Tensor) -> bool:
        """Whether p's step runs on the kernels (backend, device, state spec; plain contiguous tensors -- a
        tensor subclass such as FSDP2's DTensor shard keeps the PyTorch path, whose ops it dispatches)."""
        from ..kernels.gemm import _kernel_device  # Triton is imported only when asked for
        from ..kernels.optim import supports

        if self.backend == "reference" or not supports(self.spec) or not (
                _plain(p) and p.is_contiguous() and p.grad.is_contiguous()
                and p.dtype in (torch.float32, torch.bfloat16)):  # the parameter dtypes the kernel writes
            return False
        return p.is_cuda if self.backend == "auto" else _kernel_device(p)

    def _fused_steps(self, params: list[torch.Tensor], scalars: dict) -> None:
        """The step of parameters of one group, step count, dtype and device on the kernels: two launches for all."""
        from ..kernels.optim import triton_fp4_adamw_steps

        batch = []
        for p in params:
            state = self.state[p]
            batch.append((p if p.dim() == 2 else p.view(-1, p.shape[-1]),
                          p.grad if p.grad.dim() == 2 else p.grad.view(-1, p.grad.shape[-1]),
                          *({"codes": state[f"{n}_codes"], "scales": state[f"{n}_scales"],
                             "tensor_scale": state[f"{n}_tensor_scale"]} for n in ("m", "v"))))
        scales = triton_fp4_adamw_steps(batch, self.spec, _nibble_tables(self.spec, params[0].device), scalars,
                                        self.v_transform == "sqrt")
        for p, (m_ts, v_ts) in zip(params, scales):
            self.state[p]["m_tensor_scale"], self.state[p]["v_tensor_scale"] = m_ts, v_ts


@functools.lru_cache(maxsize=None)
def _nibble_tables(spec: QuantSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's decodes for the kernels: a 4-bit code's grid value [16] (a byte's low nibble) and a scale
    byte's block decode factor [256] (hf_fp4.nn.backends._decode_tables)."""
    values, factors = _decode_tables(spec, device)
    return values[:16, 0].contiguous(), factors


def _plain(p: torch.Tensor) -> bool:
    """Whether p and its gradient are plain tensors on one device (a tensor subclass such as FSDP2's DTensor shard
    keeps the PyTorch path, whose ops it dispatches)."""
    return type(p.data) is torch.Tensor and type(p.grad) is torch.Tensor and p.grad.device == p.device


def _flat_ready(p: torch.Tensor, device: torch.device) -> bool:
    """Whether p joins _flat_step: a plain tensor (_plain) on the step's device."""
    return _plain(p) and p.device == device


def _scalars(group: dict, t: float) -> dict:
    """The step's scalars as the update uses them (each rounded to FP32 where it meets a tensor)."""
    b1, b2 = group["betas"]
    return {"b1": b1, "one_minus_b1": 1 - b1, "b2": b2, "one_minus_b2": 1 - b2, "c1": 1 / (1 - b1 ** t),
            "c2": 1 / (1 - b2 ** t), "eps": group["eps"], "decay": 1 - group["lr"] * group["weight_decay"],
            "lr": group["lr"]}


def _update(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, master: torch.Tensor, s: dict):
    """AdamW's step in FP32, one IEEE rounding per operation (the spec of the kernels' update):
    m' = m b1 + g (1 - b1);  v' = v b2 + (g g)(1 - b2);  p' = p (1 - lr wd) - (m' c1 / (sqrt(v' c2) + eps)) lr,
    with c1, c2 the bias corrections' reciprocals.  Returns (m', v', p')."""
    m = m.mul(s["b1"]).add(g.mul(s["one_minus_b1"]))
    v = v.mul(s["b2"]).add(g.mul(g).mul(s["one_minus_b2"]))
    denom = _sqrt_rn(v.mul(s["c2"])).add(s["eps"])
    update = m.mul(s["c1"]).div(denom)
    return m, v, master.mul(s["decay"]).sub(update.mul(s["lr"]))


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded FP32 square root: through FP64 (exact enough that the rounding to FP32 is the correct
    one).  PyTorch's CPU sqrt of FP32 vectors misses it by an ulp for some inputs (a vectorised approximation)."""
    return x.double().sqrt().float()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (step counters included)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def _scale_dtype(spec: QuantSpec) -> torch.dtype:
    return {"ue4m3_fp32": torch.float8_e4m3fn, "e8m0_floor": torch.float8_e8m0fnu,
            "e8m0_ceil": torch.float8_e8m0fnu}.get(spec.scale.value, torch.float32)
