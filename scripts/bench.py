#!/usr/bin/env python
"""Side-by-side GPU benchmark: operand quantization, linear forward + backward, end-to-end train steps.

    python scripts/bench.py [--parts quant,linear,e2e] [--quick] [--out DIR]
    python scripts/bench.py --parts attention,moe [--impls hf_fp4:nvfp4,...]   (issues 12 and 16)
    python scripts/bench.py --merge A.json B.json ... --out benchmarks   # one results file from several runs

Every part puts the peers in the same process as hf_fp4: a device copy and torchao's `to_mx` (compiled)
for quantization; bf16 nn.Linear (eager and compiled), torchao float8 tensorwise / rowwise (compiled)
and a plain NVFP4 fake-quant autograd function under torch.compile ("emulation_compiled") for the
linear layer and the end-to-end step.  Times are medians of CUDA-event measurements after warm-up,
rotating among several inputs; the linear part times each impl twice, each call waited for and calls back to
back (timed(stream=True): the host runs ahead, as between the layers of a training step).  Writes
results-<date>.json ({"device", "versions", "command", "linear", "e2e", "quant"}) and results-<date>.md under --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch._dynamo.utils import counters

import hf_fp4
from hf_fp4 import FP4Linear, QuantSpec, preset
from hf_fp4.extras import versions as package_versions
from hf_fp4.nn.recipe import PRESET_NAMES
from hf_fp4.numerics.spec import ScaleRule

FP4_PRESETS = [p for p in PRESET_NAMES if p != "bf16"]
#: "hf_fp4:<preset>+bf16gemm[:mode]": the MX family's GEMMs on the BF16 tensor cores (FP4Linear.fp8_gemms=False)
MX_PRESETS = ("mxfp4", "mxfp4_dh", "tib")
VARIANTS = ("", "bf16gemm")


def hf_fp4_impl(name: str) -> tuple[str, bool, str]:
    """'hf_fp4:mxfp4+bf16gemm:graphs' -> ('mxfp4', fp8_gemms=False, 'graphs')."""
    token, _, mode = name.removeprefix("hf_fp4:").partition(":")
    recipe, _, variant = token.partition("+")
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant +{variant} in {name}; valid: +bf16gemm")
    return recipe, variant != "bf16gemm", mode
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)


# ----------------------------------------------------------------------------------------------
# Timing
def timed(fn, inputs, warmup=3, reps=10, graphs=False, stream=False):
    """Median milliseconds of fn(*inputs[i % len(inputs)]) (CUDA events on GPU).  graphs: fn runs
    torch.compile(mode="reduce-overhead") code, so each call starts a new CUDA-graph step.

    By default the host waits for each call to finish before starting the next, so a call's host-side launch
    cost shows as GPU idle time at its start.  stream: the calls run back to back, as the layers of a training
    step do (the host runs ahead of the GPU; one synchronisation after the last): a call's time is then the GPU's
    time between its events, host cost showing only where the host cannot keep up."""
    cuda = torch.cuda.is_available()
    times, events = [], []
    for i in range(warmup + reps):
        args = inputs[i % len(inputs)]
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        if cuda:
            if stream and i == warmup:
                torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            if not stream or i < warmup:
                end.synchronize()
            if i >= warmup:
                events.append((start, end))
        else:
            t0 = time.perf_counter()
            fn(*args)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    if events:
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    return statistics.median(times)


def captured_ms(fn, args, reps=20) -> float | None:
    """Median milliseconds of one replay of fn(*args) captured in a CUDA graph with static inputs: the GPU time of
    its kernels alone -- no host launch cost, and none of the input copies a CUDA-graph tree adds per step (its
    bf16_graphs row: 1.12 ms against bf16's 1.06 back to back at 4096x4096 in session 19), as inside a whole
    captured training step.  None on the CPU, for torch.compile(mode="reduce-overhead") impls (graphs of their
    own) and where capture fails (a host synchronisation inside fn)."""
    if not torch.cuda.is_available():
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream (lazy initialisation, autotuning)
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn(*args)
    except RuntimeError as err:
        print(f"note: capture failed: {str(err)[:160]}", file=sys.stderr)
        torch.cuda.synchronize()
        return None
    graph.replay()
    torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    ms = statistics.median(start.elapsed_time(end) for start, end in events)
    del graph
    return ms


# ----------------------------------------------------------------------------------------------
# The emulation peer: what a user writes in 30 lines -- NVFP4 fake quantization (two-level scales,
# E2M1 round-to-nearest), three GEMMs in an autograd function, all under torch.compile.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fake_nvfp4(t: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake quantization along the last dim (1x16 blocks, UE4M3 block scale, FP32 tensor scale)."""
    m, k = t.shape
    b = t.float().reshape(m, k // 16, 16)
    s_enc = 448.0 * 6.0 / t.abs().amax().float().clamp_min(1e-30)
    s_b = (b.abs().amax(-1, keepdim=True) / 6.0 * s_enc).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    scale = s_b / s_enc
    v = (b / scale.clamp_min(1e-30)).abs().clamp(max=6.0)
    q = torch.zeros_like(v)
    for mid, lo, hi in zip(E2M1_MIDPOINTS, E2M1_VALUES[:-1], E2M1_VALUES[1:]):
        q = torch.where(v > mid, torch.full_like(v, hi), q)
    return (torch.sign(b) * q * scale).reshape(m, k).to(t.dtype)


class EmulatedNVFP4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return fake_nvfp4(x) @ fake_nvfp4(w).t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = fake_nvfp4(dy) @ fake_nvfp4(w.t().contiguous()).t()
        dw = fake_nvfp4(dy.t().contiguous()) @ fake_nvfp4(x.t().contiguous()).t()
        return dx, dw


class EmulatedLinear(nn.Linear):
    def forward(self, x):
        shape = x.shape
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        with torch.autocast("cuda", enabled=False):
            y = EmulatedNVFP4.apply(x.reshape(-1, shape[-1]).to(dtype), self.weight.to(dtype))
        return y.reshape(*shape[:-1], -1)


class EmulatedGroupedNVFP4(torch.autograd.Function):
    """The experts' GEMMs of the emulation: x [R, K] (rows sorted by expert, segments ending at offs [E]) times
    every expert's w [E, N, K]; each operand NVFP4 fake-quantized as one tensor, blocks along its GEMM's
    contraction (the tokens for wgrad, across experts' segments), torch._grouped_mm in BF16."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        e, n, k = w.shape
        return torch._grouped_mm(fake_nvfp4(x), fake_nvfp4(w.reshape(e * n, k)).view(e, n, k).transpose(1, 2),
                                 offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        e, n, k = w.shape
        wt = w.transpose(1, 2).contiguous()
        dx = torch._grouped_mm(fake_nvfp4(dy), fake_nvfp4(wt.reshape(e * k, n)).view(e, k, n).transpose(1, 2),
                               offs=offs)
        # the tokens (wgrad's contraction, split by offs) as the operands' outer dim, as torch's own backward
        # passes them: CUDA's grouped GEMM needs each group's start 16-byte aligned along a contiguous dynamic dim
        # (session 23's device-side assert: groups of any token count)
        dyt = fake_nvfp4(dy.t().contiguous()).t().contiguous().t()  # [N, R], blocks along R, R outer
        xq = fake_nvfp4(x.t().contiguous()).t().contiguous()  # [R, K], blocks along R, R outer
        dw = torch._grouped_mm(dyt, xq, offs=offs)
        return dx, dw, None


class EmulatedExperts(nn.Module):
    """The MoE part's emulation peer: Transformers' Qwen3-MoE experts written plainly over their 3D weights --
    tokens sorted by expert, the two projections through EmulatedGroupedNVFP4, SiLU gate, routing weights and a
    scatter-add -- as a user would, under torch.compile."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts

    def forward(self, hidden, top_k_index, top_k_weights):
        m, dev, dtype = self.experts, hidden.device.type, torch.bfloat16  # BF16 GEMMs, as the FP4 rows'
        e, k = m.gate_up_proj.shape[0], top_k_index.shape[1]
        with torch.autocast(dev, enabled=False):
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.zeros(e, dtype=torch.int32, device=flat.device).scatter_add_(
                0, flat, torch.ones_like(flat, dtype=torch.int32))
            offs = counts.cumsum(0, dtype=torch.int32)
            token = order // k
            h = EmulatedGroupedNVFP4.apply(hidden.to(dtype)[token], m.gate_up_proj.to(dtype), offs)
            gate, up = h.chunk(2, dim=-1)
            y = EmulatedGroupedNVFP4.apply(nn.functional.silu(gate) * up, m.down_proj.to(dtype), offs)
            y = y.float() * top_k_weights.reshape(-1)[order, None].float()
            out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).index_add_(0, token, y)
        return out.to(hidden.dtype)


def swap_to_emulation(model: nn.Module) -> nn.Module:
    from hf_fp4.nn.swap import swap_linear_layers

    def make(name, linear):
        if name.endswith("lm_head"):
            return None
        new = EmulatedLinear.__new__(EmulatedLinear)
        nn.Module.__init__(new)
        new.in_features, new.out_features, new.weight, new.bias = (linear.in_features, linear.out_features,
                                                                   linear.weight, linear.bias)
        return new
    swap_linear_layers(model, make)
    return model


def torchao_float8(module: nn.Module, recipe: str, fsdp_all_gather: bool = False) -> nn.Module | None:
    """torchao's float8 training (recipe: tensorwise | rowwise); fsdp_all_gather: its FSDP2 float8 all-gather of
    the weights (tensorwise scaling only)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as err:  # noqa: BLE001 - any import problem means the peer is unavailable
        print(f"torchao float8 unavailable: {err}")
        return None
    cfg = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather:
        cfg = dataclasses.replace(cfg, enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(module, config=cfg, module_filter_fn=lambda m, fqn: "lm_head" not in fqn)


# ----------------------------------------------------------------------------------------------
def graph_ms(fn, inputs, reps=20):
    """GPU time of fn: the median replay of a captured CUDA graph per input (launch overhead excluded;
    the eager path's host overhead is what torch.compile's CUDA graphs remove in training)."""
    if not torch.cuda.is_available():
        return timed(fn, inputs)
    graphs = []
    for args in inputs:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(*args)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*args)
        graphs.append((g,))
    return timed(lambda g: g.replay(), graphs, reps=reps)


def bench_quant(dev, n, results):
    """Operand quantization of an n x n bf16 tensor, against a device copy and torchao's to_mx."""
    from hf_fp4.nn.operands import OperandPlan, operands
    from hf_fp4.kernels.quant import triton_quantize

    inputs = [(torch.randn(n, n, device=dev, dtype=torch.bfloat16),) for _ in range(3)]
    copy_ms = graph_ms(lambda x: x.clone(), inputs)
    copy_gbs = 4 * n * n / copy_ms / 1e6
    rows = [("copy", copy_ms, 4 * n * n, 4 * n * n)]  # (label, ms, bytes read once + written, bytes moved)
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx

        for label, elem in (("torchao_to_mx_compiled:mxfp8", torch.float8_e4m3fn),
                            ("torchao_to_mx_compiled:mxfp4", torch.float4_e2m1fn_x2)):
            f = torch.compile(lambda x, e=elem: to_mx(x, e, 32))
            f(*inputs[0])  # compile outside the graph capture
            nbytes = n * n * (2 + (1 if elem == torch.float8_e4m3fn else 0.5))
            rows.append((label, graph_ms(f, inputs), nbytes, nbytes))
    except Exception as err:  # noqa: BLE001
        print(f"torchao to_mx unavailable: {err}")
    seeds = torch.tensor([1, 2], device=dev)
    signs = hf_fp4.seeded_signs(16, 0).to(dev)

    def plan(name, form, h=0, sr=False):
        spec = QuantSpec.preset(name)
        if sr:
            spec = dataclasses.replace(spec, rounding="stochastic")
        return OperandPlan.single(spec, form, h, h > 0)

    out_bytes = {"fp8": 1, "bf16": 2}
    cases = [  # label, plans (rows of t, rows of t^T), signs
        ("mxfp4 (fp8)", (plan("mxfp4", "fp8"), None)),
        ("mxfp4_up (fp8)", (plan("mxfp4_up", "fp8"), None)),
        ("nvfp4 (bf16)", (plan("nvfp4", "bf16"), None)),
        ("ufp4 (bf16)", (plan("ufp4", "bf16"), None)),
        ("int4 (bf16)", (plan("int4", "bf16"), None)),
        ("mxfp8 (bf16)", (plan("mxfp8", "bf16"), None)),
        ("mxfp4 transposed (fp8)", (None, plan("mxfp4", "fp8"))),
        ("nvfp4 transposed (bf16)", (None, plan("nvfp4", "bf16"))),
        ("mxfp4 dual (fp8, fp8)", (plan("mxfp4", "fp8"), plan("mxfp4", "fp8"))),
        ("nvfp4 dual (bf16, bf16)", (plan("nvfp4", "bf16"), plan("nvfp4", "bf16"))),
        ("mxfp4_2d_up dual (fp8)", (plan("mxfp4_2d_up", "fp8"), plan("mxfp4_2d_up", "fp8"))),
        ("nvfp4 SR (bf16)", (plan("nvfp4", "bf16", sr=True), None)),
        ("mxfp4 SR (fp8)", (plan("mxfp4", "fp8", sr=True), None)),
        ("ufp4 RHT-16 (bf16)", (plan("ufp4", "bf16", h=16), None)),
        ("ufp4 RHT-16 + SR dual (bf16)", (plan("ufp4", "bf16", h=16), plan("ufp4", "bf16", h=16, sr=True))),
        ("mxfp4_dh H-32 transposed (fp8)", (None, plan("mxfp4", "fp8", h=32))),
    ]
    for label, plans in cases:
        s = tuple(hf_fp4.seeded_signs(p.hadamard, 0).to(dev) if p is not None and p.hadamard else None
                  for p in plans)
        ms = graph_ms(lambda x, p=plans, s=s: operands(x, p, seeds, s), inputs)
        written = sum(out_bytes[p.form] for p in plans if p is not None)
        stats_read = 2 if any(p is not None and p.stat for p in plans) else 0  # the statistics pass's read of t
        rows.append((f"hf_fp4:{label}", ms, n * n * (2 + written), n * n * (2 + written + stats_read)))
    for name in ("mxfp4", "nvfp4"):  # packed codes + scales (export path; "propagate": no host check)
        spec = dataclasses.replace(QuantSpec.preset(name), nonfinite="propagate")
        ms = graph_ms(lambda x, s=spec: triton_quantize(x, s), inputs)
        nbytes = n * n * (2 + spec.bits_per_value / 8)
        amax_read = n * n * 2 if spec.scale is ScaleRule.UE4M3_FP32 else 0  # triton_quantize's statistics pass
        rows.append((f"hf_fp4:{name} packed codes", ms, nbytes, nbytes + amax_read))
    del signs
    for label, ms, nbytes, moved in rows:
        gbs = nbytes / ms / 1e6
        results["quant"].append({"tensor": f"{n}x{n}", "impl": label, "ms": round(ms, 4), "gb_per_s": round(gbs, 1),
                                 "of_copy_bw": round(gbs / copy_gbs, 3),
                                 "moved_of_copy_bw": round(moved / ms / 1e6 / copy_gbs, 3)})
    return quant_table(results["quant"])


def quant_table(rows: list[dict]) -> str:
    """The quantization part's table: bandwidth by the bytes an operand needs (t read once, the operands written)
    and by the bytes its kernels move (the statistics pass's read of t too: the tensor amax of two-level formats,
    the row amax of the FP8 form)."""
    table = [[q["impl"], f"{q['ms']:.3f}", f"{q['gb_per_s']:.0f}", f"{q['of_copy_bw']:.0%}",
              f"{q['moved_of_copy_bw']:.0%}" if "moved_of_copy_bw" in q else "-"] for q in rows]
    return md_table(f"Operand quantization of a {rows[0]['tensor']} bf16 tensor, GPU time (CUDA-graph replay; "
                    "% of the device copy's bytes/s by the bytes read once + written, and by the bytes moved: the "
                    "statistics pass's read counted)", ["impl", "ms", "GB/s (read once)", "% of copy (read once)",
                                                        "% of copy (bytes moved)"], table)


def linear_impls(k, n, dev, names):
    """name -> module (fwd+bwd is timed), built on demand so only one lives at a time."""
    def base():
        torch.manual_seed(0)
        return nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)

    for name in names:
        torch._dynamo.reset()  # every compiled impl starts fresh (no recompile limit across impls)
        if name == "bf16":
            yield name, base()
        elif name == "bf16_compiled":
            yield name, torch.compile(base())
        elif name.startswith("torchao_fp8_"):
            m = torchao_float8(nn.Sequential(base()), name.removeprefix("torchao_fp8_"))
            if m is not None:
                yield name, torch.compile(m)
        elif name == "emulation_compiled":
            yield name, torch.compile(swap_to_emulation(nn.Sequential(base())))
        elif name == "bf16_graphs":
            yield name, torch.compile(base(), mode="reduce-overhead")
        else:
            recipe, fp8_gemms, mode = hf_fp4_impl(name)
            layer = FP4Linear.from_linear(base(), preset(recipe).linear, name="bench")
            layer.cuda_graphs = mode == "graphs"  # as hf_fp4.compile_model sets it
            layer.fp8_gemms = fp8_gemms
            if mode:
                layer = torch.compile(layer, mode="reduce-overhead" if mode == "graphs" else "default")
            yield name, layer


