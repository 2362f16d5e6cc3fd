"""How the kernels are launched: through `torch.library.wrap_triton` only while a compiler traces the launch.

torch.compile needs `wrap_triton(kernel)[grid](...)` to see a user kernel inside a `triton_op` (it records the
launch in its graph).  In eager mode the wrapper is pure cost on the torch the GPU image has (2.11): every launch
goes through its higher-order op, a Python dispatch per launch (the H200 traces of 2026-12-02 show it under the
eager FP4 attention and optimizer paths).  `launcher(kernel)[grid](*args)` wraps the launch while a compiler
traces it -- dynamo, the fake / proxy / functional dispatch modes, or arguments that are fake or functional
tensors (a traced triton_op's implementation runs on those, with the tracing mode itself popped) -- and
launches the kernel itself otherwise.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.library import wrap_triton

_TRACING_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, k) for k in ("FAKE", "PROXY", "FUNCTIONAL")
                       if hasattr(torch._C._TorchDispatchModeKey, k))


def tracing(*args) -> bool:
    """Whether a compiler is tracing the current call (so a launch must be recorded, not run).  Of the arguments only
    the first tensor is looked at: a traced call's tensors are all fake or functional (a launch has ~50 arguments,
    and looking at each cost ~10 us of host time per eager launch)."""
    return _tracing(_first_tensor(args))


def _tracing(t: torch.Tensor | None) -> bool:
    """tracing() given the call's first tensor argument (or None)."""
    if torch.compiler.is_compiling():
        return True
    if any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES):
        return True
    return t is not None and (isinstance(t, FakeTensor) or torch._is_functional_tensor(t))


def _first_tensor(args) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


class launcher:
    """`launcher(kernel)[grid](*args, **meta)`: wrap_triton's launch while a compiler traces it, else the kernel's --
    on the device of its first tensor argument: Triton launches on the *current* CUDA device, so a model on cuda:1
    in a process whose current device is cuda:0 would run its kernels on the wrong GPU (an illegal address without
    peer access).  Compiled code sets its own device guard."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            t = _first_tensor(args)  # once: both the tracing check and the device guard look at it
            if _tracing(t):
                return wrap_triton(self.kernel)[grid](*args, **kwargs)
            if t is not None and t.is_cuda and t.device.index != torch.cuda.current_device():
                with torch.cuda.device(t.device):
                    return self.kernel[grid](*args, **kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch
