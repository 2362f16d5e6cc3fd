"""Grouped expert GEMMs (issue 16's fast path): all experts of a projection in one operand call per tensor and
one grouped GEMM per product, instead of a loop over experts with a host-read routing.

The routed (token, slot) pairs are gathered into expert segments aligned to the wgrad operands' blocks
(hf_fp4.nn.grouping); then, with W the projection's weights stacked as [E * N, K]:

    fprop: y  = Q(x)    Q(W_e)^T       per segment   offsets along the rows
    dgrad: dx = Q(dy)   Q(W_e^T)^T     per segment   offsets along the rows
    wgrad: dW_e = Q(dy_e^T) Q(x_e^T)^T per expert    offsets along the contraction

Each tensor's operands are made by one call whose rows are in groups (RowGroups: the experts' segments of x and
dy, the experts' N rows of W), each group quantized as the per-expert loop (the spec: ExpertsFP4.linear on each
expert's rows) quantizes that expert's tensor: its own tensor amax (NVFP4 / UFP4's two-level scales), its own SR
stream (the expert's seeds, coordinates from the segment's first row, the segment's padded length) -- so the
operands are the loop's bit for bit (tests/test_experts.py, tests/test_kernels.py); the FP8 form's reference
exponents of the transposed orientations are per (row, expert) as well.  GEMMs, in the loop's form per GEMM:
the MX family in BF16 on torch._grouped_mm (the experts' default, ExpertsFP4.fp8_gemms False), or with
fp8_gemms on hf_fp4.kernels.grouped_gemm's FP8 kernels -- FP32 promotion after every MMA step, the two row
scales, a tile touching a lost block recomputed exactly in place; the two-level formats on its BF16 kernels, which
apply each expert's pair of FP32 tensor scales to the FP32 accumulator before the one rounding to BF16, as the
loop's GEMM does.  Outputs equal
the loop's within FP32 accumulation error.  `grouped_reason` names what keeps a layer on the loop (biases,
mean-bias removal, FP32 activations, dims off the alignment).
"""
from __future__ import annotations

import torch

from .autograd import ROLES, tensor_operands
from .grouping import GroupLayout, zero_tail_
from .operands import LinearPlan, Operand, OperandPlan, RowGroups, custom_call, fp8_shift
from .recipe import GEMMS


def grouped_reason(plan: LinearPlan, n: int, k: int, has_bias: bool, dtype: torch.dtype) -> str | None:
    """Why one projection (weights [E, n, k]) cannot take the grouped path, or None."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no _grouped_mm"
    if dtype != torch.bfloat16:
        return f"activations in {dtype} (the grouped GEMMs write BF16)"
    if has_bias:
        return "expert biases"
    if plan.mean_bias or plan.frozen_weight:
        return "mean-bias removal / a frozen packed weight"
    for name in ("x", "w", "dy"):
        for p in getattr(plan, name):
            if p is None or p.form not in ("bf16", "fp8"):
                return f"a {p.form if p else 'missing'} operand ({name}): the grouped path runs BF16 / FP8 operands"
    for g, dim in (("fprop", k), ("dgrad", n)):
        align = max(p.k_align for p in _gemm_plans(plan, g))
        if dim % align:
            return f"{g} contracts over {dim}, not a multiple of {align}"
    return None


def _gemm_plans(plan: LinearPlan, gemm: str):
    """The operand plans of one GEMM (its two operands)."""
    return [getattr(plan, t)[i] for t, roles in ROLES.items() for i, (g, _) in enumerate(roles) if g == gemm]


def segment_align(plan: LinearPlan) -> int:
    """Rows per expert segment: a multiple of the wgrad operands' blocks and Hadamard (blocks along the tokens)."""
    return max(16, *(p.k_align for p in _gemm_plans(plan, "wgrad")))


def _per_group(pair) -> bool:
    """Whether a tensor's operands depend on its group beyond its own blocks (tensor amax, SR, the FP8 form's
    reference exponents along the groups)."""
    return any(p is not None and (p.stat == 2 or p.stochastic or p.form == "fp8") for p in pair)


