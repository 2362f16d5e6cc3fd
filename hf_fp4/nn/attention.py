"""FP4 attention (Full-Stack FP4): Q, K, V and the backward's dS quantized, P V and dO V^T in BF16.

The reference here is the spec (explicit S, P, dP, dS, in FP32):

    forward    Q^, K^, V^ = Q(q), Q(k), Q(v)       blocks along head_dim (S = Q^ K^T contracts it)
               S = Q^ K^T * scale, masked;  P = softmax(S)   (a fully masked row gives P = 0)
               O = bf16(P) V^                     "P V in BF16": P rounded to BF16, V^ exact
    backward   dV = bf16(P)^T dO;  dP = dO V^^T   "dO V^T in BF16": dO as it arrives, the forward's V^
               D = rowsum(dO * O);  dS = P * (dP - D)
               dQ = Q_keys(dS) K^ * scale          dS quantized along each GEMM's contraction: along
               dK = Q_queries(dS)^T Q^ * scale     keys for dQ, along queries for dK (a 2D spec -- square
                                                   tiles -- is quantized once and serves both)

The forward's Q^, K^, V^ serve the backward too ("unified tensor reuse": saved, not re-quantized); the
quantizers are straight-through.  Every format is a QuantSpec of an `AttentionRecipe`
({q, k, v, ds}, `none` keeps a tensor in high precision); with every spec `none` this is SDPA.

`attention_forward` is registered with Transformers' attention interface as attn_implementation="hf_fp4"
(causal, GQA, padding masks, sliding windows: it takes the boolean masks Transformers builds for SDPA), and
`FP4TrainConfig(..., attention="nvfp4")` switches a model to it.  Stochastic-rounding specs draw their
Philox seeds from the module's AttentionRNG (a device step counter, checkpointed with the linears').  The Triton
flash kernels (`backend="triton"`; in a model
`config.hf_fp4_attention_backend`, "auto" by default: the kernels on CUDA, the reference elsewhere;
hf_fp4.kernels.attention) compute the same without
materialising S, P or dS: within the BF16 rounding of P and FP32 arithmetic of this reference, with dS
quantized in registers exactly as quantize_rows would quantize the kernel's own dS.  Either backend runs inside
one pair of opaque custom ops (`hf_fp4::attention`, `hf_fp4::attention_backward`), so torch.compile keeps a call in
its graph (no graph break); the flash path of a round-to-nearest recipe reads nothing on the host and runs under
CUDA graphs (hf_fp4.nn.compile.graph_safe).

Under autocast it does what SDPA does there: q, k and v are cast to the autocast dtype first, and the output is in
that dtype (`fp4_attention`); inside the ops autocast is off, so the reference computes in FP32 as written above.
Session 35: a Llama's rotary embedding hands attention FP32 q and k under BF16 autocast (cos / sin follow the FP32
hidden states) and BF16 v; without the cast O came out in FP32, so dO did too, and the flash backward ran its IEEE
FP32 path on the CUDA cores -- the fullstack study run trained at 99k tokens/s against 342k without FP4 attention.
"""
from __future__ import annotations

import functools
import json
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..numerics.philox import STEP_MIX
from ..numerics.quantize import fake_quantize, quantize
from ..numerics.scales import ScaleRule
from ..numerics.spec import QuantSpec, as_spec
from .step_counter import call_step, sr_calls_property

TENSORS = ("q", "k", "v", "ds")
IMPLEMENTATION = "hf_fp4"
#: A Philox seed: a Python int, or a one-element int64 tensor on the data's device (a model's AttentionRNG).
Seed = "int | torch.Tensor"


