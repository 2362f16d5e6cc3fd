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
payload, ~0.5 bytes per weight against 2 for BF16.  1D weights (mxfp4, mxfp4_dh, ufp4) send fprop's operand in
the forward's all-gather and dgrad's in the backward's (FSDP2 gathers again after resharding; ~0.53-0.56 bytes
each), or both each time (~1.06-1.13 bytes) where the layer's group keeps its weights after forward or checkpoints
activations (the recomputed forward runs after the backward's gather).  A weight is gathered as FP4 when its recipe rounds its operands to nearest with fixed (or
no) Hadamard signs, quantizes fprop's and dgrad's weight operands with 1-byte block scales, has no mean-bias
term (its rank-one fprop term needs W itself) and shards evenly; `hf_fp4.enable_fp4_all_gather` (nn/swap.py)
says why for the others, which FSDP2 gathers in their own dtype as before.

The master weight becomes an `FP4MasterWeight` (a tensor subclass that is its high-precision tensor for every
op: the optimizer, checkpoints and state dicts see plain values) before `fully_shard`; FSDP2 calls its
`fsdp_pre_all_gather` / `fsdp_post_all_gather` hooks, and the gathered parameter is a `GatheredFP4Weight`:
shape and dtype of W, its payload the gathered codes and scales, whose only consumer is FP4LinearFunction.
Under torch.compile a layer on a GatheredFP4Weight runs outside the compiled graph (FP4Linear._gathered_product:
traced, the tensor subclass lost its gradient); the rest of a compiled block stays compiled.
"""
from __future__ import annotations

import collections
import dataclasses
import math
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
from .operands import stored_operand
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
    # Each pass gathers only its own operand -- the forward fprop's, the backward (FSDP2 gathers again after
    # resharding) dgrad's: set by enable_fp4_all_gather when both payloads have the same size (FSDP2 sizes its
    # all-gather buffers once) and there is no square tile to share.
    split: bool = False

    def row_align(self) -> int:
        return max(o.row_align for o in self.orientations)

    def orientation(self, gemm: str) -> Orientation:
        return next(o for o in self.orientations if o.gemm == gemm)


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
    """The WeightGather of a layer whose recipe changes while its weight is FP4-gathered (a precision schedule): the
    old one, which the new recipe must keep -- the same weight operands (FSDP2 sized its all-gather buffers for
    them); a schedule may switch wgrad only."""
    new = weight_gather(recipe)
    if isinstance(new, str):
        raise ValueError(f"{name}: its weight is all-gathered as FP4 (enable_fp4_all_gather), which the new recipe "
                         f"cannot use: {new}")
    if (new.orientations, new.shared_2d) != (old.orientations, old.shared_2d):
        raise ValueError(f"{name}: the new recipe quantizes the weight's fprop / dgrad operands differently from the "
                         "one its FP4 all-gather was set up for (FSDP2 sized its buffers for those)")
    return old


# ----------------------------------------------------------------------------------------------
# The payload: quantize a shard, and rebuild the gathered tensor's QuantizedTensors.
def _rotated(t: torch.Tensor, o: Orientation, signs) -> torch.Tensor:
    x = t.float()
    return apply_hadamard(x, o.hadamard, signs) if o.hadamard else x


def _as_rows_of_w(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W^T's codes and scales (bytes) laid out along W's rows (the all-gather concatenates rows)."""
    codes = pack_codes(unpack_codes(q.codes, q.spec.grid).t().contiguous(), q.spec.grid)
    return codes, q.scales.view(torch.uint8).t().contiguous()


def _transposed(spec: QuantSpec, codes_w, scales_w, scale_dtype, tensor_scale, shape) -> QuantizedTensor:
    """The QuantizedTensor of W^T (shape) from its codes and scale bytes along W's rows."""
    codes = pack_codes(unpack_codes(codes_w, spec.grid).t().contiguous(), spec.grid)
    return QuantizedTensor(codes, scales_w.t().contiguous().view(scale_dtype), tensor_scale, torch.Size(shape), spec)


