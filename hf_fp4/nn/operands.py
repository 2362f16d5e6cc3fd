"""The operand layer: tensor + QuantSpec + Hadamard -> GEMM operand, and the GEMM of two operands.

A linear layer's three tensors each feed two GEMMs, in two orientations (RESEARCH.md):

    x  [T, K]:  fprop lhs (blocks along K)   and  wgrad rhs x^T (blocks along T)
    W  [N, K]:  fprop rhs (blocks along K)   and  dgrad rhs W^T (blocks along N)
    dy [T, N]:  dgrad lhs (blocks along N)   and  wgrad lhs dy^T (blocks along T)

`LinearPlan.build(recipe, backend)` turns a LinearRecipe into an `OperandPlan` per orientation and a
*form* per GEMM, decided from the recipe alone (never from the data):

* ``hp``   -- the GEMM is not quantized: the tensors as they are (bf16 path, exactly nn.Linear);
* ``fp32`` -- the reference backend: operands are `hf_fp4.fake_quantize` values in FP32 (any device);
* ``fp8``  -- both operands have power-of-two (E8M0) scales on a 4-bit grid: folded into E4M3, run on
  FP8 tensor cores, exact (hf_fp4.kernels.operand / gemm);
* ``bf16`` -- every other quantized GEMM on the fast path: v * block scale in BF16 (exact), FP32
  accumulation, the FP32 tensor scales applied to the output.

`operands(t, plans, seeds, signs, mu)` produces both orientations of t in one call (the Triton kernels
read t once for the statistics and once for both operands) and `gemm(a, b, form, ...)` multiplies two
operands.  Both are `torch.library` ops (on CUDA `triton_op`s, whose kernels torch.compile launches from its own
generated code), so torch.compile traces FP4Linear without graph breaks.  Called eagerly (nothing traces the
call: hf_fp4.kernels.launch.tracing) they run their implementation directly, without the custom op's dispatch.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels.launch import tracing
from ..numerics.hadamard import apply_hadamard
from ..numerics.operand_plan import (FORMS, KERNEL_FORMS, Operand, OperandPlan, RowGroups,  # noqa: F401
                                     empty_operand, fp8_capable, fp8_dmax, fp8_shift, round_up)
from ..numerics.quantize import QuantizedTensor, expand_blocks, quantize
from .recipe import GemmSpec, LinearRecipe
from ..numerics.scales import ScaleRule, e8m0_exponent, pow2
from ..numerics.spec import QuantSpec, Rounding

BACKENDS = ("auto", "reference", "triton")
#: CUDA launches through triton_ops (torch.compile traces into them and launches the kernels from its own code);
#: HF_FP4_TRITON_OPS=0 keeps the opaque custom ops on CUDA too (a Python call per op, inputs never copied);
#: a LinearPlan with triton_ops=False (FP4Linear.cuda_graphs) does the same for one layer.
TRITON_OPS = os.environ.get("HF_FP4_TRITON_OPS", "1") != "0"


def reference_operand(t: torch.Tensor, plan: OperandPlan, seed, signs: torch.Tensor | None) -> Operand:
    """The reference operand of an already oriented [rows, k] tensor: fake-quantized FP32 values."""
    x = t.float()
    if plan.hadamard:
        x = apply_hadamard(x, plan.hadamard, signs)
    if plan.spec is not None:
        x = quantize(x, plan.spec, seed=seed).dequantize()
    elif x.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
        x = x.clone()  # a custom op's outputs may not alias its inputs
    return Operand(x, torch.ones(1, device=t.device), *(torch.empty(0, device=t.device) for _ in range(3)))


def stored_operand(q: QuantizedTensor, plan: OperandPlan) -> Operand:
    """The operand of `plan` (form fp32, bf16 or fp8) from a tensor already quantized by the plan's spec (rotated
    first where the plan has a Hadamard): equal to what `operands` makes from the tensor itself (the reference
    values; for the kernel forms the same fields the operand kernels write).  The FP4 all-gather's weights
    (hf_fp4.nn.fp4_gather) arrive quantized."""
    dev = q.codes.device
    none = torch.empty(0, device=dev)
    if plan.form == "fp32":
        return Operand(q.dequantize(), torch.ones(1, device=dev), none, none, none)
    rows, k = q.shape
    r, c = plan.shape(rows, k)
    if plan.form == "bf16":
        values, decode = q.tensor_core_parts()
        data = torch.zeros(r, c, dtype=torch.bfloat16, device=dev)
        data[:rows, :k] = values
        return Operand(data, decode.reshape(1), none, none, none)
    return _stored_fp8(q, r, c)


def _stored_fp8(q: QuantizedTensor, r: int, c: int) -> Operand:
    """The FP8 form (kernels/src/operand.py) from E8M0 scales: each block folded into E4M3 against its rows'
    reference exponent (the largest block exponent of the block's rows), blocks more than DMAX binades below it
    lost to the side buffer, their rows flagged."""
    spec = q.spec
    (br, bc), shift, dmax = spec.block, fp8_shift(spec.grid), fp8_dmax(spec.grid)
    v = q.code_values()  # [Mp, Kp] signed grid values
    e = e8m0_exponent(q.scales)  # per block; 128: a NaN block
    bad = e == 128
    e_ref = torch.where(bad, torch.full_like(e, -127), e).amax(dim=1, keepdim=True)  # per block row
    nonzero = v.reshape(v.shape[0] // br, br, -1, bc).ne(0).any(dim=3).any(dim=1)
    lost = nonzero & (e_ref - e > dmax) & ~bad
    factor = torch.where(lost, 0.0, pow2((e - e_ref + shift).clamp(min=-149)))
    factor = torch.where(bad, math.nan, factor)
    mp, kp = v.shape
    data = torch.zeros(r, c, dtype=torch.float8_e4m3fn, device=v.device)
    data[:mp, :kp] = (v * expand_blocks(factor, spec.block)).to(torch.float8_e4m3fn)
    ref_rows = torch.full((r,), -127, dtype=torch.int32, device=v.device)
    ref_rows[:mp] = e_ref.reshape(-1).repeat_interleave(br)
    side = torch.zeros(r, c, dtype=torch.float8_e4m3fn, device=v.device)
    eb = torch.full((r, c // bc), -128, dtype=torch.int8, device=v.device)
    flags = torch.zeros(r + 1, dtype=torch.int8, device=v.device)
    lost_el = expand_blocks(lost, spec.block)
    side[:mp, :kp] = torch.where(lost_el, v * 2.0 ** shift, 0.0).to(torch.float8_e4m3fn)
    eb[:mp, :kp // bc] = torch.where(lost, e, -128).repeat_interleave(br, dim=0).to(torch.int8)
    flags[:mp] = lost_el.any(dim=1).to(torch.int8)
    flags[r] = flags[:r].amax()
    return Operand(data, pow2(ref_rows - shift), side, eb, flags)


def operand_values(op: Operand, plan: OperandPlan, rows: int, k: int) -> torch.Tensor:
    """The real FP32 values an operand stands for, [rows, k'] (tests and diagnostics; not the hot path)."""
    if plan.form in ("fp32", "hp"):
        return op.data.float()
    width = k + (-k % plan.hadamard if plan.hadamard else 0)
    if plan.form == "bf16":
        return (op.data.float() * op.scale)[:rows, :width]
    values = op.data.float() * op.scale[:, None]
    lost = (op.eb != -128).repeat_interleave(plan.spec.block[1], 1)
    side = op.side.float() * torch.exp2(op.eb.float() - fp8_shift(plan.spec.grid)).repeat_interleave(
        plan.spec.block[1], 1)
    return torch.where(lost, side, values)[:rows, :width]


# ----------------------------------------------------------------------------------------------
# Custom ops: the operand pair of one tensor, and the FP8 GEMM.
@functools.lru_cache(maxsize=None)
def _plans(key: str) -> tuple[OperandPlan | None, OperandPlan | None]:
    return tuple(OperandPlan.from_dict(d) if d else None for d in json.loads(key))


def plans_key(plans: tuple[OperandPlan | None, OperandPlan | None]) -> str:
    return json.dumps([p.to_dict() if p else None for p in plans])


def _groups(group_ids, group_starts, group_kp) -> RowGroups | None:
    return RowGroups(group_ids, group_starts, group_kp) if group_ids is not None else None


def _operands_impl(t, mu, seeds, signs_a, signs_b, key, group_ids=None, group_starts=None, group_kp=None):
    plans = _plans(key)
    signs = (signs_a, signs_b)
    fast = tuple(p if p is not None and p.form in KERNEL_FORMS else None for p in plans)
    groups = _groups(group_ids, group_starts, group_kp)
    if groups is not None and any(p is not None and f is None for p, f in zip(plans, fast)):
        raise ValueError("grouped operands are made by the kernels only (BF16 / FP8 forms)")
    out: list = [None, None]
    if any(fast):
        from ..kernels.operand import triton_operands

        out = triton_operands(t, fast, seeds, tuple(s if f else None for s, f in zip(signs, fast)), mu,
                              groups=groups)
    if any(p is not None and f is None for p, f in zip(plans, fast)):
        t = t.reshape(-1, t.shape[-1])
        centred = t.float() - mu if mu is not None else t
        seed_values = seeds.tolist()
        for i, (plan, f) in enumerate(zip(plans, fast)):
            if plan is not None and f is None:
                out[i] = reference_operand(centred if i == 0 else centred.t(), plan, seed_values[i], signs[i])
    result = []
    for op in out:
        result += list(op) if op is not None else [torch.empty(0, device=t.device) for _ in range(5)]
    return result


def _operands_fake(t, mu, seeds, signs_a, signs_b, key, group_ids=None, group_starts=None, group_kp=None):
    result = []
    rows, cols = t.numel() // t.shape[-1], t.shape[-1]
    groups = group_starts.shape[0] if group_starts is not None else 0
    for i, (plan, (rows, k)) in enumerate(zip(_plans(key), ((rows, cols), (cols, rows)))):
        if plan is None:
            result += [t.new_empty(0, dtype=torch.float32) for _ in range(5)]
        else:
            result += list(empty_operand(plan, rows, k, t.device, t.dtype, groups=groups, contraction_grouped=i == 1))
    return result


def _operands_kernels(t: torch.Tensor, mu: Optional[torch.Tensor], seeds: torch.Tensor,
                      signs_a: Optional[torch.Tensor], signs_b: Optional[torch.Tensor], key: str,
                      group_ids: Optional[torch.Tensor] = None, group_starts: Optional[torch.Tensor] = None,
                      group_kp: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    return _operands_impl(t, mu, seeds, signs_a, signs_b, key, group_ids, group_starts, group_kp)


# Two registrations of one implementation.  "operands" is opaque to torch.compile (any device, any form:
# the reference path reads the seeds on the host; on the CPU the kernels run in Triton's interpreter).
# "operands_cuda" (CUDA tensors, kernel forms only) is a triton_op: torch.compile traces into it and
# launches its kernels from the generated code, without a Python call per operand pair.
_operands_op = torch.library.custom_op("hf_fp4::operands", _operands_kernels, mutates_args=())
_operands_op.register_fake(_operands_fake)
_operands_cuda_op = torch.library.triton_op("hf_fp4::operands_cuda", _operands_kernels, mutates_args=())


def custom_call(impl, opaque, cuda, t: torch.Tensor, triton_ops: bool = True):
    """What to call for a custom op on tensor t: its implementation itself when nothing traces the call (eager: no
    dispatch), else the triton_op on CUDA (torch.compile traces into it), else the opaque op (the CPU, the
    reference forms, HF_FP4_TRITON_OPS=0, triton_ops=False)."""
    if not tracing(t):
        return impl
    return cuda if TRITON_OPS and triton_ops and t.is_cuda else opaque


def quantized_pair(plans) -> tuple[OperandPlan | None, OperandPlan | None]:
    """The orientations the custom op makes (the unquantized ones are views of the tensor)."""
    return tuple(p if p is not None and p.form != "hp" else None for p in plans)


def operands(t: torch.Tensor, plans: tuple[OperandPlan | None, OperandPlan | None], seeds: torch.Tensor,
             signs: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
             mu: torch.Tensor | None = None, key: str | None = None,
             triton_ops: bool = True, groups: RowGroups | None = None) -> tuple[Operand | None, Operand | None]:
    """Both orientations of a tensor t read as a matrix [rows, C] (leading dims flattened): plans[0] for its
    rows, plans[1] for the rows of its transpose.

    Quantized orientations come from one custom-op call (the kernels read t once for both, through its
    strides: an N-D t is not reshaped); an unquantized ("hp") orientation is t itself (minus mu, in t's
    dtype), transposed as a view.  triton_ops=False launches the kernels from an opaque custom op even under
    torch.compile on CUDA (see LinearPlan.triton_ops).  groups: t's rows in groups quantized as separate tensors
    (RowGroups: the grouped expert GEMMs; seeds [E, 2]).
    """
    quantized = quantized_pair(plans)
    out: list = [None, None]
    if any(quantized):  # `key` (plans_key of the pair) may be precomputed: json does not trace
        kernels_only = all(p is None or p.form in KERNEL_FORMS for p in quantized)
        op = custom_call(_operands_impl, _operands_op, _operands_cuda_op, t, triton_ops and kernels_only)
        flat = op(t, mu, seeds, *signs, key or plans_key(quantized), *(groups or ()))
        out = [Operand(*flat[5 * i:5 * i + 5]) if p is not None else None for i, p in enumerate(quantized)]
    if any(p is not None and p.form == "hp" for p in plans):
        t = t.reshape(-1, t.shape[-1])
        raw = (t.float() - mu).to(t.dtype) if mu is not None else t
        none = t.new_empty(0)
        for i, p in enumerate(plans):
            if p is not None and p.form == "hp":
                out[i] = Operand(raw if i == 0 else raw.t(), none, none, none, none)
    return tuple(out)


def _fp8_gemm_kernels(a_data: torch.Tensor, a_scale: torch.Tensor, a_side: torch.Tensor, a_eb: torch.Tensor,
                      a_flags: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor, b_side: torch.Tensor,
                      b_eb: torch.Tensor, b_flags: torch.Tensor, m: int, n: int, out_dtype: torch.dtype,
                      a_blc: int, a_shift: int, b_blc: int, b_shift: int) -> torch.Tensor:
    from ..kernels.gemm import fp8_gemm

    return fp8_gemm(Operand(a_data, a_scale, a_side, a_eb, a_flags), Operand(b_data, b_scale, b_side, b_eb, b_flags),
                    m, n, out_dtype, a_blc, a_shift, b_blc, b_shift)


# Registered twice, as the operands are: opaque (the CPU and Triton's interpreter) and as a triton_op (CUDA).
_fp8_gemm_op = torch.library.custom_op("hf_fp4::fp8_gemm", _fp8_gemm_kernels, mutates_args=())
_fp8_gemm_cuda_op = torch.library.triton_op("hf_fp4::fp8_gemm_cuda", _fp8_gemm_kernels, mutates_args=())


@_fp8_gemm_op.register_fake
def _(a_data, a_scale, a_side, a_eb, a_flags, b_data, b_scale, b_side, b_eb, b_flags, m, n, out_dtype, a_blc,
      a_shift, b_blc, b_shift):
    return a_data.new_empty(m, n, dtype=out_dtype)


def _bf16_gemm_kernels(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                       b_scale: torch.Tensor) -> torch.Tensor:
    """The fused BF16-form GEMM, or torch.mm's FP32 output and the epilogue pass (the same roundings) where an
    operand view starts off TMA's 16-byte alignment (which a compiler's trace cannot see) or the output has fewer
    tiles than half the GPU's SMs over a long contraction (a small wgrad: cuBLAS splits K, see bf16_gemm.LONG_K)."""
    from ..kernels.bf16_gemm import aligned, bf16_gemm, long_and_narrow

    if aligned(a, b) and not long_and_narrow(a, b):
        return bf16_gemm(a, b, a_scale, b_scale)
    return _mm_scaled(a, b, a_scale, b_scale, torch.bfloat16)


def _mm_scaled(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b^T of BF16-form operands as an FP32 product (torch.mm on CUDA), the tensor scales applied after."""
    from ..kernels.gemm import scale_output

    out = torch.mm(a, b.t(), out_dtype=torch.float32) if a.is_cuda else a.float() @ b.float().t()
    return scale_output(out, a_scale, b_scale, out_dtype)


# Opaque under every compiler (its launch takes host-built TMA descriptors); torch.compile and CUDA graphs call it as
# one node.
_bf16_gemm_op = torch.library.custom_op("hf_fp4::bf16_gemm", _bf16_gemm_kernels, mutates_args=())


@_bf16_gemm_op.register_fake
def _(a, b, a_scale, b_scale):
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.bfloat16)


def gemm(a: Operand, b: Operand, plans: tuple[OperandPlan, OperandPlan], m: int, n: int,
         out_dtype: torch.dtype, triton_ops: bool = True) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T -> [M, N] in out_dtype, by the form both plans share (the FP8 GEMM through its custom
    op while a compiler traces the call, else its implementation called directly).  Autocast is off inside: the
    layer has cast its activations already (as nn.Linear), and autocast's BF16 matmul would round the FP32 form's
    operands and the BF16 form's product before its tensor scales (session 35: NVFP4 / UFP4 outputs one BF16 ulp
    off on the CPU under autocast)."""
    with torch.autocast(a.data.device.type, enabled=False):
        return _gemm(a, b, plans, m, n, out_dtype, triton_ops)


def _gemm(a: Operand, b: Operand, plans: tuple[OperandPlan, OperandPlan], m: int, n: int,
          out_dtype: torch.dtype, triton_ops: bool) -> torch.Tensor:
    form = plans[0].form
    if form == "hp":
        return (a.data @ b.data.t().to(a.data.dtype)).to(out_dtype)
    if form == "fp32":
        return (a.data @ b.data.t()).to(out_dtype)
    if form == "fp8":
        pa, pb = plans
        op = custom_call(_fp8_gemm_kernels, _fp8_gemm_op, _fp8_gemm_cuda_op, a.data, triton_ops)
        return op(*a, *b, m, n, out_dtype, pa.spec.block[1], fp8_shift(pa.spec.grid), pb.spec.block[1],
                  fp8_shift(pb.spec.grid))
    # bf16: exact operands, FP32 accumulation, the two FP32 tensor scales on the output
    from ..kernels import bf16_gemm as fused

    a_data, b_data = a.data[:m], b.data[:n]
    if fused.ENABLED and out_dtype == torch.bfloat16 and a.scale.numel() == b.scale.numel() == 1 and fused.fits(
            a_data, b_data):  # one kernel: the scales in its epilogue, BF16 written once
        op = custom_call(_bf16_gemm_kernels, _bf16_gemm_op, _bf16_gemm_op, a_data, triton_ops)
        return op(a_data, b_data, a.scale.reshape(1), b.scale.reshape(1))
    return _mm_scaled(a_data, b_data, a.scale, b.scale, out_dtype)


def quantized_matmul(a: torch.Tensor, b: torch.Tensor, spec: QuantSpec, backend: str = "auto",
                     out_dtype: torch.dtype = torch.float32, fp8_gemms: bool = True) -> torch.Tensor:
    """a [m, k] @ b [k, n] with both operands quantized along k by `spec` (round to nearest; no Hadamard)
    through the layers' operand and GEMM path: on CUDA ("auto") the operand kernels (b read once, in its
    transposed orientation) and the FP8 / BF16 GEMM of the spec's family (fp8_gemms=False: the MX family's
    in BF16 too, FP32 accumulation, as for FP4Linear.fp8_gemms); "reference": the reference quantizer and an
    FP32 matmul.  Muon's NVFP4 Newton-Schulz iterations run on it."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if spec.rounding is not Rounding.NEAREST:
        raise ValueError("quantized_matmul rounds to nearest: pass a QuantSpec with rounding='nearest'")
    fast = backend == "triton" or (backend == "auto" and a.is_cuda)
    form = "fp32" if not fast or spec.scale is ScaleRule.FP32 else (
        "fp8" if fp8_gemms and fp8_capable(spec) else "bf16")
    plan = OperandPlan.single(spec, form)
    seeds = torch.zeros(2, dtype=torch.int64, device=a.device)
    if form in KERNEL_FORMS:  # never compiled (the optimizer's step): the kernels called directly, no custom ops
        from ..kernels.operand import triton_operands

        oa, ob = triton_operands(a, (plan, None), seeds)[0], triton_operands(b, (None, plan), seeds)[1]
    else:
        oa = operands(a, (plan, None), seeds, triton_ops=False)[0]
        ob = operands(b, (None, plan), seeds, triton_ops=False)[1]
    return gemm(oa, ob, (plan, plan), a.shape[0], b.shape[1], out_dtype, triton_ops=False)


# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearPlan:
    """Everything the autograd function needs from a recipe: operand plans per tensor, forms per GEMM."""

    x: tuple[OperandPlan | None, OperandPlan | None]
    w: tuple[OperandPlan | None, OperandPlan | None]
    dy: tuple[OperandPlan | None, OperandPlan | None]
    forms: tuple[str, str, str]  # fprop, dgrad, wgrad
    mean_bias: bool = False
    frozen_weight: bool = False  # a packed export: fprop's weight operand is the stored tensor itself
    # torch.compile launches the kernels from its generated code (triton_op: no Python per launch, but inductor
    # copies an unrealised input per launch); False keeps them in opaque custom ops, which is faster where CUDA
    # graphs replay the step (no Python per launch either, and no copies): FP4Linear.cuda_graphs.
    triton_ops: bool = True
    keys: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # (tensor, both) -> op key

    def key(self, tensor: str, both: bool) -> str:
        return self.keys[(tensor, both)]

    def seeded(self, tensor: str) -> bool:
        """Whether an orientation of `tensor` ("x", "w", "dy") rounds stochastically (its seeds matter)."""
        return any(p is not None and p.stochastic for p in getattr(self, tensor))

    @classmethod
    def build(cls, recipe: LinearRecipe, backend: str, frozen_weight: bool = False,
              fp8_gemms: bool = True) -> "LinearPlan":
        """backend: "reference" (FP32 fake quantization) or "triton" (fast forms).  fp8_gemms=False runs the MX
        family's GEMMs on the BF16 tensor cores instead of the FP8 ones: the same operands (E2M1 x 2^e is exact
        in BF16), FP32 accumulation; the FP8 MMA of Hopper accumulates with fewer bits (README, GPU)."""
        if backend not in ("reference", "triton"):
            raise ValueError(f"unknown backend {backend!r}; valid: reference, triton")
        plans, forms = {}, []
        for gname in ("fprop", "dgrad", "wgrad"):
            g: GemmSpec = recipe.gemm(gname)
            form = _form(g, backend, frozen_weight and gname == "fprop", fp8_gemms)
            forms.append(form)
            k_align = max([16, g.hadamard.size if g.hadamard.enabled else 1] +
                          [s.block[1] for s in (g.lhs, g.rhs) if s is not None])
            h = g.hadamard.size if g.hadamard.enabled else 0
            signed = g.hadamard.kind.value in ("random_fixed", "random_per_step")
            for role, spec in (("lhs", g.lhs), ("rhs", g.rhs)):
                if frozen_weight and gname == "fprop" and role == "rhs":
                    plans[(gname, role)] = OperandPlan(None, 0, False, "fp32")  # the stored operand itself
                    continue
                plans[(gname, role)] = OperandPlan(spec if form != "hp" else None, h if form != "hp" else 0,
                                                   signed and form != "hp", form, k_align)
        pairs = {"x": (plans[("fprop", "lhs")], plans[("wgrad", "rhs")]),
                 "w": (plans[("fprop", "rhs")], plans[("dgrad", "rhs")]),
                 "dy": (plans[("dgrad", "lhs")], plans[("wgrad", "lhs")])}
        keys = {(t, both): plans_key(quantized_pair((p[0], p[1] if both else None)))
                for t, p in pairs.items() for both in (False, True)}
        return cls(**pairs, forms=tuple(forms), mean_bias=recipe.mean_bias_removal, frozen_weight=frozen_weight,
                   keys=keys)


def plan_switch(attr: str, doc: str) -> property:
    """A boolean switch of a layer's plans (FP4Linear, ExpertsFP4): stored in `attr`; setting it rebuilds them
    (the owner's `_build_plans`), so torch.compile only ever reads built plans."""
    def get(self) -> bool:
        return getattr(self, attr)

    def set_(self, value: bool) -> None:
        setattr(self, attr, bool(value))
        self._build_plans()

    return property(get, set_, doc=doc)


def plans_by_backend(recipe: LinearRecipe, frozen_weight: bool, fp8_gemms: bool) -> dict[str, LinearPlan]:
    """The LinearPlan of each backend ("reference", "triton") of one layer's recipe and switches (FP4Linear and
    MoE experts rebuild them whenever the recipe, the frozen flag or fp8_gemms changes)."""
    return {b: LinearPlan.build(recipe, b, frozen_weight, fp8_gemms) for b in ("reference", "triton")}


def _form(g: GemmSpec, backend: str, frozen: bool, fp8_gemms: bool = True) -> str:
    if not g.quantized and not g.hadamard.enabled:
        return "hp"
    if backend == "reference" or frozen or g.lhs is None or g.rhs is None:
        return "fp32"
    if ScaleRule.FP32 in (g.lhs.scale, g.rhs.scale):
        return "fp32"
    return "fp8" if fp8_gemms and fp8_capable(g.lhs) and fp8_capable(g.rhs) else "bf16"