@dataclass(frozen=True)
class AttentionRecipe:
    """QuantSpec (or None: high precision) of each attention tensor."""

    q: QuantSpec | None = None
    k: QuantSpec | None = None
    v: QuantSpec | None = None
    ds: QuantSpec | None = None

    @classmethod
    def build(cls, value: "str | dict | AttentionRecipe | None") -> "AttentionRecipe":
        """A preset name for all four tensors ("nvfp4"), a mapping {q, k, v, ds} of preset names / spec dicts /
        "none", or an AttentionRecipe."""
        if isinstance(value, AttentionRecipe):
            return value
        if value is None or value == "none":
            return cls()
        if isinstance(value, str):
            value = dict.fromkeys(TENSORS, value)
        if not isinstance(value, dict):
            raise TypeError(f"attention: expected a preset name or a mapping of {', '.join(TENSORS)}, "
                            f"got {type(value).__name__}")
        unknown = sorted(set(value) - set(TENSORS))
        if unknown:
            raise ValueError(f"attention: unknown tensor(s) {unknown}; valid: {', '.join(TENSORS)}")
        specs = {}
        for name, spec in value.items():
            if spec is None or spec == "none":
                specs[name] = None
            elif isinstance(spec, dict):
                specs[name] = QuantSpec.from_dict(spec)
            elif isinstance(spec, str) and spec not in QuantSpec.presets():
                raise ValueError(f"attention.{name}: unknown format {spec!r}; valid: none, "
                                 f"{', '.join(QuantSpec.presets())}")
            else:
                specs[name] = as_spec(spec)
        return cls(**specs)

    def specs(self) -> dict[str, QuantSpec | None]:
        return {t: getattr(self, t) for t in TENSORS}

    @property
    def quantized(self) -> bool:
        return any(s is not None for s in self.specs().values())

    @property
    def stochastic(self) -> bool:
        return any(s is not None and s.rounding.value == "stochastic" for s in self.specs().values())

    def to_dict(self) -> dict[str, Any]:
        return {t: s.to_dict() if s is not None else "none" for t, s in self.specs().items()}


def quantize_rows(x: torch.Tensor, spec: QuantSpec | None, seed: Seed) -> torch.Tensor:
    """x [..., R, C] quantized with blocks along C and dequantized, in FP32 (x itself in FP32 for None).
    A 2D block never spans two of the leading matrices: R is zero-padded to the block height first."""
    x = x.float()
    if spec is None:
        return x
    rows, pad = x.shape[-2], -x.shape[-2] % spec.block[0]
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    seeded = {"seed": seed} if spec.rounding.value == "stochastic" else {}
    out = fake_quantize(x.reshape(-1, x.shape[-1]), spec, **seeded)
    return out.reshape(x.shape)[..., :rows, :]


def _tensor_core(dtype: torch.dtype, spec: QuantSpec | None) -> bool:
    """Whether tensor_core_operand gives exact BF16 values for a tensor of `dtype` quantized with `spec`."""
    return spec.scale is not ScaleRule.FP32 if spec is not None else dtype == torch.bfloat16