def spread_rows(t: torch.Tensor, octaves: float = 12.0, run: int = 64) -> torch.Tensor:
    """Each run of `run` consecutive rows (tokens) scaled by one 2^u, u uniform in [-octaves, octaves]: the
    spread of a trained model's activations and gradients along T.  Whole 32-token blocks of a wgrad row
    then lie more than 14 binades below the row's largest (the FP8 form's lost blocks, recomputed by the
    correction).  (Scaling each token on its own almost never did: a block's maximum over 32 tokens stays
    near the row's, so the correction was never timed -- benchmarks/results-2026-12-02.md.)"""
    g = torch.Generator(device=t.device).manual_seed(t.shape[1])
    u = torch.rand(-(-t.shape[0] // run), 1, generator=g, device=t.device) * 2 * octaves - octaves
    return (t.float() * torch.exp2(u).repeat_interleave(run, 0)[:t.shape[0]]).to(t.dtype)


def linear_step(layer, x, dy):
    """One forward + backward of a linear impl as the linear part times it: gradients are not accumulated (CUDA-graph
    outputs are reused memory)."""
    layer(x).backward(dy)
    x.grad = None
    for p in layer.parameters():
        p.grad = None


class ClockLog:
    """The GPU's median SM clock (MHz) and power draw (W) while a block runs, polled by nvidia-smi every 20 ms in
    the background; None for both without nvidia-smi (the CPU).  Session 19's bf16 layer took 5-9% longer back to
    back than waited at the large shapes, clocks unknown: the linear part now records them beside each timing."""

    def __enter__(self):
        self.sm_mhz = self.watts = None
        device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--id={device}", "--query-gpu=clocks.sm,power.draw",
                                          "--format=csv,noheader,nounits", "-lms", "20"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return
        self.proc.terminate()
        samples = []
        for line in self.proc.communicate()[0].splitlines():
            try:
                samples.append(tuple(float(v) for v in line.split(",")[:2]))
            except ValueError:  # "[N/A]" or a line cut by the termination
                continue
        if samples:
            self.sm_mhz = statistics.median(s[0] for s in samples)
            self.watts = statistics.median(s[1] for s in samples)


def linear_times(layer, name, inputs) -> tuple[float, float, float | None, dict]:
    """(ms with each call waited for, ms back to back, ms of a captured replay (captured_ms; None for the
    reduce-overhead impls), the GPU's median SM clock and power during each) of linear_step over the rotating
    inputs (the capture: the first)."""
    step, graphs = functools.partial(linear_step, layer), name.endswith("graphs")
    with ClockLog() as waited_clock:
        waited = timed(step, inputs, warmup=3, reps=20, graphs=graphs)
    with ClockLog() as stream_clock:
        stream = timed(step, inputs, warmup=3, reps=20, graphs=graphs, stream=True)
    with ClockLog() as captured_clock:
        captured = None if graphs else captured_ms(step, inputs[0])
    return waited, stream, captured, {"sm_mhz": waited_clock.sm_mhz, "watts": waited_clock.watts,
                                      "sm_mhz_stream": stream_clock.sm_mhz, "watts_stream": stream_clock.watts,
                                      "sm_mhz_captured": captured_clock.sm_mhz}


def bench_linear(dev, tokens, shapes, results, names, spread=False):
    runs = []
    make = spread_rows if spread else (lambda t: t)
    for k, n in shapes:
        inputs = [(make(torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)).requires_grad_(),
                   make(torch.randn(tokens, n, device=dev, dtype=torch.bfloat16))) for _ in range(3)]
        for name, layer in linear_impls(k, n, dev, names):
            ms, ms_stream, ms_captured, clocks = linear_times(layer, name, inputs)
            runs.append({"shape": f"{k}x{n}", "tokens": tokens, "impl": name, "ms": round(ms, 4),
                         "ms_stream": round(ms_stream, 4),
                         "ms_captured": None if ms_captured is None else round(ms_captured, 4),
                         "inputs": "spread" if spread else "normal", **clocks})
            del layer
            torch.cuda.empty_cache() if dev == "cuda" else None
    results["linear"] += runs
    return linear_tables(runs, clocks=True)


#: The linear part's timings: (result field, how it was timed)
LINEAR_TIMINGS = (("ms", "each call waited for"),
                  ("ms_stream", "calls back to back: the host runs ahead, as in a training step"),
                  ("ms_captured", "one step captured in a CUDA graph with static inputs, replayed: GPU time only, no "
                   "host cost, no graph-tree input copies; '-': reduce-overhead impls"))


def linear_tables(runs, clocks=False) -> str:
    """The linear part's tables from its result records (one inputs kind, one token count): one per timing, each
    cell ms and the speed against bf16 of the same shape ('-' where an impl lacks the timing); clocks: also the
    GPU's median SM clock during each timing."""
    impls = list(dict.fromkeys(r["impl"] for r in runs))
    shapes = list(dict.fromkeys(r["shape"] for r in runs))
    spread = runs[0].get("inputs") == "spread"
    what = ", runs of 64 rows of x and dy spread over 2^-12..2^12 (spread_rows)" if spread else ""
    text = []
    for field, how in LINEAR_TIMINGS:
        if not any(r.get(field) is not None for r in runs):
            continue
        rows = []
        for shape in shapes:
            ms = {r["impl"]: r[field] for r in runs if r["shape"] == shape and r.get(field) is not None}
            rows.append([shape] + [f"{ms[i]:.2f} ({ms['bf16'] / ms[i]:.2f}x)" if i in ms and "bf16" in ms
                                   else f"{ms[i]:.2f}" if i in ms else "-" for i in impls])
        text.append(md_table(f"Linear forward + backward, {runs[0]['tokens']} tokens{what}, bf16 (ms; speed vs bf16 "
                             f"nn.Linear; {how})", ["K x N"] + impls, rows))
    if clocks:
        keys = ("sm_mhz", "sm_mhz_stream", "sm_mhz_captured")
        rows = [[shape] + [" / ".join("-" if r.get(key) is None else f"{r[key]:.0f}" for key in keys)
                           for i in impls for r in runs if r["shape"] == shape and r["impl"] == i] for shape in shapes]
        text.append(md_table("The GPU's median SM clock during each timing, MHz (waited / back to back / captured; "
                             "nvidia-smi every 20 ms)", ["K x N"] + impls, rows))
    return "\n".join(text)


def build_model(name, cfg_kwargs, dev):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**cfg_kwargs)
    if name.startswith("hf_fp4:"):
        recipe, fp8_gemms, _ = hf_fp4_impl(name)
        model = AutoModelForCausalLM.from_config(cfg, quantization_config=hf_fp4.FP4TrainConfig(recipe))
        hf_fp4.set_fp8_gemms(model, fp8_gemms)
    else:
        model = AutoModelForCausalLM.from_config(cfg)
    model = model.to(dev)
    if name.startswith("torchao_fp8_"):
        model = torchao_float8(model, name.removeprefix("torchao_fp8_").removesuffix(":compiled"))
    if name.startswith("emulation"):
        model = swap_to_emulation(model)
    if name.endswith(("compiled", "graphs")) and model is not None:  # as the trainer compiles: block by block
        hf_fp4.compile_model(model, "reduce-overhead" if name.endswith("graphs") else "default")
    return model, cfg


