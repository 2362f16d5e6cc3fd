"""Opt-in quantization diagnostics, per layer and GEMM operand (off the hot path).

    with hf_fp4.collect_diagnostics() as stats:
        loss = model(**batch).loss; loss.backward()
    logger.log(stats)   # {"model.layers.0.mlp.up_proj/fprop/lhs/sqnr_db": 21.3, ...}

Per quantized operand: gain <Q(a),a>/<a,a>, SQNR (dB), fraction saturated.  For recipes whose weight
is quantized in 1D blocks, `<layer>/weight_transpose_mismatch` = ||Q(W)^T - Q(W^T)|| / ||W||: how far
the weight used by dgrad is from the one used by fprop (zero for 2D tiles).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from .linear import observe_operands
from .quantize import fake_quantize, quant_error_stats


def operand_stats(operand: torch.Tensor, quantized: torch.Tensor, spec) -> dict[str, float]:
    a, q = operand.double().flatten(), quantized.double().flatten()
    signal, err = (a * a).sum(), ((a - q) ** 2).sum()
    rtn = dataclasses.replace(spec, rounding="nearest")
    return {"gain": float((a * q).sum() / signal) if signal > 0 else 1.0,
            "sqnr_db": float(10 * torch.log10(signal / err)) if err > 0 else math.inf,
            "saturated": quant_error_stats(operand, rtn)["saturated"]}


@contextlib.contextmanager
def collect_diagnostics():
    """Yield a dict filled with the statistics of every quantized operand seen inside the block."""
    stats: dict[str, float] = {}

    def observe(module, gemm, role, operand, quantized, spec):
        if spec is None:
            return
        with torch.no_grad():
            prefix = f"{module.layer_name}/{gemm}/{role}"
            for key, value in operand_stats(operand, quantized, spec).items():
                stats[f"{prefix}/{key}"] = value
            dgrad_w = module.recipe.dgrad.rhs
            if gemm == "fprop" and role == "rhs" and not spec.is_2d and dgrad_w is not None:
                w = module.weight.detach().float()
                diff = fake_quantize(w, spec).t() - fake_quantize(w.t().contiguous(), dgrad_w)
                stats[f"{module.layer_name}/weight_transpose_mismatch"] = float(diff.norm() / w.norm())

    with observe_operands(observe):
        yield stats