def tensor_core_operand(x: torch.Tensor, spec: QuantSpec | None, seed: Seed, backend: str = "reference"
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values in BF16, FP32 tensor decode scale) with values * decode == quantize_rows(x, spec, seed) bit for
    bit -- code x block scale has at most 8 significant bits -- or None where the values are not BF16-exact
    (FP32 block scales; an unquantized x that is not BF16).  backend "triton": the linear layers' operand
    kernels (hf_fp4.kernels.operand, the BF16 form: bit-exact with the reference), which write the BF16 values
    straight from x in two launches, without a host synchronisation (a NaN / Inf makes its block NaN, as in the
    linear layers, instead of raising)."""
    if not _tensor_core(x.dtype, spec):
        return None
    if spec is None:
        return x, torch.ones((), dtype=torch.float32, device=x.device)
    rows, pad = x.shape[-2], -x.shape[-2] % spec.block[0]
    if backend == "triton":  # x read in its own dtype (the reference's x.float() is exact)
        from ..kernels.operand import triton_operands
        from ..numerics.operand_plan import OperandPlan

        y = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        y2 = y.reshape(-1, y.shape[-1])
        plan = OperandPlan.single(spec, "bf16")
        # round to nearest: unused seeds made on the device, no host copy.  Made per call, never cached: a tensor
        # kept from the first call lives in the CUDA-graph pool when that call is a graph-tree warm-up (session 31)
        if spec.rounding.value != "stochastic":
            seeds = torch.zeros(2, dtype=torch.int64, device=x.device)
        elif isinstance(seed, torch.Tensor):  # a model's device seed (AttentionRNG): no host read
            seeds = torch.cat([seed.reshape(1).to(x.device, torch.int64), seed.new_zeros(1, dtype=torch.int64)])
        else:
            seeds = torch.tensor([seed, 0], dtype=torch.int64).to(x.device, non_blocking=True)
        op = triton_operands(y2, (plan, None), seeds)[0]
        values, decode = op.data[:y2.shape[0], :y2.shape[1]], op.scale.reshape(())
    else:
        y = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)) if pad else x.float()
        seeded = {"seed": seed} if spec.rounding.value == "stochastic" else {}
        values, decode = quantize(y.reshape(-1, y.shape[-1]), spec, **seeded).tensor_core_parts()
    return values.reshape(y.shape)[..., :rows, :], decode


def _ds_operands(ds: torch.Tensor, spec: QuantSpec | None, seed: Seed) -> tuple[torch.Tensor, torch.Tensor]:
    """dS for dQ (blocks along keys) and for dK (blocks along queries); one quantization when the spec's
    tiles are square (transposition-invariant)."""
    along_keys = quantize_rows(ds, spec, seed)
    if spec is None or spec.block[0] == spec.block[1]:
        return along_keys, along_keys
    return along_keys, quantize_rows(ds.transpose(-1, -2), spec, seed + 1).transpose(-1, -2)


def _probabilities(qh, kh, scale, keep):
    s = (qh @ kh.transpose(-1, -2)) * scale
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.nan_to_num(p, nan=0.0) if keep is not None else p  # a fully masked row: P = 0


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H / G, T, D] -> [B, H, T, D]: each key head repeated for its G query heads (the reference path)."""
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _group_sum(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H, T, D] per query head -> [B, H / G, T, D]: a key head's gradient sums its query heads'."""
    return t.view(t.shape[0], -1, groups, *t.shape[2:]).sum(2) if groups > 1 else t


def _uses_tensor_cores(q, k, v, recipe: AttentionRecipe, backend: str) -> bool:
    """The flash kernels on exact BF16 values with tensor decodes (else: FP32 values, the IEEE path)."""
    return backend == "triton" and all(_tensor_core(t.dtype, getattr(recipe, n)) for t, n in ((q, "q"), (k, "k"),
                                                                                          (v, "v")))


def _forward(q, k, v, keep, scale: float, recipe: AttentionRecipe, seed: Seed, backend: str, causal: bool):
    """O [B, H, Tq, D] in q's dtype and what the backward reads: (Q^, K^, V^, decodes or None, lse or None)."""
    args = [(t, getattr(recipe, n), seed + i) for i, (t, n) in enumerate(((q, "q"), (k, "k"), (v, "v")))]
    # the flash kernels take exact BF16 values and tensor decodes; their product is the reference's values
    decodes = lse = None
    if backend == "triton":  # the flash kernel: P never materialised (hf_fp4.kernels.attention)
        from ..kernels.attention import flash_forward
        ops = [tensor_core_operand(*a, backend) for a in args]
        if _uses_tensor_cores(q, k, v, recipe, backend):  # exact BF16 values: the tensor cores (saved as such)
            decodes = torch.stack([o[1] for o in ops])
            qh, kh, vh = (o[0] for o in ops)
        else:  # FP32 values: the IEEE path
            qh, kh, vh = (o[0].float() * o[1] if o is not None else quantize_rows(*a) for o, a in zip(ops, args))
        out, lse = flash_forward(qh, kh, vh, keep, scale, decodes, causal=causal, return_lse=True,
                                 out_dtype=q.dtype)  # rounded by the kernel's store, as .to(q.dtype)
    else:
        qh, kh, vh = (quantize_rows(*a) for a in args)
        groups = q.shape[1] // k.shape[1]
        p = _probabilities(qh, _expand(kh, groups), scale, _with_causal(keep, causal, q.shape[2], k.shape[2], q.device))
        out = (p.to(torch.bfloat16).float() @ _expand(vh, groups)).to(q.dtype)
    return out, (qh, kh, vh, decodes, lse)