def train_step(model, dev):
    """(step(ids), optimizer): one train step -- bf16 autocast on GPU, fused AdamW, no KV cache (a cache
    makes every compiled block recompile per layer)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")

    def step(ids):
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt


def bench_e2e(dev, label, cfg_kwargs, batch, seq, steps, results, names, save=lambda: None):
    """Train steps of one model per impl; save() after each impl (a long run keeps what it measured)."""
    table, base = [], None
    for name in names:
        torch._dynamo.reset()
        model, cfg = build_model(name, cfg_kwargs, dev)
        if model is None:
            continue
        step, opt = train_step(model, dev)
        inputs = [(torch.randint(0, cfg.vocab_size, (batch, seq), device=dev),) for _ in range(3)]
        t0 = time.perf_counter()
        counters.clear()
        ms = timed(step, inputs, warmup=3, reps=steps, graphs=name.endswith("graphs"))
        tps = batch * seq / (ms / 1e3)
        base = base or tps
        results["e2e"].append({"model": label, "impl": name, "tokens_per_s": round(tps), "step_ms": round(ms, 2),
                               "tokens_per_step": batch * seq,
                               "cudagraph_skips": counters["inductor"]["cudagraph_skips"]})
        table.append([name, f"{tps:,.0f}", f"{tps / base:.2f}x", f"{time.perf_counter() - t0:.0f}"])
        print(table[-1], flush=True)
        save()
        del model, opt
        torch.cuda.empty_cache() if dev == "cuda" else None
    return md_table(f"End-to-end train step, {label}, {batch}x{seq} tokens, fp32 master weights, bf16 autocast, "
                    "fused AdamW", ["impl", "tokens/s", "vs first row", "wall s (incl. compile)"], table)


def md_table(title, header, rows):
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    return text


def bench50m_model() -> dict:
    import yaml

    cfg = yaml.safe_load((Path(__file__).resolve().parent.parent / "configs" / "bench-50m.yaml").read_text())
    return cfg["model"], cfg


def sdpa_backend(q, k, v, **options) -> str:
    """The backend PyTorch's default SDPA dispatch picks for these inputs ("flash_attention", "cudnn_attention",
    ...).  PyTorch puts cuDNN's kernels first on sm_90 when its cuDNN passes a version gate
    (check_prefer_cudnn_attention in sdp_utils.cpp), so the default row need not be the flash backend issue 12
    names: recorded, not assumed."""
    from torch.nn.attention import SDPBackend

    names = {int(value): name.lower() for name, value in SDPBackend.__members__.items()}
    try:
        return names.get(int(torch._fused_sdp_choice(q, k, v, **options)), "unknown")
    except (AttributeError, RuntimeError, TypeError):  # a private API: a torch without it
        return "unknown"


def sdpa_flash(q, k, v, **options):
    """SDPA restricted to its flash backend (in PyTorch's CUDA builds FlashAttention-2's kernels by default)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return nn.functional.scaled_dot_product_attention(q, k, v, **options)


