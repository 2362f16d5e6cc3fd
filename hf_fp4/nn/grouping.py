"""The routing layout of grouped expert GEMMs (issue 16): every expert's tokens in one padded row segment.

A MoE layer routes each of T tokens to k experts.  The grouped GEMMs read the T*k (token, slot) pairs sorted
by expert, each expert's pairs padded with zero rows to a multiple of `align` rows:

    rows  [R]   the pair (token * k + slot) a padded row holds, -1 for a padding row
    offsets [E+1]  where each expert's segment starts (multiples of align); offsets[E] = rows in use
    counts [E]  the pairs routed to each expert
    tile_expert [R // align]  the expert whose segment holds each align-row tile, -1 past offsets[E]
    starts, ends [E]  offsets[:-1] and offsets[1:] as int32 (the grouped kernels' segment bounds)
    row_expert [R]  the expert of each row as int32, 0 past offsets[E] (zero rows there)
    pos [T*k]   the row each pair lies in, R for a pair routed nowhere (the inverse of rows)

Tokens are summed over their k slots by reading each token's rows (pos) and reducing over the slots in FP32
(`combine`, and the backward of `gather`), never by a scatter-add: the index_add_ of every pair at once added a
token's slots by atomics in an order that changes run to run on CUDA, so the grouped layer was not
bit-reproducible (exact resume) where the per-expert loop is (one index_add_ per expert, no token twice).

Segments start at multiples of `align`, so an operand's blocks along the rows (the wgrad operands, blocks
along the tokens) never straddle two experts, and a GEMM tile of `align` rows belongs to one expert.

Everything is computed on the device, with no host synchronisation and shapes that depend only on (T, k, E,
align): R is the worst case, T*k + E*(align - 1) rounded up to align -- so the layout works under CUDA graphs and
torch.compile(fullgraph=True).  Expert ids outside [0, E) (expert-parallel sentinels) are routed nowhere, as in
Transformers' experts forwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupLayout:
    rows: torch.Tensor
    offsets: torch.Tensor
    counts: torch.Tensor
    tile_expert: torch.Tensor
    align: int
    top_k: int
    starts: torch.Tensor
    ends: torch.Tensor
    row_expert: torch.Tensor
    pos: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @property
    def tokens(self) -> torch.Tensor:
        """The token each padded row reads (0 for padding rows, whose `valid` is False)."""
        return self.rows.clamp(min=0) // self.top_k

    @property
    def valid(self) -> torch.Tensor:
        return self.rows >= 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [R, H]: each padded row's token, zero rows for the padding.  Its gradient sums each
        token's rows over its slots in FP32 (token_sum), deterministically."""
        return _Gather.apply(x, self)

    def combine(self, y: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """y [R, H] -> [T, H] in FP32: each token's rows weighted by its routing weight (weights [T, k]) and
        summed over the slots in order.  Padding rows are dropped whatever they hold (a bias, or a NaN from a
        non-finite weight): only the pairs' rows are read."""
        if weights.shape != (num_tokens, self.top_k):
            raise ValueError(f"combine: weights must be [{num_tokens}, {self.top_k}], got {tuple(weights.shape)}")
        return _Combine.apply(y, weights, self)

    def token_sum(self, y: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H] in FP32: sum over each token's slots s of weights[t, s] * y[row of (t, s)] (weights None: 1),
        reduced over the slots in order in FP32; a slot routed nowhere adds 0.  Not differentiable (combine and
        gather's backward are)."""
        w = None if weights is None else weights.reshape(-1)
        return _routing_call("token_sum", y.contiguous(), self.pos, self.top_k, w)


# ---------------------------------------------------------------------------------------------------------------
# The routing passes (and zero_tail_): the torch forms below are the spec (and the CPU path); on CUDA the Triton
# kernels of hf_fp4.kernels.routing compute the same (bit for bit; pair_dot within FP32 accumulation error), as
# custom ops registered as the operand kernels are (operands.custom_call): a triton_op that torch.compile traces
# into, an opaque op otherwise.

#: run the Triton kernels on the CPU too (Triton's interpreter): the tests' switch; on CUDA they always run
KERNELS_ON_CPU = False


def gather_rows_reference(x: torch.Tensor, rows: torch.Tensor, k: int, w: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[R, H]: x[rows[r] // k] (times w[rows[r]] in FP32 when given, rounded once to out_dtype), 0 where
    rows[r] < 0."""
    valid = (rows >= 0)[:, None]
    picked = x[rows.clamp(min=0) // k]
    if w is None:
        return torch.where(valid, picked, picked.new_zeros(())).to(out_dtype or x.dtype)
    picked = picked.float() * w[rows.clamp(min=0)].float()[:, None]
    return torch.where(valid, picked, 0.0).to(out_dtype or x.dtype)


def token_sum_reference(y: torch.Tensor, pos: torch.Tensor, k: int, w: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] FP32: for each token, acc = 0, then acc += FP32(y[pos[t*k+s]]) * w[t*k+s] for s = 0..k-1 in order
    (each product and sum rounded), a slot with pos >= R adding 0."""
    rows, tokens = y.shape[0], pos.shape[0] // k
    routed = (pos < rows).view(tokens, k)
    picked = y[pos.clamp(max=rows - 1)].view(tokens, k, y.shape[1])
    wk = None if w is None else w.float().view(tokens, k)
    acc = torch.zeros(tokens, y.shape[1], dtype=torch.float32, device=y.device)
    for s in range(k):
        v = picked[:, s].float()
        if wk is not None:
            v = v * wk[:, s, None]
        acc = acc + torch.where(routed[:, s, None], v, 0.0)
    return acc


def pair_dot_reference(g: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """[T*k] FP32: g[t] . y[pos[t*k+s]] (FP32), 0 for a pair routed nowhere."""
    rows = y.shape[0]
    picked = y[pos.clamp(max=rows - 1)].float()
    dots = (g.float().repeat_interleave(k, 0) * picked).sum(-1)
    return torch.where(pos < rows, dots, 0.0)


def _gather_rows_impl(x: torch.Tensor, rows: torch.Tensor, k: int, w: torch.Tensor | None,
                      out_dtype: torch.dtype) -> torch.Tensor:
    from ..kernels.routing import gather_rows

    return gather_rows(x, rows, k, w, out_dtype)


def _token_sum_impl(y: torch.Tensor, pos: torch.Tensor, k: int, w: torch.Tensor | None) -> torch.Tensor:
    from ..kernels.routing import token_sum

    return token_sum(y, pos, k, w)


def _pair_dot_impl(g: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    from ..kernels.routing import pair_dot

    return pair_dot(g, y, pos, k)


def _zero_tail_impl(out: torch.Tensor, ends: torch.Tensor) -> None:
    from ..kernels.routing import zero_tail_

    zero_tail_(out, ends)


def _register(name: str, impl, fake, mutates=()):
    opaque = torch.library.custom_op(f"hf_fp4::{name}", impl, mutates_args=mutates)
    opaque.register_fake(fake)
    return impl, opaque, torch.library.triton_op(f"hf_fp4::{name}_cuda", impl, mutates_args=mutates)


_ROUTING_OPS = {
    "gather_rows": _register("gather_rows", _gather_rows_impl,
                             lambda x, rows, k, w, out_dtype: x.new_empty(rows.shape[0], x.shape[1], dtype=out_dtype)),
    "token_sum": _register("token_sum", _token_sum_impl,
                           lambda y, pos, k, w: y.new_empty(pos.shape[0] // k, y.shape[1], dtype=torch.float32)),
    "pair_dot": _register("pair_dot", _pair_dot_impl,
                          lambda g, y, pos, k: y.new_empty(pos.shape[0], dtype=torch.float32)),
    "zero_tail_": _register("zero_tail_", _zero_tail_impl, lambda out, ends: None, mutates=("out",)),
}


def zero_tail_reference_(out: torch.Tensor, ends: torch.Tensor) -> None:
    """out[ends[-1]:] = 0 in place, on the device (no host read)."""
    past = torch.arange(out.shape[0], device=out.device) >= ends[-1]
    out.masked_fill_(past[:, None], 0)


_REFERENCES = {"gather_rows": gather_rows_reference, "token_sum": token_sum_reference,
               "pair_dot": pair_dot_reference, "zero_tail_": zero_tail_reference_}


def zero_tail_(out: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """out [R, N] with its rows past the last segment (ends [E], int32) set to zero in place: what
    torch._grouped_mm leaves unwritten, without a select over all of out.  Returns out."""
    _routing_call("zero_tail_", out, ends)
    return out


def _routing_call(name: str, *args):
    """One routing pass on its first argument's device: the kernels on CUDA (or on the CPU when KERNELS_ON_CPU),
    else the torch reference."""
    t = args[0]
    if not (t.is_cuda or KERNELS_ON_CPU):
        return _REFERENCES[name](*args)
    from .operands import custom_call

    return custom_call(*_ROUTING_OPS[name], t)(*args)


class _Gather(torch.autograd.Function):
    """GroupLayout.gather with a deterministic backward (token_sum of the rows' gradients, in x's dtype)."""

    @staticmethod
    def forward(ctx, x, layout):
        ctx.layout = layout
        x = x.contiguous()
        return _routing_call("gather_rows", x, layout.rows, layout.top_k, None, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ctx.layout.token_sum(grad).to(grad.dtype), None


class _Combine(torch.autograd.Function):
    """GroupLayout.combine: out [T, H] FP32 = token_sum of y's rows weighted by the routing weights.  Backward:
    y's row of pair (t, s) gets w[t, s] * dOut[t] (FP32, rounded once to y's dtype; padding rows 0), w[t, s] gets
    dOut[t] . y[row of (t, s)] -- gathers and per-pair dots, no scatter."""

    @staticmethod
    def forward(ctx, y, weights, layout):
        ctx.layout = layout
        ctx.save_for_backward(y, weights)
        return layout.token_sum(y, weights)

    @staticmethod
    def backward(ctx, grad):
        y, weights = ctx.saved_tensors
        layout, k = ctx.layout, ctx.layout.top_k
        grad = grad.float().contiguous()
        dy = dw = None
        if ctx.needs_input_grad[0]:
            dy = _routing_call("gather_rows", grad, layout.rows, k, weights.reshape(-1), y.dtype)
        if ctx.needs_input_grad[1]:
            y = y.contiguous()
            dw = _routing_call("pair_dot", grad, y, layout.pos, k).view_as(weights).to(weights.dtype)
        return dy, dw, None


def padded_rows(num_pairs: int, num_experts: int, align: int) -> int:
    """Rows of the layout: the worst case of sum_e round_up(count_e, align) over all routings."""
    return -(-(num_pairs + num_experts * (align - 1)) // align) * align


def group_layout(top_k_index: torch.Tensor, num_experts: int, align: int) -> GroupLayout:
    """The layout of a routing top_k_index [T, k] (int) over num_experts experts, segments aligned to `align`."""
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be [tokens, k], got shape {tuple(top_k_index.shape)}")
    if align < 1 or num_experts < 1:
        raise ValueError(f"group_layout needs align >= 1 and num_experts >= 1, got {align}, {num_experts}")
    dev, k = top_k_index.device, top_k_index.shape[1]
    flat = top_k_index.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # the unrouted last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + align - 1) // align * align
    zero = counts.new_zeros(1)
    offsets = torch.cat([zero, padded.cumsum(0)])
    starts = torch.cat([zero, counts.cumsum(0)])  # where each expert's pairs start in `order`
    sorted_key = key[order]
    e = sorted_key.clamp(max=num_experts - 1)
    j = torch.arange(flat.numel(), device=dev)
    n_rows = padded_rows(flat.numel(), num_experts, align)
    # unrouted pairs go to a scratch row past the end, cut off below
    dest = torch.where(sorted_key < num_experts, offsets[e] + j - starts[e], n_rows)
    rows = torch.full((n_rows + 1,), -1, dtype=torch.long, device=dev).scatter_(0, dest, order)[:n_rows]
    tile_start = torch.arange(0, n_rows, align, device=dev)
    # the experts whose segments end at or before each tile's start (searchsorted(offsets[1:], ., right=True)) by a
    # comparison and a sum: inductor's CUDA lowering of that searchsorted ignored the slice's storage offset and
    # searched offsets itself, giving tiles the next expert (pytorch/pytorch#182343, torch 2.11 on the GPU machine;
    # session 25: the diverged compiled NVFP4 / UFP4 MoE runs, each tile quantized with another expert's tensor scale)
    tile_expert = (offsets[None, 1:] <= tile_start[:, None]).sum(1)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1)
    bounds = offsets.to(torch.int32)
    row_expert = tile_expert.clamp(min=0).to(torch.int32).repeat_interleave(align)
    pos = torch.empty_like(dest).scatter_(0, order, dest)  # pair -> row (n_rows: routed nowhere)
    return GroupLayout(rows, offsets, counts, tile_expert, align, k, bounds[:-1], bounds[1:], row_expert, pos)