def _quantized(shard: torch.Tensor, o: Orientation, signs, amax_fn, backend: str) -> QuantizedTensor:
    """One orientation of a shard quantized (rotated first), two-level scales from amax_fn(the shard's amax):
    the reference quantizer, or the fused Triton kernel (bit-exact with it; the shard read once more for the
    statistics, no rotated copy).  The kernel lets a NaN / Inf make its block NaN, as the operand kernels of the
    fast path do (no host synchronisation inside FSDP2's all-gather; the trainer stops on the non-finite loss)."""
    if backend == "triton":
        from ..kernels.quant import triton_quantize

        return triton_quantize(shard, dataclasses.replace(o.spec, nonfinite="propagate"), hadamard=o.hadamard,
                               signs=signs, transpose=o.transposed, amax_hook=amax_fn)
    t = _rotated(shard.t() if o.transposed else shard, o, signs)
    amax = None
    if o.spec.scale is ScaleRule.UE4M3_FP32:
        amax = tensor_amax(t)
        amax = amax_fn(amax) if amax_fn is not None else amax
    return quantize(t, o.spec, tensor_amax=amax)


def shard_payload(shard: torch.Tensor, gather: WeightGather, signs: dict, amax_fn=None, gemms=None,
                  backend: str = "reference"):
    """(all-gather inputs, metadata) of one shard [n, K] of W: per orientation sent (`gemms`, default all) its codes
    and block-scale bytes, flat (W's rows first: the all-gather concatenates the shards); metadata: per orientation
    its GEMM, tensor scale (None for E8M0), scale dtype and the shard's shapes.  amax_fn(local amax) -> the
    tensor's amax (the all-reduce).  backend: "reference" or "triton" (the fused quantizer; CUDA, or Triton's
    interpreter)."""
    inputs, meta = [], []
    for o in gather.orientations:
        if gemms is not None and o.gemm not in gemms:
            continue
        q = _quantized(shard, o, signs.get(o.gemm), amax_fn, backend)
        codes, scales = _as_rows_of_w(q) if o.transposed else (q.codes, q.scales.view(torch.uint8))
        inputs += [codes.reshape(-1), scales.reshape(-1)]
        meta.append((o.gemm, q.tensor_scale, q.scales.dtype, tuple(q.shape), tuple(codes.shape), tuple(scales.shape)))
    return tuple(inputs), tuple(meta)


def gathered_operands(payload, meta, gather: WeightGather, gemms=("fprop", "dgrad")) -> dict[str, QuantizedTensor]:
    """{GEMM: the QuantizedTensor of its weight operand} from the gathered payload (the shards' flat inputs
    concatenated): fprop's (W, blocks along K) and dgrad's (W^T, blocks along N), those of `gemms` that were sent
    (or, 2D tiles, derive from what was)."""
    out = {}
    for i, (gemm, t_scale, s_dtype, q_shape, c_shape, s_shape) in enumerate(meta):
        if gemm not in gemms and not (gather.shared_2d and "dgrad" in gemms):
            continue
        o = gather.orientation(gemm)
        world = payload[2 * i].numel() // math.prod(c_shape)
        codes = payload[2 * i].view(world * c_shape[0], c_shape[1])
        scales = payload[2 * i + 1].view(world * s_shape[0], s_shape[1])
        if o.transposed:  # the shard's W^T [K, n] -> [K, world n]
            out[gemm] = _transposed(o.spec, codes, scales, s_dtype, t_scale, (q_shape[0], world * q_shape[1]))
        else:
            out[gemm] = QuantizedTensor(codes, scales.view(s_dtype), t_scale, torch.Size((world * q_shape[0],
                                                                                          q_shape[1])), o.spec)
    if gather.shared_2d and "fprop" in out and "dgrad" in gemms:  # dgrad's operand: the same tiles, transposed
        q = out["fprop"]
        out["dgrad"] = _transposed(q.spec, q.codes, q.scales.view(torch.uint8), q.scales.dtype, q.tensor_scale,
                                   (q.shape[1], q.shape[0]))
    return {g: out[g] for g in gemms if g in out}


