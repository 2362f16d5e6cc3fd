"""Muon: momentum orthogonalised by Newton-Schulz iterations, optionally with NVFP4 operands."""
from __future__ import annotations

import torch

from ..nn.operands import quantized_matmul
from ..numerics.spec import QuantSpec, as_spec
from ._common import _run_closure, _with_grads

#: x <- a x + (b S + c S^2) x with S = x x^T.  "quintic": Muon's (Jordan et al., 2024), fast but stable only
#: while every singular value stays below ~1.3 -- with NVFP4 operands (~12% error in S) it diverges (measured:
#: tests/test_optim.py, benchmarks/optim-2026-12-01.md).  "cubic": the classic Newton-Schulz step, contractive
#: for singular values in (0, sqrt 3), slower to converge, and as accurate with NVFP4 operands as in BF16.
NS_ITERATIONS = {"quintic": (3.4445, -4.7750, 2.0315), "cubic": (1.5, -0.5, 0.0)}


def _matmul(a: torch.Tensor, b: torch.Tensor, spec: QuantSpec | None) -> torch.Tensor:
    """a [m, k] @ b [k, n]: in BF16, or with both operands quantized along k (blocks of the contraction
    dimension, as hf_fp4's GEMMs take them) through the linear layers' operand and GEMM path
    (hf_fp4.nn.operands.quantized_matmul: the kernels and exact fast GEMMs on CUDA, the reference elsewhere)."""
    if spec is None:
        return a.bfloat16() @ b.bfloat16()
    return quantized_matmul(a.float(), b.float(), spec)


def newton_schulz(g: torch.Tensor, steps: int = 5, spec: "QuantSpec | str | None" = None,
                  iteration: str = "quintic") -> torch.Tensor:
    """Approximately U V^T of g = U S V^T, every matmul in BF16 or, with `spec` (e.g. "nvfp4"), with quantized
    operands.  Returns FP32 of g's shape.  See NS_ITERATIONS for the two iterations.  g may be a stack
    [B, m, n] of matrices: each is orthogonalised alone (its own norm), in batched matmuls in BF16 -- Muon
    steps its same-shaped matrices so, a launch per matmul for all of them -- and one by one with `spec` (a
    quantized operand's tensor scale is its own matrix's)."""
    spec = as_spec(spec) if spec is not None else None
    if spec is not None and g.dim() == 3:
        return torch.stack([newton_schulz(m, steps, spec, iteration) for m in g])
    a, b, c = NS_ITERATIONS[iteration]
    x = g.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(steps):
        s = _matmul(x, x.mT, spec).float()
        poly = b * s + c * _matmul(s, s, spec).float() if c else b * s
        x = a * x + _matmul(poly, x, spec).float()
    return x.mT if tall else x