def bench50m_attention() -> tuple[int, int, int, int, int]:
    """(batch, heads, key heads, head_dim, T) of one attention call in configs/bench-50m.yaml's train step (the
    study's model: B16 H10 / 5 T1024 D64)."""
    model, cfg = bench50m_model()
    heads = int(model["num_attention_heads"])
    return (int(cfg["batch_size"]), heads, int(model.get("num_key_value_heads", heads)),
            int(model["hidden_size"]) // heads, int(cfg["seq_len"]))


def attention_inputs(dev, quick, t, shape=None):
    """((batch, heads, key heads, head_dim), (q, k, v)): the attention parts' bf16 inputs of T tokens, seeded;
    shape: (batch, heads, key heads, head_dim) instead of the part's default."""
    b, h, hkv, d = shape or ((1, 4, 2, 32) if quick else (1, 32, 8, 128))
    g = torch.Generator(device=dev).manual_seed(0)
    return (b, h, hkv, d), tuple(torch.randn(b, n, t, d, device=dev, dtype=torch.bfloat16, generator=g)
                                 for n in (h, hkv, hkv))


#: the attention part's rows (an --impls that names some runs only those)
ATTENTION_IMPLS = ("sdpa", "sdpa:flash", "hf_fp4:nvfp4:reference", "hf_fp4:nvfp4:triton")


def bench_attention(dev, quick, results, names=None, model_shape=False):
    """FP4 attention (issue 12) against PyTorch's SDPA (bf16, causal, GQA): forward and forward + backward ms,
    peak memory.  Two SDPA rows: `sdpa` is the default dispatch (its backend recorded), `sdpa:flash` the flash
    backend alone (issue 12's yardstick).  hf_fp4 runs nvfp4 Q/K/V/dS with the reference or the Triton flash
    kernels.  names: the rows to run (--impls), all by default.  model_shape (part attention50m): one attention
    call of bench-50m's train step (bench50m_attention) instead of the issue's B1 H32 T4096 D128, without the
    memory-by-T table (the fullstack study run trained at 99k tokens/s against nvfp4 with LoRA-SVD's 342k: this
    times the attention at the shape that run had)."""
    from hf_fp4.nn.attention import fp4_attention

    shape = None
    if model_shape:
        *shape, t = bench50m_attention()
        if quick:  # the model's heads, fewer rows and tokens
            shape[0], t = 1, 64
    else:
        t = 64 if quick else 4096
    (b, h, hkv, d), (q, k, v) = attention_inputs(dev, quick, t, shape)
    default_backend = sdpa_backend(q, k, v, is_causal=True, enable_gqa=True)
    impls = {"sdpa": lambda q, k, v: nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                 enable_gqa=True),
             "sdpa:flash": lambda q, k, v: sdpa_flash(q, k, v, is_causal=True, enable_gqa=True),
             "hf_fp4:nvfp4:reference": lambda q, k, v: fp4_attention(q, k, v, recipe="nvfp4", causal=True),
             "hf_fp4:nvfp4:triton": lambda q, k, v: fp4_attention(q, k, v, recipe="nvfp4", backend="triton",
                                                                  causal=True)}
    if dev != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        del impls["hf_fp4:nvfp4:triton"]  # Triton on the CPU needs its interpreter
    if names:
        impls = {name: fn for name, fn in impls.items() if name in names}
    if "sdpa:flash" in impls:
        try:  # the flash backend may refuse these inputs (a build whose flash kernels take no GQA): said, not fatal
            impls["sdpa:flash"](q, k, v)
        except RuntimeError as err:
            print(f"sdpa:flash left out: {str(err).splitlines()[0]}", flush=True)
            del impls["sdpa:flash"]
    rows = []
    for name, fn in impls.items():
        row = [name]
        for what in ("fwd", "fwd+bwd"):
            qq, kk, vv = (x.clone().requires_grad_(what != "fwd") for x in (q, k, v))

            def step(qq=qq, kk=kk, vv=vv, what=what):
                out = fn(qq, kk, vv)
                if what != "fwd":
                    out.float().square().mean().backward()
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            ms = timed(step, [()], warmup=2, reps=5)
            peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan")
            # the GPU time alone (as the linear part's): the eager hf_fp4 rows are mostly host time (session 13:
            # forward 2.40 ms eager, its flash kernel 0.56); not for the reference (38 GiB and host checks)
            captured = None if name.endswith(":reference") else captured_ms(step, ())
            results.setdefault("attention", []).append({
                "shape": f"B{b} H{h}/{hkv} T{t} D{d}", "impl": name, "pass": what, "ms": round(ms, 4),
                "ms_captured": None if captured is None else round(captured, 4), "peak_gib": round(peak, 3),
                **({"backend": default_backend} if name == "sdpa" else {})})
            row += [f"{ms:.2f}", "-" if captured is None else f"{captured:.3f}", f"{peak:.2f}"]
        if name == "sdpa":
            row[0] = f"sdpa (default: {default_backend})"
        rows.append(row)
    text = md_table(f"Attention, {'bench-50m, ' if model_shape else ''}B{b} H{h} (GQA {hkv}) T{t} D{d}, causal, bf16 "
                    "inputs (ms waited for; ms of one step captured in a CUDA graph, replayed: GPU time alone; "
                    "peak GiB)",
                    ["impl", "fwd ms", "fwd captured", "fwd GiB", "fwd+bwd ms", "fwd+bwd captured", "fwd+bwd GiB"],
                    rows)
    if model_shape:
        return text
    return text + attention_memory(dev, quick, {n: f for n, f in impls.items() if not n.endswith(":reference")},
                                   results)