def orientation_bytes(o: Orientation, rows: int, cols: int) -> tuple[int, int]:
    """(code bytes, scale bytes) one orientation sends for a [rows, cols] shard of W."""
    r, c = (cols, rows) if o.transposed else (rows, cols)
    if o.hadamard:
        c += -c % o.hadamard
    br, bc = o.spec.block
    rp, cp = r + -r % br, c + -c % bc
    return rp * cp * ELEMENT_BITS[o.spec.grid] // 8, (rp // br) * (cp // bc)


def payload_bytes(gather: WeightGather, rows: int, cols: int) -> int:
    """Bytes one rank sends per all-gather for a [rows, cols] shard (its output is world x that): one orientation
    when the passes gather their own (split), else all."""
    sizes = [sum(orientation_bytes(o, rows, cols)) for o in gather.orientations]
    return max(sizes) if gather.split else sum(sizes)


def _fsdp_group(root: nn.Module, tensor):
    """FSDP2's parameter group that all-gathers `tensor` (a sharded local weight), found from the model's root, or
    None where FSDP2's internals are not as expected (then both orientations are sent)."""
    try:
        for m in root.modules():
            if hasattr(m, "_get_fsdp_state"):
                state = m._get_fsdp_state()
                groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
                for g in groups:
                    if g is not None and any(p._sharded_local_tensor is tensor for p in g.fsdp_params):
                        return g, m
    except (AttributeError, RuntimeError):
        pass
    return None


def _checkpointed(module) -> bool:
    """Activation checkpointing inside `module`: its forward runs again in the backward (HF's
    gradient_checkpointing, torch's checkpoint_wrapper)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(getattr(m, "gradient_checkpointing", False) is True or isinstance(m, CheckpointWrapper)
               for m in module.modules())


# ----------------------------------------------------------------------------------------------
# The tensor subclasses FSDP2 sees.
_PRESERVE = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default,
             aten.view.default, aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default,
             aten.split.Tensor, aten.clone.default, aten.alias.default}


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

    def data_ptr(self) -> int:
        """Its tensor's (a wrapper's own is 0: accelerate's FSDP2 prepare matches optimizer parameters by it)."""
        return self._tensor.data_ptr()

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
        group = mesh.get_group()
        layer.fp4_param_dtype = mp_policy.param_dtype or self.dtype  # (precompute_fp4_amax quantizes the same)
        gemms = self._gemms(layer, module)
        cached = iter(self.cached_amax(layer, gemms))

        def all_reduce_max(a):
            amax = next(cached, None)
            if amax is not None:  # precompute_fp4_amax's, for these very values
                return amax
            a = a.clone()
            torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX, group=group)
            return a

        inputs, meta = shard_payload(self._tensor.to(layer.fp4_param_dtype), gather, self.signs(layer), all_reduce_max,
                                     gemms, "triton" if self.device.type == "cuda" else "reference")
        return inputs, (meta, tuple(outer_size))

    def signs(self, layer) -> dict:
        """The sign vectors of the layer's weight orientations' Hadamards, on the shard's device."""
        signs = {o.gemm: layer.hadamard_signs(o.gemm) for o in layer.fp4_gather.orientations}
        return {g: s.to(self.device) if s is not None else None for g, s in signs.items()}

    def cached_amax(self, layer, gemms) -> list:
        """precompute_fp4_amax's tensor amaxes of the two-level orientations sent (in order), or Nones: valid while
        the sharded parameter holds the values they were taken from (its version counter, which every in-place
        update -- the optimizer's -- moves; the wrapper's inner tensor's does not move: updates reach it below
        autograd)."""
        two_level = [o.gemm for o in layer.fp4_gather.orientations
                     if o.spec.scale is ScaleRule.UE4M3_FP32 and (gemms is None or o.gemm in gemms)]
        cache = getattr(layer, "fp4_amax", None)
        if cache is None or _version(layer.weight, self) != cache[0]:
            return [None] * len(two_level)
        return [cache[1].get(g) for g in two_level]

    def _gemms(self, layer, module) -> tuple[str, ...] | None:
        """The weight operands this all-gather sends: the pass's own where the layer splits them (decided at its first
        gather: FSDP2 reshards it after forward, so the backward gathers again, and no activation checkpointing
        runs its forward inside the backward), else all (None)."""
        if not layer.fp4_gather.split:
            return None
        if layer.fp4_split is None:
            found = _fsdp_group(layer.fp4_root(), self)
            split = found is not None and found[0].post_forward_mesh_info is not None and not _checkpointed(found[1])
            layer.fp4_split = weakref.ref(found[0]) if split else False
        if layer.fp4_split is False:
            return None
        state = getattr(layer.fp4_split(), "_training_state", None)
        return ("dgrad",) if state is not None and state.name == "PRE_BACKWARD" else ("fprop",)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        meta, size = metadata
        if out is not None:  # FSDP2's later gathers: the same parameter object, this gather's payload
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

    def quantized(self, gemms=("fprop", "dgrad")) -> dict[str, QuantizedTensor]:
        """{GEMM: QuantizedTensor} of the weight operands of `gemms` this gather brought (fprop's and / or dgrad's)."""
        return gathered_operands(self._payload, self._meta, self._gather, gemms)

    def operands(self, plans, need_dgrad: bool) -> tuple[Operand, Operand | None]:
        """The weight operands in the forms of `plans` (LinearPlan.w): fprop's, and dgrad's when it is needed and
        came with this gather (else None: the backward's gather brings it, see `dgrad_operand`)."""
        q = self.quantized(("fprop", "dgrad") if need_dgrad else ("fprop",))
        if "fprop" not in q:
            raise RuntimeError("FP4 all-gather: this forward found the weight gathered for the backward (dgrad's "
                               "operand only) -- activation checkpointing switched on after the first step?  Enable "
                               "it before training, or gather this layer in high precision")
        owt = stored_operand(q["dgrad"], plans[1]) if need_dgrad and "dgrad" in q else None
        return stored_operand(q["fprop"], plans[0]), owt

    def dgrad_operand(self, plan) -> Operand:
        """dgrad's weight operand from the gather FSDP2 made for the backward."""
        q = self.quantized(("dgrad",))
        if "dgrad" not in q:
            raise RuntimeError("FP4 all-gather: the backward found no FP4 gather of dgrad's weight operand (FSDP2 did "
                               "not gather this layer again after the forward)")
        return stored_operand(q["dgrad"], plan)


