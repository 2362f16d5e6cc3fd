"""LoRA-SVD residual compensation (Full-Stack FP4), in one place.

A layer with ``lora_svd_rank=r`` represents W = W_res + B A: `weight` holds W_res (quantized in every GEMM)
and `lora_svd_A` [r, K], `lora_svd_B` [N, r] are trainable high-precision parameters used unquantized,
y = x Q(W_res)^T + (x A^T) B^T.  The split is a rank-r truncated SVD, B = U_r S_r^1/2, A = S_r^1/2 V_r^T; a
re-split every ``lora_svd_refresh_every`` optimizer steps folds B A back first (the optimizer moments are
kept as they are).  The factors get no weight decay (`is_factor`).
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
    layer.lora_svd_A = nn.Parameter(torch.zeros(rank, layer.in_features, device=device, dtype=dtype))
    layer.lora_svd_B = nn.Parameter(torch.zeros(layer.out_features, rank, device=device, dtype=dtype))


def has_factors(layer: nn.Module) -> bool:
    return getattr(layer, "lora_svd_A", None) is not None


@torch.no_grad()
def split(layer: nn.Module, fresh: bool = False) -> None:
    """Split W = W_res + B A by a rank-r truncated SVD.  fresh=False folds the current B A back first (a
    periodic re-split); fresh=True treats `weight` as the whole matrix (after loading a plain checkpoint)."""
    if not has_factors(layer):
        return
    full = layer.weight.float()
    if not fresh:
        full = full + layer.lora_svd_B.float() @ layer.lora_svd_A.float()
    u, s, vh = torch.linalg.svd(full, full_matrices=False)
    r = layer.lora_svd_A.shape[0]
    root = s[:r].sqrt()
    layer.lora_svd_B.copy_(u[:, :r] * root)
    layer.lora_svd_A.copy_(root[:, None] * vh[:r])
    layer.weight.copy_(full - layer.lora_svd_B.float() @ layer.lora_svd_A.float())


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
        every = m.recipe.lora_svd_refresh_every
        if every and step > 0 and step % every == 0:
            split(m)
            done = True
    return done


def is_factor(parameter_name: str) -> bool:
    """True for a LoRA-SVD factor's parameter name (they take no weight decay)."""
    return parameter_name.rpartition(".")[2] in FACTORS
