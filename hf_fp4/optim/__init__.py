"""Optimizers: FP4 AdamW state (Full-Stack FP4) and Muon with optional NVFP4 Newton-Schulz.

`build_optimizer` is the one place the trainer's `optimizer:` name becomes an optimizer.
"""
from __future__ import annotations

import torch

from ..nn import lora_svd
from .fp4_adamw import V_TRANSFORMS, FP4AdamW, state_bytes
from .muon import NS_ITERATIONS, Muon, newton_schulz, orthogonality_error

__all__ = ["FP4AdamW", "Muon", "build_optimizer", "param_groups", "newton_schulz", "orthogonality_error",
           "state_bytes", "NS_ITERATIONS", "V_TRANSFORMS"]


def param_groups(model: torch.nn.Module, optimizer_name: str, weight_decay: float, lora_svd_lr_scale: float = 1.0,
                 lora_svd_weight_decay: float = 0.0) -> list[dict]:
    """The trainer's parameter groups: matrices with weight decay, vectors without, LoRA-SVD factors in a group of
    their own (weight decay `lora_svd_weight_decay`, lr times `lora_svd_lr_scale`: build_optimizer reads the
    group's ``lr_scale``); for muon, the hidden matrices (not embeddings, LM head or LoRA-SVD factors) in a group
    marked ``muon=True``."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2 and not lora_svd.is_factor(n)]
    no_decay = [p for n, p in named if p.dim() < 2 and not lora_svd.is_factor(n)]
    factors = [p for n, p in named if lora_svd.is_factor(n)]
    factors = [{"params": factors, "weight_decay": lora_svd_weight_decay, "lr_scale": lora_svd_lr_scale}] if factors \
        else []  # no group without factors: a checkpoint's optimizer state keeps its groups
    if optimizer_name != "muon":
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}] + factors
    hidden = [p for n, p in named if p.dim() == 2 and "embed" not in n and "lm_head" not in n
              and not lora_svd.is_factor(n)]
    ids = {id(p) for p in hidden}
    return [{"params": hidden, "muon": True, "weight_decay": weight_decay},
            {"params": [p for p in decay if id(p) not in ids], "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}] + factors


def build_optimizer(name: str, groups: list[dict], lr: float, betas: tuple[float, float],
                    options: dict) -> torch.optim.Optimizer:
    """The trainer's optimizer `name` ("adamw" | "fp4_adamw" | "muon") over param groups; a group with ``lr_scale``
    takes lr times it; for muon, groups marked ``muon=True`` take ``options["muon_lr"]`` (default 0.02) as their
    lr, the others `lr`."""
    groups = [{**g, "lr": lr * g["lr_scale"]} if "lr_scale" in g else g for g in groups]
    if name == "muon":
        opts = dict(options)
        muon_lr = opts.pop("muon_lr", 0.02)
        groups = [{**g, "lr": muon_lr} if g.get("muon") else g for g in groups if g["params"]]
        return Muon(groups, lr=lr, betas=betas, **opts)
    if name == "fp4_adamw":
        return FP4AdamW(groups, lr=lr, betas=betas, **options)
    fused = {"fused": True} if torch.cuda.is_available() else {}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **fused)