def _version(param, shard) -> int | None:
    """The version counter of the sharded parameter whose local tensor is `shard` (None: not one)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and param._local_tensor is shard:
        return param._version
    return param._version if param is shard else None


@torch.no_grad()
def precompute_fp4_amax(model: nn.Module) -> int:
    """The tensor amaxes of every FP4-gathered weight's two-level operands (NVFP4, UFP4), all in one all-reduce per
    device mesh -- instead of one per operand inside each FSDP2 all-gather.  Call after `optimizer.step()` (the
    trainer does with fp4_all_gather); a weight changed since is all-reduced at its gather as before.  Weights
    not yet gathered once (their gather dtype unknown) are left to it.  Returns how many amaxes were reduced."""
    from torch.distributed.tensor import DTensor

    todo = collections.defaultdict(list)  # mesh -> [(layer, shard, gemm, local amax)]
    for layer in model.modules():
        w = getattr(layer, "weight", None)
        dtype = getattr(layer, "fp4_param_dtype", None)
        if not isinstance(w, DTensor) or not isinstance(w._local_tensor, FP4MasterWeight) or dtype is None:
            continue
        shard = w._local_tensor  # (the object FSDP2 calls fsdp_pre_all_gather on; to_local() makes a new one)
        signs = shard.signs(layer)
        values = shard._tensor.to(dtype)
        for o in layer.fp4_gather.orientations:
            if o.spec.scale is ScaleRule.UE4M3_FP32:
                amax = tensor_amax(_rotated(values.t() if o.transposed else values, o, signs.get(o.gemm)))
                todo[w.device_mesh].append((layer, shard, o.gemm, amax))
    for mesh, items in todo.items():
        amaxes = torch.stack([a for *_, a in items])
        torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
        for (layer, shard, gemm, _), amax in zip(items, amaxes):
            version = _version(layer.weight, shard)
            if getattr(layer, "fp4_amax", (None,))[0] != version:
                layer.fp4_amax = (version, {})
            layer.fp4_amax[1][gemm] = amax
    return sum(len(items) for items in todo.values())
