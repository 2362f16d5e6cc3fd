"""torch.compile for FP4 models: each decoder block compiled in place, CUDA graphs on the GPU by default.

FP4Linear has no graph break under torch.compile (its kernels are custom ops).  How its kernels are best
launched depends on the mode:

* with CUDA graphs (``reduce-overhead``, ``max-autotune``) a step replays as one graph, so a Python call per
  launch costs nothing: the kernels stay in opaque custom ops, whose inputs inductor never copies;
* without them (``default``, ``max-autotune-no-cudagraphs``) inductor launches the kernels from its own code
  (``triton_op``), avoiding a Python call per launch -- a 1.1B Llama step has thousands.

`compile_model` sets that per layer (FP4Linear.cuda_graphs); numerics are identical either way.  A model whose
blocks read the host (the per-expert loop of FP4 experts, FP4 attention on the reference backend or with
stochastic rounding: `graph_safe`) keeps the opaque custom ops too.  FP4 attention is itself an opaque custom op
(hf_fp4.nn.attention): no graph break.

Blocks compile with static shapes (``dynamic=False``): a training run has one input shape, and a new shape
compiles once more.  Under torch 2.11's automatic dynamic shapes (a frame seen again with another shape),
dynamo fails to trace FP4LinearFunction in a block that graph-breaks for FP4 attention (AssertionError in
overwrite_tensor_vt_proxy: a symbolic size among the outputs of the autograd function's forward graph) -- the
H200 GPU suite of 2026-12-02 (sessions 8, 9); reproduced on the CPU with torch 2.11 by compiling one FP4Linear,
then a model with FP4 attention (tests/test_attention.py).
"""
from __future__ import annotations

import torch
from torch import nn

from .swap import fp4_modules, place_rng_states

MODES = ("auto", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
BACKENDS = ("inductor", "aot_eager", "eager")


def graph_safe(model: nn.Module | None) -> bool:
    """False for a model with FP4 attention that reads the host (hf_fp4.nn.attention: the reference backend checks
    for non-finite values there) and for a stochastic-rounding recipe (its seed is a device tensor since session
    37, no host read, but no GPU has replayed one under CUDA graphs yet); the flash kernels of a round-to-nearest
    recipe on CUDA read nothing there and replay under CUDA graphs (tests/test_attention.py, H100, 2026-12-06).
    False for FP4 experts that run the per-expert loop (hf_fp4.nn.experts: it reads the routing counts on the
    host); experts whose every layer takes the grouped GEMMs with BF16 activations (ExpertsFP4.layer_reason: no
    host read) are graph-safe."""
    from .attention import AttentionRecipe
    from .experts import experts_modules

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "hf_fp4":
        recipe = AttentionRecipe.build(getattr(config, "hf_fp4_attention", None) or "nvfp4")
        backend = getattr(config, "hf_fp4_attention_backend", "auto")
        if recipe.stochastic or backend == "reference" or (backend == "auto" and not torch.cuda.is_available()):
            return False
    if getattr(config, "_experts_implementation", None) == "hf_fp4":
        return all(getattr(m, "hf_fp4", None) is not None and m.hf_fp4.layer_reason(m) is None
                   for m in experts_modules(model).values())
    return True


def resolve_mode(mode: str, backend: str = "inductor", model: nn.Module | None = None) -> str:
    """"auto": CUDA graphs (reduce-overhead) where there is a GPU, inductor compiles and the model allows it
    (graph_safe), else "default"."""
    if mode not in MODES:
        raise ValueError(f"compile mode {mode!r}: valid modes are {', '.join(MODES)}")
    if backend not in BACKENDS:
        raise ValueError(f"compile backend {backend!r}: valid backends are {', '.join(BACKENDS)}")
    if mode == "auto":
        graphs = torch.cuda.is_available() and backend == "inductor" and graph_safe(model)
        return "reduce-overhead" if graphs else "default"
    return mode


def uses_cuda_graphs(mode: str, backend: str = "inductor", model: nn.Module | None = None) -> bool:
    """Whether compile_model(model, mode, backend) runs the blocks under CUDA graphs."""
    return backend == "inductor" and resolve_mode(mode, backend, model) in CUDA_GRAPH_MODES


def compile_model(model: nn.Module, mode: str = "auto", backend: str = "inductor") -> nn.Module:
    """torch.compile every decoder block of `model` in place and return the model.

    Regional compilation: the blocks are Transformers' own list (`_no_split_modules`), identical blocks share
    one compiled graph, so compile time does not grow with depth; a model that names no block class is
    compiled whole.  Under a CUDA-graph mode call `torch.compiler.cudagraph_mark_step_begin()` before each
    training or evaluation forward (the trainer does).
    """
    from .attention import cache_recipes

    cache_recipes(model)  # FP4 attention's recipe built now: no graph break at a block's first compiled call
    place_rng_states(model)  # the experts' and SR attention's counters on the model's device, not in a graph
    graphs = uses_cuda_graphs(mode, backend, model)
    mode = resolve_mode(mode, backend, model)
    opaque = graphs or not graph_safe(model)  # see the module docstring
    for layer in fp4_modules(model).values():
        layer.cuda_graphs = opaque
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    for m in blocks or [model]:
        m.compile(backend=backend, dynamic=False, **({"mode": mode} if backend == "inductor" else {}))
    return model


def compiled_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that compile_model compiled."""
    return [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