def attention_memory(dev, quick, impls, results) -> str:
    """Issue 12's "memory linear in T": the peak memory of one forward + backward above what its inputs hold
    (GiB; and per 1k tokens, flat when linear) at several T, same heads as bench_attention.  CUDA only (the
    allocator's peak); the quadratic reference is left out (38.8 GiB at T 4096)."""
    if dev != "cuda":
        return "Attention memory by T: CUDA only (the allocator's peak)\n"
    rows = []
    for t in ((256, 512, 1024) if quick else (2048, 4096, 8192, 16384)):
        (b, h, hkv, d), (q, k, v) = attention_inputs(dev, quick, t)
        row = [t]
        for name, fn in impls.items():
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn(qq, kk, vv).float().square().mean().backward()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            results.setdefault("attention_memory", []).append({
                "shape": f"B{b} H{h}/{hkv} T{t} D{d}", "T": t, "impl": name, "peak_gib": round(peak, 4),
                "gib_per_1k_tokens": round(peak * 1024 / t, 4)})
            row.append(f"{peak:.3f} ({peak * 1024 / t:.4f})")
            del qq, kk, vv
        rows.append(row)
    return md_table(f"Attention memory by T, B{b} H{h} (GQA {hkv}) D{d}, causal: peak GiB of one forward + backward "
                    "above its inputs (GiB per 1k tokens: flat when linear in T)", ["T", *impls], rows)


