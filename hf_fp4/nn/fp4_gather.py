"""FP4 weight all-gather under FSDP2: each rank quantizes its shard of W, FSDP2 all-gathers the packed codes
and block scales, and the layer builds its weight operands from them -- bit for bit the operands of the
gathered high-precision weight, in a quarter of the bytes (issue 17).

FSDP2 shards a weight [N, K] along its rows (N).  A weight operand's blocks never cross a shard when:

* fprop's operand W (blocks along K, and a Hadamard along K) is row-local for 1 x B blocks; B x B tiles need
  the shard's rows to be a multiple of B;
* dgrad's operand W^T (blocks along N, a Hadamard along N) is local when the shard's rows are a multiple of
  the block and of the Hadamard size;
* the two-level formats' (NVFP4, UFP4) tensor scale comes from the tensor amax: one all-reduce (MAX) of
  the shards' amaxes, before quantizing.

Square 2D weight tiles with no Hadamard (nvfp4, tib, fullstack) make both operands from one quantization: one
payload, ~0.5 bytes per weight against 2 for BF16.  1D weights (mxfp4, mxfp4_dh, ufp4) send both orientations
(~1.06-1.13 bytes).  A weight is gathered as FP4 when its recipe rounds its operands to nearest with fixed (or
no) Hadamard signs, quantizes fprop's and dgrad's weight operands with 1-byte block scales, has no mean-bias
term (its rank-one fprop term needs W itself) and shards evenly; `enable_fp4_all_gather` says why for the
others, which FSDP2 gathers in their own dtype as before.

The master weight becomes an `FP4MasterWeight` (a tensor subclass that is its high-precision tensor for every
op: the optimizer, checkpoints and state dicts see plain values) before `fully_shard`; FSDP2 calls its
`fsdp_pre_all_gather` / `fsdp_post_all_gather` hooks, and the gathered parameter is a `GatheredFP4Weight`:
shape and dtype of W, its payload the gathered codes and scales, whose only consumer is FP4LinearFunction.
Eager mode (torch.compile of a layer whose weight is a GatheredFP4Weight is not supported).
"""
from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..numerics.formats import ELEMENT_BITS
from ..numerics.hadamard import apply_hadamard
from ..numerics.operand_plan import Operand
from ..numerics.qtensor import QuantizedTensor, pack_codes, unpack_codes
from ..numerics.quantize import quantize, tensor_amax
from ..numerics.scales import ScaleRule
from ..numerics.spec import QuantSpec, Rounding
from .recipe import HadamardKind, LinearRecipe

aten = torch.ops.aten


@dataclass(frozen=True)
class Orientation:
    """One weight operand the payload carries: its spec and Hadamard (size, GEMM whose signs it takes);
    transposed: W^T's (dgrad), sent in W's row layout so that FSDP2's concatenation along rows gathers it."""

    spec: QuantSpec
    hadamard: int
    gemm: str
    transposed: bool

    @property
    def row_align(self) -> int:
        """The shard rows this operand needs for its blocks (and rotation) to stay inside a shard."""
        if self.transposed:
            return max(self.spec.block[1], self.hadamard, 2)  # 2: two codes per byte along N
        return self.spec.block[0]


@dataclass(frozen=True)
class WeightGather:
    """What a layer's weight sends through the all-gather: its orientations (one when a square 2D tile serves
    both GEMMs), and whether dgrad's operand is the transpose of fprop's."""

    orientations: tuple[Orientation, ...]
    shared_2d: bool

    def row_align(self) -> int:
        return max(o.row_align for o in self.orientations)


def weight_gather(recipe: LinearRecipe, frozen: bool = False) -> "WeightGather | str":
    """The WeightGather of a recipe's weight, or why it must be gathered in high precision."""
    if frozen:
        return "a frozen (packed) weight"
    if recipe.activation_scheme != "plain":
        return f"activation_scheme={recipe.activation_scheme} (inference)"
    if recipe.mean_bias_removal:
        return "mean-bias removal adds mu W^T in high precision (needs W itself)"
    out = []
    for gemm_name in ("fprop", "dgrad"):
        g = recipe.gemm(gemm_name)
        spec = g.rhs
        if spec is None:
            return f"{gemm_name} does not quantize the weight (it needs W itself)"
        if spec.rounding is not Rounding.NEAREST:
            return f"{gemm_name}'s weight rounds stochastically (per-step noise)"
        if spec.scale is ScaleRule.FP32:
            return f"{gemm_name}'s weight has FP32 block scales"
        if g.hadamard.enabled and g.hadamard.kind is HadamardKind.RANDOM_PER_STEP:
            return f"{gemm_name}'s Hadamard signs change every step"
        out.append(Orientation(spec, g.hadamard.size if g.hadamard.enabled else 0, gemm_name,
                               transposed=gemm_name == "dgrad"))
    fprop, dgrad = out
    shared = (fprop.spec == dgrad.spec and fprop.spec.block[0] == fprop.spec.block[1] > 1
              and not fprop.hadamard and not dgrad.hadamard)
    return WeightGather((fprop,) if shared else (fprop, dgrad), shared)