def _backward(d_out, qh, kh, vh, out, keep, decodes, lse, scale: float, recipe: AttentionRecipe, seed: Seed,
              backend: str, causal: bool, dtypes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q_dtype, k_dtype, v_dtype = dtypes
    groups = qh.shape[1] // kh.shape[1]
    if backend == "triton":  # the flash backward: dS quantized in registers (hf_fp4.kernels.attention)
        from ..kernels.attention import flash_backward
        dq, dk, dv = flash_backward(qh, kh, vh, out, d_out, keep, scale, recipe.ds, seed + 3, decodes,
                                    causal=causal, lse=lse)  # the forward's log-sum-exp
        return dq.to(q_dtype), _group_sum(dk, groups).to(k_dtype), _group_sum(dv, groups).to(v_dtype)
    # recomputed from the saved quantized Q^, K^ (K^, V^ expanded to the query heads here only)
    kh, vh = _expand(kh, groups), _expand(vh, groups)
    p = _probabilities(qh, kh, scale, _with_causal(keep, causal, qh.shape[2], kh.shape[2], qh.device))
    d_out = d_out.float()
    dv = _group_sum(p.to(torch.bfloat16).float().transpose(-1, -2) @ d_out, groups)
    dp = d_out @ vh.transpose(-1, -2)
    ds = p * (dp - (d_out * out.float()).sum(dim=-1, keepdim=True))
    ds_keys, ds_queries = _ds_operands(ds, recipe.ds, seed + 3)
    dq = (ds_keys @ kh) * scale
    dk = _group_sum((ds_queries.transpose(-1, -2) @ qh) * scale, groups)
    return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype)


# FP4 attention as two custom ops with an autograd formula: torch.compile keeps each call in the graph as one opaque
# op (no graph break: the reference's host-side checks and the kernels' launches run inside it); on CUDA the
# flash path has no host synchronisation (it runs under CUDA graphs: hf_fp4.nn.compile.graph_safe).  The
# recipe travels as its JSON (an op takes no dataclass); the saved Q^, K^, V^, decodes and log-sum-exp are
# outputs of the forward op (empty tensors where a path has none).
def recipe_key(recipe: AttentionRecipe) -> str:
    return json.dumps(recipe.to_dict(), sort_keys=True)


@torch.compiler.assume_constant_result
def _preset_key(name: str) -> str:
    """recipe_key of a preset name for all four tensors (computed eagerly under torch.compile, a constant)."""
    return recipe_key(AttentionRecipe.build(name))


@functools.lru_cache(maxsize=None)
def _recipe_of(key: str) -> AttentionRecipe:
    return AttentionRecipe.build(json.loads(key))