MOE_SHAPE = (64, 8, 2048, 768, 16384)  # experts, top-k, hidden, expert size, tokens: issue 16's layer


def moe_steps(dev, quick, names):
    """(name, step, shape) per impl name of bench_moe's layer -- bf16:grouped_mm, bf16:eager (Transformers'
    Qwen3MoeExperts), hf_fp4:<preset> (grouped GEMMs) and hf_fp4:<preset>:loop -- each step one forward +
    backward on the same inputs and routing (also profile_fast_path.py --moe)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from hf_fp4.nn.swap import convert_model

    e, topk, hidden, inter, tokens = (4, 2, 64, 32, 64) if quick else MOE_SHAPE
    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=e, num_experts_per_tok=topk)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16 if dev == "cuda" else torch.float32)
    logits = torch.randn(tokens, e, device=dev, generator=g)
    weights, index = torch.softmax(logits, -1).topk(topk, -1)
    for name in names:
        torch.manual_seed(0)
        holder = nn.Module()
        holder.config = cfg
        # BF16 parameters in every row, as the linear part's nn.Linear: Transformers' grouped_mm is not autocast-aware
        # and runs in its weights' dtype, so FP32 parameters made the bf16 rows FP32 GEMMs (session 19: 105 ms)
        holder.experts = Qwen3MoeExperts(cfg).to(dev, torch.bfloat16 if dev == "cuda" else torch.float32)
        nn.init.normal_(holder.experts.gate_up_proj, std=0.02)
        nn.init.normal_(holder.experts.down_proj, std=0.02)
        module = holder.experts
        if name.startswith("hf_fp4:"):
            convert_model(holder, preset(name.split(":")[1].split("+")[0]))
            holder.experts.hf_fp4.grouped = not name.endswith(":loop")
            holder.experts.hf_fp4.fp8_gemms = "+fp8gemm" in name
        elif name == "emulation_compiled":
            module = torch.compile(EmulatedExperts(holder.experts))
        else:
            cfg._experts_implementation = name.split(":")[1]
        xx = x.clone().requires_grad_()

        def step(module=module, xx=xx):
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                out = module(xx, index, weights.to(xx.dtype))
            out.float().square().mean().backward()
        yield name, step, f"E{e} top{topk} H{hidden} I{inter} T{tokens}"


def moe_names(impls: str | None, loop: bool = True) -> list[str]:
    """The MoE part's rows after Transformers' bf16 ones: the presets --impls lists (all by default), each as
    hf_fp4:<preset> and, where listed, hf_fp4:<preset>+fp8gemm / +bf16gemm (the experts' GEMM form); then the
    first preset's per-expert loop (hf_fp4:<preset>:loop) unless loop is False (--no-moe-loop); the compiled NVFP4
    emulation (EmulatedExperts) last: a device-side assert in one row ends the process (session 23 lost every row
    to one in the emulation, then run first)."""
    listed = None if impls is None else impls.split(",")
    names = []
    for p in FP4_PRESETS:
        names += [f"hf_fp4:{p}{v}" for v in ("", "+fp8gemm", "+bf16gemm")
                  if (listed is None and not v) or (listed is not None and f"hf_fp4:{p}{v}" in listed)]
    first = next((n for n in names if "+" not in n), None)
    names += [f"{first}:loop"] if loop and first else []
    return names + (["emulation_compiled"] if listed is None or "emulation_compiled" in listed else [])


def bench_moe(dev, quick, results, fp4_names, save=lambda: None):
    """One MoE experts layer (issue 16) forward + backward: Transformers' bf16 implementations (grouped_mm,
    eager) against hf_fp4's FP4 experts, same routing; save() after each impl (a device-side assert, which ends the
    process, keeps the rows measured before it: session 23 lost a whole part that way)."""
    # hf_fp4:<preset> takes the grouped GEMMs (hf_fp4.nn.grouped: operands per expert group; BF16 grouped GEMMs --
    # torch._grouped_mm for the MX family, hf_fp4's with per-expert tensor scales for NVFP4 / UFP4); "+fp8gemm" runs
    # the MX family's on hf_fp4's FP8 grouped GEMMs (+bf16gemm: the default, named); ":loop" the per-expert loop
    # (~0.3 s a step on the H200 and its kernels' compiles: session 20's part, three presets each with its loop,
    # ran past 80 s without a row)
    names = ["bf16:grouped_mm", "bf16:eager"] + fp4_names
    runs, failed = results.setdefault("moe", []), []
    first = len(runs)
    for name, step, shape in moe_steps(dev, quick, names):
        try:
            ms = timed(step, [()], warmup=2, reps=5)
            # the GPU time alone (as the linear part's captured timing); not for the per-expert loops (bf16:eager,
            # :loop), which size their slices on the host and cannot be captured
            loop = name == "bf16:eager" or name.endswith(":loop")
            captured = None if loop else captured_ms(step, ())
        except Exception as err:  # noqa: BLE001  (an implementation this torch / device lacks)
            failed.append([name, f"failed: {type(err).__name__}: {str(err)[:80]}", "", "", ""])
            continue
        runs.append({"shape": shape, "impl": name, "ms": round(ms, 4),
                     "ms_captured": None if captured is None else round(captured, 4)})
        save()
    return moe_table(runs[first:], failed, shape)


def moe_table(runs, failed=(), shape=None) -> str:
    """The MoE part's table from its result records (one shape): ms waited and captured, each against
    Transformers' bf16 grouped_mm (else the first row); `failed`: rows of the impls that did not run."""
    base = next((r for r in runs if r["impl"] == "bf16:grouped_mm"), runs[0] if runs else None)
    rows = [[r["impl"], f"{r['ms']:.2f}", f"{base['ms'] / r['ms']:.2f}x"] + (
        ["-", "-"] if r.get("ms_captured") is None or base.get("ms_captured") is None
        else [f"{r['ms_captured']:.2f}", f"{base['ms_captured'] / r['ms_captured']:.2f}x"]) for r in runs]
    return md_table(f"MoE experts layer fwd+bwd, {shape or runs[0]['shape']} (ms, waited for; and one step captured "
                    "in a CUDA graph, replayed: GPU time alone, '-' where capture fails; speed vs "
                    f"{base['impl'] if base else '-'})",
                    ["impl", "ms", "vs base", "ms captured", "vs base (captured)"], rows + list(failed))


