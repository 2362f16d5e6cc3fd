"""Opt-in quantization diagnostics, per layer and GEMM operand (off the hot path).

    with hf_fp4.collect_diagnostics() as stats:
        loss = model(**batch).loss; loss.backward()
    logger.log(stats)   # {"model.layers.0.mlp.up_proj/fprop/lhs/sqnr_db": 21.3, ...}

Per quantized operand: gain <Q(a),a>/<a,a>, SQNR (dB), fraction saturated.  For recipes whose weight
is quantized in 1D blocks, `<layer>/weight_transpose_mismatch` = ||Q(W)^T - Q(W^T)|| / ||W||: how far
the weight used by dgrad is from the one used by fprop (zero for 2D tiles).

`locate_non_finite(model, step)` reruns a failed step eagerly with hooks on every FP4Linear and names the
first GEMM that met a NaN/Inf: its layer, the GEMM (fprop, or dgrad + wgrad) and the tensor (x, W, the
output, dy).  The trainer puts it in the reason of a skipped step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from .linear import FP4Linear, observe_operands
from ..numerics.quantize import NonFiniteError, fake_quantize, quant_error_stats


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

    def observe(module, gemm_name, role, operand, quantized, spec):
        if spec is None:
            return
        with torch.no_grad():
            prefix = f"{module.layer_name}/{gemm_name}/{role}"
            for key, value in operand_stats(operand, quantized, spec).items():
                stats[f"{prefix}/{key}"] = value
            dgrad_w = module.recipe.dgrad.rhs
            if gemm_name == "fprop" and role == "rhs" and not spec.is_2d and dgrad_w is not None:
                w = module.weight.detach().float()
                diff = fake_quantize(w, spec).t() - fake_quantize(w.t().contiguous(), dgrad_w)
                stats[f"{module.layer_name}/weight_transpose_mismatch"] = float(diff.norm() / w.norm())

    with observe_operands(observe):
        yield stats


def _count_bad(t) -> int:
    return int((~torch.isfinite(t.detach())).sum()) if isinstance(t, torch.Tensor) and t.is_floating_point() else 0


def locate_non_finite(model: torch.nn.Module, step) -> str | None:
    """Run step() (a forward + backward of model) eagerly with hooks on every FP4Linear; return where the
    first non-finite value entered a quantized GEMM, in execution order, or None if none did."""
    found: list[str] = []

    def report(name, what, t):
        n = _count_bad(t)
        if n and not found:
            found.append(f"{name}: {what} has {n} NaN/Inf value(s)")

    def pre(name):
        def hook(module, args):
            report(name, "fprop input x", args[0])
            report(name, "fprop/dgrad weight W", module.weight)
        return hook

    def post(name):
        def hook(module, args, output):
            report(name, "fprop output (overflow)", output)
        return hook

    def backward_pre(name):
        def hook(module, grad_output):
            report(name, "dgrad/wgrad input dy", grad_output[0])
        return hook

    handles = []
    for name, module in model.named_modules():
        if isinstance(module, FP4Linear):
            handles += [module.register_forward_pre_hook(pre(name)), module.register_forward_hook(post(name)),
                        module.register_full_backward_pre_hook(backward_pre(name))]
    try:
        with torch.compiler.set_stance("force_eager"):
            step()
    except NonFiniteError:  # the reference quantizer refusing the value the hooks have already named
        pass
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None