def _padded(rows: torch.Tensor, p: OperandPlan | None) -> torch.Tensor:
    """OperandPlan.k_padded of each group's row count, int32 (the transposed orientation's SR coordinates)."""
    if p is None:
        return torch.zeros_like(rows, dtype=torch.int32)
    h, block = p.hadamard or 1, p.spec.block[1]
    rows = (rows + h - 1) // h * h
    return ((rows + block - 1) // block * block).to(torch.int32)


def segment_groups(layout: GroupLayout, b_plan: OperandPlan | None) -> RowGroups:
    """The expert segments of a layout's rows as RowGroups (rows past the last segment: zero rows, group 0)."""
    return RowGroups(layout.row_expert, layout.starts, _padded(layout.counts, b_plan))


def weight_groups(e: int, n: int, device, b_plan: OperandPlan | None) -> RowGroups:
    """The experts' n rows each of stacked weights [E * n, K] as RowGroups."""
    ids = torch.arange(e * n, device=device, dtype=torch.int32) // n
    starts = torch.arange(e, device=device, dtype=torch.int32) * n
    return RowGroups(ids, starts, _padded(torch.full((e,), n, device=device), b_plan))


def _scales(op, plan: OperandPlan, e: int) -> torch.Tensor:
    """An operand's FP32 decode scale per expert (two-level: the kernels' per-group scales; else ones)."""
    return op.scale if plan.stat == 2 else torch.ones(e, dtype=torch.float32, device=op.data.device)


# The grouped GEMMs with per-expert scales as custom ops, registered as FP4Linear's are: opaque (the CPU, Triton's
# interpreter), and a triton_op on CUDA that torch.compile traces into; called eagerly, their implementations run
# directly (operands.custom_call).
def _rows_impl(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, n: int, k: int, b_step: int,
               a_scale: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    from ..kernels.grouped_gemm import grouped_rows

    return grouped_rows(a, b, ends, n, k, b_step, a_scale, b_scale)


def _contraction_impl(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, m: int, n: int,
                      a_scale: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    from ..kernels.grouped_gemm import grouped_contraction

    return grouped_contraction(a, b, ends, m, n, a_scale, b_scale)


_rows_op = torch.library.custom_op("hf_fp4::grouped_rows", _rows_impl, mutates_args=())
_rows_cuda_op = torch.library.triton_op("hf_fp4::grouped_rows_cuda", _rows_impl, mutates_args=())
_contraction_op = torch.library.custom_op("hf_fp4::grouped_contraction", _contraction_impl, mutates_args=())
_contraction_cuda_op = torch.library.triton_op("hf_fp4::grouped_contraction_cuda", _contraction_impl,
                                               mutates_args=())


@_rows_op.register_fake
def _(a, b, ends, n, k, b_step, a_scale, b_scale):
    return a.new_empty(a.shape[0], n, dtype=torch.bfloat16)


@_contraction_op.register_fake
def _(a, b, ends, m, n, a_scale, b_scale):
    return a.new_empty(ends.shape[0], m, n, dtype=torch.bfloat16)


def _rows_fp8_impl(a_data: torch.Tensor, a_scale: torch.Tensor, a_side: torch.Tensor, a_eb: torch.Tensor,
                   a_flags: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor, b_side: torch.Tensor,
                   b_eb: torch.Tensor, b_flags: torch.Tensor, ends: torch.Tensor, n: int, k: int, steps: list[int],
                   blocks: list[int]) -> torch.Tensor:
    from ..kernels.grouped_gemm import grouped_rows_fp8

    return grouped_rows_fp8(Operand(a_data, a_scale, a_side, a_eb, a_flags),
                            Operand(b_data, b_scale, b_side, b_eb, b_flags), ends, n, k, tuple(steps), tuple(blocks))


def _contraction_fp8_impl(a_data: torch.Tensor, a_scale: torch.Tensor, a_side: torch.Tensor, a_eb: torch.Tensor,
                          a_flags: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor, b_side: torch.Tensor,
                          b_eb: torch.Tensor, b_flags: torch.Tensor, ends: torch.Tensor, m: int, n: int,
                          steps: list[int], blocks: list[int]) -> torch.Tensor:
    from ..kernels.grouped_gemm import grouped_contraction_fp8

    return grouped_contraction_fp8(Operand(a_data, a_scale, a_side, a_eb, a_flags),
                                   Operand(b_data, b_scale, b_side, b_eb, b_flags), ends, m, n, tuple(steps),
                                   tuple(blocks))


_rows_fp8_op = torch.library.custom_op("hf_fp4::grouped_rows_fp8", _rows_fp8_impl, mutates_args=())
_rows_fp8_cuda_op = torch.library.triton_op("hf_fp4::grouped_rows_fp8_cuda", _rows_fp8_impl, mutates_args=())
_contraction_fp8_op = torch.library.custom_op("hf_fp4::grouped_contraction_fp8", _contraction_fp8_impl,
                                              mutates_args=())
_contraction_fp8_cuda_op = torch.library.triton_op("hf_fp4::grouped_contraction_fp8_cuda", _contraction_fp8_impl,
                                                   mutates_args=())


@_rows_fp8_op.register_fake
def _(a_data, a_scale, a_side, a_eb, a_flags, b_data, b_scale, b_side, b_eb, b_flags, ends, n, k, steps, blocks):
    return a_data.new_empty(a_data.shape[0], n, dtype=torch.bfloat16)


@_contraction_fp8_op.register_fake
def _(a_data, a_scale, a_side, a_eb, a_flags, b_data, b_scale, b_side, b_eb, b_flags, ends, m, n, steps, blocks):
    return a_data.new_empty(ends.shape[0], m, n, dtype=torch.bfloat16)


def _blocks(pa: OperandPlan, pb: OperandPlan) -> list[int]:
    """The FP8 GEMMs' (a's block, a's SHIFT, b's block, b's SHIFT)."""
    return [pa.spec.block[1], fp8_shift(pa.spec.grid), pb.spec.block[1], fp8_shift(pb.spec.grid)]


def _two_level(plan: LinearPlan) -> bool:
    return any(p is not None and p.stat == 2 for p in (*plan.x, *plan.w, *plan.dy))


def _rows_gemm(form: str, a: Operand, b: Operand, pa: OperandPlan, pb: OperandPlan, plan: LinearPlan, ends, e: int,
               rows: int, n: int, k: int, weight_rows: bool, t: torch.Tensor) -> torch.Tensor:
    """[R, n]: segment e of a [R, k] times expert e's B -- the stacked weights' rows e*n.. (weight_rows, fprop) or
    W^T's columns e*k.. (dgrad: B [n, E*k], its contraction k) -- in the GEMM's form; zero past the last segment
    (hf_fp4's grouped kernels write those rows; torch._grouped_mm's are zeroed in place by zero_tail_)."""
    if form == "fp8":
        if weight_rows:
            steps = [n * b.data.stride(0), n, n]
        else:  # W^T: columns e*k.. of data (and its exact copy); row scales [E, rows]; flags per row of W^T
            steps = [k, b.data.shape[0], 0]
        return custom_call(_rows_fp8_impl, _rows_fp8_op, _rows_fp8_cuda_op, t)(*a, *b, ends, n, k, steps,
                                                                               _blocks(pa, pb))
    step = n * b.data.stride(0) if weight_rows else k
    if _two_level(plan):
        return custom_call(_rows_impl, _rows_op, _rows_cuda_op, t)(a.data, b.data, ends, n, k, step,
                                                                    _scales(a, pa, e), _scales(b, pb, e))
    w = (b.data[:e * n, :k].view(e, n, k).transpose(1, 2) if weight_rows
         else b.data[:n, :e * k].view(n, e, k).permute(1, 2, 0))
    return zero_tail_(torch._grouped_mm(a.data[:rows, :k], w, offs=ends), ends)


class GroupedFP4Function(torch.autograd.Function):
    """One projection of every expert on the gathered rows xg [R, K] (segments ending at `ends`, [E] int32):
    weight [E, N, K]; returns [R, N] in BF16, zero on the rows no expert holds.  seeds [E, 6]: each expert's
    (x, W, dy) seed pairs, as the loop gives each expert's FP4LinearFunction; groups: the RowGroups of the
    segments for x and dy, and of W's experts (None where a tensor's operands need none).

    The padding rows inside the segments give zero rows (zero rows of xg times finite weights), and the incoming
    gradient's padding rows must be zero too (the callers' combine and gather make them so): x's and dy's
    per-expert statistics and wgrad blocks then see only the expert's tokens, as in the per-expert loop.  No select
    over [R, N] is made here (one cost ~1-3 ms per projection at 64 experts x 16k tokens, 2026-12-06)."""

    @staticmethod
    def forward(ctx, xg, weight, ends, seeds, signs, groups, plan: LinearPlan, need):
        e, n, k = weight.shape
        rows = xg.shape[0]
        g_x, g_w, g_dy = groups
        x_seeds = seeds[:, 0:2].contiguous() if plan.seeded("x") else torch.zeros_like(seeds[:, 0:2])
        ox, oxt = _pair(xg, plan, "x", x_seeds, signs, need[1], g_x)
        ow, owt = _pair(weight.reshape(e * n, k), plan, "w", seeds[:, 2:4].contiguous(), signs, need[0], g_w)
        # fprop: y = Q(x) Q(W_e)^T per segment    [R,K] @ [K,N] -> [R,N]
        y = _rows_gemm(plan.forms[0], ox, ow, plan.x[0], plan.w[0], plan, ends, e, rows, n, k, True, xg)
        ctx.plan, ctx.shape, ctx.w_dtype = plan, (e, n, k, rows), weight.dtype
        ctx.dy_grouped = g_dy is not None
        none = (None,) * 5
        ctx.save_for_backward(ends, seeds, *signs, *(oxt or none), *(owt or none), *(g_dy or ()))
        return y

    @staticmethod
    def backward(ctx, dy):
        e, n, k, rows = ctx.shape
        plan = ctx.plan
        ends, seeds, *rest = ctx.saved_tensors
        signs, rest = tuple(rest[:len(GEMMS)]), rest[len(GEMMS):]
        oxt, owt = Operand(*rest[:5]), Operand(*rest[5:10])
        g_dy = RowGroups(*rest[10:]) if ctx.dy_grouped else None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ody, odyt = _pair(dy.contiguous(), plan, "dy", seeds[:, 4:6].contiguous(), signs, need_dw, g_dy)
        dx = dw = None
        if need_dx:
            # dgrad: dx = Q(dy) Q(W_e^T)^T per segment    [R,N] @ [N,K] -> [R,K]
            dx = _rows_gemm(plan.forms[1], ody, owt, plan.dy[0], plan.w[1], plan, ends, e, rows, k, n, False, dy)
        if need_dw:
            # wgrad: dW_e = Q(dy_e^T) Q(x_e^T)^T per expert    [N,R_e] @ [R_e,K] -> [N,K]
            pa, pb = plan.dy[1], plan.x[1]
            if plan.forms[2] == "fp8":
                dw = custom_call(_contraction_fp8_impl, _contraction_fp8_op, _contraction_fp8_cuda_op, dy)(
                    *odyt, *oxt, ends, n, k, [odyt.data.shape[0], oxt.data.shape[0]], _blocks(pa, pb))
            elif _two_level(plan):
                dw = custom_call(_contraction_impl, _contraction_op, _contraction_cuda_op, dy)(
                    odyt.data, oxt.data, ends, n, k, _scales(odyt, pa, e), _scales(oxt, pb, e))
            else:
                dw = torch._grouped_mm(odyt.data[:n, :rows], oxt.data[:k, :rows].t(), offs=ends)
            dw = dw.to(ctx.w_dtype)
        return dx, dw, None, None, None, None, None, None


def _pair(t, plan: LinearPlan, tensor: str, seeds, signs, both: bool, groups: RowGroups | None):
    """Both orientations of t (the second when `both`), grouped as the loop's experts are."""
    if groups is None:  # nothing per expert beyond its blocks: one tensor, the seeds never read
        seeds = seeds[0]
    return tensor_operands(t, plan, seeds, signs, None, both, tensor, None, groups)


def grouped_projection(layout: GroupLayout, xg: torch.Tensor, weight: torch.Tensor, seeds: torch.Tensor, signs,
                       plan: LinearPlan, training: bool) -> torch.Tensor:
    """xg [R, K] (the layout's rows) through every expert's weight [E, N, K] -> [R, N] (BF16); seeds [E, 6]."""
    need = (training and xg.requires_grad, training and weight.requires_grad)
    e, n, _ = weight.shape
    groups = (segment_groups(layout, plan.x[1]) if _per_group(plan.x) else None,
              weight_groups(e, n, weight.device, plan.w[1]) if _per_group(plan.w) else None,
              segment_groups(layout, plan.dy[1]) if _per_group(plan.dy) else None)
    return GroupedFP4Function.apply(xg, weight, layout.ends, seeds, signs, groups, plan, need)