def bench_sharq(dev, quick, results):
    """SharQ's cost against plain NVFP4 (issue 13): W4A4 inference forward of one linear layer (no grad), bf16
    nn.Linear beside.  Activation bytes per element: plain NVFP4 reads x twice (tensor amax, operand) and writes
    a BF16 operand; SharQ reads it three times (two tensor amaxes, operands) and writes two BF16 operands, and
    its GEMM has twice the rows over the same weight."""
    tokens, shapes = (64, [(128, 128)]) if quick else (8192, [(4096, 4096), (4096, 14336), (14336, 4096)])
    x_bytes = 2  # bf16 activations
    traffic = {"bf16": 0, "hf_fp4:nvfp4": 2 * x_bytes + 2, "hf_fp4:nvfp4+sharq": 3 * x_bytes + 2 * 2}
    rows = []
    for k, n in shapes:
        x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
        lin = nn.Linear(k, n, bias=False, device=dev, dtype=x.dtype)
        layers = {"bf16": lin}
        for name, options in (("hf_fp4:nvfp4", {}), ("hf_fp4:nvfp4+sharq", {"activation_scheme": "sharq"})):
            layers[name] = FP4Linear.from_linear(lin, preset("nvfp4", gemms=("fprop",), **options).linear, name="b")
        row, base = [f"{k}x{n}"], None
        for name, layer in layers.items():
            with torch.no_grad():
                ms = timed(lambda layer=layer: layer(x), [()], warmup=2, reps=10)
            base = base or ms
            results.setdefault("sharq", []).append({"shape": f"{k}x{n}", "tokens": tokens, "impl": name,
                                                    "ms": round(ms, 4), "activation_bytes_per_element": traffic[name]})
            row.append(f"{ms:.3f} ({base / ms:.2f}x)")
        rows.append(row)
    return md_table(f"Inference forward, {tokens} tokens, W4A4 (ms; speed vs bf16). Activation operand traffic per "
                    "element: nvfp4 6 B, nvfp4+SharQ 10 B (kernel design, see bench_sharq)",
                    ["K x N"] + list(traffic), rows)


NVFP4_NS = {"ns_spec": "nvfp4", "ns_iteration": "cubic", "ns_steps": 12}
OPTIMIZERS = (("adamw", {}), ("fp4_adamw", {}), ("fp4_adamw", {"backend": "reference"}), ("muon", {}),
              ("muon", NVFP4_NS), ("muon", {**NVFP4_NS, "ns_cuda_graphs": False}))