def regather(old: WeightGather, recipe: LinearRecipe, name: str) -> WeightGather:
    """The WeightGather of a layer whose recipe changes while its weight is FP4-gathered (a precision schedule):
    the new one, which must fit the shards the old one was checked against."""
    new = weight_gather(recipe)
    if isinstance(new, str):
        raise ValueError(f"{name}: its weight is all-gathered as FP4 (enable_fp4_all_gather), which the new recipe "
                         f"cannot use: {new}")
    if new.row_align() > old.row_align():
        raise ValueError(f"{name}: the new recipe's weight operands need shard rows in multiples of "
                         f"{new.row_align()}, the FP4 all-gather was set up for {old.row_align()}")
    return new


# ----------------------------------------------------------------------------------------------
# The payload: quantize a shard, and rebuild the gathered tensor's QuantizedTensors.
def _rotated(t: torch.Tensor, o: Orientation, signs) -> torch.Tensor:
    x = t.float()
    return apply_hadamard(x, o.hadamard, signs) if o.hadamard else x


def _as_rows_of_w(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W^T's codes and scales laid out along W's rows (the all-gather concatenates rows)."""
    codes = pack_codes(unpack_codes(q.codes, q.spec.grid).t().contiguous(), q.spec.grid)
    return codes, q.scales.view(torch.uint8).t().contiguous()


def _transpose(q: QuantizedTensor, codes_w: torch.Tensor, scales_w: torch.Tensor, shape) -> QuantizedTensor:
    """The QuantizedTensor of W^T from its codes and scales along W's rows."""
    codes = pack_codes(unpack_codes(codes_w, q.spec.grid).t().contiguous(), q.spec.grid)
    return QuantizedTensor(codes, scales_w.t().contiguous().view(q.scales.dtype), q.tensor_scale, torch.Size(shape),
                           q.spec)


def shard_payload(shard: torch.Tensor, gather: WeightGather, signs: dict, amax_fn=None):
    """(the all-gather inputs, metadata) of one shard [n, K] of W: per orientation its codes [n, .] and block
    scales [n / br, .] as bytes; metadata: per orientation the tensor scale (None for E8M0) and the QuantizedTensor
    fields the gathered side needs.  amax_fn(local amax) -> the tensor's amax (the all-reduce; identity on one
    process)."""
    inputs, meta = [], []
    for o in gather.orientations:
        t = _rotated(shard.t() if o.transposed else shard, o, signs.get(o.gemm))
        amax = None
        if o.spec.scale is ScaleRule.UE4M3_FP32:
            amax = tensor_amax(t)
            amax = amax_fn(amax) if amax_fn is not None else amax
        q = quantize(t, o.spec, tensor_amax=amax)
        if o.transposed:
            codes, scales = _as_rows_of_w(q)
        else:
            codes, scales = q.codes, q.scales.view(torch.uint8)
        inputs += [codes, scales]
        meta.append((q.tensor_scale, q.scales.dtype, tuple(q.shape)))
    return tuple(inputs), tuple(meta)


def gathered_operands(payload, meta, gather: WeightGather, n_rows: int) -> list[QuantizedTensor]:
    """The QuantizedTensors of W's weight operands (fprop's, dgrad's) from the gathered payload (each input's
    shards concatenated along rows; n_rows = W's rows)."""
    out = []
    for i, (o, (t_scale, s_dtype, shard_shape)) in enumerate(zip(gather.orientations, meta)):
        codes, scales = payload[2 * i], payload[2 * i + 1]
        if o.transposed:
            shape = (shard_shape[0], n_rows)
            q = QuantizedTensor(codes, scales.view(s_dtype), t_scale, torch.Size(shape), o.spec)
            out.append(_transpose(q, codes, scales, shape))
        else:
            out.append(QuantizedTensor(codes, scales.view(s_dtype), t_scale, torch.Size((n_rows, shard_shape[1])),
                                       o.spec))
    if gather.shared_2d:  # dgrad's operand: the same tiles, transposed
        q = out[0]
        out.append(_transpose(q, q.codes, q.scales.view(torch.uint8), (q.shape[1], q.shape[0])))
    return out


def payload_bytes(gather: WeightGather, rows: int, cols: int) -> int:
    """Bytes one rank sends for a [rows, cols] shard (the all-gather input; its output is world x that)."""
    total = 0
    for o in gather.orientations:
        r, c = (cols, rows) if o.transposed else (rows, cols)
        if o.hadamard:
            c += -c % o.hadamard
        br, bc = o.spec.block
        rp, cp = r + -r % br, c + -c % bc
        total += rp * cp * ELEMENT_BITS[o.spec.grid] // 8 + (rp // br) * (cp // bc)
    return total


# ----------------------------------------------------------------------------------------------
# The tensor subclasses FSDP2 sees.
_PRESERVE = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default,
             aten.view.default, aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default,
             aten.split.Tensor, aten.clone.default, aten.chunk.default, aten.alias.default}


