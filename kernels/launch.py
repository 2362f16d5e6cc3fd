"""How the kernels are launched: through `torch.library.wrap_triton` only while a compiler traces the call.

torch.compile needs `wrap_triton(kernel)[grid](...)` to see a user kernel inside a `triton_op` (it records the
launch in its graph).  In eager mode the wrapper is pure cost on the torch the GPU image has (2.11): every launch
goes through its higher-order op, a Python dispatch per launch (the H200 traces of 2026-12-02 show it under the
eager FP4 attention and optimizer paths).  `launcher(kernel)` gives the wrapped kernel under tracing -- dynamo,
or the fake / proxy / functional dispatch modes AOTAutograd and make_fx trace with -- and the plain one otherwise.
"""
from __future__ import annotations

import torch
from torch.library import wrap_triton

_TRACING_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, k) for k in ("FAKE", "PROXY", "FUNCTIONAL")
                       if hasattr(torch._C._TorchDispatchModeKey, k))


def tracing() -> bool:
    """Whether a compiler is tracing the current call (so a launch must be recorded, not run)."""
    if torch.compiler.is_compiling():
        return True
    return any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES)


def launcher(kernel):
    """`kernel` for `launcher(kernel)[grid](*args)`: wrapped for the compiler while one traces, else as it is."""
    return wrap_triton(kernel) if tracing() else kernel
