"""What both optimizers share: closures and the (group, parameter) walk."""
from __future__ import annotations

import torch


def _run_closure(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _with_grads(optimizer: torch.optim.Optimizer):
    """(group, parameter) for every parameter that has a gradient."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                yield group, p