class FP4MasterWeight(torch.Tensor):
    """A layer's high-precision master weight (or a shard of it): every op sees its tensor; FSDP2 all-gathers it
    as FP4 payload (fsdp_pre_all_gather / fsdp_post_all_gather)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, owner):
        return torch.Tensor._make_wrapper_subclass(cls, tensor.size(), strides=tensor.stride(),
                                                   storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
                                                   layout=tensor.layout, device=tensor.device,
                                                   requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, owner):
        self._tensor = tensor
        self._owner = owner  # weakref.ref to the FP4Linear

    def __repr__(self):
        return f"FP4MasterWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        owner = next(a._owner for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, FP4MasterWeight))
        if func is aten.detach.default:
            return FP4MasterWeight(args[0]._tensor.detach(), owner)
        args, kwargs = pytree.tree_map_only(FP4MasterWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: FP4MasterWeight(t, owner), out)

    def __reduce_ex__(self, protocol):
        """Saved (torch.save, torch.distributed.checkpoint) as its plain tensor: checkpoints hold values only."""
        return self._tensor.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["_tensor"], self._owner

    @staticmethod
    def __tensor_unflatten__(inner, owner, outer_size, outer_stride):
        return FP4MasterWeight(inner["_tensor"], owner)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        layer = self._owner()
        gather = layer.fp4_gather
        dtype = mp_policy.param_dtype or self.dtype
        group = mesh.get_group()

        def all_reduce_max(a):
            a = a.clone()
            torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX, group=group)
            return a

        signs = {o.gemm: layer.hadamard_signs(o.gemm) for o in gather.orientations}
        signs = {g: s.to(self.device) if s is not None else None for g, s in signs.items()}
        inputs, meta = shard_payload(self._tensor.to(dtype), gather, signs, all_reduce_max)
        return inputs, (meta, tuple(outer_size))

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        meta, size = metadata
        if out is not None:
            out._payload, out._meta = tuple(outputs), meta
            return
        gather = self._owner().fp4_gather
        return GatheredFP4Weight(size, param_dtype, self.device, tuple(outputs), meta, gather), tuple(outputs)


class GatheredFP4Weight(torch.Tensor):
    """The unsharded weight under FP4 all-gather: shape and dtype of W, holding the gathered FP4 payload.  Its
    consumer is FP4LinearFunction (`operands`); any other op on it raises (it has no high-precision values)."""

    @staticmethod
    def __new__(cls, size, dtype, device, payload, meta, gather, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype, device=device, requires_grad=requires_grad)

    def __init__(self, size, dtype, device, payload, meta, gather: WeightGather, requires_grad=False):
        self._payload, self._meta, self._gather = payload, meta, gather

    def __repr__(self):
        return f"GatheredFP4Weight(shape={tuple(self.shape)}, dtype={self.dtype}, payload={len(self._payload)} tensors)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        w = args[0]
        if func in (aten.detach.default, aten.alias.default) or (
                func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) == tuple(w.shape)):
            return GatheredFP4Weight(w.shape, w.dtype, w.device, w._payload, w._meta, w._gather)
        raise RuntimeError(f"{func}: this weight was all-gathered as FP4 codes and scales (hf_fp4 FP4 all-gather) "
                           "and has no high-precision values; only FP4Linear's GEMMs read it.  Gather it in high "
                           "precision instead (enable_fp4_all_gather(..., skip=...))")

    def quantized(self) -> list[QuantizedTensor]:
        """The QuantizedTensors of fprop's and dgrad's weight operands."""
        return gathered_operands(self._payload, self._meta, self._gather, self.shape[0])

    def operands(self, plans, need_dgrad: bool) -> tuple[Operand, Operand | None]:
        """The weight operands (fprop's; dgrad's when need_dgrad) in the forms of `plans` (LinearPlan.w)."""
        from .operands import stored_operand

        q_fprop, q_dgrad = self.quantized()
        return stored_operand(q_fprop, plans[0]), stored_operand(q_dgrad, plans[1]) if need_dgrad else None


# ----------------------------------------------------------------------------------------------
def enable_fp4_all_gather(model: nn.Module, world_size: int | None = None, skip=()) -> dict[str, str]:
    """Make every eligible FP4Linear's weight an FP4MasterWeight, before FSDP2's `fully_shard` (accelerate's
    prepare): FSDP2 then all-gathers it as FP4 codes and scales.  world_size: the FSDP shard count (default: the
    process group's).  skip: names of layers to leave alone.  Returns {layer name: why it stays in high
    precision} for the FP4 layers that were not converted (uneven shards, recipes that need W itself)."""
    from .linear import FP4Linear

    if world_size is None:
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
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
        m.fp4_gather = reason
        w = m.weight
        m.weight = nn.Parameter(FP4MasterWeight(w.data, weakref.ref(m)), requires_grad=w.requires_grad)
    return left
