"""LoRA-SVD residual compensation (Full-Stack FP4), in one place.

A layer with ``lora_svd_rank=r`` represents W = W_res + B A: `weight` holds W_res (quantized in every GEMM)
and `lora_svd_A` [r, K], `lora_svd_B` [N, r] are trainable high-precision parameters used unquantized,
y = x Q(W_res)^T + (x A^T) B^T.  The split is a rank-r truncated SVD, B = U_r S_r^1/2, A = S_r^1/2 V_r^T; a
re-split every ``lora_svd_refresh_every`` optimizer steps folds B A back first (the optimizer moments are
kept as they are).  The factors get no weight decay (`is_factor`).  With ``lora_svd_factors="frozen"`` A and B
are not trained: they stay as the last split made them, W_res takes every update, and a re-split every
``lora_svd_refresh_every`` steps moves the current top-r directions of W into them (`trains_factors`).

MoE experts (hf_fp4.nn.experts) hold one pair per projection and expert: `<proj>_lora_svd_A` [E, r, K] and
`<proj>_lora_svd_B` [E, N, r] beside the 3D weight; the functions here split them expert by expert (batched).
"""
from __future__ import annotations

import torch
from torch import nn

FACTORS = ("lora_svd_A", "lora_svd_B")


def init_factors(layer: nn.Module, rank: int, device=None, dtype=None) -> None:
    """Give an FP4Linear its (zero) factors, or None for rank 0; the split fills them."""
    if rank == 0:
        layer.lora_svd_A = layer.lora_svd_B = None
        return
    if rank > min(layer.in_features, layer.out_features):
        raise ValueError(f"{layer.layer_name or 'FP4Linear'}: lora_svd_rank={rank} exceeds "
                         f"min(in, out) = {min(layer.in_features, layer.out_features)}")
    train = trains_factors(layer.recipe)
    layer.lora_svd_A = nn.Parameter(torch.zeros(rank, layer.in_features, device=device, dtype=dtype), train)
    layer.lora_svd_B = nn.Parameter(torch.zeros(layer.out_features, rank, device=device, dtype=dtype), train)


def trains_factors(recipe) -> bool:
    """Whether the optimizer trains a recipe's factors (lora_svd_factors "trained"); "frozen" keeps them as the
    last split made them (parameters without gradient), so W_res takes the whole update and the layer learns as
    its unfactored weight would, with B A in high precision: the gradient of W_res is that of W = W_res + B A."""
    return recipe.lora_svd_factors == "trained"


def expert_factor_names(proj: str) -> tuple[str, str]:
    """The parameter names of an experts module's factors of projection `proj` (A [E, r, K], B [E, N, r])."""
    return f"{proj}_{FACTORS[0]}", f"{proj}_{FACTORS[1]}"


def factor_pairs(layer: nn.Module) -> list[tuple[torch.Tensor, nn.Parameter, nn.Parameter]]:
    """(W as [..., N, K] -- a view of the weight --, A, B) of every low-rank pair the module holds: an FP4Linear's
    one, or one per projection of an experts module (batched over the experts)."""
    if getattr(layer, "lora_svd_A", None) is not None:
        return [(layer.weight, layer.lora_svd_A, layer.lora_svd_B)]
    pairs = []
    for proj in getattr(layer.__dict__.get("hf_fp4"), "projections", ()):
        a_name, b_name = expert_factor_names(proj)
        if getattr(layer, a_name, None) is not None:
            w = getattr(layer, proj)
            pairs.append((w.transpose(1, 2) if layer.is_transposed else w, getattr(layer, a_name),
                          getattr(layer, b_name)))
    return pairs


def has_factors(layer: nn.Module) -> bool:
    return bool(factor_pairs(layer))


@torch.no_grad()
def split(layer: nn.Module, fresh: bool = False) -> None:
    """Split W = W_res + B A by a rank-r truncated SVD.  fresh=False folds the current B A back first (a
    periodic re-split); fresh=True treats `weight` as the whole matrix (after loading a plain checkpoint)."""
    for weight, a, b in factor_pairs(layer):
        full = weight.float()
        if not fresh:
            full = full + b.float() @ a.float()
        u, s, vh = torch.linalg.svd(full, full_matrices=False)
        r = a.shape[-2]
        root = s[..., :r].sqrt()
        b.copy_(u[..., :r] * root[..., None, :])
        a.copy_(root[..., :, None] * vh[..., :r, :])
        weight.copy_(full - b.float() @ a.float())


def low_rank_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(x A^T) B^T, the unquantized low-rank part of the layer's output."""
    return nn.functional.linear(nn.functional.linear(x, layer.lora_svd_A), layer.lora_svd_B)


def factors_product(layer: nn.Module) -> torch.Tensor:
    """B A [N, K] (with gradients)."""
    return layer.lora_svd_B @ layer.lora_svd_A


def layers_with_factors(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if has_factors(m)]


def split_model(model: nn.Module, fresh: bool = False) -> int:
    """Split (or re-split) every LoRA-SVD layer of a model; returns how many were split."""
    layers = layers_with_factors(model)
    for m in layers:
        split(m, fresh=fresh)
    return len(layers)


def maybe_refresh(model: nn.Module, step: int) -> bool:
    """Re-split the LoRA-SVD layers whose recipe asks for it at optimizer step `step` (> 0)."""
    done = False
    for m in layers_with_factors(model):
        recipe = m.hf_fp4.recipe if "hf_fp4" in m.__dict__ else m.recipe  # an experts module: its state's
        every = recipe.lora_svd_refresh_every
        if every and step > 0 and step % every == 0:
            split(m)
            done = True
    return done


def is_factor(parameter_name: str) -> bool:
    """True for a LoRA-SVD factor's parameter name (they take no weight decay): an FP4Linear's `lora_svd_A` /
    `lora_svd_B`, an experts module's `<proj>_lora_svd_A` / `<proj>_lora_svd_B`."""
    return parameter_name.rpartition(".")[2].endswith(FACTORS)