class GraphedNewtonSchulz:
    """`newton_schulz` replayed from one CUDA graph per input shape: Muon's step runs the same matrices through
    the same iterations every step, and with NVFP4 operands each matmul is a few Triton launches plus host work
    per matrix (bench-50m's Muon + NVFP4 step was host-bound, 882 ms).  The first call per shape warms up on a
    side stream (Triton compiles there), then captures; later calls copy the input in, replay, and return the
    graph's output tensor -- valid until the next call with the same shape.  The same kernels run, so the
    result equals eager `newton_schulz` bit for bit (tests/test_optim.py, on a GPU)."""

    def __init__(self, steps: int, spec, iteration: str):
        self.args = (steps, spec, iteration)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        key = (tuple(g.shape), g.dtype, g.device)
        if key not in self.graphs:
            static_in = g.clone()
            side = torch.cuda.Stream(g.device)
            side.wait_stream(torch.cuda.current_stream(g.device))
            with torch.cuda.stream(side):
                newton_schulz(static_in, *self.args)
            torch.cuda.current_stream(g.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA work (a data loader's pinned copies) does not void the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static_out = newton_schulz(static_in, *self.args)
            self.graphs[key] = (graph, static_in, static_out)
        graph, static_in, static_out = self.graphs[key]
        static_in.copy_(g)
        graph.replay()
        return static_out


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked ``muon=True`` (the hidden weight matrices), AdamW for the others
    (embeddings, norms, LM head) -- one optimizer, so accelerate, schedulers and checkpoints see one.  Each
    group's ``lr`` is its own (Muon's is typically ~10x AdamW's), so an LR schedule scales both.

    Muon: buf = mu buf + g; u = g + mu buf (Nesterov); p -= lr (NS(u) sqrt(max(1, rows / cols)) + wd p).
    ``ns_spec="nvfp4"`` runs the Newton-Schulz matmuls with NVFP4 operands (`newton_schulz`); it needs
    ``ns_iteration="cubic"`` (the quintic diverges with 4-bit operands) and more steps (e.g. 12).
    ``ns_cuda_graphs`` (default True) replays each batch's Newton-Schulz from a CUDA graph on CUDA devices
    (`GraphedNewtonSchulz`: the same kernels, the same result, without the host work of each launch)."""

    def __init__(self, param_groups, lr: float = 0.02, momentum: float = 0.95, ns_steps: int = 5,
                 ns_spec: "str | None" = None, ns_iteration: str = "quintic", weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, ns_cuda_graphs: bool = True):
        if ns_iteration not in NS_ITERATIONS:
            raise ValueError(f"ns_iteration={ns_iteration!r}: valid values are {', '.join(NS_ITERATIONS)}")
        if ns_spec is not None:
            as_spec(ns_spec)  # an unknown spec name fails here
            if ns_iteration == "quintic":
                raise ValueError(f"ns_spec={ns_spec!r} with ns_iteration='quintic': the quintic iteration diverges "
                                 "with 4-bit operands (its error pushes singular values past its stable range); "
                                 "use ns_iteration='cubic' (e.g. with ns_steps=12)")
        self.ns_iteration = ns_iteration
        if not 0.0 <= momentum < 1.0 or ns_steps < 1:
            raise ValueError(f"need 0 <= momentum < 1 and ns_steps >= 1; got {momentum}, {ns_steps}")
        self.ns_spec = ns_spec
        self.ns_cuda_graphs = bool(ns_cuda_graphs)
        self._graphed: dict[int, GraphedNewtonSchulz] = {}  # by ns_steps (a group's own)
        defaults = dict(lr=lr, momentum=momentum, ns_steps=ns_steps, weight_decay=weight_decay, betas=tuple(betas),
                        eps=eps, muon=False)
        super().__init__(param_groups, defaults)
        for group in self.param_groups:
            if group["muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon groups take 2-D weight matrices only; put other parameters in a muon=False "
                                 "group (AdamW)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        batches: dict[tuple, list] = {}  # Muon's matrices by (shape, device, group): one batched Newton-Schulz each
        for group, p in _with_grads(self):
            g, state = p.grad.float(), self.state[p]
            if group["muon"]:
                buf = state.setdefault("momentum_buffer", torch.zeros_like(g))
                buf.mul_(group["momentum"]).add_(g)
                key = (tuple(p.shape), p.device, id(group))
                batches.setdefault(key, []).append((group, p, g.add(buf, alpha=group["momentum"])))
                continue
            b1, b2 = group["betas"]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["m"], state["v"] = torch.zeros_like(g), torch.zeros_like(g)
            state["step"] += 1
            t = float(state["step"])
            state["m"].mul_(b1).add_(g, alpha=1 - b1)
            state["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (state["v"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
            master = p.float().mul_(1 - group["lr"] * group["weight_decay"])
            p.copy_(master.addcdiv_(state["m"], denom, value=-group["lr"] / (1 - b1 ** t)))
        for items in batches.values():
            group = items[0][0]
            us = self._newton_schulz(torch.stack([u for _, _, u in items]), group["ns_steps"])
            for (_, p, _), u in zip(items, us):
                scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
                master = p.float().mul_(1 - group["lr"] * group["weight_decay"])
                p.copy_(master.add_(u, alpha=-group["lr"] * scale))
        return loss

    def _newton_schulz(self, g: torch.Tensor, steps: int) -> torch.Tensor:
        if not (self.ns_cuda_graphs and g.is_cuda):
            return newton_schulz(g, steps, self.ns_spec, self.ns_iteration)
        if steps not in self._graphed:
            self._graphed[steps] = GraphedNewtonSchulz(steps, self.ns_spec, self.ns_iteration)
        return self._graphed[steps](g)


def orthogonality_error(o: torch.Tensor, g: torch.Tensor) -> float:
    """|| o - U V^T ||_F / || U V^T ||_F: the distance of an orthogonalisation o of g from g's exact polar factor."""
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    polar = u @ vh
    return float((o.double() - polar).norm() / polar.norm())