def bench_optim(dev, quick, results):
    """Issue 12's optimizer costs on bench-50m's model (tiny with --quick): bytes of optimizer state, peak device
    memory of a train step (GPU only) and the step time, for AdamW (FP32 state), FP4AdamW, Muon in BF16 and with
    NVFP4 Newton-Schulz -- one model per optimizer, the same bf16 forward/backward -- and the optimizer's step alone."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_fp4.optim import build_optimizer, param_groups, state_bytes

    model_cfg, cfg = bench50m_model()
    kwargs = {k: v for k, v in model_cfg.items() if k != "model_type"}
    kwargs["vocab_size"] = int(cfg["vocab_size"])
    batch, seq = (2, 64) if quick else (int(cfg["batch_size"]), int(cfg["seq_len"]))
    if quick:
        kwargs.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    rows = []
    for name, options in OPTIMIZERS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**kwargs)).to(dev)
        opt = build_optimizer(name, param_groups(model, name, 0.1), 1e-3, (0.9, 0.95), dict(options))
        ids = [(torch.randint(0, kwargs["vocab_size"], (batch, seq), device=dev),) for _ in range(3)]

        def step(x, model=model, opt=opt):
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                model(input_ids=x, labels=x, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step(*ids[0])  # the state exists from the first step on
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ms = timed(step, ids, warmup=1, reps=3 if quick else 10)
        peak = torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else None
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):  # gradients for the step alone
            model(input_ids=ids[0][0], labels=ids[0][0], use_cache=False).loss.backward()
        opt_ms = timed(opt.step, [()], warmup=1, reps=3 if quick else 10)
        n_params = sum(p.numel() for p in model.parameters())
        label = name + ("+nvfp4_ns" if options.get("ns_spec") else "") + (
            ":reference" if options.get("backend") == "reference" else "") + (  # FP4AdamW's PyTorch path
            ":eager" if options.get("ns_cuda_graphs") is False else "")  # Muon's Newton-Schulz without graphs
        results.setdefault("optim", []).append({"model": "bench-50m" if not quick else "tiny", "impl": label,
                                                "state_bytes_per_param": round(state_bytes(opt) / n_params, 4),
                                                "peak_mib": None if peak is None else round(peak, 1),
                                                "step_ms": round(ms, 3), "optimizer_step_ms": round(opt_ms, 3)})
        rows.append([label, f"{state_bytes(opt) / n_params:.3f}", "-" if peak is None else f"{peak:,.0f}",
                     f"{ms:.2f}", f"{opt_ms:.2f}"])
        del model, opt
        torch.cuda.empty_cache() if dev == "cuda" else None
    return md_table(f"Optimizers on bench-50m's model ({batch} x {seq} tokens a step, bf16 autocast on GPU; "
                    "train step = forward, backward and optimizer step; optimizer step alone on one step's "
                    "gradients)", ["optimizer", "state bytes / parameter", "peak MiB", "train step ms",
                                   "optimizer step ms"], rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="quant,linear,e2e",
                        help="comma list of quant, linear, linear_spread (inputs with a trained model's spread of "
                             "magnitudes), e2e, e2e50m, attention, attention50m (bench-50m's attention call), moe, "
                             "sharq, optim")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke test of the script)")
    parser.add_argument("--out", default="benchmarks", help="folder for results-<date>.{json,md}")
    parser.add_argument("--impls", default=None, help="comma list restricting the linear / e2e impls")
    parser.add_argument("--no-moe-loop", action="store_true", help="MoE part: no per-expert loop row")
    parser.add_argument("--merge", nargs="*", default=None, help="merge these results JSON files into one")
    args = parser.parse_args()
    date = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        results = merge(args.merge)
        write(results, out / f"results-{results.get('date', date)}", render(results))
        return
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    versions = package_versions("torch", "triton", "transformers", "hf_fp4", "torchao")
    results = {"device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
               "versions": versions, "command": "python " + " ".join(sys.argv), "date": date,
               "linear": [], "e2e": [], "quant": []}
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in PARTS]:
        parser.error(f"unknown part(s) {', '.join(unknown)}; valid: {', '.join(PARTS)}")
    lin_names = ["bf16", "bf16_compiled", "torchao_fp8_tensorwise", "torchao_fp8_rowwise", "emulation_compiled"]
    lin_names += [f"hf_fp4:{p}" for p in FP4_PRESETS] + [f"hf_fp4:{p}:compiled" for p in FP4_PRESETS]
    lin_names += ["bf16_graphs"] + [f"hf_fp4:{p}:graphs" for p in FP4_PRESETS]
    lin_names += [f"hf_fp4:{p}+bf16gemm{m}" for p in MX_PRESETS for m in ("", ":graphs")]
    e2e_names = ["bf16", "bf16_compiled", "torchao_fp8_tensorwise:compiled", "torchao_fp8_rowwise:compiled",
                 "emulation_compiled"] + [f"hf_fp4:{p}" for p in FP4_PRESETS] + [
                 f"hf_fp4:{p}:compiled" for p in FP4_PRESETS] + ["bf16_graphs"] + [
                 f"hf_fp4:{p}:graphs" for p in FP4_PRESETS] + [f"hf_fp4:{p}+bf16gemm:graphs" for p in MX_PRESETS]
    if args.impls:
        keep = list(dict.fromkeys(args.impls.split(",")))
        # hf_fp4:<preset> (the attention / moe parts) is a linear name; the MoE part's experts GEMM forms beside it
        known = set(lin_names) | set(e2e_names) | {f"hf_fp4:{p}+fp8gemm" for p in MX_PRESETS} | set(ATTENTION_IMPLS)
        if unknown := [n for n in keep if n not in known]:
            parser.error(f"unknown impl(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        for label, names, part_names in (("linear", lin_names, ("linear", "linear_spread")),
                                         ("e2e", e2e_names, ("e2e", "e2e50m"))):
            if skipped := [n for n in keep if n not in names and any(p in parts for p in part_names)]:
                # session 14 lost torchao's linear row to an e2e-only name without a word
                print(f"note: not a {label} impl, skipped there: {', '.join(skipped)}", file=sys.stderr)
        lin_names = [n for n in lin_names if n in keep]
        e2e_names = [n for n in e2e_names if n in keep]
    # bf16 first, so that the tables' "vs first row" column is the speed against bf16 (session 13's e2e table ran
    # torchao first when --impls named bf16_graphs and not bf16)
    lin_names = sorted(lin_names, key=lambda n: not n.startswith("bf16"))
    e2e_names = sorted(e2e_names, key=lambda n: not n.startswith("bf16"))
    if args.quick:
        sizes = dict(n=256, tokens=128, shapes=[(128, 128)], steps=2, batch=2, seq=64,
                     e2e=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=256))
    else:
        sizes = dict(n=8192, tokens=8192, shapes=[(4096, 4096), (4096, 14336), (14336, 4096)], steps=10, batch=4,
                     seq=2048, e2e=LLAMA_1B)
    text = []
    stem = out / f"results-{date}{'-quick' if args.quick else ''}-{'-'.join(parts)}"
    if "quant" in parts:
        text.append(bench_quant(dev, sizes["n"], results))
        write(results, stem, "\n".join(text))
    if "linear" in parts:
        text.append(bench_linear(dev, sizes["tokens"], sizes["shapes"], results, lin_names))
        write(results, stem, "\n".join(text))
    if "linear_spread" in parts:
        text.append(bench_linear(dev, sizes["tokens"], sizes["shapes"], results, lin_names, spread=True))
        write(results, stem, "\n".join(text))
    if "e2e" in parts:
        text.append(bench_e2e(dev, "llama-1.1b", sizes["e2e"], sizes["batch"], sizes["seq"], sizes["steps"],
                              results, e2e_names, lambda: write(results, stem, render(results))))
        write(results, stem, "\n".join(text))
    if "e2e50m" in parts:
        model_cfg, cfg = bench50m_model()
        kwargs = {k: v for k, v in model_cfg.items() if k != "model_type"}
        kwargs["vocab_size"] = int(cfg["vocab_size"])
        seq, batch = int(cfg["seq_len"]), int(cfg["batch_size"])
        text.append(bench_e2e(dev, "bench-50m", kwargs, batch, seq, sizes["steps"] * 2, results, e2e_names,
                              lambda: write(results, stem, render(results))))
    # --impls restricts the attention rows when it names any of them (else it is about the other parts)
    attention_names = [n for n in (args.impls or "").split(",") if n in ATTENTION_IMPLS] or None
    for part, model_shape in (("attention", False), ("attention50m", True)):
        if part in parts:
            text.append(bench_attention(dev, args.quick, results, attention_names, model_shape=model_shape))
            write(results, stem, "\n".join(text))
    if "sharq" in parts:
        text.append(bench_sharq(dev, args.quick, results))
        write(results, stem, "\n".join(text))
    if "optim" in parts:
        text.append(bench_optim(dev, args.quick, results))
        write(results, stem, "\n".join(text))
    if "moe" in parts:
        text.append(bench_moe(dev, args.quick, results, moe_names(args.impls, not args.no_moe_loop),
                              lambda: write(results, stem, render(results))))
    write(results, stem, "\n".join(text))


PARTS = ("quant", "linear", "linear_spread", "e2e", "e2e50m", "attention", "attention50m", "moe", "sharq", "optim")


def merge(paths):
    results = None
    for p in paths:
        data = json.loads(Path(p).read_text())
        if results is None:
            results = {**data, "command": [data["command"]]}
            continue
        results["command"].append(data["command"])
        for part, rows in data.items():  # every part's rows (linear, e2e, quant, moe, attention, ...)
            if isinstance(rows, list):
                results[part] = results.get(part, []) + rows
    return results


def render(results) -> str:
    """Markdown tables of a results dict (used when merging the JSON of several runs)."""
    text = []
    if results["quant"]:
        text.append(quant_table(results["quant"]))
    for inputs in dict.fromkeys(r.get("inputs", "normal") for r in results["linear"]):
        text.append(linear_tables([r for r in results["linear"] if r.get("inputs", "normal") == inputs]))
    for model in dict.fromkeys(r["model"] for r in results["e2e"]):
        runs = [r for r in results["e2e"] if r["model"] == model]
        base = next((r["tokens_per_s"] for r in runs if r["impl"] == "bf16"), runs[0]["tokens_per_s"])
        rows = [[r["impl"], f"{r['tokens_per_s']:,}", f"{r['tokens_per_s'] / base:.2f}x"] for r in runs]
        text.append(md_table(f"End-to-end train step, {model}", ["impl", "tokens/s", "vs bf16"], rows))
    for shape in dict.fromkeys(r["shape"] for r in results.get("moe", [])):
        text.append(moe_table([r for r in results["moe"] if r["shape"] == shape]))
    return "\n".join(text)


def write(results, stem: Path, text: str):
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    commands = results["command"] if isinstance(results["command"], list) else [results["command"]]
    header = (f"# hf_fp4 benchmark, {results.get('date')}\n\n- device: {results['device']}\n- versions: "
              f"{results['versions']}\n" + "".join(f"- command: `{c}`\n" for c in commands) + "\n")
    stem.with_suffix(".md").write_text(header + text)
    print(f"-> {stem}.json, {stem}.md")


if __name__ == "__main__":
    main()