def _own(t: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """t, copied where it shares memory with one of `others` (a custom op's output may alias neither an input nor
    another output)."""
    ptr = t.untyped_storage().data_ptr()
    return t.clone() if any(ptr == o.untyped_storage().data_ptr() for o in others) and t.numel() else t


def _seed_of(seed: int, seed_t: Optional[torch.Tensor]) -> Seed:
    """The call's seed: `seed`, or the device seed `seed_t` where one is given (a stochastic recipe in a model),
    which the quantizers take as it is -- the operand kernels and the flash backward load it, the reference draws
    with it on its device: no host read."""
    return seed_t if seed_t is not None else seed


@torch.library.custom_op("hf_fp4::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: Optional[torch.Tensor], scale: float,
                  recipe: str, seed: int, backend: str, causal: bool, seed_t: Optional[torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    seed = _seed_of(seed, seed_t)
    with torch.autocast(q.device.type, enabled=False):  # the reference's FP32 products, whatever the caller's autocast
        out, (qh, kh, vh, decodes, lse) = _forward(q, k, v, keep, scale, _recipe_of(recipe), seed, backend, causal)
    saved = []
    for t in (qh, kh, vh):  # (K^ and V^ are one tensor where both are K itself, unquantized)
        saved.append(_own(t, q, k, v, *saved))
    return (out, *saved, q.new_empty(0, dtype=torch.float32) if decodes is None else decodes,
            q.new_empty(0, dtype=torch.float32) if lse is None else lse)


@_attention_op.register_fake
def _(q, k, v, keep, scale, recipe, seed, backend, causal, seed_t):
    tc = _uses_tensor_cores(q, k, v, _recipe_of(recipe), backend)
    saved = torch.bfloat16 if tc else torch.float32
    lse = q.new_empty(q.shape[:3], dtype=torch.float32) if backend == "triton" else q.new_empty(0, dtype=torch.float32)
    return (q.new_empty(q.shape), q.new_empty(q.shape, dtype=saved), k.new_empty(k.shape, dtype=saved),
            v.new_empty(v.shape, dtype=saved), q.new_empty(3 if tc else 0, dtype=torch.float32), lse)


@torch.library.custom_op("hf_fp4::attention_backward", mutates_args=())
def _attention_backward_op(d_out: torch.Tensor, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                           out: torch.Tensor, keep: Optional[torch.Tensor], decodes: torch.Tensor, lse: torch.Tensor,
                           scale: float, recipe: str, seed: int, backend: str, causal: bool, q_dtype: torch.dtype,
                           k_dtype: torch.dtype, v_dtype: torch.dtype, seed_t: Optional[torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(qh.device.type, enabled=False):  # (as the forward op)
        return _backward(d_out.contiguous(), qh, kh, vh, out, keep, decodes if decodes.numel() else None,
                         lse if lse.numel() else None, scale, _recipe_of(recipe), _seed_of(seed, seed_t), backend,
                         causal, (q_dtype, k_dtype, v_dtype))


@_attention_backward_op.register_fake
def _(d_out, qh, kh, vh, out, keep, decodes, lse, scale, recipe, seed, backend, causal, q_dtype, k_dtype, v_dtype,
      seed_t):
    return (qh.new_empty(qh.shape, dtype=q_dtype), kh.new_empty(kh.shape, dtype=k_dtype),
            vh.new_empty(vh.shape, dtype=v_dtype))


def _setup_context(ctx, inputs, output):
    q, k, v, keep, scale, recipe, seed, backend, causal, seed_t = inputs
    out, qh, kh, vh, decodes, lse = output
    ctx.save_for_backward(qh, kh, vh, out, keep, decodes, lse, seed_t)
    ctx.args = (scale, recipe, seed, backend, causal, q.dtype, k.dtype, v.dtype)


def _attention_grad(ctx, d_out, *unused):
    qh, kh, vh, out, keep, decodes, lse, seed_t = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(d_out, qh, kh, vh, out, keep, decodes, lse, *ctx.args, seed_t)
    return dq, dk, dv, None, None, None, None, None, None, None


_attention_op.register_autograd(_attention_grad, setup_context=_setup_context)


def _with_causal(keep, causal: bool, q_len: int, kv_len: int, device):
    """keep and, when causal, key <= query (aligned at the start, as Transformers' SDPA path)."""
    if not causal:
        return keep
    tril = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril()
    return tril if keep is None else keep & tril


ATTENTION_BACKENDS = ("auto", "reference", "triton")


def fp4_attention(q, k, v, keep=None, scale: float | None = None, recipe: "AttentionRecipe | str | dict" = "nvfp4",
                  seed: "int | torch.Tensor" = 0, backend: str = "reference", causal: bool = False) -> torch.Tensor:
    """FP4 attention of q [B, H, Tq, D] and k, v [B, Hkv, Tk, D] (Hkv divides H); keep: a boolean mask
    (True: attend) broadcastable to [B, H, Tq, Tk], or None (no mask); causal: also key <= query (the flash
    kernels compute it and skip the tiles above the diagonal; keep=tril within FP32 summation order).  backend
    "triton": the flash kernels (hf_fp4.kernels.attention; equal to the reference within the BF16 rounding of P
    and FP32 arithmetic); "auto": the kernels on CUDA, the reference elsewhere (a model's default).  Under autocast
    q, k and v are first cast to its dtype, as SDPA's autocast rule casts them (the output is in that dtype, so
    the flash backward takes a BF16 dO on the tensor cores).  seed: the Philox seed of stochastically rounded
    tensors (q, k, v draw from seed, seed + 1, seed + 2; dS from seed + 3 and, for dK, seed + 4), a Python int or
    a one-element int64 tensor on the device (a model's stream, see AttentionRNG: never read on the host)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"fp4_attention: unknown backend {backend!r}; valid: {', '.join(ATTENTION_BACKENDS)}")
    if backend == "auto":
        backend = "triton" if q.is_cuda else "reference"
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"fp4_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key heads")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"fp4_attention: k has {k.shape[1]} heads, v {v.shape[1]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    if isinstance(recipe, str):  # a preset name or recipe_key's JSON: no recipe built under torch.compile
        key = recipe if recipe.startswith("{") else _preset_key(recipe)
    else:
        key = recipe_key(AttentionRecipe.build(recipe))
    seed_t = seed.reshape(()) if isinstance(seed, torch.Tensor) else None
    return _attention_op(q, k, v, keep, float(scale), key, 0 if seed_t is not None else int(seed), backend,
                         bool(causal), seed_t)[0]


def _keep_mask(attention_mask, kv_len: int) -> torch.Tensor | None:
    """Transformers' SDPA-style mask (bool True = attend, or additive float) as a boolean keep mask."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., :kv_len]
    return attention_mask[..., :kv_len] > torch.finfo(attention_mask.dtype).min / 2


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature (as `sdpa_attention_forward`): returns ([B, Tq, H, D], None).
    The recipe is `module.config.hf_fp4_attention` (set by FP4TrainConfig(attention=...)), else NVFP4 for all
    four tensors."""
    if kwargs.get("softcap") is not None:
        raise ValueError("attn_implementation='hf_fp4' does not support softcap; use 'eager'")
    if dropout and module.training:
        raise ValueError(f"attn_implementation='hf_fp4' has no attention dropout (got {dropout}); set the "
                         "model's attention_dropout to 0")
    config = getattr(module, "config", None)
    recipe, key_json = module_recipe(module, config)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = q_len > 1 and attention_mask is None and (
        is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if causal and kv_len > q_len:  # as Transformers' SDPA path: causal without a mask aligns to the start
        key, value, kv_len = key[:, :, :q_len], value[:, :, :q_len], q_len
    keep = _keep_mask(attention_mask, kv_len)
    backend = getattr(config, "hf_fp4_attention_backend", "auto")
    if recipe.stochastic:  # the module's Philox stream (AttentionRNG)
        out = _stochastic_attention(module, query, key, value, keep, scaling, key_json, backend, causal)
    else:
        out = fp4_attention(query, key, value, keep, scaling, key_json, 0, backend, causal)
    return out.transpose(1, 2).contiguous(), None


def module_recipe(module: torch.nn.Module, config) -> tuple[AttentionRecipe, str]:
    """The attention recipe of `module` (config.hf_fp4_attention, else NVFP4 for all four tensors) and its JSON,
    built once per config value and kept on the module: torch.compile then reads two attributes instead of
    tracing the recipe's construction (which breaks its graph)."""
    value = getattr(config, "hf_fp4_attention", None) or "nvfp4"
    cached = getattr(module, "_hf_fp4_attention_recipe", None)
    if cached is None or cached[0] is not value:
        cached = _cache_recipe(module, value)
    return cached[1], cached[2]


@torch.compiler.disable
def _cache_recipe(module: torch.nn.Module, value, calls_attention: bool = True) -> tuple:
    """Built outside a compiled graph: a compiled call that finds no cached recipe breaks its graph here once, and
    recompiles with the module's cached recipe from then on (`cache_recipes` fills the caches before compiling).
    A stochastic recipe gives a module that calls the attention function its AttentionRNG."""
    recipe = AttentionRecipe.build(value)
    module._hf_fp4_attention_recipe = (value, recipe, recipe_key(recipe))
    if recipe.stochastic and calls_attention:
        _module_rng(module)
    return module._hf_fp4_attention_recipe


@torch.compiler.disable
def _module_rng(module: torch.nn.Module) -> "AttentionRNG":
    """The module's AttentionRNG, made on its parameters' device (the CPU on meta) where it has none yet."""
    rng = getattr(module, "_hf_fp4_attention_rng", None)
    if not isinstance(rng, AttentionRNG):
        rng = module._hf_fp4_attention_rng = AttentionRNG(getattr(module, "layer_idx", None),
                                                          _weights_device(module) or "cpu")
    return rng


def _weights_device(module: torch.nn.Module) -> torch.device | None:
    """The device of the module's parameters (None where it has none or they are on the meta device)."""
    param = next(module.parameters(), None)
    return param.device if param is not None and param.device.type != "meta" else None


def cache_recipes(model: torch.nn.Module) -> int:
    """Build the attention recipe on every module of `model` whose config asks for FP4 attention (the attention
    modules read their own `config`), so that a compiled block's first call traces without the graph break of
    `_cache_recipe`, which split each block's first graph at the attention call (two graphs and a resumed frame,
    then a recompilation).  Returns how many modules got a recipe."""
    done = 0
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) == IMPLEMENTATION:
            _cache_recipe(module, getattr(config, "hf_fp4_attention", None) or "nvfp4", _calls_attention(module))
            done += 1
    return done


def _calls_attention(module: torch.nn.Module) -> bool:
    """Whether `module` is one of Transformers' attention modules, which call the attention function (an
    `...Attention` class with a layer index).  Every module holding the config gets the recipe; only these an
    AttentionRNG before their first call (so that a resumed run can restore it first); another module that calls
    the attention function gets one at its first call."""
    return type(module).__name__.endswith("Attention") and hasattr(module, "layer_idx")


class AttentionRNG:
    """The Philox stream of one attention module's stochastically rounded tensors: a step counter (int64, on the
    module's device; advanced once per training forward, as FP4Linear's: hf_fp4.nn.step_counter) and a base from
    the module's layer index.  A call's seed is (base + step * STEP_MIX) mod 2^62, made on the device and read
    there by the quantizers (no host synchronisation), so that the layers draw distinct noise, a compiled block
    neither breaks its graph nor recompiles per call, activation checkpointing's recompute draws what the first run
    drew, and a resumed run continues the stream (`sr_calls`, in hf_fp4.rng_state_dict).  Not a buffer: HF's
    meta-device loading leaves those uninitialised, and it is not a weight."""

    SEED_MASK = (1 << 62) - 1  # seed + 4 (dK's dS) stays an int64

    def __init__(self, layer_idx, device) -> None:
        # the base a device tensor too: an integer attribute would specialise a compiled block on the layer
        self.base = torch.tensor(zlib.crc32(f"attention/{layer_idx}".encode()), dtype=torch.int64, device=device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)

    sr_calls = sr_calls_property("step")

    def place(self, device) -> None:
        if self.step.device != torch.device(device):
            self.step, self.base = self.step.to(device), self.base.to(device)

    def seed(self, device) -> torch.Tensor:
        """This call's seed (a 0-d int64 tensor), advancing the counter after a training forward."""
        self.place(device)
        step, advances = call_step(self.step)
        seed = (self.base + step * STEP_MIX) & self.SEED_MASK  # int64 wrap-around, then mod 2^62
        if advances:
            self.step.add_(1)
        return seed


def attention_rngs(model: torch.nn.Module) -> dict[str, AttentionRNG]:
    """Every attention module's RNG state in `model` (those whose recipe rounds stochastically), by module name."""
    return {name: m._hf_fp4_attention_rng for name, m in model.named_modules()
            if isinstance(getattr(m, "_hf_fp4_attention_rng", None), AttentionRNG)}


def place_attention_rngs(model: torch.nn.Module) -> None:
    """Each AttentionRNG on its module's device, eagerly: after the model is moved (the counter is not a buffer),
    before a compiled first call would move it inside its graph."""
    for name, rng in attention_rngs(model).items():
        if (device := _weights_device(model.get_submodule(name))) is not None:
            rng.place(device)


def _stochastic_attention(module, query, key, value, keep, scaling, key_json, backend, causal):
    """fp4_attention seeded from the module's AttentionRNG (made with its recipe, _cache_recipe, or at a first call
    from a module `cache_recipes` did not take for an attention module)."""
    rng = getattr(module, "_hf_fp4_attention_rng", None)
    seed = (rng if rng is not None else _module_rng(module)).seed(query.device)
    return fp4_attention(query, key, value, keep, scaling, key_json, seed, backend, causal)


def register() -> None:
    """attn_implementation="hf_fp4" for every Transformers model that supports SDPA (its masks too)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)


def enable(model: torch.nn.Module, recipe: "AttentionRecipe | str | dict") -> None:
    """Switch `model` to FP4 attention with `recipe` (stored in its config, so it saves and reloads)."""
    recipe = AttentionRecipe.build(recipe)
    model.config.hf_fp4_attention = recipe.to_dict()
    for config in (getattr(model.config, "get_text_config", lambda: None)(),):
        if config is not None and config is not model.config:
            config.hf_fp4_attention = recipe.to_dict()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(IMPLEMENTATION)
    else:
        model.config._attn_implementation = IMPLEMENTATION
    cache_recipes(model)


__all__ = ["AttentionRecipe", "AttentionRNG", "fp4_attention", "attention_forward", "register", "enable",
           "cache_recipes", "attention_rngs", "place_attention_rngs", "quantize_rows"]
